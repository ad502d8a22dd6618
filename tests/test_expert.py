"""Expert parallelism on 8 fake CPU devices: the layer and 20 training steps against one device, the
all-to-all and the smaller expert temporaries in the compiled programs, the capacity factor's drops, and
checkpoints across layouts."""

import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from jaxlm import sharding
from jaxlm.store import checkpoint as ckpt
from jaxlm.train import batches as batch_lib, loop as train, run as run_lib, state as state_lib, step as step_lib
from jaxlm.config import ConfigError, MeshConfig
from jaxlm.data import loader as loader_lib
from jaxlm.model import expert_parallel, layers, moe, transformer
from test_parallel import _state_hash

E, K, D, F = 8, 2, 16, 24
SWIGLU = layers.Activation("silu", True)
MIXTRAL = {"model.vocab_size": 128, "model.n_layers": 2, "model.n_experts": E, "model.experts_per_token": K,
           "model.norm": "rmsnorm", "model.position": "rotary", "model.glu": True, "model.activation": "silu",
           "model.d_ff": 64}


def _layer(seed=0, B=8, T=8):
    """Weights and inputs of one MoE layer with uneven routing: a constant input feature draws every token to
    expert 0 and keeps it away from expert 3."""
    ks = jax.random.split(jax.random.key(seed), 5)
    p = {"router": jax.random.normal(ks[0], (D, E)), "gate": jax.random.normal(ks[1], (E, D, F)) * 0.3,
         "up": jax.random.normal(ks[2], (E, D, F)) * 0.3, "down": jax.random.normal(ks[3], (E, F, D)) * 0.3}
    p["router"] = p["router"].at[0, 0].set(3.0).at[0, 3].set(-10.0)
    return p, jax.random.normal(ks[4], (B, T, D)).at[..., 0].set(3.0)


def _on(mesh, f):
    def g(*args):
        with sharding.activation_sharding(mesh):
            return f(*args)
    return jax.jit(g)


def _layer_loss(x, p, cf=0.0):
    y, stats = moe.moe(x, p, SWIGLU, moe.Router(K), cf)
    return jnp.sum(y.astype(jnp.float32) ** 2) + moe.load_balancing_loss(stats[None])


@pytest.mark.parametrize("axes, T, steps", [
    ({"ici_data": 2, "ici_expert": 4}, 8, 4),  # 64 rows received per device, 4 steps of 16 rows
    ({"ici_data": 2, "ici_expert": 4}, 2, 1),  # 16 rows: one step
    ({"ici_fsdp": 2, "ici_tensor": 2, "ici_expert": 2}, 7, 3)])  # buckets of 28 rows in 3 steps of 10
def test_layer_matches_one_device(axes, T, steps, monkeypatch):
    """Output, routing statistics and gradients of the expert-parallel layer equal the one-device layer's,
    with the exchange in one step or several (rows padded to equal steps), with FSDP and tensor-parallel
    expert width composed; the compiled layer moves tokens with all-to-all."""
    p, x = _layer(T=T)
    y0, s0 = jax.jit(lambda x, p: moe.moe(x, p, SWIGLU, moe.Router(K)))(x, p)
    g0 = jax.jit(jax.grad(_layer_loss, argnums=(0, 1)))(x, p)
    assert np.asarray(s0[0])[0] > 0.8 and np.asarray(s0[0])[3] == 0  # uneven: an even share is K / E
    seen = []
    steps_of = expert_parallel._steps
    monkeypatch.setattr(expert_parallel, "_steps", lambda *a: seen.append(steps_of(*a)) or seen[-1])
    mesh = sharding.make_mesh(MeshConfig(**axes))
    layer = _on(mesh, lambda x, p: moe.moe(x, p, SWIGLU, moe.Router(K)))
    y, s = layer(x, p)
    g = _on(mesh, jax.grad(_layer_loss, argnums=(0, 1)))(x, p)
    np.testing.assert_allclose(y, y0, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s, s0, rtol=1e-6, atol=1e-7)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(jnp.abs(b).max()))
    assert "all-to-all" in layer.lower(x, p).compile().as_text()
    assert set(seen) == {steps}


def test_auto_is_ragged_dot_off_a_tpu():
    """model.moe_matmul=auto takes megablox only where the program runs on a TPU (test_aot.py compiles one for a
    v5e from this host): on the CPU, with or without a mesh, ragged_dot; a named dispatch stays as named."""
    assert moe.grouped_matmul("auto") == "ragged_dot" and moe.grouped_matmul("megablox") == "megablox"
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    with sharding.activation_sharding(mesh):
        assert moe.grouped_matmul("auto") == "ragged_dot"


