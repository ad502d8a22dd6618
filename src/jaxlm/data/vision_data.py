"""Chat data with images, for training a vision-language model (docs/vision.md, "Training with images"): conversations
whose message contents hold image parts, prepared into a format-2 chat folder (loss on the assistant's answers) with
each split's images beside the shards (`prepare_vision_chat`); and the reading side: a split's images (SplitImages)
and the loader that puts one conversation in each row, padded, with the images of its rows (RowLoader, Rows).

Beside the shards, per split: {split}-images.bin (uint8 [I, *record]: a fixed-size record per image in the tower
kind's layout, data/train_images.py), {split}-images.idx.npy (int64 [D + 1]: each document's first image, then I)
and, for Llama 4 and Qwen-VL, {split}-images.grid.npy (int32 [I, 2]: each image's canvas of tiles or grid of patches).
meta.json's "images" holds the layout, the kind and its normalization, and the most images a document has. Legend:
A micro-batches, B rows, T block_size, R = T + 1, K images per row at most, S image side, D documents.
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path

import numpy as np

from jaxlm import storage
from jaxlm.config import ConfigError
from jaxlm.config.model_schema import VisionConfig
from jaxlm.data import (chat, image_kinds, images, loader as loader_lib, packing, preference, shards, sources,
                        tokenizer as tokenizer_lib, train_images)
from jaxlm.data.errors import DataError

BAD_IMAGES = ("skip", "stop")


# ---- records -> conversations with image markers --------------------------------------------------------------

def image_source(part: dict, where: str) -> str:
    """The path or data URL of one image part: OpenAI's {"type": "image_url", "image_url": {"url": ...}} or
    Hugging Face's {"type": "image", "image" | "path" | "url": ...}."""
    if part.get("type") == "image_url":
        url = part.get("image_url")
        src = url.get("url") if isinstance(url, dict) else url
    else:
        src = next((part[k] for k in ("image", "path", "url") if isinstance(part.get(k), str)), None)
    if not isinstance(src, str) or not src:
        raise DataError(f"{where}: an image part needs its path or data URL (image_url.url, or image / path / url)")
    return src


def flatten(content, marker: str, where: str) -> tuple[str, list[str]]:
    """A message content (a string, or a list of text and image parts) as text with `marker` where each image
    is, and the images' sources in order."""
    if not isinstance(content, list):
        return content, []
    text, sources = [], []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
        elif kind in ("image", "image_url"):
            sources.append(image_source(part, where))
            text.append(marker)
        else:
            raise DataError(f"{where}: a content part must be {{\"type\": \"text\", \"text\": ...}} or an image part "
                            f"(type image_url or image), not {json.dumps(part)[:80]}")
    return "".join(text), sources


def conversation(rec: dict, marker: str, where: str, folder: Path) -> tuple[list[dict], list[str]]:
    """The checked conversation of a record (chat.messages_of) with image markers in its text, and its images'
    sources in order; relative paths are taken from the folder of the file that names them."""
    rec, sources = dict(rec), []
    if isinstance(rec.get("messages"), list):
        msgs = []
        for m in rec["messages"]:
            if isinstance(m, dict) and "content" in m:
                text, found = flatten(m["content"], marker, where)
                m, sources = {**m, "content": text}, sources + found
            msgs.append(m)
        rec["messages"] = msgs
    else:
        for key in ("prompt", "completion"):
            if key in rec:
                rec[key], found = flatten(rec[key], marker, where)
                sources += found
    msgs = chat.messages_of(rec, where)
    local = [s if s.startswith("data:") or Path(s).is_absolute() else str(folder / s) for s in sources]
    return msgs, local


# ---- writing a folder -------------------------------------------------------------------------------------------

