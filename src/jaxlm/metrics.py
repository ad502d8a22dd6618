"""Model FLOPs, the machine's measured matmul peak, and metric writers (JSONL, TensorBoard, progress bar).

Model FLOPs per token follow the convention of nanoGPT and the PaLM paper: 6 * N for the weights' forward
and backward matmuls, where N counts every parameter except the token and position embedding tables
(an untied output projection counts, a tied one does not), plus 12 * layers * width * block for the
attention scores and weighted sums (forward and backward, full square, as nanoGPT counts them).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxlm import params as P
from jaxlm.config import ModelConfig


def non_embedding_params(cfg: ModelConfig) -> int:
    from jaxlm.model import param_specs

    return P.count(param_specs(cfg), exclude=lambda path: path.startswith("['embed']"))


def flops_per_token(cfg: ModelConfig) -> float:
    return 6.0 * non_embedding_params(cfg) + 12.0 * cfg.n_layers * cfg.n_heads * cfg.hd * cfg.block_size


def matmul_flops_per_second(n: int = 1024, dtype=jnp.float32, repeats: int = 10) -> float:
    """This machine's jitted n^3 matmul rate (best of `repeats`), the yardstick for model FLOP/s."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n ** 3 / best


class MetricWriter:
    """Appends one JSON record per step to metrics.jsonl and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, enabled: bool = True):
        self.enabled = enabled
        self._jsonl = open(run_dir / "metrics.jsonl", "a") if enabled else None
        self._tb = None
        if enabled and tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            step = record["step"]
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)

    def flush(self) -> None:
        if self.enabled:
            self._jsonl.flush()
            if self._tb is not None:
                self._tb.flush()

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            if self._tb is not None:
                self._tb.close()


class Progress:
    """A tqdm bar over training steps (or plain log lines when the bar is off)."""

    def __init__(self, total: int, initial: int, enabled: bool):
        self.enabled = enabled
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, smoothing=0.1)

    def update(self, n: int, postfix: dict) -> None:
        if self._bar is not None:
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(n)

    def write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