def test_megablox_values_and_gradients_equal_ragged_dots():
    """model.moe_matmul=megablox (JAX's Pallas kernel, interpreted on the CPU) against ragged_dot: the layer's output,
    statistics and gradients, on one device in float32 and bf16 (the 56 token copies padded to the kernel's row tile;
    expert 3 gets none) and expert-parallel with FSDP and tensor-parallel expert width (each device's buffers hold
    unfilled rows past the groups, which the kernel never writes: interpret mode fills them with NaN)."""
    p, x = _layer(T=7)

    def run(matmul, dtype=jnp.float32):
        def loss(x, p):
            y, stats = moe.moe(x.astype(dtype), p, SWIGLU, moe.Router(K), matmul=matmul)
            return jnp.sum(y.astype(jnp.float32) ** 2) + moe.load_balancing_loss(stats[None]), (y, stats)
        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)

    (_, (y0, s0)), g0 = jax.jit(run("ragged_dot"))(x, p)
    (_, (y1, s1)), g1 = jax.jit(run("megablox"))(x, p)
    assert np.asarray(s0[0])[3] == 0
    np.testing.assert_allclose(y1, y0, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(s1, s0)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(jnp.abs(b).max()))
    (_, (yb0, _)), gb0 = jax.jit(run("ragged_dot", jnp.bfloat16))(x, p)
    (_, (yb1, _)), gb1 = jax.jit(run("megablox", jnp.bfloat16))(x, p)
    assert yb1.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(yb1, np.float32), np.asarray(yb0, np.float32), rtol=2e-2, atol=2e-2)
    for a, b in zip(jax.tree.leaves(gb1), jax.tree.leaves(gb0)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.all(np.isfinite(a)) and np.abs(a - b).max() <= 2e-2 * np.abs(b).max()
    mesh = sharding.make_mesh(MeshConfig(ici_fsdp=2, ici_tensor=2, ici_expert=2))
    (_, (y2, s2)), g2 = _on(mesh, run("megablox"))(x, p)
    np.testing.assert_allclose(y2, y0, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s2, s0, rtol=1e-6, atol=1e-7)
    for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g0)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(jnp.abs(b).max()))
    assert moe.grouped_matmul("auto") == "ragged_dot"  # until megablox is measured faster on a chip
    # other tiles (model.moe_tiles): 320 copies in three 128-row tiles (the default's one tile of 384 rows)
    x3 = _layer(T=20)[1]
    tiled = {m: jax.jit(lambda x, p, m=m: moe.moe(x, p, SWIGLU, moe.Router(K), matmul=m, tiles=(128, 128, 128))[0])
             for m in ("ragged_dot", "megablox")}
    np.testing.assert_allclose(tiled["megablox"](x3, p), tiled["ragged_dot"](x3, p), rtol=1e-5, atol=1e-5)


def _kept_output(x, p, cf, shards):
    """The layer's output with a capacity factor, from a dense loop: each of `shards` equal blocks of tokens
    gives each expert its first ceil(cf * m * K / E) copies in token order; the rest add nothing."""
    xs = np.asarray(x, np.float64).reshape(-1, D)
    w = {k: np.asarray(v, np.float64) for k, v in p.items()}
    m = len(xs) // shards
    cap = math.ceil(cf * m * K / E)
    y, dropped = np.zeros_like(xs), 0
    for s in range(shards):
        taken = np.zeros(E, int)
        for t in range(s * m, (s + 1) * m):
            logits = xs[t] @ w["router"]
            probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
            top = np.argsort(-probs)[:K]
            for e in top:
                taken[e] += 1
                if taken[e] > cap:
                    dropped += 1
                    continue
                g = xs[t] @ w["gate"][e]
                y[t] += probs[e] / probs[top].sum() * ((g / (1 + np.exp(-g)) * (xs[t] @ w["up"][e])) @ w["down"][e])
    return y, dropped


