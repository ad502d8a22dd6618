"""Quantized matmuls against numpy references of the same rounding, against rigorous error bounds of the
float result, and inside the model, the train step's HLO and a trained checkpoint."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conftest import tiny_config
from jaxlm import cli, config as config_lib
from jaxlm.eval import heldout as evaluate
from jaxlm.model import quant
from jaxlm.train import loop as train, run as run_lib, state as state_lib, step as step_lib
from jaxlm.config import ConfigError
from jaxlm.model import forward

SPEC = "BTD,DNH->BTNH"


def operands(seed=0, B=3, T=16, D=64, N=4, H=8):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, T, D)).astype(np.float32)
    x[0, 0, 5] = 9.0  # an outlier row: per-token scales must keep it from flattening the other tokens
    w = (0.05 * rng.standard_normal((D, N, H))).astype(np.float32)
    g = rng.standard_normal((B, T, N, H)).astype(np.float32)
    return x, w, g


def np_int8(a, axes):
    """Independent reference: symmetric absmax int8 along `axes`, round half to even; float64 values."""
    a = a.astype(np.float64)
    s = np.abs(a).max(axis=axes, keepdims=True) / 127.0
    return np.clip(np.round(a / s), -127, 127) * s, s


def error_bound(spec, a, b, sa, sb, a_step=0.5, b_step=0.5):
    """Largest possible |einsum(a_q, b_q) - einsum(a, b)| per output when |a - a_q| <= a_step * sa and
    |b - b_q| <= b_step * sb elementwise: |a||db| + |da||b| + |da||db| summed over the contraction."""
    da, db = a_step * np.broadcast_to(sa, a.shape), b_step * np.broadcast_to(sb, b.shape)
    return (np.einsum(spec, np.abs(a), db) + np.einsum(spec, da, np.abs(b)) + np.einsum(spec, da, db))


def test_int8_forward_matches_reference_and_error_bound():
    x, w, _ = operands()
    got = np.asarray(quant.qdot(SPEC, jnp.asarray(x), jnp.asarray(w), quant.Recipe("int8")))
    xq, sx = np_int8(x, (2,))
    wq, sw = np_int8(w, (0,))
    np.testing.assert_allclose(got, np.einsum(SPEC, xq, wq), rtol=1e-5, atol=1e-6)
    exact = np.einsum(SPEC, x.astype(np.float64), w.astype(np.float64))
    err = np.abs(got - exact)
    assert np.all(err <= error_bound(SPEC, x, w, sx, sw) * 1.0001 + 1e-6)
    # Rounding errors are ~uniform in +-s/2 (variance s^2/12): the RMS error matches that prediction.
    predicted = np.sqrt(np.mean(np.einsum(SPEC, x.astype(np.float64) ** 2, np.broadcast_to(sw, w.shape) ** 2) / 12
                                + np.einsum(SPEC, np.broadcast_to(sx, x.shape) ** 2, w.astype(np.float64) ** 2) / 12))
    assert 0.7 < np.sqrt(np.mean(err ** 2)) / predicted < 1.3
    assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 0.02


def grads(recipe, x, w, g):
    f = lambda x, w: jnp.sum(quant.qdot(SPEC, x, w, recipe) * g)  # noqa: E731
    return [np.asarray(a) for a in jax.grad(f, (0, 1))(jnp.asarray(x), jnp.asarray(w))]


def test_int8_gradients_match_reference_and_float_within_bound():
    x, w, g = operands(1)
    dx, dw = grads(quant.Recipe("int8", stochastic_rounding=False), x, w, g)
    # The backward multiplies by the forward's int8 operands (x per token, w per output channel N, H), their
    # scales folded into g, which is quantized along each matmul's contracted axes: dx = g w^T contracts N, H
    # (g * sw per token), dw = x^T g contracts B, T (g * sx per output channel). Neither x nor w is requantized.
    xq, sx = np_int8(x, (2,))
    wq, sw = np_int8(w, (0,))
    gq_t, sg_t = np_int8(g * sw[None], (2, 3))  # sw [1, N, H] -> [1, 1, N, H]
    np.testing.assert_allclose(dx, np.einsum("BTNH,DNH->BTD", gq_t, wq / sw), rtol=1e-5, atol=1e-6)
    gq_c, sg_c = np_int8(g * sx[..., None], (0, 1))  # sx [B, T, 1] -> [B, T, 1, 1]
    np.testing.assert_allclose(dw, np.einsum("BTD,BTNH->DNH", xq / sx, gq_c), rtol=1e-5, atol=1e-6)
    sg_t, sg_c = sg_t / sw[None], sg_c / sx[..., None]  # g's rounding step in g's own units

    float_dx = np.einsum("BTNH,DNH->BTD", g.astype(np.float64), w)
    float_dw = np.einsum("BTD,BTNH->DNH", x.astype(np.float64), g)
    assert np.all(np.abs(dx - float_dx) <= error_bound("BTNH,DNH->BTD", g, w, sg_t, sw) * 1.0001 + 1e-6)
    assert np.all(np.abs(dw - float_dw) <= error_bound("BTD,BTNH->DNH", x, g, sx, sg_c) * 1.0001 + 1e-6)
    # Stochastic rounding may move g by up to a whole step (not half): the bound doubles on g's side.
    sdx, sdw = grads(quant.Recipe("int8", stochastic_rounding=True), x, w, g)
    assert np.all(np.abs(sdx - float_dx) <= error_bound("BTNH,DNH->BTD", g, w, sg_t, sw, a_step=1.0) * 1.0001 + 1e-6)
    assert np.all(np.abs(sdw - float_dw) <= error_bound("BTD,BTNH->DNH", x, g, sx, sg_c, b_step=1.0) * 1.0001 + 1e-6)
    for got, ref in [(dx, float_dx), (dw, float_dw), (sdx, float_dx), (sdw, float_dw)]:
        assert 1e-4 < np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.03


def test_stochastic_rounding_is_unbiased():
    n = 1 << 18
    # Scale 1 (the 127 sets it); 10.3 rounds to 10 every time at nearest, to 10 or 11 at random stochastically.
    x = jnp.concatenate([jnp.array([127.0]), jnp.full((n,), 10.3)])
    nearest, scale = quant.quantize(x, (0,), "int8")
    assert float(scale[0]) == 1.0 and np.all(np.asarray(nearest[1:]) == 10)
    for salt in (1, 2):
        q, _ = quant.quantize(x, (0,), "int8", quant.uniform_noise(x, salt))
        q = np.asarray(q[1:], np.float64)
        assert set(np.unique(q)) == {10.0, 11.0}
        assert abs(q.mean() - 10.3) < 4 * np.sqrt(0.3 * 0.7 / n)  # mean error ~ 0 within 4 sigma
    u = np.asarray(quant.uniform_noise(jnp.linspace(-1.0, 1.0, n), salt=0), np.float64)
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002 and abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.01
    assert not np.array_equal(quant.uniform_noise(x, 1), quant.uniform_noise(x, 2))
    # The backward's pair (dx's and dw's noise from one hash's two halves): each unbiased, the two uncorrelated.
    pair = quant.uniform_noise_pair(x, 1)
    for u in pair:
        q = np.asarray(quant.quantize(x, (0,), "int8", u)[0][1:], np.float64)
        assert set(np.unique(q)) == {10.0, 11.0} and abs(q.mean() - 10.3) < 4 * np.sqrt(0.3 * 0.7 / n)
    u, v = (np.asarray(a, np.float64) for a in quant.uniform_noise_pair(jnp.linspace(-1.0, 1.0, n), salt=0))
    for a in (u, v):
        assert abs(a.mean() - 0.5) < 0.005 and abs(a.var() - 1 / 12) < 0.002 and 0 < a.min() and a.max() < 1
    assert abs(np.corrcoef(u, v)[0, 1]) < 0.01 and abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.01


def test_int8_backward_quantizes_only_the_gradient_with_one_hash():
    """The backward keeps the forward's int8 operands: of the step's absmax reductions, the forward's two (x, w)
    and the gradient's two (for dx, for dw); one hash of the gradient serves both stochastic roundings."""
    x, w, g = operands(3)
    f = lambda x, w: jnp.sum(quant.qdot(SPEC, x, w, quant.Recipe("int8")) * g)  # noqa: E731
    eqns = [e.primitive.name for e in jax.make_jaxpr(jax.grad(f, (0, 1)))(jnp.asarray(x), jnp.asarray(w)).eqns]
    assert eqns.count("reduce_max") == 4
    assert eqns.count("xor") == 5  # one lowbias32 hash: position and salt mixed in, three xorshifts


