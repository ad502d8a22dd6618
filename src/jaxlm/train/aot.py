"""Ahead-of-time compilation: the train step compiled for a target (a TPU slice, fake CPU devices, or a GPU
host's devices) from abstract shapes, its memory per device against the target's HBM, a search for the
largest batch that fits, and saved steps that `jaxlm train ... compile.load=FILE` runs without compiling.

Flow: compile.topology -> the target's devices (compile-only TPU devices from libtpu's topology
description need no TPU) -> run.setup on them (mesh, shardings, abstract state; nothing allocated)
-> step.lower_train_step, the very lowering `jaxlm train` jits -> compile -> memory report -> saved file.
A saved step's format and loading are in saved_step.py, which `train` reads without this module. A step to save
is always compiled in the saving process, never read back from JAX's persistent compilation cache (docs/aot.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import pickle
import re
import time
from pathlib import Path
from typing import Callable

import jax
from jax.experimental import serialize_executable

from jaxlm.train import advisor, preflight, run as run_lib, saved_step, step as step_lib
from jaxlm.model import attention
from jaxlm.model.loss import describe_loss
from jaxlm.config import MESH_AXES, CompileConfig, Config, ConfigError
from jaxlm.launch.topology import TPU_GENERATIONS, slice_grid

GiB = 2**30

# GPU targets: name -> (device kind substring, GPUs per host).
GPU_TARGETS = {"a3": ("H100", 8)}
# HBM per device from the vendors' spec sheets, GiB: (substrings the device kind must all contain, GiB).
# First match wins, so "TPU v5 lite" (v5e) precedes "TPU v5" (v5p) and the 80 GB A100 precedes the 40 GB one.
HBM_GIB = [
    (("TPU v6 lite",), 32),
    (("TPU v5 lite",), 16),
    (("TPU v5",), 95),
    (("TPU v4",), 32),
    (("H200",), 141),
    (("H100",), 80),
    (("A100", "80GB"), 80),
    (("A100",), 40),
]
KNOWN = "v4-8, v5e-16, v5e-256, v5p-128, v6e-256 (TPU slices; or GEN:AxB[xC] such as v5p:4x4x12), cpu-N, a3"


@dataclasses.dataclass(frozen=True)
class Target:
    """What the step is compiled for: its devices (compile-only for TPU topologies) and memory budget."""

    name: str
    devices: tuple
    num_slices: int
    hbm_bytes: int
    hbm_source: str

    @property
    def platform(self) -> str:
        return self.devices[0].platform

    @property
    def device_kind(self) -> str:
        return self.devices[0].device_kind


def prepare_process(c: CompileConfig) -> None:
    """Settings that must be in place before JAX starts its backends (the `jaxlm compile` command calls this
    first): N host devices for cpu-N, N mocked hosts for a GPU target. A TPU topology needs no TPU here, so
    this process keeps to its CPU unless told otherwise."""
    name = c.topology.strip().lower()
    if name in GPU_TARGETS:
        if c.num_slices > 1:
            jax.config.update("mock_num_gpu_processes", c.num_slices)
        return
    if m := re.fullmatch(r"cpu-(\d+)", name):
        flags = os.environ.get("XLA_FLAGS", "")  # read when the CPU backend starts
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={m[1]}".strip()
    if name and "JAX_PLATFORMS" not in os.environ:  # JAX read the variable on import; set its config instead
        jax.config.update("jax_platforms", "cpu")


def _unknown_topology(name: str) -> ConfigError:
    return ConfigError(f"compile.topology={name!r} is not a known target; use {KNOWN}")


def tpu_topology(name: str, num_slices: int) -> tuple:
    """Compile-only devices of `num_slices` TPU slices named like v5e-256 or v5e:16x16."""
    if m := re.fullmatch(r"(v\d+[a-z]?)-(\d+)", name):
        gen, count = m[1], int(m[2])
        if gen not in TPU_GENERATIONS:
            raise _unknown_topology(name)
        topo_gen, chip_config, rank, cores = TPU_GENERATIONS[gen]
        try:
            grid = slice_grid(gen, count)
        except ValueError:
            raise ConfigError(f"compile.topology={name!r}: {gen} slices with a power-of-two chip grid are "
                              f"named like {gen}-{8 * cores if rank == 3 else 16}; give other shapes as "
                              f"{gen}:{'4x4x12' if rank == 3 else '4x8'}") from None
    elif m := re.fullmatch(r"(v\d+[a-z]?):(\d+(?:x\d+)+)", name):
        gen = m[1]
        if gen not in TPU_GENERATIONS:
            raise _unknown_topology(name)
        topo_gen, chip_config, rank, _ = TPU_GENERATIONS[gen]
        grid = tuple(int(d) for d in m[2].split("x"))
        if len(grid) != rank or 0 in grid:
            raise ConfigError(f"compile.topology={name!r}: a {gen} chip grid has {rank} dimensions")
    else:
        raise _unknown_topology(name)
    if importlib.util.find_spec("libtpu") is None:
        raise ConfigError(f"compile.topology={name} needs libtpu for TPU topologies: pip install 'jaxlm[tpu]' "
                          "(works on a CPU-only host)")
    # Slices of 4x4x4 chips and up (v4, v5p) and 16-chip rows (v5e, v6e) close into a torus.
    wrap = (all(d >= 4 for d in grid),) * 3 if rank == 3 else tuple(d == 16 for d in grid) + (False,)
    host_bounds = (min(grid[0], 2), min(grid[1], 2), 1)
    # The lockfile keeps two processes off the same TPU chips; compile-only devices use no chip.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(topology_name=f"{topo_gen}:{'x'.join(map(str, grid))}", platform="tpu",
                                            chip_config_name=chip_config, chips_per_host_bounds=host_bounds,
                                            num_slices=num_slices, wrap=wrap)
    except jax.errors.JaxRuntimeError as e:
        raise ConfigError(f"compile.topology={name}: libtpu cannot describe it ({str(e).splitlines()[0]})") from None
    return tuple(topo.devices)


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def hbm_gib(device_kind: str) -> float | None:
    for needles, gib in HBM_GIB:
        if all(n.lower() in device_kind.lower() for n in needles):
            return gib
    return None


def target(c: CompileConfig) -> Target:
    """Resolve compile.topology and compile.num_slices to devices and a memory budget per device."""
    name = c.topology.strip().lower()
    if not name:
        raise ConfigError(f"compile.topology is not set; choose one of: {KNOWN}")
    if m := re.fullmatch(r"cpu-(\d+)", name):
        n = int(m[1])
        if c.num_slices != 1:
            raise ConfigError(f"compile.num_slices={c.num_slices}: cpu-N targets are one host; "
                              f"use cpu-{n * c.num_slices}")
        cpus = jax.devices("cpu")
        if n < 1 or len(cpus) < n:
            raise ConfigError(f"compile.topology={name} needs {n} CPU devices and this process has {len(cpus)}: set "
                              f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before JAX starts "
                              "(`jaxlm compile` does)")
        devices = tuple(cpus[:n])
        hbm, source = host_memory_bytes() // n, f"host memory / {n} devices"
    elif name in GPU_TARGETS:
        kind, per_host = GPU_TARGETS[name]
        try:
            gpus = jax.devices("gpu")
        except RuntimeError:
            gpus = []
        if not gpus or kind.lower() not in gpus[0].device_kind.lower():
            have = gpus[0].device_kind if gpus else "no GPU"
            raise ConfigError(f"compile.topology={name} ({per_host} x {kind} per host) compiles on a host with "
                              f"those GPUs; this one has {have}")
        if len(gpus) != per_host * c.num_slices:
            raise ConfigError(f"compile.topology={name} compile.num_slices={c.num_slices} needs "
                              f"{per_host * c.num_slices} GPUs and this process sees {len(gpus)}: run `jaxlm compile`, "
                              "which mocks the other hosts before JAX starts")
        devices = tuple(gpus)
        hbm, source = None, None
    else:
        devices = tpu_topology(name, c.num_slices)
        hbm, source = None, None
    if c.hbm_gib is not None:
        hbm, source = int(c.hbm_gib * GiB), "compile.hbm_gib"
    elif hbm is None:
        gib = hbm_gib(devices[0].device_kind)
        if gib is None:
            raise ConfigError(f"no HBM figure for {devices[0].device_kind} devices; set compile.hbm_gib")
        hbm, source = int(gib * GiB), f"{devices[0].device_kind} HBM"
    return Target(name, devices, c.num_slices, hbm, source)


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per device from compiled.memory_analysis(). The total a step needs is its arguments (train
    state and batch), outputs, temporaries and generated code, less the outputs written in place of
    donated arguments (aliased), which would otherwise be counted twice."""

    arguments: int
    outputs: int
    temporaries: int
    generated_code: int
    aliased: int
    host: int = 0  # bytes in host memory (activations a remat policy offloads), not counted in `total`
    peak: int = 0  # the compiler's heap simulation (peak_memory_in_bytes), host memory included

    @property
    def total(self) -> int:
        return self.arguments + self.outputs + self.temporaries + self.generated_code - self.aliased


