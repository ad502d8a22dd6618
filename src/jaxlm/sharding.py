"""Device meshes and the logical-axis rules that place weights and activations on them.

Model code names logical axes only (`batch`, `embed`, `heads`, ...). The rules below map each logical
axis to zero or more mesh axes; parallelism strategies are edits of these tables, not of model code.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxlm.config import ConfigError, MeshConfig

MESH_AXES = ("data", "fsdp")

# Weights: FSDP shards the model width, so every matrix is split across the fsdp axis.
PARAM_RULES: dict[str, tuple[str, ...]] = {
    "embed": ("fsdp",),
}
# Activations: the batch is split over every data-like axis.
ACTIVATION_RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp"),
}


def mesh_shape(cfg: MeshConfig, n_devices: int) -> dict[str, int]:
    """Resolve -1 (fill) and check that the axes multiply to the device count."""
    sizes = {"data": cfg.ici_data, "fsdp": cfg.ici_fsdp}
    known = math.prod(v for v in sizes.values() if v != -1)
    fill = [k for k, v in sizes.items() if v == -1]
    if fill:
        if n_devices % known:
            raise ConfigError(f"mesh: the fixed axes ({_fmt(sizes)}) multiply to {known}, which does not divide "
                              f"the {n_devices} devices")
        sizes[fill[0]] = n_devices // known
    if math.prod(sizes.values()) != n_devices:
        raise ConfigError(f"mesh: {_fmt(sizes)} multiply to {math.prod(sizes.values())} devices but "
                          f"{n_devices} are available; set mesh.ici_* so that the product is {n_devices}")
    return sizes


def _fmt(sizes: dict[str, int]) -> str:
    return " x ".join(f"mesh.ici_{k}={v}" for k, v in sizes.items())


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    sizes = mesh_shape(cfg, len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    try:
        grid = mesh_utils.create_device_mesh(shape, devices)
    except (AssertionError, NotImplementedError, ValueError):
        grid = np.array(devices).reshape(shape)
    return Mesh(grid, MESH_AXES)


def spec(axes: Sequence[str | None], rules: dict[str, tuple[str, ...]]) -> PartitionSpec:
    """PartitionSpec for a tensor whose dimensions carry these logical axis names."""
    used: set[str] = set()
    out = []
    for name in axes:
        mesh_axes = tuple(a for a in rules.get(name, ()) if a not in used) if name else ()
        used.update(mesh_axes)
        out.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*out)


def check_divisible(name: str, shape: Sequence[int], axes: Sequence[str | None], mesh: Mesh,
                    rules: dict[str, tuple[str, ...]]) -> None:
    """Fail with one line when a sharded dimension does not split evenly over its mesh axes."""
    for dim, entry in zip(shape, spec(axes, rules)):
        if entry is None:
            continue
        names = (entry,) if isinstance(entry, str) else entry
        n = math.prod(mesh.shape[a] for a in names)
        if dim % n:
            raise ConfigError(f"{name}: dimension of size {dim} is sharded over mesh axes {names} of total size {n}, "
                              f"which does not divide it; change the mesh.ici_* sizes or the model size")


_CTX: contextvars.ContextVar[tuple[Mesh, dict] | None] = contextvars.ContextVar("jaxlm_sharding", default=None)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: dict[str, tuple[str, ...]] = ACTIVATION_RULES):
    """Within this block (while tracing), `constrain` pins activations to the mesh."""
    token = _CTX.set((mesh, rules))
    try:
        yield
    finally:
        _CTX.reset(token)


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Pin an activation's sharding by logical axes; a no-op outside `activation_sharding`."""
    ctx = _CTX.get()
    if ctx is None:
        return x
    mesh, rules = ctx
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec(axes, rules)))


def batch_sharding(mesh: Mesh, ndim: int, leading: int = 0) -> NamedSharding:
    """Sharding of a [..., batch, length] token array: `leading` unsharded dims, then the batch."""
    return NamedSharding(mesh, spec((None,) * leading + ("batch",) + (None,) * (ndim - leading - 1),
                                    ACTIVATION_RULES))
