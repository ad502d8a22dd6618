"""Device meshes and the logical-axis rules that place weights and activations on them.

Model code names logical axes only (`batch`, `length`, `embed`, `heads`, ...). The tables below map each
logical axis to zero or more mesh axes; data, FSDP, tensor, sequence and expert parallelism are all edits
of these tables (or of `mesh.rules`), never of model code.

The mesh has the axes of `config.MESH_AXES`. Each axis has an ICI size (devices within a slice or host,
connected by the fast interconnect) and a DCN size (slices or hosts, across the data-center network);
the device grid is built with DCN outer and ICI inner so that collectives on an axis stay on ICI where
they can.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import NamedTuple, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxlm.config import MESH_AXES, ConfigError, MeshConfig

Rules = dict[str, tuple[str, ...]]

# Weights. FSDP (and the sequence axis, whose devices also hold different data) shard the model width;
# tensor parallelism splits heads, MLP width and vocabulary (Megatron-style); experts and stacked layers
# have axes of their own.
PARAM_RULES: Rules = {
    "embed": ("fsdp", "sequence"),
    "q_lora": ("fsdp", "sequence"),  # latent attention's query and key/value latents (model/latent.py)
    "kv_lora": ("fsdp", "sequence"),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "experts": ("expert",),
    "layers": ("stage",),
}
# Activations. The batch is split over every data-like axis, the length over the sequence axis, and the
# tensor-parallel dimensions as their weights are.
ACTIVATION_RULES: Rules = {
    "batch": ("data", "fsdp", "expert"),
    "length": ("sequence",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "stages": ("stage",),
}


def rules_from_config(cfg: MeshConfig) -> tuple[Rules, Rules]:
    """The default tables with `mesh.rules` applied ('param.embed=fsdp+sequence;act.length=')."""
    param, act = dict(PARAM_RULES), dict(ACTIVATION_RULES)
    for entry in filter(None, (e.strip() for e in cfg.rules.replace(",", ";").split(";"))):
        key, sep, value = entry.partition("=")
        kind, dot, logical = key.strip().partition(".")
        if not sep or not dot or kind not in ("param", "act") or not logical:
            raise ConfigError(f"mesh.rules entry {entry!r} must look like 'param.embed=fsdp+sequence' or 'act.length='")
        axes = tuple(a.strip() for a in value.split("+") if a.strip())
        bad = [a for a in axes if a not in MESH_AXES]
        if bad:
            raise ConfigError(f"mesh.rules entry {entry!r}: unknown mesh axis {bad[0]!r}; mesh axes: {', '.join(MESH_AXES)}")
        (param if kind == "param" else act)[logical] = axes
    return param, act


def _resolve(sizes: dict[str, int], total: int, level: str) -> dict[str, int]:
    known = math.prod(v for v in sizes.values() if v != -1)
    fill = [k for k, v in sizes.items() if v == -1]
    if fill:
        if total % known:
            raise ConfigError(f"mesh: the fixed {level} axes ({_fmt(sizes, level)}) multiply to {known}, which does "
                              f"not divide the {total} devices available at that level")
        sizes[fill[0]] = total // known
    if math.prod(sizes.values()) != total:
        raise ConfigError(f"mesh: {_fmt(sizes, level)} multiply to {math.prod(sizes.values())} devices but "
                          f"{total} are available; set mesh.{level}_* so that the product is {total}")
    return sizes


def _fmt(sizes: dict[str, int], level: str) -> str:
    shown = {k: v for k, v in sizes.items() if v != 1} or {"data": 1}
    return " x ".join(f"mesh.{level}_{k}={v}" for k, v in shown.items())


def mesh_shape(cfg: MeshConfig, n_devices: int, devices: Sequence[jax.Device] | None = None
               ) -> tuple[dict[str, int], dict[str, int]]:
    """(ici sizes, dcn sizes) with -1 resolved; the DCN level is sized first, ICI fills each slice. A dcn
    axis of -1 fills the slices of `devices` (default: this job's devices)."""
    dcn = {a: getattr(cfg, f"dcn_{a}") for a in MESH_AXES}
    ici = {a: getattr(cfg, f"ici_{a}") for a in MESH_AXES}
    n_dcn = math.prod(v for v in dcn.values() if v != -1)
    if -1 in dcn.values():
        n_slices = _slice_count(devices if devices is not None else jax.devices())
        dcn = _resolve(dcn, n_slices, "dcn")
        n_dcn = n_slices
    if n_devices % n_dcn:
        raise ConfigError(f"mesh: the dcn axes multiply to {n_dcn}, which does not divide the {n_devices} devices")
    return _resolve(ici, n_devices // n_dcn, "ici"), dcn


def _slice_count(devices: Sequence[jax.Device]) -> int:
    # The devices may be another machine's (an ahead-of-time compile for a TPU topology), so count their slices.
    slices = {getattr(d, "slice_index", 0) for d in devices}
    return len(slices) if len(slices) > 1 else jax.process_count()


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    ici, dcn = mesh_shape(cfg, len(devices), devices)
    ici_shape = tuple(ici[a] for a in MESH_AXES)
    dcn_shape = tuple(dcn[a] for a in MESH_AXES)
    if math.prod(dcn_shape) > 1:
        # Slices on TPU; elsewhere each process is one granule (a host's GPUs, or a CPU process).
        granule_is_process = len({getattr(d, "slice_index", 0) for d in devices}) == 1
        grid = mesh_utils.create_hybrid_device_mesh(ici_shape, dcn_shape, devices,
                                                    process_is_granule=granule_is_process)
    else:
        try:
            grid = mesh_utils.create_device_mesh(ici_shape, devices)
        except (AssertionError, NotImplementedError, ValueError):
            # No physical layout is known for these devices (CPU, a device subset, shapes the TPU mesh helper
            # does not map): take them in order, which is what the ring of fake or host devices is.
            grid = np.array(devices).reshape(ici_shape)
    return Mesh(grid, MESH_AXES)


def spec(axes: Sequence[str | None], rules: Rules) -> PartitionSpec:
    """PartitionSpec for a tensor whose dimensions carry these logical axis names; a mesh axis is used once."""
    used: set[str] = set()
    out = []
    for name in axes:
        mesh_axes = tuple(a for a in rules.get(name, ()) if a not in used) if name else ()
        used.update(mesh_axes)
        out.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*out)


def shard_count(mesh: Mesh, entry) -> int:
    if entry is None:
        return 1
    return math.prod(mesh.shape[a] for a in ((entry,) if isinstance(entry, str) else entry))


def check_divisible(name: str, shape: Sequence[int], axes: Sequence[str | None], mesh: Mesh, rules: Rules) -> None:
    """Fail with one line when a sharded dimension does not split evenly over its mesh axes."""
    for dim, logical, entry in zip(shape, axes, spec(axes, rules)):
        n = shard_count(mesh, entry)
        if dim % n:
            names = (entry,) if isinstance(entry, str) else entry
            raise ConfigError(f"{name}: its '{logical}' dimension of size {dim} is sharded over mesh axes "
                              f"{'x'.join(names)} ({n} devices), which does not divide it; change "
                              f"{' or '.join(f'mesh.ici_{a} / mesh.dcn_{a}' for a in names)} or the model size")


class Pipeline(NamedTuple):
    """How the forward pass runs its layers over the `stage` mesh axis (model/pipeline.py)."""
    stages: int
    microbatches: int  # 0 = as many as stages
    repeats: int


_CTX: contextvars.ContextVar[tuple[Mesh, Rules, tuple[int, int], Rules] | None] = contextvars.ContextVar(
    "jaxlm_sharding", default=None)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: Rules = ACTIVATION_RULES, pipeline: tuple[int, int] = (0, 1),
                        param_rules: Rules = PARAM_RULES):
    """Within this block (while tracing), `constrain` pins activations to the mesh, and a mesh with a `stage`
    axis over 1 runs the layers as a pipeline of (micro-batches, repeats) = `pipeline` (training.pipeline_*)
    whose weights `constrain_param` pins by `param_rules`. Open it inside the jitted function (a program built for
    one mesh, as the train step is, or `within` a static Layout argument), never around a call of a jitted
    function that other blocks call too: jax.jit would reuse the program traced under the first."""
    token = _CTX.set((mesh, rules, pipeline, param_rules))
    try:
        yield
    finally:
        _CTX.reset(token)


