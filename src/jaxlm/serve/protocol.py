"""HTTP/1.1 connections with limits (issue 47): uvicorn's httptools protocol, plus a bound on each request's head
(its line and headers: serve.max_header_kb, its bytes counted as they arrive, before the parser keeps any of them;
serve.max_headers), on the time its head and its body take to arrive (serve.header_timeout_s, serve.body_timeout_s)
and on the connections open at once (serve.max_connections). Without them one client could hold the server's
memory and its clients' connections. Each refusal (431, 408, 503) is an OpenAI-style JSON error with `connection:
close`, counted by the `count` callable the server hands over (the app's error counter, /metrics), then the
connection is closed; a request refused behind pipelined ones is answered after them, and what a client pipelines
behind a long answer is read one read's worth at a time. docs/serve.md ("Security") has the details and figures.
"""

from __future__ import annotations

import functools
import json
from typing import Callable

from jaxlm.config import ConfigError, ServeConfig

try:
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
except ImportError as e:  # httptools or uvicorn missing: both come with the serve extra
    raise ConfigError(f"`jaxlm serve` needs uvicorn and httptools ({e}): pip install 'jaxlm[serve]'") from None

from jaxlm.serve.schemas import error_body


def protocol(limits: ServeConfig, count: Callable[[int], None]) -> Callable[..., LimitedProtocol]:
    """What uvicorn.Config takes as `http=`: a factory of connections under `limits` (serve.* settings) that call
    `count(status)` for each refusal they answer. uvicorn builds each connection's protocol by calling it with its
    own arguments (config, server_state, app_state, _loop)."""
    return functools.partial(LimitedProtocol, limits=limits, count=count)


