"""Blockwise attention in plain JAX: an online softmax over key blocks (flash attention's algorithm) with a
hand-written backward pass, so that neither the forward nor the gradient step ever holds more than one
[query block x key block] tile of scores per head. Runs on every backend: the fallback of the Pallas and cuDNN
kernels and what long sequences use on CPUs. `attend_block` (with `merge`) serves the uncached pass; ring
attention continues one online softmax over the key sets that pass by (`accumulate`, `accumulate_grads`). The
kernels slice their tiles where the arrays lie (docs/performance.md, "Attention").

Shape legend: B batch, T query length, S key length, N query heads, K kv heads, G query heads per kv head
(N = K * G), H head width, Q query block, C key block.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

_NEG = -1e30  # running max of a row that has seen no allowed key yet; exp(_NEG - x) underflows to 0
PAD_POSITION = 2 ** 30  # the position of padded keys


def attend_block(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, q_pos_BT: jax.Array,
                 k_pos_BS: jax.Array, q_seg_BT: jax.Array | None = None, k_seg_BS: jax.Array | None = None,
                 window: int | None = None, scale: float | None = None, softcap: float | None = None,
                 block_q: int = 512, block_k: int = 512, chunk: int | None = None,
                 q_reach_BT: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Attention of queries [B, T, N, H] over keys and values [B, S, K, H] (N a multiple of K), causal by
    position (key position <= query position, or <= the query's reach when q_reach_BT is given: an image's
    tokens see to its end, attention.mask), within the last `window` positions when given (the query's own
    included), within the query's block of `chunk` positions when given, and within the same segment when
    segment ids are given (both or neither).
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
    pad_t, pad_s = -T % min(block_q, T), -S % min(block_k, S)
    q_BTNH, q_pos_BT, q_seg_BT = (pad_tokens(a, pad_t) for a in (q_BTNH, q_pos_BT, q_seg_BT))
    if q_reach_BT is not None:  # None keeps the text-only program as it was
        q_reach_BT = pad_tokens(q_reach_BT, pad_t).astype(jnp.int32)
    k_BSKH, v_BSKH, k_seg_BS = (pad_tokens(a, pad_s) for a in (k_BSKH, v_BSKH, k_seg_BS))
    k_pos_BS = pad_tokens(k_pos_BS, pad_s, PAD_POSITION)
    tiling = _tiling(q_BTNH, k_BSKH, window, scale, softcap, block_q, block_k, chunk)
    out_BTNH, lse_BTN = _attend(tiling, q_BTNH, k_BSKH, v_BSKH, q_pos_BT.astype(jnp.int32),
                                k_pos_BS.astype(jnp.int32), q_seg_BT.astype(jnp.int32), k_seg_BS.astype(jnp.int32),
                                q_reach_BT)
    return out_BTNH[:, :T], lse_BTN[:, :T]


def merge(out1_BTNH, lse1_BTN, out2_BTNH, lse2_BTN) -> tuple[jax.Array, jax.Array]:
    """Combine attention results over two disjoint key sets into the result over their union."""
    lse_BTN = jnp.logaddexp(lse1_BTN, lse2_BTN)
    safe_BTN = jnp.where(jnp.isneginf(lse_BTN), 0.0, lse_BTN)
    w1_BTN1 = jnp.exp(lse1_BTN - safe_BTN)[..., None]
    w2_BTN1 = jnp.exp(lse2_BTN - safe_BTN)[..., None]
    return w1_BTN1 * out1_BTNH + w2_BTN1 * out2_BTNH, lse_BTN


def pad_tokens(x_BL, n: int, value=0):
    """x [B, L, ...] with n more tokens of `value` at the end (padded keys take PAD_POSITION: after every
    query, so causality alone masks them; padded queries add nothing to any gradient, their cotangent is 0)."""
    return x_BL if n == 0 else jnp.pad(x_BL, [(0, 0), (0, n)] + [(0, 0)] * (x_BL.ndim - 2), constant_values=value)


def attention(q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, window=None, scale=None, softcap=None,
              block_size: int = 512, chunk: int | None = None, sinks_N: jax.Array | None = None,
              reach_BT: jax.Array | None = None) -> jax.Array:
    """Causal self-attention of T tokens, in the query dtype: the `self_attention` implementation (reach_BT: a
    prompt with images, `attend_block`). With sinks_N (a logit per query head that joins every softmax
    denominator, gpt-oss) the output is rescaled by the share of the probability the keys keep:
    exp(lse) / (exp(lse) + exp(sink))."""
    with jax.named_scope("blockwise_attention"):
        out_BTNH, lse_BTN = attend_block(q_BTNH, k_BTKH, v_BTKH, positions_BT, positions_BT, segment_ids_BT,
                                         segment_ids_BT, window, scale, softcap, block_size, block_size, chunk,
                                         reach_BT)
        if sinks_N is not None:
            out_BTNH = out_BTNH * jax.nn.sigmoid(lse_BTN - sinks_N.astype(jnp.float32))[..., None]
        return out_BTNH.astype(q_BTNH.dtype)


class _Tiling(NamedTuple):
    """Static settings of one call (hashable: the custom_vjp's nondiff argument)."""
    Q: int
    C: int
    G: int
    scale: float
    window: int | None
    softcap: float | None
    chunk: int | None = None


def _tiling(q_BTNH, k_BSKH, window, scale, softcap, block_q, block_k, chunk=None) -> _Tiling:
    B, T, N, H = q_BTNH.shape
    S, K = k_BSKH.shape[1], k_BSKH.shape[2]
    Q, C = min(block_q, T), min(block_k, S)
    if T % Q or S % C:
        raise ValueError(f"blockwise: {T} queries and {S} keys must be multiples of the tiles {Q} and {C}")
    return _Tiling(Q, C, N // K, H ** -0.5 if scale is None else float(scale), window,
                   None if softcap is None else float(softcap), chunk)


def _tile(x, i, size):
    """Tile i (of `size` tokens) of x [B, L, ...]."""
    return jax.lax.dynamic_slice_in_dim(x, i * size, size, axis=1)


def _put(x, tile, i):
    return jax.lax.dynamic_update_slice_in_dim(x, tile.astype(x.dtype), i * tile.shape[1], axis=1)


def _rows(x_BQN, G):
    """[B, Q, N] -> [B, K, G, Q], the layout of a tile's rows."""
    B, Q, N = x_BQN.shape
    return x_BQN.reshape(B, Q, N // G, G).transpose(0, 2, 3, 1)


def _unrows(x_BKGQ):
    B, K, G, Q = x_BKGQ.shape
    return x_BKGQ.transpose(0, 3, 1, 2).reshape(B, Q, K * G)


def _mask(t: _Tiling, q_pos_BQ, k_pos_BC, q_seg_BQ, k_seg_BC, q_reach_BQ=None):
    q_BQ1, k_B1C = q_pos_BQ[:, :, None], k_pos_BC[:, None, :]
    limit_BQ1 = q_BQ1 if q_reach_BQ is None else q_reach_BQ[:, :, None]
    allowed_BQC = (k_B1C <= limit_BQ1) & (q_seg_BQ[:, :, None] == k_seg_BC[:, None, :])
    if t.window is not None:
        allowed_BQC &= k_B1C > q_BQ1 - t.window
    if t.chunk is not None:
        allowed_BQC &= k_B1C // t.chunk == q_BQ1 // t.chunk
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


def _tied(*arrays):
    """The arrays through one optimization barrier. Differentiating a scan over layers splits each layer into
    what depends only on values known before the gradient (positions, segment ids) and the rest, and would
    precompute every tile's mask for all (query block, key block) pairs at once, [T, T] in all; tying the
    integer inputs to q, k and v keeps the masks inside the tile loops."""
    return jax.lax.optimization_barrier(arrays)


def _accumulate(t: _Tiling, q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, state, q_reach_BT=None):
    """The online softmax over one more key set: state (m, l, acc) updated tile by tile, in place. The loops
    slice the arguments where they lie, so nothing of size T or S is copied. q_reach_BT: `attend_block`."""
    q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, q_reach_BT = _tied(
        q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, q_reach_BT)
    B, T, N, H = q_BTNH.shape
    Q, C, G = t.Q, t.C, t.G

    def query_block(i, state):
        q_BQKGH = _split_heads(_tile(q_BTNH, i, Q), G)
        q_pos_BQ, q_seg_BQ = _tile(q_pos_BT, i, Q), _tile(q_seg_BT, i, Q)
        q_reach_BQ = None if q_reach_BT is None else _tile(q_reach_BT, i, Q)
        m_BTN, l_BTN, acc_BTNH = state
        rows = (_rows(_tile(m_BTN, i, Q), G), _rows(_tile(l_BTN, i, Q), G),
                _split_heads(_tile(acc_BTNH, i, Q), G).transpose(0, 2, 3, 1, 4))

        def key_block(j, rows):
            k_BCKH, v_BCKH = _tile(k_BSKH, j, C), _tile(v_BSKH, j, C)
            allowed_BQC = _mask(t, q_pos_BQ, _tile(k_pos_BS, j, C), q_seg_BQ, _tile(k_seg_BS, j, C), q_reach_BQ)

            def update(rows):
                m_BKGQ, l_BKGQ, acc_BKGQH = rows
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
            return jax.lax.cond(jnp.any(allowed_BQC), update, lambda r: r, rows)

        m_BKGQ, l_BKGQ, acc_BKGQH = jax.lax.fori_loop(0, k_BSKH.shape[1] // C, key_block, rows)
        return (_put(m_BTN, _unrows(m_BKGQ), i), _put(l_BTN, _unrows(l_BKGQ), i),
                _put(acc_BTNH, acc_BKGQH.transpose(0, 3, 1, 2, 4).reshape(B, Q, N, H), i))

    return jax.lax.fori_loop(0, T // Q, query_block, state)


def _accumulate_grads(t: _Tiling, q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, lse_BTN,
                      delta_BTN, dout_BTNH, grads, q_reach_BT=None):
    """Flash attention's backward, adding into grads (dq, dk, dv) in place: an outer loop over key tiles
    accumulates their dk, dv while an inner loop over query tiles recomputes each tile's probabilities from
    the saved log-sum-exp and adds to dq."""
    q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, q_reach_BT = _tied(
        q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, q_reach_BT)
    B, T, N, H = q_BTNH.shape
    Q, C, G = t.Q, t.C, t.G
    cdt = q_BTNH.dtype

    def key_block(j, grads):
        k_BCKH, v_BCKH = _tile(k_BSKH, j, C), _tile(v_BSKH, j, C)
        k_pos_BC, k_seg_BC = _tile(k_pos_BS, j, C), _tile(k_seg_BS, j, C)
        dq_BTNH, dk_BSKH, dv_BSKH = grads

        def query_block(i, carry):
            q_BQKGH = _split_heads(_tile(q_BTNH, i, Q), G)
            allowed_BQC = _mask(t, _tile(q_pos_BT, i, Q), k_pos_BC, _tile(q_seg_BT, i, Q), k_seg_BC,
                                None if q_reach_BT is None else _tile(q_reach_BT, i, Q))

            def update(carry):
                dq_BTNH, dk_BCKH, dv_BCKH = carry
                do_BQKGH = _split_heads(_tile(dout_BTNH, i, Q), G).astype(cdt)
                lse_BKGQ = _rows(_tile(lse_BTN, i, Q), G)
                lse_BKGQ = jnp.where(jnp.isneginf(lse_BKGQ), 0.0, lse_BKGQ)
                delta_BKGQ = _rows(_tile(delta_BTN, i, Q), G)
                s_BKGQC = _logits(t, q_BQKGH, k_BCKH)
                p_BKGQC = jnp.where(allowed_BQC[:, None, None], jnp.exp(s_BKGQC - lse_BKGQ[..., None]), 0.0)
                dv_BCKH = dv_BCKH + jnp.einsum("BKGQC,BQKGH->BCKH", p_BKGQC.astype(cdt), do_BQKGH,
                                               preferred_element_type=jnp.float32)
                dp_BKGQC = jnp.einsum("BQKGH,BCKH->BKGQC", do_BQKGH, v_BCKH, preferred_element_type=jnp.float32)
                ds_BKGQC = p_BKGQC * (dp_BKGQC - delta_BKGQ[..., None])
                if t.softcap is not None:
                    ds_BKGQC = ds_BKGQC * (1.0 - jnp.square(s_BKGQC / t.softcap))
                ds_BKGQC = (ds_BKGQC * t.scale).astype(cdt)
                dq_BQKGH = jnp.einsum("BKGQC,BCKH->BQKGH", ds_BKGQC, k_BCKH, preferred_element_type=jnp.float32)
                dq_BTNH = _put(dq_BTNH, _tile(dq_BTNH, i, Q) + dq_BQKGH.reshape(B, Q, N, H), i)
                dk_BCKH = dk_BCKH + jnp.einsum("BKGQC,BQKGH->BCKH", ds_BKGQC, q_BQKGH,
                                               preferred_element_type=jnp.float32)
                return dq_BTNH, dk_BCKH, dv_BCKH

            return jax.lax.cond(jnp.any(allowed_BQC), update, lambda c: c, carry)

        dq_BTNH, dk_BCKH, dv_BCKH = jax.lax.fori_loop(
            0, T // Q, query_block, (dq_BTNH, _tile(dk_BSKH, j, C).astype(jnp.float32),
                                     _tile(dv_BSKH, j, C).astype(jnp.float32)))
        return dq_BTNH, _put(dk_BSKH, dk_BCKH, j), _put(dv_BSKH, dv_BCKH, j)

    return jax.lax.fori_loop(0, k_BSKH.shape[1] // C, key_block, grads)


def empty_state(B: int, T: int, N: int, H: int):
    """The online softmax's state before any key: (running max m [B, T, N], sum l [B, T, N], unnormalized
    output acc [B, T, N, H]), float32."""
    return (jnp.full((B, T, N), _NEG, jnp.float32), jnp.zeros((B, T, N), jnp.float32),
            jnp.zeros((B, T, N, H), jnp.float32))


def finish(state) -> tuple[jax.Array, jax.Array]:
    """(out float32, lse) of an online softmax state; a query that saw no allowed key gets 0 and -inf."""
    m_BTN, l_BTN, acc_BTNH = state
    seen_BTN = l_BTN > 0
    l_BTN = jnp.where(seen_BTN, l_BTN, 1.0)
    return acc_BTNH / l_BTN[..., None], jnp.where(seen_BTN, m_BTN + jnp.log(l_BTN), -jnp.inf)


def softmax_delta(out_BTNH, dout_BTNH, dlse_BTN=None) -> jax.Array:
    """[B, T, N] float32: rowsum(dout * out), the softmax's own term of the backward; the lse's cotangent adds
    to it with the opposite sign."""
    delta_BTN = jnp.einsum("BTNH,BTNH->BTN", dout_BTNH.astype(jnp.float32), out_BTNH.astype(jnp.float32))
    return delta_BTN if dlse_BTN is None else delta_BTN - dlse_BTN


def accumulate(q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, state, window=None, scale=None,
               softcap=None, block_q: int = 512, block_k: int = 512):
    """The online softmax state (`empty_state`) of these queries after one more set of keys and values: ring
    attention's forward step. Masks and arguments as `attend_block`, segment ids required; T and S must be
    multiples of the tiles (min(block, length)). Not meant to be differentiated: ring attention has its own
    backward (accumulate_grads)."""
    t = _tiling(q_BTNH, k_BSKH, window, scale, softcap, block_q, block_k)
    return _accumulate(t, q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, state)


def accumulate_grads(q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, lse_BTN, delta_BTN,
                     dout_BTNH, grads, window=None, scale=None, softcap=None, block_q: int = 512,
                     block_k: int = 512):
    """grads (dq [B, T, N, H], dk, dv [B, S, K, H], float32) plus what these keys and values contribute as one
    part of a larger key set whose merged attention has log-sum-exp lse, `softmax_delta` delta and output
    cotangent dout: ring attention's backward step. Each tile's probabilities come from the merged lse, so
    the parts' dq sum to the whole's, and each part's dk, dv are its own. Arguments as `accumulate`."""
    t = _tiling(q_BTNH, k_BSKH, window, scale, softcap, block_q, block_k)
    return _accumulate_grads(t, q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, lse_BTN,
                             delta_BTN, dout_BTNH, grads)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(t: _Tiling, q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, q_reach_BT):
    return _attend_fwd(t, q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, q_reach_BT)[0]


def _attend_fwd(t, q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, q_reach_BT):
    B, T, N, H = q_BTNH.shape
    out_BTNH, lse_BTN = finish(_accumulate(t, q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS,
                                           empty_state(B, T, N, H), q_reach_BT))
    return (out_BTNH, lse_BTN), (q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, q_reach_BT,
                                 out_BTNH, lse_BTN)


def _attend_bwd(t, residuals, cotangents):
    q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, q_reach_BT, out_BTNH, lse_BTN = residuals
    dout_BTNH, dlse_BTN = cotangents
    zeros = (jnp.zeros(q_BTNH.shape, jnp.float32), jnp.zeros(k_BSKH.shape, jnp.float32),
             jnp.zeros(v_BSKH.shape, jnp.float32))
    dq_BTNH, dk_BSKH, dv_BSKH = _accumulate_grads(t, q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS,
                                                  lse_BTN, softmax_delta(out_BTNH, dout_BTNH, dlse_BTN), dout_BTNH,
                                                  zeros, q_reach_BT)
    return (dq_BTNH.astype(q_BTNH.dtype), dk_BSKH.astype(k_BSKH.dtype), dv_BSKH.astype(v_BSKH.dtype),
            None, None, None, None, None)


_attend.defvjp(_attend_fwd, _attend_bwd)
