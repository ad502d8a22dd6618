"""The HTTP API: OpenAI-compatible /v1/models, /v1/completions and /v1/chat/completions (streamed as server-sent
events with `stream: true`), /tokenize, /health and /metrics (Prometheus text), over the engine's slots.

The engine thread hands each sequence's tokens to the request's asyncio queue; this module turns them into
text (stop strings cut here, on the text), log-probabilities and usage counts. A client that disconnects
cancels its sequences, which frees their slots at the next decode step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from jaxlm.config import DecodeConfig
from jaxlm.serve import engine as engine_lib
from jaxlm.serve import schemas
from jaxlm.serve.schemas import RequestError, error_body

RETRY_AFTER_S = 1


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
    errors: dict = field(default_factory=dict)  # status -> count, for /metrics


class TextState:
    """The text of one sequence as tokens arrive: the part safe to show (no half UTF-8 character, no text that
    may be the start of a stop string), and whether a stop string has appeared (the text ends before it)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...]):
        self.decode_fn, self.stop = decode, stop
        self.tokens: list[int] = []
        self.text = ""
        self.shown = 0
        self.stopped = False

    def add(self, token: int) -> str:
        """Append a token; returns the newly safe text."""
        self.tokens.append(token)
        self.text = self.decode_fn(self.tokens)
        for s in self.stop:
            at = self.text.find(s, max(0, self.shown - len(s)))
            if at >= 0:
                self.text, self.stopped = self.text[:at], True
        safe = len(self.text)
        if not self.stopped:
            if self.stop:
                safe -= max(len(s) for s in self.stop) - 1
            while safe > self.shown and self.text[safe - 1] == "\ufffd":
                safe -= 1
        return self._show(max(safe, self.shown))

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
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            429: "rate_limit_error"}.get(status, "server_error")
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)