@pytest.mark.parametrize("B", [8, 16])  # the exchange with a capacity factor of 1 in one step, in two
def test_capacity_factor_drops_counted_copies(B, monkeypatch):
    """A capacity factor large enough for every copy equals dropless; a small one drops the copies a dense loop
    over each device's tokens drops (counted in the statistics) and leaves their weight to the residual."""
    p, x = _layer(B=B)
    seen = []
    steps_of = expert_parallel._steps
    monkeypatch.setattr(expert_parallel, "_steps", lambda *a: seen.append(steps_of(*a)) or seen[-1])
    mesh = sharding.make_mesh(MeshConfig(ici_data=2, ici_expert=4))
    dropless = _on(mesh, lambda x, p: moe.moe(x, p, SWIGLU, moe.Router(K)))(x, p)
    roomy = _on(mesh, lambda x, p: moe.moe(x, p, SWIGLU, moe.Router(K), float(E)))(x, p)
    np.testing.assert_array_equal(roomy[0], dropless[0])
    assert float(roomy[1][2].sum()) == 0
    y, stats = _on(mesh, lambda x, p: moe.moe(x, p, SWIGLU, moe.Router(K), 1.0))(x, p)
    y_ref, dropped = _kept_output(x, p, 1.0, shards=8)
    assert dropped > 0
    assert round(float(stats[2].sum()) * x.shape[0] * x.shape[1]) == dropped
    np.testing.assert_allclose(np.asarray(y).reshape(-1, D), y_ref, atol=1e-4)
    np.testing.assert_array_equal(stats[:2], dropless[1][:2])  # routing is the same; only the work differs
    assert seen[-1] == B // 8  # the capped exchange ran in the steps the parameter names


@pytest.mark.parametrize("B, dropless_at_most, capped_at_most",
                         [(8, 0.54, 0.32), (16, 0.28, 0.17), (64, 0.08, 0.08)])
def test_expert_temporaries_shrink_with_the_expert_axis(B, dropless_at_most, capped_at_most, monkeypatch):
    """The layer's gradient compiled for expert=4 x data=2 (B x 32 tokens), against the program the same mesh
    ran before expert parallelism (the weights split by the rules, no dispatch: XLA gathers every device's
    tokens over the expert axis instead). Dropless buffers hold the worst case, 4 times the even share here,
    but the exchange runs in steps of at least D rows, so past a few hundred tokens per device dropless costs
    about what a capacity factor of 1 does. With 32 tokens per device (B=8) the weights' gradients dominate
    and the exchange runs in one step."""
    Dm, Fm = 256, 512
    p = {"router": jnp.zeros((Dm, E)), "gate": jnp.zeros((E, Dm, Fm)), "up": jnp.zeros((E, Dm, Fm)),
         "down": jnp.zeros((E, Fm, Dm))}
    axes = {"gate": ("experts", "embed", "mlp"), "up": ("experts", "embed", "mlp"),
            "down": ("experts", "mlp", "embed"), "router": ("embed", None)}
    mesh = sharding.make_mesh(MeshConfig(ici_data=2, ici_expert=4))
    p_sh = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=jax.sharding.NamedSharding(
        mesh, sharding.spec(axes[k], sharding.PARAM_RULES))) for k, v in p.items()}
    x_sh = jax.ShapeDtypeStruct((B, 32, Dm), jnp.float32, sharding=jax.sharding.NamedSharding(
        mesh, sharding.spec(("batch", "length", None), sharding.ACTIVATION_RULES)))

    def temporaries(cf):
        grad = _on(mesh, jax.grad(lambda x, p: _layer_loss(x, p, cf), argnums=1))
        return grad.lower(x_sh, p_sh).compile().memory_analysis().temp_size_in_bytes

    dropless, capped = temporaries(0.0), temporaries(1.0)
    monkeypatch.setattr(expert_parallel, "plan", lambda x_BTD, n_experts: None)
    before = temporaries(0.0)
    assert dropless < dropless_at_most * before and capped < capped_at_most * before, (dropless, capped, before)


