"""Input corpora as a stream of records, each with the place it came from (`file:line`), read one at a time so
that a corpus far larger than memory never has to fit in it (docs/data.md, "Inputs").

An input is a file, a folder (its files of known kinds, recursively, sorted), a glob, an s3:// or gs:// URL
(storage.py's fsspec filesystems), or `datasets:NAME` (a Hugging Face `datasets` name, a `save_to_disk` folder or
a folder of data files), read with a split and optionally streamed. File kinds, by suffix (after an optional .gz,
.zst or .zstd): .txt (one document, or one per line with `per_line`), .jsonl and .json (JSON lines, or a list of
records), .parquet. Bad input never passes silently: a broken JSON line, a record that is not an object or strict
invalid UTF-8 end in a DataError naming `file:line`; invalid UTF-8 is otherwise replaced or dropped and counted.
"""

from __future__ import annotations

import glob as glob_lib
import gzip
import io
import json
from collections import Counter
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np

from jaxlm import storage
from jaxlm.data.errors import UTF8_ERRORS, DataError

TEXT_KINDS = (".txt", ".text", ".md")
JSON_KINDS = (".jsonl", ".json", ".ndjson")
KINDS = TEXT_KINDS + JSON_KINDS + (".parquet",)
COMPRESSIONS = (".gz", ".zst", ".zstd")
DATASETS_PREFIX = "datasets:"


def kind_of(path: str) -> tuple[str, str]:
    """(kind suffix, compression suffix or '') of a file name."""
    p = Path(path.split("://", 1)[-1])
    comp = p.suffix.lower() if p.suffix.lower() in COMPRESSIONS else ""
    kind = (p.with_suffix("") if comp else p).suffix.lower()
    return kind, comp


def expand(inputs: list[str]) -> list[str]:
    """Each input as the files (or datasets: specs) it names, in a fixed order; a one-line error for an input
    that names nothing readable."""
    out: list[str] = []
    for spec in inputs:
        spec = str(spec)
        if spec.startswith(DATASETS_PREFIX):
            out.append(spec)
            continue
        url = bool(storage.scheme(spec)) and storage.scheme(spec) != "file"
        if url:
            fs, p = storage.filesystem(spec)
            proto = spec.split("://", 1)[0]
            try:
                if any(c in p for c in "*?["):
                    found = sorted(fs.glob(p))
                elif fs.isdir(p):
                    found = sorted(f for f in fs.find(p))
                else:
                    found = [p] if fs.exists(p) else []
            except Exception as e:  # noqa: BLE001 - each object store raises its own types
                raise DataError(f"input {spec}: cannot list it ({e.__class__.__name__}: "
                                f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})") from None
            files = [f"{proto}://{f}" for f in found if kind_of(f)[0] in KINDS]
        else:
            local = str(storage.local_path(spec))
            if any(c in local for c in "*?["):
                matches = sorted(glob_lib.glob(local, recursive=True))
                files = [m for f in matches for m in (_walk(Path(f)) if Path(f).is_dir() else [f])]
            elif Path(local).is_dir():
                files = _walk(Path(local))
            elif Path(local).is_file():
                if kind_of(local)[0] not in KINDS:
                    raise DataError(f"input {spec}: unknown file kind (known: {', '.join(KINDS)}, optionally "
                                    f"compressed {', '.join(COMPRESSIONS)})")
                files = [local]
            else:
                raise DataError(f"input {spec} does not exist")
            files = [f for f in files if kind_of(f)[0] in KINDS]
        if not files:
            raise DataError(f"input {spec} holds no files of a known kind ({', '.join(KINDS)})")
        out.extend(files)
    return out


def _walk(folder: Path) -> list[str]:
    return sorted(str(p) for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))


def _open(path: str):
    """A binary stream of a file's decompressed bytes."""
    comp = kind_of(path)[1]
    if storage.scheme(path) in ("", "file"):
        raw = open(storage.local_path(path), "rb")
    else:  # buffered, so that a .json file's first bytes can be peeked at
        raw = io.BufferedReader(storage.open_file(path, "rb"))
    if comp == ".gz":
        return gzip.GzipFile(fileobj=raw)
    if comp in (".zst", ".zstd"):
        try:
            import zstandard
        except ImportError:
            raise DataError(f"{path} is zstd-compressed: pip install zstandard (in 'jaxlm[data]')") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    return raw


