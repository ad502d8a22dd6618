"""Building blocks shared by every family: matmuls, normalization, rotary embeddings, MLP, dropout.

Shape legend: B batch, T length, D model width, N heads, H head width, F MLP hidden width.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

from jaxlm import quant, sharding


@functools.partial(jax.tree_util.register_dataclass, data_fields=["base", "a", "b", "key"],
                   meta_fields=["scale", "dropout"])
@dataclasses.dataclass
class LoraWeight:
    """A frozen weight with a LoRA adapter (Hu et al.): `dot` multiplies by base + scale * a b, computed as
    x base + scale * ((dropout(x) a) b), never forming a b. For a weight [*in, *out] (the axes a matmul
    contracts, then the rest), a is [*in, r] and b [r, *out]; stacked layers put `layers` first in all three.
    base may be a float array, a quant.QWeight (int8) or a quant.NF4Weight (QLoRA); key (one per layer when
    stacked) drives the adapter's input dropout, None in evaluation and inference."""

    base: object
    a: jax.Array
    b: jax.Array
    key: jax.Array | None
    scale: float
    dropout: float


def without_adapters(params):
    """The weights with every adapter switched off: the base model (a LoRA run's reference model)."""
    return jax.tree.map(lambda w: w.base if isinstance(w, LoraWeight) else w, params,
                        is_leaf=lambda w: isinstance(w, LoraWeight))


def _lora_dot(spec: str, x: jax.Array, w: LoraWeight) -> jax.Array:
    n_in = w.a.ndim - 1
    lhs, rest = spec.split(",")
    rhs, out = rest.split("->")
    if not (rhs[:n_in] == lhs[-n_in:] and out == lhs[:-n_in] + rhs[n_in:]):
        raise ValueError(f"a LoRA weight multiplies as x[..., *in] @ w[*in, *out]; {spec!r} is not of that form")
    lead, k, r = x.shape[: x.ndim - n_in], math.prod(w.a.shape[:n_in]), w.a.shape[-1]
    h = dropout(x, w.dropout, w.key).reshape(-1, k)
    xa = jnp.dot(h, w.a.astype(x.dtype).reshape(k, r), preferred_element_type=x.dtype)
    low = jnp.dot(xa * jnp.asarray(w.scale, x.dtype), w.b.astype(x.dtype).reshape(r, -1),
                  preferred_element_type=x.dtype)
    y = dot(spec, x, w.base)
    return y + low.reshape(*lead, *w.b.shape[1:]).astype(y.dtype)


