"""Optimizers and schedules (optim.py): Muon's update against a direct NumPy computation, per layer and per expert;
sharded Muon against one device; schedules (WSD included) against their formulas; a WSD run extended from its
stable phase against one run of the total length; Muon's state in checkpoints (exact resume) and a run continued
with Muon from an AdamW checkpoint; MuonClip's max logits against a NumPy forward pass and its clip."""

import math
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config, train_losses
from jaxlm import config as config_lib, optim, params as P, sharding, step as step_lib, train
from jaxlm.config import ConfigError, ModelConfig, OptimizerConfig
from jaxlm.data import loader as loader_lib
from jaxlm.model import attention, param_specs, transformer


def quiet(_):
    pass


# ---- which weights are matrices ----------------------------------------------------------------------------------

# GQA (2 query heads, 1 kv head), head width 12, biases, a mixture of 3 experts with a gated MLP, untied output layer:
# matrices wider than tall and taller than wide, per layer and per expert.
MOE = ModelConfig(vocab_size=11, block_size=8, n_layers=2, n_heads=2, n_kv_heads=1, d_model=16, head_dim=12, d_ff=24,
                  n_experts=3, glu=True, bias=True, tie_embeddings=False)


def test_matrix_views_follow_the_logical_axes():
    views = optim.muon_matrices(param_specs(MOE))
    got = {k: (v.batch, v.fan_in) for k, v in views.items()}
    L = "['layers']"
    assert got == {f"{L}['attn']['q']": (1, 1), f"{L}['attn']['k']": (1, 1), f"{L}['attn']['v']": (1, 1),
                   f"{L}['attn']['o']": (1, 2), f"{L}['mlp']['router']": (1, 1), f"{L}['mlp']['up']": (2, 1),
                   f"{L}['mlp']['gate']": (2, 1), f"{L}['mlp']['down']": (2, 1)}
    specs = param_specs(MOE)
    assert views[f"{L}['attn']['o']"].rows_cols(specs["layers"]["attn"]["o"].shape) == (24, 16)
    assert views[f"{L}['mlp']['down']"].rows_cols(specs["layers"]["mlp"]["down"].shape) == (24, 16)
    # embeddings, output layer, norms and biases (q_bias is [L, N, H]: two axes, still a bias) are AdamW's
    assert not any(k.endswith(("bias']", "['scale']")) or "embed" in k or "lm_head" in k for k in views)


# ---- Muon against NumPy --------------------------------------------------------------------------------------------

A, B, C = optim.NS_COEFFS


def np_orthogonalize(u: np.ndarray, batch: int, fan_in: int, steps: int = 5) -> np.ndarray:
    """Newton-Schulz on each matrix of u, one matrix at a time in a Python loop, in float64."""
    shape = u.shape
    M, N = math.prod(shape[batch:batch + fan_in]), math.prod(shape[batch + fan_in:])
    out = np.empty(shape, np.float64)
    for idx in np.ndindex(*shape[:batch]):
        x = u[idx].reshape(M, N).astype(np.float64)
        tall = M > N
        if tall:
            x = x.T
        x = x / (np.linalg.norm(x) + optim.NS_EPS)
        for _ in range(steps):
            a = x @ x.T
            x = A * x + (B * a + C * a @ a) @ x
        out[idx] = (x.T if tall else x).reshape(shape[batch:])
    return out


