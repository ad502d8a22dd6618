"""Gemma, Gemma 2 and Gemma 3 (text): GeGLU MLP, embeddings scaled by sqrt(width), RMSNorm with (1 + w), tied
embeddings, wide heads (256). Gemma 2 adds attention- and final-logit soft-capping, alternating sliding-window
and global layers, norms after attention and MLP as well as before, and a query scale from
query_pre_attn_scalar. Gemma 3 drops the soft-caps, adds QK-norm, interleaves five local layers to one global
(26 layers: four repeats and two local layers), and rotates local layers with their own base (10,000) and
global ones with 1,000,000, linearly scaled by 8 in the 4B/12B/27B models. The multimodal checkpoints
(model_type gemma3: Gemma3ForConditionalGeneration) keep the language model under language_model.* and add a
SigLIP vision tower and the projector (model.vision; docs/vision.md)."""

from __future__ import annotations

import dataclasses

from jaxlm.config import ModelConfig
from jaxlm.config.model_schema import VisionConfig
from jaxlm.families import llama
from jaxlm.families.rules import (ACTIVATIONS_TO_HF, ConvertError, Rule, activation, layer_types, linear, linear_in,
                                  pattern_from_layer_types, refuse, refuse_quantized, reshaped, rope_from_hf,
                                  rope_parameters, rope_to_hf)

