"""A request's choices (its sequences in the engine) as the API reports them: queued all or none, their events
turned into text (no half UTF-8 character shown, stop strings cut here, on the text), log-probabilities and usage
counts, waited for or streamed as server-sent events (a streamed choice sends one chunk with everything that
arrived together: the tokens of a turn's decode steps). A client that disconnects cancels its sequences, which
frees their slots at the next engine turn. Prompts to score are queued all or none too.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import orjson
from fastapi import Request
from fastapi.responses import Response

from jaxlm.serve import schemas
from jaxlm.serve.requests import QueueFull, Score, Sequence
from jaxlm.serve.schemas import RequestError, error_body
from jaxlm.serve.served import Served

_random = random.Random()  # request ids and the seeds of requests without one (seeded by the OS at import)
log = logging.getLogger("jaxlm.serve")


def request_id(kind: str) -> str:
    return f"{kind}-{_random.getrandbits(128):032x}"


class TextState:
    """The text of one sequence as tokens arrive: the part safe to show (no half UTF-8 character, no text that
    may be the start of a stop string), and whether a stop string has appeared (the text ends before it)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...]):
        self.decode_fn, self.stop = decode, stop
        self.tokens: list[int] = []
        self.text = ""
        self.shown = 0
        self.stopped = False

    def add(self, tokens: list[int]) -> tuple[str, int]:
        """Append tokens up to the one that completes a stop string, if one does; returns the newly safe text
        and how many of the tokens were taken."""
        if self.stopped:
            return "", 0
        text = self.decode_fn(self.tokens + tokens)
        if not any(text.find(s, max(0, self.shown - len(s))) >= 0 for s in self.stop):
            self.tokens.extend(tokens)
            self.text = text
            return self._show(self._safe()), len(tokens)
        shown = []  # a stop string: token by token, to take none after the one that completes it
        for n, token in enumerate(tokens, 1):
            shown.append(self._add_one(token))
            if self.stopped:
                return "".join(shown), n
        return "".join(shown), len(tokens)

    def _safe(self) -> int:
        safe = len(self.text)
        if not self.stopped:
            if self.stop:
                safe -= max(len(s) for s in self.stop) - 1
            while safe > self.shown and self.text[safe - 1] == "\ufffd":
                safe -= 1
        return max(safe, self.shown)

    def _add_one(self, token: int) -> str:
        self.tokens.append(token)
        self.text = self.decode_fn(self.tokens)
        for s in self.stop:
            at = self.text.find(s, max(0, self.shown - len(s)))
            if at >= 0:
                self.text, self.stopped = self.text[:at], True
        return self._show(self._safe())

    def flush(self) -> str:
        return self._show(len(self.text))

    def _show(self, upto: int) -> str:
        new = self.text[self.shown:upto]
        self.shown = max(self.shown, upto)
        return new


@dataclass
class Choice:
    """One sequence of a request as the API reports it."""
    seq: Sequence
    state: TextState
    events: asyncio.Queue
    logprobs: list = field(default_factory=list)  # (token id, logprob, top [(id, logprob)])
    finish_reason: str | None = None


async def score_prompts(s: Served, prompts: list[list[int]], request: Request, adapter: int = -1) -> list[tuple]:
    """Each prompt's scores (token log-probabilities and alternatives), all prompts submitted or none: when the
    queue refuses one (429) the ones submitted before it are cancelled, and so are all when the client goes."""
    loop = asyncio.get_running_loop()
    futures = [loop.create_future() for _ in prompts]

    def emit(done, ev):
        s.mailbox.post(loop, lambda: done.done() or done.set_result(ev))

    items = [Score(p, partial(emit, f), adapter=adapter) for p, f in zip(prompts, futures)]
    try:
        for item in items:
            s.engine.submit(item)
    except QueueFull:
        for item in items:
            s.engine.cancel(item)
        raise _queue_full() from None
    watcher = asyncio.create_task(_watch(request, items, s))
    try:
        events = [await f for f in futures]
    except asyncio.CancelledError:
        for item in items:
            s.engine.cancel(item)
        raise
    finally:
        watcher.cancel()
    for ev in events:
        if ev[0] == "error":
            raise RequestError(f"scoring the prompt failed: {ev[1]}", "prompt", status=ev[2])
    return [ev[1:] for ev in events]


