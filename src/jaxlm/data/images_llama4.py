"""Images in for Llama 4 (docs/vision.md): preprocessed as transformers' Llama4ImageProcessor does, with Pillow. The
image (RGB as data/images.py makes it) is fitted to the best canvas of up to `max_tiles` square tiles, resized
without distortion (never upscaled past one tile side unless smaller) by torch's antialiased bilinear filter in uint8
(int16 weights: it differs from Pillow's by one level in a few percent of pixels), padded with black at right and
bottom, and normalized in bfloat16 as the original implementation; the canvas is cut into tiles row by row, and when there is
more than one a global tile (the whole image squeezed to one tile) follows. Also the prompt's image tokens as
Llama 4's processor lays them out: <|image_start|>, each tile's <|patch|> tokens with <|tile_x_separator|> between
tiles of a row and <|tile_y_separator|> after each row, then <|image|> and the global tile's, <|image_end|>."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxlm.data import hf_folder, images
from jaxlm.data.images import ImageError

MARKER, SEP_X, SEP_Y = "<|image|>", "<|tile_x_separator|>", "<|tile_y_separator|>"


@dataclass(frozen=True)
class TileProcessor:
    """The settings of Llama 4's preprocessor_config.json (its defaults are the released models')."""
    size: int = 336
    max_tiles: int = 16
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale: float = 1 / 255
    resize_to_max_canvas: bool = False

    @classmethod
    def from_hf(cls, hf: dict, base: TileProcessor | None = None) -> TileProcessor:
        """From an image processor's settings, a key they lack taking `base`'s value (default: the released
        models'); what the processor cannot do (no resize, oblong tiles) is refused."""
        b = base or cls()
        size = hf.get("size") or {"height": b.size, "width": b.size}
        if not isinstance(size, dict) or size.get("height") != size.get("width"):
            raise ImageError(f"image processor size={size!r} is not supported (square tiles only)")
        for key in ("do_resize", "do_rescale", "do_normalize"):
            if hf.get(key) is False:
                raise ImageError(f"image processor {key}=false is not supported")
        if hf.get("resample", 2) != 2:
            raise ImageError(f"image processor resample={hf['resample']} is not supported (2: bilinear)")
        return cls(size=int(size["height"]), max_tiles=int(hf.get("max_patches", b.max_tiles)),
                   mean=tuple(hf.get("image_mean", b.mean)), std=tuple(hf.get("image_std", b.std)),
                   rescale=float(hf.get("rescale_factor", b.rescale)),
                   resize_to_max_canvas=bool(hf.get("resize_to_max_canvas", b.resize_to_max_canvas)))

    @classmethod
    def of_folder(cls, folder: Path | None, size: int) -> TileProcessor:
        """A model folder's image processor settings (data/hf_folder.py: processor_config.json, else
        preprocessor_config.json), the released models' where a key is missing (tiles of `size`); a folder with
        neither file is refused in one line."""
        return cls.from_hf(hf_folder.image_settings(folder)[0], cls(size=size))


def canvases(max_tiles: int) -> list[tuple[int, int]]:
    """Every (rows, columns) of at most max_tiles tiles, in the processor's order (grouped by aspect ratio as first
    met, from the most tiles down), which breaks its ties."""
    groups: dict[float, list] = {}
    for n in range(max_tiles, 0, -1):
        for rows in sorted(d for d in range(1, n + 1) if n % d == 0):
            groups.setdefault(rows / (n // rows), []).append((rows, n // rows))
    return [c for group in groups.values() for c in group]


def best_fit(height: int, width: int, p: TileProcessor) -> tuple[int, int]:
    """The canvas (rows, columns) an image goes to: the least upscaling of those that upscale (or the most with
    resize_to_max_canvas), else the least downscaling; among equals the smallest. Scales in float32 as transformers
    computes them."""
    options = canvases(p.max_tiles)
    sizes = np.array(options, np.float32) * np.float32(p.size)
    scales = np.minimum(sizes[:, 0] / np.float32(height), sizes[:, 1] / np.float32(width))
    up = scales[scales >= 1]
    chosen = (up.max() if p.resize_to_max_canvas else up.min()) if len(up) else scales[scales < 1].max()
    candidates = [c for c, s in zip(options, scales) if s == chosen]
    return min(candidates, key=lambda c: c[0] * c[1])  # min keeps the first of equal areas, as argmin


def fitted_size(height: int, width: int, canvas: tuple[int, int], p: TileProcessor) -> tuple[int, int]:
    """(height, width) the image is resized to inside its canvas, keeping its aspect ratio. transformers mixes a
    tensor (the canvas side, float32 arithmetic) and Python ints (float64) here; each ratio follows its operands."""
    target = [(c * p.size, True) for c in canvas]
    if not p.resize_to_max_canvas:  # never upscale past one tile side, unless smaller than it
        target = [(side, True) if side < max(n, p.size) else (max(n, p.size), False)
                  for (side, _), n in zip(target, (height, width))]
    (th, h_f32), (tw, w_f32) = target

    def scale(t, n, f32):
        return np.float32(t) / np.float32(n) if f32 else t / n

    sw, sh = scale(tw, width, w_f32), scale(th, height, h_f32)
    if sw < sh:
        new_h = math.floor(np.float32(height) * sw if w_f32 else height * sw)
        return max(min(new_h, th), 1), max(tw, 1)
    new_w = math.floor(np.float32(width) * sh if h_f32 else width * sh)
    return max(th, 1), max(min(new_w, tw), 1)


def _filter(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, int]:
    """torch's antialiased bilinear weights of one axis in fixed point: the input index of each output's window
    [n_out, K], their int16 weights [n_out, K] (0 past the window) and the bits of precision."""
    scale = n_in / n_out
    support, inv = (scale, 1 / scale) if scale >= 1 else (1.0, 1.0)
    rows = []
    for i in range(n_out):
        center = scale * (i + 0.5)
        lo, hi = max(int(center - support + 0.5), 0), min(int(center + support + 0.5), n_in)
        w = np.maximum(0.0, 1 - np.abs((np.arange(lo, hi) - center + 0.5) * inv))
        rows.append((lo, w / w.sum() if w.sum() else w))
    k = max(len(w) for _, w in rows)
    index, weight = np.zeros((n_out, k), np.int64), np.zeros((n_out, k))
    for i, (lo, w) in enumerate(rows):
        index[i] = np.minimum(lo + np.arange(k), n_in - 1)
        weight[i, :len(w)] = w
    bits = 0
    while bits < 22 and int(0.5 + weight.max() * (1 << (bits + 1))) < 1 << 15:
        bits += 1
    return index, np.trunc(0.5 + weight * (1 << bits)).astype(np.int64), bits


def resize(pixels_uint8: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [h, w, 3] resized to [height, width] as torch resizes uint8 images (bilinear, antialiased): a pass
    over the width, then over the height, each rounding to uint8; an axis of unchanged size is not touched."""
    x = pixels_uint8.astype(np.int64)
    for axis, n in ((1, width), (0, height)):
        if x.shape[axis] == n:
            continue
        index, weight, bits = _filter(x.shape[axis], n)
        x = np.moveaxis(x, axis, 0)
        acc = np.full((n, *x.shape[1:]), 1 << (bits - 1), np.int64)
        for j in range(index.shape[1]):
            acc += x[index[:, j]] * weight[:, j].reshape(-1, 1, 1)
        x = np.moveaxis(np.clip(acc >> bits, 0, 255), 0, axis)
    return x.astype(np.uint8)


def normalize(pixels_uint8: np.ndarray, p: TileProcessor) -> np.ndarray:
    """uint8 pixels [..., 3] as the processor leaves them: each step rounded to bfloat16 (times rescale, minus the
    mean, over the std), returned as float32."""
    bf16 = ml_dtypes.bfloat16
    x = (pixels_uint8.astype(np.float32) * np.float32(p.rescale)).astype(bf16)
    x = (x.astype(np.float32) - np.asarray(p.mean, bf16).astype(np.float32)).astype(bf16)
    return (x.astype(np.float32) / np.asarray(p.std, bf16).astype(np.float32)).astype(bf16).astype(np.float32)


def tiles(image, p: TileProcessor = TileProcessor()) -> tuple[np.ndarray, tuple[int, int]]:
    """The tiles [n, size, size, 3] float32 of a Pillow image and its canvas (rows, columns): the canvas's tiles
    row by row, then the global tile when there are several."""
    out, canvas = tiles_uint8(image, p)
    return normalize(out, p), canvas


def tiles_uint8(image, p: TileProcessor = TileProcessor()) -> tuple[np.ndarray, tuple[int, int]]:
    """tiles before normalization: uint8 [n, size, size, 3] and the canvas."""
    image = np.asarray(images.rgb(image), np.uint8)
    height, width = image.shape[:2]
    canvas = best_fit(height, width, p)
    new_h, new_w = fitted_size(height, width, canvas, p)
    rows, cols, s = canvas[0], canvas[1], p.size
    padded = np.zeros((rows * s, cols * s, 3), np.uint8)
    padded[:new_h, :new_w] = resize(image, new_h, new_w)
    out = padded.reshape(rows, s, cols, s, 3).transpose(0, 2, 1, 3, 4).reshape(rows * cols, s, s, 3)
    if rows * cols > 1:
        out = np.concatenate([out, resize(image, s, s)[None]])
    return out, canvas


def pixels(sources: list, p: TileProcessor = TileProcessor(),
           max_pixels: int = images.MAX_PIXELS) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """The images at `sources` (paths or data URLs) as all their tiles in order [n, size, size, 3], and each
    image's canvas (prompt_text lays the tokens out from them)."""
    out = [tiles(images.load(s, max_pixels), p) for s in sources]
    if not out:
        return np.zeros((0, p.size, p.size, 3), np.float32), []
    return np.concatenate([t for t, _ in out]), [c for _, c in out]


def image_tokens(canvas: tuple[int, int], tok, vision) -> str:
    """One image's text as Llama 4's processor writes it (tokens_per_image <|patch|> tokens a tile)."""
    start, patch, end = (tok.decode([i]) for i in (vision.boi_token_id, vision.image_token_id, vision.eoi_token_id))
    tile = patch * vision.tokens_per_image
    rows, cols = canvas
    grid = "".join(SEP_X.join([tile] * cols) + SEP_Y for _ in range(rows)) if rows * cols > 1 else ""
    return f"{start}{grid}{MARKER}{tile}{end}"


def prompt_text(text: str, tok, vision, canvases_: list[tuple[int, int]]) -> str:
    """The prompt text with each <|image|> marker (or, when it holds none, one per image before it) replaced by its
    image's tokens. Encode the result with the special tokens recognized (Tokenizer.encode_rendered)."""
    if MARKER not in text:
        text = MARKER * len(canvases_) + text
    parts = text.split(MARKER)
    if len(parts) - 1 != len(canvases_):
        raise ImageError(f"the prompt marks {len(parts) - 1} image(s) with {MARKER} but {len(canvases_)} image(s) "
                         "were given")
    return parts[0] + "".join(image_tokens(c, tok, vision) + rest for c, rest in zip(canvases_, parts[1:]))