def test_int8_remat_keeps_the_quantized_weights():
    """Under a remat policy the recomputed forward would quantize every weight again; int8 training's policy
    keeps the int8 weights and their scales instead (and nothing more), fp8's and float's do not."""
    from jax._src.ad_checkpoint import saved_residuals

    from jaxlm.config import ModelConfig
    from jaxlm.model import transformer

    x, w, _ = operands(4)
    loss = lambda x, w: jnp.sum(quant.qdot(SPEC, x, w, quant.Recipe("int8")))  # noqa: E731 - names its int8 w
    kept = {}
    for mode in ("int8", "fp8", "none"):
        f = jax.checkpoint(loss, policy=transformer.remat_policy(ModelConfig(quantization=mode, remat="full")))
        kept[mode] = sorted((a.dtype.name, a.shape) for a, src in saved_residuals(f, jnp.asarray(x), jnp.asarray(w))
                            if quant.QUANT_WEIGHT in src)
    assert kept["int8"] == [("float32", (1,) + w.shape[1:]), ("int8", w.shape)]
    assert kept["fp8"] == kept["none"] == []
    assert transformer.remat_policy(ModelConfig(quantization="int8", remat="none")) is None


def test_int8_remat_minimal_keeps_matmul_results_at_compute_dtype():
    """remat minimal keeps the matmuls' outputs: under int8 training that is each matmul's bf16 result (2 bytes
    an element), not its int32 accumulator (4), which bf16 training's minimal does not pay either; and the int8
    input and its scales that the backward multiplies by (1 byte an element), so the recomputed forward does not
    quantize the input again."""
    from jax._src.ad_checkpoint import saved_residuals

    from jaxlm.config import ModelConfig
    from jaxlm.model import layers, transformer

    x, w, _ = operands(5)
    x, w = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)

    def loss(x, w):  # the backward of silu needs the matmul's result
        with quant.recipe_scope(quant.Recipe("int8")):
            return jnp.sum(jax.nn.silu(layers.dot(SPEC, x, w)).astype(jnp.float32))

    def kept(remat):
        f = jax.checkpoint(loss, policy=transformer.remat_policy(ModelConfig(quantization="int8", remat=remat)))
        return sorted((a.dtype.name, a.shape) for a, src in saved_residuals(f, x, w) if "argument" not in src)

    y, sw = (x.shape[0], x.shape[1]) + w.shape[1:], (1,) + w.shape[1:]
    sx = x.shape[:2] + (1,)
    # the result, the int8 input and weight and their scales
    assert kept("minimal") == [("bfloat16", y), ("float32", sw), ("float32", sx), ("int8", x.shape), ("int8", w.shape)]
    assert kept("save_dots") == kept("minimal")
    assert kept("full") == [("float32", sw), ("int8", w.shape)]
    # bf16 training's minimal keeps the same bf16 result
    f = jax.checkpoint(lambda x, w: jnp.sum(jax.nn.silu(layers.dot(SPEC, x, w)).astype(jnp.float32)),
                       policy=transformer.remat_policy(ModelConfig(remat="minimal")))
    assert [(a.dtype.name, a.shape) for a, src in saved_residuals(f, x, w) if "argument" not in src] == [
        ("bfloat16", (y[0] * y[1], y[2] * y[3]))]  # as one 2-D matmul


