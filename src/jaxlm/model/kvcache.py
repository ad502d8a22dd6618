"""The key/value cache of autoregressive decoding, a pytree that lives on device between jitted steps.

Layers are grouped as the forward pass scans them: one `KindCache` per entry of cfg.layer_pattern, its arrays
stacked over the R repeats of the pattern, so prefill and decode scan the layers and their caches together.
A global layer keeps every position in slot = position; a local (sliding-window) layer keeps a ring buffer of
its window, slot = position mod window. Every slot records the position of the key it holds (EMPTY when
none), so attention masks stay functions of query and key positions, as in the uncached forward pass.
Only the kv heads are cached (grouped-query attention shares them across query heads). With `quantize`, keys
and values are stored as int8 with one float32 scale per (position, kv head).

Shape legend: R repeats of the layer pattern, B batch, T prompt length, S cache slots, K kv heads,
H head width.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxlm.config import ModelConfig
from jaxlm.sharding import constrain

EMPTY = 2**30  # position of an empty slot: larger than any query position, so causality masks it out
CACHE_AXES = ("batch", None, "kv_heads", "head_dim")  # of one layer's keys or values [B, S, K, H]


@jax.tree_util.register_dataclass
@dataclass
class KindCache:
    """Keys and values of the layers of one pattern entry: k/v [R, B, S, K, H] (int8 when quantized, with
    scales [R, B, S, K]), and the position held by each slot, pos [B, S], shared by those layers."""
    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None
    v_scale: jax.Array | None
    pos: jax.Array


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    kinds: tuple[KindCache, ...]
    length: jax.Array  # [B] tokens cached per sequence = position of the next token


def slots(cfg: ModelConfig, kind: str, length: int) -> int:
    """Cache slots of a layer kind for sequences of up to `length` tokens."""
    return min(cfg.sliding_window, length) if kind == "local" else length


def init(cfg: ModelConfig, batch: int, length: int, quantize: bool = False) -> KVCache:
    """An empty cache for `batch` sequences of up to `length` tokens."""
    R, K, H = cfg.n_layers // len(cfg.pattern), cfg.kv_heads, cfg.hd
    kinds = []
    for kind in cfg.pattern:
        S = slots(cfg, kind, length)
        dt = jnp.int8 if quantize else jnp.dtype(cfg.compute_dtype)
        scale = (lambda: jnp.ones((R, batch, S, K), jnp.float32)) if quantize else (lambda: None)
        kinds.append(KindCache(jnp.zeros((R, batch, S, K, H), dt), jnp.zeros((R, batch, S, K, H), dt),
                               scale(), scale(), jnp.full((batch, S), EMPTY, jnp.int32)))
    return KVCache(tuple(kinds), jnp.zeros((batch,), jnp.int32))


def quantize(x_BSKH: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 with one scale per (position, head): the largest magnitude maps to 127."""
    x = x_BSKH.astype(jnp.float32)
    scale_BSK = jnp.maximum(jnp.max(jnp.abs(x), axis=-1), 1e-30) / 127.0
    return jnp.round(x / scale_BSK[..., None]).astype(jnp.int8), scale_BSK


def read(x_BSKH: jax.Array, scale_BSK: jax.Array | None, dtype) -> jax.Array:
    if scale_BSK is None:
        return x_BSKH
    return (x_BSKH.astype(jnp.float32) * scale_BSK[..., None]).astype(dtype)


def store(x_BSKH: jax.Array, quantized: bool) -> tuple[jax.Array, jax.Array | None]:
    x_BSKH = constrain(x_BSKH, CACHE_AXES)
    return quantize(x_BSKH) if quantized else (x_BSKH, None)


def prefill_layout(lengths_B: jax.Array, T: int, S: int) -> tuple[jax.Array, jax.Array]:
    """Where prefill puts a prompt of lengths_B tokens (padded to T) into S slots: for each slot, the prompt
    index to copy from [B, S] and the position it then holds [B, S] (EMPTY when none). Slot s holds the latest
    position p < length with p = s mod S, so a ring buffer shorter than the prompt keeps its last S keys."""
    s_1S = jnp.arange(S, dtype=jnp.int32)[None]
    last_B1 = lengths_B[:, None] - 1
    pos_BS = s_1S + S * jnp.floor_divide(last_B1 - s_1S, S)
    valid_BS = (s_1S <= last_B1)
    return jnp.clip(pos_BS, 0, T - 1), jnp.where(valid_BS, pos_BS, EMPTY)


def write_one(x_BSKH: jax.Array, new_BKH: jax.Array, slot_B: jax.Array) -> jax.Array:
    """x with each sequence's slot replaced by its new entry (one token per sequence)."""
    return x_BSKH.at[jnp.arange(x_BSKH.shape[0]), slot_B].set(new_BKH.astype(x_BSKH.dtype))
