"""LoRA and QLoRA runs: which weights get adapters (`lora.targets`: q, k, v, o, up, gate, down), the adapters'
declarations, the frozen base (stored quantized for QLoRA) and the ways the two meet: attached for a forward pass
(layers.LoraWeight, which layers.dot multiplies as x W + (alpha / r) (x A) B), or merged into one set of weights.
A LoRA run trains the adapters only: the train state holds them, and the base rides beside it as the train step's
`frozen` argument. Adapters are ParamSpecs with their base weight's logical axes, A uniform in +-1/sqrt(fan_in),
B zero (docs/finetune.md, "LoRA").

Shape legend: L layers, r rank; a weight is [L, *in, *out], its adapter A [L, *in, r] and B [L, r, *out].
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxlm import params as P
from jaxlm.config import Config, ConfigError
from jaxlm.model import flops, param_specs, quant
from jaxlm.model.layers import LoraWeight, RowLoraWeight
from jaxlm.model.transformer import MATMUL_WEIGHTS

HF_NAMES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "up": "up_proj", "gate": "gate_proj",
            "down": "down_proj"}


def enabled(cfg: Config) -> bool:
    return cfg.lora.rank > 0


def n_in(name: str) -> int:
    """How many leading axes (after `layers`) of a block weight a matmul contracts: its input side."""
    return len(quant.BLOCK_WEIGHT_CONTRACTED[name])


def _dense_weights(cfg: Config) -> dict[str, dict[str, P.ParamSpec]]:
    """The block matmul weights that go through layers.dot, by block: every attention projection and, unless
    the MLP is a mixture of experts, the MLP's."""
    specs = param_specs(cfg.model)["layers"]
    return {blk: {n: specs[blk][n] for n in names if n in specs[blk] and not (blk == "mlp" and cfg.model.n_experts)}
            for blk, names in MATMUL_WEIGHTS.items()}


def targets(cfg: Config) -> list[tuple[str, str]]:
    """(block, name) of every adapted weight: those of lora.targets that this model has."""
    wanted = [t.strip() for t in cfg.lora.targets.split(",") if t.strip()]
    dense = _dense_weights(cfg)
    out = [(blk, n) for blk, names in dense.items() for n in names if n in wanted]
    if not out:
        have = ", ".join(n for names in dense.values() for n in names)
        raise ConfigError(f"lora.targets={cfg.lora.targets!r} names no weight of this model (its attention and "
                          f"dense MLP projections: {have})")
    return out


def _fan_in_uniform(fan_in: int):
    bound = 1.0 / math.sqrt(fan_in)
    return lambda key, shape, dtype: jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)


def specs(cfg: Config) -> dict:
    """The adapters' ParamSpecs: {"layers": {block: {name: {"a": A, "b": B}}}}."""
    dense, r = _dense_weights(cfg), cfg.lora.rank
    out: dict = {"layers": {}}
    for blk, name in targets(cfg):
        w, k = dense[blk][name], n_in(name) + 1  # + the leading layers axis
        out["layers"].setdefault(blk, {})[name] = {
            "a": P.ParamSpec((*w.shape[:k], r), (*w.axes[:k], None), _fan_in_uniform(math.prod(w.shape[1:k])),
                             cfg.model.param_dtype),
            "b": P.ParamSpec((w.shape[0], r, *w.shape[k:]), (w.axes[0], None, *w.axes[k:]), P.zeros,
                             cfg.model.param_dtype)}
    return out


def scale(cfg: Config) -> float:
    return cfg.lora.alpha / cfg.lora.rank


def _adapted(tree: dict, adapters: dict, fn) -> dict:
    """A copy of the weights `tree` with fn(block, name, weight, adapter) in place of each adapted weight."""
    out = {**tree, "layers": {**tree["layers"]}}
    for blk, names in adapters["layers"].items():
        out["layers"][blk] = {**tree["layers"][blk]}
        for name, ad in names.items():
            out["layers"][blk][name] = fn(blk, name, tree["layers"][blk][name], ad)
    return out


def attach(base: dict, adapters: dict, cfg: Config, key: jax.Array | None = None) -> dict:
    """The weights of the forward pass: each adapted weight of `base` with its adapter, in a layers.LoraWeight.
    With a key and lora.dropout > 0, each adapter drops its input with a key of its own per layer."""
    drop = cfg.lora.dropout if key is not None else 0.0
    keys = {}
    if drop > 0:
        targets_ = [(blk, n) for blk, names in adapters["layers"].items() for n in names]
        for (blk, n), k in zip(targets_, jax.random.split(key, len(targets_))):
            keys[blk, n] = jax.random.split(k, cfg.model.n_layers)
    return _adapted(base, adapters, lambda blk, name, w, ad: LoraWeight(w, ad["a"], ad["b"], keys.get((blk, name)),
                                                                        scale(cfg), drop))


