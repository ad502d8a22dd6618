"""Published model sizes as ModelConfigs, and the training settings their presets share.

Each `configs/<name>.py` preset is one of these models; sizes follow the families' released config.json files,
so `jaxlm convert from-hf` of the released weights yields exactly this model.
"""

from __future__ import annotations

import dataclasses

from jaxlm.config import CheckpointConfig, Config, ModelConfig, OptimizerConfig, TrainingConfig

GPT2 = dict(vocab_size=50257, block_size=1024, bias=True, norm="layernorm", position="learned", qk_norm=False,
            activation="gelu_tanh", glu=False, tie_embeddings=True)
LLAMA = dict(norm="rmsnorm", position="rotary", qk_norm=False, activation="silu", glu=True, tie_embeddings=False)
LLAMA2 = dict(LLAMA, vocab_size=32000, block_size=4096, norm_eps=1e-5)
LLAMA3 = dict(LLAMA, vocab_size=128256, block_size=8192, norm_eps=1e-5, rope_theta=500000.0, n_kv_heads=8)
LLAMA31 = dict(LLAMA3, block_size=131072, rope_scaling="llama3", rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
               rope_high_freq_factor=4.0, rope_original_context=8192)
GEMMA = dict(vocab_size=256000, block_size=8192, norm="rmsnorm", norm_eps=1e-6, position="rotary", qk_norm=False,
             activation="gelu_tanh", glu=True, tie_embeddings=True, norm_plus_one=True, embed_scale=True)
GEMMA2 = dict(GEMMA, post_norms=True, attn_logit_softcap=50.0, final_logit_softcap=30.0, sliding_window=4096,
              layer_pattern="local,global")
QWEN3 = dict(LLAMA, vocab_size=151936, block_size=40960, norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True,
             n_kv_heads=8, head_dim=128)

MODELS: dict[str, ModelConfig] = {name: ModelConfig(**kw) for name, kw in {
    "gpt2": dict(GPT2, n_layers=12, n_heads=12, d_model=768),
    "gpt2_medium": dict(GPT2, n_layers=24, n_heads=16, d_model=1024),
    "gpt2_large": dict(GPT2, n_layers=36, n_heads=20, d_model=1280),
    "gpt2_xl": dict(GPT2, n_layers=48, n_heads=25, d_model=1600),
    "llama2_7b": dict(LLAMA2, n_layers=32, n_heads=32, d_model=4096, d_ff=11008),
    "llama2_13b": dict(LLAMA2, n_layers=40, n_heads=40, d_model=5120, d_ff=13824),
    "llama2_70b": dict(LLAMA2, n_layers=80, n_heads=64, n_kv_heads=8, d_model=8192, d_ff=28672),
    "llama3_8b": dict(LLAMA3, n_layers=32, n_heads=32, d_model=4096, d_ff=14336),
    "llama3_70b": dict(LLAMA3, n_layers=80, n_heads=64, d_model=8192, d_ff=28672),
    "llama3_1_8b": dict(LLAMA31, n_layers=32, n_heads=32, d_model=4096, d_ff=14336),
    "llama3_2_1b": dict(LLAMA31, n_layers=16, n_heads=32, d_model=2048, d_ff=8192, rope_scaling_factor=32.0,
                        tie_embeddings=True),
    "mistral_7b": dict(LLAMA, vocab_size=32000, block_size=32768, norm_eps=1e-5, n_layers=32, n_heads=32,
                       n_kv_heads=8, d_model=4096, d_ff=14336, sliding_window=4096, layer_pattern="local"),
    "mixtral_8x7b": dict(LLAMA, vocab_size=32000, block_size=32768, norm_eps=1e-5, rope_theta=1000000.0,
                         n_layers=32, n_heads=32, n_kv_heads=8, d_model=4096, d_ff=14336, n_experts=8,
                         experts_per_token=2, router_aux_loss_coef=0.02),
    "gemma_2b": dict(GEMMA, n_layers=18, n_heads=8, n_kv_heads=1, head_dim=256, d_model=2048, d_ff=16384),
    "gemma_7b": dict(GEMMA, n_layers=28, n_heads=16, head_dim=256, d_model=3072, d_ff=24576),
    "gemma2_2b": dict(GEMMA2, n_layers=26, n_heads=8, n_kv_heads=4, head_dim=256, d_model=2304, d_ff=9216,
                      attn_scale=256.0),
    "gemma2_9b": dict(GEMMA2, n_layers=42, n_heads=16, n_kv_heads=8, head_dim=256, d_model=3584, d_ff=14336,
                      attn_scale=256.0),
    "gemma2_27b": dict(GEMMA2, n_layers=46, n_heads=32, n_kv_heads=16, head_dim=128, d_model=4608, d_ff=36864,
                       attn_scale=144.0),
    "qwen3_0_6b": dict(QWEN3, n_layers=28, n_heads=16, d_model=1024, d_ff=3072, tie_embeddings=True),
    "qwen3_8b": dict(QWEN3, n_layers=36, n_heads=32, d_model=4096, d_ff=12288),
    # MaxText's default model (its base.yml): model.global_parameter_scale=16/32/64/128 gives the models of
    # MaxText's README tables (16B, 32B, 64B, 128B) with the same weights and parameter counts.
    "maxtext_base": dict(LLAMA, vocab_size=32000, block_size=2048, norm_eps=1e-5, n_layers=16, n_heads=16,
                         head_dim=128, d_model=2048, d_ff=7168),
}.items()}


def preset(name: str) -> Config:
    """A published model with settings for fine-tuning it: bf16 matmuls over float32 weights, full remat,
    a 2048-token context (raise model.block_size for longer), a short low-LR schedule. Start from released
    weights with checkpoint.init_from=<folder written by `jaxlm convert from-hf`>."""
    model = dataclasses.replace(MODELS[name], compute_dtype="bfloat16", remat="full",
                                block_size=min(MODELS[name].block_size, 2048))
    return Config(
        model=model,
        optimizer=OptimizerConfig(lr=2e-5, min_lr=2e-6, warmup_steps=100, weight_decay=0.0),
        training=TrainingConfig(steps=1000, batch_size=8, eval_interval=200),
        checkpoint=CheckpointConfig(interval=500),
    )
