"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): keys and values come from one low-rank latent per token,
so the KV cache stores that latent and a small rotary key instead of every head's keys and values. The query is
q_b(norm(q_a x)) (or q x, model.q_lora_rank=0); the latent c = norm(kv_a x) gives each head's key part k_b c and
value v_b c, and one rotary key k_rope x is shared by the heads. Training and prefill expand the latent and run
the ordinary attention; a decode step absorbs k_b into the query and v_b into the output, reading the cached
latents as they lie, in an ordinary cache entry of one kv head: `k` the rotary key, `v` the latent
(docs/families.md, "Multi-head latent attention").

Shape legend: B batch, T length, S cache slots, D width, N heads, Q query latent (q_lora_rank), C key/value
latent (kv_lora_rank), h rotary-free head width, r rotary width, v value head width, A = h + r.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxlm.model import attention, layers
from jaxlm.params import ParamSpec, normal, ones, zeros
from jaxlm.sharding import constrain

# The query and key/value latents are split over the devices that split the width (FSDP): a model with
# thousands of these [latent, heads, head] matrices cannot keep a whole copy on every device.
Q_LORA, KV_LORA = "q_lora", "kv_lora"
NORM_EPS = 1e-6  # the latents' RMSNorms (Hugging Face DeepseekV3RMSNorm's default, not config.rms_norm_eps)


def specs(cfg, L: int) -> dict:
    D, N, dt = cfg.d_model, cfg.n_heads, cfg.param_dtype
    Q, C, h, r, v = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    w, w_out = normal(cfg.init_std), normal(cfg.init_std / (2 * cfg.n_layers) ** 0.5)
    norm = (lambda n, axis: {"scale": ParamSpec((L, n), ("layers", axis), zeros if cfg.norm_plus_one else ones, dt)})
    p = {"kv_a": ParamSpec((L, D, C), ("layers", "embed", None), w, dt),
         "kv_a_norm": norm(C, None),
         "k_rope": ParamSpec((L, D, r), ("layers", "embed", "head_dim"), w, dt),
         "k_b": ParamSpec((L, C, N, h), ("layers", KV_LORA, "heads", "head_dim"), w, dt),
         "v_b": ParamSpec((L, C, N, v), ("layers", KV_LORA, "heads", "head_dim"), w, dt),
         "o": ParamSpec((L, N, v, D), ("layers", "heads", "head_dim", "embed"), w_out, dt)}
    if Q:
        p.update(q_a=ParamSpec((L, D, Q), ("layers", "embed", None), w, dt), q_a_norm=norm(Q, None),
                 q_b=ParamSpec((L, Q, N, h + r), ("layers", Q_LORA, "heads", "head_dim"), w, dt))
    else:
        p["q"] = ParamSpec((L, D, N, h + r), ("layers", "embed", "heads", "head_dim"), w, dt)
    if cfg.attn_sinks:
        p["sinks"] = ParamSpec((L, N), ("layers", "heads"), zeros, "float32")
    return p


def _norm(x, p, cfg):
    return layers.rms_norm(x, p["scale"], NORM_EPS, cfg.norm_plus_one)


def project(x_BTD, p, cfg, positions_BT, kind="global"):
    """Queries [B, T, N, A] (rotary part rotated, last), the latents c [B, T, C] and the rotary keys
    [B, T, r] (rotated)."""
    if "q_a" in p:
        q_BTNA = layers.dot("BTQ,QNA->BTNA", _norm(layers.dot("BTD,DQ->BTQ", x_BTD, p["q_a"]), p["q_a_norm"], cfg),
                            p["q_b"])
    else:
        q_BTNA = layers.dot("BTD,DNA->BTNA", x_BTD, p["q"])
    q_BTNA = checkpoint_name(q_BTNA, "query_proj")
    c_BTC = checkpoint_name(_norm(layers.dot("BTD,DC->BTC", x_BTD, p["kv_a"]), p["kv_a_norm"], cfg), "key_proj")
    kr_BT1r = layers.dot("BTD,Dr->BTr", x_BTD, p["k_rope"])[:, :, None]
    h = cfg.qk_nope_head_dim
    qr_BTNr, kr_BT1r = attention.position_qk(q_BTNA[..., h:], kr_BT1r, cfg, positions_BT, kind)
    return jnp.concatenate([q_BTNA[..., :h], qr_BTNr], axis=-1), c_BTC, kr_BT1r[:, :, 0]


