"""A bounded soak of `jaxlm serve` on loopback: --clients concurrent clients send a mix of good, bad and hostile
requests for --seconds, then the server must be idle and whole.

The model is benchmarks/serve.py's Llama-shaped random model at --size (default tiny: seconds to build), each
token one word of text; the server runs its default settings (paged KV cache, serve.max_queue=64) with a one-line
chat template, in a process of its own. Each client loops over requests drawn at random from these kinds:
- good: a streamed completion (1 to 64 tokens, sampled with a seed or greedy); a completion with n = 2 to 4
  choices and a stop string; one with log-probabilities (logprobs=3); scoring a prompt (echo, logprobs,
  max_tokens 0); a stream the client drops after its first chunk (a cancel): each must be answered 200;
- bad: invalid JSON, or a prompt token outside the vocabulary: 400;
- hostile (issue 47), rarer, each with its expected answer:
  `extreme`: a completion or chat request with one numeric field (max_tokens, max_completion_tokens, temperature,
  top_p, top_k, n, seed, logprobs, top_logprobs) at 0, -1, 2**31, 2**63-1, 1e308 or a bare NaN in the JSON text:
  200 with a well-formed body (its choices, its text no longer than max_tokens, log-probabilities <= 0) or a 4xx
  with an error object, never 5xx; `never_fits`: more prompts x n (n=16) than serve.max_queue holds: 400;
  `tokenize_big`: /tokenize of a 7 MB text (past serve.max_tokenize_chars): 413; `big_header`: a request with a
  64 KiB header (past serve.max_header_kb): 431, or the connection closed; `dup_host`: a request with two Host
  headers: 400; `slowloris`: half a request's headers, then nothing: the server must close the connection within
  serve.header_timeout_s + 5 s (408 or a silent close). The raw-socket kinds (the last three) open connections
  of their own, at most RAW_CONNECTIONS at once, beside the clients' pool. --each-hostile makes the first draws
  take every hostile kind once, so that a short run meets them all.

Printed: requests per second; the answers by status, for the good requests, the bad ones and each hostile kind
(`hostile_<kind> status=count ...`; any answer but the expected ones fails the soak); the longest a slowloris
connection stayed open; for the good streams that finished, the largest gap between two consecutive chunks of
one stream (`worst_stream_gap_ms`) and the p99 of each stream's largest (printed, not checked: a CPU shared by 32
clients makes them long); then after the load stops: busy slots, waiting requests and pages held (all must be 0
within 30 s), and the server's resident memory (VmRSS) sampled every 10 s: its last sample against the first
taken after 60 s (`rss_growth`, within 10% for a pass in runs of 120 s or more), and its memory mappings sampled
with it: `maps_growth`, the last sample against the first of the run's second half, within 1% (each program
XLA:CPU compiles maps its code in mappings of its own, and a process reaching vm.max_map_count crashes in its
next compile: the shapes a server meets first compile early, and one that kept compiling under a steady load
would fail here). Exits 1 when a check fails.

    python benchmarks/soak.py [--seconds 600] [--clients 32] [--size tiny] [--each-hostile]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import serve as serve_bench  # noqa: E402

from jaxlm.config import ServeConfig  # noqa: E402

LIMITS = ServeConfig()  # the server runs with these defaults: the hostile kinds' expected answers follow them
GOOD = ("stream", "n", "logprobs", "score", "cancel")
# Draw weights against 1 for each good kind and for the bad one: a slowloris holds its client for
# serve.header_timeout_s and a 7 MB upload is costly, so those are the rarest (one draw in about 2,200 and one in
# about 670)
HOSTILE = {"extreme": 0.5, "never_fits": 0.1, "tokenize_big": 0.01, "big_header": 0.05, "dup_host": 0.05,
           "slowloris": 0.003}
EXPECTED = {"never_fits": {400}, "tokenize_big": {413}, "big_header": {431, "closed"}, "dup_host": {400},
            "slowloris": {408, "closed"}}  # extreme: 200 with a valid body or any 4xx (`expected`)
RAW_CONNECTIONS = 4  # raw-socket connections open at once, at most
SLOWLORIS_MARGIN_S = 5.0
EXTREME_FIELDS = {"completion": ("max_tokens", "temperature", "top_p", "top_k", "n", "seed", "logprobs"),
                  "chat": ("max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n", "seed",
                           "logprobs", "top_logprobs")}
EXTREME_VALUES = (0, -1, 2**31, 2**63 - 1, 1e308, "NaN")  # "NaN": the bare token, which JSON does not allow
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@dataclasses.dataclass
class Tally:
    """What the clients saw: answers by status for each kind, each finished good stream's largest gap between
    chunks, and how long each slowloris connection stayed open."""
    good: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    bad: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    hostile: dict = dataclasses.field(default_factory=lambda: {k: collections.Counter() for k in HOSTILE})
    stream_gaps_s: list = dataclasses.field(default_factory=list)
    slowloris_s: list = dataclasses.field(default_factory=list)

    def requests(self) -> int:
        return sum(self.good.values()) + sum(self.bad.values()) + sum(sum(c.values()) for c in self.hostile.values())


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def maps_count(pid: int) -> int:
    """The process's memory mappings (lines of /proc/PID/maps)."""
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for _ in f)


