"""Optimizers (`optimizer.name`): AdamW on every weight, or Muon on the layers' hidden matrices with AdamW on the
rest; learning-rate schedules (cosine, linear, constant, warmup-stable-decay); global-norm clipping; weight-decay
masks and both decay conventions:

coupled      p <- p - lr_t * (update_t + wd * p)                    (torch.optim.AdamW, optax.adamw)
independent  p <- p - lr_t * update_t - (lr_t / lr_peak) * wd * p   (midGPT; decay follows the schedule's
                                                                     shape but not the peak learning rate)
Muon (`scale_by_muon`) orthogonalizes each matrix's momentum by Newton-Schulz, sharded matrices first laid out
whole (`ns_layout`); docs/optimizers.md explains both. Shape legend: M rows (fan-in), N columns (fan-out), after
any leading batch axes (...).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxlm import params as P, sharding
from jaxlm.config import OptimizerConfig
from jaxlm.model.moe import BALANCE_SIGNAL

# ---- schedules ------------------------------------------------------------------------------------------------


def wsd_phases(cfg: OptimizerConfig, total_steps: int) -> tuple[int, int]:
    """(first step of the cooldown, step at which it reaches min_lr) of a warmup-stable-decay schedule."""
    end = cfg.decay_steps if cfg.decay_steps is not None else total_steps
    length = cfg.cooldown_steps if cfg.cooldown_steps is not None else round(cfg.cooldown_fraction * end)
    length = min(length, end - cfg.warmup_steps)
    return end - length, end


def schedule(cfg: OptimizerConfig, total_steps: int, peak: float | None = None) -> optax.Schedule:
    """The learning rate by optimizer step: linear warmup from 0 to `peak` (default optimizer.lr), then the
    decay of optimizer.schedule to min_lr (scaled by peak / lr for another group's peak)."""
    peak = cfg.lr if peak is None else peak
    floor = cfg.min_lr * peak / cfg.lr
    decay_steps = cfg.decay_steps if cfg.decay_steps is not None else total_steps
    warmup = optax.linear_schedule(0.0, peak, max(cfg.warmup_steps, 1))
    span = max(decay_steps - cfg.warmup_steps, 1)
    if cfg.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, span, alpha=floor / peak)
    elif cfg.schedule == "linear":
        decay = optax.linear_schedule(peak, floor, span)
    elif cfg.schedule == "wsd":
        decay = _cooldown(cfg, total_steps, peak, floor)
    else:
        decay = optax.constant_schedule(peak)
    if cfg.warmup_steps == 0:
        return decay
    return optax.join_schedules([warmup, decay], [cfg.warmup_steps])


def _cooldown(cfg: OptimizerConfig, total_steps: int, peak: float, floor: float) -> optax.Schedule:
    """WSD after warmup (steps counted from the end of warmup): `peak` until the cooldown starts, then
    cooldown_shape down to `floor`, reached at the end of the decay and kept after it."""
    start, end = (s - cfg.warmup_steps for s in wsd_phases(cfg, total_steps))

    def lr(step):
        progress = jnp.clip((step - start) / max(end - start, 1), 0.0, 1.0)
        if cfg.cooldown_shape == "linear":
            left = 1.0 - progress
        elif cfg.cooldown_shape == "cosine":
            left = 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
        else:
            left = 1.0 - jnp.sqrt(progress)
        return floor + (peak - floor) * left

    return lr


# ---- which weights Muon trains ---------------------------------------------------------------------------------

# Leading axes that index independent matrices: one per layer of a stack, one per expert of a layer.
MATRIX_BATCH_AXES = ("layers", "experts")


@dataclasses.dataclass(frozen=True)
class MatrixView:
    """How Muon reads a weight: `batch` leading axes of independent matrices, then `fan_in` axes of rows (the
    input the weight contracts), the rest columns. q [L, D, N, H] is L matrices of D x (N H); o [L, N, H, D] is L
    of (N H) x D; an expert weight [L, E, D, F] is L E matrices of D x F."""
    batch: int
    fan_in: int

    def rows_cols(self, shape: tuple[int, ...]) -> tuple[int, int]:
        b, k = self.batch, self.fan_in
        return math.prod(shape[b:b + k]), math.prod(shape[b + k:])


