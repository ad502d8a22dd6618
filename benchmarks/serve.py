"""`jaxlm serve` at a real model size, as a user would run it: its default settings, a Llama-shaped model of 134M
parameters (random weights, vocabulary 32,000, context 2,048, float32), requests with long-tailed prompt and
output lengths, against Hugging Face transformers' `generate` and its continuous batching on the same weights
and requests, and against this machine's roofline for the workload, all measured in one run.

The workload (fixed seed): prompt lengths drawn from a log-normal of median 128 tokens clipped to [16, 1024],
output lengths from one of median 96 clipped to [16, 512], random token ids; every request asks for exactly its
output length (the server ignores end-of-sequence tokens: decode.stop_at_eos=false, as vLLM's benchmark sets
ignore_eos). Each client streams one completion at a time (text, no log-probabilities) over a keep-alive
HTTP/1.1 connection; an asyncio load generator in this process reads the server-sent events itself. Tokens of a
chunk are counted from its text (the benchmark's tokenizer writes each token as one word).

Transport: TCP on 127.0.0.1, or with --uds a unix domain socket: the server runs with serve.uds=PATH (a temporary
folder) and the same clients connect with asyncio.open_unix_connection (Host: localhost), so the figures of the
two compare. Where no TCP socket opens on 127.0.0.1 (a TPU machine's sandbox) the benchmark says so in one line
and takes the unix socket itself. The summary's `transport=tcp|uds` says which ran. Without the `hf` part
neither torch nor transformers is imported: the random Llama is written with numpy (random_llama) and converted,
so `--parts serve,engine` needs only jaxlm's serving dependencies and `tokenizers` (a TPU machine without torch).

Measured, in order (the server first: its process takes the accelerator, which this one opens after it; one
process at a time holds a TPU chip; the model is converted in a child process on the CPU):
- `jaxlm serve` (below), then `machine`: the matmul rate (float32 2048^3, jitted) and the memory bandwidth (a
  sum over 512 MiB), the fastest of 5, and the load average;
- `jaxlm serve` with default settings (its process of its own) at concurrency 1, 16 and 64 (4, 32 and
  --requests requests): output tokens/s, time to first token and inter-token latency p50/p99 (a chunk's gap
  shared by its tokens), after a warm-up pass that compiles the shapes the workload needs;
- transformers' `generate` on the same --requests requests in batches of 16 in arrival order (sdpa attention,
  greedy, left padding, each batch generating its longest request's output; only the tokens each request asked
  for count), and its continuous batching (the manager `generate_batch` runs, each request added with its own
  max_new_tokens), each on the CPU threads torch takes by default;
- where the server's time goes at concurrency 64: the engine alone in this process (no HTTP) on the same
  requests, and on their prompts only (one new token each): prefill, decode, and the rest (HTTP, event loop);
- the paged cache against the slot cache (serve.page_size=0) with the same cache memory (16 sequences of the
  whole context): the sequences in flight and the throughput of the engine alone on the same requests;
- the workload's roofline: its prefill FLOPs at the matmul rate, plus its decode at the slower of its FLOPs at
  the matmul rate and its bytes (the weights once per decode step, and each token's keys and values read once
  per step) at the memory bandwidth. The steps are the first-come schedule's of the requests over 64 slots: with
  long-tailed outputs the last requests decode with few rows, so 128 requests need 635 steps where full batches
  would need 265; `roofline_full_batches` counts full batches (unreachable; the figure before 2026-12-06),
  `roofline_bytes_only` the decode's bytes alone (at 64 sequences on a CPU a decode step is bound by arithmetic);
- the uniform workload (`uniform`): 64 requests whose prompts are all 128 tokens and outputs all 64, the server
  (default settings, its process of its own) at concurrency 32 against transformers' generate at batch 16 on the
  same weights and requests (with the `hf` part): `uniform_vs_generate`, the row where a static batch wastes
  nothing (no padding, no early finishers), beside the long-tailed one's vs_generate_real (`--parts uniform,hf`
  runs this row alone);
- the toy model of the earlier figures (benchmarks/decode.py's 4-layer, 128-wide random Llama, 16-token prompts,
  64 new tokens, concurrency 16) against transformers' generate at batch 16: `vs_transformers_toy`.

With --tuned, the server with those settings besides the defaults runs the top concurrency too, printed as
`tuned (...)` with `roofline_frac_tuned`; the summary's other figures stay the defaults'.

Then the summary: vs_generate_real (the server at concurrency 64 over transformers' generate), vs_generate_batch_real
(over its continuous batching), roofline_frac (the server at concurrency 64 over the roofline's tokens/s),
engine_roofline_frac (the engine alone, no HTTP, over the same roofline: the figure where no server can run, as
on a machine that opens no sockets; `_full_batches`: over the full-batch figure), server_vs_engine (the server's output tokens/s at concurrency 64 over the
engine alone's on the same requests), and vs_transformers_toy. --size tiny runs every part on a tiny model in
seconds (the code path only: tests).

    python benchmarks/serve.py [--requests 128] [--parts serve,uniform,hf,engine,slots,toy] [--model-dir DIR]
                               [--tuned KEY=VALUE,...] [--uds]
    python benchmarks/serve.py --parts serve,engine --uds     # a TPU machine: no TCP, no torch
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import heapq
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import decode as decode_bench  # noqa: E402

from jaxlm.infer import api
from jaxlm.store import convert  # noqa: E402

SIZES = {  # a Llama's transformers config; prompt and output lengths (least, most, median); the concurrencies
    # (with their requests, None: --requests) of which the last is compared; the server's settings besides its
    # defaults; the slot cache's sequences in the comparison at equal memory
    "real": dict(model=dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                            intermediate_size=2048, vocab_size=32000, max_position_embeddings=2048),
                 prompt=(16, 1024, 128), output=(16, 512, 96), levels=((1, 4), (16, 32), (64, None)), settings=(),
                 slot_sequences=16, uniform=dict(prompt=128, output=64, requests=64, concurrency=32)),
    "small": dict(model=dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                             intermediate_size=1408, vocab_size=32000, max_position_embeddings=1024),
                  prompt=(16, 256, 64), output=(16, 128, 48), levels=((1, 2), (16, None)), settings=(),
                  slot_sequences=4, uniform=dict(prompt=64, output=32, requests=32, concurrency=16)),
    "tiny": dict(model=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=128, vocab_size=512, max_position_embeddings=256),
                 prompt=(4, 64, 16), output=(4, 32, 8), levels=((1, 2), (4, None)), settings=("serve.max_slots=4",),
                 slot_sequences=1, uniform=dict(prompt=16, output=8, requests=8, concurrency=4)),
}


# ---- the model and the workload --------------------------------------------------------------------------------

def word_tokenizer(folder: Path, vocab: int) -> None:
    """A tokenizer.json whose tokens are the words t0 .. t{vocab-1}: each token decodes to one word."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (folder / "tokenizer").mkdir(exist_ok=True)
    tok.save(str(folder / "tokenizer" / "tokenizer.json"))