def _decode(data: bytes, where: str, errors: str, stats: Counter) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        if errors == "strict":
            raise DataError(f"{where}: invalid UTF-8 at byte {e.start} ({e.reason}); use --errors replace or "
                            "--errors skip to replace or drop such bytes") from None
        text = data.decode("utf-8", errors="replace")
        stats["invalid_utf8"] += text.count("\ufffd") - data.count("\ufffd".encode())
        stats["invalid_utf8_records"] += 1
        return text if errors == "replace" else data.decode("utf-8", errors="ignore")


def records(path: str, field: str = "text", errors: str = "replace", per_line: bool = False,
            split: str = "train", streaming: bool = False, stats: Counter | None = None
            ) -> Iterator[tuple[dict, str]]:
    """(record, where) for each record of one expanded input; `where` is `file:line` (`file:row N` for parquet
    and datasets)."""
    if errors not in UTF8_ERRORS:
        raise DataError(f"errors={errors!r} is not allowed; choose one of: {', '.join(UTF8_ERRORS)}")
    stats = Counter() if stats is None else stats
    if path.startswith(DATASETS_PREFIX):
        yield from _datasets(path[len(DATASETS_PREFIX):], split, streaming)
        return
    kind, _ = kind_of(path)
    try:
        with _open(path) as f:
            if kind in TEXT_KINDS:
                if per_line:
                    for n, line in enumerate(f, start=1):
                        yield {field: _decode(line, f"{path}:{n}", errors, stats).rstrip("\r\n")}, f"{path}:{n}"
                else:
                    yield {field: _decode(f.read(), path, errors, stats)}, f"{path}:1"
            elif kind in JSON_KINDS:
                yield from _json(f, path, errors, stats)
            else:
                yield from _parquet(f, path, field)
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: cannot read it ({e.__class__.__name__}: {e})") from None


def _json(f, path: str, errors: str, stats: Counter) -> Iterator[tuple[dict, str]]:
    if f.peek(64)[:64].lstrip()[:1] == b"[":  # one JSON list of records
        text = _decode(f.read(), path, errors, stats)
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: broken JSON ({e.msg.removesuffix(' at')} at column {e.colno})"
                            ) from None
        for i, rec in enumerate(items):
            yield _record(rec, f"{path}:record {i + 1}"), f"{path}:record {i + 1}"
        return
    for n, line in enumerate(f, start=1):
        rec = _json_line(line, f"{path}:{n}", errors, stats)
        if rec is not None:
            yield rec, f"{path}:{n}"


def _json_line(line: bytes, where: str, errors: str, stats: Counter) -> dict | None:
    """The record of one JSON line; None for a blank line."""
    text = _decode(line, where, errors, stats)
    if not text.strip():
        return None
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: broken JSON line ({e.msg.removesuffix(' at')} at column {e.colno})") from None
    return _record(rec, where)


def _record(rec, where: str) -> dict:
    if not isinstance(rec, dict):
        raise DataError(f"{where}: a record must be a JSON object, not a {type(rec).__name__}")
    return rec