@dataclasses.dataclass
class Result:
    """One compile for a target: the executable, or the compiler's out-of-memory message when it refused."""

    run: run_lib.Run
    target: Target
    seconds: float
    executable: jax.stages.Compiled | None
    memory: Memory | None
    argument_bytes: int  # per device, counted from the abstract arguments' shardings
    oom: str | None = None
    oom_bytes: int | None = None  # what the compiler said the step needs, when it said so

    @property
    def bytes_per_device(self) -> int:
        if self.memory is not None:
            return self.memory.total
        return max(self.oom_bytes or 0, self.argument_bytes)

    @property
    def fits(self) -> bool:
        """The sum of memory_analysis()'s figures is an upper bound: XLA:TPU reuses donated arguments and dead
        buffers, and refuses a step that does not fit its chip. So on TPU a step the compiler accepts fits when
        its temporaries and code alone do (they cannot share memory with the live train state's arguments);
        other backends, and a budget set by compile.hbm_gib, are checked against the sum."""
        if self.executable is None:
            return False
        if self.bytes_per_device <= self.target.hbm_bytes:
            return True
        return (self.target.platform == "tpu" and self.target.hbm_source != "compile.hbm_gib"
                and self.memory.temporaries + self.memory.generated_code <= self.target.hbm_bytes)


