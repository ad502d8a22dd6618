"""`jaxlm serve` under hostile and careless clients (docs/serve.md, Security): every numeric field at its extremes
while 16 greedy streams run (each answered 4xx or validly, the streams' tokens those they get alone), a value the
decode program cannot hold failing its own request only, a device failure mid-stream ending each stream with an
error event (one log line each, counted, no internal text), scoring taking turns with decoding, /tokenize bounded,
short error messages, one Host header, HEAD, and a property-based fuzz of the request schemas against the live
server. The byte-level limits (headers, deadlines, connections) are tests/test_serve_protocol.py's."""

import concurrent.futures
import json
import logging
import threading
import time

import httpx
import pytest

from conftest import require

require("openai")
require("fastapi")
hypothesis = require("hypothesis")

import jaxlm  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from jaxlm import serve  # noqa: E402
from jaxlm.config import ServeConfig  # noqa: E402
from jaxlm.serve import programs  # noqa: E402
from jaxlm.serve.engine import ENGINE_FAILED, Engine  # noqa: E402
from jaxlm.serve.requests import Score, Sequence  # noqa: E402
from test_serve import TEMPLATE, log_decode_calls, metric, token_events, trained  # noqa: E402,F401

EXTREMES = [0, -1, 2**31, 2**63 - 1, -2**63, 2**64, 1e308, "NaN", 0.5, True, None, "x", [], {}]
FIELDS = ["max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n", "seed", "logprobs",
          "top_logprobs", "best_of", "presence_penalty", "frequency_penalty"]


@pytest.fixture(scope="module")
def server(trained, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    cfg = serve.settings_config({"serve.max_slots": 16, "serve.max_queue": 64, "max_new_tokens": 8,
                                 "serve.chat_template": str(template), "serve.model_name": "tiny",
                                 "serve.decode_steps": 8, "serve.max_tokenize_chars": 200_000})
    srv = serve.Server(serve.build(trained, cfg, log=lambda s: None), "127.0.0.1", 0).start()
    yield srv
    srv.stop()


def url(srv, path=""):
    return f"http://127.0.0.1:{srv.port}{path}"


def body_bytes(body: dict) -> bytes:
    """JSON with the string "NaN" written as the bare token NaN (not JSON, but what careless clients send)."""
    return json.dumps(body).replace('"NaN"', "NaN").encode()


def stream_text(srv, prompt: str, max_tokens: int = 32) -> str:
    """A greedy streamed completion's text; fails on anything but a stream that ends with [DONE]."""
    with httpx.Client(timeout=120) as h:
        with h.stream("POST", url(srv, "/v1/completions"), json={"model": "tiny", "prompt": prompt, "stream": True,
                                                                  "max_tokens": max_tokens, "temperature": 0}) as r:
            assert r.status_code == 200, r.read()
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    return "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines[:-1])


class Streams:
    """Greedy streams run over and over in threads until stopped; each run's text is kept."""

    def __init__(self, srv, prompts: list[str], max_tokens: int = 32):
        self.srv, self.prompts, self.max_tokens = srv, prompts, max_tokens
        self.alone = [stream_text(srv, p, max_tokens) for p in prompts]
        self.runs: list[list[str]] = [[] for _ in prompts]
        self.errors: list = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(len(prompts))]

    def _run(self, i):
        try:
            while not self.stop.is_set():
                self.runs[i].append(stream_text(self.srv, self.prompts[i], self.max_tokens))
        except Exception as e:  # noqa: BLE001 - reported by check()
            self.errors.append(e)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)

    def check(self):
        assert not self.errors, self.errors[:3]
        assert all(self.runs), "a stream never finished"
        for want, got in zip(self.alone, self.runs):
            assert set(got) == {want}


@pytest.fixture(scope="module")
def prompts(shakespeare_file):
    lines = [ln for ln in shakespeare_file.read_text()[:20000].splitlines() if len(ln) > 8]
    return [ln[:8 + i % 12] for i, ln in enumerate(lines[:16])]


