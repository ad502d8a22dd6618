"""Corpora -> prepared folders.

Format 1 (nanoGPT's train.bin / val.bin of flat token ids + meta.json), written by the presets:
`jaxlm prepare shakespeare_char [--input FILE]`, `jaxlm prepare text FILE... --vocab char|byte`,
`jaxlm prepare python_stdlib` (the offline quickstart corpus) and `jaxlm prepare openwebtext`.

Format 2 (data/shards.py), written by `jaxlm prepare corpus|chat|preference ... --tokenizer T`
(`prepare_corpus`: any input of data/sources.py; `prepare_chat`: conversations with a loss mask, data/chat.py;
`prepare_preference`: pairs of replies to one prompt, data/preference.py). `write_dataset` writes the shards as
data/encode.py's worker processes hand back the documents, in input order.
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
import sys
import sysconfig
import urllib.request
from pathlib import Path

import numpy as np

from jaxlm.data.errors import UTF8_ERRORS, DataError

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


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
    # The files' absolute paths: a later `data.input` is checked against them (ensure_prepared).
    extra = {"input": dict(stats, utf8_errors=errors, paths=[str(Path(f).resolve()) for f in files])}
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
    """Prepare a known dataset into out_dir unless its files are already there; return out_dir. With `input` (the
    run's data.input), a folder prepared from another corpus, or from the same file since changed, is refused:
    training on it would train on data the run's config does not name."""
    out_dir = Path(out_dir)
    meta = out_dir / "meta.json"
    if meta.exists() and ((out_dir / "train.bin").exists() or '"splits"' in meta.read_text()):
        if input is not None:  # format 1, or format 2 (`jaxlm prepare corpus|chat`)
            check_prepared_from(json.loads(meta.read_text()), out_dir, name, input)
        return out_dir
    try:
        if name == "shakespeare_char":
            prepare_shakespeare_char(out_dir, input)
        elif name == "python_stdlib" and input is not None:  # the preset's byte vocabulary over the user's text
            prepare_text([input], out_dir, vocab="byte")
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


def check_prepared_from(meta: dict, out_dir: Path, name: str, input: str) -> None:
    """Refuse a prepared folder whose corpus is not the file `input` as it is now (meta.json's input paths, or its
    source for folders prepared before those were recorded; the byte count where recorded)."""
    want = Path(input).resolve()
    recorded = meta.get("input", {}).get("paths") or [meta.get("source", "")]
    fix = (f"set data.dir to a new folder (prepared from {input} on first use) or remove {out_dir} to prepare it "
           "again")
    if recorded != [str(want)] and [Path(p).resolve() for p in recorded] != [want]:
        raise DataError(f"data.input={input} but {out_dir} (data.dataset={name}) was prepared from "
                        f"{', '.join(recorded) if len(recorded) <= 3 else f'{len(recorded)} files'}: {fix}")
    size = meta.get("input", {}).get("bytes")
    if want.is_file() and size is not None and want.stat().st_size != size:
        raise DataError(f"data.input={input} has {want.stat().st_size:,} bytes but {out_dir} was prepared from it "
                        f"when it had {size:,}: {fix}")


def describe(meta: dict) -> str:
    ent = meta.get("unigram_entropy")
    ent_s = f", unigram entropy {ent:.3f} nats ({ent / math.log(2):.2f} bits)" if ent is not None else ""
    return (f"{meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens, vocab {meta['vocab_size']}"
            f"{ent_s}")


# ---- format 2: any corpus through any tokenizer, in worker processes ------------------------------------------

def _clear_shards(out: Path) -> None:
    """Remove the shards of an earlier prepare into the same folder (its meta.json is already gone)."""
    shard_file = re.compile(r"\.?(train|val)-\d{5}\.(bin|mask\.bin|idx\.npy|bin\.tmp|mask\.bin\.tmp|idx\.tmp\.npy)")
    for p in out.iterdir():
        if shard_file.fullmatch(p.name):
            p.unlink()


def write_dataset(out_dir: str | Path, *args, **kwargs) -> dict:
    """_write_dataset, leaving nothing behind when the corpus is refused (a DataError: no documents, an empty
    validation split, a token id past the vocabulary): the shards written so far are removed, and the folder too
    when this prepare made it and nothing else is in it. (An interrupted prepare leaves its folder unprepared, as
    shards.begin says, for a rerun or a Ray resume to take over.)"""
    created = not Path(out_dir).exists()
    try:
        return _write_dataset(out_dir, *args, **kwargs)
    except DataError:
        out = Path(out_dir)
        if out.is_dir():
            _clear_shards(out)
            if created and not any(out.iterdir()):
                out.rmdir()
        raise


def _write_dataset(out_dir: str | Path, tok, splits: dict, kind: str = "text", workers: int | None = None,
                  shard_tokens: int | None = None, vocab_size: int | None = None, max_tokens: int | None = None,
                  val_fraction: float = 0.0, chat_template: str | None = None, progress: bool = True,
                  stats: collections.Counter | None = None, extra: dict | None = None, drop_long: bool = True,
                  encoder=None) -> dict:
    """Encode documents into a format-2 folder. `splits` maps a split name to an iterable of (payload, where,
    nbytes), payload a text (kind='text'), a conversation (kind='chat') or a pair (kind='preference', two
    documents kept together in the same split); with val_fraction > 0 and no 'val' entry, a val_fraction of the
    'train' documents (pairs), spread evenly (document n when floor((n + 1) f) > floor(n f)), goes to 'val'.
    Token ids at or above `vocab_size` (default: the tokenizer's) are refused naming the document; chat
    documents and pairs longer than `max_tokens` are dropped and counted, or with drop_long=False refused in one
    line. `encoder` (default encode.encoded) turns a split's items into encoded batches in order: data/ray_prepare.py
    gives one whose items are units of the corpus encoded by Ray tasks. Returns the meta.json written."""
    from tqdm import tqdm

    from jaxlm.data import encode, shards, tokenizer as tokenizer_lib

    stats = collections.Counter() if stats is None else stats
    limit = int(vocab_size or tok.vocab_size)
    dtype = shards.dtype_for(limit)
    workers = (os.cpu_count() or 1) if workers is None else workers
    out = shards.begin(out_dir)
    _clear_shards(out)
    mask = kind in ("chat", "preference")
    shard_tokens = shard_tokens or shards.DEFAULT_SHARD_TOKENS
    writers = {name: shards.ShardWriter(out, name, dtype, shard_tokens, loss_mask=mask) for name in ("train", "val")}
    counts = np.zeros(tok.vocab_size, np.int64)
    bar = tqdm(unit="B", unit_scale=True, unit_divisor=1024, disable=None if progress else True, mininterval=0.5,
               desc="prepare", file=sys.stderr)
    n_doc = 0
    try:
        for split, items in splits.items():
            for docs, batch_counts, wheres, nbytes, counted in (encoder or encode.encoded)(items, kind, workers, tok,
                                                                                         chat_template):
                bar.update(nbytes)
                stats.update(counted or {})
                counts = add_counts(counts, batch_counts)
                if len(batch_counts) > limit and batch_counts[limit:].any():
                    refuse_ids(docs, wheres, limit)
                if isinstance(docs, encode.Flat):  # texts: no per-document work here
                    to_val = _to_val(split, splits, val_fraction, n_doc, len(docs.lengths))
                    n_doc += len(docs.lengths)
                    _write_flat(writers, split, docs, to_val, stats)
                    bar.set_postfix(docs=stats["train_documents"] + stats["val_documents"],
                                    tokens=stats["train_tokens"] + stats["val_tokens"], refresh=False)
                    continue
                kept = []
                for doc, where in zip(docs, wheres):
                    if isinstance(doc, str):
                        raise DataError(f"{where}: {doc}")
                    parts = encode.parts(doc, kind)
                    n = sum(len(p[0]) for p in parts)
                    if max_tokens is not None and n > max_tokens:
                        if not drop_long:
                            raise DataError(f"{where}: the pair is {n} tokens (prompt twice and both replies) and "
                                            f"--max-tokens is {max_tokens}; a pair is never cut: raise --max-tokens "
                                            "(and model.block_size), or drop such pairs with --drop-long")
                        stats["long_pairs_dropped" if kind == "preference" else "too_long_dropped"] += 1
                        stats.setdefault("first_too_long", f"{where} ({n} tokens > {max_tokens})")
                        for p in parts:
                            counts[:len(batch_counts)] -= np.bincount(p[0], minlength=len(batch_counts))
                        continue
                    kept.append(parts)
                to_val = _to_val(split, splits, val_fraction, n_doc, len(kept))
                n_doc += len(kept)
                for name, docs_here in ((split, [d for d, v in zip(kept, to_val) if not v]),
                                        ("val", [d for d, v in zip(kept, to_val) if v])):
                    if docs_here:
                        flat = [p for parts in docs_here for p in parts]
                        writers[name].add_many([p[0] for p in flat], [p[1] for p in flat] if mask else None)
                        stats[f"{name}_documents"] += len(flat)
                        stats[f"{name}_tokens"] += sum(len(p[0]) for p in flat)
                bar.set_postfix(docs=stats["train_documents"] + stats["val_documents"],
                                tokens=stats["train_tokens"] + stats["val_tokens"], refresh=False)
        entries = {name: w.close() for name, w in writers.items()}
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        bar.close()
    if not entries["train"]["documents"]:
        raise DataError(f"no documents to write ({describe_stats(stats)}); check the inputs")
    if not entries["val"]["documents"] and (val_fraction > 0 or "val" in splits):
        raise DataError(f"the validation split got no documents ({entries['train']['documents']} in all, "
                        f"val_fraction={val_fraction}); give more documents (--per-line for one text file), a "
                        "larger --val-fraction, or a separate --val input")
    p = counts[counts > 0] / counts.sum()
    spec = tokenizer_lib.save_copy(tok, out) | ({"chat_template": chat_template} if chat_template else {})
    meta = {"format": shards.FORMAT, "vocab_size": limit, "dtype": dtype.name,
            "tokenizer": spec, "bos_id": tok.bos_id, "eos_id": tok.eos_id, "has_loss_mask": mask,
            "splits": entries, "train_tokens": entries["train"]["tokens"], "val_tokens": entries["val"]["tokens"],
            "unigram_entropy": max(0.0, float(-(p * np.log(p)).sum())),
            "skipped": {k: v for k, v in stats.items() if not k.startswith(("train_", "val_"))},
            **(extra or {})}
    shards.write_meta(out, meta)
    return meta


def _to_val(split: str, splits: dict, val_fraction: float, n_doc: int, n: int) -> np.ndarray:
    """Which of the next n documents (n_doc before them) go to 'val': a val_fraction of 'train' spread evenly when
    there is no 'val' input; none otherwise."""
    if not (split == "train" and "val" not in splits and val_fraction > 0):
        return np.zeros(n, bool)
    k = n_doc + np.arange(n, dtype=np.float64)
    return np.floor((k + 1) * val_fraction) > np.floor(k * val_fraction)


def _write_flat(writers: dict, split: str, docs, to_val: np.ndarray, stats: collections.Counter) -> None:
    """A batch of texts (encode.Flat) to its split's writer, the documents of to_val to 'val'."""
    for name, chosen in ((split, ~to_val), ("val", to_val)):
        if chosen.any():
            lengths = docs.lengths[chosen]
            writers[name].add_flat(docs.ids if chosen.all() else docs.ids[np.repeat(chosen, docs.lengths)], lengths)
            stats[f"{name}_documents"] += len(lengths)
            stats[f"{name}_tokens"] += int(lengths.sum())


def add_counts(counts: np.ndarray, more: np.ndarray) -> np.ndarray:
    """Token counts per id plus those of a batch, which may count ids past the end of `counts`."""
    if len(more) > len(counts):
        counts = np.concatenate([counts, np.zeros(len(more) - len(counts), np.int64)])
    counts[:len(more)] += more
    return counts


def refuse_ids(docs, wheres: list, limit: int) -> None:
    """The DataError naming the first document with a token id at or above the vocabulary size `limit`."""
    from jaxlm.data import encode

    docs = docs.documents() if isinstance(docs, encode.Flat) else docs
    bad = next(i for i, d in enumerate(docs) if not isinstance(d, str) and d[0].max() >= limit)
    raise DataError(f"{wheres[bad]}: token id {int(docs[bad][0].max())} is at or above the vocabulary size {limit}; "
                    "the tokenizer does not match the model (check --tokenizer and --vocab-size)")


def describe_stats(stats) -> str:
    parts = [f"{stats.get('files', 0)} file(s)"]
    for key, what in (("empty_documents", "empty documents skipped"),
                      ("too_long_dropped", "chat documents over --max-tokens dropped"),
                      ("long_pairs_dropped", "pairs over --max-tokens dropped"),
                      ("invalid_utf8", "invalid UTF-8 sequences replaced or dropped"),
                      ("bad_images_skipped", "conversations with a missing, corrupt or oversized image left out")):
        if stats.get(key):
            parts.append(f"{stats[key]:,} {what}")
    if stats.get("first_too_long"):
        parts.append(f"first dropped: {stats['first_too_long']}")
    if stats.get("first_bad_image"):
        parts.append(f"first bad image: {stats['first_bad_image']}")
    return ", ".join(parts)


def text_items(inputs, field, errors, per_line, split, streaming, stats):
    """write_dataset's items of the texts of `inputs`: (text, where, nbytes), or a sources.JsonLines block."""
    from jaxlm.data import sources

    for item in sources.text_blocks(inputs, field, errors, per_line, split, streaming, stats):
        if isinstance(item, sources.JsonLines):
            yield item
        else:
            yield *item, len(item[0].encode("utf-8", errors="surrogatepass"))


def prepare_corpus(inputs: list[str], out_dir: str | Path, tokenizer: str, val: list[str] | None = None,
                   val_fraction: float = 0.0005, field: str = "text", errors: str = "replace",
                   per_line: bool = False, split: str = "train", streaming: bool = False,
                   workers: int | None = None, shard_tokens: int | None = None, vocab_size: int | None = None,
                   progress: bool = True) -> dict:
    """Text from any inputs (see sources.py) -> a format-2 folder: each document encoded as the tokenizer's
    encode_document (BOS/EOS by its conventions), shards of about shard_tokens tokens, the validation split a
    fraction of the documents or the separate `val` inputs."""
    from jaxlm.data import tokenizer as tokenizer_lib

    tok = tokenizer_lib.load(tokenizer)
    vocab_size = vocab_size or model_vocab_size(tokenizer)
    splits, stats = _splits(text_items, inputs, val, field, errors, per_line, split, streaming)
    meta = write_dataset(out_dir, tok, splits, "text", workers, shard_tokens, vocab_size,
                         val_fraction=0.0 if val else val_fraction, progress=progress, stats=stats,
                         extra={"source": source_name(inputs), "utf8_errors": errors})
    return meta


def _chat_items(inputs, errors, split, streaming, stats):
    from jaxlm.data import chat, sources

    for path in sources.expand(inputs):
        stats["files"] += 1
        for rec, where in sources.records(path, "messages", errors, False, split, streaming, stats):
            messages = chat.messages_of(rec, where)
            yield messages, where, sum(len(m["content"]) for m in messages)


def prepare_chat(inputs: list[str], out_dir: str | Path, tokenizer: str, max_tokens: int | None = None,
                 chat_template: str | Path | None = None, val: list[str] | None = None, val_fraction: float = 0.01,
                 errors: str = "replace", split: str = "train", streaming: bool = False, workers: int | None = None,
                 shard_tokens: int | None = None, vocab_size: int | None = None, progress: bool = True) -> dict:
    """Chat records (see chat.py) -> a format-2 folder with a loss mask that is 1 on assistant tokens only.
    Conversations longer than max_tokens (the training block size) are dropped and counted, never cut."""
    tok, template = _with_template(tokenizer, chat_template)
    if template is None and not tok.chat_template:
        raise DataError(f"the tokenizer {tok.describe()} has no chat template; give one with --chat-template FILE "
                        "(a Jinja template as in tokenizer_config.json)")
    if max_tokens is not None and max_tokens < 2:
        raise DataError(f"--max-tokens {max_tokens} must be >= 2 (the training block size)")
    vocab_size = vocab_size or model_vocab_size(tokenizer)
    splits, stats = _splits(_chat_items, inputs, val, errors, split, streaming)
    return write_dataset(out_dir, tok, splits, "chat", workers, shard_tokens, vocab_size, max_tokens,
                         0.0 if val else val_fraction, template, progress, stats,
                         extra={"source": source_name(inputs), "max_tokens": max_tokens})


def _with_template(tokenizer: str, chat_template: str | Path | None):
    """The tokenizer, and the chat template read from the file `chat_template` (set on it) or None."""
    from jaxlm.data import tokenizer as tokenizer_lib

    tok = tokenizer_lib.load(tokenizer)
    if chat_template is None:
        return tok, None
    if not Path(chat_template).is_file():
        raise DataError(f"--chat-template {chat_template} does not exist")
    tok.chat_template = Path(chat_template).read_text()
    return tok, tok.chat_template


def _preference_items(inputs, errors, split, streaming, stats):
    from jaxlm.data import preference, sources

    for path in sources.expand(inputs):
        stats["files"] += 1
        for rec, where in sources.records(path, "chosen", errors, False, split, streaming, stats):
            pair = preference.pair_of(rec, where)
            yield pair, where, sum(len(m["content"]) if isinstance(m, dict) else len(m)
                                   for part in pair[1:] for m in ([part] if isinstance(part, str) else part))


def prepare_preference(inputs: list[str], out_dir: str | Path, tokenizer: str, max_tokens: int | None = None,
                       chat_template: str | Path | None = None, drop_long: bool = False, val: list[str] | None = None,
                       val_fraction: float = 0.01, errors: str = "replace", split: str = "train",
                       streaming: bool = False, workers: int | None = None, shard_tokens: int | None = None,
                       vocab_size: int | None = None, progress: bool = True) -> dict:
    """Preference records (data/preference.py) -> a format-2 folder of pairs, each two documents (prompt + chosen,
    prompt + rejected) with a loss mask on the replies, meta.json's kind "preference". A pair whose two documents
    together exceed max_tokens (the training block size) is refused in one line, or with drop_long dropped and
    counted; dropping is not the default because it silently skews the data toward short replies."""
    from jaxlm.data import preference

    tok, template = _with_template(tokenizer, chat_template)
    if max_tokens is not None and max_tokens < 4:
        raise DataError(f"--max-tokens {max_tokens} must be >= 4 (the training block size: a pair is two documents "
                        "of a prompt token and a reply token at least)")
    vocab_size = vocab_size or model_vocab_size(tokenizer)
    splits, stats = _splits(_preference_items, inputs, val, errors, split, streaming)
    return write_dataset(out_dir, tok, splits, "preference", workers, shard_tokens, vocab_size, max_tokens,
                         0.0 if val else val_fraction, template, progress, stats, drop_long=drop_long,
                         extra={"kind": preference.KIND, "source": source_name(inputs), "max_tokens": max_tokens})


def _splits(items, inputs: list[str], val: list[str] | None, *args) -> tuple[dict, collections.Counter]:
    """The split name -> items(inputs, *args, stats) that write_dataset reads ('val' from the `val` inputs if
    given), and the stats they count into."""
    stats = collections.Counter()
    splits = {"train": items(inputs, *args, stats)}
    if val:
        splits["val"] = items(val, *args, stats)
    return splits, stats


def model_vocab_size(tokenizer: str) -> int | None:
    """The vocabulary of the model in a `jaxlm convert from-hf` folder named as the tokenizer (its embedding
    rows), else None."""
    cfg = Path(tokenizer) / "config.json"
    if Path(tokenizer).is_dir() and (Path(tokenizer) / "tokenizer").is_dir() and cfg.is_file():
        try:
            return int(json.loads(cfg.read_text())["model"]["vocab_size"])
        except (ValueError, KeyError, TypeError):
            return None
    return None


def source_name(inputs: list[str]) -> str:
    return ", ".join(map(str, inputs)) if len(inputs) <= 3 else f"{len(inputs)} inputs"