def merge(base: dict, adapters: dict, cfg: Config) -> dict:
    """One set of weights, each adapted weight W + (alpha / r) A B in the base's dtype (a quantized base is
    dequantized first): what inference and a merged export use."""
    s = scale(cfg)

    def one(blk, name, w, ad):
        dense = quant.dequantize_base(w, cfg.model.param_dtype)
        a, b = ad["a"].astype(jnp.float32), ad["b"].astype(jnp.float32)
        k = a.ndim - 1
        delta = jnp.einsum("lir,lro->lio", a.reshape(a.shape[0], -1, a.shape[-1]), b.reshape(b.shape[0], b.shape[1], -1))
        return (dense.astype(jnp.float32) + s * delta.reshape(*a.shape[:k], *b.shape[2:])).astype(dense.dtype)

    return jax.jit(lambda b_, a_: _adapted(b_, a_, one))(base, adapters)


def serving_weights(base: dict, adapters: list[tuple[dict, float]]) -> dict:
    """The weights that serve several adapters over one base, a request's rows each with its own
    (layers.RowLoraWeight, the server's serve.adapters): every weight that one of `adapters` (trees laid out as
    `specs`, each with its scale alpha / r) adapts holds all of them, in the given order, their scales folded
    into B; an adapter that leaves the weight alone adds zeros there, and smaller ranks are padded with zeros
    to the largest. Adapter k of a row multiplies as merge(base, adapter k) does, up to float rounding."""
    adapted = sorted({(blk, name) for tree, _ in adapters for blk, names in tree["layers"].items() for name in names})
    out = {**base, "layers": {**base["layers"]}}
    for blk, name in adapted:
        mine = [(tree["layers"].get(blk, {}).get(name), s) for tree, s in adapters]
        some = next(ad for ad, _ in mine if ad is not None)
        L, k = some["a"].shape[0], some["a"].ndim - 2  # a [L, *in, r], b [L, r, *out]
        in_shape, out_shape = some["a"].shape[1:1 + k], some["b"].shape[2:]
        r = max(ad["a"].shape[-1] for ad, _ in mine if ad is not None)
        dt = some["a"].dtype
        a_parts, b_parts = [], []
        for ad, s in mine:
            a_k = jnp.zeros((L, *in_shape, r), dt) if ad is None else jnp.pad(
                ad["a"].astype(dt), [(0, 0)] * (k + 1) + [(0, r - ad["a"].shape[-1])])
            b_k = jnp.zeros((L, r, *out_shape), dt) if ad is None else jnp.pad(
                (s * ad["b"].astype(jnp.float32)).astype(dt), [(0, 0), (0, r - ad["b"].shape[1])]
                + [(0, 0)] * len(out_shape))
            a_parts.append(a_k)
            b_parts.append(b_k)
        rows = jnp.zeros((L, 0), jnp.int32)  # set by each call (layers.with_rows)
        out["layers"][blk] = {**out["layers"][blk], name: RowLoraWeight(
            base["layers"][blk][name], jnp.stack(a_parts, axis=-2), jnp.stack(b_parts, axis=1), rows)}
    return out


# ---- the frozen base ------------------------------------------------------------------------------------------

def frozen_specs(cfg: Config) -> dict:
    """The base's declarations as the run stores it: the model's own, with every dense block matmul weight
    (adapted or not) quantized for QLoRA (lora.base_quantization=int8|nf4). A quantized base keeps its other
    weights (embeddings, norms, the output layer, experts, a vision tower) in the compute dtype: frozen, they
    never meet an update, and every use casts them to it anyway (llama3.1-8b's float32 embedding and output
    layer were 3.9 GiB of a 16 GiB chip, and a bf16 copy of the output layer 1 GiB more)."""
    specs_ = param_specs(cfg.model)
    mode = cfg.lora.base_quantization
    if mode == "none":
        return specs_
    specs_ = jax.tree.map(lambda s: _in_compute_dtype(s, cfg), specs_, is_leaf=P.is_spec)
    out = {**specs_, "layers": {**specs_["layers"]}}
    for blk, names in _dense_weights(cfg).items():
        out["layers"][blk] = {**specs_["layers"][blk]}
        for name, w in names.items():
            out["layers"][blk][name] = quantized_spec(w, n_in(name), mode)
    return out


