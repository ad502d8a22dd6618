"""`jaxlm launch --scheduler slurm` on a real Slurm cluster (tests/slurm_cluster.py: slurmctld and two slurmd on
this machine): a 2-node x 4-device job gives the losses of one process with 8 devices, a job whose task on one
node is killed is requeued and its rerun continues exactly, and the signal Slurm sends before the time limit
saves a checkpoint. Also the process settings each task derives from Slurm's environment."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import xla_flags
from jaxlm import config as config_lib
from jaxlm.store import checkpoint as ckpt
from jaxlm.launch import distributed
from jaxlm.train import loop as train
from jaxlm.config import DistributedConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cluster():
    import slurm_cluster

    if (why := slurm_cluster.missing()) is not None:
        pytest.fail(why, pytrace=False)
    c = slurm_cluster.Cluster()
    try:
        c.start()
        yield c
    finally:
        c.stop()


def common(char_data) -> list[str]:
    return ["shakespeare_char_cpu", f"data.dir={char_data}", "model.n_layers=2", "model.d_model=32",
            "model.block_size=32", "model.vocab_size=128", "training.batch_size=8", "optimizer.warmup_steps=2",
            "optimizer.decay_steps=12", "checkpoint.interval=4", "training.eval_interval=0",
            "training.sample_tokens=0", "logging.progress=false", "training.log_interval=1", "mesh.ici_data=1",
            "mesh.ici_fsdp=8"]


def submit(cluster, out_dir: Path, name: str, command: list[str], *options: str) -> str:
    """`jaxlm launch --scheduler slurm --submit`, as a user types it: the job id."""
    env = dict(cluster.env, XLA_FLAGS=xla_flags(), PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT / "src"), str(ROOT / "tests"), os.environ.get("PYTHONPATH")])))
    p = subprocess.run([sys.executable, "-m", "jaxlm.cli", "launch", "--scheduler", "slurm", "--submit", "--nodes", "2",
                        "--devices-per-process", "4", "--name", name, "--output-dir", str(out_dir), *options, "--",
                        *command], env=env, capture_output=True, text=True, timeout=120, cwd=out_dir.parent)
    assert p.returncode == 0, p.stdout + p.stderr
    return re.search(r"submitted job (\d+)", p.stdout)[1]


def output(out_dir: Path, name: str, job: str) -> str:
    return (out_dir / f"{name}-{job}.out").read_text()


def recorded_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    steps = [0]
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            steps.append(json.loads(line)["step"])
        except ValueError:  # a line being written
            pass
    return max(steps)


def wait_for_step(cluster, job: str, run_dir: Path, step: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while recorded_step(run_dir) < step:
        state = cluster.job(job).get("JobState")
        assert state not in ("COMPLETED", "FAILED", "CANCELLED") and time.monotonic() < deadline, state
        time.sleep(0.2)


def task_pid(job: str, task: int) -> int:
    """The jaxlm process of one task of the job's step (found by its environment, as `scontrol listpids` would)."""
    for proc in Path("/proc").iterdir():
        try:
            env = dict(v.split("=", 1) for v in (proc / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in v)
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if (env.get("SLURM_JOB_ID") == job and env.get("SLURM_PROCID") == str(task)
                and env.get("SLURM_STEP_ID", "").isdigit() and b"jaxlm.cli" in cmd):
            return int(proc.name)
    raise AssertionError(f"no process of task {task} in job {job}")


@pytest.fixture(scope="module")
def requeued(cluster, char_data, tmp_path_factory):
    """A 2-node job of 12 steps (checkpoints every 4) whose task on n2 is killed after step 6: srun ends the other
    and the job is requeued once. Started before the module's other jobs, which then run while Slurm holds the
    requeued job back (cred_expire, 90 s: tests/slurm_cluster.py); test_two_nodes_... waits for its rerun.
    (out, run_dir, job id)."""
    base = tmp_path_factory.mktemp("requeued")
    out, run_dir = base / "slurm", base / "lost"
    job = submit(cluster, out, "lost", ["train", *common(char_data), "training.steps=12", f"run_dir={run_dir}"],
                 "--requeues", "1")
    wait_for_step(cluster, job, run_dir, 6)
    os.kill(task_pid(job, 1), signal.SIGKILL)
    return out, run_dir, job


# The signal test runs first: its job and the uninterrupted job of the test after it run during the requeued job's
# wait (the `requeued` fixture starts it), rather than one after the other.
@pytest.mark.slow
@pytest.mark.in_ci
def test_signal_before_the_time_limit_saves_a_checkpoint(cluster, requeued, char_data, tmp_path):
    out, run_dir = tmp_path / "slurm", tmp_path / "run"
    job = submit(cluster, out, "limit", ["train", *common(char_data), "training.steps=100000", f"run_dir={run_dir}"],
                 "--requeues", "0", "--time", "30", "--signal-seconds", "120")
    wait_for_step(cluster, job, run_dir, 3)
    # The time limit comes closer: 1 to 2 minutes from now, so that it is within --signal-seconds.
    h, m, s = (int(v) for v in re.fullmatch(r"(?:\d+-)?(\d+):(\d+):(\d+)", cluster.job(job)["RunTime"]).groups())
    cluster.run("scontrol", "update", f"JobId={job}", f"TimeLimit={math.ceil((h * 3600 + m * 60 + s) / 60) + 1}")
    info = cluster.wait(job, 300)
    text = output(out, "limit", job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text
    stops = set(re.findall(r"process (\d): stopped for preemption after step (\d+)", text))
    assert {p for p, _ in stops} == {"0", "1"} and len({s for _, s in stops}) == 1, text
    step = int(stops.pop()[1])
    assert 3 <= step < 100000
    assert ckpt.step_numbers(run_dir / "checkpoints")[-1] == step
    assert ckpt.verify(run_dir / "checkpoints" / str(step)) is None
    assert max(train.losses_by_step(run_dir)) == step
    assert f"jaxlm: stopped for preemption after step {step} (its checkpoint is saved); no requeue left" in text, text


@pytest.mark.slow
@pytest.mark.in_ci  # issue 30: the Slurm jobs run in CI
def test_two_nodes_match_one_process_and_a_requeued_job_resumes_exactly(cluster, requeued, char_data, tmp_path):
    out = tmp_path / "slurm"
    args = common(char_data)
    whole = submit(cluster, out, "whole", ["train", *args, "training.steps=12", f"run_dir={tmp_path / 'whole'}"],
                   "--requeues", "0")
    # One process with 8 devices, here, while the job runs.
    train.train(config_lib.load(args[0], [*args[1:], "training.steps=12", f"run_dir={tmp_path / 'one'}"]),
                jax.devices(), log=lambda s: None)
    info = cluster.wait(whole, 600)
    text = output(out, "whole", whole)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text
    # Each task joined the job as its own process, on its own node, with 4 devices and the coordinator on n1.
    for task, node in ((0, "n1"), (1, "n2")):
        assert re.search(rf"process {task} of 2 \(Slurm job {whole} step 0 task {task} on node {node} \(restart 0\)\): "
                         r"coordinator 127\.0\.0\.1:\d+, 4 local cpu device\(s\)", text), text
    a, one = train.losses_by_step(tmp_path / "whole"), train.losses_by_step(tmp_path / "one")
    assert sorted(a) == sorted(one) == list(range(1, 13)) and a[12] < a[1]
    np.testing.assert_allclose([a[s] for s in range(1, 13)], [one[s] for s in range(1, 13)], rtol=1e-5)

    # The job whose task on n2 died after step 6 (checkpoint at 4; the `requeued` fixture) was requeued once, and
    # its rerun resumes from step 4 and repeats the uninterrupted job's losses exactly.
    lost_out, run_dir, lost = requeued
    info = cluster.wait(lost, 600)
    text = output(lost_out, "lost", lost)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", text
    assert re.search(r"jaxlm: failed with status \d+; requeueing job \d+ \(restart 1 of 1\)", text), text
    assert "(restart 1)): coordinator" in text and "jaxlm: finished" in text, text
    assert re.search(r"resum\w* .*step (4|8)\b", text, re.IGNORECASE), text
    b = train.losses_by_step(run_dir)
    assert [b[s] for s in range(1, 13)] == [a[s] for s in range(1, 13)]


def test_settings_from_slurm_environment():
    """What each task of `srun` passes to jax.distributed.initialize."""
    task = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}
    cfg = DistributedConfig()
    assert distributed.settings(cfg, task) is None  # not a jaxlm job: a single process, as before
    ours = dict(task, JAXLM_COORDINATOR="10.0.0.1:4321")
    assert distributed.settings(cfg, ours) == {"coordinator_address": "10.0.0.1:4321", "num_processes": 8,
                                               "process_id": 5}
    # --gpus-per-task=2: Slurm shows the task its own two GPUs, and it uses both (JAX alone would keep
    # SLURM_LOCALID's one).
    gpus = dict(ours, CUDA_VISIBLE_DEVICES="2,3", SLURM_GPUS_PER_TASK="2")
    assert distributed.settings(cfg, gpus)["local_device_ids"] == [0, 1]
    # All of a node's GPUs visible to each of its tasks: JAX's choice (one per SLURM_LOCALID) stands.
    assert "local_device_ids" not in distributed.settings(cfg, dict(ours, CUDA_VISIBLE_DEVICES="0,1,2,3"))
    # distributed.auto=true in a user's own sbatch script: the coordinator is JAX's (the first node).
    assert distributed.settings(DistributedConfig(auto=True), task) == {"num_processes": 8, "process_id": 5}
    assert distributed.settings(DistributedConfig(auto=True), {}) == {}
    # `jaxlm launch` and the Kubernetes manifest name the process themselves; that wins over Slurm's numbering.
    launched = dict(ours, JAXLM_PROCESS_ID="1", JAXLM_NUM_PROCESSES="2")
    assert distributed.settings(cfg, launched)["process_id"] == 1


def test_script_and_errors(tmp_path):
    from jaxlm import cli

    script = subprocess.run([sys.executable, "-m", "jaxlm.cli", "launch", "--scheduler", "slurm", "--nodes", "4",
                             "--tasks-per-node", "8", "--gpus-per-process", "1", "--time", "24:00:00", "--partition",
                             "a3", "--account", "lm", "--requeues", "5", "--sbatch=--exclusive", "--", "train",
                             "openwebtext", "run_dir=/shared/owt"], capture_output=True, text=True, cwd=tmp_path)
    assert script.returncode == 0, script.stderr
    text = script.stdout
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-task=1",
                 "#SBATCH --time=24:00:00", "#SBATCH --partition=a3", "#SBATCH --account=lm", "#SBATCH --requeue",
                 "#SBATCH --signal=TERM@300", "#SBATCH --exclusive", '-lt 5 ]'):
        assert line in text, line
    assert f"srun --kill-on-bad-exit=1 {sys.executable} -m jaxlm.cli train openwebtext run_dir=/shared/owt" in text
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0  # the shell parses it
    assert not (tmp_path / "slurm").exists()  # a dry run writes nothing

    env = dict(os.environ, PATH="/nonexistent")
    p = subprocess.run([sys.executable, "-m", "jaxlm.cli", "launch", "--scheduler", "slurm", "--submit", "--nodes",
                        "2", "--", "train", "quickstart"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0
    assert p.stderr.startswith("error: sbatch is not on PATH; submit ") and "--dry-run" in p.stderr
    with pytest.raises(SystemExit):
        cli.cmd_launch(["--scheduler", "slurm", "--", "train", "quickstart"])  # --nodes missing: argparse's error
