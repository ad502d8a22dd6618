"""jaxlm on one TPU chip, measured by one script within a time budget (issue 43): training MFU of MaxText's default
model and of GPT-2 124M as `jaxlm train` runs them, where the step's time goes, long context, int8 training,
decoding and serving.

    PYTHONPATH=src python benchmarks/tpu.py [--only maxtext,gpt2] [--json FILE]   # one v5e chip: 2,200 s at most
    PYTHONPATH=src python benchmarks/tpu.py --tiny                               # toy sizes, on a CPU in seconds

Sections run as benchmarks/gpu.py's do (its runner): each in a process of its own (benchmarks/tpu_sections.py)
under a time limit, a failure or overrun reported in one line, the summary always printed, key=value lines then
tables. MFU is given two ways: by MaxText's count (6 x matmul weights + 12 x layers x width x block: attention as
the full square) and by the causal count `jaxlm train` prints (half of that square), each against the chip's
spec-sheet bf16 peak (197 TFLOP/s on a v5e) and against the bf16 matmul measured in the same run.

Sections and what they report:
  yardsticks  the chip, JAX's version, a bf16 matmul and an HBM copy (gpu_sections.yardsticks)
  maxtext     maxtext_base (1.1B) at 2 x 2,048 tokens: the preset as `jaxlm train maxtext_base` runs it (float32
              weights and Adam moments: its bytes against the chip's, it runs only where it fits), then bf16
              weights and moments with remat full and with remat minimal (`model.param_dtype=bfloat16
              model.remat=minimal`), the loss in one chunk, 4 and 8 micro-batches a step, batch 4, and the
              maxtext_base_v5e preset by name (16 micro-batches of 2 x 2,048); the step's time by operation from
              a jax.profiler trace for three rows
  gpt2        GPT-2 124M as the `openwebtext` preset trains it (128 sequences a micro-step, 16 micro-steps: more
              than one chip holds, so its bytes are reported), then batch 16 with bf16 weights and remat full,
              the splash kernel reading heads as [H, T] (model.splash_layout=seq_minor) and as [T, H], then [H, T]
              with the loss in one chunk under remat full, remat minimal and at batch 32
              (JAXLM_BENCH_GPT2_ROWS=0,3,4,5 runs only those rows)
  long        maxtext_base at 32,768 tokens a sequence, batch 1, bf16 weights, splash attention
  quant       int8 training against bf16 on maxtext_base's shape, 200 steps of a Markov corpus: speed and loss
              (JAXLM_BENCH_QUANT_MODES chooses the modes, empty for none); JAXLM_BENCH_QUANT_ROWS=0,1,2 first times
              those rows of tpu_sections.QUANT_ROWS: the whole maxtext_base_v5e step in int8 under remat policies
              and batch sizes, beside the bf16 preset (row 0)
  lora        QLoRA (nf4 base) of llama3.1-8b at 1 x 2,048 (and 50 steps on real text), 8,192, 49,152 and 65,536
              tokens, LoRA of llama3.2-3b (bf16 base) at 4 x 2,048, random bases made on the chip: tokens/s, MFU,
              the chip's peak memory beside the compiler's prediction. JAXLM_BENCH_LORA_ROWS=0,2 runs only those
              rows; JAXLM_BENCH_LORA_LOSS_STEPS=1:50 trains row 1 that many steps on text too (row 0: 50 unless given)
  vision      a gemma3-4b LoRA SFT step with one 896 x 896 image a row (tower frozen), 2 x 2,048: tokens/s, memory
  moe         a Qwen3-MoE-shaped and a Mixtral-shaped model (fewer layers, bf16 weights and moments), their experts
              by ragged_dot and by megablox (model.moe_matmul), 4 x 2,048 tokens, 10 timed steps of a Markov
              corpus from one initialization: tokens/s, MFU by the active parameters, both dispatches' first and
              last losses and their differences, the compiler's and the chip's peak memory; beside them the dense
              model of equal active parameters; the megablox and dense rows' step time by kind (a trace).
              JAXLM_BENCH_MOE_ROWS=1,4 runs only those of the six; JAXLM_BENCH_MOE_TILES=all adds megablox rows
              with each tiling of tpu_sections.MOE_TILES (or names them: 256,1024,1024/mixtral:512,512,2048),
              JAXLM_BENCH_MOE_ACCUM=4 rows of 4 micro-batches a step (Adam amortized): the MoE
              at model.moe_matmul=auto (megablox on a TPU) and the dense model; JAXLM_BENCH_MOE_UNROLLED=1 the
              same two with their layers unrolled (model.scan_layers=false)
  decode      generate at batch 1 and 64 (the 1B shape in bf16), batch 1's bytes per token over the HBM copy, batch
              64's call under the profiler (decode_b64_profile: by kind, scope and top operations); then
              llama3.1-8b's shape with int8 weights (decode.quantize_weights=int8's layout, random, made on the
              chip) at batch 1: its bytes per token over an HBM copy measured in the section, the chip's memory
  serve       the serving engine, 64 slots, 64 requests at once: output tokens/s, against generate's batch of 64
              when the decode section ran too, and the profiled round's share of Pallas kernels (paged attention);
              then the engine over llama3.1-8b's shape with int8 weights at 64 requests.
              JAXLM_BENCH_SERVE_KERNELS=ragged,jax runs the 1B row once per serve.attention_kernel instead,
              an entry taking the ragged kernel's settings after colons (serve.attention_kernel_options; `ragged`
              is its defaults, ragged:heads_batched=0:page_steps=0:prefetch=1 the kernel as first written):
              serve_<tag>_output_tokens_per_s, serve_<tag>_vs_generate_decode, serve_<tag>_pallas_kernel_share (and
              _attention_kernel_share: the attention kernel's alone; after the first entry _same_tokens_as_first,
              the share of requests whose greedy tokens equal the first entry's, and _common_prefix_as_first,
              the mean share of a request's tokens before its first that differs: long where the values differ
              by a rounding only),
              the tag the entry with `_` for `:` and `=`; each profiled round by kind, scope and top operations
              (named from the engine's programs' optimized HLO), to read against decode_b64_profile
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import gpu  # noqa: E402

SECTIONS_PY = Path(__file__).with_name("tpu_sections.py")
# Seconds each section may take at full size (process start included), as gpu.py's BUDGET_S: 2,200 s in all, so a
# machine whose commands stop at 10 minutes runs it in four or five (--only yardsticks,maxtext,gpt2: 450 s; long,
# quant: 560 s; lora,vision: 350 s; decode,serve: 520 s, the llama3.1-8b int8 rows included; moe: 320 s).
# Seen on a v5e (2026-12-06, second run): yardsticks 20 s, maxtext 105 (six rows), gpt2 74, long 46, quant 146 (two
# modes), decode 88, serve 88; (2026-12-07) decode 146, serve 173 (two kernels, no 8B row), moe 209 (no traces),
# lora row 0 with its 50 steps on text 122, row 1 with 50 steps 245, row 3 alone 229; (2026-12-07, later) long's
# 131,072-token row alone 221, quant's bf16 mode alone 99 (its int8 mode then skipped inside 240 s: now 320).
BUDGET_S = {"yardsticks": 30, "maxtext": 260, "gpt2": 160, "long": 240, "quant": 320, "lora": 200, "vision": 150,
            "moe": 320, "decode": 230, "serve": 290}
TOLERANCE_LOSS = 0.02  # int8 against bf16: final losses this close


def derive_rows(rows: list[dict], peak, matmul) -> None:
    """Each train row's TFLOP/s and MFU, by MaxText's count and by the causal one, against the spec and the
    measured matmul."""
    for r in rows:
        tps = r.get("tokens_per_s")
        for count in ("maxtext", "causal"):
            flops = tps * r[f"flops_{count}"] if tps and r.get(f"flops_{count}") else None
            r[f"tflops_{count}"] = flops / 1e12 if flops else None
            r[f"mfu_{count}"] = flops / peak if flops and peak else None
            r[f"mfu_{count}_vs_matmul"] = flops / matmul if flops and matmul else None


def summary(f: dict, status: dict, wall: float, tiny: bool) -> list[str]:
    y = f.get("yardsticks", {})
    peak, matmul = y.get("peak_bf16_spec"), y.get("matmul_bf16")
    peak = peak or next((s["peak_bf16_spec"] for s in f.values() if s.get("peak_bf16_spec")), None)  # --only lora
    kv: dict = {"device": y.get("device"), "platform": y.get("platform"), "jax": y.get("jax"),
                "sizes": "tiny" if tiny else "full", "wall_s": round(wall, 1)}
    kv.update({f"section_{n}": s["state"] for n, s in status.items()})
    kv.update({f"section_{n}_host_gib": s.get("peak_host_gib") for n, s in status.items()})
    if y:
        kv.update(matmul_bf16_tflops=gpu._tera(matmul), peak_bf16_spec_tflops=gpu._tera(peak),
                  hbm_copy_gbps=gpu._giga(y.get("hbm_copy")), hbm_spec_gbps=gpu._giga(y.get("hbm_spec")))
    tables: list[str] = []
    for name, key in (("maxtext", "maxtext_runs"), ("gpt2", "gpt2_runs"), ("long", "long_runs"),
                      ("quant", "quant_rows")):
        rows = f.get(name, {}).get(key, [])
        if not rows:
            continue
        derive_rows(rows, peak, matmul)
        first = rows[0]
        best = max((r for r in rows if r.get("tokens_per_s")), key=lambda r: r["tokens_per_s"], default=None)
        kv[f"{name}_default_tokens_per_s"] = first.get("tokens_per_s")
        kv[f"{name}_default_mfu_maxtext"] = first.get("mfu_maxtext")
        if first.get("note"):
            kv[f"{name}_default_note"] = first["note"]
        if best:
            kv.update({f"{name}_best": best["label"], f"{name}_best_tokens_per_s": best["tokens_per_s"],
                       f"{name}_best_mfu_maxtext": best.get("mfu_maxtext"),
                       f"{name}_best_mfu_causal": best.get("mfu_causal"),
                       f"{name}_best_mfu_maxtext_vs_matmul": best.get("mfu_maxtext_vs_matmul")})
            if name == "quant" and first.get("tokens_per_s") and first["label"].startswith("maxtext_base_v5e preset"):
                kv["quant_best_vs_bf16_preset"] = best["tokens_per_s"] / first["tokens_per_s"]
        tables += ["", f"{name} (MFU against the bf16 spec sheet; MaxText's count, then the causal count):"]
        tables += gpu._table(
            ["run", "batch x block", "tokens/s", "MFU maxtext", "MFU causal", "vs matmul", "GiB", "peak GiB",
             "predicted GiB", "compile s", "note"],
            [[r["label"], f"{r.get('batch')} x {r.get('block')}", r.get("tokens_per_s"), r.get("mfu_maxtext"),
              r.get("mfu_causal"), r.get("mfu_maxtext_vs_matmul"), r["bytes"] / 2**30 if r.get("bytes") else None,
              r["peak_bytes_in_use"] / 2**30 if r.get("peak_bytes_in_use") else None,
              r["predicted_peak_bytes"] / 2**30 if r.get("predicted_peak_bytes") else None,
              r.get("compile_s"), r.get("note", "")] for r in rows])
        for r in rows:
            if r.get("breakdown"):
                tables += breakdown(r["label"], r["breakdown"])
    q = f.get("quant", {}).get("quant_runs", {})
    if q:
        base = q.get("bfloat16", {})
        for mode in ("int8", "int8_nearest"):
            r = q.get(mode, {})
            if r.get("tokens_per_s") and base.get("tokens_per_s"):
                kv[f"quant_{mode}_speed_vs_bf16"] = r["tokens_per_s"] / base["tokens_per_s"]
            if r.get("final_loss") is not None and base.get("final_loss") is not None:
                kv[f"quant_{mode}_loss_vs_bf16"] = r["final_loss"] - base["final_loss"]
                kv[f"quant_{mode}_loss_within_{TOLERANCE_LOSS}"] = str(abs(kv[f"quant_{mode}_loss_vs_bf16"])
                                                                       <= TOLERANCE_LOSS).lower()
        tables += ["", f"int8 training against bf16, {f['quant'].get('quant_steps')} steps, "
                       f"{f['quant'].get('quant_model')}:"]
        tables += gpu._table(["mode", "tokens/s", "final loss", "compile s", "note"],
                             [[k, r.get("tokens_per_s"), r.get("final_loss"), r.get("compile_s"), r.get("note", "")]
                              for k, r in q.items()])
    lora_rows = f.get("lora", {}).get("lora_runs", []) + f.get("vision", {}).get("vision_runs", [])
    for r in lora_rows:
        key = ("vision_4b" if "gemma3" in r["label"] else f"qlora_8b_{r.get('block')}" if "8b" in r["label"]
               else "lora_3b")
        kv[f"{key}_tokens_per_s"] = r.get("tokens_per_s")
        kv[f"{key}_peak_gib"] = r["peak_bytes_in_use"] / 2**30 if r.get("peak_bytes_in_use") else None
        if r.get("tokens_per_s") and r.get("flops_causal") and peak:
            r["mfu_causal"] = kv[f"{key}_mfu"] = r["tokens_per_s"] * r["flops_causal"] / peak
        if r.get("losses"):
            kv[f"{key}_loss_first"], kv[f"{key}_loss_last"] = r["losses"][0], r["losses"][-1]
            # one step's loss on text is noisy (row 0's last 50th step: 8.01 after 5.19 two before): means of five
            n = min(5, len(r["losses"]) // 2) or 1
            kv[f"{key}_loss_first{n}_mean"] = statistics.fmean(r["losses"][:n])
            kv[f"{key}_loss_last{n}_mean"] = statistics.fmean(r["losses"][-n:])
            r["losses_text"] = (f"{kv[f'{key}_loss_first{n}_mean']:.3f} -> {kv[f'{key}_loss_last{n}_mean']:.3f} "
                                f"(means of the first and last {n} of {len(r['losses'])} steps)")
    if lora_rows:
        gib = lambda r, k: r[k] / 2**30 if r.get(k) else None  # noqa: E731
        tables += ["", "LoRA and QLoRA (rank 16 on q, k, v, o, up, gate, down; random bases; the vision row's tower "
                       "frozen; MFU by the causal count, no weight gradients for the base; 'predicted' is the "
                       "compiler's peak_memory_in_bytes, what `jaxlm compile` reports from a CPU host):"]
        tables += gpu._table(["run", "tokens/s", "MFU", "peak GiB in use", "predicted GiB", "compile s", "losses",
                              "note"],
                             [[r["label"], r.get("tokens_per_s"), r.get("mfu_causal"), gib(r, "peak_bytes_in_use"),
                               gib(r, "predicted_peak_bytes"), r.get("compile_s"),
                               r.get("losses_text", ""), r.get("note", "")] for r in lora_rows])
    mixtures(f.get("moe", {}).get("moe_runs", []), peak, matmul, kv, tables)
    derived = gpu.derive(f)
    for name, fn in (("decode", gpu._decode), ("serve", gpu._serve)):
        if name in f:
            fn(f[name], derived, kv, tables)
    serving(f, kv, tables)
    return [f"{k}={gpu._num(v, '{:.4g}')}" for k, v in kv.items() if v is not None] + tables


def mixtures(rows: list[dict], peak, matmul, kv: dict, tables: list) -> None:
    """The moe section: each row's MFU by the active parameters (causal count; against the spec and the measured
    matmul), megablox against ragged_dot in speed
    and in the first and last steps' losses (from the same initialization and batches: rounding only), each
    dispatch against the dense model of equal active parameters (of as many micro-batches a step), each megablox
    tiling (model.moe_tiles) against the default tiles."""
    if not rows:
        return
    by = {(r["shape"], r["dispatch"]): r for r in rows}
    for r in rows:
        tps = r.get("tokens_per_s")
        flops = tps * r["flops_causal"] if tps and r.get("flops_causal") else None
        r["mfu"] = flops / peak if flops and peak else None
        r["mfu_vs_matmul"] = flops / matmul if flops and matmul else None
        name = f"moe_{r['shape']}_{r['dispatch']}"
        kv[f"{name}_tokens_per_s"], kv[f"{name}_mfu"], kv[f"{name}_mfu_vs_matmul"] = tps, r["mfu"], r["mfu_vs_matmul"]
        kv[f"{name}_predicted_peak_gib"] = r["predicted_peak_bytes"] / 2**30 if r.get("predicted_peak_bytes") else None
        # against the dense row of the same settings: auto_X against dense_X (micro-batches, unrolled layers)
        partner = "dense_" + r["dispatch"][len("auto_"):] if r["dispatch"].startswith("auto_") else "dense"
        dense = by.get((r["shape"], partner), {}).get("tokens_per_s")
        if not r["dispatch"].startswith("dense") and tps and dense:
            kv[f"{name}_vs_dense"] = tps / dense
        mega = by.get((r["shape"], "megablox"), {}).get("tokens_per_s")
        if r["dispatch"].startswith("megablox_tiles") and tps and mega:  # a tiling against the default tiles
            kv[f"{name}_vs_megablox"] = tps / mega
    for shape in dict.fromkeys(r["shape"] for r in rows):
        a, b = by.get((shape, "ragged_dot"), {}), by.get((shape, "megablox"), {})
        if a.get("tokens_per_s") and b.get("tokens_per_s"):
            kv[f"moe_{shape}_megablox_vs_ragged_dot"] = b["tokens_per_s"] / a["tokens_per_s"]
        if a.get("losses") and b.get("losses"):
            kv[f"moe_{shape}_loss_first_megablox_minus_ragged_dot"] = b["losses"][0] - a["losses"][0]
            n = min(len(a["losses"]), len(b["losses"]))
            kv[f"moe_{shape}_loss_last_megablox_minus_ragged_dot"] = b["losses"][n - 1] - a["losses"][n - 1]
    gib = lambda r, k: r[k] / 2**30 if r.get(k) else None  # noqa: E731
    tables += ["", "Mixtures of experts, one chip (MFU by the active parameters, causal count; 'predicted' is the "
                   "compiler's peak_memory_in_bytes, what `jaxlm compile ... compile.topology=v5e-1` reports; the "
                   "chip's peak is the process's so far):"]
    tables += gpu._table(
        ["shape", "dispatch", "[micro-batches x] batch x block", "params", "active", "tokens/s", "MFU", "vs matmul", "predicted GiB",
         "peak GiB in use", "compile s", "loss first -> last", "note"],
        [[r["label"], r["dispatch"], f"{r.get('grad_accum', 1)} x " * (r.get("grad_accum", 1) > 1)
          + f"{r.get('batch')} x {r.get('block')}",
          f"{r['params_total'] / 1e9:.3g}B" if r.get("params_total") else None,
          f"{r['params_active'] / 1e9:.3g}B" if r.get("params_active") else None, r.get("tokens_per_s"), r.get("mfu"),
          r.get("mfu_vs_matmul"), gib(r, "predicted_peak_bytes"), gib(r, "peak_bytes_in_use"), r.get("compile_s"),
          f"{r['losses'][0]} -> {r['losses'][-1]} ({len(r['losses'])} steps)" if r.get("losses") else "",
          r.get("note", "")] for r in rows])
    for r in rows:
        if r.get("breakdown"):
            tables += breakdown(f"{r['label']}, {r['dispatch']}", r["breakdown"])


def serving(f: dict, kv: dict, tables: list) -> None:
    """The engine against generate at the same batch (the uniform workload: every prompt and output one length),
    the Pallas kernels' share of the profiled round (on a TPU: paged attention), and the llama3.1-8b rows with int8
    weights: batch-1 bytes per token over the HBM copy measured in the same run, the engine at serve_concurrency."""
    d, s = f.get("decode", {}), f.get("serve", {})
    rounds, runs = s.get("serve_rounds", []), d.get("decode_runs", {})
    C = s.get("serve_concurrency")
    same = runs.get(str(C), {}) if C else {}
    if rounds and same.get("decode_tokens_per_s"):
        kv["serve_vs_generate_decode"] = rounds[-1]["output_tokens_per_s"] / same["decode_tokens_per_s"]
        kv["serve_vs_generate_with_prefill"] = rounds[-1]["output_tokens_per_s"] / same["tokens_per_s"]
    prof = s.get("serve_profile", {})
    if prof.get("ms_per_step"):
        kv["serve_profile_pallas_kernel_share"] = prof["by_kind"].get("Pallas kernel (TPU)", 0) / prof["ms_per_step"]
    for key in s:  # the 1B row once per paged-attention kernel and settings (JAXLM_BENCH_SERVE_KERNELS)
        if m := re.fullmatch(r"serve_(\w+)_rounds", key):
            kv[f"serve_{m[1]}_output_tokens_per_s"] = s[key][-1]["output_tokens_per_s"]
            if same.get("decode_tokens_per_s"):
                kv[f"serve_{m[1]}_vs_generate_decode"] = s[key][-1]["output_tokens_per_s"] / same["decode_tokens_per_s"]
            p = s.get(f"serve_{m[1]}_profile", {})
            if p.get("ms_per_step"):  # all Pallas kernels (the pool's writes too, with write_kernel), attention's
                kv[f"serve_{m[1]}_pallas_kernel_share"] = p["by_kind"].get("Pallas kernel (TPU)", 0) / p["ms_per_step"]
                kv[f"serve_{m[1]}_attention_kernel_share"] = p["by_scope"].get("attention kernel", 0) / p["ms_per_step"]
            for name in ("same_tokens_as_first", "common_prefix_as_first"):  # the greedy tokens against the first's
                if f"serve_{m[1]}_{name}" in s:
                    kv[f"serve_{m[1]}_{name}"] = s[f"serve_{m[1]}_{name}"]
    profiles(d, s, kv, tables)
    copy = f.get("yardsticks", {}).get("hbm_copy") or d.get("decode8b_hbm_copy")
    one = d.get("decode8b_b1", {})
    if one:
        kv.update(decode8b_int8_b1_tokens_per_s=one.get("decode_tokens_per_s"),
                  decode8b_int8_b1_bytes_per_token=d["decode8b_weight_bytes"] + d["decode8b_kv_bytes_per_step"],
                  decode8b_int8_b1_bandwidth_vs_copy=one["bytes_per_s"] / copy if copy else None,
                  decode8b_int8_param_gib=d["decode8b_param_bytes"] / 2**30,
                  decode8b_int8_hbm_in_use_gib=(d.get("decode8b_bytes_in_use") or 0) / 2**30 or None)
    for key in ("decode8b_note", "serve8b_note"):
        kv[key] = d.get(key) or s.get(key)
    r8 = s.get("serve8b_rounds", [])
    if r8:
        kv[f"serve8b_int8_c{s.get('serve8b_concurrency')}_output_tokens_per_s"] = r8[-1]["output_tokens_per_s"]
        kv["serve8b_int8_peak_hbm_gib"] = (r8[-1].get("peak_bytes_in_use") or 0) / 2**30 or None
        if len(r8) < 3:
            kv["serve8b_note"] = "the last round finished also compiled"


def profiles(d: dict, s: dict, kv: dict, tables: list) -> None:
    """The profiled calls of the decode and serve sections, generate's largest batch (decode_b<batch>_profile) and
    each engine round (serve_profile, serve_<tag>_profile), in the train rows' breakdown format, so that the
    engine's operations read against generate's: each one's device time, its matmuls' and all but its Pallas
    kernels' (the engine's attention; generate has none)."""
    found = [(key, f"generate, batch {m[1]}, one call under the profiler", b) for key, b in d.items()
             if (m := re.fullmatch(r"decode_b(\d+)_profile", key))]
    found += [(key, f"serving engine{' (' + m[1] + ')' if m[1] else ''}, one round under the profiler", b)
              for key, b in s.items() if (m := re.fullmatch(r"serve_?(\w*)_profile", key))]
    for key, label, b in found:
        if "top" not in b:
            kv[f"{key}_note"] = b.get("note")
            continue
        kv[f"{key}_device_ms"] = b["ms_per_step"]
        kv[f"{key}_matmul_ms"] = b["by_kind"].get("matmul", 0)
        kv[f"{key}_not_pallas_ms"] = b["ms_per_step"] - b["by_kind"].get("Pallas kernel (TPU)", 0)
        kv[f"{key}_hlo_programs"] = b.get("hlo_programs")
        tables += breakdown(label, b)


def breakdown(label: str, b: dict) -> list[str]:
    if "top" not in b:
        return ["", f"{label}: {b.get('source')}: {b.get('flops')} FLOPs, {b.get('bytes_accessed')} bytes accessed"]
    return (["", f"{label}: step time by operation ({b['source']}; {b['ms_per_step']:.1f} ms of operations a step)",
             "  by kind: " + ", ".join(f"{k} {v:g} ms" for k, v in b["by_kind"].items()),
             "  by scope: " + ", ".join(f"{k} {v:g} ms" for k, v in b["by_scope"].items())]
            + gpu._table(["op", "kind", "scope", "type", "ms/step", "share"],
                         [[r["op"][:40], r["kind"], r["scope"], r.get("type", "")[:40], r["ms_per_step"],
                           f"{100 * r['share']:.1f}%"] for r in b["top"]]))


if __name__ == "__main__":
    gpu.main(BUDGET_S, SECTIONS_PY, summary, "tpu", __doc__)