def _shard_bytes(a: jax.ShapeDtypeStruct) -> int:
    return math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize


def argument_shares(run: run_lib.Run) -> dict[str, int]:
    """Bytes per device of the step's arguments by kind: the frozen base of a LoRA run, the trained weights,
    the optimizer state (with the step counters) and the batch."""
    args = step_lib.step_args(run)
    size = lambda tree: sum(_shard_bytes(a) for a in jax.tree.leaves(tree))  # noqa: E731
    state, batch = args["state"], dict(args["batch"])
    images = batch.pop("images", None)
    params = dict(state["params"])
    tower = params.pop("vision", None)  # a LoRA run's tower rides in its frozen base
    out = {"base weights (frozen)": size(args.get("frozen")),
           "trained weights" if run.abstract_frozen is None else "adapters": size(params),
           "vision tower" + (" (frozen)" if run_lib.vision_frozen(run.cfg) else ""): size(tower),
           "optimizer state": size({k: v for k, v in state.items() if k != "params"}), "batch": size(batch),
           "images": size(images)}
    return {k: v for k, v in out.items() if v}


oom_bytes = preflight.oom_need  # what an out-of-memory compile error says the step needs


def compile_for(cfg: Config, tgt: Target) -> Result:
    """Lower the train step for the target's devices exactly as `train` does and compile it."""
    if tgt.num_slices > 1 and all(getattr(cfg.mesh, f"dcn_{a}") == 1 for a in MESH_AXES):
        raise ConfigError(f"compile.num_slices={tgt.num_slices}: set the mesh axes that span the slices, e.g. "
                          f"mesh.dcn_data={tgt.num_slices} (or mesh.dcn_fsdp)")
    run = run_lib.setup(cfg, list(tgt.devices), data=False)
    argument_bytes = sum(_shard_bytes(a) for a in jax.tree.leaves(step_lib.step_args(run)))
    start = time.perf_counter()
    lowered = step_lib.lower_train_step(run)
    try:
        executable = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        message = str(e).strip().splitlines()[0]
        return Result(run, tgt, time.perf_counter() - start, None, None, argument_bytes, message,
                      oom_bytes(message, argument_bytes))
    seconds = time.perf_counter() - start
    m = executable.memory_analysis()
    host = sum(getattr(m, f"host_{k}_size_in_bytes", 0) for k in ("argument", "output", "temp", "generated_code"))
    memory = Memory(m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes,
                    m.generated_code_size_in_bytes, m.alias_size_in_bytes,
                    host - getattr(m, "host_alias_size_in_bytes", 0), getattr(m, "peak_memory_in_bytes", 0))
    return Result(run, tgt, seconds, executable, memory, argument_bytes)


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / 2**20:.2f} MiB"


