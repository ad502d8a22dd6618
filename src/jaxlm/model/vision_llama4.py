"""Llama 4's vision tower and projector (model.vision.kind = "llama4"; docs/vision.md): each tile of an image is
cut into patches embedded by one matmul (HF's unfold + linear), a class token is appended, learned positions
added and a LayerNorm applied; pre-LayerNorm blocks attend bidirectionally with a 2D rotary over the patch grid
(the class token unturned); after a last LayerNorm the class token is dropped, the grid pixel-shuffled (each
k x k square of patches one token of k^2 times the width), passed through a two-layer GELU adapter and projected
to the language model's width. A tile's soft tokens replace its image tokens in the prompt, attended causally;
training batches pad each image to K tile slots ({"tiles", "canvas"}: encode_padded, one program for any canvas).

Legend: I tiles (padded: images), K tile slots an image, S tile side, C channels, P patches a tile (+1: the class
token), Q values a patch, E tower width, N heads, H head width, A adapter width, M soft tokens a tile, D text width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm.config import ModelConfig
from jaxlm.model import layers, vision
from jaxlm.params import ParamSpec, count, normal


def specs(cfg: ModelConfig) -> dict:
    """The tower's weights; as in vision.specs, the stacked layer axis is not split over pipeline stages."""
    v, dt = cfg.vision, cfg.param_dtype
    E, A, Q, P = v.d_model, v.projector_dim, v.patch_size ** 2 * vision.CHANNELS, v.patches_per_side ** 2
    k = shuffle(cfg)
    w = normal(cfg.init_std)
    return {
        "patch": ParamSpec((Q, E), (None, "embed"), w, dt),
        "class_token": ParamSpec((E,), ("embed",), w, dt),
        "positions": ParamSpec((P + 1, E), (None, "embed"), w, dt),
        "pre_norm": vision.layer_norm_specs(cfg, (E,), ("embed",)),
        "layers": vision.layer_specs(cfg),
        "post_norm": vision.layer_norm_specs(cfg, (E,), ("embed",)),
        "adapter": {"up": ParamSpec((k * k * E, A), ("embed", "mlp"), w, dt),
                    "down": ParamSpec((A, A), ("mlp", None), w, dt)},
        "projector": {"proj": ParamSpec((A, cfg.d_model), (None, "embed"), w, dt)},
    }


def shuffle(cfg: ModelConfig) -> int:
    """The side k of the square of patches that the pixel shuffle makes one soft token (HF ratio 1/k)."""
    v = cfg.vision
    return v.patches_per_side // round(v.tokens_per_image ** 0.5)


