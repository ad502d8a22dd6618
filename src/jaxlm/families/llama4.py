"""Llama 4 (Scout, Maverick; the text model): mixture-of-experts layers of top-1 sigmoid-routed experts plus one
shared expert, the routing weight scaling the expert's input (every interleave_moe_layer_step), chunked
attention on rotary layers and no rotary on every fourth layer (no_rope_layers, with attention temperature
tuning); rotary layers L2-normalize q and k (use_qk_norm).

Layout (docs/families.md): HF rotates q and k over interleaved pairs; the import moves each head's even
dimensions first (rotate-half) and the export back. Experts are stored fused: gate_up_proj [E, D, 2F] (gate
then up), down_proj [E, F, D]. The multimodal checkpoints (model_type llama4) import their language model,
under language_model.*, without the vision tower.
"""

from __future__ import annotations

import numpy as np

from jaxlm.config import ModelConfig
from jaxlm.families import llama
from jaxlm.families.rules import ConvertError, Rule, linear, linear_in, refuse, refuse_quantized
from jaxlm.model import stack

MODEL_TYPES = ("llama4_text", "llama4")
ARCHITECTURE = "Llama4ForCausalLM"
# The multimodal checkpoints' vision tower and projector (the text model is imported alone).
VISION = (r"vision_model\..*", r"multi_modal_projector\..*")


def text_config(hf: dict) -> dict:
    return {**hf["text_config"], "model_type": "llama4_text"} if hf["model_type"] == "llama4" else hf


def config_from_hf(hf: dict) -> ModelConfig:
    hf = text_config(hf)
    refuse_quantized(hf)
    refuse(hf, "attention_bias", None)
    L = hf["num_hidden_layers"]
    interval = hf.get("interleave_moe_layer_step", 1)
    moe = hf.get("moe_layers")
    if moe is not None and list(moe) != list(range(interval - 1, L, interval)):
        raise ConvertError(f"config.json moe_layers={moe} is not supported (only every interleave_moe_layer_step-th "
                           f"layer)")
    rope = hf.get("no_rope_layers") or [int((i + 1) % hf.get("no_rope_layer_interval", 4) != 0) for i in range(L)]
    chunk = hf.get("attention_chunk_size")
    types = hf.get("layer_types") or ["chunked_attention" if r and chunk else "full_attention" for r in rope]
    kinds = []
    for i in range(L):
        if types[i] == "chunked_attention" and not rope[i]:
            raise ConvertError(f"config.json layer_types[{i}]='chunked_attention' on a layer without rotary "
                               "(no_rope_layers) is not supported")
        kinds.append("chunked" if types[i] == "chunked_attention" else "global" if rope[i] else "nope")
    pattern = next(kinds[:p] for p in range(1, L + 1) if all(kinds[i] == kinds[i % p] for i in range(L)))
    kw = llama.base_config(hf)
    kw.update(activation="silu", d_ff=hf.get("intermediate_size_mlp", hf["intermediate_size"]),
              layer_pattern=",".join(pattern), attention_chunk=chunk if "chunked" in pattern else None,
              qk_l2_norm=bool(hf.get("use_qk_norm", True)),
              attn_temperature_tuning=bool(hf.get("attn_temperature_tuning", True)),
              attn_temperature_floor=int(hf.get("floor_scale", 8192)),
              attn_temperature_scale=float(hf.get("attn_scale", 0.1)),
              n_experts=hf["num_local_experts"], experts_per_token=hf.get("num_experts_per_tok", 1),
              expert_d_ff=hf["intermediate_size"], n_shared_experts=1, moe_layer_interval=interval,
              router_score="sigmoid", router_norm_topk=False, router_weights_input=True,
              router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001))
    return ModelConfig(**kw)


def model_type(cfg: ModelConfig) -> str | None:
    llama4 = "chunked" in cfg.pattern or "nope" in cfg.pattern or cfg.qk_l2_norm or cfg.router_weights_input
    return "llama4_text" if llama4 else None


def config_to_hf(cfg: ModelConfig, t: str) -> dict:
    hf = llama.base_hf_config(cfg, "llama4_text", ARCHITECTURE)
    kinds = [cfg.pattern[i % len(cfg.pattern)] for i in range(cfg.n_layers)]
    hf.update(hidden_act="silu", attention_bias=False, intermediate_size=cfg.expert_ff, intermediate_size_mlp=cfg.ff,
              num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
              interleave_moe_layer_step=cfg.moe_layer_interval, moe_layers=None,
              no_rope_layers=[int(k != "nope") for k in kinds], attention_chunk_size=cfg.attention_chunk,
              layer_types=["chunked_attention" if k == "chunked" else "full_attention" for k in kinds],
              use_qk_norm=cfg.qk_l2_norm, attn_temperature_tuning=cfg.attn_temperature_tuning,
              floor_scale=cfg.attn_temperature_floor, attn_scale=cfg.attn_temperature_scale,
              router_aux_loss_coef=cfg.router_aux_loss_coef, router_jitter_noise=0.0, output_router_logits=False)
    return hf


def _deinterleave(H: int) -> np.ndarray:
    """Each head's dimensions, evens first: the complex pairs (2i, 2i + 1) become rotate-half pairs (i, i + H/2)."""
    return np.concatenate([np.arange(0, H, 2), np.arange(1, H, 2)])


def _rope_linear(heads: int, H: int) -> dict:
    """A q or k projection [heads * H, D] <-> ours [D, heads, H] with each head's dimensions de-interleaved."""
    order, back = _deinterleave(H), np.argsort(_deinterleave(H))
    return {"to_ours": lambda a: (a.T.reshape(a.shape[1], heads, H)[..., order],),
            "to_hf": lambda a: a[..., back].reshape(a.shape[0], -1).T}


def rules(cfg: ModelConfig) -> list[Rule]:
    D, N, K, H, F = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.hd, cfg.expert_ff
    a, f = "model.layers.{i}.self_attn.", "model.layers.{i}.feed_forward."
    kinds = stack.layout(cfg).kinds
    out = llama.outer_rules(cfg) + [
        Rule("model.layers.{i}.input_layernorm.weight", ("layers.attn_norm.scale",)),
        Rule("model.layers.{i}.post_attention_layernorm.weight", ("layers.mlp_norm.scale",)),
        Rule(a + "q_proj.weight", ("layers.attn.q",), **_rope_linear(N, H)),
        Rule(a + "k_proj.weight", ("layers.attn.k",), **_rope_linear(K, H)),
        Rule(a + "v_proj.weight", ("layers.attn.v",), **linear(lambda d: (d, K, H))),
        Rule(a + "o_proj.weight", ("layers.attn.o",), **linear_in((N, H, D)))]
    if not all(k.moe for k in kinds):
        out += llama.dense_mlp_rules(f, llama.dense_path(cfg))
    if any(k.moe for k in kinds):
        out += [Rule(f + "router.weight", ("layers.mlp.router",), **linear()),
                Rule(f + "experts.gate_up_proj", ("layers.mlp.gate", "layers.mlp.up"),
                     lambda a: (a[..., :F], a[..., F:]), lambda gate, up: np.concatenate([gate, up], axis=-1)),
                Rule(f + "experts.down_proj", ("layers.mlp.down",)),
                *llama.dense_mlp_rules(f + "shared_expert.", "layers.mlp", "shared_")]
    return out


def ignored(cfg: ModelConfig) -> tuple[str, ...]:
    return llama.ignored(cfg) + VISION


def normalize_name(name: str) -> str:
    """Multimodal checkpoints keep the text model under language_model.*."""
    return name[len("language_model."):] if name.startswith("language_model.") else name