def _parquet(f, path: str, field: str) -> Iterator[tuple[dict, str]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(f)
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid and others
        raise DataError(f"{path} is not a readable parquet file: {str(e).splitlines()[0]}") from None
    names = pf.schema_arrow.names
    columns = [c for c in ("messages", "prompt", "completion", "system", "chosen", "rejected", field)
               if c in names]
    if not columns:
        raise DataError(f"{path}: no column {field!r} (columns: {', '.join(names)}); choose one with --field")
    row = 0
    for batch in pf.iter_batches(columns=list(dict.fromkeys(columns)), batch_size=1024):
        for rec in batch.to_pylist():
            row += 1
            yield rec, f"{path}:row {row}"


def _datasets(name: str, split: str, streaming: bool) -> Iterator[tuple[dict, str]]:
    try:
        import datasets
    except ImportError:
        raise DataError("datasets: inputs need the datasets package: pip install 'jaxlm[data]'") from None
    path = Path(name)
    try:
        if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise DataError(f"datasets:{name} has no split {split!r} (splits: {', '.join(ds)})")
                ds = ds[split]
        else:
            repo, _, config = name.partition(":")
            ds = datasets.load_dataset(repo, config or None, split=split, streaming=streaming)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - hub, cache and builder errors come in many types
        raise DataError(f"datasets:{name} (split {split}): cannot load it (offline and not cached?): "
                        f"{str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__}") from None
    for i, rec in enumerate(ds):
        yield rec, f"datasets:{name}[{split}]:row {i + 1}"


def texts(inputs: list[str], field: str = "text", errors: str = "replace", per_line: bool = False,
          split: str = "train", streaming: bool = False, stats: Counter | None = None
          ) -> Iterator[tuple[str, str]]:
    """(text, where) of every document of the inputs; a record without `field` is an error naming its place,
    and empty documents are skipped and counted (stats["empty_documents"])."""
    stats = Counter() if stats is None else stats
    for path in expand(inputs):
        stats["files"] += 1
        yield from _texts_of(path, field, errors, per_line, split, streaming, stats)


def _texts_of(path, field, errors, per_line, split, streaming, stats) -> Iterator[tuple[str, str]]:
    for rec, where in records(path, field, errors, per_line, split, streaming, stats):
        text = field_text(rec, where, field, stats)
        if text is not None:
            yield text, where


def field_text(rec: dict, where: str, field: str, stats: Counter) -> str | None:
    """A record's document text; None (counted in stats["empty_documents"]) for an empty one."""
    if field not in rec or rec[field] is None:
        raise DataError(f"{where}: the record has no field {field!r} (fields: "
                        f"{', '.join(map(str, rec)) or 'none'}); choose one with --field")
    text = rec[field]
    if not isinstance(text, str):
        raise DataError(f"{where}: field {field!r} is a {type(text).__name__}, not a string")
    if not text.strip():
        stats["empty_documents"] += 1
        return None
    return text


class JsonLines(NamedTuple):
    """Whole lines of a JSON-lines file, the first of them line `first_line`, left unparsed: parsing JSON is most
    of the work of reading such a corpus, so `block_texts` does it in the process that tokenizes the block."""
    path: str
    first_line: int
    data: bytes
    field: str
    errors: str


BLOCK_BYTES = 1 << 20


def text_blocks(inputs: list[str], field: str = "text", errors: str = "replace", per_line: bool = False,
                split: str = "train", streaming: bool = False, stats: Counter | None = None,
                block_bytes: int | None = None) -> Iterator[tuple[str, str] | JsonLines]:
    """The documents of texts(), in the same order, with each JSON-lines file given as JsonLines blocks of about
    `block_bytes` (default BLOCK_BYTES) instead of one (text, where) per line."""
    if errors not in UTF8_ERRORS:
        raise DataError(f"errors={errors!r} is not allowed; choose one of: {', '.join(UTF8_ERRORS)}")
    stats = Counter() if stats is None else stats
    for path in expand(inputs):
        stats["files"] += 1
        if not path.startswith(DATASETS_PREFIX) and kind_of(path)[0] in JSON_KINDS:
            try:
                with _open(path) as f:
                    if f.peek(64)[:64].lstrip()[:1] != b"[":
                        yield from _line_blocks(f, path, field, errors, block_bytes or BLOCK_BYTES)
                        continue
            except (OSError, EOFError) as e:
                raise DataError(f"{path}: cannot read it ({e.__class__.__name__}: {e})") from None
        yield from _texts_of(path, field, errors, per_line, split, streaming, stats)


def _line_blocks(f, path: str, field: str, errors: str, block_bytes: int, line: int = 1,
                 left: int | None = None) -> Iterator[JsonLines]:
    """JsonLines blocks of the next `left` bytes of f (all of it if None), its first line numbered `line`."""
    rest = b""
    while chunk := f.read(block_bytes if left is None else min(block_bytes, left)):
        left = None if left is None else left - len(chunk)
        data = rest + chunk
        cut = data.rfind(b"\n") + 1
        if cut:
            yield JsonLines(path, line, data[:cut], field, errors)
            line += data.count(b"\n", 0, cut)
        rest = data[cut:]
    if rest:
        yield JsonLines(path, line, rest, field, errors)


def line_cuts(path: str, size: int, piece_bytes: int) -> list[int]:
    """Offsets [0, ..., size] that cut a file of `size` bytes into pieces of about piece_bytes, each cut just after
    a newline, for readers that each take one piece (range_blocks); [0, size] for a file that cannot be cut: a
    compressed one, a JSON list, or one of a piece or less."""
    kind, comp = kind_of(path)
    if comp or kind not in JSON_KINDS or size <= piece_bytes:
        return [0, size]
    cuts = [0]
    try:
        with _open(path) as f:
            if f.peek(64)[:64].lstrip()[:1] == b"[":
                return [0, size]
            for nominal in range(piece_bytes, size, piece_bytes):
                if nominal <= cuts[-1]:
                    continue
                f.seek(nominal - 1)
                while (chunk := f.read(1 << 16)) and b"\n" not in chunk:
                    pass
                cut = f.tell() - len(chunk) + chunk.find(b"\n") + 1 if chunk else size
                if cut >= size:
                    break
                cuts.append(cut)
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: cannot read it ({e.__class__.__name__}: {e})") from None
    return cuts + [size]


def range_blocks(path: str, start: int, end: int, field: str = "text", errors: str = "replace", first_line: int = 1
                 ) -> Iterator[JsonLines]:
    """The JsonLines blocks of bytes [start, end) of an uncompressed JSON-lines file (a piece of line_cuts), its
    first line numbered first_line."""
    try:
        with _open(path) as f:
            f.seek(start)
            yield from _line_blocks(f, path, field, errors, BLOCK_BYTES, first_line, end - start)
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: cannot read it ({e.__class__.__name__}: {e})") from None


class Places:
    """The places (`file:line`) of a block's documents, made when asked for: an error names one of them."""

    def __init__(self, path: str, first_line: int, lines: np.ndarray):
        self.path, self.first_line, self.lines = path, first_line, lines

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, i: int) -> str:
        return f"{self.path}:{self.first_line + int(self.lines[i])}"

    def __iter__(self) -> Iterator[str]:
        return (self[i] for i in range(len(self)))


