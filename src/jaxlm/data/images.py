"""Images in: read from a path or a data URL with Pillow (a missing, corrupt or oversized one is one ImageError
line naming it), then preprocessed as Gemma 3's Hugging Face image processor does (Pillow backend, pan-and-scan
off): RGB with transparency over white, a bilinear resize to the encoder's square, values times 1/255, then
minus the mean over the std per channel. The result is float32 [side, side, 3], what model/vision.py encodes."""

from __future__ import annotations

import base64
import binascii
import io
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxlm.data import hf_folder
from jaxlm.data.errors import DataError

MAX_PIXELS = 64 * 2**20  # larger images are refused before they are decoded (a 8192 x 8192 photo passes)
DATA_URL = re.compile(r"data:image/[\w.+-]+;base64,(?P<data>.*)", re.DOTALL)


class ImageError(DataError):
    """An image that cannot be read: missing, not an image, truncated, or larger than allowed."""


@dataclass(frozen=True)
class Processor:
    """The settings of preprocessor_config.json that Gemma 3's processor uses (its defaults are the released
    models')."""
    size: int = 896
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale: float = 1 / 255
    resample: int = 2  # Pillow's BILINEAR
    # Pan-and-scan (off in the released configs): an image this much wider than tall (or taller than wide) is also
    # cut into 2 to pan_max_crops crops of at least pan_min_crop pixels, each its own square after the whole image.
    pan_and_scan: bool = False
    pan_min_crop: int = 256
    pan_max_crops: int = 4
    pan_min_ratio: float = 1.2

    @classmethod
    def from_hf(cls, hf: dict, base: Processor | None = None) -> Processor:
        """From an image processor's settings (pan-and-scan's keys included); a key they lack takes `base`'s value
        (default: the released models')."""
        b = base or cls()
        size = hf.get("size") or {}
        side = size.get("height", size.get("shortest_edge", b.size)) if isinstance(size, dict) else size
        return cls(size=int(side), mean=tuple(hf.get("image_mean", b.mean)), std=tuple(hf.get("image_std", b.std)),
                   rescale=float(hf.get("rescale_factor", b.rescale)), resample=int(hf.get("resample", b.resample)),
                   pan_and_scan=bool(hf.get("do_pan_and_scan", b.pan_and_scan) or False),
                   pan_min_crop=int(hf.get("pan_and_scan_min_crop_size") or b.pan_min_crop),
                   pan_max_crops=int(hf.get("pan_and_scan_max_num_crops") or b.pan_max_crops),
                   pan_min_ratio=float(hf.get("pan_and_scan_min_ratio_to_activate") or b.pan_min_ratio))

    @classmethod
    def of_folder(cls, folder: Path | None, size: int) -> Processor:
        """A model folder's image processor settings (data/hf_folder.py: processor_config.json, else
        preprocessor_config.json, copied by `jaxlm convert from-hf`), the released models' where a key is missing
        (at the encoder's `size`); a folder with neither file is refused in one line."""
        return cls.from_hf(hf_folder.image_settings(folder)[0], cls(size=size))


def load(source: str | Path, max_pixels: int = MAX_PIXELS):
    """A Pillow image from a file path or a `data:image/...;base64,` URL, turned upright by its EXIF orientation
    (as transformers' load_image does)."""
    text = str(source)
    match = DATA_URL.fullmatch(text.strip())
    name = "the data URL" if match else text
    try:
        if match:
            raw = io.BytesIO(base64.b64decode(match.group("data"), validate=True))
        elif text.startswith("data:"):
            raise ImageError("a data URL must look like data:image/png;base64,<data>")
        else:
            raw = open(text, "rb")
    except FileNotFoundError:
        raise ImageError(f"image {text} does not exist") from None
    except binascii.Error:
        raise ImageError("the image data URL is not valid base64") from None
    except OSError as e:
        raise ImageError(f"cannot read image {text}: {e.strerror or e}") from None
    with raw:
        return decode(raw, name, max_pixels)


