"""Quantized matmuls: int8 and fp8 training (forward and both backward matmuls) and int8 weight storage for
inference, all entered through `layers.dot` (the one place the model multiplies by a weight). `model.quantization`:
int8 (int8 x int8 -> int32 with absmax scales along the contracted axes; dx and dw multiply by the forward's int8
operands, their scales folded into the incoming gradient, which alone is quantized, stochastically or not), fp8 (e4m3 forward, e5m2 gradients, per-tensor current scaling) or
int8_weights (inference: int8 values and one float32 scale per output channel, `quantize_params`). One
custom_vjp, no Flax (why not AQT or Qwix: docs/quantization.md).

Einsum letters come from the caller's spec. Scales keep their operand's rank, with size 1 on the
contracted axes, so the scale of x has shape x.shape with the contracted axes set to 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

INT8_MAX = 127.0
# Largest finite values: float8_e4m3fn has no infinities, so its range reaches 448; e5m2 keeps them.
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
FP8_DTYPE = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How one model quantizes its matmuls; hashable, so it rides through custom_vjp as a static argument."""

    mode: str = "none"
    logits: bool = False
    stochastic_rounding: bool = True

    @property
    def fwd(self) -> str:
        return "int8" if self.mode == "int8" else "e4m3"

    @property
    def grad(self) -> str:
        return "int8" if self.mode == "int8" else "e5m2"


# ---------------------------------------------------------------------------------------------------------
# The recipe in force while a forward pass is traced. `forward` enters it (see `scoped`); `layers.dot` reads
# it at trace time. The backward rule never reads it: the recipe is a static argument of the custom_vjp.

_local = threading.local()


def current() -> Recipe:
    return getattr(_local, "recipe", Recipe())


@contextlib.contextmanager
def recipe_scope(recipe: Recipe):
    previous = current()
    _local.recipe = recipe
    try:
        yield
    finally:
        _local.recipe = previous


def recipe_of(model_cfg) -> Recipe:
    return Recipe(model_cfg.quantization, model_cfg.quant_logits, model_cfg.quant_stochastic_rounding)


