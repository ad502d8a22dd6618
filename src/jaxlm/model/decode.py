"""The cached steps of generation: the forward pass's blocks (model/transformer.py) run over a KV cache.
`prefill` and `decode_step` (or `decode_layers`, the layers unrolled; `decoder` picks) over the slot cache
(model/kvcache.py), `prefill_chunks` for the server's slot cache, and `paged_forward`, every cached step of the
server over the paged cache (model/paged.py).

Shape legend: B batch, T length, D model width, V vocab, K kv heads, H head width, S cache slots, P rows of a
call, C tokens per row, M pages per row in the table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlm.config import ModelConfig
from jaxlm.model import attention, kvcache, latent, layers, paged, quant, stack
from jaxlm.model.transformer import (add_deepstack, attention_with_kv, block_around, cast_matmul_weights, embed, head,
                                     unembed, with_images)
from jaxlm.sharding import constrain


@quant.scoped
def prefill(params: dict, tokens_BT: jax.Array, lengths_B: jax.Array, cfg: ModelConfig, cache_length: int,
            quantize: bool = False, images: jax.Array | None = None) -> tuple[jax.Array, kvcache.KVCache]:
    """Run a batch of prompts, right-padded to T (sequence b has lengths_B[b] real tokens, 1 <= length <=
    cache_length), and fill a fresh cache for sequences of up to `cache_length` tokens. Returns the float32
    logits after each prompt's last real token [B, V] and the cache. Padding sits after the real tokens, so
    causality alone keeps it out of their attention, and prefill_layout leaves it out of the cache. images: the
    prompts' images (transformer.forward_with_aux), whose tokens see their whole image here and nowhere after."""
    B, T = tokens_BT.shape
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    x_BTD, reach_BT, mrope_BT3, deepstack_SBTD = with_images(params, embed(params, tokens_BT, cfg, positions_BT),
                                                             tokens_BT, positions_BT, images, cfg)
    x_BTD = constrain(x_BTD, ("batch", "length", "embed"))
    layouts = [kvcache.prefill_layout(lengths_B, T, kvcache.slots(cfg, kind, cache_length)) for kind in cfg.pattern]

    def step(x_BTD, p, kind, j, r, _):
        def attn(h_BTD, p_attn):
            out_BTD, k_BTKH, v_BTKH = attention_with_kv(h_BTD, p_attn, cfg, positions_BT, None, kind.attention,
                                                        None, reach_BT, mrope_BT3)
            return out_BTD, (k_BTKH, v_BTKH)

        x_BTD, _, kv = block_around(x_BTD, p, cfg, attn)
        x_BTD = add_deepstack(x_BTD, deepstack_SBTD, r * len(cfg.pattern) + j)
        entry = {}
        for name, x_BTKH in zip(("k", "v"), kv):
            x_BSKH = jnp.take_along_axis(x_BTKH, layouts[j][0][:, :, None, None], axis=1)
            entry[name], entry[f"{name}_scale"] = kvcache.store(x_BSKH.transpose(0, 2, 1, 3), quantize)
        return x_BTD, entry

    with jax.named_scope("prefill"):
        x_BTD, entries = stack.run(cfg, params["layers"], step, x_BTD)
        last_B1D = jnp.take_along_axis(x_BTD, (lengths_B - 1)[:, None, None], axis=1)
        logits_BV = unembed(params, last_B1D, cfg)[:, 0]
    kinds = tuple(kvcache.KindCache(pos=layout[1], **e) for layout, e in zip(layouts, entries))
    return logits_BV, kvcache.KVCache(kinds, lengths_B.astype(jnp.int32))


def _decode_inputs(params: dict, tokens_B: jax.Array, pos_B: jax.Array, k_pos: list[jax.Array], cfg: ModelConfig):
    """What a decode step starts from, whatever the cache's layout: the new tokens embedded at positions pos_B
    [B, 1, D], those positions [B, 1], each pattern entry's slot for them ([B] per entry of k_pos, the
    entries' [B, S] positions held) and the positions held once the step has written there."""
    B = tokens_B.shape[0]
    positions_B1 = pos_B[:, None]
    x_B1D = constrain(embed(params, tokens_B[:, None], cfg, positions_B1), ("batch", "length", "embed"))
    slots = [pos_B % p_BS.shape[1] for p_BS in k_pos]
    k_positions = [p_BS.at[jnp.arange(B), slot_B].set(pos_B) for p_BS, slot_B in zip(k_pos, slots)]
    return x_B1D, positions_B1, slots, k_positions


