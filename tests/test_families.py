"""Family options and presets: published parameter counts from abstract shapes, sliding-window masks,
the mixture-of-experts dispatch against a dense reference, and layer patterns that still scan."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm import config as config_lib, params as P, sharding
from jaxlm.config import ConfigError, MeshConfig, ModelConfig
from jaxlm.model import attention, forward, forward_with_aux, layers, moe, param_specs

# Parameter counts of the released checkpoints (the figures their model cards and safetensors report).
PUBLISHED = {
    "gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080, "gpt2-xl": 1_557_611_200,
    "llama2-7b": 6_738_415_616, "llama2-13b": 13_015_864_320, "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496, "llama3.1-8b": 8_030_261_248,
    "llama3.2-1b": 1_235_814_400, "llama3.2-3b": 3_212_749_824,
    "mistral-7b": 7_241_732_096, "mixtral-8x7b": 46_702_792_704, "gemma-2b": 2_506_172_416,
    "gemma-7b": 8_537_680_896, "gemma2-2b": 2_614_341_888, "gemma2-9b": 9_241_705_984,
    "gemma2-27b": 27_227_128_320, "qwen3-0.6b": 596_049_920, "qwen3-8b": 8_190_735_360,
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_preset_parameter_count_matches_published_figure(name):
    cfg = config_lib.load(name)
    assert P.count(param_specs(cfg.model)) == PUBLISHED[name]  # shapes only: nothing is allocated


# The 2025-26 families as their makers publish them: total and active parameters per token, in billions, to
# the digits they give, and which active count they mean: "active" (every weight a token uses, the embedding
# table included: Meta, Qwen) or "active_matmul" (without the input embedding table, of which a token reads
# one row: OpenAI, DeepSeek, Moonshot). Text models: Gemma 3's totals are its report's embedding +
# non-embedding columns plus the 417M vision encoder for the 4B, 12B and 27B, whose presets have their tower
# (4.3B, 12.2B, 27.4B); DeepSeek-V3's 671B leaves out its 11.6B
# multi-token prediction module (685B on the hub).
PUBLISHED_2025 = {
    "qwen3-30b-a3b": ("30.5", None, "active"), "qwen3-235b-a22b": ("235", "22", "active"),
    "deepseek-v3": ("671", "37", "active_matmul"), "kimi-k2": ("1e3", "32", "active_matmul"),
    "gpt-oss-20b": ("20.91", "3.61", "active_matmul"), "gpt-oss-120b": ("116.83", "5.13", "active_matmul"),
    "gemma3-1b": ("1.00", None, "active"), "gemma3-4b": ("4.30", None, "active"),
    "gemma3-12b": ("12.2", None, "active"), "gemma3-27b": ("27.4", None, "active"),
    "llama4-scout": (None, "17", "active"), "llama4-maverick": ("4e2", "17", "active"),
}


def significant(x: float, published: str) -> float:
    """x rounded to the significant digits of a published figure ("4e2": one digit, "20.91": four)."""
    mantissa = published.split("e")[0].replace(".", "").lstrip("0")
    return float(f"{x:.{len(mantissa)}g}")


@pytest.mark.parametrize("name", PUBLISHED_2025)
def test_2025_presets_have_the_published_parameter_counts(name):
    """Total and active parameters (flops.param_counts, from abstract shapes) equal the published figures to
    their digits. Not checked: Llama 4 Scout's 109B total, which includes its vision encoder (the text model
    is 107.8B), and Qwen3-30B-A3B's "3.3B activated", which its model card truncates from 3.35B (checked
    below as that)."""
    from jaxlm.model import flops

    total, active, convention = PUBLISHED_2025[name]
    c = flops.param_counts(config_lib.load(name).model)
    if total is not None:
        assert significant(c["total"] / 1e9, total) == float(total), (name, c)
    if active is not None:
        assert significant(c[convention] / 1e9, active) == float(active), (name, c)
    if name == "qwen3-30b-a3b":
        assert 3.3e9 <= c["active"] < 3.4e9 and significant(c["non_embedding"] / 1e9, "29.9") == 29.9


def test_describe_prints_counts_layers_flops_and_cache(capsys):
    from jaxlm import cli

    assert cli.main(["describe", "deepseek-v3"]) == 0
    out = capsys.readouterr().out
    assert "671,026,419,200 total" in out and "36.6B without the input embedding" in out
    assert "multi-token prediction modules 11,610,068,224" in out and "3 global; 58 global MoE" in out
    # 61 layers x (latent 512 + rotary key 64) x 2 bytes, against 61 x 2 x 8 x 128 x 2 for GQA with 8 kv heads
    assert "70,272 bytes" in out and "249,856" in out


def test_layer_pattern_errors_are_one_line():
    with pytest.raises(ConfigError, match="set model.sliding_window"):
        config_lib.load("quickstart", ["model.layer_pattern=local,global", "model.n_layers=4"])
    with pytest.raises(ConfigError, match="has 3 kinds, more than model.n_layers=2"):
        config_lib.load("quickstart", ["model.layer_pattern=local,global,local", "model.n_layers=2",
                                       "model.sliding_window=4"])
    with pytest.raises(ConfigError, match="has chunked layers; set model.attention_chunk"):
        config_lib.load("quickstart", ["model.layer_pattern=chunked,nope"])
    with pytest.raises(ConfigError, match="'loca'"):
        config_lib.load("quickstart", ["model.layer_pattern=loca"])


def test_mask_is_causal_and_windowed_by_positions():
    q = jnp.array([[5, 6, 7]])
    k = jnp.arange(8)[None]
    got = np.asarray(attention.mask(q, k, window=3))[0]
    want = np.array([[qp - 3 < kp <= qp for kp in range(8)] for qp in (5, 6, 7)])
    np.testing.assert_array_equal(got, want)
    assert np.asarray(attention.mask(q, k))[0].sum() == 6 + 7 + 8


def init(cfg, seed=0):
    mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
    return P.init(param_specs(cfg), jax.random.key(seed), mesh)


def _uneven_moe_layer(seed: int, E: int, D: int, F: int, M: int):
    """A mixture-of-experts layer's weights and M tokens [2, M / 2, D], routed unevenly: a constant input feature
    pushes every token to expert 0 and away from expert 3."""
    ks = jax.random.split(jax.random.key(seed), 5)
    p = {"router": jax.random.normal(ks[0], (D, E)), "gate": jax.random.normal(ks[1], (E, D, F)) * 0.3,
         "up": jax.random.normal(ks[2], (E, D, F)) * 0.3, "down": jax.random.normal(ks[3], (E, F, D)) * 0.3}
    p["router"] = p["router"].at[0, 0].set(3.0).at[0, 3].set(-10.0)
    return p, jax.random.normal(ks[4], (2, M // 2, D)).at[..., 0].set(3.0)


def test_moe_dispatch_matches_dense_loop_over_tokens():
    E, K, D, F, M = 5, 2, 8, 12, 40
    p, x = _uneven_moe_layer(0, E, D, F, M)
    y, stats = moe.moe(x, p, layers.Activation("silu", True), moe.Router(K))
    x_MD, y_MD = np.asarray(x, np.float64).reshape(M, D), np.zeros((M, D))
    w = {k: np.asarray(v, np.float64) for k, v in p.items()}
    for m in range(M):
        logits = x_MD[m] @ w["router"]
        probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        top = np.argsort(-probs)[:K]
        for e in top:
            g = x_MD[m] @ w["gate"][e]
            h = g / (1 + np.exp(-g)) * (x_MD[m] @ w["up"][e])
            y_MD[m] += probs[e] / probs[top].sum() * (h @ w["down"][e])
    np.testing.assert_allclose(np.asarray(y).reshape(M, D), y_MD, atol=1e-4)
    counts = np.asarray(stats[0]) * M
    assert counts.sum() == M * K and counts[0] == M and counts[3] == 0  # uneven, with an idle expert
    g = jax.grad(lambda p: jnp.sum(moe.moe(x, p, layers.Activation("silu", True), moe.Router(K))[0] ** 2))(p)
    assert all(float(jnp.abs(v).sum()) > 0 for v in jax.tree.leaves(g))


@pytest.mark.parametrize("weights_input, bias", [(False, False), (True, False), (False, True)])
def test_moe_dispatch_gradients_equal_a_dense_mixture(weights_input, bias):
    """The sorted dispatch's values and gradients (its permutations differentiated by gathers, not autodiff's
    scatters; the routing weights applied to the experts' hidden rows and down bias) against every expert run on
    every token and mixed by the routing weights, differentiated by autodiff: the inputs', the router's (through
    the weights) and each expert's, an idle one included; with the experts' biases too."""
    E, K, D, F, M = 5, 2, 8, 12, 40
    p, x = _uneven_moe_layer(1, E, D, F, M)
    if bias:
        ks = jax.random.split(jax.random.key(3), 3)
        p.update(up_bias=jax.random.normal(ks[0], (E, F)), gate_bias=jax.random.normal(ks[1], (E, F)),
                 down_bias=jax.random.normal(ks[2], (E, D)))
    act, router = layers.Activation("silu", True), moe.Router(K, weights_input=weights_input)
    g_y = jax.random.normal(jax.random.key(2), x.shape)

    def dense(x, p):
        x_MD = x.reshape(M, D)
        _, experts_MK, weights_MK = moe.route(x_MD, p, router)
        chosen_MKE = jax.nn.one_hot(experts_MK, E)
        w_ME = jnp.einsum("MK,MKE->ME", weights_MK, chosen_MKE)
        y_MD = jnp.zeros((M, D))
        b = (lambda name, e: p[name + "_bias"][e]) if bias else (lambda name, e: 0.0)
        for e in range(E):
            x_in = x_MD * w_ME[:, e:e + 1] if weights_input else x_MD
            h = act(x_in @ p["up"][e] + b("up", e), x_in @ p["gate"][e] + b("gate", e)) @ p["down"][e] + b("down", e)
            y_MD += (chosen_MKE.sum(1)[:, e:e + 1] if weights_input else w_ME[:, e:e + 1]) * h
        return y_MD.reshape(x.shape)

    def sorted_(x, p):
        return moe.moe(x, p, act, router)[0]

    y0, g0 = jax.vjp(dense, x, p)
    y1, g1 = jax.vjp(sorted_, x, p)
    np.testing.assert_allclose(y1, y0, rtol=1e-5, atol=1e-5)
    g0, g1 = g0(g_y), g1(g_y)
    assert float(jnp.abs(g1[1]["up"][3]).max()) == 0 and float(jnp.abs(g1[1]["router"]).max()) > 0
    assert not bias or float(jnp.abs(g1[1]["down_bias"][0]).max()) > 0
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()))


def test_remat_keeps_the_routing_so_the_backward_sorts_nothing_again():
    """model.remat=full keeps each MoE layer's routing indices (moe.ROUTING): the compiled gradient of a
    rematerialized layer runs the router's top-k and the dispatch's sort once, not again in the backward, with the
    gradients of a remat that keeps nothing."""
    from jaxlm.model import transformer

    E, K, D, F, M = 5, 2, 8, 12, 40
    p, x = _uneven_moe_layer(4, E, D, F, M)
    act, router = layers.Activation("silu", True), moe.Router(K)
    policy = transformer.remat_policy(ModelConfig(n_experts=E, experts_per_token=K, remat="full"))

    def grad(policy):
        layer = jax.checkpoint(lambda x, p: moe.moe(x, p, act, router)[0], policy=policy)
        return jax.jit(jax.grad(lambda x, p: jnp.sum(layer(x, p) ** 2), argnums=(0, 1)))

    kept, none = grad(policy), grad(jax.checkpoint_policies.nothing_saveable)
    hlo = {name: f.lower(x, p).compile().as_text() for name, f in (("kept", kept), ("none", none))}
    # on the CPU the top-k is a TopK custom call, the argsort a sort
    assert {k: (t.count(" sort("), t.count('"TopK"')) for k, t in hlo.items()} == {"kept": (1, 1), "none": (2, 2)}
    for a, b in zip(jax.tree.leaves(kept(x, p)), jax.tree.leaves(none(x, p))):
        np.testing.assert_array_equal(a, b)


def test_load_balancing_loss_is_one_when_uniform_and_grows_when_skewed():
    E = 4
    uniform = jnp.tile(jnp.array([[2 / E] * E, [1 / E] * E]), (3, 1, 1))  # K=2 copies, equal probabilities
    assert float(moe.load_balancing_loss(uniform)) == pytest.approx(2.0)
    skewed = jnp.tile(jnp.array([[1.5, 0.5, 0.0, 0.0], [0.7, 0.1, 0.1, 0.1]]), (3, 1, 1))
    assert float(moe.load_balancing_loss(skewed)) == pytest.approx(E * (1.5 * 0.7 + 0.5 * 0.1))


MIXED = ModelConfig(vocab_size=40, block_size=12, n_layers=4, n_heads=4, n_kv_heads=2, d_model=32, qk_norm=False,
                    glu=True, activation="gelu_tanh", norm_plus_one=True, embed_scale=True, post_norms=True,
                    attn_logit_softcap=5.0, final_logit_softcap=3.0, sliding_window=3, layer_pattern="local,global",
                    n_experts=4, experts_per_token=2, tie_embeddings=True)


def test_alternating_layers_scan_equals_python_loop():
    params = init(MIXED)
    toks = jax.random.randint(jax.random.key(1), (2, 12), 0, 40)
    scanned, aux_s = forward_with_aux(params, toks, MIXED)
    looped, aux_l = forward_with_aux(params, toks, dataclasses.replace(MIXED, scan_layers=False))
    np.testing.assert_allclose(np.asarray(scanned), np.asarray(looped), atol=1e-5)
    assert float(aux_s) == pytest.approx(float(aux_l), rel=1e-5) and float(aux_s) >= 2.0 - 1e-5
    assert float(jnp.max(jnp.abs(scanned))) < 3.0  # the final soft-cap bounds the logits
    global_only = forward(params, toks, dataclasses.replace(MIXED, layer_pattern="global"))
    assert float(jnp.max(jnp.abs(global_only - scanned))) > 1e-3  # the window really changes the local layers


def _loads(run, params, tokens):
    """Each MoE layer's max/mean of the token copies its experts receive, over a fixed batch."""
    from jaxlm.model import transformer

    with sharding.activation_sharding(run.mesh, run.act_rules):
        stats = jax.jit(lambda p, t: transformer.hidden_with_stats(p, t, run.cfg.model, None, None, None)[1])(
            params, tokens)
    f = np.asarray(stats[:, 0])
    return f.max(axis=-1) / f.mean(axis=-1)


