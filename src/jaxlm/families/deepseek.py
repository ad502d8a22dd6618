"""DeepSeek-V3 (and R1, V3.1, Kimi K2, which share its architecture): multi-head latent attention with YaRN,
the first first_k_dense_replace layers dense and the others a mixture of experts with shared experts, sigmoid
scores, group-limited top-k chosen with the score-correction bias (e_score_correction_bias), weights renormalized
and scaled by routed_scaling_factor; multi-token prediction modules stored as extra layers after the last.

Layout (docs/families.md): the rotary rows of q_b_proj and kv_a_proj_with_mqa are interleaved pairs when
rope_interleave; the import moves their even dimensions first (rotate-half) and the export back.
kv_a_proj_with_mqa splits into kv_a and k_rope, kv_b_proj into k_b and v_b. The MTP modules' copies of the
embedding and output tables are the main model's: skipped on import, left out on export.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxlm.config import ModelConfig
from jaxlm.families import llama
from jaxlm.families.rules import (ACTIVATIONS_TO_HF, Rule, activation, linear, linear_in, refuse,
                                  refuse_quantized, rope_from_hf, rope_to_hf)
from jaxlm.model import stack

MODEL_TYPES = ("deepseek_v3", "kimi_k2")
ARCHITECTURE = "DeepseekV3ForCausalLM"


def config_from_hf(hf: dict) -> ModelConfig:
    refuse_quantized(hf)
    refuse(hf, "attention_bias", None)
    refuse(hf, "scoring_func", lambda v: v in (None, "sigmoid"))
    refuse(hf, "topk_method", lambda v: v in (None, "noaux_tc"))
    refuse(hf, "moe_layer_freq", lambda v: v in (None, 1))
    N = hf["num_attention_heads"]
    h, r = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
    return ModelConfig(
        vocab_size=hf["vocab_size"], block_size=hf.get("max_position_embeddings", 4096),
        n_layers=hf["num_hidden_layers"], n_heads=N, d_model=hf["hidden_size"], head_dim=h + r,
        d_ff=hf["intermediate_size"], bias=False, norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6),
        position="rotary", qk_norm=False, glu=True, activation=activation(hf.get("hidden_act", "silu"), "hidden_act"),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), **rope_from_hf(hf),
        kv_lora_rank=hf["kv_lora_rank"], q_lora_rank=hf.get("q_lora_rank") or 0, qk_nope_head_dim=h,
        qk_rope_head_dim=r, v_head_dim=hf["v_head_dim"],
        n_experts=hf["n_routed_experts"], experts_per_token=hf["num_experts_per_tok"],
        expert_d_ff=hf["moe_intermediate_size"], n_shared_experts=hf.get("n_shared_experts") or 0,
        first_dense_layers=hf.get("first_k_dense_replace") or 0, router_score="sigmoid",
        router_norm_topk=bool(hf.get("norm_topk_prob", True)), router_scale=float(hf.get("routed_scaling_factor", 1.0)),
        router_groups=hf.get("n_group") or 1, router_topk_groups=hf.get("topk_group") or 1, router_balance_bias=True,
        router_aux_loss_coef=0.0, mtp_layers=hf.get("num_nextn_predict_layers") or 0)


def model_type(cfg: ModelConfig) -> str | None:
    return "deepseek_v3" if cfg.latent else None


def config_to_hf(cfg: ModelConfig, t: str) -> dict:
    return {
        "architectures": [ARCHITECTURE], "model_type": "deepseek_v3", "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.block_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.ff,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_heads,
        "rms_norm_eps": cfg.norm_eps, "hidden_act": ACTIVATIONS_TO_HF[cfg.activation],
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "attention_dropout": 0.0,
        "kv_lora_rank": cfg.kv_lora_rank, "q_lora_rank": cfg.q_lora_rank or None,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim, "rope_interleave": True, "n_routed_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.experts_per_token, "moe_intermediate_size": cfg.expert_ff,
        "n_shared_experts": cfg.n_shared_experts, "first_k_dense_replace": cfg.first_dense_layers,
        "norm_topk_prob": cfg.router_norm_topk, "routed_scaling_factor": cfg.router_scale,
        "n_group": cfg.router_groups, "topk_group": cfg.router_topk_groups,
        "num_nextn_predict_layers": cfg.mtp_layers, **rope_to_hf(cfg)}


def _rope_last(r: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The order that moves the last r of `width` dimensions' even ones before their odd ones, and its inverse."""
    order = np.concatenate([np.arange(width - r), width - r + np.arange(0, r, 2), width - r + np.arange(1, r, 2)])
    return order, np.argsort(order)


