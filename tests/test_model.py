import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm import params as P, sharding
from jaxlm.config import MeshConfig, ModelConfig
from jaxlm.model import forward, layers, loss_fn, param_specs

TINY = ModelConfig(vocab_size=50, block_size=16, n_layers=3, n_heads=4, d_model=32)
GPT2_LIKE = dataclasses.replace(TINY, position="learned", norm="layernorm", bias=True, qk_norm=False,
                                activation="gelu_tanh")


def init(cfg, seed=0):
    mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
    return P.init(param_specs(cfg), jax.random.key(seed), mesh)


def tokens(cfg, B=2, seed=1):
    return jax.random.randint(jax.random.key(seed), (B, cfg.block_size), 0, cfg.vocab_size)


def test_rotary_matches_naive_complex_rotation():
    B, T, N, H, theta = 2, 7, 3, 8, 10000.0
    x = np.random.default_rng(0).normal(size=(B, T, N, H)).astype(np.float32)
    pos = np.tile(np.arange(T), (B, 1)) + 3
    got = np.asarray(layers.rotary(jnp.asarray(x), jnp.asarray(pos), layers.Rope(theta)))
    want = np.empty_like(x)
    for b in range(B):
        for t in range(T):
            for i in range(H // 2):
                angle = pos[b, t] * theta ** (-2 * i / H)
                re, im = x[b, t, :, i], x[b, t, :, i + H // 2]
                want[b, t, :, i] = re * np.cos(angle) - im * np.sin(angle)
                want[b, t, :, i + H // 2] = im * np.cos(angle) + re * np.sin(angle)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_rotary_gradient_is_the_transposed_rotation():
    """The hand-written backward (rotation by minus the angle) equals a numerical vector-Jacobian product of
    the naive complex rotation, with llama3 frequency scaling and in bfloat16."""
    B, T, N, H = 2, 5, 3, 8
    scaling = (8.0, 1.0, 4.0, 8)
    rng = np.random.default_rng(0)
    x, g = (rng.normal(size=(B, T, N, H)) for _ in range(2))
    pos = np.tile(np.arange(T), (B, 1)) * 7
    inv_freq = np.asarray(layers.rope_frequencies(H, layers.Rope(500.0, "llama3", *scaling)), np.float64)
    angle = pos[..., None, None] * inv_freq  # [B, T, 1, H/2]
    # d/dx <g, R(angle) x> = R(angle)^T g = R(-angle) g
    g1, g2 = g[..., : H // 2], g[..., H // 2:]
    want = np.concatenate([g1 * np.cos(angle) + g2 * np.sin(angle), g2 * np.cos(angle) - g1 * np.sin(angle)], -1)
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)):
        _, vjp = jax.vjp(lambda x: layers.rotary(x, jnp.asarray(pos), layers.Rope(500.0, "llama3", *scaling)), jnp.asarray(x, dtype))
        got = np.asarray(vjp(jnp.asarray(g, dtype))[0], np.float64)
        np.testing.assert_allclose(got, want, atol=tol * 4, rtol=tol)


def test_rotary_scores_depend_only_on_relative_position():
    H = 16
    q = jax.random.normal(jax.random.key(0), (1, 1, 1, H))
    k = jax.random.normal(jax.random.key(1), (1, 1, 1, H))
    def score(pq, pk):
        rq = layers.rotary(q, jnp.array([[pq]]), layers.Rope(10000.0))
        rk = layers.rotary(k, jnp.array([[pk]]), layers.Rope(10000.0))
        return float(jnp.sum(rq * rk))
    assert score(5, 2) == pytest.approx(score(13, 10), rel=1e-4)


@pytest.mark.parametrize("cfg", [TINY, GPT2_LIKE], ids=["gpt", "gpt2"])
def test_causality_future_tokens_do_not_affect_past(cfg):
    cfg = dataclasses.replace(cfg, tie_embeddings=False)  # a tied output layer reads every embedding row
    params = init(cfg)
    emb = params["embed"]["tokens"]
    toks = tokens(cfg, B=1)

    def out_at(t, x_emb):
        p = dict(params, embed=dict(params["embed"], tokens=x_emb))
        return forward(p, toks, cfg)[0, t].sum()

    # Gradient of the output at position t with respect to the embedding rows used at t+1.. must be zero.
    t = 5
    g = jax.grad(out_at, argnums=1)(t, emb)
    later = set(np.asarray(toks[0, t + 1:]).tolist()) - set(np.asarray(toks[0, : t + 1]).tolist())
    assert later, "pick a seed where later positions use fresh tokens"
    for tok in later:
        assert float(jnp.abs(g[tok]).max()) == 0.0
    assert float(jnp.abs(g[toks[0, t]]).max()) > 0.0
    if cfg.position == "learned":
        def out_pos(pos_emb):
            return forward(dict(params, embed=dict(params["embed"], positions=pos_emb)), toks, cfg)[0, t].sum()
        gp = jax.grad(out_pos)(params["embed"]["positions"])
        assert float(jnp.abs(gp[t + 1:]).max()) == 0.0 and float(jnp.abs(gp[t]).max()) > 0.0
    # And directly: changing tokens after t leaves logits up to t unchanged.
    changed = toks.at[0, t + 1:].set((toks[0, t + 1:] + 1) % cfg.vocab_size)
    a, b = forward(params, toks, cfg), forward(params, changed, cfg)
    np.testing.assert_array_equal(np.asarray(a[0, : t + 1]), np.asarray(b[0, : t + 1]))
    assert not np.allclose(np.asarray(a[0, t + 1:]), np.asarray(b[0, t + 1:]))


@pytest.mark.parametrize("cfg", [TINY, GPT2_LIKE], ids=["gpt", "gpt2"])
def test_scan_equals_python_loop(cfg):
    params, toks = init(cfg), tokens(cfg)
    scanned = forward(params, toks, cfg)
    looped = forward(params, toks, dataclasses.replace(cfg, scan_layers=False))
    np.testing.assert_allclose(np.asarray(scanned), np.asarray(looped), atol=2e-5, rtol=1e-5)


def _slices(jaxpr):
    """(input shape, output shape) of every static slice in a jaxpr and in the jaxprs inside it."""
    from jax.extend.core import jaxprs_in_params

    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "slice":
            yield eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
        for sub in jaxprs_in_params(eqn.params):
            yield from _slices(sub)


def _shapes(jaxpr):
    """The shape of every value a jaxpr and the jaxprs inside it compute."""
    from jax.extend.core import jaxprs_in_params

    for eqn in jaxpr.eqns:
        yield from (tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
        for sub in jaxprs_in_params(eqn.params):
            yield from _shapes(sub)


def test_patterned_stack_scans_its_groups_without_copying_them():
    """A pattern that leaves a layer over (5 layers in groups of 2: [0, 4) scanned, layer 4 unrolled, as Gemma 3's
    34 in groups of 6): the scan takes each group's layers from the whole stacks, never a copy of the scanned
    layers (a slice [5, ...] -> [4, ...]: 11 GiB of temporaries in gemma3-4b's LoRA step), and gives the plain
    loop's loss and gradients, with and without remat."""
    from jaxlm.model import stack

    cfg = dataclasses.replace(TINY, n_layers=5, layer_pattern="local,global", sliding_window=4)
    lay = stack.layout(cfg)
    assert (lay.G, lay.groups, lay.unrolled) == (2, 2, (4,))
    params, toks = init(cfg), tokens(cfg)
    weight_shapes = {a.shape[1:] for a in jax.tree.leaves(params["layers"]) if a.ndim > 2}
    grad = jax.jit(jax.value_and_grad(loss_fn), static_argnums=3)
    for remat in ("none", "full"):
        c = dataclasses.replace(cfg, remat=remat)
        (loss, g), (loss_l, g_l) = grad(params, toks, toks, c), grad(params, toks, toks,
                                                                    dataclasses.replace(c, scan_layers=False))
        assert float(loss) == pytest.approx(float(loss_l), rel=1e-6)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_l)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)
        assert all(float(jnp.abs(g["layers"]["attn"]["q"][i]).max()) > 0 for i in range(5))
        jaxpr = jax.make_jaxpr(lambda p: jax.grad(loss_fn)(p, toks, toks, c))(params).jaxpr
        cut = [(i, o) for i, o in _slices(jaxpr) if len(i) > 1 and i[0] == 5 and o[0] == 4]
        assert not cut, cut
        if remat == "full":  # nor does the gradient keep each scan step's weights: [2 groups, ...] residuals
            kept = {s for s in _shapes(jaxpr) if s[1:] in weight_shapes and s[0] in (2, 4)}
            assert not kept, kept
    # The unpatterned stack still scans its weights as they lie (a reshape, no slice at all).
    jaxpr = jax.make_jaxpr(lambda p: jax.grad(loss_fn)(p, toks, toks, TINY))(init(TINY)).jaxpr
    assert not [(i, o) for i, o in _slices(jaxpr) if i[0] == TINY.n_layers and 0 not in i]


@pytest.mark.parametrize("policy", ["full", "minimal", "save_dots"])
def test_remat_does_not_change_gradients(policy):
    params, toks = init(TINY), tokens(TINY)
    g0 = jax.grad(loss_fn)(params, toks, toks, TINY)
    g1 = jax.grad(loss_fn)(params, toks, toks, dataclasses.replace(TINY, remat=policy))
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)


