"""Our ragged paged-attention kernel (model/ragged_paged.py), run in Pallas' TPU interpret mode on the CPU: every
row length from 0 to 40 keys in pages of 8 scattered through a pool, decode rows and prefill chunks, grouped-query
heads, soft-cap, float32 and bfloat16, against a plain numpy reference; the paged engine through it gives the flat
path's tokens; it compiles for a TPU v5e from this host (Mosaic's lowering checked without a chip)."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm import params as P, sharding
from jaxlm.config import KERNEL_OPTIONS, ConfigError, MeshConfig, ModelConfig, ServeConfig
from jaxlm.model import paged, param_specs, ragged_paged

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
A, M = 8, 6  # pages of 8 positions, tables of 6 pages: rows of up to 48 keys
LENGTHS = np.arange(41, dtype=np.int32)  # every row length 0..40, one row each


def reference(q, k, v, end, ids, q_pos, scale, softcap):
    """Each row's queries over its keys below end (causal by position), in float64 from the same (rounded)
    inputs; the queries zero-padded to the keys' width. A query that sees no key gives zeros."""
    q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
    Pn, C, N, H = q.shape
    K, _, A, Hk = k.shape
    M = ids.shape[1]
    q = np.pad(q, ((0, 0), (0, 0), (0, 0), (0, Hk - H)))
    keys = k[:, ids].reshape(K, Pn, M * A, Hk).transpose(1, 0, 2, 3)  # [P, K, S, Hk]
    values = v[:, ids].reshape(K, Pn, M * A, -1).transpose(1, 0, 2, 3)
    G = N // K
    s = np.einsum("pcngh,pnsh->pcngs", q.reshape(Pn, C, K, G, Hk), keys) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    pos = np.arange(M * A)
    ok = (pos[None, None, :] < end[:, None, None]) & (pos[None, None, :] <= q_pos[:, :, None])  # [P, C, S]
    s = np.where(ok[:, :, None, None], s, -np.inf)
    top = np.max(s, -1, keepdims=True)
    w = np.where(ok[:, :, None, None], np.exp(s - np.where(np.isfinite(top), top, 0)), 0)
    w = w / np.maximum(w.sum(-1, keepdims=True), 1e-300)
    return np.einsum("pcngs,pnsh->pcngh", w, values).reshape(Pn, C, N, -1)


def rows(seed: int, K: int, C: int, dtype, width: int):
    """The LENGTHS rows' inputs: keys and values [K, pages, A, width] in pages scattered through a pool, 8 query
    heads of 12 a token, C a row at its last C positions (those below 0: -1), and the rows' page tables."""
    rng = np.random.default_rng(seed)
    N, H, Pn = 8, 12, len(LENGTHS)
    NP = Pn * M + 5
    k = jnp.asarray(rng.normal(size=(K, NP, A, width)), dtype)
    v = jnp.asarray(rng.normal(size=(K, NP, A, width)), dtype)
    q = jnp.asarray(rng.normal(size=(Pn, C, N, H)), dtype)
    ids = rng.permutation(NP)[:Pn * M].reshape(Pn, M).astype(np.int32)
    q_pos = LENGTHS[:, None] - C + np.arange(C, dtype=np.int32)
    return k, v, q, ids, np.where(q_pos >= 0, q_pos, -1).astype(np.int32)


CASES = [
    (2, 1, None, jnp.float32, {}),  # decode rows, N = 8 query heads on 2 kv heads, one program
    (2, 1, 3.0, jnp.bfloat16, dict(block_tokens=16, row_bytes=8 * 2 * 4 * 16 * 2)),  # blocks of 2 pages, 8 rows
    (1, 5, 3.0, jnp.float32, dict(block_tokens=24)),  # prefill chunks of 5 on one kv head, blocks of 3 pages
    (2, 20, None, jnp.bfloat16, dict(tile_queries=64, row_bytes=1)),  # chunks of 20 in tiles of 16, a row each
]
# the kernel's variants (ragged_paged_attention's arguments; CASES run the defaults, all three on) and the cases
# each runs: every flag off and on, on decode rows and chunks, in one program and in several, float32 and bfloat16
# (3 s a run); "first" is the kernel as first written
FIRST = dict(heads_batched=False, page_steps=False, prefetch=1)
VARIANTS = {"first": (FIRST, (0, 1, 3)),
            "batched_pages": (dict(heads_batched=True, page_steps=True, prefetch=1), (0, 3)),
            "batched_prefetch": (dict(heads_batched=True, page_steps=False, prefetch=2), (0, 2)),
            "pages_prefetch": (dict(heads_batched=False, page_steps=True, prefetch=3), (1, 3))}


