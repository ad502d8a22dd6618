"""`jaxlm serve`: the official openai client against the server on 127.0.0.1 (greedy text equal to `jaxlm
generate`'s, streaming equal to the whole answer, echoed log-probabilities equal to the forward pass's),
concurrent streams that each get the text they get alone, faults answered 4xx without harm, eight LoRA adapters
mixed in decode calls answering as each merged alone, the same answers over a unix socket, and the command
itself. Every server binds 127.0.0.1 (or a unix socket in the test's temporary folder) and is shut down; every
request loop is bounded."""

import concurrent.futures
import contextlib
import http.client
import json
from typing import Callable
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from conftest import require

openai = require("openai")
require("fastapi")

import jaxlm  # noqa: E402
from jaxlm import serve  # noqa: E402
from jaxlm.config import ServeConfig  # noqa: E402
from jaxlm.serve import programs  # noqa: E402
from jaxlm.serve.engine import Engine  # noqa: E402
from jaxlm.infer.sampling import TOP_LOGPROBS  # noqa: E402
from jaxlm.serve.requests import QueueFull, Sequence  # noqa: E402

TEMPLATE = "{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}" \
           "{% if add_generation_prompt %}ASSISTANT: {% endif %}"
SLOTS = 8


def token_events(events: list) -> list:
    """A sequence's engine events as one (id, logprob, alternatives) per token (the engine sends the tokens of
    a decode call together)."""
    out = []
    for ev in events:
        if ev[0] == "tokens":
            _, ids, lps, tops = ev
            out.extend(zip(ids, lps, (list(zip(a, b)) for a, b in zip(*tops))) if lps is not None
                       else ((t, None, []) for t in ids))
    return out


def log_decode_calls(monkeypatch, log: Callable) -> None:
    """Call log(rows, live rows, steps) before each decode call of either cache."""
    for name, at in (("decode_loop", 3), ("paged_decode_loop", 4)):  # the rows; then adapters, steps, live rows
        def logged(*args, fn=getattr(programs, name), at=at, **kw):
            log(len(args[at]), int(np.asarray(args[at + 3]).sum()), int(args[at + 2]))
            return fn(*args, **kw)

        monkeypatch.setattr(programs, name, logged)


def log_prefill_calls(monkeypatch, log: Callable) -> None:
    """Call log([(slot, start, length) of each real row], chunk length) before each prefill call of either cache."""
    from jaxlm.serve import chunk as chunk_lib

    def slot_chunk(params, cache, logits_BV, tokens_PC, start_P, length_P, slot_P, cfg, *rest,
                   fn=chunk_lib.prefill_chunks, **kw):
        log([(int(a), int(b), int(c)) for a, b, c in zip(slot_P, start_P, length_P) if a < len(cache.length)],
            tokens_PC.shape[1])
        return fn(params, cache, logits_BV, tokens_PC, start_P, length_P, slot_P, cfg, *rest, **kw)

    def paged_chunk(params, layer_params, cache, logits_BV, tokens_PC, start_P, length_P, table_PM, slot_P,
                    adapter_P, cfg, fn=programs.paged_prefill, **kw):
        log([(int(a), int(b), int(c)) for a, b, c in zip(slot_P, start_P, length_P) if a < logits_BV.shape[0]],
            tokens_PC.shape[1])
        return fn(params, layer_params, cache, logits_BV, tokens_PC, start_P, length_P, table_PM, slot_P, adapter_P,
                  cfg, **kw)

    monkeypatch.setattr(chunk_lib, "prefill_chunks", slot_chunk)
    monkeypatch.setattr(programs, "paged_prefill", paged_chunk)


@pytest.fixture(scope="module")
def trained(char_data, tmp_path_factory):
    """A char model trained for 200 steps on tiny Shakespeare (val loss about 2.4 nats against the corpus's
    unigram entropy of 3.3): its greedy text has no near-ties to flip, unlike random weights."""
    from conftest import tiny_config
    from jaxlm.train import loop as train

    run = tmp_path_factory.mktemp("serve") / "run"
    train.train(tiny_config(char_data, run, **{"training.steps": 200, "model.block_size": 64,
                                               "optimizer.lr": 3e-3, "training.eval_interval": 200,
                                               "checkpoint.interval": 200}),
                log=lambda s: None)
    return run


@pytest.fixture(scope="module")
def server(trained, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    cfg = serve.settings_config({"serve.max_slots": 16, "serve.max_queue": 64, "max_new_tokens": 16,
                                 "serve.chat_template": str(template), "serve.model_name": "tiny",
                                 "serve.decode_steps": 8})
    srv = serve.Server(serve.build(trained, cfg, log=lambda s: None), "127.0.0.1", 0).start()
    yield srv
    srv.stop()


def client(srv, key="none"):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key=key, max_retries=0, timeout=60)


def metric(srv, name):
    text = httpx.get(f"http://127.0.0.1:{srv.port}/metrics").text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_openai_client_completions_chat_and_streaming(server, trained):
    compiled = programs.compiled_step_count()
    c = client(server)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    model = jaxlm.load(trained)
    chat_prompt = "USER: Speak\nASSISTANT: "  # the messages below through TEMPLATE
    wants = model.generate_text(["To be", "KING RICHARD:\nWhat", chat_prompt], max_new_tokens=20, temperature=0)
    for prompt, want in zip(("To be", "KING RICHARD:\nWhat"), wants):
        got = c.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
        assert got.choices[0].text == want and got.choices[0].finish_reason == "length"
        assert got.usage.prompt_tokens == len(prompt) and got.usage.completion_tokens == 20
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(
            model="tiny", prompt=prompt, max_tokens=20, temperature=0, stream=True))
        assert streamed == want

    # echo + logprobs on token ids, as lm-evaluation-harness asks: the forward pass's log-softmax.
    ids = model.tokenizer().encode("First Citizen:\nBefore")
    got = c.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0)
    logits = model.logits(np.asarray([ids]))[0]
    lp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
        logits.max(-1, keepdims=True)
    want_lp = [lp[i - 1, ids[i]] for i in range(1, len(ids))]
    got_lp = got.choices[0].logprobs.token_logprobs
    assert got_lp[0] is None and np.allclose(got_lp[1:], want_lp, atol=1e-4)
    assert got.choices[0].text == "First Citizen:\nBefore"
    top = got.choices[0].logprobs.top_logprobs
    tok = model.tokenizer()
    assert [list(t)[0] for t in top[1:]] == [tok.decode([int(np.argmax(lp[i]))]) for i in range(len(ids) - 1)]

    # chat through serve.chat_template; stop strings cut the text before them
    msgs = [{"role": "user", "content": "Speak"}]
    chat = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == wants[2][:12]  # char tokens: 12 tokens, 12 characters
    parts = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=12, temperature=0, stream=True) if ch.choices]
    assert "".join(parts) == chat.choices[0].message.content
    text = c.completions.create(model="tiny", prompt="To be", max_tokens=20, temperature=0).choices[0].text
    cut = text[3:5]
    stopped = c.completions.create(model="tiny", prompt="To be", max_tokens=20, temperature=0, stop=[cut])
    assert stopped.choices[0].text == text[:text.find(cut)] and stopped.choices[0].finish_reason == "stop"

    # sampling: the same seed reproduces, n choices differ, settings out of decode.* range are refused
    a = c.completions.create(model="tiny", prompt="To be", max_tokens=16, temperature=1.0, seed=5, n=3)
    b = c.completions.create(model="tiny", prompt="To be", max_tokens=16, temperature=1.0, seed=5, n=3)
    assert [x.text for x in a.choices] == [x.text for x in b.choices]
    assert len({x.text for x in a.choices}) == 3
    assert programs.compiled_step_count() == compiled  # one decode program per bucket, compiled at warm-up


def test_concurrent_streams_get_the_text_they_get_alone(server, shakespeare_file):
    lines = [ln for ln in shakespeare_file.read_text()[:20000].splitlines() if len(ln) > 8][:32]
    prompts = [ln[:6 + i % 20] for i, ln in enumerate(lines)]
    c = client(server)

    def ask(i):  # greedy for even clients, sampled with their own seed for odd ones (half of them with top_p)
        settings = dict(temperature=0) if i % 2 == 0 else dict(temperature=0.9, seed=100 + i)
        if i % 4 == 1:
            settings["top_p"] = 0.9
        stream = c.completions.create(model="tiny", prompt=prompts[i], max_tokens=24, stream=True, **settings)
        return "".join(ch.choices[0].text for ch in stream)

    alone = [ask(i) for i in range(32)]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        together = list(pool.map(ask, range(32)))
    assert together == alone
    assert len(set(alone)) > 16
    assert metric(server, "jaxlm_busy_slots") == 0 and metric(server, "jaxlm_queue_depth") == 0


def test_replicas_serve_as_one_engine_and_change_no_output(server, trained, shakespeare_file):
    """serve.replicas=2: two engines of half the slots each behind one server. Concurrent requests (greedy and
    seeded) spread over both and get the text the one-engine server gives them; /metrics sums the replicas."""
    from jaxlm.serve.replicas import Replicas

    lines = [ln for ln in shakespeare_file.read_text()[:20000].splitlines() if len(ln) > 8][:12]
    cfg = serve.settings_config({"serve.max_slots": 4, "serve.replicas": 2, "max_new_tokens": 16,
                                 "serve.model_name": "tiny", "serve.decode_steps": 8})
    srv = serve.Server(serve.build(trained, cfg, log=lambda s: None), "127.0.0.1", 0).start()
    try:
        engine = srv.served.engine
        assert isinstance(engine, Replicas) and [e.B for e in engine.engines] == [2, 2]

        def ask(target, i):
            settings = dict(temperature=0) if i % 2 == 0 else dict(temperature=0.9, seed=7 + i)
            stream = client(target).completions.create(model="tiny", prompt=lines[i][:24], max_tokens=12, stream=True,
                                                       **settings)
            return "".join(ch.choices[0].text for ch in stream)

        want = [ask(server, i) for i in range(12)]
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            got = list(pool.map(lambda i: ask(srv, i), range(12)))
        assert got == want
        assert all(e.requests_total > 0 for e in engine.engines)  # both replicas served
        assert metric(srv, "jaxlm_slots") == 4 and metric(srv, "jaxlm_sequences_total") == 12
        assert metric(srv, "jaxlm_generated_tokens_total") == sum(e.tokens_total for e in engine.engines) == 144
        assert metric(srv, "jaxlm_busy_slots") == 0 and metric(srv, "jaxlm_queue_depth") == 0
    finally:
        srv.stop()


