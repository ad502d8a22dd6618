"""Pipeline parallelism: the bubble of the schedule the code runs, and step times on 8 fake CPU devices.

Prints, for a few (stages S, micro-batches M, repeats R):
    stages=S microbatches=M repeats=R bubble_frac=X theory=Y
X: the fraction of stage-steps that hold no micro-batch in `model.pipeline.schedule(S, M, R)`, the table the
forward pass's loop runs; Y = (S-1)/(M+S-1), GPipe's bubble. A circular schedule (R > 1) comes in under Y.
Then the median train-step time of a small model on 8 fake CPU devices for a few layouts, against the same
step without a pipeline (data parallelism over the 8 devices). Fake devices share this machine's cores, so
the times say what the schedule costs in compute and copies, not what real chips would gain.
With --equality, also the largest relative difference of 20 steps' losses from the 1-device run per layout.

    python benchmarks/pipeline.py [--steps N] [--equality]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxlm import config as config_lib
from jaxlm.train import batches as batch_lib, run as run_lib, state as state_lib, step as step_lib  # noqa: E402
from jaxlm.model import pipeline  # noqa: E402

SCHEDULES = [(2, 2, 1), (2, 8, 1), (4, 4, 1), (4, 16, 1), (4, 4, 2), (4, 4, 4), (8, 8, 1), (8, 8, 2)]
LAYOUTS = {
    "data8 (no pipeline)": {"mesh.ici_data": 8},
    "stage2 x data4": {"mesh.ici_data": 4, "mesh.ici_stage": 2},
    "stage2 x data4, circular R=2": {"mesh.ici_data": 4, "mesh.ici_stage": 2, "training.pipeline_repeats": 2},
    "stage4 x data2": {"mesh.ici_data": 2, "mesh.ici_stage": 4},
    "stage4 x data2, circular R=2": {"mesh.ici_data": 2, "mesh.ici_stage": 4, "training.pipeline_repeats": 2},
    "stage2 x fsdp2 x data2, M=4": {"mesh.ici_data": 2, "mesh.ici_fsdp": 2, "mesh.ici_stage": 2,
                                    "training.pipeline_microbatches": 4},
}


def config(layout: dict, batch: int) -> config_lib.Config:
    return config_lib.apply_overrides(config_lib.Config(), {
        "model.vocab_size": 128, "model.block_size": 64, "model.n_layers": 8, "model.d_model": 64,
        "model.n_heads": 4, "training.batch_size": batch, "logging.progress": False, **layout})


def losses_and_times(layout: dict, devices, steps: int, batch: int = 16) -> tuple[np.ndarray, float]:
    run = run_lib.setup(config(layout, batch), devices, data=False)
    state = state_lib.init_state(run, 0)
    step = step_lib.make_train_step(run.cfg, run.optimizer, run.mesh, run.abstract_state, run.act_rules)
    rng = np.random.default_rng(0)
    losses, times = [], []
    for _ in range(steps):
        tokens = rng.integers(0, 128, size=(1, batch, 65)).astype(np.int32)
        x, y = (batch_lib.put_batch(run.mesh, a, 1, run.act_rules) for a in (tokens[..., :-1], tokens[..., 1:]))
        start = time.perf_counter()
        state, m = step(state, {"inputs": x, "targets": y})
        losses.append(float(m["loss"]))
        times.append(time.perf_counter() - start)
    return np.array(losses), float(np.median(times[2:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--equality", action="store_true")
    args = parser.parse_args()
    for S, M, R in SCHEDULES:
        print(f"stages={S} microbatches={M} repeats={R} "
              f"bubble_frac={pipeline.bubble_fraction(pipeline.schedule(S, M, R)):.4f} "
              f"theory={(S - 1) / (M + S - 1):.4f}", flush=True)
    reference = losses_and_times({"mesh.ici_data": 1}, jax.devices()[:1], 20)[0] if args.equality else None
    base = None
    for name, layout in LAYOUTS.items():
        losses, seconds = losses_and_times(layout, jax.devices(), max(args.steps, 20 if args.equality else 0))
        base = base or seconds
        line = f"layout={name!r} step_ms={seconds * 1e3:.1f} vs_unpipelined={seconds / base:.2f}"
        if reference is not None:
            line += f" max_rel_loss_diff_20_steps={np.max(np.abs(losses - reference) / reference):.2e}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
