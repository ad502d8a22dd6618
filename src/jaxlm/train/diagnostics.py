"""Where a run is and what it spends its time on: periodic stack dumps of every thread, a hang watchdog,
and the profiler (an xplane trace of a window of steps, or a server for on-demand capture).

An SPMD job that hangs on one host hangs on all of them; the stack dumps (one file per process under
<run_dir>/debugging/) show which line each host is waiting in. Both helpers run in daemon threads, so
they keep working while the main thread is blocked in data loading, a collective or a checkpoint.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

import jax

from jaxlm import storage
from jaxlm.config import Config

# EX_TEMPFAIL from sysexits.h: "try again later". Schedulers and wrapper scripts can restart on it alone,
# telling a hang apart from a crash (1) or a bad config (2).
HANG_EXIT_CODE = 75


def dump_stacks() -> str:
    """Every thread's Python stack, innermost call last, with a timestamped header."""
    names = {t.ident: t.name for t in threading.enumerate()}
    now = datetime.datetime.now().isoformat(timespec="seconds")
    lines = [f"=== stack traces at {now}, process {jax.process_index()} (pid {os.getpid()}) ==="]
    for ident, frame in sys._current_frames().items():
        lines.append(f"--- thread {names.get(ident, '?')} ({ident}) ---")
        lines.extend(s.rstrip("\n") for s in traceback.format_stack(frame))
    return "\n".join(lines) + "\n"


class StackSink:
    """Where dumps go: appended to <run_dir>/debugging/stack_trace_<process>.txt, or to stderr."""

    def __init__(self, run_dir: str | Path, to_file: bool):
        self._mirror = storage.Mirror(run_dir, download=()) if to_file else None  # uploads to a URL run_dir
        self.path = (self._mirror.dir / "debugging" / f"stack_trace_{jax.process_index()}.txt") if to_file else None
        self._lock = threading.Lock()

    def write(self, text: str) -> None:
        with self._lock:
            if self.path is None:
                print(text, file=sys.stderr, flush=True)
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(text)
                f.flush()
            self._mirror.sync()


    def close(self) -> None:
        if self._mirror is not None:
            self._mirror.close()


class StackTraceCollector:
    """Dumps all stacks to `sink` every `interval` seconds until closed."""

    def __init__(self, sink: StackSink, interval: float):
        self.sink, self.interval = sink, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxlm-stack-traces", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sink.write(dump_stacks())

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class Watchdog:
    """Reports a hang when no `beat` arrives for `timeout` seconds. It arms at the first beat, so the
    first step's compilation is never mistaken for a hang; it reports once per stall, and with `exit_on_hang`
    ends the process with HANG_EXIT_CODE (the last committed checkpoint is the restart point)."""

    def __init__(self, sink: StackSink, timeout: float, exit_on_hang: bool, log: Callable[[str], None]):
        self.sink, self.timeout, self.exit_on_hang, self.log = sink, timeout, exit_on_hang, log
        self._last: tuple[int, float] | None = None
        self._reported = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxlm-hang-watchdog", daemon=True)
        self._thread.start()

    def beat(self, step: int) -> None:
        self._last, self._reported = (step, time.monotonic()), False

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            last, reported = self._last, self._reported
            if last is None or reported or time.monotonic() - last[1] < self.timeout:
                continue
            self._reported = True
            step, t = last
            self.sink.write(dump_stacks())
            where = f" (stacks in {self.sink.path})" if self.sink.path else ""
            self.log(f"hang watchdog: no step finished for {time.monotonic() - t:.0f} s after step {step} "
                     f"(diagnostics.hang_timeout_seconds={self.timeout:g}){where}")
            if self.exit_on_hang:
                self.log(f"hang watchdog: exiting with status {HANG_EXIT_CODE}; rerun to resume from the last checkpoint")
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(HANG_EXIT_CODE)  # the main thread is stuck, so only a hard exit ends the process

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class Profiler:
    """Traces steps [start + skip_steps, start + skip_steps + steps) of this process to <run_dir>/profile
    (TensorBoard's profile plugin and xprof read it), and serves on-demand capture on profiler.port."""

    def __init__(self, cfg: Config, run_dir: str | Path, start_step: int, log: Callable[[str], None]):
        p = cfg.profiler
        self.log = log
        self._mirror = storage.Mirror(run_dir, download=())  # traces of a URL run_dir are written here, then uploaded
        self.dir = self._mirror.dir / "profile"
        self.shown = storage.join(run_dir, "profile")
        self.window = None
        first = start_step + p.skip_steps
        if (p.mode == "xplane" or cfg.debug) and first < cfg.training.steps:
            self.window = (first, min(first + p.steps, cfg.training.steps))
        elif p.mode == "xplane" or cfg.debug:
            log(f"profiler: no trace, fewer than profiler.skip_steps={p.skip_steps} steps are left to run")
        self.server = p.port
        if p.port:
            jax.profiler.start_server(p.port)
            log(f"profiler server on port {p.port}: capture from TensorBoard's profile tab or xprof")

    def before(self, step: int) -> None:
        if self.window and step == self.window[0]:
            jax.profiler.start_trace(str(self.dir))

    def after(self, done: int, outputs) -> None:
        """Ends the trace once step `done` (1-based) is the window's last, after its device work finishes."""
        if self.window and done == self.window[1]:
            jax.block_until_ready(outputs)
            jax.profiler.stop_trace()
            self._mirror.sync()
            self.log(f"profiler trace of steps {self.window[0] + 1}-{done} written to {self.shown} "
                     f"(tensorboard --logdir {self.shown}, or xprof)")

    def close(self) -> None:
        if self.server:
            jax.profiler.stop_server()
        self._mirror.close()


class Monitor:
    """The stack-trace collector and the hang watchdog a config asks for, behind one beat/close pair."""

    def __init__(self, cfg: Config, run_dir: Path, log: Callable[[str], None]):
        d = cfg.diagnostics
        self.sink = sink = StackSink(run_dir, d.stack_trace_to_file)
        self.collector = StackTraceCollector(sink, d.stack_trace_interval_seconds) if d.collect_stack_trace else None
        self.watchdog = Watchdog(sink, d.hang_timeout_seconds, d.hang_exit, log) if d.hang_timeout_seconds else None

    def beat(self, step: int) -> None:
        if self.watchdog:
            self.watchdog.beat(step)

    def close(self) -> None:
        for helper in (self.collector, self.watchdog):
            if helper:
                helper.close()
        self.sink.close()
