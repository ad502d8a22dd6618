"""Packing (`data.packing=true`): whole documents back to back in rows of R = block_size + 1 tokens, each with
its own segment id (1, 2, ... within a row; 0 = padding) and positions from 0, so attention never crosses a
document (model/attention.py masks by segment); a target is trained only inside its own document piece.

Each epoch is a permutation of the split's documents drawn from (seed, epoch), dealt round-robin to B streams,
one per row of the global batch; stream b fills row b of each micro-batch in turn. So the order does not depend
on the number of devices or processes, and the position is two integers per stream (documents consumed, tokens
consumed of the current one), saved in checkpoints for an exact resume (docs/packing.md).

Legend: A micro-batches per step, B rows per micro-batch, T block_size, R = T + 1, D documents.
"""

from __future__ import annotations

import numpy as np

from jaxlm.data import shards
from jaxlm.data.errors import DataError
from jaxlm.data.loader import check_layout, mode_changed, rows_of

PAD_ID = 0  # the token id of padding: any id in the vocabulary does, it is never attended to or trained


class Packed:
    """The plan of a packed batch: for each row (flat row number over the leading dims `shape`), its pieces
    as (global token offset, length) pairs."""

    def __init__(self, pieces: list[list[tuple[int, int]]], shape: tuple[int, ...], loss_mask: bool):
        self.pieces, self.shape, self.loss_mask = pieces, shape, loss_mask
        self._cache: dict = {}

    def only_micro_batch(self) -> Packed:
        """A plan of [1, B] rows as a plan of [B] rows (what an evaluation step takes)."""
        return Packed(self.pieces, self.shape[1:], self.loss_mask)

    def rows(self, split: shards.Split, flat_rows: np.ndarray, T: int) -> dict[str, np.ndarray]:
        """Tokens, segment ids, positions (int32 [n, R]), sources (int64 [n, R]: each token's offset in the split,
        -1 for padding) and, with a loss mask, mask (uint8) of these rows."""
        R = T + 1
        starts, lengths, row_of, col_of, seg_of = [], [], [], [], []
        for r, flat in enumerate(flat_rows.ravel()):
            col = 0
            for k, (start, length) in enumerate(self.pieces[flat]):
                starts.append(start), lengths.append(length), row_of.append(r), col_of.append(col)
                seg_of.append(k + 1)
                col += length
        lengths_P = np.asarray(lengths, dtype=np.int64)
        piece_N = np.repeat(np.arange(len(lengths_P)), lengths_P)  # which piece each token belongs to
        within_N = np.arange(len(piece_N)) - np.repeat(np.cumsum(lengths_P) - lengths_P, lengths_P)
        src_N = np.asarray(starts, dtype=np.int64)[piece_N] + within_N
        r_N, c_N = np.asarray(row_of)[piece_N], np.asarray(col_of)[piece_N] + within_N
        n = flat_rows.size
        out = {"tokens": np.full((n, R), PAD_ID, np.int32), "segment_ids": np.zeros((n, R), np.int32),
               "positions": np.zeros((n, R), np.int32), "sources": np.full((n, R), -1, np.int64)}
        out["tokens"][r_N, c_N] = split.take(src_N)
        out["sources"][r_N, c_N] = src_N
        out["segment_ids"][r_N, c_N] = np.asarray(seg_of, dtype=np.int32)[piece_N]
        out["positions"][r_N, c_N] = within_N
        if self.loss_mask:
            out["mask"] = np.zeros((n, R), np.uint8)
            out["mask"][r_N, c_N] = split.take(src_N, mask=True)
        return out

    def read(self, split: shards.Split, lead_index: tuple, cols: slice, keys: tuple[str, ...], T: int,
             reference: np.ndarray | None = None) -> dict:
        """The batch arrays of the rows `lead_index` selects (columns `cols`), reading only those rows'
        tokens. Whole rows are assembled once per row selection (devices that split a row's columns share it).
        "ref_logps" (float32, 0 where the target is not counted) come from `reference`, a value per token of the
        split (reference.py: the reference model's log-probability of that token)."""
        flat = rows_of(self.shape, lead_index)
        key = (flat.shape, flat.ravel().tobytes(), keys)
        if key not in self._cache:
            rows = self.rows(split, flat, T)
            seg_NR = rows["segment_ids"]
            counted = (seg_NR[:, 1:] == seg_NR[:, :-1]) & (seg_NR[:, 1:] > 0)
            if self.loss_mask:
                counted &= rows["mask"][:, 1:] > 0
            lead = flat.shape
            full = {"inputs": rows["tokens"][:, :-1], "targets": rows["tokens"][:, 1:],
                    "positions": rows["positions"][:, :-1], "segment_ids": seg_NR[:, :-1],
                    "weights": counted.astype(np.float32)}
            if "ref_logps" in keys:
                targets = np.maximum(rows["sources"][:, 1:], 0)
                full["ref_logps"] = np.where(counted, reference[targets], 0).astype(np.float32)
            self._cache[key] = {k: v.reshape(lead + (T,)) for k, v in full.items() if k in keys}
        return {k: v[..., cols] for k, v in self._cache[key].items()}


