"""Chunked prefill for the engine: the next chunks of several prompts run through the model (decode.prefill_chunks:
a chunk starts at any position of a slot that already holds the earlier ones, or a prefix the prefix cache copied
there), in one call, into their slots of the engine's KV cache, and the logits after each chunk into the slots'
rows of the engine's logits. The engine pads the chunks to one of a few lengths C (cache.bucket) and the rows of a
call to a power of two P, padding rows taking slot B (past the last), which writes nothing: the program compiles
once per (P, C). When every chunk of a call starts its prompt (`fresh`) the slots' earlier contents are neither
gathered nor attended to (kvcache.fresh_fits: C must fit every kind's slots, a ring buffer's included).

Shape legend: B slots, P rows of a call, C chunk length, V vocab.
"""

from __future__ import annotations

from functools import partial

import jax

from jaxlm import sharding
from jaxlm.config import ModelConfig
from jaxlm.model import decode, kvcache, layers


@partial(jax.jit, static_argnames=("cfg", "fresh", "layout"), donate_argnames=("cache", "logits_BV"))
def prefill_chunks(params, cache: kvcache.KVCache, logits_BV, tokens_PC, start_P, length_P, slot_P,
                   cfg: ModelConfig, fresh: bool = False, adapter_P=None, layout: sharding.Layout | None = None):
    """decode.prefill_chunks, with each row's logits written into logits_BV at its slot (none for a padding
    row's slot B) and each row run with its LoRA adapter adapter_P when given (layers.with_rows; -1 the base),
    traced in the engine's mesh and rules (`layout`); returns the cache and logits_BV, both donated."""
    if adapter_P is not None:
        params = layers.with_rows(params, adapter_P)
    with sharding.within(layout):
        cache, logits_PV = decode.prefill_chunks(params, cache, tokens_PC, start_P, length_P, slot_P, cfg,
                                                 fresh)
    return cache, logits_BV.at[slot_P].set(logits_PV, mode="drop")
