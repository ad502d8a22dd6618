"""Quickstart: a small byte-level GPT on the Python standard library's own source, offline, a few minutes on a
CPU (README.md). Trained with Muon at shakespeare_char_cpu's rate, 8e-3 (it ends below AdamW's val loss:
docs/optimizers.md); `optimizer.name=adamw optimizer.lr=2e-3` gives back the AdamW recipe."""

from jaxlm.config import CheckpointConfig, Config, DataConfig, ModelConfig, OptimizerConfig, TrainingConfig


def config() -> Config:
    return Config(
        model=ModelConfig(block_size=128, n_layers=4, n_heads=4, d_model=128, dropout=0.0,
                          scan_layers=False),  # 4 small layers: unrolled is faster on CPU (docs/diagnostics.md)
        data=DataConfig(dataset="python_stdlib"),
        optimizer=OptimizerConfig(name="muon", lr=8e-3, min_lr=2e-4, warmup_steps=50, beta2=0.99, weight_decay=0.1),
        training=TrainingConfig(steps=600, batch_size=16, eval_interval=200, eval_batches=10,
                                sample_tokens=300, sample_prompt="def ", sample_temperature=0.7),
        checkpoint=CheckpointConfig(interval=0),
    )