def vision_of(folder: str | Path) -> VisionConfig:
    """model.vision of a jaxlm model folder (config.json), one line when it has none."""
    path = Path(folder) / "config.json"
    try:
        v = json.loads(path.read_text())["model"]["vision"]
    except (OSError, ValueError, KeyError, TypeError):
        v = None
    if not isinstance(v, dict):
        raise DataError(f"{path} holds no model.vision: image data needs a vision-language model's folder "
                        "(`jaxlm convert from-hf` of Gemma 3, Llama 4, Qwen2.5-VL or Qwen3-VL)")
    return VisionConfig(**v)


class ImageWriter:
    """A split's images appended as uint8 records (fixed.to_record) under a temporary name, renamed with the index
    (and the grids, for a layout that stores them) at close."""

    def __init__(self, out: Path, split: str, fixed):
        self.out, self.split, self.fixed = out, split, fixed
        self.tmp = out / f".{split}-images.bin.tmp"
        self.file = open(self.tmp, "wb")
        self.starts, self.grids = [0], []

    def add(self, pixels: list[np.ndarray]) -> None:
        for p in pixels:
            record, grid = self.fixed.to_record(p)
            self.file.write(np.ascontiguousarray(record, np.uint8).tobytes())
            self.grids.append(grid)
        self.starts.append(self.starts[-1] + len(pixels))

    def close(self) -> int:
        self.file.close()
        saved = [("idx", np.asarray(self.starts, np.int64))]
        if self.fixed.stores_grids:
            saved.append(("grid", np.asarray(self.grids, np.int32).reshape(-1, 2)))
        for name, array in saved:
            np.save(self.out / f".{self.split}-images.{name}.tmp.npy", array)
            os.replace(self.out / f".{self.split}-images.{name}.tmp.npy", self.out / f"{self.split}-images.{name}.npy")
        os.replace(self.tmp, self.out / f"{self.split}-images.bin")
        return self.starts[-1]


def prepare_vision_chat(inputs: list[str | Path], out_dir: str | Path, tokenizer: str | Path,
                        vision: VisionConfig | None = None, max_tokens: int | None = None,
                        val: list[str | Path] | None = None, val_fraction: float = 0.01, bad_images: str = "skip",
                        max_pixels: int | None = images.MAX_PIXELS, processor=None, pairs: bool = False,
                        image_side: int | None = None, image_tokens: int | None = None,
                        max_tiles: int | None = None) -> dict:
    """Chat records in JSON-lines files (messages whose content holds text and image parts) -> a prepared folder:
    tokens with each image written as the tower's processor writes it (at the kind's fixed training shape,
    data/train_images.py), the loss mask on the assistant's turns, and the images resized beside the shards.
    `tokenizer`: a tokenizer, or a converted model's folder (whose config.json gives `vision` and whose image
    processor settings, data/hf_folder.py, the processor when not given). Llama 4: max_tiles, the canvas tiles an
    image at most (default the processor's max_patches). Qwen-VL: image_tokens, the budget of soft tokens an image (each at its own
    grid; default train_images.QWEN_TOKENS), or image_side, one square of that many pixels.
    pairs=True: preference records (data/preference.py) whose prompt messages hold the images, written as
    `jaxlm prepare preference` writes pairs (meta.json's kind "preference"), each of a pair's two documents with the
    prompt's images. max_pixels: an image's at most (None: images.MAX_PIXELS). A missing, corrupt or oversized
    image: with bad_images="skip" its record is left out and counted (meta.json "skipped"), with "stop" the run stops
    on one line naming the file and line. Records over `max_tokens` (a pair: its two documents together) are left
    out and counted. Returns the meta.json written."""
    if bad_images not in BAD_IMAGES:
        raise ConfigError(f"bad_images={bad_images!r}: use skip or stop")
    tok, max_pixels = tokenizer_lib.load(tokenizer), max_pixels or images.MAX_PIXELS
    vision = vision or vision_of(tokenizer)
    folder = Path(tokenizer) / "tokenizer" if (Path(tokenizer) / "tokenizer").is_dir() else Path(tokenizer)
    fixed = train_images.of_model(folder, vision, image_side, processor, image_tokens,
                                  max_tiles=max_tiles)
    marker = check_image_tokens(tok, vision)
    stats: collections.Counter = collections.Counter()
    encode = encode_pair_record if pairs else encode_record

    def units():
        for src, split in [(f, "train") for f in inputs] + [(f, "val") for f in (val or [])]:
            for rec, where in sources.records(str(src)):
                docs = encode(rec, where, tok, vision, marker, fixed, max_pixels, bad_images, stats,
                              Path(src).parent)
                if docs is not None:
                    yield split, where, docs

    return write_folder(out_dir, tok, fixed, units(), stats, max_tokens, bool(val), val_fraction,
                        {"kind": preference.KIND} if pairs else {})