@pytest.mark.parametrize("K,C,softcap,dtype,tuning", [
    *CASES, *(pytest.param(*CASES[i][:4], {**CASES[i][4], **flags}, id=f"{name}-{i}")
              for name, (flags, cases) in VARIANTS.items() for i in cases)])
def test_ragged_kernel_gives_the_reference_attention_for_every_row_length(K, C, softcap, dtype, tuning):
    """41 rows of 0..40 keys in pages scattered through a pool, each row's C queries at its last C positions
    (those below 0 padding: they see nothing and give zeros), queries of 12 wide padded to the pool's 16: the
    kernel's output, and each variant's, is the reference's within float32 rounding (bfloat16: the probabilities
    rounded to bfloat16 for the values' product)."""
    N, Hk, Pn = 8, 16, len(LENGTHS)
    k, v, q, ids, q_pos = rows(K * 100 + C, K, C, dtype, Hk)
    out = ragged_paged.ragged_paged_attention(q, k, v, LENGTHS, ids, q_pos, scale=0.3, softcap=softcap,
                                              interpret=True, **tuning)
    assert out.shape == (Pn, C, N, Hk) and out.dtype == dtype
    want = reference(q, k, v, LENGTHS, ids, q_pos, 0.3, softcap)
    got = np.asarray(out.astype(jnp.float32))
    assert np.abs(want).max() > 0.5  # outputs that are not all zeros
    np.testing.assert_allclose(got, want, atol=2e-5 if dtype == jnp.float32 else 2e-2, rtol=0)
    assert not got[0].any()  # the row of no keys
    assert not got[q_pos < 0].any()  # queries at no position


def packed_pool(k, v, width: int):
    """Keys and values [K, pages, A, H] packed as a packed_kv pool keeps them: [k | v] a vector, padded with zeros
    to `width`."""
    kv = jnp.concatenate([k, v], -1)
    return jnp.pad(kv, ((0, 0), (0, 0), (0, 0), (0, width - kv.shape[-1])))


@pytest.mark.parametrize("K,C,softcap,dtype,tuning", [
    *CASES, *(pytest.param(*CASES[i][:4], {**CASES[i][4], **VARIANTS[name][0]}, id=f"{name}-{i}")
              for name, i in (("first", 0), ("pages_prefetch", 3)))])
def test_packed_kernel_gives_the_reference_attention_for_every_row_length(K, C, softcap, dtype, tuning):
    """A packed pool (packed_kv: a kv head's key and value of 12 side by side in one vector, padded to 32) read by
    the kernel (v_pages None) for the 41 rows of 0..40 keys: the output's value lanes, 12..23, are the reference's
    attention over the separate keys and values, the rest zeros, with and without the variants."""
    N, H, Pn = 8, 12, len(LENGTHS)
    k, v, q, ids, q_pos = rows(K * 100 + C, K, C, dtype, H)
    out = ragged_paged.ragged_paged_attention(q, packed_pool(k, v, 32), None, LENGTHS, ids, q_pos, scale=0.3,
                                              softcap=softcap, interpret=True, **tuning)
    assert out.shape == (Pn, C, N, 32) and out.dtype == dtype
    want = reference(q, k, v, LENGTHS, ids, q_pos, 0.3, softcap)
    got = np.asarray(out.astype(jnp.float32))
    assert np.abs(want).max() > 0.5
    np.testing.assert_allclose(got[..., H:2 * H], want, atol=2e-5 if dtype == jnp.float32 else 2e-2, rtol=0)
    assert not got[..., 2 * H:].any()  # the padding's lanes
    assert not got[0].any() and not got[q_pos < 0].any()


# (case of CASES, packed pool, kv heads batched): each on and off, decode rows and chunks, float32 and bfloat16
@pytest.mark.parametrize("case,packed,heads_batched", [(0, False, True), (1, True, False), (2, True, True),
                                                       (3, False, False)])
