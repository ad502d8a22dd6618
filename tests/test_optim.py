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
from jaxlm import config as config_lib, params as P, sharding
from jaxlm.train import batches as batch_lib, loop as train, optim, run as run_lib, state as state_lib, step as step_lib
from jaxlm.config import ConfigError, ModelConfig, OptimizerConfig
from jaxlm.data import loader as loader_lib
from jaxlm.model import attention, latent, param_specs, transformer


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


# ---- Muon on sharded weights -------------------------------------------------------------------------------------


def _muon_run(char_data, tmp_path, devices, **overrides):
    def batch_of(rng, run):  # the same rows on every layout: two accumulated micro-batches of 8
        starts = rng.integers(0, 100_000, size=16).reshape(2, 8)
        return batch_lib.device_batch(run, "train", loader_lib.Windows(starts))

    cfg = tiny_config(char_data, tmp_path, **{"model.vocab_size": 128, "optimizer.name": "muon",
                                              "optimizer.lr": 3e-3, "training.grad_accum": 2, **overrides})
    return train_losses(cfg, devices, batch_of, steps=20)


# Layers per stack, and how Newton-Schulz lays out the matrices of a stack split over fsdp=4 x tensor=2: its layers
# over all 8 devices (8 layers), over the 4 of fsdp (4 layers), or every matrix whole on every device (3 layers).
SPLITS = {8: ("fsdp", "tensor"), 4: ("fsdp",), 3: ()}


# the scanned layouts are slow-tier tests that CI runs too (issue 31's acceptance: scanned and unscanned alike)
@pytest.mark.parametrize("scan,layers", [(False, 4), pytest.param(True, 8, marks=[pytest.mark.slow, pytest.mark.in_ci]),
                                         pytest.param(True, 3, marks=[pytest.mark.slow, pytest.mark.in_ci])],
                         ids=["unscanned-4-layers", "scanned-8-layers", "scanned-3-layers"])
def test_sharded_muon_equals_one_device(scan, layers, char_data, tmp_path):
    """FSDP x tensor parallelism (fsdp=4 x tensor=2): every matrix is split over 8 devices along both its axes and
    is gathered whole for Newton-Schulz, its stack's layers spread over the devices as evenly as they divide; 20
    steps' losses and the weights equal one device's."""
    settings = {"model.scan_layers": scan, "model.n_layers": layers}
    mesh = {"mesh.ici_data": 1, "mesh.ici_fsdp": 4, "mesh.ici_tensor": 2}
    run = run_lib.setup(tiny_config(char_data, None, **settings, **mesh, **{"model.vocab_size": 128}), jax.devices())
    q = "['layers']['attn']['q']"
    stack, home = optim.ns_layout(optim.muon_matrices(run.specs)[q], run.specs["layers"]["attn"]["q"], run.mesh,
                                  run.param_rules)
    assert tuple(stack.spec) == (("stage", *SPLITS[layers]) if SPLITS[layers] else "stage", None, None)
    ref, ref_state = _muon_run(char_data, tmp_path / "one", jax.devices()[:1], **settings)
    got, state = _muon_run(char_data, tmp_path / "eight", jax.devices(), **settings, **mesh)
    assert state["params"]["layers"]["attn"]["q"].sharding.spec[1:3] == (("fsdp", "sequence"), "tensor")
    momentum = [v for k, v in jax.tree_util.tree_flatten_with_path(state["opt_state"])[0]
                if "momentum" in jax.tree_util.keystr(k) and jax.tree_util.keystr(k).endswith("['attn']['q']")]
    assert len(momentum) == 1 and momentum[0].sharding == state["params"]["layers"]["attn"]["q"].sharding
    assert ref[-1] < ref[0] - 0.5
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    worst = 0.0
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(ref_state["params"])[0],
                            jax.tree.leaves(state["params"])):
        a, b = np.asarray(a), np.asarray(b)
        err = np.max(np.abs(a - b)) / np.max(np.abs(a))
        worst = max(worst, err)
        assert err <= 1e-5, jax.tree_util.keystr(path)
    print(f"losses: largest relative difference {np.max(np.abs(got / ref - 1)):.2e}; weights: {worst:.2e}")


# ---- WSD runs extended, Muon's state in checkpoints --------------------------------------------------------------

WSD = {"optimizer.name": "muon", "optimizer.schedule": "wsd", "optimizer.cooldown_fraction": 0.2,
       "optimizer.lr": 3e-3, "training.eval_interval": 0, "checkpoint.interval": 10, "checkpoint.keep": 10,
       "training.log_interval": 1}


