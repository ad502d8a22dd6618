"""The continuous-batching engine: a fixed number of decode slots sharing one KV cache on device.

One thread owns the device. Each turn it admits waiting requests into free slots (a prompt is prefilled alone
at a padded length, then its cache rows and last logits are copied into the slot), then runs one decode step
over every slot: each busy row samples its next token from its own logits with its own settings and random
stream, the step appends those tokens to the cache, and the tokens go back to their requests. A sequence that
ends (stop token, max_tokens, cancel) frees its slot before the next turn. The decode step has the same shapes
whatever the slots hold, so it compiles once per slot count; prefill compiles once per padded prompt length
(powers of two from 16). Scoring a prompt (the log-probability of each of its tokens, for `echo` with
`logprobs`) runs the uncached forward pass on the same thread.

A row's random stream is key(seed) folded with its choice index and then with its token index, and every row
samples from its own logits, so a request's tokens do not depend on what the other slots hold.

Shape legend: B slots, T padded prompt length, S cache slots per sequence, V vocab, K top log-probabilities.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm import generate, sharding
from jaxlm.config import ModelConfig
from jaxlm.model import forward, kvcache, transformer

TOP_LOGPROBS = 5  # the most alternatives a request may ask for, as the OpenAI completions API allows
MIN_BUCKET = 16


class QueueFull(Exception):
    """The waiting queue holds serve.max_queue requests already."""


def bucket(n: int, limit: int) -> int:
    """Padded prompt length: the next power of two from MIN_BUCKET, at most `limit`."""
    b = MIN_BUCKET
    while b < n:
        b *= 2
    return min(b, max(limit, n))


@dataclass
class Sequence:
    """One generated sequence (one choice of a request). The engine calls `emit(event)` from its thread with
    ("token", id, logprob, [(id, logprob), ...]) for every token, then ("done", reason) once, reason being
    "stop" (a stop token), "length" (max_tokens) or "cancelled"."""
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    choice: int
    stop_ids: tuple[int, ...]
    emit: Callable[[tuple], None]
    cancelled: bool = False
    slot: int = -1
    generated: int = 0
    submitted: float = field(default_factory=time.perf_counter)


@dataclass
class Score:
    """The log-probability of each prompt token after the ones before it (the first has none), with the
    TOP_LOGPROBS most likely alternatives; `emit(("score", token_lp, top_ids, top_lp))` or ("error", text)."""
    prompt: list[int]
    emit: Callable[[tuple], None]
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)


def _row_keys(seed_B, choice_B, count_B):
    return jax.vmap(lambda s, c, n: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), c), n))(
        seed_B, choice_B, count_B)


def _logprobs(logits_BV, tok_B):
    lp_BV = jax.nn.log_softmax(logits_BV, axis=-1)
    top_lp_BK, top_ids_BK = jax.lax.top_k(lp_BV, TOP_LOGPROBS)
    return jnp.take_along_axis(lp_BV, tok_B[:, None], axis=-1)[:, 0], top_ids_BK, top_lp_BK


@partial(jax.jit, static_argnames="cfg", donate_argnames=("cache", "logits_BV"))
def _step(params, cache, logits_BV, busy_B, seed_B, choice_B, count_B, temperature_B, top_k_B, top_p_B,
          cfg: ModelConfig):
    """Sample each busy row's next token from its logits, then append the tokens to the cache."""
    V = logits_BV.shape[-1]
    keys_B = _row_keys(seed_B, choice_B, count_B)
    hot_B = busy_B & (temperature_B > 0)
    filtered_B = hot_B & (((top_k_B > 0) & (top_k_B < V)) | (top_p_B < 1))

    def greedy():
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)

    def plain():  # sample_tokens' draw without top-k/top-p, row by row
        drawn_B = jax.vmap(lambda l, k, t: jax.random.categorical(k, l / jnp.maximum(t, jnp.finfo(jnp.float32).tiny)))(
            logits_BV, keys_B, temperature_B).astype(jnp.int32)
        return jnp.where(temperature_B > 0, drawn_B, greedy())

    def filtered():  # every row through sample_tokens (vmapped, it computes each branch and selects the row's)
        return jax.vmap(lambda l, k, t, tk, tp: generate.sample_tokens(l[None], k, t, tk, tp)[0])(
            logits_BV, keys_B, temperature_B, top_k_B, top_p_B)

    # The batch pays for the sort of top-k/top-p only when a row asks for them; a row's token is the same on
    # every branch that can serve it, so it does not depend on the other rows.
    tok_B = jax.lax.switch(jnp.where(jnp.any(filtered_B), 2, jnp.where(jnp.any(hot_B), 1, 0)),
                           (greedy, plain, filtered))
    tok_B = jnp.where(busy_B, tok_B, 0)
    lp_B, top_ids_BK, top_lp_BK = _logprobs(logits_BV, tok_B)
    # Idle rows decode a dummy token at position 0: their cache is replaced whole when a request takes the slot.
    cache = kvcache.KVCache(cache.kinds, jnp.where(busy_B, cache.length, 0))
    logits_BV, cache = transformer.decode_step(params, tok_B, cache, cfg)
    return tok_B, lp_B, top_ids_BK, top_lp_BK, logits_BV, cache