def test_lanes_in_kernel_give_the_same_attention_at_the_heads_width(case, packed, heads_batched):
    """lanes_in_kernel: the queries of 12 taken at their width (padded to the pool's lanes inside the kernel) and
    the output written at the values' 12 lanes (from lane 0 of a pool of 16, from 12 of a packed pool of 32): the
    reference's attention, as the kernel gives it with XLA padding and cutting around it, to the bit."""
    K, C, softcap, dtype, tuning = CASES[case]
    N, H, Pn = 8, 12, len(LENGTHS)
    k, v, q, ids, q_pos = rows(7 + case, K, C, dtype, H)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, 16 - H)))  # noqa: E731
    pools, values = ((packed_pool(k, v, 32), None), (H, H)) if packed else ((pad(k), pad(v)), (0, H))
    run = lambda inside: np.asarray(ragged_paged.ragged_paged_attention(  # noqa: E731
        q, *pools, LENGTHS, ids, q_pos, scale=0.3, softcap=softcap, values=values, lanes_in_kernel=inside,
        interpret=True, heads_batched=heads_batched, **tuning).astype(jnp.float32))
    got, around = run(True), run(False)
    assert got.shape == (Pn, C, N, H)
    want = reference(q, k, v, LENGTHS, ids, q_pos, 0.3, softcap)
    assert np.abs(want).max() > 0.5
    np.testing.assert_allclose(got, want, atol=2e-5 if dtype == jnp.float32 else 2e-2, rtol=0)
    np.testing.assert_array_equal(got, around)

class CountingKernel(ragged_paged.Kernel):
    """The ragged kernel in interpret mode, recording the query tokens of each call it is traced for."""
    calls: list = []

    def __call__(self, q_PCNH, *args, **kw):
        CountingKernel.calls.append(q_PCNH.shape[1])
        return super().__call__(q_PCNH, *args, **kw)


def test_the_paged_engine_through_the_ragged_kernel_gives_the_flat_paths_tokens():
    """The paged engine whose prefill chunks and decode steps read pages with our kernel (interpret mode; a pool
    of 16 pages of 4 positions, prompts of 5 and 13 tokens in chunks of 8) generates the flat path's greedy tokens,
    with a pool of keys and values apart and with a packed pool (packed_kv: one entry of keys and values), and
    both kinds of call went through it. (The kernel's variants, the kernel as first written among them, change
    nothing the engine sees: the kernel tests above check each against the reference attention.)"""
    from jaxlm.serve.engine import Engine
    from jaxlm.serve.requests import Sequence

    cfg = ModelConfig(vocab_size=50, block_size=64, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32)
    params = P.init(param_specs(cfg), jax.random.key(1), sharding.make_mesh(MeshConfig(), jax.devices()[:1]))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 50, n).tolist() for n in (5, 13)]
    runs, pools = [], []
    CountingKernel.calls.clear()
    for kernel in (None, CountingKernel(interpret=True, block_tokens=8, packed_kv=False),  # blocks of 2 pages
                   CountingKernel(interpret=True, block_tokens=8)):  # packed by default: heads of 8
        e = Engine(params, cfg, ServeConfig(max_slots=2, max_queue=8, prefill_chunk=8, prefix_cache=0,
                                            decode_steps=1, page_size=4), 48,
                   cache_pages=16, page_format=paged.PoolFormat(kernel=kernel))
        events = e.run([Sequence(p, 8, 0, 0, 1.0, 5 + i, 0, (), None) for i, p in enumerate(prompts)],
                       timeout=300)
        runs.append([[t for ev in evs if ev[0] == "tokens" for t in ev[1]] for evs in events])
        pools.append({name: a.shape for name, a in e.kv.cache.kinds[0].items()})
    assert 1 in CountingKernel.calls and max(CountingKernel.calls) > 1, CountingKernel.calls
    assert [len(t) for t in runs[0]] == [8] * 2
    assert runs[1] == runs[0] and runs[2] == runs[0]
    assert pools[0] == {"k": (2, 2, 16, 4, 8), "v": (2, 2, 16, 4, 8)} and pools[2] == {"kv": (2, 2, 16, 4, 16)}


