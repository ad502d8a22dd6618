"""Training throughput of jaxlm's own train step, as a fraction of this machine's jitted float32 matmul rate
measured in the same run.

Prints one line per configuration:  config=NAME tok_per_s=X model_flops_frac=Y matmul_f32_gflops=P
(P: the best matmul rate seen so far in this run, measured before and again after each configuration)
Model FLOPs per token: 6 * N (N = parameters other than the token/position embedding tables) plus
12 * layers * width * block for attention (forward + backward, full square, as nanoGPT counts it).
The step is the one `jaxlm train` runs (same jit, donation, optimizer), fed random tokens.

    python benchmarks/train_throughput.py [--steps N] [--only NAME]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import numpy as np

from jaxlm import config as config_lib, runtime
from jaxlm.model import flops
from jaxlm.train import batches as batch_lib, metrics, run as run_lib, state as state_lib, step as step_lib


def configs() -> dict[str, config_lib.Config]:
    cpu = config_lib.load("shakespeare_char_cpu")
    cpu = cpu.replace(model=dataclasses.replace(cpu.model, vocab_size=65))
    gpt2 = config_lib.load("openwebtext")
    gpt2 = gpt2.replace(model=dataclasses.replace(gpt2.model, block_size=256, compute_dtype="float32"),
                        training=dataclasses.replace(gpt2.training, batch_size=4, grad_accum=1))
    return {"shakespeare_char_cpu": cpu, "gpt2_124m_block256": gpt2}


def measure(cfg: config_lib.Config, steps: int, warmup: int = 3) -> float:
    """Tokens per second of the jitted, donated train step over `steps` steps after `warmup`."""
    run = run_lib.setup(cfg, None, data=False)  # the vocabulary is set, so no corpus is read
    cfg, mesh = run.cfg, run.mesh
    state = state_lib.init_state(run, cfg.seed)
    step = step_lib.make_train_step(cfg, run.optimizer, mesh, run.abstract_state, run.act_rules)
    t = cfg.training
    rng = np.random.default_rng(0)
    shape = (t.grad_accum, t.batch_size, cfg.model.block_size)
    batches = [batch_lib.put_batch(mesh, rng.integers(0, cfg.model.vocab_size, shape).astype(np.int32), 1)
               for _ in range(4)]
    for i in range(warmup):
        state, m = step(state, {"inputs": batches[i % 4], "targets": batches[(i + 1) % 4]})
    jax.block_until_ready(m)
    start = time.perf_counter()
    for i in range(steps):
        state, m = step(state, {"inputs": batches[i % 4], "targets": batches[(i + 1) % 4]})
    jax.block_until_ready(m)
    return steps * int(np.prod(shape)) / (time.perf_counter() - start)


def matmul_peak() -> float:
    """The machine's float32 matmul rate: the best of square matmuls of several sizes, so that a size that
    happens to suit this cache hierarchy badly does not flatter the model's fraction."""
    return max(metrics.matmul_flops_per_second(n, repeats=20) for n in (512, 1024, 2048))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=0, help="timed steps per config (default: about 10 s each)")
    ap.add_argument("--only", help="run one configuration")
    args = ap.parse_args()
    if runtime.platform() == "cpu":
        runtime.tune_for_xla_cpu()  # as `jaxlm train` does; the matmul yardstick gets the same allocator
    peak = matmul_peak()
    print(f"matmul_f32_gflops={peak / 1e9:.1f} devices={jax.device_count()} platform={jax.devices()[0].platform}")
    for name, cfg in configs().items():
        if args.only and name != args.only:
            continue
        steps = args.steps
        if not steps:
            probe = measure(cfg, 3, warmup=2)
            tokens = cfg.training.batch_size * cfg.training.grad_accum * cfg.model.block_size
            steps = max(3, int(10.0 * probe / tokens))
        tok_s = measure(cfg, steps)
        peak = max(peak, matmul_peak())  # measured again next to this config's run; the higher figure counts
        frac = tok_s * flops.flops_per_token(cfg.model) / peak
        print(f"config={name} tok_per_s={tok_s:.0f} model_flops_frac={frac:.3f} matmul_f32_gflops={peak / 1e9:.1f}",
              flush=True)


if __name__ == "__main__":
    main()