def _expanded(x_BTD, p, cfg, positions_BT, kind):
    """Every head's queries and keys [B, T, N, A] and values [B, T, N, A] (padded from v_head_dim to the key
    width when narrower), with the latents [B, T, C] and rotary keys [B, T, r] they came from."""
    q_BTNA, c_BTC, kr_BTr = project(x_BTD, p, cfg, positions_BT, kind)
    q_BTNA = constrain(q_BTNA, ("batch", "length", "heads", "head_dim"))
    k_BTNh = layers.dot("BTC,CNh->BTNh", c_BTC, p["k_b"])
    v_BTNv = checkpoint_name(layers.dot("BTC,CNv->BTNv", c_BTC, p["v_b"]), "value_proj")
    N, A, Hv = q_BTNA.shape[2], q_BTNA.shape[3], v_BTNv.shape[3]
    kr_BTNr = jnp.broadcast_to(kr_BTr[:, :, None], (*kr_BTr.shape[:2], N, kr_BTr.shape[-1]))
    k_BTNA = jnp.concatenate([k_BTNh, kr_BTNr.astype(k_BTNh.dtype)], axis=-1)
    if Hv < A:  # the kernels take values as wide as keys
        v_BTNv = jnp.pad(v_BTNv, [(0, 0)] * 3 + [(0, A - Hv)])
    return q_BTNA, k_BTNA, v_BTNv, c_BTC, kr_BTr


def attention_with_kv(x_BTD, p, cfg, positions_BT, key=None, kind="global", segment_ids_BT=None):
    """Self-attention of a latent-attention layer, and what the cache keeps of each token: the rotary keys
    [B, T, 1, r] and the latents [B, T, 1, C]."""
    with jax.named_scope("latent_attention"):
        q_BTNA, k_BTNA, v_BTNA, c_BTC, kr_BTr = _expanded(x_BTD, p, cfg, positions_BT, kind)
        out_BTNv = attention.self_attention(q_BTNA, k_BTNA, v_BTNA, positions_BT, segment_ids_BT, cfg, kind, key,
                                            p.get("sinks"))[..., :cfg.v_head_dim]
        out_BTNv = checkpoint_name(out_BTNv, "context")
        out_BTD = checkpoint_name(attention.project_out(out_BTNv, p), "out_proj")
        return out_BTD, kr_BTr[:, :, None], c_BTC[:, :, None]


def attention_with_logit_max(x_BTD, p, cfg, positions_BT, kind="global", segment_ids_BT=None):
    """attention.attention_with_logit_max of a latent-attention layer: output and each head's largest logit [N]."""
    with jax.named_scope("latent_attention"):
        q_BTNA, k_BTNA, v_BTNA, _, _ = _expanded(x_BTD, p, cfg, positions_BT, kind)
        out_BTNv = attention.self_attention(q_BTNA, k_BTNA, v_BTNA, positions_BT, segment_ids_BT, cfg, kind, None,
                                            p.get("sinks"))[..., :cfg.v_head_dim]
        top_N = attention.kind_logit_max(q_BTNA, k_BTNA, positions_BT, segment_ids_BT, cfg, kind)
        return attention.project_out(out_BTNv, p), top_N


def clip_qk(p_attn: dict, logit_max_LN: jax.Array, threshold: float, cfg) -> dict:
    """QK-clip of latent attention (MuonClip, Kimi K2): a head's score is q_nope . k_nope + q_rope . k_rope, so
    for gamma = threshold / max its rotary-free query columns (of q_b, or q) and its key projection k_b take
    sqrt(gamma) each, its rotary query columns gamma, and the rotary key, shared by every head, stays."""
    gamma_LN = attention.qk_clip_factors(logit_max_LN, threshold)
    h, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    root_LN = jnp.sqrt(gamma_LN)
    name = "q_b" if "q_b" in p_attn else "q"
    s_LNA = jnp.concatenate([jnp.repeat(root_LN[..., None], h, -1), jnp.repeat(gamma_LN[..., None], r, -1)], -1)
    return {**p_attn, name: (p_attn[name] * s_LNA[:, None]).astype(p_attn[name].dtype),
            "k_b": (p_attn["k_b"] * root_LN[:, None, :, None]).astype(p_attn["k_b"].dtype)}


def project_entries(x_BTD, p, cfg, positions_BT, kind="global"):
    """Queries [B, T, N, A] and what the cache keeps of each token: rotary keys [B, T, 1, r], latents
    [B, T, 1, C] (attention.project_entries of a latent layer)."""
    q_BTNA, c_BTC, kr_BTr = project(x_BTD, p, cfg, positions_BT, kind)
    return q_BTNA, (kr_BTr[:, :, None], c_BTC[:, :, None])


