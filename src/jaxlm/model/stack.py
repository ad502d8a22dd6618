"""The layer stack's layout and the one loop over it: each layer's kind (attention kind from model.layer_pattern,
MLP dense or mixture-of-experts), where its weights lie in the stacked arrays, and `run`, which every pass
(training forward, prefill, cached decoding, the server's chunked prefill) uses to go through the layers. Layers
are scanned in groups of G consecutive layers that repeat exactly (P, or a multiple of it when
model.moe_layer_interval does not divide P); those before the first group and after the last run unrolled. The
scan indexes each layer's weights from the whole stacks inside its rematerialization (never a copy; without remat
a reshape of the stacks where the groups are all of them). Every leaf of params["layers"] is stacked over the
layers that have it (`mixed`: `mlp` over the MoE layers, `dense_mlp` over the dense ones; `layer_view`). Entry j
of the KV cache holds the layers i with i mod P == j, repeat i // P (docs/families.md, "The options").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxlm.config import ModelConfig


@dataclass(frozen=True)
class Kind:
    """What a layer compiles as: its attention kind (global, local, chunked, nope) and whether its MLP has experts."""
    attention: str
    moe: bool


@dataclass(frozen=True)
class Layout:
    kinds: tuple[Kind, ...]  # one per layer
    P: int  # pattern length: layer i is cache entry i % P, repeat i // P
    G: int  # layers per scanned group (a multiple of P)
    start: int  # the first layer of the scanned groups (a multiple of G)
    groups: int  # scanned groups: layers [start, start + groups * G)
    mixed: bool  # both dense and MoE layers: their MLP weights are stacked apart

    @property
    def n_layers(self) -> int:
        return len(self.kinds)

    @property
    def unrolled(self) -> tuple[int, ...]:
        """The layers outside the scanned groups, in order."""
        end = self.start + self.groups * self.G
        return tuple(range(self.start)) + tuple(range(end, self.n_layers))

    @property
    def simple(self) -> bool:
        """Every layer in a scanned group of the pattern's length, one MLP kind: the layout before 2025."""
        return not self.unrolled and not self.mixed and self.G == self.P


def is_moe_layer(cfg: ModelConfig, i: int) -> bool:
    return bool(cfg.n_experts) and i >= cfg.first_dense_layers and (i + 1) % cfg.moe_layer_interval == 0


