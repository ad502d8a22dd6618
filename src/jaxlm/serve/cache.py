"""The engine's KV cache on device, which serve/engine.py schedules sequences over: paged (serve.page_size > 0: a
pool of pages, each slot's page table a row of `table`, pages handed out and prompt prefixes shared by
serve/pages.py) or the slot cache (each slot the whole context of model/kvcache.py, recent prompts kept for reuse
by serve/prefix_cache.py), with the logits after each slot's last token, a speculative draft's own cache and the
weights taken apart by layer. It runs the device programs over them (serve/programs.py, serve/chunk.py,
serve/speculate.py): a prefill chunk, a decode call, a prompt's scores.

Shape legend: B slots, b rows of a call, P rows of a prefill call, C chunk length, T padded prompt length,
M pages per sequence, V vocab, J draft tokens + 1, D model width.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm import runtime, sharding
from jaxlm.config import ModelConfig, ServeConfig
from jaxlm.infer import generate, speculative
from jaxlm.infer.sampling import RowSampling
from jaxlm.infer.speculative import Draft
from jaxlm.model import decode, kvcache, paged
from jaxlm.model.mtp import mtp_pool, mtp_weights
from jaxlm.serve import chunk as chunk_lib, programs, speculate
from jaxlm.serve.pages import PagePool
from jaxlm.serve.prefix_cache import PrefixCache
from jaxlm.serve.requests import Score, Sequence

MIN_BUCKET = 16


def bucket(n: int, limit: int) -> int:
    """Padded length of n tokens (a prompt to score, a chunk to prefill): the next of MIN_BUCKET, 2 MIN_BUCKET,
    4 MIN_BUCKET and from there powers of two and one and a half times them (96, 128, 192, 256, 384, ...), at
    most `limit` (or n when n is past it). The half steps pad long-tailed prompts less than powers of two alone
    for a few more compiled lengths; short chunks cost mostly a call's fixed time, so they keep the coarse steps
    (docs/serve.md, "Chunked prefill")."""
    b = MIN_BUCKET
    while b < n:
        if b < 4 * MIN_BUCKET:
            b *= 2
        elif b & (b - 1) == 0:  # a power of two: one and a half times it next
            b = b * 3 // 2
        else:  # one and a half times a power of two: the next power of two
            b = b * 4 // 3
    return min(b, max(limit, n))


class Cache:
    """One engine's device state (the module docstring says what), for sc.max_slots slots of `length` positions:
    `reset()` empties it, `release()` drops it. With the paged cache, cache_pages pages (None: as many as give
    every slot the whole context, the slot cache's memory)."""

    def __init__(self, params, cfg: ModelConfig, sc: ServeConfig, length: int, quantize: bool,
                 cache_pages: int | None, draft: Draft | None, mesh: jax.sharding.Mesh | None,
                 rules: tuple[sharding.Rules, sharding.Rules], page_format: paged.PoolFormat | None):
        self.cfg, self.B, self.S, self.quantize = cfg, sc.max_slots, length, quantize
        self.draft, self._draft_layer_params = draft, None
        self.pending = np.full(self.B, -1, np.int32)  # with a draft: each slot's token sent but not yet cached
        # Every program is traced in the mesh and rules of `layout`, its static argument (programs.py). The paged
        # cache's format (padding, page-attention kernel) is the devices' (None: paged.pool_format of their
        # platform; tests give their own), decided here once: a server compiled for a TPU from a CPU host gets the
        # TPU's.
        self.layout = sharding.layout(mesh, rules[1], param_rules=rules[0])
        platform = runtime.platform(mesh)
        self.page_format = (paged.pool_format(platform, sc.attention_kernel, sc.attention_kernel_options)
                            if page_format is None else page_format)
        self.page_size, self.prefix_entries = paged.page_size(sc.page_size, self.page_format), sc.prefix_cache
        rings = [n for n in map(partial(kvcache.ring, cfg), cfg.pattern) if n is not None]
        self.ring = min(rings) if rings else None  # the shortest local window or chunk
        if self.page_size:  # each sequence's page table a row of `table` [slots, pages per sequence]
            self.M = -(-length // self.page_size)
            self.NP = cache_pages or self.B * self.M
            self.table = np.zeros((self.B, self.M), np.int32)
        # The decode program's layers unrolled over the cache taken apart (programs.decode_loop), else scanned. Taking
        # it apart and back costs two copies of the rows' cache per call: with one step per call that lost to
        # the scan's copies of one step (docs/serve.md, "How it works").
        self.unroll = cfg.n_layers <= generate.UNROLL_LAYERS and (sc.decode_steps > 1 or self.page_size > 0)
        self.params = params
        self.reset()

    @property
    def params(self):
        return self._params

    @params.setter
    def params(self, params) -> None:
        """New weights (GRPO's rollouts over the trainer's latest) for the calls from now on."""
        self._params, self._layer_params = params, None

    def layer_weights(self):
        """The paged programs' layers unrolled over weights taken apart once, at the first call after new params
        (None: scanned). Taken apart inside the program, every call copied all the weights (docs/serve.md, "The
        paged KV cache"); the copies cost the weights' memory once more, until release()."""
        if not (self.unroll and self.page_size):
            return None
        if self._layer_params is None:
            self._layer_params = jax.jit(decode.layer_weights, static_argnums=1)(self._params, self.cfg)
        return self._layer_params

    def draft_layer_weights(self):
        """The draft's layers taken apart once, as layer_weights (None: scanned, for a deep draft); the multi-token
        prediction module's weights (mtp_weights) when it drafts."""
        d = self.draft
        if d.mtp:
            if self._draft_layer_params is None:
                self._draft_layer_params = jax.jit(mtp_weights, static_argnums=1)(self._params, self.cfg)
            return self._draft_layer_params
        if d.cfg.n_layers > generate.UNROLL_LAYERS:
            return None
        if self._draft_layer_params is None:
            self._draft_layer_params = jax.jit(decode.layer_weights, static_argnums=1)(d.params, d.cfg)
        return self._draft_layer_params

    def reset(self) -> None:
        """Empty cache, logits and prefix cache (at start, and after a failed call consumed the donated ones)."""
        self.logits_BV = jnp.zeros((self.B, self.cfg.vocab_size), jnp.float32)
        if self.page_size:
            self.cache = programs.empty_pages(self.cfg, self.NP, self.page_size, self.quantize, self.page_format,
                                              self.layout)
            if self.draft is not None and self.draft.mtp:  # the module's pool, and each slot's state between calls
                self.draft_cache = mtp_pool(self.cfg, self.NP, self.page_size, self.page_format)
                J, D, dt = self.draft.k + 1, self.cfg.d_model, jnp.dtype(self.cfg.compute_dtype)
                self.mtp = {"hidden_BD": jnp.zeros((self.B, D), dt), "prev_B": jnp.zeros((self.B,), jnp.int32),
                            "hid_BJD": jnp.zeros((self.B, J, D), dt), "next_BJ": jnp.zeros((self.B, J), jnp.int32)}
            elif self.draft is not None:
                self.draft_cache = programs.empty_pages(self.draft.cfg, self.NP, self.page_size, self.quantize,
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

    def release(self) -> None:
        """Drop the KV cache, the prefix cache, the last logits and the weights taken apart by layer (reset() makes
        them again)."""
        self.cache = self.logits_BV = self.prefix = self._layer_params = None
        self.draft_cache = self._draft_layer_params = self.mtp = None

    def warm_up(self) -> None:
        """Compile the prefix cache's copies."""
        if self.prefix is not None:
            self.cache = self.prefix.warm_up(self.cache)

    # ---- what fits, and the paged cache's pages -----------------------------------------------------------------

    def pages_used(self) -> int:
        """Pages of the paged cache some sequence holds (0 with the slot cache)."""
        return self.pages.used() if self.page_size else 0

    def pages_total(self) -> int:
        return self.NP if self.page_size else 0

    def never_fits(self, tokens: int) -> str | None:
        """Why a sequence of `tokens` positions (prompt and new tokens) can never run here, or None: past a slot's
        positions, or (paged) past the pages of the whole cache."""
        if tokens > self.S:
            return f"{tokens} positions (prompt and new tokens) do not fit in the {self.S} of a sequence"
        if self.page_size and -(-tokens // self.page_size) > self.NP:
            return (f"{tokens} positions (prompt and new tokens) need more than the {self.NP} pages of "
                    f"{self.page_size} positions of the KV cache (serve.cache_gib)")
        return None

    def reusable(self, item: Sequence | Score) -> int:
        """Tokens of item's prompt the cache holds already (shared pages, or the prefix cache's best entry)."""
        if not isinstance(item, Sequence):
            return 0
        if self.page_size:
            return self.pages.shared(item.context_key, item.adapter)
        return 0 if self.prefix is None or item.adapter >= 0 else self.prefix.match(item.context_key)[1]

    def take_pages(self, seq: Sequence) -> bool:
        """Give seq the pages its context fills: the registered ones that hold a prefix of it (prefilled already),
        and free ones for the rest. False (nothing taken) when too few are free. A prompt with images shares only
        pages that hold all of its images (else its images' prefill, from position 0, would write into them)."""
        A, n = self.page_size, len(seq.context)
        shared = self.pages.match(seq.context_key, seq.adapter)
        if len(shared) * A < seq.image_end:
            self.pages.release(shared)
            shared = []
        need = -(-n // A) - len(shared)
        if need > self.pages.available():
            self.pages.release(shared)
            return False
        seq.pages = shared + self.pages.take(need)
        seq.prefilled = len(shared) * A
        return True

    def seat(self, seq: Sequence) -> None:
        """seq has taken its slot: its pages go into the slot's page table."""
        if self.page_size:
            self.table[seq.slot, :len(seq.pages)] = seq.pages

    def grow(self, seq: Sequence, more: int) -> None:
        """Give decoding seq `more` pages (for the positions of the next call)."""
        self.table[seq.slot, len(seq.pages):len(seq.pages) + more] = new = self.pages.take(more)
        seq.pages += new

    def give_back(self, seq: Sequence) -> None:
        """seq leaves its slot: its pages go back to the pool."""
        if self.page_size and seq.pages:
            self.pages.release(seq.pages)
            self.table[seq.slot] = 0
            seq.pages = []

    def reuse_prefix(self, seq: Sequence) -> int:
        """Start seq's prefill: copy what the prefix cache holds of its prompt into its slot (the paged cache shares
        pages at admission instead); returns the tokens reused. It holds the base model's prompts only, and a prompt
        with images reuses only an entry that holds all of them."""
        seq.prefilled = 0
        if self.prefix is not None and seq.adapter < 0:
            entry, reused = self.prefix.match(seq.context_key)
            if reused >= max(seq.image_end, 1):
                self.cache = self.prefix.load(self.cache, entry, seq.slot)
                seq.prefilled = reused
                return reused
        return 0

    def keep_prompts(self, done: list[Sequence]) -> None:
        """Prompts whose prefill just ended, kept for later prompts that start the same: their full pages registered,
        or (slot cache) the last ones copied into the prefix cache (keeping more than it holds would evict them),
        under their keys (Sequence.key). A paged prompt whose images reach past a local layer's window is not kept:
        its images' prefill left that layer's earlier positions unwritten (programs.paged_prefill_images)."""
        if self.page_size:
            for seq in done:
                if self.ring is None or seq.image_end <= self.ring:
                    self.pages.register(seq.context_key, seq.pages, seq.adapter)
        elif self.prefix is not None:
            for seq in [seq for seq in done if seq.adapter < 0][-len(self.prefix.tokens):]:
                self.prefix.save(self.cache, seq.slot, seq.context_key)

    # ---- device calls -----------------------------------------------------------------------------------------

    def fresh_fits(self, C: int) -> bool:
        """Whether chunks of C tokens that start their prompts may run `fresh` (kvcache.fresh_fits; always paged)."""
        return self.page_size > 0 or kvcache.fresh_fits(self.cache, C)

    def prefill(self, seqs: list[Sequence], C: int, P: int, fresh: bool | None = None) -> None:
        """Run the next chunk of each of seqs' prompts (at most C tokens) into its slot, in one call of P rows
        (padding rows take slot B, which writes nothing). When all the chunks start their prompts (and fit,
        kvcache.fresh_fits), the call neither reads nor keeps what the slots held (`fresh`, unless given)."""
        if fresh is None:
            fresh = all(seq.prefilled == 0 for seq in seqs) and self.fresh_fits(C)
        tokens_PC, start_P = np.zeros((P, C), np.int32), np.zeros(P, np.int32)
        length_P, slot_P, adapter_P = np.ones(P, np.int32), np.full(P, self.B, np.int32), np.full(P, -1, np.int32)
        mtp = self.draft is not None and self.draft.mtp
        next_PC = np.zeros((P, C), np.int32) if mtp else None  # each token's next, for the module
        for i, seq in enumerate(seqs):
            n = min(len(seq.context) - seq.prefilled, C)
            tokens_PC[i, :n] = seq.context[seq.prefilled:seq.prefilled + n]
            if next_PC is not None:
                after = seq.context[seq.prefilled + 1:seq.prefilled + n + 1]
                next_PC[i, :len(after)] = after
            start_P[i], length_P[i], slot_P[i] = seq.prefilled, len(seq.context), seq.slot
            adapter_P[i] = seq.adapter
            seq.prefilled += n
        if not self.page_size:
            self.cache, self.logits_BV = chunk_lib.prefill_chunks(
                self.params, self.cache, self.logits_BV, tokens_PC, start_P, length_P, slot_P, self.cfg, fresh,
                adapter_P, layout=self.layout)
            return
        # Rows past the sequences (padding) have length 0: nothing written. Chunks that start their contexts
        # read only the pages they fill, the others all of their rows' tables.
        length_P[len(seqs):] = 0
        table_PM = self.table[np.minimum(slot_P, self.B - 1)]
        table_PM[len(seqs):] = 0
        width = -(-C // self.page_size) if fresh else self.M
        if mtp:
            self.cache, self.draft_cache, self.logits_BV, self.mtp = speculate.prefill_mtp(
                self.params, self.layer_weights(), self.draft_layer_weights(), self.cache, self.draft_cache,
                self.logits_BV, self.mtp, tokens_PC, next_PC, start_P, length_P, table_PM[:, :width], slot_P,
                adapter_P, self.cfg, layout=self.layout)
            self.pending[slot_P[:len(seqs)]] = -1
        else:
            self.cache, self.logits_BV = programs.paged_prefill(self.params, self.layer_weights(), self.cache,
                                                                self.logits_BV, tokens_PC, start_P, length_P,
                                                                table_PM[:, :width], slot_P, adapter_P, self.cfg,
                                                                layout=self.layout)
        if self.draft is not None and not mtp:
            self.draft_cache = speculate.prefill(self.draft.params, self.draft_layer_weights(), self.draft_cache,
                                                 tokens_PC, start_P, length_P, table_PM[:, :width], self.draft.cfg,
                                                 layout=self.layout)
            self.pending[slot_P[:len(seqs)]] = -1  # the next token comes from the logits after the chunk

    def prefill_images(self, seq: Sequence) -> None:
        """Prefill seq's context up to its last image token whole, with its images (one call; the rest of its prompt
        goes by chunks, as any)."""
        n = seq.image_end
        tokens_1T = np.zeros((1, bucket(n, self.S)), np.int32)
        tokens_1T[0, :n] = seq.context[:n]
        length_1, slot_1 = np.asarray([n], np.int32), np.asarray([seq.slot], np.int32)
        adapter_1 = np.asarray([seq.adapter], np.int32)
        if self.page_size:
            self.cache, self.logits_BV = programs.paged_prefill_images(
                self.params, self.cache, self.logits_BV, tokens_1T, length_1, seq.images, self.table[seq.slot][None],
                slot_1, adapter_1, self.cfg, layout=self.layout)
        else:
            self.cache, self.logits_BV = programs.slot_prefill_images(
                self.params, self.cache, self.logits_BV, tokens_1T, length_1, seq.images, slot_1, adapter_1, self.cfg,
                self.quantize, layout=self.layout)
        seq.prefilled = n

    def decode(self, rows: list[int], adapter_b, steps: int, live_b, length_b, idle_length_b, limit_b,
               sampled: RowSampling, max_steps: int) -> tuple:
        """Dispatch one decode call of up to `steps` steps over slots `rows` without waiting for it (length_b the
        paged cache's positions cached per row, idle_length_b the slot cache's dummy positions of rows not
        living, limit_b the positions a draft's rows may use); returns its tokens, log-probabilities,
        alternatives [N, b(, K)] and which of them were made [N, b] on device, with a draft then (proposed,
        kept)."""
        rows_b = np.asarray(rows, np.int32)
        if self.draft is not None:
            *out, self.cache, self.draft_cache, proposed, kept, _, mtp = speculative.decode_loop(
                self.params, self.layer_weights(), self.draft, self.draft_layer_weights(), self.cache,
                self.draft_cache, self.logits_BV, rows_b, adapter_b, np.int32(steps), live_b, length_b,
                self.pending[rows_b], limit_b, self.table[rows_b], sampled, cfg=self.cfg, max_steps=max_steps,
                mtp=self.mtp if self.draft.mtp else None, layout=self.layout)
            if self.draft.mtp:
                self.mtp = mtp
            out.append((proposed, kept))
        elif self.page_size:
            *out, self.logits_BV, self.cache = programs.paged_decode_loop(
                self.params, self.layer_weights(), self.cache, self.logits_BV, rows_b, adapter_b, np.int32(steps),
                live_b, length_b, self.table[rows_b], sampled, cfg=self.cfg, max_steps=max_steps,
                layout=self.layout)
        else:
            *out, self.logits_BV, self.cache = programs.decode_loop(
                self.params, self.cache, self.logits_BV, rows_b, adapter_b, np.int32(steps), live_b, idle_length_b,
                sampled, cfg=self.cfg, max_steps=max_steps, unroll=self.unroll, layout=self.layout)
        return tuple(out)

    def padded_length(self, n: int) -> int:
        """The length a prompt of n tokens is scored at."""
        T = bucket(n, self.S)
        return min(T, self.cfg.block_size) if self.cfg.position == "learned" else T

    def score(self, item: Score) -> tuple:
        """item's ("score", token log-probabilities, top ids, top log-probabilities) event, by the uncached forward
        pass over its prompt padded to padded_length."""
        n = len(item.prompt)
        tokens_1T = np.zeros((1, self.padded_length(n)), np.int32)
        tokens_1T[0, :n] = item.prompt
        token_lp, top_ids, top_lp = jax.device_get(programs.score(
            self.params, tokens_1T, np.asarray([item.adapter], np.int32), self.cfg, layout=self.layout))
        return "score", token_lp[:n - 1].tolist(), top_ids[:n].tolist(), top_lp[:n].tolist()