def metric(text: str, name: str) -> float:
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


# ---- good and bad requests ---------------------------------------------------------------------------------------

async def good_request(h: httpx.AsyncClient, rng: random.Random, kind: str, body: dict, t: Tally) -> None:
    """One good request of `kind`, its status counted; a finished stream's largest gap between chunks kept."""
    if kind in ("stream", "cancel"):
        last, worst, chunks = None, 0.0, 0
        async with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    now = time.monotonic()
                    if last is not None:
                        worst = max(worst, now - last)
                    last, chunks = now, chunks + 1
                    if kind == "cancel":
                        break  # leaving the block closes the connection mid-stream
        if kind == "stream" and r.status_code == 200 and chunks >= 2:
            t.stream_gaps_s.append(worst)
    else:
        extra = {"n": dict(n=rng.randint(2, 4), stop=["t1"]), "logprobs": dict(logprobs=3),
                 "score": dict(max_tokens=0, echo=True, logprobs=1)}[kind]
        r = await h.post("/v1/completions", json={**body, **extra})
    t.good[r.status_code] += 1


async def bad_request(h: httpx.AsyncClient, rng: random.Random, body: dict, vocab: int) -> int:
    """Invalid JSON, or a prompt token past the vocabulary: the status (400 expected)."""
    if rng.random() < 0.5:
        r = await h.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    else:
        r = await h.post("/v1/completions", json={**body, "prompt": body["prompt"] + [vocab + 5]})
    return r.status_code


# ---- hostile requests: each returns the key its answer is counted under ------------------------------------------

async def extreme(h: httpx.AsyncClient, rng: random.Random, vocab: int) -> int | str:
    """One numeric field at an extreme: the status when the answer is one of those allowed (200 with a valid
    body, 4xx with an error object), else the status and what is wrong with it."""
    route = rng.choice(("completion", "chat"))
    field, value = rng.choice(EXTREME_FIELDS[route]), rng.choice(EXTREME_VALUES)
    body = {"model": "bench", "max_tokens": rng.randint(1, 16), "seed": rng.randrange(1000)}
    if route == "completion":
        body["prompt"] = [rng.randrange(vocab) for _ in range(rng.randint(1, 32))]
    else:
        body["messages"] = [{"role": "user", "content": " ".join(f"t{rng.randrange(vocab)}" for _ in range(8))}]
        if field == "top_logprobs":
            body["logprobs"] = True
    if field in ("max_tokens", "max_completion_tokens"):
        del body["max_tokens"]
    body.pop(field, None)
    text = json.dumps(body)[:-1] + f', "{field}": {value if value == "NaN" else json.dumps(value)}}}'
    r = await h.post("/v1/completions" if route == "completion" else "/v1/chat/completions", content=text,
                     headers={"content-type": "application/json"})
    try:
        answer = r.json()
    except ValueError:
        return f"{r.status_code}_not_json"
    if 400 <= r.status_code < 500:
        error = answer.get("error") if isinstance(answer, dict) else None
        return r.status_code if isinstance(error, dict) and isinstance(error.get("message"), str) else \
            f"{r.status_code}_no_error_object"
    if r.status_code == 200:
        sent = {**body, field: math.nan if value == "NaN" else value}
        return 200 if valid_answer(route, answer, sent) else "200_invalid_body"
    return r.status_code


