"""Qwen3-VL (model_type qwen3_vl: Qwen3VLForConditionalGeneration): the Qwen 3 language model (llama.py: q/k
RMSNorm, SwiGLU) rotated by interleaved M-RoPE on prompts with images, and its vision tower (model.vision, kind
qwen3: model/vision_qwen3.py; docs/vision.md) with its deepstack mergers. Its checkpoints name tensors
model.language_model.* / model.visual.* / lm_head.weight, the spelling of these rules."""

from __future__ import annotations

import dataclasses

from jaxlm.config import ModelConfig
from jaxlm.config.model_schema import VisionConfig
from jaxlm.families import llama, qwen_vl
from jaxlm.families.rules import ConvertError, Rule, linear, linear_in, refuse

MODEL_TYPES = ("qwen3_vl",)
ARCHITECTURE = "Qwen3VLForConditionalGeneration"
TOWER_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu", "silu": "silu"}


def _mrope_section(hf: dict) -> list:
    text = hf.get("text_config") or hf
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    return list(params.get("mrope_section") or [24, 20, 20])


def config_from_hf(hf: dict) -> ModelConfig:
    """transformers' Qwen3-VL always interleaves M-RoPE's pairs (whatever mrope_interleaved says), so we do."""
    cfg = llama.config_from_hf(qwen_vl.text_config(hf, "qwen3"))
    v = hf.get("vision_config") or {}
    refuse(v, "in_channels", lambda n: n in (None, 3), "images are RGB")
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act not in TOWER_ACTIVATIONS:
        raise ConvertError(f"config.json vision_config.hidden_act={act!r} is not supported; known: "
                           f"{', '.join(TOWER_ACTIVATIONS)}")
    theta = (v.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    refuse({"rope_theta": theta}, "rope_theta", 10000.0, "the tower rotates with base 10000")
    if v.get("out_hidden_size", cfg.d_model) != cfg.d_model:
        raise ConvertError(f"config.json vision_config.out_hidden_size={v['out_hidden_size']} differs from the "
                           f"language model's hidden_size={cfg.d_model}")
    mrope = _mrope_section(hf)
    if len(mrope) != 3 or sum(mrope) != cfg.hd // 2:
        raise ConvertError(f"config.json mrope_section={mrope} must be three counts summing to head_dim / 2 = "
                           f"{cfg.hd // 2}")
    deepstack = list(v.get("deepstack_visual_indexes", (8, 16, 24)))
    if len(deepstack) > cfg.n_layers:
        raise ConvertError(f"config.json vision_config.deepstack_visual_indexes={deepstack} feeds more layers than "
                           f"the language model's {cfg.n_layers}")
    vision = VisionConfig(
        kind="qwen3", patch_size=v.get("patch_size", 16), d_model=v.get("hidden_size", 1152),
        n_layers=v.get("depth", 27), n_heads=v.get("num_heads", 16), d_ff=v.get("intermediate_size", 4304),
        norm_eps=1e-6, activation=TOWER_ACTIVATIONS[act], image_token_id=hf.get("image_token_id", 151655),
        boi_token_id=hf.get("vision_start_token_id", 151652), eoi_token_id=hf.get("vision_end_token_id", 151653),
        spatial_merge=v.get("spatial_merge_size", 2), temporal_patch=v.get("temporal_patch_size", 2),
        position_embeddings=v.get("num_position_embeddings", 2304), deepstack_layers=",".join(map(str, deepstack)),
        mrope_section=",".join(map(str, mrope)), mrope_interleaved=True)
    return dataclasses.replace(cfg, vision=vision)


def model_type(cfg: ModelConfig) -> str | None:
    return "qwen3_vl" if cfg.vision is not None and cfg.vision.kind == "qwen3" else None


def config_to_hf(cfg: ModelConfig, t: str) -> dict:
    v = cfg.vision
    if not v.mrope_interleaved:
        raise ConvertError("model.vision.mrope_interleaved=false cannot be exported as qwen3_vl (transformers' "
                           "Qwen3-VL always interleaves M-RoPE)")
    act = {"gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu", "silu": "silu"}[v.activation]
    return qwen_vl.hf_config(cfg, t, ARCHITECTURE, "qwen3", {"mrope_interleaved": True}, {
        "model_type": "qwen3_vl_vision", "hidden_act": act, "num_position_embeddings": v.position_embeddings,
        "deepstack_visual_indexes": list(v.deepstack)})


def _merger_rules(hf: str, ours: str) -> list[Rule]:
    return [Rule(hf + "norm.weight", (ours + "norm.scale",)), Rule(hf + "norm.bias", (ours + "norm.bias",)),
            Rule(hf + "linear_fc1.weight", (ours + "up",), **linear()), Rule(hf + "linear_fc1.bias", (ours + "up_bias",)),
            Rule(hf + "linear_fc2.weight", (ours + "down",), **linear()),
            Rule(hf + "linear_fc2.bias", (ours + "down_bias",))]


def vision_rules(cfg: ModelConfig) -> list[Rule]:
    """The tower's tensors; `{v}` runs over its layers, `{d}` over the deepstack mergers. The Conv3d kernel
    [E, C, t, p, p] is our matmul weight over patches flattened (C, t, p, p), transformers' order."""
    v = cfg.vision
    E, N, H = v.d_model, v.n_heads, v.hd
    b, ours = "model.visual.blocks.{v}.", "vision.layers."
    qkv = tuple(ours + f"attn.{n}" for n in ("q", "k", "v"))
    rules = [Rule("model.visual.patch_embed.proj.weight", ("vision.patch",),
                  to_ours=lambda w: (w.reshape(w.shape[0], -1).T,),
                  to_hf=lambda w: w.T.reshape(E, 3, v.temporal_patch, v.patch_size, v.patch_size)),
             Rule("model.visual.patch_embed.proj.bias", ("vision.patch_bias",)),
             Rule("model.visual.pos_embed.weight", ("vision.positions",)),
             Rule(b + "attn.qkv.weight", qkv, **qwen_vl.qkv_rule(E, N, H)),
             Rule(b + "attn.qkv.bias", tuple(n + "_bias" for n in qkv), **qwen_vl.qkv_rule(E, N, H)),
             Rule(b + "attn.proj.weight", (ours + "attn.o",), **linear_in((N, H, E))),
             Rule(b + "attn.proj.bias", (ours + "attn.o_bias",)),
             Rule(b + "mlp.linear_fc1.weight", (ours + "mlp.up",), **linear()),
             Rule(b + "mlp.linear_fc1.bias", (ours + "mlp.up_bias",)),
             Rule(b + "mlp.linear_fc2.weight", (ours + "mlp.down",), **linear()),
             Rule(b + "mlp.linear_fc2.bias", (ours + "mlp.down_bias",))]
    for hf_norm, our_norm in (("norm1", "attn_norm"), ("norm2", "mlp_norm")):
        rules += [Rule(b + f"{hf_norm}.weight", (ours + f"{our_norm}.scale",)),
                  Rule(b + f"{hf_norm}.bias", (ours + f"{our_norm}.bias",))]
    rules += _merger_rules("model.visual.merger.", "vision.merger.")
    if v.deepstack:
        rules += _merger_rules("model.visual.deepstack_merger_list.{d}.", "vision.deepstack.")
    return rules


def rules(cfg: ModelConfig) -> list[Rule]:
    """The language model's tensors under model.language_model (lm_head at the top), then the tower's."""
    text = [dataclasses.replace(r, hf="model.language_model." + r.hf[len("model."):]) if r.hf.startswith("model.")
            else r for r in llama.rules(cfg)]
    return text + vision_rules(cfg)


def ignored(cfg: ModelConfig) -> tuple[str, ...]:
    return llama.ignored(cfg)
