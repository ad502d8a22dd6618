"""The TPU tier's checks of our ragged paged-attention kernel (model/ragged_paged.py) and of the megablox grouped
matmul behind model.moe_matmul=megablox, compiled for the chip (not interpreted): the kernel against a float64
reference at the serving engine's shapes (pages of 128 positions, heads of 128 lanes, grouped queries, decode rows
and a prefill chunk, soft-cap; its defaults and the kernel as first written), the pool's write kernel against XLA's
scatter, and a mixture-of-experts layer's values and gradients by megablox against ragged_dot on the chip."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm.model import moe, paged, ragged_paged
from test_expert import SWIGLU, K as TOP_K, _layer
from test_pool_write import rows_of
from test_ragged_paged import FIRST, reference

pytestmark = pytest.mark.tpu


# WHOLE_BLOCKS: blocks of two pages computed whole (serve.attention_kernel_options=block_tokens=256,page_steps=0,
# the setting that took attention's share of the 1B serve round from 23% to 17%: docs/serve.md)
WHOLE_BLOCKS = dict(block_tokens=256, page_steps=False)


@pytest.mark.parametrize("variant", [{}, FIRST, WHOLE_BLOCKS], ids=["default", "first", "whole_blocks"])
@pytest.mark.parametrize("K,N,C,softcap", [(8, 32, 1, None), (2, 8, 1, 30.0), (2, 8, 64, None)])
def test_ragged_kernel_on_the_chip_gives_the_reference_attention(K, N, C, softcap, variant, tpu):
    """Rows of 0 to 700 keys (page edges, one key past them, several blocks of 4 pages) in pages of 128 scattered
    through a pool of bf16 keys and values 128 wide, C queries a row at its last positions: the chip's output is
    the float64 reference's from the same bf16 inputs within bf16 rounding of the probabilities, with the kernel's
    defaults (kv heads batched, a page at a time, two blocks read ahead), as first written (all three off) and with
    blocks of two pages computed whole."""
    A, M = 128, 6
    lengths = np.array([0, 1, 2, 127, 128, 129, 255, 256, 300, 511, 512, 513, 640, 700], np.int32)
    rng = np.random.default_rng(K * 1000 + C)
    Pn, H = len(lengths), 128
    NP = Pn * M + 3
    with jax.default_device(tpu):
        k = jnp.asarray(rng.normal(size=(K, NP, A, H)), jnp.bfloat16)
        v = jnp.asarray(rng.normal(size=(K, NP, A, H)), jnp.bfloat16)
        q = jnp.asarray(rng.normal(size=(Pn, C, N, H)), jnp.bfloat16)
        ids = rng.permutation(NP)[:Pn * M].reshape(Pn, M).astype(np.int32)
        q_pos = lengths[:, None] - C + np.arange(C, dtype=np.int32)
        q_pos = np.where(q_pos >= 0, q_pos, -1).astype(np.int32)
        out = ragged_paged.ragged_paged_attention(q, k, v, jnp.asarray(lengths), jnp.asarray(ids),
                                                  jnp.asarray(q_pos), scale=0.09, softcap=softcap,
                                                  interpret=tpu.platform != "tpu", **variant)  # a dry run: CPU
        assert out.devices() == {tpu}
    want = reference(q, k, v, lengths, ids, q_pos, 0.09, softcap)
    got = np.asarray(out.astype(jnp.float32))
    err = float(np.abs(got - want).max())
    print(f"K={K} N={N} C={C} softcap={softcap} {variant or 'default'}: largest error {err:.3g}")
    assert np.abs(want).max() > 0.5 and err <= 2e-2
    assert not got[0].any() and not got[q_pos < 0].any()


@pytest.mark.parametrize("C,dtype", [(1, "bfloat16"), (21, "bfloat16"), (1, "int8"), (21, "int8")])
def test_pool_write_kernel_on_the_chip_writes_as_the_scatter(C, dtype, tpu):
    """The pool's write kernel (write_kernel=1, the default) compiled for the chip: decode rows at every kind of
    offset and chunks of 21 tokens spanning groups and pages, into a packed pool of pages of 128 (8 kv heads, keys
    and values of 64 side by side), repeat 1 of 2, in bfloat16 and in int8 (the kernel's lowering for an int8 pool:
    the engine itself writes int8 pools, whose scales need the flat path, by the scatter): the pool equals XLA's
    scatter's to the bit."""
    K, R, NP, A = 8, 2, 16, 128
    rng = np.random.default_rng(C)
    page, off = rows_of(C, NP, A, rng)
    draw = (lambda shape: rng.normal(size=shape)) if dtype == "bfloat16" else (
        lambda shape: rng.integers(-127, 128, size=shape))
    with jax.default_device(tpu):
        arrays = {"kv": jnp.asarray(draw((K, R, NP, A, 128)), dtype)}
        new = {"kv": jnp.asarray(draw((*page.shape, K, 128)), dtype)}
        kernel = ragged_paged.Kernel(interpret=tpu.platform != "tpu", write_kernel=True)  # a dry run: CPU
        got = jax.jit(lambda a, n, p, o: paged.write(a, 1, n, p, o, kernel))(arrays, new, page, off)["kv"]
        want = jax.jit(lambda a, n, p, o: paged.write(a, 1, n, p, o))(arrays, new, page, off)["kv"]
        assert got.devices() == {tpu}
    assert bool((got == want).all()) and not bool((got == arrays["kv"]).all())


def test_megablox_on_the_chip_equals_ragged_dot(tpu):
    """One mixture-of-experts layer (8 experts, top 2, uneven routing with an expert of no tokens) in float32 on the
    chip: output, routing statistics and gradients by megablox's kernels equal ragged_dot's within the chip's
    float32 matmul rounding (operands in bf16 passes at the default precision)."""
    p, x = jax.device_put(_layer(T=7), tpu)

    def run(matmul):
        def loss(x, p):
            y, stats = moe.moe(x, p, SWIGLU, moe.Router(TOP_K), matmul=matmul)
            return jnp.sum(y ** 2) + moe.load_balancing_loss(stats[None]), (y, stats)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, p)

    (_, (y0, s0)), g0 = run("ragged_dot")
    (_, (y1, s1)), g1 = run("megablox")
    np.testing.assert_array_equal(s1, s0)
    scale = float(jnp.abs(y0).max())
    assert float(jnp.abs(y1 - y0).max()) <= 1e-2 * scale
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.all(np.isfinite(a)) and np.abs(a - b).max() <= 2e-2 * np.abs(b).max()