@pytest.mark.slow
def test_balancing_bias_moves_the_expert_loads_toward_balance(char_data, tmp_path):
    """DeepSeek-V3's auxiliary-loss-free balancing: with the routing tilted towards expert 0 (a constant
    embedding feature the router favours; the max/mean of the experts' loads over 4 batches above 2.5), 30 train
    steps at a learning rate too small to retrain the router
    leave the load as skewed without the bias update (moe_bias_update_rate=0), and bring it towards balance
    with it; the biases move by exactly the rate per step, against the load."""
    from conftest import tiny_config
    from jaxlm.train import batches as batch_lib, run as run_lib, state as state_lib, step as step_lib
    from jaxlm.data import loader as loader_lib

    skews = {}
    for rate in (0.0, 0.05):
        cfg = tiny_config(char_data, tmp_path / str(rate), **{
            "model.n_experts": 8, "model.experts_per_token": 2, "model.router_score": "sigmoid",
            "model.router_balance_bias": True, "model.moe_bias_update_rate": rate, "model.glu": True,
            "model.activation": "silu", "optimizer.lr": 1e-7, "optimizer.min_lr": 0.0, "optimizer.warmup_steps": 0,
            "training.batch_size": 8})
        run = run_lib.setup(cfg, jax.devices()[:1])
        state = state_lib.init_state(run, cfg.seed)
        p = state["params"]
        # Routers 10x their init (tokens choose differently), tilted towards expert 0 by a constant feature.
        p["embed"]["tokens"] = p["embed"]["tokens"].at[:, 0].set(0.03)
        p["layers"]["mlp"]["router"] = (10 * p["layers"]["mlp"]["router"]).at[:, 0, 0].add(1.5)
        step = step_lib.make_train_step(run.cfg, run.optimizer, run.mesh, run.abstract_state, run.act_rules)
        rng = np.random.default_rng(0)
        batches = [batch_lib.device_batch(run, "train", loader_lib.Windows(rng.integers(0, 100_000, size=(1, 8))))
                   for _ in range(30)]
        held_out = jnp.concatenate([b["inputs"][0] for b in batches[:4]])
        before = _loads(run, state["params"], held_out)
        bias0 = np.asarray(state["params"]["layers"]["mlp"]["balance_bias"])
        state, _ = step(state, batches[0])
        moved = np.asarray(state["params"]["layers"]["mlp"]["balance_bias"]) - bias0
        np.testing.assert_allclose(np.abs(moved), rate, rtol=1e-5, atol=1e-12)  # +-rate, or 0 when frozen
        assert rate == 0 or moved[:, 0].max() < 0  # expert 0, over-loaded, is pushed down
        for b in batches[1:]:
            state, _ = step(state, b)
        skews[rate] = before, _loads(run, state["params"], held_out)
    (before0, after0), (before1, after1) = skews[0.0], skews[0.05]
    assert np.all(before0 > 2.5) and np.allclose(before0, before1)  # an even load gives 1, top-2 of 8 at most 4
    assert np.all(after0 > 0.9 * before0)  # frozen biases: the skew stays
    assert np.all(after1 < 0.6 * before1), (before1, after1)