def rules(cfg: ModelConfig) -> list[Rule]:
    return llama.outer_rules(cfg) + layer_rules(cfg, "model.layers.{i}.", "layers") + mtp_rules(cfg)


def layer_rules(cfg: ModelConfig, hf: str, ours: str, dense: bool = True) -> list[Rule]:
    """One stack of layers' tensors (hf names with {i} or {m}) <-> our weights under `ours` (layers or
    mtp.block); `dense`: the dense layers' MLPs too."""
    D, N, Q, C = cfg.d_model, cfg.n_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    h, r, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    q_order, q_back = _rope_last(r, h + r)
    k_order, k_back = _rope_last(r, C + r)
    a, m = hf + "self_attn.", hf + "mlp."

    def q_to_ours(w):  # [N (h + r), in] -> [in, N, h + r], each head's rotary part de-interleaved
        return (w.T.reshape(w.shape[1], N, h + r)[..., q_order],)

    def q_to_hf(w):
        return w[..., q_back].reshape(w.shape[0], -1).T

    def kv_a_to_ours(w):  # [C + r, D] -> kv_a [D, C], k_rope [D, r] (de-interleaved)
        w = w[k_order].T
        return w[:, :C], w[:, C:]

    def kv_a_to_hf(kv_a, k_rope):
        return np.concatenate([kv_a, k_rope], axis=1).T[k_back]

    def kv_b_to_ours(w):  # [N (h + v), C] -> k_b [C, N, h], v_b [C, N, v]
        w = w.T.reshape(C, N, h + v)
        return w[..., :h], w[..., h:]

    def kv_b_to_hf(k_b, v_b):
        return np.concatenate([k_b, v_b], axis=-1).reshape(C, -1).T

    out = [Rule(hf + "input_layernorm.weight", (f"{ours}.attn_norm.scale",)),
           Rule(hf + "post_attention_layernorm.weight", (f"{ours}.mlp_norm.scale",)),
           Rule(a + "kv_a_proj_with_mqa.weight", (f"{ours}.attn.kv_a", f"{ours}.attn.k_rope"), kv_a_to_ours,
                kv_a_to_hf),
           Rule(a + "kv_a_layernorm.weight", (f"{ours}.attn.kv_a_norm.scale",)),
           Rule(a + "kv_b_proj.weight", (f"{ours}.attn.k_b", f"{ours}.attn.v_b"), kv_b_to_ours, kv_b_to_hf),
           Rule(a + "o_proj.weight", (f"{ours}.attn.o",), **linear_in((N, v, D)))]
    if Q:
        out += [Rule(a + "q_a_proj.weight", (f"{ours}.attn.q_a",), **linear()),
                Rule(a + "q_a_layernorm.weight", (f"{ours}.attn.q_a_norm.scale",)),
                Rule(a + "q_b_proj.weight", (f"{ours}.attn.q_b",), q_to_ours, q_to_hf)]
    else:
        out.append(Rule(a + "q_proj.weight", (f"{ours}.attn.q",), q_to_ours, q_to_hf))
    kinds = stack.layout(cfg).kinds
    if dense and not all(k.moe for k in kinds):
        out += llama.dense_mlp_rules(m, llama.dense_path(cfg))
    if not dense or any(k.moe for k in kinds):
        out += [Rule(m + "gate.weight", (f"{ours}.mlp.router",), **linear()),
                Rule(m + "gate.e_score_correction_bias", (f"{ours}.mlp.balance_bias",)),
                *llama.dense_mlp_rules(m + "experts.{e}.", f"{ours}.mlp")]
        if cfg.n_shared_experts:
            out += llama.dense_mlp_rules(m + "shared_experts.", f"{ours}.mlp", "shared_")
    return out


def mtp_rules(cfg: ModelConfig) -> list[Rule]:
    """The multi-token prediction modules, HF layers n_layers + m."""
    if not cfg.mtp_layers:
        return []
    hf = "model.layers.{m}."
    return [Rule(hf + "enorm.weight", ("mtp.embed_norm.scale",)),
            Rule(hf + "hnorm.weight", ("mtp.hidden_norm.scale",)),
            Rule(hf + "eh_proj.weight", ("mtp.proj",), **linear()),
            Rule(hf + "shared_head.norm.weight", ("mtp.norm.scale",)),
            *layer_rules(dataclasses.replace(cfg, first_dense_layers=0), hf, "mtp.block", dense=False)]


def ignored(cfg: ModelConfig) -> tuple[str, ...]:
    # The MTP modules' copies of the main model's embedding and output tables.
    return llama.ignored(cfg) + (r"model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight",)
