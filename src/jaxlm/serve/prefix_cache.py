"""The prefix cache: recent prompts' keys and values kept on device, so that a request whose prompt starts with
the same tokens (a shared system prompt, the other choices of an `n` > 1 request, a conversation's earlier
turns) copies them into its slot and prefills only the rest. An entry is one slot's cache rows (a kvcache.KVCache
of `entries` sequences, laid out as the engine's), saved when a prompt's prefill ends, with the prompt's tokens on
the host. A new prompt takes the entry that shares its longest prefix, at least MIN_REUSE tokens and at most all
but its last token (whose logits the prefill must give); the positions the entry holds past the shared prefix are
masked by the chunked prefill (serve/chunk.py) and overwritten. A local (sliding-window) layer's ring buffer keeps
only its last window, so an entry whose prompt outgrew the ring is reused only whole, by a prompt that extends
it. The least recently used entry is replaced first.
"""

from __future__ import annotations

from functools import partial

import jax
import numpy as np

from jaxlm import sharding
from jaxlm.config import ModelConfig
from jaxlm.model import kvcache

MIN_REUSE = 16  # fewer shared tokens (a BOS token, a common first word) are not worth a copy of the slot


@partial(jax.jit, donate_argnums=0, static_argnums=4)
def _copy(dst: kvcache.KVCache, src: kvcache.KVCache, dst_row, src_row, layout: sharding.Layout | None
          ) -> kvcache.KVCache:
    with sharding.within(layout):
        return kvcache.copy_row(dst, src, dst_row, src_row)


class PrefixCache:
    """`match(prompt)` finds the entry to reuse, `load` copies it into a slot, `save` keeps a slot's prompt.
    `store` is the on-device cache of the entries, made by the engine (sharded as its own, by `layout`)."""

    def __init__(self, cfg: ModelConfig, store: kvcache.KVCache, length: int, layout: sharding.Layout | None = None):
        self.store, self.layout = store, layout
        entries = int(store.length.shape[0])
        self.tokens: list[np.ndarray | None] = [None] * entries
        self.used = [0] * entries
        self.clock = 0
        rings = [kvcache.slots(cfg, kind, length) for kind in cfg.pattern if kvcache.ring(cfg, kind) is not None]
        self.ring = min(rings) if rings else None  # an entry longer than a ring buffer is reusable only whole

    def _touch(self, entry: int) -> None:
        self.clock += 1
        self.used[entry] = self.clock

    def match(self, prompt: list[int]) -> tuple[int, int]:
        """(entry, tokens reused) for this prompt; (-1, 0) when no entry shares MIN_REUSE tokens with it."""
        p = np.asarray(prompt)
        best = (-1, 0)
        for i, t in enumerate(self.tokens):
            if t is None:
                continue
            n = min(len(t), len(p) - 1)
            differ = np.flatnonzero(t[:n] != p[:n])
            shared = int(differ[0]) if differ.size else n
            if self.ring is not None and len(t) > self.ring and shared < len(t):
                continue
            if shared > best[1]:
                best = (i, shared)
        return best if best[1] >= MIN_REUSE else (-1, 0)

    def load(self, cache: kvcache.KVCache, entry: int, slot: int) -> kvcache.KVCache:
        """`cache` (donated) with slot `slot` holding the entry's rows."""
        self._touch(entry)
        return _copy(cache, self.store, np.int32(slot), np.int32(entry), self.layout)

    def warm_up(self, cache: kvcache.KVCache) -> kvcache.KVCache:
        """Compile both copies (slot 0 to entry 0 and back, entry 0 still counted empty); returns `cache`."""
        self.store = _copy(self.store, cache, np.int32(0), np.int32(0), self.layout)
        return _copy(cache, self.store, np.int32(0), np.int32(0), self.layout)

    def save(self, cache: kvcache.KVCache, slot: int, prompt: list[int]) -> None:
        """Keep the rows of slot `slot`, just prefilled with `prompt`, unless an entry holds that prompt already."""
        if len(prompt) < MIN_REUSE:
            return
        p = np.asarray(prompt, np.int32)
        for i, t in enumerate(self.tokens):
            if t is not None and np.array_equal(t, p):
                self._touch(i)
                return
        entry = min(range(len(self.tokens)), key=lambda i: self.used[i])
        self.store = _copy(self.store, cache, np.int32(entry), np.int32(slot), self.layout)
        self.tokens[entry] = p
        self._touch(entry)
