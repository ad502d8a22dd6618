"""How fast the packed loader (data/packing.py) makes rows, against the rows per second the quickstart train step
consumes on this machine and against Grain's first-fit packing of the same documents, measured in one run.

A synthetic format-2 dataset (shards.ShardWriter) of byte-level documents with lengths drawn from a lognormal
(median --median-tokens) is written to a temporary folder. Our loader: `PackedLoader.next()` plus reading every
row into numpy (inputs, targets, positions, segment ids, weights). Grain: MapDataset.source over the same
documents (read through shards.Split), shuffled, cut to a row, FirstFitPackIterDataset with one bin per row
of the batch, batched. The train step: the quickstart config's jitted step on random batches.

Prints `loader_rows_per_s=X ratio_to_step=Y` (aim: Y >= 50, the loader never the bottleneck), then
`grain_rows_per_s=G ratio_to_grain=Z` (Z > 1: ours is faster) and the fraction of row slots that hold tokens.

    PYTHONPATH=src python benchmarks/loader.py [--docs 20000] [--median-tokens 60] [--seconds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time

import jax
import numpy as np

from jaxlm import config as config_lib
from jaxlm.train import batches as batch_lib, run as run_lib, state as state_lib, step as step_lib
from jaxlm.data import packing, shards


def write_corpus(out, n_docs: int, median: int, seed: int = 0) -> shards.Split:
    rng = np.random.default_rng(seed)
    lengths = np.maximum(2, rng.lognormal(np.log(median), 1.0, n_docs).astype(np.int64))
    shards.begin(out)
    w = shards.ShardWriter(out, "train", np.uint16, shard_tokens=1 << 20)
    for n in lengths:
        w.add(rng.integers(0, 256, n))
    meta = {"format": shards.FORMAT, "vocab_size": 256, "dtype": "uint16", "tokenizer": {"kind": "byte"},
            "splits": {"train": w.close()}}
    shards.write_meta(out, meta)
    return shards.Split(out, meta, "train")


def rate(next_batch, rows_per_batch: int, seconds: float) -> float:
    next_batch()  # warm caches (the first epoch's permutation, Grain's pipeline)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        next_batch()
        n += 1
    return n * rows_per_batch / (time.perf_counter() - start)


def ours(split: shards.Split, T: int, B: int, seconds: float) -> tuple[float, float]:
    loader = packing.PackedLoader(split, T, B, 1, seed=0)
    keys = ("inputs", "targets", "positions", "segment_ids", "weights")
    filled = []

    def next_batch():
        b = loader.next().read(split, (slice(None), slice(None)), slice(None), keys, T)
        filled.append(float((b["segment_ids"] > 0).mean()))

    return rate(next_batch, B, seconds), float(np.mean(filled))


def grain_rate(split: shards.Split, T: int, B: int, seconds: float) -> float:
    import grain

    R = T + 1

    class Documents:
        def __len__(self):
            return split.n_documents

        def __getitem__(self, i):
            return {"tokens": split.document(int(i))[:R].astype(np.int32)}

    ds = (grain.MapDataset.source(Documents()).shuffle(seed=0).repeat().to_iter_dataset())
    ds = grain.experimental.FirstFitPackIterDataset(ds, length_struct={"tokens": R}, num_packing_bins=B,
                                                    shuffle_bins=False).batch(B)
    it = iter(ds)
    return rate(lambda: next(it), B, seconds)


def step_rows_per_s(steps: int) -> float:
    cfg = config_lib.load("quickstart")
    cfg = cfg.replace(model=dataclasses.replace(cfg.model, vocab_size=256))
    run = run_lib.setup(cfg, jax.devices()[:1], data=False)
    cfg, t = run.cfg, run.cfg.training
    state = state_lib.init_state(run, cfg.seed)
    step = step_lib.make_train_step(cfg, run.optimizer, run.mesh, run.abstract_state, run.act_rules)
    x = np.random.default_rng(0).integers(0, 256, (t.grad_accum, t.batch_size, cfg.model.block_size), np.int32)
    batch = {"inputs": batch_lib.put_batch(run.mesh, x, 1), "targets": batch_lib.put_batch(run.mesh, np.roll(x, -1, -1), 1)}
    for _ in range(2):
        state, m = step(state, batch)
    jax.block_until_ready(m)
    start = time.perf_counter()
    for _ in range(steps):
        state, m = step(state, batch)
    jax.block_until_ready(m)
    return steps * t.grad_accum * t.batch_size / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=20_000)
    ap.add_argument("--median-tokens", type=int, default=60)
    ap.add_argument("--seconds", type=float, default=3.0, help="time each loader for this long")
    ap.add_argument("--steps", type=int, default=20, help="train steps timed")
    args = ap.parse_args()
    cfg = config_lib.load("quickstart")
    T, B = cfg.model.block_size, cfg.training.batch_size
    step_rate = step_rows_per_s(args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        split = write_corpus(tmp, args.docs, args.median_tokens)
        ours_rate, filled = ours(split, T, B, args.seconds)
        print(f"quickstart step: {step_rate:,.0f} rows/s (block {T}, batch {B}); corpus {split.n_documents:,} "
              f"documents, {split.n_tokens:,} tokens; our rows hold tokens in {100 * filled:.1f}% of slots")
        print(f"loader_rows_per_s={ours_rate:.0f} ratio_to_step={ours_rate / step_rate:.1f}")
        try:
            g = grain_rate(split, T, B, args.seconds)
        except ImportError:
            print("grain is not installed (pip install grain): no comparison")
            return
        print(f"grain_rows_per_s={g:.0f} ratio_to_grain={ours_rate / g:.2f}")


if __name__ == "__main__":
    main()