def valid_answer(route: str, answer, sent: dict) -> bool:
    """A 200's body holds what the request asked for: n choices (indexed 0..n-1), each finished, its text a string
    of at most max_tokens words (the model's tokens are one word each), its log-probabilities (when asked) numbers
    <= 0."""
    n = sent.get("n", 1)
    limit = sent.get("max_completion_tokens", sent.get("max_tokens")) if route == "chat" else sent.get("max_tokens")
    try:
        choices = answer["choices"]
        if [c["index"] for c in choices] != list(range(n)) or answer["usage"]["completion_tokens"] < 0:
            return False
        for c in choices:
            text = c["text"] if route == "completion" else c["message"]["content"]
            if not isinstance(text, str) or c["finish_reason"] not in ("stop", "length"):
                return False
            if isinstance(limit, int) and len(text.split()) > limit:
                return False
            if route == "completion" and isinstance(sent.get("logprobs"), int):
                logprobs = [x for x in c["logprobs"]["token_logprobs"] if x is not None]
            elif route == "chat" and sent.get("logprobs") is True:
                logprobs = [x["logprob"] for x in c["logprobs"]["content"]]
            else:
                logprobs = []
            if not all(isinstance(x, (int, float)) and x <= 1e-6 for x in logprobs):
                return False
    except (KeyError, TypeError, IndexError):
        return False
    return True


async def never_fits(h: httpx.AsyncClient, rng: random.Random, vocab: int) -> int:
    prompts = LIMITS.max_queue // 16 + 1
    r = await h.post("/v1/completions", json={"model": "bench", "prompt": [[rng.randrange(vocab)] for _ in
                                                                            range(prompts)], "n": 16,
                                              "max_tokens": 4})
    return r.status_code


async def tokenize_big(h: httpx.AsyncClient, big: bytes) -> int:
    r = await h.post("/tokenize", content=big, headers={"content-type": "application/json"})
    return r.status_code


async def raw_exchange(port: int, data: bytes, until_close: bool, timeout: float) -> int | str:
    """Open a connection, send `data`, and read the answer's status (or, with until_close, read on until the
    server closes): "closed" when it closed without answering, "open" when `timeout` passed first."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    got = b""

    async def read():
        nonlocal got
        try:
            writer.write(data)
            await writer.drain()
        except ConnectionError:  # the server refused the rest of a head too large: its answer may still be there
            pass
        while until_close or b"\r\n\r\n" not in got:
            try:
                chunk = await reader.read(65536)
            except ConnectionError:
                return
            if not chunk:
                return
            got += chunk

    try:
        await asyncio.wait_for(read(), timeout)
    except TimeoutError:
        return "open"
    finally:
        writer.close()
    return int(got[9:12]) if got.startswith(b"HTTP/1.1 ") else "closed"


async def raw_request(kind: str, port: int) -> tuple[int | str, float]:
    """A raw-socket kind's answer, and the seconds its connection took."""
    host = f"Host: 127.0.0.1:{port}\r\n".encode()
    start = time.monotonic()
    if kind == "big_header":
        data = b"GET /v1/models HTTP/1.1\r\n" + host + b"X-Big: " + b"a" * 65536 + b"\r\n\r\n"
        key = await raw_exchange(port, data, False, 60)
    elif kind == "dup_host":
        data = b"GET /v1/models HTTP/1.1\r\n" + host + host + b"Connection: close\r\n\r\n"
        key = await raw_exchange(port, data, False, 60)
    else:  # slowloris: half a head, then nothing; the answer is the connection closing
        data = b"POST /v1/completions HTTP/1.1\r\n" + host + b"Content-Type: appl"
        key = await raw_exchange(port, data, True, LIMITS.header_timeout_s + SLOWLORIS_MARGIN_S)
    return key, time.monotonic() - start