def _queue_full() -> RequestError:
    return RequestError("the server's queue is full; retry later", status=429, code="queue_full")


def start_choices(s: Served, ids: list[list[int]], max_tokens: list[int], sampling: schemas.Sampling,
                  logprobs: int | None, adapter: int = -1, media: dict | None = None) -> list[Choice]:
    """Queue n sequences per prompt (none when max_tokens is 0), with their tokens' log-probabilities and that
    many alternatives each unless `logprobs` is None, run with LoRA adapter `adapter` (-1 the base) and `media`
    (a prompt's images, image_end and key: Sequence's fields); all or none: a full queue cancels the rest."""
    loop = asyncio.get_running_loop()
    seed = sampling.seed if sampling.seed is not None else _random.getrandbits(32)
    top_k = sampling.top_k if sampling.top_k < s.vocab_size else 0  # every token kept either way
    choices = []
    for p, m in zip(ids, max_tokens):
        for j in range(sampling.n):
            q: asyncio.Queue = asyncio.Queue()
            seq = Sequence(p, m, sampling.temperature, top_k, sampling.top_p, seed, j, s.stop_ids,
                           partial(s.mailbox.post, loop, q.put_nowait), logprobs is not None, logprobs or 0,
                           adapter=adapter, **(media or {}))
            choices.append(Choice(seq, TextState(s.decode, sampling.stop), q))
    try:
        for c in choices:
            if c.seq.max_tokens == 0:
                c.finish_reason = "length"
                c.events.put_nowait(("done", "length"))
            else:
                s.engine.submit(c.seq)
    except QueueFull:
        for c in choices:
            s.engine.cancel(c.seq)
        raise _queue_full() from None
    return choices


async def _next(c: Choice) -> list:
    """The choice's next events: all that have arrived, at least one."""
    events = [await c.events.get()]
    while not c.events.empty():
        events.append(c.events.get_nowait())
    return events


def _apply(s: Served, c: Choice, events: list) -> tuple[str, list, str | None]:
    """Engine events into (new text, new logprobs, finish reason or None)."""
    fresh = []  # (token id, logprob or None, alternatives (ids, logprobs), most likely first)
    for ev in events:
        if ev[0] == "tokens":
            _, ids, lps, tops = ev
            fresh.extend(zip(ids, lps, zip(*tops)) if lps is not None else ((t, None, ((), ())) for t in ids))
    text, taken = c.state.add([t for t, _, _ in fresh])
    fresh = fresh[:taken]  # none past the token that completed a stop string
    c.logprobs.extend(fresh)
    if c.state.stopped and c.finish_reason != "stop":
        s.engine.cancel(c.seq)
        c.finish_reason = "stop"
        text += c.state.flush()
    end = events[-1]
    if end[0] == "error":
        raise RequestError(f"generation failed: {end[1]}", status=end[2])
    if end[0] != "done":
        return text, fresh, None
    if c.finish_reason != "stop":
        c.finish_reason = "stop" if end[1] in ("stop", "cancelled") else end[1]
    return text + c.state.flush(), fresh, c.finish_reason


async def _watch(request: Request, items: list, s: Served) -> None:
    """Cancel the engine's items (sequences, scores) once the client has disconnected."""
    while True:
        await asyncio.sleep(0.1)
        if await request.is_disconnected():
            for item in items:
                s.engine.cancel(item)
            return


async def wait_choices(s: Served, choices: list[Choice], request: Request) -> None:
    watcher = asyncio.create_task(_watch(request, [c.seq for c in choices], s))
    try:
        for c in choices:
            while _apply(s, c, await _next(c))[2] is None:
                pass
    finally:
        watcher.cancel()
        for c in choices:
            s.engine.cancel(c.seq)


