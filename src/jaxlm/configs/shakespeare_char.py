"""midGPT's character-level Shakespeare GPT: 6 layers, 6 heads, 384 wide, block 256, dropout 0.2,
independent weight decay (rotary embeddings, RMSNorm, QK-LayerNorm, tied embeddings, no biases)."""

from jaxlm.config import CheckpointConfig, Config, DataConfig, ModelConfig, OptimizerConfig, TrainingConfig


def config() -> Config:
    return Config(
        model=ModelConfig(block_size=256, n_layers=6, n_heads=6, d_model=384, dropout=0.2),
        data=DataConfig(dataset="shakespeare_char"),
        optimizer=OptimizerConfig(lr=1e-3, min_lr=1e-4, warmup_steps=100, decay_steps=5000, schedule="cosine",
                                  beta2=0.99, weight_decay=1e-4, weight_decay_mode="independent"),
        training=TrainingConfig(steps=5000, batch_size=64, eval_interval=250, eval_batches=200),
        checkpoint=CheckpointConfig(interval=1000),
    )