def test_expert_parallel_setting_errors(char_data, tmp_path):
    p, x = _layer()
    with pytest.raises(ConfigError, match="expert axis of 3 devices does not divide model.n_experts=8"):
        _on(sharding.make_mesh(MeshConfig(ici_expert=3), jax.devices()[:3]),
            lambda x, p: moe.moe(x, p, SWIGLU, moe.Router(K)))(x[:6], p)
    with pytest.raises(ConfigError, match="expert_capacity_factor=-1.0 must be >= 0"):
        tiny_config(char_data, tmp_path, **{"model.expert_capacity_factor": -1.0})
    with pytest.raises(ConfigError, match="model.expert_all_to_all"):
        tiny_config(char_data, tmp_path, **{"model.expert_all_to_all": "fast"})
    with pytest.raises(ConfigError, match="model.moe_matmul"):
        tiny_config(char_data, tmp_path, **{"model.moe_matmul": "pallas"})
    assert tiny_config(char_data, tmp_path, **{"model.moe_tiles": "256, 512,1024"}).model.megablox_tiles == (256, 512,
                                                                                                       1024)
    assert tiny_config(char_data, tmp_path).model.megablox_tiles is None  # layers.MEGABLOX_TILES
    for bad in ("256,512", "100,128,128", "a,b,c", "0,128,128", "128,128,128,128"):
        with pytest.raises(ConfigError, match=r"model.moe_tiles='.*' must be three multiples of 128 \(rows, "):
            tiny_config(char_data, tmp_path, **{"model.moe_tiles": bad})
    # A batch the mesh does not split (a single decoded token) runs the layer as on one device.
    mesh = sharding.make_mesh(MeshConfig(ici_data=2, ici_expert=4))
    assert not expert_parallel.uses_ragged(mesh, "auto")  # XLA:CPU has no ragged all-to-all
    with pytest.raises(ConfigError, match="model.expert_all_to_all=ragged needs TPU devices"):
        expert_parallel.uses_ragged(mesh, "ragged")
    with sharding.activation_sharding(mesh):
        assert expert_parallel.plan(x[:1, :1], E) is None and expert_parallel.plan(x, E) is not None


def _uneven(params):
    """Tilts the routing of every layer: a constant embedding feature, which the router turns into a strong
    preference for expert 0 and against expert 3."""
    params = jax.tree.map(lambda a: a, params)
    tokens = params["embed"]["tokens"]
    params["embed"]["tokens"] = jax.device_put(tokens.at[:, 0].set(1.0), tokens.sharding)
    if "router" not in params["layers"]["mlp"]:  # a dense model
        return params
    router = params["layers"]["mlp"]["router"]
    params["layers"]["mlp"]["router"] = jax.device_put(router.at[:, 0, 0].add(1.0).at[:, 0, 3].add(-1.0),
                                                       router.sharding)
    return params


def _losses(char_data, tmp_path, devices, steps=20, **overrides):
    cfg = tiny_config(char_data, tmp_path, **{**MIXTRAL, "training.batch_size": 16, **overrides})
    run = run_lib.setup(cfg, devices)
    state = state_lib.init_state(run, cfg.seed)
    state["params"] = _uneven(state["params"])
    step = step_lib.make_train_step(run.cfg, run.optimizer, run.mesh, run.abstract_state, run.act_rules)
    rng = np.random.default_rng(0)
    losses, aux = [], None
    for i in range(steps):
        batch = batch_lib.device_batch(run, "train", loader_lib.Windows(rng.integers(0, 100_000, size=(1, 16))))
        if i == 0:
            with sharding.activation_sharding(run.mesh, run.act_rules):
                aux = jax.jit(lambda p, t: transformer.forward_with_aux(p, t, run.cfg.model)[1])(
                    state["params"], batch["inputs"][0])
        state, m = step(state, batch)
        losses.append(m["loss"])
    return np.array(jax.device_get(losses)), float(aux)


@pytest.mark.slow
@pytest.mark.in_ci
def test_training_with_expert_parallelism_matches_one_device(char_data, tmp_path):
    """20 steps of a tiny Mixtral (8 experts, top-2, routing tilted towards one expert) at expert=4 x data=2
    give the losses of one device; the load-balancing loss shows how uneven the routing is (1 when even)."""
    ref, aux_ref = _losses(char_data, tmp_path / "one", jax.devices()[:1])
    losses, aux = _losses(char_data, tmp_path / "ep", jax.devices(), **{"mesh.ici_data": 2, "mesh.ici_expert": 4})
    assert aux_ref > 1.5 and aux == pytest.approx(aux_ref, rel=1e-5)
    assert ref[-1] < ref[0] - 0.3
    np.testing.assert_allclose(losses, ref, rtol=1e-5)


