"""GPT-2 124M on OpenWebText (nanoGPT's reproduction): learned positions, LayerNorm with bias, tanh-GELU,
block 1024, vocab 50304 (50257 padded to a multiple of 64), about 2M tokens per step in bfloat16 compute."""

from jaxlm.config import CheckpointConfig, Config, DataConfig, ModelConfig, OptimizerConfig, TrainingConfig


def config() -> Config:
    return Config(
        model=ModelConfig(vocab_size=50304, block_size=1024, n_layers=12, n_heads=12, d_model=768, dropout=0.0,
                          bias=True, norm="layernorm", position="learned", qk_norm=False, activation="gelu_tanh",
                          compute_dtype="bfloat16"),
        data=DataConfig(dataset="openwebtext"),
        optimizer=OptimizerConfig(lr=6e-4, min_lr=6e-5, warmup_steps=2000, schedule="cosine", beta2=0.95,
                                  weight_decay=0.1),
        training=TrainingConfig(steps=600_000, batch_size=128, grad_accum=16, eval_interval=1000,
                                eval_batches=200),
        checkpoint=CheckpointConfig(interval=2000),
    )
