"""Chunked prefill: the next chunks of several prompts run through the model, in one call, into their slots of
the engine's KV cache.

`transformer.prefill` runs whole prompts from position 0 into a fresh cache. The engine instead prefills a
prompt a chunk at a time, between the decode steps of the other slots, and may start past a prefix whose keys
and values were copied into the slot (the prefix cache), so a chunk starts at any position of a slot that
already holds the earlier ones. Each layer's queries attend to the slot's cached keys of earlier positions and
to the chunk's own keys (causal, windowed for local layers: the mask is a function of positions, as in the
uncached pass); then the chunk's keys and values are written into the slot's cache slots (a ring buffer keeps
the latest position of each of its slots, as kvcache.prefill_layout does). A slot entry holding a position at
or past the chunk's start is left over from an earlier occupant of the slot (or a decode step run while the
slot was idle): it is masked here, and overwritten before any later query can see it.

A call takes P rows, each the chunk of one prompt with its own start, prompt length and slot: it gathers
those slots' rows of the cache, runs the model over the [P, C] tokens (a row's layout and mask depend only on
its own start, length and cached positions, so each row gets what it would get alone), and scatters the rows
back. One prompt is the case P = 1. The chunks are padded to a fixed length C (the engine uses powers of two)
and the engine pads P to a power of two with rows whose slot is B, past the last: such a row reads slot B - 1
and writes nothing. So the program compiles once per (P, C); starts, lengths and slots are traced.

When every chunk of a call starts its prompt (`fresh`, the common case of new requests without a reused
prefix) the slots' earlier contents matter to nothing: the call neither gathers them nor attends to them, and
writes the chunk's keys and values to the first C slots and empties the rest (fresh_fits: C must fit every
kind's slots, so a ring buffer shorter than C takes the general path). That also compiles once per (P, C).

Shape legend: B slots, P rows of a call, C chunk length, S cache slots per sequence, X = S + C keys a chunk
attends to, R repeats of the layer pattern, K kv heads, H head width, N query heads, D width, V vocab.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jaxlm import quant
from jaxlm.config import ModelConfig
from jaxlm.model import attention, kvcache, latent, stack, transformer
from jaxlm.sharding import constrain

ROW = ("k", "v", "k_scale", "v_scale")


def _rows(c: kvcache.KindCache, slot_P) -> dict:
    """Slots slot_P of a kind's cache: k, v [R, P, K, S, H], scales [R, P, K, S] or None (slot B, a padding
    row's, reads slot B - 1)."""
    return {name: None if getattr(c, name) is None else jnp.take(getattr(c, name), slot_P, axis=1, mode="clip")
            for name in ROW}


def _layout(pos_S, start, end, chunk_k_pos_C):
    """Where one row's chunk of positions [start, end) goes in a kind's S slots that hold positions pos_S: the
    positions of the keys its queries see [X] (the slots' earlier ones, then the chunk's own), which slots take a
    chunk entry [S], from which chunk index [S], and the positions the slots then hold [S]."""
    S, C = pos_S.shape[0], chunk_k_pos_C.shape[0]
    s_S = jnp.arange(S, dtype=jnp.int32)
    latest_S = s_S + S * jnp.floor_divide(end - 1 - s_S, S)  # the latest position < end held by each slot
    take_S = latest_S >= start
    old_k_pos_S = jnp.where(pos_S < start, pos_S, kvcache.EMPTY)
    return (jnp.concatenate([old_k_pos_S, chunk_k_pos_C]), take_S, jnp.clip(latest_S - start, 0, C - 1),
            jnp.where(take_S, latest_S, pos_S))


def _attend_chunk(h_PCD, p, cfg: ModelConfig, q_pos_PC, k_pos_PX, rows: dict, take_PS, src_PS, kind: str,
                  quantized: bool):
    """The chunks' attention over their slots' earlier keys and their own; returns the output and the slots'
    updated k, v (and scales) for this layer. With `rows` None (chunks that start their prompts, `fresh`) the
    queries see the chunk's keys only and the update is the chunk's own k, v (and scales) [P, K, C(, H)], for
    slots 0..C-1. A latent-attention layer's k and v are its rotary keys and latents (model/latent.py)."""
    attn_mod = latent if cfg.latent else attention
    with jax.named_scope("attention"):
        q_PCNH, entries = attn_mod.project_entries(h_PCD, p, cfg, q_pos_PC, kind)
        keys = []
        new = {}
        for name, x_PCKH in zip(("k", "v"), entries):
            own_PKCH = x_PCKH.transpose(0, 2, 1, 3)
            if rows is None:
                keys.append(own_PKCH.astype(q_PCNH.dtype))
                new[name], new[f"{name}_scale"] = kvcache.store(own_PKCH, quantized)
                continue
            old_PKSH = kvcache.read(rows[name], rows[f"{name}_scale"], q_PCNH.dtype)
            keys.append(jnp.concatenate([old_PKSH, own_PKCH.astype(q_PCNH.dtype)], axis=2))
            x_PSKH = jnp.take_along_axis(x_PCKH, src_PS[:, :, None, None], axis=1)
            x_PKSH, scale_PKS = kvcache.store(x_PSKH.transpose(0, 2, 1, 3), quantized)
            new[name] = jnp.where(take_PS[:, None, :, None], x_PKSH.astype(rows[name].dtype), rows[name])
            new[f"{name}_scale"] = None if not quantized else jnp.where(take_PS[:, None], scale_PKS,
                                                                        rows[f"{name}_scale"])
        mask_PCX = attention.kind_mask(cfg, kind, q_pos_PC, k_pos_PX)
        return attn_mod.attend_entries(q_PCNH, keys[0], keys[1], mask_PCX, p, cfg), new


