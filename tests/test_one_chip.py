"""Big models on one chip (docs/finetune.md, "An 8B model on one chip"): the nf4 layout against a plain
re-implementation of bitsandbytes' blocking, the quantized base's other weights in the compute dtype, the MLP in
chunks of positions against the whole (values and gradients, with a 4-bit base under adapters), the init donating
its weights, and the step compiled before any state exists refusing, in one line, a step that cannot fit."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from jaxlm import config as config_lib, params as P, sharding
from jaxlm.config import ConfigError
from jaxlm.model import lora, param_specs, quant, transformer
from jaxlm.train import preflight, run as run_lib, state as state_lib, step as step_lib


def test_the_refusal_names_the_batch_that_fits():
    """The batch a refused step would fit at, from the compiler's figure: the bytes beyond the arguments scale
    with the batch (openwebtext's 128 rows of 1,024 needing 121 GiB on a 15.75 GiB chip: 13 rows would fit,
    so 8), and none where the state alone leaves no room for a row (maxtext_base's float32 state)."""
    G = preflight.GiB
    assert preflight.fitting_batch(128, 121 * G, int(1.5 * G), int(15.75 * G)) == 8
    assert preflight.fitting_batch(8, 33 * G, int(12.5 * G), int(15.75 * G)) is None
    assert preflight.fitting_batch(4, 20 * G, 4 * G, int(15.75 * G)) == 2  # 2.5 rows fit
    assert preflight.fitting_batch(1, 20 * G, 4 * G, int(15.75 * G)) is None
    assert preflight.fitting_batch(8, None, 4 * G, int(15.75 * G)) is None


def nf4_reference(w: np.ndarray) -> np.ndarray:
    """w [I, O] through NF4 as bitsandbytes blocks a torch weight [O, I]: 64 consecutive inputs of one output a
    block, each scaled by its absolute maximum to the nearest level, then scaled back (absmax kept exact)."""
    levels = np.asarray(quant.NF4_LEVELS)
    blocks = w.T.reshape(w.shape[1], -1, 64)
    absmax = np.abs(blocks).max(-1, keepdims=True)
    nearest = levels[np.abs((blocks / absmax)[..., None] - levels).argmin(-1)]
    return (nearest * absmax).reshape(w.shape[1], w.shape[0]).T


def test_nf4_blocks_along_the_inputs_as_bitsandbytes_does():
    w = np.random.default_rng(0).normal(size=(256, 96)).astype(np.float32)
    q = quant.quantize_nf4(jnp.asarray(w), 1, 1)
    assert q.codes.shape == (128, 96) and q.codes.dtype == jnp.uint8 and q.absmax_q.shape == (4, 96)
    back = np.asarray(quant.dequantize_nf4(q, jnp.float32))
    ref = nf4_reference(w)
    # the only difference is double quantization: each block's absmax stored as int8 around its column's mean
    spread = np.abs(np.abs(w.T.reshape(96, -1, 64)).max(-1) - np.abs(w.T.reshape(96, -1, 64)).max(-1).mean(-1,
                                                                                                     keepdims=True))
    step = spread.max(-1) / 127  # one int8 step of each column's absmax
    assert np.all(np.abs(back - ref) <= step[None, :] / 2 + 1e-6)
    assert np.abs(back - ref).max() < 0.02 and np.sqrt(np.mean((back - w) ** 2)) < 0.12
    # a weight of several input axes ([N, H, D], "o") and of several output axes ([D, N, H], "q") round-trips shape
    o = jax.random.normal(jax.random.key(1), (2, 4, 32, 48))
    assert quant.dequantize_nf4(quant.quantize_nf4(o, 2, 1), jnp.float32).shape == o.shape
    qw = jax.random.normal(jax.random.key(2), (2, 128, 4, 16))
    q2 = quant.quantize_nf4(qw, 1, 2)
    assert q2.codes.shape == (2, 64, 64)
    assert float(jnp.abs(quant.dequantize_nf4(q2, jnp.float32) - qw).mean()) < 0.1


def _model(**over):
    cfg = config_lib.load("quickstart", {"model.block_size": 64, "model.vocab_size": 256, "model.glu": True,
                                         "lora.rank": 4, "lora.base_quantization": "nf4", **over})
    return cfg


def test_a_quantized_base_keeps_its_other_weights_in_the_compute_dtype():
    cfg = _model(**{"model.compute_dtype": "bfloat16"})
    specs = lora.frozen_specs(cfg)
    assert specs["embed"]["tokens"].dtype == "bfloat16" and specs["final_norm"]["scale"].dtype == "bfloat16"
    assert isinstance(specs["layers"]["mlp"]["up"], quant.NF4Weight)
    # the unquantized LoRA run keeps the param dtype: nothing changes without lora.base_quantization
    plain = lora.frozen_specs(cfg.replace(lora=dataclasses.replace(cfg.lora, base_quantization="none")))
    assert plain["embed"]["tokens"].dtype == "float32"


def test_the_mlp_in_chunks_of_positions_equals_the_whole():
    cfg = _model(**{"model.compute_dtype": "float32"})
    m = cfg.model
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    base = P.init(param_specs(m), jax.random.key(0), mesh)
    frozen = lora.quantize_base(base, cfg)
    adapters = jax.tree.map(lambda a: 0.1 * jax.random.normal(jax.random.key(3), a.shape),
                            P.init(lora.specs(cfg), jax.random.key(1), mesh))
    tokens = jax.random.randint(jax.random.key(2), (2, 64), 0, m.vocab_size)

    def loss(ad, model_cfg):
        logits = transformer.forward(lora.attach(frozen, ad, cfg), tokens, model_cfg)
        return jax.nn.log_softmax(logits.astype(jnp.float32))[..., 0].mean()

    whole, g_whole = jax.value_and_grad(loss)(adapters, m)
    chunked, g_chunked = jax.value_and_grad(loss)(adapters, dataclasses.replace(m, mlp_chunk_tokens=16))
    np.testing.assert_allclose(float(chunked), float(whole), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g_chunked), jax.tree.leaves(g_whole)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-6)  # float32 sums
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g_whole)) > 1e-3  # the adapters do get gradients
    # a chunk that does not divide the sequence leaves the MLP whole
    odd, _ = jax.value_and_grad(loss)(adapters, dataclasses.replace(m, mlp_chunk_tokens=24))
    assert float(odd) == float(whole)


