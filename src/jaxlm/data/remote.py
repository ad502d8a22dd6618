"""Prepared folders on object storage (data.dir=gs://..., s3://..., any fsspec URL), read without a local copy:
each token or mask file is an array whose reads fetch the fixed-size blocks they touch (data.block_kb) by ranged
requests, many at once; one LRU per dataset keeps fetched blocks under a byte budget (data.cache_mb). Transient
errors are retried with backoff; a missing or short file fails in one line naming its URL (docs/scaling.md).

Legend: N indices of one read, K blocks.
"""

from __future__ import annotations

import collections
import io
import threading
import time

import numpy as np

from jaxlm import storage
from jaxlm.data import shards
from jaxlm.data.errors import DataError

RETRIES = 4  # further attempts after a failed read, BACKOFF_S, 2x, 4x, 8x that apart (about 7.5 s in all)
BACKOFF_S = 0.5


class BlockCache:
    """Blocks of one dataset's files, fetched by ranged reads and kept while they fit in `budget` bytes, the
    least recently used leaving first. Thread-safe: the read-ahead threads and an evaluation read at once.
    `held` counts the bytes of the blocks kept (never above `budget`; `peak` is its highest), `fetched` and
    `requests` what was read from the server."""

    def __init__(self, fs, budget: int, block: int):
        self.fs, self.budget, self.block = fs, budget, block
        self._blocks: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self.held = self.peak = self.fetched = self.requests = 0

    def get(self, array: RemoteArray, ks: np.ndarray) -> list[np.ndarray]:
        """Blocks `ks` of `array` (at most a budget's worth), those not kept fetched together."""
        with self._lock:
            got = {int(k): self._blocks.get((array.path, int(k))) for k in ks}
            for k, blk in got.items():
                if blk is not None:
                    self._blocks.move_to_end((array.path, k))
        missing = [k for k, blk in got.items() if blk is None]
        if missing:
            fetched = self._fetch(array, missing)
            with self._lock:
                self.requests += len(missing)
                self.fetched += sum(blk.nbytes for blk in fetched)
                for k, blk in zip(missing, fetched):
                    got[k] = blk
                    self._keep((array.path, k), blk)
        return [got[int(k)] for k in ks]

    def _keep(self, key, blk: np.ndarray) -> None:
        if key in self._blocks:  # fetched by another thread meanwhile
            return
        while self._blocks and self.held + blk.nbytes > self.budget:
            self.held -= self._blocks.popitem(last=False)[1].nbytes
        self._blocks[key] = blk
        self.held += blk.nbytes
        self.peak = max(self.peak, self.held)

    def _fetch(self, array: RemoteArray, ks: list[int]) -> list[np.ndarray]:
        starts = [k * self.block for k in ks]
        ends = [min(s + self.block, array.nbytes) for s in starts]
        data = read_ranges(self.fs, array.url, array.path, starts, ends)
        return [array.block_values(k, d) for k, d in zip(ks, data)]


def read_ranges(fs, url: str, path: str, starts: list[int], ends: list[int]) -> list[bytes]:
    """Byte ranges [start, end) of the file `path` (`url` in messages), requested all at once; those that fail
    are requested again after a backoff, RETRIES times. A file gone or shorter than expected fails at once."""
    out: list = [None] * len(starts)
    todo, attempt = list(range(len(starts))), 0
    while True:
        results = fs.cat_ranges([path] * len(todo), [starts[i] for i in todo], [ends[i] for i in todo],
                                on_error="return")
        failed = []
        for i, got in zip(todo, results):
            if isinstance(got, (FileNotFoundError, PermissionError)):
                raise DataError(f"{url} cannot be read ({got.__class__.__name__}) though it was there when the run "
                                f"started: restore the prepared folder, or prepare it again")
            if isinstance(got, BaseException):
                failed.append((i, got))
            elif len(got) != ends[i] - starts[i]:
                raise DataError(f"{url} ends at byte {starts[i] + len(got):,}, before byte {ends[i]:,} that its "
                                f"listing and meta.json promise (truncated since the run started?); prepare the "
                                f"folder again and upload it whole")
            else:
                out[i] = got
        if not failed:
            return out
        if attempt == RETRIES:
            i, e = failed[0]
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise DataError(f"reading {url} (bytes {starts[i]:,}-{ends[i]:,}) failed {RETRIES + 1} times "
                            f"({e.__class__.__name__}: {first}); check the endpoint, credentials and network")
        time.sleep(BACKOFF_S * 2 ** attempt)
        todo, attempt = [i for i, _ in failed], attempt + 1