def test_faults_are_answered_4xx_and_harm_nothing(server, monkeypatch):
    url = f"http://127.0.0.1:{server.port}"
    good = {"model": "tiny", "prompt": "To be", "max_tokens": 10, "temperature": 0}
    bad = [b"{not json", b"[]", json.dumps({"model": "other", "prompt": "x"}).encode(),
           json.dumps({**good, "prompt": "x" * 70}).encode(), json.dumps({**good, "max_tokens": 60}).encode(),
           json.dumps({**good, "temperature": -1}).encode(), json.dumps({**good, "temperature": "hot"}).encode(),
           json.dumps({**good, "top_p": 0}).encode(), json.dumps({**good, "top_k": -5}).encode(),
           json.dumps({**good, "n": 0}).encode(), json.dumps({**good, "logprobs": 9}).encode(),
           json.dumps({**good, "prompt": [1, 2, 999]}).encode(), json.dumps({**good, "prompt": ""}).encode(),
           json.dumps({**good, "prompt": "\u4e2d"}).encode(), json.dumps({**good, "stop": [1]}).encode(),
           json.dumps({**good, "frequency_penalty": 1}).encode(), json.dumps({"model": "tiny"}).encode(),
           json.dumps({**good, "max_tokens": -1}).encode()]
    want = httpx.post(f"{url}/v1/completions", json=good, timeout=60).json()["choices"][0]["text"]
    codes = []
    with httpx.Client(timeout=60) as h:
        for i in range(200):
            r = h.post(f"{url}/v1/completions", content=bad[i % len(bad)],
                       headers={"content-type": "application/json"})
            codes.append(r.status_code)
            if r.status_code == 400:
                assert set(r.json()["error"]) >= {"message", "type", "param"}
        r = h.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": "hi"})
        assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    assert sorted(set(codes)) == [400] and len(codes) == 200
    assert httpx.post(f"{url}/v1/completions", json=good, timeout=60).json()["choices"][0]["text"] == want

    # a client dropped mid-stream frees its slot: steps slowed to 20 ms, 50 tokens would take a second
    log_decode_calls(monkeypatch, lambda rows, live, steps: time.sleep(0.02 * steps))
    before = metric(server, "jaxlm_generated_tokens_total")
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", f"{url}/v1/completions", json={**good, "max_tokens": 50, "stream": True}) as r:
            lines = r.iter_lines()  # held: a dropped line iterator would close the response at once
            assert next(lines).startswith("data: ")
            assert metric(server, "jaxlm_busy_slots") == 1
    deadline = time.monotonic() + 20
    while metric(server, "jaxlm_busy_slots") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "jaxlm_busy_slots") == 0 and metric(server, "jaxlm_kv_pages_used") == 0
    assert metric(server, "jaxlm_generated_tokens_total") - before < 40  # cancelled, not run to its end
    monkeypatch.undo()

    # a full queue answers 429 with Retry-After (the queue made full by refusing every submission); a request of
    # more sequences than the queue ever holds, 400 naming the limit
    def full(item):
        raise QueueFull

    monkeypatch.setattr(server.served.engine, "submit", full)
    r = httpx.post(f"{url}/v1/completions", json=good, timeout=60)
    assert r.status_code == 429 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
    monkeypatch.undo()
    r = httpx.post(f"{url}/v1/completions", json={**good, "prompt": ["To be"] * 5, "n": 16}, timeout=60)
    assert r.status_code == 400 and "serve.max_queue=64" in r.json()["error"]["message"], r.text

    # an API key: 401 without it or with a wrong one, served with it; /health stays open
    server.served.api_key = "sesame"
    try:
        for key in ("none", "wrong"):
            with pytest.raises(openai.AuthenticationError):
                client(server, key).completions.create(**good)
        assert client(server, "sesame").completions.create(**good).choices[0].text == want
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 401
    finally:
        server.served.api_key = None
    assert metric(server, 'jaxlm_http_errors_total{code="400"}') >= 200


# The client of the huge bodies below, run by its own interpreter: it makes both, says so, and sends them when told.
HUGE_BODIES = """
import http.client, json, sys, time

def send(body):
    conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=60)
    try:
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read()), time.perf_counter() - start
    finally:
        conn.close()

whole, chunks = b" " * (50 << 20), [b" " * (1 << 20)] * 9
print("ready", flush=True)
sys.stdin.readline()
print(json.dumps([send(whole), send(iter(chunks))]))  # an iterable goes chunked
"""


def test_a_huge_body_is_refused_while_streams_flow_and_foreign_hosts_and_origins_are_refused(server, monkeypatch):
    """A 50 MB body sent by http.client (from a process of its own), which sends a body whole before it reads the
    answer (as requests and httpx do), reads the 413 and its JSON error: the server answers before reading the body,
    then reads and throws away the rest before it closes (a connection closed while the client still sent lost the
    answer to a reset); so does a 9 MB chunked body, refused when it grows past serve.max_body_mb. Meanwhile 16
    streams decode (steps slowed to 5 ms, so that they outlast both bodies) with no gap over 100 ms between their
    chunks (their readers keep reading: a stream waiting with its chunks buffered would show none). The same 16
    streams run first without the bodies: where the machine is so loaded (CI's 2 cores, another test beside) that
    their chunks come further apart than 100 ms already, the bound is 1.25x their longest gap then (on a quiet
    machine their chunks come every 40-47 ms), and where the other test's load slows every decode call while the
    bodies are sent (CI: every gap 103-108 ms then, against 48 before), 1.5x the median gap of that window: a
    stream held up by a body shows as one gap far over its neighbours, not as all of them slower. A request naming another Host (a web page whose name was rebound to
    127.0.0.1) or sent by a browser from another site (Origin) is refused 403; the loopback names are answered."""
    import threading

    url = f"http://127.0.0.1:{server.port}"
    good = {"model": "tiny", "prompt": "To be", "max_tokens": 58, "temperature": 0, "stream": True}
    gaps, texts, errors = [], [], []  # gaps: (start, end) between a stream's chunks
    first, all_started = [], threading.Event()  # streams keep reading: none waits with its chunks buffered
    log_decode_calls(monkeypatch, lambda rows, live, steps: time.sleep(0.005 * steps))

    def stream():
        try:
            with httpx.Client(timeout=60) as h, h.stream("POST", f"{url}/v1/completions", json=good) as r:
                last, text = None, ""
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        if last is None:
                            first.append(1)
                            if len(first) == 16:
                                all_started.set()
                        else:
                            gaps.append((last, time.perf_counter()))
                        last = time.perf_counter()
                        text += json.loads(line[6:])["choices"][0]["text"]
                texts.append(text)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def huge_bodies() -> subprocess.Popen:
        """http.client in a process of its own, as a user's client is, its bodies made: sent on a line from us, it
        prints (status, JSON error, seconds) of each. Made in this process, the 50 MB body held the GIL, and so the
        server and the streams' readers, while the kernel mapped its pages (30-40 ms on a quiet machine; gaps of
        0.2-0.6 s on a loaded one)."""
        sender = subprocess.Popen([sys.executable, "-c", HUGE_BODIES, str(server.port)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if sender.stdout.readline() != "ready\n":
            sender.kill()
            pytest.fail(f"the client of the huge bodies did not start: {sender.communicate()[1]}")
        return sender

    def streams(sender: subprocess.Popen | None):
        """16 streams, and the sender's two bodies once all have their first chunk; the gaps between chunks while
        the bodies were sent and refused (without a sender: all of them after the first chunks), the answers."""
        for x in (gaps, texts, first):
            x.clear()
        all_started.clear()
        threads = [threading.Thread(target=stream) for _ in range(16)]
        for t in threads:
            t.start()
        try:
            assert all_started.wait(60)  # every stream has its first chunk (16 slots: all decode at once)
            t0 = time.perf_counter()
            out, err = sender.communicate("send\n", timeout=60) if sender else ("null", "")
            t1 = time.perf_counter()
        finally:
            if sender:
                sender.kill()
        assert not sender or sender.returncode == 0, err  # a reset (the body not drained) ends it with a traceback
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert len(texts) == 16 and all(len(t) == 58 for t in texts)  # char tokens: 58 each
        return [b - a for a, b in gaps if b > t0 and (a < t1 or not sender)], json.loads(out)

    quiet, _ = streams(None)
    during, ((*answer, refused_in), (*chunked_answer, _)) = streams(huge_bodies())
    monkeypatch.undo()
    for status, error in (answer, chunked_answer):
        assert status == 413 and error["error"]["code"] == "request_too_large", (status, error)
        assert "serve.max_body_mb=8 MiB" in error["error"]["message"], error
    assert refused_in < 5
    limit = max(0.1, 1.25 * max(quiet), 1.5 * statistics.median(during))
    assert len(during) >= 16 and max(during) < limit, (sorted(during)[-5:], sorted(quiet)[-5:])

    body = {"model": "tiny", "prompt": "To be", "max_tokens": 2, "temperature": 0}
    for host, want in (("evil.example", 403), (f"evil.example:{server.port}", 403), ("localhost", 200),
                       (f"127.0.0.1:{server.port}", 200), (f"[::1]:{server.port}", 200)):
        r = httpx.post(f"{url}/v1/completions", json=body, headers={"host": host}, timeout=60)
        assert r.status_code == want, (host, r.status_code)
    r = httpx.post(f"{url}/v1/completions", json=body, headers={"origin": "http://evil.example"}, timeout=60)
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    server.served.allowed_origins = frozenset({"http://app.example"})
    try:
        r = httpx.post(f"{url}/v1/completions", json=body, headers={"origin": "http://app.example"}, timeout=60)
        assert r.status_code == 200
    finally:
        server.served.allowed_origins = frozenset()
    assert metric(server, "jaxlm_busy_slots") == 0


def test_the_server_answers_on_a_unix_socket(server, tmp_path):
    """serve.uds: the server listens on a unix socket (a machine that refuses TCP sockets; a proxy or sidecar in
    front), and the openai client, through httpx's transport for one, gets the chat completion and the streamed
    completion it gets over TCP (this server shares the fixture's engine). A socket file left by a server that is
    gone is replaced; a second server on a socket one listens on, and a path holding a file that is not a socket,
    stop in one line; the socket file goes when the server stops."""
    from jaxlm.config import ConfigError

    path = tmp_path / "jaxlm.sock"
    with socket.socket(socket.AF_UNIX) as stale:  # bound and never listened on: what a killed server leaves
        stale.bind(str(path))
    cfg = serve.settings_config({"serve.uds": str(path)})
    assert serve.address(cfg.serve) == f"unix:{path} (http://localhost/v1 through the socket)"
    assert serve.allowed_hosts(cfg.serve) is None  # no browser reaches a unix socket; a proxy sends its own names
    srv = serve.Server(server.served, uds=cfg.serve.uds).start()
    try:
        with pytest.raises(ConfigError, match=f"serve.uds={path}: a server is listening on this socket already"):
            serve.Server(server.served, uds=str(path))
        messages, ask = [{"role": "user", "content": "Speak"}], dict(model="tiny", max_tokens=12, temperature=0)
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path))) as h:
            c = openai.OpenAI(base_url="http://localhost/v1", api_key="none", http_client=h, max_retries=0,
                              timeout=60)
            chat = c.chat.completions.create(messages=messages, **ask).choices[0].message.content
            streamed = "".join(ch.choices[0].text for ch in c.completions.create(prompt="To be", stream=True, **ask))
        tcp = client(server)
        assert chat == tcp.chat.completions.create(messages=messages, **ask).choices[0].message.content
        assert streamed == tcp.completions.create(prompt="To be", **ask).choices[0].text
        assert len(chat) == len(streamed) == 12  # char tokens
    finally:
        srv.stop(engine=False)
    assert not path.exists() and server.served.engine.running
    (tmp_path / "notes.txt").write_text("not a socket")
    with pytest.raises(ConfigError, match=r"serve.uds=.*notes.txt exists and is not a socket; remove it"):
        serve.settings_config({"serve.uds": str(tmp_path / "notes.txt")})
    assert (tmp_path / "notes.txt").read_text() == "not a socket"
    with pytest.raises(ConfigError, match="the folder .*missing does not exist"):
        serve.settings_config({"serve.uds": str(tmp_path / "missing" / "jaxlm.sock")})
    with pytest.raises(ConfigError, match="is 125 bytes long; a unix socket path holds at most 107"):
        serve.settings_config({"serve.uds": "/tmp/" + "s" * 120})


