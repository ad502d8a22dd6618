"""The continuous-batching engine: a fixed number of decode slots (rows) sharing one KV cache on device.

The cache is paged by default (serve.page_size > 0; model/paged.py, serve/pages.py): each sequence holds the pages
its tokens fill, taken when it is admitted (its prompt's, less those it shares with an earlier prompt) and
before each decode call (the call's positions), and given back when it ends; when too few pages are free the
sequences admitted last are preempted (their pages given back; they wait at the head of the queue to prefill
their prompt and the tokens already sent again). Prefill and decode both run decode.paged_forward through
the rows' page tables. With serve.page_size=0 each slot holds the whole context of one KV cache
(model/kvcache.py): the slot cache, kept as the reference the paged cache is tested against. What follows
holds for both unless it names one.

One thread owns the device. Each turn it admits waiting requests into free slots, prefills prompts, then runs
the decode program over the slots whose prompt is in: up to serve.decode_steps decode steps in one device call
(a `lax.while_loop`), each step sampling every live row's next token from its own logits with its own settings
and random stream and appending those tokens to the cache. A row stops inside the loop at a stop token or at
its max_tokens (admission made prompt + max_tokens fit in the slot, so that is also where its context ends),
and the loop stops early when no row is left; the tokens of all steps (and their log-probabilities, when a row
asks for them) come back together and go to their requests. A sequence that ends (stop token, max_tokens,
cancel) frees its slot before the next turn. The call takes its rows' cache apart by layer once (gathering the
bucket's rows in the same copy), runs the steps with the layers unrolled, and writes it back into the stacked
cache once, in place (as generate's decode loop does; models deeper than generate.UNROLL_LAYERS, and
serve.decode_steps=1, scan the layers of the stacked cache instead).

The host hands out a call's tokens while the device runs the next one: each turn dispatches its decode call
first (JAX dispatches asynchronously) and then waits for the call of the turn before, sends its tokens to their
requests and frees the slots it ended. The next call is planned without that call's tokens: a sequence's count
of tokens so far is what the calls dispatched for it make unless a stop token ends it early (`planned`); when one
does, that sequence's tokens from the call in flight are dropped. When requests wait and a call in flight ends a
sequence at its max_tokens, the turn collects it before dispatching, so the waiting request takes the slot at
once.

How many steps a turn runs: one in a turn that prefilled (a new request gets its first token after one step,
not after decode_steps), else serve.decode_steps.
While requests wait for a slot, a turn runs no more steps than the nearest sequence needs to reach its
max_tokens, so its slot is handed on at once.

Row buckets: the decode program is compiled (at warm-up) for all slots, for a half, a quarter and an eighth of
them, and for 4 rows and 1 (ROW_BUCKETS_SMALL); a turn gathers the busy rows of the cache into the smallest
bucket that holds them, runs the loop on that, and scatters them back, so a few busy slots do not pay for all
of them. The shapes of a bucket's program do not depend on what the slots hold nor on the steps asked for, so
requests compile nothing (but one whose sequences have more than MIN_STOP_WIDTH stop tokens: a wider program,
once).

Slot buckets: a call takes (and attends over) only the fewest cache slots that hold every position it reads or
writes, an eighth, a quarter, a half or all of them (programs.slot_buckets, kvcache.kept_slots), chosen on device by
one lax.cond per bucket inside the same program.

Prompts are prefilled into their slots in chunks (serve/chunk.py) of at most `prefill_chunk` tokens, and a turn
prefills at most that many prompt tokens before its decode call (at least one chunk), so a long prompt takes a
chunk per turn while the other slots keep decoding, instead of holding their next tokens back for its whole
prefill. A turn takes the waiting prompts' next chunks oldest first while they fit, and runs the chunks of the
same padded length together, several prompts in one device call: 16 short prompts that arrive together cost
one call, not 16. A chunk is padded to one of a few lengths (`bucket`: 16, 32, 64, 96, 128, 192, ..., at most
prefill_chunk) and a call's rows to a power of two (`prefill_rows`, up to MAX_PREFILL_ROWS), so prefill compiles
once per pair of those. With a prefix cache (serve/prefix_cache.py), a prompt that starts with the tokens of a
recent one first copies their keys and values into its slot and prefills only the rest.

Scoring a prompt (the log-probability of each of its tokens, for `echo` with `logprobs`) runs the uncached
forward pass on the same thread, within the prefill's budget: a turn scores waiting prompts while their padded
tokens fit in prefill_chunk (at least one), so 64 prompts to score take turns with the decoding slots instead of
holding their next tokens back for all 64.

A request is checked again where it enters (`check`): a value the decode program cannot hold (a top_k past int32,
a token id outside the vocabulary) fails that request alone at its admission; only a failure of a device call
fails the sequences that share it (their cache was donated to the call), each told so in one line, the error
logged once with its traceback.

A row's random stream is key(seed) folded with its choice index and then with its token index, and every row
samples from its own logits, so a request's tokens do not depend on what the other slots hold, nor on how many
steps a call runs.

The device programs a turn runs (decode loops, prefill, scoring) are in serve/programs.py.

After each turn the engine calls its `turn_hooks` (the app hands the turn's events to the event loop at once).

Shape legend: B slots, b rows of a bucket, N steps of a decode call at most, M stop tokens of a row (padded),
T padded prompt length, S cache slots per sequence, V vocab, K top log-probabilities, P rows of a prefill call,
C chunk length.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm import sharding
from jaxlm.infer import generate, speculative
from jaxlm.config import ModelConfig, ServeConfig
from jaxlm.model import decode, kvcache, layers, paged
from jaxlm.model.mtp import mtp_pool, mtp_weights
from jaxlm.serve import chunk as chunk_lib, programs, speculate
from jaxlm.serve.pages import PagePool
from jaxlm.serve.prefix_cache import PrefixCache

TOP_LOGPROBS = speculate.TOP_LOGPROBS  # the most alternatives a request may ask for
INT32_MAX = 2**31 - 1
ENGINE_FAILED = "the engine failed while running this request (the server's log has the error)"
log = logging.getLogger("jaxlm.serve")
MIN_BUCKET = 16
MIN_STOP_WIDTH = 4  # stop tokens per row the decode program takes (more compile a wider one, once)
MAX_PREFILL_ROWS = 16  # prompts' chunks prefilled in one call at most
# rows of the decode program's variants below an eighth of the slots: a call of one to four live sequences (one
# request alone, the last long ones of a burst) runs on 1 or 4 rows, not 8 (134M parameters on a 2-core CPU: a
# step of 1 row 23 ms, of 8 rows 44 ms)
ROW_BUCKETS_SMALL = (1, 4)


def whole_numbers(values, lo: int, hi: int) -> bool:
    """Whether `values` (a list or array) are whole numbers (not bools) in [lo, hi]; an empty one is."""
    try:
        a = np.asarray(values)
    except (OverflowError, ValueError, TypeError):
        return False
    return a.ndim == 1 and (a.size == 0 or (a.dtype.kind in "iu" and lo <= a.min() and a.max() <= hi))


class QueueFull(Exception):
    """The waiting queue holds serve.max_queue requests already."""


def bucket(n: int, limit: int) -> int:
    """Padded length of n tokens (a prompt to score, a chunk to prefill): the next of MIN_BUCKET, 2 MIN_BUCKET,
    4 MIN_BUCKET and from there powers of two and one and a half times them (96, 128, 192, 256, 384, ...), at
    most `limit` (or n when n is past it). With powers of two alone the long-tailed prompts of
    benchmarks/serve.py ran 1.33 padded tokens per real one through the model; the half steps take it to about
    1.17 for a few more compiled lengths (short chunks cost mostly a call's fixed time, so they keep the coarse
    steps)."""
    b = MIN_BUCKET
    while b < n:
        if b < 4 * MIN_BUCKET:
            b *= 2
        elif b & (b - 1) == 0:  # a power of two: one and a half times it next
            b = b * 3 // 2
        else:  # one and a half times a power of two: the next power of two
            b = b * 4 // 3
    return min(b, max(limit, n))


@dataclass
class Sequence:
    """One generated sequence (one choice of a request). The engine calls `emit(event)` from its thread with
    ("tokens", ids, logprobs, alternatives) once per decode call that made tokens for it (ids [n]; logprobs [n]
    and alternatives (ids [n][A], logprobs [n][A]), most likely first, A >= `alternatives`, when `logprobs`,
    else None), then ("done", reason) once, reason
    being "stop" (a stop token), "length" (max_tokens) or "cancelled"; or, instead of ("done", ...), ("error",
    text, status): 400 for a value the programs cannot hold (Engine.check), 500 when the engine failed."""
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    choice: int
    stop_ids: tuple[int, ...]
    emit: Callable[[tuple], None]
    logprobs: bool = True
    alternatives: int = TOP_LOGPROBS  # of each token, with `logprobs` (at most TOP_LOGPROBS)
    cancelled: bool = False
    slot: int = -1
    prefilled: int | None = None  # tokens of `context` in the slot's cache; None until its prefill starts
    generated: int = 0  # tokens sent to `emit`
    planned: int = 0  # tokens the decode calls dispatched so far make for it unless it stops at a stop token
    submitted: float = field(default_factory=time.perf_counter)
    out: list[int] = field(default_factory=list)  # the tokens sent (a preempted sequence prefills them again)
    resumed: list[int] | None = None  # after a preemption: the prompt and the tokens sent before it
    pages: list[int] = field(default_factory=list)  # the paged cache's pages it holds, in position order
    admitted: int = 0  # the engine's count of admissions when it was admitted (the latest is preempted first)
    adapter: int = -1  # the LoRA adapter it runs with (the engine's params' RowLoraWeight index; -1 the base)

    @property
    def context(self) -> list[int]:
        """The tokens its cache must hold before it decodes: the prompt, or after a preemption the prompt and
        the tokens sent before it."""
        return self.prompt if self.resumed is None else self.resumed

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.context)


@dataclass
class Score:
    """The log-probability of each prompt token after the ones before it (the first has none), with the
    TOP_LOGPROBS most likely alternatives; `emit(("score", token_lp, top_ids, top_lp))` or ("error", text, status)
    (as a Sequence's)."""
    prompt: list[int]
    emit: Callable[[tuple], None]
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    adapter: int = -1


class Engine:
    """`submit(seq)` queues a sequence (raises QueueFull past max_queue waiting), `cancel(seq)` ends it; the
    engine thread runs from `start()` to `stop()`. /metrics reads its counters (the *_total attributes)."""

    def __init__(self, params, cfg: ModelConfig, slots: int, cache_length: int, max_queue: int,
                 quantize_kv_cache: bool = False, mesh: jax.sharding.Mesh | None = None,
                 prefill_chunk: int = ServeConfig.prefill_chunk, prefix_cache: int = 0,
                 rules: tuple[sharding.Rules, sharding.Rules] = (sharding.PARAM_RULES, sharding.ACTIVATION_RULES),
                 decode_steps: int = ServeConfig.decode_steps, page_size: int = ServeConfig.page_size,
                 cache_pages: int | None = None, draft: tuple | None = None,
                 page_format: paged.PoolFormat | None = None):
        self.cfg, self.B, self.S = cfg, slots, cache_length
        # Speculative decoding (serve/speculate.py): draft = (its params, its ModelConfig, tokens it proposes);
        # (None, None, k): the model's first multi-token prediction module drafts (decode.draft=mtp)
        if draft is not None and not page_size:
            raise ValueError("speculative decoding (decode.draft) in the server needs the paged KV cache "
                             "(serve.page_size > 0)")
        if draft is not None:
            if draft[1] is None:
                speculative.check_mtp(cfg)
            speculative.check_draft(cfg, draft[1] or cfg, cache_length)
        self.mtp_draft = draft is not None and draft[1] is None
        self.draft, self._draft_layer_params = draft, None
        self.pending = np.full(slots, -1, np.int32)  # with a draft: each slot's token sent but not yet cached
        self.draft_proposed_total = self.draft_accepted_total = 0
        # The paged cache (page_size > 0): cache_pages pages (None: as many as give every slot the whole context,
        # the slot cache's memory), each sequence's page table a row of `table` [slots, pages per sequence].
        self.page_size = page_size
        if page_size:
            self.M = -(-cache_length // page_size)
            self.NP = cache_pages or slots * self.M
            self.table = np.zeros((slots, self.M), np.int32)
        self.admissions = 0
        self.preempted_total = 0  # sequences preempted when the paged cache ran out of pages
        self.max_queue, self.quantize, self.mesh, self.rules = max_queue, quantize_kv_cache, mesh, rules
        self.prefill_chunk, self.prefix_entries, self.decode_steps = prefill_chunk, prefix_cache, decode_steps
        # The decode program's layers unrolled over the cache taken apart (programs.decode_loop), else scanned. Taking
        # it apart and back costs two copies of the rows' cache per call: with one step per call that lost to
        # the scan's copies of one step (benchmarks/serve.py's engine alone, docs/serve.md).
        self.unroll = cfg.n_layers <= generate.UNROLL_LAYERS and (decode_steps > 1 or page_size > 0)
        # rows of the decode program's compiled variants, largest first; on a mesh a bucket must split evenly
        # over the devices as the slots do
        shards = 1 if mesh is None else mesh.size
        self.buckets = sorted({b for b in [slots // d for d in (1, 2, 4, 8) if slots % d == 0] + list(ROW_BUCKETS_SMALL)
                               if b <= slots and b % shards == 0} | {slots}, reverse=True)
        self.turn_hooks: list[Callable[[], None]] = []  # called after each turn, from the engine thread
        self.calls_total = 0  # decode calls run
        self.in_flight: tuple[list, tuple] | None = None  # the decode call dispatched last turn, not yet collected
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
        self.prefill_calls_total = 0
        # rows of the prefill program's variants (serve/chunk.py), smallest first: powers of two up to the slots
        self.prefill_rows = [1 << i for i in range(min(slots, MAX_PREFILL_ROWS).bit_length())]
        self.prefix_hits_total = 0
        self.prefix_tokens_total = 0
        self.ttft_s: collections.deque = collections.deque(maxlen=1000)  # the latest times to first token
        self.recent: collections.deque = collections.deque()  # (time, tokens) of the last steps, for tokens/s
        self.error: str | None = None
        # Every program is traced in the mesh and rules of `layout`, its static argument (programs.py). The paged
        # cache's format (padding, page-attention kernel) is the devices' (None: paged.pool_format of their
        # platform; tests give their own), decided here once: a server compiled for a TPU from a CPU host gets the
        # TPU's.
        self.layout = sharding.layout(mesh, rules[1], param_rules=rules[0])
        platform = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform
        self.page_format = paged.pool_format(platform) if page_format is None else page_format
        self.params = params
        # LoRA adapters over the base (lora.serving_weights: layers.RowLoraWeight), a sequence's picked by its
        # `adapter`; every call sets each row's (layers.with_rows)
        rows_lora = [w for w in jax.tree.leaves(params, is_leaf=lambda w: isinstance(w, layers.RowLoraWeight))
                     if isinstance(w, layers.RowLoraWeight)]
        self.adapters = rows_lora[0].a.shape[-2] if rows_lora else 0
        self._reset_cache()

    @property
    def params(self):
        return self._params

    @params.setter
    def params(self, params) -> None:
        """New weights (GRPO's rollouts over the trainer's latest) for the calls from now on."""
        self._params, self._layer_params = params, None

    def _layer_weights(self):
        """The paged decode program's layers unrolled over weights taken apart once, at the first call after new
        params (None: scanned). Taken apart inside the program, every call copied all the weights (at 125M
        parameters in float32 on a 2-core CPU, as much CPU time as a decode step's attention); the copies cost
        the weights' memory once more, until release_cache."""
        if not (self.unroll and self.page_size):
            return None
        if self._layer_params is None:
            self._layer_params = jax.jit(decode.layer_weights, static_argnums=1)(self._params, self.cfg)
        return self._layer_params

    def _draft_layer_weights(self):
        """The draft's layers taken apart once, as _layer_weights (None: scanned, for a deep draft); the multi-token
        prediction module's weights (mtp_weights) when it drafts."""
        params, cfg, _ = self.draft
        if self.mtp_draft:
            if self._draft_layer_params is None:
                self._draft_layer_params = jax.jit(mtp_weights, static_argnums=1)(self._params, self.cfg)
            return self._draft_layer_params
        if cfg.n_layers > generate.UNROLL_LAYERS:
            return None
        if self._draft_layer_params is None:
            self._draft_layer_params = jax.jit(decode.layer_weights, static_argnums=1)(params, cfg)
        return self._draft_layer_params

    def _reset_cache(self) -> None:
        """Empty cache, logits and prefix cache (at start, and after a failed call consumed the donated ones)."""
        self.logits_BV = jnp.zeros((self.B, self.cfg.vocab_size), jnp.float32)
        if self.page_size:
            self.cache = programs.empty_pages(self.cfg, self.NP, self.page_size, self.quantize, self.page_format,
                                              self.layout)
            if self.mtp_draft:  # the module's pool, and each slot's state between calls (speculate.decode_loop)
                self.draft_cache = mtp_pool(self.cfg, self.NP, self.page_size, self.page_format)
                J, D, dt = self.draft[2] + 1, self.cfg.d_model, jnp.dtype(self.cfg.compute_dtype)
                self.mtp = {"hidden_BD": jnp.zeros((self.B, D), dt), "prev_B": jnp.zeros((self.B,), jnp.int32),
                            "hid_BJD": jnp.zeros((self.B, J, D), dt), "next_BJ": jnp.zeros((self.B, J), jnp.int32)}
            elif self.draft is not None:
                self.draft_cache = programs.empty_pages(self.draft[1], self.NP, self.page_size, self.quantize,
                                                        self.page_format, self.layout)
            self.pending[:] = -1
            self.pages = PagePool(self.NP, self.page_size, share_prefixes=self.prefix_entries > 0)
            self.table[:] = 0
            self.prefix = None
            return
        self.cache = programs.empty_slots(self.cfg, self.B, self.S, self.quantize, self.layout)
        self.prefix = PrefixCache(self.cfg, programs.empty_slots(self.cfg, self.prefix_entries, self.S, self.quantize,
                                                                 self.layout),
                                  self.S, self.layout) if self.prefix_entries else None

    def release_cache(self) -> None:
        """Drop the KV cache (with the prefix cache, the last logits and the weights taken apart by layer) while the
        engine is stopped and idle: GRPO keeps one engine between batches of rollouts and frees its cache for the
        update (rl.py). reserve_cache makes it again."""
        self.cache = self.logits_BV = self.prefix = self._layer_params = None
        self.draft_cache = self._draft_layer_params = self.mtp = None

    def reserve_cache(self) -> None:
        self._reset_cache()

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

    def pages_used(self) -> int:
        """Pages of the paged cache some sequence holds (0 with the slot cache)."""
        return self.pages.used() if self.page_size else 0

    def pages_total(self) -> int:
        return self.NP if self.page_size else 0

    def tokens_per_s(self, window_s: float = 10.0) -> float:
        now = time.perf_counter()
        recent = [(t, n) for t, n in list(self.recent) if t > now - window_s]
        return sum(n for _, n in recent) / window_s

    def warm_up(self) -> None:
        """Compile the decode program of each bucket, the shortest chunk's prefill for each of prefill_rows,
        scoring and the prefix cache's copies before the first request: one-token prompts in slots that stay
        idle, then idle decode calls."""
        for P in self.prefill_rows:
            for fresh in (True, False):  # prompts' first chunks, and later chunks or after a prefix
                self._prefill_chunk([Sequence([0], 1, 0.0, 0, 1.0, 0, 0, (), lambda ev: None, slot=i,
                                              prefilled=0) for i in range(P)], bucket(1, self.prefill_chunk),
                                    fresh)
        if self.prefix is not None:
            self.cache = self.prefix.warm_up(self.cache)
        self.prefilled_tokens_total = self.prefill_calls_total = 0
        self._run_score(Score([0, 0], lambda ev: None))
        for b in self.buckets:
            jax.device_get(self._call(list(range(b)), 1)[1])
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
            more = self._admit()
            busy = any(s is not None for s in self.slots) or self.in_flight is not None
            if busy:
                try:
                    self._turn()
                except Exception as e:  # the cache was donated to the failed call: fail every slot, start afresh
                    self.in_flight = None
                    self.error = f"{type(e).__name__}: {e}"
                    failed = [s for s in self.slots if s is not None]
                    log.error("jaxlm serve: a device call failed; its %d sequences end with an error", len(failed),
                              exc_info=True)
                    for i, s in enumerate(self.slots):
                        if s is not None:
                            self.slots[i] = None
                            s.emit(("error", ENGINE_FAILED, 500))
                    self.prefilling.clear()
                    self._reset_cache()
            self._hand_over()
            if not busy and not more:
                self.wake.wait(0.05)
                self.wake.clear()
        for i, s in enumerate(self.slots):
            if s is not None:
                self._finish(i, "cancelled")
        self._hand_over()

    def _hand_over(self) -> None:
        for hook in self.turn_hooks:
            hook()

    def _turn(self) -> None:
        """Prefill, dispatch the next decode call (as many steps as the module docstring says), then hand out
        the tokens of the call dispatched last turn while the device runs this one."""
        for i, s in enumerate(self.slots):
            if s is not None and s.cancelled:
                if not s.decoding and i in self.prefilling:
                    self.prefilling.remove(i)
                self._finish(i, "cancelled")
        if self.in_flight is not None and self.waiting and any(
                s is not None and s.decoding and s.planned >= s.max_tokens for s in self.slots):
            self._collect(self.in_flight)  # it ends a sequence: the next turn admits a waiting one in its place
            self.in_flight = None
            return
        steps = 1 if self._prefill() else self.decode_steps
        planned = [s.max_tokens - s.planned for s in self.slots
                   if s is not None and s.decoding and s.planned < s.max_tokens]
        if self.waiting and planned:  # no slot is free: stop when the first one would be
            steps = min(steps, *planned)
        if planned and self.page_size:
            self._reserve(steps)
        launched = self._launch(steps) if planned else None
        if self.in_flight is not None:
            self._collect(self.in_flight)
        self.in_flight = launched
        if self.draft is not None and launched is not None:
            # a speculative call sends a count of tokens known only once it ends: the next is planned after it
            self._collect(launched)
            self.in_flight = None

    def _admit(self) -> bool:
        """Waiting requests in order: a score runs now while the turn's scoring budget lasts (the padded tokens
        of prefill_chunk, at least one score), a sequence takes a free slot and waits there for its prefill (with
        the paged cache, once the pages its context fills, less those of a shared prefix, are free: it takes them
        now). Returns whether a score waits for the next turn's budget."""
        budget = self.prefill_chunk
        while True:
            with self.lock:
                if not self.waiting:
                    return False
                item = self.waiting[0]
                if isinstance(item, Sequence) and not item.cancelled and None not in self.slots:
                    return False
                if isinstance(item, Score) and not item.cancelled:
                    cost = self._padded_length(len(item.prompt))
                    if budget < min(cost, self.prefill_chunk):
                        return True
                    budget -= cost
                self.waiting.popleft()
            if item.cancelled:
                item.emit(("done", "cancelled") if isinstance(item, Sequence) else ("error", "cancelled", 499))
                continue
            try:
                self.check(item)
            except ValueError as e:  # a value the programs cannot hold: this request fails alone
                item.emit(("error", str(e), 400))
                continue
            try:
                if isinstance(item, Score):
                    self._run_score(item)
                    continue
                if self.page_size and not self._take_pages(item):
                    with self.lock:
                        self.waiting.appendleft(item)  # until pages are given back
                    return False
                item.slot = self.slots.index(None)
                self.slots[item.slot] = item
                self.prefilling.append(item.slot)
                if self.page_size:
                    self.table[item.slot, :len(item.pages)] = item.pages
                if item.resumed is None:
                    self.requests_total += 1
                    self.prompt_tokens_total += len(item.prompt)
            except Exception:  # noqa: BLE001 - scoring's call failed: this request fails alone; the slots keep decoding
                log.error("jaxlm serve: a request failed at its admission", exc_info=True)
                item.emit(("error", ENGINE_FAILED, 500))

    def never_fits(self, tokens: int) -> str | None:
        """Why a sequence of `tokens` positions (prompt and new tokens) can never run here, or None: past a slot's
        positions, or (paged) past the pages of the whole cache."""
        if tokens > self.S:
            return f"{tokens} positions (prompt and new tokens) do not fit in the {self.S} of a sequence"
        if self.page_size and -(-tokens // self.page_size) > self.NP:
            return (f"{tokens} positions (prompt and new tokens) need more than the {self.NP} pages of "
                    f"{self.page_size} positions of the KV cache (serve.cache_gib)")
        return None

    def check(self, item: Sequence | Score) -> None:
        """Raise ValueError unless the decode and scoring programs can hold every value of `item` (run on the
        engine thread at admission: a bad request fails alone, never inside a call it would share)."""
        V = self.cfg.vocab_size
        if not -1 <= item.adapter < self.adapters:
            raise ValueError(f"adapter {item.adapter} is not one of this engine's {self.adapters}")
        if not whole_numbers(item.prompt, 0, V - 1) or not len(item.prompt):
            raise ValueError(f"a prompt must hold at least one token, each in [0, {V})")
        if isinstance(item, Score):
            if len(item.prompt) > self.S:
                raise ValueError(f"a prompt of {len(item.prompt)} tokens is longer than the {self.S} positions")
            return
        if not whole_numbers([item.max_tokens], 1, INT32_MAX):
            raise ValueError(f"max_tokens={item.max_tokens} must be a whole number >= 1")
        if (why := self.never_fits(len(item.prompt) + item.max_tokens)) is not None:
            raise ValueError(why)
        if not (isinstance(item.temperature, (int, float)) and math.isfinite(item.temperature)
                and item.temperature >= 0):
            raise ValueError(f"temperature={item.temperature} must be a finite number >= 0")
        if not whole_numbers([item.top_k], 0, INT32_MAX):
            raise ValueError(f"top_k={item.top_k} must be in [0, {INT32_MAX}]")
        if not (isinstance(item.top_p, (int, float)) and 0 < item.top_p <= 1):
            raise ValueError(f"top_p={item.top_p} must be in (0, 1]")
        if not (isinstance(item.seed, (int, np.integer)) and whole_numbers([item.choice], 0, INT32_MAX)):
            raise ValueError("seed and choice must be whole numbers (choice in int32)")
        if not whole_numbers(item.stop_ids, -INT32_MAX - 1, INT32_MAX):  # one past the vocabulary never comes
            raise ValueError("stop token ids must be int32 numbers")
        if not 0 <= item.alternatives <= TOP_LOGPROBS:
            raise ValueError(f"alternatives={item.alternatives} must be in [0, {TOP_LOGPROBS}]")

    def _take_pages(self, seq: Sequence) -> bool:
        """Give seq the pages its context fills: the registered ones that hold a prefix of it (prefilled already),
        and free ones for the rest. False (nothing taken) when too few are free."""
        A, n = self.page_size, len(seq.context)
        shared = self.pages.match(seq.context, seq.adapter)
        need = -(-n // A) - len(shared)
        if need > self.pages.available():
            self.pages.release(shared)
            return False
        seq.pages = shared + self.pages.take(need)
        seq.prefilled = len(shared) * A
        self.admissions += 1
        seq.admitted = self.admissions
        if shared:
            self.prefix_hits_total += 1
            self.prefix_tokens_total += seq.prefilled
        return True

    def _reserve(self, steps: int) -> None:
        """Paged cache: give every decoding sequence the pages its next `steps` tokens go to. When too few are
        free, the call in flight is collected (it may end sequences), then the sequences admitted last are
        preempted (their pages given back; they wait at the head of the queue, to prefill their prompt and the
        tokens sent so far again) until the rest fit."""
        A = self.page_size
        per_step = 1 if self.draft is None else self.draft[2] + 1
        while True:
            want = {}
            for s in self.slots:
                if s is not None and s.decoding and not s.cancelled and s.planned < s.max_tokens:
                    n = min(steps * per_step, s.max_tokens - s.planned)
                    more = -(-(len(s.prompt) + s.planned + n) // A) - len(s.pages)
                    if more > 0:
                        want[s.slot] = more
            if sum(want.values()) <= self.pages.available():
                break
            if self.in_flight is not None:
                self._collect(self.in_flight)
                self.in_flight = None
                continue
            victim = max((s for s in self.slots if s is not None), key=lambda s: s.admitted)
            self._preempt(victim)
        for slot, more in want.items():
            s = self.slots[slot]
            self.table[slot, len(s.pages):len(s.pages) + more] = new = self.pages.take(more)
            s.pages += new

    def _preempt(self, s: Sequence) -> None:
        """Free s's slot and pages and queue it first again, to prefill its prompt and the tokens it has sent."""
        if s.slot in self.prefilling:
            self.prefilling.remove(s.slot)
        self.slots[s.slot] = None
        self._release(s)
        s.slot, s.prefilled, s.planned = -1, None, s.generated
        s.resumed = s.prompt + s.out if s.out else None
        self.preempted_total += 1
        with self.lock:
            self.waiting.appendleft(s)

    def _release(self, s: Sequence) -> None:
        if self.page_size and s.pages:
            self.pages.release(s.pages)
            self.table[s.slot] = 0
            s.pages = []

    def _prefill(self) -> bool:
        """Prefill the next chunk of the waiting prompts, oldest first, while this turn's real tokens fit in
        prefill_chunk (at least one chunk); chunks of the same padded length run together, up to the largest
        of prefill_rows per call. Returns whether it ran any."""
        budget, chunks = self.prefill_chunk, []  # (sequence, tokens of its chunk)
        for slot in list(self.prefilling):
            seq = self.slots[slot]
            if seq.cancelled:
                self.prefilling.remove(slot)
                self._finish(slot, "cancelled")
                continue
            if seq.prefilled is None:
                self._reuse_prefix(seq)
            n = min(len(seq.context) - seq.prefilled, self.prefill_chunk)
            if chunks and n > budget:
                break
            chunks.append((seq, n))
            budget -= n
        groups: dict[int, list[Sequence]] = {}  # by padded chunk length
        for seq, n in chunks:
            groups.setdefault(bucket(n, self.prefill_chunk), []).append(seq)
        most = self.prefill_rows[-1]
        for C, seqs in groups.items():
            for i in range(0, len(seqs), most):
                self._prefill_chunk(seqs[i:i + most], C)
        done = [seq for seq, _ in chunks if seq.decoding]
        for seq in done:
            self.prefilling.remove(seq.slot)
        if self.page_size:
            for seq in done:
                self.pages.register(seq.context, seq.pages, seq.adapter)
        elif self.prefix is not None:  # the last prompts in: keeping more than the store holds would evict them
            for seq in [seq for seq in done if seq.adapter < 0][-len(self.prefix.tokens):]:
                self.prefix.save(self.cache, seq.slot, seq.prompt)
        return bool(chunks)

    def _prefill_chunk(self, seqs: list[Sequence], C: int, fresh: bool | None = None) -> None:
        """Run the next chunk of each of seqs' prompts (at most C tokens) into its slot, in one call padded to
        the smallest of prefill_rows that holds them (padding rows take slot B, which writes nothing). When all
        the chunks start their prompts (and fit, kvcache.fresh_fits), the call neither reads nor keeps what the
        slots held (`fresh`, unless given)."""
        P = min(p for p in self.prefill_rows if p >= len(seqs))
        if fresh is None:
            fresh = all(seq.prefilled == 0 for seq in seqs) and (
                self.page_size > 0 or kvcache.fresh_fits(self.cache, C))
        tokens_PC, start_P = np.zeros((P, C), np.int32), np.zeros(P, np.int32)
        length_P, slot_P, adapter_P = np.ones(P, np.int32), np.full(P, self.B, np.int32), np.full(P, -1, np.int32)
        next_PC = np.zeros((P, C), np.int32) if self.mtp_draft else None  # each token's next, for the module
        for i, seq in enumerate(seqs):
            n = min(len(seq.context) - seq.prefilled, C)
            tokens_PC[i, :n] = seq.context[seq.prefilled:seq.prefilled + n]
            if next_PC is not None:
                after = seq.context[seq.prefilled + 1:seq.prefilled + n + 1]
                next_PC[i, :len(after)] = after
            start_P[i], length_P[i], slot_P[i] = seq.prefilled, len(seq.context), seq.slot
            adapter_P[i] = seq.adapter
            seq.prefilled += n
            self.prefilled_tokens_total += n
        if self.page_size:
            # Rows past the sequences (padding) have length 0: nothing written. Chunks that start their contexts
            # read only the pages they fill, the others all of their rows' tables.
            length_P[len(seqs):] = 0
            table_PM = self.table[np.minimum(slot_P, self.B - 1)]
            table_PM[len(seqs):] = 0
            width = -(-C // self.page_size) if fresh else self.M
            if self.mtp_draft:
                self.cache, self.draft_cache, self.logits_BV, self.mtp = speculate.prefill_mtp(
                    self.params, self._layer_weights(), self._draft_layer_weights(), self.cache, self.draft_cache,
                    self.logits_BV, self.mtp, tokens_PC, next_PC, start_P, length_P, table_PM[:, :width], slot_P,
                    adapter_P, self.cfg, layout=self.layout)
                self.pending[slot_P[:len(seqs)]] = -1
            else:
                self.cache, self.logits_BV = programs.paged_prefill(self.params, self._layer_weights(), self.cache,
                                                            self.logits_BV, tokens_PC, start_P, length_P,
                                                            table_PM[:, :width], slot_P, adapter_P, self.cfg,
                                                            layout=self.layout)
            if self.draft is not None and not self.mtp_draft:
                self.draft_cache = speculate.prefill(self.draft[0], self._draft_layer_weights(), self.draft_cache,
                                                     tokens_PC, start_P, length_P, table_PM[:, :width], self.draft[1],
                                                     layout=self.layout)
                self.pending[slot_P[:len(seqs)]] = -1  # the next token comes from the logits after the chunk
        else:
            self.cache, self.logits_BV = chunk_lib.prefill_chunks(
                self.params, self.cache, self.logits_BV, tokens_PC, start_P, length_P, slot_P, self.cfg, fresh,
                adapter_P, layout=self.layout)
        self.prefill_calls_total += 1

    def _reuse_prefix(self, seq: Sequence) -> None:
        """Start seq's prefill: copy what the prefix cache holds of its prompt into its slot (the paged cache shares
        pages at admission instead). It holds the base model's prompts only."""
        seq.prefilled = 0
        if self.prefix is not None and seq.adapter < 0:
            entry, reused = self.prefix.match(seq.prompt)
            if reused:
                self.cache = self.prefix.load(self.cache, entry, seq.slot)
                seq.prefilled = reused
                self.prefix_hits_total += 1
                self.prefix_tokens_total += reused

    def _padded_length(self, n: int) -> int:
        """The length a prompt of n tokens is scored at."""
        T = bucket(n, self.S)
        return min(T, self.cfg.block_size) if self.cfg.position == "learned" else T

    def _padded(self, prompt: list[int]) -> np.ndarray:
        T = self._padded_length(len(prompt))
        tokens_1T = np.zeros((1, T), np.int32)
        tokens_1T[0, :len(prompt)] = prompt
        return tokens_1T

    def _run_score(self, item: Score) -> None:
        tokens_1T = self._padded(item.prompt)
        n = len(item.prompt)
        token_lp, top_ids, top_lp = jax.device_get(programs.score(
            self.params, tokens_1T, np.asarray([item.adapter], np.int32), self.cfg, layout=self.layout))
        item.emit(("score", token_lp[:n - 1].tolist(), top_ids[:n].tolist(), top_lp[:n].tolist()))

    def _call(self, rows: list[int], steps: int) -> tuple[list, tuple]:
        """Dispatch one decode call of up to `steps` steps over slots `rows` (a bucket; all slots in order for the
        largest) without waiting for it; returns the sequence each row decodes (None for a row that does not) and
        the call's tokens, log-probabilities, alternatives [N, b(, K)] and which of them were produced [N, b], on
        device. A sequence's tokens so far are those of the calls dispatched before (`planned`), as if none of
        them stopped it at a stop token: when one did, the row's tokens from this call are dropped."""
        b = len(rows)
        live, idle_length, left = np.zeros(b, bool), np.zeros(b, np.int32), np.zeros(b, np.int32)
        length = np.zeros(b, np.int32)  # the paged cache's: positions cached (the prompt's and the tokens' so far)
        seed, choice, count = np.zeros(b, np.uint32), np.zeros(b, np.int32), np.zeros(b, np.int32)
        temperature, top_k, top_p = np.zeros(b, np.float32), np.zeros(b, np.int32), np.ones(b, np.float32)
        want_lp, adapter = np.zeros(b, bool), np.full(b, -1, np.int32)
        seqs = [self.slots[r] for r in rows]
        width = MIN_STOP_WIDTH
        while any(s is not None and len(s.stop_ids) > width for s in seqs):
            width *= 2
        stop = np.full((b, width), -1, np.int32)
        for j, s in enumerate(seqs):
            if s is None:
                continue
            if not s.decoding:
                idle_length[j] = s.prefilled or 0
                seqs[j] = None
                continue
            if s.cancelled or s.planned >= s.max_tokens:  # its last tokens are in flight: idle, as a free slot
                seqs[j] = None
                continue
            live[j], left[j], want_lp[j], adapter[j] = True, s.max_tokens - s.planned, s.logprobs, s.adapter
            # with a draft, a slot's pending token (sent, not cached) is not in its length
            length[j] = len(s.prompt) + s.planned - int(self.draft is not None and self.pending[s.slot] >= 0)
            seed[j], choice[j], count[j] = s.seed % 2**32, s.choice, s.planned
            temperature[j], top_k[j], top_p[j] = s.temperature, s.top_k, s.top_p
            stop[j, :len(s.stop_ids)] = s.stop_ids
            if self.draft is None:  # with one, _collect sets it from the tokens the call sent
                s.planned += min(steps, s.max_tokens - s.planned)
        sampled = (left, stop, want_lp, seed, choice, count, temperature, top_k, top_p)
        rows_b = np.asarray(rows, np.int32)
        if self.draft is not None:
            limit = np.asarray([0 if s is None else len(s.prompt) + s.max_tokens for s in seqs], np.int32)
            *out, self.cache, self.draft_cache, proposed, kept, mtp = speculate.decode_loop(
                self.params, self._layer_weights(), self.draft[0], self._draft_layer_weights(), self.cache,
                self.draft_cache, self.logits_BV, rows_b, adapter, np.int32(steps), live, length,
                self.pending[rows_b], limit, self.table[rows_b], *sampled, cfg=self.cfg, draft_cfg=self.draft[1],
                k=self.draft[2], max_steps=self.decode_steps, mtp=self.mtp if self.mtp_draft else None,
                layout=self.layout)
            if self.mtp_draft:
                self.mtp = mtp
            out.append((proposed, kept))
        elif self.page_size:
            *out, self.logits_BV, self.cache = programs.paged_decode_loop(
                self.params, self._layer_weights(), self.cache, self.logits_BV, rows_b, adapter, np.int32(steps), live,
                length, self.table[rows_b], *sampled, cfg=self.cfg, max_steps=self.decode_steps, layout=self.layout)
        else:
            *out, self.logits_BV, self.cache = programs.decode_loop(
                self.params, self.cache, self.logits_BV, rows_b, adapter, np.int32(steps), live, idle_length, *sampled,
                cfg=self.cfg, max_steps=self.decode_steps, unroll=self.unroll, layout=self.layout)
        self.calls_total += 1
        return seqs, tuple(out)

    def _launch(self, steps: int) -> tuple[list, tuple] | None:
        """Dispatch a decode call over the smallest bucket that holds the decoding slots; None when no slot
        has tokens left to plan."""
        busy = [i for i, s in enumerate(self.slots) if s is not None and s.decoding and s.planned < s.max_tokens]
        if not busy:
            return None
        b = min(k for k in self.buckets if k >= len(busy))
        if b == self.B:
            rows = list(range(self.B))
        else:  # padded with free slots and those whose last tokens are in flight, then with slots being
            # prefilled (they run a dummy token, as above)
            live = set(busy)
            idle = [i for i, s in enumerate(self.slots) if s is None or (s.decoding and i not in live)]
            rows = busy + (idle + list(self.prefilling))[:b - len(busy)]
        return self._call(rows, steps)

    def _collect(self, call: tuple[list, tuple]) -> None:
        """Wait for a dispatched decode call and send each sequence still in its slot the tokens it made."""
        seqs, out = call
        if self.draft is not None:
            out, (proposed, kept) = jax.device_get((out[:5], out[5]))
            self.draft_proposed_total += int(proposed)
            self.draft_accepted_total += int(kept)
        tok, lp, top_ids, top_lp, made = jax.device_get(out)
        made_b = made.sum(axis=0).tolist()  # a row makes tokens in the first steps of a call, until it stops
        # by row, as Python lists in one conversion each (log-probabilities only when a row wants them)
        tok = tok.T.tolist()
        wanted = [s.alternatives for s in seqs if s is not None and s.logprobs]
        if wanted:
            K = min(max(wanted), self.cfg.vocab_size)
            lp, top_ids, top_lp = lp.T.tolist(), *(x[:, :, :K].transpose(1, 0, 2).tolist() for x in (top_ids, top_lp))
        now = time.perf_counter()
        n = 0
        for j, s in enumerate(seqs):
            k = made_b[j]
            # a sequence that ended (a stop token in the call before, a cancel) has left its slot: drop its tokens
            if s is None or not k or s.cancelled or self.slots[s.slot] is not s:
                continue
            if s.generated == 0:
                self.ttft_s.append(now - s.submitted)
            ids = tok[j][:k]
            if s.logprobs:
                s.emit(("tokens", ids, lp[j][:k], (top_ids[j][:k], top_lp[j][:k])))
            else:
                s.emit(("tokens", ids, None, None))
            s.generated += k
            s.out += ids
            n += k
            if self.draft is not None:
                s.planned = s.generated
                self.pending[s.slot] = ids[-1]
            if ids[-1] in s.stop_ids:  # the call stopped the row at its stop token or at its max_tokens
                self._finish(s.slot, "stop")
            elif s.generated >= s.max_tokens:
                self._finish(s.slot, "length")
        self.tokens_total += n
        self.recent.append((now, n))
        while self.recent and self.recent[0][0] < now - 60:
            self.recent.popleft()

    def _finish(self, slot: int, reason: str) -> None:
        s = self.slots[slot]
        self.slots[slot] = None
        self._release(s)
        s.emit(("done", reason))

