"""The prepared-dataset format (docs/data.md, "The prepared folder"): token shards of bounded size, an index of
document boundaries per shard and, for chat data, a loss mask; written so that an interrupted prepare never
leaves a folder that looks finished (meta.json is written last, by an atomic rename).

Format 2: meta.json (vocab_size, dtype, tokenizer, format=2, splits with their shards' token and document counts)
and per shard {split}-{k:05d}.bin (token ids, whole documents back to back), .idx.npy (int64 [documents + 1]:
document starts, then the length) and .mask.bin (uint8 per token, 1 = trained). A shard closes at the first
document boundary past `shard_tokens`. nanoGPT's train.bin/val.bin (format 1) stay readable: one shard per split.

Legend: N tokens of a split (all shards), D documents, S shards.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from jaxlm.errors import UserError

FORMAT = 2
DEFAULT_SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 ids; a shard is memory-mapped, never read whole


class FormatError(UserError, ValueError):
    """A prepared folder whose files do not match its meta.json; the message names the file."""


def dtype_for(vocab_size: int) -> np.dtype:
    if vocab_size > np.iinfo(np.uint32).max + 1:
        raise FormatError(f"a vocabulary of {vocab_size:,} tokens does not fit in uint32 token files (at most 2**32)")
    return np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32)


def shard_name(split: str, k: int) -> str:
    return f"{split}-{k:05d}"


def begin(out_dir: str | Path) -> Path:
    """Make the folder and take away its meta.json first: until the new one is written, the folder reads as
    unprepared rather than as the old corpus with half-rewritten shards."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)
    return out


