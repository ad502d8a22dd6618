"""A LoRA train step against the full fine-tune's on the same model, measured side by side in one run.

The steps are the ones `jaxlm train` runs (same jit, donation, optimizer), on random tokens, for a Llama-shaped
model (default: d 768, 12 layers, GQA 12/4, vocab 32,000, ~110M parameters; block 256, batch 4) with LoRA's
defaults (rank 16, alpha 16 on q, k, v, o, up, gate, down) and, labelled, QLoRA's nf4 base. The two kinds of step
alternate in rounds, so that the machine's drift falls on both alike; each figure is a median over rounds.

Prints key=value lines:  full_step_s lora_step_s lora_over_full (the step-time ratio, the issue's figure)
lora_tok_per_s full_tok_per_s qlora_nf4_step_s, the trained parameters of each, and the model FLOPs of each step.

    python benchmarks/lora_step.py [--rounds 5] [--steps 3] [--d-model 768 --layers 12 --block 256 --batch 4]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from jaxlm import config as config_lib, params as P, runtime, sharding
from jaxlm.store import weights
from jaxlm.model import flops, lora
from jaxlm.train import run as run_lib, state as state_lib, step as step_lib
from jaxlm.model import param_specs


def model_settings(a) -> dict:
    return {"model.d_model": a.d_model, "model.n_layers": a.layers, "model.n_heads": a.d_model // 64,
            "model.n_kv_heads": a.d_model // 192, "model.d_ff": int(a.d_model * 8 / 3) // 64 * 64,
            "model.vocab_size": 32000, "model.block_size": a.block, "model.glu": True, "model.activation": "silu",
            "model.qk_norm": False, "model.tie_embeddings": False, "training.batch_size": a.batch,
            "optimizer.name": "adamw", "optimizer.warmup_steps": 1}


def make_base(folder: Path, cfg: config_lib.Config) -> None:
    """A converted-style folder holding the model's randomly initialized weights: the LoRA runs' base."""
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    weights.save_params(folder / "params", P.init(param_specs(cfg.model), jax.random.key(0), mesh))
    (folder / "config.json").write_text(config_lib.to_json(cfg))


class Stepper:
    """One kind of train step, ready to run on fixed random batches."""

    def __init__(self, cfg: config_lib.Config):
        self.run = run_lib.setup(cfg, jax.devices()[:1], data=False)
        self.state = state_lib.init_state(self.run, 0)
        self.frozen = state_lib.load_frozen(self.run) if lora.enabled(cfg) else None
        self.step = step_lib.make_train_step(self.run.cfg, self.run.optimizer, self.run.mesh,
                                             self.run.abstract_state, self.run.act_rules)
        t, m = self.run.cfg.training, self.run.cfg.model
        rng = np.random.default_rng(0)
        x = rng.integers(0, m.vocab_size, (2, 1, t.batch_size, m.block_size + 1)).astype(np.int32)
        self.batches = [{"inputs": b[..., :-1], "targets": b[..., 1:]} for b in x]
        self.tokens = t.batch_size * m.block_size
        self.i = 0
        self.time(2)  # compile and warm up

    def time(self, steps: int) -> float:
        """Seconds per step over `steps` steps."""
        start = time.perf_counter()
        for _ in range(steps):
            args = (self.state, self.batches[self.i % 2]) + (() if self.frozen is None else (self.frozen,))
            self.state, m = self.step(*args)
            self.i += 1
        jax.block_until_ready(m)
        return (time.perf_counter() - start) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="steps of each kind per round")
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    a = ap.parse_args()
    if runtime.platform() == "cpu":
        runtime.tune_for_xla_cpu()
    base_cfg = config_lib.load("quickstart", [f"{k}={v}" for k, v in model_settings(a).items()])
    base_cfg = base_cfg.replace(model=config_lib.apply_parameter_scale(base_cfg.model))
    with tempfile.TemporaryDirectory() as tmp:
        make_base(Path(tmp), base_cfg)
        lora_over = [f"checkpoint.init_from={tmp}", "lora.rank=16"]
        kinds = {"full": base_cfg,
                 "lora": config_lib.apply_overrides(base_cfg, config_lib.parse_overrides(lora_over)),
                 "qlora_nf4": config_lib.apply_overrides(base_cfg, config_lib.parse_overrides(
                     lora_over + ["lora.base_quantization=nf4"]))}
        steppers = {name: Stepper(cfg) for name, cfg in kinds.items()}
        times = {name: [] for name in kinds}
        for r in range(a.rounds):
            for name, s in steppers.items():
                times[name].append(s.time(a.steps))
            print(f"round {r + 1}/{a.rounds}: " + " ".join(f"{k} {v[-1]:.3f} s/step" for k, v in times.items()),
                  file=sys.stderr, flush=True)
    med = {name: float(np.median(t)) for name, t in times.items()}
    full_flops = flops.flops_per_token(base_cfg.model, causal=True)
    tokens = steppers["full"].tokens
    n_base = P.count(param_specs(base_cfg.model))
    print(f"model: d {a.d_model}, {a.layers} layers, block {a.block}, batch {a.batch}, {n_base:,} parameters; "
          f"LoRA rank 16 on q,k,v,o,up,gate,down: {P.count(steppers['lora'].run.specs):,} trained")
    print(f"full_step_s={med['full']:.4f}")
    print(f"lora_step_s={med['lora']:.4f}")
    print(f"qlora_nf4_step_s={med['qlora_nf4']:.4f}")
    print(f"full_tok_per_s={tokens / med['full']:.0f}")
    print(f"lora_tok_per_s={tokens / med['lora']:.0f}")
    print(f"model_flops_per_token full={full_flops:.4g} lora={lora.flops_per_token(kinds['lora'], full_flops):.4g}")
    print(f"lora_over_full={med['lora'] / med['full']:.3f}")
    print(f"qlora_nf4_over_full={med['qlora_nf4'] / med['full']:.3f}")


if __name__ == "__main__":
    main()
