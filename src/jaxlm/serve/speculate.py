"""Speculative decoding in the server's engine (`jaxlm serve MODEL decode.draft=PATH`, the setting `jaxlm generate`
takes): the decode program that engine.py runs instead of its one-token steps when a draft is set, and the draft's
prefill. The draft keeps a paged cache of its own with the target's pages (one page table serves both), and each
row carries a pending token, sent but not yet cached: each iteration the draft proposes k tokens after it, the
target runs the k + 1 in one pass, and sampling.speculative_accept keeps a prefix and draws one more, so that the
tokens are distributed as the target's sampling alone draws them (docs/serve.md, "Speculative decoding").

Shape legend: B slots, b rows of a call, V vocab, k draft tokens, J = k + 1, L tokens a call returns per row at
most (1 + steps * J), M stop tokens per row (padded with -1) or pages per row, K top log-probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from jaxlm import sharding
from jaxlm.infer import sampling, speculative
from jaxlm.config import ModelConfig
from jaxlm.model import decode, layers
from jaxlm.model.mtp import paged_mtp
from jaxlm.serve.requests import TOP_LOGPROBS, RowSampling


@partial(jax.tree_util.register_dataclass, data_fields=["params"], meta_fields=["cfg", "k"])
@dataclass(frozen=True)
class Draft:
    """The draft model's pieces: its params and ModelConfig (both None: the model's first multi-token prediction
    module drafts, decode.draft=mtp) and the tokens it proposes per pass. A pytree: the params are arrays, the
    config and k are static."""
    params: Any
    cfg: ModelConfig | None
    k: int

    @property
    def mtp(self) -> bool:
        return self.cfg is None


def tokens_per_call(k: int, steps: int) -> int:
    """The most tokens a row sends in one call of `steps` iterations."""
    return 1 + steps * (k + 1)


def _flat(x_bJ):  # [b, J, ...] -> [b * J, ...]
    return x_bJ.reshape(-1, *x_bJ.shape[2:])


def _send(c: dict, tokens_bJ, n_b, logits_bJV, stop_bM, left_b, want_lp_b) -> dict:
    """The loop state `c` with each live row's first n_b tokens (logits_bJV: the target's logits each was drawn
    from) appended to the row's output, cut after a stop token and at left_b tokens in all; rows that stop or
    reach left_b are no longer live."""
    b, n = tokens_bJ.shape
    L, K = c["out"][0].shape[0], TOP_LOGPROBS
    i_J = jnp.arange(n)
    sent_bJ, ended_b = sampling.kept_tokens(tokens_bJ, n_b, c["live_b"], c["made_b"], left_b, stop_bM)
    at_bJ = jnp.where(sent_bJ, c["made_b"][:, None] + i_J, L)  # past the output: dropped

    def logprobs(logits_bJV, tokens_bJ):
        return jax.vmap(partial(sampling.token_logprobs, K=K), in_axes=1, out_axes=1)(logits_bJV, tokens_bJ)

    def no_logprobs(logits_bJV, tokens_bJ):
        return jnp.zeros((b, n), jnp.float32), jnp.zeros((b, n, K), jnp.int32), jnp.zeros((b, n, K), jnp.float32)

    lp = jax.lax.cond(jnp.any(sent_bJ & want_lp_b[:, None]), logprobs, no_logprobs, logits_bJV, tokens_bJ)
    rows_b1 = jnp.arange(b)[:, None]
    out = tuple(o.at[at_bJ, rows_b1].set(x, mode="drop") for o, x in zip(c["out"], (tokens_bJ, *lp, sent_bJ)))
    made_b = c["made_b"] + jnp.sum(sent_bJ, axis=1)
    return {**c, "out": out, "made_b": made_b, "live_b": c["live_b"] & ~ended_b}


def _draft_proposals(draft_params, draft_layer_params, draft_cache, pending_b, length_b, live_b, limit_b, table_bM,
                     draft_cfg: ModelConfig, k: int, draw):
    """A draft model's k proposals per row: it runs the pending token, then each proposal drawn from its
    logits by `draw(logits_bV, i)`, and once more to cache the k-th (positions at or past limit_b are not
    written). Returns the proposals [b, k], the draft's logits they were drawn from (a list of k [b, V]) and its
    cache."""
    tok_b, drafted, q_logits = pending_b, [], []
    for i in range(k + 1):
        at_b = length_b + i
        logits_i_bV, draft_cache = decode.paged_forward(
            draft_params, draft_cache, tok_b[:, None], at_b, jnp.where(live_b & (at_b < limit_b), at_b + 1, 0),
            table_bM, draft_cfg, draft_layer_params)
        if i < k:
            tok_b = draw(logits_i_bV, i)
            drafted.append(tok_b)
            q_logits.append(logits_i_bV)
    return jnp.stack(drafted, axis=1), q_logits, draft_cache


def _verify(way, logits_bJV, q_logits: list, d_bk, keys_b, settings):
    """The target's verdict on proposals d_bk [b, k] given its logits after the pending token and each proposal
    [b, J, V] and the draft's logits they were drawn from (q_logits): the tokens [b, J] (the kept proposals, then
    one drawn from the target's residual distribution, or its own after all k) and how many proposals each row
    keeps [b]. Greedy rows (way GREEDY) keep the proposals equal to the target's greedy tokens."""
    b, J, V = logits_bJV.shape
    k = J - 1

    def greedy():  # one-hot p and q: the rule keeps the proposals equal to the model's greedy tokens
        g_bJ = sampling.greedy_tokens(_flat(logits_bJV)).reshape(b, J)
        kept_b = jnp.sum(jnp.cumprod((d_bk == g_bJ[:, :k]).astype(jnp.int32), axis=1), axis=1)
        return jnp.where(jnp.arange(J) <= kept_b[:, None], g_bJ, 0), kept_b

    def sampled():
        def dist(logits_bnV):
            n = logits_bnV.shape[1]
            return sampling.probabilities(_flat(logits_bnV), *(jnp.repeat(x, n) for x in settings)).reshape(b, n, V)

        keys = jax.vmap(lambda key: jax.random.fold_in(key, 0))(keys_b)
        return sampling.speculative_accept(dist(logits_bJV), dist(jnp.stack(q_logits, axis=1)), d_bk, keys)

    return jax.lax.cond(way == sampling.GREEDY, greedy, sampled)


