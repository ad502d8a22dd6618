"""`jaxlm serve` under load on loopback: throughput and latency at several concurrencies, continuous batching
against one request at a time, and Hugging Face transformers' `generate` on the same weights, in one run.

Each server is a `jaxlm serve` process of its own; the sweep runs one of --slots slots with --settings (by default
docs/serve.md's settings for a 2-core CPU host: serve.replicas=2, two engines of half the slots, one per core, and
serve.decode_steps=16), and the same server with default settings is measured at concurrency 16 too. The model is
benchmarks/decode.py's tiny random Llama (built with transformers, imported with `jaxlm convert from-hf`), given a
byte-level tokenizer so the server can turn tokens into text. Each client streams one completion of NEW tokens
after a 16-token prompt (token ids, greedy, no stop token, logprobs=1 so that every chunk lists its tokens even
where random weights make bytes that are not yet whole UTF-8 text); REQUESTS = 2 x concurrency per level, each
client sending its next request when its last one has ended. The load generator shares this machine's cores with
the server, so it is kept light: asyncio in this process, one keep-alive HTTP/1.1 connection per client, reading
the server-sent events itself (about 1/6 of the CPU the official openai client, a thread per client, spends on
the same streams). The --slots server is measured at concurrency 16 with the official openai client too.
A chunk may carry the tokens of several decode steps (serve.decode_steps). Prints the sweep's settings, one line
per level
    concurrency=C requests=R output_tok_per_s=X ttft_p50_ms= ttft_p99_ms= itl_p50_ms= itl_p99_ms=
    chunk_gap_p50_ms= chunk_gap_p99_ms= tokens_per_chunk=
then `openai_client` (the --slots server at concurrency 16, official openai client), the --slots server at
concurrency 16 with serve.decode_steps=1 (one decode step per device call), `defaults` (the --slots server with
default settings: one engine, 8 decode steps per call, at concurrency 16),
`slots8` (a server with 8 slots) and `one_at_a_time` (a server with one slot), both with default settings at
concurrency 8, and
transformers' generate at batch 16. Every figure but the shared-prefix ones is the fastest of --repeats runs
(new prompts each), the one least disturbed by other load, as the machine may be shared;
then the engine alone (in this process, no HTTP: 16 greedy sequences submitted together to a --slots engine)
with serve.decode_steps 8 and 1, and `jaxlm.generate` at batch 16 (prefill included);
then time to first token of 16 concurrent requests that share a 512-token system prompt (each followed by 16
tokens of its own, 8 new tokens) on a 16-slot server with the prefix cache (serve.prefix_cache=4) and without
(serve.prefix_cache=0), and the summary
    batching_speedup=X/Y (continuous batching in 8 slots over one slot, both at concurrency 8)
    vs_transformers=X/Z (the server at concurrency 16 over transformers' generate at batch 16)
    vs_transformers_openai_client=O/Z (the same with the official openai client as the load generator)
    vs_transformers_defaults=D/Z (the server with default settings at concurrency 16 over the same)
    decode_steps_speedup=X/W (the server at concurrency 16, its serve.decode_steps over 1)
    server_vs_engine=D/E (the default server at concurrency 16 over the engine alone with 16 sequences, both
        one engine with 8 decode steps per call)
    ttft_p50_prefix_cache= ttft_p50_no_prefix_cache= prefix_cache_ttft_speedup= (ms; the second over the first)
TTFT counts from sending the request to the first streamed chunk with a token. A chunk gap is the time between
a stream's successive chunks; tokens_per_chunk is the mean number of tokens a chunk carries; the inter-token
latency gives each token of a chunk an equal share of the gap before that chunk (gap / tokens).

    python benchmarks/serve.py [--new-tokens 64] [--slots 32] [--settings "serve.replicas=2 serve.decode_steps=16"]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import decode as decode_bench  # noqa: E402

from jaxlm import api  # noqa: E402

PROMPT = decode_bench.PROMPT
# The --slots server's settings: docs/serve.md's for a 2-core CPU host (two engines, one per core; 16 decode steps
# per call). The server with default settings is measured at concurrency 16 as well (`defaults`).
CPU_SETTINGS = ("serve.replicas=2", "serve.decode_steps=16")
SYSTEM = 512  # tokens of the system prompt the prefix-cache requests share


def byte_tokenizer(folder: Path) -> None:
    """A byte-level tokenizer.json of 256 tokens (no merges) for the model folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    (folder / "tokenizer").mkdir(exist_ok=True)
    tok.save(str(folder / "tokenizer" / "tokenizer.json"))