def random_llama(folder: Path, hf_cfg: dict, seed: int = 0) -> None:
    """A transformers Llama folder (config.json, model.safetensors) written without torch: every matrix drawn
    from a normal of std 0.02 (transformers' initializer_range) and the norms' weights ones, as from_config
    initializes them; the `hf` part loads it with from_pretrained as it would its own."""
    D, F, N = hf_cfg["hidden_size"], hf_cfg["intermediate_size"], hf_cfg["num_attention_heads"]
    hd, KV = D // N, hf_cfg["num_key_value_heads"]
    entries = [("model.embed_tokens.weight", (hf_cfg["vocab_size"], D))]
    for i in range(hf_cfg["num_hidden_layers"]):
        entries += [(f"model.layers.{i}.{name}.weight", shape) for name, shape in (
            ("self_attn.q_proj", (N * hd, D)), ("self_attn.k_proj", (KV * hd, D)), ("self_attn.v_proj", (KV * hd, D)),
            ("self_attn.o_proj", (D, N * hd)), ("mlp.gate_proj", (F, D)), ("mlp.up_proj", (F, D)),
            ("mlp.down_proj", (D, F)), ("input_layernorm", (D,)), ("post_attention_layernorm", (D,)))]
    entries += [("model.norm.weight", (D,)), ("lm_head.weight", (hf_cfg["vocab_size"], D))]
    shapes, rng = dict(entries), np.random.default_rng(seed)

    def produce(name: str) -> np.ndarray:
        if len(shapes[name]) == 1:
            return np.ones(shapes[name], np.float32)
        return rng.normal(0.0, 0.02, shapes[name]).astype(np.float32)

    folder.mkdir(parents=True, exist_ok=True)
    convert.write_safetensors(folder / "model.safetensors", [(n, s, np.dtype(np.float32)) for n, s in entries],
                              produce)
    (folder / "config.json").write_text(json.dumps(dict(
        hf_cfg, architectures=["LlamaForCausalLM"], model_type="llama", head_dim=hd, hidden_act="silu",
        rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=10000.0), attention_bias=False,
        mlp_bias=False, initializer_range=0.02, bos_token_id=1, eos_token_id=2, dtype="float32"), indent=2))


