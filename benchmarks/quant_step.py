"""Step time of quantized training and inference against float, measured in one run.

A mid-size layer stack (default 4 layers, 512 wide, 8 heads, block 256, batch 8, byte vocabulary) runs the
train step `jaxlm train` runs under each setting; the settings take turns for several rounds so that load
from other processes hits them alike, and each reports its median step time. Then the forward pass
(evaluation / generation) with float weights against int8-stored weights, and one bare matmul.

Prints lines of  kind=train|forward|matmul mode=NAME ms=X vs_float32=R  (R > 1: slower than float32).

    python benchmarks/quant_step.py [--rounds N] [--d-model D] [--layers L]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm import config as config_lib
from jaxlm.model import quant
from jaxlm.train import run as run_lib, state as state_lib, step as step_lib
from jaxlm.model import forward


def base_config(args) -> config_lib.Config:
    return config_lib.apply_overrides(config_lib.Config(), {
        "model.vocab_size": 256, "model.block_size": args.block, "model.n_layers": args.layers,
        "model.n_heads": args.d_model // 64, "model.d_model": args.d_model, "training.batch_size": args.batch,
        "mesh.ici_data": 1})


def train_runner(cfg: config_lib.Config, batches):
    run = run_lib.setup(cfg, jax.devices()[:1], data=False)  # the vocabulary is set, so no corpus is read
    cfg, mesh = run.cfg, run.mesh
    state = state_lib.init_state(run, cfg.seed)
    step = step_lib.make_train_step(cfg, run.optimizer, mesh, run.abstract_state, run.act_rules)
    params = jax.tree.map(jnp.copy, state["params"])  # the step donates the state it is given
    holder = {"state": state}

    def run_once():
        holder["state"], m = step(holder["state"], {"inputs": batches[0], "targets": batches[1]})
        jax.block_until_ready(m)

    return run_once, params


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="rounds of turns (each setting runs 2 steps a round)")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    base = base_config(args)
    dev = jax.devices()[0]
    print(f"platform={dev.platform} device={dev.device_kind} layers={args.layers} d_model={args.d_model} "
          f"block={args.block} batch={args.batch}")
    if note := quant.fp8_fallback_message(dev):
        print(f"note: {note}")

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (1, args.batch, args.block)).astype(np.int32)
    batches = (jnp.asarray(tokens), jnp.asarray(np.roll(tokens, -1, axis=-1)))
    settings = {"float32": {}, "bfloat16": {"compute_dtype": "bfloat16"}, "int8": {"quantization": "int8"},
                "int8_nearest": {"quantization": "int8", "quant_stochastic_rounding": False},
                "fp8": {"quantization": "fp8"}}
    runners, params = {}, None
    for name, kw in settings.items():
        cfg = base.replace(model=dataclasses.replace(base.model, **kw))
        runners[name], p = train_runner(cfg, batches)
        params = p if params is None else params
        runners[name]()  # compile
    times = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name, fn in runners.items():
            times[name] += timed(fn, 2)
    report("train", times)

    x_BT = batches[0][0]
    stored = quant.quantize_params(params, base.model)
    fwd = {"float32": (jax.jit(lambda p, x: forward(p, x, base.model)), params),
           "int8_weights": (jax.jit(lambda p, x: forward(p, x, base.model)), stored)}
    for fn, p in fwd.values():
        jax.block_until_ready(fn(p, x_BT))
    times = {name: [] for name in fwd}
    for _ in range(args.rounds):
        for name, (fn, p) in fwd.items():
            times[name] += timed(lambda: jax.block_until_ready(fn(p, x_BT)), 3)
    report("forward", times)
    print(f"weights_mib float32={quant.nbytes(params) / 2**20:.1f} int8_weights={quant.nbytes(stored) / 2**20:.1f}")

    n = 2048
    a = jax.random.normal(jax.random.key(0), (n, n))
    b = jax.random.normal(jax.random.key(1), (n, n))
    mm = {"float32": jax.jit(lambda a, b: jnp.einsum("MK,KN->MN", a, b)),
          "int8": jax.jit(lambda a, b: quant.quantized_einsum("MK,KN->MN", a, b, "int8", "int8")),
          "int8_dot_only": jax.jit(lambda a, b: jnp.einsum("MK,KN->MN", a, b, preferred_element_type=jnp.int32)),
          "fp8": jax.jit(lambda a, b: quant.quantized_einsum("MK,KN->MN", a, b, "e4m3", "e4m3"))}
    ops = {name: (a.astype(jnp.int8), b.astype(jnp.int8)) if name == "int8_dot_only" else (a, b) for name in mm}
    for name, fn in mm.items():
        jax.block_until_ready(fn(*ops[name]))
    times = {name: [] for name in mm}
    for _ in range(args.rounds):
        for name, fn in mm.items():
            times[name] += timed(lambda: jax.block_until_ready(fn(*ops[name])), 3)
    report(f"matmul_{n}", times)


def report(kind: str, times: dict[str, list[float]]) -> None:
    ref = statistics.median(times["float32"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"kind={kind} mode={name} ms={med * 1e3:.1f} vs_float32={med / ref:.2f}", flush=True)


if __name__ == "__main__":
    main()
