"""nanoGPT's documented CPU run against `jaxlm train shakespeare_char_cpu`, side by side on this machine.

nanoGPT runs its own train.py (README: `--device=cpu --compile=False --eval_iters=20 --log_interval=1
--block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000
--dropout=0.0`) from a copy of a nanoGPT checkout (--nanogpt; jaxlm does not ship it), on the same corpus file.
jaxlm runs the preset as a user does (`python -m jaxlm.cli train shakespeare_char_cpu ...`). Each is a fresh
process; every line it prints is time-stamped from the process's start, so wall times include imports and
compiles. Runs alternate (nanoGPT, jaxlm, nanoGPT, ...) so that a change in the machine's load hits both.

--torch-threads N runs nanoGPT with N intra-op threads (OMP_NUM_THREADS; PyTorch's default is one per core):
on a machine shared with other work, PyTorch's threads spinning for each other can slow it many times over
(2026-12-03, load 6 to 11 on 2 cores: about 400 tokens/s with the default against 14,000 on the quiet machine).

Prints per run: the val loss at each evaluation with its wall time, the final val loss, the wall time, the time
of the first evaluation at or below --target, and the median step's tokens/s; then jaxlm over nanoGPT.

    python benchmarks/nanogpt_cpu.py --nanogpt PATH/TO/nanoGPT --input ../shared/data/tinyshakespeare/input.txt \
        [--repeats N] [--target 1.886] [--only jaxlm] [--torch-threads N] [--set key=value ...  (jaxlm settings)]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NANOGPT_ARGS = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
                "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128",
                "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0"]
TOKENS_PER_STEP = 12 * 64
EVAL = re.compile(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)")
ITER = re.compile(r"iter (\d+): loss [\d.]+, time ([\d.]+)ms")


def timed_lines(cmd: list[str], cwd: Path, env: dict) -> tuple[list[tuple[float, str]], float]:
    """Run cmd; every output line with the seconds since the start; and the total wall time."""
    start = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines = [(time.perf_counter() - start, line.rstrip()) for line in p.stdout]
    if p.wait():
        sys.exit(f"{' '.join(cmd[:4])} ... failed:\n" + "\n".join(l for _, l in lines[-30:]))
    return lines, time.perf_counter() - start


def run_nanogpt(src: Path, corpus: Path, work: Path, threads: int | None) -> dict:
    root = work / "nanoGPT"
    if not root.exists():
        shutil.copytree(src, root, ignore=shutil.ignore_patterns(".git", "out-*", "*.bin", "*.pkl"))
        shutil.copy(corpus, root / "data" / "shakespeare_char" / "input.txt")
        subprocess.run([sys.executable, "data/shakespeare_char/prepare.py"], cwd=root, check=True, capture_output=True)
    shutil.rmtree(root / "out-shakespeare-char", ignore_errors=True)
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    lines, wall = timed_lines([sys.executable, "train.py", *NANOGPT_ARGS], root, env)
    evals = [(t, int(m[1]), float(m[3])) for t, l in lines if (m := EVAL.search(l))]
    # The first iteration's time holds warm-up; nanoGPT's own log gives each iteration's milliseconds.
    step_ms = [float(m[2]) for _, l in lines if (m := ITER.search(l)) and int(m[1]) > 0]
    return {"evals": evals, "wall": wall, "tokens_per_s": TOKENS_PER_STEP / (statistics.median(step_ms) / 1000)}


def run_jaxlm(corpus: Path, work: Path, overrides: list[str]) -> dict:
    run_dir = work / f"jaxlm-{time.time_ns()}"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "jaxlm.cli", "train", "shakespeare_char_cpu", f"data.input={corpus}",
           f"data.dir={work / 'jaxlm-data'}", f"run_dir={run_dir}", "logging.progress=false",
           "checkpoint.enabled=false", "training.sample_tokens=0", *overrides]
    lines, wall = timed_lines(cmd, Path.cwd(), env)
    evals = [(t, int(m[1]), float(m[3])) for t, l in lines if (m := EVAL.search(l))]
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_s = [r["step_time_s"] for r in records if "step_time_s" in r and r["step"] > 1]
    tps = TOKENS_PER_STEP / statistics.median(step_s) if step_s else float("nan")
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"evals": evals, "wall": wall, "tokens_per_s": tps}


def first_at(evals, target: float) -> float | None:
    return next((t for t, _, v in evals if v <= target), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nanogpt", type=Path, help="a nanoGPT checkout (karpathy/nanoGPT)")
    ap.add_argument("--input", type=Path, required=True, help="tiny Shakespeare's input.txt")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--target", type=float, default=1.886, help="val loss whose first reaching is timed")
    ap.add_argument("--only", choices=["nanogpt", "jaxlm"])
    ap.add_argument("--torch-threads", type=int, help="nanoGPT's OMP_NUM_THREADS (default: PyTorch's own choice)")
    ap.add_argument("--set", action="append", default=[], dest="overrides", help="a jaxlm key=value (repeatable)")
    a = ap.parse_args()
    if a.only != "jaxlm" and a.nanogpt is None:
        ap.error("--nanogpt PATH is needed to run nanoGPT (or --only jaxlm)")
    names = [n for n in ("nanogpt", "jaxlm") if a.only in (None, n)]
    results: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="nanogpt-cpu-") as tmp:
        work = Path(tmp)
        for r in range(a.repeats):
            for name in names:
                out = (run_nanogpt(a.nanogpt, a.input.resolve(), work, a.torch_threads) if name == "nanogpt"
                       else run_jaxlm(a.input.resolve(), work, a.overrides))
                results[name].append(out)
                reach = first_at(out["evals"], a.target)
                print(f"{name} run {r + 1}: " + " ".join(f"{s}:{v:.4f}@{t:.0f}s" for t, s, v in out["evals"]), flush=True)
                print(f"{name} run {r + 1}: final val loss {out['evals'][-1][2]:.4f} wall {out['wall']:.1f} s, "
                      f"val <= {a.target} at {'never' if reach is None else f'{reach:.1f} s'}, median step "
                      f"{out['tokens_per_s']:,.0f} tokens/s", flush=True)
    if len(names) == 2:
        med = lambda name, f: statistics.median(f(o) for o in results[name])  # noqa: E731
        for what, f in (("wall time", lambda o: o["wall"]), ("tokens/s", lambda o: o["tokens_per_s"]),
                        ("final val loss", lambda o: o["evals"][-1][2])):
            print(f"jaxlm / nanoGPT {what}: {med('jaxlm', f):.4g} / {med('nanogpt', f):.4g} = "
                  f"{med('jaxlm', f) / med('nanogpt', f):.3f}")
        reached = [(first_at(o["evals"], a.target), first_at(n["evals"], a.target))
                   for o, n in zip(results["jaxlm"], results["nanogpt"])]
        print("time to val <= %.3f, jaxlm / nanoGPT: " % a.target + ", ".join(
            "n/a" if j is None or n is None else f"{j:.1f} / {n:.1f} s = {j / n:.3f}" for j, n in reached))


if __name__ == "__main__":
    main()
