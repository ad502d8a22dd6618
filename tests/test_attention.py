"""Attention implementations against dot_product (the materialized-scores reference), the implementation
choice, and training with blockwise attention."""

import contextlib
import dataclasses
import io
import re

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxlm
from jaxlm import params as P, sharding
from jaxlm.train import saved_step
from jaxlm.config import ConfigError, MeshConfig, ModelConfig, apply_overrides, Config, validate
from jaxlm.model import attention, blockwise, loss_fn, param_specs, splash

CASES = {  # name: (window, softcap, kv heads of 8 query heads, segment ids); GQA ratios 1, 2 and 8
    "causal": (None, None, 8, False),
    "window_softcap_gqa2": (24, 5.0, 4, False),
    "segments_gqa8": (None, None, 1, True),
    "all": (24, 5.0, 2, True),
}


def inputs(T, K, dtype=jnp.float32, B=2, N=8, H=16, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, T, N, H), dtype)
    k = jax.random.normal(ks[1], (B, T, K, H), dtype)
    v = jax.random.normal(ks[2], (B, T, K, H), dtype)
    return q, k, v


def segments(B, T):
    """Three packed documents per row, at different cuts in each row; positions restart at each one."""
    cuts = [(T // 3, T // 2), (T // 5, 3 * T // 4)][:B]
    seg = np.zeros((B, T), np.int32)
    for b, (c1, c2) in enumerate(cuts):
        seg[b, c1:] = 1
        seg[b, c2:] = 2
    pos = np.zeros((B, T), np.int32)
    for b in range(B):
        for t in range(1, T):
            pos[b, t] = 0 if seg[b, t] != seg[b, t - 1] else pos[b, t - 1] + 1
    return jnp.asarray(pos), jnp.asarray(seg)


def reference(q, k, v, pos, seg, window, softcap):
    return attention.attend(q, k, v, attention.mask(pos, pos, window, seg, seg), softcap=softcap)


def loss_of(f):
    # A loss whose gradient differs at every output element, so no term can cancel.
    return lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v).astype(jnp.float32)) * jnp.linspace(-1, 1, q.shape[-1]))


def assert_close(got, want, tol=1e-5):
    """Largest error at most tol times the reference's largest magnitude (at least 1): float32 sums of a few
    hundred terms in a different order differ by a few ulps of their largest term."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.max(np.abs(got - want)) <= tol * max(1.0, np.max(np.abs(want))), np.max(np.abs(got - want))


def compare(impl, T, case, dtype, layout="head_dim_minor"):
    window, softcap, K, with_segments = CASES[case]
    q, k, v = inputs(T, K, dtype)
    if with_segments:
        pos, seg = segments(2, T)
    else:
        pos, seg = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T)), None
    ref = lambda q, k, v: reference(q, k, v, pos, seg, window, softcap)  # noqa: E731
    got = {"blockwise": lambda q, k, v: blockwise.attention(q, k, v, pos, seg, window, None, softcap, block_size=16),
           "splash": lambda q, k, v: splash.attention(q, k, v, seg, window, None, softcap, block_size=128,
                                                      interpret=True, layout=layout)}[impl]
    outs = [np.asarray(f(q, k, v).astype(jnp.float32)) for f in (got, ref)]
    grads = [jax.grad(loss_of(f), argnums=(0, 1, 2))(q, k, v) for f in (got, ref)]
    return outs, [[np.asarray(g.astype(jnp.float32)) for g in gs] for gs in grads]


@pytest.mark.parametrize("case", list(CASES))
def test_blockwise_equals_dot_product_float32(case):
    (out, want), (grads, want_grads) = compare("blockwise", 80, case, jnp.float32)  # 80: a ragged last tile
    for got, ref in zip([out, *grads], [want, *want_grads]):
        assert_close(got, ref)


@pytest.mark.parametrize("case", ["causal", "all"])
def test_blockwise_equals_dot_product_bfloat16(case):
    (out, want), (grads, want_grads) = compare("blockwise", 64, case, jnp.bfloat16)
    for got, ref in zip([out, *grads], [want, *want_grads]):
        assert np.linalg.norm(got - ref) <= 2e-2 * np.linalg.norm(ref)


@pytest.mark.parametrize("case", ["causal", "all"])
def test_splash_interpret_equals_dot_product_float32(case):
    (out, want), (grads, want_grads) = compare("splash", 256, case, jnp.float32)
    for got, ref in zip([out, *grads], [want, *want_grads]):
        assert_close(got, ref)


def test_splash_seq_minor_layout_equals_dot_product_float32():
    """model.splash_layout=seq_minor: the kernels read each head as [H, T] (queries, keys and values handed over
    through the [B, N * H, T] transpose), forward and backward, with windows, soft-cap, GQA and segments."""
    assert splash._block_sizes(256, 128, "seq_minor").k_layout == splash.kernel_lib.QKVLayout.SEQ_MINOR
    (out, want), (grads, want_grads) = compare("splash", 256, "all", jnp.float32, layout="seq_minor")
    for got, ref in zip([out, *grads], [want, *want_grads]):
        assert_close(got, ref)


def test_attend_block_halves_merge_into_the_whole_with_gradients():
    """Ring attention's use: two key halves, each with its log-sum-exp, merge into attention over all keys,
    and gradients flow through the merge (the lse's cotangent included)."""
    T, K = 48, 2
    q, k, v = inputs(T, K)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))

    def merged(q, k, v):
        h = T // 2
        parts = [blockwise.attend_block(q, k[:, s], v[:, s], pos, pos[:, s], window=20, block_q=16, block_k=8)
                 for s in (slice(0, h), slice(h, T))]
        return blockwise.merge(*parts[0], *parts[1])[0]

    ref = lambda q, k, v: reference(q, k, v, pos, None, 20, None)  # noqa: E731
    assert_close(merged(q, k, v), ref(q, k, v))
    for g, w in zip(jax.grad(loss_of(merged), (0, 1, 2))(q, k, v), jax.grad(loss_of(ref), (0, 1, 2))(q, k, v)):
        assert_close(g, w)
    # The lse itself: log of the sum of exp(scaled logits) over allowed keys, by a direct computation.
    out, lse = blockwise.attend_block(q, k, v, pos, pos, window=20)
    logits = jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, 4, axis=2)) * 16 ** -0.5
    m = attention.mask(pos, pos, 20)[:, None]
    want = jax.nn.logsumexp(jnp.where(m, logits, -jnp.inf), axis=-1).transpose(0, 2, 1)
    assert_close(lse, want)