def attend_entries(q_BTNA, kr_B1Sr, c_B1SC, mask_BTS, p, cfg):
    """Queries over cached entries (rotary keys [B, 1, S, r], latents [B, 1, S, C]) with k_b and v_b
    absorbed: scores (q_nope k_b^T) . c + q_rope . k_rope, output v_b (probs . c); projected [B, T, D]."""
    h = cfg.qk_nope_head_dim
    c_BSC, kr_BSr = c_B1SC[:, 0].astype(q_BTNA.dtype), kr_B1Sr[:, 0].astype(q_BTNA.dtype)
    q_lat_BTNC = layers.dot("BTNh,CNh->BTNC", q_BTNA[..., :h], p["k_b"])
    logits_BTNS = (jnp.einsum("BTNC,BSC->BTNS", q_lat_BTNC, c_BSC, preferred_element_type=jnp.float32)
                   + jnp.einsum("BTNr,BSr->BTNS", q_BTNA[..., h:], kr_BSr, preferred_element_type=jnp.float32))
    logits_BTNS = layers.softcap(logits_BTNS * attention.scale(cfg), cfg.attn_logit_softcap)
    logits_BTNS = jnp.where(mask_BTS[:, :, None], logits_BTNS, jnp.finfo(jnp.float32).min)
    sinks = p.get("sinks")
    probs_BTNS = attention.softmax(logits_BTNS, None if sinks is None else sinks.astype(jnp.float32))
    ctx_BTNC = jnp.einsum("BTNS,BSC->BTNC", probs_BTNS.astype(c_BSC.dtype), c_BSC,
                          preferred_element_type=jnp.float32).astype(q_BTNA.dtype)
    return attention.project_out(layers.dot("BTNC,CNv->BTNv", ctx_BTNC, p["v_b"]), p)


def absorb_query(q_BTNA, p, cfg):
    """Queries with k_b absorbed [B, T, N, C + r]: (q_nope k_b^T, q_rope), whose product with a cached token's
    absorbed_keys is its score (before the scale), as attend_entries computes it. A paged decode step (model/
    paged.py) runs latent attention as one kv head this way, its values the latents (absorbed_output)."""
    h = cfg.qk_nope_head_dim
    q_lat_BTNC = layers.dot("BTNh,CNh->BTNC", q_BTNA[..., :h], p["k_b"])
    return jnp.concatenate([q_lat_BTNC, q_BTNA[..., h:].astype(q_lat_BTNC.dtype)], axis=-1)


def absorbed_keys(kr_BKSr, c_BKSC):
    """The keys absorb_query's queries meet: latent and rotary key side by side [..., C + r]."""
    return jnp.concatenate([c_BKSC, kr_BKSr.astype(c_BKSC.dtype)], axis=-1)


def absorbed_output(ctx_BTNC, p):
    """The layer's output [B, T, D] from the attention-weighted latents of each head [B, T, N, C]."""
    return attention.project_out(layers.dot("BTNC,CNv->BTNv", ctx_BTNC, p["v_b"]), p)


def attention_decode(x_B1D, p, cfg, positions_B1, cache: dict, r, slot_B, k_positions_BS, kind="global"):
    """`attention.attention_decode` of a latent layer: its stacked cache entry holds the rotary keys in k
    [R, B, 1, S, r] and the latents in v [R, B, 1, S, C]."""
    with jax.named_scope("latent_attention"):
        q_B1NA, entries = project_entries(x_B1D, p, cfg, positions_B1, kind)
        new, kr_B1Sr, c_B1SC = attention.store_stacked(cache, entries, r, slot_B, q_B1NA.dtype)
        mask_B1S = attention.kind_mask(cfg, kind, positions_B1, k_positions_BS)
        return attend_entries(q_B1NA, kr_B1Sr, c_B1SC, mask_B1S, p, cfg), new


def attention_decode_layer(x_B1D, p, cfg, positions_B1, layer: dict, slot_B, k_positions_BS, kind="global"):
    """`attention.attention_decode_layer` of a latent layer (rotary keys transposed [B, 1, r, S])."""
    with jax.named_scope("latent_attention"):
        q_B1NA, entries = project_entries(x_B1D, p, cfg, positions_B1, kind)
        new, krT_B1rS, c_B1SC = attention.store_layer(layer, entries, slot_B, q_B1NA.dtype)
        mask_B1S = attention.kind_mask(cfg, kind, positions_B1, k_positions_BS)
        return attend_entries(q_B1NA, krT_B1rS.swapaxes(2, 3), c_B1SC, mask_B1S, p, cfg), new


def attention_chunk(h_PCD, p, cfg, q_pos_PC, k_pos_PX, rows: dict | None, take_PS, src_PS, kind: str,
                    quantized: bool):
    """`attention.attention_chunk` of a latent layer (its rows' k the rotary keys, v the latents)."""
    with jax.named_scope("latent_attention"):
        q_PCNA, entries = project_entries(h_PCD, p, cfg, q_pos_PC, kind)
        kr_P1Xr, c_P1XC, new = attention.chunk_entries(entries, rows, take_PS, src_PS, quantized, q_PCNA.dtype)
        mask_PCX = attention.kind_mask(cfg, kind, q_pos_PC, k_pos_PX)
        return attend_entries(q_PCNA, kr_P1Xr, c_P1XC, mask_PCX, p, cfg), new
