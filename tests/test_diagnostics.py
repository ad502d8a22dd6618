import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import pytest

from conftest import tiny_config, xla_flags
from jaxlm import config as config_lib
from jaxlm.train import diagnostics, loop as train


def test_dump_stacks_names_a_waiting_threads_file_and_line():
    release = threading.Event()
    here = Path(__file__).resolve()

    def parked():
        release.wait()  # the line the dump must name

    line = parked.__code__.co_firstlineno + 1
    t = threading.Thread(target=parked, name="parked-worker")
    t.start()
    try:
        text = diagnostics.dump_stacks()
    finally:
        release.set()
        t.join()
    assert "--- thread parked-worker" in text
    assert f'File "{here}", line {line}, in parked' in text


def test_collector_prints_to_the_console_without_a_file(tmp_path, capsys):
    sink = diagnostics.StackSink(tmp_path, to_file=False)
    collector = diagnostics.StackTraceCollector(sink, interval=0.2)
    time.sleep(0.7)
    collector.close()
    err = capsys.readouterr().err
    assert err.count("=== stack traces at") >= 2
    assert "in test_collector_prints_to_the_console_without_a_file" in err
    assert not (tmp_path / "debugging").exists()


def test_watchdog_reports_a_stall_once_per_stall_and_names_the_step(tmp_path):
    lines = []
    sink = diagnostics.StackSink(tmp_path, to_file=True)
    dog = diagnostics.Watchdog(sink, timeout=0.4, exit_on_hang=False, log=lines.append)
    time.sleep(0.8)
    assert lines == []  # not armed before the first (compiling) step finishes
    dog.beat(7)
    time.sleep(1.6)
    assert len(lines) == 1 and "after step 7" in lines[0] and str(sink.path) in lines[0]
    dog.beat(8)
    time.sleep(1.2)
    dog.close()
    assert len(lines) == 2 and "after step 8" in lines[1]
    assert sink.path.read_text().count("=== stack traces at") == 2


HANG_SCRIPT = """
import sys, time
from pathlib import Path
from jaxlm import config as config_lib
from jaxlm.train import batches as batch_lib, loop as train

marker = Path(sys.argv[2])
original_batch = batch_lib.device_batch
calls = []

def next_that_hangs(run, split, plan):  # the 4th training batch never comes (evaluation batches pass)
    calls.append(split)
    if calls.count("train") == 4:
        marker.write_text(str(time.time()))
        time.sleep(600)  # HANG HERE
    return original_batch(run, split, plan)

batch_lib.device_batch = next_that_hangs
train.train(config_lib.load(sys.argv[1]))
"""


