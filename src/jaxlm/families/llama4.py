"""Llama 4 (Scout, Maverick; the text model): mixture-of-experts layers of top-1 sigmoid-routed experts plus one
shared expert, the routing weight scaling the expert's input (every interleave_moe_layer_step), chunked
attention on rotary layers and no rotary on every fourth layer (no_rope_layers, with attention temperature
tuning); rotary layers L2-normalize q and k (use_qk_norm).

Layout (docs/families.md): HF rotates q and k over interleaved pairs; the import moves each head's even
dimensions first (rotate-half) and the export back. Experts are stored fused: gate_up_proj [E, D, 2F] (gate
then up), down_proj [E, F, D]. The multimodal checkpoints (model_type llama4: Llama4ForConditionalGeneration)
keep the language model under language_model.* and add the vision tower (vision_model.*) and the projector
(multi_modal_projector.*): model.vision with kind llama4 (model/vision_llama4.py, docs/vision.md).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxlm.config import ModelConfig
from jaxlm.config.model_schema import VisionConfig
from jaxlm.families import llama
from jaxlm.families.rules import ConvertError, Rule, linear, linear_in, refuse, refuse_quantized, reshaped
from jaxlm.model import stack

MODEL_TYPES = ("llama4_text", "llama4")
ARCHITECTURE = "Llama4ForCausalLM"
# transformers' vision tower normalizes with nn.LayerNorm's own epsilon, whatever vision_config.norm_eps says.
VISION_EPS = 1e-5


def text_config(hf: dict) -> dict:
    return {**hf["text_config"], "model_type": "llama4_text"} if hf["model_type"] == "llama4" else hf


def config_from_hf(hf: dict) -> ModelConfig:
    cfg = text_config_from_hf(text_config(hf))
    return dataclasses.replace(cfg, vision=vision_from_hf(hf)) if hf["model_type"] == "llama4" else cfg


def vision_from_hf(hf: dict) -> VisionConfig:
    """The vision tower of a Llama4ForConditionalGeneration config.json (transformers' defaults where keys are
    missing); what transformers' code fixes whatever the config says (exact GELU, LayerNorm epsilon 1e-5) is
    taken as it computes."""
    v = hf.get("vision_config") or {}
    refuse(v, "num_channels", lambda n: n in (None, 3), "images are RGB")
    E, F = v.get("hidden_size", 768), v.get("intermediate_size", 5632)
    image, patch = v.get("image_size", 448), v.get("patch_size", 14)
    for key, default in (("image_size", image), ("patch_size", patch)):
        if not isinstance(default, int):
            raise ConvertError(f"config.json vision_config.{key}={default!r} is not supported (one side, square)")
    k = 1 / v.get("pixel_shuffle_ratio", 0.5)
    n = image // patch
    if k != round(k) or n % round(k) or E * round(k) ** 2 != F:
        raise ConvertError(f"config.json vision_config.pixel_shuffle_ratio={v.get('pixel_shuffle_ratio', 0.5)} is "
                           f"not supported with {n} patches a side and width {E}: it must be 1/k for a k dividing "
                           f"the patches a side, with intermediate_size={F} equal to hidden_size * k^2 (the "
                           "adapter's input)")
    A = v.get("projector_input_dim", 4096)
    for key, default in (("projector_output_dim", 4096), ("vision_output_dim", 7680)):
        if v.get(key, default) != A:
            raise ConvertError(f"config.json vision_config.{key}={v.get(key, default)} is not supported (it must "
                               f"equal projector_input_dim={A}: the adapter's and the projector's widths)")
    refuse(v, "multi_modal_projector_bias", None)
    rope = v.get("rope_parameters") or {}
    refuse(rope, "rope_type", lambda t: t in (None, "default"), "the tower's rotary is unscaled")
    return VisionConfig(
        kind="llama4", image_size=image, patch_size=patch, d_model=E, n_layers=v.get("num_hidden_layers", 34),
        n_heads=v.get("num_attention_heads", 16), d_ff=F, norm_eps=VISION_EPS, activation="gelu",
        tokens_per_image=(n // round(k)) ** 2, rope_theta=float(rope.get("rope_theta", 10000.0)), projector_dim=A,
        image_token_id=hf.get("image_token_index", 200092), boi_token_id=hf.get("boi_token_index", 200080),
        eoi_token_id=hf.get("eoi_token_index", 200081))


def vision_to_hf(cfg: ModelConfig) -> dict:
    v = cfg.vision
    k = v.patches_per_side // round(v.tokens_per_image ** 0.5)
    vision = {"model_type": "llama4_vision_model", "hidden_size": v.d_model, "intermediate_size": v.d_ff,
              "num_hidden_layers": v.n_layers, "num_attention_heads": v.n_heads, "num_channels": 3,
              "image_size": v.image_size, "patch_size": v.patch_size, "norm_eps": v.norm_eps, "hidden_act": "gelu",
              "pixel_shuffle_ratio": 1 / k, "projector_input_dim": v.projector_dim,
              "projector_output_dim": v.projector_dim, "vision_output_dim": v.projector_dim,
              "multi_modal_projector_bias": False, "projector_dropout": 0.0, "attention_dropout": 0.0,
              "rope_parameters": {"rope_type": "default", "rope_theta": v.rope_theta}}
    return {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
            "text_config": config_to_hf(dataclasses.replace(cfg, vision=None), "llama4_text"),
            "vision_config": vision, "image_token_index": v.image_token_id, "boi_token_index": v.boi_token_id,
            "eoi_token_index": v.eoi_token_id, "tie_word_embeddings": cfg.tie_embeddings}


def text_config_from_hf(hf: dict) -> ModelConfig:
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
    if cfg.vision is not None:
        return "llama4" if cfg.vision.kind == "llama4" else None
    llama4 = "chunked" in cfg.pattern or "nope" in cfg.pattern or cfg.qk_l2_norm or cfg.router_weights_input
    return "llama4_text" if llama4 else None


def config_to_hf(cfg: ModelConfig, t: str) -> dict:
    if t == "llama4":
        return vision_to_hf(cfg)
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
    """The language model's tensors (under language_model.* in a multimodal checkpoint), then the vision tower's."""
    if cfg.vision is None:
        return text_rules(cfg)
    text = [dataclasses.replace(r, hf="language_model." + r.hf) for r in text_rules(cfg)]
    return text + vision_rules(cfg)


def vision_rules(cfg: ModelConfig) -> list[Rule]:
    """The tower's tensors; `{v}` runs over its layers. The patch embedding's linear [E, C p p] takes each patch
    channel-major (torch's unfold); ours takes it row-major then by channel (model/vision.py patches)."""
    v = cfg.vision
    E, N, H, p = v.d_model, v.n_heads, v.hd, v.patch_size
    m, a = "vision_model.model.layers.{v}.", "vision_model.model.layers.{v}.self_attn."
    out = [Rule("vision_model.patch_embedding.linear.weight", ("vision.patch",),
                to_ours=lambda w: (w.reshape(E, 3, p, p).transpose(2, 3, 1, 0).reshape(-1, E),),
                to_hf=lambda w: w.reshape(p, p, 3, E).transpose(3, 2, 0, 1).reshape(E, -1)),
           Rule("vision_model.class_embedding", ("vision.class_token",)),
           Rule("vision_model.positional_embedding_vlm", ("vision.positions",))]
    for hf_name, ours in (("layernorm_pre", "pre_norm"), ("layernorm_post", "post_norm")):
        out += [Rule(f"vision_model.{hf_name}.weight", (f"vision.{ours}.scale",)),
                Rule(f"vision_model.{hf_name}.bias", (f"vision.{ours}.bias",))]
    for name in ("q", "k", "v"):
        out += [Rule(a + f"{name}_proj.weight", (f"vision.layers.attn.{name}",), **linear(lambda d: (d, N, H))),
                Rule(a + f"{name}_proj.bias", (f"vision.layers.attn.{name}_bias",), **reshaped((N, H)))]
    out += [Rule(a + "o_proj.weight", ("vision.layers.attn.o",), **linear_in((N, H, E))),
            Rule(a + "o_proj.bias", ("vision.layers.attn.o_bias",))]
    for hf_name, ours in (("fc1", "up"), ("fc2", "down")):
        out += [Rule(m + f"mlp.{hf_name}.weight", (f"vision.layers.mlp.{ours}",), **linear()),
                Rule(m + f"mlp.{hf_name}.bias", (f"vision.layers.mlp.{ours}_bias",))]
    for hf_name, ours in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "mlp_norm")):
        out += [Rule(m + f"{hf_name}.weight", (f"vision.layers.{ours}.scale",)),
                Rule(m + f"{hf_name}.bias", (f"vision.layers.{ours}.bias",))]
    return out + [Rule("vision_model.vision_adapter.mlp.fc1.weight", ("vision.adapter.up",), **linear()),
                  Rule("vision_model.vision_adapter.mlp.fc2.weight", ("vision.adapter.down",), **linear()),
                  Rule("multi_modal_projector.linear_1.weight", ("vision.projector.proj",), **linear())]


def text_rules(cfg: ModelConfig) -> list[Rule]:
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
    text = llama.ignored(cfg)
    return text if cfg.vision is None else tuple(r"language_model\." + p for p in text)
