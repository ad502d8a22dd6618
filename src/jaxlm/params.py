"""Weights declared once: shape, logical axes and initializer. Abstract shapes, shardings and a
jitted, sharded initialization all derive from the same declaration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from jaxlm import sharding

Init = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]


def normal(std: float) -> Init:
    return lambda key, shape, dtype: (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def zeros(key, shape, dtype):
    return jnp.zeros(shape, dtype)


def ones(key, shape, dtype):
    return jnp.ones(shape, dtype)


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: Init
    dtype: str = "float32"


def is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def abstract(specs) -> dict:
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(s.dtype)), specs, is_leaf=is_spec)


def logical_axes(specs) -> dict:
    return jax.tree.map(lambda s: s.axes, specs, is_leaf=is_spec)


def shardings(specs, mesh: Mesh, rules=sharding.PARAM_RULES) -> dict:
    def one(path, s):
        sharding.check_divisible(jax.tree_util.keystr(path), s.shape, s.axes, mesh, rules)
        return NamedSharding(mesh, sharding.spec(s.axes, rules))

    return jax.tree_util.tree_map_with_path(one, specs, is_leaf=is_spec)


def count(specs, exclude: Callable[[str], bool] = lambda path: False) -> int:
    total = 0
    for path, s in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]:
        if not exclude(jax.tree_util.keystr(path)):
            n = 1
            for d in s.shape:
                n *= d
            total += n
    return total


def init(specs, key: jax.Array, mesh: Mesh, rules=sharding.PARAM_RULES) -> dict:
    """Initialize every weight directly into its sharding (no full copy on one device)."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    out_shardings = jax.tree.leaves(shardings(specs, mesh, rules))

    def make(key):
        keys = jax.random.split(key, len(leaves))
        return [s.init(k, s.shape, jnp.dtype(s.dtype)) for k, s in zip(keys, leaves)]

    values = jax.jit(make, out_shardings=out_shardings)(key)
    return jax.tree.unflatten(treedef, values)
