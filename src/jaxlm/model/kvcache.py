"""The key/value cache of autoregressive decoding, a pytree that lives on device between jitted steps: one
`KindCache` per entry of cfg.layer_pattern, its arrays stacked over the R_j repeats of that entry, so prefill and
decode scan the layers and their caches together. A global layer keeps slot = position, a local or chunked layer a
ring buffer of its window or chunk; every slot records the position it holds (EMPTY when none), so masks stay
functions of positions. Only kv heads are cached (`quantize`: int8, a float32 scale per position and kv head); a
latent-attention layer caches its rotary key and latent as one kv head (`widths`). A decode loop carries
`LayerCaches` instead: each layer apart, keys transposed [B, K, H, S], the slots grown as the sequences lengthen
(`grow`; docs/generate.md, "How it works").

Shape legend: R repeats of the layer pattern, B batch, T prompt length, S cache slots, K kv heads, H head width.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxlm.config import ModelConfig
from jaxlm.sharding import constrain

EMPTY = 2**30  # position of an empty slot: larger than any query position, so causality masks it out
# Of one layer's keys or values [B, K, S, H]: heads-major, the layout attention multiplies in, so a decode
# step reads the cache as it lies instead of transposing a copy of it every layer.
CACHE_AXES = ("batch", "kv_heads", None, "head_dim")


@jax.tree_util.register_dataclass
@dataclass
class KindCache:
    """Keys and values of the layers of one pattern entry: k/v [R, B, K, S, H] (int8 when quantized, with
    scales [R, B, K, S]), and the position held by each slot, pos [B, S], shared by those layers. Latent
    attention: k the rotary keys [R, B, 1, S, r], v the latents [R, B, 1, S, C]."""
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


def ring(cfg: ModelConfig, kind: str) -> int | None:
    """The ring buffer's length of a layer kind (its window or chunk), None for a kind that keeps every
    position."""
    return cfg.sliding_window if kind == "local" else cfg.attention_chunk if kind == "chunked" else None


def slots(cfg: ModelConfig, kind: str, length: int) -> int:
    """Cache slots of a layer kind for sequences of up to `length` tokens."""
    n = ring(cfg, kind)
    return length if n is None else min(n, length)


def widths(cfg: ModelConfig) -> tuple[int, int, int]:
    """(kv heads, key width, value width) of a layer's cache entry; latent attention: (1, rotary key width,
    latent width)."""
    if cfg.latent:
        return 1, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    return cfg.kv_heads, cfg.hd, cfg.hd


def bytes_per_token(cfg: ModelConfig, quantize: bool = False) -> int:
    """Cache bytes each more token of a long sequence takes: the layers that keep every position (the ring
    buffers of local and chunked layers stop growing at their window or chunk)."""
    K, Hk, Hv = widths(cfg)
    per = (K * (Hk + Hv)) * (1 if quantize else jnp.dtype(cfg.compute_dtype).itemsize)
    growing = sum(ring(cfg, cfg.pattern[i % len(cfg.pattern)]) is None for i in range(cfg.n_layers))
    return growing * (per + (2 * K * 4 if quantize else 0))


def init(cfg: ModelConfig, batch: int, length: int, quantize: bool = False) -> KVCache:
    """An empty cache for `batch` sequences of up to `length` tokens."""
    K, Hk, Hv = widths(cfg)
    kinds = []
    for j, kind in enumerate(cfg.pattern):
        R, S = len(range(j, cfg.n_layers, len(cfg.pattern))), slots(cfg, kind, length)
        dt = jnp.int8 if quantize else jnp.dtype(cfg.compute_dtype)
        scale = (lambda: jnp.ones((R, batch, K, S), jnp.float32)) if quantize else (lambda: None)
        kinds.append(KindCache(jnp.zeros((R, batch, K, S, Hk), dt), jnp.zeros((R, batch, K, S, Hv), dt),
                               scale(), scale(), jnp.full((batch, S), EMPTY, jnp.int32)))
    return KVCache(tuple(kinds), jnp.zeros((batch,), jnp.int32))


def quantize(x_BKSH: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 with one scale per (head, position): the largest magnitude maps to 127."""
    x = x_BKSH.astype(jnp.float32)
    scale_BKS = jnp.maximum(jnp.max(jnp.abs(x), axis=-1), 1e-30) / 127.0
    return jnp.round(x / scale_BKS[..., None]).astype(jnp.int8), scale_BKS


