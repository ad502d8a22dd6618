"""`jaxlm serve` under load on loopback: throughput and latency at several concurrencies, continuous batching
against one request at a time, and Hugging Face transformers' `generate` on the same weights, in one run.

Each server is a `jaxlm serve` process of its own; the sweep runs one of --slots slots. The model is
benchmarks/decode.py's tiny random Llama (built with transformers, imported with `jaxlm convert from-hf`), given a
byte-level tokenizer so the server can turn tokens into text. Each client streams one completion of NEW tokens
after a 16-token prompt (token ids, greedy, no stop token, logprobs=1 so that every chunk lists its tokens even
where random weights make bytes that are not yet whole UTF-8 text) with the official openai client;
REQUESTS = 2 x concurrency per level. The servers run with their default serve.decode_steps (8), so a chunk may
carry the tokens of several decode steps. Prints one line per level
    concurrency=C requests=R output_tok_per_s=X ttft_p50_ms= ttft_p99_ms= itl_p50_ms= itl_p99_ms=
    chunk_gap_p50_ms= chunk_gap_p99_ms= tokens_per_chunk=
then the --slots server at concurrency 16 with serve.decode_steps=1 (one decode step per device call),
`slots8` (a server with 8 slots) and `one_at_a_time` (a server with one slot), both at concurrency 8, and
transformers' generate at batch 16. Every figure but the shared-prefix ones is the fastest of --repeats runs
(new prompts each), the one least disturbed by other load, as the machine may be shared;
then the engine alone (in this process, no HTTP: 16 greedy sequences submitted together to a --slots engine)
with serve.decode_steps 8 and 1, and `jaxlm.generate` at batch 16 (prefill included);
then time to first token of 16 concurrent requests that share a 512-token system prompt (each followed by 16
tokens of its own, 8 new tokens) on a 16-slot server with the prefix cache (serve.prefix_cache=4) and without
(serve.prefix_cache=0), and the summary
    batching_speedup=X/Y (continuous batching in 8 slots over one slot, both at concurrency 8)
    vs_transformers=X/Z (the server at concurrency 16 over transformers' generate at batch 16)
    decode_steps_speedup=X/W (the server at concurrency 16, serve.decode_steps=8 over 1)
    server_vs_engine=X/E (the server at concurrency 16 over the engine alone with 16 sequences)
    ttft_p50_prefix_cache= ttft_p50_no_prefix_cache= prefix_cache_ttft_speedup= (ms; the second over the first)
TTFT counts from sending the request to the first streamed chunk with a token. A chunk gap is the time between
a stream's successive chunks; tokens_per_chunk is the mean number of tokens a chunk carries; the inter-token
latency gives each token of a chunk an equal share of the gap before that chunk (gap / tokens).

    python benchmarks/serve.py [--new-tokens 64] [--slots 32]
"""

from __future__ import annotations

import argparse
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


def run_level(port: int, prompts: list[list[int]], concurrency: int, new_tokens: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)

    def one(prompt):
        t0 = time.perf_counter()
        chunks, tokens = [], 0  # (arrival time, tokens it carries) of each chunk with tokens
        for chunk in client.completions.create(model="bench", prompt=prompt, max_tokens=new_tokens, temperature=0,
                                               logprobs=1, stream=True, stream_options={"include_usage": True}):
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            elif chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.tokens:
                chunks.append((time.perf_counter(), len(chunk.choices[0].logprobs.tokens)))
        return t0, chunks, tokens

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    ttft = [chunks[0][0] - start for start, chunks, _ in results if chunks]
    gaps = [(b - a, n) for _, chunks, _ in results for (a, _), (b, n) in zip(chunks, chunks[1:])]
    itl = [g / n for g, n in gaps for _ in range(n)]
    total = sum(n for _, _, n in results)
    assert total == len(prompts) * new_tokens, f"{total} tokens of {len(prompts) * new_tokens}"
    assert total == sum(n for _, chunks, _ in results for _, n in chunks)
    pct = lambda xs, p: 1e3 * float(np.percentile(xs, p)) if xs else float("nan")  # noqa: E731
    return dict(concurrency=concurrency, requests=len(prompts), output_tok_per_s=total / wall,
                ttft_p50_ms=pct(ttft, 50), ttft_p99_ms=pct(ttft, 99), itl_p50_ms=pct(itl, 50),
                itl_p99_ms=pct(itl, 99), chunk_gap_p50_ms=pct([g for g, _ in gaps], 50),
                chunk_gap_p99_ms=pct([g for g, _ in gaps], 99),
                tokens_per_chunk=total / sum(len(chunks) for _, chunks, _ in results))


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
                 settings: tuple[str, ...] = ()) -> list[dict]:
    """A server of `slots` slots (and `settings`) at each concurrency of `levels`; of `repeats` runs of a level
    (new prompts each), the one of highest throughput, the least disturbed by other load on the machine."""
    with server(folder, [f"serve.max_slots={slots}", f"decode.cache_length={PROMPT + new_tokens}",
                         *settings]) as port:
        rng = np.random.default_rng(0)
        run_level(port, [rng.integers(0, 256, PROMPT).tolist()] * 2, 2, new_tokens)  # warm up
        out = []
        for c in levels:
            runs = [run_level(port, [rng.integers(0, 256, PROMPT).tolist() for _ in range(2 * c)], c, new_tokens)
                    for _ in range(repeats)]
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
    a = ap.parse_args()
    levels = [int(c) for c in a.levels.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        _, _, hf = decode_bench.build(Path(tmp), a.new_tokens)
        if hf is None:
            sys.exit("benchmarks/serve.py needs the hf extra (transformers, torch) to build its model")
        folder = Path(tmp) / "jx"
        byte_tokenizer(folder)
        results = {r["concurrency"]: r for r in serve_levels(folder, a.slots, levels, a.new_tokens, a.repeats)}
        for r in results.values():
            print(line(r), flush=True)
        one_step = serve_levels(folder, a.slots, [16], a.new_tokens, a.repeats, ("serve.decode_steps=1",))[0]
        print("decode_steps=1 " + line(one_step), flush=True)
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
        print(f"decode_steps_speedup={results[16]['output_tok_per_s'] / one_step['output_tok_per_s']:.2f}")
        print(f"server_vs_engine={results[16]['output_tok_per_s'] / alone[8]:.2f}")
    print(f"ttft_p50_prefix_cache={cached['ttft_p50_ms']:.1f} ttft_p50_no_prefix_cache={uncached['ttft_p50_ms']:.1f} "
          f"prefix_cache_ttft_speedup={uncached['ttft_p50_ms'] / cached['ttft_p50_ms']:.2f}")
    print(json.dumps({"levels": list(results.values()), "decode_steps_1": one_step, "slots8": batched,
                      "one_at_a_time": single,
                      "transformers": hf_tok_s, "engine_alone": alone, "generate": generate_tok_s,
                      "shared_prefix": {"prefix_cache": cached, "no_prefix_cache": uncached}}))


if __name__ == "__main__":
    main()
