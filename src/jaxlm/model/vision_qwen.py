"""Qwen2.5-VL's vision tower and where its soft tokens go: patches of any grid embedded by one matmul (the
checkpoint's Conv3d over temporal_patch frames), pre-RMSNorm blocks (attention with 2D rotary and biases, a
SwiGLU MLP with biases) that attend within windows except on `full_attention_layers`, the 2x2 patch merger to the
language model's width, and the M-RoPE positions [B, T, 3] of a prompt's tokens (model/layers.rotary).

Images are a tuple of patch grids [t, h, w, Q] (data/images_qwen.py), each its own static shape (a new grid compiles
the tower again), or, for training, padded: {"patches": [I, P, Q] in the processor's order, "grid": [I, 2]}, any
grid within P patches in one program (the layout, masks and positions computed in-graph from the grid). Legend: G
patches of an image, P patch slots, Q values per patch, E tower width, N heads, H head width, F MLP width, L layers,
M soft tokens of an image, X of all images, U merge^2 E, D language model width, B batch, T length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm.config import ModelConfig
from jaxlm.model import attention, layers, vision
from jaxlm.params import ParamSpec, count, normal, ones, zeros
from jaxlm.sharding import constrain

CHANNELS = 3
NORM_EPS = 1e-6  # the tower's and the merger's RMSNorms (fixed in Qwen2.5-VL, not read from its config)
ROPE_THETA = 10000.0


def specs(cfg: ModelConfig) -> dict:
    """The tower's weights; the stacked layer axis is unsharded (pipeline stages split the language model only)."""
    v, dt = cfg.vision, cfg.param_dtype
    E = v.d_model
    Q, U = CHANNELS * v.temporal_patch * v.patch_size ** 2, v.spatial_merge ** 2 * v.d_model
    w = normal(cfg.init_std)

    def weight(shape, axes, out_shape, out_axes):
        return ParamSpec(shape, axes, w, dt), ParamSpec(out_shape, out_axes, zeros, dt)

    merger = {"norm": {"scale": ParamSpec((E,), ("embed",), ones, dt)}}
    merger["up"], merger["up_bias"] = weight((U, U), (None, "mlp"), (U,), ("mlp",))
    merger["down"], merger["down_bias"] = weight((U, cfg.d_model), ("mlp", "embed"), (cfg.d_model,), ("embed",))
    return {"patch": ParamSpec((Q, E), (None, "embed"), w, dt),
            "layers": vision.layer_specs(cfg, gated=True, rms=True),
            "merger": merger}