def test_extreme_values_while_16_greedy_streams_run_get_4xx_or_an_answer(server, prompts, monkeypatch):
    """Every numeric field of both generation routes at 0, -1, 2^31, 2^63-1, -2^63, 2^64, 1e308, NaN and values
    of the wrong type, sent while 16 greedy streams run (decode calls slowed so that they overlap): each answered
    4xx with a short message or 200 with a valid answer, and every stream's text is the one it gets alone."""
    log_decode_calls(monkeypatch, lambda rows, live, steps: time.sleep(0.002 * steps))
    bodies = []
    for field in FIELDS:
        for value in EXTREMES:
            bodies.append(("/v1/completions", {"model": "tiny", "prompt": "To be", "max_tokens": 4, field: value}))
            bodies.append(("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                                                    "max_tokens": 4, field: value}))

    def send(item):
        path, body = item
        r = httpx.post(url(server, path), content=body_bytes(body), headers={"content-type": "application/json"},
                       timeout=120)
        return item, r.status_code, r.json()

    with Streams(server, prompts) as streams:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(send, bodies))
    streams.check()
    codes = {}
    for (path, body), status, answer in answers:
        codes[status] = codes.get(status, 0) + 1
        assert status == 200 or 400 <= status < 500, (path, body, status, answer)
        if status == 200:
            assert answer["choices"] and all(c["finish_reason"] in ("stop", "length") for c in answer["choices"])
        else:
            assert len(answer["error"]["message"]) < 300, answer
    assert codes.get(200, 0) > 50 and codes.get(400, 0) > 100, codes
    # top_k past the vocabulary keeps every token (as 0 does): the same greedy answer
    big = httpx.post(url(server, "/v1/completions"), json={"model": "tiny", "prompt": "To be", "max_tokens": 6,
                                                           "temperature": 0.7, "seed": 3, "top_k": 2**63 - 1}).json()
    off = httpx.post(url(server, "/v1/completions"), json={"model": "tiny", "prompt": "To be", "max_tokens": 6,
                                                           "temperature": 0.7, "seed": 3, "top_k": 0}).json()
    assert big["choices"][0]["text"] == off["choices"][0]["text"]
    assert metric(server, "jaxlm_busy_slots") == 0 and metric(server, "jaxlm_kv_pages_used") == 0


def test_a_value_the_decode_program_cannot_hold_fails_its_request_alone(trained):
    """Sequences submitted to the engine directly (no schema in front): one with top_k 2^31, one with a token id
    past the vocabulary, one with a NaN temperature, among good ones. The bad ones end with a 400 error event at
    their admission; the good ones decode the tokens they decode alone."""
    model = jaxlm.load(trained)
    e = Engine(model.params, model.config.model, ServeConfig(max_slots=4, max_queue=16, prefix_cache=0,
                                                             decode_steps=4), 64)
    good = [[1, 2, 3], [5, 6, 7, 8], [9, 10]]

    def run(specs):
        return e.run([Sequence(p, 12, t, k, 1.0, 0, 0, (), None) for p, t, k in specs], timeout=60)

    e.start()
    try:
        alone = [run([(p, 0.0, 0)])[0] for p in good]
        mixed = run([(good[0], 0.0, 0), ([1, 2], 0.0, 2**31), (good[1], 0.0, 0), ([1, 10**6], 0.0, 0),
                     ([3], float("nan"), 0), (good[2], 0.0, 0)])
    finally:
        e.stop()
    for i, want in zip((0, 2, 5), alone):  # the same tokens (log-probabilities to float rounding: other buckets)
        assert [t for t, _, _ in token_events(mixed[i])] == [t for t, _, _ in token_events(want)]
        assert mixed[i][-1] == ("done", "length")
    for i, words in ((1, "top_k"), (3, "prompt"), (4, "temperature")):
        assert len(mixed[i]) == 1 and mixed[i][0][0] == "error" and mixed[i][0][2] == 400, mixed[i]
        assert words in mixed[i][0][1]
    assert e.never_fits(65) is not None and e.never_fits(64) is None


def test_a_device_failure_mid_stream_ends_each_stream_with_an_error_event(server, prompts, monkeypatch, caplog):
    """The decode program fails once (an injected fault) while 4 streams and one plain request run: each stream
    ends with an error event and [DONE], the plain request gets a 500; no answer carries the fault's text; one
    line is logged per stream, the traceback once; /metrics counts the streams; the next requests are served."""
    failed = threading.Event()
    real = programs.paged_decode_loop

    def failing(*args, **kw):  # the first call once all five sequences decode
        if not failed.is_set() and server.served.engine.busy_slots() == 5:
            failed.set()
            raise RuntimeError("injected fault 7f3a")
        time.sleep(0.05)
        return real(*args, **kw)

    before = metric(server, "jaxlm_stream_errors_total")
    want = stream_text(server, prompts[0], 24)
    monkeypatch.setattr(programs, "paged_decode_loop", failing)
    caplog.set_level(logging.WARNING, logger="jaxlm.serve")

    def stream_raw(p):
        with httpx.stream("POST", url(server, "/v1/completions"), timeout=60,
                          json={"model": "tiny", "prompt": p, "stream": True, "max_tokens": 24,
                                "temperature": 0}) as r:
            return r.status_code, [ln for ln in r.iter_lines() if ln.startswith("data: ")]

    def plain():
        r = httpx.post(url(server, "/v1/completions"), timeout=60,
                       json={"model": "tiny", "prompt": prompts[5], "max_tokens": 24, "temperature": 0})
        return r.status_code, r.text

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        streams = [pool.submit(stream_raw, p) for p in prompts[1:5]]
        time.sleep(0.05)
        answer = pool.submit(plain)
        streams, answer = [f.result() for f in streams], answer.result()
    monkeypatch.undo()
    assert failed.is_set()
    for status, lines in streams:
        assert status == 200 and lines[-1] == "data: [DONE]", lines[-3:]
        error = json.loads(lines[-2][6:])["error"]
        assert error["type"] == "server_error" and error["message"] == f"generation failed: {ENGINE_FAILED}"
    assert answer[0] == 500 and "7f3a" not in answer[1], answer
    assert all("7f3a" not in ln for _, lines in streams for ln in lines)
    records = [r for r in caplog.records if r.name == "jaxlm.serve"]
    assert sum(r.exc_info is not None for r in records) == 1
    assert sum("a stream" in r.getMessage() for r in records) == 4
    assert metric(server, "jaxlm_stream_errors_total") - before == 4
    assert stream_text(server, prompts[0], 24) == want
    assert metric(server, "jaxlm_busy_slots") == 0 and metric(server, "jaxlm_kv_pages_used") == 0


def test_scoring_takes_turns_with_the_decoding_slots(trained):
    """64 prompts to score arrive while 2 sequences decode: each turn scores at most prefill_chunk padded tokens
    (here one prompt), so the decoding sequences get tokens between the scores instead of after all 64."""
    model = jaxlm.load(trained)
    e = Engine(model.params, model.config.model, ServeConfig(max_slots=2, max_queue=80, prefix_cache=0,
                                                             decode_steps=1, prefill_chunk=32), 64)
    turns = []  # (scores done, tokens made) after each turn
    scored = []
    e.turn_hooks.append(lambda: turns.append((len(scored), e.tokens_total)))
    e.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            decoding = pool.submit(e.run, [Sequence([1, 2, 3], 60, 0.0, 0, 1.0, 0, 0, (), None) for _ in range(2)],
                                   120)
            while e.tokens_total < 4:
                time.sleep(0.01)
            e.run([Score([1 + j % 20] * 20, scored.append) for j in range(64)], timeout=120)
            assert all(ev[-1] == ("done", "length") for ev in decoding.result())
    finally:
        e.stop()
    assert all(ev[0] == "score" for ev in scored)
    steps = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(turns, turns[1:])]
    assert max(n for n, _ in steps) == 1  # one 20-token prompt (padded to 32) per turn
    while_scoring = [made for n, made in steps if n]
    # the decoding went on between the scores until its sequences were done: no scoring turn starved it (how
    # many tokens were left when the scores came depends on the machine's load, so only a floor is asked)
    finished = next((i for i, made in enumerate(while_scoring) if made == 0), len(while_scoring))
    assert not any(while_scoring[finished:]) and finished >= 16, steps