@partial(jax.jit, static_argnames=("cfg", "max_steps", "layout"), donate_argnames=("cache", "draft_cache", "mtp"))
def decode_loop(params, layer_params, draft: Draft, draft_layer_params, cache, draft_cache, logits_BV, rows_b,
                adapter_b, steps, live_b, length_b, pending_b, limit_b, table_bM, sampled: RowSampling,
                cfg: ModelConfig, max_steps: int, mtp: dict | None = None, layout: sharding.Layout | None = None):
    """Up to `steps` (<= max_steps) iterations of speculative decoding over rows rows_b (see the module
    docstring): length_b positions cached per row, pending_b its pending token (-1: sample it from the row's
    logits in logits_BV), limit_b the positions it may use, `sampled` its sampling settings (left_b the tokens it
    may still send, count_b those it has sent). Returns tokens, log-probabilities, alternatives [L, b(, K)] and
    which were sent [L, b] (each row's first ones, in order), the two caches, the draft tokens proposed to live
    rows and kept by them, and `mtp`.

    draft.cfg None: the model's first multi-token prediction module drafts (draft_layer_params its mtp_weights,
    draft_cache its pool, draft.params unused), and `mtp` holds every slot's state between calls (see
    prefill_mtp): the model's hidden state after the prompt (hidden_BD, for a row that starts from its logits),
    and, for the rows that have decoded, the first position of the last pass (prev_B), the model's hidden states
    from there [B, J, D] and the tokens after them [B, J] (the module's next pass starts with them, as
    speculative.py's loop does). `layout`: the engine's mesh and rules (programs.py)."""
    draft_params, draft_cfg, k = draft.params, draft.cfg, draft.k
    left_b, stop_bM, want_lp_b, seed_b, choice_b, count_b, temperature_b, top_k_b, top_p_b = sampled.arrays()
    base = layers.with_rows(params, jnp.full_like(adapter_b, -1))  # the module's embedding and head: no adapter
    params, layer_params = layers.with_rows((params, layer_params), adapter_b)
    b, K, J, V = rows_b.shape[0], TOP_LOGPROBS, k + 1, logits_BV.shape[-1]
    L = tokens_per_call(k, max_steps)
    settings = (temperature_b, top_k_b, top_p_b)
    choice_keys_b = sampling.choice_keys(seed_b, choice_b)
    logits_bV = jnp.take(logits_BV, rows_b, axis=0)
    send = partial(_send, stop_bM=stop_bM, left_b=left_b, want_lp_b=want_lp_b)

    def body(c):
        live_b, length_b, pending_b = c["live_b"], c["length_b"], c["pending_b"]
        keys_b = sampling.row_keys(choice_keys_b, count_b + c["made_b"])
        way = sampling.branch(jnp.where(live_b, temperature_b, 0), top_k_b, top_p_b, V)

        def draw(logits_bV, i):  # a proposal from the draft's distribution q under the row's settings
            return sampling.sample_rows(way, logits_bV,
                                        lambda: jax.vmap(lambda key: jax.random.fold_in(key, i + 1))(keys_b),
                                        *settings)

        if draft_cfg is None:  # the module: the last pass's kept positions, then its own proposals one by one
            drafted, q_logits, draft_cache = speculative.mtp_proposals(
                base, draft_layer_params, c["draft_cache"], c["next_bJ"], c["hid_bJD"], c["prev_b"], length_b,
                live_b, limit_b, table_bM, cfg, k, lambda logits_bV, i: (draw(logits_bV, i), logits_bV))
            d_bk = jnp.stack(drafted, axis=1)
        else:
            d_bk, q_logits, draft_cache = _draft_proposals(draft_params, draft_layer_params, c["draft_cache"],
                                                           pending_b, length_b, live_b, limit_b, table_bM,
                                                           draft_cfg, k, draw)
        # the target: the same k + 1 tokens in one pass, its distribution p after each
        chunk_bJ = jnp.concatenate([pending_b[:, None], d_bk], axis=1)
        logits_bJV, h_bJD, cache = decode.paged_forward(
            params, c["cache"], chunk_bJ, length_b, jnp.where(live_b, jnp.minimum(length_b + J, limit_b), 0),
            table_bM, cfg, layer_params, all_logits=True, hidden=True)
        tokens_bJ, kept_b = _verify(way, logits_bJV, q_logits, d_bk, keys_b, settings)
        if draft_cfg is None:  # the module's next pass starts at this one's first position
            c = {**c, "prev_b": jnp.where(live_b, length_b, c["prev_b"]),
                 "hid_bJD": jnp.where(live_b[:, None, None], h_bJD.astype(c["hid_bJD"].dtype), c["hid_bJD"]),
                 "next_bJ": jnp.where(live_b[:, None], tokens_bJ, c["next_bJ"])}
        c = send({**c, "cache": cache, "draft_cache": draft_cache}, tokens_bJ, kept_b + 1, logits_bJV)
        return {**c, "i": c["i"] + 1, "length_b": jnp.where(live_b, length_b + kept_b + 1, length_b),
                "pending_b": jnp.take_along_axis(tokens_bJ, kept_b[:, None], axis=1)[:, 0],
                "proposed": c["proposed"] + k * jnp.sum(live_b), "kept": c["kept"] + jnp.sum(kept_b * live_b)}

    with sharding.within(layout):
        out = (jnp.zeros((L, b), jnp.int32), jnp.zeros((L, b), jnp.float32), jnp.zeros((L, b, K), jnp.int32),
               jnp.zeros((L, b, K), jnp.float32), jnp.zeros((L, b), bool))
        c = {"i": jnp.int32(0), "live_b": live_b, "made_b": jnp.zeros((b,), jnp.int32), "length_b": length_b,
             "cache": cache, "draft_cache": draft_cache, "out": out, "proposed": jnp.int32(0), "kept": jnp.int32(0)}
        # rows just prefilled: their first token from their logits, as the one-token step samples it
        fresh_b = live_b & (pending_b < 0)
        way = sampling.branch(jnp.where(fresh_b, temperature_b, 0), top_k_b, top_p_b, V)
        first_b = sampling.sample_rows(way, logits_bV, lambda: sampling.row_keys(choice_keys_b, count_b), *settings)
        c = send(c, first_b[:, None], fresh_b.astype(jnp.int32), logits_bV[:, None])
        c["pending_b"] = jnp.where(fresh_b, first_b, pending_b)
        if draft_cfg is None:  # a fresh row's module pass: the last prompt position, with the first token after it
            hid_bJD, next_bJ = jnp.take(mtp["hid_BJD"], rows_b, axis=0), jnp.take(mtp["next_BJ"], rows_b, axis=0)
            c.update(prev_b=jnp.where(fresh_b, length_b - 1, jnp.take(mtp["prev_B"], rows_b)),
                     hid_bJD=jnp.where(fresh_b[:, None, None], hid_bJD.at[:, 0].set(
                         jnp.take(mtp["hidden_BD"], rows_b, axis=0)), hid_bJD),
                     next_bJ=jnp.where(fresh_b[:, None], next_bJ.at[:, 0].set(first_b), next_bJ))
        c = jax.lax.while_loop(lambda c: (c["i"] < steps) & jnp.any(c["live_b"]), body, c)
    if draft_cfg is None:
        mtp = {**mtp, "prev_B": mtp["prev_B"].at[rows_b].set(c["prev_b"]),
               "hid_BJD": mtp["hid_BJD"].at[rows_b].set(c["hid_bJD"]),
               "next_BJ": mtp["next_BJ"].at[rows_b].set(c["next_bJ"])}
    return *c["out"], c["cache"], c["draft_cache"], c["proposed"], c["kept"], mtp