def test_grouped_query_attention_equals_repeated_kv_heads():
    gqa = dataclasses.replace(TINY, n_kv_heads=2)
    params, toks = init(gqa), tokens(gqa)
    mha_params = jax.tree.map(lambda a: a, params)
    for name in ("k", "v"):
        mha_params["layers"]["attn"][name] = jnp.repeat(params["layers"]["attn"][name], 2, axis=2)
    mha_params["layers"]["attn"]["k_norm"] = params["layers"]["attn"]["k_norm"]
    np.testing.assert_allclose(np.asarray(forward(params, toks, gqa)),
                               np.asarray(forward(mha_params, toks, TINY)), atol=1e-5)


def test_bfloat16_compute_keeps_float32_logits_and_close_loss():
    params, toks = init(TINY), tokens(TINY)
    bf = dataclasses.replace(TINY, compute_dtype="bfloat16")
    logits = forward(params, toks, bf)
    assert logits.dtype == jnp.float32
    assert abs(float(loss_fn(params, toks, toks, bf)) - float(loss_fn(params, toks, toks, TINY))) < 0.02


def test_dropout_is_active_only_with_a_key():
    cfg = dataclasses.replace(TINY, dropout=0.5)
    params, toks = init(cfg), tokens(cfg)
    det = forward(params, toks, cfg)
    np.testing.assert_array_equal(np.asarray(det), np.asarray(forward(params, toks, cfg)))
    a = forward(params, toks, cfg, key=jax.random.key(1))
    b = forward(params, toks, cfg, key=jax.random.key(2))
    assert not np.allclose(np.asarray(a), np.asarray(b))


