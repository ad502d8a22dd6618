"""Request validation for the OpenAI-compatible API: a JSON body in, a typed request out, or a RequestError
naming the field, the bad value and what is allowed (answered as 400 with an OpenAI-style error body).

Sampling defaults come from the server's decode.* settings; a request's max_tokens must fit in the cache with
its prompt, and when it is left out it is decode.max_new_tokens cut to what fits. Every number is bounded here
or by the app (max_tokens by the context, top_k by the vocabulary, the count of sequences by the queue) before it
reaches the engine, and a message quotes at most SHOWN_CHARS characters of what the client sent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from jaxlm.config import DecodeConfig
from jaxlm.errors import UserError
from jaxlm.infer.sampling import TOP_LOGPROBS

MAX_N = 16
MAX_STOP = 4
MAX_PROMPTS = 256
SEED_RANGE = (-2**63, 2**64 - 1)  # any 64-bit seed, signed or not (the engine draws from it modulo 2^32)
UNSUPPORTED_ZERO = ("presence_penalty", "frequency_penalty")
SHOWN_CHARS = 60  # of a client's value quoted back in an error message
# the error body's `type` of each status (every other one: server_error)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error", 431: "invalid_request_error"}


def shown(value: Any) -> str:
    """A client's value as an error message quotes it: its repr, cut to SHOWN_CHARS characters (a 1 MB model name
    is not sent back whole)."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


class RequestError(UserError, ValueError):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI-style error body of an answer with `status` (or of a stream's error event)."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


@dataclass(frozen=True)
class Sampling:
    max_tokens: int | None  # None: decode.max_new_tokens, cut to fit the cache
    temperature: float
    top_k: int
    top_p: float
    n: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[str | list[int]]
    sampling: Sampling
    logprobs: int | None
    echo: bool
    token_ids: bool  # return_tokens_as_token_ids: log-probabilities name tokens "token_id:N", not their text


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]  # a message with images: its content a list of {"type": "text"|"image"} items
    sampling: Sampling
    logprobs: bool
    top_logprobs: int
    images: list[tuple[str, str]]  # (the part, "messages[i].content[j]"; its URL) of each image part, in order


def _int(body: dict, key: str, default, lo: int | None = None, hi: int | None = None, allow_none=True):
    v = body.get(key, default)
    if v is None and allow_none:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(f"{key} must be an integer, got {shown(v)}", key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise RequestError(f"{key}={shown(v)} is out of range: allowed {lo if lo is not None else '-inf'} to "
                           f"{hi if hi is not None else 'inf'}", key)
    return v


def _float(body: dict, key: str, default: float, lo: float, hi: float, lo_open=False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise RequestError(f"{key} must be a finite number, got {shown(v)}", key)
    if v < lo or v > hi or (lo_open and v == lo):
        raise RequestError(f"{key}={shown(v)} is out of range: allowed {'(' if lo_open else '['}{lo}, {hi}]", key)
    return float(v)


def _bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"{key} must be true or false, got {shown(v)}", key)
    return v


def _sampling(body: dict, d: DecodeConfig, max_tokens_key: str = "max_tokens") -> Sampling:
    for key in UNSUPPORTED_ZERO:
        v = body.get(key)
        if v not in (None, 0, 0.0):
            raise RequestError(f"{key}={shown(v)} is not supported by this server (only 0)", key)
    if body.get("logit_bias"):
        raise RequestError("logit_bias is not supported by this server", "logit_bias")
    max_tokens = _int(body, max_tokens_key, None, 0)
    if max_tokens is None and max_tokens_key != "max_tokens":
        max_tokens = _int(body, "max_tokens", None, 0)
    top_k = _int(body, "top_k", d.top_k, -1)  # past the vocabulary it keeps every token, as 0 and -1 do (choices.start_choices)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise RequestError(f"stop must be a non-empty string or a list of at most {MAX_STOP} of them, got "
                           f"{shown(body.get('stop'))}", "stop")
    seed = _int(body, "seed", None, *SEED_RANGE)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError(f"stream_options must be an object, got {shown(options)}", "stream_options")
    return Sampling(max_tokens=max_tokens, temperature=_float(body, "temperature", d.temperature, 0.0, 2.0),
                    top_k=max(top_k, 0), top_p=_float(body, "top_p", d.top_p, 0.0, 1.0, lo_open=True),
                    n=_int(body, "n", 1, 1, MAX_N), seed=seed, stop=tuple(stop), stream=_bool(body, "stream"),
                    include_usage=bool(options.get("include_usage")))


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def completion(body: Any, d: DecodeConfig) -> CompletionRequest:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if "prompt" not in body:
        raise RequestError("prompt is required", "prompt")
    p = body["prompt"]
    if isinstance(p, str):
        prompts = [p]
    elif _is_ids(p) and p:
        prompts = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) or (_is_ids(x) and x) for x in p):
        prompts = list(p)
    else:
        raise RequestError("prompt must be a string, a list of strings, a list of token ids or a list of lists of "
                           "token ids (none empty)", "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise RequestError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", "prompt")
    sampling = _sampling(body, d)
    logprobs = _int(body, "logprobs", None, 0, TOP_LOGPROBS)
    echo = _bool(body, "echo")
    best_of = body.get("best_of")
    if best_of not in (None, sampling.n):
        raise RequestError(f"best_of={shown(best_of)} is not supported (leave it out or equal to n)", "best_of")
    if sampling.stream and sampling.n * len(prompts) > MAX_N:
        raise RequestError(f"streaming takes at most {MAX_N} choices (prompts x n)", "n")
    return CompletionRequest(prompts, sampling, logprobs, echo, _bool(body, "return_tokens_as_token_ids"))


def chat(body: Any, d: DecodeConfig) -> ChatRequest:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects", "messages")
    out, images = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a role and a content", "messages")
        content = m.get("content")
        if isinstance(content, list):
            content = _parts(i, content, images)
        if not isinstance(content, (str, list)):
            raise RequestError(f"messages[{i}].content must be a string", "messages")
        out.append({"role": m["role"], "content": content})
    sampling = _sampling(body, d, "max_completion_tokens")
    logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, 0, TOP_LOGPROBS)
    if top and not logprobs:
        raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
    return ChatRequest(out, sampling, logprobs, top, images)


def _parts(i: int, content: list, images: list[tuple[str, str]]) -> str | list[dict]:
    """A message's content parts: their text joined, or with image_url parts (their URLs appended to `images`)
    the items a multimodal chat template takes, {"type": "text", "text": ...} and {"type": "image"}."""
    items = []
    for j, c in enumerate(content):
        kind = c.get("type") if isinstance(c, dict) else None
        if kind == "text" and isinstance(c.get("text"), str):
            items.append({"type": "text", "text": c["text"]})
            continue
        url = c.get("image_url") if kind == "image_url" else None
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise RequestError(f"messages[{i}].content[{j}]: a part must be {{\"type\": \"text\", \"text\": ...}} "
                               "or {\"type\": \"image_url\", \"image_url\": {\"url\": ...}}", "messages")
        images.append((f"messages[{i}].content[{j}]", url))
        items.append({"type": "image"})
    if all(c["type"] == "text" for c in items):
        return "".join(c["text"] for c in items)
    return items