def test_int8_step_weights_quantize_each_weight_once_a_step(char_data, monkeypatch):
    """int8 training quantizes the block weights once a step, before the micro-batches (quant.step_weights): a
    matmul given a StepInt8 quantizes x alone, with the numbers of quantizing w where it multiplies; the step's
    quantizing of the weights sits outside the micro-batch loop; and its loss and gradients are those of the step
    that quantizes every weight in every micro-batch."""
    from jaxlm.train import objectives

    x, w, _ = operands(6)
    x, w = jnp.asarray(x), jnp.asarray(w)
    made = quant.StepInt8(w, *quant.quantize(w, (0,), "int8"))
    int8 = quant.Recipe("int8")
    f = lambda w: quant.qdot(SPEC, x, w, int8)  # noqa: E731
    reduce_max = lambda w: str(jax.make_jaxpr(f)(w)).count("reduce_max")  # noqa: E731 - the custom VJP's too
    assert (reduce_max(w), reduce_max(made)) == (2, 1)
    np.testing.assert_array_equal(np.asarray(f(made)), np.asarray(f(w)))
    # a weight contracted along other axes than its step's quantization is quantized where it multiplies
    np.testing.assert_array_equal(np.asarray(quant.qdot("BTNH,DNH->BTD", jnp.ones((3, 16, 4, 8)), made, int8)),
                                  np.asarray(quant.qdot("BTNH,DNH->BTD", jnp.ones((3, 16, 4, 8)), w, int8)))

    cfg = tiny_config(char_data, **{"model.quantization": "int8", "model.vocab_size": 65, "model.remat": "minimal",
                                    "training.grad_accum": 2, "training.batch_size": 2, "checkpoint.enabled": False})
    run = run_lib.setup(cfg, jax.devices()[:1])
    params = state_lib.init_state(run, 0)["params"]
    tokens = np.random.default_rng(0).integers(0, 65, (2, 2, 33)).astype(np.int32)
    batch = {"inputs": tokens[..., :-1], "targets": tokens[..., 1:]}

    def step():  # a new function each time: jit and make_jaxpr cache their traces by the function
        return lambda p, b: step_lib.loss_and_grads(objectives.get("next_token"), p, b, run.cfg, jax.random.key(0))

    n_weights = len(jax.tree.leaves(quant.step_weights(params, cfg.model))) // 2
    outer = lambda: [e.primitive.name for e in jax.make_jaxpr(step())(params, batch).eqns]  # noqa: E731
    assert n_weights == 6 and outer().count("reduce_max") == n_weights  # q, k, v, o, up, down; once each
    (loss, _), grads = jax.jit(step())(params, batch)
    monkeypatch.setattr(quant, "step_weights", lambda params, model_cfg: {})  # each matmul quantizes its weight
    assert outer().count("reduce_max") == 0
    (ref_loss, _), ref = jax.jit(step())(params, batch)
    assert float(loss) == float(ref_loss)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_fp8_matches_e4m3_e5m2_reference():
    x, w, g = operands(2)

    def np_fp8(a, fmt):
        s = np.abs(a).max() / quant.FP8_MAX[fmt]
        dt = ml_dtypes.float8_e4m3fn if fmt == "e4m3" else ml_dtypes.float8_e5m2
        return (a / s).astype(dt).astype(np.float64) * s

    recipe = quant.Recipe("fp8")
    y = np.asarray(quant.qdot(SPEC, jnp.asarray(x), jnp.asarray(w), recipe))
    np.testing.assert_allclose(y, np.einsum(SPEC, np_fp8(x, "e4m3"), np_fp8(w, "e4m3")), rtol=1e-4, atol=1e-5)
    dx, dw = grads(recipe, x, w, g)
    np.testing.assert_allclose(dx, np.einsum("BTNH,DNH->BTD", np_fp8(g, "e5m2"), np_fp8(w, "e4m3")),
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dw, np.einsum("BTD,BTNH->DNH", np_fp8(x, "e4m3"), np_fp8(g, "e5m2")),
                               rtol=1e-4, atol=1e-5)
    exact = np.einsum(SPEC, x.astype(np.float64), w)
    assert 0.005 < np.linalg.norm(y - exact) / np.linalg.norm(exact) < 0.08  # 3 mantissa bits: ~2^-4 / sqrt(3)
    assert "no fp8 matmul units" in quant.fp8_fallback_message(jax.devices()[0])


