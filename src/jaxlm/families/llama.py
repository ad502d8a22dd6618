"""Llama 2/3/3.1, Mistral, Mixtral and Qwen 2/3: RMSNorm, rotary, SwiGLU, grouped-query attention.

Hugging Face already stores q and k in the rotate-half rotary layout that `layers.rotary` uses (its
conversion script permuted Meta's interleaved layout once), so q/k need only reshaping here.
Differences: Mistral has sliding-window layers, Mixtral a mixture-of-experts MLP, Qwen 2 biases on
q/k/v, Qwen 3 a per-head RMSNorm on q and k; Qwen3-MoE is Qwen 3 with experts (a softmax router whose top-k
weights are renormalized when norm_topk_prob, dense layers where mlp_only_layers / decoder_sparse_step say).
"""

from __future__ import annotations

from typing import Callable

from jaxlm.config import ModelConfig
from jaxlm.families.rules import (ACTIVATIONS_TO_HF, ConvertError, Rule, activation, layer_types, linear,
                                  linear_in, pattern_from_layer_types, refuse_quantized, reshaped, rope_from_hf,
                                  rope_to_hf)
from jaxlm.model import stack

MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# Tensors some checkpoints carry that the math does not use (precomputed rotary tables).
IGNORED = (r".*rotary_emb\.inv_freq",)


def base_config(hf: dict) -> dict:
    """The settings every Llama-like family shares, from config.json."""
    D, N = hf["hidden_size"], hf["num_attention_heads"]
    return dict(
        vocab_size=hf["vocab_size"], block_size=hf.get("max_position_embeddings", 4096),
        n_layers=hf["num_hidden_layers"], n_heads=N, n_kv_heads=hf.get("num_key_value_heads") or N,
        d_model=D, head_dim=hf.get("head_dim") or D // N, d_ff=hf["intermediate_size"],
        bias=False, norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6), position="rotary", qk_norm=False,
        glu=True, tie_embeddings=bool(hf.get("tie_word_embeddings", False)), **rope_from_hf(hf),
    )


def config_from_hf(hf: dict) -> ModelConfig:
    t = hf["model_type"]
    refuse_quantized(hf)
    if hf.get("attention_bias") and t != "qwen2" or hf.get("mlp_bias"):
        raise ConvertError(f"config.json attention_bias/mlp_bias on a {t} model is not supported "
                           "(only Qwen 2's q/k/v biases are)")
    kw = base_config(hf)
    kw["activation"] = activation(hf.get("hidden_act", "silu"), "hidden_act")
    kw["qkv_bias"] = t == "qwen2"
    kw["qk_norm"] = t in ("qwen3", "qwen3_moe")
    if t in ("qwen2", "qwen3", "qwen3_moe"):
        if hf.get("use_sliding_window"):
            raise ConvertError(f"config.json use_sliding_window=true on a {t} model is not supported")
    elif hf.get("sliding_window"):
        kw.update(sliding_window=hf["sliding_window"], layer_pattern="local")
    if hf.get("layer_types") and t not in ("qwen2", "qwen3", "qwen3_moe"):
        kw["layer_pattern"] = pattern_from_layer_types(hf["layer_types"])
    if t == "mixtral":
        kw.update(n_experts=hf["num_local_experts"], experts_per_token=hf["num_experts_per_tok"],
                  router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.02))
    experts = hf.get("num_experts") or hf.get("num_local_experts")  # transformers 5 writes the latter
    if t == "qwen3_moe" and experts:
        only = list(hf.get("mlp_only_layers") or [])
        if only != list(range(len(only))):
            raise ConvertError(f"config.json mlp_only_layers={only} is not supported (only the first layers, "
                               f"[0, 1, ..., k - 1], may be dense)")
        kw.update(n_experts=experts, experts_per_token=hf["num_experts_per_tok"],
                  expert_d_ff=hf["moe_intermediate_size"], router_norm_topk=bool(hf.get("norm_topk_prob", False)),
                  first_dense_layers=len(only), moe_layer_interval=hf.get("decoder_sparse_step", 1),
                  router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001))
    return ModelConfig(**kw)


def model_type(cfg: ModelConfig) -> str:
    if cfg.n_experts and cfg.qk_norm:
        return "qwen3_moe"
    if cfg.n_experts:
        return "mixtral"
    if cfg.qk_norm:
        return "qwen3"
    if cfg.qkv_bias:
        return "qwen2"
    return "mistral" if "local" in cfg.pattern else "llama"


def base_hf_config(cfg: ModelConfig, t: str, architecture: str) -> dict:
    return {
        "architectures": [architecture], "model_type": t, "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.block_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.ff,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.hd, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_dropout": 0.0, **rope_to_hf(cfg),
    }