def write_folder(out_dir, tok, fixed, units, stats: collections.Counter,
                 max_tokens: int | None, separate_val: bool, val_fraction: float, extra: dict) -> dict:
    """Write units (split, where, documents [(ids, mask, resized images)]: a conversation, or a pair's two) into a
    prepared folder with its images; a unit is never split between train and val. Returns the meta.json written
    (with `extra`'s fields)."""
    out = shards.begin(out_dir)
    dtype = shards.dtype_for(tok.vocab_size)
    writers = {s: (shards.ShardWriter(out, s, dtype, loss_mask=True), ImageWriter(out, s, fixed))
               for s in ("train", "val")}
    counts = np.zeros(tok.vocab_size, np.int64)
    most = 0
    try:
        for split, where, docs in units:
            n_tokens = sum(len(ids) for ids, _, _ in docs)
            if max_tokens is not None and n_tokens > max_tokens:
                stats["too_long_dropped"] += 1
                stats.setdefault("first_too_long", f"{where} ({n_tokens} tokens > {max_tokens})")
                continue
            n = stats["documents"]
            stats["documents"] += 1
            to_val = split == "val" or (not separate_val
                                        and np.floor((n + 1) * val_fraction) > np.floor(n * val_fraction))
            name = "val" if to_val else "train"
            for ids, mask, pixels in docs:
                writers[name][0].add(ids, mask)
                writers[name][1].add(pixels)
                counts += np.bincount(ids, minlength=tok.vocab_size)[:tok.vocab_size]
                most = max(most, len(pixels))
            stats[f"{name}_documents"] += 1
        entries = {s: w.close() for s, (w, _) in writers.items()}
        n_images = {s: w.close() for s, (_, w) in writers.items()}
    except BaseException:
        for w, im in writers.values():
            w.abort()
            im.file.close()
            im.tmp.unlink(missing_ok=True)
        raise
    for s in ("train", "val"):
        if not entries[s]["documents"]:
            raise DataError(f"the {s} split got no documents ({dict(stats)}); give more conversations, a larger "
                            "val_fraction or a separate val input")
    p = counts[counts > 0] / counts.sum()
    meta = {"format": shards.FORMAT, "vocab_size": tok.vocab_size, "dtype": dtype.name,
            "tokenizer": tokenizer_lib.save_copy(tok, out), "bos_id": tok.bos_id, "eos_id": tok.eos_id,
            "has_loss_mask": True, "splits": entries, "train_tokens": entries["train"]["tokens"],
            "val_tokens": entries["val"]["tokens"], "unigram_entropy": max(0.0, float(-(p * np.log(p)).sum())),
            "skipped": {k: v for k, v in stats.items() if not k.endswith("documents")},
            "images": {**fixed.meta(), "max_per_document": most, "counts": n_images}, **extra}
    shards.write_meta(out, meta)
    return meta


