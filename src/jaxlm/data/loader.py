"""The reading side of a prepared dataset: its checks, and the loaders that turn it into training batches
whose position can be saved in a checkpoint and restored exactly (docs/packing.md).

Rows are cut from a split (shards.Split) as random windows (`Loader`, nanoGPT's way: block_size + 1 tokens from a
random offset, one seeded generator's state the position) or as packed whole documents (packing.py). `next()`
plans the whole global batch alike in every process, so the order never depends on the number of processes;
`read` fetches only the rows a process's devices hold. Batches are dicts of int32 "inputs", "targets" and, when
a run needs them, int32 "positions", "segment_ids" and float32 "weights" (1 = the target is trained).

Legend: A micro-batches per step, B rows per micro-batch, T block_size, R = T + 1 tokens per row.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxlm import storage
from jaxlm.config import DataConfig
from jaxlm.data import remote, shards
from jaxlm.data.errors import DataError

PACKED_KEYS = ("positions", "segment_ids", "weights")


def batch_keys(packing: bool, loss_mask: bool) -> tuple[str, ...]:
    """The arrays a train step takes: inputs and targets always; packing adds positions, segment ids and
    weights (padding and targets across a document boundary are not trained); a loss mask adds weights."""
    keys = ("inputs", "targets")
    if packing:
        return keys + PACKED_KEYS
    return keys + ("weights",) if loss_mask else keys


class Dataset:
    """One prepared folder: meta.json and the train and val splits (shards.Split), memory-mapped from a local
    folder or read by ranges from a URL's (remote.Folder, under `settings`' data.cache_mb and data.block_kb)."""

    def __init__(self, directory: str | Path, settings: DataConfig | None = None):
        local = storage.local_path(directory)
        self.dir = local if local is not None else str(directory).rstrip("/")
        self.meta = read_meta(self.dir)
        meta_path = storage.join(self.dir, "meta.json")
        try:
            self.vocab_size = int(self.meta["vocab_size"])
            dtype = np.dtype(self.meta.get("dtype", "uint16"))
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{meta_path} is not a valid meta.json ({e.__class__.__name__}: {e})") from None
        if dtype not in (np.uint16, np.uint32):
            raise DataError(f"{meta_path}: dtype {dtype} is not supported (uint16 or uint32)")
        if self.vocab_size <= 0:
            raise DataError(f"{meta_path}: vocab_size {self.vocab_size} must be > 0")
        if self.vocab_size > np.iinfo(dtype).max + 1:
            raise DataError(f"{meta_path}: vocab_size {self.vocab_size} does not fit in {dtype}")
        settings = settings or DataConfig()
        folder = None if local is not None else remote.Folder(self.dir, settings.cache_mb << 20,
                                                              settings.block_kb << 10)
        try:
            self.splits = {name: shards.Split(self.dir, self.meta, name, folder) for name in ("train", "val")}
        except (shards.FormatError, KeyError, TypeError) as e:
            raise DataError(str(e) if isinstance(e, shards.FormatError) else
                            f"{meta_path} is not a valid meta.json ({e.__class__.__name__}: {e})") from None
        for split in self.splits.values():
            self._check_ids(split)
        self.has_loss_mask = all(s.has_mask for s in self.splits.values())
        self.streamed = folder is not None

    def _check_ids(self, split: shards.Split) -> None:
        """Every token id must index the embedding table: out of range, a lookup yields NaN (or another
        row), never an error. One pass over each shard in 64M-token chunks (docs/reliability.md); shards at a
        URL are checked block by block as they are fetched instead (remote.RemoteArray.check_below)."""
        chunk = 1 << 26
        for k, data in enumerate(split.tokens_S):
            if isinstance(data, remote.RemoteArray):
                data.check_below(self.vocab_size)
                continue
            for i in range(0, len(data), chunk):
                part = data[i:i + chunk]
                if int(part.max()) >= self.vocab_size:
                    at = i + int(np.argmax(part >= self.vocab_size))
                    raise DataError(f"{data.filename} holds token id {int(data[at])} at position {at}, but "
                                    f"meta.json's vocab_size is {self.vocab_size}; the files do not belong "
                                    f"together, re-run `jaxlm prepare`")

    def check_block_size(self, block_size: int) -> None:
        for name, split in self.splits.items():
            if len(split) <= block_size:
                raise DataError(f"model.block_size={block_size} is too large for the {name} split of {self.dir} "
                                f"({len(split)} tokens); use at most {len(split) - 1}")

    def without_documents(self):
        """This folder if its splits have no document boundaries (format 1), else None."""
        return self.dir if self.splits["train"].doc_starts_D1 is None else None

    def describe(self) -> str:
        pairs = self.meta.get("kind") == "preference"  # data/preference.py: two documents a pair

        def one(name: str) -> str:
            s = self.splits[name]
            docs = (f" in {s.n_documents // 2:,} pairs" if pairs else f" in {s.n_documents:,} documents"
                    if s.n_documents is not None else "")
            return f"{name} {s.n_tokens:,} tokens{docs}"

        ent = self.meta.get("unigram_entropy")
        return (f"{one('train')}, {one('val')}, vocab {self.vocab_size}"
                + (", loss mask" if self.has_loss_mask else "")
                + (f", unigram entropy {ent:.3f} nats" if ent is not None else ""))


def read_meta(directory: str | Path) -> dict:
    """A prepared folder's meta.json (a path or a URL); one line when it is missing or not a JSON object, or when
    a URL's storage cannot be reached."""
    meta_path = storage.join(directory, "meta.json")
    try:
        if storage.local_path(directory) is not None:
            if not Path(meta_path).is_file():
                raise FileNotFoundError(meta_path)
            text = Path(meta_path).read_text()
        else:
            storage.check_reachable(directory, "data.dir")
            text = storage.read_text(meta_path)
    except FileNotFoundError:
        raise DataError(f"{meta_path} is missing; prepare the data first (`jaxlm prepare ...`)") from None
    try:
        meta = json.loads(text)
    except ValueError as e:
        raise DataError(f"{meta_path} is not a valid meta.json ({e.__class__.__name__}: {e})") from None
    if not isinstance(meta, dict):
        raise DataError(f"{meta_path} is not a valid meta.json (not a JSON object)")
    return meta


