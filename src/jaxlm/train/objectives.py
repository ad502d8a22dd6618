"""Training objectives: what the train step minimizes, one small function each, chosen by `training.objective`.

An objective's loss is `loss(params, batch, cfg, rng) -> (loss, metrics)`: `params` the weights as the forward
pass takes them (with LoRA, the frozen base and the adapters together, lora.attach), `batch` a dict of [B, T]
arrays, `cfg` the run's Config and `rng` a key for dropout (None in evaluation). The step (step.py) never names
a loss: it accumulates micro-batches, differentiates and applies the update whatever the objective. Objectives
that need several forward passes (a preference pair's two replies ride in one row) or a generation step
(reinforcement learning's rollouts, made outside the jitted step) fit the same signature.

Shape legend: B rows, T tokens per row, P pair slots per row.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jaxlm.config import PREFERENCE_OBJECTIVES, Config, ConfigError
from jaxlm.model import layers
from jaxlm.model.loss import loss_fn, token_logprobs


@dataclasses.dataclass(frozen=True)
class Objective:
    """An objective's loss and the units it averages over: counted target tokens for next_token, preference pairs
    for dpo/ipo/orpo. Before computing anything, the step counts the units of all its micro-batches (`units`) and
    hands every micro-batch `batch["normalizer"]` = that count / A, so the micro-batch losses, summed and divided
    by A, are exactly the mean over the step's units however unevenly they fall, and, the sums running over the
    global batch, across devices too. Metrics are averaged the same way. Without a normalizer (evaluation, a
    direct call) an objective averages over the units of the batch it is given."""

    name: str
    loss: Callable[[dict, dict, Config, jax.Array | None], tuple[jax.Array, dict]]
    # The units the loss averages over in a batch of arrays with any leading dims ([A, B, T] or [B, T]); None
    # when every micro-batch holds as many (all its target tokens, its rows) and averages over its own.
    units: Callable[[dict, Config], jax.Array | None]


# ---- next-token prediction: pretraining and SFT ------------------------------------------------------------------

def next_token(params: dict, batch: dict, cfg: Config, rng: jax.Array | None) -> tuple[jax.Array, dict]:
    """Mean cross-entropy of the targets, each counted with its weight (loss masks, packing), plus the
    mixture-of-experts load-balancing term (loss_fn); a batch with "images" gives them to the forward pass."""
    loss = loss_fn(params, batch["inputs"], batch["targets"], cfg.model, rng, batch.get("positions"),
                   batch.get("segment_ids"), batch.get("weights"), batch.get("normalizer"), batch.get("images"))
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
    logp_BT, entropy_BT, _ = token_logprobs(params, batch["inputs"], batch["targets"], cfg.model, rng,
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
            ref_BT = jax.lax.stop_gradient(token_logprobs(
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


# ---- preference pairs: DPO, IPO, ORPO ---------------------------------------------------------------------------
# Batches of whole pairs (data/preference.py): pair k of a row is segment 2k + 1 (prompt + chosen) and 2k + 2
# (prompt + rejected), weights 1 on the replies' targets. Each reply's log-probability is the sum (dpo) or mean
# (ipo, orpo) of its tokens' log-probabilities, as TRL computes them; a batch with "images" (pairs whose prompts hold
# images, each reply's row carrying them) gives them to the forward pass. The reference model's come in the batch
# ("ref_logps", per token, from the pass over the data before training that reference.py runs with the starting
# weights) or, in a LoRA run whose batches carry none, from the same forward pass with the adapters switched off
# (layers.without_adapters): the base is the reference there.

def _pair_sums(values_BT: jax.Array, segment_ids_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Sums of a per-token value over each pair's chosen and rejected segment, ([B, P], [B, P]): P = T // 2 + 1
    slots cover every pair a row of T inputs can hold. Order-free, so a zig-zag batch (context parallelism) sums
    alike."""
    P = segment_ids_BT.shape[-1] // 2 + 1
    sums_BS = jax.vmap(lambda v, s: jax.ops.segment_sum(v, s, num_segments=2 * P + 1))(values_BT, segment_ids_BT)
    return sums_BS[:, 1::2], sums_BS[:, 2::2]


def _has_adapters(params) -> bool:
    return any(isinstance(w, layers.LoraWeight)
               for w in jax.tree.leaves(params, is_leaf=lambda w: isinstance(w, layers.LoraWeight)))


def _token_logps(params, batch: dict, cfg: Config, rng) -> tuple[jax.Array, jax.Array]:
    logps_BT, _, aux = token_logprobs(params, batch["inputs"], batch["targets"], cfg.model, rng,
                                      batch["positions"], batch["segment_ids"], images=batch.get("images"))
    return logps_BT, aux