class RemoteArray:
    """One token or mask file of a split as a 1-D array of n values: indexing it (an integer array of any shape,
    or a slice) fetches only the blocks the indices fall in, through the dataset's BlockCache."""

    def __init__(self, cache: BlockCache, url: str, path: str, dtype: np.dtype, n: int):
        self.cache, self.url, self.path, self.dtype, self.n = cache, url, path, np.dtype(dtype), n
        self.nbytes = n * self.dtype.itemsize
        self.limit: int | None = None

    def check_below(self, limit: int) -> None:
        """Refuse token ids >= limit (the vocabulary size) in every block as it arrives: a corpus on a bucket is
        not read whole before training, as a local one is (loader.Dataset._check_ids)."""
        self.limit = limit

    def block_values(self, k: int, data: bytes) -> np.ndarray:
        blk = np.frombuffer(data, dtype=self.dtype)
        if self.limit is not None and len(blk) and int(blk.max()) >= self.limit:
            at = int(np.argmax(blk >= self.limit))
            raise DataError(f"{self.url} holds token id {int(blk[at])} at position "
                            f"{k * self.cache.block // self.dtype.itemsize + at}, but meta.json's vocab_size is "
                            f"{self.limit}; the files do not belong together, re-run `jaxlm prepare`")
        return blk

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index) -> np.ndarray:
        if isinstance(index, slice):
            index = np.arange(*index.indices(self.n))
        idx_N = np.asarray(index, dtype=np.int64).ravel()
        if len(idx_N) and (idx_N.min() < 0 or idx_N.max() >= self.n):
            raise IndexError(f"{self.url}: an index outside [0, {self.n})")
        per = self.cache.block // self.dtype.itemsize
        block_N = idx_N // per
        order_N = np.argsort(block_N, kind="stable")
        ks_K, first_K = np.unique(block_N[order_N], return_index=True)
        bounds = np.append(first_K, len(idx_N))
        out_N = np.empty(len(idx_N), self.dtype)
        step = max(1, self.cache.budget // self.cache.block)  # a budget's worth of blocks at a time
        for c in range(0, len(ks_K), step):
            for j, blk in enumerate(self.cache.get(self, ks_K[c:c + step]), start=c):
                sel = order_N[bounds[j]:bounds[j + 1]]
                out_N[sel] = blk[idx_N[sel] - ks_K[j] * per]
        return out_N.reshape(np.shape(index))


class Folder:
    """A prepared folder at a URL, as shards.Split reads one: its files' sizes from one listing, its token and
    mask files as RemoteArrays sharing one BlockCache of `cache_bytes`, its document indexes read whole."""

    def __init__(self, url: str, cache_bytes: int, block_bytes: int):
        self.url = url.rstrip("/")
        self.fs, self.root = storage.filesystem(self.url, "data.dir")
        try:
            self.sizes = storage.files(self.url)
        except FileNotFoundError:
            self.sizes = {}
        self.cache = BlockCache(self.fs, cache_bytes, block_bytes)

    def where(self, file: str) -> str:
        return storage.join(self.url, file)

    def _size(self, file: str) -> int:
        if file not in self.sizes:
            raise shards.FormatError(f"{self.where(file)} is missing; prepare the data first (`jaxlm prepare ...`) "
                                     f"and upload the whole folder")
        return self.sizes[file]

    def array(self, file: str, dtype: np.dtype, expected) -> RemoteArray:
        n = shards.check_size(self.where(file), self._size(file), dtype, expected)
        return RemoteArray(self.cache, self.where(file), self._path(file), dtype, n)

    def _path(self, file: str) -> str:
        return f"{self.root.rstrip('/')}/{file}"

    def index(self, file: str) -> np.ndarray:
        """A shard's document index, read whole (8 bytes a document) when the run starts."""
        size = self._size(file)
        data = read_ranges(self.fs, self.where(file), self._path(file), [0], [size])[0]
        try:
            return np.load(io.BytesIO(data))
        except ValueError as e:
            raise shards.FormatError(f"{self.where(file)} is not a document index ({e}); re-run `jaxlm prepare`"
                                     ) from None
