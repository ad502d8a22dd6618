"""Qwen3-VL (model_type qwen3_vl: Qwen3VLForConditionalGeneration): the Qwen 3 language model (llama.py: q/k
RMSNorm, SwiGLU) rotated by interleaved M-RoPE on prompts with images, and its vision tower (model.vision, kind
qwen3: model/vision_qwen3.py; docs/vision.md) with its deepstack mergers. Its checkpoints name tensors
model.language_model.* / model.visual.* / lm_head.weight, the spelling of these rules. Qwen3-VL-MoE (qwen3_vl_moe)
is the same with Qwen3-MoE's language model, whose experts each layer stores fused (expert_rules)."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxlm.config import ModelConfig
from jaxlm.config.model_schema import VisionConfig
from jaxlm.families import llama, qwen_vl
from jaxlm.families.rules import ConvertError, Rule, linear, linear_in, refuse
from jaxlm.model import stack

MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")
ARCHITECTURES = {"qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration"}
TEXT_FAMILIES = {"qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe"}
TOWER_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu", "silu": "silu"}


def _mrope_section(hf: dict) -> list:
    text = hf.get("text_config") or hf
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    return list(params.get("mrope_section") or [24, 20, 20])


def _moe_text_config(hf: dict) -> dict:
    """The language model's keys as a qwen3_moe's. transformers' Qwen3-VL-MoE renormalizes the top-k weights
    whatever config.json says (other readers obey norm_topk_prob), so a false one is refused, not guessed."""
    text = qwen_vl.text_config(hf, "qwen3_moe")
    refuse(text, "norm_topk_prob", lambda v: v in (None, True),
           "transformers' Qwen3-VL-MoE always renormalizes the chosen experts' weights")
    experts = text.get("num_experts", text.get("num_local_experts"))
    if not experts:
        raise ConvertError(f"config.json text_config.num_experts={experts!r}: a qwen3_vl_moe model needs experts (a "
                           "model without them is a qwen3_vl)")
    return {**text, "norm_topk_prob": True}


def config_from_hf(hf: dict) -> ModelConfig:
    """transformers' Qwen3-VL always interleaves M-RoPE's pairs (whatever mrope_interleaved says), so we do."""
    moe = hf.get("model_type") == "qwen3_vl_moe"
    cfg = llama.config_from_hf(_moe_text_config(hf) if moe else qwen_vl.text_config(hf, "qwen3"))
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
    if cfg.vision is None or cfg.vision.kind != "qwen3":
        return None
    return "qwen3_vl_moe" if cfg.n_experts else "qwen3_vl"


def config_to_hf(cfg: ModelConfig, t: str) -> dict:
    v = cfg.vision
    if not v.mrope_interleaved:
        raise ConvertError(f"model.vision.mrope_interleaved=false cannot be exported as {t} (transformers' "
                           "Qwen3-VL always interleaves M-RoPE)")
    if cfg.n_experts and not cfg.router_norm_topk:
        raise ConvertError("model.router_norm_topk=false cannot be exported as qwen3_vl_moe (transformers' "
                           "Qwen3-VL-MoE always renormalizes the chosen experts' weights)")
    act = {"gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu", "silu": "silu"}[v.activation]
    return qwen_vl.hf_config(cfg, t, ARCHITECTURES[t], TEXT_FAMILIES[t], {"mrope_interleaved": True}, {
        "model_type": f"{t}_vision", "hidden_act": act, "num_position_embeddings": v.position_embeddings,
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


def expert_rules(cfg: ModelConfig) -> list[Rule]:
    """Qwen3-VL-MoE's MLPs: the dense layers' (mlp_only_layers) as Qwen 3's, and per MoE layer the router and all
    experts in two tensors, transformers 5's layout: gate_up_proj [E, 2F, D] (each expert's gate rows, then its up
    rows) and down_proj [E, D, F], ours gate / up [E, D, F] and down [E, F, D]. The released checkpoints hold both
    with their last two axes swapped (transformers reads either by shape), and so does the import (Rule.swapped)."""
    lay, m = stack.layout(cfg), "model.layers.{i}.mlp."
    rules = [] if all(k.moe for k in lay.kinds) else llama.dense_mlp_rules(m, llama.dense_path(cfg))
    F = cfg.expert_ff
    return rules + [
        Rule(m + "gate.weight", ("layers.mlp.router",), **linear()),
        Rule(m + "experts.gate_up_proj", ("layers.mlp.gate", "layers.mlp.up"), swapped=(1, 2),
             to_ours=lambda a: (a[:, :F].transpose(0, 2, 1), a[:, F:].transpose(0, 2, 1)),
             to_hf=lambda gate, up: np.concatenate([gate, up], axis=-1).transpose(0, 2, 1)),
        Rule(m + "experts.down_proj", ("layers.mlp.down",), swapped=(1, 2),
             to_ours=lambda a: (a.transpose(0, 2, 1),), to_hf=lambda down: down.transpose(0, 2, 1))]


def rules(cfg: ModelConfig) -> list[Rule]:
    """The language model's tensors under model.language_model (lm_head at the top), then the tower's."""
    text = llama.rules(cfg, expert_rules if cfg.n_experts else llama.mlp_rules)
    text = [dataclasses.replace(r, hf="model.language_model." + r.hf[len("model."):]) if r.hf.startswith("model.")
            else r for r in text]
    return text + vision_rules(cfg)


def ignored(cfg: ModelConfig) -> tuple[str, ...]:
    return llama.ignored(cfg)
