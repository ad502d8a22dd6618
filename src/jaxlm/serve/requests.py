"""What the engine serves: a sequence to generate (one choice of a request) or a prompt to score, the events each
emits, and the check a request passes where it enters the engine (`check`): a value the device programs cannot
hold (a top_k past int32, a token id outside the vocabulary) fails that request alone at its admission, never
inside a device call it would share."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from jaxlm.infer.sampling import TOP_LOGPROBS

INT32_MAX = 2**31 - 1


class QueueFull(Exception):
    """The waiting queue holds serve.max_queue requests already."""


def whole_numbers(values, lo: int, hi: int) -> bool:
    """Whether `values` (a list or array) are whole numbers (not bools) in [lo, hi]; an empty one is."""
    try:
        a = np.asarray(values)
    except (OverflowError, ValueError, TypeError):
        return False
    return a.ndim == 1 and (a.size == 0 or (a.dtype.kind in "iu" and lo <= a.min() and a.max() <= hi))


@dataclass
class Sequence:
    """One generated sequence (one choice of a request). The engine calls `emit(event)` from its thread with
    ("tokens", ids, logprobs, alternatives) once per decode call that made tokens for it (ids [n]; logprobs [n]
    and alternatives (ids [n][A], logprobs [n][A]), most likely first, A >= `alternatives`, when `logprobs`,
    else None), then ("done", reason) once, reason
    being "stop" (a stop token), "length" (max_tokens) or "cancelled"; or, instead of ("done", ...), ("error",
    text, status): 400 for a value the programs cannot hold (`check`), 500 when the engine failed."""
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    choice: int
    stop_ids: tuple[int, ...]
    emit: Callable[[tuple], None] | None
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
    # A prompt with images: their pixels in the order of their image tokens as its tower's kind takes them
    # (data/image_kinds.py: Gemma 3 [n, side, side, 3], Llama 4 all tiles [n, side, side, 3], Qwen-VL a tuple of
    # patch grids [t, h, w, Q]; each new shape compiles the image prefill once), the prompt's tokens
    # up to its last image token (prefilled whole, with the images: Cache.prefill_images), and the key the prefix
    # caches know its tokens by (its image tokens replaced by ids drawn from a hash of their image's pixels, so
    # that only the same image in the same place shares keys and values)
    images: np.ndarray | tuple | None = None
    image_end: int = 0
    key: list[int] | None = None

    @property
    def context(self) -> list[int]:
        """The tokens its cache must hold before it decodes: the prompt, or after a preemption the prompt and
        the tokens sent before it."""
        return self.prompt if self.resumed is None else self.resumed

    @property
    def context_key(self) -> list[int]:
        """`context` as the prefix caches know it (`key` for the prompt's part)."""
        if self.key is None:
            return self.context
        return self.key + self.context[len(self.prompt):]

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.context)


@dataclass
class Score:
    """The log-probability of each prompt token after the ones before it (the first has none), with the
    TOP_LOGPROBS most likely alternatives; `emit(("score", token_lp, top_ids, top_lp))` or ("error", text, status)
    (as a Sequence's)."""
    prompt: list[int]
    emit: Callable[[tuple], None] | None
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    adapter: int = -1


def ended(item: Sequence | Score, event: tuple) -> bool:
    """Whether `event` is the last one `item` gets."""
    return event[0] in (("done", "error") if isinstance(item, Sequence) else ("score", "error"))


def check(item: Sequence | Score, vocab_size: int, adapters: int, positions: int,
          never_fits: Callable[[int], str | None]) -> None:
    """Raise ValueError unless the decode and scoring programs can hold every value of `item` (run on the
    engine thread at admission: a bad request fails alone, never inside a call it would share). `adapters`: the
    LoRA adapters served; `positions`: a sequence's; `never_fits(tokens)`: why that many never fit, or None."""
    V = vocab_size
    if not -1 <= item.adapter < adapters:
        raise ValueError(f"adapter {item.adapter} is not one of this engine's {adapters}")
    if not whole_numbers(item.prompt, 0, V - 1) or not len(item.prompt):
        raise ValueError(f"a prompt must hold at least one token, each in [0, {V})")
    if isinstance(item, Score):
        if len(item.prompt) > positions:
            raise ValueError(f"a prompt of {len(item.prompt)} tokens is longer than the {positions} positions")
        return
    if not whole_numbers([item.max_tokens], 1, INT32_MAX):
        raise ValueError(f"max_tokens={item.max_tokens} must be a whole number >= 1")
    if (why := never_fits(len(item.prompt) + item.max_tokens)) is not None:
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