def test_layouts_of_the_2025_presets():
    """Which layers are scanned in groups and which run unrolled, and where each layer's MLP weights lie."""
    from jaxlm.model import stack

    ds = stack.layout(config_lib.load("deepseek-v3").model)  # 3 dense layers, then 58 MoE layers
    assert (ds.start, ds.G, ds.groups, ds.unrolled, ds.mixed) == (3, 1, 58, (0, 1, 2), True)
    assert stack.layers_with(ds, "dense_mlp") == [0, 1, 2] and stack.index(ds, "moe", 3) == 0
    g3 = stack.layout(config_lib.load("gemma3-1b").model)  # 26 layers: 4 repeats of 6, 2 local layers left
    assert (g3.start, g3.G, g3.groups, g3.unrolled, g3.mixed) == (0, 6, 4, (24, 25), False)
    assert [k.attention for k in g3.kinds[22:]] == ["local", "global", "local", "local"]
    mav = stack.layout(config_lib.load("llama4-maverick").model)  # dense and MoE alternate within the pattern
    assert (mav.G, mav.groups, mav.unrolled, mav.mixed) == (4, 12, (), True)
    assert [(k.attention, k.moe) for k in mav.kinds[:4]] == [("chunked", False), ("chunked", True),
                                                             ("chunked", False), ("nope", True)]
    odd = ModelConfig(n_layers=7, n_experts=4, moe_layer_interval=2, first_dense_layers=2, layer_pattern="local,global",
                      sliding_window=4)  # groups of lcm(2, 2) from layer 2: [2, 6), then layer 6 unrolled
    lay = stack.layout(odd)
    assert (lay.start, lay.G, lay.groups, lay.unrolled) == (2, 2, 2, (0, 1, 6))
    assert [i for i, k in enumerate(lay.kinds) if k.moe] == [3, 5]
    assert stack.layout(config_lib.load("qwen3-30b-a3b").model).simple