def build(folder: Path, size: str, with_hf: bool = False):
    """The transformers model (random weights, seed 0; None unless with_hf) and its jaxlm conversion in folder/jx
    (both reused when there). Without with_hf neither torch nor transformers is imported: the weights are
    written by random_llama (a machine without torch: a TPU's)."""
    hf_cfg = dict(SIZES[size]["model"], tie_word_embeddings=False)
    if not (folder / "hf" / "config.json").is_file():
        if with_hf:
            import torch
            import transformers

            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**hf_cfg))
            model.save_pretrained(folder / "hf")
        else:
            random_llama(folder / "hf", hf_cfg)
    if not (folder / "jx" / "config.json").is_file():  # converted in a process of its own, on the CPU: this one
        # opens no accelerator before the server ran (one process at a time holds a TPU chip)
        subprocess.run([sys.executable, "-m", "jaxlm.cli", "convert", "from-hf", str(folder / "hf"),
                        str(folder / "jx")], check=True, stdout=subprocess.DEVNULL,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
        word_tokenizer(folder / "jx", hf_cfg["vocab_size"])
    if not with_hf:
        return None, folder / "jx"
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder / "hf", attn_implementation="sdpa").eval()
    return hf, folder / "jx"


@dataclasses.dataclass
class Request:
    prompt: list[int]
    output: int
    adapter: int = -1  # the LoRA adapter it runs with (benchmarks/multi_lora.py; -1 the base)


def workload(size: str, n: int, seed: int) -> list[Request]:
    s = SIZES[size]
    rng = np.random.default_rng(seed)
    vocab = s["model"]["vocab_size"]

    def lengths(lo, hi, median, sigma):
        return np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), lo, hi).astype(int)

    prompts, outputs = lengths(*s["prompt"], 1.0), lengths(*s["output"], 0.9)
    return [Request(rng.integers(0, vocab, p).tolist(), int(o)) for p, o in zip(prompts, outputs)]


def uniform_workload(size: str, seed: int = 7) -> list[Request]:
    """The uniform workload: every prompt and every output of one length (SIZES' `uniform`), random token ids."""
    u, vocab = SIZES[size]["uniform"], SIZES[size]["model"]["vocab_size"]
    rng = np.random.default_rng(seed)
    return [Request(rng.integers(0, vocab, u["prompt"]).tolist(), u["output"]) for _ in range(u["requests"])]


def warm_up_requests(requests: list[Request], seed: int = 99) -> list[Request]:
    """Requests of the same prompt lengths with other tokens (no prefix to share with the measured ones) and two
    new tokens each: they compile the prefill shapes the measured requests take, mostly."""
    rng = np.random.default_rng(seed)
    vocab = max(max(r.prompt) for r in requests) + 1
    return [Request(rng.integers(0, vocab, len(r.prompt)).tolist(), 2) for r in requests]


def describe(requests: list[Request]) -> str:
    p = np.asarray([len(r.prompt) for r in requests])
    o = np.asarray([r.output for r in requests])
    return (f"requests={len(requests)} prompt_tokens={p.sum()} output_tokens={o.sum()} prompt_p50={np.median(p):.0f} "
            f"prompt_p99={np.percentile(p, 99):.0f} prompt_max={p.max()} output_p50={np.median(o):.0f} "
            f"output_p99={np.percentile(o, 99):.0f} output_max={o.max()}")


# ---- the machine and the roofline ------------------------------------------------------------------------------