def matrix_view(path: str, spec: P.ParamSpec) -> MatrixView | None:
    """The matrix view of a weight that Muon trains, None for one that AdamW does: embeddings, the output layer,
    norms, biases and anything with fewer than two axes besides its layers and experts. The fan-in is the first
    of the remaining axes, except for an output projection (last axis `embed`), whose input is all the others."""
    if "['embed']" in path or "lm_head" in path or "norm" in path or path.endswith("bias']"):
        return None
    axes = spec.axes
    b = 0
    while b < len(axes) and axes[b] in MATRIX_BATCH_AXES:
        b += 1
    rest = axes[b:]
    if len(rest) < 2:
        return None
    return MatrixView(b, len(rest) - 1 if rest[-1] == "embed" else 1)


def muon_matrices(specs) -> dict[str, MatrixView]:
    """{tree path (jax.tree_util.keystr): view} of every weight in `specs` that Muon trains."""
    out = {}
    for path, spec in jax.tree_util.tree_flatten_with_path(specs, is_leaf=P.is_spec)[0]:
        key = jax.tree_util.keystr(path)
        if (view := matrix_view(key, spec)) is not None:
            out[key] = view
    return out


def describe(cfg: OptimizerConfig, specs, adapters: bool = False) -> str:
    """One line for the logs: which optimizer trains which weights."""
    if cfg.name == "adamw":
        return f"optimizer AdamW on all {P.count(specs):,} parameters"
    if adapters:
        return "optimizer.name=muon: a LoRA run trains its adapters with AdamW (Muon is for full weight matrices)"
    views = muon_matrices(specs)
    flat = {jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_flatten_with_path(specs, is_leaf=P.is_spec)[0]}
    n_muon = sum(math.prod(s.shape) for k, s in flat.items() if k in views)
    matrices = sum(math.prod(flat[k].shape[:v.batch]) for k, v in views.items())
    return (f"optimizer Muon on {matrices} matrices of {len(views)} weights ({n_muon:,} parameters), AdamW on "
            f"{len(flat) - len(views)} others ({P.count(specs) - n_muon:,}: embeddings, output layer, norms, biases)")


# ---- Muon --------------------------------------------------------------------------------------------------------

# The quintic Newton-Schulz coefficients of modded-nanogpt and Moonlight: a steep slope at 0, so that 5 steps bring
# every singular value of a normalized matrix into about [0.7, 1.2].
NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


def orthogonalize(u: jax.Array, view: MatrixView, steps: int, layout=None) -> jax.Array:
    """Newton-Schulz orthogonalization of each matrix of u (float32): X <- X / |X|_F, then `steps` times
    X <- a X + (b A + c A A) X with A = X X^T, on the wide orientation (A is min(M, N) square). `layout`, a
    sharding of the [..., M, N] stack (ns_layout), places the matrices for the iteration."""
    shape = u.shape
    M, N = view.rows_cols(shape)
    x_MN = u.astype(jnp.float32).reshape(*shape[:view.batch], M, N)
    if M > N:
        x_MN = jnp.swapaxes(x_MN, -1, -2)
    if layout is not None:
        x_MN = jax.lax.with_sharding_constraint(x_MN, layout)
    x_MN = x_MN / (jnp.sqrt(jnp.sum(jnp.square(x_MN), axis=(-2, -1), keepdims=True)) + NS_EPS)
    a, b, c = NS_COEFFS
    for _ in range(steps):
        A_MM = jnp.einsum("...ij,...kj->...ik", x_MN, x_MN)
        B_MM = b * A_MM + c * jnp.einsum("...ij,...jk->...ik", A_MM, A_MM)
        x_MN = a * x_MN + jnp.einsum("...ij,...jk->...ik", B_MM, x_MN)
    if layout is not None:  # pinned at both ends: the iteration's products stay on whole matrices
        x_MN = jax.lax.with_sharding_constraint(x_MN, layout)
    if M > N:
        x_MN = jnp.swapaxes(x_MN, -1, -2)
    return x_MN.reshape(shape)


