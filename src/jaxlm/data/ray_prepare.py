"""`jaxlm prepare corpus ... --ray [ADDRESS]`: the corpus's files cut into units (a file, or a piece of a large
uncompressed JSON-lines file cut at line ends), each encoded by a Ray task as the local prepare encodes, and
written by this process in unit order through prepare.write_dataset: the same shards and meta.json as without
Ray. Each finished unit is saved under DIR/.ray-prepare/ beside a manifest of the inputs and settings, so that a
rerun after a kill encodes only the units not saved yet (docs/data.md, "Preparing on Ray").
"""

from __future__ import annotations

import collections
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import NamedTuple

import numpy as np

from jaxlm import storage
from jaxlm.data import encode, prepare, shards, sources, tokenizer as tokenizer_lib
from jaxlm.data.errors import DataError
from jaxlm.errors import UserError

UNIT_BYTES = 64 << 20  # an uncompressed JSON-lines file larger than this is encoded in pieces of about this size
RETRIES = 3  # times Ray reruns a task whose worker process or node died
WORK = ".ray-prepare"
CHANGE_KEYS = ("mtime", "LastModified", "updated", "ETag", "etag", "md5Hash", "generation")  # fsspec info keys


class Unit(NamedTuple):
    """What one task encodes: a whole file (end None), or the bytes [start, end) of an uncompressed JSON-lines
    file, cut after a newline (sources.line_cuts). k is its place in the corpus."""
    k: int
    split: str
    path: str
    start: int = 0
    end: int | None = None

    def __str__(self) -> str:
        return self.path if self.end is None else f"{self.path} bytes {self.start}-{self.end}"


def prepare_corpus(inputs: list[str], out_dir: str | Path, tokenizer: str, address: str = "local",
                   val: list[str] | None = None, val_fraction: float = 0.0005, field: str = "text",
                   errors: str = "replace", per_line: bool = False, workers: int | None = None,
                   shard_tokens: int | None = None, vocab_size: int | None = None, progress: bool = True,
                   unit_bytes: int = UNIT_BYTES) -> dict:
    """prepare.prepare_corpus with the encoding done by Ray tasks on the cluster at `address` (host:port, auto,
    or local to start one here), at most `workers` at a time (default: the cluster's CPUs). The inputs are files
    every node can read (object storage, or a shared file system)."""
    tok = tokenizer_lib.load(tokenizer)
    limit = int(vocab_size or prepare.model_vocab_size(tokenizer) or tok.vocab_size)
    settings = {"field": field, "errors": errors, "per_line": per_line, "limit": limit,
                "dtype": shards.dtype_for(limit).name}
    units, files = plan(inputs, val, unit_bytes)
    out = Path(out_dir)
    manifest = {"tokenizer": tok.spec, "settings": settings, "files": files, "units": [list(u) for u in units]}
    ray = connect(address, workers)
    try:
        work = Work(out / WORK, manifest, len(units))
        run = Run(ray, work, _shipment(tok), settings)
        splits = {"train": [u for u in units if u.split == "train"]}
        if val:
            splits["val"] = [u for u in units if u.split == "val"]
        workers = workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
        meta = prepare.write_dataset(out, tok, splits, "text", workers, shard_tokens, limit,
                                     val_fraction=0.0 if val else val_fraction, progress=progress, stats=run.stats,
                                     extra={"source": prepare.source_name(inputs), "utf8_errors": errors},
                                     encoder=run.batches)
    finally:
        ray.shutdown()
    shutil.rmtree(work.dir)
    return meta


def plan(inputs: list[str], val: list[str] | None, unit_bytes: int) -> tuple[list[Unit], list]:
    """The units of the train inputs, then of the val inputs, in input order; and [path, size, change] of each
    file, for the manifest."""
    units: list[Unit] = []
    files = []
    for split, specs in (("train", inputs), ("val", val or [])):
        for path in sources.expand(specs) if specs else []:
            if path.startswith(sources.DATASETS_PREFIX):
                raise DataError(f"--ray reads files (local, s3://, gs://), not {path}: prepare it without --ray")
            size, change = _stat(path)
            files.append([path, size, change])
            cuts = sources.line_cuts(path, size, unit_bytes)
            pieces = list(zip(cuts, cuts[1:])) if len(cuts) > 2 else [(0, None)]
            units += [Unit(len(units) + i, split, path, a, b) for i, (a, b) in enumerate(pieces)]
    return units, files


def _stat(path: str) -> tuple[int, object]:
    """A file's size, and what tells that it changed (its modification time, or an object store's etag)."""
    local = storage.local_path(path)
    if local is not None:
        st = local.stat()
        return st.st_size, st.st_mtime_ns
    fs, p = storage.filesystem(path)
    info = fs.info(p)
    return int(info["size"]), {k: str(v) for k, v in sorted(info.items()) if k in CHANGE_KEYS}