def check_image_tokens(tok, vision: VisionConfig) -> str:
    """The text an image part becomes (what the kind's chat template writes for one: Gemma 3 its begin-of-image
    token, Llama 4 <|image|>, Qwen-VL <|vision_start|><|image_pad|><|vision_end|>), checked: each of the model's
    image tokens must be a special token of the tokenizer, read back as its own id."""
    for name in ("boi_token_id", "image_token_id", "eoi_token_id"):
        i = getattr(vision, name)
        text = tok.decode([i]) if i < tok.vocab_size else ""
        if not text or tok.encode_rendered(text) != [i]:
            raise DataError(f"model.vision.{name}={i} is not a special token of the tokenizer {tok.describe()}; "
                            "prepare image data with the model's own tokenizer")
    if vision.kind in train_images.QWEN:
        return "".join(tok.decode([i]) for i in (vision.boi_token_id, vision.image_token_id, vision.eoi_token_id))
    return image_kinds.of(vision).marker(tok, vision)


def load_images(sources: list[str], where, fixed, max_pixels, bad_images, stats) -> list[np.ndarray] | None:
    """The resized images of one record, or None when one is bad and bad_images="skip" (counted in stats)."""
    pixels = []
    for src in sources:
        try:
            pixels.append(fixed.resized(images.load(src, max_pixels)))
        except images.ImageError as e:
            if bad_images == "stop":
                raise images.ImageError(f"{where}: {e} (bad_images=stop; skip such documents with "
                                        "bad_images=skip)") from None
            stats["bad_images_skipped"] += 1
            stats.setdefault("first_bad_image", f"{where}: {e}")
            return None
    return pixels


def encode_record(rec, where, tok, vision, marker, fixed, max_pixels, bad_images, stats, folder):
    """[(ids, mask, resized images)] of one conversation, or None when an image is bad and bad_images="skip"."""
    msgs, sources = conversation(rec, marker, where, folder)
    pixels = load_images(sources, where, fixed, max_pixels, bad_images, stats)
    if pixels is None:
        return None
    try:
        ids, mask = chat.encode_chat(tok, msgs, expand=lambda text: fixed.expand(text, tok, vision,
                                                                                  pixels[:text.count(marker)]))
    except ValueError as e:
        raise DataError(f"{where}: {e}") from None
    return [(ids, mask, pixels)]


def encode_pair_record(rec, where, tok, vision, marker, fixed, max_pixels, bad_images, stats, folder):
    """The two documents [(ids, mask, resized images)] of a preference record whose `prompt` messages hold the
    images (both replies share them), or None when an image is bad and bad_images="skip"."""
    if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), list):
        raise DataError(f"{where}: a preference record with images needs `prompt` as a list of messages holding "
                        "the images, with `chosen` and `rejected` replies")
    rec, found = dict(rec), []
    for key in ("prompt", "chosen", "rejected"):
        if not isinstance(rec.get(key), list):
            continue
        msgs = []
        for m in rec[key]:
            if isinstance(m, dict) and isinstance(m.get("content"), list):
                text, srcs = flatten(m["content"], marker, where)
                if srcs and key != "prompt":
                    raise DataError(f"{where}: `{key}` holds an image; images belong to the prompt, which both "
                                    "replies share")
                m, found = {**m, "content": text}, found + srcs
            msgs.append(m)
        rec[key] = msgs
    pair = preference.pair_of(rec, where)
    local = [s if s.startswith("data:") or Path(s).is_absolute() else str(folder / s) for s in found]
    pixels = load_images(local, where, fixed, max_pixels, bad_images, stats)
    if pixels is None:
        return None
    try:
        docs = preference.encode_pair(tok, pair, expand=lambda text: fixed.expand(text, tok, vision,
                                                                                   pixels[:text.count(marker)]))
    except ValueError as e:
        raise DataError(f"{where}: {e}") from None
    return [(ids, mask, pixels) for ids, mask in docs]


# ---- reading -----------------------------------------------------------------------------------------------------