@pytest.mark.slow
def test_model_paths(char_data):
    cfg = tiny_config(char_data, **{"model.vocab_size": 65, "model.quant_logits": True})
    run = run_lib.setup(cfg, jax.devices()[:1])
    params = state_lib.init_state(run, 0)["params"]
    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, 65)
    ref = forward(params, tokens, cfg.model)
    for mode, tol in [("int8", 0.02), ("fp8", 0.1), ("int8_weights", 0.01)]:
        got = forward(params, tokens, dataclasses.replace(cfg.model, quantization=mode))
        rel = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
        assert 1e-5 < rel < tol, (mode, rel)
    stored = quant.quantize_params(params, cfg.model)
    assert stored["layers"]["attn"]["o"].value.dtype == jnp.int8
    assert stored["layers"]["attn"]["o"].scale.shape == (2, 1, 1, 32)  # per layer and output channel
    assert stored["embed"]["tokens"].scale.shape == (65, 1)  # tied and quant_logits: one scale per row
    assert quant.nbytes(stored) < 0.3 * quant.nbytes(params)
    # Float weights under int8_weights round as quantize_params stores them, so both give the same logits
    # (without quant_logits: a stored tied table would also make the embedding lookup int8).
    m = dataclasses.replace(cfg.model, quant_logits=False)
    np.testing.assert_allclose(forward(quant.quantize_params(params, m), tokens, m),
                               forward(params, tokens, dataclasses.replace(m, quantization="int8_weights")),
                               rtol=1e-5, atol=1e-5)


