"""Sampling: the one home of the rules that turn logits into tokens, shared by `generate`'s decode loop, the
server's engine and speculative decoding: `sample_tokens` (settings shared by the batch, traced so that changing
them does not recompile), `sample_rows` (each row its own settings and key), `probabilities` (the distribution
they draw from), `token_logprobs` (a token's log-probability and the likeliest alternatives) and `row_keys` (a
row's stream: key(seed) folded with its choice and token index, so its tokens depend neither on other rows nor
on how a loop is cut into calls). Temperature, top-k and top-p apply in that order (as in transformers); the
cutoffs are found by bisection on the logits, not by a sort of the vocabulary, which XLA:CPU runs slowly
(docs/generate.md).

Shape legend: B batch (rows), V vocab, K alternatives.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

TOP_LOGPROBS = 5  # the most alternatives a request may ask for, as OpenAI's completions API allows

# The three ways a batch samples, chosen at run time (lax.switch): only what the settings need runs.
GREEDY, PLAIN, FILTERED = 0, 1, 2


def greedy_tokens(logits_BV: jax.Array) -> jax.Array:
    """Each row's argmax as jnp.argmax gives it (the first of equal maxima; a NaN counts as the largest), int32,
    in two passes that XLA vectorizes: the row's maximum, then the least index that holds it. jnp.argmax's
    single variadic reduction runs 2-4x slower on XLA:CPU (16 rows of 32k logits: 0.82 -> 0.42 ms; of 256
    logits, a serving step's sampling: 9.3 -> 2.4 us)."""
    max_B1 = jnp.max(logits_BV, axis=-1, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.int32, logits_BV.shape, logits_BV.ndim - 1)
    hit = (logits_BV == max_B1) | jnp.isnan(logits_BV)
    return jnp.min(jnp.where(hit, iota, logits_BV.shape[-1] - 1), axis=-1)


def _scaled(logits_BV, temperature):
    return logits_BV / jnp.maximum(temperature, jnp.finfo(jnp.float32).tiny)


def filtered(logits_BV: jax.Array, top_k, top_p) -> jax.Array:
    """The logits with what top-k and then top-p drop set to -inf (the logits as they are when both are off)."""
    return jnp.where(keep_mask(logits_BV, top_k, top_p), logits_BV, -jnp.inf)


def branch(temperature, top_k, top_p, V: int) -> jax.Array:
    """Which way settings sample (GREEDY, PLAIN or FILTERED); of arrays of rows' settings, the widest any row
    needs."""
    hot = temperature > 0
    needs_filter = hot & (((top_k > 0) & (top_k < V)) | (top_p < 1))
    return jnp.where(jnp.any(needs_filter), FILTERED, jnp.where(jnp.any(hot), PLAIN, GREEDY))


def sample_tokens(logits_BV: jax.Array, key: jax.Array, temperature, top_k, top_p) -> jax.Array:
    """One token per row from float32 logits, the settings shared by the rows (see the module docstring).
    Greedy is an argmax, plain sampling (top-k and top-p off) a draw from the softmax; only the way the settings
    need runs."""
    def greedy():
        return greedy_tokens(logits_BV)

    def plain():
        return jax.random.categorical(key, _scaled(logits_BV, temperature), axis=-1).astype(jnp.int32)

    def cut():
        return jax.random.categorical(key, filtered(_scaled(logits_BV, temperature), top_k, top_p),
                                      axis=-1).astype(jnp.int32)

    return jax.lax.switch(branch(temperature, top_k, top_p, logits_BV.shape[-1]), (greedy, plain, cut))


def sample_rows(way, logits_BV: jax.Array, keys: Callable[[], jax.Array], temperature_B, top_k_B, top_p_B
                ) -> jax.Array:
    """Each row's next token with its own settings: `way` is `branch` of the rows that sample (traced), and
    `keys()` makes the rows' keys [B] (a threefry hash per row: about a tenth of a small model's step, so made
    only when a row samples). A row's token is the same whichever way serves it, so it does not depend on the
    other rows; the batch pays for top-k/top-p only when a row asks for them."""
    def greedy():
        return greedy_tokens(logits_BV)

    def plain():  # sample_tokens' draw without top-k/top-p, row by row
        drawn_B = jax.vmap(lambda l, k, t: jax.random.categorical(k, _scaled(l, t)))(
            logits_BV, keys(), temperature_B).astype(jnp.int32)
        return jnp.where(temperature_B > 0, drawn_B, greedy())

    def cut():  # every row through sample_tokens (vmapped, it computes each way and selects the row's)
        return jax.vmap(lambda l, k, t, tk, tp: sample_tokens(l[None], k, t, tk, tp)[0])(
            logits_BV, keys(), temperature_B, top_k_B, top_p_B)

    return jax.lax.switch(way, (greedy, plain, cut))


def probabilities(logits_BV: jax.Array, temperature_B, top_k_B, top_p_B) -> jax.Array:
    """[B, V] float32: the distribution each row's token is drawn from by its settings (per row, [B] each): the
    softmax of the scaled logits that top-k and top-p keep, or at temperature 0 all the mass on the greedy
    token. Only what the rows' settings need runs (`branch`): the filters' bisections when a row filters.
    Call it on rows, not under vmap, where the branches would all run."""
    V = logits_BV.shape[-1]

    def greedy():
        return jax.nn.one_hot(greedy_tokens(logits_BV), V, dtype=jnp.float32)

    def plain():  # top-k and top-p off in every row: no filtering to compute
        hot = jax.nn.softmax(_scaled(logits_BV, temperature_B[:, None]), axis=-1)
        return jnp.where(temperature_B[:, None] > 0, hot, greedy())

    def one(l, t, tk, tp):
        hot = jax.nn.softmax(filtered(_scaled(l[None], t), tk, tp), axis=-1)[0]
        return jnp.where(t > 0, hot, jax.nn.one_hot(greedy_tokens(l), V, dtype=jnp.float32))

    return jax.lax.switch(branch(temperature_B, top_k_B, top_p_B, V), (
        greedy, plain, lambda: jax.vmap(one)(logits_BV, temperature_B, top_k_B, top_p_B)))


def keep_mask(logits_BV: jax.Array, top_k, top_p) -> jax.Array:
    """[B, V] True for the tokens top-k and then top-p keep (see the module docstring), found without a sort."""
    V = logits_BV.shape[-1]
    order_BV = _ordered_int(logits_BV)
    lo_B1, hi_B1 = jnp.min(order_BV, -1, keepdims=True), jnp.max(order_BV, -1, keepdims=True)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    # The k-th largest: the least t with fewer than k logits above it.
    kth_B1 = jax.lax.cond(k < V, lambda: _cutoff(lambda t: jnp.sum(order_BV > t, -1, keepdims=True) < k,
                                                lo_B1, hi_B1), lambda: lo_B1)
    weights_BV = jnp.where(order_BV >= kth_B1, jnp.exp(logits_BV - jnp.max(logits_BV, -1, keepdims=True)), 0)
    total_B1 = jnp.sum(weights_BV, -1, keepdims=True)
    # The least logit whose more likely tokens hold less than top_p of the probability: it is kept, and every
    # logit at least as large.
    cut_B1 = jax.lax.cond(top_p < 1, lambda: _cutoff(
        lambda t: jnp.sum(jnp.where(order_BV > t, weights_BV, 0), -1, keepdims=True) < top_p * total_B1,
        kth_B1, hi_B1), lambda: kth_B1)
    return order_BV >= cut_B1


def _ordered_int(x: jax.Array) -> jax.Array:
    """float32 -> int32 in the same order (negative floats' magnitude bits flipped), for exact bisection."""
    i = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return i ^ ((i >> 31) & 0x7FFFFFFF)


def _cutoff(holds: Callable, lo_B1: jax.Array, hi_B1: jax.Array) -> jax.Array:
    """The least int32 t in [lo, hi] per row at which holds(t) [B, 1] is true, for a `holds` that stays true
    above it (true at hi): 32 halvings find it exactly. It is a value of the row when holds changes only
    at the row's values."""
    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # (lo + hi) // 2 without overflow
        ok = holds(mid)
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    return jax.lax.fori_loop(0, 32, halve, (lo_B1, hi_B1))[1]


def token_logprobs(logits_BV: jax.Array, tok_B: jax.Array, K: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The log-probability of each row's token [B] and its K most likely alternatives (ids and log-probabilities
    [B, K], most likely first): the logits picked, less the row's log-sum-exp (the log-softmax of only those,
    not of the whole vocabulary). A vocabulary smaller than K pads the alternatives with id 0 at -inf."""
    max_B1 = jnp.max(logits_BV, axis=-1, keepdims=True)
    lse_B1 = max_B1 + jnp.log(jnp.sum(jnp.exp(logits_BV - max_B1), axis=-1, keepdims=True))
    top_BK, top_ids_BK = jax.lax.top_k(logits_BV, min(K, logits_BV.shape[-1]))
    if top_BK.shape[-1] < K:
        pad = ((0, 0), (0, K - top_BK.shape[-1]))
        top_BK, top_ids_BK = jnp.pad(top_BK, pad, constant_values=-jnp.inf), jnp.pad(top_ids_BK, pad)
    token_B = jnp.take_along_axis(logits_BV, tok_B[:, None], axis=-1)
    return (token_B - lse_B1)[:, 0], top_ids_BK, top_BK - lse_B1


def choice_keys(seed_B: jax.Array, choice_B: jax.Array) -> jax.Array:
    """Each row's key(seed) folded with its choice index (made once per call; row_keys folds in the token's)."""
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seed_B, choice_B)


def row_keys(choice_keys_B: jax.Array, count_B: jax.Array) -> jax.Array:
    """The keys of each row's count_B-th token."""
    return jax.vmap(jax.random.fold_in)(choice_keys_B, count_B)