def read(x_BKSH: jax.Array, scale_BKS: jax.Array | None, dtype) -> jax.Array:
    if scale_BKS is None:
        return x_BKSH
    return (x_BKSH.astype(jnp.float32) * scale_BKS[..., None]).astype(dtype)


def store(x_BKSH: jax.Array, quantized: bool) -> tuple[jax.Array, jax.Array | None]:
    x_BKSH = constrain(x_BKSH, CACHE_AXES)
    return quantize(x_BKSH) if quantized else (x_BKSH, None)


def prefill_layout(lengths_B: jax.Array, T: int, S: int) -> tuple[jax.Array, jax.Array]:
    """Where prefill puts a prompt of lengths_B tokens (padded to T) into S slots: for each slot, the prompt
    index to copy from [B, S] and the position it then holds [B, S] (EMPTY when none). Slot s holds the latest
    position p < length with p = s mod S, so a ring buffer shorter than the prompt keeps its last S keys."""
    s_1S = jnp.arange(S, dtype=jnp.int32)[None]
    last_B1 = lengths_B[:, None] - 1
    pos_BS = s_1S + S * jnp.floor_divide(last_B1 - s_1S, S)
    valid_BS = (s_1S <= last_B1)
    return jnp.clip(pos_BS, 0, T - 1), jnp.where(valid_BS, pos_BS, EMPTY)


def write_one(x_RBKSH: jax.Array, new_BKH: jax.Array, r, slot_B: jax.Array) -> jax.Array:
    """x with each sequence's slot of repeat r replaced by its new entry (one token per sequence, every kv
    head; scales [R, B, K, S] take new [B, K])."""
    return x_RBKSH.at[r, jnp.arange(x_RBKSH.shape[1]), :, slot_B].set(new_BKH.astype(x_RBKSH.dtype))


def copy_row(dst: KVCache, src: KVCache, dst_row, src_row) -> KVCache:
    """dst with sequence dst_row replaced by src's sequence src_row (keys, values, scales, positions, length);
    the two caches have the same layout but may hold different numbers of sequences. Keys, values and scales
    keep the cache's sharding (CACHE_AXES behind the stacked repeats)."""
    def put(x, x_src, axis):
        one = jax.lax.dynamic_slice_in_dim(x_src, src_row, 1, axis)
        x = jax.lax.dynamic_update_slice_in_dim(x, one.astype(x.dtype), dst_row, axis)
        return constrain(x, (None,) + CACHE_AXES[:x.ndim - 1]) if axis == 1 else x

    kinds = tuple(KindCache(put(d.k, s.k, 1), put(d.v, s.v, 1),
                            None if d.k_scale is None else put(d.k_scale, s.k_scale, 1),
                            None if d.v_scale is None else put(d.v_scale, s.v_scale, 1), put(d.pos, s.pos, 0))
                  for d, s in zip(dst.kinds, src.kinds))
    return KVCache(kinds, put(dst.length, src.length, 0))


def kept_slots(cfg: ModelConfig, j: int, S: int, slots: int | None) -> int:
    """How many of pattern entry j's S slots a cache cut to `slots` keeps (None: all). A layer that holds
    position p in slot p (a global layer, or a sliding window longer than the cache) keeps its first `slots`:
    a decoder whose sequences stay below `slots` positions then attends over the same keys as with all of them
    (the slots cut off hold only later positions, which causality masks, or none). A ring buffer keeps all."""
    n = ring(cfg, cfg.pattern[j])
    return S if slots is None or (n is not None and S >= n) else min(slots, S)


def _at(rows_b: jax.Array | None, row_axis: int, slot_axis: int, L: int, r: int | None = None) -> tuple:
    """The index of sequences rows_b (all when None) and the first L slots (of repeat r when given)."""
    index = [slice(None)] * (slot_axis + 1)
    index[row_axis] = slice(None) if rows_b is None else rows_b
    index[slot_axis] = slice(0, L)
    if r is not None:
        index[0] = r
    return tuple(index)


def take_rows(cache: KVCache, cfg: ModelConfig, rows_b: jax.Array | None = None, slots: int | None = None
              ) -> KVCache:
    """The cache of sequences rows_b (all when None), in that order, cut to `slots` slots (kept_slots)."""
    kinds = []
    for j, c in enumerate(cache.kinds):
        L = kept_slots(cfg, j, c.pos.shape[1], slots)
        kinds.append(KindCache(*(None if a is None else a[_at(rows_b, 1, 3, L)]
                                 for a in (c.k, c.v, c.k_scale, c.v_scale)), c.pos[_at(rows_b, 0, 1, L)]))
    return KVCache(tuple(kinds), cache.length if rows_b is None else cache.length[rows_b])


