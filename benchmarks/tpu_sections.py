"""The measurements of benchmarks/tpu.py, one function per section, each run by tpu.py in a process of its own:

    python benchmarks/tpu_sections.py SECTION --results FILE --deadline UNIX_TIME [--tiny]

As benchmarks/gpu_sections.py (whose helpers these sections use: the yardsticks, the compile and timing of a train
step, the profile's breakdown, generate and the serving engine): figures are written as they come, one JSON
object a line, raw (tokens/s, FLOPs per token, bytes); tpu.py turns them into MFU against the yardsticks.

Sections: yardsticks, maxtext (maxtext_base at the preset's settings and at tuned ones, the step's time by
operation), gpt2 (the `openwebtext` preset), long (maxtext_base at 32,768 tokens a sequence), lora (QLoRA of
llama3.1-8b, LoRA of llama3.2-1b, random bases), vision (a gemma3-4b LoRA step with images), quant (int8 training
against bf16), moe (mixtures of experts by ragged_dot and by megablox, beside the dense model of equal active
parameters), decode (generate at batch 1 and 64, batch 64's call profiled), serve (the engine with 64 slots).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import gpu_sections as g  # noqa: E402

# Each train row: (label, settings over the preset's). The first row of a section is the preset as `jaxlm train`
# runs it; the others are the settings a user gives on the command line to go faster on one chip.
_BEST = {"model.param_dtype": "bfloat16", "model.remat": "minimal", "model.loss_chunk_tokens": 4096}
MAXTEXT_ROWS = [
    ("preset (float32 weights and Adam moments, remat full)", {}),
    ("bf16 weights and moments, remat full", {"model.param_dtype": "bfloat16"}),
    ("bf16 weights and moments, remat minimal", {"model.param_dtype": "bfloat16", "model.remat": "minimal"}),
    # Seen on a v5e: splash tiles of 1,024 as fast as 512 (16,300 tokens/s).
    ("bf16, remat minimal, loss in one chunk", _BEST),
    # The optimizer's update (reading and writing 1.1B weights and both moments, ~28 ms) shared by more tokens.
    ("bf16, remat minimal, loss in one chunk, 4 micro-batches a step", {**_BEST, "training.grad_accum": 4}),
    ("bf16, remat minimal, loss in one chunk, 8 micro-batches a step", {**_BEST, "training.grad_accum": 8}),
    # Since the layer scan indexes its weights inside each layer's checkpoint, batch 4 fits one v5e (the compile
    # from a CPU host: 14.66 GiB; it was refused at 16.59): larger matmuls, the update shared by twice the tokens.
    ("bf16, remat minimal, loss in one chunk, batch 4", {**_BEST, "training.batch_size": 4}),
    # The named line (a preset name in place of settings: that preset as `jaxlm train` runs it): the above with 16
    # micro-batches a step, their gradients added in place (v5e-1 compile: 12.02 GiB).
    ("maxtext_base_v5e preset: bf16, remat minimal, loss in one chunk, 16 micro-batches a step", "maxtext_base_v5e"),
    # The same with its 16 layers unrolled (model.scan_layers=false): the compile for v5e-1 from a CPU host
    # (remat_hlo.py) estimates 3,087.8 ms a step against 3,509.4 scanned (matmuls 2,408.8 against 2,607.3, the rest
    # 679.0 against 902.1), 13.92 GiB against 12.44; the compile takes 5.5x as long.
    ("maxtext_base_v5e preset, layers unrolled", ("maxtext_base_v5e", {"model.scan_layers": False})),
]
# GPT-2 on one chip (docs/performance.md, "GPT-2 on one chip"): at width 768 and heads of 64, recomputing a layer
# costs less than saving its activations, whose copies through padded [.., T, 64] tiles dominate; the compile from
# a CPU host puts batch 16 under remat full at 2.70 GiB and 160 ms of XLA's estimate (187 before the loss took
# its gradient in the forward and the splash kernel read heads as [H, T]).
_GPT2_ONE_CHIP = {"training.batch_size": 16, "training.grad_accum": 1, "model.param_dtype": "bfloat16",
                  "model.remat": "full"}
_GPT2_MINIMAL = {**_GPT2_ONE_CHIP, "model.splash_layout": "seq_minor", "model.loss_chunk_tokens": 1024,
                 "model.remat": "minimal"}  # row 4: 108,000 tokens/s, 46.85% on a v5e
GPT2_ROWS = [
    ("preset (128 x 1,024 tokens a micro-step, 16 of them a step)", {}),
    ("batch 16, bf16 weights and moments, remat full, splash seq_minor",
     {**_GPT2_ONE_CHIP, "model.splash_layout": "seq_minor"}),
    ("batch 16, bf16 weights and moments, remat full (splash head_dim_minor)", _GPT2_ONE_CHIP),
    # The loss over each row's 1,024 positions in one chunk (4.14 GiB): 143.6 ms of the compile's estimate against
    # 147.2 in chunks of 512. Remat minimal recomputes no matmul (741 MFLOP a token against 855) and saves
    # activations instead (6.39 GiB); the compile prices its copies above the recompute (152.8 ms), but it puts
    # elementwise work at about half the chip's copy rate, and at half its estimate of them the order reverses
    # (117.9 against 120.3). Batch 32: the optimizer's update shared by twice the tokens.
    # Seen on a v5e (2026-12-07): row 1 99,360 tokens/s (43.1% by MaxText's count), row 3 100,000 (43.4%), row 4
    # 108,000 (46.85%, peak_bytes_in_use 8.96 GiB against the compile's 6.39), row 5 102,400 (44.4%).
    ("batch 16, bf16, remat full, seq_minor, loss in one chunk",
     {**_GPT2_ONE_CHIP, "model.splash_layout": "seq_minor", "model.loss_chunk_tokens": 1024}),
    ("batch 16, bf16, remat minimal, seq_minor, loss in one chunk", _GPT2_MINIMAL),
    ("batch 32, bf16, remat full, seq_minor, loss in one chunk",
     {**_GPT2_ONE_CHIP, "model.splash_layout": "seq_minor", "model.loss_chunk_tokens": 1024,
      "training.batch_size": 32}),
    # Around row 4, the fastest measured. On the chip remat minimal ran at 0.99 of the compile's estimate and remat
    # full at 1.14 (rows 4 and 3): XLA:TPU underprices these width-768 matmuls and overprices the copies, so rows
    # are ranked by matmul FLOPs first. Batch 24 (the compile: 9.21 GiB, 151.6 ms per 16,384 tokens against 152.8).
    ("batch 24, bf16, remat minimal, seq_minor, loss in one chunk",
     {**_GPT2_MINIMAL, "training.batch_size": 24}),
    # The splash kernel's tiles (all its block sizes; 512 above): its own time the compile does not estimate.
    ("batch 16, bf16, remat minimal, seq_minor, loss in one chunk, splash tiles of 1,024",
     {**_GPT2_MINIMAL, "model.attention_block": 1024}),
    ("batch 16, bf16, remat minimal, seq_minor, loss in one chunk, splash tiles of 256",
     {**_GPT2_MINIMAL, "model.attention_block": 256}),
    # What `jaxlm train openwebtext` names on one v5e when it stops (preflight: bf16, remat minimal, the batch
    # halved to 32; the compile, with its 64 micro-batches: 9.32 GiB), here without accumulation.
    ("batch 32, bf16, remat minimal (the preflight's line)", {**_GPT2_ONE_CHIP, "model.remat": "minimal",
                                                            "training.batch_size": 32}),
    # The 12 layers unrolled (model.scan_layers=false): no copies of the saved activations into the scan's stacks
    # and out of them, no slices of the stacked weights. The compile for v5e-1 from a CPU host (remat_hlo.py) puts
    # row 7's step at 139.9 ms of estimate against 152.8 scanned (matmuls 78.6 against 83.0, the rest 61.3 against
    # 69.8), 6.55 GiB against 6.39; its compile takes about 2.4x as long.
    ("batch 16, bf16, remat minimal, seq_minor, loss in one chunk, splash tiles of 1,024, layers unrolled",
     {**_GPT2_MINIMAL, "model.attention_block": 1024, "model.scan_layers": False}),
    ("batch 16, bf16, remat minimal, seq_minor, loss in one chunk, layers unrolled",
     {**_GPT2_MINIMAL, "model.scan_layers": False}),
]
# int8 training of the whole maxtext_base_v5e step (bf16 weights and moments, the loss in one chunk, 2 x 2,048
# tokens a micro-batch, 16 a step) against the preset itself; JAXLM_BENCH_QUANT_ROWS chooses rows (quant()).
# Seen on a v5e (2026-12-07): the preset 20,016 tokens/s; int8 under remat full 24,749; remat minimal at batch 1 x
# 32 22,629 (at batch 2 its int32 matmul results did not fit); remat minimal at batch 2 x 16 keeping bf16 results
# 25,784 (1.288x), as `jaxlm train maxtext_base_v5e model.quantization=int8` printed it.
_INT8 = {"model.quantization": "int8"}
QUANT_ROWS = [
    ("maxtext_base_v5e preset (bf16, remat minimal)", "maxtext_base_v5e"),
    ("int8, remat full", {**_INT8, "model.remat": "full"}),
    # remat minimal keeps each int8 matmul's bf16 result, not its int32 accumulator: batch 2 fits (v5e-1 compile:
    # 13.22 GiB), no matmul recomputed (5.84 int8 GFLOP a token against remat full's 7.32). Since that chip run
    # the weights are quantized once a step and remat minimal keeps the matmuls' int8 inputs: the compile's step
    # at half its elementwise price 2,611.6 -> 2,313.1 ms (13.61 GiB), about 29,000 tokens/s, 1.45x, if the chip
    # keeps the 0.97 of that figure it ran at.
    ("int8, remat minimal", _INT8),
    # the gradients rounded to nearest: the stochastic rounding's hash off (the quant modes' int8_nearest: its loss)
    ("int8 with gradients rounded to nearest, remat minimal", {**_INT8, "model.quant_stochastic_rounding": False}),
    # the output projection int8 too: 3.12 bf16-equivalent GFLOP a token against 3.31, the compile's step at half
    # its elementwise price 2,299.0 ms against 2,313.1 (13.77 GiB); its loss is not measured by these rows
    ("int8 with the output projection int8 too, remat minimal", {**_INT8, "model.quant_logits": True}),
]

SIZES = {
    "full": dict(
        g.SIZES["full"], maxtext_batch=2, maxtext_steps=3, profile_steps=2, gpt2_steps=3,
        long_block=32768, long_steps=2, quant_layers=16, quant_block=2048, quant_batch=2, quant_steps=200,
        lora_block=131072, lora_steps=3, lora_loss_steps=50, vision_block=2048, vision_batch=2,
        moe_block=2048, moe_steps=10, decode_model=dict(), serve_concurrency=64),
    "tiny": dict(
        g.SIZES["tiny"],
        maxtext_model={"model.n_layers": 2, "model.d_model": 64, "model.n_heads": 4, "model.head_dim": 16,
                       "model.d_ff": 128, "model.vocab_size": 512, "model.block_size": 64},
        gpt2_model={"model.n_layers": 2, "model.d_model": 64, "model.n_heads": 4, "model.vocab_size": 512,
                    "model.block_size": 64, "training.batch_size": 8, "training.grad_accum": 1},  # the preset's
        # 128 x 16 micro-steps a step took 15 s a step at these widths
        # maxtext rows: the preset, bf16 remat minimal, 4 micro-batches, the v5e preset by name (rows 1, 3, 5 and 6
        # differ from these by values alone: remat full, the loss chunk, 8 micro-batches, batch 4); gpt2 rows: the
        # preset, bf16 remat full, remat minimal (rows 6 and 9 differ from row 4 by values alone: batch 24; batch 32
        # with the default loss chunk and splash layout)
        maxtext_rows="0,2,4,7", maxtext_batch=2, maxtext_steps=2, profile_steps=1, gpt2_steps=2, gpt2_rows="0,2,4",
        long_block=256, long_steps=1,
        quant_layers=2, quant_block=64, quant_batch=2, quant_steps=10, quant_rows="0,2",
        quant_modes="bfloat16,int8",  # int8_nearest is int8's run with another setting
        lora_model={"model.n_layers": 2, "model.d_model": 64, "model.n_heads": 4, "model.n_kv_heads": 2,
                    "model.head_dim": 16, "model.d_ff": 128, "model.vocab_size": 512},
        lora_block=64, lora_steps=2, lora_loss_steps=3, lora_rows="0,2,4", vision_block=64, vision_batch=2,
        vision_model={"model.n_layers": 6, "model.d_model": 64, "model.n_heads": 4, "model.n_kv_heads": 2,
                      "model.head_dim": 16, "model.d_ff": 128, "model.vocab_size": 512},
        vision_tower=dict(d_model=32, n_layers=1, n_heads=2, d_ff=64, image_size=28, patch_size=7, tokens_per_image=4,
                          image_token_id=511, boi_token_id=509, eoi_token_id=510),
        moe_model={"model.n_layers": 2, "model.d_model": 64, "model.n_heads": 4, "model.n_kv_heads": 2,
                   "model.head_dim": 16, "model.d_ff": 128, "model.vocab_size": 512},
        moe_experts={"qwen3_30b_a3b": {"model.n_experts": 16, "model.expert_d_ff": 32}},
        moe_block=64, moe_batch=2, moe_steps=3, moe_rows="0,1,2,4",
        moe_accum="qwen3_moe:2"),
}


class Ctx(g.Ctx):
    def __init__(self, results: str, deadline: float, tiny: bool):
        super().__init__(results, deadline, tiny)
        self.sizes = SIZES["tiny" if tiny else "full"]


def load(preset: str, ctx: Ctx, settings: dict):
    """The preset on one device, shrunk at tiny sizes (SIZES' maxtext_model, gpt2_model), with `settings` over it."""
    from jaxlm import config as config_lib

    model = ctx.sizes.get({"maxtext_base": "maxtext_model", "maxtext_base_v5e": "maxtext_model",
                           "openwebtext": "gpt2_model", "llama3_1_8b": "lora_model", "llama3_2_1b": "lora_model",
                           "llama3_2_3b": "lora_model", "gemma3_4b": "vision_model"}[preset], {})
    return config_lib.load(preset, {"mesh.ici_data": 1, **model, **settings})


def train_row(ctx: Ctx, label: str, cfg, steps: int, profile: bool = False) -> dict:
    """One train step as `jaxlm train` compiles it (train.run.setup, step.lower_train_step), on random tokens:
    its bytes on the device (compiled.memory_analysis()), and, where it fits, seconds per step and tokens/s; FLOPs
    per token by MaxText's count (full-square attention) and by the causal count `jaxlm train` prints."""
    import jax

    from jaxlm.model import flops
    from jaxlm.train import preflight, state as state_lib

    dev = jax.devices()[0]
    B, T = cfg.training.batch_size, cfg.model.block_size
    A = cfg.training.grad_accum
    row = dict(label=label, batch=B, block=T, grad_accum=A, tokens_per_step=A * B * T,
               flops_maxtext=flops.flops_per_token(cfg.model), flops_causal=flops.flops_per_token(cfg.model, True),
               remat=cfg.model.remat, param_dtype=cfg.model.param_dtype, attention=cfg.model.attention,
               quantization=cfg.model.quantization)
    limit = (dev.memory_stats() or {}).get("bytes_limit")
    run, compiled, mem, secs = g.compile_step(cfg, B, dev)
    row.update(bytes=mem, compile_s=round(secs, 1), memory_limit_bytes=limit,
               predicted_peak_bytes=preflight.peak_bytes(compiled.memory_analysis()))
    # XLA:TPU refuses at compile a step that does not fit; memory_analysis()'s sum is only an upper bound (it
    # counts buffers the compiler reuses: 18.85 GiB for the 32,768-token step that XLA:TPU placed in 12.68)
    if limit and mem and mem > limit and dev.platform != "tpu":
        row["note"] = f"does not fit: {mem / 2**30:.2f} GiB of the device's {limit / 2**30:.2f}"
        return row
    state = state_lib.init_state(run, cfg.seed)
    batch = g.random_batch(run)
    state, times = g.time_steps(compiled, state, batch, steps, ctx, reserve=2)
    step_s = statistics.median(times) if times else None
    row.update(step_s=step_s, step_s_spread=[min(times), max(times)] if times else None,
               tokens_per_s=A * B * T / step_s if step_s else None,
               peak_bytes_in_use=(dev.memory_stats() or {}).get("peak_bytes_in_use"))
    if profile and ctx.left() > 4 * (step_s or 1) + 10:
        try:
            _, row["breakdown"] = g.profile(compiled, state, batch, ctx.sizes["profile_steps"])
        except Exception as e:  # noqa: BLE001 - the breakdown is one figure of several; say why it is missing
            row["breakdown"] = g.cost_breakdown(compiled, f"trace unavailable: {g.one_line(e)}")
    return row


def rows(ctx: Ctx, key: str, preset: str, table: list, steps: int, extra: dict, profile: tuple = (),
         chosen: str | None = None) -> None:
    """Each row of `table` (label, settings) over the preset, while time is left; ctx.put(key=[rows]). A row whose
    settings are a preset's name runs that preset (with `extra`) instead, and a (name, settings) pair that preset
    with those settings. JAXLM_BENCH_<KEY>_ROWS (else `chosen`), e.g. "0,3,4": only those rows."""
    out = []
    chosen = os.environ.get(f"JAXLM_BENCH_{key.split('_')[0].upper()}_ROWS", chosen)
    for i, (label, settings) in enumerate(table):
        if chosen and str(i) not in chosen.split(","):
            continue
        if out and ctx.left() < 20:
            out.append(dict(label=label, note=f"skipped: time budget ({ctx.left():.0f} s left)"))
            continue
        try:
            if isinstance(settings, str):  # a preset's name
                name, settings = settings, {}
            elif isinstance(settings, tuple):  # (a preset's name, settings over it)
                name, settings = settings
            else:
                name = preset
            out.append(train_row(ctx, label, load(name, ctx, {**extra, **settings}), steps, profile=i in profile))
        except Exception as e:  # noqa: BLE001 - one row failing (out of memory, say) leaves the others
            full = re.search("RESOURCE_EXHAUSTED|[Oo]ut of memory", str(e))
            out.append(dict(label=label, note=f"{'does not fit' if full else 'error'}: {g.one_line(e)}"))
        ctx.put(**{key: out})


def yardsticks(ctx: Ctx) -> None:
    g.yardsticks(ctx)


def maxtext(ctx: Ctx) -> None:
    """maxtext_base (MaxText's default model, 1.1B) at 2 x 2,048 tokens: the preset, then bf16 weights, remat
    minimal, the loss in one chunk, micro-batches, batch 4, and the maxtext_base_v5e preset, scanned and with its
    layers unrolled; the time by operation of the steps of remat minimal, 4 micro-batches and the v5e preset."""
    z = ctx.sizes
    rows(ctx, "maxtext_runs", "maxtext_base", MAXTEXT_ROWS, z["maxtext_steps"],
         {"training.batch_size": z["maxtext_batch"]}, profile=(2, 4, 7), chosen=z.get("maxtext_rows"))


def gpt2(ctx: Ctx) -> None:
    """GPT-2 124M as the `openwebtext` preset trains it (float32 weights, bf16 compute; 128 sequences a micro-step:
    `jaxlm compile openwebtext compile.topology=v5e-1` puts it at about 122 GiB, more than a chip holds), then
    batch 16 with bf16 weights and remat full, the splash kernel reading heads as [H, T] and as [T, H], then with
    [H, T] and the loss in one chunk under remat full, remat minimal (profiled), and at batch 32, then around remat
    minimal: batch 24, splash tiles of 1,024 and 256, the preflight's line, and the layers unrolled (GPT2_ROWS)."""
    rows(ctx, "gpt2_runs", "openwebtext", GPT2_ROWS, ctx.sizes["gpt2_steps"], {}, profile=(4,),
         chosen=ctx.sizes.get("gpt2_rows"))


def long(ctx: Ctx) -> None:
    """maxtext_base at 32,768 tokens a sequence, batch 1, bf16 weights and remat full (attention auto: splash on
    a TPU), then at 131,072 with the layers' inputs in host memory."""
    z = ctx.sizes
    longest = 4 * z["long_block"]
    rows(ctx, "long_runs", "maxtext_base", [
        (f"{z['long_block']} tokens, bf16 weights, remat full", {}),
        # 131,072 at full size: the layers' inputs (2 GiB each of 16 at bf16) wait in host memory, and the MLP's
        # [T, 7,168] activations are made 8,192 positions at a time
        (f"{longest} tokens, bf16 weights, layer inputs offloaded, MLP in chunks of 8,192",
         {"model.block_size": longest, "model.remat": "offload_layer_inputs",
          "model.mlp_chunk_tokens": min(8192, longest)})],
         z["long_steps"], {"training.batch_size": 1, "model.block_size": z["long_block"],
                           "model.param_dtype": "bfloat16"})


def quant(ctx: Ctx) -> None:
    """int8 training (model.quantization=int8) against bf16 on maxtext_base's shape with bf16 weights, on the same
    Markov corpus and initialization: step throughput and the loss after quant_steps steps. First, where
    JAXLM_BENCH_QUANT_ROWS chooses them (e.g. "0,1,2,3"; none by default at full size), the step throughput of
    QUANT_ROWS, the whole maxtext_base_v5e step under int8's settings (quant_rows)."""
    import jax
    import numpy as np

    z = ctx.sizes
    chosen = os.environ.get("JAXLM_BENCH_QUANT_ROWS", z.get("quant_rows"))
    if chosen:
        rows(ctx, "quant_rows", "maxtext_base_v5e", QUANT_ROWS, z["maxtext_steps"], {}, chosen=chosen)
    steps, B, T = z["quant_steps"], z["quant_batch"], z["quant_block"]
    extra = {"model.n_layers": z["quant_layers"], "model.block_size": T, "model.param_dtype": "bfloat16",
             "training.batch_size": B, "training.steps": steps, "optimizer.lr": 3e-4, "optimizer.min_lr": 3e-5,
             "optimizer.warmup_steps": max(1, steps // 10)}
    vocab = load("maxtext_base", ctx, extra).model.vocab_size
    tokens, entropy = g.markov_tokens(vocab, steps * B, T + 1, 1)
    ctx.put(quant_steps=steps, quant_entropy=entropy, quant_model=dict(layers=z["quant_layers"], block=T, batch=B))
    out = {}
    # int8_nearest: int8 with its gradients rounded to nearest (model.quant_stochastic_rounding=false), the cost of
    # the stochastic rounding's hash. JAXLM_BENCH_QUANT_MODES chooses (default all three; tiny sizes: bfloat16,int8).
    # An empty JAXLM_BENCH_QUANT_MODES runs QUANT_ROWS alone.
    modes = [m for m in os.environ.get("JAXLM_BENCH_QUANT_MODES", z.get("quant_modes", "bfloat16,int8,int8_nearest"))
             .split(",") if m]
    for mode in modes:
        if out and ctx.left() < 1.2 * max(r.get("seconds", 0) for r in out.values()) + 5:
            out[mode] = dict(note="skipped: time budget")
            ctx.put(quant_runs=out)
            continue
        cfg = load("maxtext_base", ctx, {**extra, "model.quantization": "none" if mode == "bfloat16" else "int8",
                                         "model.quant_stochastic_rounding": mode != "int8_nearest"})
        t = time.perf_counter()
        try:
            losses, step_s, compile_s = g.train_losses(cfg, jax.devices()[0], tokens,
                                                       timing_chunk=max(1, min(10, steps // 4)))
            out[mode] = dict(final_loss=float(np.mean(losses[-10:])), step_s=step_s,
                             tokens_per_s=B * T / step_s if step_s else None, compile_s=compile_s,
                             losses=[round(float(x), 5) for x in losses[::10]], seconds=time.perf_counter() - t)
        except Exception as e:  # noqa: BLE001 - one mode failing leaves the other
            out[mode] = dict(note=f"error: {g.one_line(e)}", seconds=time.perf_counter() - t)
        ctx.put(quant_runs=out)


# LoRA rows: (label, preset, settings over it). Rank 16 on q, k, v, o, up, gate, down (the defaults), bf16 compute.
# The 8B's longer rows keep the layers' inputs in host memory and run the MLP 8,192 positions at a time
# (docs/finetune.md, "An 8B model on one chip"). JAXLM_BENCH_LORA_ROWS=0,2 runs only those rows: one row a process
# gives each row the chip's own peak memory (memory_stats' peak counts the whole process).
QLORA_8B = {"lora.base_quantization": "nf4", "model.remat": "full"}
QLORA_8B_LONG = {**QLORA_8B, "model.remat": "offload_layer_inputs", "model.mlp_chunk_tokens": 8192}
LORA_ROWS = [
    ("llama3.1-8b QLoRA, nf4 base, 1 x 2,048, remat full", "llama3_1_8b", {**QLORA_8B, "model.block_size": 2048}),
    ("llama3.1-8b QLoRA, nf4 base, 1 x 8,192, layer inputs offloaded", "llama3_1_8b",
     {**QLORA_8B_LONG, "model.block_size": 8192}),
    ("llama3.1-8b QLoRA, nf4 base, 1 x 49,152, layer inputs offloaded, MLP in chunks of 8,192", "llama3_1_8b",
     {**QLORA_8B_LONG, "model.block_size": 49152}),
    ("llama3.1-8b QLoRA, nf4 base, 1 x 65,536, layer inputs offloaded, MLP in chunks of 8,192", "llama3_1_8b",
     {**QLORA_8B_LONG, "model.block_size": 65536}),
    ("llama3.2-3b LoRA, bf16 base, 4 x 2,048, remat full", "llama3_2_3b",
     {"model.param_dtype": "bfloat16", "model.remat": "full", "training.batch_size": 4, "model.block_size": 2048}),
]
LOSS_STEPS = 50  # the first row also trains this many steps on real text (Python's own source, bytes)


def random_frozen(abstract: dict, seed: int = 0) -> dict:
    """A LoRA run's frozen base made on the device in its stored layout (nf4 codes and scales, or bf16 weights),
    random: no folder to read, and an 8B base in float would not fit one chip before it is quantized. Realistic in
    scale, so activations stay as a trained model's would: nf4 codes uniform over the 16 levels, the blocks' maxima
    about 0.03-0.06 (mean in [0.03, 0.06], int8 offsets of at most 0.013: a block's absolute maximum for weights of
    standard deviation ~0.02), norms of one, other floats (embedding, output layer, a bf16 base) uniform in +-0.05
    rounded to bf16. Counter-based random bits and uniform floats: the same base on every platform, bit for bit."""
    import jax
    import jax.numpy as jnp

    flat, tree = jax.tree_util.tree_flatten_with_path(abstract)
    keys = jax.random.split(jax.random.key(seed), len(flat))

    def one(key, path, a):
        name = jax.tree_util.keystr(path)
        if jnp.issubdtype(a.dtype, jnp.integer):
            info = jnp.iinfo(a.dtype)
            make = lambda k: jax.random.randint(k, a.shape, info.min, info.max, jnp.int32).astype(a.dtype)  # noqa
        elif "norm" in name:
            make = lambda k: jnp.ones(a.shape, a.dtype)  # noqa: E731
        else:
            lo, hi = (5e-5, 1e-4) if "absmax_scale" in name else (0.03, 0.06) if "absmax_mean" in name else (-.05, .05)
            make = lambda k: (jax.random.uniform(k, a.shape, jnp.float32, lo, hi)  # noqa: E731
                              .astype(jnp.bfloat16).astype(a.dtype))
        return make

    return jax.tree.unflatten(tree, made_in_chunks([(functools.partial(one(k, p, a), k), a) for k, (p, a) in
                                                    zip(keys, flat)]))


CHUNK_BYTES = 256 << 20  # leaves made together in one program up to this many bytes of output (made_in_chunks)


def made_in_chunks(makers: list) -> list:
    """The arrays of `makers`, (a function of no arguments, the abstract array it makes), in their order: leaves
    made together in one program while their outputs stay under CHUNK_BYTES (a larger one alone), so that a
    model's many small leaves cost one compile rather than one each and an 8B model's large ones are still made
    one at a time. Each leaf is computed as it would be alone: the same values, bit for bit."""
    import jax

    out, chunk, size = [], [], 0

    def flush():
        fns, shardings = [f for f, _ in chunk], [a.sharding for _, a in chunk]
        out.extend(jax.jit(lambda: [f() for f in fns], out_shardings=shardings)())

    for fn, a in makers:
        nbytes = int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
        if chunk and size + nbytes > CHUNK_BYTES:
            flush()
            chunk, size = [], 0
        chunk.append((fn, a))
        size += nbytes
    if chunk:
        flush()
    return out


def lora_row(ctx: Ctx, label: str, cfg, steps: int, loss_steps: int = 0) -> dict:
    """One LoRA (or QLoRA) train step as `jaxlm train` compiles it, over a random base: tokens/s, MFU (the causal
    count `jaxlm train` prints, no weight gradients for the base), the compiled step's bytes, the compiler's peak
    (peak_memory_in_bytes: what `jaxlm compile` predicts from a CPU host) and the chip's own peak memory in use;
    with loss_steps, that many steps on real text and their losses."""
    import jax

    from jaxlm.model import flops, lora
    from jaxlm.train import preflight, state as state_lib

    dev = jax.devices()[0]
    B, T = cfg.training.batch_size, cfg.model.block_size
    run, compiled, mem, secs = g.compile_step(cfg, B, dev)
    row = dict(label=label, batch=B, block=T, bytes=mem, compile_s=round(secs, 1),
               predicted_peak_bytes=preflight.peak_bytes(compiled.memory_analysis()),
               base_quantization=cfg.lora.base_quantization, rank=cfg.lora.rank,
               flops_causal=lora.flops_per_token(cfg, flops.flops_per_token(cfg.model, causal=True)))
    frozen = random_frozen(run.abstract_frozen)
    state = state_lib.init_state(run, cfg.seed)
    batch = g.random_batch(run)
    if run.image_slots:
        batch, row["images_per_row"] = with_image_spans(batch, cfg.model.vision), run.image_slots
    step = lambda s, b: compiled(s, b, frozen)  # noqa: E731
    state, times = g.time_steps(step, state, batch, steps, ctx, reserve=2)
    step_s = statistics.median(times) if times else None
    stats = dev.memory_stats() or {}
    row.update(step_s=step_s, tokens_per_s=B * T / step_s if step_s else None,
               peak_bytes_in_use=stats.get("peak_bytes_in_use"), bytes_limit=stats.get("bytes_limit"))
    if loss_steps:
        losses = []
        for b in text_batches(run, loss_steps):
            if ctx.left() < 5 + 2 * (step_s or 1):
                break
            state, m = step(state, b)
            losses.append(m["loss"])
        row["losses"] = [round(float(x), 4) for x in jax.device_get(losses)]
    return row


def text_batches(run, n: int):
    """n batches of real text for the run's step: windows of Python's own standard library source read as bytes
    (token ids 0..255, inside any vocabulary), each step a new window."""
    import jax
    import sysconfig

    from jaxlm.train import step as step_lib

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    data = np.frombuffer(b"".join(f.read_bytes() for f in files), np.uint8).astype(np.int32)
    shapes = step_lib.abstract_batch(run)
    A, B, T = shapes["inputs"].shape
    for i in range(n):
        at = (i * A * B * (T + 1)) % (len(data) - A * B * (T + 1))
        rows = data[at:at + A * B * (T + 1)].reshape(A, B, T + 1)
        out = {}
        for k, a in shapes.items():
            x = {"inputs": rows[..., :-1], "targets": rows[..., 1:]}.get(k)
            if x is None:
                x = np.ones(a.shape, np.float32) if a.dtype == np.float32 else np.zeros(a.shape, np.int32)
            out[k] = jax.device_put(np.ascontiguousarray(x), a.sharding)
        yield out


def with_image_spans(batch: dict, v) -> dict:
    """A random batch whose rows each hold one image as its processor writes it (begin, the soft tokens, end) from
    position 8, so the tower's soft tokens take their places and the image's tokens see the whole image."""
    import jax
    import numpy as np

    inputs = np.array(batch["inputs"])
    at, M = 8, v.tokens_per_image
    inputs[..., at - 1], inputs[..., at:at + M], inputs[..., at + M] = v.boi_token_id, v.image_token_id, v.eoi_token_id
    return {**batch, "inputs": jax.device_put(inputs, batch["inputs"].sharding)}


def vision(ctx: Ctx) -> None:
    """A gemma3-4b LoRA SFT step with images (rank 16, bf16 base, the SigLIP tower frozen, one 896 x 896 image a
    row, 2 x 2,048 tokens, remat full) on one chip: tokens/s and memory."""
    from jaxlm.config.model_schema import VisionConfig

    z = ctx.sizes
    label = f"gemma3-4b LoRA SFT, bf16 base, {z['vision_batch']} x {z['vision_block']}, one image a row"
    cfg = load("gemma3_4b", ctx, {"lora.rank": 16, "model.param_dtype": "bfloat16", "model.compute_dtype": "bfloat16",
                                  "model.remat": "full", "model.block_size": z["vision_block"],
                                  "training.batch_size": z["vision_batch"]})
    if "vision_tower" in z:  # tiny sizes: a tower to match the tiny language model
        cfg = cfg.replace(model=dataclasses.replace(cfg.model, vision=VisionConfig(**z["vision_tower"])))
    try:
        ctx.put(vision_runs=[lora_row(ctx, label, cfg, z["lora_steps"])])
    except Exception as e:  # noqa: BLE001 - say why in one line
        full = re.search("RESOURCE_EXHAUSTED|[Oo]ut of memory", str(e))
        ctx.put(vision_runs=[dict(label=label, note=f"{'does not fit' if full else 'error'}: {g.one_line(e)}")])


def lora(ctx: Ctx) -> None:
    """QLoRA (nf4) of llama3.1-8b at 2,048 tokens and longer, LoRA of llama3.2-3b with a bf16 base, one chip, random
    bases: tokens/s, MFU and memory. Rows run in order while time is left; one failing leaves the next."""
    out = []
    chosen = os.environ.get("JAXLM_BENCH_LORA_ROWS", ctx.sizes.get("lora_rows"))  # tiny: one row of each kind
    # JAXLM_BENCH_LORA_LOSS_STEPS=1:50,2:8 trains those rows that many steps on text too (row 0: 50 by default)
    loss_steps = dict(kv.split(":") for kv in os.environ.get("JAXLM_BENCH_LORA_LOSS_STEPS", "").split(",") if kv)
    loss_steps = {k: int(v) for k, v in loss_steps.items()}
    for i, (label, preset, settings) in enumerate(LORA_ROWS):
        if chosen and str(i) not in chosen.split(","):
            continue
        if out and ctx.left() < 30:
            out.append(dict(label=label, note=f"skipped: time budget ({ctx.left():.0f} s left)"))
            continue
        # QLoRA's learning rate (Dettmers et al.; Unsloth's 2e-4) with a short warmup, so the 50 steps on text
        # show the loss fall (the preset's 2e-5 after 100 steps of warmup moved it by 0.005)
        cfg = load(preset, ctx, {"lora.rank": 16, "model.compute_dtype": "bfloat16", "training.batch_size": 1,
                                 "optimizer.lr": 2e-4, "optimizer.warmup_steps": 5,
                                 **settings, "model.block_size": min(settings.get("model.block_size", 2048),
                                                                     ctx.sizes["lora_block"])})
        try:
            out.append(lora_row(ctx, label, cfg, ctx.sizes["lora_steps"],
                                loss_steps=loss_steps.get(str(i), ctx.sizes["lora_loss_steps"] if i == 0 else 0)))
        except Exception as e:  # noqa: BLE001 - one row failing (out of memory, say) leaves the other
            full = re.search("RESOURCE_EXHAUSTED|[Oo]ut of memory", str(e))
            out.append(dict(label=label, note=f"{'does not fit' if full else 'error'}: {g.one_line(e)}"))
        ctx.put(lora_runs=out)


# Mixture-of-experts shapes: (key, label, preset, settings over it), each cut to fit one v5e with bf16 weights,
# gradients and Adam moments, at about 14 GiB by the compiler's peak (`jaxlm compile ... compile.topology=v5e-1`:
# docs/performance.md, "Mixtures of experts"). Both keep their experts and routing; the vocabulary is Mixtral's
# 32,000, so that the output projection (a dense matmul) does not outweigh the layers' experts. Qwen3-MoE: 128
# experts of width 768, 8 a token, at the published width, 2 of 48 layers (14.91 GiB; 3 rows a step instead of 4
# still 14.89: the peak is not the activations'). Mixtral: 8 experts, 2 a token, at maxtext_base's widths (d_model
# 2,048, experts of 7,168: half the published ones), 3 of 32 layers (13.3 GiB). 4 x 2,048 tokens a step.
MOE_SHAPES = [
    ("qwen3_moe", "Qwen3-MoE shape: 2 layers, 128 experts x 768, top-8", "qwen3_30b_a3b",
     {"model.n_layers": 2, "model.vocab_size": 32000, "training.batch_size": 4}),
    ("mixtral", "Mixtral shape: 3 layers, d_model 2,048, 8 experts x 7,168, top-2", "mixtral_8x7b",
     {"model.n_layers": 3, "model.d_model": 2048, "model.n_heads": 16, "model.n_kv_heads": 8, "model.d_ff": 7168,
      "model.vocab_size": 32000, "training.batch_size": 4}),
]
MOE_DISPATCH = ("ragged_dot", "megablox", "dense")  # each shape's rows; dense: d_ff = top-k x the experts' width
MOE_TRAIN = {"model.param_dtype": "bfloat16", "model.compute_dtype": "bfloat16", "model.remat": "full",
             "optimizer.lr": 1e-3, "optimizer.min_lr": 1e-4, "optimizer.warmup_steps": 2}
# megablox tilings (model.moe_tiles: the largest rows, contracted, out tiles) that JAXLM_BENCH_MOE_TILES=all times
# beside each shape's default megablox row: each compiles within the kernel's VMEM for all three of its calls
# (forward gmm, the input gradient's gmm over the transposed weights, the weights' tgmm) for a v5e from this host
# (benchmarks/moe_hlo.py --tiles; docs/performance.md, "Mixtures of experts"). Qwen3-MoE: smaller row tiles waste
# less of the MXU on the 128 experts' partial tiles (512 rows an expert on average); Mixtral: fewer, longer steps
# over the contracted width.
MOE_TILES = {"qwen3_moe": ("256,1024,1024", "128,2048,1024", "256,2048,1024"),
             "mixtral": ("1024,512,1024", "512,512,2048", "2048,512,512")}


def _per_shape(text: str, every: list) -> dict:
    """An extra-rows variable's value by shape: '/'-separated entries, each VALUE (every shape) or SHAPE:VALUE."""
    out = {}
    for entry in filter(None, (e.strip() for e in text.split("/"))):
        shape, _, value = entry.rpartition(":")
        for key in ([shape] if shape else every):
            out.setdefault(key, []).append(value)
    return out


def moe_extras(tiles: str, accum: str, unrolled: str = "") -> list[tuple[str, str, dict]]:
    """The moe section's extra rows, (shape key, dispatch, settings over the megablox row's): megablox with each
    tiling `tiles` names (JAXLM_BENCH_MOE_TILES: 'all' for MOE_TILES, or TM,TK,TN entries, '/'-separated, each
    optionally SHAPE:TM,TK,TN), then the MoE at model.moe_matmul=auto (megablox on a TPU, ragged_dot elsewhere:
    the default a user gets) and the dense model, both with training.grad_accum=N for each N `accum` names
    (JAXLM_BENCH_MOE_ACCUM, e.g. 4 or qwen3_moe:4): Adam's update over all the weights amortized over N
    micro-batches, as a real MoE run at millions of tokens a step amortizes it; then, for each shape `unrolled`
    names (JAXLM_BENCH_MOE_UNROLLED: 1 for every shape, or SHAPE:1), the MoE at auto and the dense model with
    their layers unrolled (model.scan_layers=false: no copies of the stacked expert weights a layer)."""
    keys = [key for key, *_ in MOE_SHAPES]
    chosen = ({k: list(v) for k, v in MOE_TILES.items()} if tiles.strip() == "all" else _per_shape(tiles, keys))
    out = []
    for key in keys:
        for t in chosen.get(key, []):
            out.append((key, "megablox_tiles_" + t.replace(",", "_"), {"model.moe_tiles": t}))
        for n in _per_shape(accum, keys).get(key, []):
            out += [(key, f"{d}_accum{n}", {"training.grad_accum": int(n)}) for d in ("auto", "dense")]
        if _per_shape(unrolled, keys).get(key):
            out += [(key, f"{d}_unrolled", {"model.scan_layers": False}) for d in ("auto", "dense")]
    return out


def moe_configs(ctx: Ctx, tiles: str = "", accum: str = "", unrolled: str = "") -> list[tuple[str, str, str, object]]:
    """The moe section's rows in order, (shape key, shape label, dispatch, config): each MOE_SHAPES shape with
    model.moe_matmul=ragged_dot, =megablox, and as the dense model of equal active parameters (same layers and
    widths, no experts, d_ff = experts_per_token x the experts' width); then moe_extras(tiles, accum, unrolled)'s
    rows.
    JAXLM_BENCH_MOE_ROWS=0,3 indexes the six default rows (the extra rows run whenever their variables name them)."""
    from jaxlm import config as config_lib

    z = ctx.sizes
    out, extra = [], []
    for key, label, preset, settings in MOE_SHAPES:
        over = {"mesh.ici_data": 1, **MOE_TRAIN, **settings, **z.get("moe_model", {}),
                **z.get("moe_experts", {}).get(preset, {}), "model.block_size": z["moe_block"],
                "training.steps": z["moe_steps"] + 1}
        if "moe_batch" in z:  # tiny sizes
            over["training.batch_size"] = z["moe_batch"]
        m = config_lib.load(preset, over).model
        dense = {"model.n_experts": 0, "model.expert_d_ff": None, "model.d_ff": m.experts_per_token * m.expert_ff}
        for dispatch in MOE_DISPATCH:
            out.append((key, label, dispatch, config_lib.load(preset, {**over, **(
                dense if dispatch == "dense" else {"model.moe_matmul": dispatch})})))
        for k, dispatch, settings_x in moe_extras(tiles, accum, unrolled):
            if k == key:
                base = (dense if dispatch.startswith("dense") else
                        {"model.moe_matmul": "auto" if dispatch.startswith("auto") else "megablox"})
                extra.append((key, label, dispatch, config_lib.load(preset, {**over, **base, **settings_x})))
    return out + extra


def moe_row(ctx: Ctx, cfg, tokens: np.ndarray, steps: int, profile: bool = False) -> dict:
    """A train step as `jaxlm train` compiles it, trained `steps` + 1 steps from the config's seed on rows of
    `tokens` (the same batches for every row): the losses of each step, the median time of the steps after the
    first, tokens/s, FLOPs per token by the active parameters (the causal count `jaxlm train` prints), the
    compiler's peak bytes (what `jaxlm compile ... compile.topology=v5e-1` predicts) and the chip's peak in use;
    with `profile`, the step's device time by kind from a trace."""
    import jax

    from jaxlm.model import flops, moe
    from jaxlm.train import preflight, state as state_lib, step as step_lib

    dev = jax.devices()[0]
    B, T, A = cfg.training.batch_size, cfg.model.block_size, cfg.training.grad_accum
    run, compiled, mem, secs = g.compile_step(cfg, B, dev)
    counts = flops.param_counts(cfg.model)
    row = dict(batch=B, block=T, grad_accum=A, tokens_per_step=A * B * T, moe_tiles=cfg.model.moe_tiles, bytes=mem,
               compile_s=round(secs, 1),
               predicted_peak_bytes=preflight.peak_bytes(compiled.memory_analysis()),
               flops_causal=flops.flops_per_token(cfg.model, causal=True), params_total=counts["total"],
               params_active=counts["active"], n_experts=cfg.model.n_experts,
               moe_matmul=moe.grouped_matmul(cfg.model.moe_matmul) if cfg.model.n_experts else None)
    shape = step_lib.abstract_batch(run)["inputs"]
    state = state_lib.init_state(run, cfg.seed)
    losses, times = [], []
    for i in range(steps + 1):
        if times and ctx.left() < 5 + 2 * max(times):
            break
        rows = tokens[i * A * B:(i + 1) * A * B].reshape(*shape.shape[:-1], T + 1)
        batch = {k: jax.device_put(np.ascontiguousarray(x), shape.sharding)
                 for k, x in (("inputs", rows[..., :-1]), ("targets", rows[..., 1:]))}
        t = time.perf_counter()
        state, m = compiled(state, batch)
        losses.append(float(m["loss"]))  # waits for the step
        if i:
            times.append(time.perf_counter() - t)
    step_s = statistics.median(times) if times else None
    stats = dev.memory_stats() or {}
    row.update(step_s=step_s, tokens_per_s=A * B * T / step_s if step_s else None, losses=[round(x, 5) for x in losses],
               peak_bytes_in_use=stats.get("peak_bytes_in_use"), bytes_limit=stats.get("bytes_limit"))
    if profile and ctx.left() > 4 * (step_s or 1) + 30:  # where the step's time goes, by kind (as the maxtext rows)
        try:
            _, row["breakdown"] = g.profile(compiled, state, batch, ctx.sizes["profile_steps"])
        except Exception as e:  # noqa: BLE001 - the breakdown is one figure of several; say why it is missing
            row["breakdown"] = g.cost_breakdown(compiled, f"trace unavailable: {g.one_line(e)}")
    return row


def moe(ctx: Ctx) -> None:
    """Mixtures of experts on one chip (MOE_SHAPES): each shape trained moe_steps + 1 steps of a Markov corpus with
    its experts' grouped matmul by ragged_dot and by megablox (model.moe_matmul), from the same initialization and
    batches, so their losses differ by rounding only, and the dense model of equal active parameters beside them:
    tokens/s, FLOPs per token by the active parameters, the losses, the compiled step's memory. Then the extra rows
    JAXLM_BENCH_MOE_TILES (megablox tilings), JAXLM_BENCH_MOE_ACCUM (micro-batches a step) and
    JAXLM_BENCH_MOE_UNROLLED (the layers unrolled) ask for (moe_extras; untraced)."""
    import gc

    z = ctx.sizes
    # e.g. "0,1": only those rows of moe_configs; tiny: one shape in all three dispatches, the other by megablox
    chosen = os.environ.get("JAXLM_BENCH_MOE_ROWS", z.get("moe_rows"))
    configs = moe_configs(ctx, os.environ.get("JAXLM_BENCH_MOE_TILES", z.get("moe_tiles", "")),
                          os.environ.get("JAXLM_BENCH_MOE_ACCUM", z.get("moe_accum", "")),
                          os.environ.get("JAXLM_BENCH_MOE_UNROLLED", z.get("moe_unrolled", "")))
    tokens, entropy = g.markov_tokens(configs[0][3].model.vocab_size, (z["moe_steps"] + 1) * max(
        c.training.batch_size * c.training.grad_accum for *_, c in configs),
                                      z["moe_block"] + 1)
    ctx.put(moe_steps=z["moe_steps"], moe_entropy=entropy)
    out = []
    for i, (key, label, dispatch, cfg) in enumerate(configs):
        if chosen and i < len(MOE_SHAPES) * len(MOE_DISPATCH) and str(i) not in chosen.split(","):
            continue
        row = dict(shape=key, label=label, dispatch=dispatch)
        if out and ctx.left() < 30:
            out.append(dict(row, note=f"skipped: time budget ({ctx.left():.0f} s left)"))
            ctx.put(moe_runs=out)
            continue
        try:
            row.update(moe_row(ctx, cfg, tokens, z["moe_steps"], profile=dispatch in ("megablox", "dense")))
        except Exception as e:  # noqa: BLE001 - one row failing (out of memory, say) leaves the others
            full = re.search("RESOURCE_EXHAUSTED|[Oo]ut of memory", str(e))
            row["note"] = f"{'does not fit' if full else 'error'}: {g.one_line(e)}"
        out.append(row)
        ctx.put(moe_runs=out)
        gc.collect()


def int8_model(ctx: Ctx):
    """(params, ModelConfig): llama3.1-8b's shape (tiny sizes: SIZES' lora_model) with its weights in the layout
    decode.quantize_weights=int8 serves (quant.serving_params: every layer's matmul weights and the output
    projection int8 with a float32 scale per output channel; norms and the embedding bf16), random and made on the
    chip leaf by leaf (small leaves together: made_in_chunks): an 8B model in bf16 (16 GB) does not fit beside it.
    int8 values uniform over [-128, 127] with scales near 0.02 / 74 (weights of standard deviation about 0.02, as
    the initializer's), norms 1."""
    import jax
    import jax.numpy as jnp

    from jaxlm import params as P
    from jaxlm.model import param_specs, quant

    z = ctx.sizes
    block = max(z["decode_prompt"] + z["decode_new"], z["serve_prompt"] + z["serve_new"])
    cfg = load("llama3_1_8b", ctx, {"model.param_dtype": "bfloat16", "model.compute_dtype": "bfloat16",
                                    "model.block_size": block}).model
    shapes = jax.eval_shape(lambda p: quant.serving_params(p, cfg), P.abstract(param_specs(cfg)))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    paths, tree = jax.tree_util.tree_flatten_with_path(shapes)

    def make(i, path, a):
        key, name = jax.random.key(i), jax.tree_util.keystr(path)
        if a.dtype == jnp.int8:
            # random bytes (no int32 draw of the weight's size: 7.5 GB for an 8B MLP stack)
            fn = lambda: jax.lax.bitcast_convert_type(jax.random.bits(key, a.shape, jnp.uint8), jnp.int8)  # noqa
        elif name.endswith(".scale"):
            fn = lambda: (0.02 / 74 * jax.random.uniform(key, a.shape, jnp.float32, 0.5, 1.5)).astype(a.dtype)  # noqa
        elif "norm" in name:
            fn = lambda: jnp.ones(a.shape, a.dtype)  # noqa: E731
        else:
            fn = lambda: (0.02 * jax.random.normal(key, a.shape, jnp.float32)).astype(a.dtype)  # noqa: E731
        return fn, jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one)

    return jax.tree.unflatten(tree, made_in_chunks([make(i, path, a) for i, (path, a) in enumerate(paths)])), cfg


def hbm_copy(ctx: Ctx) -> float:
    """An HBM copy's rate (bytes read plus written per second; the yardsticks section's measure), for the decode
    rows' bandwidth when this run has no yardsticks section."""
    import jax
    import jax.numpy as jnp

    z = ctx.sizes
    x = jax.random.uniform(jax.random.key(2), (z["copy_bytes"] // 4,), jnp.float32)
    scale = jax.jit(lambda x: x * 1.5)
    return g.best_rate(lambda: scale(x), 2.0 * x.nbytes, z["yard_reps"])[0]


def decode_int8_8b(ctx: Ctx) -> None:
    """generate at batch 1 over llama3.1-8b's shape with int8 weights (int8_model), greedy: decode tokens/s and the
    bytes a step reads (every weight once, the untied embedding one row, the cache's filled part) against an HBM
    copy measured here; the chip's memory in use with the weights on it."""
    import gc

    import jax

    from jaxlm.config import DecodeConfig
    from jaxlm.infer import generate
    from jaxlm.model import quant

    z = ctx.sizes
    P0, N = z["decode_prompt"], z["decode_new"]
    ctx.put(decode8b_hbm_copy=hbm_copy(ctx))
    params, cfg = int8_model(ctx)
    dev = jax.devices()[0]
    weight_bytes = quant.nbytes(params)
    if not cfg.tie_embeddings:
        table = params["embed"]["tokens"]
        weight_bytes -= table.nbytes - table.nbytes // table.shape[0]
    kv_bytes = 2 * cfg.n_layers * cfg.kv_heads * cfg.hd * 2 * (P0 + N / 2)
    ctx.put(decode8b_weight_bytes=weight_bytes, decode8b_kv_bytes_per_step=kv_bytes, decode8b_prompt=P0,
            decode8b_new=N, decode8b_param_bytes=quant.nbytes(params),
            decode8b_bytes_in_use=(dev.memory_stats() or {}).get("bytes_in_use"))
    prompts = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, P0)).tolist()
    d = DecodeConfig(max_new_tokens=N, temperature=0.0)
    first = generate.generate(params, cfg, prompts, d)
    out = generate.generate(params, cfg, prompts, d)
    ctx.put(decode8b_b1=dict(decode_s=out.decode_s, compile_s=first.compile_s, step_ms=1e3 * out.decode_s / N,
                             decode_tokens_per_s=N / out.decode_s,
                             bytes_per_s=(weight_bytes + kv_bytes) / (out.decode_s / N)))
    del params, out, first
    gc.collect()


def serve_int8_8b(ctx: Ctx) -> None:
    """The serving engine over llama3.1-8b's shape with int8 weights (int8_model): serve_concurrency slots and as
    many greedy requests of serve_prompt + serve_new tokens at once, output tokens/s of the third round (the first
    two compile: prefill into fresh slots, then into used ones), and the chip's memory in use."""
    import jax

    from jaxlm.config import ServeConfig
    from jaxlm.serve.engine import Engine

    z = ctx.sizes
    C, P0, N = z["serve_concurrency"], z["serve_prompt"], z["serve_new"]
    params, cfg = int8_model(ctx)
    e = Engine(params, cfg, ServeConfig(max_slots=C, max_queue=C, prefill_chunk=C * P0, prefix_cache=0), P0 + N)
    e.start()
    rounds = []
    try:
        for r in range(3):
            if rounds and ctx.left() < 2 * rounds[-1]["wall_s"] + 5:
                break
            stats = jax.devices()[0].memory_stats() or {}
            rounds.append(dict(g.engine_round(e, cfg, C, P0, N, seed=r), bytes_in_use=stats.get("bytes_in_use"),
                               peak_bytes_in_use=stats.get("peak_bytes_in_use")))
            ctx.put(serve8b_rounds=g.lean(rounds), serve8b_concurrency=C, serve8b_page_size=e.kv.page_size)
    finally:
        e.stop()


def decode(ctx: Ctx) -> None:
    """generate on the 1B shape in bf16 (gpu_sections.decode, with batch 64's call under the profiler, time left
    for the next row), then batch 1 on llama3.1-8b's shape with int8 weights (decode_int8_8b), while time is
    left."""
    import gc

    g.decode(ctx, reserve=0 if ctx.tiny else 60)
    gc.collect()
    row_8b(ctx, decode_int8_8b, "decode8b_note", 60)


def row_8b(ctx: Ctx, fn, note: str, need: float) -> None:
    """A section's llama3.1-8b row fn(ctx) when `need` seconds are left; a skip or a failure (which leaves the
    section's 1B rows) written under `note`."""
    if ctx.left() <= need:
        ctx.put(**{note: f"skipped: time budget ({ctx.left():.0f} s left)"})
        return
    try:
        fn(ctx)
    except Exception as e:  # noqa: BLE001 - say why in one line
        ctx.put(**{note: f"error: {g.one_line(e)}"})


def kernel_entries(kernels: str) -> list[tuple[str, str, str]]:
    """JAXLM_BENCH_SERVE_KERNELS, entries KERNEL[:KEY=VALUE...] separated by commas (KERNEL one of
    serve.attention_kernel's values; the ragged kernel's settings, serve.attention_kernel_options, after colons,
    e.g. "ragged,ragged:heads_batched=0:page_steps=0:prefetch=1,jax": the ragged kernel with its defaults, then as
    first written), as (tag, kernel, options) with tag the entry's name in its figures
    (ragged_heads_batched_0_page_steps_0_prefetch_1) and options as serve.attention_kernel_options takes them; a
    bad or repeated entry stops the run in one line."""
    from jaxlm.config import ConfigError, kernel_options
    from jaxlm.model import paged

    out = []
    for entry in filter(None, (e.strip() for e in kernels.split(","))):
        name, *settings = (x.strip() for x in entry.split(":"))
        if name not in paged.ATTENTION_KERNELS:
            raise SystemExit(f"JAXLM_BENCH_SERVE_KERNELS={kernels!r}: {name!r} unknown; choose from "
                             f"{', '.join(paged.ATTENTION_KERNELS)}")
        if settings and name != "ragged":
            raise SystemExit(f"JAXLM_BENCH_SERVE_KERNELS={kernels!r}: {entry!r}: only the ragged kernel takes settings")
        try:
            kernel_options(",".join(settings))
        except ConfigError as e:
            raise SystemExit(f"JAXLM_BENCH_SERVE_KERNELS={kernels!r}: {e}") from None
        tag = "_".join([name, *(x.replace("=", "_") for x in settings)])
        if tag in [t for t, *_ in out]:
            raise SystemExit(f"JAXLM_BENCH_SERVE_KERNELS={kernels!r}: {entry!r} given twice")
        out.append((tag, name, ",".join(settings)))
    return out


def serve_kernels(ctx: Ctx, kernels: str) -> None:
    """The 1B serve row once per entry of `kernels` (JAXLM_BENCH_SERVE_KERNELS: a paged-attention kernel,
    serve.attention_kernel's values, with the ragged kernel's settings if any: kernel_entries), in this process
    one after another: each prints its output tokens/s and, where the round was profiled, the Pallas kernels'
    share of the device's time (on the 1B shape the paged attention's alone), and writes serve_<tag>_rounds and
    serve_<tag>_profile; each entry after the first, the share of the requests whose greedy tokens equal the first
    entry's (serve_<tag>_same_tokens_as_first: 1.0 where the two compute the same values, as the pool's writes by
    kernel and by scatter do) and the mean share of a request's tokens before its first that differs
    (serve_<tag>_common_prefix_as_first: greedy decoding of random weights parts at any near-tie of the logits, so
    a kernel whose values differ from the first's by a rounding keeps a long common prefix on average, where a wrong
    one parts at the first tokens)."""
    import gc

    first = None  # (label, digests, tokens) of the first entry that ran, each later entry's reference
    for tag, name, options in kernel_entries(kernels):
        label = " ".join([f"attention_kernel={name}", *options.split(",")]).strip()
        try:
            out = g.serve(ctx, attention_kernel=name, kernel_options=options, tag=tag)
        except Exception as e:  # noqa: BLE001 - one kernel failing leaves the others
            print(f"serve 1B {label}: error: {g.one_line(e)}", flush=True)
            ctx.put(**{f"serve_{tag}_note": f"error: {g.one_line(e)}"})
            continue
        digests, outputs = out["round"]["digests"], out["round"]["outputs"]
        if first is None:
            first = label, digests, outputs
        else:  # the same seed's prompts: settings that compute the same values give the same tokens, request by request
            same = sum(a == b for a, b in zip(digests, first[1])) / len(digests)
            prefix = g.common_prefix(outputs, first[2])
            ctx.put(**{f"serve_{tag}_same_tokens_as_first": same, f"serve_{tag}_common_prefix_as_first": prefix})
            print(f"serve 1B {label}: greedy tokens of {same:.0%} of the requests as {first[0]}'s, "
                  f"{prefix:.0%} of a request's tokens before the first that differs (mean)", flush=True)
        prof = out.get("profile", {})
        ms = prof.get("ms_per_step")
        share = prof["by_kind"].get("Pallas kernel (TPU)", 0) / ms if ms else None
        attention = prof.get("by_scope", {}).get("attention kernel", 0) / ms if ms else None
        print(f"serve 1B {label}: {out['round']['output_tokens_per_s']:.1f} output tokens/s, "
              + (f"Pallas kernels {share:.1%} (attention {attention:.1%}) of {ms:.0f} ms device time"
                 if share is not None else "not profiled"), flush=True)
        gc.collect()


def serve(ctx: Ctx) -> None:
    """The engine on the 1B shape in bf16 (gpu_sections.serve, with its profiled round; once per kernel of
    JAXLM_BENCH_SERVE_KERNELS when set: serve_kernels), then on llama3.1-8b's shape with int8 weights
    (serve_int8_8b), while time is left and unless JAXLM_BENCH_SERVE_8B=0."""
    import gc

    kernels = os.environ.get("JAXLM_BENCH_SERVE_KERNELS")
    if kernels:
        serve_kernels(ctx, kernels)
    else:
        g.serve(ctx)
    gc.collect()
    if os.environ.get("JAXLM_BENCH_SERVE_8B", "1") == "0":  # the 1B rows only
        ctx.put(serve8b_note="skipped: JAXLM_BENCH_SERVE_8B=0")
    else:
        row_8b(ctx, serve_int8_8b, "serve8b_note", 80)


SECTIONS = {f.__name__: f for f in (yardsticks, maxtext, gpt2, long, quant, lora, vision, moe, decode, serve)}


if __name__ == "__main__":
    g.main(SECTIONS, Ctx, __doc__)
