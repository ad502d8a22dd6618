"""Causal multi-head attention with grouped-query heads, rotary embeddings and QK normalization.

Shape legend: B batch, T query length, S key length, D model width, N query heads, K kv heads,
G query heads per kv head (N = K * G), H head width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlm.model import layers
from jaxlm.sharding import constrain


def project_qkv(x_BTD, p, cfg, positions_BT):
    q_BTNH = layers.dot("BTD,DNH->BTNH", x_BTD, p["q"])
    k_BTKH = layers.dot("BTD,DKH->BTKH", x_BTD, p["k"])
    v_BTKH = layers.dot("BTD,DKH->BTKH", x_BTD, p["v"])
    if "q_bias" in p:
        q_BTNH = q_BTNH + p["q_bias"].astype(q_BTNH.dtype)
        k_BTKH = k_BTKH + p["k_bias"].astype(k_BTKH.dtype)
        v_BTKH = v_BTKH + p["v_bias"].astype(v_BTKH.dtype)
    if cfg.qk_norm:
        q_BTNH = layers.norm(q_BTNH, p["q_norm"], cfg.norm, cfg.norm_eps)
        k_BTKH = layers.norm(k_BTKH, p["k_norm"], cfg.norm, cfg.norm_eps)
    if cfg.position == "rotary":
        q_BTNH = layers.rotary(q_BTNH, positions_BT, cfg.rope_theta)
        k_BTKH = layers.rotary(k_BTKH, positions_BT, cfg.rope_theta)
    return q_BTNH, k_BTKH, v_BTKH


def attend(q_BTNH, k_BSKH, v_BSKH, mask_BTS, dropout_rate=0.0, key=None):
    """softmax(q k^T / sqrt(H)) v with the softmax in float32; mask_BTS is True where attention is allowed."""
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    logits_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32)
    logits_BKGTS = logits_BKGTS * (H ** -0.5)
    logits_BKGTS = jnp.where(mask_BTS[:, None, None], logits_BKGTS, jnp.finfo(jnp.float32).min)
    probs_BKGTS = jax.nn.softmax(logits_BKGTS, axis=-1)
    probs_BKGTS = layers.dropout(probs_BKGTS, dropout_rate, key).astype(v_BSKH.dtype)
    out_BTKGH = jnp.einsum("BKGTS,BSKH->BTKGH", probs_BKGTS, v_BSKH, preferred_element_type=jnp.float32)
    return out_BTKGH.reshape(B, T, N, H).astype(q_BTNH.dtype)


def causal_mask(T: int) -> jax.Array:
    return jnp.tril(jnp.ones((T, T), dtype=bool))[None]


def attention(x_BTD, p, cfg, positions_BT, key=None):
    with jax.named_scope("attention"):
        q_BTNH, k_BTKH, v_BTKH = project_qkv(x_BTD, p, cfg, positions_BT)
        q_BTNH = constrain(q_BTNH, ("batch", "length", "heads", "head_dim"))
        out_BTNH = attend(q_BTNH, k_BTKH, v_BTKH, causal_mask(x_BTD.shape[1]), cfg.dropout, key)
        out_BTD = layers.dot("BTNH,NHD->BTD", out_BTNH, p["o"])
        if "o_bias" in p:
            out_BTD = out_BTD + p["o_bias"].astype(out_BTD.dtype)
        return out_BTD