# ---- the load ----------------------------------------------------------------------------------------------------

async def client(h: httpx.AsyncClient, port: int, rng: random.Random, vocab: int, context: int, until: float,
                 first: collections.deque, raw: asyncio.Semaphore, big: bytes, t: Tally) -> None:
    kinds = (*GOOD, "bad", *HOSTILE)
    weights = (1,) * (len(GOOD) + 1) + tuple(HOSTILE.values())
    while time.monotonic() < until:
        kind = first.popleft() if first else rng.choices(kinds, weights)[0]
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, min(200, context - 64)))]
        body = {"model": "bench", "prompt": prompt, "max_tokens": rng.randint(1, 64),
                "temperature": rng.choice((0, 0.8)), "seed": rng.randrange(1000)}
        counts = t.good if kind in GOOD else t.bad if kind == "bad" else t.hostile[kind]
        try:
            if kind in GOOD:
                await good_request(h, rng, kind, body, t)
            elif kind == "bad":
                t.bad[await bad_request(h, rng, body, vocab)] += 1
            elif kind == "extreme":
                t.hostile[kind][await extreme(h, rng, vocab)] += 1
            elif kind == "never_fits":
                t.hostile[kind][await never_fits(h, rng, vocab)] += 1
            elif kind == "tokenize_big":
                t.hostile[kind][await tokenize_big(h, big)] += 1
            else:
                async with raw:
                    key, seconds = await raw_request(kind, port)
                t.hostile[kind][key] += 1
                if kind == "slowloris":
                    t.slowloris_s.append(seconds)
        except (httpx.HTTPError, OSError) as e:
            counts[f"client error {type(e).__name__}"] += 1