def connect(address: str, workers: int | None):
    """The ray module, connected to the cluster at `address` (or to a new local one for 'local'); a one-line
    error when Ray is not installed or nothing answers there."""
    try:
        import ray
    except ImportError:
        raise DataError("--ray needs Ray: pip install 'jaxlm[ray]'") from None
    # The tasks print nothing; what Ray forwards otherwise is its nodes' log files (libtpu's, on a TPU host)
    quiet = dict(logging_level=logging.ERROR, log_to_driver=False)
    if address == "local":
        ray.init(address="local", num_cpus=workers, include_dashboard=False, **quiet)
        return ray
    if address != "auto":
        host, _, port = address.removeprefix("ray://").rpartition(":")
        try:  # Ray itself retries an address where nothing listens for minutes
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=10).close()
        except (OSError, ValueError) as e:
            raise DataError(f"--ray {address}: no Ray cluster answers there ({e.__class__.__name__}); give the "
                            "head's host:port (`ray start --head` prints it), auto, or no address to start one here"
                            ) from None
    try:
        ray.init(address=address, **quiet)
    except ConnectionError as e:
        raise DataError(f"--ray {address}: {str(e).splitlines()[0]}") from None
    return ray


def _shipment(tok) -> tuple[dict, dict]:
    """The tokenizer as a task rebuilds it on any node: its spec naming a copy, and its files' bytes."""
    if not tok.files:
        return dict(tok.spec), {}
    return dict(tok.spec, copy=f"tokenizer/{tok.files[0].name}"), {f.name: f.read_bytes() for f in tok.files}


_TOKENIZERS: dict = {}  # a Ray worker process's tokenizers, by spec


def _tokenizer(shipment: tuple[dict, dict]):
    spec, files = shipment
    key = json.dumps(spec, sort_keys=True)
    if key not in _TOKENIZERS:
        os.environ["RAYON_NUM_THREADS"] = "1"  # one tokenizer thread per task: Ray runs one task per CPU
        folder = Path(tempfile.mkdtemp(prefix="jaxlm-tokenizer-"))
        try:
            (folder / "tokenizer").mkdir()
            for name, data in files.items():
                (folder / "tokenizer" / name).write_bytes(data)
            _TOKENIZERS[key] = tokenizer_lib.from_spec(spec, folder)
        finally:
            shutil.rmtree(folder)
    return _TOKENIZERS[key]


def encode_unit(unit: Unit, first_line: int, tok, field: str, errors: str, per_line: bool, limit: int,
                dtype: str) -> dict:
    """A unit's documents encoded as the local prepare encodes them: ids (in the shards' dtype) and lengths end to
    end, token counts per id, what reading counted, bytes read, and newlines (of a piece, whose lines are numbered
    from first_line). Bad input raises the local prepare's DataError."""
    stats, lines = collections.Counter(), []
    if unit.end is None:
        items = prepare.text_items([unit.path], field, errors, per_line, "train", False, stats)
    else:
        if unit.start == 0:
            stats["files"] += 1
        items = _counted(sources.range_blocks(unit.path, unit.start, unit.end, field, errors, first_line), lines)
    ids, lengths, counts, nbytes = [], [], np.zeros(tok.vocab_size, np.int64), 0
    for docs, batch_counts, wheres, size, counted in encode.encoded(items, "text", 0, tok, None):
        stats.update(counted or {})
        nbytes += size
        counts = prepare.add_counts(counts, batch_counts)
        if len(batch_counts) > limit and batch_counts[limit:].any():
            prepare.refuse_ids(docs, wheres, limit)
        if not isinstance(docs, encode.Flat):  # some text the tokenizer refused (write_dataset's check)
            bad = next((f"{where}: {doc}" for doc, where in zip(docs, wheres) if isinstance(doc, str)), None)
            if bad is not None:
                raise DataError(bad)
            docs = encode.Flat(np.concatenate([d[0] for d in docs]), np.array([len(d[0]) for d in docs], np.int64))
        ids.append(docs.ids.astype(dtype))
        lengths.append(docs.lengths)
    return {"ids": np.concatenate(ids) if ids else np.zeros(0, dtype),
            "lengths": np.concatenate(lengths) if lengths else np.zeros(0, np.int64), "counts": counts,
            "stats": dict(stats), "bytes": nbytes, "lines": sum(lines)}


def _counted(blocks, lines: list):
    for block in blocks:
        lines.append(block.data.count(b"\n"))
        yield block


def _encode_task(unit: Unit, shipment: tuple[dict, dict], settings: dict) -> dict:
    """encode_unit in a Ray worker: bad input comes back as {'error': message}, which Ray would not retry."""
    try:
        return encode_unit(unit, 1, _tokenizer(shipment), **settings)
    except UserError as e:
        return {"error": str(e)}


