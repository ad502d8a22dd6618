"""What each kind of vision tower (model.vision.kind) needs of an image, in one table that `jaxlm generate --image`
(infer/api.py) and `jaxlm serve` (serve/images.py) both read: its preprocessing (Gemma 3: one square, data/images.py;
Llama 4: tiles, data/images_llama4.py; Qwen2.5-VL / Qwen3-VL: a patch grid, data/images_qwen.py), the marker a prompt
or chat template writes for an image, the prompt's image tokens written out, and the images of several prompts
batched as the forward pass takes them (one array of squares or tiles, or a tuple of patch grids)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from jaxlm.data import images, images_llama4, images_qwen


@dataclass(frozen=True)
class Prepared:
    """One preprocessed image: `pixels` as its tower takes them (Gemma 3 [1, side, side, 3], Llama 4 its tiles
    [n, side, side, 3], Qwen-VL its patch grid [t, h, w, Q]), the image tokens it becomes in a prompt, and its
    layout (Llama 4: the canvas (rows, columns) the prompt's tokens follow; else None)."""
    pixels: np.ndarray
    tokens: int
    layout: tuple | None = None


@dataclass(frozen=True)
class Kind:
    """A tower kind's image handling: `processor(folder, vision)` (the model folder's image processor settings,
    data/hf_folder.py; refused where it has none), `prepare(pil_image, processor, vision)` -> Prepared,
    `marker(tok, vision)` the text that marks an image in a prompt, `expand(text, tok, vision, prepared)` the prompt
    with its images' tokens written in, and `batch(prepared)` the images of a batch (in the order of their tokens)
    as the forward pass takes them; `serve_batch` the same for the server, where one compiled program must serve
    images of many shapes (None: as `batch`)."""
    processor: Callable
    prepare: Callable[..., Prepared]
    marker: Callable
    expand: Callable[..., str]
    batch: Callable[[list[Prepared]], object]
    serve_batch: Callable[[list[Prepared]], object] | None = None

    def for_serving(self, prepared: list[Prepared]):
        return (self.serve_batch or self.batch)(prepared)


def _squares(prepared: list[Prepared]) -> np.ndarray:
    """Squares or tiles of all images, one array [n, side, side, 3] (a new n compiles the prefill anew)."""
    return np.concatenate([p.pixels for p in prepared]).astype(np.float32)


def _special(i: int) -> Callable:
    return lambda tok, vision: tok.decode([getattr(vision, ("boi_token_id", "image_token_id")[i])])


def _siglip(image, processor, vision) -> Prepared:
    """The image's square, then its pan-and-scan crops' (layout: how many crops)."""
    views = [image] + images.crops(image, processor)
    return Prepared(np.stack([images.preprocess(v, processor) for v in views]), len(views) * vision.tokens_per_image,
                    len(views) - 1)


def _llama4(image, processor, vision) -> Prepared:
    tiles, canvas = images_llama4.tiles(image, processor)
    return Prepared(tiles, len(tiles) * vision.tokens_per_image, canvas)


def _qwen(image, processor, vision) -> Prepared:
    grid = images_qwen.preprocess(image, processor)
    t, h, w = grid.shape[:3]
    return Prepared(grid, t * h * w // vision.spatial_merge ** 2)


def soft_bucket(n: int) -> int:
    """The soft tokens an image slot of the server holds for an image of n: the least of 16, 24, 32, 48, 64, 96,
    ... (2^k and 3 x 2^(k-1)) that holds it, so images of any grid share a few programs, the padding at most half
    the image."""
    k = 16
    while k < n:
        k = k * 3 // 2 if k & (k - 1) == 0 else k * 4 // 3
    return k


def _qwen_padded(prepared: list[Prepared]):
    """Qwen-VL still images for the server: padded (model/vision_qwen.py) to one slot size, the least soft_bucket
    that holds the largest (in patches: soft tokens x merge^2), so that the prefill compiles per bucket and count
    of images, not per set of grids; a video's grid (t > 1) keeps the static form."""
    grids = [p.pixels for p in prepared]
    if any(g.shape[0] != 1 for g in grids):
        return tuple(np.asarray(g, np.float32) for g in grids)
    merge2 = grids[0].shape[1] * grids[0].shape[2] // prepared[0].tokens  # patches a soft token
    patches = images_qwen.padded(grids, soft_bucket(max(p.tokens for p in prepared)) * merge2,
                                 round(merge2 ** 0.5))
    return {"patches": patches, "grid": np.asarray([g.shape[1:3] for g in grids], np.int32)}


_QWEN = Kind(processor=images_qwen.Processor.of_folder, prepare=_qwen, marker=_special(1),
             expand=lambda text, tok, vision, ps: images_qwen.prompt_text(text, tok, vision, [p.pixels for p in ps]),
             batch=lambda ps: tuple(np.asarray(p.pixels, np.float32) for p in ps), serve_batch=_qwen_padded)

KINDS: dict[str, Kind] = {
    "siglip": Kind(processor=lambda folder, vision: images.Processor.of_folder(folder, vision.image_size),
                   prepare=_siglip, marker=_special(0),
                   expand=lambda text, tok, vision, ps: images.prompt_text(text, tok, vision, len(ps),
                                                                           [p.layout for p in ps]),
                   batch=_squares),
    "llama4": Kind(processor=lambda folder, vision: images_llama4.TileProcessor.of_folder(folder, vision.image_size),
                   prepare=_llama4, marker=lambda tok, vision: images_llama4.MARKER,
                   expand=lambda text, tok, vision, ps: images_llama4.prompt_text(text, tok, vision,
                                                                                  [p.layout for p in ps]),
                   batch=_squares),
    "qwen2_5": _QWEN,
    "qwen3": _QWEN,
}


def of(vision) -> Kind:
    """The image handling of a tower (model.vision)."""
    return KINDS[vision.kind]


def prepare_all(sources: list, vision, processor, max_pixels: int = images.MAX_PIXELS) -> list[Prepared]:
    """The images at `sources` (paths or data URLs; an unreadable one is an ImageError) preprocessed for `vision`."""
    kind = of(vision)
    return [kind.prepare(images.load(s, max_pixels), processor, vision) for s in sources]
