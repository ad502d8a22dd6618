"""A decode step's keys and values written into the paged pool by our Pallas kernel (model/pool_write.py,
`write_kernel=1` of the ragged kernel's settings), run in Pallas' TPU interpret mode on the CPU: the same pool to the
bit as XLA's scatter (out-of-range pages dropped, a layer's pages never spilling into the next's), decode steps'
pools and logits unchanged; and Mosaic's lowering for a TPU v5e from this host, the pool updated in place."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm import params as P, sharding
from jaxlm.config import MeshConfig, ModelConfig
from jaxlm.model import paged, param_specs, pool_write, ragged_paged

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
WRITING = ragged_paged.Kernel(interpret=True, write_kernel=True)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("packed", [False, True])
def test_the_kernel_writes_the_pool_as_the_scatter_does(dtype, packed):
    """Rows of one token each (each its own page, as decode rows have) at offsets in every group of a page (first
    and last position included), in repeat 1 of 2; pages NP and NP + 3 (past this repeat's pages: the next
    repeat's if added blindly) dropped, as the engine's padding is; heads of 12 padded to 128 lanes. Keys and values apart or packed."""
    K, R, NP, A, H, Pn = 2, 2, 8, 32, 12, 9
    rng = np.random.default_rng(0)
    names = ("kv",) if packed else ("k", "v")
    arrays = {n: jnp.asarray(rng.normal(size=(K, R, NP, A, 128)), dtype) for n in names}
    new = {n: jnp.asarray(rng.normal(size=(Pn, 1, K, 2 * H if packed else H)), dtype) for n in names}
    page = np.array([0, 1, 2, 3, 4, NP + 3, NP, 5, 7], np.int32)[:, None]
    off = np.array([0, 31, 16, 15, 7, 3, 0, 17, 30], np.int32)[:, None]
    want = paged.write(arrays, 1, new, page, off)
    got = paged.write(arrays, 1, new, page, off, WRITING)
    for n in names:
        assert got[n].dtype == want[n].dtype and bool((got[n] == want[n]).all()), n
        assert bool((got[n][:, 0] == arrays[n][:, 0]).all())  # repeat 0 untouched
        assert not bool((got[n] == arrays[n]).all())  # it did write
    # a chunk of several tokens a row, pages of 8 or lanes of 64 are left to the scatter
    assert not pool_write.fits((K, R, NP, 8, 128), 9) and not pool_write.fits((K, R, NP, 32, 64), 9)
    assert pool_write.fits((K, R, NP, A, 128), 9) and not pool_write.fits((K, R, NP, A, 128), 257)


def test_decode_steps_writing_by_the_kernel_leave_the_scatters_pool_and_logits(monkeypatch):
    """Decode steps through our attention kernel on a pool of 128 lanes and pages of 16 (as a TPU lays it out), the
    layers scanned and unrolled, a row sitting out a step (its page out of range): with write_kernel the decode
    steps' entries go through the write kernel (the prompt's chunk, several tokens a row, through the scatter) and
    the pool and logits are those of the scatter, to the bit."""
    from jaxlm.model import decode

    calls = []
    real = pool_write.write_tokens
    monkeypatch.setattr(pool_write, "write_tokens", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    cfg = ModelConfig(vocab_size=50, block_size=64, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32)
    params = P.init(param_specs(cfg), jax.random.key(0), sharding.make_mesh(MeshConfig(), jax.devices()[:1]))
    lw = decode.layer_weights(params, cfg)
    rng = np.random.default_rng(0)
    lengths = np.asarray([13, 5, 16], np.int32)
    seqs = rng.integers(0, cfg.vocab_size, (3, 24)).astype(np.int32)
    table = rng.permutation(12)[:9].reshape(3, 3).astype(np.int32)
    tokens = np.where(np.arange(16) < lengths[:, None], seqs[:, :16], 0).astype(np.int32)

    def steps(kernel):
        cache = paged.init(cfg, 12, 16, fmt=paged.PoolFormat(128, kernel, 16))
        _, cache = decode.paged_forward(params, cache, tokens, np.zeros(3, np.int32), lengths, table, cfg)
        L, out = lengths.copy(), []
        for step in range(3):
            length = np.where(np.arange(3) == 1, 0, L + 1).astype(np.int32) if step == 1 else L + 1
            logits, cache = jax.jit(decode.paged_forward, static_argnames="cfg")(
                params, cache, seqs[np.arange(3), L][:, None], L, length, table, cfg, lw if step % 2 else None)
            out.append(np.asarray(logits)[length > 0])
            L = np.where(length > 0, L + 1, L).astype(np.int32)
        return out, cache

    (want, want_cache), (got, got_cache) = steps(ragged_paged.Kernel(interpret=True)), steps(WRITING)
    assert calls and all(shape == (3, 2, 128) for shape in calls), calls  # [rows, kv heads, lanes]
    for a, b in zip(want, got):
        assert np.abs(a).max() > 0.1 and np.array_equal(a, b)
    for a, b in zip(jax.tree.leaves(want_cache), jax.tree.leaves(got_cache)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed (pip install 'jaxlm[tpu]')")
@pytest.mark.parametrize("K,NP,A,T,dtype", [(8, 2048, 128, 64, jnp.bfloat16), (1, 64, 16, 8, jnp.float32)])
def test_the_write_kernel_compiles_for_a_tpu_and_updates_the_pool_in_place(K, NP, A, T, dtype):
    """Mosaic lowers the kernel for a TPU v5e from this host: the 1B shape's decode step (64 rows, 8 kv heads,
    pages of 128 of a bfloat16 pool) and a float32 pool of pages of 16; the pool in is the pool out, no temporaries."""
    from jaxlm.train import aot

    device = aot.tpu_topology("v5e:1x1", 1)[0]
    placed = jax.sharding.SingleDeviceSharding(device)
    spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=placed)  # noqa: E731
    step = jax.jit(lambda pool, new, ids, off: pool_write.write_tokens(pool, new, ids, off), donate_argnums=0)
    compiled = step.lower(spec((K, NP, A, 128), dtype), spec((T, K, 128), dtype), spec((T,), jnp.int32),
                          spec((T,), jnp.int32)).compile()
    memory = compiled.memory_analysis()
    assert "paged_pool_write" in compiled.as_text()
    assert memory.alias_size_in_bytes == K * NP * A * 128 * jnp.dtype(dtype).itemsize
    assert memory.temp_size_in_bytes < 1 << 20, memory.temp_size_in_bytes
