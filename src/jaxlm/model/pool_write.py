"""Tokens' keys and values written into the paged pool (model/paged.py) by a Pallas TPU kernel instead of XLA's
scatter, which XLA:TPU applies one update after another: one vector a kv head and token, 512 for a decode step of 64
rows on 8 kv heads (about 50 us a layer on a v5e). A pool's pages are tiled in groups of CHUNK positions, and a copy
cannot start inside a group, so the kernel works a group at a time: the group is read (all kv heads, one DMA), the
rows of the call's tokens in it are set in VMEM from a window of the tokens (a second DMA), and the group is written
back, a block of groups' copies in flight at once. Each row's tokens must sit at consecutive positions (decode
steps, prompt chunks, speculative verifications) and no two rows may write one page (each row writes its own; only
full pages are shared). Shapes: P rows, C tokens a row, K kv heads, R repeats, NP pages, A a page, L lanes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

CHUNK = 8  # positions of a group: the rows of a pool's tile in HBM (a copy's offset along them must be a multiple)
BLOCK_BYTES = 2 << 20  # VMEM of the groups one program reads and writes at once, with their tokens' windows


def fits(pool_shape: tuple, width: int) -> bool:
    """Whether write_rows takes a pool [K, R, NP, A, L] and entries `width` lanes wide: pages of whole groups, the
    entries no wider than the pool's lanes, which are whole vectors."""
    return pool_shape[-2] % CHUNK == 0 and pool_shape[-1] % 128 == 0 and width <= pool_shape[-1]