def grid_constants(t: int, h: int, w: int, cfg: ModelConfig):
    """Numpy constants of a [t, h, w] patch grid (row-major): the rotary angles [G, H/2] (the first H/4 pairs by
    the patch's row, the rest by its column), and the masks [G, G] of full attention (the same frame) and of
    windowed attention (the same frame and window of window_size pixels a side)."""
    v = cfg.vision
    frame, row, col = (a.reshape(-1) for a in np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij"))
    inv_freq = _inv_freq(cfg)
    angles = np.concatenate([row[:, None] * inv_freq, col[:, None] * inv_freq], axis=1).astype(np.float32)
    cells = v.window_size // v.patch_size  # patches a window side
    window = frame * (h * w) + (row // cells) * w + col // cells
    full = frame[:, None] == frame[None, :]
    return angles, full, full & (window[:, None] == window[None, :])


def _inv_freq(cfg: ModelConfig) -> np.ndarray:
    quarter = cfg.vision.hd // 2
    return 1.0 / (ROPE_THETA ** (np.arange(0, quarter, 2, dtype=np.float32) / quarter))


def rotate(x_GNH, angles_Gh):
    """The rotate-half rotary of the tower (float32, as transformers); x [..., G, N, H], angles [..., G, H/2]."""
    H = x_GNH.shape[-1]
    cos, sin = jnp.cos(angles_Gh)[..., None, :], jnp.sin(angles_Gh)[..., None, :]
    cos, sin = jnp.concatenate([cos, cos], -1), jnp.concatenate([sin, sin], -1)
    x = x_GNH.astype(jnp.float32)
    turned = jnp.concatenate([-x[..., H // 2:], x[..., : H // 2]], axis=-1)
    return (x * cos + turned * sin).astype(x_GNH.dtype)


def _layer(x_GE, p, mask_GG, angles_Gh):
    """One pre-RMSNorm block: attention over the patches mask_GG allows, then the SwiGLU MLP."""
    with jax.named_scope("vision_attn_block"):
        h = layers.rms_norm(x_GE, p["attn_norm"]["scale"], NORM_EPS)
        a = p["attn"]
        q, k, v = (layers.dot("GE,ENH->GNH", h, a[n]) + a[f"{n}_bias"].astype(h.dtype) for n in ("q", "k", "v"))
        q, k = rotate(q, angles_Gh), rotate(k, angles_Gh)
        out_GNH = attention.attend(q[None], k[None], v[None], mask_GG[None])[0]
        x_GE = x_GE + layers.dot("GNH,NHE->GE", out_GNH, a["o"]) + a["o_bias"].astype(h.dtype)
    with jax.named_scope("vision_mlp_block"):
        h = layers.rms_norm(x_GE, p["mlp_norm"]["scale"], NORM_EPS)
        m = p["mlp"]
        gate = layers.dot("GE,EF->GF", h, m["gate"]) + m["gate_bias"].astype(h.dtype)
        up = layers.dot("GE,EF->GF", h, m["up"]) + m["up_bias"].astype(h.dtype)
        return x_GE + layers.dot("GF,FE->GE", jax.nn.silu(gate) * up, m["down"]) + m["down_bias"].astype(h.dtype)


def encode_one(p: dict, patches_thwQ: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The soft tokens [M, D] of one image's patch grid [t, h, w, Q], in the compute dtype, in the order of its
    image tokens: merged cells row-major, frame after frame."""
    v, cdt = cfg.vision, jnp.dtype(cfg.compute_dtype)
    t, h, w, Q = patches_thwQ.shape
    angles, full, window = grid_constants(t, h, w, cfg)
    x_GE = layers.dot("GQ,QE->GE", patches_thwQ.reshape(-1, Q).astype(cdt), p["patch"])
    is_full_L = np.isin(np.arange(v.n_layers), v.full_layers)

    def body(x, scanned):
        p_layer, is_full = scanned
        return _layer(x, p_layer, jnp.where(is_full, full, window), angles), None

    if cfg.remat != "none":
        body = jax.checkpoint(body)
    x_GE, _ = jax.lax.scan(body, x_GE, (p["layers"], is_full_L))
    return merge(p["merger"], x_GE, (t, h, w), cfg)


def merge(p: dict, x_GE: jax.Array, grid: tuple[int, int, int], cfg: ModelConfig) -> jax.Array:
    """The patch merger: RMS-normed patches, each merge x merge square concatenated (row by row) into one row
    [M, merge^2 E], then a GELU MLP to the language model's width [M, D]."""
    m, (t, h, w), E = cfg.vision.spatial_merge, grid, x_GE.shape[-1]
    with jax.named_scope("merger"):
        x = layers.rms_norm(x_GE, p["norm"]["scale"], NORM_EPS).reshape(t, h // m, m, w // m, m, E)
        return merger_mlp(p, x.transpose(0, 1, 3, 2, 4, 5).reshape(t * (h // m) * (w // m), m * m * E))


def merger_mlp(p: dict, x_MU: jax.Array) -> jax.Array:
    """A merger's GELU MLP [..., U] -> [..., D] (both towers)."""
    lead, U = x_MU.shape[:-1], x_MU.shape[-1]
    x_MU = x_MU.reshape(-1, U)
    x_MU = layers.gelu(layers.dot("MU,UV->MV", x_MU, p["up"]) + p["up_bias"].astype(x_MU.dtype))
    x_MD = layers.dot("MU,UD->MD", x_MU, p["down"]) + p["down_bias"].astype(x_MU.dtype)
    return x_MD.reshape(*lead, x_MD.shape[-1])


def encode(p: dict, images: tuple, cfg: ModelConfig) -> jax.Array:
    """The soft tokens [X, D] of all images (patch grids [t, h, w, Q]) in order, one after the other."""
    with jax.named_scope("vision"):
        return jnp.concatenate([encode_one(p, image, cfg) for image in images], axis=0)


def image_offsets(images: tuple, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per soft token of all images in order: its (temporal, height, width) offsets in its image's merged grid
    [X, 3], and the positions its image advances the text after it [X] (at the image's last token, max(h, w) of
    the merged grid as transformers' get_rope_index; 0 elsewhere)."""
    m = cfg.vision.spatial_merge
    offsets, advance = [], []
    for image in images:
        t, h, w = image.shape[0], image.shape[1] // m, image.shape[2] // m
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij"), -1).reshape(-1, 3)
        offsets.append(grid)
        step = np.zeros(len(grid), np.int32)
        step[-1] = max(h, w)
        advance.append(step)
    return np.concatenate(offsets).astype(np.int32), np.concatenate(advance)


def rope_positions(tokens_BT: jax.Array, images: tuple, cfg: ModelConfig) -> jax.Array:
    """The M-RoPE positions [B, T, 3] of a batch whose image tokens hold `images` in order, row after row.

    As transformers' get_rope_index: text tokens count on by one (all three components alike); an image's tokens
    sit at the next position plus their (temporal, height, width) offsets, and the text after it starts max(h, w)
    later. Each row is then shifted so that its tokens after the last image sit at their own index: rotary
    attention sees only differences of positions, so the logits are unchanged, and the decode steps that follow
    the prefill (model/decode.py) rotate by the plain index (all components equal), with no per-row offset."""
    return positions_of(tokens_BT, *image_offsets(images, cfg), cfg)


def positions_of(tokens_BT: jax.Array, offsets_X3, advance_X, cfg: ModelConfig) -> jax.Array:
    """rope_positions from the soft tokens' offsets [X, 3] and advances [X] (image_offsets, padded_offsets)."""
    B, T = tokens_BT.shape
    is_image_BT = tokens_BT == cfg.vision.image_token_id
    index_BT = jnp.clip(jnp.cumsum(is_image_BT.reshape(-1)).reshape(B, T) - 1, 0, len(advance_X) - 1)
    advance_BT = jnp.where(is_image_BT, jnp.asarray(advance_X, jnp.int32)[index_BT], 1)
    start_BT = jnp.cumsum(advance_BT, axis=1) - advance_BT
    offset_BT3 = jnp.where(is_image_BT[..., None], jnp.asarray(offsets_X3, jnp.int32)[index_BT], 0)
    shift_B = jnp.sum(is_image_BT, axis=1) - jnp.sum(jnp.where(is_image_BT, advance_BT, 0), axis=1)
    return (start_BT + shift_B[:, None])[..., None] + offset_BT3


def check(token_rows, images: tuple, cfg: ModelConfig) -> None:
    """One line (ValueError) when the images are not patch grids [t, h, w, Q] this tower takes (h and w multiples
    of the merge, Q its patch's values) or the prompts' image tokens are not their soft tokens in number."""
    v, m = cfg.vision, cfg.vision.spatial_merge
    Q = CHANNELS * v.temporal_patch * v.patch_size ** 2
    for i, g in enumerate(images):
        if g.ndim != 4 or g.shape[1] % m or g.shape[2] % m or g.shape[3] != Q:
            raise ValueError(f"image {i} has shape {g.shape}; this tower takes patch grids [t, h, w, {Q}] with h and w "
                             f"multiples of {m} (data/images_qwen.py)")
    want = sum(g.shape[0] * g.shape[1] * g.shape[2] // m ** 2 for g in images)
    have = sum(int(np.sum(np.asarray(row) == v.image_token_id)) for row in token_rows)
    if have != want:
        raise ValueError(f"the prompts hold {have} image tokens but their {len(images)} image(s) make {want} soft "
                         "tokens (images_qwen.prompt_text writes one per soft token)")


def as_input(images, cfg: ModelConfig, token_rows=None) -> tuple:
    """A caller's images as the forward pass takes them: a tuple of float32 patch grids [t, h, w, Q], each its own
    shape, checked against the image tokens of `token_rows` when given."""
    grids = tuple(np.asarray(image, np.float32) for image in images)
    if token_rows is not None:
        check(token_rows, grids, cfg)
    return grids


def images_in(p: dict, x_BTD, tokens_BT, positions_BT, images, cfg: ModelConfig):
    """transformer.with_images for Qwen2.5-VL: the soft tokens placed, causal attention, the M-RoPE positions."""
    if isinstance(images, dict):
        soft_XD, offsets_X3, advance_X, _ = compacted(*encode_padded(p, images, cfg), images["grid"], cfg)
        return (vision.place(x_BTD, tokens_BT, soft_XD, cfg.vision.image_token_id), None,
                positions_of(tokens_BT, offsets_X3, advance_X, cfg), None)
    return (vision.place(x_BTD, tokens_BT, encode(p, images, cfg), cfg.vision.image_token_id), None,
            rope_positions(tokens_BT, images, cfg), None)


# ---- padded images: any grid within P patches, one program (training batches, data/train_images.py) ------------

def padded_layout(grid_I2: jax.Array, P: int, cfg: ModelConfig):
    """Where the P patch slots of padded images sit. The patches come in the processor's order (each merge x merge
    square's patches together, row by row; the squares row-major over the merged grid), so slot g of an image of
    grid (h, w) patches is at row [I, P] and column [I, P], and valid [I, P] when g < h w."""
    m = cfg.vision.spatial_merge
    h, w = grid_I2[:, :1], grid_I2[:, 1:]
    g = jnp.arange(P, dtype=jnp.int32)[None]
    square, inner, across = g // (m * m), g % (m * m), jnp.maximum(w // m, 1)
    return square // across * m + inner // m, square % across * m + inner % m, g < h * w


def padded_angles(row_IP: jax.Array, col_IP: jax.Array, cfg: ModelConfig) -> jax.Array:
    """grid_constants' rotary angles [I, P, H/2] at each patch slot's row and column."""
    inv = jnp.asarray(_inv_freq(cfg))
    return jnp.concatenate([row_IP[..., None].astype(jnp.float32) * inv,
                            col_IP[..., None].astype(jnp.float32) * inv], axis=-1)


def padded_masks(row_IP, col_IP, valid_IP, grid_I2, cfg: ModelConfig):
    """The attention masks [I, P, P] of full layers (the image's patches) and windowed ones (those of the same
    window too); a padding slot sees only itself, and no patch sees it."""
    cells = cfg.vision.window_size // cfg.vision.patch_size
    window_IP = row_IP // cells * grid_I2[:, 1:] + col_IP // cells
    both = valid_IP[:, :, None] & valid_IP[:, None, :]
    itself = jnp.eye(valid_IP.shape[1], dtype=bool)
    return both | itself, (both & (window_IP[:, :, None] == window_IP[:, None, :])) | itself


def encode_padded(p: dict, images: dict, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """The soft tokens [I, M, D] of padded images (M = P / merge^2) and which are an image's [I, M]; equal to
    encode_one's at each image's grid."""
    v, cdt = cfg.vision, jnp.dtype(cfg.compute_dtype)
    patches_IPQ, grid_I2 = images["patches"], images["grid"].astype(jnp.int32)
    I, P, _ = patches_IPQ.shape
    row, col, valid_IP = padded_layout(grid_I2, P, cfg)
    angles_IPh = padded_angles(row, col, cfg)
    full, window = padded_masks(row, col, valid_IP, grid_I2, cfg)
    layer = jax.vmap(_layer, in_axes=(0, None, 0, 0))

    def body(x, scanned):
        p_layer, is_full = scanned
        y = layer(x, p_layer, jnp.where(is_full, full, window), angles_IPh)
        return constrain(y, ("batch", None, "embed")), None

    if cfg.remat != "none":
        body = jax.checkpoint(body)
    with jax.named_scope("vision"):
        x_IPE = constrain(layers.dot("IPQ,QE->IPE", patches_IPQ.astype(cdt), p["patch"]), ("batch", None, "embed"))
        x_IPE, _ = jax.lax.scan(body, x_IPE, (p["layers"], np.isin(np.arange(v.n_layers), v.full_layers)))
        m2 = v.spatial_merge ** 2
        with jax.named_scope("merger"):
            x_IPE = layers.rms_norm(x_IPE, p["merger"]["norm"]["scale"], NORM_EPS)
            soft_IMD = merger_mlp(p["merger"], x_IPE.reshape(I, P // m2, m2 * x_IPE.shape[-1]))
    return soft_IMD, valid_IP[:, ::m2]


def padded_offsets(grid_I2: jax.Array, M: int, cfg: ModelConfig):
    """image_offsets of padded images: offsets [I, M, 3] and advances [I, M] of each soft token slot."""
    m = cfg.vision.spatial_merge
    h, w = grid_I2[:, :1] // m, grid_I2[:, 1:] // m
    k = jnp.arange(M, dtype=jnp.int32)[None]
    across = jnp.maximum(w, 1)
    offsets = jnp.stack([jnp.zeros_like(k + h), k // across, k % across], axis=-1)
    return offsets, jnp.where(k == h * w - 1, jnp.maximum(h, w), 0)


def compacted(soft_IMD, valid_IM, grid_I2, cfg: ModelConfig):
    """The images' soft tokens [I M, D] with those of the images first, in order (what vision.place takes), their
    M-RoPE offsets [I M, 3] and advances [I M] alike, and that order [I M] (for Qwen3-VL's deepstack features)."""
    I, M, D = soft_IMD.shape
    order = jnp.argsort(~valid_IM.reshape(-1), stable=True)
    offsets_IM3, advance_IM = padded_offsets(grid_I2.astype(jnp.int32), M, cfg)
    return (soft_IMD.reshape(I * M, D)[order], offsets_IM3.reshape(I * M, 3)[order],
            advance_IM.reshape(I * M)[order], order)


def describe(cfg: ModelConfig) -> str:
    """One line for `jaxlm describe`: the tower's shape and weights."""
    v = cfg.vision
    full = ",".join(map(str, v.full_layers)) or "none"
    return (f"vision tower (Qwen2.5-VL) {count(specs(cfg)):,} parameters: {v.n_layers} layers (full attention: "
            f"{full}; the others in {v.window_size}-pixel windows), width {v.d_model}, {v.n_heads} heads of {v.hd}, "
            f"MLP {v.d_ff}; images of any size in {v.patch_size}-pixel patches, {v.spatial_merge}x"
            f"{v.spatial_merge} merged into soft tokens of width {cfg.d_model}; M-RoPE {v.mrope_section}")
