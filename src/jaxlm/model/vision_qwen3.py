"""Qwen3-VL's vision tower: patches of any grid embedded by one matmul with a bias, plus learned positions (a
square grid bilinearly resampled to the image's patch grid), pre-LayerNorm blocks (model/vision.py's, with the 2D
rotary of model/vision_qwen.py) attending over the whole frame, the 2x2 patch merger; and deepstack: the patches
after each of `deepstack_layers`, merged by a merger of their own (LayerNorm after the 2x2 concatenation), which
the language model adds at the image tokens after its first layers (model/transformer.py). The M-RoPE positions
and the checks of a prompt's images are Qwen2.5-VL's (vision_qwen.rope_positions, vision_qwen.check).

Shape legend: G patches of a frame, Q values per patch, E tower width, U merge^2 E, M soft tokens, X soft tokens
of all images, D language model width, S deepstack layers, I frames of an image.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm.config import ModelConfig
from jaxlm.model import layers, vision, vision_qwen
from jaxlm.params import ParamSpec, count, normal, ones, zeros

NORM_EPS = 1e-6  # the tower's and the mergers' LayerNorms (fixed in Qwen3-VL, not read from its config)


def merger_specs(cfg: ModelConfig, stacked: tuple = (), norm_width: int | None = None) -> dict:
    """A patch merger's weights (stacked over `stacked` leading axes): its LayerNorm over norm_width (the tower's
    width before the 2x2 concatenation, or U after it), then U -> U -> D with biases."""
    v, dt, w = cfg.vision, cfg.param_dtype, normal(cfg.init_std)
    U, lead = v.spatial_merge ** 2 * v.d_model, (None,) * len(stacked)
    n = norm_width or v.d_model
    return {"norm": {"scale": ParamSpec((*stacked, n), (*lead, "embed"), ones, dt),
                     "bias": ParamSpec((*stacked, n), (*lead, "embed"), zeros, dt)},
            "up": ParamSpec((*stacked, U, U), (*lead, None, "mlp"), w, dt),
            "up_bias": ParamSpec((*stacked, U), (*lead, "mlp"), zeros, dt),
            "down": ParamSpec((*stacked, U, cfg.d_model), (*lead, "mlp", "embed"), w, dt),
            "down_bias": ParamSpec((*stacked, cfg.d_model), (*lead, "embed"), zeros, dt)}


def specs(cfg: ModelConfig) -> dict:
    """The tower's weights; stacked layer axes are unsharded (pipeline stages split the language model only)."""
    v, dt, w = cfg.vision, cfg.param_dtype, normal(cfg.init_std)
    Q, U = vision.CHANNELS * v.temporal_patch * v.patch_size ** 2, v.spatial_merge ** 2 * v.d_model
    return {"patch": ParamSpec((Q, v.d_model), (None, "embed"), w, dt),
            "patch_bias": ParamSpec((v.d_model,), ("embed",), zeros, dt),
            "positions": ParamSpec((v.position_embeddings, v.d_model), (None, "embed"), w, dt),
            "layers": vision.layer_specs(cfg), "merger": merger_specs(cfg),
            "deepstack": merger_specs(cfg, (len(v.deepstack),), U)}


