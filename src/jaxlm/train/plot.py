"""`jaxlm plot RUN_DIR [RUN_DIR ...]`: one PNG with the loss, validation loss and throughput curves of
one or more runs, read from their metrics.jsonl (a resumed run's re-recorded steps keep the last value)."""

from __future__ import annotations

import json
from pathlib import Path

from jaxlm import storage
from jaxlm.data.errors import DataError


def read_run(run_dir: str | Path) -> dict[str, dict[int, float]]:
    """{metric: {step: value}} for every numeric metric of a run (a path or URL), the last record of a step
    winning."""
    path = storage.join(run_dir, "metrics.jsonl")
    if not storage.exists(path):
        raise DataError(f"{path} not found; is {run_dir} a jaxlm run directory?")
    series: dict[str, dict[int, float]] = {}
    for n, line in enumerate(storage.read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError):
            raise DataError(f"{path}:{n} is not a metrics record (a JSON object with a step)") from None
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                series.setdefault(k, {})[step] = float(v)
    if "loss" not in series:
        raise DataError(f"{path} holds no training loss yet")
    return series


def smooth(values: list[float]) -> list[float]:
    """Centered moving average over about 2% of the run (no lag, unlike an EMA on a short run)."""
    h = len(values) // 100
    c = [0.0]
    for v in values:
        c.append(c[-1] + v)
    return [(c[min(len(values), i + h + 1)] - c[max(0, i - h)]) / (min(len(values), i + h + 1) - max(0, i - h))
            for i in range(len(values))]


def plot(run_dirs: list[str | Path], out: str | Path) -> Path:
    """Write the PNG: loss (raw, faint, and smoothed) with validation loss; tokens/s; MFU."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    runs = [(str(d), read_run(d)) for d in run_dirs]
    fig, (ax_loss, ax_tok, ax_mfu) = plt.subplots(1, 3, figsize=(16, 4.5))
    for i, (run_dir, s) in enumerate(runs):
        color, label = f"C{i % 10}", run_dir.rstrip("/").rsplit("/", 1)[-1] or run_dir
        steps = sorted(s["loss"])
        loss = [s["loss"][k] for k in steps]
        ax_loss.plot(steps, loss, color=color, alpha=0.25, linewidth=0.8)
        ax_loss.plot(steps, smooth(loss), color=color, label=f"{label} train")
        if "val_loss" in s:
            vs = sorted(s["val_loss"])
            ax_loss.plot(vs, [s["val_loss"][k] for k in vs], "o--", color=color, label=f"{label} val")
        if "tokens_per_s" in s:
            ts = sorted(s["tokens_per_s"])
            ax_tok.plot(ts, [s["tokens_per_s"][k] for k in ts], ".-", color=color, label=label)
        if "mfu" in s:
            ms = sorted(s["mfu"])
            ax_mfu.plot(ms, [100 * s["mfu"][k] for k in ms], ".-", color=color, label=label)
    for ax, title, ylabel in ((ax_loss, "loss (smoothed; faint: every step)", "cross-entropy (nats)"),
                              (ax_tok, "throughput", "tokens/s (all devices)"),
                              (ax_mfu, "model FLOPs utilization", "MFU (%)")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
