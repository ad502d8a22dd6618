"""Faults, corruptions and bad inputs thrown at jaxlm in one run, and how many it survived or caught.

The generators of tests/test_reliability.py, test_config.py and test_data.py, at a larger scale:
- training under faults: one run of the tiny test model trained to the end through random SIGKILLs and
  SIGTERMs (each followed by a restart), compared with an uninterrupted run: per-step losses, final
  parameters and the data windows of every step must be the same bits;
- saves under fire: a process saving checkpoint after checkpoint, SIGKILLed at random moments and
  restarted; every restore must return a complete checkpoint and never an older one than before;
- NaN batches in a run (never applied, never saved) and saves that fail with a real write error;
- every file of a committed checkpoint truncated, emptied and bit-flipped, its manifest deleted;
- the config fuzz (every key with bad values, typos, impossible combinations) and the data fuzz for
  `prepare` (invalid UTF-8, NUL bytes, huge lines, empty files) plus data files that contradict their meta.

Prints key=value lines, the totals last:
    faults_injected faults_survived corruptions_tried corruptions_detected bad_inputs_tried
    bad_inputs_clear_errors steps_lost samples_repeated_or_skipped
steps_lost counts steps trained after the last committed checkpoint and so trained again after a SIGKILL
(a SIGTERM loses none); samples_repeated_or_skipped counts training windows of the finished run that differ
from the uninterrupted run's, which must be 0. Exits with status 1 when a fault was not survived, a
corruption not detected, a bad input not refused clearly or a window repeated or skipped.

    python benchmarks/reliability.py [--kills 60] [--train-faults 6] [--seed 0]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import test_config  # noqa: E402 - the fault generators of the tests
import test_data  # noqa: E402
import test_reliability as T  # noqa: E402 - (conftest, imported by it, sets up 8 fake CPU devices)
from conftest import SHAKESPEARE, tiny_config  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxlm import cli
from jaxlm.store import checkpoint as ckpt
from jaxlm.train import batches as batch_lib, loop as train, state as state_lib, step as step_lib  # noqa: E402
from jaxlm.config import CheckpointConfig  # noqa: E402
from jaxlm.data import loader as loader_lib, prepare  # noqa: E402
from jaxlm.data.errors import DataError  # noqa: E402

RUN = {**T.RUN, "training.steps": 60, "optimizer.decay_steps": 60, "checkpoint.interval": 5,
       "training.log_interval": 1}

DRIVER = """
import hashlib, json, sys
from pathlib import Path
sys.path[:0] = [sys.argv[1], sys.argv[6]]
from conftest import tiny_config
from jaxlm.train import batches as batch_lib, loop as train
from reliability import training_draws

draws = open(sys.argv[4], "a")

def record(starts):
    draws.write(hashlib.sha256(starts.tobytes()).hexdigest()[:16] + "\\n")
    draws.flush()

