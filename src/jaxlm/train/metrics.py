"""Peak FLOP/s of the chip (a table, or a matmul measured here), throughput and goodput accounting, and the
metric writers (metrics.jsonl, TensorBoard, Weights & Biases, progress bar). The model FLOPs per token that MFU
is computed from come from model/flops.py.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxlm import storage
from jaxlm.config import Config, ConfigError


def matmul_flops_per_second(n: int = 1024, dtype=jnp.float32, repeats: int = 10) -> float:
    """This machine's jitted n^3 matmul rate (best of `repeats`) for operands of `dtype` accumulated in
    float32, the way every model matmul runs (layers.dot): the yardstick for model FLOP/s on a CPU."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    f = jax.jit(lambda x: jnp.matmul(x, x, preferred_element_type=jnp.float32).astype(dtype))
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n ** 3 / best


# Dense (not sparse) peak FLOP/s per chip from the vendors' spec sheets: (device_kind substring, bf16, fp32).
# The fp32 figure is what JAX's default matmul precision runs float32 at: one bf16 pass on TPU, TF32 on
# NVIDIA GPUs since Ampere. First match wins, so "v5 lite" must precede "v5".
PEAK_FLOPS = [
    ("TPU v6 lite", 918e12, 918e12),  # v6e (Trillium)
    ("TPU v6e", 918e12, 918e12),
    ("TPU v5 lite", 197e12, 197e12),  # v5e
    ("TPU v5e", 197e12, 197e12),
    ("TPU v5p", 459e12, 459e12),
    ("TPU v5", 459e12, 459e12),
    ("TPU v4", 275e12, 275e12),
    ("B200", 2250e12, 1100e12),
    ("H200", 989e12, 494.5e12),
    ("H100", 989e12, 494.5e12),  # SXM; the PCIe card is slower, so its MFU reads low
    ("A100", 312e12, 156e12),
]


def peak_flops_per_device(device: jax.Device, compute_dtype: str, n_local_devices: int) -> tuple[float, str]:
    """(peak FLOP/s of one device for `compute_dtype` matmuls, where the figure comes from). Chips not in
    PEAK_FLOPS, and every CPU, are measured once with a jitted matmul; fake CPU devices share one host's
    cores, so each is given an equal share of the host's rate."""
    kind = device.device_kind
    for name, bf16, fp32 in PEAK_FLOPS:
        if device.platform != "cpu" and name.lower() in kind.lower():
            return (bf16 if compute_dtype == "bfloat16" else fp32), f"{kind}, {compute_dtype} spec sheet"
    measured = matmul_flops_per_second(dtype=jnp.dtype(compute_dtype))
    share = n_local_devices if device.platform == "cpu" else 1
    where = f"{kind}: jitted {compute_dtype} matmul measured here" + (f", / {share} devices" if share > 1 else "")
    return measured / share, where


class Throughput:
    """Turns (steps, seconds) of a timing window into the figures each logged step records."""

    def __init__(self, tokens_per_step: int, flops_per_step: float, n_devices: int, peak_per_device: float):
        self.tokens_per_step, self.flops_per_step = tokens_per_step, flops_per_step
        self.n_devices, self.peak_per_device = n_devices, peak_per_device

    def window(self, steps: int, seconds: float) -> dict:
        tokens_per_s = self.tokens_per_step * steps / seconds
        flops_per_device = self.flops_per_step * steps / seconds / self.n_devices
        return {"step_time_s": seconds / steps, "tokens_per_s": tokens_per_s,
                "tokens_per_s_per_device": tokens_per_s / self.n_devices,
                "tflops_per_s": flops_per_device * self.n_devices / 1e12,
                "tflops_per_s_per_device": flops_per_device / 1e12,
                "mfu": flops_per_device / self.peak_per_device}


