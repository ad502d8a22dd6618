"""The HTTP API: OpenAI-compatible /v1/models, /v1/completions and /v1/chat/completions (streamed as server-sent
events with `stream: true`), /tokenize, /health and /metrics (Prometheus text), over the engine's slots.

The engine thread posts each sequence's events (its tokens, then its end) to a Mailbox, which hands all that
one engine turn posted to the event loop in one wake-up, into the requests' asyncio queues. This module turns
them into text (stop strings cut here, on the text), log-probabilities and usage counts; a streamed choice
sends one chunk with everything that arrived together (the tokens of a turn's decode steps). A client that
disconnects cancels its sequences, which frees their slots at the next engine turn.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.requests import ClientDisconnect

from jaxlm.config import DecodeConfig
from jaxlm.serve import engine as engine_lib
from jaxlm.serve import schemas
from jaxlm.serve.schemas import RequestError, error_body, shown

RETRY_AFTER_S = 1
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
# Work done in a worker thread from these sizes, so that no request holds the event loop (other streams' tokens)
# for long: bodies parsed and validated, chat templates rendered, answers serialized from OFF_LOOP_BYTES, texts
# tokenized from OFF_LOOP_CHARS characters.
OFF_LOOP_BYTES = 256 << 10
OFF_LOOP_CHARS = 32 << 10
ANSWER_BYTES_PER_TOKEN = 48  # of a completion answer, about, per token and per log-probability (to pick the thread)
# After a 413 the rest of the body is read and thrown away before the connection closes (nginx's lingering close),
# at most this many bytes, for at most LINGER_S (nginx's lingering_time) while the client sends something every
# LINGER_IDLE_S (its lingering_timeout); serve.max_body_mb's help names these figures.
LINGER_BYTES = 256 << 20
LINGER_S = 30.0
LINGER_IDLE_S = 5.0
_random = random.Random()  # request ids and the seeds of requests without one (seeded by the OS at import)
log = logging.getLogger("jaxlm.serve")


def _request_id(kind: str) -> str:
    return f"{kind}-{_random.getrandbits(128):032x}"


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
    engine: engine_lib.Engine
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
    bos_id: int | None = None  # the tokenizer's, for clients that score a document's first token (evals.py)
    eos_id: int | None = None
    allowed_hosts: frozenset | None = LOOPBACK_HOSTS  # Host header values answered (None: any)
    allowed_origins: frozenset = frozenset()  # Origin header values answered (browsers' cross-origin requests)
    max_body_bytes: int = 8 << 20
    max_prompt_chars: int | None = None  # prompt texts longer than this cannot fit the context (_encode)
    adapters: tuple[str, ...] = ()  # LoRA adapters served over the model (serve.adapters): engine adapter i's name
    max_tokenize_chars: int = 1 << 20  # /tokenize texts longer than this are refused (413)
    errors: dict = field(default_factory=dict)  # status -> count, for /metrics
    stream_errors: int = 0  # streams ended by an error event after their 200, for /metrics
    mailbox: Mailbox = field(default_factory=Mailbox)

    def __post_init__(self):
        self.engine.turn_hooks.append(self.mailbox.flush)
        self.token_text = functools.lru_cache(maxsize=None)(lambda t: self.decode([t]))  # one token's text


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
    seq: engine_lib.Sequence
    state: TextState
    events: asyncio.Queue
    logprobs: list = field(default_factory=list)  # (token id, logprob, top [(id, logprob)])
    finish_reason: str | None = None


def _json_error(status: int, message: str, param: str | None = None, code: str | None = None, headers=None):
    kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
            413: "invalid_request_error", 429: "rate_limit_error"}.get(status, "server_error")
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)


class Gone(Exception):
    """The client left before its request's body arrived: nobody to answer (nginx logs these as 499)."""


class BodyTooLarge(Exception):
    """A request body without a Content-Length grew past serve.max_body_mb while it was read."""

    def __init__(self, more: bool):
        self.more = more  # more of the body is on its way