MODEL_TYPES = ("gemma", "gemma2", "gemma3_text", "gemma3")
ARCHITECTURES = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                 "gemma3": "Gemma3ForConditionalGeneration"}
# The spellings of the multimodal checkpoints' prefixes (the hub's, transformers 5's in memory and on disk) and
# the one the rules use.
PREFIXES = (("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
            ("vision_tower.vision_model.", "vision_tower."), ("model.multi_modal_projector.", "multi_modal_projector."))
# SigLIP's attention-pooling head, which Gemma 3 does not use (it reads the encoder's last hidden states).
VISION_HEAD = (r"vision_tower\.head\..*",)


def text_config(hf: dict) -> dict:
    if hf["model_type"] != "gemma3":
        return hf
    return {"tie_word_embeddings": hf.get("tie_word_embeddings", True), **hf["text_config"],
            "model_type": "gemma3_text"}


def config_from_hf(hf: dict) -> ModelConfig:
    cfg = text_config_from_hf(text_config(hf))
    return dataclasses.replace(cfg, vision=vision_from_hf(hf)) if hf["model_type"] == "gemma3" else cfg


def vision_from_hf(hf: dict) -> VisionConfig:
    """The vision tower of a Gemma3ForConditionalGeneration config.json (SigLIP's defaults where keys are
    missing, as transformers reads it)."""
    v = hf.get("vision_config") or {}
    refuse(v, "model_type", lambda t: t in (None, "siglip_vision_model"), "Gemma 3's vision tower is SigLIP's")
    refuse(v, "num_channels", lambda n: n in (None, 3), "images are RGB")
    act = activation(v.get("hidden_act", "gelu_pytorch_tanh"), "vision_config.hidden_act")
    if act not in ("gelu", "gelu_tanh"):
        raise ConvertError(f"config.json vision_config.hidden_act={v['hidden_act']!r} is not supported (gelu only)")
    return VisionConfig(
        image_size=v.get("image_size", 224), patch_size=v.get("patch_size", 16), d_model=v.get("hidden_size", 768),
        n_layers=v.get("num_hidden_layers", 12), n_heads=v.get("num_attention_heads", 12),
        d_ff=v.get("intermediate_size", 3072), norm_eps=v.get("layer_norm_eps", 1e-6), activation=act,
        tokens_per_image=hf.get("mm_tokens_per_image", 256),
        image_token_id=hf.get("image_token_index", hf.get("image_token_id", 262144)),
        boi_token_id=hf.get("boi_token_index", hf.get("boi_token_id", 255999)),
        eoi_token_id=hf.get("eoi_token_index", hf.get("eoi_token_id", 256000)))


def text_config_from_hf(hf: dict) -> ModelConfig:
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
    if cfg.vision is not None:
        return "gemma3"
    if cfg.post_norms and cfg.qk_norm:
        return "gemma3_text"
    if cfg.post_norms or cfg.attn_logit_softcap or cfg.final_logit_softcap:
        return "gemma2"
    return "gemma" if cfg.norm_plus_one or cfg.embed_scale else None


def config_to_hf(cfg: ModelConfig, t: str) -> dict:
    if t == "gemma3":
        v = cfg.vision
        vision = {"model_type": "siglip_vision_model", "hidden_size": v.d_model, "intermediate_size": v.d_ff,
                  "num_hidden_layers": v.n_layers, "num_attention_heads": v.n_heads, "num_channels": 3,
                  "image_size": v.image_size, "patch_size": v.patch_size, "layer_norm_eps": v.norm_eps,
                  "hidden_act": ACTIVATIONS_TO_HF[v.activation], "attention_dropout": 0.0, "vision_use_head": False}
        return {"architectures": [ARCHITECTURES[t]], "model_type": t,
                "text_config": config_to_hf(dataclasses.replace(cfg, vision=None), "gemma3_text"),
                "vision_config": vision, "mm_tokens_per_image": v.tokens_per_image,
                "image_token_index": v.image_token_id, "boi_token_index": v.boi_token_id,
                "eoi_token_index": v.eoi_token_id, "tie_word_embeddings": cfg.tie_embeddings}
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
    """The language model's tensors (under language_model.* in a multimodal checkpoint), then the vision tower's."""
    if cfg.vision is None:
        return text_rules(cfg)
    text = [dataclasses.replace(r, hf="language_model." + r.hf) for r in text_rules(cfg)]
    return text + vision_rules(cfg)


def vision_rules(cfg: ModelConfig) -> list[Rule]:
    """SigLIP's tensors as transformers 5 writes them; `{v}` runs over the encoder's layers. The patch
    embedding's convolution kernel [E, C, p, p] is our matmul weight over patches flattened (p, p, C)."""
    v = cfg.vision
    E, N, H, p = v.d_model, v.n_heads, v.hd, v.patch_size
    e, a, m = "vision_tower.embeddings.", "vision_tower.encoder.layers.{v}.self_attn.", "vision_tower.encoder.layers.{v}."
    rules = [Rule(e + "patch_embedding.weight", ("vision.patch",),
                  to_ours=lambda w: (w.transpose(2, 3, 1, 0).reshape(-1, w.shape[0]),),
                  to_hf=lambda w: w.reshape(p, p, -1, w.shape[-1]).transpose(3, 2, 0, 1)),
             Rule(e + "patch_embedding.bias", ("vision.patch_bias",)),
             Rule(e + "position_embedding.weight", ("vision.positions",))]
    for hf_name, ours in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")):
        rules += [Rule(a + hf_name + ".weight", (f"vision.layers.attn.{ours}",), **linear(lambda d: (d, N, H))),
                  Rule(a + hf_name + ".bias", (f"vision.layers.attn.{ours}_bias",), **reshaped((N, H)))]
    rules += [Rule(a + "out_proj.weight", ("vision.layers.attn.o",), **linear_in((N, H, E))),
              Rule(a + "out_proj.bias", ("vision.layers.attn.o_bias",)),
              Rule(m + "mlp.fc1.weight", ("vision.layers.mlp.up",), **linear()),
              Rule(m + "mlp.fc1.bias", ("vision.layers.mlp.up_bias",)),
              Rule(m + "mlp.fc2.weight", ("vision.layers.mlp.down",), **linear()),
              Rule(m + "mlp.fc2.bias", ("vision.layers.mlp.down_bias",))]
    for hf_name, ours in (("layer_norm1", "attn_norm"), ("layer_norm2", "mlp_norm")):
        rules += [Rule(m + hf_name + f".{part}", (f"vision.layers.{ours}.{mine}",))
                  for part, mine in (("weight", "scale"), ("bias", "bias"))]
    return rules + [Rule("vision_tower.post_layernorm.weight", ("vision.final_norm.scale",)),
                    Rule("vision_tower.post_layernorm.bias", ("vision.final_norm.bias",)),
                    Rule("multi_modal_projector.mm_soft_emb_norm.weight", ("vision.projector.norm.scale",)),
                    Rule("multi_modal_projector.mm_input_projection_weight", ("vision.projector.proj",))]


def text_rules(cfg: ModelConfig) -> list[Rule]:
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
    lm_head = (r"language_model\.lm_head\.weight",) if cfg.tie_embeddings else ()
    return llama.ignored(cfg) + lm_head + VISION_HEAD


def normalize_name(name: str) -> str:
    """A multimodal checkpoint's tensor name in the spelling of the rules (PREFIXES)."""
    for theirs, ours in PREFIXES:
        if name.startswith(theirs):
            name = ours + name[len(theirs):]
    return name