def speculative_accept(p_BJV: jax.Array, q_BkV: jax.Array, draft_Bk: jax.Array, keys_B: jax.Array
                       ) -> tuple[jax.Array, jax.Array]:
    """The rejection rule of speculative decoding (Leviathan et al. 2023; Chen et al. 2023), row by row: draft
    token d_i, drawn from the draft's distribution q_i, is kept with probability min(1, p_i(d_i) / q_i(d_i)),
    p_i being the target's distribution at the same position (both as `probabilities` gives them, so the rows'
    temperature, top-k and top-p apply to both); at the first one refused, a token is drawn from the normalized
    max(p_i - q_i, 0) instead, and when all k are kept, from p_{k+1} (J = k + 1 target distributions). The
    tokens come out distributed as the target alone would draw them; at temperature 0 (one-hot p and q) they are
    the target's greedy tokens. Returns the tokens [B, k + 1] (the kept draft tokens, then the drawn one, then
    zeros) and how many draft tokens each row kept [B]."""
    B, k = draft_Bk.shape

    def row(p_JV, q_kV, d_k, key):
        key_u, key_t = jax.random.split(key)
        p_d = jnp.take_along_axis(p_JV[:k], d_k[:, None], axis=1)[:, 0]
        q_d = jnp.take_along_axis(q_kV, d_k[:, None], axis=1)[:, 0]
        kept_k = jax.random.uniform(key_u, (k,)) * q_d < p_d  # u < p/q, q(d) > 0 as d was drawn from q
        j = jnp.sum(jnp.cumprod(kept_k.astype(jnp.int32)))
        q_next = jnp.concatenate([q_kV, jnp.zeros_like(q_kV[:1])])[j]  # zeros after the last: p_{k+1} itself
        left_V = jnp.maximum(p_JV[j] - q_next, 0)
        left_V = jnp.where(jnp.sum(left_V) > 0, left_V, p_JV[j])  # p = q to the last bit: p
        t = jax.random.categorical(key_t, jnp.log(left_V)).astype(jnp.int32)
        i_J = jnp.arange(k + 1)
        out_J = jnp.where(i_J < j, jnp.concatenate([d_k, jnp.zeros((1,), d_k.dtype)]), 0)
        return jnp.where(i_J == j, t, out_J), j

    return jax.vmap(row)(p_BJV, q_BkV, draft_Bk, keys_B)