def test_a_query_with_no_allowed_key_gets_zero_and_minus_infinity():
    q, k, v = inputs(8, 8)
    pos = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
    out, lse = blockwise.attend_block(q, k, v, pos, pos + 100)  # every key after every query
    assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))


@pytest.mark.parametrize("platform,T,dtype,softcap,want", [
    ("tpu", 2048, jnp.bfloat16, None, "splash"),
    ("tpu", 2000, jnp.bfloat16, None, "blockwise"),  # not a multiple of splash's 128
    ("gpu", 2048, jnp.bfloat16, None, "cudnn"),
    ("gpu", 2048, jnp.float32, None, "blockwise"),
    ("gpu", 2048, jnp.bfloat16, 50.0, "blockwise"),
    ("cpu", 256, jnp.float32, None, "dot_product"),
    ("cpu", 8192, jnp.float32, None, "blockwise"),
])
def test_auto_picks_by_platform_length_and_case(platform, T, dtype, softcap, want):
    cfg = ModelConfig(attention="auto", attn_logit_softcap=softcap)
    assert attention.choose(cfg, T, dtype, False, platform) == want


def test_an_explicit_kernel_without_the_case_runs_blockwise():
    assert attention.choose(ModelConfig(attention="cudnn"), 2048, jnp.bfloat16, False, "cpu") == "blockwise"
    assert attention.choose(ModelConfig(attention="cudnn"), 2048, jnp.bfloat16, True, "gpu") == "blockwise"
    assert attention.choose(ModelConfig(attention="splash"), 200, jnp.float32, False, "tpu") == "blockwise"
    assert attention.choose(ModelConfig(attention="splash"), 256, jnp.float32, False, "cpu") == "splash"


def test_auto_follows_the_mesh_not_the_host():
    class FakeTPU:
        platform = "tpu"

    class FakeMesh:
        devices = np.array([FakeTPU()])

    assert attention.mesh_platform() == "cpu"
    with sharding.activation_sharding(FakeMesh(), {}):
        assert attention.mesh_platform() == "tpu"
    assert "attention splash (model.attention=auto on tpu at 2048 tokens" in attention.describe(
        ModelConfig(block_size=2048), "tpu")