class SplitImages:
    """One split's images: uint8 records [I, *record] memory-mapped (and Llama 4's canvases or Qwen-VL's grids
    [I, 2]), each document's range of them, and their kind's training layout (train_images.Fixed, Tiles or Grids),
    which normalizes them as the tower takes them."""

    def __init__(self, directory: Path, meta: dict, split: str, n_documents: int):
        info = meta["images"]
        self.fixed = train_images.of_meta(info)
        self.max_per_document = int(info["max_per_document"])
        paths = {name: directory / f"{split}-images.{name}.npy" for name in ("idx", "grid")}
        bin_path, record = directory / f"{split}-images.bin", self.fixed.record
        for path in (paths["idx"], bin_path) + ((paths["grid"],) if self.fixed.stores_grids else ()):
            if not path.is_file():
                raise DataError(f"{path} is missing; prepare the image data again")
        self.starts_D1 = np.load(paths["idx"])
        n = int(self.starts_D1[-1])
        self.grids = np.load(paths["grid"]) if self.fixed.stores_grids else None
        if (len(self.starts_D1) != n_documents + 1 or bin_path.stat().st_size != n * int(np.prod(record))
                or (self.grids is not None and self.grids.shape != (n, 2))):
            raise DataError(f"{bin_path} and its index do not match the {split} split ({n_documents} documents, "
                            f"{n} images of {record} bytes); prepare the image data again")
        self.pixels = np.memmap(bin_path, np.uint8, "r", shape=(n, *record)) if n else np.zeros((0, *record), np.uint8)

    def of(self, d: int) -> range:
        return range(int(self.starts_D1[d]), int(self.starts_D1[d + 1]))

    def read(self, ids: np.ndarray, key: str | None = None):
        """Normalized float32 images [..., *fixed.shape] of images `ids` (-1: an empty slot, zeros); a padded
        layout's dict, Llama 4's {"tiles": [..., K, S, S, 3], "canvas": [..., 2]} or Qwen-VL's {"patches":
        [..., P, Q], "grid": [..., 2]} (an empty slot: 0 x 0), or only the one named `key`."""
        f, have = self.fixed, ids >= 0
        if not f.padded:
            out = np.zeros(ids.shape + f.shape, np.float32)
            out[have] = f.normalized(self.pixels[ids[have]])
            return out
        grid = np.zeros(ids.shape + (2,), np.int32)
        grid[have] = self.grids[ids[have]] if self.grids is not None else f.default_grid
        if key == f.grid_key:
            return grid
        pixels = np.zeros(ids.shape + f.shape[f.key], np.float32)
        pixels[have] = f.normalized(self.pixels[ids[have]], grid[have])
        return pixels if key == f.key else {f.key: pixels, f.grid_key: grid}


def open_images(dataset) -> dict[str, SplitImages] | None:
    """The images of a prepared folder's splits (None for a folder without images); a folder at a URL is refused."""
    if "images" not in dataset.meta:
        return None
    local = storage.local_path(dataset.dir)
    if local is None:
        raise DataError(f"{dataset.dir}: image data is read from a local folder; copy it to a local disk")
    return {name: SplitImages(Path(local), dataset.meta, name, split.n_documents)
            for name, split in dataset.splits.items()}


class ImageSlots:
    """A batch plan's images: per micro-batch, the images of its rows in the order their image tokens appear, in
    B * K slots (`slots`, [A, B * K] or [B * K]; -1: empty), read from `store`."""

    slots: np.ndarray
    store: SplitImages

    def images(self, index: tuple, key: str | None = None) -> np.ndarray:
        """Normalized pixels of the image slots a device shard's `index` (over [A,] B * K, *image) selects (`key`:
        Qwen-VL's patches or grids)."""
        return self.store.read(self.slots[index[:self.slots.ndim]], key)