def layout(cfg: ModelConfig, n_layers: int | None = None) -> Layout:
    """The layout of cfg's layers (of its first n_layers when given: a pipeline stage's share)."""
    L = cfg.n_layers if n_layers is None else n_layers
    P = len(cfg.pattern)
    kinds = tuple(Kind(cfg.pattern[i % P], is_moe_layer(cfg, i)) for i in range(L))
    moe = [k.moe for k in kinds]
    mixed = any(moe) and not all(moe)
    G = P if not cfg.n_experts or P % cfg.moe_layer_interval == 0 else math.lcm(P, cfg.moe_layer_interval)
    start = -(-min(cfg.first_dense_layers, L) // G) * G if cfg.n_experts else 0
    return Layout(kinds, P, G, start, max(0, (L - start) // G), mixed)


def group_of(lay: Layout, key: str) -> str:
    """Which layers a top-level leaf of params["layers"] is stacked over: all, moe or dense."""
    if lay.mixed and key == "mlp":
        return "moe"
    return "dense" if key == "dense_mlp" else "all"


def _has(lay: Layout, group: str, i: int) -> bool:
    return group == "all" or lay.kinds[i].moe == (group == "moe")


def index(lay: Layout, group: str, i: int) -> int:
    """Where layer i's weights of `group` lie along the leading axis of that group's stacked arrays."""
    return i if group == "all" else sum(_has(lay, group, m) for m in range(i))


def layers_with(lay: Layout, key: str) -> list[int]:
    """The layers that have the top-level leaf `key` of params["layers"] (store/convert.py maps HF tensors by it)."""
    return [i for i in range(lay.n_layers) if _has(lay, group_of(lay, key), i)]


def layer_view(layer_params: dict, lay: Layout, i: int) -> dict:
    """Layer i's weights sliced out of the stacked arrays; its MLP, dense or not, under `mlp`."""
    p = {}
    for key, sub in layer_params.items():
        group = group_of(lay, key)
        if _has(lay, group, i):
            # lax.index_in_dim, not a[i]: a slice with explicit strides, whose gradient JAX (0.10.2) can add into a
            # slice of an accumulator ref (train/step.py's micro-batches); a[i]'s slice has none and fails there
            p["mlp" if key == "dense_mlp" else key] = jax.tree.map(
                lambda a: jax.lax.index_in_dim(a, index(lay, group, i), keepdims=False), sub)
    return p


def _per_group(lay: Layout, group: str) -> int:
    """How many of a scanned group's G layers have the leaves of `group`."""
    return sum(_has(lay, group, lay.start + g) for g in range(lay.G))


def _in_place(layer_params: dict, lay: Layout) -> bool:
    """Whether every leaf's scanned layers are the whole leaf (no layers before or after the groups): then
    _body_params is a reshape, which costs no copy. Otherwise (Gemma 3's 34 layers in groups of 6, 4 left over;
    dense layers before the MoE groups) slicing the groups out would copy the weights, so the scan indexes them
    from the whole stacks instead (_scanned_view). A differentiated pass with remat indexes them so in either case
    (run): a scan over the reshaped stacks hands each step its slice outside the layer's checkpoint, and the
    gradient kept every step's slice, a second copy of the weights (1.8 GiB of maxtext_base's bf16 weights; 3.5
    GiB of temporaries of llama3.1-8b's QLoRA step at 2,048 tokens)."""
    for key, sub in layer_params.items():
        group = group_of(lay, key)
        n = lay.groups * _per_group(lay, group)
        if index(lay, group, lay.start) != 0 or any(a.shape[0] != n for a in jax.tree.leaves(sub)):
            return False
    return True


def _body_params(layer_params: dict, lay: Layout) -> dict:
    """The scanned groups' weights, each leaf [n, G_g, ...] (G_g of its group's layers per scanned group): a
    reshape of the stacks when _in_place."""
    out = {}
    for key, sub in layer_params.items():
        group = group_of(lay, key)
        per_group = _per_group(lay, group)
        out[key] = jax.tree.map(lambda a: a.reshape(lay.groups, per_group, *a.shape[1:]), sub)
    return out


def _scanned_view(layer_params: dict, lay: Layout, n, g: int) -> dict:
    """Layer g of scanned group n (traced), indexed from the whole stacks: no copy of the scanned layers."""
    p = {}
    for key, sub in layer_params.items():
        group = group_of(lay, key)
        if _has(lay, group, lay.start + g):
            rank = sum(_has(lay, group, lay.start + h) for h in range(g))
            at = index(lay, group, lay.start) + n * _per_group(lay, group) + rank
            p["mlp" if key == "dense_mlp" else key] = jax.tree.map(
                lambda a: jax.lax.dynamic_index_in_dim(a, at, keepdims=False), sub)
    return p


def _group_view(body: dict, lay: Layout, g: int) -> dict:
    """Layer g of a scanned group, from one step's slice of _body_params."""
    p = {}
    for key, sub in body.items():
        group = group_of(lay, key)
        if _has(lay, group, lay.start + g):
            rank = sum(_has(lay, group, lay.start + h) for h in range(g))
            p["mlp" if key == "dense_mlp" else key] = jax.tree.map(lambda a: a[rank], sub)
    return p


Step = Callable[[Any, dict, Kind, int, Any, Any], tuple[Any, Any]]


def run(cfg: ModelConfig, layer_params: dict, fn: Step, carry, xs: tuple | None = None, scan: bool = True,
        n_layers: int | None = None, remat=None):
    """Go through the layers in order: carry, y = fn(carry, p, kind, j, r, x) for each, with p the layer's
    weights (layer_view), kind its Kind, (j, r) its cache entry and repeat (r traced inside the scan) and x its
    slice of xs, a tuple over pattern entries of pytrees stacked [R_j, ...] (or None). Returns the last carry
    and the outputs as a tuple over entries of pytrees stacked [R_j, ...] (fn must give the layers of an entry
    outputs of one structure). With scan=False every layer runs unrolled (model.scan_layers=false). remat: the
    checkpoint policy of the layers of a differentiated pass (fn's own, model.remat; None: no remat), which the
    scan applies around each layer's indexing of its weights from the whole stacks (_in_place)."""
    lay = layout(cfg, n_layers)
    P = lay.P
    parts: list[list] = [[] for _ in range(P)]

    def one(carry, i):
        j, r = i % P, i // P
        x = None if xs is None else jax.tree.map(lambda a: a[r], xs[j])
        carry, y = fn(carry, layer_view(layer_params, lay, i), lay.kinds[i], j, r, x)
        parts[j].append(jax.tree.map(lambda a: a[None], y))
        return carry

    if not scan or lay.groups == 0:
        for i in range(lay.n_layers):
            carry = one(carry, i)
        return carry, tuple(_concat(p) for p in parts)

    for i in range(lay.start):
        carry = one(carry, i)
    G, per_entry = lay.G, lay.G // P
    r0 = lay.start // P
    body_xs = None if xs is None else tuple(jax.tree.map(lambda a: a[r0:r0 + lay.groups * per_entry].reshape(
        lay.groups, per_entry, *a.shape[1:]), x) for x in xs)

    in_place = remat is None and _in_place(layer_params, lay)

    def indexed(g: int):
        """Layer g of a group with its weights indexed from the whole stacks, inside a checkpoint of `remat`'s
        policy when given: the gradient indexes them again rather than keeping each step's copy (the stacks are
        loop-invariant and stay where they lie)."""
        def layer(carry, stacks, n, x):
            return fn(carry, _scanned_view(stacks, lay, n, g), lay.kinds[lay.start + g], g % P,
                      r0 + n * per_entry + g // P, x)
        return layer if remat is None else jax.checkpoint(layer, policy=remat, prevent_cse=False)

    layer_fns = None if in_place else [indexed(g) for g in range(G)]

    def step(carry, inputs):
        n, p_group, x_group = inputs
        ys = []
        for g in range(G):
            j = g % P
            x = None if x_group is None else jax.tree.map(lambda a: a[g // P], x_group[j])
            if in_place:
                carry, y = fn(carry, _group_view(p_group, lay, g), lay.kinds[lay.start + g], j,
                              r0 + n * per_entry + g // P, x)
            else:
                carry, y = layer_fns[g](carry, layer_params, n, x)
            ys.append(y)
        return carry, tuple(ys)

    carry, ys = jax.lax.scan(step, carry, (jnp.arange(lay.groups, dtype=jnp.int32),
                                           _body_params(layer_params, lay) if in_place else None, body_xs))
    for j in range(P):  # entry j's outputs of the scanned groups, in repeat order: [n, G / P, ...] -> [n G / P]
        mine = [ys[g] for g in range(j, G, P)]
        parts[j].append(jax.tree.map(lambda *a: jnp.stack(a, axis=1).reshape(lay.groups * len(a), *a[0].shape[1:]),
                                     *mine))
    for i in range(lay.start + lay.groups * G, lay.n_layers):
        carry = one(carry, i)
    return carry, tuple(_concat(p) for p in parts)


def _concat(parts: list):
    if len(parts) == 1:
        return parts[0]
    return jax.tree.map(lambda *a: jnp.concatenate(a, axis=0), *parts)


def in_layer_order(per_entry: tuple, n_layers: int):
    """Outputs per entry [R_j, ...] (run's) as one array in layer order [L, ...]."""
    P = len(per_entry)
    return jax.tree.map(lambda *a: jnp.stack([a[i % P][i // P] for i in range(n_layers)]), *per_entry)
