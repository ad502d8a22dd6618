"""The server's connections under serve.*'s limits (serve/protocol.py, issue 47), spoken to over raw sockets:
heads too large or with too many headers answered 431 and closed, a 256 MB header cut off after serve.max_header_kb
with the server's memory and /health unharmed, slow heads (slowloris) and silent connections closed at
serve.header_timeout_s, bodies that stop answered 408 at serve.body_timeout_s, keep-alive and pipelined requests
each under fresh limits, and connections past serve.max_connections answered 503. The server runs in this
process (its memory is this process's), on 127.0.0.1, with one-second timeouts; every wait has a deadline."""

import json
import logging
import select
import socket
import threading
import time

import pytest

from conftest import require

require("fastapi")

from jaxlm import serve  # noqa: E402
from jaxlm.config import ServeConfig  # noqa: E402

TIMEOUT_S = 1.0  # serve.header_timeout_s and serve.body_timeout_s here
SLACK_S = 0.75  # a timer's answer may come this much after its deadline on a busy machine
LIMITS = ServeConfig(header_timeout_s=TIMEOUT_S, body_timeout_s=TIMEOUT_S, max_header_kb=32.0, max_headers=100)
HOST = b"Host: 127.0.0.1\r\n"
HEALTH = b"GET /health HTTP/1.1\r\n" + HOST + b"\r\n"


@pytest.fixture(scope="module")
def served(char_data, tmp_path_factory):
    """The smallest model the server takes (a tiny char model trained for one step) behind the app."""
    from conftest import tiny_config
    from jaxlm.train import loop as train

    run = tmp_path_factory.mktemp("protocol") / "run"
    train.train(tiny_config(char_data, run, **{"training.steps": 1, "checkpoint.interval": 1,
                                               "training.eval_interval": 1, "optimizer.warmup_steps": 0}),
                log=lambda s: None)
    cfg = serve.settings_config({"serve.max_slots": 1, "serve.max_queue": 4, "max_new_tokens": 4,
                                 "serve.prefill_chunk": 16, "serve.decode_steps": 1, "serve.page_size": 0,
                                 "serve.prefix_cache": 0})  # the fewest programs to compile
    s = serve.build(run, cfg, log=lambda s: None)
    yield s
    s.engine.stop()


@pytest.fixture(scope="module")
def server(served):
    srv = serve.Server(served, "127.0.0.1", 0, limits=LIMITS).start()
    yield srv
    srv.stop(engine=False)


class Conn:
    """A raw client connection that reads whole HTTP answers (Content-Length bodies), keeping what follows one."""

    def __init__(self, srv, timeout: float = 5.0):
        self.sock = socket.create_connection(("127.0.0.1", srv.port), timeout=timeout)
        self.buf = b""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _more(self) -> None:
        data = self.sock.recv(1 << 16)
        if not data:
            raise EOFError(f"the server closed the connection after {self.buf[:200]!r}")
        self.buf += data

    def answer(self) -> tuple[int, dict, bytes]:
        """The next answer's status, headers (lower-case names) and body."""
        while b"\r\n\r\n" not in self.buf:
            self._more()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", 0))
        while len(self.buf) < length:
            self._more()
        body, self.buf = self.buf[:length], self.buf[length:]
        return int(lines[0].split()[1]), headers, body

    def closed(self, within: float) -> bool:
        """Whether the server closes the connection within `within` seconds (after anything still unread)."""
        deadline = time.monotonic() + within
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                if not self.sock.recv(1 << 16):
                    return True
            except TimeoutError:
                return False
            except ConnectionResetError:
                return True
        return False


def refused(answer: tuple[int, dict, bytes], status: int, code: str) -> str:
    """The message of an OpenAI-style error answer of `status` and `code` that closes the connection."""
    got, headers, body = answer
    assert got == status, (got, body)
    assert headers["connection"] == "close" and headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert error["code"] == code and error["param"] is None, error
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error"), error
    return error["message"]


