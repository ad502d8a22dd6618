"""The measurements of benchmarks/gpu.py, one function per section. gpu.py runs each section in a process of its
own (so that a section that fails, runs out of memory or overruns its time leaves the others alone, and each
starts with the whole device):

    python benchmarks/gpu_sections.py SECTION --results FILE --deadline UNIX_TIME [--tiny]

A section records its figures as it gets them, one JSON object a line in FILE, so a section stopped at its time
limit keeps what it measured; it checks the deadline before each piece of work and skips what no longer fits.
The figures are raw (tokens/s, FLOPs per token, bytes per token, seconds); gpu.py turns them into the summary
(MFU and bandwidth utilization against the yardsticks measured in the same run).

Sections: yardsticks (the device, a bf16 matmul, an HBM copy), train (the 1B model: batch that fills memory,
tokens/s, a profile's top operations, remat and attention variants), attention (cuDNN against blockwise),
precision (bf16 against float32, 100 steps), quant (int8 and fp8 training against bf16), decode (`jaxlm
generate`'s generate at batch 1 and 64), serve (the serving engine at concurrency 64).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import glob
import hashlib
import json
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import traceback

import numpy as np

# Remat and attention variants of the 1B step, in the order they run while time is left.
# Remat policies keeping more than `full` need more memory per sequence, so each runs at the batch its own memory
# allows: with the device's memory spent either way, the trade is recomputation against batch.
TRAIN_VARIANTS = [("attention=blockwise", {"attention": "blockwise"}), ("remat=minimal", {"remat": "minimal"}),
                  ("remat=save_dots", {"remat": "save_dots"}),
                  ("remat=save_qkv_out_proj", {"remat": "save_qkv_out_proj"}), ("remat=none", {"remat": "none"})]

# What each section runs at: "full" is sized for one H200 (141 GB, about 790 TFLOP/s of bf16 matmuls) and a budget
# of 7.4 minutes in all; "tiny" runs in seconds on a CPU, the same code at toy sizes.
SIZES = {
    "full": dict(
        matmul_n=8192, copy_bytes=4 << 30, yard_reps=10,
        train_model=dict(), train_block=8192, train_max_batch=64, train_memory_fraction=0.92, train_steps=2,
        profile_steps=1, variant_steps=1, train_variants=len(TRAIN_VARIANTS),
        attn_shape=dict(B=2, T=4096, N=32, K=8, H=64, window=1024),
        small_model=dict(n_layers=4, d_model=256, n_heads=4, n_kv_heads=2, d_ff=1024, vocab_size=256),
        small_block=128, small_batch=8, precision_steps=100,
        quant_model=dict(n_layers=8, d_model=1024, n_heads=16, n_kv_heads=4, d_ff=4096, vocab_size=256),
        quant_block=1024, quant_batch=8, quant_steps=200,
        decode_model=dict(), decode_prompt=128, decode_new=256, decode_batches=(1, 64),
        serve_concurrency=64, serve_prompt=128, serve_new=128),
    "tiny": dict(
        matmul_n=256, copy_bytes=16 << 20, yard_reps=3,
        train_model=dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=512),
        train_block=128, train_max_batch=4, train_budget_bytes=40 << 20, train_steps=2, profile_steps=1,
        variant_steps=1, train_variants=2, attn_shape=dict(B=1, T=64, N=4, K=2, H=32, window=16),
        small_model=dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=64),
        small_block=64, small_batch=4, precision_steps=10,
        quant_model=dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=64),
        quant_block=64, quant_batch=4, quant_steps=10,
        decode_model=dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=512),
        decode_prompt=16, decode_new=8, decode_batches=(1, 4),
        serve_concurrency=4, serve_prompt=16, serve_new=8),
}

# HBM bandwidth from the vendors' spec sheets, bytes/s (device_kind substring), for context beside the copy measured.
HBM_SPEC = [("H200", 4.8e12), ("H100", 3.35e12), ("B200", 8.0e12), ("A100", 2.0e12), ("TPU v5 lite", 8.19e11),
            ("TPU v6 lite", 1.64e12), ("TPU v5p", 2.765e12), ("TPU v4", 1.2e12)]


class Ctx:
    """Where a section writes its figures and how much time it has left."""

    def __init__(self, results: str, deadline: float, tiny: bool):
        self.results, self.deadline, self.tiny = results, deadline, tiny
        self.sizes = SIZES["tiny" if tiny else "full"]

    def put(self, **figures) -> None:
        with open(self.results, "a") as f:
            f.write(json.dumps(figures, default=_plain) + "\n")

    def left(self) -> float:
        return self.deadline - time.time()


def _plain(x):
    return x.item() if hasattr(x, "item") else str(x)


def one_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300]}" if text else type(e).__name__


def log(msg: str) -> None:
    print(f"[gpu] {msg}", file=sys.stderr, flush=True)


def block(x):
    import jax

    return jax.block_until_ready(x)


def best_rate(fn, work: float, reps: int, inner: int = 5) -> tuple[float, float]:
    """(best, median) of work / seconds per call over `reps` rounds of `inner` calls dispatched back to back."""
    block(fn())
    rates = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            out = fn()
        block(out)
        rates.append(work * inner / (time.perf_counter() - t))
    return max(rates), statistics.median(rates)


# ---- yardsticks ----------------------------------------------------------------------------------------------

def spec_peak(dev):
    """The device's bf16 peak from its spec sheet (FLOP/s), None on a CPU or a device not listed."""
    from jaxlm.train import metrics

    return next((bf16 for name, bf16, _ in metrics.PEAK_FLOPS if dev.platform != "cpu"
                 and name.lower() in dev.device_kind.lower()), None)


