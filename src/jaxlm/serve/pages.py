"""The host side of the paged KV cache (model/paged.py): which pages are free, which sequences hold which, and the
prompt prefixes they hold, shared between sequences. A sequence takes pages as it grows and gives them back when
it ends, is cancelled or is preempted. Pages are reference-counted: the full pages of a prompt (page_size tokens
each) are registered under a key that chains the keys of the pages before them (a digest of every token up to the
page's end), so a later prompt that starts with the same tokens takes those pages instead of prefilling them
again. A sequence never writes into a registered page: it registers only pages its prompt fills, and reuses at
most the full pages before its last prompt token (whose logits the prefill must give). A page no sequence holds
any more but that keeps a registered prefix stays cached, and is handed out again (its prefix forgotten) only when
no free page is left, the least recently used first.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np


class PagePool:
    """`take(n)` pages for a sequence, `release(pages)` when it is done with them; `match(tokens)` the registered
    pages that hold a prompt's prefix (taken, as `take` would), `register(tokens, pages)` a prefilled prompt's
    full pages. `available()` pages can be taken now (free ones and cached ones no sequence holds)."""

    def __init__(self, pages: int, page_size: int, share_prefixes: bool = True):
        self.pages, self.page_size, self.share = pages, page_size, share_prefixes
        self.free: list[int] = list(range(pages - 1, -1, -1))  # popped from the end: page 0 first
        self.refs = np.zeros(pages, np.int64)
        self.key_of: dict[int, bytes] = {}  # page -> the key of the prefix it holds
        self.page_of: dict[bytes, int] = {}  # key -> page
        self.cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # held by none, oldest first

    def used(self) -> int:
        """Pages some sequence holds."""
        return int(np.count_nonzero(self.refs))

    def available(self) -> int:
        return len(self.free) + len(self.cached)

    def take(self, n: int) -> list[int]:
        """n pages for a sequence (free ones first, then the least recently used cached ones, forgotten); the
        caller checks available() first."""
        if n > self.available():
            raise RuntimeError(f"{n} pages asked for, {self.available()} available")
        out = []
        for _ in range(n):
            if self.free:
                page = self.free.pop()
            else:
                page, _ = self.cached.popitem(last=False)
                del self.page_of[self.key_of.pop(page)]
            self.refs[page] = 1
            out.append(page)
        return out

    def release(self, pages: list[int]) -> None:
        for page in pages:
            self.refs[page] -= 1
            assert self.refs[page] >= 0, f"page {page} released more often than taken"
            if self.refs[page] == 0:
                if page in self.key_of:
                    self.cached[page] = None
                else:
                    self.free.append(page)

    def _keys(self, tokens, n: int, adapter: int) -> list[bytes]:
        """The keys of the first n full pages of `tokens` run with LoRA adapter `adapter` (-1 the base; another
        adapter's keys and values differ): each a digest of the key before it and its tokens."""
        keys, key = [], b"" if adapter < 0 else f"adapter {adapter}".encode()
        A = self.page_size
        ids = np.asarray(tokens[:n * A], np.int64)
        for i in range(n):
            key = hashlib.blake2b(key + ids[i * A:(i + 1) * A].tobytes(), digest_size=16).digest()
            keys.append(key)
        return keys

    def match(self, tokens, adapter: int = -1) -> list[int]:
        """The registered pages holding the longest prefix of `tokens` in full pages, before its last token;
        the sequence now holds them (released with its own)."""
        if not self.share:
            return []
        out = []
        for key in self._keys(tokens, (len(tokens) - 1) // self.page_size, adapter):
            page = self.page_of.get(key)
            if page is None:
                break
            out.append(page)
        for page in out:
            self.cached.pop(page, None)
            self.refs[page] += 1
        return out

    def shared(self, tokens, adapter: int = -1) -> int:
        """How many tokens of `tokens` match() would find in registered pages (taking none)."""
        if not self.share:
            return 0
        n = 0
        for key in self._keys(tokens, (len(tokens) - 1) // self.page_size, adapter):
            if key not in self.page_of:
                break
            n += self.page_size
        return n

    def register(self, tokens, pages: list[int], adapter: int = -1) -> None:
        """Register the pages that `tokens` (a prompt just prefilled into `pages`, in order) fill, unless their
        prefix is registered already."""
        if not self.share:
            return
        for key, page in zip(self._keys(tokens, len(tokens) // self.page_size, adapter), pages):
            if key not in self.page_of and page not in self.key_of:
                self.page_of[key], self.key_of[page] = page, key
