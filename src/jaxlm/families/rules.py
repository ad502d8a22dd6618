"""What every family module shares: a `Rule` ties one Hugging Face tensor to one or more of our weights, the
layout helpers that build rules, and the config.json readers (activations, rotary settings, refusals).

Names may hold `{i}` (layer) and `{e}` (expert); our weights are stacked, so the layer (and expert) index selects
a slice of the stacked array. `to_ours` turns the HF array into the slices (a tuple, one per path of `ours`);
`to_hf` is its inverse. `swapped`: checkpoints may also hold the tensor with these two axes swapped (Qwen3-VL-MoE's
released experts, against transformers 5's save_pretrained); the import reads either, told apart by shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from jaxlm.config import ConfigError, ModelConfig


class ConvertError(ConfigError):
    """A checkpoint or model that cannot be converted; the message names the tensor or setting."""


@dataclass(frozen=True)
class Rule:
    hf: str
    ours: tuple[str, ...]
    to_ours: Callable[[np.ndarray], tuple[np.ndarray, ...]] = lambda a: (a,)
    to_hf: Callable[..., np.ndarray] = lambda a: a
    swapped: tuple[int, int] | None = None


def linear(shape: Callable[[int], tuple[int, ...]] | None = None) -> dict:
    """A torch Linear weight [out, in] <-> ours [in, *out_shape]; `shape(in)` gives our full shape."""
    def to_ours(a):
        a = a.T
        return (a.reshape(shape(a.shape[0])) if shape else a,)

    def to_hf(a):
        return a.reshape(a.shape[0], -1).T

    return {"to_ours": to_ours, "to_hf": to_hf}


def linear_in(shape: tuple[int, ...]) -> dict:
    """A torch Linear weight [out, in] whose input side we split into several axes (attention output)."""
    return {"to_ours": lambda a: (a.T.reshape(shape),), "to_hf": lambda a: a.reshape(-1, a.shape[-1]).T}


def reshaped(shape: tuple[int, ...]) -> dict:
    return {"to_ours": lambda a: (a.reshape(shape),), "to_hf": lambda a: a.reshape(-1)}


ACTIVATIONS_FROM_HF = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
                       "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "relu": "relu"}
ACTIVATIONS_TO_HF = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}


def activation(name: str | None, key: str) -> str:
    if name not in ACTIVATIONS_FROM_HF:
        raise ConvertError(f"config.json {key}={name!r} is not supported; known: {', '.join(ACTIVATIONS_FROM_HF)}")
    return ACTIVATIONS_FROM_HF[name]


ROPE_TYPES = ("default", "llama3", "linear", "yarn")


def rope_parameters(hf: dict) -> dict:
    """One rotary setting as a transformers 5 `rope_parameters` dict, from it or from the older
    `rope_theta` / `rope_scaling` keys."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = dict(hf.get("rope_scaling") or {})
    kind = params.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    out = {**legacy, **params} if params.get("rope_type") in (None, "default") and kind != "default" else params
    out.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    out["rope_type"] = kind
    return out


