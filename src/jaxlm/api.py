"""The Python API for notebooks and scripts: `model = jaxlm.load(PATH)`, then `model.logits(tokens)` and
`model.generate(prompt_ids, ...)`. PATH is a run directory (its latest checkpoint) or a folder written by
`jaxlm convert from-hf`."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm import convert, generate
from jaxlm.config import Config, ModelConfig
from jaxlm.model import forward


@partial(jax.jit, static_argnames="cfg")
def _logits(params, tokens_BT, cfg: ModelConfig):
    return forward(params, tokens_BT, cfg)


@dataclass
class Model:
    config: Config
    params: dict
    path: Path

    def logits(self, tokens) -> np.ndarray:
        """int tokens [batch, length] -> float32 logits [batch, length, vocab] (a numpy array)."""
        tokens_BT = np.asarray(tokens)
        if tokens_BT.ndim != 2 or not np.issubdtype(tokens_BT.dtype, np.integer):
            raise ValueError(f"tokens must be an integer array [batch, length], got {tokens_BT.dtype} "
                             f"{tokens_BT.shape}")
        V = self.config.model.vocab_size
        if tokens_BT.size and (tokens_BT.min() < 0 or tokens_BT.max() >= V):
            raise ValueError(f"token ids must be in [0, {V}), got [{tokens_BT.min()}, {tokens_BT.max()}]")
        return np.asarray(_logits(self.params, jnp.asarray(tokens_BT, jnp.int32), self.config.model))

    def generate(self, prompt_ids: list[int], new_tokens: int, temperature: float = 0.8, top_k: int = 0,
                 seed: int = 0) -> list[int]:
        """Sample `new_tokens` ids after the prompt (temperature 0 = greedy)."""
        return generate.sample(self.params, self.config.model, list(prompt_ids), new_tokens,
                               jax.random.key(seed), temperature, top_k)


def load(path: str | Path) -> Model:
    cfg, params = convert.load_params(path)
    return Model(cfg, params, Path(path))
