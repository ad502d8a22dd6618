"""Blockwise attention in plain JAX: an online softmax over key blocks (flash attention's algorithm) with a
hand-written backward pass, so that neither the forward nor the gradient step ever holds more than one
[query block x key block] tile of scores per head. Runs on every backend; it is the fallback of the Pallas
and cuDNN kernels and what long sequences use on CPUs.

`attend_block` is the building block: attention of some queries over some keys, any positions, returning
the output in float32 and the log-sum-exp of each query's scores. Two results over disjoint key sets merge
exactly with `merge` (ring attention passes key blocks around and merges them this way); both results are
differentiable, the log-sum-exp included. `attend_block_grads` is the matching backward step of one key set
within a merged result (what ring attention's own backward pass runs at each step of the ring).

Shape legend: B batch, T query length, S key length, N query heads, K kv heads, G query heads per kv head
(N = K * G), H head width, Q query block, C key block; a leading n (nQ, nC) counts blocks.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

_NEG = -1e30  # running max of a row that has seen no allowed key yet; exp(_NEG - x) underflows to 0
_PAD_POSITION = 2 ** 30  # padded keys sit after every query, so causality alone masks them


def attend_block(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, q_pos_BT: jax.Array,
                 k_pos_BS: jax.Array, q_seg_BT: jax.Array | None = None, k_seg_BS: jax.Array | None = None,
                 window: int | None = None, scale: float | None = None, softcap: float | None = None,
                 block_q: int = 512, block_k: int = 512) -> tuple[jax.Array, jax.Array]:
    """Attention of queries [B, T, N, H] over keys and values [B, S, K, H] (N a multiple of K), causal by
    position (key position <= query position), within the last `window` positions when given (the query's
    own included), and within the same segment when segment ids are given (both or neither).
    Logits are q.k * scale (default 1/sqrt(H)), then softcap * tanh(logits / softcap) when softcap is set.

    Returns (out [B, T, N, H] float32, lse [B, T, N] float32): the softmax-weighted values and the
    log-sum-exp of each query's allowed logits. A query with no allowed key gets out 0 and lse -inf, so that
    `merge` ignores it. Memory is O((T + S) x H + block_q x block_k) per head, in the gradient too."""
    B, T, N, H = q_BTNH.shape
    S, K = k_BSKH.shape[1], k_BSKH.shape[2]
    if N % K:
        raise ValueError(f"attend_block: {N} query heads are not a multiple of {K} kv heads")
    if (q_seg_BT is None) != (k_seg_BS is None):
        raise ValueError("attend_block: give segment ids for both queries and keys, or for neither")
    if q_seg_BT is None:
        q_seg_BT, k_seg_BS = jnp.zeros((B, T), jnp.int32), jnp.zeros((B, S), jnp.int32)
    Q, C = min(block_q, T), min(block_k, S)
    pad_t, pad_s = -T % Q, -S % C
    q_BTNH, q_pos_BT, q_seg_BT = (jnp.pad(a, [(0, 0), (0, pad_t)] + [(0, 0)] * (a.ndim - 2))
                                  for a in (q_BTNH, q_pos_BT, q_seg_BT))
    k_BSKH, v_BSKH, k_seg_BS = (jnp.pad(a, [(0, 0), (0, pad_s)] + [(0, 0)] * (a.ndim - 2))
                                for a in (k_BSKH, v_BSKH, k_seg_BS))
    k_pos_BS = jnp.pad(k_pos_BS, [(0, 0), (0, pad_s)], constant_values=_PAD_POSITION)
    tiling = _Tiling(Q, C, N // K, H ** -0.5 if scale is None else float(scale), window,
                     None if softcap is None else float(softcap))
    out_BTNH, lse_BTN = _attend(tiling, q_BTNH, k_BSKH, v_BSKH, q_pos_BT.astype(jnp.int32),
                                k_pos_BS.astype(jnp.int32), q_seg_BT.astype(jnp.int32), k_seg_BS.astype(jnp.int32))
    return out_BTNH[:, :T], lse_BTN[:, :T]


def merge(out1_BTNH, lse1_BTN, out2_BTNH, lse2_BTN) -> tuple[jax.Array, jax.Array]:
    """Combine attention results over two disjoint key sets into the result over their union."""
    lse_BTN = jnp.logaddexp(lse1_BTN, lse2_BTN)
    safe_BTN = jnp.where(jnp.isneginf(lse_BTN), 0.0, lse_BTN)
    w1_BTN1 = jnp.exp(lse1_BTN - safe_BTN)[..., None]
    w2_BTN1 = jnp.exp(lse2_BTN - safe_BTN)[..., None]
    return w1_BTN1 * out1_BTNH + w2_BTN1 * out2_BTNH, lse_BTN


def attend_block_grads(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, q_pos_BT: jax.Array,
                       k_pos_BS: jax.Array, q_seg_BT: jax.Array, k_seg_BS: jax.Array, out_BTNH: jax.Array,
                       lse_BTN: jax.Array, dout_BTNH: jax.Array, window: int | None = None,
                       scale: float | None = None, softcap: float | None = None, block_q: int = 512,
                       block_k: int = 512) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The gradients (dq, dk, dv) that these keys and values receive as one part of a larger key set whose
    attention, merged over every part, is (out [B, T, N, H] float32, lse [B, T, N]) with cotangent dout on
    out: ring attention's backward step. Each tile's probabilities come from the merged lse, so the parts'
    dq sum to the whole's, and each part's dk, dv are its own. Segment ids are required here (zeros for one
    segment per row); arguments and masks are those of `attend_block`, results in the input dtypes."""
    T, S = q_BTNH.shape[1], k_BSKH.shape[1]
    Q, C = min(block_q, T), min(block_k, S)
    pad_t, pad_s = -T % Q, -S % C

    def pad(a, n, value=0):
        return jnp.pad(a, [(0, 0), (0, n)] + [(0, 0)] * (a.ndim - 2), constant_values=value)

    # Padded query rows have dout = 0 and so add nothing; padded keys sit after every query.
    tiling = _Tiling(Q, C, q_BTNH.shape[2] // k_BSKH.shape[2], q_BTNH.shape[3] ** -0.5 if scale is None
                     else float(scale), window, None if softcap is None else float(softcap))
    residuals = (pad(q_BTNH, pad_t), pad(k_BSKH, pad_s), pad(v_BSKH, pad_s), pad(q_pos_BT, pad_t).astype(jnp.int32),
                 pad(k_pos_BS, pad_s, _PAD_POSITION).astype(jnp.int32), pad(q_seg_BT, pad_t).astype(jnp.int32),
                 pad(k_seg_BS, pad_s).astype(jnp.int32), pad(out_BTNH.astype(jnp.float32), pad_t),
                 pad(lse_BTN, pad_t))
    dout_BTNH, lse_BTN = pad(dout_BTNH, pad_t), residuals[-1]
    dq_BTNH, dk_BSKH, dv_BSKH = _attend_bwd(tiling, residuals, (dout_BTNH, jnp.zeros_like(lse_BTN)))[:3]
    return dq_BTNH[:, :T], dk_BSKH[:, :S], dv_BSKH[:, :S]