def test_tokenize_is_bounded_and_errors_are_short_and_hosts_and_head_are_honest(server, prompts):
    """/tokenize past serve.max_tokenize_chars: 413; one within it answered while a stream flows; a 1 MB model
    name answered 400 in a short message; two Host headers 400; HEAD /health 200 without a body."""
    with httpx.Client(timeout=60) as h:
        r = h.post(url(server, "/tokenize"), json={"prompt": "a" * 200_001})
        assert r.status_code == 413 and "serve.max_tokenize_chars=200000" in r.json()["error"]["message"]
        text = "To be or not to be " * 10_000  # 190,000 characters
        with Streams(server, prompts[:2], 48) as streams:
            r = h.post(url(server, "/tokenize"), json={"prompt": text})
            time.sleep(0.2)
        streams.check()
        assert r.status_code == 200 and r.json()["count"] == len(text)
        r = h.post(url(server, "/v1/completions"), json={"model": "m" * (1 << 20), "prompt": "x"})
        assert r.status_code == 400 and len(r.text) < 400 and "characters)" in r.json()["error"]["message"], r.text[:400]
        assert h.head(url(server, "/health")).status_code == 200
        assert h.head(url(server, "/health")).content == b""
    import socket

    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2**64, 2**64) | st.floats(allow_nan=False)
                           | st.text(max_size=20), lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8)