@quant.scoped
def decode_step(params: dict, tokens_B: jax.Array, cache: kvcache.KVCache, cfg: ModelConfig
                ) -> tuple[jax.Array, kvcache.KVCache]:
    """Append one token per sequence at position cache.length: float32 logits of the next token [B, V] and
    the cache holding the new keys and values."""
    pos_B = cache.length
    x_B1D, positions_B1, slots, k_positions = _decode_inputs(params, tokens_B, pos_B, [c.pos for c in cache.kinds],
                                                             cfg)
    attn_mod = latent if cfg.latent else attention

    def step(carry, p, kind, j, r, _):  # the stacked caches ride in the carry: each layer writes its entries in place
        x_B1D, stacks = carry

        def attn(h_B1D, p_attn):
            return attn_mod.attention_decode(h_B1D, p_attn, cfg, positions_B1, stacks[j], r, slots[j],
                                             k_positions[j], kind.attention)

        x_B1D, _, new_j = block_around(x_B1D, p, cfg, attn)
        return (x_B1D, stacks[:j] + (new_j,) + stacks[j + 1:]), None

    stacks = tuple({"k": c.k, "v": c.v, "k_scale": c.k_scale, "v_scale": c.v_scale} for c in cache.kinds)
    with jax.named_scope("decode"):
        (x_B1D, new), _ = stack.run(cfg, params["layers"], step, (x_B1D, stacks))
        logits_BV = unembed(params, x_B1D, cfg)[:, 0]
    kinds = tuple(kvcache.KindCache(pos=k_pos, **c) for k_pos, c in zip(k_positions, new))
    return logits_BV, kvcache.KVCache(kinds, pos_B + 1)


@quant.scoped
def layer_weights(params: dict, cfg: ModelConfig) -> tuple[dict, ...]:
    """The layers' weights one by one, dense matmul weights in the compute dtype: taken apart once before a
    decode loop (decode_layers), so that its steps neither slice nor cast the stacked weights."""
    lay = stack.layout(cfg)
    return tuple(cast_matmul_weights(stack.layer_view(params["layers"], lay, i), cfg) for i in range(cfg.n_layers))


@quant.scoped
def decode_layers(params: dict, layer_params: tuple[dict, ...], tokens_B: jax.Array, cache: kvcache.LayerCaches,
                  cfg: ModelConfig) -> tuple[jax.Array, kvcache.LayerCaches]:
    """decode_step over the cache taken apart by layer (kvcache.unstack) and the weights (layer_weights), the
    layers unrolled: each reads and writes its own cache buffers in place, where the scan over stacked layers
    slices a copy of every layer's keys and values per step. Equal to decode_step up to float rounding (the
    q.k product reads the keys transposed), which left the sampled tokens of tests/test_generate.py unchanged."""
    pos_B = cache.length
    x_B1D, positions_B1, slots, k_positions = _decode_inputs(params, tokens_B, pos_B, cache.pos, cfg)
    P = len(cfg.pattern)
    attn_mod = latent if cfg.latent else attention
    new = []
    with jax.named_scope("decode"):
        for i, (p, layer) in enumerate(zip(layer_params, cache.layers)):
            j = i % P

            def attn(h_B1D, p_attn, j=j, layer=layer):
                return attn_mod.attention_decode_layer(h_B1D, p_attn, cfg, positions_B1, layer, slots[j],
                                                       k_positions[j], cfg.pattern[j])

            x_B1D, _, layer = block_around(x_B1D, p, cfg, attn)
            new.append(layer)
        logits_BV = unembed(params, x_B1D, cfg)[:, 0]
    return logits_BV, kvcache.LayerCaches(tuple(new), tuple(k_positions), pos_B + 1)


def decoder(params: dict, cache: kvcache.KVCache, cfg: ModelConfig, unroll: bool, rows_b: jax.Array | None = None,
            slots: int | None = None):
    """A decode loop's step and the cache in the layout it takes: `step(tokens_B, cache) -> (logits_BV, cache)`,
    of the sequences rows_b of `cache` and cut to `slots` slots (kvcache.kept_slots) when given. With `unroll`
    the weights and the cache are taken apart by layer here, once (decode_layers; kvcache.restack puts the
    cache back), else the step scans the stacked layers (decode_step; kvcache.put_rows puts it back)."""
    if not unroll:
        return (lambda tokens_B, c: decode_step(params, tokens_B, c, cfg)), (
            cache if rows_b is None and slots is None else kvcache.take_rows(cache, cfg, rows_b, slots))
    layer_params = layer_weights(params, cfg)
    return ((lambda tokens_B, c: decode_layers(params, layer_params, tokens_B, c, cfg)),
            kvcache.unstack(cache, cfg, rows_b, slots))


