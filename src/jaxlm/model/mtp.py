"""Multi-token prediction (DeepSeek-V3; model.mtp_layers): the modules' hidden states and logits in training
(`mtp_hidden`, `mtp_logits`; their loss is model/loss.py's `mtp_loss_sum`), and a module run over its own paged
pool (`mtp_pool`, `mtp_weights`, `paged_mtp`), the draft of speculative decoding.

Shape legend: M modules, B batch, T length, D model width, V vocab, E experts, P rows of a call, C tokens per row.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxlm.config import ModelConfig
from jaxlm.model import layers, paged, quant
from jaxlm.model.decode import last_real, paged_layout
from jaxlm.model.transformer import (block, block_around, cast_matmul_weights, default_positions, embed, head,
                                     hidden_with_stats, param_specs)


def mtp_hidden(params: dict, x_BTD: jax.Array, tokens_BT: jax.Array, cfg: ModelConfig, positions_BT: jax.Array,
               segment_ids_BT: jax.Array | None = None):
    """DeepSeek-V3's multi-token prediction modules over the main model's last residual stream x_BTD: module m
    (from 0) at position t combines the previous depth's hidden state at t (the main model's after its final
    norm, for m = 0) with the embedding of token t + m + 1 (tokens_BT here are the *next* tokens, the
    targets), runs one block at positions t + m + 1 and normalizes; its logits predict token t + m + 2. Returns
    each module's normalized hidden states [M, B, T, D] and routing statistics [M, 3, E] (positions past the
    sequence see padding, which the loss masks)."""
    mtp = params["mtp"]
    norm = lambda x, q: layers.norm(x, q, cfg.norm, cfg.norm_eps, cfg.norm_plus_one)  # noqa: E731
    block_specs_ = param_specs(cfg)["mtp"]["block"]
    h_BTD = norm(x_BTD, params["final_norm"])
    hidden, stats = [], []
    for m in range(cfg.mtp_layers):
        p = jax.tree.map(lambda a: a[m], mtp)
        ahead_BT = jnp.pad(tokens_BT[:, m:], [(0, 0), (0, m)])
        pos_BT = positions_BT + m + 1
        e_BTD = embed(params, ahead_BT, cfg, pos_BT)
        with jax.named_scope("mtp"):
            cat_BT2D = jnp.concatenate([norm(e_BTD, p["embed_norm"]), norm(h_BTD, p["hidden_norm"])], axis=-1)
            h_BTD = layers.dot("BTE,ED->BTD", cat_BT2D, layers.matmul_weight(
                p["proj"], (None, "embed"), jnp.dtype(cfg.compute_dtype)))
            h_BTD, stats_3E = block(h_BTD, cast_matmul_weights(p["block"], cfg, block_specs_), cfg, pos_BT, None,
                                    "global", segment_ids_BT)
            h_BTD = norm(h_BTD, p["norm"])
        hidden.append(h_BTD)
        stats.append(stats_3E)
    return jnp.stack(hidden), jnp.stack(stats)


@quant.scoped
def mtp_logits(params: dict, tokens_BT: jax.Array, cfg: ModelConfig, positions_BT: jax.Array | None = None
               ) -> jax.Array:
    """The multi-token prediction modules' logits [M, B, T, V] for a batch of tokens: module m's at position t
    predict token t + m + 2, from tokens up to t + m + 1 (those past the end are padding)."""
    positions_BT = default_positions(tokens_BT, positions_BT)
    x_BTD, _ = hidden_with_stats(params, tokens_BT, cfg, None, positions_BT, None)
    next_BT = jnp.pad(tokens_BT[:, 1:], [(0, 0), (0, 1)])
    hidden_MBTD, _ = mtp_hidden(params, x_BTD, next_BT, cfg, positions_BT)
    return jnp.stack([head(params, h_BTD, cfg) for h_BTD in hidden_MBTD])


def mtp_pool(cfg: ModelConfig, pages: int, page_size: int, fmt: paged.PoolFormat = paged.PoolFormat()
             ) -> paged.PagedCache:
    """A paged pool (of format fmt) for the multi-token prediction modules' attention (paged_mtp): one global layer
    per module."""
    return paged.init(dataclasses.replace(cfg, n_layers=cfg.mtp_layers, layer_pattern="global"), pages, page_size,
                      fmt=fmt)


@quant.scoped
def mtp_weights(params: dict, cfg: ModelConfig, m: int = 0) -> dict:
    """Multi-token prediction module m's weights, its block's dense matmul weights in the compute dtype: taken
    apart once before a decode loop, as decode.layer_weights takes the layers'."""
    p = jax.tree.map(lambda a: a[m], params["mtp"])
    cdt = jnp.dtype(cfg.compute_dtype)
    return {**p, "proj": layers.matmul_weight(p["proj"], (None, "embed"), cdt),
            "block": cast_matmul_weights(p["block"], cfg, param_specs(cfg)["mtp"]["block"])}


@quant.scoped
def paged_mtp(params: dict, module_params: dict, cache: paged.PagedCache, tokens_PC: jax.Array,
              prev_PCD: jax.Array, start_P: jax.Array, length_P: jax.Array, table_PM: jax.Array, cfg: ModelConfig,
              m: int = 0) -> tuple[jax.Array, jax.Array, paged.PagedCache]:
    """Multi-token prediction module m (module_params: mtp_weights(params, cfg, m)) over its own paged pool
    (mtp_pool), as mtp_hidden runs it in training, at positions t from start_P[p] (real below length_P[p], as in
    decode.paged_forward): the previous depth's normalized hidden state at t (prev_PCD: the main model's, from
    decode.paged_forward's `hidden`) with the embedding of the token after it (tokens_PC: the next tokens, as
    mtp_hidden takes them) through one block whose keys and values go to pool layer m at index t through the
    row's page table. Training runs the block at t + m + 1 over a sequence that starts there; indices and rotary
    positions from t give the same attention (rotary attention depends on the difference of positions, and
    the sequence's start needs no masked entry before it). Returns the logits after each row's last real
    position [P, V] (they predict the token at t + m + 2: the draft of speculative decoding), the module's
    normalized hidden state there [P, D] (the previous depth of the next draft), and the pool."""
    end_P, q_pos_PC, page_PC, off_PC, flat = paged_layout(cache, tokens_PC, start_P, length_P, table_PM)
    p = module_params
    norm = lambda x, q: layers.norm(x, q, cfg.norm, cfg.norm_eps, cfg.norm_plus_one)  # noqa: E731
    cdt = jnp.dtype(cfg.compute_dtype)
    with jax.named_scope("mtp"):
        e_PCD = embed(params, tokens_PC, cfg, q_pos_PC)
        cat_PC2D = jnp.concatenate([norm(e_PCD, p["embed_norm"]), norm(prev_PCD.astype(cdt), p["hidden_norm"])],
                                   axis=-1)
        x_PCD = layers.dot("BTE,ED->BTD", cat_PC2D, p["proj"])
        arrays = cache.kinds[0]

        def attn(h_PCD, p_attn):
            return paged.attention(h_PCD, p_attn, cfg, arrays, m, q_pos_PC, page_PC, off_PC, table_PM, end_P,
                                   "global", flat, cache.kernel)

        x_PCD, _, arrays = block_around(x_PCD, p["block"], cfg, attn)
        h_P1D = norm(last_real(x_PCD, start_P, end_P), p["norm"])
        logits_PV = head(params, h_P1D, cfg)[:, 0]
    return logits_PV, h_P1D[:, 0], paged.PagedCache((arrays,), cache.kernel)