class Rows(ImageSlots):
    """The plan of a batch of one conversation per row [A, B] (or [B]): its documents and their image slots."""

    def __init__(self, docs: np.ndarray, slots: np.ndarray, store: SplitImages):
        self.docs, self.slots, self.store, self.shape = docs, slots, store, docs.shape

    def only_micro_batch(self) -> Rows:
        return Rows(self.docs[0], self.slots[0], self.store)

    def read(self, split: shards.Split, lead_index: tuple, cols: slice, keys: tuple[str, ...], T: int) -> dict:
        """inputs, targets and weights (1 on the assistant's targets; padding is never trained) of the rows
        `lead_index` selects, columns `cols`."""
        docs = self.docs[lead_index]
        tokens = np.full(docs.shape + (T + 1,), packing.PAD_ID, np.int32)
        mask = np.zeros(docs.shape + (T + 1,), np.float32)
        for at, d in np.ndenumerate(docs):
            start, end = int(split.doc_starts_D1[d]), int(split.doc_starts_D1[d + 1])
            tokens[at][:end - start] = split.take(np.arange(start, end))
            mask[at][:end - start] = split.take(np.arange(start, end), mask=True)
        full = {"inputs": tokens[..., :-1], "targets": tokens[..., 1:], "weights": mask[..., 1:]}
        return {k: full[k][..., cols] for k in keys}


class PackedRows(ImageSlots):
    """A packing.Packed plan of whole documents (conversations, or preference pairs' two documents) with the image
    slots of its rows: read as the packed plan reads (segment ids, positions from 0 in each document)."""

    def __init__(self, packed: packing.Packed, slots: np.ndarray, store: SplitImages):
        self.packed, self.slots, self.store, self.shape = packed, slots, store, packed.shape

    def only_micro_batch(self) -> PackedRows:
        return PackedRows(self.packed.only_micro_batch(), self.slots[0], self.store)

    def read(self, *args, **kwargs) -> dict:
        return self.packed.read(*args, **kwargs)


def slots_of(packed: packing.Packed, split: shards.Split, store: SplitImages, K: int) -> np.ndarray:
    """The image slots [*lead, B * K] of a plan of whole documents [*lead, B]: each micro-batch's images in the order
    of its rows and of the documents within them (the order of their image tokens), then -1."""
    *lead, B = packed.shape
    out = np.full((int(np.prod(lead, dtype=np.int64)), B * K), -1, np.int64)
    for m in range(out.shape[0]):
        ids = [i for row in packed.pieces[m * B:(m + 1) * B] for start, _ in row
               for i in store.of(int(np.searchsorted(split.doc_starts_D1, start, side="right")) - 1)]
        if len(ids) > B * K:  # the loaders fill rows within K images; a plan that does not is a bug, not bad data
            raise AssertionError(f"{len(ids)} images for {B * K} slots")
        out[m, :len(ids)] = ids
    return out.reshape(tuple(lead) + (B * K,))


def pair_images(store: SplitImages) -> np.ndarray:
    """Images of each preference pair [P]: its prompt's, once in each of its two documents."""
    n_D = np.diff(store.starts_D1)
    return n_D[0::2] + n_D[1::2]


class WithImages:
    """A loader of whole documents (PackedConversations, preference.PairLoader) whose plans come with their rows'
    image slots (PackedRows); the position is the inner loader's."""

    def __init__(self, inner, split: shards.Split, store: SplitImages, K: int):
        self.inner, self.split, self.store, self.K = inner, split, store, K

    def next(self) -> PackedRows:
        packed = self.inner.next()
        return PackedRows(packed, slots_of(packed, self.split, self.store, self.K), self.store)

    def state(self) -> dict:
        return self.inner.state()

    def restore(self, state: dict) -> None:
        self.inner.restore(state)


def check_rows(split: shards.Split, block_size: int) -> np.ndarray:
    """The split's document lengths [D], each checked to fit a row of block_size + 1 tokens (never cut)."""
    lengths = np.diff(split.doc_starts_D1)
    if lengths.max() > block_size + 1:
        d = int(np.argmax(lengths))
        raise DataError(f"document {d} of the {split.name} split of {split.dir} is {int(lengths[d])} tokens, and "
                        f"image data puts a conversation whole in a row of model.block_size + 1 = {block_size + 1}: "
                        f"raise model.block_size, or prepare with max_tokens <= {block_size + 1}")
    return lengths


