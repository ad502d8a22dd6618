"""Keys and values written into the paged pool by our Pallas kernel (model/pool_write.py, `write_kernel=1` of the
ragged kernel's settings), run in Pallas' TPU interpret mode on the CPU: the same pool to the bit as XLA's scatter
for decode rows and prompt chunks (out-of-range pages dropped, a layer's pages never spilling into the next's), the
paged steps' pools and logits unchanged; and Mosaic's lowering for a TPU v5e from this host, the pool in place."""

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


def rows_of(C: int, NP: int, A: int, rng):
    """Pages and offsets [P, C] of rows of C tokens at consecutive positions: each row its own pages (a table of 3),
    starting anywhere in a group, the last tokens past its length (padding) at page NP; C = 1, decode rows at every
    kind of offset (a page's first and last position, a group's first and last), two of them dropped."""
    if C == 1:
        page = np.array([0, 1, 2, 3, 4, NP + 3, NP, 5, 7], np.int32)[:, None]
        return page, np.array([0, A - 1, 16, 15, 7, 3, 0, 17, A - 2], np.int32)[:, None]
    tables = rng.permutation(NP)[:12].reshape(4, 3)
    start, length = np.array([0, 5, A - 3, 9]), np.array([C, C - 4, C, 1])
    pos = start[:, None] + np.arange(C)
    page = np.where(np.arange(C) < length[:, None], np.take_along_axis(tables, pos // A, 1), NP)
    return page.astype(np.int32), (pos % A).astype(np.int32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("C", [1, 21])
def test_the_kernel_writes_the_pool_as_the_scatter_does(dtype, packed, C):
    """Decode rows (one token each, at every kind of offset) and chunks of 21 tokens (rows starting anywhere in a
    group, spanning pages, padding past a row's length) in repeat 1 of 2; pages NP and NP + 3 (past this repeat's
    pages: the next repeat's if added blindly) dropped, as the engine's padding is; heads of 12 padded to 128
    lanes. Keys and values apart or packed. The pool equals the scatter's to the bit."""
    K, R, NP, A, H = 2, 2, 16, 32, 12
    rng = np.random.default_rng(C)
    page, off = rows_of(C, NP, A, rng)
    names = ("kv",) if packed else ("k", "v")
    arrays = {n: jnp.asarray(rng.normal(size=(K, R, NP, A, 128)), dtype) for n in names}
    new = {n: jnp.asarray(rng.normal(size=(*page.shape, K, 2 * H if packed else H)), dtype) for n in names}
    want = paged.write(arrays, 1, new, page, off)
    got = paged.write(arrays, 1, new, page, off, WRITING)
    for n in names:
        assert got[n].dtype == want[n].dtype and bool((got[n] == want[n]).all()), n
        assert bool((got[n][:, 0] == arrays[n][:, 0]).all())  # repeat 0 untouched
        assert not bool((got[n] == arrays[n]).all())  # it did write
    # pages of a part of a group and pools of part of a vector's lanes are left to the scatter
    assert not pool_write.fits((K, R, NP, 12, 128), 24) and not pool_write.fits((K, R, NP, 32, 64), 24)
    assert pool_write.fits((K, R, NP, A, 128), 24) and not pool_write.fits((K, R, NP, A, 128), 129)


def test_steps_writing_by_the_kernel_leave_the_scatters_pool_and_logits(monkeypatch):
    """A prompt's chunk and decode steps through our attention kernel on a pool of 128 lanes and pages of 16 (as a
    TPU lays it out), the layers scanned and unrolled, a row sitting out a step (its page out of range): with
    write_kernel every entry goes through the write kernel, and the pool and logits are the scatter's, to the
    bit."""
    from jaxlm.model import decode

    calls = []
    real = pool_write.write_rows
    monkeypatch.setattr(pool_write, "write_rows", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
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
    # [rows, tokens, kv heads, key and value]: the prompt's chunk and the decode steps, scanned and unrolled
    assert {shape for shape in calls} == {(3, 16, 2, 16), (3, 1, 2, 16)}, calls
    for a, b in zip(want, got):
        assert np.abs(a).max() > 0.1 and np.array_equal(a, b)
    for a, b in zip(jax.tree.leaves(want_cache), jax.tree.leaves(got_cache)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed (pip install 'jaxlm[tpu]')")
@pytest.mark.parametrize("K,NP,A,P_,C,dtype", [(8, 2048, 128, 64, 1, jnp.bfloat16), (8, 2048, 128, 8, 512, jnp.bfloat16),
                                               (1, 64, 16, 8, 3, jnp.float32)])
def test_the_write_kernel_compiles_for_a_tpu_and_updates_the_pool_in_place(K, NP, A, P_, C, dtype):
    """Mosaic lowers the kernel for a TPU v5e from this host: the 1B shape's decode step (64 rows, 8 kv heads of 64,
    keys and values packed in 128 lanes, pages of 128 of a bfloat16 pool), its prompt chunks of 512, and a float32
    pool of pages of 16; the pool in is the pool out, and the temporaries are the tokens' (padded), not the pool's."""
    from jaxlm.train import aot

    device = aot.tpu_topology("v5e:1x1", 1)[0]
    placed = jax.sharding.SingleDeviceSharding(device)
    spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=placed)  # noqa: E731
    step = jax.jit(lambda pool, new, page, off: pool_write.write_rows(pool, new, page, off), donate_argnums=0)
    compiled = step.lower(spec((K, NP, A, 128), dtype), spec((P_, C, K, 128), dtype), spec((P_, C), jnp.int32),
                          spec((P_, C), jnp.int32)).compile()
    memory = compiled.memory_analysis()
    pool = K * NP * A * 128 * jnp.dtype(dtype).itemsize
    assert "paged_pool_write" in compiled.as_text()
    assert memory.alias_size_in_bytes == pool
    # the tokens, padded by a group each side, their kv heads by the tile's rows (16 at most)
    tokens = P_ * (C + 2 * pool_write.CHUNK) * -(-K // 16) * 16 * 128 * jnp.dtype(dtype).itemsize
    assert memory.temp_size_in_bytes <= 2 * tokens + (64 << 10), (memory.temp_size_in_bytes, tokens)
