"""gpt-oss (OpenAI, 2025): a mixture of experts with a biased softmax router (top-k, weights renormalized over
the chosen), experts with biases and a clamped SwiGLU ((up + 1) * gate * sigmoid(1.702 gate), both clipped at
swiglu_limit), attention with biases on q, k, v and o and a learned sink logit per head, sliding-window and
full layers alternating, YaRN rotary scaling.

Checkpoints store each layer's experts fused: gate_up_proj [E, D, 2F] with gate and up interleaved along the
last axis (gate at even columns), down_proj [E, F, D], and their biases. The released checkpoints are MXFP4
quantized; transformers can dequantize them to bf16 (Mxfp4Config(dequantize=True), then save_pretrained),
which this import reads.
"""

from __future__ import annotations

import numpy as np

from jaxlm.config import ModelConfig
from jaxlm.families import llama
from jaxlm.families.rules import Rule, layer_types, linear, pattern_from_layer_types, refuse, refuse_quantized

MODEL_TYPES = ("gpt_oss",)
ARCHITECTURE = "GptOssForCausalLM"


def config_from_hf(hf: dict) -> ModelConfig:
    refuse_quantized(hf)
    refuse(hf, "attention_bias", lambda v: v is not False, "gpt-oss always has attention biases")
    kw = llama.base_config(hf)
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                      for i in range(hf["num_hidden_layers"])]
    kw.update(activation="silu", qkv_bias=True, attn_out_bias=True, attn_sinks=True,
              sliding_window=hf.get("sliding_window"), layer_pattern=pattern_from_layer_types(types),
              n_experts=hf["num_local_experts"], experts_per_token=hf["num_experts_per_tok"],
              router_bias=True, expert_bias=True, swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
              swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
              router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001))
    return ModelConfig(**kw)


def model_type(cfg: ModelConfig) -> str | None:
    return "gpt_oss" if cfg.attn_sinks else None


def config_to_hf(cfg: ModelConfig, t: str) -> dict:
    hf = llama.base_hf_config(cfg, t, ARCHITECTURE)
    hf.update(hidden_act="silu", attention_bias=True, num_local_experts=cfg.n_experts,
              num_experts_per_tok=cfg.experts_per_token, sliding_window=cfg.sliding_window,
              layer_types=layer_types(cfg), swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha,
              router_aux_loss_coef=cfg.router_aux_loss_coef, output_router_logits=False)
    return hf


def _split_gate_up(a):  # [E, D, 2F], gate at even columns -> gate, up [E, D, F]
    return a[..., ::2], a[..., 1::2]


def _join_gate_up(gate, up):
    out = np.empty((*gate.shape[:-1], 2 * gate.shape[-1]), gate.dtype)
    out[..., ::2], out[..., 1::2] = gate, up
    return out


def rules(cfg: ModelConfig) -> list[Rule]:
    a, m = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    return llama.outer_rules(cfg) + [
        Rule("model.layers.{i}.input_layernorm.weight", ("layers.attn_norm.scale",)),
        Rule("model.layers.{i}.post_attention_layernorm.weight", ("layers.mlp_norm.scale",)),
        *llama.attention_rules(cfg),
        Rule(a + "o_proj.bias", ("layers.attn.o_bias",)),
        Rule(a + "sinks", ("layers.attn.sinks",)),
        Rule(m + "router.weight", ("layers.mlp.router",), **linear()),
        Rule(m + "router.bias", ("layers.mlp.router_bias",)),
        Rule(m + "experts.gate_up_proj", ("layers.mlp.gate", "layers.mlp.up"), _split_gate_up, _join_gate_up),
        Rule(m + "experts.gate_up_proj_bias", ("layers.mlp.gate_bias", "layers.mlp.up_bias"), _split_gate_up,
             _join_gate_up),
        Rule(m + "experts.down_proj", ("layers.mlp.down",)),
        Rule(m + "experts.down_proj_bias", ("layers.mlp.down_bias",)),
    ]


def ignored(cfg: ModelConfig) -> tuple[str, ...]:
    return llama.ignored(cfg)

