"""Apertus: Llama's attention with Qwen 3's per-head RMSNorm on q and k, and a plain two-layer MLP (up, activation,
down; no gate). With a GELU activation it is jaxlm's default GPT (rotary, RMSNorm, QK-norm, no biases, tied
embeddings) exactly, so that `jaxlm convert to-hf` exports a run of the default model as a model transformers loads.
Apertus's own checkpoints use the xIELU activation, which jaxlm does not have: their import is refused.
"""

from __future__ import annotations

from jaxlm.config import ModelConfig
from jaxlm.families import llama
from jaxlm.families.rules import ACTIVATIONS_TO_HF, ConvertError, Rule, activation, linear, refuse_quantized

MODEL_TYPES = ("apertus",)
IGNORED = llama.IGNORED


def model_type(cfg: ModelConfig) -> str | None:
    plain = (not cfg.glu and cfg.position == "rotary" and cfg.norm == "rmsnorm" and not cfg.n_experts
             and cfg.vision is None and not cfg.latent)
    return "apertus" if plain else None


def config_from_hf(hf: dict) -> ModelConfig:
    refuse_quantized(hf)
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ConvertError("config.json attention_bias/mlp_bias on an apertus model is not supported")
    kw = llama.base_config(hf)
    kw.update(glu=False, qk_norm=True, activation=activation(hf.get("hidden_act", "xielu"), "hidden_act"))
    return ModelConfig(**kw)


def config_to_hf(cfg: ModelConfig, t: str) -> dict:
    hf = llama.base_hf_config(cfg, t, "ApertusForCausalLM")
    hf.update(hidden_act=ACTIVATIONS_TO_HF[cfg.activation], attention_bias=False)
    return hf


def rules(cfg: ModelConfig) -> list[Rule]:
    m = "model.layers.{i}."
    return (llama.outer_rules(cfg)
            + [Rule(m + "attention_layernorm.weight", ("layers.attn_norm.scale",)),
               Rule(m + "feedforward_layernorm.weight", ("layers.mlp_norm.scale",))]
            + llama.attention_rules(cfg)
            + [Rule(m + "mlp.up_proj.weight", ("layers.mlp.up",), **linear()),
               Rule(m + "mlp.down_proj.weight", ("layers.mlp.down",), **linear())])


def ignored(cfg: ModelConfig) -> tuple[str, ...]:
    return llama.ignored(cfg)