def health_ms(conn: Conn) -> float:
    """Milliseconds from sending GET /health on `conn` to reading its answer, which must be 200."""
    start = time.perf_counter()
    conn.send(HEALTH)
    assert conn.answer()[0] == 200
    return (time.perf_counter() - start) * 1e3


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def errors(srv, status: int) -> int:
    return srv.served.errors.get(status, 0)


def test_heads_too_large_or_with_too_many_headers_are_answered_431_and_closed(server):
    """A 64 KiB header, and 101 headers, are answered 431 and their connections closed; a head of 32,764 bytes (4
    under serve.max_header_kb) with 100 headers is answered on a fresh connection."""
    before = errors(server, 431)
    with Conn(server) as c:  # a 64 KiB header
        c.send(b"GET /health HTTP/1.1\r\n" + HOST + b"X-Big: " + b"a" * (64 << 10) + b"\r\n\r\n")
        assert "serve.max_header_kb=32 KiB" in refused(c.answer(), 431, "request_header_fields_too_large")
        assert c.closed(within=2)
    with Conn(server) as c:  # Host and 100 more: 101 headers
        c.send(b"GET /health HTTP/1.1\r\n" + HOST + b"".join(b"X-H%d: v\r\n" % i for i in range(100)) + b"\r\n")
        assert "serve.max_headers=100" in refused(c.answer(), 431, "request_header_fields_too_large")
        assert c.closed(within=2)
    with Conn(server) as c:
        pad = b"X-Pad: " + b"a" * (31 << 10) + b"\r\n"
        c.send(b"GET /health HTTP/1.1\r\n" + HOST + pad + b"".join(b"X-H%d: v\r\n" % i for i in range(98)) + b"\r\n")
        assert c.answer()[0] == 200
    assert errors(server, 431) == before + 2


def test_a_256_mb_header_is_cut_off_without_harm_to_memory_or_health(server):
    """The sender of an endless header sees its connection closed long before 256 MB are sent; the server's memory
    (this process's) stays within 50 MiB of where it was, and /health answers within 50 ms meanwhile."""
    before, start_rss = errors(server, 431), rss_mib()
    latencies, peak, done = [], [start_rss], threading.Event()

    def probe():
        with Conn(server) as c:
            while not done.is_set():
                latencies.append(health_ms(c))
                peak.append(rss_mib())
                time.sleep(0.005)

    prober = threading.Thread(target=probe)
    prober.start()
    sent, chunk, deadline = 0, b"a" * (64 << 10), time.monotonic() + 20
    try:
        with Conn(server) as c:
            c.send(b"GET /health HTTP/1.1\r\n" + HOST + b"X-Big: ")
            try:
                while sent < 256 << 20 and time.monotonic() < deadline:
                    c.send(chunk)
                    sent += len(chunk)
            except (BrokenPipeError, ConnectionResetError):
                pass
            else:
                pytest.fail(f"the server took {sent / 2**20:.0f} MiB of one header without closing the connection")
        time.sleep(0.1)  # a few more probes after the cut
    finally:
        done.set()
        prober.join(timeout=30)
    print(f"sent {sent / 2**20:.2f} MiB before the close; RSS grew {max(peak) - start_rss:.1f} MiB; /health worst "
          f"{max(latencies):.1f} ms of {len(latencies)}")
    assert sent < 16 << 20
    assert max(peak) - start_rss < 50
    assert len(latencies) >= 5 and max(latencies) < 50
    assert errors(server, 431) == before + 1


