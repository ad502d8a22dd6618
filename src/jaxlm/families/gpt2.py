"""GPT-2: learned positions, LayerNorm with biases, biases everywhere, GELU (tanh), tied embeddings.

Its checkpoints store linear weights as Conv1D [in, out] (already our orientation) and fuse q, k and v into
one `c_attn` matrix; hub checkpoints of the base model omit the `transformer.` prefix (convert.py adds it).
"""

from __future__ import annotations

import numpy as np

from jaxlm.config import ModelConfig
from jaxlm.families.rules import ACTIVATIONS_TO_HF, ConvertError, Rule, activation, linear

MODEL_TYPES = ("gpt2",)
# Causal-mask buffers that older checkpoints saved with the weights.
IGNORED = (r"transformer\.h\.\d+\.attn\.(masked_)?bias",)


def config_from_hf(hf: dict) -> ModelConfig:
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if hf.get(key):
            raise ConvertError(f"config.json {key}=true is not supported")
    if hf.get("scale_attn_weights") is False:
        raise ConvertError("config.json scale_attn_weights=false is not supported")
    D = hf["n_embd"]
    return ModelConfig(
        vocab_size=hf["vocab_size"], block_size=hf["n_positions"], n_layers=hf["n_layer"], n_heads=hf["n_head"],
        d_model=D, d_ff=hf.get("n_inner") or 4 * D, bias=True, norm="layernorm",
        norm_eps=hf.get("layer_norm_epsilon", 1e-5), position="learned", qk_norm=False,
        activation=activation(hf.get("activation_function", "gelu_new"), "activation_function"), glu=False,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


def model_type(cfg: ModelConfig) -> str | None:
    return "gpt2" if cfg.position == "learned" else None


def config_to_hf(cfg: ModelConfig, t: str) -> dict:
    act = "gelu_new" if cfg.activation == "gelu_tanh" else ACTIVATIONS_TO_HF[cfg.activation]
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
            "n_positions": cfg.block_size, "n_embd": cfg.d_model, "n_layer": cfg.n_layers, "n_head": cfg.n_heads,
            "n_inner": cfg.ff, "activation_function": act, "layer_norm_epsilon": cfg.norm_eps,
            "tie_word_embeddings": cfg.tie_embeddings, "scale_attn_weights": True,
            "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0}


def rules(cfg: ModelConfig) -> list[Rule]:
    D, N, H = cfg.d_model, cfg.n_heads, cfg.hd
    h = "transformer.h.{i}."

    def split_qkv(a):  # [D, 3 * N * H] -> q, k, v as [D, N, H]
        return tuple(x.reshape(a.shape[0], N, H) for x in np.split(a, 3, axis=-1))

    def join_qkv(q, k, v):
        return np.concatenate([x.reshape(x.shape[0], -1) for x in (q, k, v)], axis=-1)

    def split_qkv_bias(a):
        return tuple(x.reshape(N, H) for x in np.split(a, 3))

    def join_qkv_bias(q, k, v):
        return np.concatenate([x.reshape(-1) for x in (q, k, v)])

    return [
        Rule("transformer.wte.weight", ("embed.tokens",)),
        Rule("transformer.wpe.weight", ("embed.positions",)),
        Rule("transformer.ln_f.weight", ("final_norm.scale",)),
        Rule("transformer.ln_f.bias", ("final_norm.bias",)),
        Rule(h + "ln_1.weight", ("layers.attn_norm.scale",)),
        Rule(h + "ln_1.bias", ("layers.attn_norm.bias",)),
        Rule(h + "attn.c_attn.weight", ("layers.attn.q", "layers.attn.k", "layers.attn.v"), split_qkv, join_qkv),
        Rule(h + "attn.c_attn.bias", ("layers.attn.q_bias", "layers.attn.k_bias", "layers.attn.v_bias"),
             split_qkv_bias, join_qkv_bias),
        Rule(h + "attn.c_proj.weight", ("layers.attn.o",), lambda a: (a.reshape(N, H, D),),
             lambda a: a.reshape(-1, a.shape[-1])),
        Rule(h + "attn.c_proj.bias", ("layers.attn.o_bias",)),
        Rule(h + "ln_2.weight", ("layers.mlp_norm.scale",)),
        Rule(h + "ln_2.bias", ("layers.mlp_norm.bias",)),
        Rule(h + "mlp.c_fc.weight", ("layers.mlp.up",)),
        Rule(h + "mlp.c_fc.bias", ("layers.mlp.up_bias",)),
        Rule(h + "mlp.c_proj.weight", ("layers.mlp.down",)),
        Rule(h + "mlp.c_proj.bias", ("layers.mlp.down_bias",)),
    ] + ([] if cfg.tie_embeddings else [Rule("lm_head.weight", ("lm_head",), **linear())])  # a torch Linear


def ignored(cfg: ModelConfig) -> tuple[str, ...]:
    return IGNORED + ((r"lm_head\.weight",) if cfg.tie_embeddings else ())  # tied: a copy of wte


def normalize_name(name: str) -> str:
    return name if name.startswith("transformer.") or name.startswith("lm_head") else "transformer." + name
