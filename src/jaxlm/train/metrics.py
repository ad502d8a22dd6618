"""Model FLOPs, peak FLOP/s of the chip (a table, or a matmul measured here), throughput and goodput
accounting, and the metric writers (metrics.jsonl, TensorBoard, Weights & Biases, progress bar).

Model FLOPs per token (forward + backward, the figure MFU is computed from) are counted from the config:
6 FLOPs per weight of every matmul a token goes through (attention projections, latent attention's included;
the router, shared experts and experts_per_token of the routed experts, or the dense MLP; the output
projection, tied to the token embedding or not; multi-token prediction modules; norms, biases and the
embedding lookup are not matmuls) plus the attention scores and the weighted sum of values, 12 * layers *
heads * head_dim * block_size for the full square as nanoGPT counts it, or half that when only the causal
triangle is counted (`causal=True`, what jaxlm prints); local and chunked layers count their band of keys.

Shape legend: T block length, L layers, D model width, N query heads, K key/value heads, H head width,
F MLP hidden width, V vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxlm import storage
from jaxlm.config import Config, ConfigError, ModelConfig


def non_embedding_params(cfg: ModelConfig) -> int:
    """Parameters other than the token and position embedding tables (`--print-params`, model scaling)."""
    from jaxlm import params as P
    from jaxlm.model import param_specs

    return P.count(param_specs(cfg), exclude=lambda path: path.startswith("['embed']"))


# The leaves of the weights tree that a token multiplies by (the rest: norms, biases, sinks, balancing biases,
# learned positions); the experts' own are counted experts_per_token / n_experts of the time.
MATMUL_LEAVES = ("q", "k", "v", "o", "q_a", "q_b", "kv_a", "k_rope", "k_b", "v_b", "up", "gate", "down",
                 "shared_up", "shared_gate", "shared_down", "router", "proj", "lm_head")
EXPERT_LEAVES = ("up", "gate", "down", "up_bias", "gate_bias", "down_bias")


def _leaves(specs) -> list[tuple[list[str], tuple[int, ...]]]:
    from jaxlm import params as P

    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=P.is_spec)[0]
    return [([k.key for k in path], s.shape) for path, s in flat]


def _is_expert(path: list[str], specs) -> bool:
    """An experts' weight: under an MLP whose weights include a router."""
    node = specs
    for k in path[:-1]:
        node = node[k]
    return path[-1] in EXPERT_LEAVES and "router" in node


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """total: the model's weights (the multi-token prediction modules apart, as the families publish them);
    active: those one token uses, the routed experts counted experts_per_token of n_experts (Meta's and
    Qwen's convention); active_matmul: active without the input embedding table when it is not also the
    output projection (a token reads one row of it: OpenAI's and DeepSeek's convention); embedding: the token
    table; non_embedding: total without the token table and the output projection; mtp: the multi-token
    prediction modules."""
    from jaxlm.model import param_specs

    specs = param_specs(cfg)
    out = {"total": 0, "active": 0, "embedding": 0, "mtp": 0}
    for path, shape in _leaves(specs):
        n = math.prod(shape)
        if path[0] == "mtp":
            out["mtp"] += n
            continue
        out["total"] += n
        out["active"] += n * cfg.experts_per_token // cfg.n_experts if _is_expert(path, specs) else n
        if path[:2] == ["embed", "tokens"]:
            out["embedding"] += n
    out["active_matmul"] = out["active"] - (0 if cfg.tie_embeddings else out["embedding"])
    out["non_embedding"] = out["total"] - out["embedding"] - (0 if cfg.tie_embeddings else cfg.d_model * cfg.vocab_size)
    return out


def matmul_weights(cfg: ModelConfig) -> int:
    """Weights that take part in a matmul for every token: per layer the attention projections (latent
    attention's included), the router, shared experts and experts_per_token of the routed experts (or the
    dense MLP), plus the output projection (counted whether or not it shares its table with the token
    embedding) and, with multi-token prediction, its modules (they run in every training step)."""
    from jaxlm.model import param_specs

    specs = param_specs(cfg)
    total = 0
    for path, shape in _leaves(specs):
        n = math.prod(shape)
        if path[-1] in MATMUL_LEAVES or (path[:2] == ["embed", "tokens"] and cfg.tie_embeddings):
            total += n * cfg.experts_per_token // cfg.n_experts if _is_expert(path, specs) else n
    return total + cfg.mtp_layers * cfg.d_model * cfg.vocab_size  # the MTP modules share the output projection