def put_rows(cache: KVCache, sub: KVCache, rows_b: jax.Array | None = None) -> KVCache:
    """`cache` with `sub` (of take_rows) written back at sequences rows_b (all when None) and the slots it
    kept, laid out as `init` lays it out."""
    def put(a, x, row_axis, slot_axis):
        if a is None or (rows_b is None and a.shape == x.shape):  # all of it (the scan's stacked cache)
            return x
        a = a.at[_at(rows_b, row_axis, slot_axis, x.shape[slot_axis])].set(x)
        return constrain(a, (None,) + CACHE_AXES[:a.ndim - 1]) if a.ndim > 2 else a

    kinds = tuple(KindCache(put(c.k, s.k, 1, 3), put(c.v, s.v, 1, 3), put(c.k_scale, s.k_scale, 1, 3),
                            put(c.v_scale, s.v_scale, 1, 3), put(c.pos, s.pos, 0, 1))
                  for c, s in zip(cache.kinds, sub.kinds))
    return KVCache(kinds, sub.length if rows_b is None else cache.length.at[rows_b].set(sub.length))


# Of one layer's keys transposed [B, K, H, S] in LayerCaches.
KEY_T_AXES = ("batch", "kv_heads", "head_dim", None)


@jax.tree_util.register_dataclass
@dataclass
class LayerCaches:
    """The cache as a decode loop carries it: layers[i] of layer i holds k [B, K, H, S] (keys transposed, the
    layout of the q.k product), v [B, K, S, H], and k_scale, v_scale [B, K, S] (None unless int8); pos[j] [B, S]
    and the slots of the layers of cfg.pattern[j]; length [B] as in KVCache."""
    layers: tuple[dict, ...]
    pos: tuple[jax.Array, ...]
    length: jax.Array


def unstack(cache: KVCache, cfg: ModelConfig, rows_b: jax.Array | None = None, slots: int | None = None
            ) -> LayerCaches:
    """The stacked cache taken apart by layer (layer i is repeat i // P of pattern entry i % P), keys
    transposed: of sequences rows_b only, in that order, when given, and cut to `slots` slots (kept_slots)
    when given (the server's decode program takes its bucket's rows, and only the slots they reach). One copy
    of that part of the cache, made once before a decode loop."""
    P = len(cfg.pattern)
    Ls = [kept_slots(cfg, j, c.pos.shape[1], slots) for j, c in enumerate(cache.kinds)]
    # The stacked keys transposed before a layer is sliced out: XLA then slices, gathers and transposes in one
    # copy, where transposing the slice made it copy the layer twice.
    keys_RBKHS = [c.k.swapaxes(3, 4) for c in cache.kinds]
    layers = []
    for i in range(cfg.n_layers):
        j, r = i % P, i // P
        c, L = cache.kinds[j], Ls[j]
        layers.append({"k": constrain(keys_RBKHS[j][_at(rows_b, 1, 4, L, r)], KEY_T_AXES),
                       "v": constrain(c.v[_at(rows_b, 1, 3, L, r)], CACHE_AXES),
                       "k_scale": None if c.k_scale is None else c.k_scale[_at(rows_b, 1, 3, L, r)],
                       "v_scale": None if c.v_scale is None else c.v_scale[_at(rows_b, 1, 3, L, r)]})
    return LayerCaches(tuple(layers), tuple(c.pos[_at(rows_b, 0, 1, L)] for c, L in zip(cache.kinds, Ls)),
                       cache.length if rows_b is None else cache.length[rows_b])


def restack(cache: LayerCaches, cfg: ModelConfig, into: KVCache, rows_b: jax.Array | None = None) -> KVCache:
    """The inverse of unstack: `into` (the stacked cache unstack took apart) with the layers' caches written
    back by pattern entry (keys [R, B, K, S, H] again, int8 scales alike) at sequences rows_b when given, in
    the slots unstack kept. One copy of that part of the cache, made once after a decode loop that must hand
    back the stacked cache (the server's decode program), in place when `into` is donated."""
    P = len(cfg.pattern)
    kinds = []
    for j, (c, pos_BS) in enumerate(zip(into.kinds, cache.pos)):
        L = pos_BS.shape[1]
        arrays = {"k": c.k, "v": c.v, "k_scale": c.k_scale, "v_scale": c.v_scale}
        for r, layer in enumerate(cache.layers[j::P]):
            for name, x in arrays.items():
                if x is not None:
                    new = layer[name].swapaxes(2, 3) if name == "k" else layer[name]
                    arrays[name] = x.at[_at(rows_b, 1, 3, L, r)].set(new)
        arrays = {name: None if x is None else constrain(x, (None,) + CACHE_AXES[:x.ndim - 1])
                  for name, x in arrays.items()}
        kinds.append(KindCache(**arrays, pos=c.pos.at[_at(rows_b, 0, 1, L)].set(pos_BS)))
    return KVCache(tuple(kinds), cache.length if rows_b is None else into.length.at[rows_b].set(cache.length))


