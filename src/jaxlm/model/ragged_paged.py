"""Ragged paged attention: our Pallas TPU kernel over the paged KV pool (model/paged.py) for rows of any number of
query tokens in one call (decode rows and causal prefill chunks, each with its own positions and key length). A
program takes several rows' query tiles; per row it copies only the pages below its length, one DMA a page for all
kv heads, blocks read ahead; every query of a kv head is computed against that one load, the softmax carried in
float32. Defaults (the fastest variants on a v5e; each can be turned off): a decode row's kv heads together, a page
at a time, two blocks ahead. A packed pool (`packed_kv`) holds a kv head's key and value side by side, [k | v]:
queries zero over the values' lanes give the logits, probabilities give [p k | p v]. Scale and soft-cap here;
windows, chunks, sinks, int8 pools, latent attention and meshes keep the flat path (docs/serve.md).
Shapes: P rows, C query tokens a row, N query heads, K kv heads, G = N / K, H head width (the pool's, padded to
lanes), A tokens a page, M pages a row's table, T query tiles a row, Q = G x (query tokens a tile)."""

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
# heads_batched: the scores of all kv heads of a step (K x Q x keys, float32) at most, else the loop over kv heads
# (a prefill tile of 512 query rows on 8 kv heads over a block of 512 keys would be 8 MiB of VMEM)
BATCHED_SCORE_BYTES = 1 << 20
# prefetch > 1: the kernel's scoped VMEM limit (Mosaic's default, 16 MiB on a v5e, does not hold a prefill tile's
# queries and output beside 4 blocks of 1 MiB of keys and values; a v5e and a v6e have 128 MiB)
PREFETCH_VMEM_BYTES = 64 << 20
# The variants' defaults: the fastest on a v5e (2026-12-07, the 1B shape's serve round: 7,946 output tokens/s against
# 7,189 with all three off, the kernel as first written; docs/serve.md)
HEADS_BATCHED, PAGE_STEPS, PREFETCH = True, True, 2
# The pool written by model/pool_write.py's kernel, not XLA's scatter: 12,134 output tokens/s against 10,056 on the
# same serve round (2026-12-07, one v5e, docs/serve.md)
WRITE_KERNEL = True
NEG = -0.7 * float(jnp.finfo(jnp.float32).max)  # a masked logit: finite, so that exp(NEG - NEG) is no NaN


class Kernel(NamedTuple):
    """The ragged kernel as a pool's format carries it (paged.PoolFormat.kernel; hashable: a compiled program's
    static argument): `interpret` runs it in Pallas' TPU interpret mode (CPU tests); `block_tokens` and
    `row_bytes` as BLOCK_TOKENS and ROW_BLOCK_BYTES; the variants as ragged_paged_attention's arguments,
    `heads_batched`, `page_steps`, `prefetch` (defaults HEADS_BATCHED, PAGE_STEPS, PREFETCH; False, False, 1: the
    kernel as first written); `packed_kv`, the pool's keys and values packed in one entry (model/paged.py lays the
    pool out so and calls the kernel with v_pages None; None, the default: packed where the model's pool can be,
    paged.entry_specs); `lanes_in_kernel` as ragged_paged_attention's; `write_kernel`, the steps' entries written
    into the pool by model/pool_write.py's kernel instead of XLA's scatter (default WRITE_KERNEL; where the pool's
    shape allows, pool_write.fits). serve.attention_kernel_options sets all but `interpret` (config.kernel_options)."""
    interpret: bool = False
    block_tokens: int = BLOCK_TOKENS
    heads_batched: bool = HEADS_BATCHED
    page_steps: bool = PAGE_STEPS
    prefetch: int = PREFETCH
    row_bytes: int = ROW_BLOCK_BYTES
    packed_kv: bool | None = None
    lanes_in_kernel: bool = False
    write_kernel: bool = WRITE_KERNEL

    def __call__(self, q_PCNH, k_pages, v_pages, end_P, ids_PM, q_pos_PC, *, scale: float, softcap=None,
                 values=None):
        """ragged_paged_attention with this kernel's settings (v_pages None: a packed pool)."""
        return ragged_paged_attention(q_PCNH, k_pages, v_pages, end_P, ids_PM, q_pos_PC, scale=scale,
                                      softcap=softcap, block_tokens=self.block_tokens, row_bytes=self.row_bytes,
                                      heads_batched=self.heads_batched, page_steps=self.page_steps,
                                      prefetch=self.prefetch, values=values, lanes_in_kernel=self.lanes_in_kernel,
                                      interpret=self.interpret)