def yardsticks(ctx: Ctx) -> None:
    """The device, its spec-sheet peaks, and two ceilings measured here: a bf16 matmul (float32 accumulation, bf16
    result, as the model's matmuls run) and an HBM copy (bytes read plus written)."""
    import jax
    import jax.numpy as jnp
    import jaxlib

    z = ctx.sizes
    dev = jax.devices()[0]
    spec = spec_peak(dev)
    hbm = next((bw for name, bw in HBM_SPEC if dev.platform != "cpu" and name in dev.device_kind), None)
    stats = dev.memory_stats() or {}
    ctx.put(device=dev.device_kind, platform=dev.platform, devices=jax.device_count(), jax=jax.__version__,
            jaxlib=jaxlib.__version__, python=platform.python_version(), peak_bf16_spec=spec, hbm_spec=hbm,
            memory_limit_bytes=stats.get("bytes_limit"), sizes="tiny" if ctx.tiny else "full")
    n = z["matmul_n"]
    a, b = (jax.random.normal(jax.random.key(i), (n, n), jnp.bfloat16) for i in (0, 1))  # never zeros
    mm = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    best, med = best_rate(functools.partial(mm, a, b), 2.0 * n ** 3, z["yard_reps"])
    ctx.put(matmul_bf16=best, matmul_bf16_median=med, matmul_n=n)
    a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
    mm32 = jax.jit(lambda a, b: a @ b)  # JAX's default precision: TF32 on NVIDIA GPUs since Ampere
    ctx.put(matmul_f32=best_rate(functools.partial(mm32, a32, b32), 2.0 * n ** 3, z["yard_reps"])[0])
    del a, b, a32, b32
    x = jax.random.uniform(jax.random.key(2), (z["copy_bytes"] // 4,), jnp.float32)
    scale = jax.jit(lambda x: x * 1.5)  # reads every byte once and writes every byte once
    best, med = best_rate(lambda: scale(x), 2.0 * x.nbytes, z["yard_reps"])
    ctx.put(hbm_copy=best, hbm_copy_median=med, copy_bytes=x.nbytes)


# ---- train: the 1B model --------------------------------------------------------------------------------------

def train_config(z: dict, **model):
    """The Llama-3.2-1B-shaped step (preset llama3.2-1b: bf16 matmuls over float32 weights and Adam moments, full
    remat, attention auto, loss in chunks of 512), on one device, at z's sizes."""
    from jaxlm import config as config_lib

    cfg = config_lib.load("llama3.2-1b", {"mesh.ici_data": 1, "model.block_size": z["train_block"],
                                          **{f"model.{k}": v for k, v in {**z["train_model"], **model}.items()}})
    if cfg.model.rope_original_context > cfg.model.block_size:  # the tiny model: keep the scaling meaningful
        cfg = cfg.replace(model=dataclasses.replace(cfg.model, rope_original_context=cfg.model.block_size // 2))
    return cfg


def with_batch(cfg, batch: int):
    return cfg.replace(training=dataclasses.replace(cfg.training, batch_size=batch, per_device_batch_size=None))


def memory_bytes(compiled) -> int | None:
    """Bytes per device of a compiled step (jaxlm compile's total: arguments + outputs + temporaries + code -
    outputs aliased to donated arguments)."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            + m.generated_code_size_in_bytes - m.alias_size_in_bytes)


def compile_step(cfg, batch: int, device, quick: bool = False):
    """(run, compiled train step, bytes per device, seconds). `quick` turns XLA:GPU's autotuning off: enough for
    the memory analysis of the batch search, not for timing."""
    from jaxlm.train import run as run_lib, step as step_lib

    run = run_lib.setup(with_batch(cfg, batch), [device], data=False)
    t = time.perf_counter()
    lowered = step_lib.lower_train_step(run)
    compiled = None
    if quick and device.platform == "gpu":
        try:
            compiled = lowered.compile({"xla_gpu_autotune_level": 0})
        except Exception as e:  # noqa: BLE001 - an option this jaxlib lacks: compile as usual
            log(f"compile without autotuning failed ({one_line(e)}); compiling with it")
    if compiled is None:
        compiled = lowered.compile()
    return run, compiled, memory_bytes(compiled), time.perf_counter() - t


def random_batch(run, seed: int = 0) -> dict:
    """Random tokens for every array of the run's batch, placed as the compiled step expects them."""
    import jax

    from jaxlm.train import step as step_lib

    rng = np.random.default_rng(seed)
    out = {}
    for k, a in step_lib.abstract_batch(run).items():
        x = (rng.integers(0, run.cfg.model.vocab_size, a.shape).astype(np.int32) if a.dtype == np.int32
             else np.ones(a.shape, np.float32))
        out[k] = jax.device_put(x, a.sharding)
    return out


def time_steps(step, state, batch, steps: int, ctx: Ctx, reserve: float = 0.0):
    """(state, [seconds of each step]) after one untimed step; stops early when the next step would not leave
    `reserve` seconds before the deadline."""
    state, m = step(state, batch)
    block(m)
    times = []
    for _ in range(steps):
        if times and ctx.left() < reserve + 2 * max(times):
            break
        t = time.perf_counter()
        state, m = step(state, batch)
        block(m)
        times.append(time.perf_counter() - t)
    return state, times


def fitting_batch(batch: int, memory: int | None, budget: int | None, fixed: int) -> int:
    """The batch whose memory fits the budget, from a compile at `batch` that took `memory` bytes: the bytes above
    the batch-independent `fixed` part grow with the batch. `batch` itself when it fits or nothing is known; 0 when
    not even one sequence fits."""
    if not budget or not memory or memory <= budget:
        return batch
    per_sequence = max((memory - fixed) / batch, 1)
    return int(min(batch - 1, (budget - fixed) // per_sequence))


def fit_variant(cfg, batch: int, device, budget: int | None, fixed: int, quick_first: bool, compile=compile_step):
    """(batch, run, compiled, bytes, compile seconds, note): a variant of the step at the main step's batch, or at
    the smaller batch its own memory allows (a remat policy that keeps more than `full` needs more per sequence, so
    the trade is recomputation against batch). `quick_first` sizes it with a compile without autotuning, so the
    real compile runs once; the real compile's memory is checked again and the batch lowered at most once more.
    No program (None) and a note when not even one sequence fits."""
    b, secs, mem = batch, 0.0, None
    if quick_first:
        _, _, mem, secs = compile(cfg, b, device, quick=True)
        b = fitting_batch(b, mem, budget, fixed)
    measured = batch
    for _ in range(2):
        if b < 1:
            per_sequence = (mem - fixed) / measured
            return 0, None, None, mem, secs, (f"does not fit at batch 1 (about {(fixed + per_sequence) / 2**30:.2f} "
                                              f"GiB of {budget / 2**30:.2f})")
        run, compiled, mem, s = compile(cfg, b, device)
        secs += s
        measured, b = b, fitting_batch(b, mem, budget, fixed)
        if b == measured:
            break
    return measured, run, compiled, mem, secs, "" if b == measured else "over the memory budget after two compiles"


def train(ctx: Ctx) -> None:
    import jax

    from jaxlm import params as P
    from jaxlm.train import state as state_lib
    from jaxlm.model import attention, flops, param_specs

    z = ctx.sizes
    dev = jax.devices()[0]
    cfg = train_config(z)
    T = cfg.model.block_size
    ctx.put(train_model="llama3.2-1b shape" + (" (tiny)" if ctx.tiny else ""),
            train_params=P.count(param_specs(cfg.model)), train_block=T,
            train_flops_per_token=flops.flops_per_token(cfg.model, causal=True),
            train_attention=attention.describe(cfg.model, dev.platform), train_remat=cfg.model.remat)
    limit = (dev.memory_stats() or {}).get("bytes_limit")
    budget = int(limit * z["train_memory_fraction"]) if limit and not ctx.tiny else z.get("train_budget_bytes")
    ctx.put(train_budget_bytes=budget)

    # The batch that fills memory: two quick compiles give bytes per sequence (the step's memory is linear in the
    # batch), then the estimate is compiled for real and stepped down while the compiler says it does not fit.
    t0 = time.perf_counter()
    _, _, m1, s1 = compile_step(cfg, 1, dev, quick=True)
    if m1 is None or budget is None:
        batch, fixed, slope = 1, 0, 0
        ctx.put(train_search="no memory analysis on this backend: batch 1")
    else:
        if m1 > budget:
            raise RuntimeError(f"the step does not fit at batch 1: {m1 / 2**30:.1f} GiB of {budget / 2**30:.1f}")
        _, _, m2, s2 = compile_step(cfg, 2, dev, quick=True)
        slope = max(m2 - m1, 1)
        fixed = m1 - slope
        batch = int(max(1, min(z["train_max_batch"], (budget - fixed) // slope)))
        ctx.put(train_search=dict(batch1_bytes=m1, batch2_bytes=m2, per_sequence_bytes=slope, fixed_bytes=fixed,
                                  estimate=batch, quick_compile_s=[round(s1, 1), round(s2, 1)]))
    log(f"train: batch {batch} x {T} tokens (search {time.perf_counter() - t0:.0f} s)")
    runs = []

    def record(label, batch, times, mem, csec, note=""):
        tokens = batch * T
        step_s = statistics.median(times) if times else None
        runs.append(dict(label=label, batch=batch, tokens_per_step=tokens, step_s=step_s,
                         step_s_spread=[min(times), max(times)] if times else None,
                         tokens_per_s=tokens / step_s if step_s else None, bytes=mem, compile_s=csec, note=note))
        ctx.put(train_runs=runs)

    for attempt in range(3):
        run, compiled, mem, csec = compile_step(cfg, batch, dev)
        while budget and mem and mem > budget and batch > 1:
            batch = max(1, batch - math.ceil((mem - budget) / max(slope, 1)))
            run, compiled, mem, csec = compile_step(cfg, batch, dev)
        state = state_lib.init_state(run, cfg.seed)
        batch_arrays = random_batch(run)
        try:
            state, times = time_steps(compiled, state, batch_arrays, z["train_steps"], ctx, reserve=0.25 * ctx.left())
            break
        except Exception as e:  # noqa: BLE001 - the allocator's fragmentation: a smaller batch, at most twice
            if attempt == 2 or batch == 1 or not re.search("RESOURCE_EXHAUSTED|[Oo]ut of memory", str(e)):
                raise
            log(f"train: batch {batch} ran out of memory ({one_line(e)}); trying {max(1, batch * 4 // 5)}")
            state = batch_arrays = compiled = None
            batch = max(1, batch * 4 // 5)
    record("auto, remat=full (preset)", batch, times, mem, csec)
    main_step = statistics.median(times)

    try:
        state, breakdown = profile(compiled, state, batch_arrays, z["profile_steps"])
    except Exception as e:  # noqa: BLE001 - the breakdown is one figure of several; say why it is missing
        breakdown = cost_breakdown(compiled, f"trace unavailable: {one_line(e)}")
    ctx.put(train_breakdown=breakdown)

    # model.attention=cudnn is what auto runs on a GPU (and where cuDNN lacks a case both run blockwise): the
    # first row's program.
    impl = attention.choose(cfg.model, T, jax.numpy.bfloat16, False, dev.platform)
    record("attention=cudnn", batch, [], None, None, "skipped: not a GPU" if dev.platform != "gpu" else
           f"the first row's program (auto runs {impl} here)")
    for label, change in TRAIN_VARIANTS[:z["train_variants"]]:
        # A lower bound (XLA:GPU reuses the main compile's autotuning for the same matmul shapes): a variant that
        # starts and then overruns is stopped with the section, after every figure before it was recorded.
        need = 0.5 * csec + (1 + z["variant_steps"]) * main_step + 5
        if ctx.left() < need:
            record(label, batch, [], None, None, f"skipped: time budget ({ctx.left():.0f} s left, ~{need:.0f} needed)")
            continue
        try:
            b, vrun, vcomp, vmem, vsec, note = fit_variant(train_config(z, **change), batch, dev, budget, fixed,
                                                           quick_first="remat" in change and dev.platform == "gpu")
            if vcomp is None:
                record(label, batch, [], vmem, vsec, note)
                continue
            vbatch = batch_arrays if b == batch else random_batch(vrun)
            state, vtimes = time_steps(vcomp, state, vbatch, z["variant_steps"], ctx, reserve=5)
            record(label, b, vtimes, vmem, vsec, note)
            del vcomp, vbatch
        except Exception as e:  # noqa: BLE001 - one variant failing (out of memory, say) leaves the others
            record(label, batch, [], None, None, f"error: {one_line(e)}")
            state = state_lib.init_state(run, cfg.seed)  # a failed call may have consumed the donated state


# ---- the profile's top operations -----------------------------------------------------------------------------

def profile(compiled, state, batch, steps: int):
    """Trace `steps` steps with jax.profiler and attribute the device's time to the compiled program's operations."""
    import jax
    from jax.profiler import ProfileData

    folder = tempfile.mkdtemp(prefix="jaxlm_gpu_trace_")
    jax.profiler.start_trace(folder)
    try:
        for _ in range(steps):
            state, m = compiled(state, batch)
        block(m)
    finally:
        jax.profiler.stop_trace()
    files = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
    if not files:
        raise RuntimeError(f"the profiler wrote no .xplane.pb under {folder}")
    return state, breakdown_of(ProfileData.from_file(files[0]), hlo_index(compiled.as_text()), steps)


# Events on XLA:CPU's threads that are the runtime's own, not operations of the program
RUNTIME_EVENTS = ("ThunkExecutor", "SlinkyThreadPool", "ThreadpoolListener", "end: ", "MutexLock")


def hlo_index(text: str) -> dict[str, tuple[str, str, str]]:
    """Each instruction of the optimized HLO by name -> (kind, model scope, forward|backward), from its opcode,
    custom-call target or fusion backend, and its metadata's op_name (the jax.named_scope path)."""
    # Fused computations holding a matmul: a fusion that calls one is a matmul (XLA:TPU fuses every dot with what
    # surrounds it; its fusion line names no dot).
    with_dot, current = set(), None
    for line in text.splitlines():
        head = re.match(r"\s*%?([\w.\-]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$", line)
        if head and "=" not in line.split("{")[0]:
            current = head[1]
        elif current and re.search(r"\b(dot|convolution)\(", line):
            with_dot.add(current)
    out = {}
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)", line)
        if not m:
            continue
        name, rest = m.groups()
        op = re.search(r'op_name="([^"]*)"', rest)
        op_name = op[1] if op else ""
        calls = re.search(r"calls=%?([\w.\-]+)", rest)
        kind = ("matmul" if calls and calls[1] in with_dot and re.search(r"\bfusion\(", rest)
                else op_kind(re.sub(r"metadata=\{[^}]*\}", "", rest)))  # the op_name's "transpose(" is no opcode
        out[name] = (kind, op_scope(op_name), "backward" if "transpose(" in op_name else "forward")
    return out


def result_type(rest: str) -> str:
    """The result type of an HLO instruction's text after its name ("bf16[64,2048]{1,0} fusion(...)" ->
    "bf16[64,2048]"), layouts left out: what tells apart instructions of one name in different programs."""
    m = re.match(r"\s*(.*?)\s+[\w\-]+\(", re.sub(r"\{[^{}]*\}", "", rest))
    return m[1] if m else ""


def hlo_index_of(texts) -> dict[str, tuple[str, str, str]]:
    """hlo_index over several programs' optimized HLO (the serving engine's prefill and decode programs, generate's
    prefill and decode): each instruction keyed "name type" (result_type), which breakdown_of looks up first, and by
    its name alone where no two programs give that name different entries."""
    out, clashes = {}, set()
    for text in texts:
        types = {}
        for line in text.splitlines():
            if m := re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)", line):
                types[m[1]] = result_type(m[2])
        for name, entry in hlo_index(text).items():
            out[f"{name} {types.get(name, '')}"] = entry
            if out.setdefault(name, entry) != entry:
                clashes.add(name)
    for name in clashes:
        del out[name]
    return out


def op_kind(rest: str) -> str:
    if "cudnn" in rest and re.search("fmha|attention|flash", rest, re.I):
        return "attention kernel (cuDNN)"
    if "tpu_custom_call" in rest:
        return "Pallas kernel (TPU)"
    if re.search(r"__cublas|gemm|\bdot\(|convolution\(", rest):
        return "matmul"
    if "__ynn_fusion" in rest:
        return "XLA:CPU ynn fusion"
    if re.search(r"\b(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)", rest):
        return "collective"
    if re.search(r"\b(copy|transpose|copy-start|copy-done|dynamic-update-slice)\(", rest):
        return "copy / transpose"
    if re.search(r"\bfusion\(", rest):
        return "fusion (elementwise, reduce)"
    if re.search(r"\b(while|conditional|call)\(", rest):
        return "control flow"
    if "custom-call(" in rest:
        return "custom call"
    return "other"


def op_scope(op_name: str) -> str:
    parts = op_name.split("/")
    if any(p.endswith("_attention") for p in parts):
        return "attention kernel"
    if "attn_block" in parts or "attention" in parts:
        return "attention block (projections, rotary)"
    if "mlp_block" in parts:
        return "mlp"
    if "chunked_loss" in parts or "logits" in parts:
        return "logits + loss"
    if "embed" in parts:
        return "embedding"
    if "while" in parts:
        return "layers (other)"
    return "optimizer + other" if op_name else "unattributed"


def kernel_kind(name: str) -> str:
    """A GPU kernel's kind from its name, for events the HLO does not name."""
    low = name.lower()
    if "fmha" in low or "flash" in low or "cudnn" in low:
        return "attention kernel (cuDNN)"
    if "gemm" in low or "xmma" in low or "cutlass" in low or "matmul" in low:
        return "matmul"
    if "memcpy" in low or "copy" in low:
        return "copy / transpose"
    return "kernel"


def op_of(ev) -> str:
    """The HLO instruction an event ran: a GPU kernel's `hlo_op` stat where the trace has one, else its name."""
    for key, value in ev.stats:
        if key == "hlo_op" and value:
            return str(value)
    return ev.name


def self_times(events) -> dict[str, float]:
    """Nanoseconds of each operation on one line, less the time of the events nested in it (a while loop's
    event holds its body's operations on XLA:CPU's threads)."""
    out = collections.Counter()
    stack: list[tuple[float, str]] = []
    for ev in sorted(events, key=lambda e: (e.start_ns, -e.duration_ns)):
        while stack and stack[-1][0] <= ev.start_ns:
            stack.pop()
        if stack:
            out[stack[-1][1]] -= ev.duration_ns
        name = op_of(ev)
        out[name] += ev.duration_ns
        stack.append((ev.start_ns + ev.duration_ns, name))
    return out


def breakdown_of(data, index: dict, steps: int, top: int = 12) -> dict:
    planes = list(data.planes)
    gpu = [p for p in planes if p.name.startswith(("/device:GPU", "/device:TPU"))]
    if gpu:  # the derived "XLA Ops" line where the trace has it, else the kernels on every stream
        lines = list(gpu[0].lines)
        chosen = [ln for ln in lines if ln.name == "XLA Ops"] or [ln for ln in lines if ln.name.startswith("Stream")]
        source = (f"jax.profiler trace, {gpu[0].name} "
                  + ("XLA Ops" if chosen and chosen[0].name == "XLA Ops" else f"kernels on {len(chosen)} streams"))
    else:
        host = [p for p in planes if p.name == "/host:CPU"]
        chosen = [ln for ln in (host[0].lines if host else []) if ln.name.startswith("tf_XLA")]
        source = "jax.profiler trace, XLA:CPU threads (op time summed over threads)"
    times, texts, categories, stat_names = collections.Counter(), {}, {}, set()
    for ln in chosen:
        for ev in ln.events:  # a TPU op's category, where the trace names it (a fusion holding a matmul says so)
            for key, value in ev.stats:
                stat_names.add(key)
                if key == "hlo_category" and value:
                    categories.setdefault(op_key(op_of(ev), True), str(value))
        for name, ns in self_times(ln.events).items():
            if not name.startswith(RUNTIME_EVENTS):
                times[op_key(name, True)] += ns
                texts.setdefault(op_key(name, True), name.lstrip("%").partition(" = ")[2])
    total = sum(times.values())
    if not total:
        raise RuntimeError(f"no operation events in the trace (planes: {[p.name for p in planes]})")
    by_kind, by_scope, by_pass = collections.Counter(), collections.Counter(), collections.Counter()
    rows, others = [], []  # the top operations, and the top ones that are not matmuls (what tuning goes after)
    for (name, typ, operands), ns in times.most_common():
        text = texts[name, typ, operands]
        kind, scope, direction = (index.get(f"{name} {typ}") or index.get(name)
                                  or (category_kind(categories.get((name, typ, operands))) or trace_kind(name, text),
                                      "unattributed", "?"))
        by_kind[kind] += ns
        by_scope[scope] += ns
        by_pass[direction] += ns
        row = dict(op=name, kind=kind, scope=scope, type=typ, ms_per_step=ns / 1e6 / steps, share=ns / total)
        if len(rows) < top:
            rows.append(row)
        if kind != "matmul" and len(others) < 2 * top:
            others.append(dict(row, text=text[:300]))
    ms = lambda c: {k: round(v / 1e6 / steps, 3) for k, v in c.most_common()}  # noqa: E731
    return dict(source=source, ms_per_step=total / 1e6 / steps, top=rows, top_not_matmul=others, by_kind=ms(by_kind),
                by_scope=ms(by_scope), by_pass=ms(by_pass), event_stats=sorted(stat_names)[:40])


def op_key(event_name: str, operands: bool = False) -> tuple[str, ...]:
    """An operation of a trace as (instruction name, result type): a TPU's XLA Ops events are named by the whole
    instruction ("fusion.405 = bf16[...] fusion(...)"), and the programs of one trace (the serving engine's) reuse
    names, which the result type mostly tells apart; a name alone (a GPU kernel, XLA:CPU's events) has no type.
    `operands`: the operands' types as a third item, which tells apart the programs' instructions of one name and
    result (the engine's prefill and decode scatters into the same pool)."""
    op, _, text = event_name.lstrip("%").partition(" = ")
    if not operands:
        return op, result_type(text)
    inside = re.sub(r"\{[^{}]*\}", "", text).partition("(")[2]
    return op, result_type(text), " ".join(re.findall(r"\b[a-z]+\d*\[[\d,]*\]", inside))


def trace_kind(name: str, text: str) -> str:
    """The kind of an operation from its trace event alone (no HLO, no category): its instruction's text, or a
    kernel's name; a fusion named after a dot or convolution (XLA names a fusion by its root, "convolution_fusion.3")
    is a matmul, which the text of its fusion line does not show."""
    if not text:
        return kernel_kind(name)
    kind = op_kind(text)
    return "matmul" if kind == "fusion (elementwise, reduce)" and re.search(r"convolution|dot", name) else kind


def category_kind(category: str | None) -> str | None:
    """The kind of an operation from the trace's own category (a TPU's `hlo_category` stat), None where it has none:
    without the program's HLO (the serving engine runs several), a fusion's event text does not show the matmul
    inside it."""
    if not category:
        return None
    c = category.lower()
    if "convolution" in c or "dot" in c or "matmul" in c:
        return "matmul"
    if "custom" in c:
        return None  # a Pallas kernel: named by its text
    if "data formatting" in c or "copy" in c or "transpose" in c:
        return "copy / transpose"
    if "fusion" in c or "elementwise" in c or "reduce" in c:
        return "fusion (elementwise, reduce)"
    return None


def cost_breakdown(compiled, why: str) -> dict:
    """The compiler's cost analysis of the step, when no trace could be read: FLOPs and bytes accessed."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return dict(source=f"compiled.cost_analysis() ({why})", flops=cost.get("flops"),
                bytes_accessed=cost.get("bytes accessed"))


# ---- attention: cuDNN against blockwise -----------------------------------------------------------------------

def attention(ctx: Ctx) -> None:
    """cuDNN's flash attention against jaxlm's blockwise kernel, forward and gradients in bf16, for the cases the
    model runs: causal multi-head, causal grouped-query, a sliding window, packed segments. Each is also compared
    with the float32 dot_product reference (the scores materialized), which says how far bf16 alone moves them."""
    import jax
    import jax.numpy as jnp

    from jaxlm.config import ModelConfig
    from jaxlm.model import attention as attn

    s = ctx.sizes["attn_shape"]
    B, T, N, K, H, W = s["B"], s["T"], s["N"], s["K"], s["H"], s["window"]
    gpu = jax.devices()[0].platform == "gpu"
    cases = [("causal", N, None, False), ("causal_gqa", K, None, False), ("sliding_window_gqa", K, W, False),
             ("packed_segments_gqa", K, None, True)]
    results = {}
    for i, (label, kv, window, packed) in enumerate(cases):
        if ctx.left() < 10:
            results[label] = dict(note="skipped: time budget")
            ctx.put(attention_cases=results)
            continue
        keys = jax.random.split(jax.random.key(i), 4)
        q = jax.random.normal(keys[0], (B, T, N, H), jnp.bfloat16)
        k = jax.random.normal(keys[1], (B, T, kv, H), jnp.bfloat16)
        v = jax.random.normal(keys[2], (B, T, kv, H), jnp.bfloat16)
        g = jax.random.normal(keys[3], (B, T, N, H), jnp.bfloat16)
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        seg = None
        if packed:  # three documents a row, positions restarting at each, as packing writes them
            cuts = np.array([0, T // 3, T // 2 + T // 7, T])
            seg_np = np.searchsorted(cuts, np.arange(T), side="right").astype(np.int32) - 1
            seg = jnp.broadcast_to(jnp.asarray(seg_np), (B, T))
            pos = jnp.broadcast_to(jnp.asarray(np.arange(T) - cuts[seg_np], np.int32), (B, T))

        def run(impl, dtype):
            cfg = ModelConfig(vocab_size=8, block_size=T, n_heads=N, n_kv_heads=kv, head_dim=H, d_model=N * H,
                              attention=impl, sliding_window=window, compute_dtype="bfloat16")

            def f(q, k, v):
                return attn.self_attention(q, k, v, pos, seg, cfg, kind="global" if window is None else "local")

            def fwd_bwd(q, k, v, g):
                out, vjp = jax.vjp(f, q, k, v)
                return (out, *vjp(g.astype(out.dtype)))

            args = [x.astype(dtype) for x in (q, k, v, g)]
            lowered = jax.jit(fwd_bwd).lower(*args)
            compiled = lowered.compile()
            outs = [np.asarray(x, np.float32) for x in block(compiled(*args))]
            chosen = attn.choose(cfg, T, jnp.dtype(dtype), packed, jax.devices()[0].platform)
            calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', compiled.as_text())))
            return outs, chosen, calls

        def rel(a, b):
            return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))

        row = {}
        ref, _, _ = run("dot_product", jnp.float32)
        blk, _, _ = run("blockwise", jnp.bfloat16)
        row["blockwise_vs_f32"] = dict(out=rel(blk[0], ref[0]), grads=max(rel(a, b) for a, b in zip(blk[1:], ref[1:])))
        if not gpu:
            row["cudnn"] = "skipped: not a GPU"
        else:
            cud, chosen, calls = run("cudnn", jnp.bfloat16)
            fmha = any(re.search("fmha|attention|flash", c, re.I) for c in calls)
            if chosen != "cudnn":
                row["cudnn"] = (f"not run: jaxlm's cudnn path takes no segment ids, so attention.choose runs "
                                f"{chosen}" if packed else f"not run: attention.choose runs {chosen}")
            else:
                out_err = rel(cud[0], blk[0])
                grad_err = max(rel(a, b) for a, b in zip(cud[1:], blk[1:]))
                row["cudnn_vs_blockwise"] = dict(out=out_err, grads=grad_err)
                row["cudnn_vs_f32"] = dict(out=rel(cud[0], ref[0]),
                                           grads=max(rel(a, b) for a, b in zip(cud[1:], ref[1:])))
                row["cudnn_kernel_in_program"] = fmha
                row["custom_calls"] = calls
                if not fmha:
                    row["note"] = "no cuDNN attention call in the program; custom calls: " + (", ".join(calls) or "none")
                row["pass"] = bool(out_err <= ATTN_TOL["out"] and grad_err <= ATTN_TOL["grads"] and fmha)
        results[label] = row
        ctx.put(attention_cases=results, attention_shape=s, attention_tolerance=ATTN_TOL)


# bf16 tolerances, ||a - b|| / ||b||: bf16 rounds to 2^-9 relative; two kernels that round differently land a few
# 1e-3 apart on the output, more on gradients, which sum over the sequence.
ATTN_TOL = {"out": 1e-2, "grads": 2e-2}


# ---- precision: bf16 against float32 ----------------------------------------------------------------------------

def markov_tokens(vocab: int, rows: int, length: int, seed: int = 0, branching: int = 4) -> tuple[np.ndarray, float]:
    """Rows of a random first-order Markov chain (each token has `branching` successors with random probabilities):
    a corpus a small model learns within a hundred steps, the same on every machine. Also returns the chain's mean
    entropy per token (nats), the floor the loss tends to."""
    rng = np.random.default_rng(seed)
    succ = rng.integers(0, vocab, (vocab, branching))
    probs = rng.dirichlet(np.ones(branching), size=vocab)
    cum = np.cumsum(probs, axis=1)
    x = np.empty((rows, length), np.int32)
    x[:, 0] = rng.integers(0, vocab, rows)
    for t in range(1, length):
        j = np.minimum((cum[x[:, t - 1]] < rng.random(rows)[:, None]).sum(1), branching - 1)
        x[:, t] = succ[x[:, t - 1], j]
    return x, float(np.mean(-(probs * np.log(probs)).sum(1)))


def small_config(z: dict, model: dict, block: int, batch: int, steps: int, **extra):
    from jaxlm import config as config_lib

    return config_lib.load("llama3.2-1b", {
        "mesh.ici_data": 1, "model.block_size": block, "model.rope_original_context": block // 2,
        **{f"model.{k}": v for k, v in {**model, **extra}.items()}, "training.batch_size": batch,
        "training.steps": steps, "optimizer.lr": 3e-3, "optimizer.min_lr": 3e-4,
        "optimizer.warmup_steps": max(1, steps // 10), "optimizer.weight_decay": 0.0})


def train_losses(cfg, device, tokens: np.ndarray, timing_chunk: int = 0):
    """(losses of each step, seconds per step or None, compile seconds): the jitted train step on `device` over
    batches cut from tokens [steps * batch, block + 1]. With timing_chunk, steps run in chunks of that many with one
    wait at each chunk's end, and the median chunk gives the time per step."""
    import jax

    from jaxlm.train import batches as batch_lib, run as run_lib, state as state_lib, step as step_lib

    run = run_lib.setup(cfg, [device], data=False)
    state = state_lib.init_state(run, cfg.seed)
    step = step_lib.make_train_step(run.cfg, run.optimizer, run.mesh, run.abstract_state, run.act_rules)
    B = cfg.training.batch_size
    batches = [tokens[i:i + B][None] for i in range(0, len(tokens), B)]

    def put(x):
        return batch_lib.put_batch(run.mesh, np.ascontiguousarray(x), 1, run.act_rules)

    losses, chunks = [], []
    t = time.perf_counter()
    state, m = step(state, {"inputs": put(batches[0][..., :-1]), "targets": put(batches[0][..., 1:])})
    losses.append(m["loss"])
    block(m)
    compile_s = time.perf_counter() - t
    t = time.perf_counter()
    for i, x in enumerate(batches[1:], 1):
        state, m = step(state, {"inputs": put(x[..., :-1]), "targets": put(x[..., 1:])})
        losses.append(m["loss"])
        if timing_chunk and i % timing_chunk == 0:
            block(m)
            chunks.append((time.perf_counter() - t) / timing_chunk)
            t = time.perf_counter()
    out = np.asarray(jax.device_get(losses), np.float64)
    return out, (statistics.median(chunks) if chunks else None), compile_s


def precision(ctx: Ctx) -> None:
    """A small model trained 100 steps in bf16 (float32 weights) on the device, against the same model, data and
    initialization in float32 on this machine's CPU in the same process (the reference), and in float32 on the
    device (TF32 matmuls on NVIDIA GPUs: how far the device's float32 alone moves the loss)."""
    import jax

    z = ctx.sizes
    steps = z["precision_steps"]
    tokens, entropy = markov_tokens(z["small_model"]["vocab_size"], steps * z["small_batch"], z["small_block"] + 1)
    ctx.put(precision_steps=steps, precision_entropy=entropy)
    cpu, dev = jax.devices("cpu")[0], jax.devices()[0]
    runs = [("cpu_float32", cpu, "float32")] + ([("device_float32", dev, "float32")] if dev.platform != "cpu" else [])
    runs.append(("device_bfloat16", dev, "bfloat16"))
    out = {}
    for label, device, dtype in runs:
        if ctx.left() < 5:
            out[label] = dict(note="skipped: time budget")
            continue
        cfg = small_config(z, z["small_model"], z["small_block"], z["small_batch"], steps, compute_dtype=dtype)
        t = time.perf_counter()
        losses, _, _ = train_losses(cfg, device, tokens)
        out[label] = dict(losses=[round(float(x), 5) for x in losses], seconds=time.perf_counter() - t,
                          device=device.device_kind)
        ctx.put(precision_runs=out)


# ---- quant: int8 and fp8 training against bf16 -------------------------------------------------------------------

def quant(ctx: Ctx) -> None:
    """Step throughput and the loss after 200 steps of int8 and fp8 training (model.quantization) against bf16
    on the same model, data and initialization; all with bf16 compute over float32 weights."""
    import jax

    from jaxlm.model import quant as quant_lib

    z = ctx.sizes
    steps = z["quant_steps"]
    dev = jax.devices()[0]
    ctx.put(quant_steps=steps, quant_note=quant_lib.fp8_fallback_message(dev) or "fp8 runs on the device's fp8 units",
            quant_model=dict(z["quant_model"], block=z["quant_block"], batch=z["quant_batch"]))
    tokens, entropy = markov_tokens(z["quant_model"]["vocab_size"], steps * z["quant_batch"], z["quant_block"] + 1, 1)
    out = {}
    for mode in ("bfloat16", "fp8", "int8"):
        if out and ctx.left() < 1.3 * max(r.get("seconds", 0) for r in out.values()) + 5:
            out[mode] = dict(note="skipped: time budget")
            ctx.put(quant_runs=out)
            continue
        cfg = small_config(z, z["quant_model"], z["quant_block"], z["quant_batch"], steps, compute_dtype="bfloat16",
                           quantization="none" if mode == "bfloat16" else mode)
        t = time.perf_counter()
        try:
            losses, step_s, compile_s = train_losses(cfg, dev, tokens, timing_chunk=max(1, min(10, steps // 4)))
            tokens_per_step = z["quant_batch"] * z["quant_block"]
            out[mode] = dict(final_loss=float(np.mean(losses[-10:])), step_s=step_s,
                             tokens_per_s=tokens_per_step / step_s if step_s else None, compile_s=compile_s,
                             losses=[round(float(x), 5) for x in losses[::10]], seconds=time.perf_counter() - t)
        except Exception as e:  # noqa: BLE001 - one mode failing leaves the others
            out[mode] = dict(note=f"error: {one_line(e)}", seconds=time.perf_counter() - t)
        ctx.put(quant_runs=out, quant_entropy=entropy)


# ---- decode and serve -------------------------------------------------------------------------------------------

PROFILE_TOP = 16  # operations listed from the engine's and generate's profiles


def inference_model(z: dict):
    """(params, ModelConfig): the 1B shape with bf16 weights (what a converted checkpoint serves), random."""
    import jax

    from jaxlm import params as P, sharding
    from jaxlm.config import MeshConfig
    from jaxlm.model import param_specs

    block = max(z["decode_prompt"] + z["decode_new"], z["serve_prompt"] + z["serve_new"])
    cfg = train_config(dict(z, train_block=block), param_dtype="bfloat16", compute_dtype="bfloat16").model
    mesh = sharding.make_mesh(MeshConfig(ici_data=1), jax.devices()[:1])
    return P.init(param_specs(cfg), jax.random.key(0), mesh), cfg


def decode(ctx: Ctx, reserve: float = 0.0) -> None:
    """`jaxlm generate`'s decoder (jaxlm.infer.generate.generate: prefill, then the on-device loop over the KV cache)
    at batch 1 and 64, greedy, no stop token; and what batch 1 reads per token: every weight (the tied embedding
    is the output projection, read whole) and the cache's filled part. Then, while time is left beyond `reserve`
    seconds, one more call at the largest batch under the profiler (generate_profile): decode_b<batch>_profile."""
    from jaxlm.infer import generate
    from jaxlm.model import quant as quant_lib
    from jaxlm.config import DecodeConfig

    z = ctx.sizes
    params, cfg = inference_model(z)
    P0, N = z["decode_prompt"], z["decode_new"]
    weight_bytes = quant_lib.nbytes(params)
    if not cfg.tie_embeddings:  # an untied table is read one row a token
        table = params["embed"]["tokens"]
        weight_bytes -= table.nbytes - table.nbytes // table.shape[0]
    kv_per_position = 2 * cfg.n_layers * cfg.kv_heads * cfg.hd * 2  # keys and values, bf16
    ctx.put(decode_weight_bytes=weight_bytes, decode_kv_bytes_per_step=kv_per_position * (P0 + N / 2),
            decode_prompt=P0, decode_new=N)
    out = {}
    for B in z["decode_batches"]:
        if out and ctx.left() < 1.5 * max(r.get("seconds", 0) for r in out.values()) + 5:
            out[B] = dict(note="skipped: time budget")
            ctx.put(decode_runs=out)
            continue
        t = time.perf_counter()
        prompts = np.random.default_rng(B).integers(0, cfg.vocab_size, (B, P0)).tolist()
        d = DecodeConfig(max_new_tokens=N, temperature=0.0)
        first = generate.generate(params, cfg, prompts, d)  # compiles
        g = generate.generate(params, cfg, prompts, d)
        assert all(len(t) == N for t in g.tokens), "a sequence stopped early"
        out[B] = dict(decode_s=g.decode_s, prefill_s=g.prefill_s, compile_s=first.compile_s,
                      decode_tokens_per_s=B * N / g.decode_s, tokens_per_s=B * N / (g.decode_s + g.prefill_s),
                      step_ms=1e3 * g.decode_s / N, seconds=time.perf_counter() - t)
        ctx.put(decode_runs=out)
    B, r = max(out.items())
    # reading the trace takes several times the call's own time
    if "note" in r or ctx.left() < reserve + 10 * (r["decode_s"] + r["prefill_s"]) + 20:
        ctx.put(**{f"decode_b{B}_profile": dict(note=f"skipped: time budget ({ctx.left():.0f} s left)")})
        return
    t = time.perf_counter()
    prompts = np.random.default_rng(B).integers(0, cfg.vocab_size, (B, P0)).tolist()  # the row's own
    prof = generate_profile(params, cfg, prompts, DecodeConfig(max_new_tokens=N, temperature=0.0))
    ctx.put(**{f"decode_b{B}_profile": dict(prof, seconds=time.perf_counter() - t)})


def serve(ctx: Ctx, attention_kernel: str | None = None, kernel_options: str = "", tag: str | None = None) -> dict:
    """The serving engine (continuous batching over one KV cache, the loop `jaxlm serve` runs without HTTP) with C
    slots and C greedy requests submitted at once: output tokens/s of the third round (the first two compile).
    `attention_kernel` and `kernel_options` (serve.attention_kernel and serve.attention_kernel_options; None and
    '': their defaults); `tag` (default: the kernel's name) names the figures serve_<tag>_rounds and
    serve_<tag>_profile. Returns the last round and the profile (if taken)."""
    from jaxlm.config import ServeConfig
    from jaxlm.serve.engine import Engine

    z = ctx.sizes
    C, P0, N = z["serve_concurrency"], z["serve_prompt"], z["serve_new"]
    params, cfg = inference_model(z)
    tag = f"_{tag or attention_kernel}" if tag or attention_kernel else ""
    chosen = {"attention_kernel": attention_kernel} if attention_kernel else {}
    if kernel_options:
        chosen["attention_kernel_options"] = kernel_options
    # A turn prefills every waiting prompt (16 rows a call), so the decode program runs at all C rows from the start
    # and only that bucket compiles.
    e = Engine(params, cfg, ServeConfig(max_slots=C, max_queue=C, prefill_chunk=C * P0, prefix_cache=0, **chosen),
               P0 + N)
    e.start()
    rounds, out = [], {}
    try:
        for r in range(3):  # the first two compile (prefill into fresh slots, then into used ones)
            rounds.append(engine_round(e, cfg, C, P0, N, seed=r))
            ctx.put(**{f"serve{tag}_rounds": lean(rounds)}, serve_concurrency=C, serve_prompt=P0, serve_new=N,
                    serve_decode_steps=e.decode_steps)
        out["round"] = rounds[-1]
        if ctx.left() > 2 * rounds[-1]["wall_s"] + 10:
            out["profile"] = engine_profile(e, cfg, C, P0, N)
            ctx.put(**{f"serve{tag}_profile": out["profile"]})
    finally:
        e.stop()
    return out


def engine_round(e, cfg, C: int, P0: int, N: int, seed: int) -> dict:
    """C greedy requests of P0 random prompt tokens and N new ones through the engine at once: the round's wall
    time, output tokens, output tokens/s, each request's tokens as a short digest (`digests`: rounds of one seed
    through two settings compare by them) and the tokens themselves (`outputs`, left out of the figures: lean)."""
    from jaxlm.serve.requests import Sequence

    prompts = np.random.default_rng(seed).integers(0, cfg.vocab_size, (C, P0))
    t = time.perf_counter()
    events = e.run([Sequence(p.tolist(), N, 0.0, 0, 1.0, 0, 0, (), None, logprobs=False) for p in prompts])
    if e.error:
        raise RuntimeError(f"engine: {e.error}")
    wall = time.perf_counter() - t
    outputs = [[t for x in ev if x[0] == "tokens" for t in x[1]] for ev in events]
    tokens = sum(map(len, outputs))
    digests = [hashlib.sha1(np.asarray(o, np.int64).tobytes()).hexdigest()[:12] for o in outputs]
    return dict(wall_s=wall, tokens=tokens, output_tokens_per_s=tokens / wall, digests=digests, outputs=outputs)


def lean(rounds: list[dict]) -> list[dict]:
    """engine_round's rounds as the figures keep them: without each request's tokens."""
    return [{k: v for k, v in r.items() if k != "outputs"} for r in rounds]


def common_prefix(a: list[list[int]], b: list[list[int]]) -> float:
    """The mean share of each request's tokens in `a` before its first that differs from the same request's in
    `b` (1.0: all equal). Greedy decoding of random weights can part at any near-tie of the logits, so settings
    whose values differ by a rounding part late on average, where a wrong computation parts at once."""
    shares = []
    for x, y in zip(a, b):
        n = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        shares.append(n / max(len(x), 1))
    return sum(shares) / max(len(shares), 1)


@contextlib.contextmanager
def lowering_calls(module):
    """While inside, the first call of each shape of `module`'s jitted functions (the engine's programs,
    serve/programs.py) is also lowered with that call's own arguments, before it runs: once the program has run, a
    lookup in jax's caches, and that lowering's compile() the executable the call runs. Yields the list of them."""
    import jax

    lowered, seen = [], set()

    def shape(a):  # what tells programs apart cheaply: arrays' shapes, plain values (static arguments), else type
        if isinstance(a, (np.ndarray, jax.Array)):
            return np.shape(a), str(a.dtype)
        return a if isinstance(a, (bool, int, float, str, type(None))) else type(a).__name__

    def recording(name, f):
        def call(*args, **kw):
            key = (name, tuple(map(shape, args)), tuple((k, shape(v)) for k, v in kw.items()))
            if key not in seen:
                seen.add(key)
                lowered.append(f.lower(*args, **kw))
            return f(*args, **kw)
        return call

    jitted = {name: f for name, f in vars(module).items() if callable(f) and hasattr(f, "lower")}
    for name, f in jitted.items():
        setattr(module, name, recording(name, f))
    try:
        yield lowered
    finally:
        for name, f in jitted.items():
            setattr(module, name, f)


def optimized_hlo(compiled) -> list[str]:
    """The optimized HLO of each of `compiled` (executables, or lowerings compiled here: from jax's cache), once."""
    texts = [(c.compile() if hasattr(c, "compile") else c).as_text() for c in compiled]
    return list(dict.fromkeys(texts))


def traced(run, index_of, top: int, steps: int = 1) -> dict:
    """run() under jax.profiler: the device's time by kind of operation, scope and top operations (breakdown_of),
    the operations named from the optimized HLO of the programs index_of() gives after the run (hlo_index_of);
    `wall_ms`, the run's wall time."""
    import jax
    from jax.profiler import ProfileData

    folder = tempfile.mkdtemp(prefix="jaxlm_trace_")
    jax.profiler.start_trace(folder)
    try:
        t = time.perf_counter()
        run()
        wall = time.perf_counter() - t
    finally:
        jax.profiler.stop_trace()
    files = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
    if not files:
        return dict(note=f"the profiler wrote no .xplane.pb under {folder}")
    t = time.perf_counter()
    texts = index_of()
    hlo_s = time.perf_counter() - t
    out = breakdown_of(ProfileData.from_file(files[0]), hlo_index_of(texts), steps, top=top)
    out.update(wall_ms=1e3 * wall, hlo_programs=len(texts), hlo_s=hlo_s)
    return out


def engine_profile(e, cfg, C: int, P0: int, N: int) -> dict:
    """One more round of the engine under jax.profiler: the device's time by kind of operation (as the train rows'
    breakdown; programs of the prefill and the decode buckets together, their operations named from the optimized
    HLO of the programs the round ran: lowering_calls) and its share of the round's wall time (`device_busy`: on a
    GPU or TPU the rest is the host's turn loop, dispatch and waits; on a CPU the ops' time is summed over threads,
    so no share is given)."""
    import jax

    from jaxlm.serve import programs
    from jaxlm.serve.requests import Sequence

    prompts = np.random.default_rng(3).integers(0, cfg.vocab_size, (C, P0))
    with lowering_calls(programs) as lowered:
        out = traced(lambda: e.run([Sequence(p.tolist(), N, 0.0, 0, 1.0, 0, 0, (), None, logprobs=False)
                                    for p in prompts]), lambda: optimized_hlo(lowered), top=PROFILE_TOP)
    if "wall_ms" in out:
        out["output_tokens_per_s"] = C * N / (out["wall_ms"] / 1e3)
        if jax.default_backend() != "cpu":
            out["device_busy"] = out["ms_per_step"] / out["wall_ms"]
    return out


def generate_profile(params, cfg, prompts, d) -> dict:
    """One more call of generate (prefill and the decode loop) under jax.profiler, as engine_profile: the device's
    time by kind and top operations, named from the optimized HLO of generate's executables for these shapes (the
    last it compiled), so that a chip run reads the engine's round against generate's op by op."""
    import jax

    from jaxlm.infer import generate

    out = traced(lambda: generate.generate(params, cfg, prompts, d), lambda: optimized_hlo(generate.executables()[-1]),
                 top=PROFILE_TOP)
    if "wall_ms" in out and jax.default_backend() != "cpu":
        out["device_busy"] = out["ms_per_step"] / out["wall_ms"]
    return out


SECTIONS = {f.__name__: f for f in (yardsticks, train, attention, precision, quant, decode, serve)}


def on_an_accelerator() -> None:
    """Full sizes are for a GPU or TPU: on a CPU they take its host's memory (a 1B model in float32, 4 GiB copy
    buffers), as when a TPU machine's JAX is hidden behind a CPU-only one on PYTHONPATH."""
    import jax

    if jax.default_backend() == "cpu":
        raise RuntimeError(f"JAX {jax.__version__} (from {os.path.dirname(jax.__file__)}) sees only the CPU; full sizes "
                           "need a GPU or TPU (run with --tiny on a CPU, or put the machine's JAX first on PYTHONPATH)")


def main(sections: dict = SECTIONS, ctx_class=Ctx, doc: str = __doc__) -> None:
    """Run one section (benchmarks/tpu_sections.py runs its own here too)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("section", choices=list(sections))
    ap.add_argument("--results", required=True)
    ap.add_argument("--deadline", type=float, required=True)
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args()
    ctx = ctx_class(a.results, a.deadline, a.tiny)
    t = time.perf_counter()
    try:
        if not a.tiny:
            on_an_accelerator()
        if a.section != "yardsticks":  # MFU for a section run without the yardsticks (--only lora)
            import jax

            ctx.put(peak_bf16_spec=spec_peak(jax.devices()[0]))
        sections[a.section](ctx)
    except Exception as e:  # noqa: BLE001 - the summary names the section's error in one line
        traceback.print_exc()
        ctx.put(error=one_line(e))
        sys.exit(1)
    finally:
        log(f"{a.section}: {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main()
