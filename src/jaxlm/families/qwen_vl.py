"""Qwen2.5-VL (model_type qwen2_5_vl: Qwen2_5_VLForConditionalGeneration): the Qwen 2 language model (llama.py:
q/k/v biases, SwiGLU) rotated by M-RoPE on prompts with images (rope_parameters' mrope_section), and its vision
tower (model.vision, kind qwen2_5: model/vision_qwen.py; docs/vision.md). The hub's checkpoints name tensors
model.layers.* / visual.* / lm_head.weight, transformers 5's model.language_model.* / model.visual.*; the rules
use the hub's spelling (as written on export) and normalize_name reads both."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxlm.config import ModelConfig
from jaxlm.config.model_schema import VisionConfig
from jaxlm.families import llama
from jaxlm.families.rules import ConvertError, Rule, linear, linear_in, refuse

MODEL_TYPES = ("qwen2_5_vl",)
ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"
PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def text_config(hf: dict, model_type: str = "qwen2") -> dict:
    """The language model's config.json keys as a `model_type` (qwen2, qwen3) model's (transformers 5 nests them
    under text_config, older checkpoints keep them at the top), with M-RoPE's rotary settings as plain ones."""
    text = dict(hf.get("text_config") or hf)
    text["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    params = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    params.pop("mrope_section", None)
    params.pop("mrope_interleaved", None)
    if params.get("rope_type", params.get("type")) in ("mrope", None):
        params["rope_type"] = "default"
    params.pop("type", None)
    params.setdefault("rope_theta", text.get("rope_theta", 1000000.0))
    text.pop("rope_scaling", None)
    return {**text, "model_type": model_type, "rope_parameters": params}


def _mrope_section(hf: dict) -> list:
    text = hf.get("text_config") or hf
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if params.get("mrope_interleaved"):
        raise ConvertError("config.json rope_parameters.mrope_interleaved=true is not supported on a qwen2_5_vl model")
    return list(params.get("mrope_section") or [16, 24, 24])


def config_from_hf(hf: dict) -> ModelConfig:
    cfg = llama.config_from_hf(text_config(hf))
    v = hf.get("vision_config") or {}
    refuse(v, "in_channels", lambda n: n in (None, 3), "images are RGB")
    refuse(v, "hidden_act", lambda a: a in (None, "silu"), "the tower's MLP is SwiGLU")
    theta = (v.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    refuse({"rope_theta": theta}, "rope_theta", 10000.0, "the tower rotates with base 10000")
    if v.get("out_hidden_size", cfg.d_model) != cfg.d_model:
        raise ConvertError(f"config.json vision_config.out_hidden_size={v['out_hidden_size']} differs from the "
                           f"language model's hidden_size={cfg.d_model}")
    mrope = _mrope_section(hf)
    if sum(mrope) != cfg.hd // 2:
        raise ConvertError(f"config.json mrope_section={mrope} must sum to head_dim / 2 = {cfg.hd // 2}")
    vision = VisionConfig(
        kind="qwen2_5", patch_size=v.get("patch_size", 14), d_model=v.get("hidden_size", 1280),
        n_layers=v.get("depth", 32), n_heads=v.get("num_heads", 16), d_ff=v.get("intermediate_size", 3420),
        norm_eps=1e-6, activation="silu", image_token_id=hf.get("image_token_id", 151655),
        boi_token_id=hf.get("vision_start_token_id", 151652), eoi_token_id=hf.get("vision_end_token_id", 151653),
        spatial_merge=v.get("spatial_merge_size", 2), temporal_patch=v.get("temporal_patch_size", 2),
        window_size=v.get("window_size", 112),
        full_attention_layers=",".join(map(str, v.get("fullatt_block_indexes", (7, 15, 23, 31)))),
        mrope_section=",".join(map(str, mrope)))
    return dataclasses.replace(cfg, vision=vision)


def model_type(cfg: ModelConfig) -> str | None:
    return "qwen2_5_vl" if cfg.vision is not None and cfg.vision.kind == "qwen2_5" else None


def config_to_hf(cfg: ModelConfig, t: str) -> dict:
    v = cfg.vision
    return hf_config(cfg, t, ARCHITECTURE, "qwen2", {}, {
        "model_type": "qwen2_5_vl_vision", "hidden_act": "silu", "window_size": v.window_size,
        "fullatt_block_indexes": list(v.full_layers)})


def hf_config(cfg: ModelConfig, t: str, architecture: str, text_family: str, rope: dict, vision: dict) -> dict:
    """config.json of a Qwen-VL model (model_type t): its text model's (`text_family`'s, with the M-RoPE sections
    and `rope`), the tower's keys that Qwen2.5-VL and Qwen3-VL share and `vision`'s, and the image tokens."""
    v = cfg.vision
    text = llama.config_to_hf(dataclasses.replace(cfg, vision=None), text_family)
    del text["architectures"]
    text.update(model_type=f"{t}_text", rope_parameters={**text["rope_parameters"], "mrope_section": list(v.mrope),
                                                         **rope})
    tower = {"depth": v.n_layers, "hidden_size": v.d_model, "intermediate_size": v.d_ff, "num_heads": v.n_heads,
             "in_channels": 3, "patch_size": v.patch_size, "spatial_merge_size": v.spatial_merge,
             "temporal_patch_size": v.temporal_patch, "out_hidden_size": cfg.d_model, **vision}
    return {"architectures": [architecture], "model_type": t, "text_config": text, "vision_config": tower,
            "image_token_id": v.image_token_id, "vision_start_token_id": v.boi_token_id,
            "vision_end_token_id": v.eoi_token_id, "tie_word_embeddings": cfg.tie_embeddings}


def qkv_rule(E: int, N: int, H: int) -> dict:
    """The tower's fused qkv Linear [3E, E] (or its bias [3E]) <-> our q, k, v [E, N, H] (biases [N, H])."""
    def to_ours(a):
        parts = np.split(a.T if a.ndim == 2 else a, 3, axis=-1)
        return tuple(p.reshape((E, N, H) if a.ndim == 2 else (N, H)) for p in parts)

    def to_hf(*parts):
        if parts[0].ndim == 3:
            return np.concatenate([p.reshape(E, -1) for p in parts], axis=1).T
        return np.concatenate([p.reshape(-1) for p in parts])

    return {"to_ours": to_ours, "to_hf": to_hf}


def vision_rules(cfg: ModelConfig) -> list[Rule]:
    """The tower's tensors; `{v}` runs over its layers. The Conv3d kernel [E, C, t, p, p] is our matmul weight
    over patches flattened (C, t, p, p), transformers' order of a patch's values."""
    v = cfg.vision
    E, N, H = v.d_model, v.n_heads, v.hd
    b = "visual.blocks.{v}."
    qkv = ("vision.layers.attn.q", "vision.layers.attn.k", "vision.layers.attn.v")
    rules = [Rule("visual.patch_embed.proj.weight", ("vision.patch",),
                  to_ours=lambda w: (w.reshape(w.shape[0], -1).T,),
                  to_hf=lambda w: w.T.reshape(E, 3, v.temporal_patch, v.patch_size, v.patch_size)),
             Rule(b + "norm1.weight", ("vision.layers.attn_norm.scale",)),
             Rule(b + "norm2.weight", ("vision.layers.mlp_norm.scale",)),
             Rule(b + "attn.qkv.weight", qkv, **qkv_rule(E, N, H)),
             Rule(b + "attn.qkv.bias", tuple(n + "_bias" for n in qkv), **qkv_rule(E, N, H)),
             Rule(b + "attn.proj.weight", ("vision.layers.attn.o",), **linear_in((N, H, E))),
             Rule(b + "attn.proj.bias", ("vision.layers.attn.o_bias",))]
    for name in ("gate", "up", "down"):
        rules += [Rule(b + f"mlp.{name}_proj.weight", (f"vision.layers.mlp.{name}",), **linear()),
                  Rule(b + f"mlp.{name}_proj.bias", (f"vision.layers.mlp.{name}_bias",))]
    return rules + [Rule("visual.merger.ln_q.weight", ("vision.merger.norm.scale",)),
                    Rule("visual.merger.mlp.0.weight", ("vision.merger.up",), **linear()),
                    Rule("visual.merger.mlp.0.bias", ("vision.merger.up_bias",)),
                    Rule("visual.merger.mlp.2.weight", ("vision.merger.down",), **linear()),
                    Rule("visual.merger.mlp.2.bias", ("vision.merger.down_bias",))]


def rules(cfg: ModelConfig) -> list[Rule]:
    return llama.rules(cfg) + vision_rules(cfg)


def ignored(cfg: ModelConfig) -> tuple[str, ...]:
    return llama.ignored(cfg)


def normalize_name(name: str) -> str:
    """A checkpoint's tensor name in the spelling of the rules (PREFIXES)."""
    for theirs, ours in PREFIXES:
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    return name

