"""Memory-shaped rewrites for long sequences (docs/performance.md, "131,072 tokens on one chip") compute what they
replace: the chunked MLP with its norms inside the chunks against the whole MLP (values and every gradient), and
rotary's halves cast separately against the cast of the whole."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm import config as config_lib, params as P, sharding
from jaxlm.model import layers, loss as loss_lib, param_specs


@pytest.mark.parametrize("post_norms", [False, True])
def test_the_mlp_block_in_chunks_with_its_norms_equals_the_whole(post_norms):
    cfg = config_lib.load("quickstart", {"model.block_size": 64, "model.vocab_size": 128, "model.glu": True,
                                         "model.n_layers": 2, "model.post_norms": post_norms})
    m = cfg.model
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    # norm scales away from 1, so that their gradients and the inputs' differ across positions and chunks
    params = jax.tree.map(lambda a: a + 0.1 * jax.random.normal(jax.random.key(5), a.shape, a.dtype),
                          P.init(param_specs(m), jax.random.key(0), mesh))
    tokens = jax.random.randint(jax.random.key(2), (2, 64), 0, m.vocab_size)

    def loss(p, model_cfg):
        return loss_lib.loss_fn(p, tokens, jnp.roll(tokens, -1, axis=1), model_cfg)

    whole, g_whole = jax.value_and_grad(loss)(params, m)
    chunked, g_chunked = jax.value_and_grad(loss)(params, dataclasses.replace(m, mlp_chunk_tokens=16))
    np.testing.assert_allclose(float(chunked), float(whole), rtol=1e-6)
    flat_whole = jax.tree_util.tree_leaves_with_path(g_whole)
    for (path, a), b in zip(flat_whole, jax.tree.leaves(g_chunked)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-4, atol=1e-6,  # float32 sums
                                   err_msg=jax.tree_util.keystr(path))
    mlp_norms = [a for path, a in flat_whole if "mlp_norm" in (name := jax.tree_util.keystr(path))
                 or "mlp_post_norm" in name]  # the norms that moved into the chunks get gradients
    assert len(mlp_norms) == (2 if post_norms else 1) and min(float(jnp.abs(a).max()) for a in mlp_norms) > 1e-4


def test_rotary_halves_cast_separately_equal_the_cast_of_the_whole():
    x = jax.random.normal(jax.random.key(0), (2, 40, 3, 16), jnp.bfloat16)
    pos = jnp.broadcast_to(jnp.arange(40, dtype=jnp.int32), (2, 40)) + 5
    rope = layers.Rope(10000.0)

    def before(x):  # the cast of the whole, then the halves
        H = x.shape[-1]
        angle = pos[..., None].astype(jnp.float32) * layers.rope_frequencies(H, rope)
        sin, cos = jnp.sin(angle)[:, :, None, :], jnp.cos(angle)[:, :, None, :]
        x32 = x.astype(jnp.float32)
        x1, x2 = x32[..., : H // 2], x32[..., H // 2:]
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)

    np.testing.assert_array_equal(np.asarray(layers.rotary(x, pos, rope), np.float32),
                                  np.asarray(before(x), np.float32))
