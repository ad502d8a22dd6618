"""Multi-process runs through JAX's own distributed runtime (`jax.distributed`), and preemption notices
(SIGTERM/SIGINT) turned into one step at which every process stops.

A run is multi-process when `distributed.coordinator_address` is set, when `jaxlm launch` (or the Kubernetes
manifest it writes) exported JAXLM_COORDINATOR / JAXLM_NUM_PROCESSES / JAXLM_PROCESS_ID, when the sbatch script
of `jaxlm launch --scheduler slurm` exported JAXLM_COORDINATOR to the tasks of its `srun` (process id and count
then come from SLURM_PROCID / SLURM_NTASKS), or when `distributed.auto=true` lets JAX detect the cluster (TPU
pods, Slurm, Open MPI, Kubernetes). CPU processes exchange data through gloo. Each process prints one line
saying who it is (`describe`).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable

import jax

from jaxlm.config import DistributedConfig

_initialized = False


def settings(cfg: DistributedConfig, env=None) -> dict | None:
    """Arguments for jax.distributed.initialize, or None for a single-process run (`env`: os.environ)."""
    env = os.environ if env is None else env
    if cfg.coordinator_address is not None:
        return {"coordinator_address": cfg.coordinator_address, "num_processes": cfg.num_processes,
                "process_id": cfg.process_id}
    if "JAXLM_COORDINATOR" in env and "JAXLM_PROCESS_ID" in env:
        return {"coordinator_address": env["JAXLM_COORDINATOR"], "num_processes": int(env["JAXLM_NUM_PROCESSES"]),
                "process_id": int(env["JAXLM_PROCESS_ID"])}
    if "JAXLM_COORDINATOR" in env and slurm_task(env):
        return {"coordinator_address": env["JAXLM_COORDINATOR"], **_slurm(env)}
    if cfg.auto:
        return _slurm(env) if slurm_task(env) else {}
    return None


def slurm_task(env) -> bool:
    """True in a task of a Slurm job step (`srun`), where SLURM_PROCID and SLURM_NTASKS number the processes."""
    return all(k in env for k in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_NTASKS"))


def _slurm(env) -> dict:
    """Process id and count of a Slurm task, and its local devices. JAX's own Slurm detection restricts each
    process to the one GPU numbered SLURM_LOCALID; with `--gpus-per-task=G` Slurm has already given each task
    its own G GPUs (CUDA_VISIBLE_DEVICES), so that would keep one of them, or one that is not there: a task with
    exactly its GPUs visible uses them all. The coordinator, when not given, is JAX's choice (the first node)."""
    out = {"num_processes": int(env["SLURM_NTASKS"]), "process_id": int(env["SLURM_PROCID"])}
    visible = [g for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
    per_task = env.get("SLURM_GPUS_PER_TASK", "").rsplit(":", 1)[-1]
    if visible and per_task.isdigit() and len(visible) == int(per_task):
        out["local_device_ids"] = list(range(len(visible)))
    return out


def describe(env=None) -> str:
    """One line per process, printed when it joins the job: its index, the coordinator, the scheduler's name for
    where it runs, and its local devices (what to check first when a multi-node job does not start)."""
    env = os.environ if env is None else env
    from jax._src import distributed as jax_distributed

    if slurm_task(env):
        where = (f"Slurm job {env['SLURM_JOB_ID']} step {env['SLURM_STEP_ID']} task {env['SLURM_PROCID']} on node "
                 f"{env.get('SLURMD_NODENAME', '?')} (restart {env.get('SLURM_RESTART_COUNT', '0')})")
    elif "JOB_COMPLETION_INDEX" in env:
        where = f"Kubernetes pod {env.get('HOSTNAME', '?')} (index {env['JOB_COMPLETION_INDEX']})"
    elif "JAXLM_LAUNCH_EVENTS" in env:
        where = "jaxlm launch"
    else:
        where = "JAX's cluster detection" if "JAXLM_COORDINATOR" not in env else "JAXLM_COORDINATOR"
    devices = jax.local_devices()
    ids = ",".join(str(d.id) for d in devices)
    return (f"process {jax.process_index()} of {jax.process_count()} ({where}): coordinator "
            f"{jax_distributed.global_state.coordinator_address}, {len(devices)} local {devices[0].platform} "
            f"device(s) [{ids}]")


def initialize(cfg: DistributedConfig) -> None:
    """Join the job once per process, before any device is touched."""
    global _initialized
    args = settings(cfg)
    if args is None or _initialized:
        return
    if os.environ.get("JAX_PLATFORMS", "") in ("", "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**args)
    _initialized = True
    print(describe(), flush=True)


# What a collective's error says when the process at the other end is gone (gloo on CPU; the coordination
# service elsewhere).
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "heartbeat",
              "task has been shut down", "Connection refused")


def lost_peer(error: BaseException, wait_s: float = 5.0) -> str | None:
    """One line for an error raised because another process of this job is gone, else None. Under `jaxlm
    launch` it names that process and how it ended (the launcher writes it within a second of noticing)."""
    if not _initialized or jax.process_count() == 1 or not isinstance(error, jax.errors.JaxRuntimeError):
        return None
    text = str(error)
    if not any(marker in text for marker in _PEER_GONE):
        return None
    events = os.environ.get("JAXLM_LAUNCH_EVENTS")
    lost = "another process of the job is gone"
    deadline = time.monotonic() + wait_s
    while events and time.monotonic() < deadline:
        if Path(events).is_file() and (line := Path(events).read_text().strip()):
            lost = line
            break
        time.sleep(0.1)
    detail = text.strip().splitlines()[0]
    return (f"process {jax.process_index()} stopped: {lost} ({detail[:160]}); rerun the same command to resume from "
            f"the last checkpoint")


def is_main() -> bool:
    """Only process 0 writes logs, metrics and progress; every process writes its checkpoint shards."""
    return jax.process_index() == 0


class Preemption:
    """SIGTERM (a scheduler's preemption notice) or SIGINT -> every process stops after the same step.

    One process: Python handlers note the signal; `reached(step)` is then True after the current step.
    Several processes: JAX's preemption service already catches SIGTERM (it installs its own handler in
    `jax.distributed.initialize`) and tells the coordinator, and `reached_preemption_sync_point(step)` turns
    True on every process at the same step, whichever process got the signal. SIGINT is passed on to it as
    a SIGTERM to this process. A second SIGINT raises KeyboardInterrupt, for a user who will not wait.
    """

    def __init__(self, enabled: bool, log: Callable[[str], None] = print):
        self.signal_name: str | None = None
        self._marked = False
        self._log = log
        self._old: dict = {}
        self._service = enabled and _initialized and jax.config.jax_enable_preemption_service
        if not enabled or threading.current_thread() is not threading.main_thread():
            return
        handlers = {signal.SIGINT: self._forward} if self._service else {signal.SIGTERM: self._note,
                                                                         signal.SIGINT: self._note}
        for sig, handler in handlers.items():
            self._old[sig] = signal.signal(sig, handler)

    def _note(self, signum, frame) -> None:
        if self.signal_name is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return  # schedulers may repeat SIGTERM; the save is already on its way
        self.signal_name = signal.Signals(signum).name
        self._log(f"received {self.signal_name}: saving a checkpoint after this step, then exiting "
                  f"(Ctrl-C again aborts without saving)")

    def _forward(self, signum, frame) -> None:
        if self.signal_name is not None:
            raise KeyboardInterrupt
        self.signal_name = "SIGINT"
        os.kill(os.getpid(), signal.SIGTERM)

    def reached(self, step: int) -> bool:
        """True on every process at the same step once any of them was asked to stop. Call it every step.
        The first time, process 0 creates the file named by JAXLM_PREEMPTED_FILE, if set: the sbatch script of
        `jaxlm launch --scheduler slurm` reads it to requeue a run that stopped for preemption, not at its end."""
        if self._service:
            from jax.experimental import multihost_utils

            stop = multihost_utils.reached_preemption_sync_point(step)
        else:
            stop = self.signal_name is not None
        if stop and not self._marked:
            self._marked = True
            if (mark := os.environ.get("JAXLM_PREEMPTED_FILE")) and jax.process_index() == 0:
                Path(mark).write_text(f"{step}\n")
        return stop

    def close(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}