def write_meta(out_dir: str | Path, meta: dict) -> None:
    """The last step of a prepare: meta.json appears whole or not at all."""
    path = Path(out_dir) / "meta.json"
    tmp = path.with_name(f".meta.json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, path)


class ShardWriter:
    """Appends documents of one split to shards of about `shard_tokens` tokens. Each shard is written under a
    temporary name and renamed when closed; `close()` returns the split's entry for meta.json."""

    def __init__(self, out_dir: str | Path, split: str, dtype, shard_tokens: int = DEFAULT_SHARD_TOKENS,
                 loss_mask: bool = False):
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens={shard_tokens} must be >= 1")
        self.dir, self.split, self.dtype = Path(out_dir), split, np.dtype(dtype)
        self.shard_tokens, self.loss_mask = shard_tokens, loss_mask
        self.shards: list[dict] = []
        self._open = None

    def _start(self) -> None:
        name = shard_name(self.split, len(self.shards))
        self._name = name
        self._tokens = open(self.dir / f".{name}.bin.tmp", "wb")
        self._mask = open(self.dir / f".{name}.mask.bin.tmp", "wb") if self.loss_mask else None
        self._starts: list[int] = []
        self._n = 0
        self._open = True

    def add(self, ids: np.ndarray, mask: np.ndarray | None = None) -> None:
        """One document's token ids (BOS/EOS included as the tokenizer uses them) and, with a loss mask, its
        per-token 0/1 targets mask of the same length."""
        self.add_many([ids], None if mask is None else [mask])

    def add_many(self, ids_list: list[np.ndarray], masks: list[np.ndarray] | None = None) -> None:
        """Documents in order, as add() of each, written with one write per shard they fall in."""
        ids_list = [np.asarray(ids) for ids in ids_list]
        if any(ids.ndim != 1 for ids in ids_list):
            raise ValueError("a document is a non-empty 1-D array of token ids")
        if self.loss_mask and (masks is None or len(masks) != len(ids_list)
                               or any(len(m) != len(i) for m, i in zip(masks, ids_list))):
            raise ValueError("with a loss mask, every document needs a mask of its own length")
        if ids_list:
            self.add_flat(np.concatenate(ids_list), np.fromiter(map(len, ids_list), np.int64, len(ids_list)),
                          np.concatenate(masks) if self.loss_mask else None)

    def add_flat(self, ids_T: np.ndarray, lengths_D: np.ndarray, mask_T: np.ndarray | None = None) -> None:
        """Documents in order given end to end: their token ids (and loss masks) in one array, and their lengths."""
        if (lengths_D <= 0).any() or ids_T.ndim != 1 or lengths_D.sum() != len(ids_T):
            raise ValueError("a document is a non-empty 1-D array of token ids")
        offsets = np.concatenate([[0], np.cumsum(lengths_D)])
        i = 0
        while i < len(lengths_D):
            if not self._open:
                self._start()
            ends_D = self._n + offsets[i + 1:] - offsets[i]
            full = np.flatnonzero(ends_D >= self.shard_tokens)
            j = i + (int(full[0]) + 1 if len(full) else len(ends_D))  # this shard takes documents i..j-1
            self._starts.extend([self._n, *ends_D[:j - i - 1].tolist()])
            self._tokens.write(ids_T[offsets[i]:offsets[j]].astype(self.dtype, copy=False).tobytes())
            if self._mask is not None:
                self._mask.write(mask_T[offsets[i]:offsets[j]].astype(np.uint8, copy=False).tobytes())
            self._n = int(ends_D[j - i - 1])
            if self._n >= self.shard_tokens:
                self._finish()
            i = j

    def _finish(self) -> None:
        self._tokens.close()
        if self._mask is not None:
            self._mask.close()
        name = self._name
        np.save(self.dir / f".{name}.idx.tmp.npy", np.asarray(self._starts + [self._n], dtype=np.int64))
        os.replace(self.dir / f".{name}.idx.tmp.npy", self.dir / f"{name}.idx.npy")
        if self._mask is not None:
            os.replace(self.dir / f".{name}.mask.bin.tmp", self.dir / f"{name}.mask.bin")
        os.replace(self.dir / f".{name}.bin.tmp", self.dir / f"{name}.bin")
        self.shards.append({"name": name, "tokens": self._n, "documents": len(self._starts)})
        self._open = False

    def close(self) -> dict:
        if self._open:
            self._finish()
        return {"tokens": sum(s["tokens"] for s in self.shards),
                "documents": sum(s["documents"] for s in self.shards), "shards": self.shards}

    def abort(self) -> None:
        """Remove the shard being written (an interrupted prepare leaves only what `begin` said is unprepared)."""
        if self._open:
            self._tokens.close()
            if self._mask is not None:
                self._mask.close()
            for suffix in (".bin.tmp", ".mask.bin.tmp"):
                (self.dir / f".{self._name}{suffix}").unlink(missing_ok=True)
            self._open = False


def check_size(where: str, size: int, dtype: np.dtype, expected) -> int:
    """The number of values in a file of `size` bytes, checked against meta.json's count (`expected`, None for
    masks and format 1); `where` names it in the one-line error."""
    if size % dtype.itemsize:
        raise FormatError(f"{where}: {size} bytes is not a whole number of {dtype} tokens (truncated file?)")
    n = size // dtype.itemsize
    if expected is not None and int(expected) != n:
        raise FormatError(f"{where} holds {n} tokens but meta.json says {expected}; re-run `jaxlm prepare`")
    if n == 0:
        raise FormatError(f"{where} is empty")
    return n


class LocalFolder:
    """A prepared folder on a local disk: token and mask files memory-mapped, document indexes loaded. (A folder
    at a URL is read by remote.Folder, with the same methods.)"""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)

    def where(self, file: str) -> str:
        return str(self.dir / file)

    def array(self, file: str, dtype: np.dtype, expected) -> np.ndarray:
        path = self.dir / file
        if not path.is_file():
            raise FormatError(f"{path} is missing; prepare the data first (`jaxlm prepare ...`)")
        n = check_size(str(path), path.stat().st_size, dtype, expected)
        return np.memmap(path, dtype=dtype, mode="r", shape=(n,))

    def index(self, file: str) -> np.ndarray:
        path = self.dir / file
        if not path.is_file():
            raise FormatError(f"{path} is missing; re-run `jaxlm prepare`")
        return np.load(path)