async def _stream(s: Served, choices: list[Choice], request: Request):
    """(index, choice, text, logprobs, finish) as events arrive, over all choices; cancels on disconnect (the
    response generator is closed then)."""
    # the server may keep writing to a closed socket
    watcher = asyncio.create_task(_watch(request, [c.seq for c in choices], s))
    pending: dict = {}
    try:
        if len(choices) == 1:  # the common case, without a task per piece
            c = choices[0]
            while True:
                text, fresh, finish = _apply(s, c, await _next(c))
                if text or fresh or finish:
                    yield 0, c, text, fresh, finish
                if finish is not None:
                    return
        pending = {asyncio.ensure_future(_next(c)): k for k, c in enumerate(choices)}
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                k = pending.pop(fut)
                c = choices[k]
                text, fresh, finish = _apply(s, c, fut.result())
                if text or fresh or finish:
                    yield k, c, text, fresh, finish
                if finish is None:
                    pending[asyncio.ensure_future(_next(c))] = k
    finally:
        watcher.cancel()
        for fut in pending:
            fut.cancel()
        for c in choices:
            s.engine.cancel(c.seq)


def completion_logprobs(s: Served, fresh: list, top_n: int, token_ids: bool = False) -> dict:
    """The completions API's logprobs object. With `token_ids` (vLLM's return_tokens_as_token_ids) tokens are
    named "token_id:N" instead of by their text, which two tokens may share (lm-eval's greedy check compares
    ids this way); text offsets still count the text."""
    name = (lambda t: f"token_id:{t}") if token_ids else s.token_text
    offsets, at = [], 0
    for t, _, _ in fresh:
        offsets.append(at)
        at += len(s.token_text(t))
    return {"tokens": [name(t) for t, _, _ in fresh], "token_logprobs": [lp for _, lp, _ in fresh],
            "top_logprobs": [None if lp is None else {name(a): b for a, b in zip(*(x[:top_n] for x in top))}
                             for _, lp, top in fresh],
            "text_offset": offsets}


def usage_counts(usage: dict, choices: list[Choice]) -> dict:
    completion = sum(len(c.state.tokens) for c in choices)
    return {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": completion,
            "total_tokens": usage["prompt_tokens"] + completion}


def _sse(obj: dict) -> bytes:
    """One server-sent event. orjson: a streamed chunk's JSON in a fifth of the time of json.dumps, which took
    a tenth of the event loop's time under load (benchmarks/serve.py)."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def event_stream(s: Served, request: Request, choices: list[Choice], head: dict, opening: list[dict],
                 choice_chunk: Callable, usage: dict | None) -> EventStream:
    """A streamed answer as server-sent events: a chunk for each of `opening` (choices' first chunks), then one
    per piece of the choices' text as it comes (`choice_chunk(index, choice, text, logprobs, finish)`), the usage
    when asked for (`usage` not None), and [DONE]. Every chunk carries `head` (id, object, created, model)."""
    async def events():  # (piece, whether it ends the body)
        for choice in opening:
            yield _sse({**head, "choices": [choice]}), False
        last, unfinished = b"", len(choices)
        try:
            async for k, c, text, fresh, finish in _stream(s, choices, request):
                piece = _sse({**head, "choices": [choice_chunk(k, c, text, fresh, finish)]})
                unfinished -= finish is not None
                if unfinished:
                    yield piece, False
                else:  # the last choice's last piece goes out with the usage, [DONE] and the body's end, in one write
                    last = piece
        except RequestError as e:  # after the 200: an error event ends the stream (as vLLM's and OpenAI's do)
            s.stream_errors += 1
            log.warning("jaxlm serve: a stream (%s) ended with an error: %s", head["id"], e)
            error = error_body(e.status, str(e), e.param, e.code)
            yield _sse(error) + b"data: [DONE]\n\n", True
            return
        if usage is not None:
            last += _sse({**head, "choices": [], "usage": usage_counts(usage, choices)})
        yield last + b"data: [DONE]\n\n", True

    return EventStream(events())


class EventStream(Response):
    """A text/event-stream answer sent piece by piece as `events` yields (piece, last), the last piece with the
    end of the body in one write. Starlette's StreamingResponse, on this server's ASGI version, runs each answer
    in a task group that also waits for the client to disconnect: a fifth of the event loop's time per short
    streamed request. Here a disconnect is seen by _watch, which cancels the sequences and so ends `events`."""
    media_type = "text/event-stream"

    def __init__(self, events):
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers(None)

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async for piece, last in self.events:
            await send({"type": "http.response.body", "body": piece, "more_body": not last})