def attention_keys(cfg: ModelConfig, causal: bool) -> float:
    """Keys a query attends to, summed over the layers (and the MTP modules' global ones): block_size for
    global layers (half with `causal`), the window or chunk for local and chunked ones (all of their band)."""
    from jaxlm.model import stack

    T = cfg.block_size
    total = 0.0
    for kind in stack.layout(cfg).kinds + (stack.Kind("global", False),) * cfg.mtp_layers:
        band = {"local": cfg.sliding_window, "chunked": cfg.attention_chunk}.get(kind.attention)
        total += min(band, T) if band else (T / 2 if causal else T)
    return total


def flops_per_token(cfg: ModelConfig, causal: bool = False) -> float:
    """Training FLOPs (forward + backward) per token: 6 per matmul weight (matmul_weights) plus the attention
    scores and weighted values, 6 * heads * (query-key width + value width) per key a query attends to
    (12 * layers * heads * head_dim * block_size for the full square, as nanoGPT's estimate_mfu counts it).
    The default counts full-square global attention; `causal=True` counts half of it, the work a causal model
    needs, and is what `jaxlm train` reports. Local and chunked layers count their band."""
    attention = 6.0 * cfg.n_heads * (cfg.qk_dim + cfg.v_dim) * attention_keys(cfg, causal)
    return 6.0 * matmul_weights(cfg) + attention


def describe_model(cfg: ModelConfig) -> list[str]:
    """`jaxlm describe`: parameter counts (total, active per token both ways, embedding, MTP modules), the
    layer layout, training FLOPs per token and KV-cache bytes per token, one line each."""
    from jaxlm.model import kvcache, stack

    c = param_counts(cfg)
    lay = stack.layout(cfg)
    n_moe = sum(k.moe for k in lay.kinds)
    lines = [f"parameters {c['total']:,} total ({c['total'] / 1e9:.3g}B), active per token {c['active']:,} "
             f"({c['active'] / 1e9:.3g}B; {c['active_matmul']:,} = {c['active_matmul'] / 1e9:.3g}B without the "
             f"input embedding table), embedding {c['embedding']:,}"
             + (f", multi-token prediction modules {c['mtp']:,} more" if c["mtp"] else ""),
             f"layers {cfg.n_layers} ({'; '.join(_layer_summary(lay))}), width {cfg.d_model}, "
             + (f"latent attention (q rank {cfg.q_lora_rank}, kv rank {cfg.kv_lora_rank}) with {cfg.n_heads} heads"
                if cfg.latent else f"{cfg.n_heads} heads of {cfg.hd} ({cfg.kv_heads} kv)")
             + (f", {cfg.n_experts} experts of {cfg.expert_ff} (top {cfg.experts_per_token}"
                + (f", {cfg.n_shared_experts} shared" if cfg.n_shared_experts else "") + f") in {n_moe} layers"
                if n_moe else "") + f", MLP {cfg.ff}",
             f"training FLOPs per token at {cfg.block_size} tokens: {flops_per_token(cfg, causal=True):,.0f} "
             f"(causal attention counted as half)",
             f"KV cache per token of a long sequence: {kvcache.bytes_per_token(cfg):,} bytes in {cfg.compute_dtype}"
             + _cache_comparison(cfg)]
    return lines


def _cache_comparison(cfg: ModelConfig) -> str:
    """For latent attention: what the same heads' keys and values would take, and a GQA model of the same
    width with 8 kv heads of the value width."""
    if not cfg.latent:
        return ""
    from jaxlm.model import kvcache

    itemsize = jnp.dtype(cfg.compute_dtype).itemsize
    heads = cfg.n_layers * cfg.n_heads * (cfg.qk_dim + cfg.v_dim) * itemsize
    gqa = kvcache.bytes_per_token(dataclasses.replace(cfg, kv_lora_rank=0, q_lora_rank=0, n_kv_heads=8,
                                                      head_dim=cfg.v_head_dim))
    return (f" (latent {cfg.kv_lora_rank} + rotary key {cfg.qk_rope_head_dim} per layer; the heads' own keys and "
            f"values would take {heads:,}, a GQA model with 8 kv heads of {cfg.v_head_dim} {gqa:,})")


def _layer_summary(lay) -> list[str]:
    runs = []
    for kind in lay.kinds:
        name = kind.attention + (" MoE" if kind.moe else "")
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    if len(runs) > 8:  # a long repeating pattern: say it once
        return [f"pattern {','.join(k.attention for k in lay.kinds[lay.start:lay.start + lay.G])} repeated"]
    return [f"{n} {name}" for name, n in runs]


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