def np_reference(params: dict, grads: list[dict], views: dict, o: OptimizerConfig) -> dict:
    """AdamW and Muon, step by step, in float64: clipping by the global norm, then per weight its group's update,
    decoupled weight decay and constant learning rate."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    mu = {k: np.zeros_like(v) for k, v in p.items()}
    nu = {k: np.zeros_like(v) for k, v in p.items()}
    for t, g in enumerate(grads, start=1):
        norm = math.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in g.values()))
        g = {k: v.astype(np.float64) * min(1.0, o.grad_clip / norm) for k, v in g.items()}
        for k in p:
            if k in views:
                mu[k] = o.muon_momentum * mu[k] + g[k]
                u = g[k] + o.muon_momentum * mu[k] if o.muon_nesterov else mu[k]
                v = views[k]
                M, N = v.rows_cols(p[k].shape)
                step = np_orthogonalize(u, v.batch, v.fan_in, o.muon_ns_steps) * o.muon_rms * math.sqrt(max(M, N))
                p[k] = p[k] - o.muon_lr * (step + o.muon_weight_decay * p[k])
            else:
                mu[k] = o.beta1 * mu[k] + (1 - o.beta1) * g[k]
                nu[k] = o.beta2 * nu[k] + (1 - o.beta2) * g[k] ** 2
                step = (mu[k] / (1 - o.beta1 ** t)) / (np.sqrt(nu[k] / (1 - o.beta2 ** t)) + o.eps)
                decays = not ("norm" in k or k.endswith("bias']")) and p[k].ndim >= 2
                p[k] = p[k] - o.lr * (step + (o.weight_decay * p[k] if decays else 0.0))
    return p


def test_muon_update_equals_numpy_per_layer_and_per_expert():
    o = OptimizerConfig(name="muon", lr=0.01, muon_lr=0.03, weight_decay=0.1, muon_weight_decay=0.05, warmup_steps=0,
                        schedule="constant", grad_clip=1.0)
    specs = param_specs(MOE)
    opt = optim.make(o, 10, specs)
    params = P.init(specs, jax.random.key(0), sharding.make_mesh(config_lib.MeshConfig(), jax.devices()[:1]))
    params = jax.tree.map(lambda x: x + 0.01, params)  # zero-initialized biases would stay at zero
    rng = np.random.default_rng(1)
    grads = [jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params) for _ in range(3)]
    state = opt.init(params)
    update = jax.jit(opt.update)
    p = params
    for g in grads:
        u, state = update(g, state, p)
        p = jax.tree.map(lambda a, b: a + b, p, u)
    flat = lambda t: {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(t)[0]}  # noqa: E731
    views = optim.muon_matrices(specs)
    want = np_reference(flat(params), [flat(g) for g in grads], views, o)
    got, start = flat(p), flat(params)
    worst = 0.0
    for k in want:
        moved_want, moved_got = want[k] - start[k], got[k] - start[k]
        err = np.max(np.abs(moved_got - moved_want)) / np.max(np.abs(moved_want))
        worst = max(worst, err)
        assert err < 2e-5, (k, err)
    print(f"largest error of the parameter change, relative to its largest entry: {worst:.2e}")


def test_orthogonalize_pushes_singular_values_towards_one():
    u = np.random.default_rng(0).normal(size=(3, 32, 48)).astype(np.float32)
    o = np.asarray(optim.orthogonalize(jnp.asarray(u), optim.MatrixView(1, 1), 5))
    s = np.linalg.svd(o, compute_uv=False)
    assert s.shape == (3, 32) and 0.6 < s.min() and s.max() < 1.25  # quintic NS: about [0.7, 1.2], not exactly 1
    s_in = np.linalg.svd(u, compute_uv=False)
    assert s_in.max() / s_in.min() > 5  # the input was far from orthogonal


# ---- schedules ---------------------------------------------------------------------------------------------------


def np_schedule(o: OptimizerConfig, total: int, t: int) -> float:
    if t < o.warmup_steps:
        return o.lr * t / o.warmup_steps
    end = o.decay_steps or total
    if o.schedule == "constant":
        return o.lr
    if o.schedule in ("cosine", "linear"):
        p = min((t - o.warmup_steps) / (end - o.warmup_steps), 1.0)
        left = 0.5 * (1 + math.cos(math.pi * p)) if o.schedule == "cosine" else 1 - p
        return o.min_lr + (o.lr - o.min_lr) * left
    length = o.cooldown_steps if o.cooldown_steps is not None else round(o.cooldown_fraction * end)
    start = end - length
    p = min(max((t - start) / length, 0.0), 1.0)
    left = {"linear": 1 - p, "cosine": 0.5 * (1 + math.cos(math.pi * p)), "sqrt": 1 - math.sqrt(p)}[o.cooldown_shape]
    return o.min_lr + (o.lr - o.min_lr) * left


@pytest.mark.parametrize("kw", [
    {"schedule": "cosine"}, {"schedule": "linear"}, {"schedule": "constant"},
    {"schedule": "wsd"}, {"schedule": "wsd", "cooldown_shape": "sqrt", "cooldown_fraction": 0.5},
    {"schedule": "wsd", "cooldown_shape": "cosine", "cooldown_steps": 7, "decay_steps": 90},
], ids=["cosine", "linear", "constant", "wsd-linear-20%", "wsd-sqrt-50%", "wsd-cosine-7-steps"])
def test_schedules_follow_their_formulas(kw):
    o = OptimizerConfig(lr=0.02, min_lr=0.002, warmup_steps=10, **kw)
    sched = optim.schedule(o, 100)
    for t in range(0, 111):
        assert float(sched(t)) == pytest.approx(np_schedule(o, 100, t), rel=1e-5, abs=1e-9), t
    if o.schedule == "wsd":  # the stable phase holds the peak until the cooldown begins
        start, end = optim.wsd_phases(o, 100)
        assert float(sched(start)) == np.float32(o.lr) and float(sched(end)) == pytest.approx(o.min_lr)
    muon = optim.schedule(o, 100, peak=0.2)  # another group's peak: the same shape, ten times higher
    assert float(muon(55)) == pytest.approx(10 * float(sched(55)), rel=1e-6)


def test_bad_optimizer_settings_fail_in_one_line():
    base = config_lib.Config()
    for overrides, message in [
        ({"optimizer.name": "lion"}, "optimizer.name"),
        ({"optimizer.schedule": "wsd", "optimizer.cooldown_fraction": 1.5}, "cooldown_fraction=1.5 must be in"),
        ({"optimizer.schedule": "wsd", "optimizer.cooldown_steps": 5000}, "cooldown_steps=5000 is longer than"),
        ({"optimizer.muon_momentum": 1.0}, "muon_momentum=1.0 must be in [0, 1)"),
        ({"optimizer.qk_clip": -1}, "qk_clip=-1"),
        ({"optimizer.qk_clip": 100, "lora.rank": 8}, "keeps frozen"),
    ]:
        with pytest.raises(ConfigError, match=None) as e:
            config_lib.validate(config_lib.apply_overrides(base, overrides))
        assert message in str(e.value) and "\n" not in str(e.value), (overrides, str(e.value))
