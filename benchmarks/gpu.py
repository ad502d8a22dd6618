"""jaxlm on one GPU, measured by one script within a time budget (issue 29): training throughput and MFU of a
Llama-3.2-1B-shaped model, where its step time goes, remat and attention variants, cuDNN attention against
blockwise, bf16 training against float32, int8 and fp8 training against bf16, decoding and serving.

    PYTHONPATH=src python benchmarks/gpu.py [--json FILE]     # sized for one H200: 445 s at most (7.4 minutes)
    PYTHONPATH=src python benchmarks/gpu.py --tiny            # the same code at toy sizes, on a CPU in seconds

Each section runs in a process of its own (benchmarks/gpu_sections.py), one after the other, under a time limit:
its share of the budget plus what the sections before it left unused. A section that fails, runs out of memory or
overruns its limit is stopped and reported in one line; what it measured before that is kept, and the summary is
always printed. The summary ends the output: key=value lines, then short tables.

Sections and what they report:
  yardsticks  the device, JAX's version, a bf16 matmul (the measured peak) and an HBM copy (the measured bandwidth);
              the spec-sheet bf16 peak and HBM bandwidth from tables (metrics.PEAK_FLOPS, gpu_sections.HBM_SPEC)
  train       the 1B model (preset llama3.2-1b: d 2048, 16 layers, GQA 32/8, vocabulary 128,256, tied; 8,192
              tokens; bf16 matmuls over float32 weights and Adam moments; full remat; attention auto; loss in chunks
              of 512), at the batch that fills 92% of the device's memory (two quick compiles give bytes per
              sequence from compiled.memory_analysis(), then the estimate is compiled and stepped down until it
              fits); tokens/s, model TFLOP/s (flops.flops_per_token, causal), MFU against the spec sheet and
              against the measured matmul; the step's time by operation from a jax.profiler trace (attributed to
              the model's named scopes through the optimized HLO; the compiler's cost analysis when no trace can
              be read); then the same step with attention=blockwise and other remat policies while time is left
  attention   cuDNN attention against blockwise, forward and gradients in bf16, for causal, grouped-query, sliding
              window and packed segments, each also against a float32 reference (CPU: blockwise only)
  precision   a small model, 100 steps in bf16 on the device against float32 on the CPU of the same machine in the
              same run (the reference) and float32 on the device, on a synthetic Markov corpus of known entropy
  quant       int8 and fp8 training against bf16 on one model: step throughput, loss after 200 steps
  decode      jaxlm.infer.generate.generate (what `jaxlm generate` runs) at batch 1 and 64 on the 1B model in bf16;
              batch 1's bytes per token (weights + filled cache) over the measured HBM bandwidth
  serve       the serving engine with 64 slots and 64 requests at once: output tokens/s

No section needs a network or a dataset: tokens are random or generated here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SECTIONS_PY = Path(__file__).with_name("gpu_sections.py")
# Seconds each section may take at full size (process start included); a section also gets what those before it
# left unused. Their sum is the whole run's budget: 445 s.
BUDGET_S = {"yardsticks": 20, "train": 220, "attention": 30, "precision": 35, "quant": 50, "decode": 45, "serve": 45}
TINY_BUDGET_S = 150  # each section at tiny sizes (a slow, shared CPU)
TOLERANCE_LOSS = 0.02  # bf16 against float32, and int8/fp8 against bf16: final losses this close
HOST_MEMORY_FRACTION = 0.8  # a section holding more of the host's memory is stopped (a TPU host's is finite too)


def run_sections(names: list[str], tiny: bool, scale: float, log, script: Path = SECTIONS_PY,
                 budget_s: dict = BUDGET_S, tag: str = "gpu", done=None) -> tuple[dict, dict, float]:
    """Run each section of `script` in its own process (benchmarks/tpu.py runs its own sections here too); returns
    (figures by section, status by section, wall seconds). `done(figures, status, wall)` is called after each
    section (main writes --json then, so that a run stopped from outside keeps the sections it finished)."""
    budgets = {n: (TINY_BUDGET_S if tiny else budget_s[n]) * scale for n in names}
    start = time.time()
    end = start + sum(budgets.values())
    figures, status = {}, {}
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")  # JAX's GPU allocator takes 75% unless told
    with tempfile.TemporaryDirectory(prefix=f"jaxlm_{tag}_") as tmp:
        for i, name in enumerate(names):
            later = sum(budgets[n] for n in names[i + 1:])
            limit = max(end - time.time() - later, 1.0)
            results = Path(tmp) / f"{name}.jsonl"
            cmd = [sys.executable, str(script), name, "--results", str(results),
                   "--deadline", str(time.time() + 0.95 * limit - 2)] + (["--tiny"] if tiny else [])
            log(f"[{tag}] section {name}: up to {limit:.0f} s")
            t = time.time()
            rc, peak, over = watch(subprocess.Popen(cmd, env=env, stdout=sys.stderr, stderr=sys.stderr), limit)
            seconds = time.time() - t
            got = {}
            if results.exists():
                for line in results.read_text().splitlines():
                    if line.strip():
                        got.update(json.loads(line))
            figures[name] = got
            if over:
                state = (f"stopped: its host memory reached {peak / 2**30:.1f} GiB, over the {over / 2**30:.1f} GiB "
                         "allowed (its figures up to then are kept)")
            elif rc is None:
                state = f"timed out after {limit:.0f} s (its figures up to then are kept)"
            elif rc != 0:
                state = "error: " + got.get("error", f"exit code {rc} (killed or crashed; see the log above)")
            else:
                state = "ok"
            status[name] = dict(state=state, seconds=round(seconds, 1), limit_s=round(limit, 1),
                                peak_host_gib=round(peak / 2**30, 2) if peak else None)
            if done is not None:
                done(figures, status, time.time() - start)
    return figures, status, time.time() - start


def host_memory_allowed() -> int | None:
    """Bytes of host memory a section may hold: HOST_MEMORY_FRACTION of the machine's (Linux), so that a section
    that runs away is stopped and reported rather than the whole run killed by the machine."""
    try:
        total_kb = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError):
        return None
    return int(total_kb * 1024 * HOST_MEMORY_FRACTION)


def resident_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return None


def watch(proc: subprocess.Popen, limit: float) -> tuple[int | None, int, int | None]:
    """Wait for a section's process: (exit code or None when it ran past `limit` seconds, its peak resident bytes
    as sampled, the allowed bytes when it went over them and was stopped, else None)."""
    allowed, peak, end = host_memory_allowed(), 0, time.time() + limit
    while True:
        try:
            return proc.wait(timeout=0.25), peak, None
        except subprocess.TimeoutExpired:
            pass
        peak = max(peak, resident_bytes(proc.pid) or 0)
        over = allowed is not None and peak > allowed
        if over or time.time() > end:
            proc.kill()
            proc.wait()
            return None, peak, allowed if over else None


# ---- the summary ------------------------------------------------------------------------------------------------

def _num(x, fmt="{:.3g}") -> str:
    return "n/a" if x is None else fmt.format(x) if isinstance(x, (int, float)) else str(x)


def _table(header: list[str], rows: list[list]) -> list[str]:
    cells = [header] + [[_num(c) if not isinstance(c, str) else c for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]


def derive(f: dict) -> dict:
    """Figures that combine sections: MFU against the peaks, bandwidth utilization, loss differences."""
    y = f.get("yardsticks", {})
    peak, mm, copy, hbm = y.get("peak_bf16_spec"), y.get("matmul_bf16"), y.get("hbm_copy"), y.get("hbm_spec")
    out: dict = {}
    t = f.get("train", {})
    fpt = t.get("train_flops_per_token")
    for r in t.get("train_runs", []):
        flops = r["tokens_per_s"] * fpt if r.get("tokens_per_s") and fpt else None
        r["tflops"] = flops / 1e12 if flops else None
        r["mfu_spec"] = flops / peak if flops and peak else None
        r["mfu_matmul"] = flops / mm if flops and mm else None
    p = f.get("precision", {}).get("precision_runs", {})
    ref = p.get("cpu_float32", {}).get("losses")
    for r in p.values():
        if r.get("losses"):
            r["final_loss"] = statistics.mean(r["losses"][-10:])
            if ref and len(ref) == len(r["losses"]):
                r["final_vs_cpu_f32"] = r["final_loss"] - statistics.mean(ref[-10:])
                r["max_abs_vs_cpu_f32"] = max(abs(a - b) for a, b in zip(r["losses"], ref))
    q = f.get("quant", {}).get("quant_runs", {})
    base = q.get("bfloat16", {})
    for r in q.values():
        if r.get("tokens_per_s") and base.get("tokens_per_s"):
            r["speed_vs_bf16"] = r["tokens_per_s"] / base["tokens_per_s"]
        if r.get("final_loss") is not None and base.get("final_loss") is not None:
            r["loss_vs_bf16"] = r["final_loss"] - base["final_loss"]
    d = f.get("decode", {})
    one = d.get("decode_runs", {}).get("1", {})
    if one.get("step_ms") and d.get("decode_weight_bytes"):
        rate = (d["decode_weight_bytes"] + d["decode_kv_bytes_per_step"]) / (one["step_ms"] / 1e3)
        out["decode_b1_bytes_per_s"] = rate
        out["decode_b1_mbu"] = rate / copy if copy else None
        out["decode_b1_mbu_spec"] = rate / hbm if hbm else None
    return out


def summary(f: dict, status: dict, wall: float, tiny: bool) -> list[str]:
    y = f.get("yardsticks", {})
    derived = derive(f)
    kv: dict = {"device": y.get("device"), "platform": y.get("platform"), "jax": y.get("jax"),
                "sizes": "tiny" if tiny else "full", "wall_s": round(wall, 1)}
    kv.update({f"section_{n}": s["state"] for n, s in status.items()})
    if y:
        kv.update(matmul_bf16_tflops=_tera(y.get("matmul_bf16")), matmul_f32_tflops=_tera(y.get("matmul_f32")),
                  peak_bf16_spec_tflops=_tera(y.get("peak_bf16_spec")),
                  hbm_copy_gbps=_giga(y.get("hbm_copy")), hbm_spec_gbps=_giga(y.get("hbm_spec")))
    lines = []
    tables: list[str] = []
    for name, fn in (("train", _train), ("attention", _attention), ("precision", _precision), ("quant", _quant),
                     ("decode", _decode), ("serve", _serve)):
        if name not in f:
            continue
        try:
            fn(f[name], derived, kv, tables)
        except Exception as e:  # noqa: BLE001 - one section's figures missing must not lose the summary
            kv[f"{name}_summary_error"] = f"{type(e).__name__}: {e}"
    lines += [f"{k}={_num(v, '{:.4g}')}" for k, v in kv.items() if v is not None]
    return lines + tables


def _tera(x):
    return None if x is None else round(x / 1e12, 2)


def _giga(x):
    return None if x is None else round(x / 1e9, 1)


def _train(t: dict, derived: dict, kv: dict, tables: list) -> None:
    runs = t.get("train_runs", [])
    kv.update(train_attention=t.get("train_attention"), train_params=t.get("train_params"),
              train_flops_per_token=t.get("train_flops_per_token"))
    if runs:
        m = runs[0]
        kv.update(train_batch=m["batch"], train_tokens_per_step=m["tokens_per_step"],
                  train_step_s=m.get("step_s"), train_tokens_per_s=m.get("tokens_per_s"),
                  train_tflops=m.get("tflops"), train_mfu=m.get("mfu_spec"), train_mfu_vs_matmul=m.get("mfu_matmul"),
                  train_memory_gib=m["bytes"] / 2**30 if m.get("bytes") else None)
        tables += ["", "training (1B shape; MFU against the bf16 spec sheet and against the matmul measured here):"]
        tables += _table(["run", "batch", "tokens/s", "TFLOP/s", "MFU spec", "MFU matmul", "GiB", "compile s", "note"],
                         [[r["label"], r["batch"], r.get("tokens_per_s"), r.get("tflops"), r.get("mfu_spec"),
                           r.get("mfu_matmul"), r["bytes"] / 2**30 if r.get("bytes") else None, r.get("compile_s"),
                           r.get("note", "")] for r in runs])
    b = t.get("train_breakdown")
    if b and "top" in b:
        kv["train_breakdown_source"] = b["source"]
        tables += ["", f"step time by operation ({b['source']}; {b['ms_per_step']:.1f} ms of operations per step):"]
        tables += ["  by scope: " + ", ".join(f"{k} {v:g} ms" for k, v in b["by_scope"].items()),
                   "  by kind: " + ", ".join(f"{k} {v:g} ms" for k, v in b["by_kind"].items()),
                   "  by pass: " + ", ".join(f"{k} {v:g} ms" for k, v in b["by_pass"].items())]
        tables += _table(["op", "kind", "scope", "ms/step", "share"],
                         [[r["op"][:40], r["kind"], r["scope"], r["ms_per_step"], f"{100 * r['share']:.1f}%"]
                          for r in b["top"]])
    elif b:
        kv["train_breakdown_source"] = b["source"]
        kv.update(train_cost_flops=b.get("flops"), train_cost_bytes=b.get("bytes_accessed"))


def _attention(a: dict, derived: dict, kv: dict, tables: list) -> None:
    cases = a.get("attention_cases", {})
    if not cases:
        return
    rows, passed = [], []
    for label, r in cases.items():
        cb, cf, bf = r.get("cudnn_vs_blockwise", {}), r.get("cudnn_vs_f32", {}), r.get("blockwise_vs_f32", {})
        note = r.get("note") or (r["cudnn"] if isinstance(r.get("cudnn"), str) else "")
        if "pass" in r:
            passed.append(r["pass"])
        rows.append([label, cb.get("out"), cb.get("grads"), cf.get("out"), cf.get("grads"), bf.get("out"),
                     bf.get("grads"), {True: "yes", False: "NO"}.get(r.get("pass"), "-"), note])
    kv["attention_cudnn_equals_blockwise"] = (("true" if all(passed) else "false") + f" ({sum(passed)} of "
                                              f"{len(passed)} cases)") if passed else "n/a"
    tol = a.get("attention_tolerance", {})
    tables += ["", f"attention, ||a - b|| / ||b|| (shape {a.get('attention_shape')}; pass: cudnn within "
                   f"{tol.get('out')} of blockwise on the output, {tol.get('grads')} on the gradients):"]
    tables += _table(["case", "cudnn~blk out", "grads", "cudnn~f32 out", "grads", "blk~f32 out", "grads", "pass",
                      "note"], rows)


def _precision(p: dict, derived: dict, kv: dict, tables: list) -> None:
    runs = p.get("precision_runs", {})
    if not runs:
        return
    bf = runs.get("device_bfloat16", {})
    if bf.get("final_vs_cpu_f32") is not None:
        d = bf["final_vs_cpu_f32"]
        kv.update(precision_bf16_vs_f32_final=d, precision_bf16_vs_f32_max=bf["max_abs_vs_cpu_f32"],
                  precision_bf16_tracks_f32=str(abs(d) <= TOLERANCE_LOSS).lower())
    tables += ["", f"bf16 against float32, {p.get('precision_steps')} steps (final: mean of the last 10; the "
                   f"corpus's entropy {p.get('precision_entropy', 0):.3f} nats):"]
    tables += _table(["run", "device", "first loss", "final loss", "final - cpu f32", "max |diff|", "seconds"],
                     [[k, r.get("device", ""), r["losses"][0] if r.get("losses") else None, r.get("final_loss"),
                       r.get("final_vs_cpu_f32"), r.get("max_abs_vs_cpu_f32"), r.get("seconds")]
                      for k, r in runs.items()])


def _quant(q: dict, derived: dict, kv: dict, tables: list) -> None:
    runs = q.get("quant_runs", {})
    if not runs:
        return
    for mode in ("fp8", "int8"):
        r = runs.get(mode, {})
        kv[f"quant_{mode}_speed_vs_bf16"] = r.get("speed_vs_bf16")
        if r.get("loss_vs_bf16") is not None:
            kv[f"quant_{mode}_loss_vs_bf16"] = r["loss_vs_bf16"]
            kv[f"quant_{mode}_loss_within_{TOLERANCE_LOSS}"] = str(abs(r["loss_vs_bf16"]) <= TOLERANCE_LOSS).lower()
    kv["quant_note"] = q.get("quant_note")
    tables += ["", f"quantized training, {q.get('quant_steps')} steps, model {q.get('quant_model')}:"]
    tables += _table(["mode", "tokens/s", "vs bf16", "final loss", "- bf16", "compile s", "note"],
                     [[k, r.get("tokens_per_s"), r.get("speed_vs_bf16"), r.get("final_loss"), r.get("loss_vs_bf16"),
                       r.get("compile_s"), r.get("note", "")] for k, r in runs.items()])


def _decode(d: dict, derived: dict, kv: dict, tables: list) -> None:
    runs = d.get("decode_runs", {})
    for b, r in runs.items():
        kv[f"generate_b{b}_decode_tokens_per_s"] = r.get("decode_tokens_per_s")
    kv.update(decode_b1_mbu=derived.get("decode_b1_mbu"), decode_b1_mbu_spec=derived.get("decode_b1_mbu_spec"),
              decode_b1_bytes_per_token=(d["decode_weight_bytes"] + d["decode_kv_bytes_per_step"])
              if "decode_weight_bytes" in d else None)
    tables += ["", f"generate ({d.get('decode_prompt')}-token prompts, {d.get('decode_new')} new tokens, greedy):"]
    tables += _table(["batch", "decode tokens/s", "with prefill", "ms/step", "prefill s", "compile s", "note"],
                     [[b, r.get("decode_tokens_per_s"), r.get("tokens_per_s"), r.get("step_ms"), r.get("prefill_s"),
                       r.get("compile_s"), r.get("note", "")] for b, r in runs.items()])


def _serve(s: dict, derived: dict, kv: dict, tables: list) -> None:
    rounds = s.get("serve_rounds", [])
    if rounds:
        kv[f"serve_c{s.get('serve_concurrency')}_output_tokens_per_s"] = rounds[-1]["output_tokens_per_s"]
        kv["serve_first_round_tokens_per_s"] = rounds[0]["output_tokens_per_s"]
        if len(rounds) < 3:
            kv["serve_note"] = "the last round finished also compiled"
    prof = s.get("serve_profile", {})
    if "by_kind" in prof:  # the profiled round: where the engine's device time goes, and how busy the device was
        kv["serve_profile_device_busy"] = prof.get("device_busy")
        tables += ["", f"serving engine, one round under the profiler ({prof['wall_ms']:.1f} ms wall, "
                   f"{prof['ms_per_step']:.1f} ms of device operations; {prof['source']}):"]
        tables += _table(["kind", "ms"], [[k, v] for k, v in prof["by_kind"].items()])
        tables += _table(["top operation not a matmul", "kind", "ms"],
                         [[r["op"], r["kind"], r["ms_per_step"]] for r in prof.get("top_not_matmul", [])[:8]])


def main(budget_s: dict = BUDGET_S, script: Path = SECTIONS_PY, summarize=None, tag: str = "gpu",
         doc: str = __doc__) -> None:
    """The command line of this script, and of benchmarks/tpu.py with its own sections, budgets and summary."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="toy sizes: the CPU path CI runs")
    ap.add_argument("--only", help="comma-separated sections (default: all, in order)")
    ap.add_argument("--json", help="also write every figure to this file")
    ap.add_argument("--budget-scale", type=float, default=1.0, help="multiply every section's time budget")
    a = ap.parse_args()
    names = list(budget_s)
    if a.only:
        names = [n.strip() for n in a.only.split(",")]
        unknown = [n for n in names if n not in budget_s]
        if unknown:
            sys.exit(f"error: unknown section(s) {', '.join(unknown)}; sections: {', '.join(budget_s)}")
    def write(figures, status, wall, partial=True):
        if a.json:  # after each section (partial: later sections not run yet), then whole
            Path(a.json).write_text(json.dumps({"figures": figures, "status": status, "derived": derive(figures),
                                                "wall_s": wall, "partial": partial}, indent=1, default=str))

    figures, status, wall = run_sections(names, a.tiny, a.budget_scale,
                                         lambda s: print(s, file=sys.stderr, flush=True), script, budget_s, tag,
                                         write)
    lines = (summarize or summary)(figures, status, wall, a.tiny)
    print("\n".join(["", f"==== jaxlm {tag.upper()} benchmark summary (benchmarks/{tag}.py) ===="] + lines),
          flush=True)
    write(figures, status, wall, partial=False)


if __name__ == "__main__":
    main()
