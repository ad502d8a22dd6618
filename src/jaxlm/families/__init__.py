"""Model families as data: each module maps a Hugging Face `config.json` to a ModelConfig and back, and lists
the tensors of its checkpoints with the layout change between their names and shapes and ours.

A `Rule` ties one Hugging Face tensor to one or more of our weights. Names may hold `{i}` (layer) and `{e}`
(expert); our weights are stacked, so the layer (and expert) index selects a slice of the stacked array.
`to_ours` turns the HF array into the slices (a tuple, one per path of `ours`); `to_hf` is its inverse.
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


def rope_from_hf(hf: dict) -> dict:
    """Rotary settings from either the transformers 5 `rope_parameters` or the older `rope_theta`/`rope_scaling`."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    scaling = params if params.get("rope_type") not in (None, "default") else legacy
    out = {"rope_theta": float(theta)}
    if kind == "llama3":
        out.update(rope_scaling="llama3", rope_scaling_factor=float(scaling["factor"]),
                   rope_low_freq_factor=float(scaling["low_freq_factor"]),
                   rope_high_freq_factor=float(scaling["high_freq_factor"]),
                   rope_original_context=int(scaling["original_max_position_embeddings"]))
    elif kind != "default":
        raise ConvertError(f"config.json rope scaling type {kind!r} is not supported (supported: default, llama3)")
    return out


def rope_to_hf(cfg: ModelConfig) -> dict:
    out = {"rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "llama3":
        out["rope_scaling"] = {"rope_type": "llama3", "factor": cfg.rope_scaling_factor,
                               "low_freq_factor": cfg.rope_low_freq_factor,
                               "high_freq_factor": cfg.rope_high_freq_factor,
                               "original_max_position_embeddings": cfg.rope_original_context}
    return out


def pattern_from_layer_types(layer_types: list[str]) -> str:
    """The shortest repeating unit of HF `layer_types` as our layer_pattern ('local,global' for Gemma 2)."""
    kinds = ["local" if t == "sliding_attention" else "global" for t in layer_types]
    for period in range(1, len(kinds) + 1):
        if len(kinds) % period == 0 and kinds == kinds[:period] * (len(kinds) // period):
            return ",".join(kinds[:period])
    raise AssertionError("unreachable: the full list is always a period")


def layer_types(cfg: ModelConfig) -> list[str]:
    return [("sliding_attention" if cfg.pattern[i % len(cfg.pattern)] == "local" else "full_attention")
            for i in range(cfg.n_layers)]


def _families():
    from jaxlm.families import gemma, gpt2, llama

    return {t: m for m in (gpt2, llama, gemma) for t in m.MODEL_TYPES}


def for_model_type(model_type: str | None):
    fams = _families()
    if model_type not in fams:
        raise ConvertError(f"config.json model_type={model_type!r} is not supported; supported: {', '.join(fams)}")
    return fams[model_type]


def for_config(cfg: ModelConfig):
    """The family and HF model_type that represent this model, chosen from its options."""
    from jaxlm.families import gemma, gpt2, llama

    for fam in (gpt2, gemma, llama):
        model_type = fam.model_type(cfg)
        if model_type:
            return fam, model_type
    raise AssertionError("unreachable: llama.model_type always answers")
