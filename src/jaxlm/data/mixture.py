"""Data mixtures (`data.mixture="dirA:0.7,dirB:0.3"`): several prepared datasets read as one, each row of each
batch drawn from a dataset chosen with the given weights.

Each dataset keeps its own loader (random windows or packed streams, loader.py / packing.py); a seeded
generator picks the source of every row of the global batch, and only the chosen source's loader advances
(for packing, only the stream of that row). The generator's state and every source's loader state make the
mixture's position, saved in checkpoints for an exact resume. The datasets must share one tokenizer.

Legend: A micro-batches per step, B rows per micro-batch, T block_size, S sources.
"""

from __future__ import annotations

import json

import numpy as np

from jaxlm.data import loader as loader_lib, packing, shards
from jaxlm.data.errors import DataError
from jaxlm.data.loader import check_layout, mode_changed, rows_of


class MixedSplit:
    """One split of every source, in mixture order."""

    def __init__(self, sources: list[shards.Split]):
        self.sources = sources


class MixtureDataset:
    """The mixture's datasets, checked to share one tokenizer; looks like a loader.Dataset to the training
    loop (meta, vocabulary, splits, checks)."""

    def __init__(self, sources: list[tuple[str, float]]):
        self.datasets = [loader_lib.Dataset(path) for path, _ in sources]
        self.weights = [w for _, w in sources]
        first = self.datasets[0]
        for ds in self.datasets[1:]:
            for key in ("tokenizer", "vocab_size"):
                if ds.meta.get(key) != first.meta.get(key):
                    raise DataError(f"data.mixture: {ds.dir} and {first.dir} have different tokenizers (meta.json "
                                    f"{key}: {json.dumps(ds.meta.get(key))[:80]} vs "
                                    f"{json.dumps(first.meta.get(key))[:80]}); prepare them with the same one")
        self.dir, self.meta, self.vocab_size = first.dir, first.meta, first.vocab_size
        self.splits = {name: MixedSplit([ds.splits[name] for ds in self.datasets]) for name in ("train", "val")}
        self.has_loss_mask = all(ds.has_loss_mask for ds in self.datasets)

    def check_block_size(self, block_size: int) -> None:
        for ds in self.datasets:
            ds.check_block_size(block_size)

    def without_documents(self):
        """The first source without document boundaries (format 1), or None."""
        return next((ds.dir for ds in self.datasets if ds.splits["train"].doc_starts_D1 is None), None)

    def describe(self) -> str:
        return "; ".join(f"{w:g} x {ds.dir}: {ds.describe()}" for ds, w in zip(self.datasets, self.weights))


class MixedPlan:
    """The plan of a mixed batch: for each row (flat over `shape`), its source and that source's row item (a
    window start, or a packed row's pieces)."""

    def __init__(self, items: list[tuple[int, object]], shape: tuple[int, ...], packed: bool, loss_mask: bool):
        self.items, self.shape, self.packed, self.loss_mask = items, shape, packed, loss_mask

    def only_micro_batch(self) -> MixedPlan:
        """A plan of [1, B] rows as a plan of [B] rows (what an evaluation step takes)."""
        return MixedPlan(self.items, self.shape[1:], self.packed, self.loss_mask)

    def read(self, split: MixedSplit, lead_index: tuple, cols: slice, keys: tuple[str, ...], T: int) -> dict:
        flat = rows_of(self.shape, lead_index)
        ncols = len(range(T)[cols])
        out: dict[str, np.ndarray] = {}
        source_N = np.array([self.items[f][0] for f in flat.ravel()])
        for s in np.unique(source_N):
            sel = np.flatnonzero(source_N == s)
            row_items = [self.items[f][1] for f in flat.ravel()[sel]]
            sub = (packing.Packed(row_items, (len(sel),), self.loss_mask) if self.packed
                   else loader_lib.Windows(np.array(row_items, dtype=np.int64)))
            part = sub.read(split.sources[s], (slice(None),), cols, keys, T)
            for k, v in part.items():
                if k not in out:
                    out[k] = np.zeros((flat.size, ncols), v.dtype)
                out[k][sel] = v
        return {k: v.reshape(flat.shape + (ncols,)) for k, v in out.items()}


class MixtureLoader:
    """Rows of several sources, [grad_accum, batch] per `next()`, resumable exactly."""

    def __init__(self, loaders: list, weights: list[float], names: list[str], seed: int, packed: bool,
                 loss_mask: bool):
        self.loaders, self.names, self.packed, self.loss_mask = loaders, names, packed, loss_mask
        self.weights = [float(w) for w in weights]
        self.p = np.asarray(self.weights) / sum(self.weights)
        self.shape = loaders[0].shape
        self.rng = np.random.Generator(np.random.PCG64([seed, 1]))  # not the sources' own streams

    def next(self) -> MixedPlan:
        A, B = self.shape
        source_AB = self.rng.choice(len(self.p), size=(A, B), p=self.p)
        items: list = [None] * (A * B)
        for b in range(B):
            for a in range(A):
                s = int(source_AB[a, b])
                items[a * B + b] = (s, self.loaders[s].row(b))
        return MixedPlan(items, self.shape, self.packed, self.loss_mask)

    def _layout(self) -> dict:
        return {"sources": self.names, "weights": self.weights}

    def state(self) -> dict:
        return {"kind": "mixture", "bit_generator": self.rng.bit_generator.state, **self._layout(),
                "loaders": [ld.state() for ld in self.loaders]}

    def restore(self, state: dict) -> None:
        if state.get("kind", "windows") != "mixture":
            raise DataError(mode_changed(state.get("kind", "windows"), "mixture"))
        check_layout(state, self._layout())
        try:
            self.rng.bit_generator.state = state["bit_generator"]
            saved = state["loaders"]
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"the checkpoint's data-loader state cannot be restored ({e}); "
                            f"it was written by an incompatible loader") from None
        for ld, st in zip(self.loaders, saved):
            ld.restore(st)
