"""Causal multi-head attention with grouped-query heads, rotary embeddings, QK normalization, sliding
windows and logit soft-capping; one-token decoding over a KV cache. `self_attention` is the one interface of
the uncached pass and picks the implementation (`model.attention`): dot_product here, blockwise
(model/blockwise.py), splash (model/splash.py, TPU) or cuDNN's flash kernel (GPU); a mesh that splits the
sequence runs context parallelism instead (model/ring.py, `model.context_parallel`).

Shape legend: B batch, T query length, S key length (cache slots when decoding), D model width, N query
heads, K kv heads, G query heads per kv head (N = K * G), H head width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxlm import sharding
from jaxlm.model import blockwise, kvcache, layers, ring, splash
from jaxlm.sharding import constrain

# On CPUs the [T, T] scores are cheaper to materialize than to tile below this many tokens.
CPU_BLOCKWISE_FROM = 2048


def project_qkv(x_BTD, p, cfg, positions_BT):
    q_BTNH = layers.dot("BTD,DNH->BTNH", x_BTD, p["q"])
    k_BTKH = layers.dot("BTD,DKH->BTKH", x_BTD, p["k"])
    v_BTKH = layers.dot("BTD,DKH->BTKH", x_BTD, p["v"])
    if "q_bias" in p:
        q_BTNH = q_BTNH + p["q_bias"].astype(q_BTNH.dtype)
        k_BTKH = k_BTKH + p["k_bias"].astype(k_BTKH.dtype)
        v_BTKH = v_BTKH + p["v_bias"].astype(v_BTKH.dtype)
    # Names for remat policies (model.remat=save_qkv_proj, offload_qkv_proj): the projections' outputs.
    q_BTNH = checkpoint_name(q_BTNH, "query_proj")
    k_BTKH = checkpoint_name(k_BTKH, "key_proj")
    v_BTKH = checkpoint_name(v_BTKH, "value_proj")
    if cfg.qk_norm:
        q_BTNH = layers.norm(q_BTNH, p["q_norm"], cfg.norm, cfg.norm_eps, cfg.norm_plus_one)
        k_BTKH = layers.norm(k_BTKH, p["k_norm"], cfg.norm, cfg.norm_eps, cfg.norm_plus_one)
    if cfg.position == "rotary":
        scaling = None
        if cfg.rope_scaling == "llama3":
            scaling = (cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                       cfg.rope_original_context)
        q_BTNH = layers.rotary(q_BTNH, positions_BT, cfg.rope_theta, scaling)
        k_BTKH = layers.rotary(k_BTKH, positions_BT, cfg.rope_theta, scaling)
    return q_BTNH, k_BTKH, v_BTKH


def attend(q_BTNH, k_BSKH, v_BSKH, mask_BTS, dropout_rate=0.0, key=None, scale=None, softcap=None):
    """softmax(softcap(q k^T * scale)) v with the softmax in float32; mask_BTS is True where attention is
    allowed. `scale` defaults to 1/sqrt(H).

    Computed heads-major: with (B, K) as leading batch dims both products are plain batched matmuls, and
    the G query heads that share a kv head are folded into the query length (M = G * T)."""
    return attend_heads_major(q_BTNH, k_BSKH.transpose(0, 2, 1, 3), v_BSKH.transpose(0, 2, 1, 3), mask_BTS,
                              dropout_rate, key, scale, softcap)


def attend_heads_major(q_BTNH, k_BKSH, v_BKSH, mask_BTS, dropout_rate=0.0, key=None, scale=None, softcap=None):
    """`attend` with keys and values already heads-major [B, K, S, H] (the KV cache's layout)."""
    B, T, N, H = q_BTNH.shape
    K = k_BKSH.shape[1]
    G = N // K
    q_BKMH = q_BTNH.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, H)
    logits_BKMS = jnp.einsum("BKMH,BKSH->BKMS", q_BKMH, k_BKSH, preferred_element_type=jnp.float32)
    logits_BKMS = logits_BKMS * (H ** -0.5 if scale is None else scale)
    logits_BKMS = layers.softcap(logits_BKMS, softcap)
    mask_BMS = jnp.tile(mask_BTS, (1, G, 1)) if G > 1 else mask_BTS
    logits_BKMS = jnp.where(mask_BMS[:, None], logits_BKMS, jnp.finfo(jnp.float32).min)
    probs_BKMS = jax.nn.softmax(logits_BKMS, axis=-1)
    probs_BKMS = layers.dropout(probs_BKMS, dropout_rate, key).astype(v_BKSH.dtype)
    out_BKMH = jnp.einsum("BKMS,BKSH->BKMH", probs_BKMS, v_BKSH, preferred_element_type=jnp.float32)
    out_BTNH = out_BKMH.reshape(B, K, G, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)
    return out_BTNH.astype(q_BTNH.dtype)


