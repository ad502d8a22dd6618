"""What stands in front of every route (`Guard`, ASGI middleware): the Host and Origin allow-lists, the API key,
the body limit, and the count of error answers; the JSON error answer the app and the guard send.
"""

from __future__ import annotations

import asyncio
import hmac

from fastapi.responses import JSONResponse

from jaxlm.serve import chat_page
from jaxlm.serve.schemas import error_body
from jaxlm.serve.served import LOOPBACK_HOSTS, Served

# After a 413 the rest of the body is read and thrown away before the connection closes (nginx's lingering close),
# at most this many bytes, for at most LINGER_S (nginx's lingering_time) while the client sends something every
# LINGER_IDLE_S (its lingering_timeout); serve.max_body_mb's help names these figures.
LINGER_BYTES = 256 << 20
LINGER_S = 30.0
LINGER_IDLE_S = 5.0


def json_error(status: int, message: str, param: str | None = None, code: str | None = None, headers=None):
    """An error answer: the OpenAI-style body (schemas.error_body) with `status`."""
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


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


def same_origin(origin: bytes, host: bytes, named: bool) -> bool:
    """Whether a browser's request comes from a page this server served (the chat page, chat_page.py): its Origin
    is http(s)://HOST with HOST as the request's Host header has it, and that name is one the server answers to
    by name (`named`: the Host was checked against serve.allowed_hosts or the loopback names) or a loopback name.
    A page elsewhere that rebinds its own name to this server's address sends an Origin and Host of that name, so
    on a server that answers any Host (serve.host=0.0.0.0, serve.uds) it is refused."""
    scheme, _, rest = origin.decode("latin-1").lower().partition("://")
    if scheme not in ("http", "https") or rest != host.decode("latin-1").strip().lower():
        return False
    return named or host_name(host) in LOOPBACK_HOSTS


class Guard:
    """ASGI middleware, in front of every route: the Host header's allow-list (a web page whose name was rebound to
    127.0.0.1 sends its own name: refused, 403), a browser's cross-origin request refused unless its Origin is
    allowed or the chat page's own (403), the API key (every path but /health and the chat page's; 401), the body
    limit (413: a Content-Length past it is refused before the body is read, a body without one when it grows past
    it; see _too_large), and the count of error answers (every answer goes out through its `send`). Plain ASGI
    rather than Starlette's BaseHTTPMiddleware, which would hide a client's disconnect from streaming answers."""

    def __init__(self, app, served: Served):
        self.app, self.s = app, served

    async def _refuse(self, scope, receive, send, status: int, message: str, code: str):
        await json_error(status, message, code=code)(scope, receive, send)

    async def _too_large(self, receive, send, unread: int) -> None:
        """Answer 413, then read and throw away the rest of the body (`unread` bytes at most; none when that is past
        LINGER_BYTES, which would be cut off anyway) before closing the connection: http.client, requests and httpx
        send the whole body before they read, and a connection closed under them while they send loses the
        answer to a reset. Each read takes what has arrived (uvicorn stops reading the socket past 64 KiB: a few
        hundred kB) and the next one waits on the socket, a turn of the event loop in which other streams flow."""
        s = self.s
        response = json_error(413, f"the request body is larger than serve.max_body_mb={s.max_body_bytes / 2**20:g} "
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

    async def __call__(self, scope, receive, raw_send):
        s = self.s
        if scope["type"] != "http":
            return await self.app(scope, receive, raw_send)
        started = False

        async def send(message):  # every answer goes out here
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] >= 400 and message["status"] != 499:
                    s.count_error(message["status"])
            await raw_send(message)

        headers = dict(scope["headers"])
        if sum(name == b"host" for name, _ in scope["headers"]) > 1:  # RFC 9112 3.2: a request with two is refused
            return await self._refuse(scope, receive, send, 400, "a request must carry one Host header",
                                      "invalid_host")
        if s.allowed_hosts is not None and host_name(headers.get(b"host", b"")) not in s.allowed_hosts:
            return await self._refuse(scope, receive, send, 403, "this Host is not served here (serve.allowed_hosts)",
                                      "host_not_allowed")
        origin = headers.get(b"origin")
        if origin is not None and origin.decode("latin-1") not in s.allowed_origins and not (
                s.ui and same_origin(origin, headers.get(b"host", b""), s.allowed_hosts is not None)):
            return await self._refuse(scope, receive, send, 403, "cross-origin requests are refused unless their "
                                      "Origin is in serve.allowed_origins (or, for the chat page, its name in "
                                      "serve.allowed_hosts)", "origin_not_allowed")
        path = scope["path"]
        if s.api_key and path != "/health" and not (s.ui and path in chat_page.PATHS):
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

        try:
            await self.app(scope, counted_receive if length is None else receive, send)
        except BodyTooLarge as e:
            if not started:
                await self._too_large(receive, send, LINGER_BYTES if e.more else 0)
