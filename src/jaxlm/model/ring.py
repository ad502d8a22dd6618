"""Context parallelism: self-attention of a sequence split over the mesh axes of the logical `length` axis, so that
no device holds the whole sequence's queries, keys and values at once; `self_attention` runs `attention` here
whenever the active mesh splits the length. model.context_parallel `ring` passes each device's block of keys and
values around the ring (`ppermute`), continuing one online softmax (`blockwise.accumulate`), and its custom VJP is
a second ring that carries dk, dv home; `all_gather` gathers them once per layer. Masks go by position and segment
id, so `zigzag_order` can balance causal work; key blocks no query of a device may see are skipped whole
(docs/scaling.md, "Context parallelism").

Shape legend: B batch, T query length (this device's share in the shard_map bodies), S key length, N query
heads, K kv heads, H head width.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxlm import sharding
from jaxlm.model import blockwise


class _Ring(NamedTuple):
    """Static settings of one call (hashable: the custom_vjp's nondiff argument)."""
    axis: str | tuple[str, ...]
    n: int
    window: int | None
    scale: float | None
    softcap: float | None
    block: int


def context_devices(mesh=None, rules=None) -> int:
    """How many devices a mesh splits the `length` axis over with these activation rules (by default the
    active mesh's; 1 outside a mesh)."""
    if mesh is None:
        ctx = sharding.active()
        if ctx is None:
            return 1
        mesh, rules = ctx
    return sharding.shard_count(mesh, sharding.spec(("length",), rules)[0])


def zigzag_order(T: int, n: int) -> np.ndarray:
    """[T] token indices: the sequence cut into 2n chunks, device i (of n, each holding T / n consecutive slots)
    getting chunks i and 2n-1-i, so that causal attention gives every device the same work."""
    chunks = np.arange(T).reshape(2 * n, T // (2 * n))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])


def attention(q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, window=None, scale=None, softcap=None,
              block_size: int = 512, method: str = "ring") -> jax.Array:
    """Causal self-attention of a sequence split over the active mesh's `length` axes (T a multiple of their
    size), in the query dtype; masks and arguments as `blockwise.attention`. method: ring or all_gather."""
    mesh, rules = sharding.active()
    axis = sharding.spec(("length",), rules)[0]
    B, T, N, _ = q_BTNH.shape
    K = k_BTKH.shape[2]
    batch = _split(mesh, rules, "batch", B)
    heads, kv_heads = _split(mesh, rules, "heads", N), _split(mesh, rules, "kv_heads", K)
    if heads != kv_heads:  # a device needs the kv heads of its query heads: both split the same way, or neither
        heads = kv_heads = None
    q_spec = PartitionSpec(batch, axis, heads, None)
    kv_spec = PartitionSpec(batch, axis, kv_heads, None)
    tok_spec = PartitionSpec(batch, axis)
    if segment_ids_BT is None:
        segment_ids_BT = jnp.zeros(positions_BT.shape, jnp.int32)
    s = _Ring(axis, sharding.shard_count(mesh, axis), window, scale, softcap, block_size)
    local = functools.partial(_ring if method == "ring" else _gathered, s)
    with jax.named_scope(f"{method}_attention"):
        return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, tok_spec, tok_spec),
                             out_specs=q_spec, check_vma=False)(
            q_BTNH, k_BTKH, v_BTKH, positions_BT.astype(jnp.int32), segment_ids_BT.astype(jnp.int32))


def _split(mesh, rules, logical: str, size: int):
    """The mesh axes `logical` is split over when they divide `size`; else None (kept whole)."""
    entry = sharding.spec((logical,), rules)[0]
    return entry if size % sharding.shard_count(mesh, entry) == 0 else None


def _gathered(s: _Ring, q_BTNH, k_BTKH, v_BTKH, pos_BT, seg_BT):
    gather = lambda x: jax.lax.all_gather(x, s.axis, axis=1, tiled=True)  # noqa: E731
    out_BTNH, _ = blockwise.attend_block(q_BTNH, gather(k_BTKH), gather(v_BTKH), pos_BT, gather(pos_BT), seg_BT,
                                         gather(seg_BT), s.window, s.scale, s.softcap, s.block, s.block)
    return out_BTNH.astype(q_BTNH.dtype)


def _shift(s: _Ring, tree):
    """Every device's arrays to the next device of the ring."""
    return jax.lax.ppermute(tree, s.axis, [(i, (i + 1) % s.n) for i in range(s.n)])


def _may_attend(s: _Ring, q_pos_BT, k_pos_BS):
    """False when no query may see any key of the block by position alone (so the whole block is skipped).
    Padding (blockwise.PAD_POSITION, see _ring) counts as neither a query nor a key."""
    pad = blockwise.PAD_POSITION
    seen = jnp.min(k_pos_BS) <= jnp.max(jnp.where(q_pos_BT < pad, q_pos_BT, -1))
    if s.window is not None:
        seen &= jnp.max(jnp.where(k_pos_BS < pad, k_pos_BS, -pad)) > jnp.min(q_pos_BT) - s.window
    return seen