def update_scale(view: MatrixView, shape: tuple[int, ...], rms: float) -> float:
    """The factor of an orthogonalized update: rms * sqrt(max(M, N)) gives it an RMS of about `rms` (an exactly
    orthogonal M x N matrix has RMS 1 / sqrt(max(M, N))); rms = 0 takes Keller Jordan's max(1, N / M) ** 0.5."""
    M, N = view.rows_cols(shape)
    return rms * math.sqrt(max(M, N)) if rms > 0 else max(1.0, N / M) ** 0.5


def ns_layout(view: MatrixView, spec: P.ParamSpec, mesh, rules) -> tuple | None:
    """(sharding of the weight's [..., M, N] stack for Newton-Schulz, the weight's own sharding), or None when its
    matrices are whole on every device already. The stack keeps the sharding of its leading axes and splits the
    first of them that divides evenly over as many as it can of the mesh axes its matrix axes were split over
    (all of them, else the largest group that divides); the devices of the axes left out hold the same matrices,
    and with no leading axis to split, every device holds every matrix (a gather)."""
    pspec = sharding.spec(spec.axes, rules)
    entries = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in pspec]
    entries += [()] * (len(spec.shape) - len(entries))
    matrix = tuple(a for e in entries[view.batch:] for a in e if mesh.shape[a] > 1)
    if not matrix:
        return None
    size = lambda axes: math.prod(mesh.shape[a] for a in axes)  # noqa: E731
    groups = sorted((c for r in range(len(matrix), 0, -1) for c in itertools.combinations(matrix, r)), key=size,
                    reverse=True)
    batch = entries[:view.batch]
    for i, e in enumerate(batch):
        split = next((c for c in groups if spec.shape[i] % (size(e) * size(c)) == 0), None)
        if split is not None:
            batch[i] = e + split
            break
    stack = jax.sharding.PartitionSpec(*(e if len(e) > 1 else e[0] if e else None for e in batch), None, None)
    return jax.sharding.NamedSharding(mesh, stack), jax.sharding.NamedSharding(mesh, pspec)


class MuonState(NamedTuple):
    momentum: optax.Updates  # one per matrix weight, in the weight's dtype and sharding


def scale_by_muon(views: dict[str, MatrixView], momentum: float, nesterov: bool, ns_steps: int, rms: float,
                  layouts: dict[str, tuple] | None = None) -> optax.GradientTransformation:
    """Muon's direction for the weights named in `views` (optax.partition hands this transform those alone; the
    others are empty nodes of the tree): m <- momentum m + g, then orthogonalize(g + momentum m) (Nesterov) or
    orthogonalize(m), times update_scale. `layouts` (ns_layout, by path) place sharded matrices for the
    iteration and the result back where the weight lives."""
    layouts = layouts or {}

    def init(params):
        return MuonState(jax.tree.map(jnp.zeros_like, params))

    def update(grads, state, params=None):
        del params
        m = jax.tree.map(lambda m, g: (momentum * m + g).astype(m.dtype), state.momentum, grads)

        def direction(path, g, m):
            key = jax.tree_util.keystr(path)
            view, (stack, home) = views[key], layouts.get(key) or (None, None)
            u = g + momentum * m if nesterov else m
            out = (orthogonalize(u, view, ns_steps, stack) * update_scale(view, g.shape, rms)).astype(g.dtype)
            return out if home is None else jax.lax.with_sharding_constraint(out, home)

        return jax.tree_util.tree_map_with_path(direction, grads, m), MuonState(m)

    return optax.GradientTransformation(init, update)


# ---- the optimizer -----------------------------------------------------------------------------------------------


def decay_mask(params, decay_embeddings: bool):
    """Decay matrices only: never norms or biases (and embedding tables only when asked)."""

    def keep(path, leaf):
        name = jax.tree_util.keystr(path)
        if "norm" in name or name.endswith("bias']"):
            return False
        if "['embed']" in name:
            return decay_embeddings
        return leaf.ndim >= 2

    return jax.tree_util.tree_map_with_path(keep, params)


