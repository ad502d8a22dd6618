"""Token files and a nanoGPT-style loader of random windows whose position can be saved and restored.

Every batch is drawn from one seeded numpy generator, so the data order depends only on the seed and
the number of batches drawn; the generator's state goes into each checkpoint for an exact resume.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxlm.data.prepare import DataError


class Dataset:
    """train.bin / val.bin / meta.json of one prepared corpus, memory-mapped."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        meta_path = self.dir / "meta.json"
        if not meta_path.is_file():
            raise DataError(f"{meta_path} is missing; prepare the data first (`jaxlm prepare ...`)")
        try:
            self.meta = json.loads(meta_path.read_text())
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
        self.splits = {name: self._open(name, dtype) for name in ("train", "val")}
        for name, data in self.splits.items():
            self._check_ids(name, data)

    def _open(self, name: str, dtype: np.dtype) -> np.ndarray:
        path = self.dir / f"{name}.bin"
        if not path.is_file():
            raise DataError(f"{path} is missing; prepare the data first (`jaxlm prepare ...`)")
        size = path.stat().st_size
        if size % dtype.itemsize:
            raise DataError(f"{path}: {size} bytes is not a whole number of {dtype} tokens (truncated file?)")
        n = size // dtype.itemsize
        expected = self.meta.get(f"{name}_tokens")
        if expected is not None and int(expected) != n:
            raise DataError(f"{path} holds {n} tokens but meta.json says {expected}; re-run `jaxlm prepare`")
        if n == 0:
            raise DataError(f"{path} is empty")
        return np.memmap(path, dtype=dtype, mode="r", shape=(n,))

    def _check_ids(self, name: str, data: np.ndarray) -> None:
        """Every token id must index the embedding table: out of range, a lookup yields NaN (or another
        row), never an error. One pass over the file in 64M-token chunks (about a second per 10 GB)."""
        chunk = 1 << 26
        for i in range(0, len(data), chunk):
            part = data[i:i + chunk]
            if int(part.max()) >= self.vocab_size:
                at = i + int(np.argmax(part >= self.vocab_size))
                raise DataError(f"{self.dir / (name + '.bin')} holds token id {int(data[at])} at position {at}, but "
                                f"meta.json's vocab_size is {self.vocab_size}; the files do not belong together, "
                                f"re-run `jaxlm prepare`")

    def check_block_size(self, block_size: int) -> None:
        for name, data in self.splits.items():
            if len(data) <= block_size:
                raise DataError(f"model.block_size={block_size} is too large for {self.dir / (name + '.bin')} "
                                f"({len(data)} tokens); use at most {len(data) - 1}")


def windows(data: np.ndarray, starts: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and next-token targets for windows beginning at `starts`: int32 [..., block_size] each."""
    idx = starts[..., None] + np.arange(block_size + 1)
    w = np.asarray(data[idx], dtype=np.int32)
    return w[..., :-1], w[..., 1:]


class Loader:
    """Random windows of one split, [grad_accum, batch, block] per call, from a resumable generator."""

    def __init__(self, data: np.ndarray, block_size: int, batch_size: int, grad_accum: int, seed: int):
        self.data, self.block_size = data, block_size
        self.shape = (grad_accum, batch_size)
        self.rng = np.random.Generator(np.random.PCG64(seed))

    def next_starts(self) -> np.ndarray:
        """Start offsets [grad_accum, batch] of the next global batch. Every process draws the same ones
        and then reads only its own rows, so the data order does not depend on the number of processes."""
        return self.rng.integers(0, len(self.data) - self.block_size, size=self.shape)

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        return windows(self.data, self.next_starts(), self.block_size)

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
        here = self._layout()
        differ = [k for k in here if k in state and state[k] != here[k]]
        if differ:
            names = {"grad_accum": "training.grad_accum", "batch_size": "training.batch_size (global)",
                     "block_size": "model.block_size", "tokens": "training tokens in train.bin"}
            diffs = ", ".join(f"{names[k]} {state[k]} there, {here[k]} here" for k in differ)
            raise DataError(f"the checkpoint's data position cannot continue in this run ({diffs}): the same "
                            f"generator state would draw different windows. Resume with the saved settings, or "
                            f"start a new run_dir with checkpoint.init_from=<this run> to keep the weights")
        try:
            self.rng.bit_generator.state = state["bit_generator"]
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"the checkpoint's data-loader state cannot be restored ({e}); "
                            f"it was written by an incompatible loader") from None


def fixed_starts(data: np.ndarray, block_size: int, batch_size: int, n: int, seed: int) -> np.ndarray:
    """Start offsets [n, batch] of held-out batches that are the same at every evaluation and resume."""
    rng = np.random.Generator(np.random.PCG64(seed))
    return rng.integers(0, len(data) - block_size, size=(n, batch_size))
