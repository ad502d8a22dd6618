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
from jaxlm.model import transformer


@dataclasses.dataclass(frozen=True)
class Objective:
    name: str
    loss: Callable[[dict, dict, Config, jax.Array | None], tuple[jax.Array, dict]]
    # The units the loss averages over in a batch of arrays with any leading dims ([A, B, T] or [B, T]); None
    # when they are all the target tokens, as many in every micro-batch (no normalizer is needed then).
    units: Callable[[dict], jax.Array | None]


# ---- next-token prediction: pretraining and SFT ------------------------------------------------------------------

def next_token(params: dict, batch: dict, cfg: Config, rng: jax.Array | None) -> tuple[jax.Array, dict]:
    """Mean cross-entropy of the targets, each counted with its weight (loss masks, packing), plus the
    mixture-of-experts load-balancing term (transformer.loss_fn)."""
    loss = transformer.loss_fn(params, batch["inputs"], batch["targets"], cfg.model, rng, batch.get("positions"),
                               batch.get("segment_ids"), batch.get("weights"), batch.get("normalizer"))
    return loss, {}


def _token_units(batch: dict) -> jax.Array | None:
    return None if "weights" not in batch else jnp.sum(batch["weights"])


OBJECTIVES = {"next_token": Objective("next_token", next_token, _token_units)}


def get(name: str) -> Objective:
    if name not in OBJECTIVES:
        raise ConfigError(f"training.objective={name!r} is not known; choose one of: {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name]


def units_or_tokens(objective: Objective, batch: dict) -> jax.Array:
    """How many units a batch's loss averaged over, for weighing several batches' losses (evaluation)."""
    units = objective.units(batch)
    return jnp.float32(batch["inputs"].size) if units is None else units