def error_answer(status: int, message: str, code: str, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A whole HTTP answer: an OpenAI-style JSON error body, and `connection: close`."""
    body = json.dumps(error_body(status, message, None, code), separators=(",", ":")).encode()
    head = [STATUS_LINE[status]]
    head += [name + b": " + value + b"\r\n" for name, value in default_headers]  # date, server
    head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body), b"connection: close\r\n"]
    return b"".join(head) + b"\r\n" + body


class LimitedProtocol(HttpToolsProtocol):
    """One connection: uvicorn's httptools protocol under serve.*'s limits (the module's docstring says which)."""

    def __init__(self, *args, limits: ServeConfig, count: Callable[[int], None], **kwargs):
        super().__init__(*args, **kwargs)
        self.limits, self.count = limits, count
        self.max_head_bytes = int(limits.max_header_kb * 1024)
        self.reading_head = True  # the parser is in a request's head, or waits for the next request
        self.head_bytes = 0  # bytes received since that head began, as data_received counts them
        self.head_size = 0  # the head's target and headers, as the parser hands them over
        self.header_count = 0
        self.heads = 0  # heads completed on this connection
        self.refusal: tuple[int, str, str] | None = None  # (status, message, code) found by a parser callback
        self.over_limit = False  # opened while serve.max_connections were open
        self.head_timer = self.body_timer = None

    # The connection

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.over_limit = len(self.connections) > self.limits.max_connections
        self.head_timer = self.loop.call_later(self.limits.header_timeout_s, self.head_timed_out)
        self.resume_reading = self.flow.resume_reading
        self.flow.resume_reading = self.resume_unless_queued

    def resume_unless_queued(self) -> None:
        """uvicorn resumes reading whenever an app awaits its request, and so does every is_disconnected() poll
        of a long answer: not while requests wait in the pipeline or a refusal is pending, so that a client that
        pipelines requests behind a long answer has at most one read's worth parsed and queued (unbounded before:
        70,867 requests queued in 2 s behind one stream)."""
        if not self.pipeline and self.refusal is None:
            self.resume_reading()

    def connection_lost(self, exc) -> None:
        self.cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.reading_head:
            self.head_bytes += len(data)
            if self.head_bytes > self.max_head_bytes:
                return self.head_past_limit(data)
        self.feed(data)

    def feed(self, data: bytes) -> None:
        """Parse `data` (uvicorn's data_received), then answer a refusal a parser callback found in it. Once a
        request is refused, what follows it is thrown away unparsed."""
        if self.refusal is None:
            super().data_received(data)
        if self.refusal is not None:
            self.refuse_head(self.refusal)

    def head_past_limit(self, data: bytes) -> None:
        """`data` takes the head being read past serve.max_header_kb: give the parser only the bytes within the
        limit, and refuse the request (431) unless its head ended in them; the bytes after a head that ended are
        counted and parsed as usual (they may hold the next request's head, itself past the limit)."""
        while True:
            within = self.max_head_bytes - (self.head_bytes - len(data))  # bytes of `data` the head may still take
            heads = self.heads
            self.feed(data[:within])
            if self.refusal is not None or self.transport.is_closing():
                return
            if self.heads == heads:
                return self.refuse_head(self.too_large())
            data = data[within:]
            if not self.reading_head:  # a body
                return self.feed(data)
            self.head_bytes += len(data)  # the next head (its count started over when the request before ended)
            if self.head_bytes <= self.max_head_bytes:
                return self.feed(data)

    # Refusals

    def too_large(self) -> tuple[int, str, str]:
        return (431, f"the request's line and headers are larger than serve.max_header_kb="
                f"{self.limits.max_header_kb:g} KiB", "request_header_fields_too_large")

    def refuse_head(self, refusal: tuple[int, str, str]) -> None:
        """Refuse the request whose head is being read: answer (status, message, code) and close the connection,
        once the answers to the requests pipelined before it have ended (reading stays stopped until then)."""
        self.refusal = refusal
        if self.transport.is_closing():
            return
        if self.idle():
            self.close_with(*refusal)
        else:  # on_response_complete answers it
            self.flow.pause_reading()

    def close_with(self, status: int, message: str, code: str, answer: bool = True) -> None:
        """Answer `status` (unless `answer` is False), count it, and close the connection."""
        self.cancel_timers()
        if answer:
            self.transport.write(error_answer(status, message, code, self.server_state.default_headers))
            self.count(status)
        self.transport.close()

    def head_timed_out(self) -> None:
        self.head_timer = None
        if self.head_bytes == 0:  # nothing of a request came: close as an idle connection
            self.cancel_timers()
            self.transport.close()
        else:  # the timer runs only while every request before is answered
            self.close_with(408, "the request's line and headers did not arrive within serve.header_timeout_s="
                            f"{self.limits.header_timeout_s:g} s", "request_timeout")

    def body_timed_out(self) -> None:
        """Answer 408 unless the request's response has started (then only close), and let its app, which may be
        awaiting the body, read a disconnect."""
        self.body_timer = None
        cycle = self.cycle
        cycle.disconnected = True
        cycle.message_event.set()
        self.close_with(408, "the request's body did not arrive within serve.body_timeout_s="
                        f"{self.limits.body_timeout_s:g} s of its headers", "request_timeout",
                        answer=not cycle.response_started)

    # Timers

    def start_head_timer(self) -> None:
        if self.head_timer is None:
            self.head_timer = self.loop.call_later(self.limits.header_timeout_s, self.head_timed_out)

    def start_body_timer(self) -> None:
        if self.body_timer is None:
            self.body_timer = self.loop.call_later(self.limits.body_timeout_s, self.body_timed_out)

    def cancel_timers(self) -> None:
        for timer in (self.head_timer, self.body_timer):
            if timer is not None:
                timer.cancel()
        self.head_timer = self.body_timer = None

    def idle(self) -> bool:
        """Every request read so far is answered: the connection owes the server its next request."""
        return self.cycle is None or self.cycle.response_complete

    def queued(self) -> bool:
        """The request being read waits behind an earlier one (pipelined; uvicorn stops reading meanwhile)."""
        return bool(self.pipeline) and self.pipeline[0][0] is self.cycle

    # Parser callbacks: a refusal found in one is kept, and every later callback of the data ignored.

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.head_size = self.header_count = 0

    def on_url(self, url: bytes) -> None:
        if self.refusal is None:
            self.head_size += len(url)
            if self.head_size > self.max_head_bytes:
                self.refusal = self.too_large()
            else:
                super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.refusal is None:
            self.header_count += 1
            self.head_size += len(name) + len(value) + 4  # ": " and CRLF
            if self.header_count > self.limits.max_headers:
                self.refusal = (431, f"the request has more than serve.max_headers={self.limits.max_headers} "
                                "headers", "request_header_fields_too_large")
            elif self.head_size > self.max_head_bytes:
                self.refusal = self.too_large()
            else:
                super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self.refusal is not None:
            return
        self.reading_head = False
        self.heads += 1
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None
        if self.over_limit:
            self.refusal = (503, f"the server has serve.max_connections={self.limits.max_connections} connections "
                            "open; try again later", "too_many_connections")
            return
        before = self.cycle
        super().on_headers_complete()
        if self.cycle is not before and not self.queued():  # served now (not an upgrade, not pipelined)
            self.start_body_timer()

    def on_body(self, body: bytes) -> None:
        if self.refusal is None:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self.refusal is not None:
            return
        super().on_message_complete()
        self.reading_head, self.head_bytes = True, 0
        if self.body_timer is not None:
            self.body_timer.cancel()
            self.body_timer = None
        if self.idle():  # answered before its body ended
            self.start_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # starts the next pipelined request, if one is waiting
        if self.transport.is_closing():
            return
        self.resume_unless_queued()  # the pipeline's last request started: what follows it may be read
        if self.idle():
            if self.refusal is not None:  # a later request's head was refused meanwhile
                self.close_with(*self.refusal)
            elif self.reading_head:
                self.start_head_timer()
        elif not self.reading_head and not self.queued():  # a pipelined request started, its body still to come
            self.start_body_timer()