def dot(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """Every dense matmul of the model goes through here: operands and result in x's dtype, accumulated in
    float32 by the matmul itself (TPU's MXU, cuBLAS and XLA:CPU all accumulate bf16 products in float32). A
    float32 result rounded afterwards gives the same numbers, but XLA materializes the float32 array, and the
    backward pass then multiplies float32 cotangents: float32 [B, T, D] and [B, T, N, H] temporaries per layer.

    A weight contraction `x[..., *in] @ w[*in, *out]` runs as one 2-D matmul over flattened dims: XLA:CPU
    then picks fast GEMM layouts in both passes, where the N-D einsum's weight gradient (contracting batch
    and length at once) goes through a slow transposing copy."""
    if isinstance(w, LoraWeight):
        return _lora_dot(spec, x, w)
    if isinstance(w, quant.NF4Weight):  # QLoRA's frozen base: dequantized here, one layer at a time
        w = quant.dequantize_nf4(w, x.dtype)
    if quant.applies(w):
        return quant.dot(spec, x, w).astype(x.dtype)
    lhs, rest = spec.split(",")
    rhs, out = rest.split("->")
    contracted = "".join(c for c in lhs if c in rhs and c not in out)
    n_in = len(contracted)
    if n_in and lhs.endswith(contracted) and rhs.startswith(contracted) and out == lhs[:-n_in] + rhs[n_in:]:
        lead, k = x.shape[: x.ndim - n_in], math.prod(x.shape[x.ndim - n_in:])
        y = jnp.dot(x.reshape(-1, k), w.astype(x.dtype).reshape(k, -1), preferred_element_type=x.dtype)
        return y.reshape(*lead, *w.shape[n_in:])
    return jnp.einsum(spec, x, w.astype(x.dtype), preferred_element_type=x.dtype)


def pin_grad(w: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """w itself; its gradient is pinned to the weight sharding of `axes` (the weight rules) where it is
    computed. A layer's weight gradient is a sum over the batch, which every device holds a part of: pinned,
    XLA reduce-scatters it into each device's shard at once; unpinned inside the layer scan's backward, it
    all-reduces the whole [D, F] matrix per layer, and the output projection's float32 [D, V] gradient stays
    whole through the backward of every layer."""
    return _pin_grad(w, tuple(axes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _pin_grad(w, axes):
    return w


def _pin_grad_fwd(w, axes):
    return w, None


def _pin_grad_bwd(axes, _, g):
    return (sharding.constrain_param(g, axes),)


_pin_grad.defvjp(_pin_grad_fwd, _pin_grad_bwd)


def matmul_weight(w: jax.Array, axes: tuple[str | None, ...], dtype) -> jax.Array:
    """A weight as `dot` consumes it: cast to the compute dtype where it lies, so XLA gathers the narrower
    copy, with its gradient (in that dtype) pinned to the weight's sharding (pin_grad). Weights taking the
    quantized path are left as they are; an adapted weight casts its base and its adapter's two factors."""
    if isinstance(w, LoraWeight):
        n_in = w.a.ndim - 1
        return dataclasses.replace(w, base=matmul_weight(w.base, axes, dtype),
                                   a=pin_grad(w.a.astype(dtype), (*axes[:n_in], None)),
                                   b=pin_grad(w.b.astype(dtype), (None, *axes[n_in:])))
    if quant.applies(w) or isinstance(w, quant.NF4Weight):
        return w
    return pin_grad(w.astype(dtype), axes)


def ragged_dot(x_MD: jax.Array, w_EDF: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
    """Grouped matmul for mixture-of-experts: rows of x, sorted by expert, meet their expert's matrix.
    Same dtype policy as `dot`; no work is spent on padding or on experts that received no tokens."""
    return jax.lax.ragged_dot(x_MD, w_EDF.astype(x_MD.dtype), group_sizes_E,
                              preferred_element_type=jnp.float32).astype(x_MD.dtype)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, plus_one: bool = False) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    scale = scale.astype(jnp.float32)
    return (y * (1.0 + scale if plus_one else scale)).astype(x.dtype)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array | None, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps) * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def norm(x: jax.Array, p: dict, kind: str, eps: float, plus_one: bool = False) -> jax.Array:
    if kind == "rmsnorm":
        return rms_norm(x, p["scale"], eps, plus_one)
    return layer_norm(x, p["scale"], p.get("bias"), eps)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap): bounds logits smoothly (Gemma 2); None leaves x unchanged."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def rope_frequencies(H: int, theta: float, llama3_scaling: tuple[float, float, float, int] | None = None):
    """Inverse frequencies of the H/2 rotary pairs. `llama3_scaling` = (factor, low_freq_factor,
    high_freq_factor, original_context): long wavelengths are slowed by `factor`, short ones kept, and the
    band between interpolated smoothly, as Llama 3.1 was trained."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
    if llama3_scaling is None:
        return inv_freq
    factor, low, high, original = llama3_scaling
    wavelen = 2 * jnp.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return jnp.where(wavelen > original / low, inv_freq / factor,
                     jnp.where(wavelen < original / high, inv_freq, mid))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rotary(x_BTNH: jax.Array, positions_BT: jax.Array, theta: float,
           llama3_scaling: tuple[float, float, float, int] | None = None) -> jax.Array:
    """Rotary position embedding in the rotate-half layout (the one Hugging Face Llama weights use).

    Its gradient is the same rotation by minus the angle (a rotation's transpose), computed in one fused pass
    from the output's gradient: differentiated op by op, the backward holds float32 copies of q and k and of
    their rotated halves, several [B, T, N, H] float32 arrays per layer at the peak of the training step."""
    return _rotate(x_BTNH, positions_BT, theta, llama3_scaling, 1.0)


def _rotate(x_BTNH, positions_BT, theta, llama3_scaling, sign: float):
    H = x_BTNH.shape[-1]
    inv_freq = rope_frequencies(H, theta, llama3_scaling)
    angle_BTh = positions_BT[..., None].astype(jnp.float32) * inv_freq
    sin, cos = sign * jnp.sin(angle_BTh)[:, :, None, :], jnp.cos(angle_BTh)[:, :, None, :]
    x = x_BTNH.astype(jnp.float32)
    x1, x2 = x[..., : H // 2], x[..., H // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTNH.dtype)


def _rotary_fwd(x_BTNH, positions_BT, theta, llama3_scaling):
    return _rotate(x_BTNH, positions_BT, theta, llama3_scaling, 1.0), positions_BT


def _rotary_bwd(theta, llama3_scaling, positions_BT, g_BTNH):
    return _rotate(g_BTNH, positions_BT, theta, llama3_scaling, -1.0), None


rotary.defvjp(_rotary_fwd, _rotary_bwd)


def gelu(x: jax.Array) -> jax.Array:
    """Exact GELU, x * Phi(x), written with erf as PyTorch computes it. jax.nn.gelu's exact form goes
    through erfc, which is more precise far into the negative tail (where GELU is ~0 anyway) and on XLA:CPU
    about twice as slow, a few percent of a small model's step."""
    return 0.5 * x * (1.0 + jax.lax.erf(x * jnp.asarray(2 ** -0.5, x.dtype)))


ACTIVATIONS = {
    "gelu": gelu,
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
    h_BTF = checkpoint_name(h_BTF, "mlp_hidden")
    out_BTD = dot("BTF,FD->BTD", h_BTF, p["down"])
    if "down_bias" in p:
        out_BTD = out_BTD + p["down_bias"].astype(out_BTD.dtype)
    return out_BTD


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))