class PackedConversations:
    """Conversations with images packed whole into rows (data.packing=true): each row takes the next conversations
    of its stream while their tokens fit block_size + 1 and their images its K slots; a packing.Packed plan of
    [grad_accum, batch] rows per `next()` (WithImages adds the image slots). The order is packing.PackedLoader's,
    and the position the number of conversations each stream has consumed."""

    def __init__(self, split: shards.Split, store: SplitImages, block_size: int, batch_size: int, grad_accum: int,
                 seed: int, slots: int):
        self.lengths_D = check_rows(split, block_size)
        self.starts_D, self.images_D = split.doc_starts_D1[:-1], np.diff(store.starts_D1)
        self.split, self.T, self.seed, self.K = split, block_size, seed, slots
        self.shape, self.n_docs = (grad_accum, batch_size), len(self.lengths_D)
        self.consumed_B = np.zeros(batch_size, np.int64)
        self._perms: dict[int, np.ndarray] = {}

    def row(self, b: int) -> list[tuple[int, int]]:
        room, slots, pieces = self.T + 1, self.K, []
        while True:
            i = b + int(self.consumed_B[b]) * self.shape[1]
            d = packing.stream_item(self._perms, self.seed, i, self.n_docs)
            length, n = int(self.lengths_D[d]), int(self.images_D[d])
            if length > room or n > slots:  # never at a row's start: check_rows and run.image_slots see to it
                return pieces
            pieces.append((int(self.starts_D[d]), length))
            room, slots = room - length, slots - n
            self.consumed_B[b] += 1

    def next(self) -> packing.Packed:
        return packing.plan(self.row, self.shape, loss_mask=True)

    def _layout(self) -> dict:
        return {"grad_accum": self.shape[0], "batch_size": self.shape[1], "block_size": self.T,
                "documents": self.n_docs, "images_per_row": self.K}

    def state(self) -> dict:
        return {"kind": "packed_images", "seed": self.seed, "consumed": self.consumed_B.tolist(), **self._layout()}

    def restore(self, state: dict) -> None:
        self.seed, (self.consumed_B,) = packing.restored_streams(state, "packed_images", self._layout(),
                                                                 ("consumed",), self.shape[1])
        self._perms.clear()


class RowLoader:
    """Conversations with images, one per row padded to block_size + 1 tokens, [grad_accum, batch] rows per
    `next()` with `slots` image slots per row (0: the most a document has); each epoch a permutation of the split's
    documents drawn from (seed, epoch), the position one count of documents consumed (saved in checkpoints for an
    exact resume)."""

    def __init__(self, split: shards.Split, store: SplitImages, block_size: int, batch_size: int, grad_accum: int,
                 seed: int, slots: int = 0):
        lengths = check_rows(split, block_size)
        self.split, self.store, self.seed = split, store, seed
        self.shape, self.K = (grad_accum, batch_size), slots or max(store.max_per_document, 1)
        self.n_docs, self.consumed = len(lengths), 0
        self._perms: dict[int, np.ndarray] = {}

    def next(self) -> Rows:
        A, B = self.shape
        docs = np.array([packing.stream_item(self._perms, self.seed, self.consumed + i, self.n_docs)
                         for i in range(A * B)], np.int64).reshape(A, B)
        self.consumed += A * B
        slots = np.full((A, B * self.K), -1, np.int64)
        for a in range(A):
            ids = [i for d in docs[a] for i in self.store.of(int(d))]
            slots[a, :len(ids)] = ids
        return Rows(docs, slots, self.store)

    def _layout(self) -> dict:
        return {"grad_accum": self.shape[0], "batch_size": self.shape[1], "documents": self.n_docs}

    def state(self) -> dict:
        return {"kind": "rows", "seed": self.seed, "consumed": self.consumed, **self._layout()}

    def restore(self, state: dict) -> None:
        if state.get("kind", "windows") != "rows":
            raise DataError(loader_lib.mode_changed(state.get("kind", "windows"), "rows"))
        loader_lib.check_layout(state, self._layout())
        self.seed, self.consumed = int(state["seed"]), int(state["consumed"])
        self._perms.clear()