def test_the_attention_kernel_setting_picks_the_tpu_pools_kernel():
    """serve.attention_kernel names the TPU pool's kernel (ours, JAX's or none), serve.attention_kernel_options
    sets ours; other devices take none; a bad value is one line naming the choices."""
    from jaxlm.config import load

    assert isinstance(paged.pool_format("tpu", "ragged").kernel, ragged_paged.Kernel)
    assert paged.pool_format("tpu", "jax").kernel.__name__ == "paged_attention"
    assert paged.pool_format("tpu", "flat") == paged.PoolFormat(128, None, paged.TPU_PAGE)
    assert paged.pool_format("cpu", "ragged").kernel is None
    assert load("quickstart", ["serve.attention_kernel=ragged"]).serve.attention_kernel == "ragged"
    with pytest.raises(ConfigError, match="choose one of: jax, ragged, flat") as e:
        load("quickstart", ["serve.attention_kernel=raged"])
    assert "\n" not in str(e.value)
    # serve.attention_kernel_options: the ragged kernel's variants and sizes (its fields); by default the variants
    # measured fastest on a v5e, each of which a setting turns off (all three: the kernel as first written)
    assert set(KERNEL_OPTIONS) == set(ragged_paged.Kernel._fields) - {"interpret"}
    assert paged.pool_format("tpu", "ragged").kernel == ragged_paged.Kernel(
        heads_batched=True, page_steps=True, prefetch=2, block_tokens=512, row_bytes=1 << 20, packed_kv=None)
    assert paged.pool_format("tpu", "ragged", "heads_batched=0, prefetch=3,block_tokens=256").kernel == \
        ragged_paged.Kernel(block_tokens=256, heads_batched=False, page_steps=True, prefetch=3)
    assert paged.pool_format("tpu", "ragged", "page_steps=1").kernel == ragged_paged.Kernel()
    assert paged.pool_format("tpu", "ragged", "heads_batched=0,page_steps=0,prefetch=1").kernel == \
        ragged_paged.Kernel(heads_batched=False, page_steps=False, prefetch=1)
    assert paged.pool_format("tpu", "ragged", "packed_kv=1,page_steps=0").kernel == ragged_paged.Kernel(
        page_steps=False, packed_kv=True)
    assert paged.pool_format("tpu", "ragged", "packed_kv=1").kernel.heads_batched
    assert paged.pool_format("tpu", "ragged", "packed_kv=0").kernel == ragged_paged.Kernel(packed_kv=False)
    ragged = ["serve.attention_kernel=ragged"]
    assert load("quickstart", [*ragged, "serve.attention_kernel_options=page_steps=1,row_bytes=4096"]
                ).serve.attention_kernel_options == "page_steps=1,row_bytes=4096"
    for bad, says in [([*ragged, "serve.attention_kernel_options=heads_batched=2"], "'heads_batched=2' must be"),
                      ([*ragged, "serve.attention_kernel_options=prefech=2"], "'prefech=2' must be KEY=VALUE"),
                      ([*ragged, "serve.attention_kernel_options=prefetch=0"], "'prefetch=0' must be"),
                      ([*ragged, "serve.attention_kernel_options=prefetch=1,prefetch=2"], "'prefetch=2' must be"),
                      (["serve.attention_kernel=jax", "serve.attention_kernel_options=prefetch=2"],
                       "set serve.attention_kernel=ragged too")]:
        with pytest.raises(ConfigError, match=says) as e:
            load("quickstart", bad)
        assert "\n" not in str(e.value)


