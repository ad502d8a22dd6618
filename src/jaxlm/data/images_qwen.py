"""Images for Qwen-VL models (Qwen2.5-VL, Qwen3-VL: each with its preprocessor_config.json), preprocessed as
transformers' Qwen2VLImageProcessor (Pillow backend) does: RGB, a bicubic resize to the nearest sides that are
multiples of patch x merge with the pixel count within [min_pixels, max_pixels] (smart_resize), values times 1/255,
minus the mean over the std per channel, cut into patches. The result is one patch grid [t, h, w, Q] float32 per
image (t = 1: a still image repeated over temporal_patch frames; Q = channels x temporal_patch x patch^2 in
transformers' order), what model/vision_qwen.py encodes; hf_order flattens it as the processor's pixel_values.
Reading files (and their errors) is data/images.py's."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxlm.data import hf_folder, images
from jaxlm.data.images import ImageError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class Processor:
    """The settings of a Qwen2.5-VL preprocessor_config.json (its defaults are the released models')."""
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    rescale: float = 1 / 255
    resample: int = 3  # Pillow's BICUBIC

    @classmethod
    def from_hf(cls, hf: dict, base: Processor | None = None) -> Processor:
        """From an image processor's settings; a key they lack takes `base`'s value (default: Qwen2.5-VL's)."""
        b = base or cls()
        size = hf.get("size") or {}
        return cls(patch_size=int(hf.get("patch_size", b.patch_size)),
                   merge_size=int(hf.get("merge_size", b.merge_size)),
                   temporal_patch_size=int(hf.get("temporal_patch_size", b.temporal_patch_size)),
                   min_pixels=int(hf.get("min_pixels") or size.get("shortest_edge") or b.min_pixels),
                   max_pixels=int(hf.get("max_pixels") or size.get("longest_edge") or b.max_pixels),
                   mean=tuple(hf.get("image_mean", b.mean)), std=tuple(hf.get("image_std", b.std)),
                   rescale=float(hf.get("rescale_factor", b.rescale)), resample=int(hf.get("resample", b.resample)))

    @classmethod
    def defaults(cls, vision) -> Processor:
        """The released models' settings at the tower's patch and merge sizes (for Qwen3-VL, kind qwen3, its mean,
        std and pixel bounds): what a key missing from a folder's settings takes, and an explicit choice in code."""
        qwen3 = {"mean": (0.5,) * 3, "std": (0.5,) * 3, "min_pixels": 65536, "max_pixels": 16777216}
        return cls(patch_size=vision.patch_size, merge_size=vision.spatial_merge,
                   temporal_patch_size=vision.temporal_patch, **(qwen3 if vision.kind == "qwen3" else {}))

    @classmethod
    def of_folder(cls, folder: Path | None, vision) -> Processor:
        """A model folder's image processor settings (data/hf_folder.py: processor_config.json, else
        preprocessor_config.json), `defaults(vision)` where a key is missing; a folder with neither file is refused
        in one line."""
        return cls.from_hf(hf_folder.image_settings(folder)[0], cls.defaults(vision))


def smart_resize(height: int, width: int, p: Processor) -> tuple[int, int]:
    """The sides an image is resized to: multiples of patch x merge, near the original aspect ratio, the pixel
    count within [min_pixels, max_pixels] (transformers' smart_resize)."""
    factor = p.patch_size * p.merge_size
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"an image of {width}x{height} pixels is too elongated (aspect ratio over 200)")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > p.max_pixels:
        beta = math.sqrt(height * width / p.max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < p.min_pixels:
        beta = math.sqrt(p.min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def preprocess(image, p: Processor = Processor()) -> np.ndarray:
    """The patch grid [1, h, w, Q] float32 of a Pillow image (h, w: its resized sides in patches)."""
    rgb = images.rgb(image)
    height, width = smart_resize(rgb.height, rgb.width, p)
    return patches(np.asarray(rgb.resize((width, height), resample=p.resample), np.uint8), p)


def patches(pixels_uint8: np.ndarray, p: Processor = Processor()) -> np.ndarray:
    """The patch grid [1, h, w, Q] float32 of uint8 pixels [height, width, 3] already at their resized sides."""
    height, width = pixels_uint8.shape[:2]
    x = (pixels_uint8.astype(np.float64) * p.rescale).astype(np.float32)
    x = (x - np.asarray(p.mean, np.float32)) / np.asarray(p.std, np.float32)
    P, h, w = p.patch_size, height // p.patch_size, width // p.patch_size
    grid = x.reshape(h, P, w, P, 3).transpose(0, 2, 4, 1, 3)  # [h, w, C, P, P]
    grid = np.broadcast_to(grid[:, :, :, None], (h, w, 3, p.temporal_patch_size, P, P))
    return np.ascontiguousarray(grid.reshape(1, h, w, -1), np.float32)


def grids(sources: list[str | Path], p: Processor = Processor(), max_pixels: int = images.MAX_PIXELS) -> list:
    """The images at `sources` (paths or data URLs) loaded and preprocessed, one patch grid each."""
    return [preprocess(images.load(s, max_pixels), p) for s in sources]


def hf_order(grid_thwQ: np.ndarray, merge: int) -> np.ndarray:
    """A patch grid flattened as the processor's pixel_values [t * h * w, Q]: each merge x merge square's patches
    together (row by row), the squares row-major."""
    t, h, w, Q = grid_thwQ.shape
    x = grid_thwQ.reshape(t, h // merge, merge, w // merge, merge, Q).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, Q)


def padded(grids_thwQ: list, P: int, merge: int) -> np.ndarray:
    """Still images' patch grids [1, h, w, Q] as the towers' padded form takes them: [n, P, Q] in the processor's
    order (hf_order), zeros after each image's h w patches (model/vision_qwen.py)."""
    out = np.zeros((len(grids_thwQ), P, grids_thwQ[0].shape[-1]) if grids_thwQ else (0, P, 0), np.float32)
    for i, g in enumerate(grids_thwQ):
        flat = hf_order(np.asarray(g, np.float32), merge)
        out[i, :len(flat)] = flat
    return out


def prompt_text(text: str, tok, vision, image_grids: list) -> str:
    """The prompt with its images written as Qwen2.5-VL's processor writes them: each image pad token in the text
    (when it holds none, one per image before it, each between vision_start and vision_end as the chat template
    writes them) becomes t * h * w / merge^2 of them, one per soft token of its image."""
    start, pad, end = (tok.decode([i]) for i in (vision.boi_token_id, vision.image_token_id, vision.eoi_token_id))
    if pad not in text:
        text = f"{start}{pad}{end}" * len(image_grids) + text
    pieces = text.split(pad)
    if len(pieces) - 1 != len(image_grids):
        raise ImageError(f"the prompt marks {len(pieces) - 1} image(s) with {pad} but {len(image_grids)} image(s) "
                         "were given")
    out = pieces[0]
    for grid, piece in zip(image_grids, pieces[1:]):
        t, h, w = grid.shape[:3]
        out += pad * (t * h * w // vision.spatial_merge ** 2) + piece
    return out