def attention(q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, window=None, scale=None, softcap=None,
              block_size: int = 512) -> jax.Array:
    """Causal self-attention of T tokens, in the query dtype: the `self_attention` implementation."""
    with jax.named_scope("blockwise_attention"):
        out_BTNH, _ = attend_block(q_BTNH, k_BTKH, v_BTKH, positions_BT, positions_BT, segment_ids_BT,
                                   segment_ids_BT, window, scale, softcap, block_size, block_size)
        return out_BTNH.astype(q_BTNH.dtype)


class _Tiling(NamedTuple):
    """Static settings of one call (hashable: the custom_vjp's nondiff argument)."""
    Q: int
    C: int
    G: int
    scale: float
    window: int | None
    softcap: float | None


def _blocks(x, n_block):
    """[B, L, ...] -> [L / n_block, B, n_block, ...]: the block index leads, for lax.scan."""
    B, L = x.shape[:2]
    return x.reshape(B, L // n_block, n_block, *x.shape[2:]).swapaxes(0, 1)


def _unblocks(x):
    return x.swapaxes(0, 1).reshape(x.shape[1], -1, *x.shape[3:])


def _mask(t: _Tiling, q_pos_BQ, k_pos_BC, q_seg_BQ, k_seg_BC):
    q_BQ1, k_B1C = q_pos_BQ[:, :, None], k_pos_BC[:, None, :]
    allowed_BQC = (k_B1C <= q_BQ1) & (q_seg_BQ[:, :, None] == k_seg_BC[:, None, :])
    if t.window is not None:
        allowed_BQC &= k_B1C > q_BQ1 - t.window
    return allowed_BQC


def _logits(t: _Tiling, q_BQKGH, k_BCKH):
    """Scaled (and capped) logits [B, K, G, Q, C] in float32."""
    s_BKGQC = jnp.einsum("BQKGH,BCKH->BKGQC", q_BQKGH, k_BCKH, preferred_element_type=jnp.float32) * t.scale
    if t.softcap is not None:
        s_BKGQC = t.softcap * jnp.tanh(s_BKGQC / t.softcap)
    return s_BKGQC


def _split_heads(x_BLNH, G):
    B, L, N, H = x_BLNH.shape
    return x_BLNH.reshape(B, L, N // G, G, H)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(t: _Tiling, q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS):
    return _forward(t, q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS)


def _tied(*arrays):
    """The arrays through one optimization barrier. Differentiating a scan over layers splits each layer into
    what depends only on values known before the gradient (positions, segment ids) and the rest, and would
    precompute every tile's mask for all (query block, key block) pairs at once, [T, T] in all; tying the
    integer inputs to q, k and v keeps the masks inside the tile loops."""
    return jax.lax.optimization_barrier(arrays)


def _forward(t: _Tiling, q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS):
    q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS = _tied(
        q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS)
    B, T, N, H = q_BTNH.shape
    K = N // t.G
    keys = (_blocks(k_BSKH, t.C), _blocks(v_BSKH, t.C), _blocks(k_pos_BS, t.C), _blocks(k_seg_BS, t.C))

    def query_block(_, q_inputs):
        q_BQKGH, q_pos_BQ, q_seg_BQ = q_inputs

        def key_block(carry, k_inputs):
            k_BCKH, v_BCKH, k_pos_BC, k_seg_BC = k_inputs
            allowed_BQC = _mask(t, q_pos_BQ, k_pos_BC, q_seg_BQ, k_seg_BC)

            def update(carry):
                m_BKGQ, l_BKGQ, acc_BKGQH = carry
                s_BKGQC = jnp.where(allowed_BQC[:, None, None], _logits(t, q_BQKGH, k_BCKH), _NEG)
                m_new_BKGQ = jnp.maximum(m_BKGQ, s_BKGQC.max(-1))
                p_BKGQC = jnp.where(allowed_BQC[:, None, None], jnp.exp(s_BKGQC - m_new_BKGQ[..., None]), 0.0)
                alpha_BKGQ = jnp.exp(m_BKGQ - m_new_BKGQ)
                pv_BKGQH = jnp.einsum("BKGQC,BCKH->BKGQH", p_BKGQC.astype(v_BCKH.dtype), v_BCKH,
                                      preferred_element_type=jnp.float32)
                return (m_new_BKGQ, l_BKGQ * alpha_BKGQ + p_BKGQC.sum(-1),
                        acc_BKGQH * alpha_BKGQ[..., None] + pv_BKGQH)

            # Whole tiles outside the mask (above the causal diagonal, outside the window, across segments)
            # cost nothing.
            return jax.lax.cond(jnp.any(allowed_BQC), update, lambda c: c, carry), None

        Q = q_BQKGH.shape[1]
        init = (jnp.full((B, K, t.G, Q), _NEG, jnp.float32), jnp.zeros((B, K, t.G, Q), jnp.float32),
                jnp.zeros((B, K, t.G, Q, H), jnp.float32))
        (m_BKGQ, l_BKGQ, acc_BKGQH), _ = jax.lax.scan(key_block, init, keys)
        seen_BKGQ = l_BKGQ > 0
        out_BKGQH = acc_BKGQH / jnp.where(seen_BKGQ, l_BKGQ, 1.0)[..., None]
        lse_BKGQ = jnp.where(seen_BKGQ, m_BKGQ + jnp.log(jnp.where(seen_BKGQ, l_BKGQ, 1.0)), -jnp.inf)
        return None, (out_BKGQH.transpose(0, 3, 1, 2, 4).reshape(B, Q, N, H),
                      lse_BKGQ.transpose(0, 3, 1, 2).reshape(B, Q, N))

    queries = (_blocks(_split_heads(q_BTNH, t.G), t.Q), _blocks(q_pos_BT, t.Q), _blocks(q_seg_BT, t.Q))
    _, (out_nBQNH, lse_nBQN) = jax.lax.scan(query_block, None, queries)
    return _unblocks(out_nBQNH), _unblocks(lse_nBQN)


def _attend_fwd(t, q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS):
    out_BTNH, lse_BTN = _forward(t, q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS)
    return (out_BTNH, lse_BTN), (q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, out_BTNH, lse_BTN)


def _attend_bwd(t, residuals, cotangents):
    """Flash attention's backward: an outer loop over key blocks accumulates their dk, dv while an inner loop
    over query blocks recomputes each tile's probabilities from the saved log-sum-exp and adds to dq."""
    q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, out_BTNH, lse_BTN = residuals
    q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS = _tied(
        q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS)
    dout_BTNH, dlse_BTN = cotangents
    G = t.G
    cdt = q_BTNH.dtype
    # D = rowsum(dout * out) is the softmax's own term; the lse cotangent adds to it with the opposite sign.
    delta_BTN = jnp.sum(dout_BTNH.astype(jnp.float32) * out_BTNH, axis=-1) - dlse_BTN
    safe_lse_BTN = jnp.where(jnp.isneginf(lse_BTN), 0.0, lse_BTN)

    def per_query(x_BTN):  # [B, T, N] -> [nQ, B, K, G, Q], the layout of a tile's rows
        B, T, N = x_BTN.shape
        return _blocks(x_BTN.reshape(B, T, N // G, G), t.Q).transpose(0, 1, 3, 4, 2)

    queries = (_blocks(_split_heads(q_BTNH, G), t.Q), _blocks(_split_heads(dout_BTNH.astype(cdt), G), t.Q),
               per_query(safe_lse_BTN), per_query(delta_BTN), _blocks(q_pos_BT, t.Q), _blocks(q_seg_BT, t.Q))
    B, T, N, H = q_BTNH.shape
    dq_nBQKGH = jnp.zeros((T // t.Q, B, t.Q, N // G, G, H), jnp.float32)

    def key_block(dq_nBQKGH, k_inputs):
        k_BCKH, v_BCKH, k_pos_BC, k_seg_BC = k_inputs

        def query_block(dkv, q_inputs):
            q_BQKGH, do_BQKGH, lse_BKGQ, delta_BKGQ, q_pos_BQ, q_seg_BQ, dq_BQKGH = q_inputs
            allowed_BQC = _mask(t, q_pos_BQ, k_pos_BC, q_seg_BQ, k_seg_BC)

            def update(operands):
                (dk_BCKH, dv_BCKH), dq_BQKGH = operands
                s_BKGQC = _logits(t, q_BQKGH, k_BCKH)
                p_BKGQC = jnp.where(allowed_BQC[:, None, None], jnp.exp(s_BKGQC - lse_BKGQ[..., None]), 0.0)
                dv_BCKH = dv_BCKH + jnp.einsum("BKGQC,BQKGH->BCKH", p_BKGQC.astype(cdt), do_BQKGH,
                                               preferred_element_type=jnp.float32)
                dp_BKGQC = jnp.einsum("BQKGH,BCKH->BKGQC", do_BQKGH, v_BCKH, preferred_element_type=jnp.float32)
                ds_BKGQC = p_BKGQC * (dp_BKGQC - delta_BKGQ[..., None])
                if t.softcap is not None:
                    ds_BKGQC = ds_BKGQC * (1.0 - jnp.square(s_BKGQC / t.softcap))
                ds_BKGQC = (ds_BKGQC * t.scale).astype(cdt)
                dq_BQKGH = dq_BQKGH + jnp.einsum("BKGQC,BCKH->BQKGH", ds_BKGQC, k_BCKH,
                                                 preferred_element_type=jnp.float32)
                dk_BCKH = dk_BCKH + jnp.einsum("BKGQC,BQKGH->BCKH", ds_BKGQC, q_BQKGH,
                                               preferred_element_type=jnp.float32)
                return (dk_BCKH, dv_BCKH), dq_BQKGH

            dkv, dq_BQKGH = jax.lax.cond(jnp.any(allowed_BQC), update, lambda o: o, (dkv, dq_BQKGH))
            return dkv, dq_BQKGH

        init = (jnp.zeros(k_BCKH.shape, jnp.float32), jnp.zeros(v_BCKH.shape, jnp.float32))
        (dk_BCKH, dv_BCKH), dq_nBQKGH = jax.lax.scan(query_block, init, (*queries, dq_nBQKGH))
        return dq_nBQKGH, (dk_BCKH, dv_BCKH)

    keys = (_blocks(k_BSKH, t.C), _blocks(v_BSKH, t.C), _blocks(k_pos_BS, t.C), _blocks(k_seg_BS, t.C))
    dq_nBQKGH, (dk_nBCKH, dv_nBCKH) = jax.lax.scan(key_block, dq_nBQKGH, keys)
    dq_BTNH = _unblocks(dq_nBQKGH).reshape(B, T, N, H).astype(q_BTNH.dtype)
    return (dq_BTNH, _unblocks(dk_nBCKH).astype(k_BSKH.dtype), _unblocks(dv_nBCKH).astype(v_BSKH.dtype),
            None, None, None, None)


_attend.defvjp(_attend_fwd, _attend_bwd)