@pytest.mark.parametrize("overrides,message", [
    ({"model.attention": "blockwise", "model.dropout": "0.1"}, "model.attention=blockwise has no dropout"),
    ({"model.attention": "flash"}, "model.attention"),
    ({"model.attention_block": "0"}, "model.attention_block=0 must be > 0"),
    ({"model.loss_chunk_tokens": "-1"}, "model.loss_chunk_tokens=-1 must be >= 0"),
])
def test_attention_settings_are_validated_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(apply_overrides(Config(), overrides))


def test_a_saved_step_refuses_another_attention_or_remat_setting():
    cfg = Config()
    saved = {"platform": "cpu", "device_kind": "cpu", "n_devices": 1, "jaxlm": jaxlm.__version__, "jax": jax.__version__,
             "args": [],
             "settings": saved_step.baked_settings(cfg)}
    for key, value in (("attention", "blockwise"), ("remat", "save_qkv_proj"), ("loss_chunk_tokens", 1024)):
        other = cfg.replace(model=dataclasses.replace(cfg.model, **{key: value}))
        here = dict(saved, settings=saved_step.baked_settings(other))
        with pytest.raises(ConfigError, match=f"was compiled with model.{key}="):
            saved_step.check_signature(saved, here, "step.jaxlm")


@pytest.mark.slow
def test_fifty_training_steps_blockwise_match_dot_product():
    cfg = ModelConfig(vocab_size=64, block_size=32, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32,
                      sliding_window=12, layer_pattern="local,global", attention_block=16)
    mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
    tokens = jax.random.randint(jax.random.key(3), (4, cfg.block_size + 1), 0, cfg.vocab_size)
    opt = optax.adam(3e-3)

    def run(impl):
        c = dataclasses.replace(cfg, attention=impl)
        params = P.init(param_specs(c), jax.random.key(0), mesh)
        state = opt.init(params)

        @jax.jit
        def step(params, state):
            loss, g = jax.value_and_grad(loss_fn)(params, tokens[:, :-1], tokens[:, 1:], c)
            updates, state = opt.update(g, state)
            return optax.apply_updates(params, updates), state, loss

        losses = []
        for _ in range(50):
            params, state, loss = step(params, state)
            losses.append(float(loss))
        return np.array(losses)

    dot, block = run("dot_product"), run("blockwise")
    assert dot[-1] < dot[0] - 1.0  # it learns, so the comparison covers moving weights
    np.testing.assert_allclose(block, dot, atol=1e-4, rtol=0)


def test_chunked_loss_equals_the_whole_loss_with_gradients():
    """Chunks of 5 over 16 positions (a padded last chunk), per-token weights and a normalizer."""
    cfg = ModelConfig(vocab_size=50, block_size=16, n_layers=1, n_heads=4, d_model=32, tie_embeddings=False)
    mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
    params = P.init(param_specs(cfg), jax.random.key(0), mesh)
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 50)
    weights = (jax.random.uniform(jax.random.key(2), (2, 16)) > 0.3).astype(jnp.float32)
    args = (tokens[:, :-1], tokens[:, 1:])
    kw = {"weights_BT": weights, "normalizer": jnp.float32(7.0)}
    whole = jax.value_and_grad(loss_fn)(params, *args, cfg, **kw)
    chunked = jax.value_and_grad(loss_fn)(params, *args, dataclasses.replace(cfg, loss_chunk_tokens=5), **kw)
    assert float(whole[0]) > 1.0
    assert_close(chunked[0], whole[0])
    for g, w in zip(jax.tree.leaves(chunked[1]), jax.tree.leaves(whole[1])):
        assert_close(g, w)


def _vocab_matmuls(jaxpr, V: int) -> int:
    """dot_generals with a V-wide operand or result, in jaxpr and every jaxpr inside it (scans, remat, vjps)."""
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            n += any(V in getattr(v.aval, "shape", ()) for v in (*eqn.invars, *eqn.outvars))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's, or a Jaxpr
                if hasattr(sub, "eqns"):
                    n += _vocab_matmuls(sub, V)
    return n


