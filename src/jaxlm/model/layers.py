"""Building blocks shared by every family: matmuls, normalization, rotary embeddings, MLP, dropout.

Shape legend: B batch, T length, D model width, N heads, H head width, F MLP hidden width.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
import numpy as np

from jaxlm import sharding
from jaxlm.model import quant
from jaxlm.params import ParamSpec, normal, ones, zeros


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


@functools.partial(jax.tree_util.register_dataclass, data_fields=["base", "a", "b", "rows"], meta_fields=[])
@dataclasses.dataclass
class RowLoraWeight:
    """A frozen weight with n LoRA adapters, one chosen per row of the batch (S-LoRA, Punica): `dot` multiplies
    row p of x by base + A_k B_k, k = rows[p] (-1: the base alone), so that requests for different adapters share
    one matmul of the base. For a weight [*in, *out]: a [*in, n, r], b [n, r, *out] with each adapter's scale
    (alpha / r) folded in and ranks padded with zeros to the largest; rows [P] (int32). Stacked layers put
    `layers` first in all four; rows until a call sets them (with_rows) is [*layers, 0]."""

    base: object
    a: jax.Array
    b: jax.Array
    rows: jax.Array


def with_rows(params, rows_P: jax.Array):
    """The weights with every RowLoraWeight's adapter of each row set to rows_P [P] (params unchanged when they
    hold none)."""
    def one(w):
        if not isinstance(w, RowLoraWeight):
            return w
        return dataclasses.replace(w, rows=jnp.broadcast_to(rows_P.astype(jnp.int32),
                                                            (*w.rows.shape[:-1], rows_P.shape[0])))

    return jax.tree.map(one, params, is_leaf=lambda w: isinstance(w, RowLoraWeight))


def _row_lora_dot(spec: str, x: jax.Array, w: RowLoraWeight) -> jax.Array:
    """x base + each row's (x A_k) B_k: the inputs times every adapter's A at once [.., n r] (one matmul; n r is
    small against the width), the other adapters' columns zeroed, times every adapter's B stacked [n r, out]."""
    n_in = w.a.ndim - 2
    lhs, rest = spec.split(",")
    rhs, out = rest.split("->")
    if not (rhs[:n_in] == lhs[-n_in:] and out == lhs[:-n_in] + rhs[n_in:]):
        raise ValueError(f"a LoRA weight multiplies as x[..., *in] @ w[*in, *out]; {spec!r} is not of that form")
    P, (n, r), k = x.shape[0], w.a.shape[-2:], math.prod(w.a.shape[:n_in])
    xa = jnp.dot(x.reshape(-1, k), w.a.astype(x.dtype).reshape(k, n * r), preferred_element_type=x.dtype)
    mine_P1n1 = (w.rows[:, None] == jnp.arange(n, dtype=jnp.int32))[:, None, :, None]
    xa = jnp.where(mine_P1n1, xa.reshape(P, -1, n, r), 0).reshape(-1, n * r)
    low = jnp.dot(xa, w.b.astype(x.dtype).reshape(n * r, -1), preferred_element_type=x.dtype)
    y = dot(spec, x, w.base)
    return y + low.reshape(y.shape).astype(y.dtype)


def dequantized(w, dtype):
    """A 4-bit (QLoRA) weight, alone or under an adapter, as the dense array `dot` would make of it; any other
    weight unchanged. For code that multiplies by one weight many times (a chunked MLP)."""
    if isinstance(w, quant.NF4Weight):
        return quant.dequantize_nf4(w, dtype)
    if isinstance(w, LoraWeight) and isinstance(w.base, quant.NF4Weight):
        return dataclasses.replace(w, base=quant.dequantize_nf4(w.base, dtype))
    return w


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
    if isinstance(w, RowLoraWeight):
        return _row_lora_dot(spec, x, w)
    if isinstance(w, quant.NF4Weight):  # QLoRA's frozen base: dequantized here, one layer at a time
        w = quant.dequantize_nf4(w, x.dtype)
    if quant.applies(w):
        # named at the compute dtype: remat minimal keeps this under int8 training, not the int32 accumulator
        return checkpoint_name(quant.dot(spec, x, w).astype(x.dtype), quant.QUANT_OUT)
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
    if isinstance(w, RowLoraWeight):  # served, never differentiated
        return dataclasses.replace(w, base=matmul_weight(w.base, axes, dtype), a=w.a.astype(dtype),
                                   b=w.b.astype(dtype))
    if quant.applies(w) or isinstance(w, quant.NF4Weight):
        return w
    return pin_grad(w.astype(dtype), axes)


def ragged_dot(x_MD: jax.Array, w_EDF: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
    """Grouped matmul for mixture-of-experts: rows of x, sorted by expert, meet their expert's matrix.
    Same dtype policy as `dot` (the result in x's dtype from the matmul itself: a float32 result rounded after
    costs XLA:TPU a float32 [A, F] array per projection, and float32 cotangents in the backward); no work is
    spent on padding or on experts that received no tokens."""
    return jax.lax.ragged_dot(x_MD, w_EDF.astype(x_MD.dtype), group_sizes_E, preferred_element_type=x_MD.dtype)


# megablox tiles (rows, contracted width, output width): the largest each call uses; a width below its tile is
# one whole tile. The rows are padded to a multiple of the row tile. model.moe_tiles sets others.
MEGABLOX_TILES = (512, 1024, 1024)


class MegabloxTiling(NamedTuple):
    """The tiles of each megablox call (forward, or either backward product) with m rows, k contracted and n out:
    at most these, a width below its tile one whole tile. A value (hashable, equal by its tiles): the kernel's
    compile caches on it."""
    tm: int
    tk: int
    tn: int

    def __call__(self, m: int, k: int, n: int) -> tuple[int, int, int]:
        return min(self.tm, m), min(self.tk, k), min(self.tn, n)


def _megablox_tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
    """The default tiles (MEGABLOX_TILES) of one megablox call with m rows, k contracted, n out."""
    return MegabloxTiling(*MEGABLOX_TILES)(m, k, n)


def megablox_dot(x_MD: jax.Array, w_EDF: jax.Array, group_sizes_E: jax.Array, interpret: bool = False,
                 filled: bool = False, tiles: tuple[int, int, int] | None = None) -> jax.Array:
    """`ragged_dot` by JAX's megablox grouped-matmul Pallas kernel for TPU (its own backward kernels; Pallas
    interpret mode elsewhere, exact but slow, for tests). Rows past the groups' sum (padding to the row tile,
    or an expert-parallel buffer's unfilled rows) are never written by the kernel: they come out zero, as
    ragged_dot's do, and their gradient too. filled: the groups cover all M rows, so only the padding (cut off
    again) lies past them and no row needs the masks, each a pass over [M, D] both ways. tiles: the largest tiles
    (rows, contracted, out; model.moe_tiles), MEGABLOX_TILES where None."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    tiling = MegabloxTiling(*(tiles or MEGABLOX_TILES))
    M = x_MD.shape[0]
    tm = min(tiling.tm, -(-M // 128) * 128)
    rows = -(-M // tm) * tm
    if filled:
        x = jnp.pad(x_MD, ((0, rows - M), (0, 0))) if rows > M else x_MD
        y = gmm(x, w_EDF.astype(x_MD.dtype), group_sizes_E.astype(jnp.int32), x_MD.dtype, tiling,
                None, None, False, interpret)
        return y[:M]
    live = (jnp.arange(rows) < jnp.sum(group_sizes_E))[:, None]
    x = jnp.where(live, jnp.pad(x_MD, ((0, rows - M), (0, 0))), 0)  # also zeroes the kernel's unwritten gradient
    y = gmm(x, w_EDF.astype(x_MD.dtype), group_sizes_E.astype(jnp.int32), x_MD.dtype, tiling,
            None, None, False, interpret)
    return jnp.where(live, y, 0)[:M]


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


class Rope(NamedTuple):
    """Rotary settings of one layer kind (hashable: a static argument of `rotary`). `scaling`: none, llama3
    (Llama 3.1: long wavelengths slowed by `factor`, short ones kept, the band between interpolated), linear
    (every frequency divided by `factor`), yarn (YaRN: llama3's idea with a linear ramp over rotation counts
    beta_fast..beta_slow, and the rotated vectors multiplied by `attention_factor`). `sections`: with positions
    [B, T, 3] (temporal, height, width: Qwen-VL's M-RoPE), the first sections[0] frequency pairs turn by the first
    component, the next sections[1] by the second, the rest by the third (`interleaved`, Qwen3-VL: pair j turns by
    component j mod 3 while j < 3 sections[that component], else by the first); [B, T] positions turn all by one."""
    theta: float
    scaling: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    sections: tuple[int, ...] = ()  # M-RoPE (Qwen-VL): rotary pairs per position component, for [B, T, 3] positions
    interleaved: bool = False  # M-RoPE's pairs assigned t, h, w, t, h, w, ... (Qwen3-VL) rather than in sections


def rope_frequencies(H: int, rope: Rope) -> jax.Array:
    """Inverse frequencies of the H/2 rotary pairs, float32, computed as Hugging Face computes them."""
    inv_freq = 1.0 / (rope.theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
    if rope.scaling == "linear":
        return inv_freq / rope.factor
    if rope.scaling == "llama3":
        wavelen = 2 * jnp.pi / inv_freq
        original, low, high = rope.original_context, rope.low_freq_factor, rope.high_freq_factor
        smooth = (original / wavelen - low) / max(high - low, 1e-30)  # no band between when low == high
        mid = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
        return jnp.where(wavelen > original / low, inv_freq / rope.factor,
                         jnp.where(wavelen < original / high, inv_freq, mid))
    if rope.scaling == "yarn":
        def correction_dim(rotations):
            return H * math.log(rope.original_context / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

        low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, H - 1)
        high = high + 0.001 if low == high else high
        ramp = jnp.clip((jnp.arange(H // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        return inv_freq / rope.factor * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rotary(x_BTNH: jax.Array, positions_BT: jax.Array, rope: Rope) -> jax.Array:
    """Rotary position embedding in the rotate-half layout (the one Hugging Face Llama weights use), times
    rope.attention_factor (1 but for YaRN).

    Its gradient is the same rotation by minus the angle (a rotation's transpose), computed in one fused pass
    from the output's gradient: differentiated op by op, the backward holds float32 copies of q and k and of
    their rotated halves, several [B, T, N, H] float32 arrays per layer at the peak of the training step."""
    return _rotate(x_BTNH, positions_BT, rope, 1.0)


def mrope_components(half: int, rope: Rope) -> np.ndarray:
    """The position component [half] (0 temporal, 1 height, 2 width) that turns each rotary pair under M-RoPE."""
    if not rope.interleaved:
        return np.repeat(np.arange(len(rope.sections)), rope.sections)
    j, component = np.arange(half), np.zeros(half, np.int64)
    for c in (1, 2):
        component[(j % 3 == c) & (j < 3 * rope.sections[c])] = c
    return component


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rotary_heads_major(x_BNTH: jax.Array, positions_BT: jax.Array, rope: Rope) -> jax.Array:
    """`rotary` of heads-major x [B, N, T, H] (the splash kernel's layout): the same values, turned in place."""
    return _rotate(x_BNTH, positions_BT, rope, 1.0, heads_major=True)


def _rotary_heads_major_fwd(x_BNTH, positions_BT, rope):
    return _rotate(x_BNTH, positions_BT, rope, 1.0, heads_major=True), positions_BT


def _rotary_heads_major_bwd(rope, positions_BT, g_BNTH):
    return _rotate(g_BNTH, positions_BT, rope, -1.0, heads_major=True), None


rotary_heads_major.defvjp(_rotary_heads_major_fwd, _rotary_heads_major_bwd)


def _rotate(x_BTNH, positions_BT, rope: Rope, sign: float, heads_major: bool = False):
    H = x_BTNH.shape[-1]
    inv_freq = rope_frequencies(H, rope)
    angle_BTh = positions_BT[..., None].astype(jnp.float32) * inv_freq
    if positions_BT.ndim == 3:  # M-RoPE: each frequency pair takes its component's angle
        component_h = mrope_components(H // 2, rope)
        angle_BTh = jnp.take_along_axis(angle_BTh, jnp.asarray(component_h)[None, None, None, :], axis=2)[:, :, 0]
    heads = 1 if heads_major else 2  # where the heads axis goes: x is [B, N, T, H] or [B, T, N, H]
    sin, cos = sign * jnp.expand_dims(jnp.sin(angle_BTh), heads), jnp.expand_dims(jnp.cos(angle_BTh), heads)
    if rope.attention_factor != 1.0:
        sin, cos = sin * rope.attention_factor, cos * rope.attention_factor
    # Each half sliced before its cast: a float32 copy of the whole x (what XLA makes of a cast before the slices,
    # fused into the projection that feeds it) would be a [B, T, N, H] float32 array per call.
    x1, x2 = x_BTNH[..., : H // 2].astype(jnp.float32), x_BTNH[..., H // 2:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTNH.dtype)


def _rotary_fwd(x_BTNH, positions_BT, rope):
    return _rotate(x_BTNH, positions_BT, rope, 1.0), positions_BT


def _rotary_bwd(rope, positions_BT, g_BTNH):
    return _rotate(g_BTNH, positions_BT, rope, -1.0), None


rotary.defvjp(_rotary_fwd, _rotary_bwd)


def rms_scale(x: jax.Array, eps: float) -> jax.Array:
    """x divided by its root mean square over the last axis, in float32 (an RMSNorm without weights)."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)).astype(x.dtype)


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


class Activation(NamedTuple):
    """How an MLP's hidden layer is formed from its up (and gate) projections: `name` from ACTIVATIONS, gated
    (GLU: act(gate) * up) or not; with `limit`, gpt-oss's clamped SwiGLU instead (gate clipped to <= limit,
    up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate))."""
    name: str
    glu: bool
    limit: float | None = None
    alpha: float = 1.702

    def __call__(self, up, gate=None):
        if self.limit is not None:
            gate = jnp.minimum(gate, self.limit)
            up = jnp.clip(up, -self.limit, self.limit)
            return (up + 1) * gate * jax.nn.sigmoid(self.alpha * gate)
        act = ACTIVATIONS[self.name]
        return act(gate) * up if self.glu else act(up)


def activation_of(cfg) -> Activation:
    return Activation(cfg.activation, cfg.glu, cfg.swiglu_limit, cfg.swiglu_alpha)


def mlp(x_BTD: jax.Array, p: dict, act: Activation, prefix: str = "") -> jax.Array:
    """The dense MLP of the weights p[prefix + up/gate/down] (and biases up_bias/down_bias when present):
    prefix "shared_" is a mixture of experts' shared expert."""
    h_BTF = dot("BTD,DF->BTF", x_BTD, p[prefix + "up"])
    if prefix + "up_bias" in p:
        h_BTF = h_BTF + p[prefix + "up_bias"].astype(h_BTF.dtype)
    h_BTF = act(h_BTF, dot("BTD,DF->BTF", x_BTD, p[prefix + "gate"]) if act.glu else None)
    h_BTF = checkpoint_name(h_BTF, "mlp_hidden")
    out_BTD = dot("BTF,FD->BTD", h_BTF, p[prefix + "down"])
    if prefix + "down_bias" in p:
        out_BTD = out_BTD + p[prefix + "down_bias"].astype(out_BTD.dtype)
    return out_BTD


def norm_specs(cfg, shape, axes) -> dict:
    """A norm's scale (and LayerNorm bias) of the given shape; scales start at 1 (at 0 when it multiplies by
    1 + scale)."""
    p = {"scale": ParamSpec(shape, axes, zeros if cfg.norm_plus_one else ones, cfg.param_dtype)}
    if cfg.norm == "layernorm" and cfg.bias:
        p["bias"] = ParamSpec(shape, axes, zeros, cfg.param_dtype)
    return p


def mlp_specs(cfg, L: int, F: int, prefix: str = "", bias: bool | None = None) -> dict:
    """The dense MLP of width F of L stacked layers: up, gate (GLU) [L, D, F], down [L, F, D], and with `bias`
    (default model.bias) up_bias and down_bias; names behind `prefix`."""
    D, dt = cfg.d_model, cfg.param_dtype
    w, w_out = normal(cfg.init_std), normal(cfg.init_std / (2 * cfg.n_layers) ** 0.5)
    p = {"up": ParamSpec((L, D, F), ("layers", "embed", "mlp"), w, dt),
         "down": ParamSpec((L, F, D), ("layers", "mlp", "embed"), w_out, dt)}
    if cfg.glu:
        p["gate"] = ParamSpec((L, D, F), ("layers", "embed", "mlp"), w, dt)
    if cfg.bias if bias is None else bias:
        p["up_bias"] = ParamSpec((L, F), ("layers", "mlp"), zeros, dt)
        p["down_bias"] = ParamSpec((L, D), ("layers", "embed"), zeros, dt)
    return {prefix + name: spec for name, spec in p.items()}


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))
