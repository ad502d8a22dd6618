"""Decode throughput with and without the KV cache, and against Hugging Face transformers' `generate`, on one
tiny random Llama-style model (built with transformers' LlamaConfig when the `hf` extra is installed, imported
with `jaxlm convert from-hf`, so both libraries run the same weights), all measured in this one run.

For batch 1 and 16 and NEW new tokens after a 16-token prompt, prints one line
    batch=B cached_tok_per_s=X uncached_tok_per_s=Y hf_tok_per_s=Z cache_speedup=X/Y vs_transformers=X/Z
`cached` is jaxlm.infer.generate.generate: prefill + the on-device decode loop over the cache, both timed (a first
call compiles and warms up). `uncached` recomputes the forward pass over the whole prefix (prompt + tokens so
far) for every new token, as a decoder without a cache must: the prefix is padded up to a multiple of 16 tokens
so that 17 compiled programs cover every length, all compiled before timing. `hf` is transformers' greedy
generate with its own cache, fp32, eager attention, prefill included. Tokens/s count new tokens of all
sequences; greedy throughout. Each line ends with the load average of the machine when it was printed.

With --compare-ref the line also holds `stacked_tok_per_s`: the same prefill and greedy loop, but each step
`decode.decode_step` (the server's step) over the stacked full-length cache, as generate decoded before
its loop took the layers and the cache apart and grew the cache in segments; `vs_stacked` is cached/stacked.

    python benchmarks/decode.py [--new-tokens 256] [--batches 1,16] [--compare-ref]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm.infer import api, generate
from jaxlm.store import convert
from jaxlm.config import DecodeConfig, ModelConfig
from jaxlm.model import decode, forward

PROMPT = 16
HF = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=128,
          intermediate_size=384, vocab_size=256)


def build(folder: Path, new_tokens: int):
    """(jaxlm params, ModelConfig, transformers model or None) of the same random weights."""
    try:
        import torch
        import transformers
    except ImportError:
        torch = None
    if torch is None:
        cfg = ModelConfig(vocab_size=HF["vocab_size"], n_layers=4, n_heads=4, n_kv_heads=2, d_model=128, d_ff=384,
                          norm="rmsnorm", qk_norm=False, activation="silu", glu=True, tie_embeddings=False)
        from jaxlm import params as P, sharding
        from jaxlm.config import MeshConfig
        from jaxlm.model import param_specs

        mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
        params, hf = P.init(param_specs(cfg), jax.random.key(0), mesh), None
    else:
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(
            transformers.LlamaConfig(**HF, max_position_embeddings=PROMPT + new_tokens),
            attn_implementation="eager").eval()
        hf.save_pretrained(folder / "hf")
        convert.from_hf(str(folder / "hf"), folder / "jx", log=lambda s: None)
        model = api.load(folder / "jx")
        params, cfg = model.params, model.config.model
    return params, dataclasses.replace(cfg, block_size=PROMPT + new_tokens), hf


def cached(params, cfg, prompts, new_tokens) -> float:
    d = DecodeConfig(max_new_tokens=new_tokens, temperature=0.0)
    generate.generate(params, cfg, prompts.tolist(), d)  # compile and warm up, as for the other two
    out = generate.generate(params, cfg, prompts.tolist(), d)
    assert all(len(t) == new_tokens for t in out.tokens)
    return len(prompts) * new_tokens / (out.prefill_s + out.decode_s)


@partial(jax.jit, static_argnames=("cfg", "new_tokens"))
def _stacked(params, prompts_BT, cfg, new_tokens: int):
    """Greedy tokens [B, N] by prefill and decode.decode_step over the stacked cache of every position."""
    B, T = prompts_BT.shape
    logits_BV, cache = decode.prefill(params, prompts_BT, jnp.full((B,), T, jnp.int32), cfg, T + new_tokens)

    def body(i, c):
        logits_BV, cache, out_BN = c
        tok_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
        logits_BV, cache = decode.decode_step(params, tok_B, cache, cfg)
        return logits_BV, cache, out_BN.at[:, i].set(tok_B)

    return jax.lax.fori_loop(0, new_tokens, body, (logits_BV, cache, jnp.zeros((B, new_tokens), jnp.int32)))[2]


def stacked(params, cfg, prompts, new_tokens) -> float:
    jax.block_until_ready(_stacked(params, prompts, cfg, new_tokens))  # compile and warm up
    t0 = time.perf_counter()
    out = jax.block_until_ready(_stacked(params, prompts, cfg, new_tokens))
    seconds = time.perf_counter() - t0
    want = generate.generate(params, cfg, prompts.tolist(), DecodeConfig(max_new_tokens=new_tokens, temperature=0.0))
    assert np.asarray(out).tolist() == want.tokens, "generate and the stacked decode_step disagree"
    return len(prompts) * new_tokens / seconds


BUCKET = 16


@partial(jax.jit, static_argnames=("cfg", "length"), donate_argnums=1)
def _recompute_step(params, buf_BS, n, cfg, length: int):
    """Forward over the first `length` positions (the prefix, padded); the greedy token after position n - 1
    goes to position n."""
    logits_BTV = forward(params, buf_BS[:, :length], cfg)
    tok_B = jnp.argmax(jax.lax.dynamic_index_in_dim(logits_BTV, n - 1, axis=1, keepdims=False), axis=-1)
    return buf_BS.at[:, n].set(tok_B.astype(jnp.int32))


def uncached(params, cfg, prompts, new_tokens) -> float:
    B, total = len(prompts), PROMPT + new_tokens
    lengths = [min(-(-n // BUCKET) * BUCKET, total) for n in range(PROMPT, total)]  # prefix n, padded

    def run():
        buf = jnp.zeros((B, total), jnp.int32).at[:, :PROMPT].set(jnp.asarray(prompts))
        for n, length in zip(range(PROMPT, total), lengths):
            buf = _recompute_step(params, buf, n, cfg, length)
        return jax.block_until_ready(buf)

    run()  # compile every prefix length
    t0 = time.perf_counter()
    out = run()
    seconds = time.perf_counter() - t0
    want = generate.generate(params, cfg, prompts.tolist(), DecodeConfig(max_new_tokens=4, temperature=0.0))
    assert np.asarray(out)[:, PROMPT:PROMPT + 4].tolist() == want.tokens, "the two decoders disagree"
    return B * new_tokens / seconds


def with_transformers(hf, prompts, new_tokens) -> float:
    import torch

    x = torch.tensor(prompts)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        hf.generate(x, **dict(kw, max_new_tokens=4, min_new_tokens=4))  # warm up
        t0 = time.perf_counter()
        hf.generate(x, **kw)
    return len(prompts) * new_tokens / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--compare-ref", action="store_true",
                    help="also time decode_step over the stacked full-length cache (the loop before segments)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        params, cfg, hf = build(Path(tmp), a.new_tokens)
        for B in map(int, a.batches.split(",")):
            prompts = np.random.default_rng(B).integers(0, cfg.vocab_size, (B, PROMPT)).astype(np.int32)
            c = cached(params, cfg, prompts, a.new_tokens)
            u = uncached(params, cfg, prompts, a.new_tokens)
            line = f"batch={B} cached_tok_per_s={c:.1f} uncached_tok_per_s={u:.1f}"
            if hf is not None:
                h = with_transformers(hf, prompts, a.new_tokens)
                line += f" hf_tok_per_s={h:.1f}"
            line += f" cache_speedup={c / u:.2f}"
            line += f" vs_transformers={c / h:.2f}" if hf is not None else " vs_transformers=n/a (no hf extra)"
            if a.compare_ref:
                s = stacked(params, cfg, prompts, a.new_tokens)
                line += f" stacked_tok_per_s={s:.1f} vs_stacked={c / s:.2f}"
            print(line + " load_avg=%.2f,%.2f,%.2f" % os.getloadavg(), flush=True)


if __name__ == "__main__":
    main()