def scoped(fn):
    """Wrap a model function with a `cfg` argument (forward, prefill, decode_step) so that the matmuls it
    traces follow cfg's quantization."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        cfg = signature.bind_partial(*args, **kwargs).arguments["cfg"]
        with recipe_scope(recipe_of(cfg)):
            return fn(*args, **kwargs)

    return wrapped


# ---------------------------------------------------------------------------------------------------------
# Int8 weights for inference.

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QWeight:
    """A weight stored as int8 values and float32 scales; value * scale is the dequantized weight."""

    value: jax.Array
    scale: jax.Array


# Axes each stored weight is contracted over in the forward pass, counted after the leading `layers` axis of
# the stacked block weights; the scale is per remaining axis (per output channel).
BLOCK_WEIGHT_CONTRACTED = {"q": (0,), "k": (0,), "v": (0,), "o": (0, 1), "up": (0,), "gate": (0,), "down": (0,),
                           "q_a": (0,), "q_b": (0,), "kv_a": (0,), "k_rope": (0,), "shared_up": (0,),
                           "shared_gate": (0,), "shared_down": (0,)}
EXPERTS = ("up", "gate", "down")  # a mixture of experts' own (grouped matmuls): left float


def quantize_params(params: dict, model_cfg) -> dict:
    """A copy of `params` with every block matmul weight (and, with model.quant_logits, the output projection)
    stored as a QWeight. Norms, biases and, unless it is the output projection, the embedding stay float."""

    def q(w, axes):
        value, scale = quantize(w, axes, "int8")
        return QWeight(value, scale)

    out = jax.tree.map(lambda a: a, params)
    for group in ("attn", "mlp", "dense_mlp"):
        experts = "router" in params["layers"].get(group, {})
        for name, w in params["layers"].get(group, {}).items():
            if name in BLOCK_WEIGHT_CONTRACTED and not (experts and name in EXPERTS):
                out["layers"][group][name] = q(w, tuple(a + 1 for a in BLOCK_WEIGHT_CONTRACTED[name]))
    if model_cfg.quant_logits:
        if "lm_head" in params:
            out["lm_head"] = q(params["lm_head"], (0,))
        else:
            out["embed"]["tokens"] = q(params["embed"]["tokens"], (1,))
    return out


def serving_params(params: dict, model_cfg) -> dict:
    """The weights `jaxlm generate` and `jaxlm serve` multiply with decode.quantize_weights=int8: quantize_params'
    with the output projection too (it is read whole every decode step: a quarter of an 8B Llama's bytes at
    batch 1), whatever model.quant_logits says."""
    return quantize_params(params, dataclasses.replace(model_cfg, quant_logits=True))


# ---------------------------------------------------------------------------------------------------------
# NF4 weights for QLoRA's frozen base (Dettmers et al., 2023).

# The 16 levels of 4-bit NormalFloat: quantiles of a standard normal scaled to [-1, 1], with an exact zero.
NF4_LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)
NF4_BLOCK = 64


@functools.partial(jax.tree_util.register_dataclass, data_fields=["codes", "absmax_q", "absmax_scale", "absmax_mean"],
                   meta_fields=["in_shape", "out_shape"])
@dataclasses.dataclass
class NF4Weight:
    """A weight [*lead, *in, *out] in 4-bit NormalFloat, blocked as bitsandbytes blocks a torch weight: along the
    input side (the axes a matmul contracts, flattened to I rows), blocks of 64 rows (one block of I where I is
    not a multiple of 128) in each output column (the output side flattened to O), each block's values divided
    by its absolute maximum and rounded to the nearest of the 16 NF4 levels. Two codes a byte, row i's in the
    high nibble and row i + I/2's in the low one (codes [*lead, I/2, O]): unpacking is then a concatenation of
    rows and every scale a broadcast over rows, which XLA fuses with the lookup into one pass that writes the
    weight once (codes cut into blocks of 32 bytes along the output side were unpacked through three float32
    copies of each weight on a TPU). Double quantization: the blocks' maxima are stored as int8 around their
    column's mean ([*lead, I/64, O]), with one float32 scale and mean per column ([*lead, 1, O]), about 0.13 bits
    per weight instead of 0.5."""

    codes: jax.Array
    absmax_q: jax.Array
    absmax_scale: jax.Array
    absmax_mean: jax.Array
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]


def nf4_block(in_size: int) -> int:
    return NF4_BLOCK if in_size % (2 * NF4_BLOCK) == 0 else in_size


def quantize_nf4(w: jax.Array, n_in: int, n_out: int) -> NF4Weight:
    """w [*lead, *in, *out] with n_in input and n_out output axes last -> NF4Weight."""
    lead = w.shape[:w.ndim - n_in - n_out]
    in_shape, out_shape = tuple(w.shape[len(lead):w.ndim - n_out]), tuple(w.shape[w.ndim - n_out:])
    I, O = math.prod(in_shape), math.prod(out_shape)
    if I % 2:
        raise ValueError(f"NF4 packs two input rows a byte; an input width of {I} is odd")
    bs = nf4_block(I)
    x = w.astype(jnp.float32).reshape(*lead, I // bs, bs, O)
    absmax = jnp.max(jnp.abs(x), axis=-2)
    normed = (x / jnp.where(absmax > 0, absmax, 1.0)[..., None, :]).reshape(*lead, I, O)
    levels = jnp.asarray(NF4_LEVELS, jnp.float32)
    codes = jnp.searchsorted((levels[1:] + levels[:-1]) / 2, normed).astype(jnp.uint8)  # the nearest level
    packed = (codes[..., :I // 2, :] << 4) | codes[..., I // 2:, :]
    mean = jnp.mean(absmax, axis=-2, keepdims=True)
    spread = jnp.max(jnp.abs(absmax - mean), axis=-2, keepdims=True)
    scale = jnp.where(spread > 0, spread / INT8_MAX, 1.0)
    absmax_q = jnp.clip(jnp.round((absmax - mean) / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return NF4Weight(packed, absmax_q, scale, mean, in_shape, out_shape)


def _nf4_value(code: jax.Array, dtype) -> jax.Array:
    """NF4_LEVELS[code] for 4-bit codes, as a tree of 15 selects on the code's bits: elementwise, so XLA fuses it
    with the unpacking and the scaling into one pass that writes the weight once in `dtype` (a table lookup is a
    gather, which XLA:TPU does not fuse: it materialized int32 indices and float32 values of every layer's
    weights, 1.5 GiB a layer of llama3.1-8b's MLP)."""
    level = [jnp.asarray(v, dtype) for v in NF4_LEVELS]
    for bit in range(4):
        on = ((code >> bit) & 1).astype(jnp.bool_)
        level = [jnp.where(on, hi, lo) for lo, hi in zip(level[0::2], level[1::2])]
    return level[0]


def dequantize_nf4(w: NF4Weight, dtype) -> jax.Array:
    """The weight [*lead, *in, *out] in `dtype`, as a matmul consumes it: each code's level times its block's
    absmax (computed in float32, rounded once)."""
    lead, (n, O) = w.codes.shape[:-2], w.absmax_q.shape[-2:]
    absmax = w.absmax_q.astype(jnp.float32) * w.absmax_scale + w.absmax_mean  # [*lead, n, O]: n blocks of rows
    if n == 1:  # one block of all I rows
        values = jnp.concatenate([_nf4_value(w.codes >> 4, jnp.float32), _nf4_value(w.codes & 15, jnp.float32)],
                                 axis=-2) * absmax
    else:  # the high nibbles hold blocks 0 .. n/2 - 1, the low ones the rest: scaled each as [n / 2, bs, O]
        codes = w.codes.reshape(*lead, n // 2, -1, O)
        half = lambda v, a: _nf4_value(v, jnp.float32) * a[..., None, :]  # noqa: E731
        values = jnp.concatenate([half(codes >> 4, absmax[..., :n // 2, :]), half(codes & 15, absmax[..., n // 2:, :])],
                                 axis=-3)
    return values.astype(dtype).reshape(*lead, *w.in_shape, *w.out_shape)


def dequantize_base(w, dtype) -> jax.Array:
    """A weight stored float, as a QWeight or as an NF4Weight, as a float array of `dtype`."""
    if isinstance(w, QWeight):
        return (w.value.astype(jnp.float32) * w.scale).astype(dtype)
    if isinstance(w, NF4Weight):
        return dequantize_nf4(w, dtype)
    return w.astype(dtype)


def take(table, ids):
    """Rows of an embedding table, float or QWeight (one scale per row, so only the taken rows dequantize)."""
    if isinstance(table, QWeight):
        return jnp.take(table.value, ids, axis=0).astype(jnp.float32) * jnp.take(table.scale, ids, axis=0)
    return jnp.take(table, ids, axis=0)


def nbytes(params) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))


# ---------------------------------------------------------------------------------------------------------
# Quantizers.

def _hash32(x: jax.Array, salt: int) -> jax.Array:
    """32 random bits per element (uint32), hashed from the element's bits, its position and `salt`.

    A hash instead of a PRNG key keeps `layers.dot` free of key plumbing and the run reproducible (same inputs,
    same noise), while the draws still change whenever the gradient does, i.e. every step and every layer.
    The mixer is the `lowbias32` integer finalizer (avalanches every input bit into every output bit)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    index = jax.lax.broadcasted_iota(jnp.uint32, x.shape, 0)
    for axis in range(1, x.ndim):
        index = index * jnp.uint32(x.shape[axis]) + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis)
    h = bits ^ (index * jnp.uint32(0x9E3779B9)) ^ jnp.uint32((salt * 0x85EBCA6B) & 0xFFFFFFFF)
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x846CA68B)
    return h ^ (h >> 16)


def uniform_noise(x: jax.Array, salt: int = 0) -> jax.Array:
    """Uniform [0, 1) noise per element (24 bits of `_hash32`'s)."""
    return (_hash32(x, salt) >> 8).astype(jnp.float32) * (1.0 / (1 << 24))


def uniform_noise_pair(x: jax.Array, salt: int = 0) -> tuple[jax.Array, jax.Array]:
    """Two independent uniform noises per element of x from one hash: its high and its low 16 bits, each read
    as (k + 1/2) / 2^16, whose mean is exactly 1/2. The backward pass rounds its incoming gradient twice (for dx
    and for dw); one hash for both halves the hashing, which costs more than the rounding itself. floor(y + u)
    with such u is unbiased up to 2^-17 of a step, the float32 resolution of y = x / scale in [64, 127]."""
    h = _hash32(x, salt)
    unit = lambda k: (k.astype(jnp.float32) + 0.5) * (1.0 / (1 << 16))  # noqa: E731
    return unit(h >> 16), unit(h & jnp.uint32(0xFFFF))


def quantize(x: jax.Array, axes: tuple[int, ...], fmt: str, noise: jax.Array | None = None):
    """(values, scale) with x ~= values * scale. int8: symmetric absmax along `axes` (one scale per slice
    over the other axes), rounded to nearest or, given uniform `noise`, stochastically (floor(x/s + u) is
    unbiased). e4m3/e5m2: one scale for the whole tensor, rounded to nearest by the cast."""
    x32 = x.astype(jnp.float32)
    if fmt == "int8":
        amax = jnp.max(jnp.abs(x32), axis=axes, keepdims=True)
        scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
        y = x32 / scale
        y = jnp.round(y) if noise is None else jnp.floor(y + noise)
        return jnp.clip(y, -INT8_MAX, INT8_MAX).astype(jnp.int8), scale
    amax = jnp.max(jnp.abs(x32), keepdims=True)
    scale = jnp.where(amax > 0, amax / FP8_MAX[fmt], 1.0)
    return (x32 / scale).astype(FP8_DTYPE[fmt]), scale


# ---------------------------------------------------------------------------------------------------------
# The quantized einsum and its custom VJP.

def parse(spec: str) -> tuple[str, str, str, str]:
    """'BTD,DF->BTF' -> ('BTD', 'DF', 'BTF', 'D'): the operands, the result and the contracted letters."""
    inputs, y_s = spec.replace(" ", "").split("->")
    x_s, w_s = inputs.split(",")
    contracted = "".join(c for c in x_s if c in w_s and c not in y_s)
    for c in x_s + w_s:
        if c not in contracted and c not in y_s:
            raise ValueError(f"quantized einsum {spec!r}: letter {c!r} is summed in one operand only")
    return x_s, w_s, y_s, contracted


def _axes(operand_s: str, letters: str) -> tuple[int, ...]:
    return tuple(i for i, c in enumerate(operand_s) if c in letters)


def _scale_to_output(scale, operand_s: str, y_s: str, contracted: str):
    """An operand's scale (size 1 on the contracted axes) laid out to broadcast against the einsum result."""
    kept = sorted((i for i, c in enumerate(operand_s) if c not in contracted), key=lambda i: y_s.index(operand_s[i]))
    sizes = {operand_s[i]: scale.shape[i] for i in kept}
    dropped = [i for i in range(len(operand_s)) if i not in kept]  # the contracted axes, all of size 1
    return jnp.transpose(scale, kept + dropped).reshape([sizes.get(c, 1) for c in y_s])


def quantized_einsum(spec: str, x, w, x_fmt: str, w_fmt: str, x_noise=None, w_noise=None) -> jax.Array:
    """einsum(spec, x, w) in float32, computed from int8 (int32 accumulation) or fp8 (float32 accumulation)
    operands scaled along the contracted axes, so the scales factor out of the sum onto the result."""
    x_s, w_s, y_s, contracted = parse(spec)
    qx, sx = quantize(x, _axes(x_s, contracted), x_fmt, x_noise)
    qw, sw = quantize(w, _axes(w_s, contracted), w_fmt, w_noise)
    acc = jnp.einsum(spec, qx, qw, preferred_element_type=jnp.int32 if x_fmt == "int8" else jnp.float32)
    return (acc.astype(jnp.float32) * _scale_to_output(sx, x_s, y_s, contracted)
            * _scale_to_output(sw, w_s, y_s, contracted))


# The name int8 training gives each weight's int8 values and scales: the layers' remat policy keeps them
# (transformer.remat_policy), so the backward's recomputed forward does not quantize the weights a second time.
QUANT_WEIGHT = "quant_weight"
# The name of a quantized matmul's result at the compute dtype (layers.dot): under int8 training, the remat
# policies that keep matmul outputs keep this (2 bytes an element) in place of the int32 accumulator (4).
QUANT_OUT = "quant_out"
# The name of a quantized matmul's int8 input and its scales, the residuals its backward multiplies by: remat
# minimal keeps them too, so the backward's recomputed forward does not quantize the input again.
QUANT_IN = "quant_in"


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepInt8:
    """A block weight under int8 training with its int8 values and scales (quantize along the axes its forward
    matmul contracts), made once a step before the micro-batches (step_weights): each micro-batch's forward
    multiplies by these instead of quantizing the weight again. The gradient flows to `w` alone (the custom VJP's
    dw, straight through the rounding)."""

    w: jax.Array
    value: jax.Array
    scale: jax.Array


def step_weights(params: dict, model_cfg) -> dict:
    """{group: {name: (values, scales)}} of every block weight int8 training multiplies through `qdot` (those
    quantize_params stores as int8, the experts' left float), stacked over the layers as the weights are: made
    once a step, the gradient stopped. A step of 16 micro-batches otherwise quantized each weight 16 times, and
    the layers' scan copied every micro-batch's int8 weights into a stack for the backward pass."""
    out = {}
    for group in ("attn", "mlp", "dense_mlp"):
        if group not in params["layers"]:
            continue
        weights = params["layers"][group]
        experts = "router" in weights
        out[group] = {name: quantize(jax.lax.stop_gradient(w), tuple(a + 1 for a in BLOCK_WEIGHT_CONTRACTED[name]),
                                     "int8")
                      for name, w in weights.items()
                      if name in BLOCK_WEIGHT_CONTRACTED and not (experts and name in EXPERTS)
                      and isinstance(w, jax.Array)}
    return out


def with_step_weights(params: dict, made: dict) -> dict:
    """params with the weights of step_weights' `made` as StepInt8 (the gradient still flows to each weight)."""
    layers = dict(params["layers"])
    for group, named in made.items():
        layers[group] = {**layers[group], **{name: StepInt8(layers[group][name], *vs) for name, vs in named.items()}}
    return {**params, "layers": layers}


def qdot(spec: str, x, w, recipe: Recipe) -> jax.Array:
    """Quantized einsum(spec, x, w) for training (float32 result); the backward matmuls are quantized too."""
    if recipe.mode != "int8":
        return _qdot_fp8(spec, x, w, recipe)
    _, w_s, _, contracted = parse(spec)
    axes = _axes(w_s, contracted)
    if isinstance(w, StepInt8):
        if w.scale.shape == tuple(1 if i in axes else n for i, n in enumerate(w.w.shape)):
            return _qdot_int8(spec, x, w.w, w.value, w.scale, recipe)
        w = w.w  # contracted along other axes than its step's quantization: quantized here
    # w's whole gradient is the custom VJP's dw (straight through the rounding): none flows through its scale
    qw, sw = quantize(jax.lax.stop_gradient(w), axes, "int8")
    return _qdot_int8(spec, x, w, checkpoint_name(qw, QUANT_WEIGHT), checkpoint_name(sw, QUANT_WEIGHT), recipe)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _qdot_fp8(spec: str, x, w, recipe: Recipe) -> jax.Array:
    return quantized_einsum(spec, x, w, recipe.fwd, recipe.fwd)


def _qdot_fp8_fwd(spec, x, w, recipe):
    # The float operands are the residuals: with one scale per tensor, requantizing them for the backward is
    # the forward's rounding.
    return _qdot_fp8(spec, x, w, recipe), (x, w)


def _qdot_fp8_bwd(spec, recipe, residuals, g):
    x, w = residuals
    x_s, w_s, y_s, _ = parse(spec)
    dx = quantized_einsum(f"{y_s},{w_s}->{x_s}", g, w, recipe.grad, recipe.fwd)
    dw = quantized_einsum(f"{x_s},{y_s}->{w_s}", x, g, recipe.fwd, recipe.grad)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_qdot_fp8.defvjp(_qdot_fp8_fwd, _qdot_fp8_bwd)


def _int8_forward(spec, x, qw, sw):
    x_s, w_s, y_s, contracted = parse(spec)
    qx, sx = quantize(x, _axes(x_s, contracted), "int8")
    y = (jnp.einsum(spec, qx, qw, preferred_element_type=jnp.int32).astype(jnp.float32)
         * _scale_to_output(sx, x_s, y_s, contracted) * _scale_to_output(sw, w_s, y_s, contracted))
    return y, qx, sx


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 5))
def _qdot_int8(spec: str, x, w, qw, sw, recipe: Recipe) -> jax.Array:
    """int8 einsum of x and w, given w's int8 values qw and scales sw (quantize(w) along the contracted axes)."""
    return _int8_forward(spec, x, qw, sw)[0]


def _qdot_int8_fwd(spec, x, w, qw, sw, recipe):
    # The residuals are the forward's int8 operands and their scales: the backward multiplies by these same
    # int8 values, the forward's scales folded into the incoming gradient before it is quantized, so it
    # quantizes neither x nor w again (two absmax reductions and two rounding passes a matmul fewer).
    y, qx, sx = _int8_forward(spec, x, qw, sw)
    qx, sx = checkpoint_name(qx, QUANT_IN), checkpoint_name(sx, QUANT_IN)
    # empty arrays carry the float operands' dtypes for the cotangents
    return y, (qx, sx, qw, sw, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _int8_grad_matmul(spec: str, g_folded, g_axes, other, g_first: bool, noise):
    """einsum(spec) of the incoming gradient (its forward scales folded in, float32), quantized to int8 along
    `g_axes`, with the other operand's int8 values; the gradient's scale laid out on the result."""
    a_s, b_s, r_s, contracted = parse(spec)
    qg, sg = quantize(g_folded, g_axes, "int8", noise)
    operands = (qg, other) if g_first else (other, qg)
    acc = jnp.einsum(spec, *operands, preferred_element_type=jnp.int32).astype(jnp.float32)
    return acc * _scale_to_output(sg, a_s if g_first else b_s, r_s, contracted)


def _qdot_int8_bwd(spec, recipe, residuals, g):
    x_s, w_s, y_s, contracted = parse(spec)
    qx, sx, qw, sw, x_dtype, w_dtype = residuals
    # x ~= qx * sx and w ~= qw * sw, with sx and sw constant along the forward's contracted axes, so
    # dx = einsum(g, w) = einsum(g * sw, qw) and dw = einsum(x, g) = einsum(qx, g * sx) (the scales laid out
    # like y). Each folded gradient is quantized along the axes its matmul contracts: dx's along w's letters
    # in y (one scale per row of x's layout), dw's along x's letters in y (one scale per column of w's).
    noise = uniform_noise_pair(g, salt=1) if recipe.stochastic_rounding else (None, None)
    g32 = g.astype(jnp.float32)
    dx_spec, dw_spec = f"{y_s},{w_s}->{x_s}", f"{x_s},{y_s}->{w_s}"
    dx = _int8_grad_matmul(dx_spec, g32 * _scale_to_output(sw, w_s, y_s, contracted),
                           _axes(y_s, parse(dx_spec)[3]), qw, True, noise[0])
    dw = _int8_grad_matmul(dw_spec, g32 * _scale_to_output(sx, x_s, y_s, contracted),
                           _axes(y_s, parse(dw_spec)[3]), qx, False, noise[1])
    return (dx.astype(x_dtype.dtype), dw.astype(w_dtype.dtype), np.zeros(qw.shape, jax.dtypes.float0),
            jnp.zeros_like(sw))


_qdot_int8.defvjp(_qdot_int8_fwd, _qdot_int8_bwd)


def applies(w, logits: bool = False) -> bool:
    """Whether a matmul with weight `w` takes the quantized path under the recipe being traced."""
    recipe = current()
    return isinstance(w, QWeight) or (recipe.mode != "none" and (recipe.logits or not logits))


def dot(spec: str, x, w) -> jax.Array:
    """The quantized counterpart of `layers.dot` (float32 result) for the recipe being traced."""
    recipe = current()
    if isinstance(w, QWeight) or recipe.mode == "int8_weights":
        # A float weight under int8_weights is rounded the way quantize_params stores it, so evaluating float
        # params in this mode gives the numbers the int8 copy gives.
        x_s, w_s, y_s, contracted = parse(spec)
        value, scale = (w.value, w.scale) if isinstance(w, QWeight) else quantize(w, _axes(w_s, contracted), "int8")
        if any(scale.shape[i] != 1 for i in _axes(w_s, contracted)):
            raise ValueError(f"weight scale of shape {scale.shape} is not per output channel for {spec!r}")
        y = jnp.einsum(spec, x, value.astype(x.dtype), preferred_element_type=jnp.float32)
        return y * _scale_to_output(scale, w_s, y_s, contracted)
    return qdot(spec, x, w, recipe)


def fp8_native(device) -> bool:
    """NVIDIA GPUs from compute capability 8.9 (Ada, Hopper and newer) multiply fp8 in hardware."""
    if device.platform != "gpu":
        return False
    try:
        return float(getattr(device, "compute_capability", "0")) >= 8.9
    except ValueError:
        return False


def fp8_fallback_message(device) -> str | None:
    """One line for runs asking for fp8 on hardware without it (None where fp8 is native)."""
    if fp8_native(device):
        return None
    kind = getattr(device, "device_kind", device.platform)
    return (f"model.quantization=fp8: {device.platform} device '{kind}' has no fp8 matmul units; XLA upcasts "
            "the e4m3/e5m2 operands and multiplies in float32 (same rounding of the operands, no speed-up). "
            "fp8 is fast on NVIDIA GPUs with compute capability 8.9+ (Ada, Hopper); on CPU use int8.")