def stop_at_step(monkeypatch, step: int):
    """SIGTERM to this process while the loop fetches the batch of `step` (1-based): the run saves that step and
    returns, as a preempted (or killed with a warning) run does."""
    real, n = batch_lib.device_batch, [0]

    def batch(run, split, plan):
        if len(plan.shape) == 2:  # the loop's [grad_accum, batch]; evaluation passes [batch]
            n[0] += 1
            if n[0] == step:
                os.kill(os.getpid(), signal.SIGTERM)
        return real(run, split, plan)

    monkeypatch.setattr(batch_lib, "device_batch", batch)


def restored(cfg, run_dir):
    from jaxlm.store import checkpoint as ckpt

    run = run_lib.setup(cfg)
    return jax.device_get(ckpt.restore_newest(run_dir, run.abstract_state, log=quiet)[1])


@pytest.mark.slow
@pytest.mark.in_ci  # issue 31: WSD extension is exact
def test_wsd_run_extended_in_its_stable_phase_equals_one_long_run(char_data, tmp_path, monkeypatch):
    """A 40-step Muon run with WSD, stopped at step 13 (its cooldown would begin at 32), extended with
    training.steps=60: the same losses, learning rates and final state (weights, Muon's momentum, AdamW's
    moments) as one 60-step run, whose cooldown begins at 48."""
    long_cfg = tiny_config(char_data, tmp_path / "long", **{**WSD, "training.steps": 60})
    train.train(long_cfg, log=quiet)
    stop_at_step(monkeypatch, 13)
    summary = train.train(tiny_config(char_data, tmp_path / "ext", **{**WSD, "training.steps": 40}), log=quiet)
    monkeypatch.undo()
    assert summary["preempted_at"] == 13
    lines = []
    summary = train.train(tiny_config(char_data, tmp_path / "ext", **{**WSD, "training.steps": 60}), log=lines.append)
    assert summary["start_step"] == 13
    assert ("training.steps 40 -> 60 at step 13: still in the stable phase, the cooldown now runs from step 48 to 60 "
            "(was 32)") in lines
    records = {r["step"]: r for r in train.read_metrics(tmp_path / "long") if "loss" in r}
    ext = {r["step"]: r for r in train.read_metrics(tmp_path / "ext") if "loss" in r}
    assert [ext[s]["loss"] for s in range(1, 61)] == [records[s]["loss"] for s in range(1, 61)]
    assert [ext[s]["lr"] for s in range(1, 61)] == [records[s]["lr"] for s in range(1, 61)]
    lrs = [records[s]["lr"] for s in range(1, 61)]  # step s is the update at count s - 1
    assert lrs[5:49] == [pytest.approx(3e-3)] * 44 and lrs[49] < 3e-3  # the cooldown: counts 48-60
    assert lrs[-1] == pytest.approx(1e-4 + (3e-3 - 1e-4) / 12)
    assert records[60]["loss"] < records[1]["loss"] - 0.5
    a, b = restored(long_cfg, tmp_path / "long"), restored(long_cfg, tmp_path / "ext")
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.array_equal(x, y)


def test_a_run_continues_with_muon_from_an_adamw_checkpoint(char_data, tmp_path):
    run_dir = tmp_path / "run"
    common = {"training.eval_interval": 0, "optimizer.lr": 1e-2}
    train.train(tiny_config(char_data, run_dir, **{**common, "training.steps": 10}), log=quiet)
    lines = []
    cfg = tiny_config(char_data, run_dir, **{**common, "training.steps": 20, "optimizer.name": "muon"})
    summary = train.train(cfg, log=lines.append)
    assert summary["start_step"] == 10
    said = [line for line in lines if "another optimizer's state" in line]
    assert len(said) == 1 and "fresh muon state" in said[0] and "schedule continues at step 10" in said[0]
    records = {r["step"]: r for r in train.read_metrics(run_dir) if "loss" in r}
    assert records[11]["lr"] == pytest.approx(float(optim.schedule(cfg.optimizer, 20)(10)))
    # the trained weights, not a fresh start
    assert records[11]["loss"] < records[1]["loss"] - 0.5 and abs(records[11]["loss"] - records[10]["loss"]) < 0.15
    state = restored(cfg, run_dir)
    momentum = [v for k, v in jax.tree_util.tree_flatten_with_path(state["opt_state"])[0]
                if "momentum" in jax.tree_util.keystr(k)]
    assert len(momentum) == 6 and all(np.any(m != 0) for m in momentum)  # Muon's, trained for 10 steps
    with pytest.raises(train.ConfigError, match="different model"):  # the weights must still fit
        train.train(tiny_config(char_data, run_dir, **{"model.n_layers": 3, "optimizer.name": "adamw"}), log=quiet)