def kept_tokens(tokens_BJ: jax.Array, n_B: jax.Array, live_B: jax.Array, made_B: jax.Array, left_B: jax.Array,
                stop_BM: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The stop rule of every decode loop: of each live row's first n_B new tokens (tokens_BJ), the row keeps those
    up to and including its first stop token (stop_BM, padded with -1) and up to left_B tokens in all (made_B
    made before). Returns which tokens it keeps [B, J] and whether the row ended [B] (a stop token kept, or
    left_B reached)."""
    i_J = jnp.arange(tokens_BJ.shape[1])
    kept_BJ = (i_J < n_B[:, None]) & live_B[:, None]
    stop_BJ = jnp.any(tokens_BJ[..., None] == stop_BM[:, None, :], axis=-1) & kept_BJ
    kept_BJ &= jnp.cumsum(stop_BJ, axis=1) - stop_BJ < 1  # up to and including the first stop token
    kept_BJ &= made_B[:, None] + i_J < left_B[:, None]
    ended_B = jnp.any(stop_BJ & kept_BJ, axis=1) | (made_B + jnp.sum(kept_BJ, axis=1) >= left_B)
    return kept_BJ, ended_B


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class RowSampling:
    """Each row's sampling settings as a decode call takes them [b] (stop tokens [b, M], padded with -1): the
    tokens it may still send, its stop tokens, whether it wants log-probabilities, its seed, choice index and
    count of tokens so far (its random stream), temperature, top_k and top_p."""
    left_b: np.ndarray
    stop_bM: np.ndarray
    want_lp_b: np.ndarray
    seed_b: np.ndarray
    choice_b: np.ndarray
    count_b: np.ndarray
    temperature_b: np.ndarray
    top_k_b: np.ndarray
    top_p_b: np.ndarray

    def arrays(self) -> tuple:
        return tuple(getattr(self, f.name) for f in fields(self))


def sampled_steps(decode: Callable, state, logits_bV, steps, live_b, sampled: RowSampling, max_steps: int,
                  on_step: Callable | None = None, logprobs: bool = True):
    """The one decode loop (generate's, and the engine's over either cache): up to `steps` (<= max_steps) steps, each sampling every live row's next
    token (its count_b-th plus the step) and running `decode(tok_b, live_b, state) -> (logits_bV, state)`, which
    appends them to the cache; a row stops living after a token in its stop_bM (padded with -1) or its
    left_b-th token, and the loop ends early once no row lives. Returns tokens, log-probabilities (zeros unless
    a live row wants them) and top alternatives [N, b(, K)], which of them were produced [N, b], the logits, the
    state and which rows still live. `on_step(i, tok_b, live_b)`, where given, runs in each step (a host
    callback: generate's streaming); without `logprobs` (static) the log-probabilities are not computed (zeros)."""
    left_b, stop_bM, want_lp_b, seed_b, choice_b, count_b, temperature_b, top_k_b, top_p_b = sampled.arrays()
    b, V = logits_bV.shape
    way = branch(jnp.where(live_b, temperature_b, 0), top_k_b, top_p_b, V)
    N, K = max_steps, TOP_LOGPROBS
    out = (jnp.zeros((N, b), jnp.int32), jnp.zeros((N, b), jnp.float32), jnp.zeros((N, b, K), jnp.int32),
           jnp.zeros((N, b, K), jnp.float32), jnp.zeros((N, b), bool))
    choice_keys_b = choice_keys(seed_b, choice_b)

    def no_logprobs(logits_bV, tok_b):
        return jnp.zeros((b,), jnp.float32), jnp.zeros((b, K), jnp.int32), jnp.zeros((b, K), jnp.float32)

    def body(loop):
        i, state, logits_bV, live_b, out = loop
        tok_b = sample_rows(way, logits_bV, lambda: row_keys(choice_keys_b, count_b + i), temperature_b, top_k_b,
                            top_p_b)
        tok_b = jnp.where(live_b, tok_b, 0)
        if on_step is not None:
            on_step(i, tok_b, live_b)
        if logprobs:
            lp = jax.lax.cond(jnp.any(live_b & want_lp_b), partial(token_logprobs, K=K), no_logprobs, logits_bV,
                              tok_b)
            out = tuple(o.at[i].set(x) for o, x in zip(out, (tok_b, *lp, live_b)))
        else:
            out = (out[0].at[i].set(tok_b), *out[1:4], out[4].at[i].set(live_b))
        _, ended_b = kept_tokens(tok_b[:, None], jnp.ones_like(left_b), live_b, jnp.broadcast_to(i, (b,)), left_b,
                                 stop_bM)
        logits_bV, state = decode(tok_b, live_b, state)
        return i + 1, state, logits_bV, live_b & ~ended_b, out

    def more(loop):
        return (loop[0] < steps) & jnp.any(loop[3])

    _, state, logits_bV, live_b, out = jax.lax.while_loop(more, body, (jnp.int32(0), state, logits_bV, live_b, out))
    return out, logits_bV, state, live_b
