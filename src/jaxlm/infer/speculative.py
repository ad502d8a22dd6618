"""Speculative decoding, the one loop that `jaxlm generate` (`decode.draft=PATH` or `mtp`) and the server's engine
both run (decode_loop): a draft model with the same tokenizer (or the model's own multi-token prediction module)
proposes k tokens after each row's pending token, the target runs the k + 1 in one pass over its pages, and
sampling.speculative_accept keeps a prefix and draws one more, so that the tokens are distributed as the
target's own sampling draws them (greedy tokens identical). Both models keep paged caches with one page table;
positions past a row's kept tokens are written over later, never read. Rows advance by their own counts, each
with its own random stream (sampling.row_keys) and settings (sampling.RowSampling). docs/generate.md, serve.md.

Shape legend: B batch or slots, b rows of a call, T prompt length, V vocab, k draft tokens, J = k + 1, N new
tokens, L tokens a call returns per row at most (1 + steps * J), M stop tokens (padded with -1) or pages per row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm import runtime, sharding
from jaxlm.infer import generate, sampling
from jaxlm.infer.sampling import TOP_LOGPROBS, RowSampling
from jaxlm.config import ConfigError, DecodeConfig, ModelConfig, draft_tokens, validate_decode
from jaxlm.model import decode, layers, paged
from jaxlm.model.mtp import mtp_pool, mtp_weights, paged_mtp

PAGE = 16  # positions per page of the two caches


@dataclass
class Speculation(generate.Generation):
    proposed: int = 0  # draft tokens proposed to live sequences
    accepted: int = 0  # of them, kept
    passes: int = 0  # target forward passes (iterations of the loop)

    @property
    def acceptance(self) -> float:
        return self.accepted / max(self.proposed, 1)


@partial(jax.jit, static_argnames=("cfg", "draft_cfg", "pages", "fmt"))
def _prefill(params, draft_params, prompts_BT, lengths_B, cfg: ModelConfig, draft_cfg: ModelConfig, pages: int,
             fmt: paged.PoolFormat):
    """Both models' caches (pools of format `fmt`), each sequence's pages the b-th run of `pages`, holding the
    prompts; the target's logits after each prompt."""
    B, T = prompts_BT.shape
    table_BM = jnp.arange(B * pages, dtype=jnp.int32).reshape(B, pages)
    zeros_B = jnp.zeros((B,), jnp.int32)
    logits_BV, cache = decode.paged_forward(params, paged.init(cfg, B * pages, PAGE, fmt=fmt), prompts_BT,
                                            zeros_B, lengths_B, table_BM, cfg)
    _, draft_cache = decode.paged_forward(draft_params, paged.init(draft_cfg, B * pages, PAGE, fmt=fmt),
                                          prompts_BT, zeros_B, lengths_B, table_BM, draft_cfg)
    return logits_BV, cache, draft_cache


