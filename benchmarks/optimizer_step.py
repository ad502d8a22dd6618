"""Throughput of a train step with Muon (and with MuonClip's QK-clip) over the same step with AdamW, on the
quickstart model and on a 124M GPT-2-shaped model, measured alternately in one run.

Muon's extra work, Newton-Schulz on every hidden matrix, does not grow with the batch, while the forward and
backward passes do; so the ratio depends on the tokens per step. Each model's line gives the measured step
times and, from them, the update's own extra seconds, and the ratio that extra cost would leave at larger
batches (an extrapolation from these measurements, marked as such).

Prints one line per model and optimizer: model=NAME optimizer=NAME tokens_per_step=N step_s=S tok_per_s=X
over_adamw=R; then per model: muon_extra_s=E (step_s(muon) - step_s(adamw)) and the extrapolated ratios.

With --collectives it instead compiles (nothing allocated) the 124M model's train step for 8 fake CPU devices
as fsdp=4 x tensor=2 and counts the collectives XLA's partitioner put in each optimizer's step, with the bytes
each device receives: what Muon's Newton-Schulz on sharded matrices costs in communication, against one gather
of every matrix it orthogonalizes (the other way to do it).

    python benchmarks/optimizer_step.py [--steps N] [--rounds R] [--only quickstart|gpt2_124m]
    python benchmarks/optimizer_step.py --collectives
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import statistics
import sys
import time

if "--collectives" in sys.argv:  # before jax is imported: 8 fake devices
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax
import numpy as np

from jaxlm import config as config_lib
from jaxlm.train import batches as batch_lib, optim, run as run_lib, state as state_lib, step as step_lib

OPTIMIZERS = {"adamw": {"optimizer.name": "adamw"}, "muon": {"optimizer.name": "muon"},
              "muon+qk_clip": {"optimizer.name": "muon", "optimizer.qk_clip": 100.0}}


def models() -> dict[str, config_lib.Config]:
    quick = config_lib.load("quickstart")
    quick = quick.replace(model=dataclasses.replace(quick.model, vocab_size=256))
    gpt2 = config_lib.load("openwebtext")  # GPT-2 124M: 12 layers, 768 wide, vocab 50304
    gpt2 = gpt2.replace(model=dataclasses.replace(gpt2.model, block_size=256, compute_dtype="float32"),
                        training=dataclasses.replace(gpt2.training, batch_size=4, grad_accum=1))
    return {"quickstart": quick, "gpt2_124m": gpt2}


class Stepper:
    """One compiled train step and its state, fed random tokens."""

    def __init__(self, cfg: config_lib.Config):
        run = run_lib.setup(cfg, jax.devices()[:1], data=False)  # the vocabulary is set: no corpus is read
        self.cfg, t = run.cfg, run.cfg.training
        self.state = state_lib.init_state(run, 0)
        self.step = step_lib.make_train_step(run.cfg, run.optimizer, run.mesh, run.abstract_state, run.act_rules)
        self.tokens = t.grad_accum * t.batch_size * run.cfg.model.block_size
        rng = np.random.default_rng(0)
        shape = (t.grad_accum, t.batch_size, run.cfg.model.block_size)
        self.batches = [batch_lib.put_batch(run.mesh, rng.integers(0, run.cfg.model.vocab_size, shape).astype(np.int32),
                                            1) for _ in range(3)]
        self.run(2)  # compile and warm up

    def run(self, steps: int) -> float:
        """Seconds per step over `steps` steps."""
        start = time.perf_counter()
        for i in range(steps):
            self.state, m = self.step(self.state, {"inputs": self.batches[i % 3], "targets": self.batches[(i + 1) % 3]})
        jax.block_until_ready(m)
        return (time.perf_counter() - start) / steps


COLLECTIVE = re.compile(r"= \(?((?:[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?,? ?)+)\)?[^=\n]*? "
                        r"(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)(?:-start)?\(")
BYTES = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "f16": 2, "pred": 1, "s8": 1, "u8": 1}


def collectives(cfg: config_lib.Config) -> dict[str, tuple[int, int]]:
    """op -> (count, bytes of their results per device) in the compiled train step."""
    run = run_lib.setup(cfg, jax.devices(), data=False)
    step = step_lib.make_train_step(run.cfg, run.optimizer, run.mesh, run.abstract_state, run.act_rules)
    hlo = step.lower(*step_lib.step_args(run).values()).compile().as_text()
    out: dict[str, tuple[int, int]] = {}
    for shapes, op in COLLECTIVE.findall(hlo):
        size = sum(BYTES.get(t, 4) * math.prod(int(d) for d in dims.split(",") if d)
                   for t, dims in re.findall(r"([a-z0-9]+)\[([0-9,]*)\]", shapes))
        n, b = out.get(op, (0, 0))
        out[op] = (n + 1, b + size)
    return out


def report_collectives() -> None:
    base = config_lib.apply_overrides(models()["gpt2_124m"], {
        "mesh.ici_data": 1, "mesh.ici_fsdp": 4, "mesh.ici_tensor": 2, "training.batch_size": 8})
    found = {o: collectives(config_lib.apply_overrides(base, kw)) for o, kw in OPTIMIZERS.items() if o != "muon+qk_clip"}
    for o, ops in found.items():
        print(f"optimizer={o} " + " ".join(f"{op}={n}:{b / 2**20:.1f}MiB" for op, b in sorted(
            (op, b) for op, (n, b) in ops.items()) for n in [ops[op][0]]), flush=True)
    extra = sum(b for _, b in found["muon"].values()) - sum(b for _, b in found["adamw"].values())
    run = run_lib.setup(base, jax.devices(), data=False)
    views = optim.muon_matrices(run.specs)
    flat = {jax.tree_util.keystr(p): s for p, s in
            jax.tree_util.tree_flatten_with_path(run.specs, is_leaf=lambda x: hasattr(x, "axes"))[0]}
    gather = sum(4 * math.prod(flat[k].shape) * 7 / 8 for k in views)  # float32, 7/8 of it from other devices
    layouts = {k: optim.ns_layout(v, flat[k], run.mesh, run.param_rules) for k, v in views.items()}
    print(f"muon extra collective bytes per device {extra / 2**20:.1f} MiB; one all-gather of every Muon matrix "
          f"{gather / 2**20:.1f} MiB; Newton-Schulz layouts: " + ", ".join(
              f"{k.split('[')[-1][1:-2]} {tuple(lay[0].spec)}" for k, lay in layouts.items() if lay), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=0, help="steps per measurement (0: 20 quickstart, 2 gpt2_124m)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating measurements per optimizer (median)")
    ap.add_argument("--only", choices=list(models()))
    ap.add_argument("--collectives", action="store_true", help="count the sharded step's collectives instead")
    a = ap.parse_args()
    if a.collectives:
        return report_collectives()
    for name, base in models().items():
        if a.only not in (None, name):
            continue
        steps = a.steps or (20 if name == "quickstart" else 2)
        steppers = {o: Stepper(config_lib.apply_overrides(base, kw)) for o, kw in OPTIMIZERS.items()}
        times: dict[str, list[float]] = {o: [] for o in OPTIMIZERS}
        for _ in range(a.rounds):
            for o, s in steppers.items():
                times[o].append(s.run(steps))
        step_s = {o: statistics.median(v) for o, v in times.items()}
        tokens = steppers["adamw"].tokens
        for o in OPTIMIZERS:
            print(f"model={name} optimizer={o} tokens_per_step={tokens} step_s={step_s[o]:.4f} "
                  f"tok_per_s={tokens / step_s[o]:,.0f} over_adamw={step_s['adamw'] / step_s[o]:.3f}", flush=True)
        extra = step_s["muon"] - step_s["adamw"]
        per_token = step_s["adamw"] / tokens  # the AdamW step, all of it counted as growing with the batch
        guesses = " ".join(f"{n:,}:{(per_token * n) / (per_token * n + extra):.3f}" for n in
                           (tokens * 8, tokens * 64, 2 ** 19))
        print(f"model={name} muon_extra_s={extra:.4f} muon_over_adamw_extrapolated_at_tokens_per_step {guesses}",
              flush=True)


if __name__ == "__main__":
    main()