def host_name(header: bytes) -> str:
    """The name of a Host header, its port left out ("[::1]:8000" -> "::1")."""
    host = header.decode("latin-1").strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    name, _, port = host.rpartition(":")
    return name if name and port.isdigit() else host


class Guard:
    """ASGI middleware, in front of every route: the Host header's allow-list (a web page whose name was rebound to
    127.0.0.1 sends its own name: refused, 403), a browser's cross-origin request refused unless its Origin is
    allowed (403), the API key (every path but /health; 401), the body limit (413: a Content-Length past it is
    refused before the body is read, a body without one when it grows past it; see _too_large), and the count of
    error answers. Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would hide a client's disconnect
    from streaming answers."""

    def __init__(self, app, served: Served):
        self.app, self.s = app, served

    async def _refuse(self, scope, receive, send, status: int, message: str, code: str):
        self.s.errors[status] = self.s.errors.get(status, 0) + 1
        await _json_error(status, message, code=code)(scope, receive, send)

    async def _too_large(self, receive, send, unread: int) -> None:
        """Answer 413, then read and throw away the rest of the body (`unread` bytes at most; none when that is past
        LINGER_BYTES, which would be cut off anyway) before closing the connection: http.client, requests and httpx
        send the whole body before they read, and a connection closed under them while they send loses the
        answer to a reset. Each read takes what has arrived (uvicorn stops reading the socket past 64 KiB: a few
        hundred kB) and the next one waits on the socket, a turn of the event loop in which other streams flow."""
        s = self.s
        s.errors[413] = s.errors.get(413, 0) + 1
        response = _json_error(413, f"the request body is larger than serve.max_body_mb={s.max_body_bytes / 2**20:g} "
                               "MiB", code="request_too_large", headers={"connection": "close"})
        await send({"type": "http.response.start", "status": 413, "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body, "more_body": True})
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LINGER_S
        while 0 < unread <= LINGER_BYTES:
            try:
                async with asyncio.timeout(min(LINGER_IDLE_S, deadline - loop.time())):
                    message = await receive()
            except TimeoutError:
                break
            unread -= len(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        await send({"type": "http.response.body", "body": b""})  # the server closes the connection after it

    async def __call__(self, scope, receive, send):
        s = self.s
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if sum(name == b"host" for name, _ in scope["headers"]) > 1:  # RFC 9112 3.2: a request with two is refused
            return await self._refuse(scope, receive, send, 400, "a request must carry one Host header",
                                      "invalid_host")
        if s.allowed_hosts is not None and host_name(headers.get(b"host", b"")) not in s.allowed_hosts:
            return await self._refuse(scope, receive, send, 403, "this Host is not served here (serve.allowed_hosts)",
                                      "host_not_allowed")
        origin = headers.get(b"origin")
        if origin is not None and origin.decode("latin-1") not in s.allowed_origins:
            return await self._refuse(scope, receive, send, 403, "cross-origin requests are refused unless their "
                                      "Origin is in serve.allowed_origins", "origin_not_allowed")
        if s.api_key and scope["path"] != "/health":
            got = headers.get(b"authorization", b"")
            if not hmac.compare_digest(got, f"Bearer {s.api_key}".encode()):
                return await self._refuse(scope, receive, send, 401, "missing or wrong API key: send the header "
                                          "Authorization: Bearer KEY", "invalid_api_key")
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > s.max_body_bytes):
            # A client that asked to be told to go on (Expect: 100-continue) sends no body after a refusal.
            waits = b"100-continue" in headers.get(b"expect", b"").lower()
            return await self._too_large(receive, send, int(length) if length.isdigit() and not waits else 0)
        received = 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > s.max_body_bytes:
                raise BodyTooLarge(message.get("more_body", False))
            return message

        started = False

        async def counting_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] >= 400 and message["status"] != 499:
                    s.errors[message["status"]] = s.errors.get(message["status"], 0) + 1
            await send(message)

        try:
            await self.app(scope, counted_receive if length is None else receive, counting_send)
        except BodyTooLarge as e:
            if not started:
                await self._too_large(receive, send, LINGER_BYTES if e.more else 0)


def create_app(s: Served) -> FastAPI:
    app = FastAPI(title="jaxlm", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, served=s)

    @app.exception_handler(RequestError)
    async def request_error(request: Request, e: RequestError):
        headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 429 else None
        if e.status >= 500:
            log.warning("jaxlm serve: %s %s answered %d: %s", request.method, request.url.path, e.status, e)
        return _json_error(e.status, str(e), e.param, e.code, headers)

    @app.exception_handler(Gone)
    async def gone(request: Request, e: Gone):
        return Response(status_code=499)  # never sent: the connection is closed (Guard does not count it)

    _info_routes(app, s)
    _completion_route(app, s)
    _chat_route(app, s)
    return app


def _info_routes(app: FastAPI, s: Served) -> None:
    """/health, /v1/models, /metrics and /tokenize."""

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        return {"status": "ok" if s.engine.running else "stopped"}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        common = {"object": "model", "created": 0, "owned_by": "jaxlm", "max_model_len": s.engine.S,
                  "bos_token_id": s.bos_id, "eos_token_id": s.eos_id}
        return {"object": "list", "data": [{"id": s.name, **common}] + [
            {"id": name, **common, "parent": s.name} for name in s.adapters]}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics():
        return PlainTextResponse(prometheus(s), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _body(request)
        text = body.get("prompt", body.get("text")) if isinstance(body, dict) else None
        if not isinstance(text, str):
            raise RequestError("give the text to tokenize as {\"prompt\": TEXT}", "prompt")
        if len(text) > s.max_tokenize_chars:
            raise RequestError(f"the text of {len(text)} characters is longer than serve.max_tokenize_chars="
                               f"{s.max_tokenize_chars}", "prompt", status=413, code="request_too_large")
        ids = await _encode(s, text, bounded=False)
        return await _answer({"tokens": ids, "count": len(ids), "max_model_len": s.engine.S}, len(ids) * 8)


def _completion_route(app: FastAPI, s: Served) -> None:
    """/v1/completions: text or token-id prompts, `n` choices each, `echo` and `logprobs` (scored prompts)."""

    @app.post("/v1/completions")
    async def completions(request: Request):
        body, size = await _body(request, sized=True)
        adapter, model = _check_model(s, body)
        req = await _off_loop(size, schemas.completion, body, s.decode_cfg)
        ids = [await _encode(s, p, s.encode_prompt) if isinstance(p, str) else _check_ids(s, p) for p in req.prompts]
        max_tokens = [_max_tokens(s, len(p), req.sampling.max_tokens) for p in ids]
        want_scores = req.echo and req.logprobs is not None
        # the prompts are scored first (all queued at once), then their sequences (none for max_tokens 0)
        _check_room(s, max(len(ids) if want_scores else 0, req.sampling.n * sum(m > 0 for m in max_tokens)))
        scores = await _scores(s, ids, request, adapter) if want_scores else [None] * len(ids)
        choices = _start(s, ids, max_tokens, req.sampling, req.logprobs, adapter)
        head = {"id": _request_id("cmpl"), "object": "text_completion", "created": int(time.time()),
                "model": model}

        def prompt_logprobs(i):
            if not want_scores:
                return []
            token_lp, top_ids, top_lp = scores[i]
            p = ids[i]
            return [(p[0], None, ((), ()))] + [(p[j], token_lp[j - 1], (top_ids[j - 1], top_lp[j - 1]))
                                               for j in range(1, len(p))]

        def choice_body(k, c: Choice, text: str, fresh: list, finish):
            out = {"index": k, "text": text, "logprobs": None, "finish_reason": finish}
            if req.logprobs is not None:
                out["logprobs"] = _completion_logprobs(s, fresh, req.logprobs, req.token_ids)
            return out

        def prompt_texts():
            return [p if isinstance(p, str) else s.decode(ids[i]) for i, p in enumerate(req.prompts)]

        # the bytes an answer's echoed prompts and log-probabilities come to, about: large ones are built off the loop
        per_token = ANSWER_BYTES_PER_TOKEN * (1 + (req.logprobs or 0))
        echoed_bytes = per_token * req.sampling.n * sum(map(len, ids)) if req.echo else 0
        usage = {"prompt_tokens": sum(map(len, ids))}
        if req.sampling.stream:
            def opening():
                texts = prompt_texts()
                return [choice_body(k, c, texts[k // req.sampling.n], prompt_logprobs(k // req.sampling.n), None)
                        for k, c in enumerate(choices)]

            echoed = await _off_loop(echoed_bytes, opening) if req.echo else []
            return _event_stream(s, request, choices, head, echoed, choice_body,
                                 usage if req.sampling.include_usage else None)
        await _wait(s, choices, request)

        def answer():
            texts, out = prompt_texts() if req.echo else None, []
            for k, c in enumerate(choices):
                i = k // req.sampling.n
                text = (texts[i] if req.echo else "") + c.state.text
                out.append(choice_body(k, c, text, prompt_logprobs(i) + c.logprobs, c.finish_reason))
            return orjson.dumps({**head, "choices": out, "usage": _usage(usage, choices)})

        size = echoed_bytes + per_token * sum(len(c.state.tokens) for c in choices)
        return Response(await _off_loop(size, answer), media_type="application/json")


def _chat_route(app: FastAPI, s: Served) -> None:
    """/v1/chat/completions: the messages rendered by the chat template, answered as one assistant message."""

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body, size = await _body(request, sized=True)
        adapter, model = _check_model(s, body)
        req = await _off_loop(size, schemas.chat, body, s.decode_cfg)
        if s.chat_template is None:
            raise RequestError("this model's tokenizer has no chat template: use /v1/completions, or start the "
                               "server with serve.chat_template=FILE (a Jinja chat template)", "messages")
        try:
            prompt = await _off_loop(size, s.chat_template, req.messages)
        except Exception as e:  # noqa: BLE001 - the template's own error (e.g. raise_exception) names the fault
            raise RequestError(f"the chat template failed on these messages: {shown(str(e))}", "messages") from None
        ids = [await _encode(s, prompt, s.encode_chat)]
        _check_room(s, req.sampling.n)
        choices = _start(s, ids, [_max_tokens(s, len(ids[0]), req.sampling.max_tokens)], req.sampling,
                         req.top_logprobs if req.logprobs else None, adapter)
        head = {"id": _request_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()),
                "model": model}
        usage = {"prompt_tokens": len(ids[0])}

        def logprobs(fresh):
            if not req.logprobs:
                return None
            return {"content": [{"token": s.token_text(t), "logprob": lp,
                                 "top_logprobs": [{"token": s.token_text(a), "logprob": b}
                                                  for a, b in zip(*(x[:req.top_logprobs] for x in top))]}
                                for t, lp, top in fresh]}

        def chunk(k, c: Choice, text: str, fresh: list, finish):
            delta = {"content": text} if text or finish is None else {}
            return {"index": k, "delta": delta, "logprobs": logprobs(fresh), "finish_reason": finish}

        if req.sampling.stream:
            roles = [{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for k in range(len(choices))]
            return _event_stream(s, request, choices, {**head, "object": "chat.completion.chunk"}, roles, chunk,
                                 usage if req.sampling.include_usage else None)
        await _wait(s, choices, request)

        def answer():
            return orjson.dumps({**head, "choices": [{"index": k, "message": {"role": "assistant",
                                                                            "content": c.state.text},
                                                      "logprobs": logprobs(c.logprobs),
                                                      "finish_reason": c.finish_reason}
                                                     for k, c in enumerate(choices)],
                                 "usage": _usage(usage, choices)})

        size = ANSWER_BYTES_PER_TOKEN * (1 + req.top_logprobs) * sum(len(c.state.tokens) for c in choices)
        return Response(await _off_loop(size, answer), media_type="application/json")


def _event_stream(s: Served, request: Request, choices: list[Choice], head: dict, opening: list[dict],
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
            error = error_body(str(e), "server_error" if e.status >= 500 else "invalid_request_error", e.param,
                               e.code)
            yield _sse(error) + b"data: [DONE]\n\n", True
            return
        if usage is not None:
            last += _sse({**head, "choices": [], "usage": _usage(usage, choices)})
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


async def _body(request: Request, sized: bool = False):
    """The request's JSON, parsed by orjson (in a worker thread when the body is large, so that other streams'
    tokens keep flowing); with `sized`, (the JSON, the body's bytes)."""
    try:
        raw = await request.body()
    except ClientDisconnect:  # gone, or cut off by serve.body_timeout_s (answered 408 by serve/protocol.py)
        raise Gone from None
    try:
        body = await _off_loop(len(raw), orjson.loads, raw)
    except orjson.JSONDecodeError as e:
        raise RequestError(f"the request body is not valid JSON: {shown(str(e))}") from None
    return (body, len(raw)) if sized else body


async def _off_loop(size: int, fn: Callable, *args):
    """fn(*args), in a worker thread when `size` (bytes of what it works on) is OFF_LOOP_BYTES or more."""
    if size >= OFF_LOOP_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


async def _answer(obj: dict, size: int) -> Response:
    """A JSON answer serialized by orjson (FastAPI's own encoder walks every value in Python: a large answer held
    the event loop for seconds), in a worker thread when `size` (its estimated bytes) is large. The completion
    routes build their answers in the thread too (`answer()` there), from the same estimate."""
    return Response(await _off_loop(size, orjson.dumps, obj), media_type="application/json")


def _check_room(s: Served, sequences: int) -> None:
    """A request of more sequences (prompts x n) than the queue holds can never be queued: 400 naming the limit,
    rather than a 429 that retrying cannot cure."""
    if sequences > s.engine.max_queue:
        raise RequestError(f"this request asks for {sequences} sequences (prompts x n); the "
                           f"server queues at most serve.max_queue={s.engine.max_queue} at once", "n",
                           code="request_too_large")


def _check_model(s: Served, body) -> tuple[int, str]:
    """The engine adapter a request's `model` names (-1: the base model, also when none is named) and its name."""
    name = body.get("model") if isinstance(body, dict) else None
    if name in (None, s.name):
        return -1, s.name
    if name in s.adapters:
        return s.adapters.index(name), name
    served = ", ".join(repr(n) for n in (s.name, *s.adapters))
    raise RequestError(f"model {shown(name)} is not served here; this server serves {served}", "model",
                       code="model_not_found")


async def _encode(s: Served, text: str, encode: Callable[[str], list[int]] | None = None, bounded: bool = True
                  ) -> list[int]:
    """The text's tokens. A prompt (`bounded`) with more characters than the context's tokens can hold
    (s.max_prompt_chars: no token covers more characters than the longest in the vocabulary) is refused before
    tokenizing it; a long text is tokenized in a worker thread, so that other streams' tokens keep flowing."""
    if bounded and s.max_prompt_chars is not None and len(text) > s.max_prompt_chars:
        raise RequestError(f"the prompt of {len(text)} characters is longer than the context of {s.engine.S} "
                           "tokens can hold", "prompt", code="context_length_exceeded")
    try:
        if len(text) >= OFF_LOOP_CHARS:
            return await asyncio.to_thread(encode or s.encode, text)
        return (encode or s.encode)(text)
    except ValueError as e:  # a character outside a char/byte vocabulary (TokenizerError)
        raise RequestError(f"the prompt cannot be tokenized: {shown(str(e))}", "prompt") from None


def _check_ids(s: Served, ids: list[int]) -> list[int]:
    if len(ids) > s.engine.S:  # before the ids are read: a body of millions of them is refused at once
        raise RequestError(f"the prompt of {len(ids)} tokens is longer than the context of {s.engine.S} tokens",
                           "prompt", code="context_length_exceeded")
    if min(ids) < 0 or max(ids) >= s.vocab_size:
        raise RequestError(f"prompt token ids must be in [0, {s.vocab_size}), got [{min(ids)}, {max(ids)}]",
                           "prompt")
    return ids


def _max_tokens(s: Served, prompt_len: int, asked: int | None) -> int:
    S = s.engine.S
    if prompt_len == 0:
        raise RequestError("the prompt must hold at least one token", "prompt")
    if prompt_len > S:
        raise RequestError(f"the prompt of {prompt_len} tokens is longer than the context of {S} tokens",
                           "prompt", code="context_length_exceeded")
    if asked is None:
        asked = min(s.decode_cfg.max_new_tokens, S - prompt_len)
    elif prompt_len + asked > S:
        raise RequestError(f"max_tokens={asked} with a prompt of {prompt_len} tokens runs past the context of {S} "
                           f"tokens: at most {S - prompt_len}", "max_tokens", code="context_length_exceeded")
    if asked and (why := s.engine.never_fits(prompt_len + asked)) is not None:  # none for 0 (only scored)
        raise RequestError(f"this request can never run here: {why}", "max_tokens", code="context_length_exceeded")
    return asked


async def _scores(s: Served, prompts: list[list[int]], request: Request, adapter: int = -1) -> list[tuple]:
    """Each prompt's scores (token log-probabilities and alternatives), all prompts submitted or none: when the
    queue refuses one (429) the ones submitted before it are cancelled, and so are all when the client goes."""
    loop = asyncio.get_running_loop()
    futures = [loop.create_future() for _ in prompts]

    def emit(done, ev):
        s.mailbox.post(loop, lambda: done.done() or done.set_result(ev))

    items = [engine_lib.Score(p, partial(emit, f), adapter=adapter) for p, f in zip(prompts, futures)]
    try:
        for item in items:
            s.engine.submit(item)
    except engine_lib.QueueFull:
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


def _start(s: Served, ids: list[list[int]], max_tokens: list[int], sampling: schemas.Sampling,
           logprobs: int | None, adapter: int = -1) -> list[Choice]:
    """Queue n sequences per prompt (none when max_tokens is 0), with their tokens' log-probabilities and that
    many alternatives each unless `logprobs` is None, run with LoRA adapter `adapter` (-1 the base); all or
    none: a full queue cancels the rest."""
    loop = asyncio.get_running_loop()
    seed = sampling.seed if sampling.seed is not None else _random.getrandbits(32)
    top_k = sampling.top_k if sampling.top_k < s.vocab_size else 0  # every token kept either way
    choices = []
    for p, m in zip(ids, max_tokens):
        for j in range(sampling.n):
            q: asyncio.Queue = asyncio.Queue()
            seq = engine_lib.Sequence(p, m, sampling.temperature, top_k, sampling.top_p, seed, j,
                                      s.stop_ids, partial(s.mailbox.post, loop, q.put_nowait), logprobs is not None,
                                      logprobs or 0, adapter=adapter)
            choices.append(Choice(seq, TextState(s.decode, sampling.stop), q))
    try:
        for c in choices:
            if c.seq.max_tokens == 0:
                c.finish_reason = "length"
                c.events.put_nowait(("done", "length"))
            else:
                s.engine.submit(c.seq)
    except engine_lib.QueueFull:
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


async def _wait(s: Served, choices: list[Choice], request: Request) -> None:
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


def _completion_logprobs(s: Served, fresh: list, top_n: int, token_ids: bool = False) -> dict:
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


def _usage(usage: dict, choices: list[Choice]) -> dict:
    completion = sum(len(c.state.tokens) for c in choices)
    return {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": completion,
            "total_tokens": usage["prompt_tokens"] + completion}


def _sse(obj: dict) -> bytes:
    """One server-sent event. orjson: a streamed chunk's JSON in a fifth of the time of json.dumps, which took
    a tenth of the event loop's time under load (benchmarks/serve.py)."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def prometheus(s: Served) -> str:
    e = s.engine
    ttft = sorted(e.ttft_s)

    def q(p):
        return ttft[min(len(ttft) - 1, int(p * len(ttft)))] if ttft else float("nan")

    lines = []

    def metric(name, kind, help, samples):
        lines.extend([f"# HELP {name} {help}", f"# TYPE {name} {kind}"])
        lines.extend(f"{name}{labels} {value}" for labels, value in samples)

    metric("jaxlm_queue_depth", "gauge", "Requests waiting for a decode slot.", [("", e.queue_depth())])
    metric("jaxlm_busy_slots", "gauge", "Decode slots holding a sequence.", [("", e.busy_slots())])
    metric("jaxlm_slots", "gauge", "Decode slots (serve.max_slots).", [("", e.B)])
    metric("jaxlm_kv_pages_used", "gauge", "Pages of the paged KV cache that sequences hold.", [("", e.pages_used())])
    metric("jaxlm_kv_pages", "gauge", "Pages of the paged KV cache (0: the slot cache).", [("", e.pages_total())])
    metric("jaxlm_preemptions_total", "counter", "Sequences preempted (pages given back, recomputed later) when the "
           "paged cache ran out.", [("", e.preempted_total)])
    metric("jaxlm_generated_tokens_total", "counter", "Tokens generated.", [("", e.tokens_total)])
    metric("jaxlm_decode_calls_total", "counter", "Device calls of the decode program (each runs up to "
           "serve.decode_steps steps).", [("", e.calls_total)])
    metric("jaxlm_prompt_tokens_total", "counter", "Prompt tokens of the sequences admitted.",
           [("", e.prompt_tokens_total)])
    metric("jaxlm_prefill_tokens_total", "counter", "Prompt tokens run through the model (not reused).",
           [("", e.prefilled_tokens_total)])
    metric("jaxlm_prefix_cache_hits_total", "counter", "Sequences that reused a stored prompt's keys and values.",
           [("", e.prefix_hits_total)])
    metric("jaxlm_prefix_cache_tokens_total", "counter", "Prompt tokens reused from the prefix cache.",
           [("", e.prefix_tokens_total)])
    metric("jaxlm_sequences_total", "counter", "Sequences admitted into a slot.", [("", e.requests_total)])
    metric("jaxlm_draft_tokens_proposed_total", "counter", "Tokens the draft model proposed (decode.draft).",
           [("", e.draft_proposed_total)])
    metric("jaxlm_draft_tokens_accepted_total", "counter", "Of them, tokens the model kept.",
           [("", e.draft_accepted_total)])
    metric("jaxlm_generation_tokens_per_second", "gauge", "Tokens generated per second over the last 10 s.",
           [("", round(e.tokens_per_s(), 3))])
    metric("jaxlm_time_to_first_token_seconds", "summary",
           "Time from a sequence's arrival to its first token (the latest 1000 sequences).",
           [('{quantile="0.5"}', q(0.5)), ('{quantile="0.99"}', q(0.99)), ("_sum", sum(ttft)),
            ("_count", len(ttft))])
    metric("jaxlm_http_errors_total", "counter", "Answers with an error status.",
           [(f'{{code="{k}"}}', v) for k, v in sorted(s.errors.items())])
    metric("jaxlm_stream_errors_total", "counter", "Streamed answers ended by an error event after their 200.",
           [("", s.stream_errors)])
    return "\n".join(lines) + "\n"