def test_int8_train_step_hlo_has_integer_dots(char_data):
    cfg = tiny_config(char_data, **{"model.quantization": "int8", "model.vocab_size": 65})
    run = run_lib.setup(cfg, jax.devices()[:1])
    step = step_lib.make_train_step(run.cfg, run.optimizer, run.mesh, run.abstract_state)
    xs = jax.ShapeDtypeStruct((1, 8, 32), jnp.int32)
    lowered = step.lower(run.abstract_state, {"inputs": xs, "targets": xs})
    int_dots = re.findall(r"stablehlo\.dot_general.*\(tensor<[0-9x]+xi8>, tensor<[0-9x]+xi8>\) -> tensor<[0-9x]+xi32>",
                          lowered.as_text())
    # q, k, v, o, up, down in the scanned block: one forward and two backward matmuls each.
    assert len(int_dots) == 18
    compiled = lowered.compile().as_text()
    assert len(re.findall(r"= s32\[[0-9,]+\]\{[0-9,]*\} dot\(", compiled)) >= 18


@pytest.mark.slow
def test_int8_training_tracks_float(char_data, tmp_path):
    losses, peak_lines = {}, {}
    for mode in ("none", "int8"):
        cfg = tiny_config(char_data, tmp_path / mode, **{"model.quantization": mode, "checkpoint.enabled": False,
                                                         "training.steps": 30, "optimizer.lr": 1e-2})
        lines = []
        train.train(cfg, devices=jax.devices()[:1], log=lines.append)
        losses[mode] = train.losses_by_step(tmp_path / mode)
        peak_lines[mode] = next(line for line in lines if line.startswith("model FLOPs"))
    # MFU is against the compute dtype's peak: the header says that int8 matmuls can take it past 100%
    assert "int8 matmuls run faster than that peak, so MFU can pass 100%" in peak_lines["int8"]
    assert "MFU can pass" not in peak_lines["none"]
    assert losses["none"][30] < losses["none"][1] - 0.5
    assert abs(losses["int8"][30] - losses["none"][30]) < 0.05
    assert losses["int8"][30] != losses["none"][30]


@pytest.mark.slow
def test_eval_with_int8_weights_from_checkpoint(char_data, tmp_path, capsys):
    cfg = tiny_config(char_data, tmp_path / "run", **{"training.steps": 60, "training.eval_interval": 0,
                                                      "checkpoint.interval": 0})
    trained = train.train(cfg, devices=jax.devices()[:1], log=lambda s: None)
    same = evaluate.evaluate_run(tmp_path / "run", {"training.sample_tokens": 0}, jax.devices()[:1], lambda s: None)
    assert same["val_loss"] == pytest.approx(trained["val_loss"], rel=1e-6)
    q = evaluate.evaluate_run(tmp_path / "run", {"model.quantization": "int8_weights", "training.sample_tokens": 40},
                              jax.devices()[:1], lambda s: None)
    assert q["float_val_loss"] == pytest.approx(trained["val_loss"], rel=1e-6)
    assert 0 < abs(q["val_loss"] - q["float_val_loss"]) < 0.02
    assert q["param_bytes"] < 0.5 * q["float_param_bytes"] and len(q["sample"]) == 40

    assert cli.main(["eval", str(tmp_path / "nowhere")]) == 2
    assert cli.main(["train", "shakespeare_char_cpu", "model.quantization=int8_weights"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: {tmp_path / 'nowhere'} holds no config.json; pass the run_dir of a training run",
                   "error: model.quantization=int8_weights is for inference and cannot be trained; train with none, "
                   "int8 or fp8, then `jaxlm eval RUN_DIR model.quantization=int8_weights`"]
    with pytest.raises(ConfigError, match=r"model.quantization='int4' is not allowed .*none, int8, fp8, int8_weights"):
        config_lib.load("shakespeare_char_cpu", ["model.quantization=int4"])