batch_lib.make_loader = training_draws(batch_lib.make_loader, record)
summary = train.train(tiny_config(Path(sys.argv[2]), Path(sys.argv[3]), **json.loads(sys.argv[5])), log=print)
print("START", summary["start_step"], flush=True)
"""


def training_draws(make_loader, record):
    """batches.make_loader whose training loader hands the start offsets of every batch it draws to `record`:
    the windows of the training steps only, not those of the fixed evaluation batches, which come from
    loaders of their own (seed + 2, one micro-batch) that every start of a run makes again."""
    def make(run, split="train", grad_accum=None, seed=None):
        loader = make_loader(run, split, grad_accum, seed)
        if split == "train" and grad_accum is None and seed is None:
            next_starts = loader.next_starts

            def logged():
                starts = next_starts()
                record(starts)
                return starts

            loader.next_starts = logged
        return loader

    return make


def train_under_faults(data: Path, work: Path, n_faults: int, rng: random.Random) -> dict:
    """Reference run in this process; then the same run in subprocesses, each killed (SIGKILL) or preempted
    (SIGTERM) at a random moment and restarted, until one finishes."""
    ref_dir = work / "reference"
    ref_draws = []
    make_loader = batch_lib.make_loader
    batch_lib.make_loader = training_draws(make_loader, lambda starts: ref_draws.append(
        hashlib.sha256(starts.tobytes()).hexdigest()[:16]))
    try:
        cfg = tiny_config(data, ref_dir, **RUN)
        train.train(cfg, log=lambda s: None)
    finally:
        batch_lib.make_loader = make_loader

    run_dir, lineage, lost, injected, sigterms, clean_exits = work / "faulty", {}, 0, 0, 0, 0
    steps = RUN["training.steps"]
    fault_steps = sorted(rng.sample(range(3, steps - 2), n_faults))
    for i in range(n_faults + 1):
        start = ckpt.newest_verified(run_dir / "checkpoints")[0] or 0
        # At least one step into this process, so that its signal handlers are in place.
        target = max(fault_steps[i], start + 1) if i < n_faults else steps
        sig = rng.choice([signal.SIGKILL, signal.SIGTERM]) if target < steps - 1 else None
        draws = work / f"draws{i}.txt"
        p = subprocess.Popen([sys.executable, "-c", DRIVER, str(ROOT / "tests"), str(data), str(run_dir), str(draws),
                              json.dumps(RUN), str(ROOT / "benchmarks")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if sig is not None:
            # Just after the batch of a random step is drawn: inside that step, its metrics flush or its save.
            while p.poll() is None and (not draws.exists() or start + len(draws.read_text().split()) < target):
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.03))
            p.send_signal(sig)
        out = p.communicate(timeout=900)[0]
        expected = -signal.SIGKILL if sig == signal.SIGKILL else 0
        if p.returncode != expected:
            raise RuntimeError(f"restart {i} ended with {p.returncode}, expected {expected}:\n{out[-3000:]}")
        drawn = draws.read_text().split()
        for k, h in enumerate(drawn):
            lineage[start + k + 1] = h  # a restart overwrites the steps it trains again
        if sig is None:
            break
        injected += 1
        sigterms += sig == signal.SIGTERM
        clean_exits += sig == signal.SIGTERM and "stopped for preemption" in out
        resumed = ckpt.newest_verified(run_dir / "checkpoints")[0] or 0
        lost += max(0, start + len(drawn) - resumed)  # steps that will be trained again
    ref_losses, got = train.losses_by_step(ref_dir), train.losses_by_step(run_dir)
    exact = ([got.get(s) for s in range(1, steps + 1)] == [ref_losses[s] for s in range(1, steps + 1)]
             and T.tree_hash(T.restore_step(cfg, run_dir, steps)) == T.tree_hash(T.restore_step(cfg, ref_dir, steps)))
    mismatched = sum(lineage.get(s) != ref_draws[s - 1] for s in range(1, steps + 1))
    return {"train_faults": injected, "train_sigterms": sigterms, "train_run_exact": int(exact),
            "train_faults_survived": injected if exact and clean_exits == sigterms else 0, "steps_lost": lost,
            "samples_repeated_or_skipped": mismatched * cfg.training.batch_size * cfg.training.grad_accum}


def nan_batches(data: Path, work: Path) -> dict:
    """Three NaN batches in one run: survived when each leaves params and optimizer state as they were and
    no committed checkpoint holds a non-finite value."""
    poisoned = {4, 9, 10}
    real = batch_lib.device_batch
    batch_lib.device_batch = T.poisoned(real, poisoned)
    try:
        settings = {**T.RUN, "training.steps": 12, "checkpoint.interval": 1, "checkpoint.keep": 20}
        cfg = tiny_config(data, work / "nan", **settings)
        summary = train.train(cfg, log=lambda s: None)
    finally:
        batch_lib.device_batch = real
    states = {s: T.restore_step(cfg, work / "nan", s) for s in ckpt.step_numbers(work / "nan" / "checkpoints")}
    finite = all(np.isfinite(leaf).all() for st in states.values() for leaf in jax.tree.leaves(st)
                 if np.issubdtype(np.asarray(leaf).dtype, np.floating))
    survived = sum(finite and T.tree_hash({k: states[s][k] for k in ("params", "opt_state")})
                   == T.tree_hash({k: states[s - 1][k] for k in ("params", "opt_state")}) for s in poisoned)
    assert summary["nonfinite_skips"] == len(poisoned)
    return {"nan_batches": len(poisoned), "nan_batches_survived": survived}


def failing_saves(work: Path, n: int) -> dict:
    """Saves that fail with a real write error (the file-size limit, EFBIG) while Orbax writes in the
    background: survived when the failure is reported, the previous checkpoint stays intact and the next save
    commits."""
    x = np.random.default_rng(0).standard_normal(1 << 19).astype(np.float32)
    state = {"x": jnp.asarray(x), "step": jnp.int32(0)}
    ck = ckpt.Checkpointer(work / "saves", CheckpointConfig(keep=1, on_error="stop"), log=lambda s: None)
    survived, step = 0, 1
    ck.save(step, state, {"pos": step})
    ck.wait()
    for _ in range(n):
        with T.file_size_limit(1 << 18):
            ck.save(step + 1, state, {"pos": step + 1})
            ck.wait()
        try:
            ck.check()
            reported = False
        except ckpt.CheckpointError:
            reported = True
        intact = ckpt.newest_verified(ck.dir)[0] == step
        ck.save(step + 2, state, {"pos": step + 2})
        ck.wait()
        survived += reported and intact and ckpt.newest_verified(ck.dir)[0] == step + 2
        step += 2
    ck.close()
    return {"failing_saves": n, "failing_saves_survived": survived}


def corruption_matrix(ckpt_dir: Path, rng: random.Random) -> dict:
    """Every file of the newest checkpoint truncated, bit-flipped (3 random bits, one at a time) and emptied,
    a file deleted, the manifest deleted: each must fail verification, and the previous checkpoint be chosen."""
    steps = ckpt.step_numbers(ckpt_dir)
    newest, previous = ckpt_dir / str(steps[-1]), steps[-2]
    files = [p for p in newest.rglob("*") if p.is_file() and p.name != ckpt.MANIFEST]
    tried = detected = 0

    def check():
        nonlocal tried, detected
        tried += 1
        detected += ckpt.verify(newest) is not None and ckpt.newest_verified(ckpt_dir)[0] == previous

    for path in files:
        for _ in range(3):
            for _ in T.corruptions(path, rng):
                check()
        data = path.read_bytes()
        path.unlink()
        check()
        path.write_bytes(data)
    manifest = (newest / ckpt.MANIFEST).read_bytes()
    (newest / ckpt.MANIFEST).unlink()
    check()
    (newest / ckpt.MANIFEST).write_bytes(manifest)
    assert ckpt.verify(newest) is None
    return {"corruptions_tried": tried, "corruptions_detected": detected}


def config_fuzz(data: Path, work: Path, seeds: int) -> tuple[int, int]:
    blocked = {}

    def compiled(*args, **kwargs):
        raise AssertionError("a bad config got as far as compiling")

    for module, name in ((state_lib, "init_state"), (state_lib, "init_state_from"), (step_lib, "make_train_step"),
                         (step_lib, "make_eval_step")):
        blocked[module, name] = getattr(module, name)
        setattr(module, name, compiled)
    base = ["shakespeare_char_cpu", f"data.dir={data}", "model.n_layers=2", "model.d_model=32", "model.n_heads=4",
            "model.block_size=32", "training.batch_size=8", "training.steps=20", "optimizer.warmup_steps=5",
            "logging.progress=false", "logging.tensorboard=false"]
    tried = clear = 0
    try:
        for seed in range(seeds):
            for i, (args, key) in enumerate(test_config.config_mutations(seed)):
                err = io.StringIO()
                tried += 1
                try:
                    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                        code = cli.main(["train", *base, f"run_dir={work / 'fuzz' / f'{seed}_{i}'}", *args])
                except BaseException:  # noqa: BLE001 - a traceback is exactly what this counts as unclear
                    continue
                msg = err.getvalue()
                clear += code == 2 and msg.count("\n") == 1 and key in msg and "Traceback" not in msg
    finally:
        for (module, name), fn in blocked.items():
            setattr(module, name, fn)
    return tried, clear


def data_fuzz(data: Path, work: Path, seeds: int) -> tuple[int, int]:
    """prepare on bad inputs (a clear outcome: counts that match an independent count, or a one-line
    DataError where the input has no usable text), and data files that contradict their meta."""
    tried = clear = 0
    for seed in range(seeds):
        rng = random.Random(seed)
        for i, raw in enumerate(test_data.bad_inputs(rng)):
            src = work / f"bad{seed}_{i}.txt"
            src.write_bytes(raw)
            invalid = test_data.reference_invalid_utf8(raw)
            for errors in prepare.UTF8_ERRORS:
                tried += 1
                try:
                    meta = prepare.prepare_text([src], work / f"prep{seed}_{i}_{errors}", rng.choice(["char", "byte"]),
                                                errors)
                    clear += meta["input"]["invalid_utf8"] == invalid and meta["input"]["nul_bytes"] == raw.count(0)
                except DataError as e:
                    clear += "\n" not in str(e)
                except Exception:  # noqa: BLE001 - a crash is exactly what this counts as unclear
                    pass
    meta = json.loads((data / "meta.json").read_text())
    train_bin = (data / "train.bin").read_bytes()
    mismatches = [({"vocab_size": 10}, None), ({"vocab_size": 0}, None), ({"vocab_size": 70_000}, None),
                  ({"dtype": "float32"}, None), ({"train_tokens": meta["train_tokens"] + 1}, None),
                  ({}, train_bin[:-1]), ({}, train_bin[:-2]), ({"train_tokens": 0}, b""),
                  ({}, train_bin[:100] + np.uint16(65).tobytes() + train_bin[102:])]
    for i, (changes, train_bytes) in enumerate(mismatches):
        d = work / f"mismatch{i}"
        d.mkdir()
        (d / "meta.json").write_text(json.dumps({**meta, **changes}))
        (d / "train.bin").write_bytes(train_bin if train_bytes is None else train_bytes)
        shutil.copy(data / "val.bin", d / "val.bin")
        tried += 1
        try:
            loader_lib.Dataset(d)
        except DataError as e:
            clear += "\n" not in str(e)
    return tried, clear


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=60, help="SIGKILLs of a process saving checkpoints")
    p.add_argument("--train-faults", type=int, default=6, help="SIGKILL/SIGTERM of a training run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input", default=str(SHAKESPEARE), help="tiny Shakespeare text")
    a = p.parse_args()
    rng = random.Random(a.seed)
    t0 = time.perf_counter()
    results: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cache = work / "jax_cache"  # every restart compiles the same step: load it instead
        settings = {"jax_compilation_cache_dir": str(cache), "jax_persistent_cache_min_compile_time_secs": 0,
                    "jax_persistent_cache_min_entry_size_bytes": 0}
        for k, v in settings.items():
            jax.config.update(k, v)
            os.environ[k.upper()] = str(v)
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.reset_cache()
        data = work / "data"
        prepare.prepare_shakespeare_char(data, a.input)

        results |= train_under_faults(data, work, a.train_faults, rng)
        (work / "saves_under_fire").mkdir()
        records = T.kill_during_saves(work / "saves_under_fire", a.kills, a.seed)
        # A record is written by each restart once it has restored; a kill that lands before that (in start-up,
        # slower on a loaded machine) leaves no record, and the next restart's record checks the same state. A
        # kill is survived unless a record shows a committed checkpoint lost, incomplete or older than before.
        bad, newest = 0, None
        for r in records[1:]:
            if r["restored"] is None:
                bad += newest is not None
            elif not r["complete"] or (newest is not None and r["restored"] < newest):
                bad += 1
            else:
                newest = r["restored"]
        results |= {"kills_during_saves": a.kills, "kills_during_saves_survived": a.kills - bad,
                    "kills_before_a_restore": a.kills + 1 - len(records),
                    "kills_that_cut_a_save_short": sum(r["interrupted_save"] for r in records)}
        results |= nan_batches(data, work)
        results |= failing_saves(work, 3)
        results |= corruption_matrix(work / "faulty" / "checkpoints", rng)
        c_tried, c_clear = config_fuzz(data, work, seeds=2)
        d_tried, d_clear = data_fuzz(data, work, seeds=3)
        results |= {"config_fuzz_tried": c_tried, "config_fuzz_clear": c_clear, "data_fuzz_tried": d_tried,
                    "data_fuzz_clear": d_clear}

    results["faults_injected"] = (results["train_faults"] + results["kills_during_saves"] + results["nan_batches"]
                                  + results["failing_saves"])
    results["faults_survived"] = (results["train_faults_survived"] + results["kills_during_saves_survived"]
                                  + results["nan_batches_survived"] + results["failing_saves_survived"])
    results["bad_inputs_tried"] = c_tried + d_tried
    results["bad_inputs_clear_errors"] = c_clear + d_clear
    results["wall_seconds"] = round(time.perf_counter() - t0)
    order = ["faults_injected", "faults_survived", "corruptions_tried", "corruptions_detected", "bad_inputs_tried",
             "bad_inputs_clear_errors", "steps_lost", "samples_repeated_or_skipped"]
    for k in [k for k in results if k not in order] + order:
        print(f"{k}={results[k]}")
    checks = {"faults_survived": results["faults_survived"] == results["faults_injected"],
              "corruptions_detected": results["corruptions_detected"] == results["corruptions_tried"],
              "bad_inputs_clear_errors": results["bad_inputs_clear_errors"] == results["bad_inputs_tried"],
              "samples_repeated_or_skipped": results["samples_repeated_or_skipped"] == 0}
    failed = [k for k, ok in checks.items() if not ok]
    if failed:
        raise SystemExit(f"reliability check failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
