"""TPU tier: the Pallas kernels compiled for the chip against exact attention (`make test-tpu`; docs/tpu.md). Splash
attention (model/splash.py), forward and gradients, in float32 and bfloat16, causal, with a sliding window, soft-capped
logits and packed segments; the paged decode kernel (JAX's Pallas paged_attention, through paged.kernel_decode) and
the flat path over a pool of 128 lanes, alone and in a model's decode steps. Off a TPU (a dry run) the kernels run in
Pallas interpret mode.

How close is close enough on the chip: its float32 matmuls at JAX's default precision round their operands to
bfloat16 (2^-9 relative), and a kernel's own dots may too. So each kernel is held to the accuracy of XLA's own
attention (attention.attend_heads_major, what the uncached model runs) on the same chip, in the same dtype, at the
default precision: the kernel's largest error against exact attention (float32 at full precision on the CPU beside
the chip, from the same inputs) may be CHIP_FACTOR times XLA's, plus a floor of float32's rounding of a sum (1e-5 of
the output's scale) for a dry run, where XLA's float32 is exact. A mistake of the kernels' bookkeeping (a key of the
window, a segment, a page, a soft cap) costs tenths, far above either."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm.config import ModelConfig
from jaxlm.model import attention, decode, forward, paged, splash
from test_attention import CASES, inputs, loss_of, reference, segments
from test_paged import (DECODE_PAGE, DECODE_PAGES, MODELS, decode_inputs,  # noqa: F401 - page_kernel: a fixture
                        page_kernel)

pytestmark = pytest.mark.tpu

CHIP_FACTOR = 4.0
FLOOR = 1e-5  # of the exact output's scale: float32 sums in another order


def cpu():
    """The CPU beside the chip: exact references in float32 at full precision."""
    return jax.devices("cpu")[0]


def on_cpu_exactly(f, *args):
    """f(*args) on the CPU in float32 at full precision (bfloat16 arguments widened exactly)."""
    args = jax.device_put(jax.tree.map(lambda a: np.asarray(a, np.float32), args), cpu())
    with jax.default_matmul_precision("highest"):
        return jax.tree.map(np.asarray, jax.jit(f)(*args))


def largest_error(got, exact) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - exact)))


def assert_as_accurate_as_xla(name, got, exact, xla_error):
    """`got` (a kernel's) is within CHIP_FACTOR times XLA's own error (xla_error: of its result over the same
    inputs) of `exact`, plus the floor (module docstring)."""
    scale = max(1.0, float(np.abs(exact).max()))
    err = largest_error(got, exact)
    print(f"{name}: error {err:.3g}, XLA's {xla_error:.3g} (scale {scale:.3g})")
    assert err <= CHIP_FACTOR * xla_error + FLOOR * scale, (name, err, xla_error, scale)


# ---- splash attention -------------------------------------------------------------------------------------------

T, H = 512, 128  # four tiles of 128 along each axis: causality and the window skip whole tiles


@pytest.mark.parametrize("case,dtype", [("all", jnp.float32),
                                        *((case, jnp.bfloat16) for case in CASES)])
def test_splash_forward_and_gradients_are_as_accurate_as_xla_attention(case, dtype, tpu):
    """Splash attention compiled for the chip (8 query heads, GQA ratios 1 to 8; CASES of tests/test_attention.py:
    causal; a window of 24 with logits soft-capped at 5; packed segments; all of them) of 2 rows of 512 tokens and
    heads of 128, its output and the gradients of q, k and v, against exact attention, as accurate as XLA's."""
    window, softcap, K, with_segments = CASES[case]
    q, k, v = jax.device_put(inputs(T, K, dtype, H=H), tpu)
    if with_segments:
        pos, seg = segments(2, T)
    else:
        pos, seg = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T)), None
    interpret = tpu.platform != "tpu"

    def ref(q, k, v):
        return reference(q, k, v, pos, seg, window, softcap)

    def kernel(q, k, v):
        return splash.attention(q, k, v, seg, window, None, softcap, block_size=128, interpret=interpret)

    def out_and_grads(f):
        return lambda q, k, v: (f(q, k, v), jax.grad(loss_of(f), argnums=(0, 1, 2))(q, k, v))

    got = jax.tree.map(np.asarray, jax.jit(out_and_grads(kernel))(q, k, v))
    xla = jax.tree.map(np.asarray, jax.jit(out_and_grads(ref))(q, k, v))
    exact = on_cpu_exactly(out_and_grads(ref), q, k, v)
    assert float(np.abs(exact[0]).max()) > 0.5 and all(float(np.abs(g).max()) > 0.05 for g in exact[1])
    for name, g, x, e in zip(("out", "dq", "dk", "dv"), [got[0], *got[1]], [xla[0], *xla[1]],
                             [exact[0], *exact[1]]):
        assert g.dtype == dtype
        assert_as_accurate_as_xla(f"{case} {jnp.dtype(dtype).name} {name}", g, e, largest_error(x, e))


