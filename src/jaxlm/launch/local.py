"""`jaxlm launch --processes N [--devices-per-process K] -- train ...`: start N local processes that form
one JAX job through a coordinator on 127.0.0.1. For testing multi-host code paths on one machine (with K
fake CPU devices each) and for one node with several GPUs (one process per GPU group)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# After one process fails, the others get this long to leave on their own (each watches the launcher's events
# file, see watch_peers) before they are killed.
FAILED_GRACE_S = 30.0
# How often a launched process looks at the events file.
WATCH_S = 0.2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(prefix + line)
        out.flush()


def how_it_ended(index: int, pid: int, code: int) -> str:
    """'process 1 (pid 4242) was killed by SIGKILL' or 'process 1 (pid 4242) exited with status 2'."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"process {index} (pid {pid}) was killed by {name}"
    return f"process {index} (pid {pid}) exited with status {code}"


_leaving = threading.Lock()


def leave(line: str) -> None:
    """Print `error: line` and end this process at once, from any thread; only the first caller prints (a
    collective that failed on the lost peer and the watcher below may both get here). Shutting down the
    distributed runtime would wait for the lost process, so nothing else runs."""
    _leaving.acquire()
    try:
        print(f"error: {line}", file=sys.stderr, flush=True)
        sys.stdout.flush()
    finally:
        os._exit(1)


def watch_peers() -> None:
    """In a process started by `jaxlm launch`: once the launcher records that another process failed, leave
    with one line naming it, whatever this process is doing (a collective that never returns, a barrier of the
    coordination service, a preemption sync point: none of them can complete without the lost process)."""
    events = os.environ.get("JAXLM_LAUNCH_EVENTS")
    if not events or int(os.environ.get("JAXLM_NUM_PROCESSES", "1")) < 2:
        return
    me = os.environ.get("JAXLM_PROCESS_ID", "?")

    def watch():
        path = Path(events)
        while True:
            time.sleep(WATCH_S)
            try:
                lost = path.read_text().strip()
            except OSError:
                continue
            if lost:
                leave(f"process {me} stopped: {lost}; rerun the same command to resume from the last checkpoint")

    threading.Thread(target=watch, name="jaxlm-watch-peers", daemon=True).start()


def launch(command: list[str], processes: int, devices_per_process: int | None = None,
           port: int | None = None, gpus_per_process: int | None = None) -> int:
    """Run `jaxlm <command>` in `processes` processes. Returns 0, or for the first process that failed its
    exit status, 128 + N for one killed by signal N (as a shell reports it); says which one and how on stderr,
    and writes it to the file named by JAXLM_LAUNCH_EVENTS in the processes' environment, where the survivors
    read it to name the process they lost (distributed.lost_peer)."""
    with tempfile.TemporaryDirectory(prefix="jaxlm-launch-") as tmp:
        return _launch(command, processes, devices_per_process, port, gpus_per_process, Path(tmp) / "events")


def _launch(command, processes, devices_per_process, port, gpus_per_process, events: Path) -> int:
    port = port or free_port()
    procs = []
    for i in range(processes):
        env = dict(os.environ, JAXLM_COORDINATOR=f"127.0.0.1:{port}", JAXLM_NUM_PROCESSES=str(processes),
                   JAXLM_PROCESS_ID=str(i), JAXLM_LAUNCH_EVENTS=str(events), PYTHONUNBUFFERED="1")
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
    status, failure = 0, None
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
                    status = 128 - code if code < 0 else code
                    failure = how_it_ended(procs.index(p), p.pid, code)
                    # The others read this and leave (watch_peers). Not SIGTERM: JAX's preemption service would
                    # catch it and wait at a sync point for the lost process.
                    tmp = events.with_suffix(".tmp")
                    tmp.write_text(failure + "\n")
                    tmp.replace(events)
                    if remaining:
                        print(f"jaxlm launch: {failure}; stopping the other processes", file=sys.stderr, flush=True)
                    deadline = time.monotonic() + FAILED_GRACE_S
            if deadline is not None and time.monotonic() > deadline:
                for q in remaining:  # still here: stuck before it could watch (or not a jaxlm process)
                    q.kill()
                deadline = None
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    for p in procs:
        p.wait()
    if failure:
        print(f"jaxlm launch: {failure}; exit status {status}. Rerun the same command to resume from the last "
              f"checkpoint", file=sys.stderr, flush=True)
    return status