def _reference_token_logps(params, batch: dict, cfg: Config) -> jax.Array:
    """The reference model's log-probability of each target [B, T]: from the batch, or a LoRA run's base."""
    if "ref_logps" in batch:
        return batch["ref_logps"]
    if _has_adapters(params):
        return jax.lax.stop_gradient(_token_logps(layers.without_adapters(params), batch, cfg, None)[0])
    raise ConfigError(f"training.objective={cfg.training.objective} needs the reference model's log-probabilities: "
                      "batches with ref_logps (reference.py computes them before training) or a LoRA run (lora.rank), "
                      "whose base is the reference")


def _replies(params, batch: dict, cfg: Config, rng, average: bool, reference: bool) -> dict:
    """Per pair slot [B, P]: the policy's log-probabilities of the chosen and rejected replies ("chosen",
    "rejected"), the reference's ("ref_chosen", "ref_rejected") when asked, summed over the reply's tokens or
    with `average` their mean; "present" marks the slots that hold a pair; "aux" the load-balancing loss."""
    w_BT, seg_BT = batch["weights"], batch["segment_ids"]
    logps_BT, aux = _token_logps(params, batch, cfg, rng)
    n_c, n_r = _pair_sums(w_BT, seg_BT)
    scale = (lambda x_BP, n_BP: x_BP / jnp.maximum(n_BP, 1.0)) if average else (lambda x_BP, n_BP: x_BP)
    per_token = {"": logps_BT}
    if reference:
        per_token["ref_"] = _reference_token_logps(params, batch, cfg)
    out = {"present": n_c > 0, "aux": aux}
    for prefix, values_BT in per_token.items():
        c, r = _pair_sums(values_BT * w_BT, seg_BT)
        out[prefix + "chosen"], out[prefix + "rejected"] = scale(c, n_c), scale(r, n_r)
    return out


def _pair_mean(terms: dict, present_BP: jax.Array, batch: dict) -> dict:
    """Each [B, P] term summed over the pairs present, over the step's pairs / A (the normalizer) or, without
    one, over this batch's pairs."""
    normalizer = batch.get("normalizer")
    if normalizer is None:
        normalizer = jnp.maximum(jnp.sum(present_BP), 1.0)
    return {k: jnp.sum(jnp.where(present_BP, v, 0.0)) / normalizer for k, v in terms.items()}


def _with_aux(loss: jax.Array, aux: jax.Array, cfg: Config) -> jax.Array:
    return loss + cfg.model.router_aux_loss_coef * aux if cfg.model.n_experts else loss


def _rewards(chosen, rejected) -> dict:
    return {"rewards/chosen": chosen, "rewards/rejected": rejected, "rewards/margins": chosen - rejected,
            "rewards/accuracies": (chosen > rejected).astype(jnp.float32)}


def _against_reference(params: dict, batch: dict, cfg: Config, rng, average: bool, loss_of) -> tuple[jax.Array, dict]:
    """The loss loss_of(h) averaged over pairs, h = (log pi(chosen) - log pi(rejected)) - (the same under the
    reference), with TRL's metrics: rewards beta (log pi - log ref) of each reply, and the policy's logps."""
    beta = cfg.dpo.beta
    x = _replies(params, batch, cfg, rng, average=average, reference=True)
    h = (x["chosen"] - x["rejected"]) - (x["ref_chosen"] - x["ref_rejected"])
    terms = {**_rewards(beta * (x["chosen"] - x["ref_chosen"]), beta * (x["rejected"] - x["ref_rejected"])),
             "logps/chosen": x["chosen"], "logps/rejected": x["rejected"]}
    m = _pair_mean(jax.tree.map(jax.lax.stop_gradient, terms) | {"loss": loss_of(h)}, x["present"], batch)
    return _with_aux(m.pop("loss"), x["aux"], cfg), m


def dpo(params: dict, batch: dict, cfg: Config, rng: jax.Array | None) -> tuple[jax.Array, dict]:
    """Direct Preference Optimization (Rafailov et al. 2023), TRL's loss_type="sigmoid" with label smoothing
    (conservative DPO): -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h), log-probabilities summed over the
    reply's tokens. At the start (policy = reference) h = 0 and the loss is ln 2."""
    beta, eps = cfg.dpo.beta, cfg.dpo.label_smoothing

    def loss_of(h):
        return -(1 - eps) * jax.nn.log_sigmoid(beta * h) - eps * jax.nn.log_sigmoid(-beta * h)

    with jax.named_scope("dpo"):
        return _against_reference(params, batch, cfg, rng, False, loss_of)


def ipo(params: dict, batch: dict, cfg: Config, rng: jax.Array | None) -> tuple[jax.Array, dict]:
    """Identity Preference Optimization (Azar et al. 2023, eq. 17): (h - 1 / (2 beta))^2 with h from the mean
    log-probability of the reply's tokens, as TRL's loss_type="ipo" computes it (rewards and logps metrics from
    the means too)."""
    beta = cfg.dpo.beta
    with jax.named_scope("ipo"):
        return _against_reference(params, batch, cfg, rng, True, lambda h: jnp.square(h - 1 / (2 * beta)))


