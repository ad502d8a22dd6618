"""The HTTP API: OpenAI-compatible /v1/models, /v1/completions and /v1/chat/completions (streamed as server-sent
events with `stream: true`), /tokenize, /health and /metrics (Prometheus text), over the engine's slots, and the
chat page at / (chat_page.py). A request passes guard.py's Guard, is read and validated (schemas.py), and its prompts
are tokenized and bounded here; its choices are queued, waited for or streamed by choices.py. Work on large bodies,
texts and answers runs in a worker thread, so that no request holds the event loop (other streams' tokens) for long.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from starlette.requests import ClientDisconnect

from jaxlm.serve import chat_page, images, schemas
from jaxlm.serve.choices import (Choice, completion_logprobs, event_stream, request_id, score_prompts, start_choices,
                                 usage_counts, wait_choices)
from jaxlm.serve.guard import Gone, Guard, json_error
from jaxlm.serve.schemas import RequestError, shown
from jaxlm.serve.served import Served

RETRY_AFTER_S = 1
# Work done in a worker thread from these sizes, so that no request holds the event loop (other streams' tokens)
# for long: bodies parsed and validated, chat templates rendered, answers serialized from OFF_LOOP_BYTES, texts
# tokenized from OFF_LOOP_CHARS characters.
OFF_LOOP_BYTES = 256 << 10
OFF_LOOP_CHARS = 32 << 10
ANSWER_BYTES_PER_TOKEN = 48  # of a completion answer, about, per token and per log-probability (to pick the thread)
log = logging.getLogger("jaxlm.serve")


def create_app(s: Served) -> FastAPI:
    app = FastAPI(title="jaxlm", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, served=s)

    @app.exception_handler(RequestError)
    async def request_error(request: Request, e: RequestError):
        headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 429 else None
        if e.status >= 500:
            log.warning("jaxlm serve: %s %s answered %d: %s", request.method, request.url.path, e.status, e)
        return json_error(e.status, str(e), e.param, e.code, headers)

    @app.exception_handler(Gone)
    async def gone(request: Request, e: Gone):
        return Response(status_code=499)  # never sent: the connection is closed (Guard does not count it)

    _info_routes(app, s)
    _completion_route(app, s)
    _chat_route(app, s)
    if s.ui:
        chat_page.add_routes(app)
    return app


def _info_routes(app: FastAPI, s: Served) -> None:
    """/health, /v1/models, /metrics and /tokenize."""

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        return {"status": "ok" if s.engine.running else "stopped"}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        common = {"object": "model", "created": 0, "owned_by": "jaxlm", "max_model_len": s.engine.S,
                  "bos_token_id": s.bos_id, "eos_token_id": s.eos_id, "images": s.images is not None,
                  "images_refused": None if s.images is not None else s.images_refused}
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
        scores = await score_prompts(s, ids, request, adapter) if want_scores else [None] * len(ids)
        choices = start_choices(s, ids, max_tokens, req.sampling, req.logprobs, adapter)
        head = {"id": request_id("cmpl"), "object": "text_completion", "created": int(time.time()),
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
                out["logprobs"] = completion_logprobs(s, fresh, req.logprobs, req.token_ids)
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
            return event_stream(s, request, choices, head, echoed, choice_body,
                                usage if req.sampling.include_usage else None)
        await wait_choices(s, choices, request)

        def answer():
            texts, out = prompt_texts() if req.echo else None, []
            for k, c in enumerate(choices):
                i = k // req.sampling.n
                text = (texts[i] if req.echo else "") + c.state.text
                out.append(choice_body(k, c, text, prompt_logprobs(i) + c.logprobs, c.finish_reason))
            return orjson.dumps({**head, "choices": out, "usage": usage_counts(usage, choices)})

        size = echoed_bytes + per_token * sum(len(c.state.tokens) for c in choices)
        return Response(await _off_loop(size, answer), media_type="application/json")


def _chat_route(app: FastAPI, s: Served) -> None:
    """/v1/chat/completions: the messages rendered by the chat template, answered as one assistant message."""

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body, size = await _body(request, sized=True)
        adapter, model = _check_model(s, body)
        req = await _off_loop(size, schemas.chat, body, s.decode_cfg)
        pixels = await asyncio.to_thread(images.pixels, s.images, s.images_refused, req.images) if req.images \
            else None
        if s.chat_template is None:
            raise RequestError("this model's tokenizer has no chat template: use /v1/completions, or start the "
                               "server with serve.chat_template=FILE (a Jinja chat template)", "messages")
        try:
            prompt = await _off_loop(size, s.chat_template, req.messages)
        except Exception as e:  # noqa: BLE001 - the template's own error (e.g. raise_exception) names the fault
            raise RequestError(f"the chat template failed on these messages: {shown(str(e))}", "messages") from None
        media = None
        if pixels is None:
            ids = [await _encode(s, prompt, s.encode_chat)]
        else:
            _encode_bound(s, prompt)
            got, image_end = await _off_loop(len(prompt), images.prompt, s.images, prompt, pixels, s.encode_chat)
            ids = [got]
            media = await asyncio.to_thread(images.media, s.images, got, pixels, image_end)
        _check_room(s, req.sampling.n)
        choices = start_choices(s, ids, [_max_tokens(s, len(ids[0]), req.sampling.max_tokens)], req.sampling,
                                req.top_logprobs if req.logprobs else None, adapter, media)
        head = {"id": request_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()),
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
            return event_stream(s, request, choices, {**head, "object": "chat.completion.chunk"}, roles, chunk,
                                usage if req.sampling.include_usage else None)
        await wait_choices(s, choices, request)

        def answer():
            return orjson.dumps({**head, "choices": [{"index": k, "message": {"role": "assistant",
                                                                            "content": c.state.text},
                                                      "logprobs": logprobs(c.logprobs),
                                                      "finish_reason": c.finish_reason}
                                                     for k, c in enumerate(choices)],
                                 "usage": usage_counts(usage, choices)})

        size = ANSWER_BYTES_PER_TOKEN * (1 + req.top_logprobs) * sum(len(c.state.tokens) for c in choices)
        return Response(await _off_loop(size, answer), media_type="application/json")


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
    if bounded:
        _encode_bound(s, text)
    try:
        if len(text) >= OFF_LOOP_CHARS:
            return await asyncio.to_thread(encode or s.encode, text)
        return (encode or s.encode)(text)
    except ValueError as e:  # a character outside a char/byte vocabulary (TokenizerError)
        raise RequestError(f"the prompt cannot be tokenized: {shown(str(e))}", "prompt") from None


def _encode_bound(s: Served, text: str) -> None:
    """Refuse a prompt text longer than the context's tokens can hold (s.max_prompt_chars)."""
    if s.max_prompt_chars is not None and len(text) > s.max_prompt_chars:
        raise RequestError(f"the prompt of {len(text)} characters is longer than the context of {s.engine.S} "
                           "tokens can hold", "prompt", code="context_length_exceeded")


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
