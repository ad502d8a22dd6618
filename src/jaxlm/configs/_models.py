"""Published model sizes as ModelConfigs, and the training settings their presets share.

Each `configs/<name>.py` preset is one of these models; sizes follow the families' released config.json files,
so `jaxlm convert from-hf` of the released weights yields exactly this model.
"""

from __future__ import annotations

import dataclasses

from jaxlm.config import CheckpointConfig, Config, ModelConfig, OptimizerConfig, TrainingConfig
from jaxlm.config.model_schema import VisionConfig

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

QWEN3_MOE = dict(QWEN3, n_kv_heads=4, block_size=40960, n_experts=128, experts_per_token=8, router_aux_loss_coef=0.001)
GEMMA3 = dict(GEMMA, vocab_size=262208, block_size=131072, qk_norm=True, post_norms=True, sliding_window=1024,
              layer_pattern="local,local,local,local,local,global", rope_theta=1000000.0, local_rope_theta=10000.0,
              rope_scaling="linear", rope_scaling_factor=8.0, head_dim=256, attn_scale=256.0)
GPT_OSS = dict(LLAMA, vocab_size=201088, block_size=131072, norm_eps=1e-5, n_heads=64, n_kv_heads=8, head_dim=64,
               d_model=2880, d_ff=2880, experts_per_token=4, qkv_bias=True, attn_out_bias=True, attn_sinks=True,
               router_bias=True, expert_bias=True, swiglu_limit=7.0, layer_pattern="local,global", sliding_window=128,
               rope_theta=150000.0, rope_scaling="yarn", rope_scaling_factor=32.0, rope_original_context=4096,
               rope_yarn_truncate=False, router_aux_loss_coef=0.001)
LLAMA4 = dict(LLAMA, vocab_size=202048, block_size=1048576, norm_eps=1e-5, rope_theta=500000.0, n_layers=48,
              n_heads=40, n_kv_heads=8, head_dim=128, d_model=5120, d_ff=16384, expert_d_ff=8192,
              n_shared_experts=1, experts_per_token=1, layer_pattern="chunked,chunked,chunked,nope",
              attention_chunk=8192, attn_temperature_tuning=True, router_score="sigmoid", router_norm_topk=False,
              router_weights_input=True, router_aux_loss_coef=0.001)
DEEPSEEK_V3 = dict(LLAMA, vocab_size=129280, block_size=163840, norm_eps=1e-6, n_layers=61, n_heads=128,
                   d_model=7168, head_dim=192, d_ff=18432, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128, n_experts=256, experts_per_token=8, expert_d_ff=2048,
                   n_shared_experts=1, first_dense_layers=3, router_score="sigmoid", router_groups=8,
                   router_topk_groups=4, router_scale=2.5, router_balance_bias=True, router_aux_loss_coef=0.0,
                   rope_scaling="yarn", rope_scaling_factor=40.0, rope_original_context=4096, rope_yarn_mscale=1.0,
                   rope_yarn_mscale_all_dim=1.0, mtp_layers=1)

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
    "llama3_2_3b": dict(LLAMA31, n_layers=28, n_heads=24, d_model=3072, d_ff=8192, rope_scaling_factor=32.0,
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
    "qwen3_30b_a3b": dict(QWEN3_MOE, n_layers=48, n_heads=32, d_model=2048, d_ff=6144, expert_d_ff=768),
    "qwen3_235b_a22b": dict(QWEN3_MOE, n_layers=94, n_heads=64, d_model=4096, d_ff=12288, expert_d_ff=1536),
    "gemma3_1b": dict(GEMMA3, vocab_size=262144, block_size=32768, n_layers=26, n_heads=4, n_kv_heads=1,
                      d_model=1152, d_ff=6912, sliding_window=512, rope_scaling="none"),
    # The 4B, 12B and 27B are Gemma3ForConditionalGeneration: the language model and its SigLIP tower
    # (VisionConfig's defaults: 27 layers of width 1152, MLP 4304, 16 heads, 896-pixel images in 14-pixel patches
    # pooled to 256 soft tokens); the 1B is text only.
    "gemma3_4b": dict(GEMMA3, n_layers=34, n_heads=8, n_kv_heads=4, d_model=2560, d_ff=10240, vision=VisionConfig()),
    "gemma3_12b": dict(GEMMA3, n_layers=48, n_heads=16, n_kv_heads=8, d_model=3840, d_ff=15360,
                       vision=VisionConfig()),
    "gemma3_27b": dict(GEMMA3, n_layers=62, n_heads=32, n_kv_heads=16, head_dim=128, d_model=5376, d_ff=21504,
                       attn_scale=168.0, vision=VisionConfig()),
    "gpt_oss_20b": dict(GPT_OSS, n_layers=24, n_experts=32),
    "gpt_oss_120b": dict(GPT_OSS, n_layers=36, n_experts=128),
    "llama4_scout": dict(LLAMA4, n_experts=16, qk_l2_norm=True, rope_scaling="llama3", rope_scaling_factor=16.0,
                         rope_low_freq_factor=1.0, rope_high_freq_factor=1.0, rope_original_context=8192),
    "llama4_maverick": dict(LLAMA4, n_experts=128, moe_layer_interval=2),
    "deepseek_v3": DEEPSEEK_V3,
    "kimi_k2": dict(DEEPSEEK_V3, vocab_size=163840, block_size=131072, n_heads=64, n_experts=384, first_dense_layers=1,
                    router_groups=1, router_topk_groups=1, router_scale=2.827, rope_theta=50000.0,
                    rope_scaling_factor=32.0, mtp_layers=0),
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