class Layout(NamedTuple):
    """The arguments of an `activation_sharding` block, frozen (rules as sorted (name, axes) pairs): hashable, so
    that a jitted program takes it as a static argument and enters it while traced (`within`). Model code reads
    the block while it is traced, which jax.jit's caches do not see: a program traced inside a block opened
    outside it would be reused under another mesh or other rules."""
    mesh: Mesh
    rules: tuple[tuple[str, tuple[str, ...]], ...]
    pipeline: tuple[int, int]
    param_rules: tuple[tuple[str, tuple[str, ...]], ...]


def layout(mesh: Mesh | None, rules: Rules = ACTIVATION_RULES, pipeline: tuple[int, int] = (0, 1),
           param_rules: Rules = PARAM_RULES) -> Layout | None:
    """The Layout of activation_sharding(mesh, rules, pipeline, param_rules); None without a mesh."""
    if mesh is None:
        return None
    frozen = lambda r: tuple(sorted((k, tuple(v)) for k, v in r.items()))  # noqa: E731
    return Layout(mesh, frozen(rules), tuple(pipeline), frozen(param_rules))


@contextlib.contextmanager
def within(layout: Layout | None):
    """The block of a program's static `layout` argument, opened inside the program: activation_sharding of it, or
    none at all for None (a block opened around the call does not reach in)."""
    token = _CTX.set(None if layout is None else (layout.mesh, dict(layout.rules), layout.pipeline,
                                                  dict(layout.param_rules)))
    try:
        yield
    finally:
        _CTX.reset(token)


