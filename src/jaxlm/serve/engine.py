"""The continuous-batching engine: a fixed number of decode slots sharing one KV cache on device.

One thread owns the device. Each turn it admits waiting requests into free slots, prefills prompts, then runs
one decode step over every slot whose prompt is in: each such row samples its next token from its own logits
with its own settings and random stream, the step appends those tokens to the cache, and the tokens go back to
their requests. A sequence that ends (stop token, max_tokens, cancel) frees its slot before the next turn.

Prompts are prefilled into their slots in chunks (serve/chunk.py) of at most `prefill_chunk` tokens, and a turn
prefills at most that many tokens before its decode step, so a long prompt takes a chunk per turn while the
other slots keep decoding, instead of holding their next token back for its whole prefill. A chunk is padded to
a power of two from 16 tokens (at most prefill_chunk), so prefill compiles once per chunk length. With a prefix
cache (serve/prefix_cache.py), a prompt that starts with the tokens of a recent one first copies their keys and
values into its slot and prefills only the rest.

The decode step has the same shapes whatever the slots hold, so it compiles once per slot count. Scoring a
prompt (the log-probability of each of its tokens, for `echo` with `logprobs`) runs the uncached forward pass
on the same thread.

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
from jaxlm.config import ModelConfig, ServeConfig
from jaxlm.model import forward, kvcache, transformer
from jaxlm.serve import chunk as chunk_lib
from jaxlm.serve.prefix_cache import PrefixCache

TOP_LOGPROBS = 5  # the most alternatives a request may ask for, as the OpenAI completions API allows
MIN_BUCKET = 16


class QueueFull(Exception):
    """The waiting queue holds serve.max_queue requests already."""


def bucket(n: int, limit: int) -> int:
    """Padded length of n tokens (a prompt to score, a chunk to prefill): the next power of two from
    MIN_BUCKET, at most `limit` (or n when n is past it)."""
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
    prefilled: int | None = None  # prompt tokens in the slot's cache; None until its prefill starts
    generated: int = 0
    submitted: float = field(default_factory=time.perf_counter)

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.prompt)


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
def _step(params, cache, logits_BV, busy_B, idle_length_B, seed_B, choice_B, count_B, temperature_B, top_k_B,
          top_p_B, cfg: ModelConfig):
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
    # Idle rows decode a dummy token at position idle_length_B: 0 for a free slot, the next chunk's start for a
    # slot being prefilled, where the chunk masks that entry and then overwrites it (serve/chunk.py).
    cache = kvcache.KVCache(cache.kinds, jnp.where(busy_B, cache.length, idle_length_B))
    logits_BV, cache = transformer.decode_step(params, tok_B, cache, cfg)
    return tok_B, lp_B, top_ids_BK, top_lp_BK, logits_BV, cache


def _empty(cfg: ModelConfig, slots: int, length: int, quantize: bool) -> kvcache.KVCache:
    """An empty cache for `slots` sequences, its keys and values sharded by kv heads (and slots by `batch`)."""
    cache = kvcache.init(cfg, slots, length, quantize)
    kinds = tuple(kvcache.KindCache(*(None if a is None else sharding.constrain(a, (None,) + kvcache.CACHE_AXES[
        :a.ndim - 1]) for a in (c.k, c.v, c.k_scale, c.v_scale)), c.pos) for c in cache.kinds)
    return kvcache.KVCache(kinds, cache.length)


@partial(jax.jit, static_argnames="cfg")
def _score(params, tokens_1T, cfg: ModelConfig):
    lp_TV = jax.nn.log_softmax(forward(params, tokens_1T, cfg)[0], axis=-1)
    top_lp_TK, top_ids_TK = jax.lax.top_k(lp_TV, TOP_LOGPROBS)
    token_lp_T = jnp.take_along_axis(lp_TV[:-1], tokens_1T[0, 1:, None], axis=-1)[:, 0]
    return token_lp_T, top_ids_TK, top_lp_TK


class Engine:
    """`submit(seq)` queues a sequence (raises QueueFull past max_queue waiting), `cancel(seq)` ends it; the
    engine thread runs from `start()` to `stop()`. /metrics reads its counters (the *_total attributes)."""

    def __init__(self, params, cfg: ModelConfig, slots: int, cache_length: int, max_queue: int,
                 quantize_kv_cache: bool = False, mesh: jax.sharding.Mesh | None = None,
                 prefill_chunk: int = ServeConfig.prefill_chunk, prefix_cache: int = 0,
                 rules: tuple[sharding.Rules, sharding.Rules] = (sharding.PARAM_RULES, sharding.ACTIVATION_RULES)):
        self.params, self.cfg, self.B, self.S = params, cfg, slots, cache_length
        self.max_queue, self.quantize, self.mesh, self.rules = max_queue, quantize_kv_cache, mesh, rules
        self.prefill_chunk, self.prefix_entries = prefill_chunk, prefix_cache
        self.waiting: collections.deque = collections.deque()
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.slots: list[Sequence | None] = [None] * slots
        self.prefilling: collections.deque = collections.deque()  # slots whose prompt is not all in, oldest first
        self.running = False
        self.thread: threading.Thread | None = None
        self.tokens_total = 0
        self.requests_total = 0
        self.prompt_tokens_total = 0
        self.prefilled_tokens_total = 0  # prompt tokens run through the model (not taken from the prefix cache)
        self.prefix_hits_total = 0
        self.prefix_tokens_total = 0
        self.ttft_s: collections.deque = collections.deque(maxlen=1000)  # the latest times to first token
        self.recent: collections.deque = collections.deque()  # (time, tokens) of the last steps, for tokens/s
        self.error: str | None = None
        # a function of this engine's own: `constrain` reads the mesh from a context that jax.jit's caches (keyed
        # by the function) do not hold, so a shared one would hand a later engine an earlier one's layout
        self._empty = jax.jit(lambda *a: _empty(*a), static_argnums=(0, 1, 2, 3))
        with self._ctx():
            self._reset_cache()

    def _ctx(self):
        if self.mesh is None:
            return contextlib.nullcontext()
        return sharding.activation_sharding(self.mesh, self.rules[1], param_rules=self.rules[0])

    def _reset_cache(self) -> None:
        """Empty slots, logits and prefix cache (at start, and after a failed call consumed the donated ones)."""
        self.cache = self._empty(self.cfg, self.B, self.S, self.quantize)
        self.logits_BV = jnp.zeros((self.B, self.cfg.vocab_size), jnp.float32)
        self.prefix = PrefixCache(self.cfg, self._empty(self.cfg, self.prefix_entries, self.S, self.quantize),
                                  self.S) if self.prefix_entries else None

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
        """Compile the decode step, the shortest chunk's prefill, scoring and the prefix cache's copies before
        the first request: a prompt in a slot that stays idle, then an idle step."""
        with self._ctx():
            seq = Sequence([0], 1, 0.0, 0, 1.0, 0, 0, (), lambda ev: None, slot=0)
            self.slots[0] = seq
            self._prefill_chunk(seq)
            if self.prefix is not None:
                self.cache = self.prefix.warm_up(self.cache)
            self.slots[0] = None
            self.prefilled_tokens_total = 0
            self._run_score(Score([0, 0], lambda ev: None))
            self._run_step(np.zeros(self.B, bool), np.zeros(self.B, np.int32))
            jax.block_until_ready((self.cache, self.logits_BV))

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
                        self._prefill()
                        self._decode()
                    except Exception as e:  # the cache was donated to the failed call: fail every slot, start afresh
                        self.error = f"{type(e).__name__}: {e}"
                        for i, s in enumerate(self.slots):
                            if s is not None:
                                self.slots[i] = None
                                s.emit(("error", self.error))
                        self.prefilling.clear()
                        self._reset_cache()
                    continue
            self.wake.wait(0.05)
            self.wake.clear()
        for i, s in enumerate(self.slots):
            if s is not None:
                self._finish(i, "cancelled")

    def _admit(self) -> None:
        """Waiting requests in order: a score runs now, a sequence takes a free slot and waits there for its
        prefill."""
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
                elif len(item.prompt) + item.max_tokens > self.S:
                    raise ValueError(f"a prompt of {len(item.prompt)} tokens + {item.max_tokens} new ones do not "
                                     f"fit in the {self.S} positions of a slot")
                else:
                    item.slot = self.slots.index(None)
                    self.slots[item.slot] = item
                    self.prefilling.append(item.slot)
                    self.requests_total += 1
                    self.prompt_tokens_total += len(item.prompt)
            except Exception as e:  # this request fails alone; the slots keep decoding
                item.emit(("error", f"{type(e).__name__}: {e}"))

    def _prefill(self) -> None:
        """Prefill chunks, oldest prompt first, until this turn has run prefill_chunk tokens (at least one chunk)."""
        budget = self.prefill_chunk
        while self.prefilling and budget > 0:
            seq = self.slots[self.prefilling[0]]
            if seq.cancelled:
                self.prefilling.popleft()
                self._finish(seq.slot, "cancelled")
                continue
            budget -= self._prefill_chunk(seq)
            if seq.decoding:
                self.prefilling.popleft()
                if self.prefix is not None:
                    self.prefix.save(self.cache, seq.slot, seq.prompt)

    def _prefill_chunk(self, seq: Sequence) -> int:
        """Run the next chunk of seq's prompt into its slot (first taking what the prefix cache holds of it);
        returns the chunk's padded length."""
        if seq.prefilled is None:
            seq.prefilled = 0
            if self.prefix is not None:
                entry, reused = self.prefix.match(seq.prompt)
                if reused:
                    self.cache = self.prefix.load(self.cache, entry, seq.slot)
                    seq.prefilled = reused
                    self.prefix_hits_total += 1
                    self.prefix_tokens_total += reused
        n = min(len(seq.prompt) - seq.prefilled, self.prefill_chunk)
        C = bucket(n, self.prefill_chunk)
        tokens_C = np.zeros(C, np.int32)
        tokens_C[:n] = seq.prompt[seq.prefilled:seq.prefilled + n]
        self.cache, self.logits_BV = chunk_lib.prefill_chunk(
            self.params, self.cache, self.logits_BV, tokens_C, np.int32(seq.prefilled), np.int32(len(seq.prompt)),
            np.int32(seq.slot), self.cfg)
        seq.prefilled += n
        self.prefilled_tokens_total += n
        return C

    def _padded(self, prompt: list[int]) -> np.ndarray:
        T = bucket(len(prompt), self.S)
        if self.cfg.position == "learned":
            T = min(T, self.cfg.block_size)
        tokens_1T = np.zeros((1, T), np.int32)
        tokens_1T[0, :len(prompt)] = prompt
        return tokens_1T

    def _run_score(self, item: Score) -> None:
        tokens_1T = self._padded(item.prompt)
        n = len(item.prompt)
        token_lp, top_ids, top_lp = jax.device_get(_score(self.params, tokens_1T, self.cfg))
        item.emit(("score", token_lp[:n - 1].tolist(), top_ids[:n].tolist(), top_lp[:n].tolist()))

    def _run_step(self, busy: np.ndarray, idle_length: np.ndarray):
        B = self.B
        seed, choice, count = np.zeros(B, np.uint32), np.zeros(B, np.int32), np.zeros(B, np.int32)
        temperature, top_k, top_p = np.zeros(B, np.float32), np.zeros(B, np.int32), np.ones(B, np.float32)
        for i, s in enumerate(self.slots):
            if busy[i]:
                seed[i], choice[i], count[i] = s.seed % 2**32, s.choice, s.generated
                temperature[i], top_k[i], top_p[i] = s.temperature, s.top_k, s.top_p
        tok, lp, top_ids, top_lp, self.logits_BV, self.cache = _step(
            self.params, self.cache, self.logits_BV, busy, idle_length, seed, choice, count, temperature, top_k,
            top_p, self.cfg)
        return jax.device_get((tok, lp, top_ids, top_lp))

    def _decode(self) -> None:
        for i, s in enumerate(self.slots):
            if s is not None and s.cancelled:
                if not s.decoding and i in self.prefilling:
                    self.prefilling.remove(i)
                self._finish(i, "cancelled")
        busy = np.asarray([s is not None and s.decoding for s in self.slots])
        if not busy.any():
            return
        idle_length = np.asarray([0 if s is None or s.decoding else (s.prefilled or 0) for s in self.slots],
                                 np.int32)
        tok, lp, top_ids, top_lp = self._run_step(busy, idle_length)
        now = time.perf_counter()
        n = 0
        for i, s in enumerate(self.slots):
            if not busy[i]:
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