def remedies(run: run_lib.Run, tgt: Target) -> list[str]:
    """Settings that lower a step's memory per device, from what this run uses (preflight.remedies)."""
    return preflight.remedies(run, run.mesh.devices.size // tgt.num_slices)


def _images(run: run_lib.Run) -> str:
    """The images a step's rows carry, for the report ('' for none)."""
    if not run.image_slots:
        return ""
    v, shape, n = run.cfg.model.vision, run.image_shape, run.image_slots
    images, tower = f"{n} image{'s' if n > 1 else ''}", f"tower of {v.n_layers} layers, width {v.d_model}"
    if isinstance(shape, dict) and "patches" in shape:  # Qwen-VL: each image at its own grid within a budget
        return f", {images} per row (each at its own grid, at most {shape['patches'][0] // v.spatial_merge ** 2} " \
               f"soft tokens; {tower})"
    if isinstance(shape, dict):  # Llama 4: each image's tiles, padded
        K, S = shape["tiles"][0], shape["tiles"][1]
        return f", {images} per row (up to {K} tile{'s' if K > 1 else ''} of {S}x{S} each, {v.tokens_per_image} tokens a tile; {tower})"
    return f", {images} of {v.image_size}x{v.image_size} per row ({v.tokens_per_image} tokens each; {tower})"


def report(r: Result) -> list[str]:
    """The memory report, one figure a line, ending with the verdict (machine_lines follow it)."""
    run, tgt = r.run, r.target
    t, m_cfg = run.cfg.training, run.cfg.model
    shape = {k: v for k, v in run.mesh.shape.items() if v > 1} or {"data": 1}
    slices = f", {tgt.num_slices} slices" if tgt.num_slices > 1 else ""
    lines = [f"train step for {tgt.name} ({len(tgt.devices)} x {tgt.device_kind}{slices}): "
             f"lowered and compiled in {r.seconds:.1f} s",
             f"mesh {shape} | batch {t.batch_size} sequences ({t.per_device_batch_size:g} per device) x "
             f"{t.grad_accum} accumulation x {m_cfg.block_size} tokens{_images(run)} | remat {m_cfg.remat} | "
             + (attention.describe_with_images(m_cfg, tgt.platform)
                if run.image_slots and m_cfg.vision.kind == "siglip"  # Gemma 3's image tokens see their image whole
                else attention.describe(m_cfg, tgt.platform, mesh=run.mesh, rules=run.act_rules))
             + describe_loss(m_cfg)]
    if r.memory is not None:
        mem = r.memory
        shares = argument_shares(run)
        lines += ["memory per device (compiled.memory_analysis()):",
                  f"  arguments       {_gib(mem.arguments):>12}   train state and batch: "
                  + ", ".join(f"{name} {_gib(n)}" for name, n in shares.items()),
                  f"  outputs         {_gib(mem.outputs):>12}   new train state and metrics",
                  f"  temporaries     {_gib(mem.temporaries):>12}   activations, gradients, scratch "
                  f"({100 * mem.temporaries / max(mem.total, 1):.0f}% of the total)",
                  f"  generated code  {_gib(mem.generated_code):>12}",
                  f"  aliased         {_gib(-mem.aliased):>12}   outputs written over donated arguments",
                  f"  total           {_gib(mem.total):>12}   of {_gib(tgt.hbm_bytes)} ({tgt.hbm_source}); an upper "
                  "bound: the compiler also reuses buffers",
                  f"  host memory     {_gib(mem.host):>12}   offloaded activations (model.remat=offload_*), "
                  "not in the total"] + ([
                  f"  peak            {_gib(mem.peak):>12}   the compiler's heap simulation, host memory included "
                  "(on a v5e the same figure as the chip's own compile)"] if mem.peak else [])
    else:
        lines += [f"the compiler ran out of memory: {r.oom}",
                  f"  arguments       {_gib(r.argument_bytes):>12}   train state and batch (from their shardings): "
                  + ", ".join(f"{name} {_gib(n)}" for name, n in argument_shares(run).items()),
                  f"  total, about   {_gib(r.bytes_per_device):>12}   "
                  + ("no figure from the compiler: the arguments alone" if r.oom_bytes is None else
                     "the compiler's total" if "Used " in r.oom else "arguments + the compiler's temporaries")]
    if r.fits and r.bytes_per_device > tgt.hbm_bytes:
        lines.append(f"fits: XLA:TPU accepted the step, whose temporaries and code take "
                     f"{_gib(r.memory.temporaries + r.memory.generated_code)} of {_gib(tgt.hbm_bytes)} (the total "
                     "above counts buffers the compiler reuses)")
    elif r.fits:
        lines.append(f"fits: {_gib(tgt.hbm_bytes - r.bytes_per_device)} of {_gib(tgt.hbm_bytes)} free per device")
    else:
        over = r.bytes_per_device - tgt.hbm_bytes
        about = "" if r.memory is not None else "about "
        need = (f"needs {about}{_gib(r.bytes_per_device)} per device, {_gib(over)} over"
                if over > 0 else "needs more than")
        fixes = remedies(run, tgt)
        if r.argument_bytes > tgt.hbm_bytes:  # no batch or remat setting helps while the state alone is too big
            fixes.insert(0, f"more devices (a larger topology or compile.num_slices): the train state alone is "
                            f"{_gib(r.argument_bytes)} per device"
                            + (", or model.param_dtype=bfloat16" if m_cfg.param_dtype == "float32" else ""))
        lines.append(f"does not fit: {need} the {_gib(tgt.hbm_bytes)} of {tgt.hbm_source}; reduce it with "
                     + "; ".join(fixes or ["more devices"]))
    return lines


def machine_lines(r: Result) -> list[str]:
    return [f"bytes_per_device={r.bytes_per_device}", f"hbm_bytes={r.target.hbm_bytes}",
            f"fits={'true' if r.fits else 'false'}"]


def find_batch_size(cfg: Config, tgt: Target, log: Callable[[str], None] = print) -> tuple[Result | None, list]:
    """The largest whole per_device_batch_size (up to compile.max_batch_size) whose step fits: double from 1
    until a candidate does not fit, then bisect between the last that fits and the first that does not.
    Returns (the best compile, or None when even 1 does not fit; every compile tried, in order)."""
    tried: list[Result] = []

    def fits(b: int) -> bool:
        r = compile_for(cfg.replace(training=dataclasses.replace(cfg.training, per_device_batch_size=float(b))), tgt)
        tried.append(r)
        log(f"  {b:>21}  {r.run.cfg.training.batch_size:>12}  {_gib(r.bytes_per_device):>16}  "
            f"{'yes' if r.fits else 'no':>4}  {r.seconds:>9.1f}")
        return r.fits

    log(f"largest per_device_batch_size that fits {_gib(tgt.hbm_bytes)} ({tgt.hbm_source}):")
    log("  per_device_batch_size  global_batch  bytes_per_device  fits  compile_s")
    top = cfg.compile.max_batch_size
    lo, hi, b = 0, None, 1  # lo fits (0: none yet), hi does not
    while hi is None and lo < top:
        if fits(b):
            lo, b = b, min(2 * b, top)
        else:
            hi = b
    while hi is not None and lo and hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    best = next((r for r in tried if r.fits and r.run.cfg.training.per_device_batch_size == lo), None)
    return best, tried


# --- saved steps ------------------------------------------------------------------------------------------


def signature(run: run_lib.Run, topology: str = "", num_slices: int = 1) -> dict:
    """What a step compiled for this run is compiled for (saved_step.signature)."""
    return saved_step.signature(run.cfg, run.mesh, step_lib.step_args(run), topology, num_slices)


@contextlib.contextmanager
def persistent_cache_off():
    """JAX's persistent compilation cache off in this process while the block runs: what it compiles is
    compiled here, not read back from the cache, and so can be serialized whole (see the module docstring)."""
    from jax.experimental.compilation_cache import compilation_cache

    was = jax.config.jax_enable_compilation_cache
    if _persistent_cache_on():  # executables read from the cache may sit in JAX's in-memory caches: drop them
        jax.clear_caches()
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # JAX decides once whether to use the cache (on its next compile): again
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        compilation_cache.reset_cache()


def _persistent_cache_on() -> bool:
    return bool(jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir)


def save(path: str | Path, r: Result) -> Path:
    """Write the compiled step and its signature, atomically (a reader never sees half a file). A step
    compiled while the persistent compilation cache was on may have been read back from it and is compiled
    again without the cache first; `compile_command` compiles with the cache off when it saves."""
    executable = r.executable
    if _persistent_cache_on():
        with persistent_cache_off():
            executable = step_lib.lower_train_step(r.run).compile()
    payload, in_tree, out_tree = serialize_executable.serialize(executable)
    sig = signature(r.run, r.target.name, r.target.num_slices)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(saved_step.HEADER)
        f.write(json.dumps(sig).encode() + b"\n")
        pickle.dump((payload, in_tree, out_tree), f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)
    return path


def compile_command(cfg: Config, log: Callable[[str], None] = print) -> dict:
    """`jaxlm compile`: compile (or search the batch size) for compile.topology, print the report, save the
    step to compile.output when it fits. Returns a summary. A step to be saved is compiled with the persistent
    compilation cache off, so that it is compiled here and save() need not compile it again."""
    with persistent_cache_off() if cfg.compile.output else contextlib.nullcontext():
        return _compile_and_report(cfg, log)


def _compile_and_report(cfg: Config, log: Callable[[str], None]) -> dict:
    tgt = target(cfg.compile)
    tried = []
    if cfg.compile.find_batch_size:
        best, tried = find_batch_size(cfg, tgt, log)
        r = best or tried[0]
    else:
        r = compile_for(cfg, tgt)
    lines = report(r)
    if not r.fits:
        lines[-1:-1] = advisor.advise(r, compile_for, target, log)
    for line in lines[:-1]:
        log(line)
    saved = None
    if cfg.compile.output:
        if r.fits:
            saved = save(cfg.compile.output, r)
            log(f"saved the compiled step to {saved} ({saved.stat().st_size / 2**20:.1f} MiB); train with "
                f"compile.load={saved}")
        else:
            log(f"not saved to {cfg.compile.output}: the step does not fit")
    log(lines[-1])
    if cfg.compile.find_batch_size:
        log(f"per_device_batch_size={r.run.cfg.training.per_device_batch_size:g}" if r.fits else
            "per_device_batch_size=none")
    for line in machine_lines(r):
        log(line)
    return {"fits": r.fits, "bytes_per_device": r.bytes_per_device, "hbm_bytes": tgt.hbm_bytes,
            "compile_seconds": r.seconds, "per_device_batch_size": r.run.cfg.training.per_device_batch_size,
            "tried": [(x.run.cfg.training.per_device_batch_size, x.bytes_per_device, x.fits) for x in tried],
            "output": str(saved) if saved else None}
