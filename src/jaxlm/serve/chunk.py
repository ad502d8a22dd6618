"""Chunked prefill: the next chunk of one prompt run through the model into its slot of the engine's KV cache.

`transformer.prefill` runs a whole prompt from position 0 into a fresh cache. The engine instead prefills a
prompt a chunk at a time, between the decode steps of the other slots, and may start past a prefix whose keys
and values were copied into the slot (the prefix cache), so a chunk starts at any position of a slot that
already holds the earlier ones. Each layer's queries attend to the slot's cached keys of earlier positions and
to the chunk's own keys (causal, windowed for local layers: the mask is a function of positions, as in the
uncached pass); then the chunk's keys and values are written into the slot's cache slots (a ring buffer keeps
the latest position of each of its slots, as kvcache.prefill_layout does). A slot entry holding a position at
or past the chunk's start is left over from an earlier occupant of the slot (or a decode step run while the
slot was idle): it is masked here, and overwritten before any later query can see it.

The chunk is padded to a fixed length C (the engine uses powers of two), so the program compiles once per chunk
length; its start, the prompt's length and the slot are traced.

Shape legend: B slots, C chunk length, S cache slots per sequence, X = S + C keys a chunk attends to,
R repeats of the layer pattern, K kv heads, H head width, N query heads, D width, V vocab.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jaxlm import quant
from jaxlm.config import ModelConfig
from jaxlm.model import attention, kvcache, transformer
from jaxlm.sharding import constrain

ROW = ("k", "v", "k_scale", "v_scale")


def _row(c: kvcache.KindCache, slot) -> dict:
    """One slot of a kind's cache: k, v [R, 1, K, S, H], scales [R, 1, K, S] or None."""
    return {name: None if getattr(c, name) is None else
            jax.lax.dynamic_slice_in_dim(getattr(c, name), slot, 1, axis=1) for name in ROW}


def _attend_chunk(h_1CD, p, cfg: ModelConfig, q_pos_1C, k_pos_1X, row: dict, take_1S, src_S, local: bool):
    """The chunk's attention over the slot's earlier keys and its own; returns the output and the slot's
    updated k, v (and scales) for this layer."""
    with jax.named_scope("attention"):
        q_1CNH, k_1CKH, v_1CKH = attention.project_qkv(h_1CD, p, cfg, q_pos_1C)
        quantized = row["k_scale"] is not None
        keys = []
        new = {}
        for name, x_1CKH in (("k", k_1CKH), ("v", v_1CKH)):
            old_1KSH = kvcache.read(row[name], row[f"{name}_scale"], q_1CNH.dtype)
            keys.append(jnp.concatenate([old_1KSH, x_1CKH.transpose(0, 2, 1, 3).astype(q_1CNH.dtype)], axis=2))
            x_1KSH, scale_1KS = kvcache.store(jnp.take(x_1CKH, src_S, axis=1).transpose(0, 2, 1, 3), quantized)
            new[name] = jnp.where(take_1S[:, None, :, None], x_1KSH.astype(row[name].dtype), row[name])
            new[f"{name}_scale"] = None if not quantized else jnp.where(take_1S[:, None], scale_1KS,
                                                                        row[f"{name}_scale"])
        mask_1CX = attention.mask(q_pos_1C, k_pos_1X, cfg.sliding_window if local else None)
        out_1CNH = attention.attend_heads_major(q_1CNH, keys[0], keys[1], mask_1CX, scale=attention._scale(cfg),
                                                softcap=cfg.attn_logit_softcap)
        return attention._project_out(out_1CNH, p), new


@partial(jax.jit, static_argnames="cfg", donate_argnames=("cache", "logits_BV"))
@quant.scoped
def prefill_chunk(params, cache: kvcache.KVCache, logits_BV, tokens_C, start, length, slot, cfg: ModelConfig):
    """Run prompt tokens [start, start + C) (tokens_C; those at or past `length` are padding) in slot `slot`,
    whose cache holds the prompt's positions before `start`. Returns the cache with the chunk's keys and values
    and length min(start + C, length) in that slot, and logits_BV with the slot's row set to the logits after
    the chunk's last real token (the next token's, once the chunk reaches the prompt's end)."""
    C = tokens_C.shape[0]
    positions_C = start + jnp.arange(C, dtype=jnp.int32)
    end = jnp.minimum(start + C, length)
    # Padding takes the last real position, valid for learned position tables; its keys are masked (EMPTY).
    q_pos_1C = jnp.minimum(positions_C, length - 1)[None]
    chunk_k_pos_1C = jnp.where(positions_C < length, positions_C, kvcache.EMPTY)[None]
    x_1CD = constrain(transformer.embed(params, tokens_C[None], cfg, q_pos_1C), ("batch", "length", "embed"))

    layouts = []  # per kind: key positions [1, X], which slots take a chunk entry [1, S], from where [S], new pos
    for c in cache.kinds:
        S = c.pos.shape[1]
        pos_S = jax.lax.dynamic_index_in_dim(c.pos, slot, keepdims=False)
        s_S = jnp.arange(S, dtype=jnp.int32)
        latest_S = s_S + S * jnp.floor_divide(end - 1 - s_S, S)  # the latest position < end held by each slot
        take_S = latest_S >= start
        old_k_pos_S = jnp.where(pos_S < start, pos_S, kvcache.EMPTY)
        k_pos_1X = jnp.concatenate([old_k_pos_S[None], chunk_k_pos_1C], axis=1)
        layouts.append((k_pos_1X, take_S[None], jnp.clip(latest_S - start, 0, C - 1),
                        jnp.where(take_S, latest_S, pos_S)))

    def step(x_1CD, inputs):
        p_group, rows = inputs
        new_rows = []
        for j, kind in enumerate(cfg.pattern):
            k_pos_1X, take_1S, src_S, _ = layouts[j]

            def attn(h_1CD, p_attn, j=j, local=(kind == "local")):
                return _attend_chunk(h_1CD, p_attn, cfg, q_pos_1C, k_pos_1X, rows[j], take_1S, src_S, local)

            x_1CD, _, new = transformer._block(x_1CD, jax.tree.map(lambda a: a[j], p_group), cfg, attn)
            new_rows.append(new)
        return x_1CD, tuple(new_rows)

    rows = tuple(_row(c, slot) for c in cache.kinds)
    with jax.named_scope("prefill_chunk"):
        x_1CD, new_rows = jax.lax.scan(step, x_1CD, (transformer._grouped(cfg, params["layers"]), rows))
        last_11D = jax.lax.dynamic_slice_in_dim(x_1CD, end - 1 - start, 1, axis=1)
        logits_1V = transformer.unembed(params, last_11D, cfg)[:, 0]

    kinds = []
    for c, new, layout in zip(cache.kinds, new_rows, layouts):
        put = {name: None if getattr(c, name) is None else constrain(
            jax.lax.dynamic_update_slice_in_dim(getattr(c, name), new[name], slot, axis=1),
            (None,) + kvcache.CACHE_AXES[:getattr(c, name).ndim - 1]) for name in ROW}
        kinds.append(kvcache.KindCache(pos=jax.lax.dynamic_update_slice_in_dim(c.pos, layout[3][None], slot, 0),
                                       **put))
    length_B = jax.lax.dynamic_update_slice_in_dim(cache.length, end[None].astype(jnp.int32), slot, 0)
    logits_BV = jax.lax.dynamic_update_slice_in_dim(logits_BV, logits_1V.astype(logits_BV.dtype), slot, 0)
    return kvcache.KVCache(tuple(kinds), length_B), logits_BV