def rotary_angles(cfg: ModelConfig) -> np.ndarray:
    """The angle of each pair of a head's dimensions at each position [P + 1, H / 2] (numpy float32, a constant):
    the first half of the pairs turns by (column + 1) times the frequencies, the second half by (row + 1); the class
    token, last, not at all."""
    v = cfg.vision
    n, H = v.patches_per_side, v.hd
    freqs = 1.0 / (np.float32(v.rope_theta) ** (np.arange(0, H // 2, 2)[: H // 4].astype(np.float32) / (H // 2)))
    grid = np.arange(n * n)
    x = ((grid % n + 1)[:, None] * freqs[None]).astype(np.float32)
    y = ((grid // n + 1)[:, None] * freqs[None]).astype(np.float32)
    return np.concatenate([np.concatenate([x, y], axis=1), np.zeros((1, H // 2), np.float32)], axis=0)


def rotate(angles_PH: np.ndarray):
    """Queries and keys [I, P, N, H] turned over adjacent pairs (2i, 2i + 1) of each head (HF's complex layout),
    in float32."""
    cos, sin = np.cos(angles_PH)[None, :, None], np.sin(angles_PH)[None, :, None]

    def turn(x):
        pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
        re, im = pairs[..., 0], pairs[..., 1]
        out = jnp.stack([re * cos - im * sin, re * sin + im * cos], axis=-1)
        return out.reshape(x.shape).astype(x.dtype)

    return lambda q, k: (turn(q), turn(k))


def encode(p: dict, pixels_ISSC: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The soft tokens [I, M, D] of tiles [I, S, S, C] (preprocessed: data/images_llama4.py), in the compute
    dtype."""
    v = cfg.vision
    cdt = jnp.dtype(cfg.compute_dtype)
    I = pixels_ISSC.shape[0]
    with jax.named_scope("vision"):
        x_IPQ = vision.patches(pixels_ISSC.astype(cdt), v.patch_size)
        x_IPE = layers.dot("IPQ,QE->IPE", x_IPQ, p["patch"])
        cls_IPE = jnp.broadcast_to(p["class_token"].astype(cdt), (I, 1, v.d_model))
        x_IPE = jnp.concatenate([x_IPE, cls_IPE], axis=1) + p["positions"].astype(cdt)
        x_IPE = layers.layer_norm(x_IPE, p["pre_norm"]["scale"], p["pre_norm"]["bias"], v.norm_eps)
        x_IPE = vision.encoder(x_IPE, p["layers"], cfg, rotate(rotary_angles(cfg)))
        x_IPE = layers.layer_norm(x_IPE, p["post_norm"]["scale"], p["post_norm"]["bias"], v.norm_eps)
        return project(p, x_IPE[:, :-1], cfg)


def project(p: dict, x_IPE: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Patches [I, P, E] pixel-shuffled (each k x k square of the grid one row of k^2 E values, row-major over
    the square, as HF's pixel_shuffle orders them), through the GELU adapter (GELU after both layers) and projected
    to [I, M, D]."""
    v = cfg.vision
    I, _, E = x_IPE.shape
    n = v.patches_per_side
    act = layers.Activation(v.activation, False)
    with jax.named_scope("projector"):
        x_IMR = vision.patches(x_IPE.reshape(I, n, n, E), shuffle(cfg))
        h_IMA = act(layers.dot("IMR,RA->IMA", x_IMR, p["adapter"]["up"]))
        h_IMA = act(layers.dot("IMA,AB->IMB", h_IMA, p["adapter"]["down"]))
        return layers.dot("IMA,AD->IMD", h_IMA, p["projector"]["proj"])


as_input = vision.as_input  # tiles [n, side, side, 3], as Gemma 3's images


def images_in(p: dict, x_BTD, tokens_BT, positions_BT, images, cfg: ModelConfig):
    """transformer.with_images for Llama 4: the tiles' soft tokens placed (of a caller's tiles [n, S, S, C], or of
    padded images, compacted); its image tokens attend causally (no reach), as transformers' Llama 4 does."""
    soft = compacted(*encode_padded(p, images, cfg)) if isinstance(images, dict) else encode(p, images, cfg)
    return vision.place(x_BTD, tokens_BT, soft, cfg.vision.image_token_id), None, None, None


# ---- padded images: any canvas within K tiles, one program (training batches, data/train_images.py) -------------

def tile_counts(canvas_I2: jax.Array) -> jax.Array:
    """The tiles of each image [I] of canvases (rows, columns): its own, then the global tile when there are several;
    an empty slot (0 x 0) none."""
    n_I = canvas_I2[:, 0] * canvas_I2[:, 1]
    return jnp.where(n_I > 1, n_I + 1, n_I)


def encode_padded(p: dict, images: dict, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """The soft tokens [I, K, M, D] of padded images {"tiles": [I, K, S, S, C], "canvas": [I, 2]} and which tiles
    are an image's [I, K]. Every slot goes through the tower (static shapes); tiles never attend to one another, so
    the padding changes no image's tokens."""
    tiles, canvas_I2 = images["tiles"], images["canvas"].astype(jnp.int32)
    I, K = tiles.shape[:2]
    soft = encode(p, tiles.reshape(I * K, *tiles.shape[2:]), cfg)
    return soft.reshape(I, K, *soft.shape[1:]), jnp.arange(K, dtype=jnp.int32)[None] < tile_counts(canvas_I2)[:, None]


def compacted(soft_IKMD: jax.Array, valid_IK: jax.Array) -> jax.Array:
    """The images' soft tokens [I K M, D] with those of their tiles first, in order (what vision.place takes)."""
    I, K, M, D = soft_IKMD.shape
    keep = jnp.broadcast_to(valid_IK[:, :, None], (I, K, M)).reshape(-1)
    return soft_IKMD.reshape(I * K * M, D)[jnp.argsort(~keep, stable=True)]


def describe(cfg: ModelConfig) -> str:
    """One line for `jaxlm describe`: the tower's shape and weights."""
    v = cfg.vision
    k = shuffle(cfg)
    return (f"vision tower (llama4) {count(specs(cfg)):,} parameters: {v.n_layers} layers, width {v.d_model}, "
            f"{v.n_heads} heads of {v.hd} (2D rotary, base {v.rope_theta:g}), MLP {v.d_ff}; {v.image_size}x"
            f"{v.image_size} tiles in {v.patch_size}-pixel patches ({v.patches_per_side ** 2} and a class token), "
            f"pixel-shuffled {k}x{k} to {v.tokens_per_image} soft tokens per tile, adapter {v.projector_dim}, "
            f"projected to width {cfg.d_model}")