def test_a_refused_scoring_job_cancels_its_siblings_and_keys_come_from_a_file(tmp_path):
    """The prompts of an echo + logprobs request are scored all or none: when the queue refuses one (429), the
    ones submitted before it are cancelled. serve.api_key_file gives the key (not on the command line); listening
    beyond loopback without a key prints a warning."""
    import asyncio

    from jaxlm.serve.choices import score_prompts
    from jaxlm.serve.schemas import RequestError
    from jaxlm.serve.served import Mailbox

    class Full:  # an engine whose queue takes two items
        def __init__(self):
            self.submitted, self.cancelled = [], []

        def submit(self, item):
            if len(self.submitted) == 2:
                raise QueueFull
            self.submitted.append(item)

        def cancel(self, item):
            self.cancelled.append(item)

    class Served:
        engine, mailbox = Full(), Mailbox()

    async def ask():
        with pytest.raises(RequestError) as e:
            await score_prompts(Served, [[1, 2], [3, 4], [5, 6], [7, 8]], request=None)
        return e.value

    e = asyncio.run(ask())
    assert e.status == 429 and e.code == "queue_full"
    assert len(Served.engine.submitted) == 2 and all(x in Served.engine.cancelled for x in Served.engine.submitted)

    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    sc = serve.settings_config({"serve.api_key_file": str(key_file)}).serve
    assert serve.api_key_of(sc) == "s3cret"
    assert serve.api_key_of(ServeConfig(api_key="direct", api_key_file=str(key_file))) == "direct"
    assert "WARNING" in serve.exposure_warning("0.0.0.0", None)
    assert serve.exposure_warning("0.0.0.0", "s3cret") is None and serve.exposure_warning("127.0.0.1", None) is None
    assert serve.allowed_hosts(ServeConfig(host="0.0.0.0")) is None
    assert serve.allowed_hosts(ServeConfig(allowed_hosts="api.example, [::1]")) == {"api.example", "::1"}


