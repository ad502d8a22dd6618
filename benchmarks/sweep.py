"""A sweep of training settings at one token budget: every point trains the preset for the same number of tokens
(training.steps x batch_size x grad_accum x block_size, the preset's unless --steps says otherwise) and reports
its final validation loss. The recipe of shakespeare_char_cpu (configs/shakespeare_char_cpu.py) was chosen with
it; docs/optimizers.md has the sweeps that were run and their results.

A grid is a space-separated list of key=v1,v2,...; the points are its cartesian product, and several --grid
give the union. Points already in --out (same preset, settings and seed) are skipped, so an interrupted sweep
goes on where it stopped. One line per point as it ends, then all points best first.

    python benchmarks/sweep.py shakespeare_char_cpu --input ../shared/data/tinyshakespeare/input.txt \
        --grid "optimizer.name=muon optimizer.lr=2e-3,4e-3" --grid "optimizer.name=adamw" --seeds 0,1,2 \
        [--out sweep.jsonl] [--set key=value ...  (settings of every point)]
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax

from jaxlm import config as config_lib
from jaxlm.train import loop as train


def points(grids: list[str]) -> list[dict[str, str]]:
    out = []
    for grid in grids:
        axes = [(k, v.split(",")) for k, _, v in (item.partition("=") for item in grid.split())]
        for values in itertools.product(*(vs for _, vs in axes)):
            point = dict(zip((k for k, _ in axes), values))
            if point not in out:
                out.append(point)
    return out


def budget(cfg: config_lib.Config) -> int:
    t = cfg.training
    return t.steps * t.batch_size * t.grad_accum * cfg.model.block_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("preset")
    ap.add_argument("--grid", action="append", default=[], help="key=v1,v2 key=v1,... (repeatable)")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds; each point runs once per seed")
    ap.add_argument("--input", help="the corpus file, for a dataset not prepared yet (data.input)")
    ap.add_argument("--out", type=Path, default=Path("sweep.jsonl"), help="results, one JSON record per run")
    ap.add_argument("--set", action="append", default=[], dest="common", help="key=value of every point (repeatable)")
    a = ap.parse_args()
    common = dict(item.partition("=")[::2] for item in a.common)
    if a.input:
        common.setdefault("data.input", a.input)
    base = config_lib.load(a.preset)
    tokens = budget(config_lib.apply_overrides(base, common))
    done = [json.loads(line) for line in a.out.read_text().splitlines()] if a.out.exists() else []
    seeds = [int(s) for s in a.seeds.split(",")]
    results = []
    for point in points(a.grid or [""]):
        for seed in seeds:
            settings = {**common, **point, "seed": str(seed)}
            key = {"preset": a.preset, "settings": settings}
            old = next((r for r in done if {"preset": r["preset"], "settings": r["settings"]} == key), None)
            if old is not None:
                results.append(old)
                continue
            cfg = config_lib.apply_overrides(base, settings)
            if budget(cfg) != tokens:
                raise SystemExit(f"{point} trains {budget(cfg):,} tokens, the sweep's budget is {tokens:,}; change "
                                 "training.steps with batch_size, grad_accum or block_size")
            run_dir = Path(tempfile.mkdtemp(prefix="sweep-"))
            cfg = config_lib.apply_overrides(cfg, {
                "run_dir": str(run_dir), "checkpoint.enabled": "false", "logging.progress": "false",
                "logging.tensorboard": "false", "training.sample_tokens": "0", "training.eval_interval": "0"})
            config_lib.validate(cfg)
            start = time.perf_counter()
            summary = train.train(cfg, devices=jax.devices()[:1], log=lambda s: None)
            shutil.rmtree(run_dir, ignore_errors=True)
            record = {**key, "val_loss": summary["val_loss"], "train_loss": summary["train_loss"],
                      "wall_s": time.perf_counter() - start, "tokens_per_s": summary.get("tokens_per_s"),
                      "tokens": tokens}
            with a.out.open("a") as f:
                f.write(json.dumps(record) + "\n")
            results.append(record)
            print(f"val {record['val_loss']:.4f} train {record['train_loss']:.4f} {record['wall_s']:.0f} s "
                  f"{record['tokens_per_s']:,.0f} tok/s  {' '.join(f'{k}={v}' for k, v in point.items())} seed={seed}",
                  flush=True)
    by_point: dict[str, list[float]] = {}
    for r in results:
        name = " ".join(f"{k}={v}" for k, v in r["settings"].items() if k not in common and k != "seed") or "(preset)"
        by_point.setdefault(name, []).append(r["val_loss"])
    print(f"\n{a.preset}, {tokens:,} tokens per point; val loss (mean over seeds, n):")
    for name, vals in sorted(by_point.items(), key=lambda kv: statistics.mean(kv[1])):
        spread = f" +- {statistics.stdev(vals):.4f}" if len(vals) > 1 else ""
        print(f"  {statistics.mean(vals):.4f}{spread} (n={len(vals)})  {name}")


if __name__ == "__main__":
    main()