def mesh_size() -> int:
    """The devices of the mesh activations are pinned to in this block (1 outside `activation_sharding`)."""
    ctx = _CTX.get()
    return 1 if ctx is None else ctx[0].size


def pipeline() -> Pipeline | None:
    """The pipeline the forward pass runs in this block, or None (no mesh, or one stage)."""
    ctx = _CTX.get()
    if ctx is None or ctx[0].shape.get("stage", 1) == 1:
        return None
    return Pipeline(ctx[0].shape["stage"], *ctx[2])


def active() -> tuple[Mesh, Rules] | None:
    """The (mesh, activation rules) of the enclosing `activation_sharding` block; None outside one."""
    ctx = _CTX.get()
    return None if ctx is None else ctx[:2]


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Pin an activation's sharding by logical axes; a no-op outside `activation_sharding`."""
    ctx = _CTX.get()
    if ctx is None:
        return x
    mesh, rules = ctx[:2]
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec(axes, rules)))


def constrain_param(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Pin a weight (or its gradient) by logical axes and the weight rules; a no-op outside
    `activation_sharding`."""
    ctx = _CTX.get()
    if ctx is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(ctx[0], spec(axes, ctx[3])))


def batch_sharding(mesh: Mesh, ndim: int, leading: int = 0, rules: Rules = ACTIVATION_RULES) -> NamedSharding:
    """Sharding of a token array [(leading dims,) batch, length]."""
    return NamedSharding(mesh, spec((None,) * leading + ("batch", "length")[: ndim - leading], rules))


def batch_split(mesh: Mesh, rules: Rules = ACTIVATION_RULES) -> int:
    """How many ways the global batch is split (the product of the mesh axes the `batch` axis maps to)."""
    return shard_count(mesh, spec(("batch",), rules)[0])