def block_texts(block: JsonLines, stats: Counter) -> tuple[list[str], Places | list[str]]:
    """The non-empty documents of a block and their places (`file:line`), as texts() would give them."""
    try:
        found = _plain_block(block, stats)
    except UnicodeDecodeError:
        found = None
    return found if found is not None else _checked_block(block, stats)


def _plain_block(block: JsonLines, stats: Counter) -> tuple[list[str], Places] | None:
    """block_texts of a block of valid UTF-8 whose lines are objects with a string `field` (the common case, in
    one pass with no per-line bookkeeping); None where a line is not, for _checked_block to say why."""
    lines = block.data.decode("utf-8").split("\n")
    if not lines[-1]:
        lines.pop()
    found, numbers, empty, field, loads = [], [], 0, block.field, json.loads
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = loads(line)
        except ValueError:
            return None
        text = rec.get(field) if isinstance(rec, dict) else None
        if not isinstance(text, str):
            return None
        if text.strip():
            found.append(text)
            numbers.append(i)
        else:
            empty += 1
    stats["empty_documents"] += empty
    return found, Places(block.path, block.first_line, np.asarray(numbers, np.int32))


def _checked_block(block: JsonLines, stats: Counter) -> tuple[list[str], list[str]]:
    found, wheres = [], []
    lines = block.data.split(b"\n")
    if not lines[-1]:
        lines.pop()
    for i, line in enumerate(lines):
        where = f"{block.path}:{block.first_line + i}"
        rec = _json_line(line, where, block.errors, stats)
        text = None if rec is None else field_text(rec, where, block.field, stats)
        if text is not None:
            found.append(text)
            wheres.append(where)
    return found, wheres