MIXED_2025 = ModelConfig(vocab_size=40, block_size=16, n_layers=5, n_heads=4, n_kv_heads=2, d_model=32,
                         qk_norm=False, glu=True, activation="silu", layer_pattern="chunked,nope",
                         attention_chunk=4, n_experts=4, experts_per_token=2, first_dense_layers=1,
                         moe_layer_interval=2, n_shared_experts=1, expert_d_ff=24, router_score="sigmoid",
                         router_balance_bias=True, attn_sinks=True, mtp_layers=1, tie_embeddings=False)


@pytest.mark.slow
def test_irregular_layers_scan_equals_python_loop():
    """A model with a dense first layer, MoE layers every second layer, a pattern that leaves a last layer
    over (5 layers of 2 kinds) and an MTP module: the scan with its unrolled layers equals the plain loop, as
    do the load-balancing loss and the MTP logits; the latent-attention variant too."""
    from jaxlm.model.loss import loss_terms
    from jaxlm.model.mtp import mtp_logits

    toks = jax.random.randint(jax.random.key(1), (2, 16), 0, 40)
    for cfg in (MIXED_2025, dataclasses.replace(MIXED_2025, kv_lora_rank=8, q_lora_rank=8, qk_nope_head_dim=8,
                                                qk_rope_head_dim=4, v_head_dim=8, attn_sinks=False)):
        params = init(cfg)
        assert params["layers"]["mlp"]["router"].shape[0] == 2 and params["layers"]["dense_mlp"]["up"].shape[0] == 3
        fwd = jax.jit(forward_with_aux, static_argnums=2)
        scanned, aux_s = fwd(params, toks, cfg)
        looped, aux_l = fwd(params, toks, dataclasses.replace(cfg, scan_layers=False))
        np.testing.assert_allclose(np.asarray(scanned), np.asarray(looped), atol=1e-5)
        assert float(aux_s) == pytest.approx(float(aux_l), rel=1e-5) and float(aux_s) >= 2.0 - 1e-5
        mtp = jax.jit(mtp_logits, static_argnums=2)(params, toks, cfg)
        assert mtp.shape == (1, 2, 16, 40) and float(jnp.abs(mtp - scanned[None]).max()) > 1e-3
        loss, terms = jax.jit(loss_terms, static_argnums=3)(params, toks, toks, cfg)
        assert set(terms) == {"cross_entropy", "mtp", "load_balancing"}
        want = terms["cross_entropy"] + cfg.mtp_loss_weight * terms["mtp"] + cfg.router_aux_loss_coef * terms[
            "load_balancing"]
        assert float(loss) == pytest.approx(float(want), rel=1e-6)
