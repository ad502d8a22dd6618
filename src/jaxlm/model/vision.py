"""The vision tower of a vision-language model (Gemma 3's SigLIP) and its projector: the weights, the encoder
(patches embedded by one matmul, learned positions, pre-LayerNorm blocks of bidirectional attention and MLP, a
final LayerNorm), the projector (the patch grid average-pooled to `tokens_per_image` soft tokens, RMS-normed and
projected to the language model's width), and where those soft tokens go in a prompt: at its image tokens, which
attend to every token of their own image (their reach) and causally to the rest.

Shape legend: I images, S image side in pixels, C colour channels, P patches per image, Q values per patch
(patch side^2 * C), E encoder width, N heads, H head width, F MLP width, L encoder layers, M soft tokens per
image, D language model width, B batch, T length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm.config import ModelConfig
from jaxlm.sharding import constrain
from jaxlm.model import attention, blockwise, layers
from jaxlm.params import ParamSpec, count, normal, ones, zeros

CHANNELS = 3


def specs(cfg: ModelConfig) -> dict:
    """The tower's weights. The stacked layer axis is left unsharded (`None`, not `layers`): pipeline stages split
    the language model's layers only; the widths shard as the language model's do (embed, heads, mlp)."""
    v, dt = cfg.vision, cfg.param_dtype
    E, Q, P = v.d_model, v.patch_size ** 2 * CHANNELS, v.patches_per_side ** 2
    w = normal(cfg.init_std)
    return {
        "patch": ParamSpec((Q, E), (None, "embed"), w, dt),
        "patch_bias": ParamSpec((E,), ("embed",), zeros, dt),
        "positions": ParamSpec((P, E), (None, "embed"), w, dt),
        "layers": layer_specs(cfg),
        "final_norm": layer_norm_specs(cfg, (E,), ("embed",)),
        # Gemma's RMSNorm multiplies by (1 + scale).
        "projector": {"norm": {"scale": ParamSpec((E,), ("embed",), zeros, dt)},
                      "proj": ParamSpec((E, cfg.d_model), (None, "embed"), w, dt)},
    }


def layer_norm_specs(cfg: ModelConfig, shape: tuple, axes: tuple) -> dict:
    dt = cfg.param_dtype
    return {"scale": ParamSpec(shape, axes, ones, dt), "bias": ParamSpec(shape, axes, zeros, dt)}


def layer_specs(cfg: ModelConfig, gated: bool = False, rms: bool = False) -> dict:
    """The stacked pre-norm encoder blocks (attention and MLP, all with biases), shared by the towers: LayerNorm,
    or RMSNorm (`rms`, scale only), and a gated MLP (`gated`: gate and up, Qwen2.5-VL's SwiGLU) or a plain one."""
    v, dt = cfg.vision, cfg.param_dtype
    E, N, H, F, L = v.d_model, v.n_heads, v.hd, v.d_ff, v.n_layers
    w = normal(cfg.init_std)

    def weight(shape, axes, out_shape, out_axes):
        return ParamSpec(shape, axes, w, dt), ParamSpec(out_shape, out_axes, zeros, dt)

    attn, mlp = {}, {}
    for name in ("q", "k", "v"):
        attn[name], attn[f"{name}_bias"] = weight((L, E, N, H), (None, "embed", "heads", "head_dim"),
                                                  (L, N, H), (None, "heads", "head_dim"))
    attn["o"], attn["o_bias"] = weight((L, N, H, E), (None, "heads", "head_dim", "embed"), (L, E), (None, "embed"))
    for name in ("gate", "up") if gated else ("up",):
        mlp[name], mlp[f"{name}_bias"] = weight((L, E, F), (None, "embed", "mlp"), (L, F), (None, "mlp"))
    mlp["down"], mlp["down_bias"] = weight((L, F, E), (None, "mlp", "embed"), (L, E), (None, "embed"))
    norm = ({"scale": ParamSpec((L, E), (None, "embed"), ones, dt)} if rms
            else layer_norm_specs(cfg, (L, E), (None, "embed")))
    return {"attn_norm": norm, "attn": attn, "mlp_norm": dict(norm), "mlp": mlp}


def patches(pixels_ISSC: jax.Array, patch: int) -> jax.Array:
    """Images [I, S, S, C] as rows of patches [I, P, Q], row-major over the grid, each patch row-major then
    by channel: the convolution of the patch embedding becomes one matmul."""
    I, S, _, C = pixels_ISSC.shape
    n = S // patch
    x = pixels_ISSC.reshape(I, n, patch, n, patch, C).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(I, n * n, patch * patch * C)


def block(x_IPE, p, cfg: ModelConfig, rotate=None, mask_IPP=None):
    """One pre-LayerNorm encoder block: bidirectional attention over an image's patches (`attend`: those mask_IPP
    allows; None: all), then the MLP. `rotate(q, k)` turns queries and keys before attention (Llama 4's 2D
    rotary)."""
    v = cfg.vision
    with jax.named_scope("vision_attn_block"):
        h = layers.layer_norm(x_IPE, p["attn_norm"]["scale"], p["attn_norm"]["bias"], v.norm_eps)
        a = p["attn"]
        q_IPNH = layers.dot("IPE,ENH->IPNH", h, a["q"]) + a["q_bias"].astype(h.dtype)
        k_IPNH = layers.dot("IPE,ENH->IPNH", h, a["k"]) + a["k_bias"].astype(h.dtype)
        v_IPNH = layers.dot("IPE,ENH->IPNH", h, a["v"]) + a["v_bias"].astype(h.dtype)
        if rotate is not None:
            q_IPNH, k_IPNH = rotate(q_IPNH, k_IPNH)
        out_IPNH = attend(q_IPNH, k_IPNH, v_IPNH, mask_IPP, cfg.attention_block)
        x_IPE = x_IPE + layers.dot("IPNH,NHE->IPE", out_IPNH, a["o"]) + a["o_bias"].astype(h.dtype)
    with jax.named_scope("vision_mlp_block"):
        h = layers.layer_norm(x_IPE, p["mlp_norm"]["scale"], p["mlp_norm"]["bias"], v.norm_eps)
        return x_IPE + layers.mlp(h, p["mlp"], layers.Activation(v.activation, False))


def attend(q_IPNH, k_IPNH, v_IPNH, mask_IPP, block: int):
    """Bidirectional attention of an image's patches [I, P, N, H] in the query dtype: over those mask_IPP allows,
    or (None) over all of them, blockwise in tiles of `block` (model.attention_block) when the patches exceed one
    tile, so no [I, N, P, P] of scores is ever held (2 GiB in float32 for two 896x896 images, 4,096 patches)."""
    I, P = q_IPNH.shape[:2]
    if mask_IPP is None and P > block:
        pos_IP = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (I, P))
        out_IPNH, _ = blockwise.attend_block(q_IPNH, k_IPNH, v_IPNH, pos_IP, pos_IP, block_q=block, block_k=block,
                                             q_reach_BT=jnp.full((I, P), P - 1, jnp.int32))  # each sees all
        return out_IPNH.astype(q_IPNH.dtype)
    mask_IPP = jnp.ones((I, P, P), bool) if mask_IPP is None else mask_IPP
    return attention.attend(q_IPNH, k_IPNH, v_IPNH, mask_IPP)


