"""Shared fixtures: 8 fake CPU devices, tiny configs and a small prepared corpus."""

import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session and the processes its tests start (the CLI's default,
# ~/.cache/jaxlm/xla, is left alone): repeated runs of the same tiny configs load instead of compiling.
_XLA_CACHE = None
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _XLA_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxlm-test-xla-cache-")

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


@pytest.fixture(scope="module")
def compilation_cache(tmp_path_factory):
    """For a module whose tests train the same tiny model again (one train() call or subprocess each): every
    call compiles its step anew, and a persistent compilation cache for the module turns those compiles into
    loads (a run: about 30 s -> 6 s on 2 cores); the executables, and so the losses, are the same."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    path = str(tmp_path_factory.mktemp("jax_cache"))
    settings = {"jax_compilation_cache_dir": path, "jax_persistent_cache_min_compile_time_secs": 0,
                "jax_persistent_cache_min_entry_size_bytes": 0}
    old = {k: getattr(jax.config, k) for k in settings}
    env = {k.upper(): str(v) for k, v in settings.items()}
    old_env = {k: os.environ.get(k) for k in env}
    for k, v in settings.items():
        jax.config.update(k, v)
    os.environ.update(env)  # for the subprocesses
    cc.reset_cache()
    yield
    for k, v in old.items():
        jax.config.update(k, v)
    for k, v in old_env.items():
        if v is None:
            os.environ.pop(k)
        else:
            os.environ[k] = v
    cc.reset_cache()


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


def pytest_sessionfinish(session, exitstatus):
    if _XLA_CACHE:
        shutil.rmtree(_XLA_CACHE, ignore_errors=True)
