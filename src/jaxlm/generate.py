"""Sampling from a trained model. This version re-runs the forward pass over a sliding window for each new
token (no KV cache); it is jitted end to end with the loop on device."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jaxlm.config import ModelConfig
from jaxlm.model import forward


def sample_logits(logits_V: jax.Array, key: jax.Array, temperature: float, top_k: int) -> jax.Array:
    """One token id from float32 logits: greedy at temperature 0, else softmax sampling over the top k."""
    if temperature == 0.0:
        return jnp.argmax(logits_V, axis=-1).astype(jnp.int32)
    logits_V = logits_V / temperature
    if top_k > 0 and top_k < logits_V.shape[-1]:
        kth = jax.lax.top_k(logits_V, top_k)[0][..., -1:]
        logits_V = jnp.where(logits_V < kth, -jnp.inf, logits_V)
    return jax.random.categorical(key, logits_V, axis=-1).astype(jnp.int32)


@partial(jax.jit, static_argnames=("cfg", "prompt_len", "new_tokens", "temperature", "top_k"))
def _sample(params, prompt, key, cfg: ModelConfig, prompt_len: int, new_tokens: int, temperature: float,
            top_k: int):
    T = cfg.block_size
    buf = jnp.zeros(max(prompt_len + new_tokens, T), jnp.int32).at[:prompt_len].set(prompt)

    def body(i, carry):
        buf, key = carry
        n = prompt_len + i
        start = jnp.maximum(n - T, 0)
        window_T = jax.lax.dynamic_slice(buf, (start,), (T,))
        logits_TV = forward(params, window_T[None], cfg)[0]
        last_V = jax.lax.dynamic_index_in_dim(logits_TV, n - 1 - start, keepdims=False)
        key, sub = jax.random.split(key)
        return buf.at[n].set(sample_logits(last_V, sub, temperature, top_k)), key

    buf, _ = jax.lax.fori_loop(0, new_tokens, body, (buf, key))
    return buf[prompt_len: prompt_len + new_tokens]


def sample(params, cfg: ModelConfig, prompt_ids: list[int], new_tokens: int, key: jax.Array,
           temperature: float = 0.8, top_k: int = 0) -> list[int]:
    if not prompt_ids:
        raise ValueError("the prompt must hold at least one token")
    if new_tokens <= 0:
        return []
    out = _sample(params, jnp.asarray(prompt_ids, jnp.int32), key, cfg, len(prompt_ids), new_tokens,
                  float(temperature), int(top_k))
    return [int(t) for t in jax.device_get(out)]
