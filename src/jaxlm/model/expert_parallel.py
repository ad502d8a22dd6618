"""Expert parallelism: a mixture-of-experts layer whose experts are split over the `expert` mesh axis runs under
`shard_map`. Each device routes its own tokens and sorts the token copies by expert, so by destination, into one
bucket per device; an all-to-all delivers the buckets (ragged or padded: `uses_ragged`), the receiver runs its
experts with one grouped matmul (`ragged_dot`) and the inverse all-to-all brings the results back. Routing and
statistics are the single-device layer's (the statistics summed over devices). Buffers (`capacity`), the exchange
in rematerialized steps (`_steps`) and the other axes: docs/scaling.md, "Expert parallelism".

Shape legend: B batch, T length, D model width, E experts, K experts per token, F expert hidden width, X devices
on the expert axis, G experts per device (E / X), m tokens per device, a token copies per device (m * K), C rows
per bucket (Cd), n steps, c rows of each bucket per step (C / n, rounded up), R rows received per step (X * c).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxlm import sharding
from jaxlm.config import ConfigError


class Plan(NamedTuple):
    mesh: Mesh
    x_spec: P  # the tokens [B, T, D], split as the activations are
    token_axes: tuple[str, ...]  # mesh axes over which devices hold different tokens
    mlp_axes: tuple[str, ...]  # mesh axes splitting the experts' hidden width F


def plan(x_BTD: jax.Array, n_experts: int) -> Plan | None:
    """How to run this layer expert-parallel on the active mesh, or None to run it as on one device (no mesh,
    one device on the expert axis, or a batch the mesh does not split evenly, as a decode step's may not)."""
    ctx = sharding.active()
    if ctx is None or ctx[0].shape.get("expert", 1) == 1:
        return None
    mesh, rules = ctx
    X = mesh.shape["expert"]
    if sharding.pipeline() is not None:
        raise ConfigError(f"mesh: expert parallelism (expert axis of {X}) does not run inside a pipeline "
                          f"(stage axis of {mesh.shape['stage']}); set mesh.ici_expert / mesh.dcn_expert or "
                          "mesh.ici_stage / mesh.dcn_stage to 1")
    if n_experts % X:
        raise ConfigError(f"mesh: the expert axis of {X} devices does not divide model.n_experts={n_experts}; "
                          "change mesh.ici_expert / mesh.dcn_expert")
    x_spec = sharding.spec(("batch", "length", None), rules)
    token_axes = tuple(a for entry in x_spec for a in ((entry,) if isinstance(entry, str) else entry or ()))
    if "expert" not in token_axes:
        raise ConfigError("mesh.rules: with an expert axis over 1 the activations' batch or length must be split "
                          "over `expert` too (act.batch=data+fsdp+expert)")
    if any(dim % sharding.shard_count(mesh, entry) for dim, entry in zip(x_BTD.shape, x_spec)):
        return None
    mlp_axes = tuple(a for a in rules.get("mlp", ()) if a not in token_axes)
    return Plan(mesh, x_spec, token_axes, mlp_axes)


def capacity(m: int, k: int, n_experts: int, n_devices: int, capacity_factor: float) -> tuple[int, int]:
    """(Ce, Cd): the copies an expert takes from one device, and the rows of one device's bucket for
    another, for m tokens per device."""
    worst = m * min(k, n_experts // n_devices)
    if not capacity_factor:
        return m, worst
    per_expert = min(m, math.ceil(capacity_factor * m * k / n_experts))
    return per_expert, min(worst, per_expert * (n_experts // n_devices))


def moe(plan_: Plan, x_BTD: jax.Array, p: dict, k: int, capacity_factor: float, all_to_all: str,
        route: Callable, experts: Callable, weights_input: bool = False, pallas: bool = False):
    """The layer of model/moe.py, expert-parallel: route(x_MD, p) -> (scores_ME, experts_MK, weights_MK)
    and experts(x_AD, p, group_sizes_E) -> y_AD are that layer's own; with weights_input each copy's weight
    scales the token it carries instead of the expert's output; pallas: experts() calls a Pallas kernel (megablox),
    whose outputs shard_map's check of varying axes cannot type, so the check is off. Returns y [B, T, D] and the
    statistics [3, E] (routed fraction, mean score, dropped fraction)."""
    mesh, x_spec, token_axes, mlp_axes = plan_
    E = p["router"].shape[-1]
    X = mesh.shape["expert"]
    G = E // X
    ragged = uses_ragged(mesh, all_to_all)
    mlp = mlp_axes[0] if len(mlp_axes) == 1 else (mlp_axes or None)
    w_specs = {"router": P(), "up": P("expert", None, mlp), "down": P("expert", mlp, None)}
    if "gate" in p:
        w_specs["gate"] = P("expert", None, mlp)
    for name, spec in (("router_bias", P()), ("balance_bias", P()), ("up_bias", P("expert", mlp)),
                       ("gate_bias", P("expert", mlp)), ("down_bias", P("expert", None))):
        if name in p:
            w_specs[name] = spec
    n_token_shards = math.prod(mesh.shape[a] for a in token_axes)

    def local(x_bTD, q):
        if mlp_axes and "down_bias" in q:  # the outputs are summed over `tensor`: one shard adds the bias
            first = jnp.all(jnp.stack([jax.lax.axis_index(a) == 0 for a in mlp_axes]))
            q = {**q, "down_bias": jnp.where(first, q["down_bias"], 0)}
        b, T, D = x_bTD.shape
        m = b * T
        a = m * k
        Ce, C = capacity(m, k, E, X, capacity_factor)
        me = jax.lax.axis_index("expert")
        with jax.named_scope("router"):
            x_mD = x_bTD.reshape(m, D)
            probs_mE, experts_mK, weights_mK = route(x_mD, q)
        with jax.named_scope("dispatch"):
            experts_a = experts_mK.reshape(-1)
            order_a = jnp.argsort(experts_a, stable=True)
            sorted_a = experts_a[order_a]
            counts_E = jnp.bincount(experts_a, length=E).astype(jnp.int32)
            rank_a = jnp.arange(a, dtype=jnp.int32) - (jnp.cumsum(counts_E) - counts_E)[sorted_a]
            kept_XG = jnp.minimum(counts_E, Ce).reshape(X, G)
            # Slot of each copy: its destination's bucket, its expert's place in that bucket, its rank there;
            # a dropped copy gets the slot past the end. Only these integer maps are scattered; the token rows
            # move by gathers through them.
            start_E = (jnp.cumsum(kept_XG, axis=1) - kept_XG).reshape(E)
            slot_sorted_a = jnp.where(rank_a < Ce, (sorted_a // G) * C + start_E[sorted_a] + rank_a, X * C)
            slot_a = jnp.zeros((a,), jnp.int32).at[order_a].set(slot_sorted_a)
            got_XG = jax.lax.all_to_all(kept_XG, "expert", 0, 0)  # copies from device i for local expert g
        n = _steps(X * C, D, C)
        if weights_input:  # the rows sent are the copies, each its token times its weight
            rows, row_a = (x_mD[:, None] * weights_mK[..., None].astype(x_mD.dtype)).reshape(a, D), jnp.arange(a)
        else:
            rows, row_a = x_mD, jnp.arange(a) // k
        y_aD = _exchange_and_run(rows, row_a.astype(jnp.int32), slot_a, kept_XG.sum(axis=1), got_XG, C, n, me,
                                 ragged, lambda x_nD, g_G: experts(x_nD, q, g_G), token_axes, mlp_axes)
        with jax.named_scope("combine"):
            if weights_input:
                y_mD = jnp.sum(y_aD.reshape(m, k, D).astype(jnp.float32), axis=1)
            else:
                y_mD = jnp.einsum("mKD,mK->mD", y_aD.reshape(m, k, D).astype(jnp.float32), weights_mK)
        M = m * n_token_shards
        stats_3E = jax.lax.psum(jnp.stack([counts_E.astype(jnp.float32), jnp.sum(probs_mE, axis=0),
                                           (counts_E - kept_XG.reshape(E)).astype(jnp.float32)]), token_axes) / M
        return y_mD.reshape(b, T, D).astype(x_bTD.dtype), stats_3E

    with jax.named_scope("expert_parallel"):
        return jax.shard_map(local, mesh=mesh, in_specs=(x_spec, w_specs), out_specs=(x_spec, P()),
                             check_vma=not pallas)(
            x_BTD, {name: p[name] for name in w_specs})


def _steps(rows: int, width: int, C: int) -> int:
    """Into how many steps the exchange of `rows` (X * C) received rows is cut: steps of at least `width` (D)
    rows. Fewer rows per step would leave the steps' matmuls bound by reading the local experts' weights
    (each step reads them again), and the backward pass carries the weights' gradients (G x D x F per matrix)
    through the steps, which outweigh a step's hidden activations below about D rows (rows x F per matrix,
    times G where the grouped matmul runs densely, as on CPU)."""
    return max(1, min(C, rows // width))


def _exchange_and_run(x_mD: jax.Array, src_a: jax.Array, slot_a: jax.Array, sent_X: jax.Array, got_XG: jax.Array,
                      C: int, n: int, me: jax.Array, ragged: bool, experts: Callable,
                      token_axes: tuple[str, ...], mlp_axes: tuple[str, ...]) -> jax.Array:
    """Every copy's expert output [a, D] (zeros for a dropped copy), copy a carrying row src_a[a] of x_mD (its
    token, or its own scaled row). The X buckets of C rows are exchanged in
    n steps of c = C / n rows (rounded up) each: a step sends rows [j c, (j + 1) c) of every bucket, the
    receiver runs its experts on the X c rows it got, and the results come back. The steps run in a
    rematerialized scan, so the exchange buffers and the experts' hidden activations exist for one step at a
    time, forward and backward; what persists is the tokens and the copies' outputs [a, D]."""
    m, D = x_mD.shape
    X, G = got_XG.shape
    c = -(-C // n)
    a = slot_a.shape[0]
    bucket_a, row_a = slot_a // C, slot_a % C
    local_a = bucket_a * c + row_a % c  # the copy's row in its step's buffer; past the end for a dropped copy
    step_a = jnp.where(bucket_a < X, row_a // c, n)
    # token_nXc: the row of x_mD in row (step, bucket, row) of the exchange, m (out of range: zeros) where unfilled
    token_nXc = jnp.full((X, n * c), m, jnp.int32).at[bucket_a, step_a * c + row_a % c].set(
        src_a, mode="drop").reshape(X, n, c).transpose(1, 0, 2)
    ends_XG = jnp.cumsum(got_XG, axis=1)
    got_X = ends_XG[:, -1]

    def step(y_aD, xs):
        j, token_Xc = xs
        send_X = jnp.clip(sent_X - j * c, 0, c)
        recv_X = jnp.clip(got_X - j * c, 0, c)
        with jax.named_scope("dispatch"):
            send_XcD = jnp.take(x_mD, token_Xc, axis=0, mode="fill", fill_value=0)
            recv_XcD = _exchange(send_XcD, send_X, recv_X, me, ragged)
            # Regroup the received rows by local expert (the unfilled rows, G, last).
            row_Xc = j * c + jnp.arange(c, dtype=jnp.int32)
            expert_R = jnp.sum(row_Xc[None, :, None] >= ends_XG[:, None, :], axis=2).reshape(X * c)
            order_R = jnp.argsort(expert_R, stable=True)
            back_R = jnp.zeros_like(order_R).at[order_R].set(jnp.arange(X * c, dtype=order_R.dtype))
            x_RD = jnp.take(recv_XcD.reshape(X * c, D), order_R, axis=0)
        with jax.named_scope("experts"):
            y_RD = experts(x_RD, jnp.bincount(expert_R, length=G + 1)[:G].astype(jnp.int32))
            if mlp_axes:
                y_RD = jax.lax.psum(y_RD, mlp_axes)
        with jax.named_scope("combine"):
            y_XcD = jnp.take(y_RD, back_R, axis=0).reshape(X, c, D)
            back_RD = _exchange(y_XcD, recv_X, send_X, me, ragged).reshape(X * c, D)
            mine_a = jnp.where(step_a == j, local_a, X * c)
            return y_aD + jnp.take(back_RD, mine_a, axis=0, mode="fill", fill_value=0), None

    y_aD = jax.lax.pcast(jnp.zeros((a, D), x_mD.dtype), token_axes, to="varying")  # as the tokens are
    if n == 1:
        return step(y_aD, (0, token_nXc[0]))[0]
    steps = jnp.arange(n, dtype=jnp.int32)
    return jax.lax.scan(jax.checkpoint(step, prevent_cse=False), y_aD, (steps, token_nXc))[0]


def uses_ragged(mesh: Mesh, all_to_all: str) -> bool:
    """Whether the exchange is `ragged_all_to_all` (model.expert_all_to_all), by the mesh's devices: an
    ahead-of-time compile for TPU traces on a CPU host. XLA:CPU does not implement it, and XLA:TPU refuses it
    on v5e pod slices ("not supported in limited ICI routing settings", seen at v5e-256; v5e-16, v6e-256 and
    v5p-128 compile it)."""
    device = mesh.devices.flat[0]
    if all_to_all == "auto":
        return device.platform == "tpu" and device.device_kind != "TPU v5 lite"
    if all_to_all == "ragged" and device.platform != "tpu":
        raise ConfigError(f"model.expert_all_to_all=ragged needs TPU devices (jax.lax.ragged_all_to_all); these "
                          f"are {device.platform}: use auto or padded")
    return all_to_all == "ragged"


def _exchange(send_XCD: jax.Array, send_X: jax.Array, recv_X: jax.Array, me: jax.Array, ragged: bool):
    """Bucket i of every device goes to device i, where it lands as bucket (sender's index): an all-to-all
    over `expert`. send_X / recv_X: the filled rows of each bucket sent / received (what a ragged exchange
    moves; the padded one moves whole buckets)."""
    X, C, D = send_XCD.shape
    if not ragged:
        return jax.lax.all_to_all(send_XCD, "expert", 0, 0)
    offsets_X = jnp.arange(X, dtype=jnp.int32) * C
    out = jax.lax.ragged_all_to_all(send_XCD.reshape(X * C, D), jnp.zeros((X * C, D), send_XCD.dtype), offsets_X,
                                    send_X.astype(jnp.int32), jnp.full((X,), me * C, jnp.int32),
                                    recv_X.astype(jnp.int32), axis_name="expert")
    return out.reshape(X, C, D)
