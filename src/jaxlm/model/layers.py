"""Building blocks shared by every family: matmuls, normalization, rotary embeddings, MLP, dropout.

Shape legend: B batch, T length, D model width, N heads, H head width, F MLP hidden width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlm import quant


def dot(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """Every dense matmul of the model goes through here: operands in x's dtype, float32 accumulation,
    result back in x's dtype (bf16 x bf16 -> f32 is the fast path on CPUs with AVX-512 BF16 and on TPU/GPU)."""
    if quant.applies(w):
        return quant.dot(spec, x, w).astype(x.dtype)
    return jnp.einsum(spec, x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array | None, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps) * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def norm(x: jax.Array, p: dict, kind: str, eps: float) -> jax.Array:
    if kind == "rmsnorm":
        return rms_norm(x, p["scale"], eps)
    return layer_norm(x, p["scale"], p.get("bias"), eps)


def rotary(x_BTNH: jax.Array, positions_BT: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding in the rotate-half layout (the one Hugging Face Llama weights use)."""
    H = x_BTNH.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
    angle_BTh = positions_BT[..., None].astype(jnp.float32) * inv_freq
    sin, cos = jnp.sin(angle_BTh)[:, :, None, :], jnp.cos(angle_BTh)[:, :, None, :]
    x = x_BTNH.astype(jnp.float32)
    x1, x2 = x[..., : H // 2], x[..., H // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTNH.dtype)


ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
}


def mlp(x_BTD: jax.Array, p: dict, activation: str, glu: bool) -> jax.Array:
    act = ACTIVATIONS[activation]
    h_BTF = dot("BTD,DF->BTF", x_BTD, p["up"])
    if "up_bias" in p:
        h_BTF = h_BTF + p["up_bias"].astype(h_BTF.dtype)
    if glu:
        h_BTF = act(dot("BTD,DF->BTF", x_BTD, p["gate"])) * h_BTF
    else:
        h_BTF = act(h_BTF)
    out_BTD = dot("BTF,FD->BTD", h_BTF, p["down"])
    if "down_bias" in p:
        out_BTD = out_BTD + p["down_bias"].astype(out_BTD.dtype)
    return out_BTD


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))