class Goodput:
    """Splits this process's wall time into buckets that sum to it: init (setup, state init or restore),
    compile (the first step), data (loading and transferring batches), compute (train steps, including
    waiting for their results), checkpoint, eval (evaluation and the final sample), and other (logging,
    host overhead: whatever no bucket claimed)."""

    BUCKETS = ("init", "compile", "data", "compute", "checkpoint", "eval")

    def __init__(self):
        self.start = time.perf_counter()
        self.seconds = dict.fromkeys(self.BUCKETS, 0.0)

    @contextlib.contextmanager
    def phase(self, bucket: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[bucket] += time.perf_counter() - t

    def charge_unaccounted(self, bucket: str) -> None:
        """Give `bucket` all the wall time so far that no phase claimed (for init, which spans many calls)."""
        self.seconds[bucket] += time.perf_counter() - self.start - sum(self.seconds.values())

    def summary(self) -> dict:
        wall = time.perf_counter() - self.start
        out = {f"goodput_{b}_s": s for b, s in self.seconds.items()}
        out["goodput_other_s"] = wall - sum(self.seconds.values())
        out["goodput_wall_s"] = wall
        out["goodput"] = self.seconds["compute"] / wall
        return out

    @staticmethod
    def describe(summary: dict) -> str:
        wall = summary["goodput_wall_s"]
        parts = [f"{b} {summary[f'goodput_{b}_s']:.1f} s ({100 * summary[f'goodput_{b}_s'] / wall:.0f}%)"
                 for b in (*Goodput.BUCKETS, "other")]
        return f"time {wall:.1f} s: " + ", ".join(parts)


def require_wandb() -> None:
    try:
        import wandb  # noqa: F401 - only whether it imports matters here
    except ImportError:
        raise ConfigError("logging.wandb=true needs the wandb package: pip install 'jaxlm[wandb]' "
                          "(or set logging.wandb=false)") from None


def start_wandb(cfg: Config, run_dir: Path):
    """Start the run's Weights & Biases run, or continue it: its id is kept in <run_dir>/wandb_id, so a
    resumed run directory logs into the same W&B run. WANDB_MODE=offline works as usual."""
    import secrets

    import wandb

    id_file = run_dir / "wandb_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(6)
    id_file.write_text(run_id + "\n")
    lc = cfg.logging
    return wandb.init(project=lc.wandb_project, entity=lc.wandb_entity, name=lc.wandb_run_name or run_dir.name,
                      id=run_id, resume="allow", dir=str(run_dir), config=cfg.to_dict())


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported without torch: tensorboardX imports torch on import when it is
    installed (about 3 s here) only to accept torch tensors, and jaxlm writes Python numbers. Once torch is loaded
    (by the caller), tensorboardX sees it as usual."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX handles
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class MetricWriter:
    """Appends one JSON record per step to metrics.jsonl and mirrors its numbers to TensorBoard and,
    when given a started run, to Weights & Biases."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, enabled: bool = True, wandb_run=None):
        self.enabled = enabled
        self._mirror = storage.Mirror(run_dir) if enabled else None  # run_dir itself, or a cache of a URL's files
        self._jsonl = open(self._mirror.dir / "metrics.jsonl", "a") if enabled else None
        self._tb = None
        self._wandb = wandb_run if enabled else None
        if enabled and tensorboard:
            self._tb = _summary_writer_class()(str(self._mirror.dir / "tensorboard"))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        step = record["step"]
        scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def append(self, name: str, records: list[dict]) -> None:
        """Records appended to another jsonl file of the run directory (e.g. GRPO's completions.jsonl)."""
        if self.enabled and records:
            with open(self._mirror.dir / name, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in records))

    def flush(self) -> None:
        if self.enabled:
            self._jsonl.flush()
            if self._tb is not None:
                self._tb.flush()
            self._mirror.sync()

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            if self._tb is not None:
                self._tb.close()
            if self._wandb is not None:
                self._wandb.finish()
            self._mirror.close()


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