class PackedLoader:
    """Packed rows of one split, a plan of [grad_accum, batch] rows per `next()`, resumable exactly."""

    def __init__(self, split: shards.Split, block_size: int, batch_size: int, grad_accum: int, seed: int,
                 loss_mask: bool = False):
        if split.doc_starts_D1 is None:
            raise DataError(f"data.packing=true needs document boundaries, and the {split.name} split of "
                            f"{split.dir} has none (a format-1 train.bin/val.bin); prepare the corpus again with "
                            f"`jaxlm prepare`, or set data.packing=false")
        self.split, self.T, self.seed, self.loss_mask = split, block_size, seed, loss_mask
        self.shape = (grad_accum, batch_size)
        self.starts_D = split.doc_starts_D1[:-1]
        self.lengths_D = np.diff(split.doc_starts_D1)
        self.n_docs = len(self.lengths_D)
        self.consumed_B = np.zeros(batch_size, np.int64)  # documents each stream has finished
        self.offset_B = np.zeros(batch_size, np.int64)  # tokens of its current document already placed
        self._perms: dict[int, np.ndarray] = {}

    def _document(self, b: int) -> int:
        """The document stream b is on: number b + consumed * B of the sequence of epochs."""
        return stream_item(self._perms, self.seed, b + int(self.consumed_B[b]) * self.shape[1], self.n_docs)

    def row(self, b: int) -> list[tuple[int, int]]:
        """Fill one row from stream b; advance the stream past what it placed."""
        R = self.T + 1
        room, pieces = R, []
        while room > 1:
            d = self._document(b)
            offset = int(self.offset_B[b])
            left = int(self.lengths_D[d]) - offset
            if left <= room:  # the document (or the rest of a split one) fits
                pieces.append((int(self.starts_D[d]) + offset, left))
                room -= left
                self.consumed_B[b] += 1
                self.offset_B[b] = 0
            elif offset == 0 and left <= R:  # fits a row, but not this one's remaining room
                break
            else:  # longer than a row: fill the room, continue one token back in the next row
                pieces.append((int(self.starts_D[d]) + offset, room))
                self.offset_B[b] += room - 1
                room = 0
        return pieces

    def next(self) -> Packed:
        return plan(self.row, self.shape, self.loss_mask)

    def _layout(self) -> dict:
        return {"grad_accum": self.shape[0], "batch_size": self.shape[1], "block_size": self.T,
                "tokens": self.split.n_tokens, "documents": self.n_docs, "loss_mask": self.loss_mask}

    def state(self) -> dict:
        return {"kind": "packed", "seed": self.seed, "consumed": self.consumed_B.tolist(),
                "offset": self.offset_B.tolist(), **self._layout()}

    def restore(self, state: dict) -> None:
        self.seed, (self.consumed_B, self.offset_B) = restored_streams(state, "packed", self._layout(),
                                                                       ("consumed", "offset"), self.shape[1])
        self._perms.clear()


def stream_item(perms: dict[int, np.ndarray], seed: int, i: int, n: int) -> int:
    """Item i of the sequence of epochs, each a permutation of n items drawn from (seed, epoch); `perms` keeps the
    permutations of the epochs in use."""
    epoch, k = divmod(i, n)
    if epoch not in perms:
        if len(perms) > 1:  # streams stay within an epoch of each other: two are enough
            perms.pop(min(perms))
        rng = np.random.Generator(np.random.PCG64([seed, epoch]))
        perms[epoch] = rng.permutation(n)
    return int(perms[epoch][k])


def plan(row, shape: tuple[int, int], loss_mask: bool) -> Packed:
    """A Packed plan of [A, B] rows, row b of each micro-batch filled in turn by `row(b)` from stream b."""
    A, B = shape
    pieces: list = [None] * (A * B)
    for b in range(B):
        for a in range(A):
            pieces[a * B + b] = row(b)
    return Packed(pieces, shape, loss_mask)


def restored_streams(state: dict, kind: str, layout: dict, keys: tuple[str, ...], B: int
                     ) -> tuple[int, list[np.ndarray]]:
    """The seed and the per-stream counters `keys` ([B] each) of a saved loader `state` of this `kind` and
    `layout`; one line when the checkpoint was written by another kind of loader or with other settings."""
    if state.get("kind", "windows") != kind:
        raise DataError(mode_changed(state.get("kind", "windows"), kind))
    check_layout(state, layout)
    try:
        return int(state["seed"]), [np.asarray(state[k], np.int64).reshape(B) for k in keys]
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"the checkpoint's data-loader state cannot be restored ({e}); "
                        f"it was written by an incompatible loader") from None