def _summary(results: list, concurrency: int, new_tokens: int, wall: float) -> dict:
    """The level's figures from each request's (start, [(chunk arrival, tokens it carries)], tokens)."""
    ttft = [chunks[0][0] - start for start, chunks, _ in results if chunks]
    gaps = [(b - a, n) for _, chunks, _ in results for (a, _), (b, n) in zip(chunks, chunks[1:])]
    itl = [g / n for g, n in gaps for _ in range(n)]
    total = sum(n for _, _, n in results)
    assert total == len(results) * new_tokens, f"{total} tokens of {len(results) * new_tokens}"
    assert total == sum(n for _, chunks, _ in results for _, n in chunks)
    pct = lambda xs, p: 1e3 * float(np.percentile(xs, p)) if xs else float("nan")  # noqa: E731
    return dict(concurrency=concurrency, requests=len(results), output_tok_per_s=total / wall,
                ttft_p50_ms=pct(ttft, 50), ttft_p99_ms=pct(ttft, 99), itl_p50_ms=pct(itl, 50),
                itl_p99_ms=pct(itl, 99), chunk_gap_p50_ms=pct([g for g, _ in gaps], 50),
                chunk_gap_p99_ms=pct([g for g, _ in gaps], 99),
                tokens_per_chunk=total / sum(len(chunks) for _, chunks, _ in results))


def _request(prompt: list[int], new_tokens: int) -> dict:
    return dict(model="bench", prompt=prompt, max_tokens=new_tokens, temperature=0, logprobs=1, stream=True,
                stream_options={"include_usage": True})


async def _chunks(reader: asyncio.StreamReader):
    """A response's status and its body's pieces as they arrive (chunked transfer encoding, as a streamed
    answer comes, or one Content-Length body)."""
    status = int((await reader.readline()).split()[1])
    headers = {}
    while (header := await reader.readline()) not in (b"\r\n", b""):
        name, value = header.decode("latin-1").split(":", 1)
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") != "chunked":
        yield status, await reader.readexactly(int(headers.get("content-length", 0)))
        return
    while size := int((await reader.readline()).split(b";")[0], 16):
        yield status, (await reader.readexactly(size + 2))[:-2]
    await reader.readline()


async def _stream_completion(conn, port: int, prompt: list[int], new_tokens: int):
    """One streamed completion on a keep-alive connection: (start, [(chunk arrival, tokens)], tokens)."""
    reader, writer = conn
    body = json.dumps(_request(prompt, new_tokens)).encode()
    t0 = time.perf_counter()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (port, len(body), body))
    chunks, tokens, pending = [], 0, b""
    async for status, data in _chunks(reader):
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {data[:300]!r}")
        events = (pending + data).split(b"\n\n")
        pending = events.pop()
        for event in events:
            if not event.startswith(b"data: {"):
                continue
            d = json.loads(event[6:])
            if d.get("usage"):
                tokens = d["usage"]["completion_tokens"]
            elif d["choices"] and (lp := d["choices"][0]["logprobs"]) and lp["tokens"]:
                chunks.append((time.perf_counter(), len(lp["tokens"])))
    return t0, chunks, tokens


def run_level(port: int, prompts: list[list[int]], concurrency: int, new_tokens: int, client: str = "light") -> dict:
    """`concurrency` clients, each streaming completions of the next prompts one after another, until all are
    done. The light client is asyncio in this process, one keep-alive HTTP/1.1 connection per client, reading
    the server-sent events itself; `openai` is the official client, a thread per client."""
    if client == "openai":
        return _run_level_openai(port, prompts, concurrency, new_tokens)
    todo = list(enumerate(prompts))[::-1]
    results = [None] * len(prompts)

    async def one_client():
        conn = await asyncio.open_connection("127.0.0.1", port)
        try:
            while todo:
                i, p = todo.pop()
                results[i] = await _stream_completion(conn, port, p, new_tokens)
        finally:
            conn[1].close()

    async def level():
        t0 = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        return time.perf_counter() - t0

    wall = asyncio.run(level())
    return _summary(results, concurrency, new_tokens, wall)


