"""Training objectives: what the train step minimizes, one small function each, chosen by `training.objective`.

An objective's loss is `loss(params, batch, cfg, rng) -> (loss, metrics)`: `params` the weights as the forward
pass takes them (with LoRA, the frozen base and the adapters together, lora.attach), `batch` a dict of [B, T]
arrays, `cfg` the run's Config and `rng` a key for dropout (None in evaluation). The step (step.py) never names
a loss: it accumulates micro-batches, differentiates and applies the update whatever the objective.

Averages. Each objective averages over units of its own: counted target tokens for next_token, preference pairs
for dpo/ipo/orpo. Before computing anything, the step counts the units of all its micro-batches (`units`) and
hands every micro-batch `batch["normalizer"]` = that count / A, so the micro-batch losses, summed and divided
by A, are exactly the mean over the step's units however unevenly they fall, and, the sums running over the
global batch, across devices too. Metrics are averaged the same way. Without a normalizer (evaluation, a
direct call) an objective averages over the units of the batch it is given.

Objectives that need several forward passes (a preference pair's chosen and rejected completions ride in one
batch as two segments of a row) or a generation step (reinforcement learning: the rollouts are made outside the
jitted step and arrive as a batch) fit the same signature.

Shape legend: B rows, T tokens per row.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jaxlm.config import Config, ConfigError
from jaxlm.model import layers, transformer


@dataclasses.dataclass(frozen=True)
class Objective:
    name: str
    loss: Callable[[dict, dict, Config, jax.Array | None], tuple[jax.Array, dict]]
    # The units the loss averages over in a batch of arrays with any leading dims ([A, B, T] or [B, T]); None
    # when every micro-batch holds as many (all its target tokens, its rows) and averages over its own.
    units: Callable[[dict, Config], jax.Array | None]


# ---- next-token prediction: pretraining and SFT ------------------------------------------------------------------

def next_token(params: dict, batch: dict, cfg: Config, rng: jax.Array | None) -> tuple[jax.Array, dict]:
    """Mean cross-entropy of the targets, each counted with its weight (loss masks, packing), plus the
    mixture-of-experts load-balancing term (transformer.loss_fn)."""
    loss = transformer.loss_fn(params, batch["inputs"], batch["targets"], cfg.model, rng, batch.get("positions"),
                               batch.get("segment_ids"), batch.get("weights"), batch.get("normalizer"))
    return loss, {}


def _token_units(batch: dict, cfg: Config) -> jax.Array | None:
    return None if "weights" not in batch else jnp.sum(batch["weights"])


# ---- GRPO: reinforcement learning on rewarded rollouts -----------------------------------------------------------

def grpo(params: dict, batch: dict, cfg: Config, rng: jax.Array | None) -> tuple[jax.Array, dict]:
    """The clipped policy-gradient loss of GRPO (Shao et al. 2024) with DAPO's asymmetric clip and the loss
    normalizations of GRPO, DAPO and Dr. GRPO, as TRL's GRPOTrainer computes them, over rows of prompt +
    completion (rl.py): per completion token, -min(r A, clip(r, 1 - eps, 1 + eps_high) A) + beta KL, with
    r = pi / pi_old (exactly 1 when the batch has no old log-probabilities: one update per batch of rollouts) and
    KL the k3 estimator exp(ref - logp) - (ref - logp) - 1 (with LoRA the reference is the base, adapters off).
    Metrics: kl, clip_ratio (the share of completion tokens whose term is clipped) and entropy, the micro-batch's
    means over completion tokens."""
    g = cfg.grpo
    logp_BT, entropy_BT, _ = transformer.token_logprobs(params, batch["inputs"], batch["targets"], cfg.model, rng,
                                                        batch.get("positions"), batch.get("segment_ids"),
                                                        g.temperature)
    w_BT, adv_BT = batch["weights"], batch["advantages"]
    old_BT = batch["old_logps"] if "old_logps" in batch else jax.lax.stop_gradient(logp_BT)
    ratio_BT = jnp.exp(logp_BT - old_BT)
    lo, hi = 1.0 - g.epsilon, 1.0 + (g.epsilon if g.epsilon_high is None else g.epsilon_high)
    loss_BT = -jnp.minimum(ratio_BT * adv_BT, jnp.clip(ratio_BT, lo, hi) * adv_BT)
    tokens = jnp.maximum(jnp.sum(w_BT), 1.0)
    mean = lambda x_BT: jnp.sum(x_BT * w_BT) / tokens  # noqa: E731
    clipped_BT = ((ratio_BT < lo) & (adv_BT < 0)) | ((ratio_BT > hi) & (adv_BT > 0))
    metrics = {"clip_ratio": mean(clipped_BT.astype(jnp.float32)), "entropy": mean(jax.lax.stop_gradient(entropy_BT))}
    if g.beta > 0:
        if "ref_logps" in batch:
            ref_BT = batch["ref_logps"]
        else:  # a LoRA run: its base is the reference
            ref_BT = jax.lax.stop_gradient(transformer.token_logprobs(
                layers.without_adapters(params), batch["inputs"], batch["targets"], cfg.model, None,
                batch.get("positions"), batch.get("segment_ids"), g.temperature)[0])
        d_BT = ref_BT - logp_BT
        kl_BT = jnp.exp(d_BT) - d_BT - 1.0
        loss_BT = loss_BT + g.beta * kl_BT
        metrics["kl"] = mean(jax.lax.stop_gradient(kl_BT))
    summed = jnp.sum(loss_BT * w_BT)
    if g.loss_type == "grpo":  # each sequence's mean, then the mean over sequences
        rows = jnp.sum(loss_BT * w_BT, axis=-1) / jnp.maximum(jnp.sum(w_BT, axis=-1), 1.0)
        loss = jnp.mean(rows)
    elif g.loss_type == "dr_grpo":  # Dr. GRPO: a constant, sequences x the longest completion allowed
        loss = summed / (w_BT.shape[0] * g.max_completion_tokens)
    elif g.loss_type == "bnpo":  # the micro-batch's completion tokens
        loss = summed / tokens
    else:  # dapo: every completion token of the step
        loss = summed / batch.get("normalizer", tokens)
    return loss, metrics


def _grpo_units(batch: dict, cfg: Config) -> jax.Array | None:
    return jnp.sum(batch["weights"]) if cfg.grpo.loss_type == "dapo" else None


OBJECTIVES = {"next_token": Objective("next_token", next_token, _token_units),
              "grpo": Objective("grpo", grpo, _grpo_units)}


def get(name: str) -> Objective:
    if name not in OBJECTIVES:
        raise ConfigError(f"training.objective={name!r} is not known; choose one of: {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name]


def units_or_tokens(objective: Objective, batch: dict, cfg: Config) -> jax.Array:
    """How many units a batch's loss averaged over, for weighing several batches' losses (evaluation)."""
    units = objective.units(batch, cfg)
    return jnp.float32(batch["inputs"].size) if units is None else units
