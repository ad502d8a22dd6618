"""The draft's prefill in the server's engine (`jaxlm serve MODEL decode.draft=PATH`): the draft model's cache
entries of prompts' chunks, or, when the model's multi-token prediction module drafts, the model's pass over the
chunks with the module's entries beside it. The decode loop itself is infer/speculative.py's decode_loop, the one
that `jaxlm generate` runs too (docs/serve.md, "Speculative decoding").

Shape legend: B slots, P prompts' chunks, C a chunk's positions, D width, M pages per row.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jaxlm import sharding
from jaxlm.config import ModelConfig
from jaxlm.model import decode, layers
from jaxlm.model.mtp import paged_mtp


@partial(jax.jit, static_argnames=("cfg", "layout"), donate_argnames=("cache", "draft_cache", "logits_BV", "mtp"))
def prefill_mtp(params, layer_params, mtp_weights, cache, draft_cache, logits_BV, mtp, tokens_PC, next_PC, start_P,
                length_P, table_PM, slot_P, adapter_P, cfg: ModelConfig, layout: sharding.Layout | None = None):
    """programs.paged_prefill for a model whose first multi-token prediction module drafts: the model's pass
    over prompts' chunks (its logits and hidden state after each row's last real token into logits_BV and
    mtp["hidden_BD"] at the row's slot), then the module's entries of the chunk's positions that have a token
    after them in the prompt (next_PC: the chunk's tokens shifted by one; the prompt's last position waits for
    the first sampled token, in decode_loop). The module serves no adapter."""
    base = layers.with_rows(params, jnp.full_like(adapter_P, -1))
    params, layer_params = layers.with_rows((params, layer_params), adapter_P)
    with sharding.within(layout):
        logits_PV, h_PCD, cache = decode.paged_forward(params, cache, tokens_PC, start_P, length_P, table_PM,
                                                       cfg, layer_params, hidden=True)
        _, _, draft_cache = paged_mtp(base, mtp_weights, draft_cache, next_PC, h_PCD, start_P,
                                      jnp.maximum(length_P - 1, 0), table_PM, cfg)
    end_P = jnp.clip(length_P, start_P, start_P + tokens_PC.shape[1])
    last_PD = jnp.take_along_axis(h_PCD, jnp.maximum(end_P - 1 - start_P, 0)[:, None, None], axis=1)[:, 0]
    mtp = {**mtp, "hidden_BD": mtp["hidden_BD"].at[slot_P].set(last_PD.astype(mtp["hidden_BD"].dtype), mode="drop")}
    return cache, draft_cache, logits_BV.at[slot_P].set(logits_PV, mode="drop"), mtp


@partial(jax.jit, static_argnames=("cfg", "layout"), donate_argnames="cache")
def prefill(params, layer_params, cache, tokens_PC, start_P, length_P, table_PM, cfg: ModelConfig,
            layout: sharding.Layout | None = None):
    """The draft's cache entries of prompts' chunks (programs.paged_prefill's, without the logits; its layers
    unrolled over `layer_params` when given)."""
    with sharding.within(layout):
        return decode.paged_forward(params, cache, tokens_PC, start_P, length_P, table_PM, cfg, layer_params)[1]