def test_engine_queue_is_bounded_and_a_failing_prefill_fails_alone(trained):
    model = jaxlm.load(trained)
    e = Engine(model.params, model.config.model, ServeConfig(max_slots=2, max_queue=2, prefix_cache=0), 64)
    events = [[], [], [], []]
    seqs = [Sequence([1, 2, 3], 4, 0.0, 0, 1.0, 0, 0, (), events[i].append) for i in range(3)]
    e.submit(seqs[0])
    e.submit(seqs[1])
    with pytest.raises(QueueFull):
        e.submit(seqs[2])
    bad = Sequence([1] * 100, 4, 0.0, 0, 1.0, 0, 0, (), events[3].append)  # past the 64 positions
    e.waiting.appendleft(bad)
    e.start()
    deadline = time.monotonic() + 60
    while not (events[0] and events[1] and events[0][-1][0] == events[1][-1][0] == "done"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    e.stop()
    assert events[3] == [("error", "104 positions (prompt and new tokens) do not fit in the 64 of a sequence", 400)]
    assert {ev[0] for ev in events[0][:-1]} == {"tokens"} and events[0][-1] == ("done", "length")
    assert len(token_events(events[0])) == 4
    assert events[0] == events[1]  # both ran after the failure, with the same greedy tokens and logprobs
    assert not events[2]


@pytest.mark.parametrize("page_size", [0, 16])
def test_generate_samples_what_the_server_samples_for_the_same_seed(trained, page_size):
    """One decode loop (sampling.sampled_steps): `jaxlm generate`'s row b, sampled at temperature 1, is the
    server's choice b of a request with the same seed, token for token, with the slot cache and the paged one."""
    from jaxlm.config import DecodeConfig
    from jaxlm.infer import generate

    model = jaxlm.load(trained)
    prompt = model.tokenizer().encode("To be, or not")
    e = Engine(model.params, model.config.model, ServeConfig(max_slots=4, prefix_cache=0, page_size=page_size), 64)
    events = e.run([Sequence(prompt, 16, 1.0, 0, 1.0, 7, b, (), None) for b in range(3)], timeout=120)
    served = [[t for t, _, _ in token_events(ev)] for ev in events]
    got = generate.generate(model.params, model.config.model, [prompt] * 3,
                            DecodeConfig(max_new_tokens=16, temperature=1.0, seed=7)).tokens
    assert got == served
    assert len({tuple(t) for t in got}) == 3  # the choices differ: each row its own stream


@pytest.mark.parametrize("page_size", [pytest.param(0, marks=pytest.mark.slow), 16])  # the slot cache: slow tier
def test_a_long_prompt_is_prefilled_in_chunks_between_the_other_slots_steps(trained, shakespeare_file, monkeypatch,
                                                                             page_size):
    """A 40-token prompt with serve.prefill_chunk=16 takes three chunks, one per engine turn, and the sequence
    already decoding gets a token in each of those turns; its greedy text equals `jaxlm generate`'s. With the
    slot cache and with the paged one."""
    from jaxlm.serve import chunk as chunk_lib

    model = jaxlm.load(trained)
    tok = model.tokenizer()
    text = shakespeare_file.read_text()[:2000]
    long_prompt = text[100:140]
    log = []
    prefill_programs = (chunk_lib.prefill_chunks, programs.paged_prefill)
    log_prefill_calls(monkeypatch, lambda rows, C: log.extend(("chunk", slot, start, C) for slot, start, _ in rows))
    e = Engine(model.params, model.config.model,
               ServeConfig(max_slots=2, max_queue=4, prefill_chunk=16, prefix_cache=0, page_size=page_size), 64)
    a = Sequence(tok.encode("To be"), 12, 0.0, 0, 1.0, 0, 0, (), lambda ev: log.append(("a", ev)))
    b = Sequence(tok.encode(long_prompt), 10, 0.0, 0, 1.0, 0, 0, (), lambda ev: log.append(("b", ev)))
    e.run([a, b], timeout=120)  # both wait before the engine starts: the order of events below is not timing's
    # another length and other chunk starts: the same programs (one per chunk length, here 16)
    compiled = [p._cache_size() for p in prefill_programs]
    (*_, end), = e.run([Sequence(tok.encode(text[300:323]), 2, 0.0, 0, 1.0, 0, 0, (), None)], timeout=120)
    assert end == ("done", "length")
    assert [p._cache_size() for p in prefill_programs] == compiled
    assert e.pages_used() == 0
    b_chunks = [i for i, x in enumerate(log) if x[0] == "chunk" and x[1] == b.slot]
    assert [log[i][2:] for i in b_chunks] == [(0, 16), (16, 16), (32, 16)]
    b_first = next(i for i, x in enumerate(log) if x[0] == "b")
    a_tokens = [i for i, x in enumerate(log) if x[0] == "a" and x[1][0] == "tokens"]
    assert all(any(i < j < k for j in a_tokens) for i, k in zip(b_chunks, b_chunks[1:]))
    # a decodes in each of b's three turns; a call's tokens are handed out in the turn after it (while the next
    # call runs), so between b's first chunk and b's first tokens come a's from the call before and those three
    assert sum(b_chunks[0] < j < b_first for j in a_tokens) == 4
    b_text = tok.decode([t for t, _, _ in token_events([x[1] for x in log if x[0] == "b"])])
    a_text = tok.decode([t for t, _, _ in token_events([x[1] for x in log if x[0] == "a"])])
    assert a_text == model.generate_text("To be", max_new_tokens=12, temperature=0)
    assert b_text == model.generate_text(long_prompt, max_new_tokens=10, temperature=0)


CHUNK_MODELS = {  # a Mistral-like sliding window over every layer, a Gemma 2-like local/global pattern, and
    # learned positions (GPT-2) with a mixture-of-experts MLP
    "sliding": dict(layer_pattern="local", norm="rmsnorm", glu=True, activation="silu"),
    "gemma2": dict(n_layers=4, layer_pattern="local,global", attn_logit_softcap=5.0, final_logit_softcap=3.0,
                   post_norms=True, norm_plus_one=True, embed_scale=True),
    "learned_moe": dict(position="learned", n_experts=4, experts_per_token=2),
}


@pytest.mark.parametrize("family,quantize", [("sliding", False), ("gemma2", False), ("sliding", True),
                                             ("learned_moe", False)])
def test_several_prompts_chunks_in_one_call_equal_them_one_at_a_time(family, quantize):
    """One prefill_chunks call over four prompts' chunks (different lengths; two continue a chunk run earlier,
    one of them past the 8-slot ring of the local layers; one stops short of its prompt's end) and four padding
    rows gives each slot the cache, length and logits that the chunks run one at a time give, and those of
    `decode.prefill` of the whole prompt where the prompt is all in (float caches). The slots not in the
    call, among them slot B - 1 that the padding rows read, keep their cache bit for bit. Every slot first
    holds an earlier occupant's 16 positions, which the new prompts must mask and overwrite."""
    import jax
    from jaxlm import params as P, sharding
    from jaxlm.config import MeshConfig, ModelConfig
    from jaxlm.model import decode, kvcache, param_specs
    from jaxlm.serve import chunk as chunk_lib

    cfg = ModelConfig(**{**dict(vocab_size=50, block_size=64, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32,
                                sliding_window=8), **CHUNK_MODELS[family]})
    params = P.init(param_specs(cfg), jax.random.key(0), sharding.make_mesh(MeshConfig(), jax.devices()[:1]))
    B, S, C = 6, 40, 16
    rng = np.random.default_rng(0)
    prompts = {slot: rng.integers(0, 50, n).astype(np.int32) for slot, n in ((1, 30), (4, 9), (0, 20), (3, 40))}
    jobs = [(slot, prompts[slot], start) for slot, start in ((1, 16), (4, 0), (0, 0), (3, 16))]

    def run(cache, logits_BV, rows, pad_to):
        """prefill_chunks over rows (slot, prompt, start of its chunk), padded with rows of slot B."""
        tokens_PC, start_P = np.zeros((pad_to, C), np.int32), np.zeros(pad_to, np.int32)
        length_P, slot_P = np.ones(pad_to, np.int32), np.full(pad_to, B, np.int32)
        for i, (slot, prompt, start) in enumerate(rows):
            chunk = prompt[start:start + C]
            tokens_PC[i, :len(chunk)], start_P[i], length_P[i], slot_P[i] = chunk, start, len(prompt), slot
        return chunk_lib.prefill_chunks(params, cache, logits_BV, tokens_PC, start_P, length_P, slot_P, cfg)

    cache = kvcache.init(cfg, B, S, quantize)
    logits_BV = np.zeros((B, cfg.vocab_size), np.float32)
    occupants = [(slot, rng.integers(0, 50, 16).astype(np.int32), 0) for slot in range(B)]
    cache, logits_BV = run(cache, logits_BV, occupants, 8)
    cache, logits_BV = run(cache, logits_BV, [(slot, prompt, 0) for slot, prompt, start in jobs if start], 2)
    before = jax.tree.map(np.array, (cache, logits_BV))  # donated below: copies
    alone = jax.tree.map(np.asarray, before)
    for job in jobs:
        alone = run(*jax.tree.map(np.array, alone), [job], 1)
    together = run(*jax.tree.map(np.array, before), jobs, 8)
    for got, want, old in zip(jax.tree.leaves(together), jax.tree.leaves(alone), jax.tree.leaves(before)):
        got, want, old = np.asarray(got), np.asarray(want), np.asarray(old)
        if got.dtype == np.int32:  # positions, lengths: exact
            assert np.array_equal(got, want)
        else:  # int8 entries may round the other way where a value lies on a step's edge
            assert np.allclose(got.astype(np.float32), want.astype(np.float32), rtol=0,
                               atol=1 if got.dtype == np.int8 else 1e-5)
        axis = 1 if got.ndim >= 4 else 0  # keys, values, scales [R, B, ...]; positions, lengths, logits [B, ...]
        untouched = [2, 5]
        assert np.array_equal(np.take(got, untouched, axis), np.take(old, untouched, axis))
    cache, logits_BV = together
    assert list(np.asarray(cache.length)) == [16, 30, 16, 32, 9, 16]
    if quantize:
        return
    for slot in (1, 4):  # prompts now all in: the whole prompt's prefill into a fresh cache
        n = len(prompts[slot])
        want_logits, fresh = decode.prefill(params, prompts[slot][None], np.asarray([n]), cfg, S)
        assert np.allclose(logits_BV[slot], want_logits[0], rtol=0, atol=1e-4)
        for c, f in zip(cache.kinds, fresh.kinds):
            held = np.asarray(f.pos[0]) != kvcache.EMPTY  # the others hold the earlier occupant's, masked
            assert np.array_equal(np.asarray(c.pos[slot])[held], np.asarray(f.pos[0])[held])
            for a, b in ((c.k, f.k), (c.v, f.v)):
                assert np.allclose(np.asarray(a[:, slot])[..., held, :], np.asarray(b[:, 0])[..., held, :],
                                   rtol=0, atol=1e-4)


@pytest.mark.parametrize("family,quantize", [("sliding", False), ("gemma2", False), ("sliding", True),
                                             ("learned_moe", False)])
def test_first_chunks_prefilled_fresh_equal_the_general_prefill(family, quantize):
    """Chunks that start their prompts, run `fresh` (the slots' earlier contents neither read nor kept: the
    engine's path for new prompts), give the logits and lengths of the general path, the same positions, keys
    and values in the slots the chunk fills, and empty slots after them (where the general path keeps an earlier
    occupant's, masked); the slots not in the call keep theirs bit for bit."""
    import jax
    from jaxlm import params as P, sharding
    from jaxlm.config import MeshConfig, ModelConfig
    from jaxlm.model import kvcache, param_specs
    from jaxlm.serve import chunk as chunk_lib

    cfg = ModelConfig(**{**dict(vocab_size=50, block_size=64, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32,
                                sliding_window=8), **CHUNK_MODELS[family]})
    params = P.init(param_specs(cfg), jax.random.key(0), sharding.make_mesh(MeshConfig(), jax.devices()[:1]))
    B, S, C = 6, 40, 8  # C fits the local layers' 8-slot ring
    rng = np.random.default_rng(1)
    cache = kvcache.init(cfg, B, S, quantize)
    assert kvcache.fresh_fits(cache, C) and kvcache.fresh_fits(cache, 16) == ("local" not in cfg.pattern)
    logits_BV = np.zeros((B, cfg.vocab_size), np.float32)
    tokens_PC = rng.integers(0, 50, (B, 16)).astype(np.int32)  # earlier occupants of every slot: 16 positions
    cache, logits_BV = chunk_lib.prefill_chunks(params, cache, logits_BV, tokens_PC, np.zeros(B, np.int32),
                                                np.full(B, 16, np.int32), np.arange(B, dtype=np.int32), cfg)
    tokens_PC = np.zeros((4, C), np.int32)
    lengths = [5, 8, 20]  # the last one's first chunk only
    for i, n in enumerate(lengths):
        tokens_PC[i, :min(n, C)] = rng.integers(0, 50, min(n, C))
    args = (tokens_PC, np.zeros(4, np.int32), np.asarray(lengths + [1], np.int32), np.asarray([4, 0, 3, B], np.int32))
    before = jax.tree.map(np.array, (cache, logits_BV))
    general = chunk_lib.prefill_chunks(params, *jax.tree.map(np.array, before), *args, cfg)
    fresh = chunk_lib.prefill_chunks(params, *jax.tree.map(np.array, before), *args, cfg, True)
    (g_cache, g_logits), (f_cache, f_logits) = general, fresh
    assert np.allclose(np.asarray(f_logits), np.asarray(g_logits), rtol=0, atol=1e-5)
    assert np.array_equal(f_cache.length, g_cache.length)
    for slot, n in zip((4, 0, 3), lengths):
        filled = min(n, C)
        for f, g, old in zip(f_cache.kinds, g_cache.kinds, before[0].kinds):
            assert np.array_equal(np.asarray(f.pos[slot])[:filled], np.asarray(g.pos[slot])[:filled])
            assert (np.asarray(f.pos[slot])[filled:] == kvcache.EMPTY).all()
            for name in ("k", "v", "k_scale", "v_scale"):
                a, b = getattr(f, name), getattr(g, name)
                if a is not None:
                    assert np.allclose(np.asarray(a[:, slot, :, :filled], np.float32),
                                       np.asarray(b[:, slot, :, :filled], np.float32), rtol=0,
                                       atol=1 if a.dtype == np.int8 else 1e-5)
    for f, old in zip(jax.tree.leaves(f_cache), jax.tree.leaves(before[0])):
        axis = 1 if f.ndim >= 4 else 0
        assert np.array_equal(np.take(np.asarray(f), [1, 2, 5], axis), np.take(old, [1, 2, 5], axis))


def test_prompts_arriving_together_are_prefilled_together_and_change_no_output(trained, shakespeare_file,
                                                                              monkeypatch):
    """Twelve greedy sequences submitted together to 8 slots with serve.prefill_chunk=32: a turn takes the
    waiting prompts' next chunks, oldest first, while their tokens fit in 32, and runs those of the same padded
    length in one call (among them the rest of a 45-token prompt with two new prompts), so there are fewer
    calls than chunks; every text equals `jaxlm generate`'s."""
    model = jaxlm.load(trained)
    tok = model.tokenizer()
    text = shakespeare_file.read_text()[:6000]
    lengths = [5, 45, 12, 3, 9, 14, 8, 40, 14, 6, 7, 10]
    prompts = [text[400 * i:400 * i + n] for i, n in enumerate(lengths)]
    max_tokens = [10 + 3 * (i % 4) for i in range(len(prompts))]
    calls = []
    log_prefill_calls(monkeypatch, lambda rows, C: calls.append([(length, start) for _, start, length in rows]))
    e = Engine(model.params, model.config.model,
               ServeConfig(max_slots=SLOTS, max_queue=16, prefill_chunk=32, prefix_cache=0), 64)
    events = e.run([Sequence(tok.encode(p), m, 0.0, 0, 1.0, 0, 0, (), None) for p, m in zip(prompts, max_tokens)],
                   timeout=120)
    chunks = sum(map(len, calls))
    assert chunks == len(prompts) + 2  # the 45- and 40-token prompts take two chunks each
    # a prompt's second chunk with two first ones, then three first ones: the other chunks run alone
    assert [(45, 32), (12, 0), (3, 0)] in calls and [(9, 0), (14, 0), (8, 0)] in calls
    assert e.prefill_calls_total == len(calls) == chunks - 4
    assert all(sum(min(length - start, 32) for length, start in c) <= 32 for c in calls)
    got = [tok.decode([t for t, _, _ in token_events(evs)]) for evs in events]
    want = model.generate_text(prompts, max_new_tokens=max(max_tokens), temperature=0)
    assert got == [w[:m] for w, m in zip(want, max_tokens)]


@pytest.mark.parametrize("page_size", [pytest.param(0, marks=pytest.mark.slow), 16])  # the slot cache: slow tier
def test_prefix_cache_reuses_a_shared_prompt_and_changes_no_output(trained, shakespeare_file, page_size):
    """Four prompts that share a 40-token system prompt: with the prefix cache the last three reuse its keys and
    values (the slot cache copies a stored prompt's 40; the paged cache shares the first prompt's two full pages
    of 16, the sequences holding them together), the counters say how many tokens were reused and how many
    prefilled, and the answers are the same without it and equal `jaxlm generate`'s."""
    model = jaxlm.load(trained)
    tok = model.tokenizer()
    text = shakespeare_file.read_text()[3000:6000]
    system = text[:40]
    prompts = [system + text[200 + 50 * i: 208 + 50 * i] for i in range(4)]
    reuse = 40 if page_size == 0 else 32
    runs = {}
    for prefix_cache in (4, 0):
        e = Engine(model.params, model.config.model,
                   ServeConfig(max_slots=4, max_queue=8, prefix_cache=prefix_cache, page_size=page_size), 64)
        events = e.run([Sequence(tok.encode(prompts[0]), 12, 0.0, 0, 1.0, 0, 0, (), None)], timeout=120)
        held = []
        events += e.run([Sequence(tok.encode(p), 12, 0.0, 0, 1.0, 0, 0, (), lambda ev: held.append(e.pages_used()))
                         for p in prompts[1:]], timeout=120)  # together, after the first: they share its pages
        runs[prefix_cache] = [tok.decode([t for t, _, _ in token_events(ev)]) for ev in events]
        if prefix_cache:
            assert (e.prefix_hits_total, e.prefix_tokens_total) == (3, 3 * reuse)
            if page_size:  # three sequences of 3 pages (48 prompt tokens + 12 new ones) sharing their first 2
                assert max(held) == 2 + 3 * 2
        else:
            assert (e.prefix_hits_total, e.prefix_tokens_total) == (0, 0)
        assert e.prefilled_tokens_total + e.prefix_tokens_total == sum(map(len, prompts))
        assert e.pages_used() == 0
    assert runs[4] == runs[0] == model.generate_text(prompts, max_new_tokens=12, temperature=0)


@pytest.mark.slow
def test_several_decode_steps_per_call_and_row_buckets_change_no_output(trained, shakespeare_file, monkeypatch):
    """Sequences of mixed prompt lengths (one prefilled in three chunks) and max_tokens, some ending at a stop
    token, some sampled with their own seeds, one arriving while the others decode: with up to 8 decode steps
    per call over row buckets they get the same tokens (and log-probabilities to float rounding) as with one step
    per call, and with the layers scanned over the stacked cache (as a model deeper than generate.UNROLL_LAYERS,
    or one step per call, runs them) as with them unrolled over the cache taken apart, the greedy ones `jaxlm
    generate`'s cut after the stop token; and over the fewest cache slots that hold the rows' positions (16, 32
    or 64) as over all 64; and with the paged cache (layers unrolled and scanned) as with the slot cache. Each
    call runs on the smallest bucket that holds the decoding slots, with one step after a prefill and the most
    else."""
    from jaxlm.infer import generate as generate_lib

    model = jaxlm.load(trained)
    tok = model.tokenizer()
    text = shakespeare_file.read_text()[:4000]
    prompts = [text[0:5], text[200:240], text[500:512], text[900:903], text[2000:2007], text[1300:1320],
               text[3500:3514]]
    max_tokens = [30, 20, 25, 12, 20, 16, 9]
    greedy = model.generate_text(prompts, max_new_tokens=30, temperature=0)
    # greedy[4] is "\n\n\nThe the...": it stops at its 4th token while six slots decode; greedy[6] at its first
    stops = [(), (), (), (), tuple(tok.encode("T")), (), tuple(tok.encode("e"))]
    assert greedy[4].index("T") == 3 and greedy[6][0] == "e"
    temperature = [0, 0, 0.9, 0, 0, 0.8, 0]
    log = []
    decode_loop = programs.decode_loop
    log_decode_calls(monkeypatch, lambda *call: log.append(call))  # rows, live rows, steps
    log_prefill_calls(monkeypatch, lambda rows, C: log.append("chunk"))
    runs = {}
    divisors = programs.SLOT_DIVISORS
    for most, unroll, cut, page_size in ((1, False, True, 0), (8, True, True, 0), (8, False, True, 0),
                                         (8, True, False, 0), (8, True, True, 16), (8, False, True, 16)):
        monkeypatch.setattr(generate_lib, "UNROLL_LAYERS", 16 if most == 1 or unroll else 0)
        monkeypatch.setattr(programs, "SLOT_DIVISORS", divisors if cut else ())
        decode_loop.clear_cache()  # the slot buckets are read when the program is traced
        e = Engine(model.params, model.config.model, ServeConfig(max_slots=SLOTS, max_queue=16, prefill_chunk=16,
                                                                 prefix_cache=0, decode_steps=most,
                                                                 page_size=page_size), 64)
        assert e.kv.unroll == unroll  # one step per call scans the slot cache whatever the depth
        if not page_size:
            assert programs.slot_buckets(e.cfg, e.kv.cache) == ([16, 32, 64] if cut else [64])
        e.warm_up()
        log.clear()
        events = [[] for _ in prompts]
        seqs = [Sequence(tok.encode(p), m, t, 0, 1.0, 40 + i, 0, stop, events[i].append)
                for i, (p, m, t, stop) in enumerate(zip(prompts, max_tokens, temperature, stops))]
        for s in seqs[:-1]:
            e.submit(s)
        e.start()
        deadline = time.monotonic() + 120
        try:
            while not seqs[0].generated:  # the last one arrives while the others decode
                assert time.monotonic() < deadline
                time.sleep(0.005)
        except BaseException:
            e.stop()
            raise
        e.submit(seqs[-1])
        try:
            while not all(ev and ev[-1][0] == "done" for ev in events):
                assert time.monotonic() < deadline, "the engine did not finish in time"
                time.sleep(0.01)
        finally:
            e.stop()
        assert e.pages_used() == 0
        runs[most, unroll, cut, page_size] = events
        calls = [x for x in log if x != "chunk"]
        assert e.buckets == [8, 4, 2, 1] and {rows for rows, _, _ in calls} == {8, 4, 2, 1}
        assert all(rows == min(b for b in e.buckets if b >= live) for rows, live, _ in calls)
        assert all(x[2] == (1 if before == "chunk" else most)
                   for before, x in zip(log, log[1:]) if x != "chunk")
        assert max(steps for _, _, steps in calls) == most
    monkeypatch.setattr(programs, "SLOT_DIVISORS", divisors)
    decode_loop.clear_cache()
    eight = runs[8, True, True, 0]
    for other in (runs[1, False, True, 0], runs[8, False, True, 0], runs[8, True, False, 0], runs[8, True, True, 16],
                  runs[8, False, True, 16]):
        for a, b in zip(other, eight):
            assert [t for t, _, _ in token_events(a)] == [t for t, _, _ in token_events(b)] and a[-1] == b[-1]
            assert np.allclose([lp for _, lp, _ in token_events(a)], [lp for _, lp, _ in token_events(b)],
                               rtol=0, atol=1e-5)
    for i, events in enumerate(eight):
        got = tok.decode([t for t, _, _ in token_events(events)])
        if temperature[i] == 0:
            want = greedy[i][:max_tokens[i]]
            if stops[i]:
                want = want[:want.index(tok.decode(list(stops[i]))) + 1]
            assert got == want
        assert events[-1] == ("done", "stop" if stops[i] else "length")


def test_the_paged_cache_holds_more_sequences_in_the_same_memory_and_changes_no_output(trained, shakespeare_file):
    """Eight sequences (greedy, sampled with their seeds, with top-p, one ending at a stop token) in a paged cache
    of 8 pages of 16 positions: the memory of 2 slots of the slot cache's 64. The paged engine decodes more of them
    at once (each holds only the pages its tokens fill), runs out of pages as they grow and preempts the latest
    admitted (they prefill their prompt and the tokens sent so far again, later), and every sequence gets the
    tokens, log-probabilities (to float rounding) and ending it gets from the slot cache with 8 slots; afterwards
    no page is held."""
    model = jaxlm.load(trained)
    tok = model.tokenizer()
    text = shakespeare_file.read_text()[:5000]
    lengths = [5, 17, 9, 20, 3, 12, 7, 15]
    prompts = [tok.encode(text[500 * i:500 * i + n]) for i, n in enumerate(lengths)]
    max_tokens = [30, 24, 36, 20, 40, 28, 33, 26]
    temperature = [0, 0.9, 0, 0.8, 0, 1.0, 0, 0.7]
    greedy = model.generate_text(text[1000:1009], max_new_tokens=36, temperature=0)
    stops = [()] * 8
    stops[2] = tuple(tok.encode(greedy[20]))  # the greedy sequence of prompt 2 ends at its 21st token or before
    runs, in_flight = {}, []
    for page_size, slots, pages in ((0, 8, None), (16, 8, 8)):
        e = Engine(model.params, model.config.model, ServeConfig(max_slots=slots, max_queue=16, prefill_chunk=32,
                                                                 prefix_cache=0, page_size=page_size), 64,
                   cache_pages=pages)
        events = e.run([Sequence(p, max_tokens[i], temperature[i], 0, 0.9 if i == 5 else 1.0, 11 + i, 0, stops[i],
                                 lambda ev: in_flight.append((page_size, e.busy_slots())))
                        for i, p in enumerate(prompts)], timeout=120)
        runs[page_size] = events
        assert e.pages_used() == 0 and not any(e.slots)
    assert e.preempted_total > 0
    assert max(n for p, n in in_flight if p) > 2  # the slot cache holds 2 sequences in this memory
    for a, b in zip(runs[0], runs[16]):
        assert [t for t, _, _ in token_events(a)] == [t for t, _, _ in token_events(b)] and a[-1] == b[-1]
        assert np.allclose([lp for _, lp, _ in token_events(a)], [lp for _, lp, _ in token_events(b)],
                           rtol=0, atol=1e-4)
    assert runs[0][2][-1] == ("done", "stop") and len(token_events(runs[0][2])) <= 21


@pytest.mark.parametrize("quantize", [False, True])
def test_restack_puts_back_every_layer_unstack_took_apart(quantize):
    """The server's decode program takes the stacked cache apart by layer and stacks it back once per call:
    with local and global layers (ring buffers shorter than the global slots) and int8 scales, layer i of
    unstack is repeat i // 2 of pattern entry i % 2, keys transposed, and restack gives back every array; of a
    bucket's rows, unstack takes those rows and restack puts them back in their slots; cut to fewer slots, the
    global layers keep the first ones and the ring buffers all theirs."""
    import jax
    from jaxlm.config import ModelConfig
    from jaxlm.model import kvcache

    cfg = ModelConfig(vocab_size=64, block_size=32, n_layers=4, n_heads=4, n_kv_heads=2, d_model=32,
                      sliding_window=8, layer_pattern="local,global")
    empty = kvcache.init(cfg, 3, 20, quantize)
    leaves, tree = jax.tree.flatten(empty)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    cache = jax.tree.unflatten(tree, [
        jax.random.randint(k, x.shape, -100, 100).astype(x.dtype) if x.dtype != np.float32
        else jax.random.uniform(k, x.shape) for k, x in zip(keys, leaves)])
    apart = kvcache.unstack(cache, cfg)
    for i, layer in enumerate(apart.layers):
        c, r = cache.kinds[i % 2], i // 2
        assert np.array_equal(layer["k"], np.swapaxes(c.k[r], 2, 3)) and np.array_equal(layer["v"], c.v[r])
        assert (layer["k_scale"] is None) == (not quantize)
    assert [p.shape[1] for p in apart.pos] == [8, 20]
    back = kvcache.restack(apart, cfg, jax.tree.map(jax.numpy.zeros_like, cache))
    assert jax.tree.structure(back) == tree
    for a, b in zip(jax.tree.leaves(back), leaves := jax.tree.leaves(cache)):
        assert a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b)
    # A bucket's rows (slots 2 and 0) come apart in its order and go back where they were, the others untouched.
    rows = np.array([2, 0], np.int32)
    apart = kvcache.unstack(cache, cfg, rows)
    want = kvcache.unstack(kvcache.take_rows(cache, cfg, rows), cfg)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(apart), jax.tree.leaves(want)))
    zeros = jax.tree.map(jax.numpy.zeros_like, cache)
    back = kvcache.restack(apart, cfg, zeros, rows)
    for a, b, z in zip(*(map(np.asarray, jax.tree.leaves(t)) for t in (back, cache, zeros))):
        axis = 0 if a.ndim <= 2 else 1  # positions [B, S] and lengths [B]; keys, values, scales [R, B, ...]
        assert np.array_equal(np.take(a, rows, axis), np.take(b, rows, axis))
        assert np.array_equal(np.take(a, [1], axis), np.take(z, [1], axis))
    # Cut to 12 slots, the global layers keep their first 12 and the ring buffers of 8 all theirs, taken apart
    # (unstack) or stacked (take_rows, as the scanned layers take them), and only those go back.
    for cut, put in ((kvcache.unstack(cache, cfg, rows, 12), lambda c: kvcache.restack(c, cfg, zeros, rows)),
                     (kvcache.take_rows(cache, cfg, rows, 12), lambda c: kvcache.put_rows(zeros, c, rows))):
        assert [p.shape[1] for p in (cut.pos if hasattr(cut, "pos") else [c.pos for c in cut.kinds])] == [8, 12]
        back = put(cut)
        for j, (c, z, got) in enumerate(zip(cache.kinds, zeros.kinds, back.kinds)):
            S = c.pos.shape[1]
            kept = np.arange(S) < (12 if j == 1 else S)
            for name, slot_axis in (("k", 3), ("v", 3), ("k_scale", 3), ("v_scale", 3), ("pos", 1)):
                a, b, zero = (None if getattr(x, name) is None else np.asarray(getattr(x, name))
                              for x in (got, c, z))
                if a is None:
                    continue
                row_axis = slot_axis - 2 if name != "pos" else 0
                a, b, zero = (np.take(x, rows, row_axis) for x in (a, b, zero))
                assert np.array_equal(np.compress(kept, a, slot_axis), np.compress(kept, b, slot_axis))
                assert np.array_equal(np.compress(~kept, a, slot_axis), np.compress(~kept, zero, slot_axis))