def test_a_packed_pool_holds_keys_and_values_in_one_entry_or_says_why_it_cannot(monkeypatch):
    """packed_kv=1: the pool's one entry "kv" a token, a kv head's key and value of 64 side by side in 128 lanes
    (half the padded pool's bytes on a TPU, the same unpadded); an int8 pool, latent attention or heads wider than
    64 are one line saying so. By default a pool is packed where it can be and laid out apart where not; packed_kv=0
    never packs."""
    from jaxlm import runtime
    from jaxlm.serve import cache_pages, packed

    cfg = ModelConfig(vocab_size=50, block_size=64, n_layers=3, n_heads=8, n_kv_heads=2, d_model=512,
                      compute_dtype="bfloat16")  # heads of 64
    fmt = paged.pool_format("tpu", "ragged", "packed_kv=1")
    pool = jax.eval_shape(lambda: paged.init(cfg, 10, 128, fmt=fmt))
    assert {name: (a.shape, a.dtype) for name, a in pool.kinds[0].items()} == {"kv": ((2, 3, 10, 128, 128),
                                                                                      jnp.bfloat16)}
    assert paged.bytes_per_token(cfg, lane=128, packed=True) == 3 * 2 * 128 * 2
    assert paged.bytes_per_token(cfg, lane=128) == 2 * paged.bytes_per_token(cfg, lane=128, packed=True)
    assert paged.bytes_per_token(cfg, lane=1) == paged.bytes_per_token(cfg, lane=1, packed=True)
    assert not packed(ServeConfig(attention_kernel_options="packed_kv=1"))  # this host's pool is a CPU's
    with monkeypatch.context() as tpu:  # a TPU's server fits twice the packed pages in the same memory
        tpu.setattr(runtime, "platform", lambda *_: "tpu")
        assert packed(ServeConfig(attention_kernel_options="packed_kv=1"))
        per_page = 128 * 3 * 2 * 128 * 2  # positions x layers x kv heads x lanes x bytes, keys and values packed
        assert cache_pages(cfg, ServeConfig(cache_gib=1, attention_kernel_options="packed_kv=1"), 64, False) == \
            2**30 // per_page and cache_pages(cfg, ServeConfig(cache_gib=1, attention_kernel_options="packed_kv=0"), 64,
                                              False) == 2**30 // (2 * per_page)
    wide = ModelConfig(vocab_size=50, block_size=64, n_layers=1, n_heads=4, n_kv_heads=2, d_model=512)  # of 128
    latent = ModelConfig(vocab_size=50, block_size=64, n_layers=1, n_heads=4, n_kv_heads=4, d_model=64,
                         kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    for model, quantize, says in [(wide, False, "keys and values are 128 \\+ 128 lanes wide, more than 128"),
                                  (cfg, True, "an int8 pool"), (latent, False, "latent attention")]:
        with pytest.raises(ConfigError, match=f"packed_kv=1 packs .*{says}.*: drop packed_kv") as e:
            paged.init(model, 4, 16, quantize, fmt)
        assert "\n" not in str(e.value)
        # by default (packed_kv unset, or 0) the same pools are laid out apart, as is every pool with packed_kv=0
        for options in ("", "packed_kv=0"):
            assert set(paged.init(model, 4, 16, quantize, paged.pool_format("tpu", "ragged", options)).kinds[0]) \
                == ({"k", "v", "k_scale", "v_scale"} if quantize else {"k", "v"})
    default, off = (paged.pool_format("tpu", "ragged", o) for o in ("", "packed_kv=0"))
    assert set(paged.init(cfg, 4, 16, fmt=default).kinds[0]) == {"kv"}  # heads of 64: packed by default
    assert set(paged.init(cfg, 4, 16, fmt=off).kinds[0]) == {"k", "v"}
    with monkeypatch.context() as tpu:
        tpu.setattr(runtime, "platform", lambda *_: "tpu")
        assert cache_pages(cfg, ServeConfig(cache_gib=1), 64, False) == 2**30 // per_page
        assert cache_pages(wide, ServeConfig(cache_gib=1), 64, False) == \
            2**30 // (128 * paged.bytes_per_token(wide, lane=128))  # heads of 128: apart


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed (pip install 'jaxlm[tpu]')")
@pytest.mark.parametrize("variant", [{}, FIRST, dict(prefetch=3), dict(packed=True), dict(FIRST, packed=True),
                                     dict(lanes_in_kernel=True, values=(0, 64)),
                                     dict(packed=True, lanes_in_kernel=True, values=(64, 64)),
                                     dict(FIRST, packed=True, lanes_in_kernel=True, values=(64, 64))],
                         ids=["", "first", "prefetch3", "packed", "first-packed", "lanes", "packed-lanes",
                              "first-packed-lanes"])
@pytest.mark.parametrize("P_,C,K,A_,dtype,softcap", [(64, 1, 8, 128, jnp.bfloat16, None),
                                                     (2, 256, 8, 128, jnp.bfloat16, 50.0),
                                                     (8, 1, 1, 16, jnp.float32, 30.0)])
def test_ragged_kernel_compiles_for_a_tpu(P_, C, K, A_, dtype, softcap, variant):
    """The kernel (its defaults, as first written, three blocks read ahead) lowered by Mosaic and compiled for a
    TPU v5e from this host: the 1B shape's decode rows (32 query heads on 8 kv heads of 64 in a pool of 128 lanes,
    pages of 128), its prefill chunks of 256 (in tiles of 128; 3 or 4 blocks of 1 MiB of keys and values with them
    need more than Mosaic's default 16 MiB of VMEM: PREFETCH_VMEM_BYTES), and float32 pools of small pages on one
    kv head; packed (packed_kv), the pool's one entry of keys and values side by side, 64 + 64 lanes."""
    from jaxlm.train import aot

    device = aot.tpu_topology("v5e:1x1", 1)[0]
    placed = jax.sharding.SingleDeviceSharding(device)
    spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=placed)  # noqa: E731
    M_, NP = 16, 512
    N = 4 * K
    variant = dict(variant)
    packed = variant.pop("packed", False)
    attend = jax.jit(lambda q, k, v, e, i, p: ragged_paged.ragged_paged_attention(
        q, k, None if packed else v, e, i, p, scale=0.125, softcap=softcap, **variant))
    compiled = attend.lower(spec((P_, C, N, 64), dtype), spec((K, NP, A_, 128), dtype),
                            spec((K, NP, A_, 128), dtype), spec((P_,), jnp.int32), spec((P_, M_), jnp.int32),
                            spec((P_, C), jnp.int32)).compile()
    assert "tpu_custom_call" in compiled.as_text()


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed (pip install 'jaxlm[tpu]')")
@pytest.mark.parametrize("rows,chunk,table_width,options", [
    pytest.param(8, 512, 32, "packed_kv=0", marks=pytest.mark.slow),  # 30-70 s each
    pytest.param(8, 512, 32, "", marks=pytest.mark.slow),
    (64, 1, 128, "packed_kv=0"), (64, 1, 128, "")])