def fresh_fits(cache: kvcache.KVCache, C: int) -> bool:
    """Whether chunks of C tokens that start their prompts can take prefill_chunks' `fresh` path: every kind
    holds position s in slot s for s < C (C no more than its slots, a ring buffer's included)."""
    return all(C <= c.pos.shape[1] for c in cache.kinds)


@partial(jax.jit, static_argnames=("cfg", "fresh"), donate_argnames=("cache", "logits_BV"))
@quant.scoped
def prefill_chunks(params, cache: kvcache.KVCache, logits_BV, tokens_PC, start_P, length_P, slot_P,
                   cfg: ModelConfig, fresh: bool = False):
    """Run, for each row p, prompt tokens [start_P[p], start_P[p] + C) (tokens_PC[p]; those at or past
    length_P[p] are padding) in slot slot_P[p], whose cache holds the prompt's positions before start_P[p].
    Returns the cache with each row's keys and values and length min(start + C, length) in its slot, and
    logits_BV with the slot's row set to the logits after the chunk's last real token (the next token's, once
    the chunk reaches the prompt's end). A slot may appear in one row only, or be B (a padding row: no effect).
    `fresh` (every start_P 0, and fresh_fits): the slots' earlier contents are neither read nor kept, only
    written: the chunk's keys and values go to slots 0..C-1 and every later slot is emptied (EMPTY)."""
    C = tokens_PC.shape[1]
    positions_PC = start_P[:, None] + jnp.arange(C, dtype=jnp.int32)
    end_P = jnp.minimum(start_P + C, length_P)
    # Padding takes the last real position, valid for learned position tables; its keys are masked (EMPTY).
    q_pos_PC = jnp.minimum(positions_PC, length_P[:, None] - 1)
    chunk_k_pos_PC = jnp.where(positions_PC < length_P[:, None], positions_PC, kvcache.EMPTY)
    x_PCD = constrain(transformer.embed(params, tokens_PC, cfg, q_pos_PC), ("batch", "length", "embed"))
    # per kind: key positions [P, X], which slots take a chunk entry [P, S], from where [P, S], new positions
    if fresh:  # keys: the chunk's own; slots 0..C-1 take its positions, the rest are emptied
        P = tokens_PC.shape[0]
        layouts = [(chunk_k_pos_PC, None, None, jnp.concatenate(
            [chunk_k_pos_PC, jnp.full((P, c.pos.shape[1] - C), kvcache.EMPTY, jnp.int32)], axis=1))
            for c in cache.kinds]
    else:
        layouts = [jax.vmap(_layout)(jnp.take(c.pos, slot_P, axis=0, mode="clip"), start_P, end_P,
                                     chunk_k_pos_PC) for c in cache.kinds]

    def step(x_PCD, p, kind, j, r, rows_j):
        k_pos_PX, take_PS, src_PS, _ = layouts[j]

        def attn(h_PCD, p_attn):
            return _attend_chunk(h_PCD, p_attn, cfg, q_pos_PC, k_pos_PX, None if fresh else rows_j, take_PS,
                                 src_PS, kind.attention, cache.kinds[j].k_scale is not None)

        x_PCD, _, new = transformer._block(x_PCD, p, cfg, attn)
        return x_PCD, new

    rows = None if fresh else tuple(_rows(c, slot_P) for c in cache.kinds)
    with jax.named_scope("prefill_chunks"):
        x_PCD, new_rows = stack.run(cfg, params["layers"], step, x_PCD, rows)
        last_P1D = jnp.take_along_axis(x_PCD, (end_P - 1 - start_P)[:, None, None], axis=1)
        logits_PV = transformer.unembed(params, last_P1D, cfg)[:, 0]

    def put(a, x_P, axis, first=None):  # slot B (padding) is dropped; `first`: into slots 0..first-1 only
        index = (slice(None),) * axis + (slot_P,) + (() if first is None else (slice(None), slice(0, first)))
        return a.at[index].set(x_P.astype(a.dtype), mode="drop")

    kinds = []
    for c, new, layout in zip(cache.kinds, new_rows, layouts):
        arrays = {name: None if getattr(c, name) is None else constrain(
            put(getattr(c, name), new[name], 1, C if fresh else None),
            (None,) + kvcache.CACHE_AXES[:getattr(c, name).ndim - 1]) for name in ROW}
        kinds.append(kvcache.KindCache(pos=put(c.pos, layout[3], 0), **arrays))
    return kvcache.KVCache(tuple(kinds), put(cache.length, end_P, 0)), put(logits_BV, logits_PV, 0)