def machine() -> dict:
    """The float32 matmul rate (FLOP/s) and memory bandwidth (bytes/s) of this machine, fastest of 5."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((2048, 2048), jnp.float32)
    x = jnp.ones((128 << 20,), jnp.float32)  # 512 MiB
    mm, total = jax.jit(lambda a: a @ a), jax.jit(jnp.sum)
    jax.block_until_ready((mm(a), total(x)))
    t_mm = t_bw = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(mm(a))
        t_mm = min(t_mm, time.perf_counter() - t)
        t = time.perf_counter()
        jax.block_until_ready(total(x))
        t_bw = min(t_bw, time.perf_counter() - t)
    return dict(flops=2 * 2048 ** 3 / t_mm, bandwidth=x.nbytes / t_bw)


def schedule_steps(outputs: list[int], slots: int) -> int:
    """The fewest decode steps in which `slots` sequences at a time can make these outputs, taken in order as the
    clients and the engine take them (each request starts when a slot frees; its first token comes with its
    prefill, then one token a step): the makespan of that first-come schedule."""
    free = [0] * slots
    for o in outputs:
        start = heapq.heappop(free)
        heapq.heappush(free, start + max(o - 1, 0))
    return max(free)


def roofline(requests: list[Request], cfg, weight_bytes: int, kv_bytes_per_token: int, m: dict,
             concurrency: int) -> dict:
    """The workload's least time on this machine: prefill FLOPs at the matmul rate; decode at the slower of its
    FLOPs at the matmul rate and its bytes at the memory bandwidth: the weights once per decode step, each cached
    token's keys and values once per step that attends to it. The steps are those of the first-come schedule of
    the requests over `concurrency` slots (schedule_steps: as the output lengths are long-tailed, the last
    requests decode with few rows in flight); `roofline_full_batches` counts every step as full instead (total
    output / concurrency steps), which no schedule of these requests reaches."""
    L, D, F, V = cfg.n_layers, cfg.d_model, cfg.ff, cfg.vocab_size
    per_token = 2 * (L * (4 * D * D + 3 * D * F) + D * V)  # the matmuls of one token (attention projections, GLU MLP)
    attn = 4 * L * D  # FLOPs per cached key a token attends to (q.k and p.v)
    prefill = sum(len(r.prompt) * per_token + attn * len(r.prompt) * (len(r.prompt) + 1) / 2 for r in requests)
    decode_flops, kv_read, out = 0.0, 0.0, 0
    for r in requests:
        P, O = len(r.prompt), r.output
        decode_flops += O * per_token + attn * (O * P + O * (O - 1) / 2)
        kv_read += kv_bytes_per_token * (O * P + O * (O - 1) / 2)
        out += O
    steps, full_steps = schedule_steps([r.output for r in requests], concurrency), out / concurrency
    t_prefill = prefill / m["flops"]

    def tok_per_s(decode_steps: float, bytes_only: bool = False) -> float:
        decode_bytes = decode_steps * weight_bytes + kv_read
        t_memory = decode_bytes / m["bandwidth"]
        return out / (t_prefill + (t_memory if bytes_only else max(decode_flops / m["flops"], t_memory)))

    return dict(roofline_tok_per_s=tok_per_s(steps), roofline_bytes_only_tok_per_s=tok_per_s(steps, True),
                roofline_full_batches_tok_per_s=tok_per_s(full_steps), schedule_steps=steps,
                full_batch_steps=full_steps, prefill_s=t_prefill, decode_compute_s=decode_flops / m["flops"],
                decode_memory_s=(steps * weight_bytes + kv_read) / m["bandwidth"])


# ---- jaxlm serve under load --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Endpoint:
    """Where the server listens: 127.0.0.1:port over TCP, or a unix domain socket's path (serve.uds). The clients
    speak the same HTTP/1.1 over either, so the two transports' figures compare."""
    port: int = 0
    uds: str = ""

    @property
    def host(self) -> bytes:  # the Host header: the server answers localhost on a unix socket
        return b"localhost" if self.uds else b"127.0.0.1:%d" % self.port

    def open(self):
        """A coroutine giving a new connection's (reader, writer)."""
        if self.uds:
            return asyncio.open_unix_connection(self.uds)
        return asyncio.open_connection("127.0.0.1", self.port)


def tcp_works() -> bool:
    """Whether this machine opens TCP sockets on 127.0.0.1: a listener, and a connection to it."""
    try:
        with socket.socket() as listener, socket.socket() as client:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            client.settimeout(10)
            client.connect(listener.getsockname())
        return True
    except OSError:
        return False


async def _chunks(reader: asyncio.StreamReader):
    """A response's status and its body's pieces as they arrive (chunked transfer encoding, or one
    Content-Length body)."""
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


def _post(writer: asyncio.StreamWriter, ep: Endpoint, body: dict) -> None:
    """Send a completions request (JSON) on a keep-alive connection."""
    data = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (ep.host, len(data), data))


async def _health(ep: Endpoint) -> int:
    """The status of GET /health on a connection of its own (0 where no connection opens yet)."""
    try:
        reader, writer = await ep.open()
    except OSError:
        return 0
    try:
        writer.write(b"GET /health HTTP/1.1\r\nhost: %s\r\nconnection: close\r\n\r\n" % ep.host)
        status = (await reader.readline()).split()
        return int(status[1]) if len(status) > 1 else 0
    except OSError:
        return 0
    finally:
        writer.close()


async def _stream_completion(conn, ep: Endpoint, r: Request):
    """One streamed completion on a keep-alive connection: (start, [(chunk arrival, tokens)], tokens)."""
    reader, writer = conn
    t0 = time.perf_counter()
    _post(writer, ep, dict(model="bench", prompt=r.prompt, max_tokens=r.output, temperature=0, stream=True))
    chunks, pending = [], b""
    async for status, data in _chunks(reader):
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {data[:300]!r}")
        events = (pending + data).split(b"\n\n")
        pending = events.pop()
        for event in events:
            if event.startswith(b"data: {"):
                choices = json.loads(event[6:])["choices"]
                if choices and (n := len(choices[0]["text"].split())):
                    chunks.append((time.perf_counter(), n))
    return t0, chunks, sum(n for _, n in chunks)