def make(cfg: OptimizerConfig, total_steps: int, specs=None, mesh=None,
         param_rules=sharding.PARAM_RULES) -> optax.GradientTransformation:
    """The run's optimizer. With optimizer.name=muon, `specs` (the trained weights' ParamSpecs) say which weights
    are matrices for Muon; without them (a LoRA run's adapters) every weight takes AdamW. With the `mesh` the
    weights are placed on (and its rules), sharded matrices are laid out whole for Newton-Schulz (ns_layout)."""
    lr = schedule(cfg, total_steps)
    wd = cfg.weight_decay / cfg.lr if cfg.weight_decay_mode == "independent" else cfg.weight_decay
    parts = []
    if cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    adamw = optax.adamw(lr, b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps, weight_decay=wd,
                        mask=lambda p: decay_mask(p, cfg.decay_embeddings))
    views = muon_matrices(specs) if cfg.name == "muon" and specs is not None else {}
    if not views:
        return balance_bias_steps(optax.chain(*parts, adamw))
    muon_lr = cfg.muon_lr if cfg.muon_lr is not None else cfg.lr
    muon_wd = cfg.muon_weight_decay if cfg.muon_weight_decay is not None else cfg.weight_decay
    if cfg.weight_decay_mode == "independent":
        muon_wd /= muon_lr
    layouts = {}
    if mesh is not None and mesh.devices.size > 1:
        flat = {jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_flatten_with_path(specs, is_leaf=P.is_spec)[0]}
        layouts = {k: ns_layout(v, flat[k], mesh, param_rules) for k, v in views.items()}
    muon = optax.chain(scale_by_muon(views, cfg.muon_momentum, cfg.muon_nesterov, cfg.muon_ns_steps, cfg.muon_rms,
                                     layouts),
                       optax.add_decayed_weights(muon_wd),
                       optax.scale_by_learning_rate(schedule(cfg, total_steps, muon_lr)))

    def labels(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: "muon" if jax.tree_util.keystr(path) in views else "adamw", params)

    return balance_bias_steps(optax.chain(*parts, optax.partition({"adamw": adamw, "muon": muon}, labels)))


def frozen(inner: optax.GradientTransformation, names: tuple[str, ...]) -> optax.GradientTransformation:
    """`inner` for every weight but the subtrees `names` of the weights tree (a vision tower left as it is), which
    get zero updates and no optimizer state (no moments, no weight decay)."""
    def labels(params):
        return {k: jax.tree.map(lambda _: "frozen" if k in names else "trained", v) for k, v in params.items()}

    return optax.partition({"trained": inner, "frozen": optax.set_to_zero()}, labels)


def schedule_at(opt_state, step):
    """`opt_state` with the step count of every learning-rate schedule in it set to `step`: a fresh optimizer
    state (new moments) that continues the run's schedule where its weights left off."""
    is_sched = lambda s: isinstance(s, optax.ScaleByScheduleState)  # noqa: E731
    return jax.tree.map(lambda s: s._replace(count=jnp.asarray(step, s.count.dtype)) if is_sched(s) else s,
                        opt_state, is_leaf=is_sched)


def _is_balance_bias(path) -> bool:
    return jax.tree_util.keystr(path).endswith("['balance_bias']")


def balance_bias_steps(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner` for every weight but the mixture of experts' balancing biases (model/moe.py), whose gradient
    slot holds minus the step DeepSeek-V3's auxiliary-loss-free balancing takes, scaled by BALANCE_SIGNAL: they
    move by exactly that step, and `inner` (clipping, AdamW and its decay) sees zeros in their place. The
    state is `inner`'s own, so checkpoints of models without such biases keep their layout."""
    def update(grads, state, params=None):
        inner_grads = jax.tree_util.tree_map_with_path(
            lambda path, g: jax.numpy.zeros_like(g) if _is_balance_bias(path) else g, grads)
        updates, state = inner.update(inner_grads, state, params)
        updates = jax.tree_util.tree_map_with_path(
            lambda path, u, g: -g / BALANCE_SIGNAL if _is_balance_bias(path) else u, updates, grads)
        return updates, state

    return optax.GradientTransformation(inner.init, update)
