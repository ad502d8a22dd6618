"""The paged KV cache: decode.paged_forward over pages scattered through a pool gives the logits of the
uncached forward pass (prefill chunks read by rows, decode steps and verification flat, layers unrolled and
scanned) for the families' attention variants, the 2025-26 families' too (latent attention, sinks, chunked and
no-rope layers, dense and MoE layers stacked apart); the paged engine serves those families as the slot engine
does; the host's page pool counts references, shares prompt prefixes by full pages and hands cached pages out
again oldest first."""

import contextlib

import jax
import numpy as np
import pytest

from jaxlm import params as P, sharding
from jaxlm.config import MeshConfig, ModelConfig, ServeConfig
from jaxlm.model import decode, forward, paged, param_specs, ragged_paged
from jaxlm.serve.pages import PagePool
from test_generate import TINY_2025

MODELS = {  # grouped-query heads; a sliding window over every layer; Gemma 2's local/global pattern with soft-caps;
    # learned positions with a mixture-of-experts MLP
    "gqa": dict(),
    "sliding": dict(layer_pattern="local", norm="rmsnorm", glu=True, activation="silu"),
    "gemma2": dict(n_layers=4, layer_pattern="local,global", attn_logit_softcap=5.0, final_logit_softcap=3.0,
                   post_norms=True, norm_plus_one=True, embed_scale=True),
    "learned_moe": dict(position="learned", n_experts=4, experts_per_token=2),
    **{name: {**TINY_2025[name], "init_std": 0.2} for name in ("deepseek_v3", "gpt_oss", "llama4", "gemma3")},
}


@pytest.mark.parametrize("family,quantize,lane", [
    ("gqa", False, 1), ("sliding", True, 1), ("gemma2", False, 1), ("learned_moe", False, 1),
    ("deepseek_v3", False, 1), ("gqa", False, 128), ("sliding", True, 128), ("deepseek_v3", False, 128),
    # a packed pool (packed_kv), read in XLA by the local layers and by our kernel (interpret mode) by the global
    # (gemma2's with the lanes padded and cut inside the kernel: lanes_in_kernel)
    *(pytest.param(family, False, paged.PoolFormat(128, ragged_paged.Kernel(
        interpret=True, packed_kv=True, lanes_in_kernel=family == "gemma2")), id=f"{family}-packed")
      for family in ("sliding", "gemma2")),
    *(pytest.param(*case, marks=pytest.mark.slow)
      for case in (("gpt_oss", False, 1), ("deepseek_v3", True, 1), ("llama4", False, 1), ("gemma3", False, 1)))])
