"""The paged KV cache: transformer.paged_forward over pages scattered through a pool gives the logits of the
uncached forward pass (prefill chunks read by rows, decode steps and verification flat, layers unrolled and
scanned) for the families' attention variants, the 2025-26 families' too (latent attention, sinks, chunked and
no-rope layers, dense and MoE layers stacked apart); the paged engine serves those families as the slot engine
does; the host's page pool counts references, shares prompt prefixes by full pages and hands cached pages out
again oldest first."""

import time

import jax
import numpy as np
import pytest

from jaxlm import params as P, sharding
from jaxlm.config import MeshConfig, ModelConfig
from jaxlm.model import forward, paged, param_specs, transformer
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


@pytest.mark.parametrize("family,quantize", [
    ("gqa", False), ("sliding", True), ("gemma2", False), ("learned_moe", False), ("deepseek_v3", False),
    *(pytest.param(*case, marks=pytest.mark.slow)
      for case in (("gpt_oss", False), ("deepseek_v3", True), ("llama4", False), ("gemma3", False)))])
def test_paged_forward_equals_the_uncached_forward(family, quantize):
    """Three sequences in pages of 4 positions taken at random from a 64-page pool (a window of 8: the local
    layers' keys span pages): a first chunk of 32 (read by rows; the prompts 5 to 22 tokens, the rest padding),
    six decode steps with the layers unrolled in which one row sits out every other step (length 0: it writes
    and reads nothing), then three tokens at once with every logit (flat, scanned layers). Each gives the logits
    of the uncached forward pass at its positions (int8 within its rounding); the pages no row holds keep their
    zeros."""
    cfg = ModelConfig(**{**dict(vocab_size=50, block_size=64, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32,
                                sliding_window=8), **MODELS[family]})
    params = P.init(param_specs(cfg), jax.random.key(0), sharding.make_mesh(MeshConfig(), jax.devices()[:1]))
    A, NP, M = 4, 64, 12
    cache = paged.init(cfg, NP, A, quantize)
    rng = np.random.default_rng(0)
    lengths = np.asarray([13, 5, 22], np.int32)
    seqs = [rng.integers(0, 50, 40).astype(np.int32) for _ in lengths]
    table = rng.permutation(NP)[:3 * M].reshape(3, M).astype(np.int32)
    full = [np.asarray(forward(params, s[None], cfg)[0]) for s in seqs]
    run = jax.jit(transformer.paged_forward, static_argnames=("cfg", "all_logits"))
    assert np.abs(np.diff(full[2], axis=0)).max() > 0.1  # logits that differ from token to token
    tol = 0.02 * max(np.abs(f).max() for f in full) if quantize else 2e-5  # int8: within its rounding
    tokens = np.zeros((3, 32), np.int32)
    for b, n in enumerate(lengths):
        tokens[b, :n] = seqs[b][:n]
    logits, cache = run(params, cache, tokens, np.zeros(3, np.int32), lengths, table, cfg)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(logits[b], full[b][n - 1], rtol=0, atol=tol)
    layer_params = transformer.layer_weights(params, cfg)
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
            assert not np.asarray(pool)[:, unheld].any()
            assert np.asarray(pool)[:, held].any()


def test_a_pages_layout_and_size_follow_the_entries():
    cfg = ModelConfig(vocab_size=50, block_size=64, n_layers=4, n_heads=4, n_kv_heads=2, d_model=32)
    cache = paged.init(cfg, 10, 16, quantize=True)
    assert cache.pages == 10 and cache.page_size == 16
    assert {name: a.shape for name, a in cache.kinds[0].items()} == {
        "k": (4, 10, 2, 16, 8), "v": (4, 10, 2, 16, 8), "k_scale": (4, 10, 16, 2), "v_scale": (4, 10, 16, 2)}
    assert paged.bytes_per_token(cfg, quantize=True) == 4 * 2 * (2 * 8 + 2 * 4)
    assert paged.bytes_per_token(cfg) == 4 * 2 * 2 * 8 * 4  # float32: layers x (k, v) x heads x width x 4 bytes


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
    args = (params, transformer.layer_weights(params, cfg), cache, np.zeros((rows, 1), np.int32),
            np.full(rows, 20, np.int32), np.full(rows, 21, np.int32), np.zeros((rows, table_width), np.int32))
    step = jax.jit(lambda params, lw, cache, tok, start, length, table: transformer.paged_forward(
        params, cache, tok, start, length, table, cfg, lw), donate_argnums=2)
    memory = step.lower(*args).compile().memory_analysis()
    assert memory.alias_size_in_bytes == pool  # the pool in is the pool out
    assert memory.temp_size_in_bytes < pool / 20, (memory.temp_size_in_bytes, pool)


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
    from jaxlm.serve import engine as engine_lib

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
        e = engine_lib.Engine(params, cfg, 4, 48, max_queue=8, prefill_chunk=8, prefix_cache=2, decode_steps=4,
                              page_size=page_size, cache_pages=pages)
        events = [[] for _ in prompts]
        for i, p in enumerate(prompts):
            stop = (tokens(runs[0][2])[0][5],) if page_size and i == 2 else ()
            e.submit(engine_lib.Sequence(p, max_tokens[i], temperature[i], 0, 1.0, 5 + i, 0, stop, events[i].append))
        e.start()
        deadline = time.monotonic() + 300
        try:
            while not all(ev and ev[-1][0] == "done" for ev in events):
                assert time.monotonic() < deadline, "the engine did not finish in time"
                time.sleep(0.01)
        finally:
            e.stop()
        runs[page_size] = events
        assert e.pages_used() == 0 and not any(e.slots)
    assert e.preempted_total > 0 and e.prefix_hits_total > 0

    for i, (a, b) in enumerate(zip(runs[0], runs[4])):
        (ta, la), (tb, lb) = tokens(a), tokens(b)
        if i == 2:  # stopped at the slot engine's 6th token (or at an earlier equal one)
            assert tb == ta[:len(tb)] and tb[-1] == ta[5] and len(tb) <= 6 and b[-1] == ("done", "stop")
            continue
        assert ta == tb and a[-1] == b[-1] and len(ta) == max_tokens[i]
        np.testing.assert_allclose(la, lb, rtol=0, atol=1e-4)