@partial(jax.jit, donate_argnames=("cache", "logits_BV"))
def _insert(cache, logits_BV, one, one_logits_1V, slot):
    """Copy a prefilled sequence (batch 1) into row `slot` of the slot cache and logits."""
    def put(x, x1, axis):
        return jax.lax.dynamic_update_slice_in_dim(x, x1.astype(x.dtype), slot, axis)

    kinds = tuple(kvcache.KindCache(put(c.k, c1.k, 1), put(c.v, c1.v, 1),
                                    None if c.k_scale is None else put(c.k_scale, c1.k_scale, 1),
                                    None if c.v_scale is None else put(c.v_scale, c1.v_scale, 1),
                                    put(c.pos, c1.pos, 0))
                  for c, c1 in zip(cache.kinds, one.kinds))
    return kvcache.KVCache(kinds, put(cache.length, one.length, 0)), put(logits_BV, one_logits_1V, 0)


@partial(jax.jit, static_argnames=("cfg", "slots", "length", "quantize"))
def _empty(cfg: ModelConfig, slots: int, length: int, quantize: bool):
    cache = kvcache.init(cfg, slots, length, quantize)
    kinds = tuple(kvcache.KindCache(*(None if a is None else sharding.constrain(a, (None,) + kvcache.CACHE_AXES[
        :a.ndim - 1]) for a in (c.k, c.v, c.k_scale, c.v_scale)), c.pos) for c in cache.kinds)
    return kvcache.KVCache(kinds, cache.length), jnp.zeros((slots, cfg.vocab_size), jnp.float32)


@partial(jax.jit, static_argnames="cfg")
def _score(params, tokens_1T, cfg: ModelConfig):
    lp_TV = jax.nn.log_softmax(forward(params, tokens_1T, cfg)[0], axis=-1)
    top_lp_TK, top_ids_TK = jax.lax.top_k(lp_TV, TOP_LOGPROBS)
    token_lp_T = jnp.take_along_axis(lp_TV[:-1], tokens_1T[0, 1:, None], axis=-1)[:, 0]
    return token_lp_T, top_ids_TK, top_lp_TK