@pytest.mark.parametrize("page_size", [pytest.param(0, marks=pytest.mark.slow), 16])  # the slot cache: slow tier
def test_an_int8_cache_decodes_the_same_unrolled_and_scanned(trained, shakespeare_file, monkeypatch, page_size):
    """With decode.quantize_kv_cache the decode program carries int8 keys, values and scales (the slot cache's
    taken apart and stacked back, or the paged cache's pages): unrolled it gives the tokens (and
    log-probabilities within 1e-5) of the scan over the stacked layers, the greedy ones `jaxlm generate`'s with
    the same int8 cache."""
    from jaxlm.infer import generate as generate_lib

    model = jaxlm.load(trained)
    tok = model.tokenizer()
    text = shakespeare_file.read_text()[:3000]
    prompts = [text[0:9], text[700:730], text[2000:2004]]
    temperature = [0, 0.9, 0]
    runs = {}
    for unroll in (True, False):
        monkeypatch.setattr(generate_lib, "UNROLL_LAYERS", 16 if unroll else 0)
        e = Engine(model.params, model.config.model,
                   ServeConfig(max_slots=4, max_queue=8, prefix_cache=0, page_size=page_size), 64,
                   quantize_kv_cache=True)
        k = e.kv.cache.kinds[0]["k"] if page_size else e.kv.cache.kinds[0].k
        assert e.kv.unroll == unroll and k.dtype == np.int8
        events = e.run([Sequence(tok.encode(p), 24, t, 0, 1.0, 7 + i, 0, (), None)
                        for i, (p, t) in enumerate(zip(prompts, temperature))], timeout=120)
        runs[unroll] = events
    for a, b in zip(runs[True], runs[False]):
        assert [t for t, _, _ in token_events(a)] == [t for t, _, _ in token_events(b)]
        assert a[-1] == b[-1] == ("done", "length")
        assert np.allclose([lp for _, lp, _ in token_events(a)], [lp for _, lp, _ in token_events(b)],
                           rtol=0, atol=1e-5)
    greedy = model.generate_text([prompts[0], prompts[2]], max_new_tokens=24, temperature=0, quantize_kv_cache=True)
    assert [tok.decode([t for t, _, _ in token_events(runs[True][i])]) for i in (0, 2)] == greedy