def test_paged_steps_through_the_ragged_kernel_compiled_for_a_tpu_update_the_pool_in_place(rows, chunk,
                                                                                           table_width, options):
    """The engine's paged programs with serve.attention_kernel=ragged compiled for a TPU v5e from this host (heads
    of 64 in a pool of 128 lanes): a prompt chunk of 512 and a decode step of 64 rows run our kernel and need no
    pool-sized temporaries (the pool's layers seen as one axis of pages is a view, not a copy), over a pool of keys
    and values apart (packed_kv=0) and over a packed pool (the default for heads of 64), half its bytes."""
    from jax.sharding import SingleDeviceSharding

    from jaxlm.model import decode
    from jaxlm.serve import programs
    from jaxlm.train import aot

    device = aot.tpu_topology("v5e:1x1", 1)[0]
    fmt = paged.pool_format(device.platform, "ragged", options)
    cfg = ModelConfig(vocab_size=1024, block_size=2048, n_layers=2, n_heads=12, n_kv_heads=4, d_model=768,
                      d_ff=2048, norm="rmsnorm", glu=True, activation="silu")

    def on_tpu(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=SingleDeviceSharding(device)),
                            tree)

    params = on_tpu(P.abstract(param_specs(cfg)))
    lw = on_tpu(jax.eval_shape(lambda p: decode.layer_weights(p, cfg), params))
    cache = on_tpu(jax.eval_shape(lambda: paged.init(cfg, 8192, 16, fmt=fmt)))
    i32 = lambda *shape: on_tpu(jax.ShapeDtypeStruct(shape, np.int32))  # noqa: E731
    logits = on_tpu(jax.ShapeDtypeStruct((64, cfg.vocab_size), np.float32))
    compiled = programs.paged_prefill.lower(params, lw, cache, logits, i32(rows, chunk), i32(rows), i32(rows),
                                            i32(rows, table_width), i32(rows), i32(rows), cfg).compile()
    memory = compiled.memory_analysis()
    pool = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
    packed = options != "packed_kv=0"
    assert pool == 8192 * 16 * paged.bytes_per_token(cfg, lane=128, packed=packed) == (
        8192 * 16 * 2 * 4 * 128 * (1 if packed else 2) * 4)  # pages x page x layers x kv heads x lanes x float32
    assert memory.alias_size_in_bytes >= pool  # the pool in is the pool out
    # the kernel's default prefetch=2 raises its VMEM limit (PREFETCH_VMEM_BYTES), which leaves XLA's own fusions
    # less of it: the chunk of 512's temporaries over the packed pool are 35.8 MB then (under 27 MB with
    # prefetch=1), a fifteenth of the pool; a pool-sized copy would be all of it
    assert memory.temp_size_in_bytes < pool / 10, (memory.temp_size_in_bytes, pool)
    assert "ragged_paged_attention" in compiled.as_text()