def encode(p: dict, pixels_ISSC: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The soft tokens [I, M, D] of images [I, S, S, C] (preprocessed: data/images.py), in the compute dtype."""
    v = cfg.vision
    cdt = jnp.dtype(cfg.compute_dtype)
    with jax.named_scope("vision"):
        x_IPQ = patches(pixels_ISSC.astype(cdt), v.patch_size)
        x_IPE = layers.dot("IPQ,QE->IPE", x_IPQ, p["patch"]) + p["patch_bias"].astype(cdt)
        # Each device encodes the images of its own rows: pinned like the batch, or the partitioner may replicate
        # the tower's attention over every image of the batch on every device.
        x_IPE = constrain(x_IPE + p["positions"].astype(cdt), ("batch", None, "embed"))

        x_IPE = encoder(x_IPE, p["layers"], cfg, pinned=True)
        x_IPE = layers.layer_norm(x_IPE, p["final_norm"]["scale"], p["final_norm"]["bias"], v.norm_eps)
        return project(p["projector"], x_IPE, cfg)


def encoder(x_IPE, p_layers, cfg: ModelConfig, rotate=None, pinned: bool = False, mask_IPP=None):
    """The stacked blocks scanned over x [I, P, E]; with `model.remat` other than none each keeps only its input
    (the tower is a small share of the step). pinned: each block's output sharded as the batch (images in the order
    of the batch's rows), so each device encodes its own rows' images. mask_IPP: as block's."""
    def body(x, p_layer):
        y = block(x, p_layer, cfg, rotate, mask_IPP)
        return (constrain(y, ("batch", None, "embed")) if pinned else y), None

    if cfg.remat != "none":
        body = jax.checkpoint(body)
    return jax.lax.scan(body, x_IPE, p_layers)[0]


def project(p: dict, x_IPE: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The encoder's patches [I, P, E] average-pooled over square windows of the grid to M = tokens_per_image
    soft tokens, RMS-normed and projected to the language model's width [I, M, D]."""
    v = cfg.vision
    I, _, E = x_IPE.shape
    n, m = v.patches_per_side, round(v.tokens_per_image ** 0.5)
    k = n // m
    with jax.named_scope("projector"):
        grid = x_IPE.astype(jnp.float32).reshape(I, m, k, m, k, E)
        pooled_IME = jnp.mean(grid, axis=(2, 4)).reshape(I, m * m, E).astype(x_IPE.dtype)
        normed_IME = layers.rms_norm(pooled_IME, p["norm"]["scale"], v.norm_eps, plus_one=True)
        return layers.dot("IME,ED->IMD", normed_IME, p["proj"])


def place(x_BTD: jax.Array, tokens_BT: jax.Array, soft_IMD: jax.Array, image_token_id: int) -> jax.Array:
    """The embeddings with the image tokens' rows replaced by the soft tokens, in order over the batch's rows
    (image i's M tokens are the i-th run of M image tokens). A prompt whose image tokens outnumber the soft tokens
    repeats the last image's last soft token."""
    B, T, D = x_BTD.shape
    is_image_BT = tokens_BT == image_token_id
    soft_XD = soft_IMD.reshape(-1, D).astype(x_BTD.dtype)
    index_BT = jnp.cumsum(is_image_BT.reshape(-1)).reshape(B, T) - 1
    index_BT = jnp.clip(index_BT, 0, soft_XD.shape[0] - 1)
    return jnp.where(is_image_BT[..., None], jnp.take(soft_XD, index_BT, axis=0), x_BTD)


def reach(tokens_BT: jax.Array, positions_BT: jax.Array, image_token_id: int) -> jax.Array:
    """The last key position each query may see [B, T]: its own, but for an image token the position of its
    image's last token, so the tokens of one image see each other (Gemma 3), and earlier tokens causally."""
    T = tokens_BT.shape[1]
    is_image_BT = tokens_BT == image_token_id
    at_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), tokens_BT.shape)
    # The first text token at or after each index; an image's tokens all find the one after its last.
    after_BT = jax.lax.cummin(jnp.where(is_image_BT, T, at_BT), axis=1, reverse=True)
    last_BT = jnp.take_along_axis(positions_BT, jnp.minimum(after_BT - 1, T - 1), axis=1)
    return jnp.where(is_image_BT, last_BT, positions_BT)


