"""Ragged paged attention: our Pallas TPU kernel over the paged KV pool (model/paged.py) for rows of any number of
query tokens in one call (decode rows and causal prefill chunks, each row with its own positions and key length).
A program takes several rows' query tiles; per row it copies only the pages below its length, a block of pages at a
time, one DMA per page for all kv heads, double-buffered; every query head of a kv head and every query token of
the tile is computed against that one load, the softmax carried across blocks in float32. It does the scale and
the logit soft-cap; windows, chunked attention, sinks, int8 pools, latent attention and meshes keep the flat path
(docs/serve.md, "The paged KV cache").

Shape legend: P rows, C query tokens a row, N query heads, K kv heads, G = N / K, H head width (the pool's,
padded to lanes), A tokens a page, M pages a row's table, T query tiles a row, Q = G x (query tokens a tile).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

BLOCK_TOKENS = 512  # keys a block reads per row (block pages x page): 4 pages of 128, double-buffered in VMEM
ROW_BLOCK_BYTES = 1 << 20  # queries a program takes (rows x kv heads x Q x H), at most (and at least one row)
TILE_QUERIES = 512  # query rows (G x tokens) of a row's tile at most: a long chunk is split into tiles
NEG = -0.7 * float(jnp.finfo(jnp.float32).max)  # a masked logit: finite, so that exp(NEG - NEG) is no NaN


class Kernel(NamedTuple):
    """The ragged kernel as a pool's format carries it (paged.PoolFormat.kernel; hashable: a compiled program's
    static argument): `interpret` runs it in Pallas' TPU interpret mode (CPU tests), `block_tokens` as
    BLOCK_TOKENS."""
    interpret: bool = False
    block_tokens: int = BLOCK_TOKENS

    def __call__(self, q_PCNH, k_pages, v_pages, end_P, ids_PM, q_pos_PC, *, scale: float, softcap=None):
        return ragged_paged_attention(q_PCNH, k_pages, v_pages, end_P, ids_PM, q_pos_PC, scale=scale,
                                      softcap=softcap, block_tokens=self.block_tokens, interpret=self.interpret)


def _tiles(C: int, G: int, tile_queries: int) -> tuple[int, int]:
    """(query tokens a tile, tiles a row): the whole row when its G x C query rows fit tile_queries, else tiles of
    a multiple of 16 tokens (a bfloat16 block's sublane tile)."""
    if G * C <= tile_queries:
        return C, 1
    c = max(16, tile_queries // G // 16 * 16)
    return c, -(-C // c)


def _kernel(lens_ref, ids_ref, q_ref, pos_ref, k_hbm, v_hbm, o_ref, kbuf, vbuf, sems, m_ref, l_ref, acc_ref, *,
            scale: float, softcap, rows: int, tiles: int, M: int):
    """One program: `rows` rows' tile t of queries q_ref [rows, 1, K, Q, H] (positions pos_ref [rows, 1, Q, 1])
    over their pages; lens_ref [P T] (keys each row's tile reads) and ids_ref [P M] (pages) in SMEM."""
    b, t = pl.program_id(0), pl.program_id(1)
    _, K, Bp, A, _ = kbuf.shape
    BA = Bp * A
    Q = q_ref.shape[3]

    def length(i):
        return lens_ref[(b * rows + i) * tiles + t]

    def copies(i, blk, slot):
        """The block's page copies (k and v of page j, all kv heads each) and whether each is made: only pages
        below the row's length."""
        pages = jax.lax.div(length(i) + A - 1, A)  # lax.div: `//` lowers through sign, which asks the device
        out = []
        for j in range(Bp):
            page = blk * Bp + j
            pid = ids_ref[(b * rows + i) * M + jnp.minimum(page, M - 1)]
            out.append((page < pages, pltpu.make_async_copy(k_hbm.at[:, pid], kbuf.at[slot, :, j], sems.at[0, slot]),
                        pltpu.make_async_copy(v_hbm.at[:, pid], vbuf.at[slot, :, j], sems.at[1, slot])))
        return out

    def start(i, blk, slot):
        for made, ck, cv in copies(i, blk, slot):
            @pl.when(made)
            def _():
                ck.start()
                cv.start()

    def wait(i, blk, slot):
        for made, ck, cv in copies(i, blk, slot):
            @pl.when(made)
            def _():
                ck.wait()
                cv.wait()

    def compute(i, blk, slot):
        n = length(i)
        k_pos = blk * BA + jax.lax.broadcasted_iota(jnp.int32, (Q, BA), 1)
        ok = (k_pos < n) & (k_pos <= pos_ref[i, 0])
        for h in range(K):
            q = q_ref[i, 0, h]
            k = kbuf[slot, h].reshape(BA, k_hbm.shape[-1])
            v = vbuf[slot, h].reshape(BA, v_hbm.shape[-1])
            s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
            if softcap is not None:
                s = softcap * jnp.tanh(s / softcap)
            s = jnp.where(ok, s, NEG)
            m_prev = m_ref[h]
            m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
            p = jnp.where(ok, jnp.exp(s - m_new), 0.0)
            alpha = jnp.exp(m_prev - m_new)
            l_ref[h] = alpha * l_ref[h] + p.sum(axis=1, keepdims=True)
            acc_ref[h] = alpha * acc_ref[h] + jax.lax.dot_general(
                p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
            m_ref[h] = m_new

    # pages past a row's length are not copied: their buffer keeps what it held, which must be finite (p = 0
    # there, and 0 x NaN is NaN)
    vbuf[...] = jnp.zeros(vbuf.shape, vbuf.dtype)
    start(0, 0, 0)

    def row(i, slot):
        n = length(i)
        blocks = jnp.maximum(jax.lax.div(n + BA - 1, BA), 1)  # a row of no keys still takes (and passes on) a step
        m_ref[...] = jnp.full(m_ref.shape, NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        def step(blk, slot):
            wait(i, blk, slot)
            last = blk + 1 >= blocks
            nxt_i, nxt_blk = jnp.where(last, i + 1, i), jnp.where(last, 0, blk + 1)

            @pl.when(nxt_i < rows)
            def _():
                start(nxt_i, nxt_blk, 1 - slot)

            @pl.when(n > 0)
            def _():
                compute(i, blk, slot)

            return 1 - slot

        slot = jax.lax.fori_loop(0, blocks, step, slot)
        for h in range(K):
            o_ref[i, 0, h] = (acc_ref[h] / jnp.maximum(l_ref[h], jnp.finfo(jnp.float32).tiny)).astype(o_ref.dtype)
        return slot

    jax.lax.fori_loop(0, rows, row, 0)


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "block_tokens", "row_bytes", "tile_queries",
                                             "interpret"))
def ragged_paged_attention(q_PCNH, k_pages, v_pages, end_P, ids_PM, q_pos_PC, *, scale: float, softcap=None,
                           block_tokens: int = BLOCK_TOKENS, row_bytes: int = ROW_BLOCK_BYTES,
                           tile_queries: int = TILE_QUERIES, interpret: bool = False) -> jax.Array:
    """Each row p's queries q_PCNH[p] (at positions q_pos_PC[p], causal) over its keys below end_P[p], found in
    pages ids_PM[p] of k_pages [K, pages, A, Hk] and v_pages [K, pages, A, Hv] (position s in page ids[s // A] at
    offset s % A); queries narrower than Hk are padded with zeros. Logits are scaled by `scale`, then soft-capped
    (softcap x tanh(logit / softcap); None: not). A query that sees no key (a row of no keys, a position
    below 0) gives zeros. block_tokens, row_bytes and tile_queries: as BLOCK_TOKENS, ROW_BLOCK_BYTES and
    TILE_QUERIES. Returns [P, C, N, Hv] in q's dtype."""
    P, C, N, H = q_PCNH.shape
    K, _, A, Hk = k_pages.shape
    Hv, M, G = v_pages.shape[-1], ids_PM.shape[1], N // K
    Bp = max(1, min(M, block_tokens // A))
    Ct, T = _tiles(C, G, tile_queries)
    Q = G * Ct
    dt = k_pages.dtype
    rows = max(1, min(P, row_bytes // (K * Q * max(Hk, Hv) * jnp.dtype(dt).itemsize)))
    Pp = -(-P // rows) * rows
    # queries [Pp, T, K, G Ct, Hk] in (g, c) order; padding rows and tokens sit at position -1 and see nothing
    q = jnp.pad(q_PCNH.astype(dt), ((0, Pp - P), (0, T * Ct - C), (0, 0), (0, Hk - H)))
    q = q.reshape(Pp, T, Ct, K, G, Hk).transpose(0, 1, 3, 4, 2, 5).reshape(Pp, T, K, Q, Hk)
    pos_PTc = jnp.pad(q_pos_PC.astype(jnp.int32), ((0, Pp - P), (0, T * Ct - C)), constant_values=-1).reshape(
        Pp, T, Ct)
    pos = jnp.tile(pos_PTc, (1, 1, G))[..., None]  # [Pp, T, Q, 1]
    end = jnp.pad(end_P.astype(jnp.int32), (0, Pp - P))
    lens_PT = jnp.clip(jnp.minimum(end[:, None], pos_PTc.max(-1) + 1), 0, M * A)
    ids = jnp.pad(ids_PM.astype(jnp.int32), ((0, Pp - P), (0, 0))).reshape(-1)

    kernel = functools.partial(_kernel, scale=float(scale), softcap=None if softcap is None else float(softcap),
                               rows=rows, tiles=T, M=M)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(Pp // rows, T),
            in_specs=[pl.BlockSpec((rows, 1, K, Q, Hk), lambda b, t, *_: (b, t, 0, 0, 0)),
                      pl.BlockSpec((rows, 1, Q, 1), lambda b, t, *_: (b, t, 0, 0)),
                      pl.BlockSpec(memory_space=pl.ANY),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((rows, 1, K, Q, Hv), lambda b, t, *_: (b, t, 0, 0, 0)),
            scratch_shapes=[pltpu.VMEM((2, K, Bp, A, Hk), dt), pltpu.VMEM((2, K, Bp, A, Hv), v_pages.dtype),
                            pltpu.SemaphoreType.DMA((2, 2)),
                            pltpu.VMEM((K, Q, 1), jnp.float32), pltpu.VMEM((K, Q, 1), jnp.float32),
                            pltpu.VMEM((K, Q, Hv), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct((Pp, T, K, Q, Hv), q_PCNH.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="ragged_paged_attention",
    )(lens_PT.reshape(-1), ids, q, pos, k_pages, v_pages)
    out = out.reshape(Pp, T, K, G, Ct, Hv).transpose(0, 1, 4, 2, 3, 5).reshape(Pp, T * Ct, N, Hv)
    return out[:P, :C]