@pytest.mark.slow
def test_hang_is_shown_in_the_stack_trace_file_and_the_watchdog_exits(char_data, tmp_path):
    interval = 2.0
    script = tmp_path / "hang.py"
    script.write_text(HANG_SCRIPT)
    sleep_line = HANG_SCRIPT.splitlines().index("        time.sleep(600)  # HANG HERE") + 1
    run_dir = tmp_path / "run"
    cfg = tiny_config(char_data, run_dir, **{
        "checkpoint.enabled": False, "training.eval_interval": 0, "diagnostics.collect_stack_trace": True,
        "diagnostics.stack_trace_interval_seconds": interval, "diagnostics.stack_trace_to_file": True,
        "diagnostics.hang_timeout_seconds": 6, "diagnostics.hang_exit": True})
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(config_lib.to_json(cfg))
    marker = tmp_path / "sleeping"
    env = dict(os.environ, XLA_FLAGS=xla_flags(), PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, str(script), str(cfg_file), str(marker)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 300
        while not marker.exists() and time.time() < deadline and p.poll() is None:
            time.sleep(0.05)
        assert marker.exists(), p.communicate()[0]
        slept_at = float(marker.read_text() or time.time())
        trace_file = run_dir / "debugging" / "stack_trace_0.txt"
        wanted = f'File "{script}", line {sleep_line}, in next_that_hangs'
        while time.time() < slept_at + interval + 5:
            if trace_file.exists() and wanted in trace_file.read_text():
                break
            time.sleep(0.05)
        assert trace_file.exists() and wanted in trace_file.read_text(), "stack trace missing the sleeping frame"
        assert p.wait(timeout=60) == diagnostics.HANG_EXIT_CODE
    finally:
        if p.poll() is None:
            p.kill()
    out = p.stdout.read()
    assert "hang watchdog: no step finished for" in out and "after step 3" in out
    assert f"exiting with status {diagnostics.HANG_EXIT_CODE}" in out


def _fields(buf: bytes) -> list[tuple[int, object]]:
    """Decode one protobuf message into (field number, value) pairs; raises on malformed input."""
    def varint(i):
        value = shift = 0
        while True:
            b = buf[i]
            i += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return value, i

    i, out = 0, []
    while i < len(buf):
        key, i = varint(i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = varint(i)
        elif wire == 2:
            n, i = varint(i)
            value, i = buf[i:i + n], i + n
            assert i <= len(buf), "length runs past the end"
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            value, i = buf[i:i + n], i + n
        else:
            raise AssertionError(f"wire type {wire} is not valid protobuf")
        out.append((number, value))
    return out


@pytest.mark.slow
def test_profiler_writes_an_xplane_trace_that_parses(char_data, tmp_path):
    cfg = tiny_config(char_data, tmp_path / "run", **{"profiler": "xplane", "profiler.skip_steps": 1,
                                                       "profiler.steps": 2, "training.steps": 4, "optimizer.warmup_steps": 1,
                                                       "checkpoint.enabled": False, "training.eval_interval": 0})
    assert cfg.profiler.mode == "xplane"
    logged = []
    train.train(cfg, devices=jax.devices()[:1], log=logged.append)
    assert any("profiler trace of steps 2-3 written to" in line for line in logged)
    (pb,) = (tmp_path / "run" / "profile").glob("plugins/profile/*/*.xplane.pb")
    data = pb.read_bytes()
    assert len(data) > 1000
    # XSpace: field 1 = planes (XPlane: field 2 = name, field 4 = event metadata map, whose values'
    # field 2 is the event name).
    planes = {}
    for number, plane in _fields(data):
        if number == 1:
            f = _fields(plane)
            name = next(v for n, v in f if n == 2).decode()
            planes[name] = {m.decode(errors="replace") for n, entry in f if n == 4
                            for k, meta in _fields(entry) if k == 2 for kk, m in _fields(meta) if kk == 2}
    assert "/host:CPU" in planes
    assert "train" in planes["/host:CPU"]  # the per-step annotation the profile's step view uses
    assert any("step_fn" in name for name in planes["/host:CPU"])


def test_debug_is_a_shortcut_for_an_xplane_window(tmp_path):
    cfg = config_lib.apply_overrides(config_lib.Config(), {"debug": "true", "training.steps": "100"})
    p = diagnostics.Profiler(cfg, tmp_path, start_step=40, log=lambda s: None)
    assert p.window == (43, 48)
    cfg = config_lib.apply_overrides(cfg, {"debug": "false", "profiler": "none"})
    assert diagnostics.Profiler(cfg, tmp_path, start_step=40, log=lambda s: None).window is None


@pytest.mark.parametrize("overrides, message", [
    ({"diagnostics.hang_exit": "true"}, "diagnostics.hang_exit=true needs diagnostics.hang_timeout_seconds > 0"),
    ({"diagnostics.stack_trace_interval_seconds": "0"}, "diagnostics.stack_trace_interval_seconds=0.0 must be > 0"),
    ({"profiler": "xplane", "training.steps": "3", "optimizer.warmup_steps": "0"}, "profiler.skip_steps=3 leaves no step to trace in training.steps=3"),
    ({"profiler.port": "70000"}, "profiler.port=70000 must be a TCP port"),
    ({"profiler": "xplain"}, "profiler.mode='xplain' is not allowed (did you mean 'xplane'?)"),
])
def test_bad_diagnostics_settings_fail_with_one_line(overrides, message):
    with pytest.raises(config_lib.ConfigError, match=re.escape(message)) as e:
        config_lib.validate(config_lib.apply_overrides(config_lib.Config(), overrides))
    assert "\n" not in str(e.value)