def test_initial_loss_is_near_uniform():
    params, toks, targets = init(TINY), tokens(TINY, B=4), tokens(TINY, B=4, seed=7)
    assert float(loss_fn(params, toks, targets, TINY)) == pytest.approx(np.log(TINY.vocab_size), rel=0.05)


def test_param_count_matches_hand_count():
    L, D, V, F = TINY.n_layers, TINY.d_model, TINY.vocab_size, 4 * TINY.d_model
    hd = D // TINY.n_heads
    per_layer = 4 * D * D + 2 * D * F + 2 * D + 2 * hd
    assert P.count(param_specs(TINY)) == V * D + L * per_layer + D
    L2 = GPT2_LIKE
    per_layer2 = 4 * D * D + 4 * D + 2 * D * F + F + D + 4 * D
    assert P.count(param_specs(L2)) == V * D + L2.block_size * D + L * per_layer2 + 2 * D


def test_packed_documents_give_each_document_its_own_logits():
    """Documents packed into one row (positions restarting, segment ids 1, 2, 3) get the logits each document
    gets alone, and a row's tokens never see another document (a sliding-window layer included)."""
    cfg = dataclasses.replace(TINY, layer_pattern="local,global,global", sliding_window=4)
    params = init(cfg)
    lengths = [5, 8, 3]
    toks = np.asarray(tokens(cfg, B=1, seed=3))[0]
    positions = np.concatenate([np.arange(n) for n in lengths])[None]
    segments = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])[None]
    packed = np.asarray(forward(params, jnp.asarray(toks[None]), cfg, positions_BT=jnp.asarray(positions),
                                segment_ids_BT=jnp.asarray(segments, jnp.int32)))[0]
    start = 0
    for n in lengths:
        alone = np.asarray(forward(params, jnp.asarray(toks[None, start:start + n]), cfg))[0]
        np.testing.assert_allclose(packed[start:start + n], alone, atol=1e-5)
        start += n


def test_loss_weights_count_only_weighted_tokens():
    params = init(TINY)
    toks = tokens(TINY)
    weights = jnp.zeros(toks.shape).at[:, 5:9].set(1.0)
    weighted = loss_fn(params, toks, toks, TINY, weights_BT=weights)
    logits = forward(params, toks, TINY)[:, 5:9]
    want = jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, toks[:, 5:9, None], -1)[..., 0])
    assert float(weighted) == pytest.approx(float(want), rel=1e-6)
    # A masked token's target changes nothing.
    other = toks.at[:, 2].set((toks[:, 2] + 1) % TINY.vocab_size)
    g0 = jax.grad(loss_fn)(params, toks, toks, TINY, weights_BT=weights)
    g1 = jax.grad(loss_fn)(params, toks, other, TINY, weights_BT=weights)
    assert all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)))