# ORPO's odds of a reply, p / (1 - p) with p its mean token probability, need log(1 - p); a mean log-probability
# that rounds to 0 (p = 1 in float32) would make it -inf, so it is held just below.
ORPO_MAX_LOGP = -1e-7


def orpo(params: dict, batch: dict, cfg: Config, rng: jax.Array | None) -> tuple[jax.Array, dict]:
    """Odds Ratio Preference Optimization (Hong et al. 2024), reference-free: the chosen reply's negative
    log-likelihood plus lambda times -log sigmoid(log odds(chosen) - log odds(rejected)), odds(y) = p / (1 - p)
    with log p the mean log-probability of the reply's tokens (the paper's eq. 6-7; TRL's ORPOTrainer). The NLL is
    each pair's mean over its chosen tokens, averaged over pairs like every term here; TRL averages it over all
    the chosen tokens of its batch instead, which weighs long replies more and depends on how pairs fall into
    batches. Metrics as TRL names them: rewards (lambda times the mean log-probabilities), log_odds_ratio (the
    mean log sigmoid), log_odds_chosen, nll_loss."""
    with jax.named_scope("orpo"):
        lam = cfg.orpo.lambda_
        x = _replies(params, batch, cfg, rng, average=True, reference=False)
        c, r = jnp.minimum(x["chosen"], ORPO_MAX_LOGP), jnp.minimum(x["rejected"], ORPO_MAX_LOGP)
        log_odds = (c - r) - (jnp.log(-jnp.expm1(c)) - jnp.log(-jnp.expm1(r)))
        ratio = jax.nn.log_sigmoid(log_odds)
        nll = -x["chosen"]
        terms = {**_rewards(lam * x["chosen"], lam * x["rejected"]), "logps/chosen": x["chosen"],
                 "logps/rejected": x["rejected"], "log_odds_ratio": ratio, "log_odds_chosen": log_odds,
                 "nll_loss": nll}
        m = _pair_mean(jax.tree.map(jax.lax.stop_gradient, terms) | {"loss": nll - lam * ratio}, x["present"], batch)
        return _with_aux(m.pop("loss"), x["aux"], cfg), m


def _pair_units(batch: dict, cfg: Config) -> jax.Array:
    """Pairs in a batch of any leading dims: a row's pairs are numbered from 0 (segments 1, 2; 3, 4; ...), so its
    count is half its highest segment id, rounded up; order-free, like _pair_sums."""
    return jnp.sum((jnp.max(batch["segment_ids"], axis=-1) + 1) // 2).astype(jnp.float32)


OBJECTIVES = {"next_token": Objective("next_token", next_token, _token_units),
              "dpo": Objective("dpo", dpo, _pair_units),
              "ipo": Objective("ipo", ipo, _pair_units),
              "orpo": Objective("orpo", orpo, _pair_units),
              "grpo": Objective("grpo", grpo, _grpo_units)}
PREFERENCE = PREFERENCE_OBJECTIVES
# The objectives whose batches carry the reference model's log-probabilities (unless a LoRA run's base serves).
NEEDS_REFERENCE = ("dpo", "ipo")


def describe(cfg: Config) -> str:
    """For the logs: the run's objective and its settings."""
    name = cfg.training.objective
    if name == "orpo":
        return f"objective orpo: lambda {cfg.orpo.lambda_:g}, no reference model"
    if name == "grpo":
        g = cfg.grpo
        return (f"objective grpo: {g.group_size} completions per prompt, loss {g.loss_type}, clip "
                f"[{1 - g.epsilon:g}, {1 + (g.epsilon if g.epsilon_high is None else g.epsilon_high):g}], beta "
                f"{g.beta:g}" + ("" if not g.beta else " (reference: the base, adapters off)" if cfg.lora.rank
                                 else " (reference: the starting weights)")
                + f", {g.iterations} update(s) per batch of rollouts")
    if name in NEEDS_REFERENCE:
        smoothing = f", label smoothing {cfg.dpo.label_smoothing:g}" if name == "dpo" else ""
        where = ("the base, adapters off" if cfg.lora.rank > 0
                 else "log-probabilities of the starting weights (<run_dir>/reference)")
        return f"objective {name}: beta {cfg.dpo.beta:g}{smoothing}; reference: {where}"
    return f"objective {name}"


def get(name: str) -> Objective:
    if name not in OBJECTIVES:
        raise ConfigError(f"training.objective={name!r} is not known; choose one of: {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name]


def units_or_tokens(objective: Objective, batch: dict, cfg: Config) -> jax.Array:
    """How many units a batch's loss averaged over, for weighing several batches' losses (evaluation)."""
    units = objective.units(batch, cfg)
    return jnp.float32(batch["inputs"].size) if units is None else units
