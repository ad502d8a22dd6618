"""Images at one fixed shape for training (data/vision_data.py), per tower kind, so that a batch's images stack
(static shapes for jit): each kept as uint8 [S, S, 3] beside the shards and normalized when read. Gemma 3 (siglip):
the processor's square; Llama 4: one tile, the image fitted into it without distortion and padded with black, as
its processor does with max_patches=1; Qwen2.5-VL / Qwen3-VL: a square of `side` pixels (a multiple of patch x
merge whose area the model's processor keeps, so its smart_resize leaves it as it is), bicubic, one patch grid
[1, S/p, S/p, Q] of (S / (p * merge))^2 soft tokens. meta.json's "images" records the kind and its settings."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxlm.data import images, images_llama4, images_qwen
from jaxlm.data.errors import DataError

QWEN = ("qwen2_5", "qwen3")
QWEN_MERGED_SIDE = 16  # the default Qwen training square: 16 x 16 soft tokens (448 pixels for Qwen2.5-VL)


@dataclass(frozen=True)
class Fixed:
    """How a kind's training images are kept (`resized`: a Pillow image -> uint8 [S, S, 3]) and read
    (`normalized`: uint8 [..., S, S, 3] -> float32 [..., *shape], what the tower takes per image)."""
    kind: str
    side: int
    processor: object  # images.Processor, images_llama4.TileProcessor or images_qwen.Processor

    @property
    def shape(self) -> tuple[int, ...]:
        if self.kind in QWEN:
            p = self.processor
            return (1, self.side // p.patch_size, self.side // p.patch_size,
                    3 * p.temporal_patch_size * p.patch_size ** 2)
        return (self.side, self.side, 3)

    def resized(self, image) -> np.ndarray:
        if self.kind == "llama4":
            return images_llama4.tiles_uint8(image, self.processor)[0][0]
        rgb = images.rgb(image)
        return np.asarray(rgb.resize((self.side, self.side), resample=self.processor.resample), np.uint8)

    def normalized(self, pixels_uint8: np.ndarray) -> np.ndarray:
        if self.kind == "llama4":
            return images_llama4.normalize(pixels_uint8, self.processor)
        if self.kind in QWEN:
            flat = pixels_uint8.reshape((-1, self.side, self.side, 3))
            out = np.stack([images_qwen.patches(x, self.processor) for x in flat]) if len(flat) else \
                np.zeros((0,) + self.shape, np.float32)
            return out.reshape(pixels_uint8.shape[:-3] + self.shape)
        return images.normalize(pixels_uint8, self.processor)

    def expand(self, text: str, tok, vision, n: int) -> str:
        """The prompt text with its n images' tokens written in (image_kinds' layouts at this shape)."""
        if self.kind == "llama4":
            return images_llama4.prompt_text(text, tok, vision, [(1, 1)] * n)
        if self.kind in QWEN:
            return images_qwen.prompt_text(text, tok, vision, [np.empty(self.shape[:3] + (0,))] * n)
        return images.prompt_text(text, tok, vision, n)

    def meta(self) -> dict:
        p = self.processor
        out = {"size": self.side, "mean": list(p.mean), "std": list(p.std), "rescale": p.rescale}
        if self.kind != "siglip":
            out["kind"] = self.kind
        if self.kind in QWEN:
            out.update(patch_size=p.patch_size, merge_size=p.merge_size, temporal_patch_size=p.temporal_patch_size)
        return out

    @classmethod
    def of_meta(cls, info: dict) -> Fixed:
        """The shape a prepared folder's meta.json "images" records (no kind: Gemma 3's, as before kinds)."""
        kind, S = info.get("kind", "siglip"), int(info["size"])
        common = {"mean": tuple(info["mean"]), "std": tuple(info["std"]), "rescale": float(info["rescale"])}
        if kind == "llama4":
            return cls(kind, S, images_llama4.TileProcessor(size=S, max_tiles=1, **common))
        if kind in QWEN:
            return cls(kind, S, images_qwen.Processor(patch_size=int(info["patch_size"]),
                                                      merge_size=int(info["merge_size"]),
                                                      temporal_patch_size=int(info["temporal_patch_size"]), **common))
        return cls(kind, S, images.Processor(size=S, **common))


def of_model(folder: Path | None, vision, side: int | None = None, processor=None) -> Fixed:
    """The training shape of a model's images: its folder's preprocessor_config.json (or `processor`, or the
    defaults) at the kind's fixed shape; `side` (Qwen-VL only: the square's pixels) refused in one line where
    it cannot work."""
    kind = vision.kind
    if kind in QWEN:
        p = processor or images_qwen.Processor.of_folder(folder, vision)
        if (p.patch_size, p.merge_size, p.temporal_patch_size) != (vision.patch_size, vision.spatial_merge,
                                                                   vision.temporal_patch):
            raise DataError(f"the processor's patch {p.patch_size}, merge {p.merge_size} and temporal patch "
                            f"{p.temporal_patch_size} differ from model.vision's; prepare with the model's folder")
        factor = p.patch_size * p.merge_size
        side = side or factor * QWEN_MERGED_SIDE
        if side % factor or not p.min_pixels <= side * side <= p.max_pixels:
            raise DataError(f"image side {side}: Qwen-VL training squares must be a multiple of patch x merge = "
                            f"{factor} pixels with an area within the processor's [{p.min_pixels}, {p.max_pixels}] "
                            f"pixels (else its smart_resize would change them), e.g. {factor * QWEN_MERGED_SIDE}")
        return Fixed(kind, side, p)
    if side is not None and side != vision.image_size:
        raise DataError(f"image side {side}: a {kind} tower takes {vision.image_size}-pixel images "
                        "(model.vision.image_size); the side is a setting of Qwen-VL data only")
    if kind == "llama4":
        p = processor or images_llama4.TileProcessor.of_folder(folder, vision.image_size)
        p = dataclasses.replace(p, max_tiles=1)
    else:
        p = processor or images.Processor.of_folder(folder, vision.image_size)
        if p.pan_and_scan:
            raise DataError("preprocessor_config.json do_pan_and_scan=true: pan-and-scan crops are taken by `jaxlm "
                            "generate` and `jaxlm serve`, not by prepared training data; set it to false to prepare")
    if p.size != vision.image_size:
        raise DataError(f"the processor resizes to {p.size} pixels and model.vision.image_size is "
                        f"{vision.image_size}; they must agree")
    return Fixed(kind, vision.image_size, p)