class Engine:
    """`submit(seq)` queues a sequence (raises QueueFull past max_queue waiting), `cancel(seq)` ends it; the
    engine thread runs from `start()` to `stop()`. `stats()` reads the counters /metrics shows."""

    def __init__(self, params, cfg: ModelConfig, slots: int, cache_length: int, max_queue: int,
                 quantize_kv_cache: bool = False, mesh: jax.sharding.Mesh | None = None):
        self.params, self.cfg, self.B, self.S = params, cfg, slots, cache_length
        self.max_queue, self.quantize, self.mesh = max_queue, quantize_kv_cache, mesh
        self.waiting: collections.deque = collections.deque()
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.slots: list[Sequence | None] = [None] * slots
        self.running = False
        self.thread: threading.Thread | None = None
        self.tokens_total = 0
        self.requests_total = 0
        self.prompt_tokens_total = 0
        self.ttft_s: collections.deque = collections.deque(maxlen=1000)  # the latest times to first token
        self.recent: collections.deque = collections.deque()  # (time, tokens) of the last steps, for tokens/s
        self.error: str | None = None
        with self._ctx():
            self.cache, self.logits_BV = _empty(cfg, slots, cache_length, quantize_kv_cache)

    def _ctx(self):
        return sharding.activation_sharding(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    # ---- called from other threads ----------------------------------------------------------------------------

    def submit(self, item: Sequence | Score) -> None:
        with self.lock:
            if len(self.waiting) >= self.max_queue:
                raise QueueFull
            self.waiting.append(item)
        self.wake.set()

    def cancel(self, item: Sequence | Score) -> None:
        item.cancelled = True
        self.wake.set()

    def busy_slots(self) -> int:
        return sum(s is not None for s in self.slots)

    def queue_depth(self) -> int:
        return len(self.waiting)

    def tokens_per_s(self, window_s: float = 10.0) -> float:
        now = time.perf_counter()
        recent = [(t, n) for t, n in list(self.recent) if t > now - window_s]
        return sum(n for _, n in recent) / window_s

    def warm_up(self) -> None:
        """Compile the decode step, the shortest prompts' prefill and scoring before the first request: a
        prompt in a slot that stays idle, then an idle step."""
        seq = Sequence([0], 1, 0.0, 0, 1.0, 0, 0, (), lambda ev: None)
        with self._ctx():
            self._prefill(seq, 0)
            self.slots[0] = None
            self.requests_total = self.prompt_tokens_total = 0
            self._run_score(Score([0, 0], lambda ev: None))
            B = self.B
            out = _step(self.params, self.cache, self.logits_BV, np.zeros(B, bool), np.zeros(B, np.uint32),
                        np.zeros(B, np.int32), np.zeros(B, np.int32), np.zeros(B, np.float32), np.zeros(B, np.int32),
                        np.ones(B, np.float32), self.cfg)
            self.logits_BV, self.cache = jax.block_until_ready(out[-2:])

    def start(self) -> None:
        self.running = True
        self.thread = threading.Thread(target=self._loop, name="jaxlm-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.running = False
        self.wake.set()
        if self.thread is not None:
            self.thread.join()

    # ---- the engine thread -------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while self.running:
            with self._ctx():
                self._admit()
                if any(s is not None for s in self.slots):
                    try:
                        self._decode()
                    except Exception as e:  # the step's buffers were donated: fail the busy rows, start afresh
                        self.error = f"{type(e).__name__}: {e}"
                        for i, s in enumerate(self.slots):
                            if s is not None:
                                self.slots[i] = None
                                s.emit(("error", self.error))
                        self.cache, self.logits_BV = _empty(self.cfg, self.B, self.S, self.quantize)
                    continue
            self.wake.wait(0.05)
            self.wake.clear()
        for i, s in enumerate(self.slots):
            if s is not None:
                self._finish(i, "cancelled")

    def _admit(self) -> None:
        while True:
            with self.lock:
                if not self.waiting:
                    return
                item = self.waiting[0]
                if isinstance(item, Sequence) and not item.cancelled and None not in self.slots:
                    return
                self.waiting.popleft()
            if item.cancelled:
                item.emit(("done", "cancelled") if isinstance(item, Sequence) else ("error", "cancelled"))
                continue
            try:
                if isinstance(item, Score):
                    self._run_score(item)
                else:
                    self._prefill(item, self.slots.index(None))
            except Exception as e:  # this request fails alone; the slots keep decoding
                item.emit(("error", f"{type(e).__name__}: {e}"))

    def _padded(self, prompt: list[int]) -> np.ndarray:
        T = bucket(len(prompt), self.S)
        if self.cfg.position == "learned":
            T = min(T, self.cfg.block_size)
        tokens_1T = np.zeros((1, T), np.int32)
        tokens_1T[0, :len(prompt)] = prompt
        return tokens_1T

    def _prefill(self, seq: Sequence, slot: int) -> None:
        if len(seq.prompt) + seq.max_tokens > self.S:
            raise ValueError(f"a prompt of {len(seq.prompt)} tokens + {seq.max_tokens} new ones do not fit in the "
                             f"{self.S} positions of a slot")
        tokens_1T = self._padded(seq.prompt)
        logits_1V, one = generate._prefill(self.params, tokens_1T, np.asarray([len(seq.prompt)], np.int32),
                                           self.cfg, self.S, self.quantize)
        self.cache, self.logits_BV = _insert(self.cache, self.logits_BV, one, logits_1V, np.int32(slot))
        seq.slot = slot
        self.slots[slot] = seq
        self.requests_total += 1
        self.prompt_tokens_total += len(seq.prompt)

    def _run_score(self, item: Score) -> None:
        tokens_1T = self._padded(item.prompt)
        n = len(item.prompt)
        token_lp, top_ids, top_lp = jax.device_get(_score(self.params, tokens_1T, self.cfg))
        item.emit(("score", token_lp[:n - 1].tolist(), top_ids[:n].tolist(), top_lp[:n].tolist()))

    def _decode(self) -> None:
        rows = [(i, s) for i, s in enumerate(self.slots) if s is not None]
        for i, s in rows:
            if s.cancelled:
                self._finish(i, "cancelled")
        if not any(s is not None for s in self.slots):
            return
        B = self.B
        busy = np.zeros(B, bool)
        seed, choice, count = np.zeros(B, np.uint32), np.zeros(B, np.int32), np.zeros(B, np.int32)
        temperature, top_k, top_p = np.zeros(B, np.float32), np.zeros(B, np.int32), np.ones(B, np.float32)
        for i, s in enumerate(self.slots):
            if s is not None:
                busy[i] = True
                seed[i], choice[i], count[i] = s.seed % 2**32, s.choice, s.generated
                temperature[i], top_k[i], top_p[i] = s.temperature, s.top_k, s.top_p
        tok, lp, top_ids, top_lp, self.logits_BV, self.cache = _step(
            self.params, self.cache, self.logits_BV, busy, seed, choice, count, temperature, top_k, top_p, self.cfg)
        tok, lp, top_ids, top_lp = jax.device_get((tok, lp, top_ids, top_lp))
        now = time.perf_counter()
        n = 0
        for i, s in enumerate(self.slots):
            if s is None:
                continue
            if s.generated == 0:
                self.ttft_s.append(now - s.submitted)
            s.generated += 1
            n += 1
            t = int(tok[i])
            s.emit(("token", t, float(lp[i]), list(zip(top_ids[i].tolist(), top_lp[i].tolist()))))
            if t in s.stop_ids:
                self._finish(i, "stop")
            elif s.generated >= s.max_tokens:
                self._finish(i, "length")
        self.tokens_total += n
        self.recent.append((now, n))
        while self.recent and self.recent[0][0] < now - 60:
            self.recent.popleft()

    def _finish(self, slot: int, reason: str) -> None:
        s = self.slots[slot]
        self.slots[slot] = None
        s.emit(("done", reason))


def compiled_step_count() -> int:
    """How many decode-step programs this process has compiled (one per slot count and model)."""
    return _step._cache_size()