# ---- the paged decode kernel --------------------------------------------------------------------------------

K_HEADS, PAGE, PAGES, REPEATS = 2, 16, 192, 2
LENGTHS = np.array([1, 17, 300, 512, 0], np.int32)  # rows of one key, a page and one, 19 pages, the whole table, none
TABLE_WIDTH = 32  # pages of a row: 512 positions, two blocks of the kernel's 256 keys


def pool_and_queries(dtype, head, groups):
    """A pool [K, R, NP, page, 128] of random keys and values (random in the lanes past `head` too, and in the
    pages no row holds), each row's table of distinct pages, queries [P, 1, K groups, head]."""
    rng = np.random.default_rng(0)
    lanes = paged.pool_shape((K_HEADS, head), REPEATS, PAGES, PAGE, lane=128)
    assert lanes[-1] == 128
    k, v = (jnp.asarray(rng.standard_normal(lanes), dtype) for _ in range(2))
    table = rng.permutation(PAGES)[:len(LENGTHS) * TABLE_WIDTH].reshape(len(LENGTHS), TABLE_WIDTH).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((len(LENGTHS), 1, K_HEADS * groups, head)), dtype)
    return {"k": k, "v": v}, table, q


def gathered(pool, r, table, head):
    """Each row's keys or values of repeat r in table order, [P, K, M page, head] (numpy: independent of paged.py)."""
    x = np.asarray(pool)[:, r][:, table]  # [K, P, M, page, lanes]
    Kh, Pr, M, A, _ = x.shape
    return x.transpose(1, 0, 2, 3, 4).reshape(Pr, Kh, M * A, -1)[..., :head]


def dense(q, k, v, end, softcap):
    """XLA's attention (attention.attend_heads_major) of each row's query over its keys below `end`; rows without
    keys give zeros (as kernel_decode's)."""
    allowed = (jnp.arange(k.shape[2]) < end[:, None])[:, None, :]
    out = attention.attend_heads_major(q, k, v, allowed, softcap=softcap)
    return jnp.where(end[:, None, None, None] > 0, out, 0)


# (pool dtype, head width, soft cap, query heads per kv head): JAX's kernel lays out the queries of 8 (or a multiple)
# per kv head as they come, and others widened to float32
@pytest.mark.parametrize("dtype,head,softcap,groups", [(jnp.float32, 128, None, 4), (jnp.bfloat16, 128, 5.0, 8),
                                                       (jnp.bfloat16, 64, None, 4)])