def groups(page_PC, off_PC, NP: int, A: int):
    """The groups a call writes, row by row (at most `per_row` a row, fewer padded with page -1): their page
    (-1: none), first position (a multiple of CHUNK), first row set and count, and the window of the row's tokens
    aligned to the group: token index + CHUNK (the tokens padded with CHUNK on both sides) of the group's row 0
    (rows of one token: 0, the token copied alone). Returns ([P, per_row] arrays, per_row)."""
    P, C = page_PC.shape
    per_row = min(C, (C - 1) // CHUNK + 2)
    valid = (page_PC >= 0) & (page_PC < NP)
    if C == 1:  # decode rows: a group each, its token at row off % CHUNK (the window: the token alone, at row 0)
        row0 = off_PC % CHUNK
        return (jnp.where(valid, page_PC, -1), off_PC - row0, row0, valid.astype(jnp.int32),
                jnp.zeros_like(off_PC)), 1
    gid = jnp.where(valid, page_PC * (A // CHUNK) + off_PC // CHUNK, -1)  # a group's number in the pool
    prev = jnp.pad(gid, ((0, 0), (1, 0)), constant_values=-1)[:, :-1]
    starts = valid & (gid != prev)
    index = jnp.cumsum(starts, axis=1) - 1  # each token's group in its row
    j = jnp.arange(per_row)[None, :, None]
    first = starts[:, None, :] & (index[:, None, :] == j)  # [P, per_row, C]
    t0 = jnp.argmax(first, axis=-1)
    count = jnp.sum(valid[:, None, :] & (index[:, None, :] == j), axis=-1)
    take = lambda x: jnp.take_along_axis(x, t0, axis=1)  # noqa: E731
    present = first.any(-1)
    row0 = take(off_PC) % CHUNK
    return (jnp.where(present, take(page_PC), -1), take(off_PC) - row0, row0, jnp.where(present, count, 0),
            t0 - row0 + CHUNK), per_row


def _kernel(ids_ref, base_ref, row0_ref, count_ref, win_ref, rows_ref, tokens_hbm, pool_in, pool_out, buf, stage,
            sems, *, block: int, single: bool):
    """Program b's groups g = b block + i: the group's positions [base, base + CHUNK) of page ids[g] into buf[i],
    the row's tokens of window win[g] into stage[i] (`single`, rows of one token: the token into stage[i]'s row
    row0); rows [row0, row0 + count) of the group set from the window; the group written back. A group of page -1
    is skipped."""
    del pool_in  # aliased to pool_out: read and written there
    b = pl.program_id(0)

    def copies(i, back: bool = False):
        """Group i's reads (the group, the tokens' window), or its write back."""
        g = b * block + i
        group = pool_out.at[:, ids_ref[g], pl.ds(pl.multiple_of(base_ref[g], CHUNK), CHUNK)]
        if back:
            return [pltpu.make_async_copy(buf.at[i], group, sems.at[2])]
        if single:
            window, into = tokens_hbm.at[rows_ref[g], pl.ds(0, 1)], stage.at[i, pl.ds(row0_ref[g], 1)]
        else:
            window, into = tokens_hbm.at[rows_ref[g], pl.ds(win_ref[g], CHUNK)], stage.at[i]
        return [pltpu.make_async_copy(group, buf.at[i], sems.at[0]), pltpu.make_async_copy(window, into, sems.at[1])]

    def each(fn):
        def body(i, carry):
            @pl.when(ids_ref[b * block + i] >= 0)
            def _():
                fn(i)
            return carry
        jax.lax.fori_loop(0, block, body, 0)

    each(lambda i: [c.start() for c in copies(i)])
    each(lambda i: [c.wait() for c in copies(i)])

    def merge(i):
        g = b * block + i
        rows = jax.lax.broadcasted_iota(jnp.int32, buf.shape[1:], 1)
        new = jnp.swapaxes(stage[i].astype(jnp.float32), 0, 1)  # [K, CHUNK, L]
        keep = (rows >= row0_ref[g]) & (rows < row0_ref[g] + count_ref[g])
        buf[i] = jnp.where(keep, new, buf[i].astype(jnp.float32)).astype(buf.dtype)

    each(merge)
    each(lambda i: [c.start() for c in copies(i, back=True)])
    each(lambda i: [c.wait() for c in copies(i, back=True)])


@functools.partial(jax.jit, static_argnames=("interpret",))
def write_rows(pool, new_PCKL, page_PC, off_PC, *, interpret: bool = False):
    """`pool` [K, pages, A, L] with row p's token c's vectors new_PCKL[p, c] [K, width] (zeros past the width) written
    at page page_PC[p, c], offset off_PC[p, c]; a page outside [0, pages) drops the token. In place where the
    caller donates the pool (or the program updates it); new_PCKL takes the pool's dtype."""
    K, NP, A, L = pool.shape
    P, C = page_PC.shape
    (ids, base, row0, count, win), per_row = groups(page_PC, off_PC, NP, A)
    G = P * per_row
    tile = lambda n: -(-n // 16) * 16  # noqa: E731 - rows as VMEM pads them (a bfloat16 tile's 16)
    block = max(1, min(G, BLOCK_BYTES // ((K * tile(CHUNK) + CHUNK * tile(K)) * L * pool.dtype.itemsize)))
    Gp = -(-G // block) * block
    flat = lambda x, fill=0: jnp.pad(x.reshape(-1), (0, Gp - G), constant_values=fill).astype(jnp.int32)  # noqa: E731
    rows = jnp.broadcast_to(jnp.arange(P)[:, None], (P, per_row))
    pad = 0 if C == 1 else CHUNK
    tokens = jnp.pad(new_PCKL.astype(pool.dtype), ((0, 0), (pad, pad), (0, 0), (0, L - new_PCKL.shape[-1])))
    return pl.pallas_call(
        functools.partial(_kernel, block=block, single=C == 1),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(Gp // block,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.VMEM((block, K, CHUNK, L), pool.dtype),
                            pltpu.VMEM((block, CHUNK, K, L), pool.dtype), pltpu.SemaphoreType.DMA((3,))]),
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        input_output_aliases={7: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="paged_pool_write",
    )(flat(ids, -1), flat(base), flat(row0), flat(count), flat(win), flat(rows), tokens, pool)