def _run_level_openai(port: int, prompts: list[list[int]], concurrency: int, new_tokens: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)

    def one(prompt):
        t0 = time.perf_counter()
        chunks, tokens = [], 0  # (arrival time, tokens it carries) of each chunk with tokens
        for chunk in client.completions.create(**_request(prompt, new_tokens)):
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            elif chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.tokens:
                chunks.append((time.perf_counter(), len(chunk.choices[0].logprobs.tokens)))
        return t0, chunks, tokens

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, prompts))
    return _summary(results, concurrency, new_tokens, time.perf_counter() - t0)


def line(r: dict) -> str:
    return " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items())


@contextlib.contextmanager
def server(folder: Path, settings: list[str]):
    """`jaxlm serve` in its own process (its threads do not share this one's interpreter lock with the
    clients); yields its port once it answers, stops it after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = ["serve.max_queue=256", "serve.model_name=bench", f"serve.port={port}", "decode.stop_at_eos=false",
                *settings]
    proc = subprocess.Popen([sys.executable, "-m", "jaxlm.cli", "serve", str(folder), *settings],
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"jaxlm serve did not start (exit status {proc.poll()})")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def serve_levels(folder: Path, slots: int, levels: list[int], new_tokens: int, repeats: int = 1,
                 settings: tuple[str, ...] = (), client: str = "light") -> list[dict]:
    """A server of `slots` slots (and `settings`) at each concurrency of `levels`; of `repeats` runs of a level
    (new prompts each), the one of highest throughput, the least disturbed by other load on the machine."""
    with server(folder, [f"serve.max_slots={slots}", f"decode.cache_length={PROMPT + new_tokens}",
                         *settings]) as port:
        rng = np.random.default_rng(0)
        run_level(port, [rng.integers(0, 256, PROMPT).tolist()] * 2, 2, new_tokens)  # warm up
        out = []
        for c in levels:
            runs = [run_level(port, [rng.integers(0, 256, PROMPT).tolist() for _ in range(2 * c)], c, new_tokens,
                              client) for _ in range(repeats)]
            out.append(max(runs, key=lambda r: r["output_tok_per_s"]))
        return out


def shared_prefix_ttft(folder: Path, prefix_cache: int, new_tokens: int = 8, requests: int = 16) -> dict:
    """16 concurrent requests: one SYSTEM-token system prompt, then PROMPT tokens of each request's own."""
    length = SYSTEM + PROMPT + new_tokens
    settings = [f"serve.max_slots={requests}", f"decode.cache_length={length}", f"serve.prefix_cache={prefix_cache}"]
    with server(folder, settings) as port:
        rng = np.random.default_rng(1)
        warm = rng.integers(0, 256, SYSTEM + PROMPT).tolist()  # another system prompt: compiles the chunk lengths
        run_level(port, [warm, warm], 1, new_tokens)
        system = rng.integers(0, 256, SYSTEM).tolist()
        prompts = [system + rng.integers(0, 256, PROMPT).tolist() for _ in range(requests)]
        return run_level(port, prompts, requests, new_tokens)