def mask(q_positions_BT: jax.Array, k_positions_BS: jax.Array, window: int | None = None,
         q_segment_ids_BT: jax.Array | None = None, k_segment_ids_BS: jax.Array | None = None) -> jax.Array:
    """[B, T, S], True where query t may attend to key s: causal, within the last `window` positions (the
    query's own included) when a window is given, and in the same segment (packed document) when segment ids
    are given. A function of positions and segment ids, not of array offsets, so a decoder attending from new
    tokens into a cache of old ones uses the same rule, and positions may restart at each packed document."""
    q_BT1, k_B1S = q_positions_BT[:, :, None], k_positions_BS[:, None, :]
    allowed_BTS = k_B1S <= q_BT1
    if window is not None:
        allowed_BTS &= k_B1S > q_BT1 - window
    if q_segment_ids_BT is not None:
        allowed_BTS &= q_segment_ids_BT[:, :, None] == k_segment_ids_BS[:, None, :]
    return allowed_BTS


def self_attention(q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, cfg, local=False, key=None):
    """The one attention interface of the uncached pass: queries [B, T, N, H], keys and values [B, T, K, H]
    of the same tokens, their positions [B, T] and segment ids [B, T] (int32; tokens attend only within their
    own segment; None = one segment per row). Every implementation takes these arguments; masks are causal by
    position, windowed for `local` layers, and never cross a segment."""
    T = q_BTNH.shape[1]
    window = cfg.sliding_window if local else None
    if (n := ring.context_devices()) > 1 and T % n == 0:  # the sequence is split: context parallelism
        if key is not None:  # train.setup refuses this for runs; a direct caller gets told too
            raise ValueError("attention dropout (model.dropout > 0) is not supported with context parallelism")
        return ring.attention(q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, window, _scale(cfg),
                              cfg.attn_logit_softcap, cfg.attention_block, cfg.context_parallel)
    platform = mesh_platform()
    impl = choose(cfg, T, q_BTNH.dtype, segment_ids_BT is not None, platform, dropout=key is not None)
    if impl == "blockwise":
        return blockwise.attention(q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, window, _scale(cfg),
                                   cfg.attn_logit_softcap, cfg.attention_block)
    if impl == "splash":
        return splash.attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, window, _scale(cfg), cfg.attn_logit_softcap,
                                cfg.attention_block, interpret=platform != "tpu")
    if impl == "cudnn":
        return _cudnn(q_BTNH, k_BTKH, v_BTKH, window, _scale(cfg))
    mask_BTS = mask(positions_BT, positions_BT, window, segment_ids_BT, segment_ids_BT)
    return attend(q_BTNH, k_BTKH, v_BTKH, mask_BTS, cfg.dropout, key, _scale(cfg), cfg.attn_logit_softcap)


def mesh_platform() -> str:
    """The platform of the devices the step is traced for: the active mesh's (an ahead-of-time compile for
    TPU runs on a CPU host), else the default backend's."""
    ctx = sharding.active()
    return ctx[0].devices.flat[0].platform if ctx is not None else jax.devices()[0].platform


def _cudnn_supports(dtype, softcap, has_segments) -> bool:
    return jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and softcap is None and not has_segments


def choose(cfg, T: int, dtype, has_segments: bool, platform: str, dropout: bool = False) -> str:
    """The implementation `self_attention` runs for T tokens of this dtype on this platform. `auto` takes the
    fastest that covers the case; an explicit kernel that lacks the case (splash: T not a multiple of 128;
    cudnn: not a GPU, float32, soft-cap or segment ids) runs blockwise instead. Splash off TPU runs in Pallas
    interpret mode: exact but slow, for tests."""
    name = cfg.attention
    if name == "auto":
        if dropout:  # only dot_product drops attention probabilities
            return "dot_product"
        name = {"tpu": "splash", "gpu": "cudnn", "cuda": "cudnn", "rocm": "blockwise"}.get(
            platform, "blockwise" if T >= CPU_BLOCKWISE_FROM else "dot_product")
    if name == "splash" and not splash.supports(T):
        return "blockwise"
    if name == "cudnn" and (platform not in ("gpu", "cuda")
                            or not _cudnn_supports(dtype, cfg.attn_logit_softcap, has_segments)):
        return "blockwise"
    return name