def _pad(x: jax.Array, axis: int, S: int, value=0) -> jax.Array:
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, S - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def grow(cache: LayerCaches | KVCache, cfg: ModelConfig, length: int) -> LayerCaches | KVCache:
    """The cache for sequences of up to `length` tokens (not fewer than it holds now): the new slots empty.
    Exact while every position held is below the old slot count: then slot = position in the old and the
    new layout alike (a ring buffer already as long as its window keeps its slots)."""
    P = len(cfg.pattern)
    S_new = [slots(cfg, kind, length) for kind in cfg.pattern]
    if isinstance(cache, KVCache):  # k, v [R, B, K, S, H], scales [R, B, K, S]
        return KVCache(tuple(KindCache(
            constrain(_pad(c.k, 3, S), (None,) + CACHE_AXES), constrain(_pad(c.v, 3, S), (None,) + CACHE_AXES),
            *(None if x is None else _pad(x, 3, S, 1) for x in (c.k_scale, c.v_scale)), _pad(c.pos, 1, S, EMPTY))
            for c, S in zip(cache.kinds, S_new)), cache.length)
    layers = []
    for i, layer in enumerate(cache.layers):
        S = S_new[i % P]
        layers.append({"k": constrain(_pad(layer["k"], 3, S), KEY_T_AXES),
                       "v": constrain(_pad(layer["v"], 2, S), CACHE_AXES),
                       "k_scale": None if layer["k_scale"] is None else _pad(layer["k_scale"], 2, S, 1),
                       "v_scale": None if layer["v_scale"] is None else _pad(layer["v_scale"], 2, S, 1)})
    pos = tuple(_pad(p, 1, S, EMPTY) for p, S in zip(cache.pos, S_new))
    return LayerCaches(tuple(layers), pos, cache.length)


def write_layer(x: jax.Array, new: jax.Array, slot_B: jax.Array, slot_axis: int) -> jax.Array:
    """One layer's x with each sequence's slot (along slot_axis, after the batch) replaced by its new entry:
    keys [B, K, H, S] (slot_axis 3) or values [B, K, S, H] (2) take [B, K, H]; scales [B, K, S] (2) [B, K]."""
    index = [jnp.arange(x.shape[0])] + [slice(None)] * (x.ndim - 1)
    index[slot_axis] = slot_B
    return x.at[tuple(index)].set(new.astype(x.dtype))


def chunk_layout(pos_S, start, end, chunk_k_pos_C):
    """Where one sequence's chunk of positions [start, end) goes in a kind's S slots that hold positions pos_S
    (decode.prefill_chunks): the positions of the keys its queries see [X = S + C] (the slots' earlier ones,
    then the chunk's own, chunk_k_pos_C), which slots take a chunk entry [S], from which chunk index [S], and the
    positions the slots then hold [S]. A slot holding a position at or past `start` is left over from an earlier
    occupant (or a dummy decode step): masked (EMPTY), and overwritten before a later query can see it."""
    S, C = pos_S.shape[0], chunk_k_pos_C.shape[0]
    s_S = jnp.arange(S, dtype=jnp.int32)
    latest_S = s_S + S * jnp.floor_divide(end - 1 - s_S, S)  # the latest position < end held by each slot
    take_S = latest_S >= start
    old_k_pos_S = jnp.where(pos_S < start, pos_S, EMPTY)
    return (jnp.concatenate([old_k_pos_S, chunk_k_pos_C]), take_S, jnp.clip(latest_S - start, 0, C - 1),
            jnp.where(take_S, latest_S, pos_S))


def fresh_fits(cache: KVCache, C: int) -> bool:
    """Whether chunks of C tokens that start their prompts can take decode.prefill_chunks' `fresh` path: every kind
    holds position s in slot s for s < C (C no more than its slots, a ring buffer's included)."""
    return all(C <= c.pos.shape[1] for c in cache.kinds)
