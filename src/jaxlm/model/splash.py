"""TPU attention with the Pallas splash-attention kernel (`jax.experimental.pallas.ops.tpu.splash_attention`):
flash attention that skips the tiles a block-sparse mask rules out, with its own backward kernels.

The kernel works on one device's data, so it runs under `shard_map` over the mesh's batch and heads axes
(as the active sharding rules map them); the sequence stays whole on each device. Its masks are static
functions of array index, so causality and windows follow the token's index in the row; with packed
documents the segment ids keep documents apart, which equals the position rule of `attention.mask` whenever
positions count up by one within each document (what the data packer writes).

Shape legend: B batch, T length, N query heads, K kv heads, H head width.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib
from jax.sharding import PartitionSpec

from jaxlm import sharding

BLOCK = 128  # the kernel's smallest tile along the sequence: lengths must be multiples of it


def supports(T: int) -> bool:
    return T % BLOCK == 0


def _block_sizes(T: int, block: int, layout: str = "head_dim_minor") -> kernel_lib.BlockSizes:
    b = max(BLOCK, min(block, T) // BLOCK * BLOCK)
    while T % b:
        b -= BLOCK
    qkv = kernel_lib.QKVLayout.SEQ_MINOR if layout == "seq_minor" else kernel_lib.QKVLayout.HEAD_DIM_MINOR
    return kernel_lib.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                                 block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b, q_layout=qkv, k_layout=qkv,
                                 v_layout=qkv)


@functools.lru_cache(maxsize=64)
def _kernel(N: int, T: int, window: int | None, softcap: float | None, block: int, interpret: bool,
            chunk: int | None = None, layout: str = "head_dim_minor"):
    """The kernel for these static settings, cached across traces. Its constructor turns the mask's block tables
    (numpy) into arrays; made during a trace, those would be that trace's tracers, and the cache would hand them
    to the next trace (UnexpectedTracerError at a second trace of the step, or the evaluation step). So they are
    made eagerly, as constants that any trace can capture."""
    with jax.ensure_compile_time_eval():
        return _make_kernel(N, T, window, softcap, block, interpret, chunk, layout)


def _make_kernel(N, T, window, softcap, block, interpret, chunk, layout):
    if chunk is not None:
        one = mask_lib.ChunkedCausalMask((T, T), chunk_size=chunk)
    elif window is not None:
        one = mask_lib.LocalMask((T, T), window_size=(window - 1, 0), offset=0)
    else:
        one = mask_lib.CausalMask((T, T))
    return kernel_lib.make_splash_mha(mask_lib.MultiHeadMask([one] * N), block_sizes=_block_sizes(T, block, layout),
                                      attn_logits_soft_cap=softcap, head_shards=1, q_seq_shards=1,
                                      interpret=interpret)


def attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, window=None, scale=None, softcap=None, block_size=512,
              interpret=False, chunk=None, sinks_N=None, layout: str = "head_dim_minor") -> jax.Array:
    """Causal self-attention of T tokens (T a multiple of 128) in the query dtype; `window` limits each query
    to the last `window` tokens, itself included, `chunk` to its own block of that many tokens; sinks_N (a
    logit per query head) join the softmax denominators. Runs in Pallas interpret mode (any backend) when
    asked. `layout` (model.splash_layout): how the kernel holds each head's queries, keys and values, [T, H]
    (head_dim_minor) or [H, T] (seq_minor)."""
    heads_major = _heads_major_seq_minor if layout == "seq_minor" else lambda x: x.transpose(0, 2, 1, 3)
    H = q_BTNH.shape[-1]
    scale = H ** -0.5 if scale is None else scale
    q_BTNH = q_BTNH * jnp.asarray(scale, q_BTNH.dtype)
    out_BNTH = _run(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, window, softcap, block_size, interpret, chunk, sinks_N,
                    layout, heads_major, heads_axis=2)
    return out_BNTH.transpose(0, 2, 1, 3).astype(q_BTNH.dtype)


def attention_heads_major(q_BNTH, k_BKTH, v_BKTH, segment_ids_BT, window=None, scale=None, softcap=None,
                          block_size=512, interpret=False, chunk=None, sinks_N=None,
                          layout: str = "head_dim_minor") -> jax.Array:
    """`attention` of heads-major queries [B, N, T, H], keys and values [B, K, T, H], the kernel's own layout:
    out [B, N, T, H]. The projections write this layout and read it back (attention.attention_with_kv), so no
    transposing copy of q, k, v or the output runs on either side of the kernel, forward or backward."""
    H = q_BNTH.shape[-1]
    scale = H ** -0.5 if scale is None else scale
    q_BNTH = q_BNTH * jnp.asarray(scale, q_BNTH.dtype)
    out_BNTH = _run(q_BNTH, k_BKTH, v_BKTH, segment_ids_BT, window, softcap, block_size, interpret, chunk, sinks_N,
                    layout, lambda x: x, heads_axis=1)
    return out_BNTH.astype(q_BNTH.dtype)


def _run(q, k, v, segment_ids_BT, window, softcap, block_size, interpret, chunk, sinks_N, layout, heads_major,
         heads_axis: int):
    """The kernel over q, k, v (their heads on axis `heads_axis`; heads_major(x) makes x [B, heads, T, H]) under
    shard_map over the batch and heads axes: out [B, N, T, H]."""
    B, T, N, K = q.shape[0], q.shape[3 - heads_axis], q.shape[heads_axis], k.shape[heads_axis]
    has_segments, has_sinks = segment_ids_BT is not None, sinks_N is not None

    def local(q, k, v, *rest):
        seg, sinks = (rest[0] if has_segments else None), (rest[-1] if has_sinks else None)
        kern = _kernel(q.shape[heads_axis], T, window, softcap, block_size, interpret, chunk, layout)
        q_BNTH, k_BKTH, v_BKTH = heads_major(q), heads_major(k), heads_major(v)
        if seg is not None:
            ids = kernel_lib.SegmentIds(q=seg, kv=seg)
            return jax.vmap(lambda q, k, v, s: kern(q, k, v, segment_ids=s, sinks=sinks))(q_BNTH, k_BKTH, v_BKTH, ids)
        return jax.vmap(lambda q, k, v: kern(q, k, v, sinks=sinks))(q_BNTH, k_BKTH, v_BKTH)

    with jax.named_scope("splash_attention"):
        seg = (segment_ids_BT.astype(jnp.int32),) if has_segments else ()
        seg += (sinks_N.astype(jnp.float32),) if has_sinks else ()
        ctx = sharding.active()
        if ctx is None:
            return local(q, k, v, *seg)
        mesh, rules = ctx
        batch, heads = _axes(mesh, rules, "batch", B), _axes(mesh, rules, "heads", N)
        kv_heads = _axes(mesh, rules, "kv_heads", K)
        if heads != kv_heads:  # both split the same way, or neither
            heads = kv_heads = None

        def spec(h):
            return PartitionSpec(batch, h, None, None) if heads_axis == 1 else PartitionSpec(batch, None, h, None)

        q_spec, kv_spec = spec(heads), spec(kv_heads)
        in_specs = ((q_spec, kv_spec, kv_spec) + ((PartitionSpec(batch, None),) if has_segments else ())
                    + ((PartitionSpec(heads),) if has_sinks else ()))
        return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=PartitionSpec(batch, heads, None, None),
                             check_vma=False)(q, k, v, *seg)


def _heads_major_seq_minor(x_BTNH):
    """x [B, N, T, H] (transpose(0, 2, 1, 3)) spelled through the [B, N * H, T] transpose of the projection's
    [B, T, N * H] result: the [B, N, H, T] layout the seq_minor kernel reads is then that one 2-D transpose per
    row, with no [.., T, H] array of H < 128 lanes (padded tiles) made on the way (docs/performance.md)."""
    B, T, N, H = x_BTNH.shape
    return x_BTNH.reshape(B, T, N * H).swapaxes(1, 2).reshape(B, N, H, T).swapaxes(2, 3)


def _axes(mesh, rules, logical: str, size: int):
    """The mesh axes `logical` is split over when they divide `size`; else None (kept whole)."""
    entry = sharding.spec((logical,), rules)[0]
    return entry if size % sharding.shard_count(mesh, entry) == 0 else None
