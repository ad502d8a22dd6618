"""How long one client's heavy or hostile requests hold back the streams of the others in `jaxlm serve`.

The server (benchmarks/serve.py's Llama-shaped random model at --size, its default settings, in a process of its
own) streams 16 greedy completions over and over (16-token prompts, 120 new tokens); the gaps between consecutive
chunks of each stream are recorded in phases of --phase-seconds. In each phase but the baselines, another process
sends one kind of request again and again (0.3 s apart, each after the one before is answered):
- `tokenize_7mb`: /tokenize of a 7 MB text, past serve.max_tokenize_chars (answered 413);
- `tokenize_1m_chars`: /tokenize of a text just under it (answered with its ~200,000 tokens);
- `chat_6mb`: a chat request of 60,000 messages (6 MB: parsed, validated and rendered through a one-line chat
  template, then refused as longer than the context: 400);
- `header_256mb`: a request whose header goes on for 256 MB (cut off at serve.max_header_kb);
- `slowloris_100`: 100 connections that send half a request line and then nothing (closed at
  serve.header_timeout_s).
The first second and the last 0.2 s of each phase are left out (the sender starting and stopping there is this
machine's work, not the server's). Printed per phase: the worst gap, the p99 and the median, in ms, and the answers
the sender got. The load generator, the sender and the server share this machine's cores: on a 2-core CPU the
baseline's worst gap is the noise floor to read the others against.

    python benchmarks/stream_gaps.py [--size tiny] [--phase-seconds 10] [--kinds baseline,tokenize_7mb,...]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import serve as serve_bench  # noqa: E402

KINDS = ("baseline", "tokenize_7mb", "tokenize_1m_chars", "chat_6mb", "header_256mb", "slowloris_100", "baseline")
STREAMS = 16
SETTLE_S, TAIL_S = 1.0, 0.2
SLOWLORIS_WAIT_S = 20.0  # a server that never closes them: the connections are given up after this
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


async def stream_forever(port: int, i: int, gaps: list, stop: asyncio.Event) -> None:
    """Greedy streams one after another; (time, gap) for each chunk after a stream's first."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as h:
        while not stop.is_set():
            body = {"model": "bench", "prompt": [1 + (i * 7 + j) % 400 for j in range(16)], "max_tokens": 120,
                    "temperature": 0, "stream": True}
            last = None
            async with h.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        now = time.monotonic()
                        if last is not None:
                            gaps.append((now, now - last))
                        last = now


async def send_one(h: httpx.AsyncClient, port: int, kind: str, texts: dict) -> str:
    """One request of `kind`; what came back (a status, or how the connection ended)."""
    if kind in ("tokenize_7mb", "tokenize_1m_chars"):
        return str((await h.post("/tokenize", json={"prompt": texts[kind]})).status_code)
    if kind == "chat_6mb":
        return str((await h.post("/v1/chat/completions", json=texts[kind])).status_code)
    if kind == "header_256mb":
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
        sent = 0
        try:
            while sent < 256 << 20:
                writer.write(b"a" * (1 << 20))
                await writer.drain()
                sent += 1 << 20
            return "all sent"
        except OSError:
            return "closed"
        finally:
            writer.close()
    if kind == "slowloris_100":
        start, conns = time.monotonic(), []
        for _ in range(100):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0")
            conns.append((reader, writer))
        try:
            await asyncio.wait_for(asyncio.gather(*(reader.read() for reader, _ in conns)), SLOWLORIS_WAIT_S)
            return f"closed after {time.monotonic() - start:.0f} s"
        except TimeoutError:
            return f"open after {SLOWLORIS_WAIT_S:.0f} s"
        finally:
            for _, writer in conns:
                writer.close()
    raise ValueError(kind)


def sender(port: int, kind: str) -> int:
    """The sending process: requests of `kind` until SIGTERM; prints what came back, one JSON line each."""
    texts = {"tokenize_7mb": "word " * (7 * 2**20 // 5), "tokenize_1m_chars": "word " * (2**20 // 5 - 10),
             "chat_6mb": {"model": "bench", "messages": [{"role": "user", "content": "w " * 50}] * 60000,
                          "max_tokens": 4}}

    async def run():
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as h:
            while not stop.is_set():
                try:
                    answer = await send_one(h, port, kind, texts)
                except httpx.HTTPError as e:
                    answer = type(e).__name__
                print(json.dumps(answer), flush=True)
                try:
                    await asyncio.wait_for(stop.wait(), 0.3)
                except TimeoutError:
                    pass

    asyncio.run(run())
    return 0


async def measure(port: int, kinds: list[str], phase_s: float) -> list[str]:
    gc.disable()  # this process's own collections would show as gaps
    gaps: list = []
    stop = asyncio.Event()
    streams = [asyncio.create_task(stream_forever(port, i, gaps, stop)) for i in range(STREAMS)]
    await asyncio.sleep(5)  # every stream under way
    lines = []
    for kind in kinds:
        start = time.monotonic()
        proc = None if kind == "baseline" else subprocess.Popen(
            [sys.executable, __file__, "--send", str(port), kind], stdout=subprocess.PIPE, text=True)
        await asyncio.sleep(phase_s)
        answers = []
        if proc is not None:
            proc.terminate()
            answers = [json.loads(line) for line in proc.communicate()[0].splitlines()]
        g = sorted(x for t, x in gaps if start + SETTLE_S <= t <= start + phase_s - TAIL_S)
        gaps.clear()
        if not g:
            raise RuntimeError(f"no stream made a chunk during {kind}")
        seen = ", ".join(f"{a} x{answers.count(a)}" for a in sorted(set(answers)))
        lines.append(f"{kind:18s} worst_gap_ms={1000 * g[-1]:.0f} p99_gap_ms={1000 * g[int(0.99 * len(g))]:.0f} "
                     f"median_gap_ms={1000 * statistics.median(g):.1f} chunks={len(g)} answers=[{seen}]")
        print(lines[-1], flush=True)
    stop.set()
    await asyncio.gather(*streams, return_exceptions=True)
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=list(serve_bench.SIZES), default="tiny")
    ap.add_argument("--phase-seconds", type=float, default=10.0)
    ap.add_argument("--kinds", default=",".join(KINDS))
    a = ap.parse_args(argv)
    kinds = a.kinds.split(",")
    unknown = set(kinds) - set(KINDS)
    if unknown:
        ap.error(f"unknown kinds {sorted(unknown)}; choose from {', '.join(dict.fromkeys(KINDS))}")
    with tempfile.TemporaryDirectory() as tmp:
        _, folder = serve_bench.build(Path(tmp), a.size)
        template = Path(tmp) / "chat.jinja"
        template.write_text(CHAT_TEMPLATE)
        with serve_bench.server(folder, ["serve.max_queue=64", f"serve.chat_template={template}"]) as endpoint:
            asyncio.run(measure(endpoint.port, kinds, a.phase_seconds))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--send":
        sys.exit(sender(int(sys.argv[2]), sys.argv[3]))
    sys.exit(main())
