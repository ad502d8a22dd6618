"""A decode step's keys and values written into the paged pool (model/paged.py) by a Pallas TPU kernel instead of
XLA's scatter. XLA:TPU writes a scatter's updates one after another, one vector a kv head and token (512 of them for
64 rows on 8 kv heads, about 50 us a layer on a v5e), while the pool's pages are tiled in rows of several positions,
so a single position cannot be copied on its own. The kernel reads, for every token, the aligned group of CHUNK
positions holding its slot (all kv heads, one DMA), sets the slot's row in VMEM, and writes the group back: two DMAs
a token, all in flight at once. Tokens of one call must not share a group (decode rows do not: each row writes its
own page, and only full pages are shared). Shapes: T tokens, K kv heads, R repeats, NP pages, A a page, L lanes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

CHUNK = 16  # positions of the group read and written around a slot: a bfloat16 tile's rows (8 for 32-bit)
MAX_TOKENS = 256  # tokens a call at most (the groups in VMEM: 256 x 8 heads x 16 x 128 lanes x 2 bytes = 8 MiB)


def fits(pool_shape: tuple, tokens: int) -> bool:
    """Whether write_tokens takes a pool [K, R, NP, A, L] and this many tokens: pages of whole groups, lanes of
    whole vectors, and the groups within MAX_TOKENS."""
    return pool_shape[-2] % CHUNK == 0 and pool_shape[-1] % 128 == 0 and 0 < tokens <= MAX_TOKENS


def _kernel(ids_ref, base_ref, row_ref, new_ref, pool_in, pool_out, buf, sems, *, tokens: int):
    """Per token t: positions [base, base + CHUNK) of page ids_ref[t] (base = base_ref[t]) into buf[t], their row
    row_ref[t] set to new_ref[t], the group back; a token of page -1 is skipped."""
    del pool_in  # aliased to pool_out: read and written there

    def copy(t, to_pool: bool):
        hbm = pool_out.at[:, ids_ref[t], pl.ds(pl.multiple_of(base_ref[t], CHUNK), CHUNK)]
        return pltpu.make_async_copy(buf.at[t], hbm, sems.at[1]) if to_pool else pltpu.make_async_copy(
            hbm, buf.at[t], sems.at[0])

    def each(fn):
        def body(t, carry):
            @pl.when(ids_ref[t] >= 0)
            def _():
                fn(t)
            return carry
        jax.lax.fori_loop(0, tokens, body, 0)

    each(lambda t: copy(t, False).start())
    each(lambda t: copy(t, False).wait())

    def set_row(t):
        rows = jax.lax.broadcasted_iota(jnp.int32, buf.shape[1:], 1)
        group = buf[t].astype(jnp.float32)
        new = new_ref[t].astype(jnp.float32)[:, None, :]
        buf[t] = jnp.where(rows == row_ref[t], new, group).astype(buf.dtype)

    each(set_row)
    each(lambda t: copy(t, True).start())
    each(lambda t: copy(t, True).wait())


@functools.partial(jax.jit, static_argnames=("interpret",))
def write_tokens(pool, new_TKL, ids_T, off_T, *, interpret: bool = False):
    """`pool` [K, pages, A, L] with token t's vectors new_TKL[t] [K, L] written at page ids_T[t], offset off_T[t]
    (a page outside [0, pages) drops the token), in place where the caller donates the pool; new_TKL takes the
    pool's dtype."""
    K, NP, A, L = pool.shape
    T = new_TKL.shape[0]
    ids = jnp.where((ids_T >= 0) & (ids_T < NP), ids_T, -1).astype(jnp.int32)
    off = jnp.clip(off_T, 0, A - 1).astype(jnp.int32)
    base = off // CHUNK * CHUNK
    return pl.pallas_call(
        functools.partial(_kernel, tokens=T),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(1,),
            in_specs=[pl.BlockSpec((T, K, L), lambda i, *_: (0, 0, 0)), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.VMEM((T, K, CHUNK, L), pool.dtype), pltpu.SemaphoreType.DMA((2,))]),
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        input_output_aliases={4: 0},
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=32 << 20),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="paged_pool_write",
    )(ids, base, off - base, new_TKL.astype(pool.dtype), pool)
