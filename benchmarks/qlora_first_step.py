"""The first QLoRA step of llama3.1-8b (nf4 base, rank-16 adapters on all seven projections) on this process's
device, for comparing the chip's bf16 step against the same step in float32 on a CPU:

    python benchmarks/qlora_first_step.py --json chip.json                         # the default device (a TPU)
    JAX_PLATFORMS=cpu python benchmarks/qlora_first_step.py --float32 --json cpu.json
    python benchmarks/qlora_first_step.py --compare chip.json cpu.json

The base is tpu_sections.random_frozen's: random, realistic in scale, and the same in both processes bit for bit. The adapters
start as LoRA starts them (B = 0), so the first step's loss is the base's; the batch is Python's standard library
source (bytes), as the lora rows of benchmarks/tpu.py use. Prints the loss and the adapters' gradient norm.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

TOLERANCE = 1e-2  # the chip's first loss against the CPU's float32 one


def first_step(block: int, float32: bool, preset: str = "llama3_1_8b", extra: dict | None = None) -> dict:
    import jax
    import numpy as np

    from jaxlm import config as config_lib
    from jaxlm.train import run as run_lib, state as state_lib, step as step_lib
    import tpu_sections

    dtype = "float32" if float32 else "bfloat16"
    cfg = config_lib.load(preset, {"lora.rank": 16, "lora.base_quantization": "nf4",
                                          "model.compute_dtype": dtype, "training.batch_size": 1,
                                          "model.block_size": block, "optimizer.lr": 2e-4,
                                          "optimizer.warmup_steps": 5, **(extra or {})})
    dev = jax.devices()[0]
    t0 = time.perf_counter()
    run = run_lib.setup(cfg, [dev], data=False)
    compiled = step_lib.lower_train_step(run).compile()
    frozen = tpu_sections.random_frozen(run.abstract_frozen)
    state = state_lib.init_state(run, cfg.seed)
    batch = next(tpu_sections.text_batches(run, 1))
    if float32:
        with jax.default_matmul_precision("highest"):
            _, m = compiled(state, batch, frozen)
    else:
        _, m = compiled(state, batch, frozen)
    m = jax.device_get(m)
    return dict(preset=preset, platform=dev.platform, compute_dtype=dtype, block=block, loss=float(m["loss"]),
                grad_norm=float(m.get("grad_norm", np.nan)), seconds=round(time.perf_counter() - t0, 1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--float32", action="store_true", help="compute in float32 (the CPU reference)")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--preset", default="llama3_1_8b")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="settings over the preset's (a smaller "
                    "model to try the script)")
    ap.add_argument("--compare", nargs=2, metavar=("CHIP", "CPU"), help="compare two runs' files")
    a = ap.parse_args(argv)
    if a.compare:
        chip, cpu = (json.loads(Path(f).read_text()) for f in a.compare)
        diff = abs(chip["loss"] - cpu["loss"])
        print(f"first loss: {chip['platform']} {chip['compute_dtype']} {chip['loss']:.5f}, {cpu['platform']} "
              f"{cpu['compute_dtype']} {cpu['loss']:.5f}, difference {diff:.2e} (bound {TOLERANCE:g}); adapters' "
              f"gradient norm {chip['grad_norm']:.4g} vs {cpu['grad_norm']:.4g}")
        return 0 if diff <= TOLERANCE else 1
    out = first_step(a.block, a.float32, a.preset, dict(kv.split("=", 1) for kv in a.set))
    print(json.dumps(out))
    if a.json:
        Path(a.json).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
