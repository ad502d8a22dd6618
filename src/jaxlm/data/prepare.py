"""Corpora -> train.bin / val.bin (flat token ids, uint16 or uint32) + meta.json, as nanoGPT lays them out.

`jaxlm prepare shakespeare_char [--input FILE]`, `jaxlm prepare text FILE... --out DIR`,
`jaxlm prepare python_stdlib` (the offline quickstart corpus) and `jaxlm prepare openwebtext`.
"""

from __future__ import annotations

import json
import math
import sysconfig
import urllib.request
from pathlib import Path

import numpy as np

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


class DataError(ValueError):
    """Missing, unreadable or inconsistent data; the message says how to fix it."""


def unigram_entropy(ids: np.ndarray, vocab_size: int) -> float:
    """Entropy in nats of the token frequencies: the loss of a model that ignores context."""
    counts = np.bincount(ids, minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return max(0.0, float(-(p * np.log(p)).sum()))  # not -0.0 for a one-token corpus


def write_split(out_dir: Path, ids: np.ndarray, vocab_size: int, tokenizer: dict, source: str,
                val_fraction: float = 0.1, extra: dict | None = None) -> dict:
    """Write train.bin/val.bin (first 1 - val_fraction for training) and meta.json (with `extra` merged in);
    return the meta."""
    if len(ids) < 2:
        raise DataError(f"the corpus from {source} has {len(ids)} tokens; at least 2 are needed")
    if vocab_size > np.iinfo(np.uint32).max + 1:
        raise DataError(f"a vocabulary of {vocab_size:,} tokens does not fit in uint32 token files (at most 2**32)")
    dtype = np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
    n_train = int(len(ids) * (1 - val_fraction))
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = np.asarray(ids, dtype=dtype)
    ids[:n_train].tofile(out_dir / "train.bin")
    ids[n_train:].tofile(out_dir / "val.bin")
    meta = {
        "vocab_size": int(vocab_size),
        "dtype": np.dtype(dtype).name,
        "train_tokens": int(n_train),
        "val_tokens": int(len(ids) - n_train),
        "unigram_entropy": unigram_entropy(ids.astype(np.int64), vocab_size),
        "tokenizer": tokenizer,
        "source": source,
        **(extra or {}),
    }
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


UTF8_ERRORS = ("replace", "skip", "strict")
_REPLACEMENT = "\ufffd".encode()


def read_text(path: str | Path, errors: str = "replace", stats: dict | None = None) -> str:
    """A file's text. Invalid UTF-8 is replaced by U+FFFD (`replace`), dropped (`skip`) or an error
    (`strict`); `stats` (if given) accumulates counts of files, empty files, bytes, invalid sequences,
    NUL bytes, lines and the longest line in bytes."""
    if errors not in UTF8_ERRORS:
        raise DataError(f"errors={errors!r} is not allowed; choose one of: {', '.join(UTF8_ERRORS)}")
    p = Path(path)
    if not p.is_file():
        raise DataError(f"input file {path} does not exist")
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
        invalid = 0
    except UnicodeDecodeError as e:
        if errors == "strict":
            raise DataError(f"{path}: invalid UTF-8 at byte {e.start} ({e.reason}); prepare with --errors replace "
                            f"or --errors skip to replace or drop such bytes") from None
        text = data.decode("utf-8", errors="replace")
        # Each maximal invalid subsequence becomes one U+FFFD; valid sequences decode on their own, so the
        # U+FFFD characters the file itself holds are exactly its encoded replacement characters.
        invalid = text.count("\ufffd") - data.count(_REPLACEMENT)
        if errors == "skip":
            text = data.decode("utf-8", errors="ignore")
    if stats is not None:
        newlines = np.flatnonzero(np.frombuffer(data, np.uint8) == ord("\n"))
        bounds = np.concatenate([[-1], newlines, [len(data)]])
        for key, n in (("files", 1), ("empty_files", int(not data)), ("bytes", len(data)),
                       ("invalid_utf8", invalid), ("nul_bytes", data.count(b"\0")),
                       ("lines", len(newlines) + (bool(data) and not data.endswith(b"\n")))):
            stats[key] = stats.get(key, 0) + n
        stats["longest_line"] = max(stats.get("longest_line", 0), int(np.diff(bounds).max()) - 1 if data else 0)
    return text


def describe_input(stats: dict, errors: str) -> str:
    done = {"replace": "replaced by U+FFFD", "skip": "dropped", "strict": "rejected"}[errors]
    return (f"read {stats['files']} file(s) ({stats['empty_files']} empty), {stats['bytes']:,} bytes, "
            f"{stats['lines']:,} lines (longest {stats['longest_line']:,} bytes), {stats['invalid_utf8']:,} invalid "
            f"UTF-8 sequences {done}, {stats['nul_bytes']:,} NUL bytes")


def prepare_text(files: list[str | Path], out_dir: str | Path, vocab: str = "char", errors: str = "replace") -> dict:
    """Any text files -> a char-level (distinct characters) or byte-level (256) dataset. The input counts
    (see read_text) go into meta.json under "input"."""
    stats: dict = {}
    text = "".join(read_text(f, errors, stats) for f in files)
    source = ", ".join(str(f) for f in files) if len(files) <= 3 else f"{len(files)} files"
    if not text:
        raise DataError(f"no text in {source} ({describe_input(stats, errors)})")
    extra = {"input": dict(stats, utf8_errors=errors)}
    if vocab == "char":
        # Code points as one array: sorting and indexing stay in numpy however long the text or its lines.
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        alphabet, ids = np.unique(points, return_inverse=True)
        chars = "".join(map(chr, alphabet))
        return write_split(Path(out_dir), ids.astype(np.int64), len(chars), {"kind": "char", "chars": chars}, source,
                           extra=extra)
    if vocab == "byte":
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        return write_split(Path(out_dir), ids, 256, {"kind": "byte"}, source, extra=extra)
    raise DataError(f"unknown vocabulary {vocab!r}; choose char or byte")


def prepare_shakespeare_char(out_dir: str | Path, input: str | Path | None = None, errors: str = "replace") -> dict:
    """Tiny Shakespeare, char-level. Uses `input` if given, else downloads it."""
    out_dir = Path(out_dir)
    if input is None:
        out_dir.mkdir(parents=True, exist_ok=True)
        input = out_dir / "input.txt"
        if not input.exists():
            try:
                with urllib.request.urlopen(SHAKESPEARE_URL, timeout=20) as r:
                    input.write_bytes(r.read())
            except OSError as e:
                raise DataError(f"cannot download tiny Shakespeare ({e.__class__.__name__}); pass a local copy "
                                f"with --input FILE (or data.input=FILE when training)") from None
    return prepare_text([input], out_dir, vocab="char", errors=errors)


def stdlib_sources(max_bytes: int = 8_000_000) -> list[Path]:
    """The Python standard library's own .py files, in a fixed order, up to max_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for p in sorted(root.rglob("*.py")):
        if any(part in ("site-packages", "dist-packages", "test", "tests", "idlelib") for part in p.parts):
            continue
        try:
            size = p.stat().st_size
        except OSError:
            continue
        if total + size > max_bytes:
            continue
        files.append(p)
        total += size
    if not files:
        raise DataError(f"no Python sources found under {root}")
    return files


def prepare_python_stdlib(out_dir: str | Path, max_bytes: int = 8_000_000) -> dict:
    """The quickstart corpus: byte-level Python source from this machine, no download."""
    return prepare_text(stdlib_sources(max_bytes), out_dir, vocab="byte") | {"source": "python stdlib"}


def prepare_openwebtext(out_dir: str | Path, num_proc: int = 8) -> dict:
    """OpenWebText with GPT-2 BPE (nanoGPT's prepare.py): needs `datasets`, `tiktoken` and the network."""
    try:
        import datasets
        import tiktoken
    except ImportError:
        raise DataError("openwebtext needs the `datasets` and `tiktoken` packages: pip install 'jaxlm[data]'") from None
    try:
        enc = tiktoken.get_encoding("gpt2")
        ds = datasets.load_dataset("openwebtext", num_proc=num_proc, trust_remote_code=True)
    except Exception as e:  # noqa: BLE001 - hub/network errors come in many types
        raise DataError(f"cannot fetch openwebtext or the GPT-2 BPE (offline?): {str(e).splitlines()[0]}") from None
    split = ds["train"].train_test_split(test_size=0.0005, seed=2357, shuffle=True)
    split["val"] = split.pop("test")

    def tokenize(example):
        ids = enc.encode_ordinary(example["text"]) + [enc.eot_token]
        return {"ids": ids, "len": len(ids)}

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, dset in split.items():
        tok = dset.map(tokenize, remove_columns=["text"], num_proc=num_proc)
        total = int(np.sum(tok["len"], dtype=np.uint64))
        arr = np.memmap(out_dir / f"{name}.bin", dtype=np.uint16, mode="w+", shape=(total,))
        idx = 0
        shards = 1024
        for i in range(shards):
            batch = tok.shard(num_shards=shards, index=i, contiguous=True).with_format("numpy")
            chunk = np.concatenate(batch["ids"]) if len(batch) else np.zeros(0, np.uint16)
            arr[idx: idx + len(chunk)] = chunk
            idx += len(chunk)
        arr.flush()
        counts[name] = total
    meta = {"vocab_size": enc.n_vocab, "dtype": "uint16", "train_tokens": counts["train"],
            "val_tokens": counts["val"], "tokenizer": {"kind": "tiktoken", "encoding": "gpt2"},
            "source": "openwebtext"}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


PREPARERS = {"shakespeare_char", "python_stdlib", "openwebtext"}


def ensure_prepared(name: str, out_dir: str | Path, input: str | None = None) -> Path:
    """Prepare a known dataset into out_dir unless its files are already there; return out_dir."""
    out_dir = Path(out_dir)
    if (out_dir / "meta.json").exists() and ((out_dir / "train.bin").exists()  # format 1
                                             or (out_dir / "train-00000.bin").exists()):  # format 2 (shards.py)
        return out_dir
    try:
        if name == "shakespeare_char":
            prepare_shakespeare_char(out_dir, input)
        elif name == "python_stdlib":
            prepare_python_stdlib(out_dir)
        elif input is not None:
            prepare_text([input], out_dir, vocab="char")
        elif name == "openwebtext":
            raise DataError(f"no prepared openwebtext; run `jaxlm prepare openwebtext --out {out_dir}` first")
        else:
            raise DataError("no prepared data (train.bin, val.bin, meta.json); run `jaxlm prepare` or set "
                            "data.input=FILE")
    except DataError as e:  # say which setting led here: the folder may be a default the user never typed
        raise DataError(f"data.dir={out_dir} (data.dataset={name}): {e}") from None
    return out_dir


def describe(meta: dict) -> str:
    ent = meta.get("unigram_entropy")
    ent_s = f", unigram entropy {ent:.3f} nats ({ent / math.log(2):.2f} bits)" if ent is not None else ""
    return (f"{meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens, vocab {meta['vocab_size']}"
            f"{ent_s}")

