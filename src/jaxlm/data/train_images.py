"""Images for training (data/vision_data.py) at static shapes for jit, per tower kind, kept as uint8 beside the shards
and normalized when read. Gemma 3 (siglip): the processor's square (`Fixed`). Llama 4 (`Tiles`): each image's tiles
as its processor cuts them (a best-fit canvas of up to max_tiles tiles, then the global tile), padded to K tile slots
with the canvas beside; read as {"tiles": [K, S, S, 3], "canvas": [2]} (model/vision_llama4.py); folders prepared
before kept one tile an image. Qwen2.5-VL / Qwen3-VL (`Grids`): each image at its own grid within a budget of soft
tokens, padded to the budget with its grid beside; read as {"patches": [P, Q], "grid": [2]} (model/vision_qwen.py);
folders prepared before kept one square of `side` pixels. meta.json's "images" records the kind and its settings."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxlm.data import images, images_llama4, images_qwen
from jaxlm.data.errors import DataError

QWEN = ("qwen2_5", "qwen3")
QWEN_MERGED_SIDE = 16  # the Qwen training square's soft tokens a side, an example in messages
QWEN_TOKENS = 256  # the default budget of soft tokens an image (Qwen-VL): what the 16 x 16 square held before


@dataclass(frozen=True)
class Fixed:
    """How Gemma 3's training images are kept (`resized`: a Pillow image -> uint8 [S, S, 3], the `record` stored)
    and read (`normalized`: uint8 [n, S, S, 3] -> float32 [n, *shape], what the tower takes per image)."""
    kind: str
    side: int
    processor: object  # images.Processor

    padded = False  # the batch's images are one array, not a dict of padded images and their grids
    stores_grids = False

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.side, self.side, 3)

    @property
    def record(self) -> tuple[int, ...]:
        return self.shape

    def resized(self, image) -> np.ndarray:
        rgb = images.rgb(image)
        return np.asarray(rgb.resize((self.side, self.side), resample=self.processor.resample), np.uint8)

    def to_record(self, pixels: np.ndarray) -> tuple[np.ndarray, None]:
        return pixels, None

    def normalized(self, pixels_uint8: np.ndarray, grids=None) -> np.ndarray:
        return images.normalize(pixels_uint8, self.processor)

    def expand(self, text: str, tok, vision, pixels: list) -> str:
        """The prompt text with its images' tokens written in (image_kinds' layout at this shape)."""
        return images.prompt_text(text, tok, vision, len(pixels))

    def meta(self) -> dict:
        p = self.processor
        return {"size": self.side, "mean": list(p.mean), "std": list(p.std), "rescale": p.rescale}


def tile_slots(max_tiles: int) -> int:
    """The tiles an image of at most max_tiles canvas tiles has at most: the global tile follows a canvas of several."""
    return max_tiles + 1 if max_tiles > 1 else 1


def tile_count(canvas) -> int:
    """The tiles of an image on a canvas (rows, columns): its own, and the global tile when there are several (0 x 0:
    no image, none)."""
    n = int(canvas[0]) * int(canvas[1])
    return n + 1 if n > 1 else n


@dataclass(frozen=True)
class Tiles:
    """Llama 4's training images: each fitted to its best canvas of up to processor.max_tiles tiles and cut as its
    processor does (`resized`: (uint8 tiles [n, S, S, 3], canvas (rows, columns))), stored padded with zeros to
    K = tile_slots(max_tiles) tiles (`record`) with the canvas beside, and read as normalized tiles [n, K, S, S, 3]
    (zeros past each image's) with the canvases (`normalized`). stores_grids=False: a folder prepared before, one tile
    an image (max_tiles 1), no canvases stored (each 1 x 1)."""
    kind: str
    side: int
    processor: object  # images_llama4.TileProcessor
    stores_grids: bool = True

    padded = True
    key, grid_key = "tiles", "canvas"
    default_grid = (1, 1)

    @property
    def n_tiles(self) -> int:
        return tile_slots(self.processor.max_tiles)

    @property
    def shape(self) -> dict:
        return {"tiles": (self.n_tiles, self.side, self.side, 3), "canvas": (2,)}

    @property
    def record(self) -> tuple[int, ...]:
        return self.shape["tiles"]

    def resized(self, image) -> tuple[np.ndarray, tuple[int, int]]:
        return images_llama4.tiles_uint8(image, self.processor)

    def to_record(self, pixels: tuple) -> tuple[np.ndarray, tuple[int, int]]:
        tiles, canvas = pixels
        out = np.zeros(self.record, np.uint8)
        out[:len(tiles)] = tiles
        return out, canvas

    def normalized(self, records: np.ndarray, canvases: np.ndarray) -> np.ndarray:
        out = np.zeros((len(records),) + self.record, np.float32)
        for i, (record, canvas) in enumerate(zip(records, canvases)):
            n = tile_count(canvas)
            out[i, :n] = images_llama4.normalize(np.asarray(record[:n]), self.processor)
        return out

    def expand(self, text: str, tok, vision, pixels: list) -> str:
        """The prompt text with its images' tokens written in, each at its own canvas, as image_kinds writes it."""
        return images_llama4.prompt_text(text, tok, vision, [canvas for _, canvas in pixels])

    def meta(self) -> dict:
        p = self.processor
        out = {"kind": self.kind, "size": self.side, "mean": list(p.mean), "std": list(p.std), "rescale": p.rescale}
        if not self.stores_grids:
            return out
        return {**out, "layout": "tiles", "max_tiles": p.max_tiles, "tiles": self.n_tiles,
                "resize_to_max_canvas": p.resize_to_max_canvas}


@dataclass(frozen=True)
class Grids:
    """Qwen-VL's training images: each resized as the processor does with max_pixels lowered to `tokens` soft tokens
    (side 0), or to one square of `side` pixels (folders prepared before; image_side); stored as uint8 pixels
    padded to P = tokens x merge^2 patches' worth (`record`) with its grid (h, w) in patches, and read as padded
    patches in the processor's order (`normalized`)."""
    kind: str
    processor: object  # images_qwen.Processor
    tokens: int
    side: int = 0

    padded = True
    key, grid_key = "patches", "grid"

    @property
    def stores_grids(self) -> bool:
        return not self.side

    @property
    def default_grid(self) -> tuple[int, int]:
        """The grid of every image of a folder of squares (no grids stored)."""
        n = self.side // self.processor.patch_size
        return n, n

    @property
    def n_patches(self) -> int:
        return self.tokens * self.processor.merge_size ** 2

    @property
    def shape(self) -> dict:
        p = self.processor
        return {"patches": (self.n_patches, 3 * p.temporal_patch_size * p.patch_size ** 2), "grid": (2,)}

    @property
    def record(self) -> tuple[int, ...]:
        return (self.side, self.side, 3) if self.side else (self.n_patches * self.processor.patch_size ** 2, 3)

    def resizing(self) -> images_qwen.Processor:
        """The processor with max_pixels within the budget."""
        p = self.processor
        return dataclasses.replace(p, max_pixels=min(p.max_pixels, self.tokens * (p.patch_size * p.merge_size) ** 2))

    def resized(self, image) -> np.ndarray:
        """uint8 [height, width, 3] at the sides the processor gives (or the square)."""
        rgb = images.rgb(image)
        if self.side:
            height = width = self.side
        else:
            p = self.resizing()
            height, width = images_qwen.smart_resize(rgb.height, rgb.width, p)
            if height * width > p.max_pixels:
                raise images.ImageError(f"a {rgb.width}x{rgb.height} image resizes to {width}x{height} pixels, over "
                                        f"the budget of {self.tokens} soft tokens ({p.max_pixels} pixels)")
        return np.asarray(rgb.resize((width, height), resample=self.processor.resample), np.uint8)

    def to_record(self, pixels: np.ndarray) -> tuple[np.ndarray, tuple[int, int]]:
        """The stored record of resized pixels (padded with zeros) and its grid in patches."""
        grid = (pixels.shape[0] // self.processor.patch_size, pixels.shape[1] // self.processor.patch_size)
        if self.side:
            return pixels, grid
        out = np.zeros(self.record, np.uint8)
        out[:pixels.shape[0] * pixels.shape[1]] = pixels.reshape(-1, 3)
        return out, grid

    def normalized(self, records: np.ndarray, grids: np.ndarray) -> np.ndarray:
        """Padded float32 patches [n, P, Q] of n records with their grids [n, 2] (zeros after each image's)."""
        p, P = self.processor, self.processor.patch_size
        out = np.zeros((len(records),) + self.shape["patches"], np.float32)
        for i, (record, (h, w)) in enumerate(zip(records, grids)):
            pixels = np.asarray(record).reshape(-1, 3)[:h * P * w * P].reshape(h * P, w * P, 3)
            out[i, :h * w] = images_qwen.hf_order(images_qwen.patches(pixels, p), p.merge_size)
        return out

    def expand(self, text: str, tok, vision, pixels: list) -> str:
        """The prompt text with its images' tokens written in: each image's own count, as image_kinds writes it."""
        P = self.processor.patch_size
        return images_qwen.prompt_text(text, tok, vision, [np.empty((1, x.shape[0] // P, x.shape[1] // P, 0))
                                                           for x in pixels])

    def meta(self) -> dict:
        p = self.processor
        out = {"kind": self.kind, "mean": list(p.mean), "std": list(p.std), "rescale": p.rescale,
               "patch_size": p.patch_size, "merge_size": p.merge_size, "temporal_patch_size": p.temporal_patch_size}
        return {**out, "size": self.side} if self.side else {**out, "layout": "grids", "tokens": self.tokens,
                                                             "max_pixels": self.resizing().max_pixels}


def of_meta(info: dict) -> Fixed | Tiles | Grids:
    """The layout a prepared folder's meta.json "images" records (no kind: Gemma 3's, as before kinds; Llama 4 or a
    Qwen kind without a layout: the one tile or the square of folders prepared before)."""
    kind = info.get("kind", "siglip")
    common = {"mean": tuple(info["mean"]), "std": tuple(info["std"]), "rescale": float(info["rescale"])}
    if kind in QWEN:
        p = images_qwen.Processor(patch_size=int(info["patch_size"]), merge_size=int(info["merge_size"]),
                                  temporal_patch_size=int(info["temporal_patch_size"]), **common)
        if info.get("layout") == "grids":
            return Grids(kind, p, int(info["tokens"]))
        S = int(info["size"])
        return Grids(kind, p, (S // (p.patch_size * p.merge_size)) ** 2, S)
    S = int(info["size"])
    if kind == "llama4":
        if info.get("layout") == "tiles":
            p = images_llama4.TileProcessor(size=S, max_tiles=int(info["max_tiles"]), **common,
                                            resize_to_max_canvas=bool(info.get("resize_to_max_canvas", False)))
            return Tiles(kind, S, p)
        return Tiles(kind, S, images_llama4.TileProcessor(size=S, max_tiles=1, **common), stores_grids=False)
    return Fixed(kind, S, images.Processor(size=S, **common))


def released(vision):
    """The released models' image processor of a tower's kind at its sizes, chosen explicitly (never a folder's
    missing settings)."""
    if vision.kind in QWEN:
        return images_qwen.Processor.defaults(vision)
    if vision.kind == "llama4":
        return images_llama4.TileProcessor(size=vision.image_size)
    return images.Processor(size=vision.image_size)


def of_model(folder: Path | None, vision, side: int | None = None, processor=None, tokens: int | None = None,
             check: bool = True, max_tiles: int | None = None) -> Fixed | Tiles | Grids:
    """The training layout of a model's images: its folder's image processor settings (data/hf_folder.py; refused
    where it has none), or `processor`, at the kind's shape. Llama 4: each image's tiles on a canvas of at most
    `max_tiles` (default the processor's max_patches). Qwen-VL: each image's own grid within `tokens` soft tokens (default QWEN_TOKENS), or
    the square of `side` pixels. Refused in one line where they cannot work (check=False: an ahead-of-time compile
    without data takes the shape as it is, and without a folder the released models' settings: released)."""
    kind = vision.kind
    if processor is None and folder is None and not check:
        processor = released(vision)
    if max_tiles is not None and kind != "llama4":
        raise DataError(f"max tiles {max_tiles}: a {kind} tower does not cut images into tiles; the number of tiles "
                        "is a setting of Llama 4 data only")
    if kind in QWEN:
        return _qwen(folder, vision, side, processor, tokens, check)
    if side is not None and side != vision.image_size:
        raise DataError(f"image side {side}: a {kind} tower takes {vision.image_size}-pixel images "
                        "(model.vision.image_size); the side is a setting of Qwen-VL data only")
    if tokens is not None:
        raise DataError(f"image tokens {tokens}: a {kind} tower takes a fixed number of soft tokens a tile; the "
                        "budget is a setting of Qwen-VL data only")
    if kind == "llama4":
        p = processor or images_llama4.TileProcessor.of_folder(folder, vision.image_size)
        if max_tiles is not None and max_tiles < 1:
            raise DataError(f"max tiles {max_tiles}: an image takes at least one tile")
        p = dataclasses.replace(p, max_tiles=p.max_tiles if max_tiles is None else max_tiles)
    else:
        p = processor or images.Processor.of_folder(folder, vision.image_size)
        if p.pan_and_scan:
            raise DataError("preprocessor_config.json do_pan_and_scan=true: pan-and-scan crops are taken by `jaxlm "
                            "generate` and `jaxlm serve`, not by prepared training data; set it to false to prepare")
    if p.size != vision.image_size:
        raise DataError(f"the processor resizes to {p.size} pixels and model.vision.image_size is "
                        f"{vision.image_size}; they must agree")
    return Tiles(kind, vision.image_size, p) if kind == "llama4" else Fixed(kind, vision.image_size, p)


def _qwen(folder, vision, side, processor, tokens, check) -> Grids:
    p = processor or images_qwen.Processor.of_folder(folder, vision)
    if (p.patch_size, p.merge_size, p.temporal_patch_size) != (vision.patch_size, vision.spatial_merge,
                                                               vision.temporal_patch):
        raise DataError(f"the processor's patch {p.patch_size}, merge {p.merge_size} and temporal patch "
                        f"{p.temporal_patch_size} differ from model.vision's; prepare with the model's folder")
    factor = p.patch_size * p.merge_size
    if side is not None and tokens is not None:
        raise DataError("image side and image tokens both given: give the budget of soft tokens an image (each "
                        "image at its own grid), or the side of one square for all")
    if side is not None:
        if side % factor or not p.min_pixels <= side * side <= p.max_pixels:
            raise DataError(f"image side {side}: Qwen-VL training squares must be a multiple of patch x merge = "
                            f"{factor} pixels with an area within the processor's [{p.min_pixels}, {p.max_pixels}] "
                            f"pixels (else its smart_resize would change them), e.g. {factor * QWEN_MERGED_SIDE}")
        return Grids(vision.kind, p, (side // factor) ** 2, side)
    tokens = QWEN_TOKENS if tokens is None else tokens
    out = Grids(vision.kind, p, tokens)
    if check and (tokens < 1 or p.min_pixels > out.resizing().max_pixels):
        raise DataError(f"image tokens {tokens}: {tokens} soft tokens of {factor}x{factor} pixels are under the "
                        f"processor's min_pixels {p.min_pixels}; give at least "
                        f"{-(-p.min_pixels // factor ** 2)} (or lower min_pixels in preprocessor_config.json)")
    return out