def config_to_hf(cfg: ModelConfig, t: str) -> dict:
    hf = base_hf_config(cfg, t, ARCHITECTURES[t])
    hf.update(hidden_act=ACTIVATIONS_TO_HF[cfg.activation], attention_bias=cfg.qkv_bias, mlp_bias=False)
    if t in ("mistral", "mixtral"):
        hf["sliding_window"] = cfg.sliding_window if "local" in cfg.pattern else None
    if t in ("qwen2", "qwen3", "qwen3_moe"):
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers,
                  layer_types=layer_types(cfg))
    if t == "mixtral":
        hf.update(num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
                  router_aux_loss_coef=cfg.router_aux_loss_coef, output_router_logits=False)
    if t == "qwen3_moe":
        hf.update(num_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
                  moe_intermediate_size=cfg.expert_ff, norm_topk_prob=cfg.router_norm_topk,
                  mlp_only_layers=list(range(cfg.first_dense_layers)), decoder_sparse_step=cfg.moe_layer_interval,
                  router_aux_loss_coef=cfg.router_aux_loss_coef, output_router_logits=False)
    return hf


def attention_rules(cfg: ModelConfig) -> list[Rule]:
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.hd
    a = "model.layers.{i}.self_attn."
    rules = [
        Rule(a + "q_proj.weight", ("layers.attn.q",), **linear(lambda d: (d, N, H))),
        Rule(a + "k_proj.weight", ("layers.attn.k",), **linear(lambda d: (d, K, H))),
        Rule(a + "v_proj.weight", ("layers.attn.v",), **linear(lambda d: (d, K, H))),
        Rule(a + "o_proj.weight", ("layers.attn.o",), **linear_in((N, H, D))),
    ]
    if cfg.qkv_bias:
        rules += [Rule(a + "q_proj.bias", ("layers.attn.q_bias",), **reshaped((N, H))),
                  Rule(a + "k_proj.bias", ("layers.attn.k_bias",), **reshaped((K, H))),
                  Rule(a + "v_proj.bias", ("layers.attn.v_bias",), **reshaped((K, H)))]
    if cfg.qk_norm:
        rules += [Rule(a + "q_norm.weight", ("layers.attn.q_norm.scale",)),
                  Rule(a + "k_norm.weight", ("layers.attn.k_norm.scale",))]
    return rules


def mlp_rules(cfg: ModelConfig) -> list[Rule]:
    lay = stack.layout(cfg)
    dense = dense_mlp_rules("model.layers.{i}.mlp.", dense_path(cfg)) if not all(k.moe for k in lay.kinds) else []
    if not any(k.moe for k in lay.kinds):
        return dense
    if model_type(cfg) == "qwen3_moe":
        m = "model.layers.{i}.mlp."
        return dense + [Rule(m + "gate.weight", ("layers.mlp.router",), **linear()),
                        *dense_mlp_rules(m + "experts.{e}.", "layers.mlp")]
    m = "model.layers.{i}.block_sparse_moe."
    return [Rule(m + "gate.weight", ("layers.mlp.router",), **linear()),
            Rule(m + "experts.{e}.w1.weight", ("layers.mlp.gate",), **linear()),
            Rule(m + "experts.{e}.w3.weight", ("layers.mlp.up",), **linear()),
            Rule(m + "experts.{e}.w2.weight", ("layers.mlp.down",), **linear())]


def dense_path(cfg: ModelConfig) -> str:
    """Where the dense MLPs of a model's dense layers lie: layers.dense_mlp when MoE layers hold layers.mlp."""
    return "layers.dense_mlp" if stack.layout(cfg).mixed else "layers.mlp"


def dense_mlp_rules(hf: str, ours: str, prefix: str = "") -> list[Rule]:
    """A SwiGLU MLP's gate_proj / up_proj / down_proj Linear weights (names behind hf) <-> ours.[prefix]gate/up/down."""
    return [Rule(hf + "gate_proj.weight", (f"{ours}.{prefix}gate",), **linear()),
            Rule(hf + "up_proj.weight", (f"{ours}.{prefix}up",), **linear()),
            Rule(hf + "down_proj.weight", (f"{ours}.{prefix}down",), **linear())]


def outer_rules(cfg: ModelConfig) -> list[Rule]:
    rules = [Rule("model.embed_tokens.weight", ("embed.tokens",)), Rule("model.norm.weight", ("final_norm.scale",))]
    if not cfg.tie_embeddings:
        rules.append(Rule("lm_head.weight", ("lm_head",), **linear()))
    return rules


def rules(cfg: ModelConfig, mlp: Callable[[ModelConfig], list[Rule]] = mlp_rules) -> list[Rule]:
    """Every tensor; `mlp` gives the MLPs' rules (Qwen3-VL-MoE's fused experts: families/qwen3_vl.py)."""
    return (outer_rules(cfg) + [Rule("model.layers.{i}.input_layernorm.weight", ("layers.attn_norm.scale",)),
                                Rule("model.layers.{i}.post_attention_layernorm.weight", ("layers.mlp_norm.scale",))]
            + attention_rules(cfg) + mlp(cfg))


def ignored(cfg: ModelConfig) -> tuple[str, ...]:
    return IGNORED + ((r"lm_head\.weight",) if cfg.tie_embeddings else ())