def _tiles(C: int, G: int, tile_queries: int) -> tuple[int, int]:
    """(query tokens a tile, tiles a row): the whole row when its G x C query rows fit tile_queries, else tiles of
    a multiple of 16 tokens (a bfloat16 block's sublane tile)."""
    if G * C <= tile_queries:
        return C, 1
    c = max(16, tile_queries // G // 16 * 16)
    return c, -(-C // c)


def _dmas(lens_ref, ids_ref, k_hbm, v_hbm, kbuf, vbuf, sems, *, rows: int, tiles: int, M: int):
    """The program's (length, start, wait): length(i), the keys row i's tile reads; start(i, blk, slot) and
    wait(i, blk, slot), of the copies of row i's block blk into kbuf and vbuf's slot (v_hbm None, a packed pool:
    into kbuf only)."""
    b, t = pl.program_id(0), pl.program_id(1)
    Bp, A = kbuf.shape[2:4]

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
            made = [pltpu.make_async_copy(k_hbm.at[:, pid], kbuf.at[slot, :, j], sems.at[0, slot])]
            if v_hbm is not None:
                made.append(pltpu.make_async_copy(v_hbm.at[:, pid], vbuf.at[slot, :, j], sems.at[1, slot]))
            out.append((page < pages, made))
        return out

    def start(i, blk, slot):
        for made, dmas in copies(i, blk, slot):
            @pl.when(made)
            def _():
                for dma in dmas:
                    dma.start()

    def wait(i, blk, slot):
        for made, dmas in copies(i, blk, slot):
            @pl.when(made)
            def _():
                for dma in dmas:
                    dma.wait()

    return length, start, wait


def _online(m_ref, l_ref, acc_ref, h, q, k, v, ok, batched: bool, *, scale: float, softcap):
    """The softmax carried over keys k [.., keys, H] and values v [.., keys, Hv] for queries q [.., Q, H] of
    kv head h (an index; batched: all kv heads, a leading axis of q, k, v and the carried state), where
    ok [Q, keys]; m_ref, l_ref and acc_ref carry its running maximum, sum and output."""
    bd = ((0,), (0,)) if batched else ((), ())
    s = jax.lax.dot_general(q, k, ((((2,), (2,)) if batched else ((1,), (1,))), bd),
                            preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(ok, s, NEG)
    m_prev = m_ref[h]
    m_new = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
    p = jnp.where(ok, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m_prev - m_new)
    l_ref[h] = alpha * l_ref[h] + p.sum(axis=-1, keepdims=True)
    acc_ref[h] = alpha * acc_ref[h] + jax.lax.dot_general(
        p.astype(v.dtype), v, ((((2,), (1,)) if batched else ((1,), (0,))), bd),
        preferred_element_type=jnp.float32)
    m_ref[h] = m_new


def _lanes(x, start: int, width: int, batched: bool, *, widen: bool):
    """Lanes moved by a product with a 0/1 matrix, exact (each output lane one input lane times 1): widen, x [.., H]
    into lanes start..start+H of `width` zeros; else x [.., W]'s lanes start..start+width. What Mosaic does
    without lane slices or pads at an offset inside a vector; `batched`: x's leading axis (kv heads) too."""
    rows, cols = x.shape[-1], width
    r = jax.lax.broadcasted_iota(jnp.int32, (rows, cols), 0)
    c = jax.lax.broadcasted_iota(jnp.int32, (rows, cols), 1)
    sel = ((c == r + start) if widen else (r == c + start)).astype(x.dtype)
    if batched:
        sel = jnp.broadcast_to(sel, (x.shape[0], rows, cols))
    dims = (((2,), (1,)), ((0,), (0,))) if batched else (((1,), (0,)), ((), ()))
    exact = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None  # bfloat16 times 1 is exact as it is
    return jax.lax.dot_general(x, sel, dims, precision=exact, preferred_element_type=jnp.float32).astype(x.dtype)


def _finish(o_ref, l_ref, acc_ref, i, *, heads_batched: bool, lanes_out):
    """Row i's output: the carried sum of values over the carried sum of probabilities, in o_ref's dtype, cut to
    lanes_out (start, width) where given."""
    def out(o, batched):
        o = o.astype(o_ref.dtype)
        return o if lanes_out is None else _lanes(o, *lanes_out, batched, widen=False)

    if heads_batched:
        o_ref[i, 0] = out(acc_ref[...] / jnp.maximum(l_ref[...], jnp.finfo(jnp.float32).tiny), True)
        return
    for h in range(acc_ref.shape[0]):
        o_ref[i, 0, h] = out(acc_ref[h] / jnp.maximum(l_ref[h], jnp.finfo(jnp.float32).tiny), False)


def _kernel(lens_ref, ids_ref, q_ref, pos_ref, *refs, scale: float, softcap, rows: int, tiles: int, M: int,
            heads_batched: bool = False, page_steps: bool = False, packed: bool = False, lanes_out=None):
    """One program: `rows` rows' tile t of queries q_ref [rows, 1, K, Q, H] (positions pos_ref [rows, 1, Q, 1])
    over their pages; lens_ref [P T] (keys each row's tile reads) and ids_ref [P M] (pages) in SMEM. refs: the
    pools k_hbm and v_hbm, the output o_ref, the buffers kbuf and vbuf of S blocks (S - 1 read ahead; 2: the
    double buffer), the DMA semaphores and the softmax's state m_ref, l_ref and acc_ref; packed (a packed pool):
    no v_hbm nor vbuf, the values read from the keys' vectors. heads_batched and page_steps: as
    ragged_paged_attention's; queries narrower than the pool and lanes_out (start, width): lanes_in_kernel's."""
    if packed:
        k_hbm, o_ref, kbuf, sems, m_ref, l_ref, acc_ref = refs
        v_hbm = vbuf = None
    else:
        k_hbm, v_hbm, o_ref, kbuf, vbuf, sems, m_ref, l_ref, acc_ref = refs
    length, start, wait = _dmas(lens_ref, ids_ref, k_hbm, v_hbm, kbuf, vbuf, sems, rows=rows, tiles=tiles, M=M)
    S, K, Bp, A, Hk = kbuf.shape
    Hv = Hk if packed else vbuf.shape[-1]
    BA = Bp * A
    Q = q_ref.shape[3]

    def online(h, q, at, ok, batched):
        """_online over the keys and values of kbuf[at] (and vbuf[at]), reshaped to [.., keys, width]; queries
        narrower than the keys (lanes_in_kernel) padded with zeros here."""
        if q.shape[-1] < Hk:
            q = _lanes(q, 0, Hk, batched, widen=True)
        k = kbuf[at]
        v = k if packed else vbuf[at]
        lead = (K,) if batched else ()
        k, v = k.reshape(*lead, -1, Hk), v.reshape(*lead, -1, Hv)
        _online(m_ref, l_ref, acc_ref, h, q, k, v, ok, batched, scale=scale, softcap=softcap)

    def compute(i, blk, slot):
        n = length(i)
        if page_steps:  # a page at a time, only the pages below the row's length
            def page(j, carry):
                k_pos = blk * BA + j * A + jax.lax.broadcasted_iota(jnp.int32, (Q, A), 1)
                ok = (k_pos < n) & (k_pos <= pos_ref[i, 0])
                if heads_batched:
                    online(slice(None), q_ref[i, 0], (slot, slice(None), j), ok, True)
                else:
                    for h in range(K):
                        online(h, q_ref[i, 0, h], (slot, h, j), ok, False)
                return carry

            pages = jnp.clip(jax.lax.div(n + A - 1, A) - blk * Bp, 0, Bp)
            jax.lax.fori_loop(0, pages, page, 0)
            return
        k_pos = blk * BA + jax.lax.broadcasted_iota(jnp.int32, (Q, BA), 1)
        ok = (k_pos < n) & (k_pos <= pos_ref[i, 0])
        if heads_batched:
            online(slice(None), q_ref[i, 0], (slot,), ok, True)
            return
        for h in range(K):
            online(h, q_ref[i, 0, h], (slot, h), ok, False)

    def blocks_of(n):
        return jnp.maximum(jax.lax.div(n + BA - 1, BA), 1)  # a row of no keys still takes (and passes on) a step

    finish = functools.partial(_finish, o_ref, l_ref, acc_ref, heads_batched=heads_batched, lanes_out=lanes_out)

    def reset():
        m_ref[...] = jnp.full(m_ref.shape, NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    # pages past a row's length are not copied: their buffer keeps what it held, which must be finite (p = 0
    # there, and 0 x NaN is NaN)
    values = kbuf if packed else vbuf
    values[...] = jnp.zeros(values.shape, values.dtype)
    if S > 2:
        _pipeline(rows, S, length, blocks_of, start, wait, compute, finish, reset)
        return
    start(0, 0, 0)

    def row(i, slot):
        n = length(i)
        blocks = blocks_of(n)
        reset()

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
        finish(i)
        return slot

    jax.lax.fori_loop(0, rows, row, 0)


def _pipeline(rows: int, S: int, length, blocks_of, start, wait, compute, finish, reset) -> None:
    """The program's blocks (row by row, each row's in order) with S - 1 of them in flight ahead of the one
    computed (ragged_paged_attention's `prefetch`), in S slots taken in turn: a pointer to the next block to
    start, carried across rows, so that the next rows' pages are copied while this one is computed."""
    D = S - 1

    def advance(i, blk):
        last = blk + 1 >= blocks_of(length(jnp.minimum(i, rows - 1)))
        return jnp.where(last, i + 1, i), jnp.where(last, 0, blk + 1)

    ahead = (jnp.int32(0), jnp.int32(0))
    for d in range(D):
        @pl.when(ahead[0] < rows)
        def _():
            start(ahead[0], ahead[1], d)

        ahead = advance(*ahead)

    def row(i, carry):
        n = length(i)
        reset()

        def step(blk, carry):
            slot, ai, ablk = carry
            wait(i, blk, slot)

            @pl.when(ai < rows)
            def _():
                start(ai, ablk, jax.lax.rem(slot + D, S))

            ai, ablk = advance(ai, ablk)

            @pl.when(n > 0)
            def _():
                compute(i, blk, slot)

            return jax.lax.rem(slot + 1, S), ai, ablk

        carry = jax.lax.fori_loop(0, blocks_of(n), step, carry)
        finish(i)
        return carry

    jax.lax.fori_loop(0, rows, row, (jnp.int32(0), *ahead))


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "block_tokens", "row_bytes", "tile_queries",
                                             "heads_batched", "page_steps", "prefetch", "values", "lanes_in_kernel",
                                             "interpret"))
def ragged_paged_attention(q_PCNH, k_pages, v_pages, end_P, ids_PM, q_pos_PC, *, scale: float, softcap=None,
                           block_tokens: int = BLOCK_TOKENS, row_bytes: int = ROW_BLOCK_BYTES,
                           tile_queries: int = TILE_QUERIES, heads_batched: bool = HEADS_BATCHED,
                           page_steps: bool = PAGE_STEPS, prefetch: int = PREFETCH, values=None,
                           lanes_in_kernel: bool = False, interpret: bool = False) -> jax.Array:
    """Each row p's queries q_PCNH[p] (at positions q_pos_PC[p], causal) over its keys below end_P[p], found in
    pages ids_PM[p] of k_pages [K, pages, A, Hk] and v_pages [K, pages, A, Hv] (position s in page ids[s // A] at
    offset s % A); queries narrower than Hk are padded with zeros. v_pages None: k_pages is a packed pool, each
    vector a key (the queries' width H) and its value side by side, so that the padded queries (zeros over the
    values' lanes) give the logits, and the output is the probabilities times the whole vectors, [P, C, N, Hk],
    whose value lanes (from H on) the caller keeps. Logits are scaled by `scale`, then soft-capped
    (softcap x tanh(logit / softcap); None: not). A query that sees no key (a row of no keys, a position
    below 0) gives zeros. block_tokens, row_bytes and tile_queries: as BLOCK_TOKENS, ROW_BLOCK_BYTES and
    TILE_QUERIES. Variants (on by default, HEADS_BATCHED, PAGE_STEPS, PREFETCH; all off, heads_batched=False,
    page_steps=False, prefetch=1, is the kernel as first written: a loop over kv heads computing whole blocks, one
    block read ahead): `heads_batched`, a row's kv heads computed together (batched dot_generals, the softmax on
    [K, Q, keys]) where those scores take at most BATCHED_SCORE_BYTES (decode rows; a prefill tile of more
    query rows keeps the loop over kv heads); `page_steps`, a block computed a page at a time, only the pages
    below the row's length, not the whole block; `prefetch`, blocks read ahead of the one computed (1:
    double-buffered; more: the next rows' pages in flight too, prefetch + 1 blocks of VMEM under a limit of
    PREFETCH_VMEM_BYTES). `values` (start, width): the output's lanes the caller keeps (None: all Hv); and
    `lanes_in_kernel`, the queries taken at their own width and the output written at `width`, padded and cut
    inside the kernel by exact 0/1 products instead of by XLA around the call. Returns [P, C, N, width] in q's
    dtype."""
    if prefetch < 1:
        raise ValueError(f"prefetch={prefetch} must be >= 1")
    P, C, N, H = q_PCNH.shape
    K, _, A, Hk = k_pages.shape
    packed = v_pages is None
    Hv, M, G = Hk if packed else v_pages.shape[-1], ids_PM.shape[1], N // K
    Bp = max(1, min(M, block_tokens // A))
    Ct, T = _tiles(C, G, tile_queries)
    Q = G * Ct
    dt = k_pages.dtype
    rows = max(1, min(P, row_bytes // (K * Q * max(Hk, Hv) * jnp.dtype(dt).itemsize)))
    Pp = -(-P // rows) * rows
    # queries [Pp, T, K, G Ct, Hk] in (g, c) order; padding rows and tokens sit at position -1 and see nothing
    Hq = H if lanes_in_kernel else Hk  # the queries' lanes as the kernel takes them
    q = jnp.pad(q_PCNH.astype(dt), ((0, Pp - P), (0, T * Ct - C), (0, 0), (0, Hq - H)))
    q = q.reshape(Pp, T, Ct, K, G, Hq).transpose(0, 1, 3, 4, 2, 5).reshape(Pp, T, K, Q, Hq)
    start, width = values or (0, Hv)
    Ho = width if lanes_in_kernel else Hv  # the output's lanes as the kernel writes them
    pos_PTc = jnp.pad(q_pos_PC.astype(jnp.int32), ((0, Pp - P), (0, T * Ct - C)), constant_values=-1).reshape(
        Pp, T, Ct)
    pos = jnp.tile(pos_PTc, (1, 1, G))[..., None]  # [Pp, T, Q, 1]
    end = jnp.pad(end_P.astype(jnp.int32), (0, Pp - P))
    lens_PT = jnp.clip(jnp.minimum(end[:, None], pos_PTc.max(-1) + 1), 0, M * A)
    ids = jnp.pad(ids_PM.astype(jnp.int32), ((0, Pp - P), (0, 0))).reshape(-1)

    heads_batched = heads_batched and K * Q * (A if page_steps else Bp * A) * 4 <= BATCHED_SCORE_BYTES
    vmem = dict(vmem_limit_bytes=PREFETCH_VMEM_BYTES) if prefetch > 1 else {}
    variants = {k: v for k, v in dict(heads_batched=heads_batched, page_steps=page_steps, packed=packed,
                                      lanes_out=(start, width) if lanes_in_kernel and values else None).items() if v}
    kernel = functools.partial(_kernel, scale=float(scale), softcap=None if softcap is None else float(softcap),
                               rows=rows, tiles=T, M=M, **variants)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(Pp // rows, T),
            in_specs=[pl.BlockSpec((rows, 1, K, Q, Hq), lambda b, t, *_: (b, t, 0, 0, 0)),
                      pl.BlockSpec((rows, 1, Q, 1), lambda b, t, *_: (b, t, 0, 0)),
                      *[pl.BlockSpec(memory_space=pl.ANY)] * (1 if packed else 2)],
            out_specs=pl.BlockSpec((rows, 1, K, Q, Ho), lambda b, t, *_: (b, t, 0, 0, 0)),
            scratch_shapes=[pltpu.VMEM((prefetch + 1, K, Bp, A, Hk), dt),
                            *([] if packed else [pltpu.VMEM((prefetch + 1, K, Bp, A, Hv), v_pages.dtype)]),
                            pltpu.SemaphoreType.DMA((1 if packed else 2, prefetch + 1)),
                            pltpu.VMEM((K, Q, 1), jnp.float32), pltpu.VMEM((K, Q, 1), jnp.float32),
                            pltpu.VMEM((K, Q, Hv), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct((Pp, T, K, Q, Ho), q_PCNH.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"), **vmem),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="ragged_paged_attention",
    )(lens_PT.reshape(-1), ids, q, pos, *((k_pages,) if packed else (k_pages, v_pages)))
    out = out.reshape(Pp, T, K, G, Ct, Ho).transpose(0, 1, 4, 2, 3, 5).reshape(Pp, T * Ct, N, Ho)
    return out[:P, :C, :, start:start + width] if Ho != width else out[:P, :C]