def test_while_a_request_waits_for_a_slot_a_call_ends_when_the_first_slot_frees(trained, monkeypatch):
    """Two slots, three sequences: while the third waits, a call runs no more steps than the nearest sequence
    needs to finish, so the third is admitted in the turn right after; then the steps grow again."""
    model = jaxlm.load(trained)
    steps = []
    log_decode_calls(monkeypatch, lambda rows, live, n: steps.append(n))
    e = Engine(model.params, model.config.model,
               ServeConfig(max_slots=2, max_queue=4, prefill_chunk=16, prefix_cache=0, decode_steps=8), 64)
    events = e.run([Sequence([1, 2, 3], m, 0.0, 0, 1.0, 0, 0, (), None) for m in (6, 30, 5)], timeout=60)
    # a and b prefilled (in one call): 1 step; then 5 (not 8) end a while c waits; c prefilled: 1; then 8 (c
    # ends after 4 of them), 8 and the 8 that end b
    assert steps == [1, 5, 1, 8, 8, 8]
    assert [len(token_events(ev)) for ev in events] == [6, 30, 5]


def test_decode_logprobs_equal_the_log_softmax():
    """The decode program's log-probabilities (sampling.token_logprobs: the logits picked, less the row's
    log-sum-exp) against the log-softmax of the whole row: the token's and the top alternatives', in order."""
    import jax
    import jax.numpy as jnp
    from jaxlm.infer import sampling

    logits = jax.random.normal(jax.random.key(3), (6, 256)) * 8
    tok = jnp.asarray([0, 5, 255, 17, 3, 100], jnp.int32)
    K = TOP_LOGPROBS
    token_lp, top_ids, top_lp = jax.jit(sampling.token_logprobs, static_argnums=2)(logits, tok, K)
    lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    np.testing.assert_allclose(token_lp, lp[np.arange(6), np.asarray(tok)], atol=1e-5)
    want_ids = np.argsort(-lp, axis=-1, kind="stable")[:, :TOP_LOGPROBS]
    np.testing.assert_array_equal(top_ids, want_ids)
    np.testing.assert_allclose(top_lp, np.take_along_axis(lp, want_ids, axis=-1), atol=1e-5)


