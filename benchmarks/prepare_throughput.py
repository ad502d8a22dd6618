"""Throughput of `jaxlm prepare corpus` against Hugging Face `datasets` tokenizing the same files with the same
tokenizer, in one run.

A byte-level BPE is trained on tiny Shakespeare (`jaxlm tokenizer train`); the corpus is --copies shuffled copies
of its paragraphs as JSON lines, split over --files files. Ours: prepare_corpus with --workers processes,
from the jsonl files to finished shards. Theirs: `datasets.load_dataset("json")` (reading the same files into
Arrow) then `.map(batched=True, num_proc=--workers)` calling the same tokenizers.Tokenizer's encode_batch, into
a fresh cache folder. Both produce every document's ids; ratio = their wall seconds / ours. Prints
`tokenizer=NAME mb_per_s=X tokens_per_s=Y`, `vs_datasets_map=R` and `vs_datasets_map_fast=R` (the same map
calling encode_batch_fast, which skips character offsets as jaxlm's workers do: the baseline at its fastest;
plus the parts of the baseline, and the CPU seconds of each side, this process and its worker processes
together: on a machine shared with other jobs the wall times depend on the share of the cores each side gets,
the CPU seconds much less).
"""

import argparse
import json
import os
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

from jaxlm.data import bpe, prepare

SHAKESPEARE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tinyshakespeare" / "input.txt"


def make_corpus(folder: Path, source: Path, copies: int, files: int) -> list[str]:
    paragraphs = [p for p in source.read_text().split("\n\n") if p.strip()]
    rng = random.Random(0)
    outs = [open(folder / f"part-{i:02d}.jsonl", "w") for i in range(files)]
    for c in range(copies):
        order = paragraphs[:]
        rng.shuffle(order)
        for i, p in enumerate(order):
            outs[(c * len(order) + i) % files].write(json.dumps({"text": p}) + "\n")
    for f in outs:
        f.close()
    return [f.name for f in outs]


def baseline(files: list[str], tok_file: Path, workers: int, cache: Path, method: str = "encode_batch"
             ) -> tuple[float, float, int]:
    import datasets

    datasets.disable_progress_bars()
    t0 = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=files, split="train", cache_dir=str(cache))
    t1 = time.perf_counter()

    def encode(batch):
        from tokenizers import Tokenizer

        tok = encode.tok = getattr(encode, "tok", None) or Tokenizer.from_file(str(tok_file))
        return {"ids": [e.ids for e in getattr(tok, method)(batch["text"], add_special_tokens=False)]}

    out = ds.map(encode, batched=True, num_proc=workers, remove_columns=["text"])
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, sum(len(x) for x in out["ids"]) + len(out)


def cpu_seconds() -> float:
    """User + system seconds of this process and of its finished (reaped) worker processes."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=20, help="copies of tiny Shakespeare (1.1 MB each)")
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--input", default=str(SHAKESPEARE))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="jaxlm-prepare-bench-") as tmp:
        tmp = Path(tmp)
        (tmp / "corpus").mkdir()
        files = make_corpus(tmp / "corpus", Path(a.input), a.copies, a.files)
        mb = sum(os.path.getsize(f) for f in files) / 1e6
        tok_dir = bpe.train_bpe([a.input], a.vocab_size, tmp / "tok")
        t, c = time.perf_counter(), cpu_seconds()
        meta = prepare.prepare_corpus(files, tmp / "ours", str(tok_dir), val_fraction=0.001, workers=a.workers,
                                      progress=False)
        ours, ours_cpu = time.perf_counter() - t, cpu_seconds() - c
        tokens = meta["train_tokens"] + meta["val_tokens"]
        c = cpu_seconds()
        load_s, map_s, their_tokens = baseline(files, tok_dir / "tokenizer.json", a.workers, tmp / "hf-cache")
        their_cpu = cpu_seconds() - c
        # the same map calling encode_batch_fast (no character offsets, as jaxlm's workers call it): the baseline
        # at its fastest
        fast_load_s, fast_map_s, _ = baseline(files, tok_dir / "tokenizer.json", a.workers, tmp / "hf-cache-fast",
                                              "encode_batch_fast")
    if their_tokens != tokens:  # both count each document's ids plus its EOS
        sys.exit(f"the two tokenizations differ: {tokens} tokens against {their_tokens}")
    docs = meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"]
    print(f"corpus {mb:.1f} MB in {len(files)} jsonl files, {docs:,} "
          f"documents, {tokens:,} tokens, workers={a.workers}")
    print(f"ours {ours:.2f} s | datasets load_dataset {load_s:.2f} s + map {map_s:.2f} s = {load_s + map_s:.2f} s "
          f"(map alone: ratio {map_s / ours:.2f})")
    print(f"cpu seconds: ours {ours_cpu:.2f} | datasets {their_cpu:.2f} (ratio {their_cpu / ours_cpu:.2f}); load "
          f"average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"tokenizer=byte_level_bpe_{a.vocab_size} mb_per_s={mb / ours:.2f} tokens_per_s={tokens / ours:,.0f}")
    print(f"datasets with encode_batch_fast: load_dataset {fast_load_s:.2f} s + map {fast_map_s:.2f} s")
    print(f"vs_datasets_map={(load_s + map_s) / ours:.2f}")
    print(f"vs_datasets_map_fast={(fast_load_s + fast_map_s) / ours:.2f}")


if __name__ == "__main__":
    main()