def describe(cfg, platform: str, dtype=None, mesh=None, rules=None) -> str:
    """One line for the logs: what uncached attention runs at the configured length; given the mesh and
    activation rules of the run, context parallelism when they split the sequence (as `self_attention`)."""
    T = cfg.block_size
    if mesh is not None and (n := ring.context_devices(mesh, rules)) > 1 and T % n == 0:
        return (f"attention {cfg.context_parallel} context parallelism over {n} devices (model.context_parallel="
                f"{cfg.context_parallel}: {T // n} of {T} tokens per device, blockwise tiles of "
                f"{min(cfg.attention_block, T // n if cfg.context_parallel == 'ring' else T)})")
    dtype = jnp.dtype(cfg.compute_dtype) if dtype is None else dtype
    impl = choose(cfg, T, dtype, False, platform)
    return (f"attention {impl} (model.attention={cfg.attention} on {platform} at {T} tokens"
            + (f", tiles of {cfg.attention_block}" if impl in ("blockwise", "splash") else "") + ")")


def _cudnn(q_BTNH, k_BTKH, v_BTKH, window, scale):
    """cuDNN's fused flash attention (GPU; bf16/fp16). Its causal and window masks go by index in the row, which
    is the position rule when positions count 0..T-1, as they do without segment ids."""
    with jax.named_scope("cudnn_attention"):
        return jax.nn.dot_product_attention(q_BTNH, k_BTKH, v_BTKH, scale=scale, is_causal=True,
                                            local_window_size=None if window is None else (window - 1, 0),
                                            implementation="cudnn")


def _scale(cfg):
    return None if cfg.attn_scale is None else cfg.attn_scale ** -0.5


def _project_out(out_BTNH, p):
    out_BTD = layers.dot("BTNH,NHD->BTD", out_BTNH, p["o"])
    if "o_bias" in p:
        out_BTD = out_BTD + p["o_bias"].astype(out_BTD.dtype)
    return out_BTD


def attention_with_kv(x_BTD, p, cfg, positions_BT, key=None, local=False, segment_ids_BT=None):
    """Self-attention over x; `local` layers see only the last cfg.sliding_window positions, and tokens see
    only their own segment. Also returns the keys and values [B, T, K, H], which prefill stores in the cache."""
    with jax.named_scope("attention"):
        q_BTNH, k_BTKH, v_BTKH = project_qkv(x_BTD, p, cfg, positions_BT)
        q_BTNH = constrain(q_BTNH, ("batch", "length", "heads", "head_dim"))
        out_BTNH = self_attention(q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, cfg, local, key)
        out_BTNH = checkpoint_name(out_BTNH, "context")
        return checkpoint_name(_project_out(out_BTNH, p), "out_proj"), k_BTKH, v_BTKH


def attention_with_logit_max(x_BTD, p, cfg, positions_BT, local=False, segment_ids_BT=None):
    """Self-attention over x (no dropout), and the largest attention logit of each query head over the batch [N]:
    what MuonClip's QK-clip watches (`logit_max`)."""
    with jax.named_scope("attention"):
        q_BTNH, k_BTKH, v_BTKH = project_qkv(x_BTD, p, cfg, positions_BT)
        out_BTNH = self_attention(q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, cfg, local)
        window = cfg.sliding_window if local else None
        top_N = logit_max(q_BTNH, k_BTKH, positions_BT, segment_ids_BT, window, _scale(cfg), cfg.attention_block)
        return _project_out(out_BTNH, p), top_N