def rope_from_hf(hf: dict, params: dict | None = None) -> dict:
    """Our rotary settings from config.json (or from one layer type's `params`); a rope type we lack stops
    the import, naming it."""
    params = rope_parameters(hf) if params is None else params
    kind = params.get("rope_type") or params.get("type") or "default"
    out = {"rope_theta": float(params.get("rope_theta", 10000.0))}
    if kind not in ROPE_TYPES:
        raise ConvertError(f"config.json rope scaling type {kind!r} is not supported (supported: "
                           f"{', '.join(ROPE_TYPES)})")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConvertError(f"config.json partial_rotary_factor={params['partial_rotary_factor']} is not supported")
    if kind == "llama3":
        out.update(rope_scaling="llama3", rope_scaling_factor=float(params["factor"]),
                   rope_low_freq_factor=float(params["low_freq_factor"]),
                   rope_high_freq_factor=float(params["high_freq_factor"]),
                   rope_original_context=int(params["original_max_position_embeddings"]))
    elif kind == "linear":
        out.update(rope_scaling="linear", rope_scaling_factor=float(params["factor"]))
    elif kind == "yarn":
        original = int(params.get("original_max_position_embeddings") or hf["max_position_embeddings"])
        factor = params.get("factor") or hf["max_position_embeddings"] / original
        out.update(rope_scaling="yarn", rope_scaling_factor=float(factor), rope_original_context=original,
                   rope_yarn_beta_fast=float(params.get("beta_fast") or 32.0),
                   rope_yarn_beta_slow=float(params.get("beta_slow") or 1.0),
                   rope_yarn_truncate=bool(params.get("truncate", True)),
                   rope_yarn_mscale=float(params.get("mscale") or 0.0),
                   rope_yarn_mscale_all_dim=float(params.get("mscale_all_dim") or 0.0))
        if params.get("attention_factor") is not None:
            out["rope_attention_factor"] = float(params["attention_factor"])
    return out


def rope_to_hf(cfg: ModelConfig) -> dict:
    """`rope_parameters` (transformers 5) of the global layers."""
    out = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "llama3":
        out.update(rope_type="llama3", factor=cfg.rope_scaling_factor, low_freq_factor=cfg.rope_low_freq_factor,
                   high_freq_factor=cfg.rope_high_freq_factor,
                   original_max_position_embeddings=cfg.rope_original_context)
    elif cfg.rope_scaling == "linear":
        out.update(rope_type="linear", factor=cfg.rope_scaling_factor)
    elif cfg.rope_scaling == "yarn":
        out.update(rope_type="yarn", factor=cfg.rope_scaling_factor,
                   original_max_position_embeddings=cfg.rope_original_context, beta_fast=cfg.rope_yarn_beta_fast,
                   beta_slow=cfg.rope_yarn_beta_slow, truncate=cfg.rope_yarn_truncate)
        for key, value in (("mscale", cfg.rope_yarn_mscale), ("mscale_all_dim", cfg.rope_yarn_mscale_all_dim),
                           ("attention_factor", cfg.rope_attention_factor)):
            if value:
                out[key] = value
    return {"rope_parameters": out}


def refuse(hf: dict, key: str, allowed, what: str = "") -> None:
    """Stop the import with one line when config.json sets `key` to anything but `allowed` (a value or a
    predicate)."""
    value = hf.get(key)
    ok = allowed(value) if callable(allowed) else value == allowed or (allowed is None and not value)
    if not ok:
        raise ConvertError(f"config.json {key}={value!r} is not supported" + (f" ({what})" if what else ""))


def refuse_quantized(hf: dict) -> None:
    q = hf.get("quantization_config")
    if q:
        method = q.get("quant_method", "?") if isinstance(q, dict) else q
        raise ConvertError(f"config.json quantization_config.quant_method={method!r} is not supported: convert "
                           "bf16/f16/f32 weights (dequantize the checkpoint with transformers and save_pretrained it)")


def pattern_from_layer_types(layer_types: list[str], kinds: dict | None = None) -> str:
    """The shortest pattern of HF `layer_types` as our layer_pattern ('local,global' for Gemma 2): the kinds
    repeat with that period, the last repeat possibly cut short (Gemma 3's 26 layers of 5 local + 1 global).
    `kinds` maps HF layer types to ours (default: sliding_attention -> local, others global)."""
    kinds = kinds or {"sliding_attention": "local"}
    ours = [kinds.get(t, "global") for t in layer_types]
    for period in range(1, len(ours) + 1):
        if all(ours[i] == ours[i % period] for i in range(len(ours))):
            return ",".join(ours[:period])
    raise AssertionError("unreachable: the full list is always a period")


def layer_types(cfg: ModelConfig) -> list[str]:
    return [("sliding_attention" if cfg.pattern[i % len(cfg.pattern)] == "local" else "full_attention")
            for i in range(cfg.n_layers)]