@pytest.mark.parametrize("tie", [True, False])
def test_chunked_loss_takes_its_gradient_in_the_forward(tie):
    """The chunked loss's gradient costs three [*, V] matmuls (logits, then their gradient into the hidden states
    and into the weights), not four: no chunk's logits are recomputed in the backward; two where the output layer
    is frozen. Values and gradients equal the loss's in one piece."""
    V = 96
    cfg = ModelConfig(vocab_size=V, block_size=16, n_layers=1, n_heads=2, d_model=16, tie_embeddings=tie,
                      loss_chunk_tokens=8)
    mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
    params = P.init(param_specs(cfg), jax.random.key(0), mesh)
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, V)
    grad = jax.make_jaxpr(jax.grad(lambda p, x, y: loss_fn(p, x, y, cfg)))(params, tokens[:, :-1], tokens[:, 1:])
    assert _vocab_matmuls(grad.jaxpr, V) == 3
    # a frozen output layer (LoRA): two, the logits and the hidden states' gradient
    frozen = lambda a, x, y: loss_fn({**params, "layers": a}, x, y, cfg)  # noqa: E731
    grad = jax.make_jaxpr(jax.grad(frozen))(params["layers"], tokens[:, :-1], tokens[:, 1:])
    assert _vocab_matmuls(grad.jaxpr, V) == 2
    chunked = jax.value_and_grad(loss_fn)(params, tokens[:, :-1], tokens[:, 1:], cfg)
    whole = jax.value_and_grad(loss_fn)(params, tokens[:, :-1], tokens[:, 1:],
                                        dataclasses.replace(cfg, loss_chunk_tokens=0))
    assert_close(chunked[0], whole[0])
    for g, w in zip(jax.tree.leaves(chunked[1]), jax.tree.leaves(whole[1])):
        assert_close(g, w)


def _reduced_shapes(jaxpr) -> list:
    """The result shapes of every reduce_sum in jaxpr and the jaxprs inside it."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "reduce_sum":
            out.append(tuple(eqn.outvars[0].aval.shape))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    out += _reduced_shapes(sub)
    return out


def test_projection_bias_gradients_sum_rows_of_the_flat_projection():
    """GPT-2's q/k/v biases are added to the [B, T, N * H] matmul result, so their gradients are row sums of that
    2-D array ([N * H]), never sums of a [B, T, N, H] array into [N, H] (heads of 64: padded TPU tiles). The
    values equal the per-head addition's."""
    cfg = ModelConfig(vocab_size=64, block_size=16, n_layers=1, n_heads=4, d_model=32, bias=True, qk_norm=False,
                      norm="layernorm", position="learned", attention="dot_product")
    mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
    params = P.init(param_specs(cfg), jax.random.key(0), mesh)
    params["layers"]["attn"]["q_bias"] = jax.random.normal(jax.random.key(3), params["layers"]["attn"]["q_bias"].shape)
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 64)
    grad_fn = jax.grad(lambda p: loss_fn(p, tokens[:, :-1], tokens[:, 1:], cfg))
    shapes = _reduced_shapes(jax.make_jaxpr(grad_fn)(params).jaxpr)
    assert (32,) in shapes and (4, 8) not in shapes, shapes
    x = jax.random.normal(jax.random.key(2), (2, 16, 32))
    p_attn = jax.tree.map(lambda a: a[0], params["layers"]["attn"])
    per_head = jnp.einsum("btd,dnh->btnh", x, p_attn["q"]) + p_attn["q_bias"]
    assert_close(attention._project(x, p_attn, "q"), per_head)


def test_chunked_loss_never_holds_the_whole_logits():
    """The gradient step's temporaries: the [B, T, V] float32 logits (and their gradient) are gone."""
    cfg = ModelConfig(vocab_size=8192, block_size=512, n_layers=1, n_heads=2, d_model=32)
    mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
    params = jax.eval_shape(lambda: P.init(param_specs(cfg), jax.random.key(0), mesh))
    tokens = jax.ShapeDtypeStruct((2, 512), jnp.int32)

    def temp_bytes(c):
        step = jax.jit(jax.grad(lambda p, x, y: loss_fn(p, x, y, c)))
        return step.lower(params, tokens, tokens).compile().memory_analysis().temp_size_in_bytes

    logits_bytes = 2 * 512 * 8192 * 4
    whole, chunked = temp_bytes(cfg), temp_bytes(dataclasses.replace(cfg, loss_chunk_tokens=64))
    assert whole - chunked >= 1.5 * logits_bytes, (whole, chunked)  # the logits and their gradient