@quant.scoped
def prefill_chunks(params: dict, cache: kvcache.KVCache, tokens_PC: jax.Array, start_P: jax.Array,
                   length_P: jax.Array, slot_P: jax.Array, cfg: ModelConfig, fresh: bool = False
                   ) -> tuple[kvcache.KVCache, jax.Array]:
    """Run, for each row p (P rows here, of chunks of C tokens), prompt tokens [start_P[p], start_P[p] + C)
    (tokens_PC[p]; those at or past length_P[p] are padding) in slot slot_P[p], whose cache holds the prompt's
    positions before start_P[p].
    Returns the cache with each row's keys and values and length min(start + C, length) in its slot, and each
    row's logits after its chunk's last real token [P, V] (the next token's, once the chunk reaches the prompt's
    end). A slot may appear in one row only, or be B, past the last (a padding row: reads slot B - 1, writes
    nothing). A row's layout and mask depend only on its own start, length and cached positions, so each row
    gets what it would get alone. The server's slot cache prefills prompts this way, a chunk at a time between
    decode steps, and after a prefix copied into the slot (serve/engine.py).
    `fresh` (every start_P 0, and fresh_fits): the slots' earlier contents are neither read nor kept, only
    written: the chunk's keys and values go to slots 0..C-1 and every later slot is emptied (EMPTY)."""
    C = tokens_PC.shape[1]
    positions_PC = start_P[:, None] + jnp.arange(C, dtype=jnp.int32)
    end_P = jnp.minimum(start_P + C, length_P)
    # Padding takes the last real position, valid for learned position tables; its keys are masked (EMPTY).
    q_pos_PC = jnp.minimum(positions_PC, length_P[:, None] - 1)
    chunk_k_pos_PC = jnp.where(positions_PC < length_P[:, None], positions_PC, kvcache.EMPTY)
    x_PCD = constrain(embed(params, tokens_PC, cfg, q_pos_PC), ("batch", "length", "embed"))
    # per kind: key positions [P, X], which slots take a chunk entry [P, S], from where [P, S], new positions
    if fresh:  # keys: the chunk's own; slots 0..C-1 take its positions, the rest are emptied
        P = tokens_PC.shape[0]
        layouts = [(chunk_k_pos_PC, None, None, jnp.concatenate(
            [chunk_k_pos_PC, jnp.full((P, c.pos.shape[1] - C), kvcache.EMPTY, jnp.int32)], axis=1))
            for c in cache.kinds]
    else:
        layouts = [jax.vmap(kvcache.chunk_layout)(jnp.take(c.pos, slot_P, axis=0, mode="clip"), start_P, end_P,
                                                  chunk_k_pos_PC) for c in cache.kinds]
    attn_mod = latent if cfg.latent else attention

    def step(x_PCD, p, kind, j, r, rows_j):
        k_pos_PX, take_PS, src_PS, _ = layouts[j]

        def attn(h_PCD, p_attn):
            return attn_mod.attention_chunk(h_PCD, p_attn, cfg, q_pos_PC, k_pos_PX, None if fresh else rows_j,
                                            take_PS, src_PS, kind.attention, cache.kinds[j].k_scale is not None)

        x_PCD, _, new = block_around(x_PCD, p, cfg, attn)
        return x_PCD, new

    # Slots slot_P of each kind's cache (slot B, a padding row's, reads slot B - 1).
    names = ("k", "v", "k_scale", "v_scale")
    rows = None if fresh else tuple({name: None if getattr(c, name) is None else jnp.take(
        getattr(c, name), slot_P, axis=1, mode="clip") for name in names} for c in cache.kinds)
    with jax.named_scope("prefill_chunks"):
        x_PCD, new_rows = stack.run(cfg, params["layers"], step, x_PCD, rows)
        last_P1D = jnp.take_along_axis(x_PCD, (end_P - 1 - start_P)[:, None, None], axis=1)
        logits_PV = unembed(params, last_P1D, cfg)[:, 0]

    def put(a, x_P, axis, first=None):  # slot B (padding) is dropped; `first`: into slots 0..first-1 only
        index = (slice(None),) * axis + (slot_P,) + (() if first is None else (slice(None), slice(0, first)))
        return a.at[index].set(x_P.astype(a.dtype), mode="drop")

    kinds = []
    for c, new, layout in zip(cache.kinds, new_rows, layouts):
        arrays = {name: None if getattr(c, name) is None else constrain(
            put(getattr(c, name), new[name], 1, C if fresh else None),
            (None,) + kvcache.CACHE_AXES[:getattr(c, name).ndim - 1]) for name in names}
        kinds.append(kvcache.KindCache(pos=put(c.pos, layout[3], 0), **arrays))
    return kvcache.KVCache(tuple(kinds), put(cache.length, end_P, 0)), logits_PV