NUMBERS = st.sampled_from([0, 1, -1, 2, 16, 17, 2**31, 2**63 - 1, -2**63, 1e308, -1e308, 0.5, 1.0])
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", ""]),
                                 "content": st.text(max_size=30) | JSON_VALUES})
COMPLETION = st.fixed_dictionaries(
    {"model": st.sampled_from(["tiny", "other"]) | JSON_VALUES,
     "prompt": st.text(max_size=40) | st.lists(st.integers(-5, 100), max_size=6) | st.lists(st.text(max_size=10),
                                                                                            max_size=3) | JSON_VALUES},
    optional={k: NUMBERS | JSON_VALUES for k in FIELDS} | {"stream": st.booleans() | JSON_VALUES,
                                                            "echo": st.booleans(), "stop": JSON_VALUES,
                                                            "stream_options": JSON_VALUES, "logit_bias": JSON_VALUES})
CHAT = st.fixed_dictionaries(
    {"model": st.just("tiny"), "messages": st.lists(MESSAGE, max_size=3) | JSON_VALUES},
    optional={k: NUMBERS | JSON_VALUES for k in FIELDS} | {"stream": st.booleans(), "logprobs": JSON_VALUES,
                                                            "stop": JSON_VALUES})
WORDS = st.text(alphabet="abcdefghijklmnopqrstuvwxyz ,.", min_size=1, max_size=20)  # in the char vocabulary
SAMPLING = {"temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 2**40),
            "n": st.integers(1, 3), "seed": st.integers(-2**63, 2**64 - 1), "stream": st.booleans()}
WELL_FORMED = (st.tuples(st.just("/v1/completions"), st.fixed_dictionaries(
    {"model": st.just("tiny"), "prompt": WORDS, "max_tokens": st.integers(1, 8)},
    optional={**SAMPLING, "logprobs": st.integers(0, 5), "echo": st.booleans()}))
    | st.tuples(st.just("/v1/chat/completions"), st.fixed_dictionaries(
        {"model": st.just("tiny"), "messages": st.lists(st.fixed_dictionaries({"role": st.just("user"),
                                                                               "content": WORDS}), min_size=1,
                                                        max_size=2), "max_tokens": st.integers(1, 8)},
        optional={**SAMPLING, "logprobs": st.booleans()})))
REQUESTS = (WELL_FORMED | st.tuples(st.just("/v1/completions"), COMPLETION)
            | st.tuples(st.just("/v1/chat/completions"), CHAT)
            | st.tuples(st.just("/tokenize"), JSON_VALUES | st.fixed_dictionaries({"prompt": st.text(max_size=50)})))


def test_fuzzed_requests_are_answered_2xx_or_4xx_and_streams_are_unaffected(server, prompts):
    """hypothesis draws request bodies over the schemas (well-formed ones with sampling values anywhere in their
    ranges, and right and wrong types, extremes, nesting) for the three POST routes while 4 greedy streams run:
    every answer is 2xx or 4xx (a stream's body ends with [DONE]), and every stream's text is the one it gets
    alone."""
    seen = {}

    @hypothesis.settings(max_examples=150, deadline=None, database=None, derandomize=True,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(REQUESTS)
    def check(request):
        path, body = request
        if isinstance(body, dict) and body.get("max_tokens") is None and "max_completion_tokens" not in body:
            body = {**body, "max_tokens": 4}
        r = httpx.post(url(server, path), content=json.dumps(body).encode(),
                       headers={"content-type": "application/json"}, timeout=120)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (path, body, r.status_code, r.text[:300])
        if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text, r.text[-300:]

    with Streams(server, prompts[:4]) as streams:
        check()
    streams.check()
    assert seen.get(200, 0) >= 10 and seen.get(400, 0) >= 20, seen  # both kinds drawn (the mix varies by version)
    assert metric(server, "jaxlm_busy_slots") == 0 and metric(server, "jaxlm_kv_pages_used") == 0