def test_slowloris_connections_are_closed_at_the_header_timeout_while_health_answers(server):
    """100 connections trickle a byte every 0.3 s of a request line or of headers that never end: each is answered
    408 and closed by about serve.header_timeout_s; /health answers meanwhile and after."""
    before = errors(server, 408)
    starts = [b"GET /heal", b"GET /health HTTP/1.1\r\n" + HOST + b"X-Slow: a"]
    opened, conns = [], []
    for i in range(100):
        opened.append(time.monotonic())
        conns.append(Conn(server))
        conns[i].send(starts[i % 2])
    open_, closed_at, answers, latencies = set(range(100)), {}, {}, []  # closed_at: seconds after opening
    with Conn(server) as h:
        while open_ and time.monotonic() < opened[0] + TIMEOUT_S + 3:
            latencies.append(health_ms(h))
            readable, _, _ = select.select([conns[i].sock for i in open_], [], [], 0.3)
            for i in [i for i in open_ if conns[i].sock in readable]:
                try:
                    data = conns[i].sock.recv(1 << 16)
                except ConnectionResetError:  # a trickled byte the server had not read when it closed
                    data = b""
                if data:
                    answers[i] = answers.get(i, b"") + data
                else:
                    open_.discard(i)
                    closed_at[i] = time.monotonic() - opened[i]
            for i in list(open_):
                try:
                    conns[i].send(b"a")
                except (BrokenPipeError, ConnectionResetError):
                    open_.discard(i)
                    closed_at[i] = time.monotonic() - opened[i]
        for c in conns:
            c.sock.close()
        latencies.append(health_ms(h))
    print(f"100 slow connections closed {min(closed_at.values(), default=0):.2f}-"
          f"{max(closed_at.values(), default=0):.2f} s after they opened; /health worst {max(latencies):.1f} ms")
    assert not open_, f"{len(open_)} of 100 slow connections still open after {TIMEOUT_S + 3} s"
    assert TIMEOUT_S - 0.05 < min(closed_at.values()) and max(closed_at.values()) < TIMEOUT_S + SLACK_S
    assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers.values()) and len(answers) >= 50  # read before a reset
    assert errors(server, 408) == before + 100
    assert max(latencies) < 100


def test_a_connection_that_sends_nothing_is_closed_at_the_header_timeout(server):
    start = time.monotonic()
    with Conn(server) as c:
        assert c.closed(within=TIMEOUT_S + SLACK_S)
        assert time.monotonic() - start > TIMEOUT_S - 0.05
        assert c.buf == b""  # silently, as an idle connection


@pytest.mark.parametrize("body", ["short", "chunked"])
def test_a_body_that_stops_is_answered_408_and_the_app_sees_a_disconnect(server, body, caplog):
    """A POST whose Content-Length says 1000 sends 10 bytes, or a chunked body never ends: 408 at about
    serve.body_timeout_s, and the app's task, which awaited the body, ends quietly (no traceback logged)."""
    caplog.set_level(logging.WARNING)
    head = b"POST /v1/completions HTTP/1.1\r\n" + HOST + b"Content-Type: application/json\r\n"
    if body == "short":
        request = head + b"Content-Length: 1000\r\n\r\n" + b'{"prompt":'
    else:
        request = head + b"Transfer-Encoding: chunked\r\n\r\n" + b'a\r\n{"prompt":\r\n'
    before = errors(server, 408)
    with Conn(server) as c:
        start = time.monotonic()
        c.send(request)
        message = refused(c.answer(), 408, "request_timeout")
        assert TIMEOUT_S - 0.05 < time.monotonic() - start < TIMEOUT_S + SLACK_S
        assert "serve.body_timeout_s=1 s" in message
        assert c.closed(within=1)
    assert errors(server, 408) == before + 1
    deadline = time.monotonic() + 5
    while server.server.server_state.tasks:
        assert time.monotonic() < deadline, "the app still awaits the body of a request that timed out"
        time.sleep(0.01)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[-2000:]