def test_text_of_several_tokens_at_once_equals_token_by_token():
    """TextState over byte tokens (UTF-8 characters split across tokens) with stop strings: fed in chunks of
    every size, it shows the same text as token by token, never past a stop string, and takes the tokens up to
    the one that completes it."""
    from jaxlm.serve.choices import TextState

    def decode(ids):
        return bytes(ids).decode("utf-8", errors="replace")

    ids = list("héllo wörld, ✓ the stop is here; after".encode())
    rng = np.random.default_rng(0)
    for stop in ((), ("stop",), ("ö",), ("✓ t", "zz"), ("llo w",), ("after",), ("absent",)):
        text = decode(ids)
        at = min([text.find(s) for s in stop if s in text], default=-1)
        want = text if at < 0 else text[:at]
        want_taken = len(ids) if at < 0 else min(n for n in range(len(ids) + 1)
                                                 if any(s in decode(ids[:n]) for s in stop))
        for trial in range(20):
            state, shown, taken, i = TextState(decode, stop), [], 0, 0
            while i < len(ids) and not state.stopped:
                n = 1 if trial == 0 else int(rng.integers(1, 9))
                piece, took = state.add(ids[i:i + n])
                assert want.startswith("".join(shown) + piece)  # nothing shown that the answer does not hold
                shown.append(piece)
                taken += took
                i += n
            shown.append(state.flush())
            assert "".join(shown) == want and taken == want_taken and state.tokens == ids[:want_taken]


