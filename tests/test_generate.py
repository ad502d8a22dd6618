"""Generation: cached prefill + decode against the full forward pass for every family, sampling rules against
numpy references, greedy generation against transformers' `generate`, and the `jaxlm generate` command."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm import params as P, sharding
from jaxlm.config import MeshConfig
from jaxlm.configs._models import MODELS
from jaxlm.model import forward, kvcache, param_specs, transformer

TINY = dict(vocab_size=64, block_size=64, n_heads=4, n_kv_heads=2, d_model=32, head_dim=8, d_ff=48,
            sliding_window=5, compute_dtype="float32", param_dtype="float32", init_std=0.2)
FAMILIES = {"gpt2": 2, "llama3_1_8b": 2, "mistral_7b": 2, "mixtral_8x7b": 2, "gemma_2b": 2, "gemma2_2b": 4,
            "qwen3_0_6b": 2}  # preset -> layers (Gemma 2 alternates local and global, twice)


def tiny(name: str, **kw):
    kw = {**TINY, "n_layers": FAMILIES[name], **kw}
    if MODELS[name].rope_scaling == "llama3":
        kw["rope_original_context"] = 8
    return dataclasses.replace(MODELS[name], **kw)


def init(cfg, seed=0):
    mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
    return P.init(param_specs(cfg), jax.random.key(seed), mesh)


def cached_logits(params, cfg, tokens_BT, prompt_lengths, quantize=False):
    """Logits at every position after the prompt, by prefill of the prompts then one decode step per token."""
    B, T = tokens_BT.shape
    P0 = max(prompt_lengths)
    prompts = np.zeros((B, P0), np.int32)
    for b, n in enumerate(prompt_lengths):
        prompts[b, :n] = tokens_BT[b, :n]
    lengths = jnp.asarray(prompt_lengths, jnp.int32)
    logits, cache = jax.jit(transformer.prefill, static_argnums=(3, 4, 5))(
        params, jnp.asarray(prompts), lengths, cfg, T, quantize)
    step = jax.jit(transformer.decode_step, static_argnums=3)
    out = [[] for _ in range(B)]
    for i in range(T - min(prompt_lengths) + 1):
        for b, n in enumerate(prompt_lengths):
            if n + i <= T:
                out[b].append(np.asarray(logits[b]))
        if i == T - min(prompt_lengths):
            break
        pos = np.minimum(np.asarray(prompt_lengths) + i, T - 1)
        logits, cache = step(params, jnp.asarray(tokens_BT[np.arange(B), pos]), cache, cfg)
    return out


# Gemma 2 (local and global layers, soft-caps, post-norms) runs by default; the rest compile for a minute each
# on a shared 2-core CPU, so they are slow tests.
@pytest.mark.parametrize("name", [n if n == "gemma2_2b" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in FAMILIES])
def test_cached_decoding_equals_full_forward(name):
    cfg = tiny(name)
    params = init(cfg)
    T = 12  # longer than the window of 5: the ring buffer wraps
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (3, T)).astype(np.int32)
    full = np.asarray(jax.jit(forward, static_argnums=2)(params, jnp.asarray(tokens), cfg))
    lengths = [3, 7, 1]  # prompts of different lengths in one batch, one of them a single token
    got = cached_logits(params, cfg, tokens, lengths)
    for b, n in enumerate(lengths):
        want = full[b, n - 1:]
        assert len(got[b]) == len(want) == T - n + 1
        np.testing.assert_allclose(np.stack(got[b]), want, atol=1e-5, rtol=0)
    assert np.abs(np.diff(full, axis=1)).max() > 0.1  # positions differ: the check above is not vacuous
