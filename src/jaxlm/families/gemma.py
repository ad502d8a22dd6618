"""Gemma, Gemma 2 and Gemma 3 (text): GeGLU MLP, embeddings scaled by sqrt(width), RMSNorm with (1 + w), tied
embeddings, wide heads (256). Gemma 2 adds attention- and final-logit soft-capping, alternating sliding-window
and global layers, norms after attention and MLP as well as before, and a query scale from
query_pre_attn_scalar. Gemma 3 drops the soft-caps, adds QK-norm, interleaves five local layers to one global
(26 layers: four repeats and two local layers), and rotates local layers with their own base (10,000) and
global ones with 1,000,000, linearly scaled by 8 in the 4B/12B/27B models. The multimodal checkpoints
(model_type gemma3: Gemma3ForConditionalGeneration) import their language model, under language_model.*,
with the vision tower left out."""

from __future__ import annotations

from jaxlm.config import ModelConfig
from jaxlm.families import llama
from jaxlm.families.rules import (ACTIVATIONS_TO_HF, ConvertError, Rule, activation, layer_types,
                                  pattern_from_layer_types, refuse, refuse_quantized, rope_from_hf,
                                  rope_parameters, rope_to_hf)

MODEL_TYPES = ("gemma", "gemma2", "gemma3_text", "gemma3")
ARCHITECTURES = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
# The multimodal checkpoints' vision tower and projector (the text model is imported alone).
VISION = (r"vision_tower\..*", r"multi_modal_projector\..*")


def text_config(hf: dict) -> dict:
    if hf["model_type"] != "gemma3":
        return hf
    return {"tie_word_embeddings": hf.get("tie_word_embeddings", True), **hf["text_config"],
            "model_type": "gemma3_text"}


def config_from_hf(hf: dict) -> ModelConfig:
    hf = text_config(hf)
    refuse_quantized(hf)
    kw = llama.base_config(hf)
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    kw.update(activation=activation(act, "hidden_activation"), norm_plus_one=True, embed_scale=True,
              tie_embeddings=bool(hf.get("tie_word_embeddings", True)))
    if hf["model_type"] == "gemma2":
        types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                          for i in range(hf["num_hidden_layers"])]
        kw.update(post_norms=True, attn_scale=float(hf.get("query_pre_attn_scalar", kw["head_dim"])),
                  attn_logit_softcap=hf.get("attn_logit_softcapping"),
                  final_logit_softcap=hf.get("final_logit_softcapping"),
                  sliding_window=hf.get("sliding_window"), layer_pattern=pattern_from_layer_types(types))
    if hf["model_type"] == "gemma3_text":
        refuse(hf, "use_bidirectional_attention", None)
        refuse(hf, "attention_bias", None)
        every = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
        types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % every else "full_attention"
                                          for i in range(hf["num_hidden_layers"])]
        kw.update(post_norms=True, qk_norm=True, attn_scale=float(hf.get("query_pre_attn_scalar", kw["head_dim"])),
                  attn_logit_softcap=hf.get("attn_logit_softcapping"),
                  final_logit_softcap=hf.get("final_logit_softcapping"), sliding_window=hf.get("sliding_window"),
                  layer_pattern=pattern_from_layer_types(types), **_gemma3_rope(hf))
    return ModelConfig(**kw)


def _gemma3_rope(hf: dict) -> dict:
    """Global layers' rotary settings and local layers' base, from per-layer-type rope_parameters or the older
    rope_theta / rope_scaling / rope_local_base_freq."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        glob, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    else:
        glob, local = rope_parameters(hf), {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}
    out = rope_from_hf(hf, glob)
    if rope_from_hf(hf, local) != {"rope_theta": out["rope_theta"]} or len(out) > 1:  # else local = global
        local_out = rope_from_hf(hf, local)
        if len(local_out) > 1:
            raise ConvertError(f"config.json rope scaling of sliding_attention layers ({local.get('rope_type')}) is "
                               "not supported (local layers rotate unscaled)")
        out["local_rope_theta"] = local_out["rope_theta"]
    return out


def model_type(cfg: ModelConfig) -> str | None:
    if cfg.post_norms and cfg.qk_norm:
        return "gemma3_text"
    if cfg.post_norms or cfg.attn_logit_softcap or cfg.final_logit_softcap:
        return "gemma2"
    return "gemma" if cfg.norm_plus_one or cfg.embed_scale else None


def config_to_hf(cfg: ModelConfig, t: str) -> dict:
    hf = llama.base_hf_config(cfg, t, ARCHITECTURES[t])
    hf.update(hidden_activation=ACTIVATIONS_TO_HF[cfg.activation], hidden_act=ACTIVATIONS_TO_HF[cfg.activation],
              attention_bias=False)
    if t == "gemma2":
        scalar = cfg.attn_scale if cfg.attn_scale is not None else cfg.hd
        hf.update(query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
                  attn_logit_softcapping=cfg.attn_logit_softcap, final_logit_softcapping=cfg.final_logit_softcap,
                  sliding_window=cfg.sliding_window, layer_types=layer_types(cfg))
    if t == "gemma3_text":
        glob = rope_to_hf(cfg)["rope_parameters"]
        local = {"rope_type": "default", "rope_theta": cfg.local_rope_theta or cfg.rope_theta}
        scalar = cfg.attn_scale if cfg.attn_scale is not None else cfg.hd
        hf.update(query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
                  attn_logit_softcapping=cfg.attn_logit_softcap, final_logit_softcapping=cfg.final_logit_softcap,
                  sliding_window=cfg.sliding_window, layer_types=layer_types(cfg),
                  rope_parameters={"full_attention": glob, "sliding_attention": local},
                  use_bidirectional_attention=False)
    return hf


def rules(cfg: ModelConfig) -> list[Rule]:
    ln = "model.layers.{i}."
    if cfg.post_norms:
        norms = [Rule(ln + "input_layernorm.weight", ("layers.attn_norm.scale",)),
                 Rule(ln + "post_attention_layernorm.weight", ("layers.attn_post_norm.scale",)),
                 Rule(ln + "pre_feedforward_layernorm.weight", ("layers.mlp_norm.scale",)),
                 Rule(ln + "post_feedforward_layernorm.weight", ("layers.mlp_post_norm.scale",))]
    else:
        norms = [Rule(ln + "input_layernorm.weight", ("layers.attn_norm.scale",)),
                 Rule(ln + "post_attention_layernorm.weight", ("layers.mlp_norm.scale",))]
    return llama.outer_rules(cfg) + norms + llama.attention_rules(cfg) + llama.mlp_rules(cfg)


def ignored(cfg: ModelConfig) -> tuple[str, ...]:
    return llama.ignored(cfg) + VISION


def normalize_name(name: str) -> str:
    """Multimodal checkpoints keep the text model under language_model.*."""
    return name[len("language_model."):] if name.startswith("language_model.") else name