def test_stop_strings_are_cut_exactly_when_chunks_carry_several_tokens(server, trained):
    """A streamed chunk carries the tokens of several decode steps; a stop string that ends inside a chunk, or
    spans two, still ends the text right before it: no text after it reaches the client, the usage counts the
    tokens up to the one that completed it, and the log-probabilities are those tokens'."""
    c = client(server)
    want = jaxlm.load(trained).generate_text("KING RICHARD:\nWhat", max_new_tokens=30, temperature=0)
    for at, n in ((2, 2), (3, 3), (6, 4), (13, 5), (20, 3)):
        stop = want[at:at + n]
        cut = want[:want.find(stop)]
        taken = want.find(stop) + n  # char tokens: the one that completes the stop string is the last taken
        got = c.completions.create(model="tiny", prompt="KING RICHARD:\nWhat", max_tokens=30, temperature=0,
                                   stop=[stop], logprobs=1)
        assert got.choices[0].text == cut and got.choices[0].finish_reason == "stop"
        assert got.usage.completion_tokens == taken and len(got.choices[0].logprobs.tokens) == taken
        chunks = list(c.completions.create(model="tiny", prompt="KING RICHARD:\nWhat", max_tokens=30, temperature=0,
                                           stop=[stop], logprobs=1, stream=True,
                                           stream_options={"include_usage": True}))
        texts = [ch.choices[0].text for ch in chunks if ch.choices]
        assert "".join(texts) == cut
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
        assert sum(len(ch.choices[0].logprobs.tokens) for ch in chunks if ch.choices and ch.choices[0].logprobs) \
            == taken == chunks[-1].usage.completion_tokens
    calls, tokens = metric(server, "jaxlm_decode_calls_total"), metric(server, "jaxlm_generated_tokens_total")
    streamed = [ch for ch in c.completions.create(model="tiny", prompt="To be", max_tokens=30, temperature=0,
                                                  logprobs=1, stream=True) if ch.choices[0].logprobs.tokens]
    assert max(len(ch.choices[0].logprobs.tokens) for ch in streamed) > 1  # chunks of several tokens
    # alone on the server: decode calls of 1, 8, 8 and 8 steps, then one that ends after 5 (of 8)
    assert metric(server, "jaxlm_decode_calls_total") - calls == 5
    assert metric(server, "jaxlm_generated_tokens_total") - tokens == 30


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [0, 16])
def test_serving_on_a_mesh_shards_the_weights_and_cache_and_answers_as_one_device(trained, page_size):
    """`jaxlm serve ... mesh.ici_data=2 mesh.ici_tensor=2` on 4 fake CPU devices: the weights and the KV cache
    are sharded (kv heads over `tensor`; the slot cache's slots over `data`, the paged cache's pages whole), and
    greedy answers equal one device's. The char vocabulary (65) does not split in two, so mesh.rules keeps it
    whole."""
    settings = {"serve.max_slots": 4, "serve.model_name": "tiny", "serve.prefill_chunk": 16,
                "serve.page_size": page_size}
    cfg = serve.settings_config({**settings, "max_new_tokens": 16, "mesh.ici_data": 2, "mesh.ici_tensor": 2,
                                 "mesh.rules": "param.vocab=;act.vocab="})
    srv = serve.Server(serve.build(trained, cfg, log=lambda s: None), "127.0.0.1", 0).start()
    try:
        e = srv.served.engine
        assert e.mesh.shape == {**e.mesh.shape, "data": 2, "tensor": 2} and e.mesh.size == 4
        if page_size:
            k = e.kv.cache.kinds[0]["k"]  # [K, R, NP, page, H]
            assert k.sharding.shard_shape(k.shape) == (k.shape[0] // 2, *k.shape[1:])
        else:
            k = e.kv.cache.kinds[0].k  # [R, B, K, S, H]
            assert k.sharding.shard_shape(k.shape) == (k.shape[0], k.shape[1] // 2, k.shape[2] // 2, *k.shape[3:])
            assert e.kv.prefix.store.kinds[0].k.sharding.is_equivalent_to(k.sharding, k.ndim)
        wq = e.params["layers"]["attn"]["q"]
        assert len(wq.sharding.device_set) == 4 and wq.sharding.shard_shape(wq.shape) != wq.shape
        prompts = ["To be", "KING RICHARD:\nWhat", "First Citizen:\nBefore we proceed any"]
        c = client(srv)
        got = [c.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0).choices[0].text
               for p in prompts]
    finally:
        srv.stop()
    assert got == jaxlm.load(trained).generate_text(prompts, max_new_tokens=16, temperature=0)
    # a server built after it in the same process without a mesh (as `jaxlm eval --tasks` does after other work)
    # keeps its cache (and prefix cache) on one device, whatever layouts earlier engines compiled
    plain = serve.build(trained, serve.settings_config(settings), log=lambda s: None).engine
    assert plain.mesh is None
    if page_size:
        devices = [len(plain.kv.cache.kinds[0]["k"].sharding.device_set)] * 2
    else:
        devices = [len(c.kinds[0].k.sharding.device_set) for c in (plain.kv.prefix.store, plain.kv.cache)]
    plain.stop()
    assert devices == [1, 1], devices


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("over", ["tcp", "uds"])
def test_cli_serves_with_an_api_key_from_the_environment(trained, over, tmp_path):
    """`jaxlm serve` on a TCP port, or on a unix socket (serve.uds) where a killed server left its socket file:
    the start-up lines name where it listens and how a browser reaches the chat page (test_serve_page.py runs the
    socat line); the socket file is gone after the server stops."""
    sock = tmp_path / "jaxlm.sock"
    if over == "uds":
        with socket.socket(socket.AF_UNIX) as stale:
            stale.bind(str(sock))
        where, base, listening = f"serve.uds={sock}", "http://localhost", f"listening on unix:{sock} "
    else:
        port = free_port()
        where, base, listening = f"serve.port={port}", f"http://127.0.0.1:{port}", "listening on http://127.0.0.1:"
    h = httpx.Client(base_url=base, transport=httpx.HTTPTransport(uds=str(sock)) if over == "uds" else None)
    env = dict(os.environ, JAXLM_API_KEY="k1")
    proc = subprocess.Popen([sys.executable, "-m", "jaxlm.cli", "serve", str(trained), where,
                             "serve.max_slots=2", "temperature=0"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                if h.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="k1", http_client=h, max_retries=0, timeout=60)
        got = c.completions.create(model=trained.name, prompt="To be", max_tokens=8)
        assert got.choices[0].text == jaxlm.generate(trained, "To be", max_new_tokens=8, temperature=0)
        assert h.get("/v1/models").status_code == 401
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        h.close()
    printed = proc.stderr.read()
    assert listening in printed
    assert (f"chat page: a browser needs TCP: forward a port to the socket, `socat TCP-LISTEN:8000,bind=127.0.0.1,"
            f"reuseaddr,fork UNIX-CONNECT:{sock}`" if over == "uds" else f"chat page: http://127.0.0.1:{port}/\n") \
        in printed
    assert not sock.exists()


def test_serve_settings_fail_in_one_line(tmp_path):
    from jaxlm.config import ConfigError

    with pytest.raises(ConfigError, match=r"serve.port=70000 must be in \[1, 65535\]"):
        serve.settings_config({"serve.port": 70000})
    with pytest.raises(ConfigError, match="serve.max_slots=0 must be >= 1"):
        serve.settings_config({"serve.max_slots": 0})
    with pytest.raises(ConfigError, match="serve.decode_steps=0 must be >= 1"):
        serve.settings_config({"serve.decode_steps": 0})
    with pytest.raises(ConfigError, match="serve.max_slots=6 must be a multiple of serve.replicas=4"):
        serve.settings_config({"serve.max_slots": 6, "serve.replicas": 4})
    with pytest.raises(ConfigError, match="training.steps: `jaxlm serve` takes"):
        serve.settings_config({"training.steps": 3})
    with pytest.raises(ConfigError, match="not a file"):
        serve.settings_config({"serve.chat_template": str(tmp_path / "missing.jinja")})
    with pytest.raises(ConfigError, match="serve.api_key_file=.* is not a file"):
        serve.settings_config({"serve.api_key_file": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="serve.max_body_mb=0.0 must be > 0"):
        serve.settings_config({"serve.max_body_mb": 0})
    with pytest.raises(ConfigError, match="decode.draft=.* does not exist"):
        serve.settings_config({"decode.draft": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="needs the paged KV cache"):
        serve.settings_config({"decode.draft": str(tmp_path), "serve.page_size": 0})


MC_TASK = """task: jaxlm_test_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""
GEN_TASK = """task: jaxlm_test_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 10
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.mark.slow
def test_lm_eval_tasks_through_the_server_match_direct_scoring(trained, shakespeare_file, tmp_path):
    """A multiple-choice task (the true next words of a Shakespeare line against two others) and a generation
    task, run by lm-evaluation-harness through `jaxlm eval --tasks` (a server on 127.0.0.1): the accuracy equals
    choosing by log-likelihoods from `jaxlm.load(...).logits`, and generation equals `jaxlm generate`'s."""
    require("lm_eval")
    from jaxlm import cli

    model = jaxlm.load(trained)
    tok = model.tokenizer()
    lines = [ln for ln in shakespeare_file.read_text()[5000:40000].splitlines() if len(ln) > 30][:12]
    rng = np.random.default_rng(0)
    docs, correct = [], 0
    for i, ln in enumerate(lines):
        others = [lines[(i + k) % len(lines)][20:28] for k in (3, 7)]
        choices = [ln[20:28], *others]
        order = rng.permutation(3)
        choices = [choices[j] for j in order]
        answer = int(np.where(order == 0)[0][0])
        docs.append({"context": ln[:20], "choices": choices, "answer": answer})
        ll = []
        for ch in choices:
            ids = tok.encode(ln[:20] + ch)
            logits = model.logits(np.asarray([ids]))[0].astype(np.float64)
            lp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
            ll.append(sum(lp[j - 1, ids[j]] for j in range(20, len(ids))))
        correct += int(np.argmax(ll) == answer)
    want_acc = correct / len(docs)
    gen_docs = [{"context": ln[:15], "target": model.generate_text(ln[:15], max_new_tokens=10,
                                                                    temperature=0).split("\n")[0]}
                for ln in lines[:4]]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name, template, rows in (("mc", MC_TASK, docs), ("gen", GEN_TASK, gen_docs)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tasks / f"{name}.yaml").write_text(template.format(data=tmp_path / f"{name}.jsonl"))
    out = tmp_path / "results.json"
    assert cli.main(["eval", str(trained), "--tasks", "jaxlm_test_mc,jaxlm_test_gen", "--include-path", str(tasks),
                     "--output", str(out), "serve.max_slots=8", "max_new_tokens=16"]) == 0
    results = json.loads(out.read_text())["results"]
    assert results["jaxlm_test_mc"]["acc,none"] == pytest.approx(want_acc)
    assert want_acc > 1 / 3  # better than chance: the trained model knows something of the text
    assert results["jaxlm_test_gen"]["exact_match,none"] == 1.0


@pytest.fixture(scope="module")
def adapter_folders(trained, tmp_path_factory):
    """Eight LoRA adapters of the trained model, random A and B (B is zero at initialization: no effect to test),
    of ranks 2 to 8, other targets and scales, each in a converted folder beside the base's weights (as `jaxlm
    convert from-hf BASE OUT --adapter PEFT_DIR` leaves it): serving one alone serves it merged."""
    from jaxlm import config as config_lib
    from jaxlm.store import weights
    from test_lora import random_adapters

    model = jaxlm.load(trained)
    root = tmp_path_factory.mktemp("adapters")
    targets = ["q,k,v,o", "q,v", "o,up,down", "up", "q,k,v,o,up,down", "k,o", "down", "v,up"]
    folders = []
    for i, t in enumerate(targets):
        cfg = config_lib.apply_overrides(model.config, {"lora.rank": 2 + i % 7, "lora.alpha": 4.0 + i,
                                                        "lora.targets": t})
        folder = root / f"a{i}"
        folder.mkdir()
        (folder / "config.json").write_text(config_lib.to_json(cfg))
        weights.save_params(folder / "params", model.params)
        weights.save_params(folder / weights.ADAPTER_DIR, random_adapters(cfg, seed=10 + i, scale=0.2))
        folders.append(folder)
    return folders


@pytest.mark.slow
def test_eight_adapters_mixed_in_decode_steps_answer_as_each_merged_alone(trained, adapter_folders,
                                                                          shakespeare_file, monkeypatch):
    """One server with serve.adapters naming eight adapters over the base: 27 concurrent requests, three per
    adapter and three for the base under its own name, share decode steps (one call holds rows of several
    adapters), and each gets the greedy text and log-probabilities (to float rounding) that a server of that
    adapter merged into the base (or of the base) gives it alone. /v1/models lists the adapters; an unknown
    model is refused 400 in OpenAI's error shape; afterwards no page is held."""
    names = [f"lora{i}" for i in range(len(adapter_folders))]
    lines = [ln for ln in shakespeare_file.read_text()[:20000].splitlines() if len(ln) > 12]
    prompts = [lines[7 * i][:5 + i] for i in range(3)]
    settings = {"serve.max_slots": SLOTS, "serve.max_queue": 64, "max_new_tokens": 16, "serve.decode_steps": 4}

    def ask(srv, model, prompt):
        got = client(srv).completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, logprobs=1)
        return got.choices[0].text, got.choices[0].logprobs.token_logprobs

    alone = {}
    for name, folder in [("base", trained), *zip(names, adapter_folders)]:
        srv = serve.Server(serve.build(folder, serve.settings_config({**settings, "serve.model_name": name}),
                                       log=lambda s: None), "127.0.0.1", 0).start()
        try:
            alone[name] = [ask(srv, name, p) for p in prompts]
        finally:
            srv.stop()
    assert len({tuple(t for t, _ in answers) for answers in alone.values()}) == len(alone)  # all differ

    adapters = {}
    fn = programs.paged_decode_loop

    def logged(*args, **kw):  # each call's adapters of its live rows
        adapters.setdefault("calls", []).append({int(a) for a, live in zip(args[5], args[7]) if live})
        return fn(*args, **kw)

    monkeypatch.setattr(programs, "paged_decode_loop", logged)
    cfg = serve.settings_config({**settings, "serve.model_name": "base", "serve.adapters": ",".join(
        f"{n}={f}" for n, f in zip(names, adapter_folders))})
    srv = serve.Server(serve.build(trained, cfg, log=lambda s: None), "127.0.0.1", 0).start()
    try:
        assert [m.id for m in client(srv).models.list().data] == ["base", *names]
        jobs = [(name, i) for i in range(len(prompts)) for name in alone]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            together = list(pool.map(lambda job: ask(srv, job[0], prompts[job[1]]), jobs))
        for (name, i), (text, lps) in zip(jobs, together):
            assert text == alone[name][i][0], (name, i)
            np.testing.assert_allclose(lps, alone[name][i][1], rtol=0, atol=1e-4)
        assert max(len(a) for a in adapters["calls"]) >= 3  # rows of several adapters in one decode call
        r = httpx.post(f"http://127.0.0.1:{srv.port}/v1/completions", json={"model": "lora9", "prompt": "To be"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found"
        assert "'lora9' is not served here" in r.json()["error"]["message"]
        assert metric(srv, "jaxlm_kv_pages_used") == 0
    finally:
        srv.stop()


def test_adapters_that_cannot_be_served_fail_in_one_line(trained, adapter_folders, tmp_path):
    from jaxlm import config as config_lib
    from jaxlm.store import adapters
    from jaxlm.config import ConfigError

    for value, message in [("lora0", "entry 'lora0' must be NAME=PATH"),
                           (f"a={adapter_folders[0]},a={adapter_folders[1]}", "names 'a' twice"),
                           (f"a={tmp_path / 'missing'}", "is not a folder")]:
        with pytest.raises(ConfigError, match=message):
            serve.settings_config({"serve.adapters": value})
    model = jaxlm.load(trained)
    with pytest.raises(ConfigError, match="the base model's own name"):
        serve.with_adapters(model, [("tiny", str(adapter_folders[0]))], "tiny")
    with pytest.raises(ConfigError, match="holds no LoRA adapter"):
        adapters.for_serving(trained, model.config, None)
    wide = tmp_path / "wide"
    wide.mkdir()
    (wide / "config.json").write_text(config_lib.to_json(config_lib.apply_overrides(
        model.config, {"model.d_model": 64, "lora.rank": 4})))
    with pytest.raises(ConfigError, match=r"adapts layers.attn.q of shape \[2, 64, 4, 16\], and the served base's"):
        adapters.for_serving(wide, model.config, None)


@contextlib.contextmanager
def without_persistent_cache():
    """JAX's persistent compilation cache off while the programs of the block compile. On an AVX-512 machine
    (jaxlib 0.10.2) XLA:CPU crashed serializing the draft server's decode program into the suite's cache after
    this module's earlier programs (a segfault or an abort in executable.serialize(), three runs out of three, at
    this tree and at the one CI passed the day before); alone, or with the cache off, it passes."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()


def test_the_server_decodes_with_a_draft_and_counts_its_proposals(server, trained):
    """`jaxlm serve RUN decode.draft=RUN` (the model as its own draft, proposing decode.draft_tokens' default of 3
    a pass): greedy completions over HTTP equal the server's without a draft, and /metrics counts the proposals,
    all kept. (tests/test_serve_speculative.py checks a smaller draft and sampling against the engine alone.)"""
    prompts = ["KING:", "To be, or not", "O"]

    def answers(srv):
        with client(srv) as c:
            return [c.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0).choices[0].text
                    for p in prompts]

    want = answers(server)
    cfg = serve.settings_config({"serve.max_slots": 4, "max_new_tokens": 16, "serve.model_name": "tiny",
                                 "decode.draft": str(trained)})
    with without_persistent_cache():
        srv = serve.Server(serve.build(trained, cfg, log=lambda s: None), "127.0.0.1", 0).start()
    try:
        assert srv.served.engine.draft.k == 3
        assert answers(srv) == want
        proposed, accepted = (metric(srv, f"jaxlm_draft_tokens_{x}_total") for x in ("proposed", "accepted"))
        assert proposed == accepted > 0 and proposed % 3 == 0
    finally:
        srv.stop()