def engine_alone(folder: Path, slots: int, prompts: np.ndarray, new_tokens: int, decode_steps: int,
                 repeats: int) -> float:
    """Tokens/s of the serving engine in this process, without HTTP: len(prompts) greedy sequences submitted
    together to a `slots`-slot engine, the fastest of `repeats` runs."""
    from jaxlm.serve import engine as engine_lib

    model = api.load(folder)
    e = engine_lib.Engine(model.params, model.config.model, slots, PROMPT + new_tokens, len(prompts),
                          decode_steps=decode_steps)
    e.warm_up()
    e.start()
    best = 0.0
    try:
        for _ in range(repeats):
            events = [[] for _ in prompts]
            t0 = time.perf_counter()
            for p, ev in zip(prompts, events):
                e.submit(engine_lib.Sequence(p.tolist(), new_tokens, 0.0, 0, 1.0, 0, 0, (), ev.append))
            while not all(ev and ev[-1][0] == "done" for ev in events):
                time.sleep(0.001)
            best = max(best, len(prompts) * new_tokens / (time.perf_counter() - t0))
    finally:
        e.stop()
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--levels", default="1,8,16,32")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each measurement (the fastest counts)")
    ap.add_argument("--settings", default=" ".join(CPU_SETTINGS),
                    help="serve.* settings of the --slots server (default: docs/serve.md's for a 2-core CPU host)")
    a = ap.parse_args()
    settings = tuple(a.settings.split())
    levels = [int(c) for c in a.levels.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        _, _, hf = decode_bench.build(Path(tmp), a.new_tokens)
        if hf is None:
            sys.exit("benchmarks/serve.py needs the hf extra (transformers, torch) to build its model")
        folder = Path(tmp) / "jx"
        byte_tokenizer(folder)
        print(f"settings: {' '.join(settings) or '(defaults)'}", flush=True)
        results = {r["concurrency"]: r for r in serve_levels(folder, a.slots, levels, a.new_tokens, a.repeats,
                                                             settings)}
        for r in results.values():
            print(line(r), flush=True)
        openai16 = serve_levels(folder, a.slots, [16], a.new_tokens, a.repeats, settings, client="openai")[0]
        print("openai_client " + line(openai16), flush=True)
        one_step = serve_levels(folder, a.slots, [16], a.new_tokens, a.repeats,
                                settings + ("serve.decode_steps=1",))[0]
        print("decode_steps=1 " + line(one_step), flush=True)
        defaults16 = serve_levels(folder, a.slots, [16], a.new_tokens, a.repeats)[0]
        print("defaults " + line(defaults16), flush=True)
        batched = serve_levels(folder, 8, [8], a.new_tokens, a.repeats)[0]
        print("slots8 " + line(batched), flush=True)
        single = serve_levels(folder, 1, [8], a.new_tokens, a.repeats)[0]
        print("one_at_a_time " + line(single), flush=True)
        prompts = np.random.default_rng(16).integers(0, 256, (16, PROMPT)).astype(np.int32)
        hf_tok_s = max(decode_bench.with_transformers(hf, prompts, a.new_tokens) for _ in range(a.repeats))
        print(f"transformers_batch16_tok_per_s={hf_tok_s:.1f}", flush=True)
        alone = {n: engine_alone(folder, a.slots, prompts, a.new_tokens, n, a.repeats) for n in (8, 1)}
        model = api.load(folder)
        cfg = dataclasses.replace(model.config.model, block_size=PROMPT + a.new_tokens)  # as decode.py's build
        generate_tok_s = max(decode_bench.cached(model.params, cfg, prompts, a.new_tokens) for _ in range(a.repeats))
        print(f"engine_alone decode_steps=8 tok_per_s={alone[8]:.1f} decode_steps=1 tok_per_s={alone[1]:.1f} "
              f"generate_batch16_tok_per_s={generate_tok_s:.1f}", flush=True)
        cached = shared_prefix_ttft(folder, 4)
        print("shared_prefix prefix_cache=4 " + line(cached), flush=True)
        uncached = shared_prefix_ttft(folder, 0)
        print("shared_prefix prefix_cache=0 " + line(uncached), flush=True)
    print(f"batching_speedup={batched['output_tok_per_s'] / single['output_tok_per_s']:.2f}")
    if 16 in results:
        print(f"vs_transformers={results[16]['output_tok_per_s'] / hf_tok_s:.2f}")
        print(f"vs_transformers_openai_client={openai16['output_tok_per_s'] / hf_tok_s:.2f}")
        print(f"vs_transformers_defaults={defaults16['output_tok_per_s'] / hf_tok_s:.2f}")
        print(f"decode_steps_speedup={results[16]['output_tok_per_s'] / one_step['output_tok_per_s']:.2f}")
        print(f"server_vs_engine={defaults16['output_tok_per_s'] / alone[8]:.2f}")
    print(f"ttft_p50_prefix_cache={cached['ttft_p50_ms']:.1f} ttft_p50_no_prefix_cache={uncached['ttft_p50_ms']:.1f} "
          f"prefix_cache_ttft_speedup={uncached['ttft_p50_ms'] / cached['ttft_p50_ms']:.2f}")
    print(json.dumps({"settings": settings, "levels": list(results.values()), "openai_client": openai16,
                      "decode_steps_1": one_step, "defaults": defaults16,
                      "slots8": batched, "one_at_a_time": single,
                      "transformers": hf_tok_s, "engine_alone": alone, "generate": generate_tok_s,
                      "shared_prefix": {"prefix_cache": cached, "no_prefix_cache": uncached}}))


if __name__ == "__main__":
    main()