class Guard:
    """ASGI middleware: the API key check (every path but /health) and the count of error answers. Plain ASGI
    rather than Starlette's BaseHTTPMiddleware, which would hide a client's disconnect from streaming answers."""

    def __init__(self, app, served: Served):
        self.app, self.s = app, served

    async def __call__(self, scope, receive, send):
        s = self.s
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if s.api_key and scope["path"] != "/health":
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, f"Bearer {s.api_key}".encode()):
                s.errors[401] = s.errors.get(401, 0) + 1
                response = _json_error(401, "missing or wrong API key: send the header Authorization: Bearer KEY",
                                       code="invalid_api_key")
                return await response(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start" and message["status"] >= 400:
                s.errors[message["status"]] = s.errors.get(message["status"], 0) + 1
            await send(message)

        await self.app(scope, receive, counting_send)


def create_app(s: Served) -> FastAPI:
    app = FastAPI(title="jaxlm", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, served=s)

    @app.exception_handler(RequestError)
    async def request_error(request: Request, e: RequestError):
        headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 429 else None
        return _json_error(e.status, str(e), e.param, e.code, headers)

    _info_routes(app, s)
    _completion_route(app, s)
    _chat_route(app, s)
    return app


def _info_routes(app: FastAPI, s: Served) -> None:
    """/health, /v1/models, /metrics and /tokenize."""

    @app.get("/health")
    async def health():
        return {"status": "ok" if s.engine.running else "stopped"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": s.name, "object": "model", "created": 0, "owned_by": "jaxlm",
                                            "max_model_len": s.engine.S}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus(s), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _body(request)
        if not isinstance(body, dict) or not isinstance(body.get("prompt", body.get("text")), str):
            raise RequestError("give the text to tokenize as {\"prompt\": TEXT}", "prompt")
        ids = _encode(s, body.get("prompt", body.get("text")))
        return {"tokens": ids, "count": len(ids), "max_model_len": s.engine.S}


def _completion_route(app: FastAPI, s: Served) -> None:
    """/v1/completions: text or token-id prompts, `n` choices each, `echo` and `logprobs` (scored prompts)."""

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _body(request)
        _check_model(s, body)
        req = schemas.completion(body, s.decode_cfg)
        ids = [_encode(s, p, s.encode_prompt) if isinstance(p, str) else _check_ids(s, p) for p in req.prompts]
        max_tokens = [_max_tokens(s, len(p), req.sampling.max_tokens) for p in ids]
        want_scores = req.echo and req.logprobs is not None
        scores = await asyncio.gather(*(_score(s, p) for p in ids)) if want_scores else [None] * len(ids)
        choices = _start(s, ids, max_tokens, req.sampling)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": s.name}

        def prompt_logprobs(i):
            if not want_scores:
                return []
            token_lp, top_ids, top_lp = scores[i]
            p = ids[i]
            return [(p[0], None, [])] + [(p[j], token_lp[j - 1], list(zip(top_ids[j - 1], top_lp[j - 1])))
                                         for j in range(1, len(p))]

        def choice_body(k, c: Choice, text: str, fresh: list, finish):
            out = {"index": k, "text": text, "logprobs": None, "finish_reason": finish}
            if req.logprobs is not None:
                out["logprobs"] = _completion_logprobs(s, fresh, req.logprobs)
            return out

        prompt_texts = [p if isinstance(p, str) else s.decode(ids[i]) for i, p in enumerate(req.prompts)]
        usage = {"prompt_tokens": sum(map(len, ids))}
        if req.sampling.stream:
            echoed = [choice_body(k, c, prompt_texts[k // req.sampling.n], prompt_logprobs(k // req.sampling.n),
                                  None) for k, c in enumerate(choices)] if req.echo else []
            return _event_stream(s, request, choices, head, echoed, choice_body,
                                 usage if req.sampling.include_usage else None)
        await _wait(s, choices, request)
        out = []
        for k, c in enumerate(choices):
            i = k // req.sampling.n
            text = (prompt_texts[i] if req.echo else "") + c.state.text
            out.append(choice_body(k, c, text, prompt_logprobs(i) + c.logprobs, c.finish_reason))
        return {**head, "choices": out, "usage": _usage(usage, choices)}


def _chat_route(app: FastAPI, s: Served) -> None:
    """/v1/chat/completions: the messages rendered by the chat template, answered as one assistant message."""

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _body(request)
        _check_model(s, body)
        req = schemas.chat(body, s.decode_cfg)
        if s.chat_template is None:
            raise RequestError("this model's tokenizer has no chat template: use /v1/completions, or start the "
                               "server with serve.chat_template=FILE (a Jinja chat template)", "messages")
        try:
            prompt = s.chat_template(req.messages)
        except Exception as e:
            raise RequestError(f"the chat template failed on these messages: {e}", "messages") from None
        ids = [_encode(s, prompt, s.encode_chat)]
        choices = _start(s, ids, [_max_tokens(s, len(ids[0]), req.sampling.max_tokens)], req.sampling)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": s.name}
        usage = {"prompt_tokens": len(ids[0])}

        def logprobs(fresh):
            if not req.logprobs:
                return None
            return {"content": [{"token": s.decode([t]), "logprob": lp,
                                 "top_logprobs": [{"token": s.decode([a]), "logprob": b}
                                                  for a, b in top[:req.top_logprobs]]}
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
        return {**head, "choices": [{"index": k, "message": {"role": "assistant", "content": c.state.text},
                                     "logprobs": logprobs(c.logprobs), "finish_reason": c.finish_reason}
                                    for k, c in enumerate(choices)],
                "usage": _usage(usage, choices)}


def _event_stream(s: Served, request: Request, choices: list[Choice], head: dict, opening: list[dict],
                  choice_chunk: Callable, usage: dict | None) -> StreamingResponse:
    """A streamed answer as server-sent events: a chunk for each of `opening` (choices' first chunks), then one
    per piece of the choices' text as it comes (`choice_chunk(index, choice, text, logprobs, finish)`), the usage
    when asked for (`usage` not None), and [DONE]. Every chunk carries `head` (id, object, created, model)."""
    async def events():
        for choice in opening:
            yield _sse({**head, "choices": [choice]})
        async for k, c, text, fresh, finish in _stream(s, choices, request):
            yield _sse({**head, "choices": [choice_chunk(k, c, text, fresh, finish)]})
        if usage is not None:
            yield _sse({**head, "choices": [], "usage": _usage(usage, choices)})
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def _body(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None


def _check_model(s: Served, body) -> None:
    if isinstance(body, dict) and body.get("model") not in (None, s.name):
        raise RequestError(f"model {body.get('model')!r} is not served here; this server serves {s.name!r}",
                           "model", code="model_not_found")


def _encode(s: Served, text: str, encode: Callable[[str], list[int]] | None = None) -> list[int]:
    try:
        return (encode or s.encode)(text)
    except ValueError as e:  # a character outside a char/byte vocabulary (TokenizerError)
        raise RequestError(f"the prompt cannot be tokenized: {e}", "prompt") from None


def _check_ids(s: Served, ids: list[int]) -> list[int]:
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
        return min(s.decode_cfg.max_new_tokens, S - prompt_len)
    if prompt_len + asked > S:
        raise RequestError(f"max_tokens={asked} with a prompt of {prompt_len} tokens runs past the context of {S} "
                           f"tokens: at most {S - prompt_len}", "max_tokens", code="context_length_exceeded")
    return asked


async def _score(s: Served, ids: list[int]):
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def emit(ev):
        try:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(ev))
        except RuntimeError:  # the server is shutting down: nobody is waiting any more
            pass

    item = engine_lib.Score(ids, emit)
    try:
        s.engine.submit(item)
    except engine_lib.QueueFull:
        raise _queue_full() from None
    try:
        ev = await done
    except asyncio.CancelledError:
        s.engine.cancel(item)
        raise
    if ev[0] == "error":
        raise RequestError(f"scoring the prompt failed: {ev[1]}", status=500)
    return ev[1:]


def _queue_full() -> RequestError:
    return RequestError("the server's queue is full; retry later", status=429, code="queue_full")


def _start(s: Served, ids: list[list[int]], max_tokens: list[int], sampling: schemas.Sampling) -> list[Choice]:
    """Queue n sequences per prompt (none when max_tokens is 0); all or none: a full queue cancels the rest."""
    loop = asyncio.get_running_loop()
    seed = sampling.seed if sampling.seed is not None else int.from_bytes(uuid.uuid4().bytes[:4], "little")
    choices = []
    for p, m in zip(ids, max_tokens):
        for j in range(sampling.n):
            q: asyncio.Queue = asyncio.Queue()

            def emit(ev, q=q):
                try:
                    loop.call_soon_threadsafe(q.put_nowait, ev)
                except RuntimeError:  # the server is shutting down: nobody is waiting any more
                    pass

            seq = engine_lib.Sequence(p, m, sampling.temperature, sampling.top_k, sampling.top_p, seed, j,
                                      s.stop_ids, emit)
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


def _apply(s: Served, c: Choice, ev) -> tuple[str, list, str | None]:
    """One engine event into (new text, new logprobs, finish reason or None)."""
    if ev[0] == "token":
        if c.state.stopped:
            return "", [], None
        text = c.state.add(ev[1])
        fresh = [ev[1:]]
        c.logprobs.extend(fresh)
        if c.state.stopped:
            s.engine.cancel(c.seq)
            c.finish_reason = "stop"
            return text + c.state.flush(), fresh, None
        return text, fresh, None
    if ev[0] == "error":
        raise RequestError(f"generation failed: {ev[1]}", status=500)
    if c.finish_reason != "stop":
        c.finish_reason = "stop" if ev[1] in ("stop", "cancelled") else ev[1]
    return c.state.flush(), [], c.finish_reason


async def _watch(request: Request, choices: list[Choice], s: Served) -> None:
    while True:
        await asyncio.sleep(0.1)
        if await request.is_disconnected():
            for c in choices:
                s.engine.cancel(c.seq)
            return


async def _wait(s: Served, choices: list[Choice], request: Request) -> None:
    watcher = asyncio.create_task(_watch(request, choices, s))
    try:
        for c in choices:
            while True:
                if _apply(s, c, await c.events.get())[2] is not None:
                    break
    finally:
        watcher.cancel()
        for c in choices:
            s.engine.cancel(c.seq)


async def _stream(s: Served, choices: list[Choice], request: Request):
    """(index, choice, text, logprobs, finish) as events arrive, over all choices; cancels on disconnect (the
    response generator is closed then)."""
    pending = {asyncio.ensure_future(c.events.get()): k for k, c in enumerate(choices)}
    watcher = asyncio.create_task(_watch(request, choices, s))  # the server may keep writing to a closed socket
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                k = pending.pop(fut)
                c = choices[k]
                text, fresh, finish = _apply(s, c, fut.result())
                if text or fresh or finish:
                    yield k, c, text, fresh, finish
                if finish is None:
                    pending[asyncio.ensure_future(c.events.get())] = k
    finally:
        watcher.cancel()
        for fut in pending:
            fut.cancel()
        for c in choices:
            s.engine.cancel(c.seq)


def _completion_logprobs(s: Served, fresh: list, top_n: int) -> dict:
    tokens = [s.decode([t]) for t, _, _ in fresh]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in fresh],
            "top_logprobs": [None if lp is None else {s.decode([a]): b for a, b in top[:top_n]}
                             for _, lp, top in fresh],
            "text_offset": offsets}


def _usage(usage: dict, choices: list[Choice]) -> dict:
    completion = sum(len(c.state.tokens) for c in choices)
    return {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": completion,
            "total_tokens": usage["prompt_tokens"] + completion}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


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
    metric("jaxlm_generated_tokens_total", "counter", "Tokens generated.", [("", e.tokens_total)])
    metric("jaxlm_prompt_tokens_total", "counter", "Prompt tokens of the sequences admitted.",
           [("", e.prompt_tokens_total)])
    metric("jaxlm_prefill_tokens_total", "counter", "Prompt tokens run through the model (not reused).",
           [("", e.prefilled_tokens_total)])
    metric("jaxlm_prefix_cache_hits_total", "counter", "Sequences that reused a stored prompt's keys and values.",
           [("", e.prefix_hits_total)])
    metric("jaxlm_prefix_cache_tokens_total", "counter", "Prompt tokens reused from the prefix cache.",
           [("", e.prefix_tokens_total)])
    metric("jaxlm_sequences_total", "counter", "Sequences admitted into a slot.", [("", e.requests_total)])
    metric("jaxlm_generation_tokens_per_second", "gauge", "Tokens generated per second over the last 10 s.",
           [("", round(e.tokens_per_s(), 3))])
    metric("jaxlm_time_to_first_token_seconds", "summary",
           "Time from a sequence's arrival to its first token (the latest 1000 sequences).",
           [('{quantile="0.5"}', q(0.5)), ('{quantile="0.99"}', q(0.99)), ("_sum", sum(ttft)),
            ("_count", len(ttft))])
    metric("jaxlm_http_errors_total", "counter", "Answers with an error status.",
           [(f'{{code="{k}"}}', v) for k, v in sorted(s.errors.items())])
    return "\n".join(lines) + "\n"
