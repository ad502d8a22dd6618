"""Shared fixtures: 8 fake CPU devices, tiny configs and a small prepared corpus."""

import os
import shutil
import tempfile

# The tests compile hundreds of tiny programs and run each for a few steps: LLVM's optimizations cost more there
# than they save (tests/test_model.py: 94 s with XLA's default, 56 s without). Every program of the suite, in this
# process and in the processes its tests start (`xla_flags`), is compiled this way, so results that tests compare
# bit for bit come from the same code. Runs outside the tests keep XLA's default.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a process a test starts: the suite's flags, with `devices` fake CPU devices if given
    (else one; `jaxlm launch` adds its own count)."""
    count = f" --xla_force_host_platform_device_count={devices}" if devices else ""
    return TEST_XLA_FLAGS + count


os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {xla_flags(8)}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session and the processes its tests start (the CLI's default,
# ~/.cache/jaxlm/xla, is left alone): repeated runs of the same tiny configs load instead of compiling.
# Every program is cached, however quick its compile: most tests train the same tiny models again (in this
# process or in the ones they start), and a load is faster than any compile; the executables, and so the
# losses, are the same.
_XLA_CACHE = None
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _XLA_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxlm-test-xla-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from jaxlm import config as config_lib  # noqa: E402
from jaxlm.data import prepare  # noqa: E402

SHAKESPEARE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tinyshakespeare" / "input.txt"


@pytest.fixture(scope="session")
def shakespeare_file() -> Path:
    if not SHAKESPEARE.is_file():
        pytest.skip(f"{SHAKESPEARE} not found")
    return SHAKESPEARE


@pytest.fixture(scope="session")
def char_data(tmp_path_factory, shakespeare_file) -> Path:
    out = tmp_path_factory.mktemp("shakespeare_char")
    prepare.prepare_shakespeare_char(out, shakespeare_file)
    return out


def tiny_config(data_dir: Path, run_dir: Path | None = None, **overrides) -> config_lib.Config:
    base = {
        "model.block_size": 32, "model.n_layers": 2, "model.n_heads": 4, "model.d_model": 32,
        "training.steps": 20, "training.batch_size": 8, "training.eval_interval": 10, "training.eval_batches": 2,
        "training.log_interval": 5, "training.sample_tokens": 0, "optimizer.warmup_steps": 5,
        "checkpoint.interval": 10, "logging.progress": False, "logging.tensorboard": False,
        "data.dir": str(data_dir), "run_dir": str(run_dir) if run_dir else None,
    }
    base.update(overrides)
    cfg = config_lib.apply_overrides(config_lib.Config(), base)
    config_lib.validate(cfg)
    return cfg


# Modules that hold the longest tests (two-process runs, an S3 server) run first, so that with two workers
# (`make test`) the long ones do not start last while the other worker has nothing left to do.
FIRST = ("test_sharding", "test_storage")


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: 0 if item.module.__name__ in FIRST else 1)  # stable: modules stay in order


def pytest_sessionfinish(session, exitstatus):
    if _XLA_CACHE:
        shutil.rmtree(_XLA_CACHE, ignore_errors=True)