def test_the_init_donates_its_weights(char_data, tmp_path):
    run = run_lib.setup(tiny_config(char_data, tmp_path), jax.devices()[:1])
    shapes = state_lib.placed(run.specs, run.mesh, run.param_rules)
    compiled = state_lib._state_from_params(run).lower(shapes).compile()
    weights = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(shapes))
    assert compiled.memory_analysis().alias_size_in_bytes == weights  # the state holds them, not a copy of them


def test_the_refusal_names_settings_that_fit_together_by_compiling_them(char_data, tmp_path):
    """`jaxlm train openwebtext` on one v5e: the preset's step needs ~121 GiB, and no one remedy alone fits it;
    the refusal also names a combination that a compile showed to fit (bf16 and, for the preset's remat none,
    remat minimal before remat full, the batch halved as needed)."""
    run = run_lib.setup(tiny_config(char_data, tmp_path), jax.devices()[:1])
    whole = preflight._compiled_bytes(run, 2**40)
    lean = config_lib.apply_overrides(run.cfg, {"model.param_dtype": "bfloat16", "model.remat": "full",
                                                "training.per_device_batch_size": 2.0, "training.grad_accum": 4})
    limit = (whole + preflight._compiled_bytes(run_lib.setup(lean, jax.devices()[:1], data=False), 2**40)) // 2
    with pytest.raises(ConfigError) as e:
        preflight.check(run, limit=limit)
    line = str(e.value)
    assert "\n" not in line and ": these fit together: model.param_dtype=bfloat16 model.remat=minimal" in line, line
    named = dict(kv.split("=") for kv in line.split("these fit together: ")[1].split(" (compiled")[0].split())
    assert "; or make it fit with model.param_dtype=bfloat16" in line, line
    fitting = run_lib.setup(config_lib.apply_overrides(run.cfg, named), jax.devices()[:1], data=False)
    assert preflight._compiled_bytes(fitting, 2**40) <= limit < whole
    assert float(named.get("training.per_device_batch_size", 8)) * int(named.get("training.grad_accum", 1)) == 8


def test_a_step_that_cannot_fit_stops_in_one_line_before_any_state(char_data, tmp_path):
    run = run_lib.setup(tiny_config(char_data, tmp_path), jax.devices()[:1])
    assert run.cfg.model.param_dtype == "float32"
    with pytest.raises(ConfigError) as e:
        preflight.check(run, limit=2**16)
    line = str(e.value)
    assert "\n" not in line and "needs" in line and "per device" in line, line
    for remedy in ("model.param_dtype=bfloat16", "lora.rank=16 lora.base_quantization=nf4", "more devices"):
        assert remedy in line, line
    # with room, the same call hands back the compiled step, whose losses are the jitted step's
    compiled = preflight.check(run, limit=2**40)
    jitted = step_lib.make_train_step(run.cfg, run.optimizer, run.mesh, run.abstract_state, run.act_rules)
    rng = np.random.default_rng(0)
    batch = {k: jnp.asarray(rng.integers(0, 65, a.shape), a.dtype) for k, a in step_lib.abstract_batch(run).items()}
    losses = {}
    for name, step in (("compiled", compiled), ("jitted", jitted)):
        state, out = state_lib.init_state(run, 0), []
        for _ in range(2):
            state, m = step(state, batch)
            out.append(float(m["loss"]))
        losses[name] = out
    assert losses["compiled"] == losses["jitted"]