def expected(kind: str, key) -> bool:
    if kind == "extreme":
        return isinstance(key, int) and (key == 200 or 400 <= key < 500)
    return key in EXPECTED[kind]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--size", choices=list(serve_bench.SIZES), default="tiny")
    ap.add_argument("--each-hostile", action="store_true", help="draw every hostile kind once first")
    a = ap.parse_args(argv)
    ok = True
    t, rss = Tally(), []
    big = json.dumps({"model": "bench", "prompt": "t1 " * (7_000_000 // 3)}).encode()
    with tempfile.TemporaryDirectory() as tmp:
        _, folder = serve_bench.build(Path(tmp), a.size)
        vocab = serve_bench.SIZES[a.size]["model"]["vocab_size"]
        context = serve_bench.SIZES[a.size]["model"]["max_position_embeddings"]
        (Path(tmp) / "chat.jinja").write_text(CHAT_TEMPLATE)
        # serve_bench.server queues 4096 requests; the soak runs the default queue, which never_fits outgrows
        settings = [f"serve.max_queue={LIMITS.max_queue}", f"serve.chat_template={Path(tmp) / 'chat.jinja'}"]
        with serve_bench.server(folder, settings) as endpoint:
            port = endpoint.port
            proc_pid = next(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _is_server(p, port))
            start = time.monotonic()

            async def run():
                limits = httpx.Limits(max_connections=a.clients)
                first = collections.deque(HOSTILE if a.each_hostile else ())
                raw = asyncio.Semaphore(RAW_CONNECTIONS)
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=300, limits=limits) as h:
                    until = time.monotonic() + a.seconds

                    async def sample_rss():
                        while time.monotonic() < until:
                            rss.append((time.monotonic() - start, rss_kib(proc_pid), maps_count(proc_pid)))
                            await asyncio.sleep(10)

                    await asyncio.gather(sample_rss(), *(client(h, port, random.Random(i), vocab, context, until,
                                                                first, raw, big, t) for i in range(a.clients)))

            asyncio.run(run())
            wall = time.monotonic() - start
            deadline = time.monotonic() + 30
            while True:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
                idle = [metric(text, n) for n in ("jaxlm_busy_slots", "jaxlm_queue_depth", "jaxlm_kv_pages_used")]
                if idle == [0, 0, 0] or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            rss.append((time.monotonic() - start, rss_kib(proc_pid), maps_count(proc_pid)))

    def statuses(counts):
        return " ".join(f"{k}={v}" for k, v in sorted(counts.items(), key=str))

    print(f"seconds={wall:.0f} clients={a.clients} requests={t.requests()} requests_per_s={t.requests() / wall:.1f}")
    print("status " + statuses(t.good))
    print("bad_requests_status " + statuses(t.bad))
    for kind, counts in t.hostile.items():
        print(f"hostile_{kind} " + statuses(counts))
    if t.slowloris_s:
        print(f"slowloris_worst_close_s={max(t.slowloris_s):.1f} (allowed: serve.header_timeout_s="
              f"{LIMITS.header_timeout_s:g} + {SLOWLORIS_MARGIN_S:g})")
    gaps_ms = [g * 1000 for g in sorted(t.stream_gaps_s)]
    if gaps_ms:
        print(f"worst_stream_gap_ms={gaps_ms[-1]:.0f} p99_stream_gap_ms={gaps_ms[int(0.99 * (len(gaps_ms) - 1))]:.0f} "
              f"streams={len(gaps_ms)} (each finished good stream's largest gap between chunks: the largest, the p99)")
    print(f"after busy_slots={idle[0]:.0f} queue_depth={idle[1]:.0f} kv_pages_used={idle[2]:.0f}")
    after_minute = next((x for x in rss if x[0] >= 60), rss[0])
    growth = rss[-1][1] / after_minute[1] - 1
    half = next(x for x in rss if x[0] >= rss[-1][0] / 2)
    maps_growth = rss[-1][2] / half[2] - 1
    print("rss_mib " + " ".join(f"{s:.0f}s:{kib / 1024:.0f}" for s, kib, _ in rss))
    print(f"rss_growth={growth:+.3f} (last sample against the first after 60 s"
          f"{'' if wall >= 120 else '; not checked in a run shorter than 120 s'})")
    print("maps " + " ".join(f"{s:.0f}s:{n}" for s, _, n in rss))
    print(f"maps_growth={maps_growth:+.3f} (last sample against the first after {half[0]:.0f} s: {half[2]} -> "
          f"{rss[-1][2]} mappings; {after_minute[2]} after 60 s)")
    if set(t.good) - {200}:
        print("FAIL: answers other than 200 to good requests")
        ok = False
    if set(t.bad) - {400}:
        print("FAIL: bad requests answered other than 400")
        ok = False
    for kind, counts in t.hostile.items():
        if wrong := [k for k in counts if not expected(kind, k)]:
            print(f"FAIL: hostile {kind} answered {', '.join(map(str, wrong))}")
            ok = False
    if idle != [0, 0, 0]:
        print("FAIL: the server is not idle after the load")
        ok = False
    if abs(growth) > 0.10 and wall >= 120:
        print("FAIL: resident memory moved more than 10%")
        ok = False
    if maps_growth > 0.01 and wall >= 120:
        print("FAIL: the server's memory mappings grew more than 1% in the second half (it keeps compiling)")
        ok = False
    print("soak " + ("passed" if ok else "failed"))
    return 0 if ok else 1


def _is_server(proc: Path, port: int) -> bool:
    try:
        return f"serve.port={port}" in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