def test_named_remat_policies_keep_the_named_activations_and_the_gradients():
    cfg = ModelConfig(vocab_size=50, block_size=16, n_layers=2, n_heads=4, d_model=32, glu=True)
    mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
    params = P.init(param_specs(cfg), jax.random.key(0), mesh)
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 50)

    def loss(policy):
        return lambda p: loss_fn(p, tokens[:, :-1], tokens[:, 1:], dataclasses.replace(cfg, remat=policy))

    def kept(policy, shape="[2,2,16,4,8]"):
        """Residuals of the layer scan of a shape (default: q, k or v [L, B, T, N, H]), and whether each is on
        the host."""
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            jax.ad_checkpoint.print_saved_residuals(loss(policy), params)
        avals = [line.split(" ")[0] for line in out.getvalue().splitlines()]
        return [a.startswith("f32<host>") for a in avals if a.endswith(shape)]

    assert kept("full") == []
    assert kept("save_qkv_proj") == [False] * 3
    assert kept("offload_qkv_proj") == [True] * 3
    layer_inputs = "[2,2,16,32]"  # [L, B, T, D]: the stack of the layers' inputs
    assert kept("full", layer_inputs) == [False]
    assert kept("offload_layer_inputs", layer_inputs) == [True]
    want = jax.grad(loss("none"))(params)
    for policy in ("offload_attention", "offload_layer_inputs"):
        for g, w in zip(jax.tree.leaves(jax.grad(loss(policy))(params)), jax.tree.leaves(want)):
            assert_close(g, w)


def test_splash_runs_per_device_under_the_mesh():
    """Batch over `data` and heads over `tensor`: each device runs the kernel on its shard (shard_map)."""
    mesh = sharding.make_mesh(MeshConfig(ici_data=2, ici_tensor=2), jax.devices()[:4])
    T = 128
    q, k, v = inputs(T, 4, B=4)
    _, seg = segments(2, T)
    seg = jnp.concatenate([seg, seg[::-1]])
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (4, T))
    with sharding.activation_sharding(mesh):
        got = jax.jit(lambda q, k, v: splash.attention(q, k, v, seg, 40, None, None, 128, interpret=True))(q, k, v)
    assert_close(got, reference(q, k, v, pos, seg, 40, None))


def test_splash_trains_evaluates_and_trains_again_in_one_process(char_data, tmp_path):
    """The kernel is cached across traces (splash._kernel): nothing made while one step is traced may reach the
    next trace. A run traces the train step, then the evaluation step, then trains on (each a new trace of the
    kernel's cached constants); before the kernel's tables were made eagerly, the second trace failed with
    UnexpectedTracerError (on a TPU at the quickstart's first evaluation)."""
    from conftest import tiny_config
    from jaxlm.train import loop as train

    splash._kernel.cache_clear()
    cfg = tiny_config(char_data, tmp_path / "run", **{
        "model.attention": "splash", "model.block_size": 128, "training.steps": 4, "training.eval_interval": 2,
        "optimizer.warmup_steps": 1, "checkpoint.interval": 0})
    summary = train.train(cfg, log=lambda s: None)
    assert summary["steps"] == 4 and np.isfinite(summary["train_loss"]) and np.isfinite(summary["val_loss"])
    assert splash._kernel.cache_info().hits > 0  # the later traces did take the cached kernel


def test_two_models_with_the_same_attention_shape_share_the_splash_kernel():
    """Two models whose attention has the same heads and length (so the same cached kernel), one traced after
    the other, each with gradients: the second takes the first's kernel and must still trace and equal the
    reference."""
    splash._kernel.cache_clear()
    T = 128
    q, k, v = inputs(T, 8)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
    want = reference(q, k, v, pos, None, None, None)
    for depth in (1, 2):  # two programs: one and two layers of the same attention
        def model(q, k, v, depth=depth):
            out = q
            for _ in range(depth):
                out = splash.attention(out, k, v, None, None, None, None, block_size=128, interpret=True)
            return jnp.sum(out ** 2), out

        (_, out), grads = jax.jit(jax.value_and_grad(model, has_aux=True))(q, k, v)
        if depth == 1:
            assert_close(out, want)
        assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
    assert splash._kernel.cache_info().hits > 0


