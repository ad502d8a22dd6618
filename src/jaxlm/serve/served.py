"""What the HTTP app serves (`Served`: the engine, the tokenizer, the model's name and context, the decode.*
defaults, the limits and the error counts /metrics reports), and the Mailbox that hands what the engine thread
posts (each sequence's tokens, then its end) to the event loop: all that one engine turn posted in one wake-up.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from dataclasses import dataclass, field
from typing import Callable

from jaxlm.config import DecodeConfig
from jaxlm.serve.engine import Engine
from jaxlm.serve.images import ImageServing
from jaxlm.serve.replicas import Replicas

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


class Mailbox:
    """Calls from the engine thread to event loops, handed over once per engine turn: `post(loop, fn, *args)`
    keeps a call, `flush()` (an engine turn hook) wakes each loop once to make the calls kept for it, in order."""

    def __init__(self):
        self.lock = threading.Lock()
        self.calls: list = []

    def post(self, loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> None:
        with self.lock:
            self.calls.append((loop, fn, args))

    def flush(self) -> None:
        with self.lock:
            calls, self.calls = self.calls, []
        by_loop: dict = {}
        for loop, fn, args in calls:
            by_loop.setdefault(loop, []).append((fn, args))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # the server is shutting down: nobody is waiting any more
                pass


def _deliver(batch: list) -> None:
    for fn, args in batch:
        fn(*args)


@dataclass
class Served:
    """What the app serves: the engine, the tokenizer, the model's name and context, the decode.* defaults."""
    engine: Engine | Replicas
    encode: Callable[[str], list[int]]  # plain text, as /tokenize answers
    encode_prompt: Callable[[str], list[int]]  # a completion prompt: the tokenizer's BOS first when it uses one
    encode_chat: Callable[[str], list[int]]  # a rendered chat: its special-token strings are special tokens
    decode: Callable[[list[int]], str]
    name: str
    vocab_size: int
    decode_cfg: DecodeConfig
    stop_ids: tuple[int, ...]
    chat_template: Callable[[list[dict]], str] | None
    api_key: str | None
    bos_id: int | None = None  # the tokenizer's, for clients that score a document's first token (eval/harness.py)
    eos_id: int | None = None
    allowed_hosts: frozenset | None = LOOPBACK_HOSTS  # Host header values answered (None: any)
    allowed_origins: frozenset = frozenset()  # Origin header values answered (browsers' cross-origin requests)
    max_body_bytes: int = 8 << 20
    max_prompt_chars: int | None = None  # prompt texts longer than this cannot fit the context (app._encode)
    adapters: tuple[str, ...] = ()  # LoRA adapters served over the model (serve.adapters): engine adapter i's name
    max_tokenize_chars: int = 1 << 20  # /tokenize texts longer than this are refused (413)
    images: ImageServing | None = None  # what chat requests' images need; None: images are refused
    images_refused: str = "this model has no vision tower"  # why, when images is None
    ui: bool = True  # the chat page at / (serve.ui, chat_page.py)
    errors: dict = field(default_factory=dict)  # status -> count, for /metrics
    stream_errors: int = 0  # streams ended by an error event after their 200, for /metrics
    mailbox: Mailbox = field(default_factory=Mailbox)

    def __post_init__(self):
        self.engine.turn_hooks.append(self.mailbox.flush)
        self.token_text = functools.lru_cache(maxsize=None)(lambda t: self.decode([t]))  # one token's text

    def count_error(self, status: int) -> None:
        """Count an answer with an error status (app.Guard's, and the connections' refusals: serve/protocol.py)."""
        self.errors[status] = self.errors.get(status, 0) + 1