def test_paged_forward_equals_the_uncached_forward(family, quantize, lane):
    """Three sequences in pages of 4 positions taken at random from a 64-page pool (a window of 8: the local
    layers' keys span pages): a first chunk of 32 (read by rows; the prompts 5 to 22 tokens, the rest padding),
    six decode steps with the layers unrolled in which one row sits out every other step (length 0: it writes
    and reads nothing), then three tokens at once with every logit (flat, scanned layers). Each gives the logits
    of the uncached forward pass at its positions (int8 within its rounding); the pages no row holds keep their
    zeros. With lane 128 (what TPUs take) the pool's vectors are padded to 128 wide, to the same logits; packed
    (a format whose kernel packs a kv head's key and value in one vector), the same."""
    cfg = ModelConfig(**{**dict(vocab_size=50, block_size=64, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32,
                                sliding_window=8), **MODELS[family]})
    params = P.init(param_specs(cfg), jax.random.key(0), sharding.make_mesh(MeshConfig(), jax.devices()[:1]))
    A, NP, M = 4, 64, 12
    fmt = lane if isinstance(lane, paged.PoolFormat) else paged.PoolFormat(lane)
    cache = paged.init(cfg, NP, A, quantize, fmt)
    assert ("kv" in cache.kinds[0]) == paged.packs(fmt)
    rng = np.random.default_rng(0)
    lengths = np.asarray([13, 5, 22], np.int32)
    seqs = [rng.integers(0, 50, 40).astype(np.int32) for _ in lengths]
    table = rng.permutation(NP)[:3 * M].reshape(3, M).astype(np.int32)
    full = [np.asarray(forward(params, s[None], cfg)[0]) for s in seqs]
    run = jax.jit(decode.paged_forward, static_argnames=("cfg", "all_logits"))
    assert np.abs(np.diff(full[2], axis=0)).max() > 0.1  # logits that differ from token to token
    tol = 0.02 * max(np.abs(f).max() for f in full) if quantize else 2e-5  # int8: within its rounding
    tokens = np.zeros((3, 32), np.int32)
    for b, n in enumerate(lengths):
        tokens[b, :n] = seqs[b][:n]
    logits, cache = run(params, cache, tokens, np.zeros(3, np.int32), lengths, table, cfg)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(logits[b], full[b][n - 1], rtol=0, atol=tol)
    layer_params = decode.layer_weights(params, cfg)
    L = lengths.copy()
    for i in range(6):
        live = np.asarray([1, 1, i % 2], np.int32)
        tokens = np.asarray([seqs[b][L[b]] for b in range(3)], np.int32)[:, None]
        logits, cache = run(params, cache, tokens, L * live, (L + 1) * live, table, cfg, layer_params)
        for b in np.flatnonzero(live):
            np.testing.assert_allclose(logits[b], full[b][L[b]], rtol=0, atol=tol)
        L = L + live
    tokens = np.stack([seqs[b][L[b]:L[b] + 3] for b in range(3)])
    logits, cache = run(params, cache, tokens, L, L + 3, table, cfg, None, True)
    for b in range(3):
        np.testing.assert_allclose(logits[b], full[b][L[b]:L[b] + 3], rtol=0, atol=tol)
    held = sorted({int(p) for b in range(3) for p in table[b, :-(-(L[b] + 3) // A)]})
    unheld = np.setdiff1d(np.arange(NP), held)
    for kind in cache.kinds:
        for pool in kind.values():
            assert not np.take(np.asarray(pool), unheld, axis=-3).any()  # [..., NP, page, last]
            assert np.take(np.asarray(pool), held, axis=-3).any()


def test_a_pages_layout_and_size_follow_the_entries():
    cfg = ModelConfig(vocab_size=50, block_size=64, n_layers=4, n_heads=4, n_kv_heads=2, d_model=32)
    cache = paged.init(cfg, 10, 16, quantize=True)
    assert cache.pages == 10 and cache.page_size == 16
    assert {name: a.shape for name, a in cache.kinds[0].items()} == {
        "k": (2, 4, 10, 16, 8), "v": (2, 4, 10, 16, 8), "k_scale": (4, 10, 16, 2), "v_scale": (4, 10, 16, 2)}
    assert paged.bytes_per_token(cfg, quantize=True) == 4 * 2 * (2 * 8 + 2 * 4)
    assert paged.bytes_per_token(cfg) == 4 * 2 * 2 * 8 * 4  # float32: layers x (k, v) x heads x width x 4 bytes
    # on TPU (lanes 128) keys and values are padded to 128 wide, the scales are not
    assert paged.pool_format("tpu").lane == 128 and paged.pool_format("cpu") == paged.PoolFormat(1, None)
    padded = paged.init(cfg, 10, 16, quantize=True, fmt=paged.PoolFormat(lane=128))
    assert {name: a.shape for name, a in padded.kinds[0].items()} == {
        "k": (2, 4, 10, 16, 128), "v": (2, 4, 10, 16, 128), "k_scale": (4, 10, 16, 2), "v_scale": (4, 10, 16, 2)}
    assert paged.bytes_per_token(cfg, quantize=True, lane=128) == 4 * 2 * (2 * 128 + 2 * 4)
    # serve.page_size's default (-1) is the format's page: 128 on TPU, whose kernel copies a page at a time
    assert ServeConfig().page_size == -1
    assert paged.page_size(-1, paged.pool_format("tpu")) == 128 and paged.page_size(-1, paged.pool_format("cpu")) == 16
    assert paged.page_size(-1) == 16 and paged.page_size(0) == 0 and paged.page_size(4, paged.pool_format("tpu")) == 4


@pytest.fixture
def page_kernel():
    """JAX's Pallas paged-attention kernel, for a pool's format (paged.PoolFormat), counting its calls in
    `page_kernel.calls`: on a TPU compiled for the chip, elsewhere run in TPU interpret mode (the kernel's own
    program, its DMAs and semaphores simulated on the CPU)."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    calls = []

    def kernel(*args, **kw):  # called while a step is traced, in whichever thread traces it (the engine's too)
        calls.append(kw["pages_per_compute_block"])
        with contextlib.nullcontext() if jax.default_backend() == "tpu" else pltpu.force_tpu_interpret_mode():
            return paged_attention(*args, **kw)

    kernel.calls = calls
    return kernel


DECODE_PAGE, DECODE_PAGES, DECODE_TABLE = 8, 64, 8  # the kernel tests' pool: pages of 8 tokens, tables of 8 pages


def decode_inputs(cfg: ModelConfig, device):
    """The kernel tests' decode steps (here and in tests/test_tpu_numerics.py): the model's weights on `device`,
    three rows' prompt lengths, their token sequences, page tables, padded prompts and layer weights."""
    params = P.init(param_specs(cfg), jax.random.key(0), sharding.make_mesh(MeshConfig(), [device]))
    rng = np.random.default_rng(0)
    lengths = np.asarray([13, 5, 22], np.int32)
    seqs = [rng.integers(0, cfg.vocab_size, 40).astype(np.int32) for _ in lengths]
    table = rng.permutation(DECODE_PAGES)[:3 * DECODE_TABLE].reshape(3, DECODE_TABLE).astype(np.int32)
    tokens = np.zeros((3, 32), np.int32)
    for b, n in enumerate(lengths):
        tokens[b, :n] = seqs[b][:n]
    return params, lengths, seqs, table, tokens, decode.layer_weights(params, cfg)


# gemma2 at the pool's own width (the kernel reads the global layers; the window's keep the flat path), gqa with every
# layer through the kernel at TPU's 128 lanes (the query padded, the output cut back)
@pytest.mark.parametrize("family,lane", [("gemma2", 1), ("gqa", 128)])
def test_decode_steps_through_the_page_attention_kernel_give_the_flat_paths_logits(family, lane, page_kernel,
                                                                                     monkeypatch):
    """Decode steps whose global layers read their pages with the Pallas kernel (paged.kernel_decode: the pool's
    layers seen as one axis of pages, the page table offset by the layer) give the logits of the flat path, the
    layers scanned and unrolled, with a row that sits out a step (length 0); Gemma 2's local layers (a window)
    and soft-capped logits: the kernel caps them, the window's layers keep the flat path. With lane 128 (TPU's
    pool) the query is padded to the pool's width and the output cut back."""
    cfg = ModelConfig(**{**dict(vocab_size=50, block_size=64, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32,
                                sliding_window=8), **MODELS[family]})
    params, lengths, seqs, table, tokens, lw = decode_inputs(cfg, jax.devices()[0])
    A, NP = DECODE_PAGE, DECODE_PAGES
    monkeypatch.setattr(paged, "KERNEL_BLOCK_TOKENS", 32)

    def steps(kernel):
        jax.clear_caches()
        _, cache = decode.paged_forward(params, paged.init(cfg, NP, A, fmt=paged.PoolFormat(lane, kernel)),
                                        tokens, np.zeros(3, np.int32), lengths, table, cfg)
        L, out = lengths.copy(), []
        for step in range(4):
            tok = np.asarray([seqs[b][L[b]] for b in range(3)], np.int32)[:, None]
            length = np.where(np.arange(3) == 1, 0, L + 1).astype(np.int32) if step == 1 else L + 1
            logits, cache = jax.jit(decode.paged_forward, static_argnames="cfg")(
                params, cache, tok, L, length, table, cfg, lw if step % 2 else None)
            out.append(np.asarray(logits)[length > 0])
            L = np.where(length > 0, L + 1, L).astype(np.int32)
        return out

    flat = steps(None)
    through_kernel = steps(page_kernel)
    layers = cfg.n_layers // 2 if family == "gemma2" else cfg.n_layers
    assert len(page_kernel.calls) == 1 + layers  # traced once with the layers scanned, once per layer unrolled
    assert set(page_kernel.calls) == {4}  # blocks of 32 keys: a table of 8 pages of 8 in two
    for a, b in zip(flat, through_kernel):
        assert np.abs(a).max() > 0.1
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-3)  # float32 sums in another order


@pytest.mark.parametrize("rows,table_width", [(1, 5), (4, 5), (1, 16), (8, 8)])
def test_a_decode_step_updates_the_pool_in_place_whatever_its_table_width(rows, table_width):
    """A decode step over a donated pool of 2,000 pages needs no pool-sized buffer of its own, also where every
    row's pages fit one block of the flat path's loop (narrow tables, few rows: XLA:CPU once copied the whole pool
    there, every step, so that a 1-row step of a 4-layer model took 8 ms over 2,000 pages and 140 ms over
    20,000 instead of 0.3)."""
    cfg = ModelConfig(vocab_size=64, block_size=64, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, d_ff=64)
    params = P.init(param_specs(cfg), jax.random.key(0), sharding.make_mesh(MeshConfig(), jax.devices()[:1]))
    cache = paged.init(cfg, 2000, 16)
    pool = sum(x.nbytes for x in jax.tree.leaves(cache))
    args = (params, decode.layer_weights(params, cfg), cache, np.zeros((rows, 1), np.int32),
            np.full(rows, 20, np.int32), np.full(rows, 21, np.int32), np.zeros((rows, table_width), np.int32))
    step = jax.jit(lambda params, lw, cache, tok, start, length, table: decode.paged_forward(
        params, cache, tok, start, length, table, cfg, lw), donate_argnums=2)
    memory = step.lower(*args).compile().memory_analysis()
    assert memory.alias_size_in_bytes == pool  # the pool in is the pool out
    assert memory.temp_size_in_bytes < pool / 20, (memory.temp_size_in_bytes, pool)


@pytest.mark.parametrize("rows,chunk,table_width,kernel", [(1, 16, 1, False), (8, 512, 32, False),
                                                            (64, 1, 128, False), (64, 1, 128, True)])
def test_paged_steps_compiled_for_a_tpu_update_the_pool_in_place(rows, chunk, table_width, kernel):
    """The engine's paged programs compiled for a TPU v5e (libtpu, from this CPU host) with heads of 64, as the
    134M benchmark model has: a short prompt chunk (flat), a long one (by rows) and a decode step of 64 rows (flat
    and through the Pallas kernel) need no pool-sized temporaries. Before the pool was padded to 128 lanes, its
    writes indexed per head and the flat path's dots taken at full precision, XLA:TPU copied or cast the whole pool
    in each (the engine ran out of the chip's memory at its warm-up at the default cache size)."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
    from jax.sharding import SingleDeviceSharding

    from jaxlm.train import aot
    from jaxlm.serve import programs

    device = aot.tpu_topology("v5e:1x1", 1)[0]
    fmt = paged.pool_format(device.platform, "jax")  # 128 lanes, JAX's Pallas kernel (ours: test_ragged_paged.py)
    assert fmt.kernel is paged_attention
    fmt = fmt if kernel else fmt._replace(kernel=None)
    cfg = ModelConfig(vocab_size=1024, block_size=2048, n_layers=2, n_heads=12, n_kv_heads=12, d_model=768,
                      d_ff=2048, norm="rmsnorm", glu=True, activation="silu")

    def on_tpu(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=SingleDeviceSharding(device)),
                            tree)

    params = on_tpu(P.abstract(param_specs(cfg)))
    lw = on_tpu(jax.eval_shape(lambda p: decode.layer_weights(p, cfg), params))
    cache = on_tpu(jax.eval_shape(lambda: paged.init(cfg, 8192, 16, fmt=fmt)))  # 3.2 GB
    assert cache.kinds[0]["k"].shape == (12, 2, 8192, 16, 128)
    i32 = lambda *shape: on_tpu(jax.ShapeDtypeStruct(shape, np.int32))  # noqa: E731
    logits = on_tpu(jax.ShapeDtypeStruct((64, cfg.vocab_size), np.float32))
    compiled = programs.paged_prefill.lower(params, lw, cache, logits, i32(rows, chunk), i32(rows), i32(rows),
                                            i32(rows, table_width), i32(rows), i32(rows), cfg).compile()
    memory = compiled.memory_analysis()
    pool = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
    assert memory.alias_size_in_bytes >= pool  # the pool in is the pool out
    assert memory.temp_size_in_bytes < pool / 20, (memory.temp_size_in_bytes, pool)
    assert ("jit(paged_attention)/pallas_call" in compiled.as_text()) == kernel  # the Pallas kernel, if asked for


def test_the_paged_engine_through_the_page_attention_kernel_gives_the_flat_paths_tokens(page_kernel):
    """The paged engine whose decode steps read pages with the Pallas kernel gives the tokens and log-probabilities
    (to float rounding) of the flat path: greedy and seeded sampling, a shared prompt prefix, preemption (a pool
    of 16 pages of 4 positions for 4 sequences of up to 30), speculation off; afterwards no page is held."""
    from jaxlm.serve.engine import Engine
    from jaxlm.serve.requests import Sequence

    cfg = ModelConfig(vocab_size=50, block_size=64, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32)
    params = P.init(param_specs(cfg), jax.random.key(1), sharding.make_mesh(MeshConfig(), jax.devices()[:1]))
    rng = np.random.default_rng(1)
    shared = rng.integers(0, 50, 9).tolist()
    prompts = [rng.integers(0, 50, n).tolist() for n in (5, 13, 3)] + [shared + [7], shared + [8, 9]]
    max_tokens, temperature = [16, 12, 18, 10, 14], [0, 0.9, 0, 1.0, 0]
    runs = []
    for decode_kernel in (None, page_kernel):
        e = Engine(params, cfg, ServeConfig(max_slots=4, max_queue=8, prefill_chunk=8, prefix_cache=0,
                                            decode_steps=4, page_size=4), 48,
                   cache_pages=16, page_format=paged.PoolFormat(kernel=decode_kernel))
        events = e.run([Sequence(p, max_tokens[i], temperature[i], 0, 1.0, 5 + i, 0, (), None)
                        for i, p in enumerate(prompts)], timeout=300)
        assert e.kv.pages.used() == 0
        runs.append(([[t for ev in evs if ev[0] == "tokens" for t in ev[1]] for evs in events],
                     [[lp for ev in evs if ev[0] == "tokens" for lp in ev[2]] for evs in events], e.preempted_total))
    assert page_kernel.calls, "the kernel was not used"
    (tokens_flat, lp_flat, preempted), (tokens_kernel, lp_kernel, _) = runs
    assert preempted > 0 and [len(t) for t in tokens_flat] == max_tokens
    assert tokens_kernel == tokens_flat
    for a, b in zip(lp_flat, lp_kernel):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-3)


def test_page_pool_counts_references_shares_prefixes_and_evicts_the_oldest():
    pool = PagePool(6, 4)
    a = list(range(10))  # 2 full pages and 2 tokens
    pages_a = pool.take(3)
    assert pages_a == [0, 1, 2] and pool.available() == 3 and pool.used() == 3
    pool.register(a, pages_a)  # its two full pages
    assert pool.shared(a + [99]) == 8 and pool.shared(a[:8]) == 4  # never the page of the last token
    b = a[:8] + [50, 51, 52]
    shared = pool.match(b)
    assert shared == [0, 1] and pool.refs[:3].tolist() == [2, 2, 1]
    pages_b = shared + pool.take(1)
    pool.release(pages_a)
    assert pool.refs[:4].tolist() == [1, 1, 0, 1] and pool.available() == 3  # page 2 back: it holds no full prefix
    pool.release(pages_b)
    assert pool.used() == 0 and pool.available() == 6 and len(pool.cached) == 2  # 0 and 1 stay registered
    assert pool.match([7] + a[1:]) == []  # another first page: nothing shared
    c = pool.take(5)  # four free pages, then the least recently used cached one (page 0), forgotten
    assert sorted(c) == [0, 2, 3, 4, 5] and pool.shared(a + [1]) == 0 and list(pool.cached) == [1]
    pool.release(c)
    assert pool.match(a + [1]) == [] and pool.available() == 6
    off = PagePool(4, 4, share_prefixes=False)
    off.register(a, off.take(3))
    assert off.match(a + [1]) == [] and off.shared(a + [1]) == 0
    with pytest.raises(RuntimeError, match="2 pages asked for, 1 available"):
        off.take(2)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_the_paged_engine_serves_the_2025_families_as_the_slot_engine(family):
    """A DeepSeek-V3-like model (latent attention's pages hold a latent and a rotary key per token; a dense layer
    before MoE layers) and a gpt-oss-like one (sinks, sliding-window and global layers, MoE): six sequences
    (greedy and seeded sampling, two sharing a prompt prefix of two pages, one stopping at a stop token) in a
    pool of 16 pages of 4 positions, a third of what the 4 slots of the slot cache hold, so sequences are
    preempted and prefilled again. Each gets the tokens, ending and log-probabilities (to float rounding) that
    the slot engine gives it; afterwards no page is held."""
    from jaxlm.serve.engine import Engine
    from jaxlm.serve.requests import Sequence

    cfg = ModelConfig(**{**dict(vocab_size=50, block_size=64, n_heads=4, n_kv_heads=2, d_model=32, sliding_window=6),
                         **MODELS[family]})
    params = P.init(param_specs(cfg), jax.random.key(1), sharding.make_mesh(MeshConfig(), jax.devices()[:1]))
    rng = np.random.default_rng(1)
    shared = rng.integers(0, 50, 9).tolist()
    prompts = [rng.integers(0, 50, n).tolist() for n in (5, 13, 3, 11)] + [shared + [7], shared + [8, 9]]
    max_tokens, temperature = [20, 14, 24, 10, 16, 12], [0, 0.9, 0, 1.0, 0, 0.8]
    def tokens(events):
        return [t for ev in events if ev[0] == "tokens" for t in ev[1]], [
            lp for ev in events if ev[0] == "tokens" for lp in ev[2]]

    runs = {}
    for page_size, pages in ((0, None), (4, 16)):
        e = Engine(params, cfg, ServeConfig(max_slots=4, max_queue=8, prefill_chunk=8, prefix_cache=2,
                                            decode_steps=4, page_size=page_size), 48, cache_pages=pages)
        stops = [(tokens(runs[0][2])[0][5],) if page_size and i == 2 else () for i in range(len(prompts))]
        runs[page_size] = e.run([Sequence(p, max_tokens[i], temperature[i], 0, 1.0, 5 + i, 0, stops[i], None)
                                 for i, p in enumerate(prompts)], timeout=300)
        assert e.pages_used() == 0 and not any(e.slots)
    assert e.preempted_total > 0 and e.prefix_hits_total > 0

    for i, (a, b) in enumerate(zip(runs[0], runs[4])):
        (ta, la), (tb, lb) = tokens(a), tokens(b)
        if i == 2:  # stopped at the slot engine's 6th token (or at an earlier equal one)
            assert tb == ta[:len(tb)] and tb[-1] == ta[5] and len(tb) <= 6 and b[-1] == ("done", "stop")
            continue
        assert ta == tb and a[-1] == b[-1] and len(ta) == max_tokens[i]
        np.testing.assert_allclose(la, lb, rtol=0, atol=1e-4)