# ---- MuonClip ----------------------------------------------------------------------------------------------------

# No QK-norm and no rotary embedding, so the NumPy forward below needs only norms, matmuls, softmax and relu;
# grouped-query heads (4 query heads over 2 kv heads).
CLIP = ModelConfig(vocab_size=11, block_size=8, n_layers=2, n_heads=4, n_kv_heads=2, d_model=16, d_ff=32,
                   qk_norm=False, position="learned", activation="relu")


def np_logit_max(p: dict, tokens: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """[L, N] the largest causal attention logit of each layer's heads, by a direct float64 forward pass."""
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    B, T = tokens.shape
    G = cfg.n_heads // cfg.kv_heads
    rms = lambda x, s: x / np.sqrt(np.mean(x ** 2, -1, keepdims=True) + cfg.norm_eps) * s  # noqa: E731
    x = f(p["embed"]["tokens"])[tokens] + f(p["embed"]["positions"])[:T]
    causal = np.tril(np.ones((T, T), bool))
    out = []
    for i in range(cfg.n_layers):
        lp = jax.tree.map(lambda a: f(a[i]), p["layers"])
        h = rms(x, lp["attn_norm"]["scale"])
        q = np.einsum("btd,dnh->bnth", h, lp["attn"]["q"])
        k = np.repeat(np.einsum("btd,dkh->bkth", h, lp["attn"]["k"]), G, axis=1)
        v = np.repeat(np.einsum("btd,dkh->bkth", h, lp["attn"]["v"]), G, axis=1)
        logits = np.einsum("bnth,bnsh->bnts", q, k) / np.sqrt(cfg.hd)
        out.append(np.where(causal, logits, -np.inf).max(axis=(0, 2, 3)))
        probs = np.exp(np.where(causal, logits, -np.inf) - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + np.einsum("bnth,nhd->btd", np.einsum("bnts,bnsh->bnth", probs, v), lp["attn"]["o"])
        h = rms(x, lp["mlp_norm"]["scale"])
        x = x + np.maximum(h @ lp["mlp"]["up"], 0) @ lp["mlp"]["down"]
    return np.stack(out)


def _clip_params(cfg: ModelConfig, seed=0):
    mesh = sharding.make_mesh(config_lib.MeshConfig(), jax.devices()[:1])
    params = P.init(param_specs(cfg), jax.random.key(seed), mesh)
    # Larger query and key weights than the initializer's, so logits spread well beyond 1.
    attn = {**params["layers"]["attn"], **{n: params["layers"]["attn"][n] * 25
                                           for n in ("q", "k", "q_a", "q_b", "kv_a", "k_b", "k_rope")
                                           if n in params["layers"]["attn"]}}
    return {**params, "layers": {**params["layers"], "attn": attn}}


def test_attention_logit_max_equals_a_numpy_forward_pass():
    params = _clip_params(CLIP)
    tokens = np.random.default_rng(0).integers(0, 11, (3, 8))
    got = np.asarray(transformer.attention_logit_max(params, jnp.asarray(tokens), CLIP))
    want = np_logit_max(params, tokens, CLIP)
    assert got.shape == (2, 4) and np.ptp(want) > 1.0
    np.testing.assert_allclose(got, want, rtol=2e-5)
    # computed a few queries at a time (attention_block), with padding, it is the same
    small = ModelConfig(**{**CLIP.__dict__, "attention_block": 3})
    np.testing.assert_allclose(np.asarray(transformer.attention_logit_max(params, jnp.asarray(tokens), small)), got,
                               rtol=1e-6)


LATENT = {"kv_lora_rank": 6, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 6, "n_kv_heads": None}


@pytest.mark.parametrize("kw", [{}, {"n_kv_heads": 4}, {"qk_norm": True}, {"qk_norm": True, "norm_plus_one": True},
                                {"bias": True}, LATENT, {**LATENT, "q_lora_rank": 8}],
                         ids=["gqa", "mha", "qk-norm", "qk-norm-plus-one", "biases", "latent", "latent-q-lora"])
def test_qk_clip_brings_each_offending_head_to_the_threshold(kw):
    """On the inputs it was measured on, a clipped layer's heads peak at min(max, threshold) (per head), or, with
    QK-norm, at max x gamma of the layer's worst head; the other heads are left alone. Latent attention's heads
    (a rotary key shared by all) too."""
    cfg = ModelConfig(**{**CLIP.__dict__, "position": "rotary", **kw})
    config_lib.validate(config_lib.Config(model=cfg))
    attn_mod = latent if cfg.latent else attention
    params = _clip_params(cfg, seed=1)
    if cfg.bias:  # nonzero biases, which must scale with their projections
        params["layers"]["attn"] = {**params["layers"]["attn"], **{
            n: params["layers"]["attn"][n] + 0.5 for n in ("q_bias", "k_bias")}}
    x = jax.random.normal(jax.random.key(2), (2, 8, 16))
    positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
    layer = lambda p: jax.tree.map(lambda a: a[0], p)  # noqa: E731
    top_N = attn_mod.attention_with_logit_max(x, layer(params["layers"]["attn"]), cfg, positions)[1]
    threshold = float(np.median(top_N))
    top_LN = jnp.stack([top_N, top_N + 1e9])  # layer 1 would be clipped hard; only layer 0 is checked here
    clipped = transformer.clip_qk(params, top_LN, threshold, cfg)["layers"]["attn"]
    after_N = np.asarray(attn_mod.attention_with_logit_max(x, layer(clipped), cfg, positions)[1])
    before = np.asarray(top_N)
    want = before * min(1.0, threshold / before.max()) if cfg.qk_norm else np.minimum(before, threshold)
    np.testing.assert_allclose(after_N, want, rtol=1e-5)
    assert (before > threshold).any() and (before <= threshold).any()
    scaled = ("q", "k", "q_bias", "k_bias", "q_norm", "k_norm", "q_b", "k_b")
    assert all(clipped[n] is params["layers"]["attn"][n] for n in clipped if n not in scaled)


def test_train_step_with_qk_clip_logs_each_layer_and_clips_after_the_update(char_data, tmp_path):
    base = {"optimizer.name": "muon", "model.qk_norm": False, "checkpoint.enabled": False}
    runs = {}
    for name, clip in (("plain", 0.0), ("clip", 1.5)):
        cfg = tiny_config(char_data, tmp_path, **base, **{"optimizer.qk_clip": clip})
        run = run_lib.setup(cfg, jax.devices()[:1])
        state = state_lib.init_state(run, 0)
        state["params"]["layers"]["attn"] = {**state["params"]["layers"]["attn"], **{
            n: state["params"]["layers"]["attn"][n] * 6 for n in ("q", "k")}}
        step = step_lib.make_train_step(run.cfg, run.optimizer, run.mesh, run.abstract_state, run.act_rules)
        x = np.random.default_rng(0).integers(0, 65, (1, 8, 32)).astype(np.int32)
        batch = {"inputs": x, "targets": np.roll(x, -1, axis=-1)}
        before = jax.device_get(state["params"])
        new, m = step(state, batch)
        runs[name] = (run.cfg, before, jax.device_get(new["params"]), jax.device_get(m))
    cfg, before, plain, m = runs["plain"]
    assert not any(k.startswith("attn_logit_max") for k in m)
    cfg, _, clipped, m = runs["clip"]
    top_LN = np.asarray(transformer.attention_logit_max(before, jnp.asarray(x[0]), cfg.model))
    assert [float(m[f"attn_logit_max/{i}"]) for i in range(2)] == pytest.approx(list(np.max(top_LN, axis=1)), rel=1e-5)
    assert int(m["qk_clipped_heads"]) == int(np.sum(top_LN > 1.5)) > 0
    want = attention.clip_qk(plain["layers"]["attn"], top_LN, 1.5, cfg.model)
    for n in ("q", "k", "v", "o"):
        np.testing.assert_allclose(clipped["layers"]["attn"][n], want[n], rtol=1e-5, atol=1e-7)
    assert not np.allclose(clipped["layers"]["attn"]["q"], plain["layers"]["attn"]["q"])


def test_a_resumed_run_with_other_training_steps_says_where_its_schedule_goes():
    wsd = OptimizerConfig(schedule="wsd", warmup_steps=10, cooldown_fraction=0.2)
    assert train._schedule_change(wsd, 100, 200, 90) == (
        "training.steps 100 -> 200 at step 90: the cooldown had begun at step 80; from here the rate follows the new "
        "schedule (160 to 200), rising from the first run's")
    assert "jumping" in train._schedule_change(wsd, 200, 100, 150)  # shortened past the new cooldown's start
    assert "decay now ends at step 200" in train._schedule_change(OptimizerConfig(), 100, 200, 50)
    assert "unchanged" in train._schedule_change(OptimizerConfig(decay_steps=100), 100, 200, 50)
