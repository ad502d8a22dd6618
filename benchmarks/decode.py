"""Decode throughput with and without the KV cache, and against Hugging Face transformers' `generate`, on one
tiny random Llama-style model (built with transformers' LlamaConfig when the `hf` extra is installed, imported
with `jaxlm convert from-hf`, so both libraries run the same weights), all measured in this one run.

For batch 1 and 16 and NEW new tokens after a 16-token prompt, prints one line
    batch=B cached_tok_per_s=X uncached_tok_per_s=Y hf_tok_per_s=Z cache_speedup=X/Y vs_transformers=X/Z
`cached` is jaxlm.generate.generate (prefill + on-device decode loop over the cache; compile time excluded);
`uncached` is generate.sample, which re-runs the forward pass over the whole context window (prompt + NEW
tokens) for every token; `hf` is transformers' greedy generate with its own cache, fp32, eager attention.
Tokens/s count new tokens of all sequences; greedy decoding throughout.

    python benchmarks/decode.py [--new-tokens 256]
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm import api, convert, generate
from jaxlm.config import DecodeConfig, ModelConfig

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
    out = generate.generate(params, cfg, prompts.tolist(), d)
    assert all(len(t) == new_tokens for t in out.tokens)
    return out.decode_tokens_per_s


def uncached(params, cfg, prompts, new_tokens) -> float:
    run = jax.jit(jax.vmap(lambda p: generate._sample(params, p, jax.random.key(0), cfg, PROMPT, new_tokens, 0.0, 0)))
    x = jnp.asarray(prompts)
    jax.block_until_ready(run(x))  # compile
    t0 = time.perf_counter()
    jax.block_until_ready(run(x))
    return prompts.size // PROMPT * new_tokens / (time.perf_counter() - t0)


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
            print(line, flush=True)


if __name__ == "__main__":
    main()
