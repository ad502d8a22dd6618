"""The continuous-batching engine: decode slots sharing one KV cache on device (serve/cache.py), fed from a queue of
requests (serve/requests.py) by one thread that owns the device. Each turn admits waiting requests into free slots
(with the paged cache once their pages are free; when pages run out the sequences admitted last are preempted),
scores and prefills prompts a chunk at a time within serve.prefill_chunk's budget, dispatches one decode call of
up to serve.decode_steps steps over the smallest row bucket that holds the decoding slots, and hands out the
tokens of the call before while the device runs it. docs/serve.md ("How it works", "The paged KV cache") tells
the whole story, with the figures behind it.

Shape legend: B slots, b rows of a bucket, N steps of a decode call at most, M stop tokens of a row (padded),
P rows of a prefill call, C chunk length, V vocab, K top log-probabilities.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from functools import partial
from typing import Callable

import jax
import numpy as np

from jaxlm import sharding
from jaxlm.config import ModelConfig, ServeConfig
from jaxlm.infer import speculative
from jaxlm.infer.sampling import RowSampling
from jaxlm.infer.speculative import Draft
from jaxlm.model import layers, paged
from jaxlm.serve.cache import Cache, bucket
from jaxlm.serve.requests import QueueFull, Score, Sequence, check, ended

ENGINE_FAILED = "the engine failed while running this request (the server's log has the error)"
log = logging.getLogger("jaxlm.serve")
MIN_STOP_WIDTH = 4  # stop tokens per row the decode program takes (more compile a wider one, once)
MAX_PREFILL_ROWS = 16  # prompts' chunks prefilled in one call at most
# rows of the decode program's variants below an eighth of the slots: a call of one to four live sequences (one
# request alone, the last long ones of a burst) runs on 1 or 4 rows, not 8 (docs/serve.md, "Row buckets")
ROW_BUCKETS_SMALL = (1, 4)


class Engine:
    """`submit(item)` queues a sequence or a score (raises QueueFull past max_queue waiting), `cancel(item)` ends
    it, `run(items)` submits and waits for them; the engine thread runs from `start()` to `stop()`, and calls its
    `turn_hooks` after each turn (the app hands the turn's events to the event loop at once). /metrics reads its
    counters (the *_total attributes)."""

    def __init__(self, params, cfg: ModelConfig, sc: ServeConfig, cache_length: int, *,
                 quantize_kv_cache: bool = False, cache_pages: int | None = None, draft: Draft | None = None,
                 mesh: jax.sharding.Mesh | None = None,
                 rules: tuple[sharding.Rules, sharding.Rules] = (sharding.PARAM_RULES, sharding.ACTIVATION_RULES),
                 page_format: paged.PoolFormat | None = None):
        """An engine over the model (params, cfg; on `mesh`, sharded by `rules`: the parameter and the activation
        rules) with serve.* settings `sc` (its max_slots slots of cache_length positions, max_queue, prefill_chunk,
        prefix_cache, decode_steps and page_size; the paged cache of cache_pages pages, None: every slot the whole
        context), decode.quantize_kv_cache, and a speculative `draft` (decode.draft; needs the paged cache)."""
        if draft is not None and not sc.page_size:
            raise ValueError("speculative decoding (decode.draft) in the server needs the paged KV cache "
                             "(serve.page_size > 0)")
        if draft is not None:
            if draft.mtp:
                speculative.check_mtp(cfg)
            speculative.check_draft(cfg, draft.cfg or cfg, cache_length)
        self.cfg, self.B, self.S, self.mesh, self.draft = cfg, sc.max_slots, cache_length, mesh, draft
        self.max_queue, self.prefill_chunk, self.decode_steps = sc.max_queue, sc.prefill_chunk, sc.decode_steps
        # rows of the decode program's compiled variants, largest first; on a mesh a bucket must split evenly
        # over the devices as the slots do
        shards, slots = 1 if mesh is None else mesh.size, self.B
        self.buckets = sorted({b for b in [slots // d for d in (1, 2, 4, 8) if slots % d == 0] + list(ROW_BUCKETS_SMALL)
                               if b <= slots and b % shards == 0} | {slots}, reverse=True)
        # rows of the prefill program's variants (serve/chunk.py), smallest first: powers of two up to the slots
        self.prefill_rows = [1 << i for i in range(min(slots, MAX_PREFILL_ROWS).bit_length())]
        self.turn_hooks: list[Callable[[], None]] = []  # called after each turn, from the engine thread
        self.waiting: collections.deque = collections.deque()
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.slots: list[Sequence | None] = [None] * slots
        self.prefilling: collections.deque = collections.deque()  # slots whose prompt is not all in, oldest first
        self.in_flight: tuple[list, tuple] | None = None  # the decode call dispatched last turn, not yet collected
        self.running, self.thread, self.error = False, None, None
        self.admissions = 0
        self.calls_total = 0  # decode calls run
        self.preempted_total = 0  # sequences preempted when the paged cache ran out of pages
        self.draft_proposed_total = self.draft_accepted_total = 0
        self.tokens_total = self.requests_total = self.prompt_tokens_total = 0
        self.prefilled_tokens_total = 0  # prompt tokens run through the model (not taken from the prefix cache)
        self.prefill_calls_total = self.prefix_hits_total = self.prefix_tokens_total = 0
        self.ttft_s: collections.deque = collections.deque(maxlen=1000)  # the latest times to first token
        self.recent: collections.deque = collections.deque()  # (time, tokens) of the last steps, for tokens/s
        # LoRA adapters over the base (lora.serving_weights: layers.RowLoraWeight), a sequence's picked by its
        # `adapter`; every call sets each row's (layers.with_rows)
        rows_lora = [w for w in jax.tree.leaves(params, is_leaf=lambda w: isinstance(w, layers.RowLoraWeight))
                     if isinstance(w, layers.RowLoraWeight)]
        self.adapters = rows_lora[0].a.shape[-2] if rows_lora else 0
        self.kv = Cache(params, cfg, sc, cache_length, quantize_kv_cache, cache_pages, draft, mesh, rules,
                        page_format)

    @property
    def params(self):
        return self.kv.params

    @params.setter
    def params(self, params) -> None:
        """New weights (GRPO's rollouts over the trainer's latest) for the calls from now on."""
        self.kv.params = params

    def release_cache(self) -> None:
        """Drop the KV cache (with the prefix cache, the last logits and the weights taken apart by layer) while the
        engine is stopped and idle: GRPO keeps one engine between batches of rollouts and frees its cache for the
        update (train/grpo.py). reserve_cache makes it again."""
        self.kv.release()

    def reserve_cache(self) -> None:
        self.kv.reset()

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

    def run(self, items: list[Sequence | Score], timeout: float | None = None) -> list[list[tuple]]:
        """Submit `items`, wait until each has ended, and return each one's events in order (an item's own `emit`,
        when it has one, gets them too). A stopped engine is started once all are submitted and stopped after
        them. Raises QueueFull as submit does, TimeoutError after `timeout` seconds."""
        events: list[list[tuple]] = [[] for _ in items]
        left = threading.Semaphore(0)

        def collect(item, got: list, emit, event: tuple) -> None:
            got.append(event)
            if emit is not None:
                emit(event)
            if ended(item, event):
                left.release()

        for item, got in zip(items, events):
            item.emit = partial(collect, item, got, item.emit)
        for item in items:
            self.submit(item)
        started = not self.running
        if started:
            self.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for _ in items:
                if not left.acquire(timeout=None if deadline is None else max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"the engine did not finish {len(items)} requests within {timeout} s")
        finally:
            if started:
                self.stop()
        return events

    def busy_slots(self) -> int:
        return sum(s is not None for s in self.slots)

    def queue_depth(self) -> int:
        return len(self.waiting)

    def pages_used(self) -> int:
        return self.kv.pages_used()

    def pages_total(self) -> int:
        return self.kv.pages_total()

    def never_fits(self, tokens: int) -> str | None:
        return self.kv.never_fits(tokens)

    def tokens_per_s(self, window_s: float = 10.0) -> float:
        now = time.perf_counter()
        recent = [(t, n) for t, n in list(self.recent) if t > now - window_s]
        return sum(n for _, n in recent) / window_s

    def warm_up(self) -> None:
        """Compile the decode program of each bucket, the shortest chunk's prefill for each of prefill_rows,
        scoring and the prefix cache's copies before the first request: one-token prompts in slots that stay
        idle, then idle decode calls."""
        C = bucket(1, self.prefill_chunk)
        for P in self.prefill_rows:
            # prompts' first chunks (unless a ring buffer is shorter than the chunk), and later chunks or after a prefix
            for fresh in (True, False) if self.kv.fresh_fits(C) else (False,):
                self._prefill_chunk([Sequence([0], 1, 0.0, 0, 1.0, 0, 0, (), None, slot=i, prefilled=0)
                                     for i in range(P)], C, fresh)
        self.kv.warm_up()
        self.prefilled_tokens_total = self.prefill_calls_total = 0
        self.kv.score(Score([0, 0], None))
        for b in self.buckets:
            jax.device_get(self._call(list(range(b)), 1)[1])
        jax.block_until_ready((self.kv.cache, self.kv.logits_BV))

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
                    self._fail(e)
            self._hand_over()
            if not busy and not more:
                self.wake.wait(0.05)
                self.wake.clear()
        for i, s in enumerate(self.slots):
            if s is not None:
                self._finish(i, "cancelled")
        self._hand_over()

    def _fail(self, e: Exception) -> None:
        """A device call failed and took the cache donated to it: fail every slot's sequence, start afresh."""
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
        self.kv.reset()

    def _hand_over(self) -> None:
        for hook in self.turn_hooks:
            hook()

    def _turn(self) -> None:
        """Prefill, dispatch the next decode call, then hand out the tokens of the call dispatched last turn while
        the device runs this one. A call runs one step in a turn that prefilled (a new request's first token comes
        after one step), else serve.decode_steps; while requests wait for a slot, no more than the nearest
        sequence needs to reach its max_tokens. A call is planned without the tokens of the one in flight (a
        sequence's `planned`); when requests wait and the call in flight ends a sequence at its max_tokens, the
        turn collects it first, so the waiting request takes the slot at once."""
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
        if planned and self.kv.page_size:
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
                    cost = self.kv.padded_length(len(item.prompt))
                    if budget < min(cost, self.prefill_chunk):
                        return True
                    budget -= cost
                self.waiting.popleft()
            if item.cancelled:
                item.emit(("done", "cancelled") if isinstance(item, Sequence) else ("error", "cancelled", 499))
                continue
            try:
                check(item, self.cfg.vocab_size, self.adapters, self.S, self.never_fits)
            except ValueError as e:  # a value the programs cannot hold: this request fails alone
                item.emit(("error", str(e), 400))
                continue
            try:
                if isinstance(item, Score):
                    item.emit(self.kv.score(item))
                    continue
                if self.kv.page_size and not self._take_pages(item):
                    with self.lock:
                        self.waiting.appendleft(item)  # until pages are given back
                    return False
                item.slot = self.slots.index(None)
                self.slots[item.slot] = item
                self.prefilling.append(item.slot)
                self.kv.seat(item)
                if item.resumed is None:
                    self.requests_total += 1
                    self.prompt_tokens_total += len(item.prompt)
            except Exception:  # noqa: BLE001 - scoring's call failed: this request fails alone; the slots keep decoding
                log.error("jaxlm serve: a request failed at its admission", exc_info=True)
                item.emit(("error", ENGINE_FAILED, 500))

    def _take_pages(self, seq: Sequence) -> bool:
        """Give seq the pages its context fills (Cache.take_pages); False when too few are free."""
        if not self.kv.take_pages(seq):
            return False
        self.admissions += 1
        seq.admitted = self.admissions
        if seq.prefilled:  # pages shared with an earlier prompt
            self.prefix_hits_total += 1
            self.prefix_tokens_total += seq.prefilled
        return True

    def _reserve(self, steps: int) -> None:
        """Paged cache: give every decoding sequence the pages its next `steps` tokens go to. When too few are
        free, the call in flight is collected (it may end sequences), then the sequences admitted last are
        preempted (their pages given back; they wait at the head of the queue, to prefill their prompt and the
        tokens sent so far again) until the rest fit."""
        A = self.kv.page_size
        per_step = 1 if self.draft is None else self.draft.k + 1
        while True:
            want = {}
            for s in self.slots:
                if s is not None and s.decoding and not s.cancelled and s.planned < s.max_tokens:
                    n = min(steps * per_step, s.max_tokens - s.planned)
                    more = -(-(len(s.prompt) + s.planned + n) // A) - len(s.pages)
                    if more > 0:
                        want[s.slot] = more
            if sum(want.values()) <= self.kv.pages.available():
                break
            if self.in_flight is not None:
                self._collect(self.in_flight)
                self.in_flight = None
                continue
            victim = max((s for s in self.slots if s is not None), key=lambda s: s.admitted)
            self._preempt(victim)
        for slot, more in want.items():
            self.kv.grow(self.slots[slot], more)

    def _preempt(self, s: Sequence) -> None:
        """Free s's slot and pages and queue it first again, to prefill its prompt and the tokens it has sent."""
        if s.slot in self.prefilling:
            self.prefilling.remove(s.slot)
        self.slots[s.slot] = None
        self.kv.give_back(s)
        s.slot, s.prefilled, s.planned = -1, None, s.generated
        s.resumed = s.prompt + s.out if s.out else None
        self.preempted_total += 1
        with self.lock:
            self.waiting.appendleft(s)

    def _prefill(self) -> bool:
        """Prefill the next chunk of the waiting prompts, oldest first, while this turn's real tokens fit in
        prefill_chunk (at least one chunk); chunks of the same padded length run together, up to the largest
        of prefill_rows per call. A prompt starts after what the prefix cache holds of it; a prompt with images
        first runs its tokens up to its last image token whole, in a call of its own (Cache.prefill_images: an
        image's tokens see one another), then the rest by chunks. Returns whether it ran any."""
        budget, chunks, wholes = self.prefill_chunk, [], []  # (sequence, tokens of its chunk); image prompts
        for slot in list(self.prefilling):
            seq = self.slots[slot]
            if seq.cancelled:
                self.prefilling.remove(slot)
                self._finish(slot, "cancelled")
                continue
            if seq.prefilled is None and (reused := self.kv.reuse_prefix(seq)):
                self.prefix_hits_total += 1
                self.prefix_tokens_total += reused
            whole = seq.prefilled < seq.image_end
            n = seq.image_end if whole else min(len(seq.context) - seq.prefilled, self.prefill_chunk)
            if (chunks or wholes) and n > budget:
                break
            if whole:
                wholes.append(seq)
            else:
                chunks.append((seq, n))
            budget -= n
        for seq in wholes:
            self.prefilled_tokens_total += seq.image_end
            self.kv.prefill_images(seq)
            self.prefill_calls_total += 1
        groups: dict[int, list[Sequence]] = {}  # by padded chunk length
        for seq, n in chunks:
            groups.setdefault(bucket(n, self.prefill_chunk), []).append(seq)
        most = self.prefill_rows[-1]
        for C, seqs in groups.items():
            for i in range(0, len(seqs), most):
                self._prefill_chunk(seqs[i:i + most], C)
        done = [seq for seq in [seq for seq, _ in chunks] + wholes if seq.decoding]
        for seq in done:
            self.prefilling.remove(seq.slot)
        self.kv.keep_prompts(done)
        return bool(chunks or wholes)

    def _prefill_chunk(self, seqs: list[Sequence], C: int, fresh: bool | None = None) -> None:
        """One prefill call (Cache.prefill) of seqs' next chunks, padded to the smallest of prefill_rows that
        holds them."""
        self.prefilled_tokens_total += sum(min(len(seq.context) - seq.prefilled, C) for seq in seqs)
        self.kv.prefill(seqs, C, min(p for p in self.prefill_rows if p >= len(seqs)), fresh)
        self.prefill_calls_total += 1

    def _call(self, rows: list[int], steps: int) -> tuple[list, tuple]:
        """Dispatch one decode call of up to `steps` steps over slots `rows` (a bucket; all slots in order for the
        largest) without waiting for it; returns the sequence each row decodes (None for a row that does not) and
        the call's outputs on device (Cache.decode). A sequence's tokens so far are those of the calls dispatched
        before (`planned`), as if none of them stopped it at a stop token: when one did, the row's tokens from
        this call are dropped."""
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
            length[j] = len(s.prompt) + s.planned - int(self.draft is not None and self.kv.pending[s.slot] >= 0)
            seed[j], choice[j], count[j] = s.seed % 2**32, s.choice, s.planned
            temperature[j], top_k[j], top_p[j] = s.temperature, s.top_k, s.top_p
            stop[j, :len(s.stop_ids)] = s.stop_ids
            if self.draft is None:  # with one, _collect sets it from the tokens the call sent
                s.planned += min(steps, s.max_tokens - s.planned)
        sampled = RowSampling(left, stop, want_lp, seed, choice, count, temperature, top_k, top_p)
        limit = None
        if self.draft is not None:
            limit = np.asarray([0 if s is None else len(s.prompt) + s.max_tokens for s in seqs], np.int32)
        out = self.kv.decode(rows, adapter, steps, live, length, idle_length, limit, sampled, self.decode_steps)
        self.calls_total += 1
        return seqs, out

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
                self.kv.pending[s.slot] = ids[-1]
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
        self.kv.give_back(s)
        s.emit(("done", reason))