def decode(raw, name: str, max_pixels: int = MAX_PIXELS):
    """A Pillow image from the open binary stream `raw` (named `name` in errors), upright (as load)."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        image = Image.open(raw)
        size = image.size
    except Image.DecompressionBombError:
        size = None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise _unreadable(name, e) from None
    if size is None or size[0] * size[1] > max_pixels:
        shown = f" is {size[0]}x{size[1]} pixels," if size else " has"
        raise ImageError(f"image {name}{shown} more than the {max_pixels:,} pixels allowed")
    try:
        image.load()
    except (OSError, SyntaxError, ValueError) as e:
        raise _unreadable(name, e) from None
    return ImageOps.exif_transpose(image)


def _unreadable(name: str, e: Exception) -> ImageError:
    return ImageError(f"image {name} is not a readable image ({type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else 'truncated or corrupt'})")


def rgb(image):
    """The image in RGB, anything transparent composited over white."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def preprocess(image, processor: Processor = Processor()) -> np.ndarray:
    """The pixel values [size, size, 3] float32 of a Pillow image: resized in uint8 by Pillow, rescaled in float64
    and rounded to float32 before the normalization, as transformers does, so the values agree to the bit."""
    return normalize(resized(image, processor), processor)


def crops(image, processor: Processor) -> list:
    """Pan-and-scan's crops of a Pillow image (none unless processor.pan_and_scan): along its long side, about as
    many as its aspect ratio rounded (2 to pan_max_crops), none where the ratio is under pan_min_ratio or a crop
    would be under pan_min_crop pixels; the last crop cut at the image's edge. As Gemma 3's processor crops."""
    from PIL import Image

    p = processor
    width, height = image.size
    if not p.pan_and_scan or max(width, height) / min(width, height) < p.pan_min_ratio:
        return []
    long, short = max(width, height), min(width, height)
    n = min(p.pan_max_crops, max(2, min(long // p.pan_min_crop, int(long / short + 0.5))))
    across, down = (n, 1) if width >= height else (1, n)
    crop_w, crop_h = -(-width // across), -(-height // down)
    if min(crop_w, crop_h) < p.pan_min_crop:
        return []
    array = np.asarray(rgb(image))
    return [Image.fromarray(array[y:y + crop_h, x:x + crop_w])
            for y in range(0, crop_h * down, crop_h) for x in range(0, crop_w * across, crop_w)]


def resized(image, processor: Processor = Processor()) -> np.ndarray:
    """The image in RGB resized to the processor's square, uint8 [size, size, 3]: what a prepared dataset stores
    (data/vision_data.py), normalized when read."""
    side = processor.size
    return np.asarray(rgb(image).resize((side, side), resample=processor.resample), np.uint8)


def normalize(pixels_uint8: np.ndarray, processor: Processor = Processor()) -> np.ndarray:
    """Resized uint8 pixels [..., size, size, 3] as the encoder takes them: float32 (x * rescale - mean) / std."""
    x = (pixels_uint8.astype(np.float64) * processor.rescale).astype(np.float32)
    return (x - np.asarray(processor.mean, np.float32)) / np.asarray(processor.std, np.float32)


def pixels(sources: list[str | Path], processor: Processor = Processor(), max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """The images at `sources` (paths or data URLs) loaded and preprocessed [n, size, size, 3]."""
    if not sources:
        return np.zeros((0, processor.size, processor.size, 3), np.float32)
    return np.stack([preprocess(load(s, max_pixels), processor) for s in sources])


def prompt_text(text: str, tok, vision, n_images: int, n_crops: list[int] | None = None) -> str:
    """The prompt text with n images written as Gemma 3's processor writes them: each begin-of-image token in the
    text (or, when it holds none, n of them before it) becomes "\\n\\n" + begin + image tokens (one per soft
    token) + end + "\\n\\n"; an image with pan-and-scan crops (n_crops, per image) becomes "Here is the original
    image" + that + "and here are some crops to help you see better" + one such sequence a crop. Encode the result
    with the special tokens recognized (Tokenizer.encode_rendered)."""
    boi, image, eoi = (tok.decode([i]) for i in (vision.boi_token_id, vision.image_token_id, vision.eoi_token_id))
    if boi not in text:
        text = boi * n_images + text
    if text.count(boi) != n_images:
        raise ImageError(f"the prompt marks {text.count(boi)} image(s) with {boi} but {n_images} image(s) were given")
    one = f"\n\n{boi}{image * vision.tokens_per_image}{eoi}\n\n"
    parts = text.split(boi)
    out = [parts[0]]
    for i, part in enumerate(parts[1:]):
        n = n_crops[i] if n_crops else 0
        out.append((f"Here is the original image {one} and here are some crops to help you see better "
                    + " ".join([one] * n)) if n else one)
        out.append(part)
    return "".join(out)