def rows_of(shape: tuple[int, ...], lead_index: tuple) -> np.ndarray:
    """Flat row numbers of the rows `lead_index` (slices over the leading dims of a batch) selects."""
    return np.arange(int(np.prod(shape))).reshape(shape)[lead_index]


class Windows:
    """The plan of a batch of random windows: their start offsets [A, B] (or [B])."""

    def __init__(self, starts: np.ndarray):
        self.starts = starts
        self.shape = starts.shape

    def only_micro_batch(self) -> Windows:
        """A plan of [1, B] rows as a plan of [B] rows (what an evaluation step takes)."""
        return Windows(self.starts[0])

    def read(self, split: shards.Split, lead_index: tuple, cols: slice, keys: tuple[str, ...], T: int) -> dict:
        """The arrays named in `keys` for the rows `lead_index` and columns `cols` of the batch. Only the
        tokens of these rows and columns are read from the shards."""
        idx = self.starts[lead_index][..., None] + np.arange(T)[cols]
        out = {"inputs": split.take(idx).astype(np.int32), "targets": split.take(idx + 1).astype(np.int32)}
        if "weights" in keys:
            out["weights"] = split.take(idx + 1, mask=True).astype(np.float32)
        return out


class Loader:
    """Random windows of one split, [grad_accum, batch, block] per call, from a resumable generator."""

    def __init__(self, split: shards.Split, block_size: int, batch_size: int, grad_accum: int, seed: int):
        self.data, self.block_size = split, block_size
        self.shape = (grad_accum, batch_size)
        self.rng = np.random.Generator(np.random.PCG64(seed))

    def next_starts(self) -> np.ndarray:
        """Start offsets [grad_accum, batch] of the next global batch. Every process draws the same ones
        and then reads only its own rows, so the data order does not depend on the number of processes."""
        return self.rng.integers(0, len(self.data) - self.block_size, size=self.shape)

    def next(self) -> Windows:
        return Windows(self.next_starts())

    def row(self, b: int) -> int:
        """The start of one window (for a mixture, which draws rows one at a time)."""
        return int(self.rng.integers(0, len(self.data) - self.block_size))

    def _layout(self) -> dict:
        """What the drawn windows depend on besides the generator: the same state continues the same data
        order only over the same token count with the same batch shape and window length. The number of
        devices and processes does not matter (every process draws the global batch)."""
        return {"grad_accum": self.shape[0], "batch_size": self.shape[1], "block_size": self.block_size,
                "tokens": len(self.data)}

    def state(self) -> dict:
        return {"bit_generator": self.rng.bit_generator.state, **self._layout()}

    def restore(self, state: dict) -> None:
        """Continue exactly where the checkpoint's loader stopped, or fail saying why that is impossible."""
        if state.get("kind", "windows") != "windows":
            raise DataError(mode_changed(state.get("kind"), "windows"))
        check_layout(state, self._layout())
        try:
            self.rng.bit_generator.state = state["bit_generator"]
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"the checkpoint's data-loader state cannot be restored ({e}); "
                            f"it was written by an incompatible loader") from None


LAYOUT_NAMES = {"grad_accum": "training.grad_accum", "batch_size": "training.batch_size (global)",
                "block_size": "model.block_size", "tokens": "training tokens in the train split",
                "documents": "training documents in the train split", "sources": "data.mixture's datasets",
                "weights": "data.mixture's weights", "loss_mask": "data.loss_mask",
                "pairs": "preference pairs in the train split", "packing": "data.packing"}


def check_layout(state: dict, here: dict) -> None:
    differ = [k for k in here if k in state and state[k] != here[k]]
    if differ:
        diffs = ", ".join(f"{LAYOUT_NAMES[k]} {state[k]} there, {here[k]} here" for k in differ)
        raise DataError(f"the checkpoint's data position cannot continue in this run ({diffs}): the same "
                        f"state would read different rows. Resume with the saved settings, or "
                        f"start a new run_dir with checkpoint.init_from=<this run> to keep the weights")


def mode_changed(saved, here: str) -> str:
    name = {"windows": "random windows (data.packing=false)", "packed": "packing (data.packing=true)",
            "mixture": "a mixture (data.mixture)", "pairs": "preference pairs (training.objective=dpo|ipo|orpo)",
            "rows": "conversations with images, one per row (data/vision_data.py)"}
    return (f"the checkpoint's data position was saved by {name.get(saved, repr(saved))} and this run reads "
            f"{name[here]}; resume with the saved data settings, or start a new run_dir with "
            f"checkpoint.init_from=<this run> to keep the weights")