class Split:
    """One split of a prepared folder: its shards as one sequence of N tokens (`take` reads any global offsets),
    the documents' global start offsets [D + 1] (None for format 1), and the loss mask (None without one). The
    files are memory-mapped (LocalFolder), or read by ranges from object storage (`folder`, a remote.Folder)."""

    def __init__(self, directory: str | Path, meta: dict, split: str, folder=None):
        self.dir, self.name = (Path(directory) if folder is None else directory), split
        self.folder = LocalFolder(directory) if folder is None else folder
        dtype = np.dtype(meta.get("dtype", "uint16"))
        entry = meta.get("splits", {}).get(split) if "splits" in meta else None
        if entry is None and "splits" in meta:
            raise FormatError(f"{self.folder.where('meta.json')} has no split {split!r}")
        if entry is None:  # format 1
            shards = [{"name": split, "tokens": meta.get(f"{split}_tokens"), "documents": None}]
        else:
            shards = entry["shards"]
        self.tokens_S = [self.folder.array(s["name"] + ".bin", dtype, s["tokens"]) for s in shards]
        sizes_S = np.array([len(t) for t in self.tokens_S], dtype=np.int64)
        self.offsets_S1 = np.concatenate([[0], np.cumsum(sizes_S)])  # where each shard starts, then N
        self.n_tokens = int(self.offsets_S1[-1])
        self.has_mask = bool(meta.get("has_loss_mask")) and entry is not None
        self.mask_S = ([self.folder.array(s["name"] + ".mask.bin", np.dtype(np.uint8), s["tokens"]) for s in shards]
                       if self.has_mask else None)
        self.doc_starts_D1 = None
        if entry is not None:
            starts = []
            for k, s in enumerate(shards):
                idx = self.folder.index(f"{s['name']}.idx.npy")
                if len(idx) != s["documents"] + 1 or idx[-1] != s["tokens"]:
                    raise FormatError(f"{self.folder.where(s['name'] + '.idx.npy')} does not match meta.json "
                                      f"({len(idx) - 1} documents, {int(idx[-1])} tokens; meta.json says "
                                      f"{s['documents']}, {s['tokens']})")
                starts.append(idx[:-1] + self.offsets_S1[k])
            self.doc_starts_D1 = np.concatenate(starts + [[self.n_tokens]]).astype(np.int64)

    @property
    def n_documents(self) -> int | None:
        return None if self.doc_starts_D1 is None else len(self.doc_starts_D1) - 1

    def __len__(self) -> int:
        return self.n_tokens

    def take(self, idx: np.ndarray, mask: bool = False) -> np.ndarray:
        """Tokens (or, with mask=True, loss-mask values) at global offsets `idx` (any shape), across shards."""
        arrays = self.mask_S if mask else self.tokens_S
        if len(arrays) == 1:
            return np.asarray(arrays[0][idx])
        idx = np.asarray(idx)
        shard = np.searchsorted(self.offsets_S1, idx, side="right") - 1
        out = np.empty(idx.shape, dtype=arrays[0].dtype)
        for k in np.unique(shard):
            sel = shard == k
            out[sel] = arrays[k][idx[sel] - self.offsets_S1[k]]
        return out

    def document(self, i: int) -> np.ndarray:
        """Token ids of document i (documents never span shards)."""
        start, end = int(self.doc_starts_D1[i]), int(self.doc_starts_D1[i + 1])
        k = int(np.searchsorted(self.offsets_S1, start, side="right") - 1)
        return np.asarray(self.tokens_S[k][start - self.offsets_S1[k]:end - self.offsets_S1[k]])