@quant.scoped
def paged_forward(params: dict, cache: paged.PagedCache, tokens_PC: jax.Array, start_P: jax.Array,
                  length_P: jax.Array, table_PM: jax.Array, cfg: ModelConfig,
                  layer_params: tuple[dict, ...] | None = None, all_logits: bool = False, hidden: bool = False
                  ) -> tuple[jax.Array, paged.PagedCache] | tuple[jax.Array, jax.Array, paged.PagedCache]:
    """Run tokens [P, C] of P sequences over the paged cache (model/paged.py), each row from position start_P[p]
    through its page table table_PM[p]: the tokens below length_P[p] are real (the rest padding: neither
    written nor attended to), their cache entries are written into the row's pages, and each attends to the
    row's keys before it. One function for every cached step of the server: a prompt's chunk (C up to the
    chunk length, after the pages of its earlier chunks or of a shared prefix), a decode step (C = 1; a row
    with length_P 0 does nothing) and a speculative verification (C = draft tokens + 1). Returns float32 logits,
    of every token [P, C, V] with `all_logits`, else of each row's last real token [P, V], and the cache.

    `layer_params` (layer_weights: the layers' weights one by one, taken apart once before a decode loop) runs
    the layers unrolled, each reading and writing its own slice of the stacked pool; else the layers go through
    stack.run (scanned groups). The table's pages must cover every real token's position (the caller allocates
    them). `hidden` also returns every token's last hidden state after the final norm [P, C, D] (what the
    multi-token prediction modules take: mtp.paged_mtp), as (logits, hidden, cache)."""
    end_P, q_pos_PC, page_PC, off_PC, flat = paged_layout(cache, tokens_PC, start_P, length_P, table_PM)
    x_PCD = constrain(embed(params, tokens_PC, cfg, q_pos_PC), ("batch", "length", "embed"))

    def layer(carry, p, kind, j, r, _):
        x_PCD, kinds = carry

        def attn(h_PCD, p_attn):
            return paged.attention(h_PCD, p_attn, cfg, kinds[j], r, q_pos_PC, page_PC, off_PC, table_PM, end_P,
                                   kind.attention, flat, cache.kernel)

        x_PCD, _, arrays = block_around(x_PCD, p, cfg, attn)
        return (x_PCD, kinds[:j] + (arrays,) + kinds[j + 1:]), None

    kinds = tuple(cache.kinds)
    P_ = len(cfg.pattern)
    with jax.named_scope("paged"):
        if layer_params is not None:
            lay = stack.layout(cfg)
            for i, p in enumerate(layer_params):
                (x_PCD, kinds), _ = layer((x_PCD, kinds), p, lay.kinds[i], i % P_, i // P_, None)
        else:
            (x_PCD, kinds), _ = stack.run(cfg, params["layers"], lambda carry, p, *rest: layer(
                carry, cast_matmul_weights(p, cfg), *rest), (x_PCD, kinds))
        if not (all_logits or hidden):  # a prompt chunk's call: only its last real token is normalized
            x_PCD = last_real(x_PCD, start_P, end_P)
        h_PCD = layers.norm(x_PCD, params["final_norm"], cfg.norm, cfg.norm_eps, cfg.norm_plus_one)
        logits = head(params, h_PCD if all_logits or not hidden else last_real(h_PCD, start_P, end_P), cfg)
    logits = logits if all_logits else logits[:, 0]
    cache = paged.PagedCache(kinds, cache.kernel)
    return (logits, h_PCD, cache) if hidden else (logits, cache)


def paged_layout(cache: paged.PagedCache, tokens_PC, start_P, length_P, table_PM):
    """Where tokens [P, C] from start_P (real below length_P) go in a paged pool: each row's end of real tokens
    [P], the positions its queries take [P, C], the page and offset of each token's entry [P, C] (real tokens'
    pages from the row's table; padding's past the pool, so that the write is dropped), and whether the rows
    read their pages flat (paged.attention)."""
    C = tokens_PC.shape[1]
    A = cache.page_size
    positions_PC = start_P[:, None] + jnp.arange(C, dtype=jnp.int32)
    end_P = jnp.clip(length_P, start_P, start_P + C)
    real_PC = positions_PC < end_P[:, None]
    # Padding takes the last real position (valid for learned position tables) and is masked as a key.
    q_pos_PC = jnp.maximum(jnp.minimum(positions_PC, end_P[:, None] - 1), 0)
    slot_PC = jnp.take_along_axis(table_PM, jnp.clip(positions_PC // A, 0, table_PM.shape[1] - 1), axis=1)
    page_PC = jnp.where(real_PC, slot_PC, cache.pages)
    return end_P, q_pos_PC, page_PC, positions_PC % A, C <= paged.FLAT_MAX_QUERIES


def last_real(x_PCD, start_P, end_P):
    """Each row's entry at its last real token [P, 1, D] (the first, for a row with none)."""
    return jnp.take_along_axis(x_PCD, jnp.maximum(end_P - 1 - start_P, 0)[:, None, None], axis=1)