def as_input(images, cfg: ModelConfig, token_rows=None):
    """A caller's images as the forward pass takes them (each tower's as_input; transformer.tower): here one
    float32 array [n, side, side, 3] (Gemma 3; Llama 4's tiles)."""
    return np.asarray(images, np.float32)


def images_in(p: dict, x_BTD, tokens_BT, positions_BT, images, cfg: ModelConfig):
    """What a prompt's images give the language model (transformer.with_images): the embeddings with the soft
    tokens placed, each token's reach (an image's tokens see one another), no M-RoPE positions, no deepstack."""
    image_token = cfg.vision.image_token_id
    return (place(x_BTD, tokens_BT, encode(p, images, cfg), image_token),
            reach(tokens_BT, positions_BT, image_token), None, None)


def describe(cfg: ModelConfig) -> str:
    """One line for `jaxlm describe`: the tower's shape and weights."""
    v = cfg.vision
    return (f"vision tower {count(specs(cfg)):,} parameters: {v.n_layers} layers, width {v.d_model}, {v.n_heads} "
            f"heads of {v.hd}, MLP {v.d_ff}; {v.image_size}x{v.image_size} images in {v.patch_size}-pixel patches "
            f"({v.patches_per_side ** 2}), pooled to {v.tokens_per_image} soft tokens of width {cfg.d_model}")