def _in_compute_dtype(s: P.ParamSpec, cfg: Config) -> P.ParamSpec:
    floating = jnp.issubdtype(jnp.dtype(s.dtype), jnp.floating)
    return dataclasses.replace(s, dtype=cfg.model.compute_dtype) if floating else s


def quantized_spec(w: P.ParamSpec, k: int, mode: str):
    """The declaration of a stacked weight [L, *in, *out] (k input axes) quantized by `mode`: a QWeight or an
    NF4Weight whose leaves are ParamSpecs (their initializers are never called: quantize_base fills them)."""
    lead, out = w.shape[:1 + k], w.shape[1 + k:]
    lead_axes, out_axes = w.axes[:1 + k], w.axes[1 + k:]
    never = P.zeros
    if mode == "int8":  # int8 values, one float32 scale per output channel
        return quant.QWeight(P.ParamSpec(w.shape, w.axes, never, "int8"),
                             P.ParamSpec((lead[0], *([1] * k), *out), (lead_axes[0], *([None] * k), *out_axes), never,
                                         "float32"))
    I, O = math.prod(w.shape[1:1 + k]), math.prod(out)
    bs = quant.nf4_block(I)
    columns = (*lead_axes[:1], None, out_axes[0])
    return quant.NF4Weight(P.ParamSpec((*lead[:1], I // 2, O), (*lead_axes[:2], out_axes[0]), never, "uint8"),
                           P.ParamSpec((*lead[:1], I // bs, O), columns, never, "int8"),
                           P.ParamSpec((*lead[:1], 1, O), columns, never, "float32"),
                           P.ParamSpec((*lead[:1], 1, O), columns, never, "float32"),
                           tuple(w.shape[1:1 + k]), tuple(out))


def quantized_weights(cfg: Config) -> list[tuple[str, str]]:
    """(block, name) of every base weight that lora.base_quantization stores quantized (none without it)."""
    if cfg.lora.base_quantization == "none":
        return []
    return [(blk, name) for blk, names in _dense_weights(cfg).items() for name in names]


def quantize_weight(w: jax.Array, name: str, mode: str):
    """One stacked block weight [L, *in, *out] (or a slice of its layers) quantized by `mode` (int8|nf4): each
    layer's codes depend on that layer's values only, so a slice quantizes to the same codes as the whole."""
    k = n_in(name)
    if mode == "int8":
        value, s = quant.quantize(w, tuple(range(1, 1 + k)), "int8")
        return quant.QWeight(value, s)
    return quant.quantize_nf4(w, k, w.ndim - 1 - k)


def quantize_base(params: dict, cfg: Config) -> dict:
    """The base's weights as frozen_specs declares them (unchanged without lora.base_quantization)."""
    mode = cfg.lora.base_quantization
    if mode == "none":
        return params
    out = jax.tree.map(lambda a: a.astype(cfg.model.compute_dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a,
                       params)
    for blk, name in quantized_weights(cfg):
        out["layers"][blk][name] = quantize_weight(params["layers"][blk][name], name, mode)
    return out


def flops_per_token(cfg: Config, full: float) -> float:
    """Training FLOPs per token of a LoRA run from the full fine-tune's `full` (flops.flops_per_token): the base's
    matmuls run forward and backward to their inputs but compute no weight gradient (2 of the 6 FLOPs per
    weight), and each adapter costs its own 6 per parameter."""
    return full - 2.0 * flops.matmul_weights(cfg.model) + 6.0 * P.count(specs(cfg))


def describe(cfg: Config) -> str:
    """One line for the logs: what is adapted, how many weights train, and the base."""
    lo = cfg.lora
    names = [n for _, n in targets(cfg)]
    trained, total = P.count(specs(cfg)), P.count(param_specs(cfg.model))
    base = {"none": cfg.model.param_dtype, "int8": "int8, per-channel scales", "nf4": "nf4, blocks of 64"}
    return (f"LoRA rank {lo.rank}, alpha {lo.alpha:g} (scale {scale(cfg):g}), dropout {lo.dropout:g} on "
            f"{','.join(names)} of {cfg.model.n_layers} layers: {trained:,} trained parameters, "
            f"{100 * trained / total:.2f}% of the base's {total:,}; base frozen ({base[lo.base_quantization]}) from "
            f"{cfg.checkpoint.init_from}")
