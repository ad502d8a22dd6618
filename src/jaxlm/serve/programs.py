"""The continuous-batching engine's device programs (serve/engine.py runs them): the decode loop over the slot
cache and over the paged cache, prompts' chunks prefilled into pages, an empty cache of either kind, and a
prompt's log-probabilities for scoring. Each is a jitted function of arrays and static settings, among them the
engine's mesh and rules (`layout`, a sharding.Layout the program traces in: never a block opened around the call,
which jax.jit's cache would not see); the engine owns the host side (slots, queues, pages, which rows a call
takes).

Shape legend: B slots, b rows of a call, N steps of a decode call at most, M stop tokens of a row (padded), S
cache slots per sequence, V vocab, K top log-probabilities, P rows of a prefill call, C chunk length, T tokens.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from jaxlm import sharding
from jaxlm.infer import sampling, speculative
from jaxlm.infer.sampling import TOP_LOGPROBS, RowSampling
from jaxlm.config import ModelConfig
from jaxlm.model import decode, forward, kvcache, layers, paged
from jaxlm.model.decode import decoder, paged_forward

SLOT_DIVISORS = (8, 4, 2)  # the decode program's slot buckets besides all slots: S / each (slot_buckets)
MIN_SLOTS = 16  # the fewest slots of a slot bucket


@partial(jax.jit, static_argnames=("cfg", "max_steps", "unroll", "layout"), donate_argnames=("cache", "logits_BV"))
def decode_loop(params, cache, logits_BV, rows_b, adapter_b, steps, live_b, idle_length_b, sampled: RowSampling,
                cfg: ModelConfig, max_steps: int, unroll: bool, layout: sharding.Layout | None = None):
    """sampled_steps over slots rows_b of the slot cache (all slots in order when there are B of them). With
    `unroll` the steps run over the cache taken apart by layer (kvcache.unstack, decode.decode_layers), as
    generate's loop does for models of up to generate.UNROLL_LAYERS layers: one copy of the rows' part of the
    cache in (the gather of rows_b included) and one out (kvcache.restack, in place into the donated cache) per
    call, where the scan over the stacked cache (unroll False) copies each layer's keys and values out of the
    stack every step. Either way the call takes only the fewest slots of slot_buckets that hold the positions
    it reads and writes. adapter_b: each row's LoRA adapter (layers.with_rows; -1 the base). `layout`: the
    engine's mesh and rules (every program here traces in it). Returns sampled_steps' outputs, the logits and the
    cache."""
    params = layers.with_rows(params, adapter_b)
    B, b = logits_BV.shape[0], rows_b.shape[0]
    whole = b == B
    logits_bV = logits_BV if whole else jnp.take(logits_BV, rows_b, axis=0)
    rows = None if whole else rows_b

    def run(slots, out, logits_bV, cache):  # the call over the first `slots` slots of the rows' cache
        step, sub = decoder(params, cache, cfg, unroll, rows, slots)

        def decode(tok_b, live_b, sub):
            # Rows not living decode a dummy token at idle_length_b: 0 for a free slot or a finished sequence,
            # the next chunk's start for a slot being prefilled, where the chunk masks that entry and then
            # overwrites it (decode.prefill_chunks).
            return step(tok_b, dataclasses.replace(sub, length=jnp.where(live_b, sub.length, idle_length_b)))

        out, logits_bV, sub, _ = sampling.sampled_steps(decode, sub, logits_bV, steps, live_b, sampled, max_steps)
        cache = kvcache.restack(sub, cfg, cache, rows) if unroll else kvcache.put_rows(cache, sub, rows)
        return out, logits_bV, cache

    with sharding.within(layout):
        buckets = slot_buckets(cfg, cache)
        N, K = max_steps, TOP_LOGPROBS
        zeros = (jnp.zeros((N, b), jnp.int32), jnp.zeros((N, b), jnp.float32), jnp.zeros((N, b, K), jnp.int32),
                 jnp.zeros((N, b, K), jnp.float32), jnp.zeros((N, b), bool))
        if len(buckets) == 1:
            out, logits_bV, cache = run(None, zeros, logits_bV, cache)
        else:
            # The fewest slots that hold every position this call reads or writes: a live row's cached ones and the
            # ones its steps append, a dummy token's (idle_length_b).
            length_b = cache.length if whole else cache.length[rows_b]
            reach = jnp.maximum(jnp.max(jnp.where(live_b, length_b + jnp.minimum(steps, sampled.left_b), 0)),
                                jnp.max(idle_length_b) + 1)
            which = jnp.sum(jnp.asarray(buckets[:-1]) < reach)
            # One cond per bucket rather than a lax.switch: XLA then updates the donated cache in place, where the
            # switch's branches each copied all of it.
            state = (zeros, logits_bV, cache)
            for j, S in enumerate(buckets):
                state = jax.lax.cond(which == j, partial(run, S), lambda *state: state, *state)
            out, logits_bV, cache = state
    if not whole:
        logits_bV = logits_BV.at[rows_b].set(logits_bV)
    return *out, logits_bV, cache


@partial(jax.jit, static_argnames=("cfg", "max_steps", "layout"), donate_argnames=("cache", "logits_BV"))
def paged_decode_loop(params, layer_params, cache, logits_BV, rows_b, adapter_b, steps, live_b, length_b, table_bM,
                      sampled: RowSampling, cfg: ModelConfig, max_steps: int,
                      layout: sharding.Layout | None = None):
    """sampled_steps over rows rows_b of the paged cache (model/paged.py): each step writes every live row's
    token at position length_b (plus the steps before) into its pages (table_bM, which the host has made cover
    the call's positions) and attends over its pages; rows not living do nothing. With `layer_params` (the
    layers' weights taken apart once, by the engine: decode.layer_weights) the layers are unrolled, else
    scanned. adapter_b: each row's LoRA adapter (layers.with_rows; -1 the base). Returns sampled_steps'
    outputs, the logits and the cache. A call of all B rows takes them in order (the engine's largest bucket), so
    its logits are used as they are: the gather of rows_b and the scatter back, a copy of [B, V] float32 each
    (row by row, the scatter), cost about 1.7 ms a call on the 1B shape by the compiler's estimate
    (docs/serve.md, "The engine's step against generate's")."""
    params, layer_params = layers.with_rows((params, layer_params), adapter_b)
    whole = rows_b.shape[0] == logits_BV.shape[0]
    logits_bV = logits_BV if whole else jnp.take(logits_BV, rows_b, axis=0)

    def decode(tok_b, live_b, state):
        cache, length_b = state
        logits_bV, cache = paged_forward(params, cache, tok_b[:, None], jnp.where(live_b, length_b, 0),
                                         jnp.where(live_b, length_b + 1, 0), table_bM, cfg, layer_params)
        return logits_bV, (cache, length_b + live_b)

    with sharding.within(layout):
        out, logits_bV, (cache, _), _ = sampling.sampled_steps(decode, (cache, length_b), logits_bV, steps, live_b,
                                                               sampled, max_steps)
    return *out, logits_bV if whole else logits_BV.at[rows_b].set(logits_bV), cache


@partial(jax.jit, static_argnames=("cfg", "layout"), donate_argnames=("cache", "logits_BV"))
def paged_prefill(params, layer_params, cache, logits_BV, tokens_PC, start_P, length_P, table_PM, slot_P, adapter_P,
                  cfg: ModelConfig, layout: sharding.Layout | None = None):
    """Prompts' chunks into their pages (paged_forward), each row's logits after its chunk into
    logits_BV at its slot (none for a padding row's slot B, whose length 0 writes nothing); adapter_P each row's
    LoRA adapter. With `layer_params` (the engine's, as the decode loop's) the layers are unrolled: scanned over
    the stacked weights, the call sliced and cast every layer's weights afresh, a fixed cost that dominated short
    chunks (docs/serve.md, "Measured")."""
    params, layer_params = layers.with_rows((params, layer_params), adapter_P)
    with sharding.within(layout):
        logits_PV, cache = paged_forward(params, cache, tokens_PC, start_P, length_P, table_PM, cfg,
                                         layer_params)
    return cache, logits_BV.at[slot_P].set(logits_PV, mode="drop")


@partial(jax.jit, static_argnames=("cfg", "quantize", "layout"), donate_argnames=("cache", "logits_BV"))
def slot_prefill_images(params, cache, logits_BV, tokens_1T, length_1, images, slot_1, adapter_1, cfg: ModelConfig,
                        quantize: bool, layout: sharding.Layout | None = None):
    """One prompt's tokens [0, length_1) (padded to T) with its images, prefilled whole (decode.prefill: an image's
    tokens see one another) into a fresh one-sequence cache of the engine's slots, then copied into slot slot_1 of
    the slot cache, and the logits after its last token into logits_BV there."""
    S = max(c.pos.shape[1] for c in cache.kinds)  # the cache's positions (a ring buffer's slots do not depend on them)
    with sharding.within(layout):
        logits_1V, one = decode.prefill(layers.with_rows(params, adapter_1), tokens_1T, length_1, cfg, S, quantize,
                                        images)
        cache = kvcache.copy_row(cache, one, slot_1[0], 0)
    return cache, logits_BV.at[slot_1].set(logits_1V)


@partial(jax.jit, static_argnames=("cfg", "layout"), donate_argnames=("cache", "logits_BV"))
def paged_prefill_images(params, cache, logits_BV, tokens_1T, length_1, images, table_1M, slot_1, adapter_1,
                         cfg: ModelConfig, layout: sharding.Layout | None = None):
    """One prompt's tokens [0, length_1) (padded to T) with its images, prefilled whole (decode.prefill: an image's
    tokens see one another) and written into its pages (table_1M), and the logits after its last token into
    logits_BV at slot_1. A local layer keeps only its window's last positions (decode.prefill's ring buffer): the
    positions before are never read by this sequence's later tokens, and such a prompt's pages are not shared
    (Cache.keep_prompts)."""
    A, T = cache.page_size, tokens_1T.shape[1]
    with sharding.within(layout):
        logits_1V, one = decode.prefill(layers.with_rows(params, adapter_1), tokens_1T, length_1, cfg, T, False,
                                        images)
        kinds = []
        for j, (held, arrays) in enumerate(zip(one.kinds, cache.kinds)):
            pos_1S = held.pos  # each slot's position, EMPTY when it holds none: written past the pool (dropped)
            page_1S = jnp.where(pos_1S < kvcache.EMPTY,
                                jnp.take(table_1M[0], jnp.minimum(pos_1S // A, table_1M.shape[1] - 1)), cache.pages)
            for r in range(paged.repeats(cfg, j)):
                k_1SKH, v_1SKH = (x[r].transpose(0, 2, 1, 3) for x in (held.k, held.v))
                arrays = paged.write(arrays, r, paged.entries(k_1SKH, v_1SKH, arrays), page_1S, pos_1S % A)
            kinds.append(arrays)
    return paged.PagedCache(tuple(kinds), cache.kernel), logits_BV.at[slot_1].set(logits_1V)


def slot_buckets(cfg: ModelConfig, cache: kvcache.KVCache) -> list[int]:
    """The slot counts the decode program is compiled for, fewest first: a call attends over (and copies) the
    fewest that hold its rows' positions (kvcache.kept_slots), S/8, S/4, S/2 or all S of them (from
    MIN_SLOTS slots), where a full cache's slots all cost every step. Only all S when no layer can be cut."""
    S = max(c.pos.shape[1] for c in cache.kinds)
    if all(kvcache.kept_slots(cfg, j, c.pos.shape[1], 1) == c.pos.shape[1] for j, c in enumerate(cache.kinds)):
        return [S]
    return sorted({S // d for d in SLOT_DIVISORS if S // d >= MIN_SLOTS} | {S})


@partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def empty_slots(cfg: ModelConfig, slots: int, length: int, quantize: bool, layout: sharding.Layout | None
                ) -> kvcache.KVCache:
    """An empty cache for `slots` sequences, its keys and values sharded by kv heads (and slots by `batch`)."""
    with sharding.within(layout):
        cache = kvcache.init(cfg, slots, length, quantize)
        kinds = tuple(kvcache.KindCache(*(None if a is None else sharding.constrain(a, (None,) + kvcache.CACHE_AXES[
            :a.ndim - 1]) for a in (c.k, c.v, c.k_scale, c.v_scale)), c.pos) for c in cache.kinds)
        return kvcache.KVCache(kinds, cache.length)


@partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5))
def empty_pages(cfg: ModelConfig, pages: int, page_size: int, quantize: bool, fmt: paged.PoolFormat,
                layout: sharding.Layout | None) -> paged.PagedCache:
    """An empty pool of pages of format fmt; keys and values [K, R, NP, page, H] sharded by kv heads."""
    with sharding.within(layout):
        cache = paged.init(cfg, pages, page_size, quantize, fmt)
        return paged.PagedCache(tuple({name: sharding.constrain(a, ("kv_heads", None, None, None, "head_dim"))
                                       if a.ndim == 5 else a for name, a in kind.items()} for kind in cache.kinds),
                                cache.kernel)


@partial(jax.jit, static_argnames=("cfg", "layout"))
def score(params, tokens_1T, adapter_1, cfg: ModelConfig, layout: sharding.Layout | None = None):
    """A prompt's log-probabilities by the uncached forward pass: each token's after the ones before it [T - 1], and
    the TOP_LOGPROBS most likely tokens at every position with theirs [T, K]."""
    with sharding.within(layout):
        lp_TV = jax.nn.log_softmax(forward(layers.with_rows(params, adapter_1), tokens_1T, cfg)[0], axis=-1)
    top_lp_TK, top_ids_TK = jax.lax.top_k(lp_TV, TOP_LOGPROBS)
    token_lp_T = jnp.take_along_axis(lp_TV[:-1], tokens_1T[0, 1:, None], axis=-1)[:, 0]
    return token_lp_T, top_ids_TK, top_lp_TK


def compiled_step_count() -> int:
    """How many decode programs this process has compiled (one per bucket, engine settings and model)."""
    return decode_loop._cache_size() + paged_decode_loop._cache_size() + speculative.decode_loop._cache_size()
