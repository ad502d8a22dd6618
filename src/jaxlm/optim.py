"""Optimizer: AdamW with warmup + decay, global-norm clipping, weight-decay masks and both decay conventions.

coupled      p <- p - lr_t * (adam_t + wd * p)                    (torch.optim.AdamW, optax.adamw)
independent  p <- p - lr_t * adam_t - (lr_t / lr_peak) * wd * p   (midGPT; decay follows the schedule's
                                                                   shape but not the peak learning rate)
"""

from __future__ import annotations

import jax
import optax

from jaxlm.config import OptimizerConfig
from jaxlm.model.moe import BALANCE_SIGNAL


def schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    decay_steps = cfg.decay_steps if cfg.decay_steps is not None else total_steps
    warmup = optax.linear_schedule(0.0, cfg.lr, max(cfg.warmup_steps, 1))
    span = max(decay_steps - cfg.warmup_steps, 1)
    if cfg.schedule == "cosine":
        decay = optax.cosine_decay_schedule(cfg.lr, span, alpha=cfg.min_lr / cfg.lr)
    elif cfg.schedule == "linear":
        decay = optax.linear_schedule(cfg.lr, cfg.min_lr, span)
    else:
        decay = optax.constant_schedule(cfg.lr)
    if cfg.warmup_steps == 0:
        return decay
    return optax.join_schedules([warmup, decay], [cfg.warmup_steps])


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


def make(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    lr = schedule(cfg, total_steps)
    wd = cfg.weight_decay / cfg.lr if cfg.weight_decay_mode == "independent" else cfg.weight_decay
    parts = []
    if cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(optax.adamw(lr, b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps, weight_decay=wd,
                             mask=lambda p: decay_mask(p, cfg.decay_embeddings)))
    return balance_bias_steps(optax.chain(*parts))


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