class Run:
    """One prepare on Ray: its tasks, the results they saved, and what reading counted (write_dataset's stats)."""

    def __init__(self, ray, work: Work, shipment: tuple[dict, dict], settings: dict):
        self.ray, self.work, self.settings = ray, work, settings
        self.shipment = ray.put(shipment)
        self.task = ray.remote(num_cpus=1, max_retries=RETRIES)(_encode_task)
        self.stats: collections.Counter = collections.Counter()
        self.failed: dict[int, str] = {}
        self.first_line: dict[str, int] = {}  # a file's next piece starts at this line

    def batches(self, units: list[Unit], kind: str, workers: int, tok, chat_template):
        """write_dataset's encoder (encode.encoded's batches): one batch per unit, in order, read from the saved
        results while at most `workers` tasks encode the units not saved yet."""
        todo = collections.deque(u for u in units if u.k not in self.work.saved)
        running: dict = {}
        for unit in units:
            while (result := self._result(unit, tok, todo)) is None:
                while todo and len(running) < workers:
                    u = todo.popleft()
                    if not self.failed or u.k < min(self.failed):  # nothing past a bad unit is written
                        running[self.task.options(name=f"prepare unit {u.k}").remote(u, self.shipment,
                                                                                      self.settings)] = u
                self._collect(running)
            batch = encode.Flat(result["ids"], result["lengths"])
            yield batch, result["counts"], None, result["bytes"], result["stats"]

    def _result(self, unit: Unit, tok, todo: collections.deque) -> dict | None:
        """The saved result of a unit (None while it is not saved); a failed unit's DataError."""
        if unit.k in self.failed:
            if unit.start:  # its task numbered lines from the piece's start: redo it here to name the right line
                encode_unit(unit, self.first_line[unit.path], tok, **self.settings)
            raise DataError(self.failed[unit.k])
        if unit.k not in self.work.saved:
            return None
        result = self.work.load(unit.k)
        if result is None:  # a damaged saved result: encode the unit again
            todo.appendleft(unit)
            return None
        if unit.end is not None:
            self.first_line[unit.path] = (1 if unit.start == 0 else self.first_line[unit.path]) + result["lines"]
        return result

    def _collect(self, running: dict) -> None:
        """Wait for a task to finish, then save its result (or keep its error)."""
        ray = self.ray
        ready, _ = ray.wait(list(running), num_returns=1)
        for ref in ready:
            unit = running.pop(ref)
            try:
                result = ray.get(ref)
            except ray.exceptions.RayTaskError:
                raise
            except ray.exceptions.RayError as e:  # a worker or node lost more often than Ray retries
                raise DataError(f"{unit}: Ray lost the task {RETRIES + 1} times ({e.__class__.__name__}); run the "
                                "same command again to resume") from None
            if "error" in result:
                self.failed[unit.k] = result["error"]
            else:
                self.work.save(unit.k, result)


class Work:
    """DIR/.ray-prepare/: manifest.json (the units, the inputs' sizes and change times, the settings) and, per
    unit finished, unit-K.npz (ids, lengths, counts; a zip, whose CRC-32 is checked as it is read) then
    unit-K.json (the rest), each written under a temporary name and renamed. A manifest that differs starts the
    folder over."""

    def __init__(self, folder: Path, manifest: dict, n_units: int):
        self.dir = folder
        manifest = json.loads(json.dumps(manifest))
        path = folder / "manifest.json"
        if path.is_file() and _read_json(path) != manifest:
            print(f"prepare: the inputs or settings differ from those of the unfinished prepare in {folder}; "
                  "starting over", file=sys.stderr)
            shutil.rmtree(folder)
        if not path.is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            _write_atomic(path, json.dumps(manifest).encode())
        self.saved = {int(p.name[5:-5]) for p in folder.glob("unit-*.json")}
        if self.saved:
            print(f"prepare: resuming from {folder}: {len(self.saved)} of {n_units} units already encoded",
                  file=sys.stderr)

    def save(self, k: int, result: dict) -> None:
        import io

        buf = io.BytesIO()
        np.savez(buf, ids=result["ids"], lengths=result["lengths"], counts=result["counts"])
        _write_atomic(self.dir / f"unit-{k:06d}.npz", buf.getbuffer())
        info = {key: result[key] for key in ("stats", "bytes", "lines")} | {"tokens": len(result["ids"])}
        _write_atomic(self.dir / f"unit-{k:06d}.json", json.dumps(info).encode())
        self.saved.add(k)

    def load(self, k: int) -> dict | None:
        """A saved result, checked; None (and forgotten) when it is damaged."""
        try:
            info = _read_json(self.dir / f"unit-{k:06d}.json")
            with np.load(self.dir / f"unit-{k:06d}.npz") as z:
                result = {name: z[name] for name in ("ids", "lengths", "counts")}
            ok = len(result["ids"]) == info["tokens"] == result["lengths"].sum()
        except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile):
            ok = False
        if not ok:
            self.saved.discard(k)
            return None
        return result | info


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None


def _write_atomic(path: Path, data) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
