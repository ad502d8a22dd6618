"""Gemma and Gemma 2: GeGLU MLP, embeddings scaled by sqrt(width), RMSNorm with (1 + w), tied embeddings,
wide heads (256). Gemma 2 adds attention- and final-logit soft-capping, alternating sliding-window and global
layers, norms after attention and MLP as well as before, and a query scale from query_pre_attn_scalar."""

from __future__ import annotations

from jaxlm.config import ModelConfig
from jaxlm.families import ACTIVATIONS_TO_HF, Rule, activation, layer_types, llama, pattern_from_layer_types

MODEL_TYPES = ("gemma", "gemma2")
ARCHITECTURES = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM"}


def config_from_hf(hf: dict) -> ModelConfig:
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
    return ModelConfig(**kw)


def model_type(cfg: ModelConfig) -> str | None:
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
    return llama.ignored(cfg)