def run_level(ep: Endpoint, requests: list[Request], concurrency: int) -> dict:
    """`concurrency` clients, each streaming the next request's completion when its last one ends."""
    todo = list(enumerate(requests))[::-1]
    results = [None] * len(requests)

    async def one_client():
        conn = await ep.open()
        try:
            while todo:
                i, r = todo.pop()
                results[i] = await _stream_completion(conn, ep, r)
        finally:
            conn[1].close()

    async def level():
        t0 = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        return time.perf_counter() - t0

    wall = asyncio.run(level())
    total = sum(n for _, _, n in results)
    assert total == sum(r.output for r in requests), f"{total} tokens of {sum(r.output for r in requests)}"
    ttft = [chunks[0][0] - start for start, chunks, _ in results if chunks]
    itl = [(b - a) / n for _, chunks, _ in results for (a, _), (b, n) in zip(chunks, chunks[1:]) for _ in range(n)]
    pct = lambda xs, p: 1e3 * float(np.percentile(xs, p)) if xs else float("nan")  # noqa: E731
    return dict(concurrency=concurrency, requests=len(requests), output_tok_per_s=total / wall,
                ttft_p50_ms=pct(ttft, 50), ttft_p99_ms=pct(ttft, 99), itl_p50_ms=pct(itl, 50),
                itl_p99_ms=pct(itl, 99), wall_s=wall)


def line(r: dict) -> str:
    return " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items())


@contextlib.contextmanager
def server(folder: Path, settings: list[str], uds: bool = False):
    """`jaxlm serve` in its own process, on a free TCP port of 127.0.0.1 or (uds) on a unix socket in a temporary
    folder; yields its Endpoint once it answers, stops it after."""
    with tempfile.TemporaryDirectory(prefix="jaxlm-serve-") as sockets:
        if uds:
            ep = Endpoint(uds=str(Path(sockets) / "serve.sock"))
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                ep = Endpoint(port=s.getsockname()[1])
        where = f"serve.uds={ep.uds}" if uds else f"serve.port={ep.port}"
        settings = ["serve.max_queue=4096", "serve.model_name=bench", where, "decode.stop_at_eos=false", *settings]
        proc = subprocess.Popen([sys.executable, "-m", "jaxlm.cli", "serve", str(folder), *settings],
                                stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 1800
            while asyncio.run(_health(ep)) != 200:
                if proc.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"jaxlm serve did not start (exit status {proc.poll()})")
                time.sleep(0.5)
            yield ep
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def tuned_settings(text: str) -> tuple[str, ...]:
    """--tuned's comma-separated KEY=VALUE settings, a value keeping its own commas: a piece whose key names no
    section (no '.' before its '=') continues the setting before it, as in
    serve.attention_kernel_options=block_tokens=256,page_steps=0."""
    out: list[str] = []
    for piece in filter(None, (p.strip() for p in text.split(","))):
        if out and "." not in piece.split("=", 1)[0]:
            out[-1] += "," + piece
        else:
            out.append(piece)
    return tuple(out)


def serve_levels(folder: Path, size: str, n: int, settings: tuple[str, ...] = (), top_only: bool = False,
                 uds: bool = False) -> dict:
    """The server (default settings, and `settings` besides them; on a unix socket with uds) at each concurrency
    of the size's levels (the last only with top_only), after a warm-up pass; the last level runs the n requests
    of seed 0, the ones the other parts run."""
    out = {}
    levels = SIZES[size]["levels"][-1:] if top_only else SIZES[size]["levels"]
    with server(folder, [*SIZES[size]["settings"], *settings], uds) as ep:
        run_level(ep, warm_up_requests(workload(size, n, seed=0)), levels[-1][0])
        for concurrency, count in levels:
            requests = workload(size, n, seed=0) if count is None else workload(size, count, seed=concurrency)
            out[concurrency] = run_level(ep, requests, concurrency)
            print((f"tuned ({','.join(settings)}) " if settings else "") + line(out[concurrency]), flush=True)
    return out


def serve_uniform(folder: Path, size: str, uds: bool = False) -> dict:
    """The server (default settings) on the uniform workload at its concurrency, after a warm-up pass of the same
    lengths (other tokens)."""
    u = SIZES[size]["uniform"]
    requests = uniform_workload(size)
    with server(folder, list(SIZES[size]["settings"]), uds) as ep:
        run_level(ep, warm_up_requests(requests), u["concurrency"])
        out = run_level(ep, requests, u["concurrency"])
    print(f"uniform prompt={u['prompt']} output={u['output']} " + line(out), flush=True)
    return out


# ---- transformers ------------------------------------------------------------------------------------------------