@pytest.mark.parametrize("heads,position,qk_norm,bias,split", [
    ((4, 4), "rotary", False, False, False),  # MHA, rotary
    ((4, 2), "rotary", True, True, False),  # GQA, QK-norm and q/k/v/o biases
    ((4, 1), "learned", False, True, False),  # no rotary (GPT-2's learned positions), biases
    ((4, 2), "rotary", False, False, True),  # batch over `data`, heads over `tensor` (the kernel under shard_map)
])
def test_splash_heads_major_projections_equal_the_token_major_path(monkeypatch, heads, position, qk_norm, bias,
                                                                   split):
    """With splash the q/k/v projections write the kernel's [B, N, T, H] and the output projection reads it back
    (attention._splash_attention_with_kv); output and every gradient equal the [B, T, N, H] path's, which
    transposes around the kernel, within float32 rounding."""
    N, K = heads
    cfg = ModelConfig(vocab_size=64, block_size=128, n_layers=1, n_heads=N, n_kv_heads=K, d_model=64,
                      position=position, qk_norm=qk_norm, bias=bias, attention="splash", attention_block=128)
    mesh = (sharding.make_mesh(MeshConfig(ici_data=2, ici_tensor=2), jax.devices()[:4]) if split
            else sharding.make_mesh(MeshConfig(), jax.devices()[:1]))
    p_attn = jax.tree.map(lambda a: a[0], P.init(param_specs(cfg), jax.random.key(0), mesh)["layers"]["attn"])
    # nonzero biases, norm scales away from 1
    p_attn = {k: jax.tree.map(lambda a, i=i: a + 0.1 * jax.random.normal(jax.random.key(10 + i), a.shape, a.dtype),
                              v) for i, (k, v) in enumerate(p_attn.items())}
    x = jax.random.normal(jax.random.key(1), (2, 128, 64))
    positions = jnp.broadcast_to(jnp.arange(128), (2, 128))
    g = jax.random.normal(jax.random.key(2), (2, 128, 64))

    def run(p, x):
        out, k, v = attention.attention_with_kv(x, p, cfg, positions)
        return jnp.sum(out * g), (out, k, v)

    def grads():
        with sharding.activation_sharding(mesh) if split else contextlib.nullcontext():
            return jax.jit(jax.value_and_grad(run, argnums=(0, 1), has_aux=True))(p_attn, x)

    assert attention._splash_heads_major(x, p_attn, cfg, "global", None)
    (_, got), got_grads = grads()
    monkeypatch.setattr(attention, "_splash_heads_major", lambda *a: False)
    (_, want), want_grads = grads()
    for a, b in zip(jax.tree.leaves((got, got_grads)), jax.tree.leaves((want, want_grads))):
        assert a.shape == b.shape
        assert_close(a, b)


def test_splash_heads_major_projections_under_int8_training_equal_the_token_major_path(monkeypatch):
    """int8 training's quantized q/k/v/o matmuls write and read the kernel's [B, N, T, H] too: each token's scale
    spans the same contracted axes in either layout, so output and gradients equal the [B, T, N, H] path's
    (gradients rounded to nearest: stochastic rounding's noise follows the gradient's layout)."""
    from jaxlm.model import quant

    cfg = ModelConfig(vocab_size=64, block_size=128, n_layers=1, n_heads=4, n_kv_heads=2, d_model=64,
                      attention="splash", attention_block=128, quantization="int8")
    mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
    p_attn = jax.tree.map(lambda a: a[0], P.init(param_specs(cfg), jax.random.key(0), mesh)["layers"]["attn"])
    x = jax.random.normal(jax.random.key(1), (2, 128, 64))
    positions = jnp.broadcast_to(jnp.arange(128), (2, 128))
    g = jax.random.normal(jax.random.key(2), (2, 128, 64))

    recipe = quant.Recipe("int8", stochastic_rounding=False)

    def run(p, x):
        with quant.recipe_scope(recipe):
            out, _, _ = attention.attention_with_kv(x, p, cfg, positions)
        return jnp.sum(out * g), out

    with quant.recipe_scope(recipe):
        assert attention._splash_heads_major(x, p_attn, cfg, "global", None)
    grads = jax.jit(jax.value_and_grad(run, argnums=(0, 1), has_aux=True))
    (_, got), got_grads = grads(p_attn, x)
    lowered = jax.jit(run).lower(p_attn, x).as_text()
    assert len(re.findall(r"tensor<[0-9x]+xi8>, tensor<[0-9x]+xi8>\) -> tensor<[0-9x]+xi32>", lowered)) == 4
    # the weights quantized once a step (quant.step_weights) take the same path, to the same values
    stepped = {**p_attn, **{n: quant.StepInt8(p_attn[n], *quant.quantize(p_attn[n], quant.BLOCK_WEIGHT_CONTRACTED[n],
                                                                        "int8")) for n in "qkvo"}}
    with quant.recipe_scope(recipe):
        assert attention._splash_heads_major(x, stepped, cfg, "global", None)
    assert_close(jax.jit(run)(stepped, x)[1], got)
    monkeypatch.setattr(attention, "_splash_heads_major", lambda *a: False)
    (_, want), want_grads = grads(p_attn, x)
    for a, b in zip(jax.tree.leaves((got, got_grads)), jax.tree.leaves((want, want_grads))):
        assert a.shape == b.shape
        assert_close(a, b)
