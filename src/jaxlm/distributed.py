"""Multi-process runs through JAX's own distributed runtime (`jax.distributed`), and preemption notices
(SIGTERM/SIGINT) turned into one step at which every process stops.

A run is multi-process when `distributed.coordinator_address` is set, when `jaxlm launch` exported
JAXLM_COORDINATOR / JAXLM_NUM_PROCESSES / JAXLM_PROCESS_ID, or when `distributed.auto=true` lets JAX
detect the cluster (TPU pods, Slurm, Open MPI, Kubernetes). CPU processes exchange data through gloo.
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


def settings(cfg: DistributedConfig) -> dict | None:
    """Arguments for jax.distributed.initialize, or None for a single-process run."""
    if cfg.coordinator_address is not None:
        return {"coordinator_address": cfg.coordinator_address, "num_processes": cfg.num_processes,
                "process_id": cfg.process_id}
    if "JAXLM_COORDINATOR" in os.environ:
        return {"coordinator_address": os.environ["JAXLM_COORDINATOR"],
                "num_processes": int(os.environ["JAXLM_NUM_PROCESSES"]),
                "process_id": int(os.environ["JAXLM_PROCESS_ID"])}
    if cfg.auto:
        return {}
    return None


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
        """True on every process at the same step once any of them was asked to stop. Call it every step."""
        if self._service:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self.signal_name is not None

    def close(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}