def hf_generate(hf, requests: list[Request], batch: int = 16) -> float:
    """Output tokens/s of transformers' generate in batches of `batch` in arrival order: left-padded, greedy, each
    batch generating its longest request's output; only the tokens each request asked for count."""
    import torch

    t0 = time.perf_counter()
    for i in range(0, len(requests), batch):
        part = requests[i:i + batch]
        T = max(len(r.prompt) for r in part)
        ids = torch.zeros((len(part), T), dtype=torch.long)
        mask = torch.zeros((len(part), T), dtype=torch.long)
        for b, r in enumerate(part):
            ids[b, T - len(r.prompt):] = torch.tensor(r.prompt)
            mask[b, T - len(r.prompt):] = 1
        new = max(r.output for r in part)
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, pad_token_id=0)
        assert out.shape[1] == T + new
    return sum(r.output for r in requests) / (time.perf_counter() - t0)


def hf_continuous(hf, requests: list[Request], cache_bytes: int) -> float:
    """Output tokens/s of transformers' continuous batching (the manager generate_batch runs), each request added
    with its own max_new_tokens, greedy, end-of-sequence ignored, its paged cache given `cache_bytes` (the
    jaxlm server's; on a CPU it would otherwise size it by the host's memory)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gc = GenerationConfig(max_new_tokens=max(r.output for r in requests), do_sample=False, eos_token_id=-1,
                          pad_token_id=0)
    c = hf.config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4
    cbc = ContinuousBatchingConfig(num_blocks=max(1, cache_bytes // (256 * per_token)))
    t0 = time.perf_counter()
    done, total = 0, 0
    with hf.continuous_batching_context_manager(generation_config=gc, continuous_batching_config=cbc, block=True,
                                                timeout=5) as manager:
        for r in requests:
            manager.add_request(r.prompt, max_new_tokens=r.output, eos_token_id=-1)
        while done < len(requests):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done += 1
                total += len(result.generated_tokens)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped early")
    assert total == sum(r.output for r in requests), f"{total} tokens of {sum(r.output for r in requests)}"
    return total / (time.perf_counter() - t0)


# ---- the engine alone --------------------------------------------------------------------------------------------

def engine_run(model, requests: list[Request], slots: int, params=None, cache_pages: int | None = None,
               **settings) -> dict:
    """The engine in this process on `requests` all submitted at once (at most `slots` decoding), over the model's
    weights or `params`, with serve.* `settings` (prefix_cache 0 unless given): wall time, output tokens/s, the
    most sequences in flight, and the process's CPU time."""
    from jaxlm.config import ServeConfig
    from jaxlm.serve.engine import Engine
    from jaxlm.serve.requests import Sequence

    gc.collect()  # an earlier run's engine (threads, closures: a cycle) and its cache pages freed before these
    m = model.config.model
    sc = ServeConfig(**{"max_slots": slots, "max_queue": len(requests) + 1, "prefix_cache": 0, **settings})
    e = Engine(model.params if params is None else params, m, sc, m.block_size, cache_pages=cache_pages)
    e.warm_up()
    e.start()
    try:
        e.run([Sequence(r.prompt, 2, 0.0, 0, 1.0, 0, 0, (), None, logprobs=False, adapter=a.adapter)
               for r, a in zip(warm_up_requests(requests), requests)])
        busiest = [0]

        def emit(ev):
            busiest[0] = max(busiest[0], e.busy_slots())

        t0, cpu0 = time.perf_counter(), time.process_time()
        e.run([Sequence(r.prompt, r.output, 0.0, 0, 1.0, 0, 0, (), emit, logprobs=False, adapter=r.adapter)
               for r in requests])
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    finally:
        e.stop()
    return dict(wall_s=wall, output_tok_per_s=sum(r.output for r in requests) / wall, in_flight=busiest[0],
                preempted=e.preempted_total, cpu_s=cpu)


# ---- the toy model of the earlier figures ------------------------------------------------------------------------

def toy(tmp: Path, settings: tuple[str, ...] = (), uds: bool = False) -> dict:
    """The earlier benchmark's model and requests: the server (defaults and `settings`; on a unix socket with uds)
    at concurrency 16 against transformers' generate at batch 16."""
    new = 64
    _, _, hf = decode_bench.build(tmp, new)
    folder = tmp / "jx"
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    (folder / "tokenizer").mkdir(exist_ok=True)
    tok.save(str(folder / "tokenizer" / "tokenizer.json"))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, decode_bench.PROMPT).tolist() for _ in range(2 * 16)]
    with server(folder, [f"decode.cache_length={decode_bench.PROMPT + new}", *settings], uds) as ep:
        _toy_level(ep, prompts[:4], 4, new)  # warm up
        served = max(_toy_level(ep, prompts, 16, new) for _ in range(3))
    batch = np.random.default_rng(16).integers(0, 256, (16, decode_bench.PROMPT)).astype(np.int32)
    hf_tok_s = max(decode_bench.with_transformers(hf, batch, new) for _ in range(3))
    return dict(server_tok_per_s=served, transformers_batch16_tok_per_s=hf_tok_s, vs_transformers_toy=served / hf_tok_s)