def test_paged_decode_kernel_and_flat_path_are_as_accurate_as_xla_attention(dtype, head, softcap, groups, tpu,
                                                                             page_kernel):
    """One decode step's attention of 5 rows (lengths 1 to 512 and an empty row; 2 kv heads of 4 or 8 query heads
    each) over the pages of the second of two layers in a pool of 192 pages of 16 positions, 128 lanes wide: through
    the Pallas kernel (paged.kernel_decode, the layer's pages offset in the pool's one axis of pages, the query
    padded to 128 lanes where heads are 64, blocks of 256 keys) and through the flat path (paged.attend_flat). Each
    is as accurate as XLA's attention over the same keys gathered in table order. JAX's kernel computes with keys and
    values in bfloat16 whatever the pool's dtype (its MultiPageAsyncCopyDescriptor.wait_and_get_loaded casts
    them), so its exact reference takes them rounded so; the flat path's takes them as stored."""
    arrays, table, q = pool_and_queries(dtype, head, groups)
    arrays, q = jax.device_put((arrays, q), tpu)
    end, r, scale = jnp.asarray(LENGTHS), 1, head ** -0.5
    kernel = jax.jit(lambda q, arrays: paged.kernel_decode(page_kernel, q, arrays, r, table, end, scale, softcap))
    got_kernel = np.asarray(kernel(q, arrays))
    assert page_kernel.calls == [16]  # pages_per_compute_block: 256 keys of 16-position pages

    def read(ids):
        return tuple(jnp.moveaxis(arrays[name][:, r, ids, :, :head], 0, 1) for name in ("k", "v"))

    flat = jax.jit(lambda q: paged.attend_flat(q, read, K_HEADS, PAGE, jnp.asarray(table), end, (end - 1)[:, None],
                                               scale, softcap, None, None))
    got_flat = np.asarray(flat(q))
    k, v = (gathered(arrays[name], r, table, head) for name in ("k", "v"))
    k, v = jax.device_put((jnp.asarray(k), jnp.asarray(v)), tpu)
    xla = np.asarray(jax.jit(lambda q, k, v: dense(q, k, v, end, softcap))(q, k, v))
    exact = on_cpu_exactly(lambda q, k, v: dense(q, k, v, end, softcap), q, k, v)
    as_bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731 - what the kernel computes with
    exact_bf16_kv = on_cpu_exactly(lambda q, k, v: dense(q, k, v, end, softcap), q, as_bf16(k), as_bf16(v))
    assert float(np.abs(exact).max()) > 0.5
    assert not got_kernel[LENGTHS == 0].any() and not got_flat[LENGTHS == 0].any()
    name = f"{jnp.dtype(dtype).name} heads {head} softcap {softcap} groups {groups}"
    print(f"{name}: the kernel against exact attention over the keys and values as stored "
          f"{largest_error(got_kernel, exact):.3g}")
    xla_error = largest_error(xla, exact)
    assert_as_accurate_as_xla(f"{name} kernel", got_kernel, exact_bf16_kv, xla_error)
    assert_as_accurate_as_xla(f"{name} flat", got_flat, exact, xla_error)


def test_decode_steps_through_the_kernel_give_the_flat_paths_logits(tpu, page_kernel):
    """tests/test_paged.py's decode steps (a prompt chunk, then four steps, layers scanned and unrolled in turn, a
    row sitting one out) of a Gemma-2-like model (local layers with a window read their pages flat, global ones
    through the kernel; soft-capped logits) with heads of 128 in bfloat16, over a pool of 128 lanes: through the
    Pallas kernel and through the flat path only. The logits differ by no more than the flat path's differ from the
    uncached forward pass on the chip (CHIP_FACTOR times, plus a floor of 1e-3 of their scale)."""
    cfg = ModelConfig(**{**dict(vocab_size=50, block_size=64, n_heads=4, n_kv_heads=2, d_model=512, sliding_window=8,
                                compute_dtype="bfloat16"), **MODELS["gemma2"]})
    assert cfg.hd == 128 and cfg.n_layers == 4
    params, lengths, seqs, table, tokens, lw = decode_inputs(cfg, tpu)
    A, NP = DECODE_PAGE, DECODE_PAGES
    run = jax.jit(decode.paged_forward, static_argnames="cfg")

    def steps(kernel):
        """The logits of each decode step's live rows, and their positions."""
        _, cache = run(params, paged.init(cfg, NP, A, fmt=paged.PoolFormat(128, kernel)), tokens,
                       np.zeros(3, np.int32), lengths, table, cfg)
        L, out = lengths.copy(), []
        for step in range(4):
            tok = np.asarray([seqs[b][L[b]] for b in range(3)], np.int32)[:, None]
            length = np.where(np.arange(3) == 1, 0, L + 1).astype(np.int32) if step == 1 else L + 1
            logits, cache = run(params, cache, tok, L, length, table, cfg, lw if step % 2 else None)
            out += [(np.asarray(logits[b], np.float64), b, int(L[b])) for b in np.flatnonzero(length > 0)]
            L = np.where(length > 0, L + 1, L).astype(np.int32)
        return out

    flat = steps(None)
    through_kernel = steps(page_kernel)
    assert len(page_kernel.calls) == 3  # traced once with the layers scanned, once per global layer unrolled
    uncached = jax.jit(forward, static_argnames="cfg")
    full = [np.asarray(uncached(params, s[None], cfg=cfg)[0], np.float64) for s in seqs]
    scale = max(float(np.abs(f).max()) for f, _, _ in flat)
    err = max(largest_error(k, f) for (k, _, _), (f, _, _) in zip(through_kernel, flat))
    noise = max(largest_error(full[b][at], f) for f, b, at in flat)
    print(f"kernel vs flat {err:.3g}, flat vs the uncached forward {noise:.3g} (scale {scale:.3g})")
    assert scale > 0.1 and len(flat) == len(through_kernel) == 11
    assert err <= CHIP_FACTOR * noise + 1e-3 * scale, (err, noise, scale)