def test_keep_alive_and_pipelined_requests_each_get_fresh_limits(server):
    """Two requests of 20 KiB heads on one connection, the second sent 0.8 x serve.header_timeout_s after the first
    answer, are both answered (their heads counted apart, the timer restarted), and the idle connection is closed
    at serve.header_timeout_s after the second. Pipelined in one write, two such requests are answered and a third
    of 40 KiB is answered 431."""
    pad = b"X-Pad: " + b"a" * (20 << 10) + b"\r\n"
    request = b"GET /health HTTP/1.1\r\n" + HOST + pad + b"\r\n"
    with Conn(server) as c:
        c.send(request)
        assert c.answer()[0] == 200
        time.sleep(0.8 * TIMEOUT_S)
        c.send(request)
        assert c.answer()[0] == 200
        start = time.monotonic()
        assert c.closed(within=TIMEOUT_S + SLACK_S) and time.monotonic() - start > TIMEOUT_S / 2
    with Conn(server) as c:
        c.send(request + request + b"GET /health HTTP/1.1\r\n" + HOST + b"X-Pad: " + b"a" * (40 << 10) + b"\r\n\r\n")
        assert c.answer()[0] == 200
        assert c.answer()[0] == 200
        refused(c.answer(), 431, "request_header_fields_too_large")
        assert c.closed(within=2)


def test_a_connection_past_max_connections_is_answered_503(served):
    """With serve.max_connections=2, a third connection's request is answered 503 and closed while the first two go
    on; once they have closed, a new connection is answered."""
    srv = serve.Server(served, "127.0.0.1", 0, limits=ServeConfig(max_connections=2)).start()
    before = errors(srv, 503)
    try:
        with Conn(srv) as a, Conn(srv) as b:
            health_ms(a), health_ms(b)  # both answered 200
            with Conn(srv) as c:
                c.send(HEALTH)
                assert "serve.max_connections=2" in refused(c.answer(), 503, "too_many_connections")
                assert c.closed(within=2)
            health_ms(a)
        deadline, refusals = time.monotonic() + 5, 1
        while True:  # until the server has seen the two closes
            with Conn(srv) as d:
                d.send(HEALTH)
                status = d.answer()[0]
            if status == 200:
                break
            assert status == 503 and time.monotonic() < deadline, f"{status} after the other connections closed"
            refusals += 1
            time.sleep(0.05)
        assert errors(srv, 503) == before + refusals
    finally:
        srv.stop(engine=False)


def test_requests_pipelined_behind_a_long_answer_are_read_a_read_at_a_time(server, monkeypatch):
    """A streamed completion of 20 tokens (decode calls slowed to 0.1 s: about 2 s) and, on the same connection,
    4,000 requests pipelined behind it in chunks of 100 over its first half second: while the stream runs the
    connection has parsed only what its first read after the stream's request brought (its app's disconnect polls,
    every 0.1 s, used to resume reading: all 4,000 queued), and every request is answered after it."""
    from test_serve import log_decode_calls

    log_decode_calls(monkeypatch, lambda rows, live, steps: time.sleep(0.1))
    body = b'{"prompt": "ab", "max_tokens": 20, "stream": true}'
    stream = (b"POST /v1/completions HTTP/1.1\r\n" + HOST + b"Content-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    queued, sampling = [0], threading.Event()
    sampling.set()

    def watch():  # the longest pipeline of any connection while the stream runs
        while sampling.is_set():
            try:
                queued[0] = max([queued[0]] + [len(p.pipeline) for p in list(server.server.server_state.connections)])
            except RuntimeError:  # the set changed while it was copied
                pass
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with Conn(server, timeout=30) as c:
            c.send(stream)
            for _ in range(40):
                c.send(HEALTH * 100)
                time.sleep(0.01)
            time.sleep(0.5)  # the stream still runs: reading must have stayed paused
            sampling.clear()
            watcher.join()
            data, deadline = b"", time.monotonic() + 60
            while data.count(b"HTTP/1.1 200") < 4001:
                assert time.monotonic() < deadline, data.count(b"HTTP/1.1 200")
                data += c.sock.recv(1 << 16)
    finally:
        sampling.clear()
        watcher.join()
    assert data.index(b"[DONE]") < data.index(b'{"status":"ok"}')  # the stream was still running while sampled
    assert data.count(b'{"status":"ok"}') == 4000
    assert 0 < queued[0] <= 1000, queued[0]