def _ring(s: _Ring, q_BTNH, k_BTKH, v_BTKH, pos_BT, seg_BT):
    """This device's share of the output, in the query dtype. A share that is not a multiple of the tile is
    padded: padded keys sit after every query, and the padded queries' outputs are dropped."""
    T = q_BTNH.shape[1]
    pad = -T % min(s.block, T)
    if pad:
        q_BTNH, k_BTKH, v_BTKH, seg_BT = (blockwise.pad_tokens(a, pad) for a in (q_BTNH, k_BTKH, v_BTKH, seg_BT))
        pos_BT = blockwise.pad_tokens(pos_BT, pad, blockwise.PAD_POSITION)
    return _ring_attention(s, q_BTNH, k_BTKH, v_BTKH, pos_BT, seg_BT)[:, :T]


def _accumulate(s: _Ring, q_BTNH, q_pos_BT, q_seg_BT, kv, state):
    k_BSKH, v_BSKH, k_pos_BS, k_seg_BS = kv
    return jax.lax.cond(_may_attend(s, q_pos_BT, k_pos_BS),
                        lambda state: blockwise.accumulate(q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT,
                                                           k_seg_BS, state, s.window, s.scale, s.softcap, s.block,
                                                           s.block),
                        lambda state: state, state)


def _forward(s: _Ring, q_BTNH, k_BTKH, v_BTKH, pos_BT, seg_BT):
    """(out float32, lse) of this device's queries over the whole ring's keys: one online softmax, continued
    over each block as it passes."""
    def step(carry, _):
        state, kv = carry
        incoming = _shift(s, kv)  # in flight while this block is attended
        return (_accumulate(s, q_BTNH, pos_BT, seg_BT, kv, state), incoming), None

    # Positions and segment ids go through the barrier with q, k, v: see blockwise._tied.
    q_BTNH, k_BTKH, v_BTKH, pos_BT, seg_BT = jax.lax.optimization_barrier((q_BTNH, k_BTKH, v_BTKH, pos_BT, seg_BT))
    B, T, N, H = q_BTNH.shape
    init = (blockwise.empty_state(B, T, N, H), (k_BTKH, v_BTKH, pos_BT, seg_BT))
    (state, kv), _ = jax.lax.scan(step, init, None, length=s.n - 1)
    return blockwise.finish(_accumulate(s, q_BTNH, pos_BT, seg_BT, kv, state))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attention(s: _Ring, q_BTNH, k_BTKH, v_BTKH, pos_BT, seg_BT):
    return _forward(s, q_BTNH, k_BTKH, v_BTKH, pos_BT, seg_BT)[0].astype(q_BTNH.dtype)


def _ring_fwd(s, q_BTNH, k_BTKH, v_BTKH, pos_BT, seg_BT):
    out_BTNH, lse_BTN = _forward(s, q_BTNH, k_BTKH, v_BTKH, pos_BT, seg_BT)
    out_BTNH = out_BTNH.astype(q_BTNH.dtype)
    # What the backward needs is this device's own: no key block of another device, nothing per ring step. The
    # output is kept as returned (the query dtype, bf16 in mixed precision), half the bytes of the float32 one,
    # so the backward's softmax_delta reads the rounded output; the equality tests run float32, where the two
    # are the same.
    return out_BTNH, (q_BTNH, k_BTKH, v_BTKH, pos_BT, seg_BT, out_BTNH, lse_BTN)


def _ring_bwd(s, residuals, dout_BTNH):
    """The key blocks go round the ring again, each with the dk, dv it has gathered so far (float32); after n
    steps and one last shift every block is back on its own device with its whole gradient."""
    q_BTNH, k_BTKH, v_BTKH, pos_BT, seg_BT, out_BTNH, lse_BTN = residuals
    delta_BTN = blockwise.softmax_delta(out_BTNH, dout_BTNH)

    def grads(kv, dq_BTNH, dkv):
        k_BSKH, v_BSKH, k_pos_BS, k_seg_BS = kv

        def run(grads):
            return blockwise.accumulate_grads(q_BTNH, k_BSKH, v_BSKH, pos_BT, k_pos_BS, seg_BT, k_seg_BS, lse_BTN,
                                              delta_BTN, dout_BTNH, grads, s.window, s.scale, s.softcap, s.block,
                                              s.block)

        dq_BTNH, dk_BSKH, dv_BSKH = jax.lax.cond(_may_attend(s, pos_BT, k_pos_BS), run, lambda g: g,
                                                 (dq_BTNH, *dkv))
        return dq_BTNH, (dk_BSKH, dv_BSKH)

    def step(carry, _):
        dq_BTNH, kv, dkv = carry
        incoming = _shift(s, kv)
        dq_BTNH, dkv = grads(kv, dq_BTNH, dkv)
        return (dq_BTNH, incoming, _shift(s, dkv)), None

    zeros_kv = (jnp.zeros(k_BTKH.shape, jnp.float32), jnp.zeros(v_BTKH.shape, jnp.float32))
    init = (jnp.zeros(q_BTNH.shape, jnp.float32), (k_BTKH, v_BTKH, pos_BT, seg_BT), zeros_kv)
    (dq_BTNH, kv, dkv), _ = jax.lax.scan(step, init, None, length=s.n - 1)
    dq_BTNH, dkv = grads(kv, dq_BTNH, dkv)
    dk_BTKH, dv_BTKH = _shift(s, dkv)
    return dq_BTNH.astype(q_BTNH.dtype), dk_BTKH.astype(k_BTKH.dtype), dv_BTKH.astype(v_BTKH.dtype), None, None


_ring_attention.defvjp(_ring_fwd, _ring_bwd)
