"""nanoGPT's documented CPU run of character-level Shakespeare: 4 layers, 4 heads, 128 wide, block 64,
batch 12, 2000 iterations, no dropout (nanoGPT reports val loss about 1.88). The optimizer is jaxlm's tuned
recipe for that budget, Muon at lr 8e-3 with a 30-step warmup and cosine decay over the 2000 steps, found by
benchmarks/sweep.py (docs/optimizers.md has the sweep); nanoGPT's own AdamW recipe is `optimizer.name=adamw
optimizer.lr=1e-3 optimizer.warmup_steps=100`."""

from jaxlm.config import CheckpointConfig, Config, DataConfig, ModelConfig, OptimizerConfig, TrainingConfig


def config() -> Config:
    return Config(
        model=ModelConfig(block_size=64, n_layers=4, n_heads=4, d_model=128, dropout=0.0,
                          scan_layers=False),  # 4 small layers: unrolled is faster on CPU (docs/diagnostics.md)
        data=DataConfig(dataset="shakespeare_char"),
        optimizer=OptimizerConfig(name="muon", lr=8e-3, min_lr=1e-4, warmup_steps=30, decay_steps=2000,
                                  schedule="cosine", beta2=0.99, weight_decay=0.1),
        training=TrainingConfig(steps=2000, batch_size=12, eval_interval=250, eval_batches=20),
        checkpoint=CheckpointConfig(interval=250),
    )
