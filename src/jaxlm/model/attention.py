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

from jaxlm import runtime, sharding
from jaxlm.config import ConfigError
from jaxlm.model import blockwise, kvcache, layers, quant, ring, splash
from jaxlm.params import ParamSpec, normal, zeros
from jaxlm.sharding import constrain

# On CPUs the [T, T] scores are cheaper to materialize than to tile below this many tokens.
CPU_BLOCKWISE_FROM = 2048


def specs(cfg, L: int) -> dict:
    """The attention weights of L stacked layers: q, k, v [L, D, heads, H], o [L, N, H, D], and the biases,
    norms and sinks the options ask for (latent attention declares its own, model/latent.py)."""
    D, N, K, H, dt = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.hd, cfg.param_dtype
    w, w_out = normal(cfg.init_std), normal(cfg.init_std / (2 * cfg.n_layers) ** 0.5)
    p = {"q": ParamSpec((L, D, N, H), ("layers", "embed", "heads", "head_dim"), w, dt),
         "k": ParamSpec((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"), w, dt),
         "v": ParamSpec((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"), w, dt),
         "o": ParamSpec((L, N, H, D), ("layers", "heads", "head_dim", "embed"), w_out, dt)}
    if cfg.bias or cfg.qkv_bias:
        p["q_bias"] = ParamSpec((L, N, H), ("layers", "heads", "head_dim"), zeros, dt)
        p["k_bias"] = ParamSpec((L, K, H), ("layers", "kv_heads", "head_dim"), zeros, dt)
        p["v_bias"] = ParamSpec((L, K, H), ("layers", "kv_heads", "head_dim"), zeros, dt)
    if cfg.bias or cfg.attn_out_bias:
        p["o_bias"] = ParamSpec((L, D), ("layers", "embed"), zeros, dt)
    if cfg.qk_norm:
        p["q_norm"] = layers.norm_specs(cfg, (L, H), ("layers", "head_dim"))
        p["k_norm"] = layers.norm_specs(cfg, (L, H), ("layers", "head_dim"))
    if cfg.attn_sinks:
        p["sinks"] = ParamSpec((L, N), ("layers", "heads"), zeros, "float32")
    return p


def rope_of(cfg, kind: str = "global") -> layers.Rope | None:
    """The rotary settings of a layer kind: None for `nope` layers (and learned positions); `local` layers
    take model.local_rope_theta, unscaled, when it is set (Gemma 3)."""
    if cfg.position != "rotary" or kind == "nope":
        return None
    if kind == "local" and cfg.local_rope_theta is not None:
        return layers.Rope(cfg.local_rope_theta)
    if cfg.rope_scaling == "none":
        return layers.Rope(cfg.rope_theta)
    factor = 1.0
    if cfg.rope_scaling == "yarn":
        factor = cfg.rope_attention_factor
        if factor is None:
            f, m, m_all = cfg.rope_scaling_factor, cfg.rope_yarn_mscale, cfg.rope_yarn_mscale_all_dim
            factor = (layers.yarn_mscale(f, m) / layers.yarn_mscale(f, m_all) if m and m_all
                      else layers.yarn_mscale(f))
    return layers.Rope(cfg.rope_theta, cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_low_freq_factor,
                       cfg.rope_high_freq_factor, cfg.rope_original_context, cfg.rope_yarn_beta_fast,
                       cfg.rope_yarn_beta_slow, cfg.rope_yarn_truncate, float(factor))


def scale(cfg) -> float:
    """The factor on q.k: attn_scale ** -0.5 (default the query-key head width), times YaRN's
    (0.1 mscale_all_dim ln(factor) + 1)^2 when mscale_all_dim is set (DeepSeek-V3)."""
    base = (cfg.qk_dim if cfg.attn_scale is None else cfg.attn_scale) ** -0.5
    if cfg.rope_scaling == "yarn" and cfg.rope_yarn_mscale_all_dim:
        base *= layers.yarn_mscale(cfg.rope_scaling_factor, cfg.rope_yarn_mscale_all_dim) ** 2
    return base


def limits(cfg, kind: str) -> tuple[int | None, int | None]:
    """(window, chunk) of a layer kind's mask: local layers see the last model.sliding_window positions,
    chunked layers the positions of their own model.attention_chunk block."""
    return (cfg.sliding_window if kind == "local" else None, cfg.attention_chunk if kind == "chunked" else None)


def temperature(cfg, kind: str, positions_BT):
    """Llama 4's attention temperature tuning of `nope` layers: a factor per query [B, T, 1, 1], or None."""
    if not cfg.attn_temperature_tuning or kind != "nope":
        return None
    floor = jnp.floor((positions_BT.astype(jnp.float32) + 1.0) / cfg.attn_temperature_floor)
    return (jnp.log1p(floor) * cfg.attn_temperature_scale + 1.0)[:, :, None, None]


def position_qk(q_BTNH, k_BTKH, cfg, positions_BT, kind: str, mrope_BT3=None):
    """Rotary, then (rotary layers) L2 QK-norm, then (nope layers) temperature tuning. mrope_BT3 (a prompt with
    Qwen-VL images: model/vision_qwen.py) rotates by M-RoPE positions instead of positions_BT."""
    rope = rope_of(cfg, kind)
    if rope is not None:
        turn_by = positions_BT
        if mrope_BT3 is not None:
            rope = rope._replace(sections=cfg.vision.mrope, interleaved=cfg.vision.mrope_interleaved)
            turn_by = mrope_BT3
        q_BTNH = layers.rotary(q_BTNH, turn_by, rope)
        k_BTKH = layers.rotary(k_BTKH, turn_by, rope)
        if cfg.qk_l2_norm:
            q_BTNH, k_BTKH = layers.rms_scale(q_BTNH, cfg.norm_eps), layers.rms_scale(k_BTKH, cfg.norm_eps)
    if (t := temperature(cfg, kind, positions_BT)) is not None:
        q_BTNH = (q_BTNH.astype(jnp.float32) * t).astype(q_BTNH.dtype)
    return q_BTNH, k_BTKH


def project_qkv(x_BTD, p, cfg, positions_BT, kind: str = "global", mrope_BT3=None):
    q_BTNH, k_BTKH, v_BTKH = (_project(x_BTD, p, name) for name in "qkv")
    # Names for remat policies (model.remat=save_qkv_proj, offload_qkv_proj): the projections' outputs.
    q_BTNH = checkpoint_name(q_BTNH, "query_proj")
    k_BTKH = checkpoint_name(k_BTKH, "key_proj")
    v_BTKH = checkpoint_name(v_BTKH, "value_proj")
    if cfg.qk_norm:
        q_BTNH = layers.norm(q_BTNH, p["q_norm"], cfg.norm, cfg.norm_eps, cfg.norm_plus_one)
        k_BTKH = layers.norm(k_BTKH, p["k_norm"], cfg.norm, cfg.norm_eps, cfg.norm_plus_one)
    q_BTNH, k_BTKH = position_qk(q_BTNH, k_BTKH, cfg, positions_BT, kind, mrope_BT3)
    return q_BTNH, k_BTKH, v_BTKH


def _project(x_BTD, p, name: str):
    """x times the projection p[name] [D, N, H], plus its bias [N, H] where the layer has one: [B, T, N, H]. A bias
    is added to the matmul's [B, T, N * H] result before the heads are split off, so that its gradient is a sum
    over rows of that 2-D array (at heads of 64 a [.., N, H] array is a padded, slow-to-reduce layout on a TPU)."""
    w, bias = p[name], p.get(f"{name}_bias")
    if bias is None or not isinstance(w, jax.Array):
        out = layers.dot("BTD,DNH->BTNH", x_BTD, w)
        return out if bias is None else out + bias.astype(out.dtype)
    D, N, H = w.shape
    out_BTE = layers.dot("BTD,DE->BTE", x_BTD, w.reshape(D, N * H)) + bias.reshape(N * H).astype(x_BTD.dtype)
    return out_BTE.reshape(*x_BTD.shape[:2], N, H)


def attend(q_BTNH, k_BSKH, v_BSKH, mask_BTS, dropout_rate=0.0, key=None, scale=None, softcap=None, sinks_N=None):
    """softmax(softcap(q k^T * scale)) v with the softmax in float32; mask_BTS is True where attention is
    allowed. `scale` defaults to 1/sqrt(H); sinks_N (one logit per query head) join every denominator.

    Computed heads-major: with (B, K) as leading batch dims both products are plain batched matmuls, and
    the G query heads that share a kv head are folded into the query length (M = G * T)."""
    return attend_heads_major(q_BTNH, k_BSKH.transpose(0, 2, 1, 3), v_BSKH.transpose(0, 2, 1, 3), mask_BTS,
                              dropout_rate, key, scale, softcap, sinks_N)


def softmax(logits, sinks=None):
    """Softmax over the last axis in float32; `sinks` (broadcast against logits without that axis) add
    exp(sink) to the denominator: a key that every query sees and whose value is zero."""
    if sinks is None:
        return jax.nn.softmax(logits, axis=-1)
    m = jnp.maximum(jnp.max(logits, axis=-1), sinks)
    e = jnp.exp(logits - m[..., None])
    return e / (jnp.sum(e, axis=-1) + jnp.exp(sinks - m))[..., None]


def attend_heads_major(q_BTNH, k_BKSH, v_BKSH, mask_BTS, dropout_rate=0.0, key=None, scale=None, softcap=None,
                       sinks_N=None):
    """`attend` with keys and values already heads-major [B, K, S, H] (the KV cache's layout); values may be
    of another width than queries and keys."""
    B, T, N, H = q_BTNH.shape
    K = k_BKSH.shape[1]
    G = N // K
    q_BKMH = q_BTNH.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, H)
    logits_BKMS = jnp.einsum("BKMH,BKSH->BKMS", q_BKMH, k_BKSH, preferred_element_type=jnp.float32)
    logits_BKMS = logits_BKMS * (H ** -0.5 if scale is None else scale)
    logits_BKMS = layers.softcap(logits_BKMS, softcap)
    mask_BMS = jnp.tile(mask_BTS, (1, G, 1)) if G > 1 else mask_BTS
    logits_BKMS = jnp.where(mask_BMS[:, None], logits_BKMS, jnp.finfo(jnp.float32).min)
    sinks_KM = None if sinks_N is None else jnp.repeat(sinks_N.astype(jnp.float32).reshape(K, G), T, axis=1)
    probs_BKMS = softmax(logits_BKMS, sinks_KM)
    probs_BKMS = layers.dropout(probs_BKMS, dropout_rate, key).astype(v_BKSH.dtype)
    out_BKMH = jnp.einsum("BKMS,BKSH->BKMH", probs_BKMS, v_BKSH, preferred_element_type=jnp.float32)
    Hv = v_BKSH.shape[-1]
    out_BTNH = out_BKMH.reshape(B, K, G, T, Hv).transpose(0, 3, 1, 2, 4).reshape(B, T, N, Hv)
    return out_BTNH.astype(q_BTNH.dtype)


def mask(q_positions_BT: jax.Array, k_positions_BS: jax.Array, window: int | None = None,
         q_segment_ids_BT: jax.Array | None = None, k_segment_ids_BS: jax.Array | None = None,
         chunk: int | None = None, q_reach_BT: jax.Array | None = None) -> jax.Array:
    """[B, T, S], True where query t may attend to key s: causal, within the last `window` positions (the
    query's own included) when a window is given, within the query's block of `chunk` positions when a chunk
    is given (Llama 4), and in the same segment (packed document) when segment ids are given. A function of
    positions and segment ids, not of array offsets, so a decoder attending from new tokens into a cache of
    old ones uses the same rule, and positions may restart at each packed document. q_reach_BT (None = the
    queries' own positions) moves each query's causal limit: an image's tokens see to its end (model/vision.py)."""
    q_BT1, k_B1S = q_positions_BT[:, :, None], k_positions_BS[:, None, :]
    allowed_BTS = k_B1S <= (q_BT1 if q_reach_BT is None else q_reach_BT[:, :, None])
    if window is not None:
        allowed_BTS &= k_B1S > q_BT1 - window
    if chunk is not None:
        allowed_BTS &= k_B1S // chunk == q_BT1 // chunk
    if q_segment_ids_BT is not None:
        allowed_BTS &= q_segment_ids_BT[:, :, None] == k_segment_ids_BS[:, None, :]
    return allowed_BTS


def kind_mask(cfg, kind: str, q_positions_BT, k_positions_BS, q_segment_ids_BT=None, k_segment_ids_BS=None):
    """`mask` of a layer kind (its window or chunk)."""
    window, chunk = limits(cfg, kind)
    return mask(q_positions_BT, k_positions_BS, window, q_segment_ids_BT, k_segment_ids_BS, chunk)


def self_attention(q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, cfg, kind="global", key=None,
                   sinks_N=None, reach_BT=None):
    """The one attention interface of the uncached pass: queries [B, T, N, H], keys and values [B, T, K, H]
    of the same tokens, their positions [B, T] and segment ids [B, T] (int32; tokens attend only within their
    own segment; None = one segment per row). Every implementation takes these arguments; masks are causal by
    position, windowed for `local` layers, blocked for `chunked` ones, and never cross a segment; sinks_N (a
    logit per query head) join the softmax denominators. reach_BT (a prompt with images: `mask`) runs
    dot_product where that is the implementation chosen, else blockwise (the kernels take no per-query reach;
    blockwise keeps their memory bound)."""
    T = q_BTNH.shape[1]
    window, chunk = limits(cfg, kind)
    if reach_BT is not None:
        if ring.context_devices() > 1:
            raise ConfigError("images (bidirectional attention over an image's tokens) need the `length` axis on "
                              "one device; set mesh.ici_sequence and mesh.dcn_sequence to 1")
        impl = choose(cfg, T, q_BTNH.dtype, segment_ids_BT is not None, mesh_platform(), dropout=key is not None)
        if impl != "dot_product":
            return blockwise.attention(q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, window, scale(cfg),
                                       cfg.attn_logit_softcap, cfg.attention_block, chunk, sinks_N, reach_BT)
        mask_BTS = mask(positions_BT, positions_BT, window, segment_ids_BT, segment_ids_BT, chunk, reach_BT)
        return attend(q_BTNH, k_BTKH, v_BTKH, mask_BTS, cfg.dropout, key, scale(cfg), cfg.attn_logit_softcap,
                      sinks_N)
    if (n := ring.context_devices()) > 1 and T % n == 0:  # the sequence is split: context parallelism
        if key is not None:  # train.setup refuses this for runs; a direct caller gets told too
            raise ValueError("attention dropout (model.dropout > 0) is not supported with context parallelism")
        if chunk is not None or sinks_N is not None:
            raise ConfigError("context parallelism (a mesh that splits the sequence) does not support chunked "
                              "attention or attention sinks; keep the `length` axis on one device")
        return ring.attention(q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, window, scale(cfg),
                              cfg.attn_logit_softcap, cfg.attention_block, cfg.context_parallel)
    platform = mesh_platform()
    impl = choose(cfg, T, q_BTNH.dtype, segment_ids_BT is not None, platform, dropout=key is not None)
    if impl == "blockwise":
        return blockwise.attention(q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, window, scale(cfg),
                                   cfg.attn_logit_softcap, cfg.attention_block, chunk, sinks_N)
    if impl == "splash":
        return splash.attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, window, scale(cfg), cfg.attn_logit_softcap,
                                cfg.attention_block, interpret=platform != "tpu", chunk=chunk, sinks_N=sinks_N,
                                layout=cfg.splash_layout)
    if impl == "cudnn":
        return _cudnn(q_BTNH, k_BTKH, v_BTKH, window, scale(cfg))
    mask_BTS = mask(positions_BT, positions_BT, window, segment_ids_BT, segment_ids_BT, chunk)
    return attend(q_BTNH, k_BTKH, v_BTKH, mask_BTS, cfg.dropout, key, scale(cfg), cfg.attn_logit_softcap, sinks_N)


def mesh_platform() -> str:
    """The platform of the devices the step is traced for: the active mesh's (an ahead-of-time compile for
    TPU runs on a CPU host), else the default backend's."""
    ctx = sharding.active()
    return runtime.platform(ctx[0] if ctx is not None else None)


def _cudnn_supports(cfg, dtype, has_segments) -> bool:
    return (jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and cfg.attn_logit_softcap is None and not has_segments
            and not cfg.attn_sinks and "chunked" not in cfg.pattern)


def choose(cfg, T: int, dtype, has_segments: bool, platform: str, dropout: bool = False) -> str:
    """The implementation `self_attention` runs for T tokens of this dtype on this platform. `auto` takes the
    fastest that covers the case; an explicit kernel that lacks the case (splash: T not a multiple of 128;
    cudnn: not a GPU, float32, soft-cap, segment ids, sinks or chunked layers) runs blockwise instead. Splash
    off TPU runs in Pallas interpret mode: exact but slow, for tests."""
    name = cfg.attention
    if name == "auto":
        if dropout:  # only dot_product drops attention probabilities
            return "dot_product"
        name = {"tpu": "splash", "gpu": "cudnn", "cuda": "cudnn", "rocm": "blockwise"}.get(
            platform, "blockwise" if T >= CPU_BLOCKWISE_FROM else "dot_product")
    if name == "splash" and not splash.supports(T):
        return "blockwise"
    if name == "cudnn" and (platform not in ("gpu", "cuda") or not _cudnn_supports(cfg, dtype, has_segments)):
        return "blockwise"
    return name


def describe_with_images(cfg, platform: str) -> str:
    """`describe` for rows whose image tokens see their whole image (Gemma 3): what `self_attention` runs then."""
    impl = choose(cfg, cfg.block_size, jnp.dtype(cfg.compute_dtype), True, platform)
    return (f"attention {'dot_product' if impl == 'dot_product' else 'blockwise'} (rows with images: an image's "
            f"tokens see the whole image, docs/vision.md)")


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
            + (f", tiles of {cfg.attention_block}" if impl in ("blockwise", "splash") else "") + ")"
            + (" | latent attention (model.kv_lora_rank)" if cfg.latent else ""))


def _cudnn(q_BTNH, k_BTKH, v_BTKH, window, scale):
    """cuDNN's fused flash attention (GPU; bf16/fp16). Its causal and window masks go by index in the row, which
    is the position rule when positions count 0..T-1, as they do without segment ids."""
    with jax.named_scope("cudnn_attention"):
        return jax.nn.dot_product_attention(q_BTNH, k_BTKH, v_BTKH, scale=scale, is_causal=True,
                                            local_window_size=None if window is None else (window - 1, 0),
                                            implementation="cudnn")


def project_out(out_BTNH, p):
    """The output projection o (and its bias) of attention's per-head outputs."""
    out_BTD = layers.dot("BTNH,NHD->BTD", out_BTNH, p["o"])
    if "o_bias" in p:
        out_BTD = out_BTD + p["o_bias"].astype(out_BTD.dtype)
    return out_BTD


def attention_with_kv(x_BTD, p, cfg, positions_BT, key=None, kind="global", segment_ids_BT=None, reach_BT=None,
                      mrope_BT3=None):
    """Self-attention over x for a layer of `kind` (reach_BT: `self_attention`; mrope_BT3: `position_qk`). Also
    returns the keys and values [B, T, K, H], which prefill stores in the cache."""
    with jax.named_scope("attention"):
        if reach_BT is None and mrope_BT3 is None and key is None and _splash_heads_major(x_BTD, p, cfg, kind,
                                                                                            segment_ids_BT):
            return _splash_attention_with_kv(x_BTD, p, cfg, positions_BT, kind, segment_ids_BT)
        q_BTNH, k_BTKH, v_BTKH = project_qkv(x_BTD, p, cfg, positions_BT, kind, mrope_BT3)
        q_BTNH = constrain(q_BTNH, ("batch", "length", "heads", "head_dim"))
        out_BTNH = self_attention(q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, cfg, kind, key,
                                  p.get("sinks"), reach_BT)
        out_BTNH = checkpoint_name(out_BTNH, "context")
        return checkpoint_name(project_out(out_BTNH, p), "out_proj"), k_BTKH, v_BTKH


def _splash_heads_major(x_BTD, p, cfg, kind: str, segment_ids_BT) -> bool:
    """Whether this layer's uncached pass runs splash with the projections writing and reading the kernel's
    heads-major layout: splash chosen, the sequence on one device, array weights (not adapted or stored
    quantized; int8 and fp8 training's quantized matmuls take any layout, layers.dot) and no temperature tuning."""
    T = x_BTD.shape[1]
    return (choose(cfg, T, x_BTD.dtype, segment_ids_BT is not None, mesh_platform()) == "splash"
            and ring.context_devices() <= 1 and not (cfg.attn_temperature_tuning and kind == "nope")
            and all(isinstance(p[n], (jax.Array, quant.StepInt8)) for n in "qkvo"))


def _project_heads_major(x_BTD, p, name: str):
    """x times the projection p[name] [D, N, H], plus its bias [N, H]: [B, N, T, H], the matmul writing the heads-major
    layout itself."""
    out_BNTH = layers.dot("BTD,DNH->BNTH", x_BTD, p[name])
    bias = p.get(f"{name}_bias")
    return out_BNTH if bias is None else _add_head_bias(out_BNTH, bias)


@jax.custom_vjp
def _add_head_bias(x_BNTH, bias_NH):
    """x plus a bias per head [N, H]. Its gradient, the sum of x's over batch and length, is taken as a matmul with
    a vector of ones: XLA's reduction of a [B, N, T, H] array into [N, H] runs at a fraction of the bandwidth on a
    TPU (heads of 64 fill half of each tile), the matmul at about its full rate."""
    return x_BNTH + bias_NH.astype(x_BNTH.dtype)[:, None, :]


def _add_head_bias_bwd(bias_NH, g_BNTH):
    ones_BT = jnp.ones((g_BNTH.shape[0], g_BNTH.shape[2]), g_BNTH.dtype)
    g_NH = jnp.einsum("BNTH,BT->NH", g_BNTH, ones_BT, preferred_element_type=jnp.float32)
    return g_BNTH, g_NH.astype(bias_NH.dtype)


_add_head_bias.defvjp(lambda x_BNTH, bias_NH: (_add_head_bias(x_BNTH, bias_NH), bias_NH), _add_head_bias_bwd)


def _splash_attention_with_kv(x_BTD, p, cfg, positions_BT, kind: str, segment_ids_BT):
    """`attention_with_kv` through splash in the kernel's layout: the q, k, v projections write [B, heads, T, H],
    QK-norm and rotary turn them there, and the output projection reads the kernel's [B, N, T, H] output, so XLA
    has no [B, T, N, H] <-> [B, N, T, H] copies to make around the kernel (docs/performance.md, "Attention"). The
    same values as the [B, T, N, H] path (tests/test_attention.py)."""
    q_BNTH, k_BKTH, v_BKTH = (checkpoint_name(_project_heads_major(x_BTD, p, name), f"{proj}_proj")
                              for name, proj in zip("qkv", ("query", "key", "value")))
    if cfg.qk_norm:
        q_BNTH = layers.norm(q_BNTH, p["q_norm"], cfg.norm, cfg.norm_eps, cfg.norm_plus_one)
        k_BKTH = layers.norm(k_BKTH, p["k_norm"], cfg.norm, cfg.norm_eps, cfg.norm_plus_one)
    rope = rope_of(cfg, kind)
    if rope is not None:
        q_BNTH = layers.rotary_heads_major(q_BNTH, positions_BT, rope)
        k_BKTH = layers.rotary_heads_major(k_BKTH, positions_BT, rope)
        if cfg.qk_l2_norm:
            q_BNTH, k_BKTH = layers.rms_scale(q_BNTH, cfg.norm_eps), layers.rms_scale(k_BKTH, cfg.norm_eps)
    q_BNTH = constrain(q_BNTH, ("batch", "heads", "length", "head_dim"))
    window, chunk = limits(cfg, kind)
    out_BNTH = splash.attention_heads_major(q_BNTH, k_BKTH, v_BKTH, segment_ids_BT, window, scale(cfg),
                                            cfg.attn_logit_softcap, cfg.attention_block,
                                            interpret=mesh_platform() != "tpu", chunk=chunk, sinks_N=p.get("sinks"),
                                            layout=cfg.splash_layout)
    out_BNTH = checkpoint_name(out_BNTH, "context")
    out_BTD = layers.dot("BNTH,NHD->BTD", out_BNTH, p["o"])
    if "o_bias" in p:
        out_BTD = out_BTD + p["o_bias"].astype(out_BTD.dtype)
    return checkpoint_name(out_BTD, "out_proj"), k_BKTH.transpose(0, 2, 1, 3), v_BKTH.transpose(0, 2, 1, 3)


def attention_with_logit_max(x_BTD, p, cfg, positions_BT, kind="global", segment_ids_BT=None):
    """Self-attention over x (no dropout), and the largest attention logit of each query head over the batch
    [N]: what MuonClip's QK-clip watches (clip_qk)."""
    with jax.named_scope("attention"):
        q_BTNH, k_BTKH, v_BTKH = project_qkv(x_BTD, p, cfg, positions_BT, kind)
        out_BTNH = self_attention(q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, cfg, kind, None,
                                  p.get("sinks"))
        return project_out(out_BTNH, p), kind_logit_max(q_BTNH, k_BTKH, positions_BT, segment_ids_BT, cfg, kind)


def kind_logit_max(q_BTNH, k_BTKH, positions_BT, segment_ids_BT, cfg, kind: str) -> jax.Array:
    """`logit_max` under the mask and scale of a layer kind."""
    window, chunk = limits(cfg, kind)
    return logit_max(q_BTNH, k_BTKH, positions_BT, segment_ids_BT, window, chunk, scale(cfg), cfg.attention_block)


def logit_max(q_BTNH, k_BTKH, positions_BT, segment_ids_BT=None, window=None, chunk=None, factor=None,
              block=512) -> jax.Array:
    """The largest logit q.k * factor (before any soft-cap; factor defaults to 1/sqrt(H)) of each query head over
    every pair the mask allows [N], in float32, `block` queries at a time, so the [B, N, T, T] logits never exist
    at once."""
    B, T, N, H = q_BTNH.shape
    K = k_BTKH.shape[2]
    factor = H ** -0.5 if factor is None else factor
    C = min(block, T)
    pad = -T % C
    seg_BT = jnp.zeros((B, T), jnp.int32) if segment_ids_BT is None else segment_ids_BT
    # Padded queries get position -1, which no key precedes: they see nothing.
    q_nBCKGH = jnp.pad(q_BTNH, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(B, -1, C, K, N // K, H).swapaxes(0, 1)
    pos_nBC = jnp.pad(positions_BT, ((0, 0), (0, pad)), constant_values=-1).reshape(B, -1, C).swapaxes(0, 1)
    seg_nBC = jnp.pad(seg_BT, ((0, 0), (0, pad))).reshape(B, -1, C).swapaxes(0, 1)

    def one(inputs):
        q_BCKGH, pos_BC, seg_BC = inputs
        logits_BKGCS = jnp.einsum("BCKGH,BSKH->BKGCS", q_BCKGH, k_BTKH, preferred_element_type=jnp.float32) * factor
        allowed_BCS = mask(pos_BC, positions_BT, window, seg_BC, seg_BT, chunk)
        logits_BKGCS = jnp.where(allowed_BCS[:, None, None], logits_BKGCS, -jnp.inf)
        return jnp.max(logits_BKGCS, axis=(0, 3, 4)).reshape(N)

    return jnp.max(jax.lax.map(one, (q_nBCKGH, pos_nBC, seg_nBC)), axis=0)


def qk_clip_factors(logit_max_LN: jax.Array, threshold: float) -> jax.Array:
    """gamma [L, N]: threshold / max for each head whose largest logit exceeded the threshold, else 1."""
    return jnp.where(logit_max_LN > threshold, threshold / logit_max_LN, 1.0)


def clip_qk(p_attn: dict, logit_max_LN: jax.Array, threshold: float, cfg) -> dict:
    """QK-clip (MuonClip, Kimi K2): the stacked attention weights [L, ...] with each head whose largest logit
    exceeded `threshold` scaled so that, on the same inputs, it would have been `threshold`: gamma = threshold /
    max. The query and key projections take sqrt(gamma) each when every query head has its own key head; with
    grouped-query heads the shared keys stay and the query head takes gamma. With QK-norm the projections' scale
    cancels, so the layer's query and key norm scales, shared by its heads, take sqrt(gamma) of its worst head.
    Biases of the projections scale with them."""
    gamma_LN = qk_clip_factors(logit_max_LN, threshold)
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


def project_entries(x_BTD, p, cfg, positions_BT, kind="global"):
    """Queries [B, T, N, H] and what the cache keeps of each token, (keys, values) [B, T, K, H]."""
    q_BTNH, k_BTKH, v_BTKH = project_qkv(x_BTD, p, cfg, positions_BT, kind)
    return q_BTNH, (k_BTKH, v_BTKH)


def attend_entries(q_BTNH, k_BKSH, v_BKSH, mask_BTS, p, cfg):
    """Queries over cached keys and values (heads-major [B, K, S, H]), projected out [B, T, D]."""
    out_BTNH = attend_heads_major(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale=scale(cfg), softcap=cfg.attn_logit_softcap,
                                  sinks_N=p.get("sinks"))
    return project_out(out_BTNH, p)


def store_stacked(cache: dict, entries, r, slot_B, dtype):
    """Write one new token's cache entries (k, v [B, 1, K, H]) at [r, b, slot_B[b]] of the stacked k, v
    [R, B, K, S, H] (and int8 scales), in place; returns the updated stacked cache and repeat r's keys and
    values read back [B, K, S, H] in `dtype`."""
    quantized = cache["k_scale"] is not None
    new = {}
    for name, x_B1KH in zip(("k", "v"), entries):
        x_BK1H, scale_BK1 = kvcache.store(x_B1KH.transpose(0, 2, 1, 3), quantized)
        new[name] = kvcache.write_one(cache[name], x_BK1H[:, :, 0], r, slot_B)
        new[f"{name}_scale"] = None if not quantized else kvcache.write_one(cache[f"{name}_scale"],
                                                                            scale_BK1[:, :, 0], r, slot_B)
    layer = {k: None if v is None else constrain(v[r], kvcache.CACHE_AXES[:v.ndim - 1]) for k, v in new.items()}
    return new, kvcache.read(layer["k"], layer["k_scale"], dtype), kvcache.read(layer["v"], layer["v_scale"], dtype)


def store_layer(layer: dict, entries, slot_B, dtype):
    """Write one new token's cache entries at slot_B of one layer's own cache (kvcache.LayerCaches: keys
    transposed [B, K, H, S]), in place; returns the updated layer cache, its keys transposed [B, K, H, S] and
    its values [B, K, S, H] in `dtype`."""
    quantized = layer["k_scale"] is not None
    new = {}
    for name, x_B1KH, axis in zip(("k", "v"), entries, (3, 2)):
        x_BK1H, scale_BK1 = kvcache.store(x_B1KH.transpose(0, 2, 1, 3), quantized)
        new[name] = kvcache.write_layer(layer[name], x_BK1H[:, :, 0], slot_B, axis)
        new[f"{name}_scale"] = None if not quantized else kvcache.write_layer(layer[f"{name}_scale"],
                                                                              scale_BK1[:, :, 0], slot_B, 2)
    kT_BKHS = new["k"] if not quantized else (
        new["k"].astype(jnp.float32) * new["k_scale"][:, :, None]).astype(dtype)
    return new, kT_BKHS, kvcache.read(new["v"], new["v_scale"], dtype)


def attention_decode(x_B1D, p, cfg, positions_B1, cache: dict, r, slot_B, k_positions_BS, kind="global"):
    """Attention of one new token per sequence over the cache. `cache` holds the k, v [R, B, K, S, H] and
    k_scale, v_scale [R, B, K, S] (None unless int8) of every repeat of this layer's pattern entry; this layer
    is repeat `r`. The new key and value are written at [r, b, slot_B[b]] first, in place (the stacked arrays
    are a loop carry, so a step writes one entry per sequence instead of copying the cache), and
    k_positions_BS already names the positions every slot holds after that write, so the mask is the same
    function of positions as in the uncached pass. Returns the output and the updated stacked cache."""
    with jax.named_scope("attention"):
        q_B1NH, entries = project_entries(x_B1D, p, cfg, positions_B1, kind)
        new, k_BKSH, v_BKSH = store_stacked(cache, entries, r, slot_B, q_B1NH.dtype)
        mask_B1S = kind_mask(cfg, kind, positions_B1, k_positions_BS)
        return attend_entries(q_B1NH, k_BKSH, v_BKSH, mask_B1S, p, cfg), new


def attention_decode_layer(x_B1D, p, cfg, positions_B1, layer: dict, slot_B, k_positions_BS, kind="global"):
    """`attention_decode` over one layer's own cache (kvcache.LayerCaches: keys transposed [B, K, H, S]): the
    new key and value are written at slot_B first, in place, then the token attends over every slot. Returns
    the output and the layer's updated cache."""
    with jax.named_scope("attention"):
        q_B1NH, k_B1KH, v_B1KH = project_qkv(x_B1D, p, cfg, positions_B1, kind)
        new, kT_BKHS, v_BKSH = store_layer(layer, (k_B1KH, v_B1KH), slot_B, q_B1NH.dtype)
        mask_B1S = kind_mask(cfg, kind, positions_B1, k_positions_BS)
        out_B1NH = attend_one(q_B1NH, kT_BKHS, v_BKSH, mask_B1S, scale(cfg), cfg.attn_logit_softcap, p.get("sinks"))
        return project_out(out_B1NH, p), new


def attend_one(q_B1NH, kT_BKHS, v_BKSH, mask_B1S, scale=None, softcap=None, sinks_N=None):
    """`attend` of one query per sequence over keys transposed [B, K, H, S] and values [B, K, S, H]: the G
    query heads of a kv head are the rows of both products, which need no transposed copy of the keys."""
    B, _, N, H = q_B1NH.shape
    K = kT_BKHS.shape[1]
    q_BKGH = q_B1NH.reshape(B, K, N // K, H)
    logits_BKGS = jnp.einsum("BKGH,BKHS->BKGS", q_BKGH, kT_BKHS, preferred_element_type=jnp.float32)
    logits_BKGS = layers.softcap(logits_BKGS * (H ** -0.5 if scale is None else scale), softcap)
    logits_BKGS = jnp.where(mask_B1S[:, None], logits_BKGS, jnp.finfo(jnp.float32).min)
    sinks_KG = None if sinks_N is None else sinks_N.astype(jnp.float32).reshape(K, N // K)
    probs_BKGS = softmax(logits_BKGS, sinks_KG).astype(v_BKSH.dtype)
    out_BKGH = jnp.einsum("BKGS,BKSH->BKGH", probs_BKGS, v_BKSH, preferred_element_type=jnp.float32)
    return out_BKGH.reshape(B, 1, N, v_BKSH.shape[-1]).astype(q_B1NH.dtype)


def chunk_entries(entries, rows: dict | None, take_PS, src_PS, quantized: bool, dtype):
    """The keys and values a chunk of new tokens [P, C] attends to and the slot cache's updated rows
    (decode.prefill_chunks): `entries` are the chunk's own (k, v [P, C, K, H]), `rows` its sequences'
    cached k, v [P, K, S, H] (and scales) of this layer, take_PS which slots take a chunk entry and src_PS from
    which chunk index (kvcache.chunk_layout). Returns k, v [P, K, X, H] in `dtype` (X = S + C: the cached ones,
    then the chunk's) and the rows' new k, v (and scales). With `rows` None (chunks that start their prompts,
    `fresh`) the keys are the chunk's own (X = C) and the update is those, for slots 0..C-1."""
    keys = []
    new = {}
    for name, x_PCKH in zip(("k", "v"), entries):
        own_PKCH = x_PCKH.transpose(0, 2, 1, 3)
        if rows is None:
            keys.append(own_PKCH.astype(dtype))
            new[name], new[f"{name}_scale"] = kvcache.store(own_PKCH, quantized)
            continue
        old_PKSH = kvcache.read(rows[name], rows[f"{name}_scale"], dtype)
        keys.append(jnp.concatenate([old_PKSH, own_PKCH.astype(dtype)], axis=2))
        x_PSKH = jnp.take_along_axis(x_PCKH, src_PS[:, :, None, None], axis=1)
        x_PKSH, scale_PKS = kvcache.store(x_PSKH.transpose(0, 2, 1, 3), quantized)
        new[name] = jnp.where(take_PS[:, None, :, None], x_PKSH.astype(rows[name].dtype), rows[name])
        new[f"{name}_scale"] = None if not quantized else jnp.where(take_PS[:, None], scale_PKS,
                                                                    rows[f"{name}_scale"])
    return keys[0], keys[1], new


def attention_chunk(h_PCD, p, cfg, q_pos_PC, k_pos_PX, rows: dict | None, take_PS, src_PS, kind: str,
                    quantized: bool):
    """Attention of chunks of new tokens [P, C] at positions q_pos_PC over their sequences' earlier keys in the
    slot cache and their own (chunk_entries; k_pos_PX the positions of the keys seen). Returns the output and
    the rows' updated k, v (and scales)."""
    with jax.named_scope("attention"):
        q_PCNH, entries = project_entries(h_PCD, p, cfg, q_pos_PC, kind)
        k_PKXH, v_PKXH, new = chunk_entries(entries, rows, take_PS, src_PS, quantized, q_PCNH.dtype)
        mask_PCX = kind_mask(cfg, kind, q_pos_PC, k_pos_PX)
        return attend_entries(q_PCNH, k_PKXH, v_PKXH, mask_PCX, p, cfg), new
