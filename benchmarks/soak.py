"""A bounded soak of `jaxlm serve` on loopback: --clients concurrent clients send a mix of requests for
--seconds, then the server must be idle and whole.

The model is benchmarks/serve.py's Llama-shaped random model at --size (default tiny: seconds to build), each
token one word of text; the server runs its default settings (paged KV cache) in a process of its own. Each client
loops over requests of these kinds, drawn at random: a streamed completion (1 to 64 tokens, sampled with a seed
or greedy); a completion with n = 2 to 4 choices and a stop string; one with log-probabilities (logprobs=3);
scoring a prompt (echo, logprobs, max_tokens 0); a stream the client drops after its first chunk (a cancel);
and a bad request (invalid JSON, or a prompt token outside the vocabulary), which must be answered 400.

Checked and printed: the answers by status (no 5xx may occur; 400 only for the bad requests), requests per
second, then after the load stops: busy slots, waiting requests and pages held (all must be 0 within 30 s), and
the server's resident memory (VmRSS) sampled every 10 s: its last sample against the first taken after 60 s
(`rss_growth`, within 5% for a pass), and its memory mappings sampled with it: `maps_growth`, the last sample
against the first of the run's second half, within 1% (each program XLA:CPU compiles maps its code in mappings
of its own, and a process reaching vm.max_map_count crashes in its next compile: the shapes a server meets
first compile early, and one that kept compiling under a steady load would fail here). Exits 1 when a check
fails.

    python benchmarks/soak.py [--seconds 600] [--clients 32] [--size tiny]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import serve as serve_bench  # noqa: E402


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


async def client(h: httpx.AsyncClient, rng: random.Random, vocab: int, context: int, until: float,
                 codes: collections.Counter, bad_codes: collections.Counter) -> None:
    while time.monotonic() < until:
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, min(200, context - 64)))]
        kind = rng.choice(("stream", "n", "logprobs", "score", "cancel", "bad"))
        body = {"model": "bench", "prompt": prompt, "max_tokens": rng.randint(1, 64),
                "temperature": rng.choice((0, 0.8)), "seed": rng.randrange(1000)}
        try:
            if kind == "stream" or kind == "cancel":
                async with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if kind == "cancel" and line.startswith("data: {"):
                            break  # leaving the block closes the connection mid-stream
                codes[r.status_code] += 1
            elif kind == "bad":
                if rng.random() < 0.5:
                    r = await h.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
                else:
                    r = await h.post("/v1/completions", json={**body, "prompt": prompt + [vocab + 5]})
                bad_codes[r.status_code] += 1
            else:
                extra = {"n": dict(n=rng.randint(2, 4), stop=["t1"]), "logprobs": dict(logprobs=3),
                         "score": dict(max_tokens=0, echo=True, logprobs=1)}[kind]
                r = await h.post("/v1/completions", json={**body, **extra})
                codes[r.status_code] += 1
        except httpx.HTTPError as e:
            codes[f"client error {type(e).__name__}"] += 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--size", choices=list(serve_bench.SIZES), default="tiny")
    a = ap.parse_args(argv)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        _, folder = serve_bench.build(Path(tmp), a.size)
        vocab = serve_bench.SIZES[a.size]["model"]["vocab_size"]
        context = serve_bench.SIZES[a.size]["model"]["max_position_embeddings"]
        with serve_bench.server(folder, []) as port:
            proc_pid = next(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _is_server(p, port))
            codes, bad_codes, rss = collections.Counter(), collections.Counter(), []
            start = time.monotonic()

            async def run():
                limits = httpx.Limits(max_connections=a.clients)
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=300, limits=limits) as h:
                    until = time.monotonic() + a.seconds

                    async def sample_rss():
                        while time.monotonic() < until:
                            rss.append((time.monotonic() - start, rss_kib(proc_pid), maps_count(proc_pid)))
                            await asyncio.sleep(10)

                    await asyncio.gather(sample_rss(), *(client(h, random.Random(i), vocab, context, until, codes,
                                                                bad_codes)
                                                         for i in range(a.clients)))

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
    answered = sum(v for k, v in codes.items() if isinstance(k, int))
    print(f"seconds={wall:.0f} clients={a.clients} requests={answered + sum(bad_codes.values())} "
          f"requests_per_s={(answered + sum(bad_codes.values())) / wall:.1f}")
    print("status " + " ".join(f"{k}={v}" for k, v in sorted(codes.items(), key=str)))
    print("bad_requests_status " + " ".join(f"{k}={v}" for k, v in sorted(bad_codes.items(), key=str)))
    print(f"after busy_slots={idle[0]:.0f} queue_depth={idle[1]:.0f} kv_pages_used={idle[2]:.0f}")
    after_minute = next((x for x in rss if x[0] >= 60), rss[0])
    growth = rss[-1][1] / after_minute[1] - 1
    half = next(x for x in rss if x[0] >= rss[-1][0] / 2)
    maps_growth = rss[-1][2] / half[2] - 1
    print("rss_mib " + " ".join(f"{t:.0f}s:{kib / 1024:.0f}" for t, kib, _ in rss))
    print(f"rss_growth={growth:+.3f} (last sample against the first after 60 s)")
    print("maps " + " ".join(f"{t:.0f}s:{n}" for t, _, n in rss))
    print(f"maps_growth={maps_growth:+.3f} (last sample against the first after {half[0]:.0f} s: {half[2]} -> "
          f"{rss[-1][2]} mappings; {after_minute[2]} after 60 s)")
    if any(not isinstance(k, int) or k >= 500 or k != 200 for k in codes):
        print("FAIL: answers other than 200 to good requests")
        ok = False
    if set(bad_codes) - {400}:
        print("FAIL: bad requests answered other than 400")
        ok = False
    if idle != [0, 0, 0]:
        print("FAIL: the server is not idle after the load")
        ok = False
    if abs(growth) > 0.05 and wall >= 120:
        print("FAIL: resident memory moved more than 5%")
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