@partial(jax.jit, static_argnames=("cfg", "layout"), donate_argnames=("cache", "draft_cache", "logits_BV", "mtp"))
def prefill_mtp(params, layer_params, mtp_weights, cache, draft_cache, logits_BV, mtp, tokens_PC, next_PC, start_P,
                length_P, table_PM, slot_P, adapter_P, cfg: ModelConfig, layout: sharding.Layout | None = None):
    """programs.paged_prefill for a model whose first multi-token prediction module drafts: the model's pass
    over prompts' chunks (its logits and hidden state after each row's last real token into logits_BV and
    mtp["hidden_BD"] at the row's slot), then the module's entries of the chunk's positions that have a token
    after them in the prompt (next_PC: the chunk's tokens shifted by one; the prompt's last position waits for
    the first sampled token, in decode_loop). The module serves no adapter."""
    base = layers.with_rows(params, jnp.full_like(adapter_P, -1))
    params, layer_params = layers.with_rows((params, layer_params), adapter_P)
    with sharding.within(layout):
        logits_PV, h_PCD, cache = decode.paged_forward(params, cache, tokens_PC, start_P, length_P, table_PM,
                                                       cfg, layer_params, hidden=True)
        _, _, draft_cache = paged_mtp(base, mtp_weights, draft_cache, next_PC, h_PCD, start_P,
                                      jnp.maximum(length_P - 1, 0), table_PM, cfg)
    end_P = jnp.clip(length_P, start_P, start_P + tokens_PC.shape[1])
    last_PD = jnp.take_along_axis(h_PCD, jnp.maximum(end_P - 1 - start_P, 0)[:, None, None], axis=1)[:, 0]
    mtp = {**mtp, "hidden_BD": mtp["hidden_BD"].at[slot_P].set(last_PD.astype(mtp["hidden_BD"].dtype), mode="drop")}
    return cache, draft_cache, logits_BV.at[slot_P].set(logits_PV, mode="drop"), mtp


@partial(jax.jit, static_argnames=("cfg", "layout"), donate_argnames="cache")
def prefill(params, layer_params, cache, tokens_PC, start_P, length_P, table_PM, cfg: ModelConfig,
            layout: sharding.Layout | None = None):
    """The draft's cache entries of prompts' chunks (programs.paged_prefill's, without the logits; its layers
    unrolled over `layer_params` when given)."""
    with sharding.within(layout):
        return decode.paged_forward(params, cache, tokens_PC, start_P, length_P, table_PM, cfg, layer_params)[1]
