"""Images in chat requests (a model with a vision tower; docs/vision.md, "Serving images"): a request's image_url
parts read (data:image/...;base64 URLs; http(s) ones fetched only with serve.allow_image_urls) and preprocessed as
the tower's kind takes them (data/image_kinds.py), within serve.max_images_per_request and serve.max_image_pixels,
each fault a 400 naming its part; the rendered prompt's image markers expanded into the image tokens; and the key the
prefix caches know the prompt by: each image's tokens replaced by ids drawn from a hash of its pixels, so that the
same text with another image never shares an image's keys and values."""

from __future__ import annotations

import hashlib
import io
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable

import numpy as np

from jaxlm.config import ModelConfig
from jaxlm.data import image_kinds, images as images_lib
from jaxlm.serve.schemas import RequestError

FETCH_TIMEOUT_S = 10


@dataclass(frozen=True)
class ImageServing:
    """What a server that takes images needs: the tower's settings, its kind's image handling
    (data/image_kinds.py) and the model folder's preprocessing, the text of the marker the chat template writes for
    an image, `expand(text, prepared)` (the markers written out as the images' tokens), the serve.* limits and the
    most bytes a fetched image may have."""
    cfg: ModelConfig
    kind: image_kinds.Kind
    processor: object
    marker: str
    expand: Callable[[str, list], str]
    max_images: int
    max_pixels: int
    allow_urls: bool
    max_fetch_bytes: int


def pixels(iv: ImageServing | None, refused: str, parts: list[tuple[str, str]]) -> list[image_kinds.Prepared]:
    """The images of `parts` ((where, URL): where names the part, messages[i].content[j]) preprocessed as the
    tower takes them; a RequestError (400) naming the first part at fault. `refused`: why this server takes no
    images, when iv is None. Reads and resizes images: run it in a worker thread."""
    if iv is None:
        raise RequestError(f"{parts[0][0]}: {refused}; send text parts only", "messages")
    if len(parts) > iv.max_images:
        raise RequestError(f"the messages hold {len(parts)} images; this server takes at most "
                           f"serve.max_images_per_request={iv.max_images} per request", "messages")
    return [_one(iv, where, url) for where, url in parts]


def _one(iv: ImageServing, where: str, url: str) -> image_kinds.Prepared:
    try:
        if url.startswith(("http://", "https://")):
            if not iv.allow_urls:
                raise RequestError(f"{where}: this server does not fetch image URLs (serve.allow_image_urls=false);"
                                   " send the image as a data:image/...;base64 URL", "messages")
            image = images_lib.decode(io.BytesIO(_fetch(iv, where, url)), url, iv.max_pixels)
        elif url.startswith("data:"):
            image = images_lib.load(url, iv.max_pixels)
        else:  # never a path on the server's disk
            raise RequestError(f"{where}: an image URL must be a data:image/...;base64 URL"
                               f"{' or an http(s) URL' if iv.allow_urls else ''}", "messages")
        return iv.kind.prepare(image, iv.processor, iv.cfg.vision)
    except images_lib.ImageError as e:
        raise RequestError(f"{where}: {e}", "messages") from None


def _fetch(iv: ImageServing, where: str, url: str) -> bytes:
    """An http(s) image's bytes, at most max_fetch_bytes of them."""
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as answer:
            raw = answer.read(iv.max_fetch_bytes + 1)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise RequestError(f"{where}: cannot fetch the image: {getattr(e, 'reason', e)}", "messages") from None
    if len(raw) > iv.max_fetch_bytes:
        raise RequestError(f"{where}: the image at the URL is larger than {iv.max_fetch_bytes:,} bytes",
                           "messages")
    return raw


def prompt(iv: ImageServing, text: str, prepared: list[image_kinds.Prepared], encode: Callable[[str], list[int]]
           ) -> tuple[list[int], int]:
    """The tokens of a rendered chat prompt holding one image marker per prepared image, the images written in
    (expand), and the index after its last image token. A RequestError unless the template placed one marker per
    image and the text holds no image tokens of its own."""
    n, found = len(prepared), text.count(iv.marker)
    if found != n:
        raise RequestError(f"the chat template wrote {found} image marker(s) {iv.marker} for the messages' {n} "
                           "image(s): its messages must not write the marker as text, and the template must place "
                           "image parts ({'type': 'image'} content items)", "messages")
    try:
        ids = encode(iv.expand(text, prepared))
    except images_lib.ImageError as e:
        raise RequestError(str(e), "messages") from None
    at = np.flatnonzero(np.asarray(ids) == iv.cfg.vision.image_token_id)
    if len(at) != sum(p.tokens for p in prepared):
        raise RequestError("the messages hold image token strings of their own; leave them out", "messages")
    return ids, int(at[-1]) + 1


def media(iv: ImageServing, ids: list[int], prepared: list[image_kinds.Prepared], image_end: int) -> dict:
    """What the engine takes of a prompt's images: them as the kind serves them (float32, Qwen-VL's padded to a
    bucket), the index after the last image token, and the prefix key; arrays of megabytes hashed and copied, so
    the server runs it in a worker thread, off the event loop that streams the other requests."""
    return {"images": iv.kind.for_serving(prepared), "image_end": image_end, "key": cache_key(ids, prepared, iv.cfg)}


def cache_key(ids: list[int], prepared: list[image_kinds.Prepared], cfg: ModelConfig) -> list[int]:
    """`ids` with each image's tokens replaced by negative ids (no token's) read from a hash of its pixels: 31 bits
    per image token, so the key of two different images collides with odds of 2^-(31 x its image tokens). With
    M-RoPE (Qwen-VL) the text before the last image is marked negative too, salted by a hash of all the prompt's
    images (-1 - (id x an odd number + salt) mod 2^31): the prefill with images rotates the whole prompt by a
    shift that all its images set (model/vision_qwen.rope_positions), so its keys and values serve only a prompt
    with the same images, never a text prompt that starts the same, nor one with the same first image and others
    after it."""
    key = list(ids)
    at = [i for i, t in enumerate(ids) if t == cfg.vision.image_token_id]
    digests = [hashlib.shake_256(np.ascontiguousarray(image.pixels).tobytes()).digest(4 * image.tokens)
               for image in prepared]
    if cfg.vision.kind in ("qwen2_5", "qwen3"):
        salt = int.from_bytes(hashlib.shake_256(b"".join(digests)).digest(4), "little")
        key[:at[-1]] = [-1 - ((t * 0x9E3779B1 + salt) & 0x7FFFFFFF) for t in key[:at[-1]]]
    start = 0
    for image, digest in zip(prepared, digests):
        words = np.frombuffer(digest, "<u4") & 0x7FFFFFFF
        for k, w in zip(at[start:start + image.tokens], words):
            key[k] = -1 - int(w)
        start += image.tokens
    return key
