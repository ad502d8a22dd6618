"""TPU tier: the commands on the chip as users run them (`make test-tpu`; docs/tpu.md). The quickstart through the CLI
with evaluation, checkpoints and a sample, killed after a checkpoint and resumed exactly; a step compiled ahead of
time for v5e:1x1 by a CPU-only process, saved, loaded and run on the chip. Each command is a process of its own,
one at a time (one program at a time holds the chip)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import chip_free_for_processes
from jaxlm.train import loop as train

pytestmark = pytest.mark.tpu


@pytest.fixture
def tpu():
    """The chip, left to the commands this module starts (this module runs first: tests/conftest.py)."""
    chip_free_for_processes()

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))
    return env


def _jaxlm(*args, cwd, timeout=300, stdout_only=False, **env) -> str:
    p = subprocess.run([sys.executable, "-m", "jaxlm.cli", *args], cwd=cwd, env=_env(**env), capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode == 0, f"jaxlm {' '.join(args)} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout if stdout_only else p.stdout + p.stderr


def test_quickstart_with_defaults_trains_evaluates_checkpoints_and_samples(tpu, tpu_quickstart_run):
    """`jaxlm train quickstart` on the chip with its defaults (splash attention, Muon), shortened to 240 steps so
    that its evaluation at step 200 and the one at the end both run, with checkpoints and the sample."""
    run, out = tpu_quickstart_run
    assert "on 1 tpu devices" in out and "attention splash" in out, out
    losses = train.losses_by_step(run)
    assert sorted(losses) == list(range(1, 241))
    assert losses[240] < 0.6 * losses[1], (losses[1], losses[240])
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [200, 240], evals
    assert evals[-1]["val_loss"] < 2.5, evals[-1]
    assert (run / "checkpoints" / "200" / "jaxlm_manifest.json").exists()
    assert "def " in out.split("sample")[-1], out[-2000:]


def test_generate_and_eval_commands_on_the_chip(tpu, tpu_quickstart_run, tmp_path):
    """`jaxlm generate` samples from the run's checkpoint on the chip (greedy: two samples of one prompt in a batch
    are the same text), and `jaxlm eval` gives the run's own final evaluation back (the same held-out batches, the
    same weights)."""
    run, _ = tpu_quickstart_run
    out = _jaxlm("generate", str(run), "--prompt", "def ", "--num-samples", "2", "max_new_tokens=48", "temperature=0",
                 cwd=tmp_path, stdout_only=True)
    first = out.split("--- sample 1 of 2\n", 1)[1].split("\n--- sample 2 of 2\n")[0]
    second = out.split("--- sample 2 of 2\n", 1)[1].removesuffix("\n")
    assert first == second and len(first) > 20, (first, second)
    out = _jaxlm("eval", str(run), "training.sample_tokens=0", cwd=tmp_path)
    final = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if "val_loss" in l][-1]
    line = next(l for l in out.splitlines() if "val loss" in l)
    val = float(line.split("val loss")[1].split()[0].strip(",;"))
    assert abs(val - final["val_loss"]) < 2e-3, (line, final)


def test_killed_after_a_checkpoint_and_rerun_resumes_exactly(tpu, tpu_quickstart_run, tmp_path):
    """The quickstart run's command again, SIGKILLed once step 110 is past the checkpoint of step 100; the rerun
    resumes there and its losses equal the uninterrupted run's (tpu_quickstart_run) bit for bit: same chip, same
    programs (the persistent compilation cache hands the run's own executables back)."""
    ref, _ = tpu_quickstart_run
    args = ["train", "quickstart", f"data.dir={ref.parent / 'data'}", "training.steps=240", "checkpoint.interval=100",
            "logging.progress=false"]
    run_dir = tmp_path / "killed"
    p = subprocess.Popen([sys.executable, "-m", "jaxlm.cli", *args, f"run_dir={run_dir}"], cwd=tmp_path, env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    metrics = run_dir / "metrics.jsonl"

    def past(step):  # every step is recorded; the file is flushed every 10 (training.log_interval)
        return metrics.exists() and any(json.loads(l)["step"] >= step for l in metrics.read_text().splitlines())

    while time.time() < deadline and not ((run_dir / "checkpoints" / "100" / "jaxlm_manifest.json").exists()
                                          and past(110)):
        time.sleep(0.02)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not past(240), "the run ended before it was killed"
    time.sleep(5)  # the chip can refuse a program started just after another ended
    out = _jaxlm(*args, f"run_dir={run_dir}", cwd=tmp_path)
    assert "resumed from" in out, out
    a, b = train.losses_by_step(ref), train.losses_by_step(run_dir)
    assert sorted(b) == list(range(1, 241))
    assert [a[s] for s in range(1, 241)] == [b[s] for s in range(1, 241)]


def test_a_step_compiled_for_v5e_on_a_cpu_host_is_saved_loaded_and_trains_on_the_chip(tpu, tpu_quickstart_run,
                                                                                        tmp_path):
    """`jaxlm compile quickstart compile.topology=v5e:1x1` in a process that sees only the CPU (as on a CPU host
    with libtpu), then `jaxlm train ... compile.load=` on the chip with the quickstart run's settings: it loads the
    saved step, and its losses are the jitted run's."""
    run, _ = tpu_quickstart_run
    same = [f"data.dir={run.parent / 'data'}", "training.steps=240", "training.eval_interval=0",
            "training.sample_tokens=0", "checkpoint.enabled=false", "logging.progress=false"]
    out = _jaxlm("compile", "quickstart", *same, "compile.topology=v5e:1x1", "compile.output=step.jaxlm", cwd=tmp_path,
                 JAX_PLATFORMS="cpu")
    assert "saved the compiled step to step.jaxlm" in out, out
    out = _jaxlm("train", "quickstart", *same, "compile.load=step.jaxlm", f"run_dir={tmp_path / 'aot'}", cwd=tmp_path)
    assert "train step loaded from step.jaxlm" in out, out
    aot, jit = train.losses_by_step(tmp_path / "aot"), train.losses_by_step(run)
    assert sorted(aot) == list(range(1, 241)) and aot[240] < aot[1]
    assert max(abs(aot[s] - jit[s]) for s in aot) < 1e-3, (aot, jit)