def position_taps(h: int, w: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """The learned positions of a [h, w] patch grid as a bilinear resampling (corners aligned) of the [side, side]
    table: per patch row-major, its 4 table rows [h w, 4] and their weights [h w, 4] (float32, as transformers)."""
    def axis(n):
        src = np.arange(n, dtype=np.float32) * np.float32(side - 1) / np.float32(max(n - 1, 1))
        floor = np.floor(src)
        taps = np.clip(floor.astype(np.int64)[:, None] + np.arange(2), 0, side - 1)
        weights = np.clip(1 - np.abs(src[:, None] - floor[:, None] - np.arange(2, dtype=np.float32)), 0, None)
        return taps, weights.astype(np.float32)

    (rt, rw), (ct, cw) = axis(h), axis(w)
    taps = (rt[:, None, :, None] * side + ct[None, :, None, :]).reshape(h * w, 4)
    weights = (rw[:, None, :, None] * cw[None, :, None, :]).reshape(h * w, 4)
    return taps, weights


def merge(p: dict, x_IGE: jax.Array, grid: tuple | None, cfg: ModelConfig, post_norm: bool) -> jax.Array:
    """A patch merger: each merge x merge square of patches concatenated (row by row) into one row [M, U], the
    LayerNorm before (over E) or after (over U, post_norm: the deepstack mergers), then a GELU MLP to [M, D].
    grid None: padded images [I, P, E] -> [I, P / merge^2, D]."""
    m, E = cfg.vision.spatial_merge, x_IGE.shape[-1]
    norm = lambda x: layers.layer_norm(x, p["norm"]["scale"], p["norm"]["bias"], NORM_EPS)  # noqa: E731
    with jax.named_scope("merger"):
        x = x_IGE if post_norm else norm(x_IGE)
        if grid is None:  # padded images [I, P, E]: the patches already in the processor's order
            x_MU = x.reshape(x.shape[0], -1, m * m * E)
        else:
            t, h, w = grid
            x = x.reshape(t, h // m, m, w // m, m, E).transpose(0, 1, 3, 2, 4, 5)
            x_MU = x.reshape(t * (h // m) * (w // m), m * m * E)
        return vision_qwen.merger_mlp(p, norm(x_MU) if post_norm else x_MU)


def encode_one(p: dict, patches_thwQ: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """The soft tokens [M, D] of one image's patch grid [t, h, w, Q] (merged cells row-major, frame after frame)
    and its deepstack features [S, M, D], in the compute dtype. Each frame attends over itself."""
    v, cdt = cfg.vision, jnp.dtype(cfg.compute_dtype)
    t, h, w, Q = patches_thwQ.shape
    angles = jnp.asarray(vision_qwen.grid_constants(1, h, w, cfg)[0])
    taps, weights = position_taps(h, w, round(v.position_embeddings ** 0.5))
    positions_GE = jnp.einsum("GkE,Gk->GE", jnp.take(p["positions"], jnp.asarray(taps), axis=0).astype(jnp.float32),
                              jnp.asarray(weights))
    x_IGE = layers.dot("IGQ,QE->IGE", patches_thwQ.reshape(t, h * w, Q).astype(cdt), p["patch"])
    x_IGE = x_IGE + p["patch_bias"].astype(cdt) + positions_GE.astype(cdt)
    return tower(p, x_IGE, angles, (t, h, w), cfg)


def tower(p: dict, x_IGE, angles, grid: tuple | None, cfg: ModelConfig, mask_IGG=None, pinned: bool = False):
    """The blocks over embedded patches [I, G, E] (frames of one image, or padded images: grid None, with their
    mask), scanned in segments that end at a deepstack layer: the soft tokens [.., M, D] and deepstack features
    [S, .., M, D]."""
    v = cfg.vision

    def rotate(q, k):  # angles [G, H/2] broadcast over the frames, or [I, G, H/2] per padded image
        return vision_qwen.rotate(q, angles), vision_qwen.rotate(k, angles)

    def blocks(x, layers_):
        return vision.encoder(x, layers_, cfg, rotate, pinned, mask_IGG)

    features, start = [], 0
    for s, end in enumerate(v.deepstack):
        x_IGE = blocks(x_IGE, jax.tree.map(lambda a: a[start:end + 1], p["layers"]))
        features.append(merge(jax.tree.map(lambda a: a[s], p["deepstack"]), x_IGE, grid, cfg, post_norm=True))
        start = end + 1
    if start < v.n_layers:
        x_IGE = blocks(x_IGE, jax.tree.map(lambda a: a[start:], p["layers"]))
    soft_MD = merge(p["merger"], x_IGE, grid, cfg, post_norm=False)
    return soft_MD, jnp.stack(features) if features else jnp.zeros((0, *soft_MD.shape), soft_MD.dtype)


def padded_positions(table_RE: jax.Array, row_IP, col_IP, grid_I2, side: int) -> jax.Array:
    """position_taps in-graph for padded images: each patch slot's learned position [I, P, E] (float32), the
    table's bilinear resampling at its row and column of its image's grid."""
    def axis(at_IP, n_I1):
        src = at_IP.astype(jnp.float32) * np.float32(side - 1) / jnp.maximum(n_I1 - 1, 1).astype(jnp.float32)
        floor = jnp.floor(src)
        taps = jnp.clip(floor.astype(jnp.int32)[..., None] + jnp.arange(2), 0, side - 1)
        return taps, jnp.clip(1 - jnp.abs(src[..., None] - floor[..., None] - jnp.arange(2, dtype=jnp.float32)), 0)

    (rt, rw), (ct, cw) = axis(row_IP, grid_I2[:, :1]), axis(col_IP, grid_I2[:, 1:])
    I, P = row_IP.shape
    taps = (rt[..., :, None] * side + ct[..., None, :]).reshape(I, P, 4)
    weights = (rw[..., :, None] * cw[..., None, :]).reshape(I, P, 4)
    return jnp.einsum("IPkE,IPk->IPE", jnp.take(table_RE, taps, axis=0).astype(jnp.float32), weights)


def encode_padded(p: dict, images: dict, cfg: ModelConfig):
    """The soft tokens [I, M, D] of padded images (vision_qwen.py), their deepstack features [S, I, M, D] and which
    soft tokens are an image's [I, M]; equal to encode_one's at each image's grid."""
    v, cdt = cfg.vision, jnp.dtype(cfg.compute_dtype)
    patches_IPQ, grid_I2 = images["patches"], images["grid"].astype(jnp.int32)
    P = patches_IPQ.shape[1]
    row, col, valid_IP = vision_qwen.padded_layout(grid_I2, P, cfg)
    mask_IPP = vision_qwen.padded_masks(row, col, valid_IP, grid_I2, cfg)[0]
    positions_IPE = padded_positions(p["positions"], row, col, grid_I2, round(v.position_embeddings ** 0.5))
    with jax.named_scope("vision"):
        x_IPE = layers.dot("IPQ,QE->IPE", patches_IPQ.astype(cdt), p["patch"])
        x_IPE = x_IPE + p["patch_bias"].astype(cdt) + positions_IPE.astype(cdt)
        soft_IMD, deep_SIMD = tower(p, x_IPE, vision_qwen.padded_angles(row, col, cfg), None, cfg, mask_IPP,
                                    pinned=True)
    return soft_IMD, deep_SIMD, valid_IP[:, ::v.spatial_merge ** 2]


def encode(p: dict, images: tuple, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """The soft tokens [X, D] of all images (patch grids [t, h, w, Q]) in order and their deepstack features
    [S, X, D]."""
    with jax.named_scope("vision"):
        soft, deep = zip(*(encode_one(p, image, cfg) for image in images))
        return jnp.concatenate(soft, axis=0), jnp.concatenate(deep, axis=1)


def deepstack_addends(deep_SXD: jax.Array, tokens_BT: jax.Array, cfg: ModelConfig) -> jax.Array:
    """What the first S language layers add to their output [S, B, T, D]: the deepstack features at the image
    tokens (in order over the batch's rows, as vision.place), zero elsewhere."""
    B, T = tokens_BT.shape
    zeros_BTD = jnp.zeros((B, T, deep_SXD.shape[-1]), deep_SXD.dtype)
    return jnp.stack([vision.place(zeros_BTD, tokens_BT, d, cfg.vision.image_token_id) for d in deep_SXD])


as_input = vision_qwen.as_input  # patch grids, as Qwen2.5-VL's


def images_in(p: dict, x_BTD, tokens_BT, positions_BT, images, cfg: ModelConfig):
    """transformer.with_images for Qwen3-VL: as Qwen2.5-VL's, and the deepstack addends."""
    if isinstance(images, dict):
        soft_IMD, deep_SIMD, valid_IM = encode_padded(p, images, cfg)
        soft_XD, offsets_X3, advance_X, order = vision_qwen.compacted(soft_IMD, valid_IM, images["grid"], cfg)
        S, I, M, D = deep_SIMD.shape
        deep_SXD = deep_SIMD.reshape(S, I * M, D)[:, order]
        mrope_BT3 = vision_qwen.positions_of(tokens_BT, offsets_X3, advance_X, cfg)
    else:
        soft_XD, deep_SXD = encode(p, images, cfg)
        mrope_BT3 = vision_qwen.rope_positions(tokens_BT, images, cfg)
    return (vision.place(x_BTD, tokens_BT, soft_XD, cfg.vision.image_token_id), None, mrope_BT3,
            deepstack_addends(deep_SXD, tokens_BT, cfg))


def describe(cfg: ModelConfig) -> str:
    """One line for `jaxlm describe`: the tower's shape and weights."""
    v = cfg.vision
    return (f"vision tower (Qwen3-VL) {count(specs(cfg)):,} parameters: {v.n_layers} layers, width {v.d_model}, "
            f"{v.n_heads} heads of {v.hd}, MLP {v.d_ff}; images of any size in {v.patch_size}-pixel patches, "
            f"{v.spatial_merge}x{v.spatial_merge} merged into soft tokens of width {cfg.d_model}; deepstack from "
            f"layers {v.deepstack_layers or 'none'}; M-RoPE {v.mrope} (interleaved: {v.mrope_interleaved})")
