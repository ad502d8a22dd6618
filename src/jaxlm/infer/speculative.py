"""Speculative decoding for `jaxlm generate` (`decode.draft=PATH`, docs/generate.md): a small draft model with
the same tokenizer proposes decode.draft_tokens (k) tokens, the target scores them all in one forward pass, and
sampling.speculative_accept keeps a prefix and draws one more: 1 to k + 1 tokens per pass of the target,
distributed exactly as its own sampling (greedy tokens identical). Both models keep a paged cache (model/paged.py)
and run every cached step through decode.paged_forward with their layers unrolled. An iteration starts from each
sequence's pending token: the draft takes k + 1 steps, the target verifies the same k + 1 tokens at once; both
caches are then cut back to the kept tokens by the sequence's length (pages hold every position). Rows advance
by their own counts, the loop on device until every sequence has stopped.

Shape legend: B batch, T prompt length, V vocab, k draft tokens, J = k + 1, N new tokens, M pages per sequence.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm import runtime
from jaxlm.infer import generate, sampling
from jaxlm.config import ConfigError, DecodeConfig, ModelConfig, draft_tokens, validate_decode
from jaxlm.model import decode, paged
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


@partial(jax.jit, static_argnames=("cfg", "draft_cfg", "k", "max_new_tokens", "stream"))
def _loop(params, draft_params, logits_BV, cache, draft_cache, lengths_B, key, temperature, top_k, top_p, stop_S,
          last_BD, stream_id, cfg: ModelConfig, draft_cfg: ModelConfig | None, k: int, max_new_tokens: int,
          stream: bool):
    """Tokens [B, N] (0 after a sequence stopped), their counts [B], the draft tokens proposed to and kept by
    live sequences, and the passes of the target. draft_cfg None: the model's first multi-token prediction
    module drafts (draft_params unused; last_BD the model's hidden state after each prompt). With `stream` each
    pass's tokens go to the host callback of stream_id (generate.streaming)."""
    B, N = logits_BV.shape[0], max_new_tokens
    J = k + 1
    mtp = draft_cfg is None
    settings_B = [jnp.broadcast_to(x, (B,)) for x in (temperature, top_k, top_p)]
    table_BM = jnp.arange(cache.pages, dtype=jnp.int32).reshape(B, -1)
    layers = decode.layer_weights(params, cfg)
    draft_layers = mtp_weights(params, cfg) if mtp else decode.layer_weights(draft_params, draft_cfg)

    def draw(logits_BV, key, i):
        q_BV = sampling.probabilities(logits_BV, *settings_B)
        return jax.random.categorical(jax.random.fold_in(key, i), jnp.log(q_BV)).astype(jnp.int32), q_BV

    def draft_model(c, live_B, length_B, key_draft):
        """The pending token, then the draft's own k proposals, each from its distribution q."""
        tok_B, draft_cache, drafted, qs = c["pending_B"], c["draft_cache"], [], []
        for i in range(J):
            draft_logits_BV, draft_cache = decode.paged_forward(
                draft_params, draft_cache, tok_B[:, None], length_B + i, jnp.where(live_B, length_B + i + 1, 0),
                table_BM, draft_cfg, draft_layers)
            if i < k:
                tok_B, q_BV = draw(draft_logits_BV, key_draft, i)
                drafted.append(tok_B)
                qs.append(q_BV)
        return drafted, qs, {"draft_cache": draft_cache}

    def draft_mtp(c, live_B, length_B, key_draft):
        drafted, qs, draft_cache = mtp_proposals(
            params, draft_layers, c["draft_cache"], c["next_BJ"], c["hid_BJD"], c["prev_B"], length_B, live_B,
            length_B + J, table_BM, cfg, k, lambda logits_BV, i: draw(logits_BV, key_draft, i))
        return drafted, qs, {"draft_cache": draft_cache}

    def emit(c, tokens_BJ, n_B):
        """Append each row's first n_B tokens, cut after a stop token and at N; returns the state."""
        live_BJ, ended_B = sampling.kept_tokens(tokens_BJ, n_B, ~c["done_B"], c["count_B"], jnp.full((B,), N),
                                                jnp.broadcast_to(stop_S, (B, stop_S.shape[0])))
        at_BJ = jnp.where(live_BJ, c["count_B"][:, None] + jnp.arange(J), N)
        out_BN = c["out_BN"].at[jnp.arange(B)[:, None], at_BJ].set(tokens_BJ, mode="drop")
        count_B = c["count_B"] + jnp.sum(live_BJ, axis=1)
        done_B = c["done_B"] | ended_B
        if stream:
            jax.debug.callback(generate.emit, stream_id, c["i"], tokens_BJ, jnp.sum(live_BJ, axis=1))
        return {**c, "out_BN": out_BN, "count_B": count_B, "done_B": done_B, "i": c["i"] + 1}

    def body(c):
        key, key_draft, key_accept = jax.random.split(c["key"], 3)
        live_B = ~c["done_B"]
        length_B = jnp.where(live_B, c["length_B"], 0)  # a sequence that has stopped writes and reads nothing
        drafted, qs, drafts = (draft_mtp if mtp else draft_model)(c, live_B, length_B, key_draft)
        d_Bk = jnp.stack(drafted, axis=1)
        # the target: the same k + 1 tokens in one pass, a distribution p after each
        chunk_BJ = jnp.concatenate([c["pending_B"][:, None], d_Bk], axis=1)
        logits_BJV, h_BJD, cache = decode.paged_forward(params, c["cache"], chunk_BJ, length_B,
                                                        jnp.where(live_B, length_B + J, 0), table_BM, cfg,
                                                        layers, all_logits=True, hidden=True)
        p_BJV = sampling.probabilities(logits_BJV.reshape(B * J, -1), *(jnp.repeat(x, J) for x in settings_B)
                                       ).reshape(logits_BJV.shape)
        tokens_BJ, kept_B = sampling.speculative_accept(p_BJV, jnp.stack(qs, axis=1), d_Bk,
                                                        jax.random.split(key_accept, B))
        if mtp:  # the module's next pass starts after this one's first position (its hidden states, new tokens)
            drafts.update(prev_B=jnp.where(live_B, length_B, c["prev_B"]),
                          hid_BJD=jnp.where(live_B[:, None, None], h_BJD.astype(c["hid_BJD"].dtype), c["hid_BJD"]),
                          next_BJ=jnp.where(live_B[:, None], tokens_BJ, c["next_BJ"]))
        c = emit({**c, "key": key, **drafts}, tokens_BJ, kept_B + 1)
        # both caches keep the pending token and the kept drafts; the drawn token is the next pending one
        return {**c, "pending_B": jnp.take_along_axis(tokens_BJ, kept_B[:, None], axis=1)[:, 0], "cache": cache,
                "length_B": jnp.where(live_B, c["length_B"] + kept_B + 1, c["length_B"]),
                "proposed": c["proposed"] + k * jnp.sum(live_B), "kept": c["kept"] + jnp.sum(kept_B * live_B)}

    key, first = jax.random.split(key)
    pending_B = sampling.sample_tokens(logits_BV, first, temperature, top_k, top_p)
    c = {"i": jnp.int32(0), "key": key, "cache": cache, "draft_cache": draft_cache, "pending_B": pending_B,
         "length_B": lengths_B,
         "out_BN": jnp.zeros((B, N), jnp.int32), "count_B": jnp.zeros((B,), jnp.int32),
         "done_B": jnp.zeros((B,), bool), "proposed": jnp.int32(0), "kept": jnp.int32(0)}
    if mtp:  # the module's first pass: the first sampled token at the position after each prompt
        c.update(prev_B=lengths_B - 1, hid_BJD=jnp.zeros((B, J, last_BD.shape[-1]), last_BD.dtype).at[:, 0].set(
            last_BD), next_BJ=jnp.zeros((B, J), jnp.int32).at[:, 0].set(pending_B))
    c = emit(c, jnp.concatenate([pending_B[:, None], jnp.zeros((B, k), jnp.int32)], axis=1), jnp.ones((B,), jnp.int32))
    c = jax.lax.while_loop(lambda c: ~jnp.all(c["done_B"]), body, c)
    return c["out_BN"], c["count_B"], c["proposed"], c["kept"], c["i"] - 1


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
    """generate.generate with a draft model proposing config.draft_tokens tokens per pass of the target (see the
    module docstring); draft_params and draft_cfg None: the model's own first multi-token prediction module
    drafts (decode.draft=mtp). `on_tokens(tokens, live)` is called on the host for each new token of every
    sequence, as generate calls it."""
    validate_decode(d)
    k = draft_tokens(d, mtp=draft_cfg is None)
    generate.check_prompts(prompts, cfg, d)
    B, T = len(prompts), -(-max(map(len, prompts)) // generate.PAD) * generate.PAD
    length = T + d.max_new_tokens + k + 1
    if draft_cfg is None:
        check_mtp(cfg)
    check_draft(cfg, cfg if draft_cfg is None else draft_cfg, length)
    prompts_BT, lengths_B = generate.padded_prompts(prompts, T)
    settings, stop_S, key = generate.sampling_inputs(d, stop_ids)
    fmt = paged.pool_format(runtime.platform())  # the pools' format on the devices the call runs on
    t0 = time.perf_counter()
    if draft_cfg is None:
        logits_BV, cache, draft_cache, last_BD = jax.block_until_ready(
            _prefill_mtp(params, prompts_BT, lengths_B, cfg, -(-length // PAGE), fmt))
    else:
        logits_BV, cache, draft_cache = jax.block_until_ready(
            _prefill(params, draft_params, prompts_BT, lengths_B, cfg, draft_cfg, -(-length // PAGE), fmt))
        last_BD = jnp.zeros((B, 1), jnp.float32)
    t1 = time.perf_counter()
    stream = on_tokens is not None
    streamed = contextlib.nullcontext(np.int32(0))
    if stream:
        lock, state = threading.Lock(), {"next": 0, "held": {}}

        def in_order(i, tokens_BJ, count_B):  # the callback is unordered: passes wait for the ones before
            with lock:
                state["held"][int(i)] = (np.asarray(tokens_BJ), np.asarray(count_B))
                while state["next"] in state["held"]:
                    toks, n = state["held"].pop(state["next"])
                    for j in range(int(n.max(initial=0))):
                        on_tokens(toks[:, j], j < n)
                    state["next"] += 1

        streamed = generate.streaming(in_order)
    args = (params, draft_params, logits_BV, cache, draft_cache, lengths_B, key, *settings, stop_S, last_BD)
    static = (cfg, draft_cfg, k, d.max_new_tokens, stream)
    loop = generate.compiled_once(_EXECUTABLES, (generate.signature(args), static),
                                  lambda: _loop.lower(*args, np.int32(0), *static).compile())
    t2 = time.perf_counter()
    with streamed as stream_id:
        out = jax.block_until_ready(loop(*args, stream_id))
        jax.effects_barrier()
    t3 = time.perf_counter()
    out_BN, count_B, proposed, kept, passes = (np.asarray(x) for x in out)
    return Speculation([out_BN[b, :count_B[b]].tolist() for b in range(B)], t2 - t1, t1 - t0, t3 - t2,
                       int(proposed), int(kept), int(passes))


_EXECUTABLES: dict = {}  # the loop compiled per key of shapes, shardings and settings (generate.compiled_once)