@pytest.mark.slow
def test_checkpoints_restore_across_expert_layouts(char_data, tmp_path):
    """A run at expert=4 saves at steps 10 and 20; one device restores the same bits and, resumed from step
    10, repeats its losses; that run's own step 20 restores at expert=4 to the same bits as on one device."""
    common = {**MIXTRAL, "training.batch_size": 16, "training.eval_interval": 0}
    ep = {"mesh.ici_data": 2, "mesh.ici_expert": 4}
    train.train(tiny_config(char_data, tmp_path / "ep", **common, **ep), jax.devices(), log=lambda s: None)

    def hashes(run_dir):
        out = set()
        for mesh, devices in ((ep, 8), ({"mesh.ici_data": 1}, 1)):
            run = run_lib.setup(tiny_config(char_data, run_dir, **common, **mesh), jax.devices()[:devices])
            out.add(_state_hash(ckpt.restore_newest(run_dir, run.abstract_state, log=lambda s: None)[1]))
        return out

    assert len(hashes(tmp_path / "ep")) == 1
    shutil.copytree(tmp_path / "ep" / "checkpoints" / "10", tmp_path / "one" / "checkpoints" / "10")
    train.train(tiny_config(char_data, tmp_path / "one", **common), jax.devices()[:1], log=lambda s: None)
    a, b = train.losses_by_step(tmp_path / "ep"), train.losses_by_step(tmp_path / "one")
    assert sorted(b) == list(range(11, 21))
    np.testing.assert_allclose([b[s] for s in range(11, 21)], [a[s] for s in range(11, 21)], rtol=1e-5)
    assert len(hashes(tmp_path / "one")) == 1


# Tiny models of the 2025-26 families (the options of tests/test_hf_families.py's checkpoints, char data).
FAMILIES = {
    "gemma3": {"model.n_experts": 0, "model.n_layers": 4, "model.layer_pattern": "local,local,global",
               "model.sliding_window": 8, "model.local_rope_theta": 10000.0, "model.rope_theta": 1e6,
               "model.rope_scaling": "linear", "model.norm_plus_one": True, "model.embed_scale": True,
               "model.post_norms": True, "model.activation": "gelu_tanh", "model.attn_scale": 24.0},
    "qwen3_moe": {"model.n_layers": 3, "model.qk_norm": True, "model.expert_d_ff": 24, "model.first_dense_layers": 1,
                  "model.router_norm_topk": True},
    "gpt_oss": {"model.layer_pattern": "local,global", "model.sliding_window": 8, "model.qkv_bias": True,
                "model.attn_out_bias": True, "model.attn_sinks": True, "model.router_bias": True,
                "model.expert_bias": True, "model.swiglu_limit": 7.0, "model.rope_scaling": "yarn",
                "model.rope_scaling_factor": 4.0, "model.rope_original_context": 16},
    "llama4": {"model.n_layers": 4, "model.layer_pattern": "chunked,chunked,chunked,nope",
               "model.attention_chunk": 8, "model.qk_norm": False, "model.qk_l2_norm": True,
               "model.attn_temperature_tuning": True, "model.attn_temperature_floor": 4, "model.moe_layer_interval": 2,
               "model.n_shared_experts": 1, "model.experts_per_token": 1, "model.router_score": "sigmoid",
               "model.router_norm_topk": False, "model.router_weights_input": True, "model.expert_d_ff": 24},
    "deepseek_v3": {"model.n_layers": 3, "model.qk_norm": False, "model.kv_lora_rank": 16, "model.q_lora_rank": 16,
                    "model.qk_nope_head_dim": 8, "model.qk_rope_head_dim": 8, "model.v_head_dim": 8,
                    "model.first_dense_layers": 1, "model.n_shared_experts": 1, "model.router_score": "sigmoid",
                    "model.router_groups": 2, "model.router_topk_groups": 1, "model.router_scale": 2.5,
                    "model.router_balance_bias": True, "model.expert_d_ff": 24, "model.rope_scaling": "yarn",
                    "model.rope_scaling_factor": 4.0, "model.rope_original_context": 16,
                    "model.rope_yarn_mscale_all_dim": 1.0, "model.mtp_layers": 1},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_new_families_train_with_fsdp_and_experts_as_on_one_device(name, char_data, tmp_path):
    """10 steps of a tiny model of each family (MoE routing tilted towards one expert) on 8 devices, FSDP 2 x
    expert 2 x tensor 2, give the losses of one device to 1e-5, and the loss falls. DeepSeek's multi-token
    prediction loss and balancing bias are in its step; Gemma 3 (dense: the expert axis splits the batch) has
    a last partial repeat of its pattern."""
    fast = {**FAMILIES[name], "optimizer.lr": 3e-3}
    ref, aux_ref = _losses(char_data, tmp_path / "one", jax.devices()[:1], steps=10, **fast)
    losses, aux = _losses(char_data, tmp_path / "mesh", jax.devices(), steps=10, **fast,
                          **{"mesh.ici_data": 1, "mesh.ici_fsdp": 2, "mesh.ici_expert": 2, "mesh.ici_tensor": 2})
    assert aux == pytest.approx(aux_ref, rel=1e-5) and (aux_ref > 1.0 or name == "gemma3")
    assert ref[-1] < ref[0] - 0.3
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