@partial(jax.jit, static_argnames=("cfg", "pages", "fmt"))
def _prefill_mtp(params, prompts_BT, lengths_B, cfg: ModelConfig, pages: int, fmt: paged.PoolFormat):
    """The model's cache and its multi-token prediction module's (mtp_pool, the same pages; both of format `fmt`)
    holding the prompts, the logits after each prompt, and the model's last hidden state there [B, D]. The
    module's entries are those of positions 0 .. length - 2 (the model's hidden state at t with token t + 1); the
    loop's first pass adds the last one's with the first sampled token."""
    B, T = prompts_BT.shape
    table_BM = jnp.arange(B * pages, dtype=jnp.int32).reshape(B, pages)
    zeros_B = jnp.zeros((B,), jnp.int32)
    logits_BV, h_BTD, cache = decode.paged_forward(params, paged.init(cfg, B * pages, PAGE, fmt=fmt),
                                                   prompts_BT, zeros_B, lengths_B, table_BM, cfg, hidden=True)
    _, _, draft_cache = paged_mtp(params, mtp_weights(params, cfg),
                                  mtp_pool(cfg, B * pages, PAGE, fmt), prompts_BT[:, 1:],
                                  h_BTD[:, :-1], zeros_B, lengths_B - 1, table_BM, cfg)
    last_BD = jnp.take_along_axis(h_BTD, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
    return logits_BV, cache, draft_cache, last_BD


def mtp_proposals(params, module_params, pool, next_BJ, hid_BJD, prev_B, length_B, live_B, limit_B, table_BM,
                  cfg: ModelConfig, k: int, draw: Callable):
    """k proposals of the model's first multi-token prediction module (module_params: mtp_weights)
    for rows holding length_B positions: the module runs over the positions of the last pass that the rows kept
    (from prev_B: the model's hidden states there hid_BJD, with the tokens after them next_BJ, the kept
    proposals and the pending token), whose last logits give the first proposal; each further one comes from
    the module's own hidden state and the proposal before it (positions at or past limit_B are not written).
    `draw(logits_BV, i)` -> (token_B, what the caller keeps of it). Returns the tokens, the kept values and the
    module's pool. `jaxlm generate`'s loop and the server's (serve/speculate.py) both draft with it."""
    logits_BV, g_BD, pool = paged_mtp(params, module_params, pool, next_BJ, hid_BJD, prev_B,
                                      jnp.where(live_B, length_B, 0), table_BM, cfg)
    drafted, kept = [], []
    for i in range(k):
        tok_B, x = draw(logits_BV, i)
        drafted.append(tok_B)
        kept.append(x)
        if i + 1 < k:
            at_B = length_B + i
            logits_BV, g_BD, pool = paged_mtp(params, module_params, pool, tok_B[:, None], g_BD[:, None],
                                              at_B, jnp.where(live_B & (at_B < limit_B), at_B + 1, 0),
                                              table_BM, cfg)
    return drafted, kept, pool


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
            drafted, q_logits, draft_cache = mtp_proposals(
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
    return *c["out"], c["cache"], c["draft_cache"], c["proposed"], c["kept"], c["i"], mtp


def check_draft(cfg: ModelConfig, draft_cfg: ModelConfig, length: int) -> None:
    """A draft must share the target's vocabulary, and both models must have `length` positions per sequence
    (learned position tables end at block_size); else one ConfigError line."""
    if draft_cfg.vocab_size != cfg.vocab_size:
        raise ConfigError(f"the draft model's vocabulary ({draft_cfg.vocab_size} tokens) is not the target's "
                          f"({cfg.vocab_size}); a draft must share the target's tokenizer")
    for c in (cfg, draft_cfg):
        if c.position == "learned" and length > c.block_size:
            raise ConfigError(f"speculative decoding needs {length} positions per sequence but a model has "
                              f"learned positions up to {c.block_size}")


def check_mtp(cfg: ModelConfig) -> None:
    """decode.draft=mtp needs a model with multi-token prediction modules; else one ConfigError line."""
    if not cfg.mtp_layers:
        raise ConfigError("decode.draft=mtp drafts with the model's multi-token prediction modules, and this model "
                          "has none (model.mtp_layers=0): give a draft model's directory instead")


def generate_speculative(params, cfg: ModelConfig, draft_params, draft_cfg: ModelConfig | None,
                         prompts: Sequence[Sequence[int]], d: DecodeConfig, stop_ids: Sequence[int] = (),
                         on_tokens: Callable[[np.ndarray, np.ndarray], None] | None = None) -> Speculation:
    """generate.generate with a draft model proposing config.draft_tokens tokens per pass of the target, through
    decode_loop (the server's loop: each row b samples from key(decode.seed) folded with b); draft_params and
    draft_cfg None: the model's own first multi-token prediction module drafts (decode.draft=mtp).
    `on_tokens(tokens, live)` is called on the host for each new token of every sequence, as generate calls it."""
    validate_decode(d)
    draft = Draft(draft_params, draft_cfg, draft_tokens(d, mtp=draft_cfg is None))
    generate.check_prompts(prompts, cfg, d)
    B, T, N = len(prompts), -(-max(map(len, prompts)) // generate.PAD) * generate.PAD, d.max_new_tokens
    length = T + N + draft.k + 1
    if draft.mtp:
        check_mtp(cfg)
    check_draft(cfg, cfg if draft.mtp else draft_cfg, length)
    prompts_BT, lengths_B = generate.padded_prompts(prompts, T)
    fmt = paged.pool_format(runtime.platform())  # the pools' format on the devices the call runs on
    pages = -(-length // PAGE)
    t0 = time.perf_counter()
    mtp = None
    if draft.mtp:
        logits_BV, cache, draft_cache, last_BD = jax.block_until_ready(
            _prefill_mtp(params, prompts_BT, lengths_B, cfg, pages, fmt))
        dt, J = jnp.dtype(cfg.compute_dtype), draft.k + 1
        mtp = {"hidden_BD": last_BD.astype(dt), "prev_B": jnp.zeros((B,), jnp.int32),
               "hid_BJD": jnp.zeros((B, J, cfg.d_model), dt), "next_BJ": jnp.zeros((B, J), jnp.int32)}
    else:
        logits_BV, cache, draft_cache = jax.block_until_ready(
            _prefill(params, draft_params, prompts_BT, lengths_B, cfg, draft_cfg, pages, fmt))
    t1 = time.perf_counter()
    rows = _Rows(lengths_B, N, d, stop_ids)
    layer_params = decode.layer_weights(params, cfg)
    draft_layer_params = mtp_weights(params, cfg) if draft.mtp else decode.layer_weights(draft_params, draft_cfg)
    table_BM = np.arange(B * pages, dtype=np.int32).reshape(B, pages)
    args = (params, layer_params, draft, draft_layer_params, cache, draft_cache, logits_BV, np.arange(B, dtype=np.int32),
            np.full((B,), -1, np.int32), np.int32(LOOP_STEPS if on_tokens is None else STREAM_STEPS),
            *rows.call(table_BM))
    loop = generate.compiled_once(_EXECUTABLES, (generate.signature((*args, mtp)), cfg),
                                  lambda: decode_loop.lower(*args, cfg=cfg, max_steps=LOOP_STEPS, mtp=mtp).compile())
    t2 = time.perf_counter()
    proposed = kept = passes = 0
    while not rows.done.all():
        *out, cache, draft_cache, p, k, i, mtp = loop(*args[:4], cache, draft_cache, *args[6:10],
                                                      *rows.call(table_BM), mtp=mtp)
        tokens_LB, sent_LB = jax.device_get((out[0], out[4]))
        rows.take(tokens_LB, sent_LB.sum(axis=0), on_tokens)
        proposed, kept, passes = proposed + int(p), kept + int(k), passes + int(i)
    t3 = time.perf_counter()
    return Speculation(rows.tokens, t2 - t1, t1 - t0, t3 - t2, proposed, kept, passes)


LOOP_STEPS = 16  # iterations of the loop per call at most (its output's size): between calls the host takes the
STREAM_STEPS = 4  # new tokens; fewer per call when they are streamed (the same program: steps is an argument)


class _Rows:
    """generate_speculative's rows between calls of the loop: tokens sent, pending token, cached length."""

    def __init__(self, lengths_B, N: int, d: DecodeConfig, stop_ids: Sequence[int]):
        B = len(lengths_B)
        self.lengths, self.N, self.stop = np.asarray(lengths_B, np.int32), N, set(int(t) for t in stop_ids)
        self.tokens: list[list[int]] = [[] for _ in range(B)]
        self.pending = np.full((B,), -1, np.int32)  # sent, not yet cached (-1: sample it from the logits)
        self.done = np.zeros((B,), bool)
        stop_BM = np.full((B, max(len(stop_ids), 1)), -1, np.int32)
        stop_BM[:, :len(stop_ids)] = list(stop_ids)
        full = lambda x, dtype: np.full((B,), x, dtype)  # noqa: E731
        self.fixed = dict(stop_bM=stop_BM, want_lp_b=full(False, bool), seed_b=full(d.seed % 2**32, np.uint32),
                          choice_b=np.arange(B, dtype=np.int32), temperature_b=full(d.temperature, np.float32),
                          top_k_b=full(d.top_k, np.int32), top_p_b=full(d.top_p, np.float32))

    def call(self, table_BM) -> tuple:
        """decode_loop's live_b, length_b, pending_b, limit_b, table_bM and sampled for the next call."""
        count = np.asarray([len(t) for t in self.tokens], np.int32)
        length = self.lengths + count - (self.pending >= 0)
        sampled = sampling.RowSampling(left_b=self.N - count, count_b=count, **self.fixed)
        return ~self.done, length, self.pending.copy(), self.lengths + self.N, table_BM, sampled

    def take(self, tokens_LB: np.ndarray, n_B: np.ndarray, on_tokens) -> None:
        """A call's tokens (each row's first n_B of tokens_LB), streamed to on_tokens in order."""
        for b, n in enumerate(n_B.tolist()):
            if n:
                new = tokens_LB[:n, b].tolist()
                self.tokens[b] += new
                self.pending[b] = new[-1]
                self.done[b] |= new[-1] in self.stop
            self.done[b] |= len(self.tokens[b]) >= self.N
        if on_tokens is not None:
            for j in range(int(n_B.max(initial=0))):
                on_tokens(np.where(j < n_B, tokens_LB[j], 0), j < n_B)


_EXECUTABLES: dict = {}  # the loop compiled per key of shapes, shardings and settings (generate.compiled_once)