def _toy_level(ep: Endpoint, prompts: list[list[int]], concurrency: int, new: int) -> float:
    """Output tokens/s of `concurrency` clients, each on a keep-alive connection of its own, asking for `new`
    greedy tokens after each prompt in turn (counted from each answer's usage). The clients are this file's own
    asyncio ones, as the real size's are: httpx's cost as much CPU a request as the toy model does, so with
    them this measured the clients (docs/serve.md, "Measured")."""
    todo = list(prompts)

    async def one():
        reader, writer = await ep.open()
        try:
            while todo:
                _post(writer, ep, dict(model="bench", prompt=todo.pop(), max_tokens=new, temperature=0))
                async for status, data in _chunks(reader):
                    if status != 200:
                        raise RuntimeError(f"HTTP {status}: {data[:300]!r}")
                    assert json.loads(data)["usage"]["completion_tokens"] == new
        finally:
            writer.close()

    async def level():
        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(concurrency)))
        return time.perf_counter() - t0

    return len(prompts) * new / asyncio.run(level())


# ---- main ----------------------------------------------------------------------------------------------------------

def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=list(SIZES), default="real")
    ap.add_argument("--requests", type=int, default=128, help="requests at concurrency 64 (and for transformers)")
    ap.add_argument("--parts", default="serve,uniform,hf,engine,slots,toy")
    ap.add_argument("--model-dir", help="keep the built model here for later runs (default: a temporary folder)")
    ap.add_argument("--tuned", default="", help="comma-separated server settings (e.g. decode.quantize_kv_cache=true) "
                    "also measured at the top concurrency with the serve part, printed beside the defaults as tuned")
    ap.add_argument("--uds", action="store_true", help="the server listens on a unix domain socket (serve.uds) and "
                    "the clients connect there; chosen by itself where no TCP socket opens on 127.0.0.1")
    a = ap.parse_args(argv)
    parts = set(a.parts.split(","))
    uds = a.uds
    if not uds and parts & {"serve", "toy"} and not tcp_works():
        print("no TCP socket opens on 127.0.0.1 here: the server listens on a unix domain socket (as with --uds)",
              flush=True)
        uds = True
    report: dict = {"load_avg_start": os.getloadavg(), "transport": "uds" if uds else "tcp"}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(a.model_dir or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        hf, jx = build(folder, a.size, with_hf="hf" in parts)
        requests = workload(a.size, a.requests, seed=0)
        print("workload " + describe(requests), flush=True)
        top = SIZES[a.size]["levels"][-1][0]
        if "serve" in parts:  # first: the server's process takes the accelerator, which this one opens below (one
            # process at a time holds a TPU chip)
            report["serve"] = serve_levels(jx, a.size, a.requests, uds=uds)
            if a.tuned:
                tuned = serve_levels(jx, a.size, a.requests, tuned_settings(a.tuned), top_only=True, uds=uds)
                report["serve_tuned"] = dict(settings=a.tuned, **tuned[top])
        if "uniform" in parts:
            report["uniform"] = dict(serve=serve_uniform(jx, a.size, uds), **SIZES[a.size]["uniform"])
        model = api.load(jx)
        m = model.config.model
        mach = machine()
        report["machine"] = mach
        print(f"machine matmul_gflops={mach['flops'] / 1e9:.1f} membw_gbs={mach['bandwidth'] / 1e9:.1f} "
              f"load_avg={' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        from jaxlm.model import paged

        weight_bytes = sum(x.nbytes for x in __import__("jax").tree.leaves(model.params))
        from jaxlm.config import ServeConfig
        from jaxlm.serve import cache_pages

        server_pages = cache_pages(m, ServeConfig(), m.block_size, False)  # the server's default
        A = paged.page_size(ServeConfig().page_size)  # its pages' positions on these devices
        cache_bytes = server_pages * A * paged.bytes_per_token(m)
        roof = roofline(requests, m, weight_bytes, paged.bytes_per_token(m, lane=1), mach, top)  # unpadded
        report["roofline"] = roof
        print(line(roof), flush=True)
        if "hf" in parts and (parts & {"serve", "engine"} or "uniform" not in parts):  # `uniform,hf`: its row only
            report["transformers_generate_batch16"] = hf_generate(hf, requests)
            print(f"transformers_generate_batch16 output_tok_per_s={report['transformers_generate_batch16']:.1f}",
                  flush=True)
            report["transformers_continuous_batching"] = hf_continuous(hf, requests, cache_bytes)
            print(f"transformers_continuous_batching output_tok_per_s="
                  f"{report['transformers_continuous_batching']:.1f}", flush=True)
        if "uniform" in parts and "hf" in parts:
            report["uniform"]["transformers_generate_batch16"] = hf_generate(hf, uniform_workload(a.size))
            print(f"uniform transformers_generate_batch16 output_tok_per_s="
                  f"{report['uniform']['transformers_generate_batch16']:.1f}", flush=True)
        if "engine" in parts:
            prompts_only = [dataclasses.replace(r, output=1) for r in requests]
            # an untimed pass first: it compiles the prefill programs (chunk lengths x rows) these prompts use, as
            # the server's lower concurrencies did before its timed level (the engine's warm-up compiles only the
            # shortest chunk's; without this pass the engine alone ran 9 s slower the first time than the second)
            engine_run(model, prompts_only, top, cache_pages=server_pages)
            alone = engine_run(model, requests, top, cache_pages=server_pages)
            prefill = engine_run(model, prompts_only, top, cache_pages=server_pages)
            report["engine"] = dict(alone=alone, prefill_only=prefill)
            print("engine_alone " + line(alone), flush=True)
            print("engine_prefill_only " + line(prefill), flush=True)
        if "slots" in parts:
            per_token = paged.bytes_per_token(m)
            sequences = SIZES[a.size]["slot_sequences"]
            pages = sequences * m.block_size // A
            slot = engine_run(model, requests, sequences, page_size=0, prefix_cache=0)
            paged_run = engine_run(model, requests, top, cache_pages=pages)
            report["slots"] = dict(slot=slot, paged=paged_run, cache_gib=pages * A * per_token / 2**30)
            print(f"slot_cache slots={sequences} " + line(slot), flush=True)
            print(f"paged_cache pages={pages} " + line(paged_run), flush=True)
        if "toy" in parts:
            report["toy"] = toy(Path(tmp) / "toy", SIZES[a.size]["settings"], uds)
            print("toy " + line(report["toy"]), flush=True)
    report["load_avg_end"] = os.getloadavg()
    summary: dict = {"transport": report["transport"]} if parts & {"serve", "toy"} else {}
    if "serve" in parts:
        s64 = report["serve"][top]["output_tok_per_s"]
        summary["roofline_frac"] = s64 / roof["roofline_tok_per_s"]
        summary["roofline_frac_bytes_only"] = s64 / roof["roofline_bytes_only_tok_per_s"]
        summary["roofline_frac_full_batches"] = s64 / roof["roofline_full_batches_tok_per_s"]
        if "serve_tuned" in report:
            summary["roofline_frac_tuned"] = report["serve_tuned"]["output_tok_per_s"] / roof["roofline_tok_per_s"]
        if "hf" in parts:
            summary["vs_generate_real"] = s64 / report["transformers_generate_batch16"]
            summary["vs_generate_batch_real"] = s64 / report["transformers_continuous_batching"]
        if "engine" in parts:
            e = report["engine"]
            total = report["serve"][top]["wall_s"]
            decode = e["alone"]["wall_s"] - e["prefill_only"]["wall_s"]
            summary.update(time_prefill=e["prefill_only"]["wall_s"] / total, time_decode=decode / total,
                           time_http_and_host=(total - e["alone"]["wall_s"]) / total,
                           server_vs_engine=s64 / e["alone"]["output_tok_per_s"])
    if "engine" in parts:  # the engine alone (no HTTP): where no server can run (no sockets), this is the figure
        alone = report["engine"]["alone"]["output_tok_per_s"]
        summary["engine_roofline_frac"] = alone / roof["roofline_tok_per_s"]
        summary["engine_roofline_frac_full_batches"] = alone / roof["roofline_full_batches_tok_per_s"]
    if "slots" in parts:
        sl = report["slots"]
        summary["paged_vs_slot_sequences"] = sl["paged"]["in_flight"] / sl["slot"]["in_flight"]
        summary["paged_vs_slot_throughput"] = sl["paged"]["output_tok_per_s"] / sl["slot"]["output_tok_per_s"]
    if "toy" in parts:
        summary["vs_transformers_toy"] = report["toy"]["vs_transformers_toy"]
    if "transformers_generate_batch16" in report.get("uniform", {}):
        u = report["uniform"]
        summary["uniform_vs_generate"] = u["serve"]["output_tok_per_s"] / u["transformers_generate_batch16"]
    for k, v in summary.items():
        print(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}")
    report["summary"] = summary
    print(json.dumps(report, default=float))
    return report


if __name__ == "__main__":
    main()