def logit_max(q_BTNH, k_BTKH, positions_BT, segment_ids_BT=None, window=None, scale=None, chunk=512) -> jax.Array:
    """The largest logit q.k * scale (before any soft-cap) of each query head over every pair the mask allows
    [N], in float32, `chunk` queries at a time, so the [B, N, T, T] logits never exist at once."""
    B, T, N, H = q_BTNH.shape
    K = k_BTKH.shape[2]
    scale = H ** -0.5 if scale is None else scale
    C = min(chunk, T)
    pad = -T % C
    seg_BT = jnp.zeros((B, T), jnp.int32) if segment_ids_BT is None else segment_ids_BT
    # Padded queries get position -1, which no key precedes: they see nothing.
    q_nBCKGH = jnp.pad(q_BTNH, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(B, (T + pad) // C, C, K, N // K, H)
    pos_nBC = jnp.pad(positions_BT, ((0, 0), (0, pad)), constant_values=-1).reshape(B, -1, C).swapaxes(0, 1)
    seg_nBC = jnp.pad(seg_BT, ((0, 0), (0, pad))).reshape(B, -1, C).swapaxes(0, 1)

    def one(inputs):
        q_BCKGH, pos_BC, seg_BC = inputs
        logits_BKGCS = jnp.einsum("BCKGH,BSKH->BKGCS", q_BCKGH, k_BTKH, preferred_element_type=jnp.float32) * scale
        allowed_BCS = mask(pos_BC, positions_BT, window, seg_BC, seg_BT)
        logits_BKGCS = jnp.where(allowed_BCS[:, None, None], logits_BKGCS, -jnp.inf)
        return jnp.max(logits_BKGCS, axis=(0, 3, 4)).reshape(N)

    return jnp.max(jax.lax.map(one, (q_nBCKGH.swapaxes(0, 1), pos_nBC, seg_nBC)), axis=0)


def clip_qk(p_attn: dict, logit_max_LN: jax.Array, threshold: float, cfg) -> dict:
    """QK-clip (MuonClip, Kimi K2): the stacked attention weights [L, ...] with each head whose largest logit
    exceeded `threshold` scaled so that, on the same inputs, it would have been `threshold`: gamma = threshold /
    max. The query and key projections take sqrt(gamma) each when every query head has its own key head; with
    grouped-query heads the shared keys stay and the query head takes gamma. With QK-norm the projections' scale
    cancels, so the layer's query and key norm scales, shared by its heads, take sqrt(gamma) of its worst head.
    Biases of the projections scale with them."""
    gamma_LN = jnp.where(logit_max_LN > threshold, threshold / logit_max_LN, 1.0)
    L, N = gamma_LN.shape
    K = cfg.kv_heads
    p = {**p_attn}
    if cfg.qk_norm:
        root_L = jnp.sqrt(jnp.min(gamma_LN, axis=1))
        for name in ("q_norm", "k_norm"):
            norm = {**p[name]}
            # The norm multiplies by `scale`, or by (1 + scale) with norm_plus_one (Gemma).
            shift = 1.0 if cfg.norm_plus_one else 0.0
            norm["scale"] = ((norm["scale"] + shift) * root_L[:, None] - shift).astype(norm["scale"].dtype)
            if "bias" in norm:
                norm["bias"] = (norm["bias"] * root_L[:, None]).astype(norm["bias"].dtype)
            p[name] = norm
        return p
    q_LN, k_LK = (jnp.sqrt(gamma_LN), jnp.sqrt(gamma_LN)) if K == N else (gamma_LN, jnp.ones((L, K)))
    for name, s_LX in (("q", q_LN), ("k", k_LK)):
        p[name] = (p[name] * s_LX[:, None, :, None]).astype(p[name].dtype)
        if f"{name}_bias" in p:
            p[f"{name}_bias"] = (p[f"{name}_bias"] * s_LX[:, :, None]).astype(p[f"{name}_bias"].dtype)
    return p


def attention(x_BTD, p, cfg, positions_BT, key=None, local=False, segment_ids_BT=None):
    """Self-attention over x; `local` layers see only the last cfg.sliding_window positions."""
    return attention_with_kv(x_BTD, p, cfg, positions_BT, key, local, segment_ids_BT)[0]


def attention_decode(x_B1D, p, cfg, positions_B1, cache: dict, r, slot_B, k_positions_BS, local=False):
    """Attention of one new token per sequence over the cache. `cache` holds the k, v [R, B, K, S, H] and
    k_scale, v_scale [R, B, K, S] (None unless int8) of every repeat of this layer's pattern entry; this layer
    is repeat `r`. The new key and value are written at [r, b, slot_B[b]] first, in place (the stacked arrays
    are a loop carry, so a step writes one entry per sequence instead of copying the cache), and
    k_positions_BS already names the positions every slot holds after that write, so the mask is the same
    function of positions as in the uncached pass. Returns the output and the updated stacked cache."""
    with jax.named_scope("attention"):
        q_B1NH, k_B1KH, v_B1KH = project_qkv(x_B1D, p, cfg, positions_B1)
        quantized = cache["k_scale"] is not None
        new = {}
        for name, x_B1KH in (("k", k_B1KH), ("v", v_B1KH)):
            x_BK1H, scale_BK1 = kvcache.store(x_B1KH.transpose(0, 2, 1, 3), quantized)
            new[name] = kvcache.write_one(cache[name], x_BK1H[:, :, 0], r, slot_B)
            new[f"{name}_scale"] = None if not quantized else kvcache.write_one(cache[f"{name}_scale"],
                                                                                scale_BK1[:, :, 0], r, slot_B)
        layer = {k: None if v is None else constrain(v[r], kvcache.CACHE_AXES[:v.ndim - 1])
                 for k, v in new.items()}
        k_BKSH = kvcache.read(layer["k"], layer["k_scale"], q_B1NH.dtype)
        v_BKSH = kvcache.read(layer["v"], layer["v_scale"], q_B1NH.dtype)
        mask_B1S = mask(positions_B1, k_positions_BS, cfg.sliding_window if local else None)
        out_B1NH = attend_heads_major(q_B1NH, k_BKSH, v_BKSH, mask_B1S, scale=_scale(cfg),
                                      softcap=cfg.attn_logit_softcap)
        return _project_out(out_B1NH, p), new


def attention_decode_layer(x_B1D, p, cfg, positions_B1, layer: dict, slot_B, k_positions_BS, local=False):
    """`attention_decode` over one layer's own cache (kvcache.LayerCaches: keys transposed [B, K, H, S]): the
    new key and value are written at slot_B first, in place, then the token attends over every slot. Returns
    the output and the layer's updated cache."""
    with jax.named_scope("attention"):
        q_B1NH, k_B1KH, v_B1KH = project_qkv(x_B1D, p, cfg, positions_B1)
        quantized = layer["k_scale"] is not None
        new = {}
        for name, x_B1KH, axis in (("k", k_B1KH, 3), ("v", v_B1KH, 2)):
            x_BK1H, scale_BK1 = kvcache.store(x_B1KH.transpose(0, 2, 1, 3), quantized)
            new[name] = kvcache.write_layer(layer[name], x_BK1H[:, :, 0], slot_B, axis)
            new[f"{name}_scale"] = None if not quantized else kvcache.write_layer(layer[f"{name}_scale"],
                                                                                  scale_BK1[:, :, 0], slot_B, 2)
        kT_BKHS = new["k"] if not quantized else (
            new["k"].astype(jnp.float32) * new["k_scale"][:, :, None]).astype(q_B1NH.dtype)
        v_BKSH = kvcache.read(new["v"], new["v_scale"], q_B1NH.dtype)
        mask_B1S = mask(positions_B1, k_positions_BS, cfg.sliding_window if local else None)
        out_B1NH = attend_one(q_B1NH, kT_BKHS, v_BKSH, mask_B1S, scale=_scale(cfg), softcap=cfg.attn_logit_softcap)
        return _project_out(out_B1NH, p), new


def attend_one(q_B1NH, kT_BKHS, v_BKSH, mask_B1S, scale=None, softcap=None):
    """`attend` of one query per sequence over keys transposed [B, K, H, S] and values [B, K, S, H]: the G
    query heads of a kv head are the rows of both products, which need no transposed copy of the keys."""
    B, _, N, H = q_B1NH.shape
    K = kT_BKHS.shape[1]
    q_BKGH = q_B1NH.reshape(B, K, N // K, H)
    logits_BKGS = jnp.einsum("BKGH,BKHS->BKGS", q_BKGH, kT_BKHS, preferred_element_type=jnp.float32)
    logits_BKGS = layers.softcap(logits_BKGS * (H ** -0.5 if scale is None else scale), softcap)
    logits_BKGS = jnp.where(mask_B1S[:, None], logits_BKGS, jnp.finfo(jnp.float32).min)
    probs_BKGS = jax.nn.softmax(logits_BKGS, axis=-1).astype(v_BKSH.dtype)
    out_BKGH = jnp.einsum("BKGS,BKSH->BKGH", probs_BKGS, v_BKSH, preferred_element_type=jnp.float32)
    return out_BKGH.reshape(B, 1, N, H).astype(q_B1NH.dtype)
