"""`jaxlm launch --processes N [--devices-per-process K] -- train ...`: start N local processes that form
one JAX job through a coordinator on 127.0.0.1. For testing multi-host code paths on one machine (with K
fake CPU devices each) and for one node with several GPUs (one process per GPU group)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

# After one process fails, the others get SIGTERM and this long to exit before they are killed.
FAILED_GRACE_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(prefix + line)
        out.flush()


def launch(command: list[str], processes: int, devices_per_process: int | None = None,
           port: int | None = None, gpus_per_process: int | None = None) -> int:
    """Run `jaxlm <command>` in `processes` processes; return the first non-zero exit status, else 0."""
    port = port or free_port()
    procs = []
    for i in range(processes):
        env = dict(os.environ, JAXLM_COORDINATOR=f"127.0.0.1:{port}", JAXLM_NUM_PROCESSES=str(processes),
                   JAXLM_PROCESS_ID=str(i), PYTHONUNBUFFERED="1")
        if devices_per_process:
            env["JAX_PLATFORMS"] = "cpu"
            flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
            env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices_per_process}"])
        if gpus_per_process:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i * gpus_per_process + g) for g in range(gpus_per_process))
        p = subprocess.Popen([sys.executable, "-m", "jaxlm.cli", *command], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=_pump, args=(p.stdout, f"[{i}] " if processes > 1 else "", sys.stdout),
                         daemon=True).start()
        procs.append(p)
    status = 0
    deadline = None

    def forward(signum, frame):
        # A preemption notice for the job: every process gets SIGTERM, which JAX's preemption service turns
        # into one agreed step to save at (SIGINT too, since a terminal's Ctrl-C may reach only this process).
        for q in procs:
            if q.poll() is None:
                q.send_signal(signal.SIGTERM)

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        remaining = list(procs)
        while remaining:
            for p in list(remaining):
                try:
                    code = p.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    continue
                remaining.remove(p)
                if code != 0 and status == 0:
                    status = code
                    for q in remaining:  # one failed process would leave the others waiting on collectives
                        q.terminate()
                    deadline = time.monotonic() + FAILED_GRACE_S
            if deadline is not None and time.monotonic() > deadline:
                for q in remaining:  # they cannot finish a collective with a dead peer
                    q.kill()
                deadline = None
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    for p in procs:
        p.wait()
    return status
