"""benchmarks/gpu.py: the whole script at tiny sizes on the CPU (the path CI keeps working; its real sizes run on
an H200, docs/performance.md), a section stopped at its time limit, and on hand-made inputs what only a GPU run
exercises: a GPU trace's layout, the HLO's cuBLAS and cuDNN calls, and the summary's arithmetic."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import first_run_environment, xla_flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu  # noqa: E402
import gpu_sections  # noqa: E402


def run_script(*args: str) -> tuple[dict[str, str], str]:
    env = first_run_environment(XLA_FLAGS=xla_flags(), PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), *args], capture_output=True, text=True,
                       env=env, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = p.stdout.split("==== jaxlm GPU benchmark summary (benchmarks/gpu.py) ====")[1]
    kv = dict(line.split("=", 1) for line in summary.splitlines() if "=" in line and " " not in line.split("=")[0])
    return kv, summary


@pytest.mark.slow
@pytest.mark.in_ci  # the script runs in CI at tiny sizes
def test_every_section_runs_at_tiny_sizes_on_cpu(tmp_path):
    # decode and serve run in tests/test_benchmark_tpu.py: benchmarks/tpu.py's decode and serve sections run these
    # (gpu_sections.decode and .serve, at the same tiny sizes) and its summary prints them through gpu.py's
    run = [name for name in gpu.BUDGET_S if name not in ("decode", "serve")]
    kv, text = run_script("--tiny", "--only", ",".join(run), "--json", str(tmp_path / "gpu.json"))
    states = {name: kv[f"section_{name}"] for name in run}
    assert set(states.values()) == {"ok"} and "section_decode" not in kv, states
    assert kv["platform"] == "cpu" and kv["sizes"] == "tiny"
    assert float(kv["matmul_bf16_tflops"]) > 0 and float(kv["hbm_copy_gbps"]) > 0
    # training: the memory search reaches the cap of 4 sequences within 40 MiB, and the figures agree
    assert kv["train_batch"] == "4" and kv["train_tokens_per_step"] == "512"
    assert float(kv["train_tokens_per_s"]) == pytest.approx(512 / float(kv["train_step_s"]), rel=1e-3)
    assert kv["train_breakdown_source"].startswith("jax.profiler trace")
    figures = json.loads((tmp_path / "gpu.json").read_text())["figures"]
    runs = {r["label"]: r for r in figures["train"]["train_runs"]}
    assert list(runs) == ["auto, remat=full (preset)", "attention=cudnn", "attention=blockwise", "remat=minimal"]
    assert runs["attention=cudnn"]["note"] == "skipped: not a GPU"
    for label in ("attention=blockwise", "remat=minimal"):  # at the main step's batch: 40 MiB holds them
        assert runs[label]["batch"] == 4 and runs[label]["tokens_per_s"] > 0 and runs[label]["note"] == ""
        assert label in text
    scopes = figures["train"]["train_breakdown"]["by_scope"]
    assert scopes.get("mlp", 0) > 0 and scopes.get("attention block (projections, rotary)", 0) > 0
    # attention: cuDNN is skipped on a CPU; blockwise in bf16 lands within bf16 rounding of the float32 reference
    for case in figures["attention"]["attention_cases"].values():
        assert case["cudnn"] == "skipped: not a GPU"
        assert 1e-4 < case["blockwise_vs_f32"]["out"] < 1e-2 and case["blockwise_vs_f32"]["grads"] < 2e-2
    # bf16 tracks float32 on the CPU reference; int8 and fp8 (emulated here) track bf16; every run learned
    assert kv["precision_bf16_tracks_f32"] == "true"
    runs = figures["precision"]["precision_runs"]
    assert len(runs["cpu_float32"]["losses"]) == 10 and runs["cpu_float32"]["losses"][-1] < runs["cpu_float32"]["losses"][0]
    assert kv["quant_fp8_loss_within_0.02"] == "true" and kv["quant_int8_loss_within_0.02"] == "true"
    assert "XLA upcasts" in kv["quant_note"]


def test_a_section_over_its_time_limit_is_stopped_and_the_summary_still_printed():
    kv, _ = run_script("--tiny", "--only", "yardsticks", "--budget-scale", "0.003")  # 0.45 s: less than JAX's import
    assert kv["section_yardsticks"].startswith("timed out after")
    assert kv["sizes"] == "tiny" and "matmul_bf16_tflops" not in kv


# ---- what only a GPU run exercises, on hand-made inputs ---------------------------------------------------------

GPU_HLO = """
  %custom-call.3 = (bf16[8192,2048]{1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", metadata={op_name="jit(step_fn)/jvp()/while/body/closed_call/mlp_block/dot_general"}
  %custom-call.7 = (bf16[1,4096,32,64]{3,2,1,0}, f32[1,32,4096]{2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(step_fn)/jvp()/while/body/closed_call/attn_block/attention/cudnn_attention/dot_product_attention"}
  %gemm_fusion.2 = bf16[8192,8192]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_computation.2, metadata={op_name="jit(step_fn)/transpose(jvp())/while/body/closed_call/mlp_block/dot_general"}, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %loop_add_fusion = f32[2048,2048]{1,0} fusion(%p, %u), kind=kLoop, calls=%fused_computation.9, metadata={op_name="jit(step_fn)/add"}
  %select_fusion.4 = bf16[8192,2048]{1,0} fusion(%g, %h), kind=kLoop, calls=%fused_computation.11, metadata={op_name="jit(step_fn)/transpose(jvp())/while/body/closed_call/mlp_block/select_n"}
  %copy.5 = bf16[2048,8192]{0,1} copy(%w), metadata={op_name="jit(step_fn)/jvp()/while/body/closed_call/mlp_block/transpose"}
  ROOT %tuple.1 = (f32[]) tuple(%c)
"""


def event(name, start, duration, **stats):
    return SimpleNamespace(name=name, start_ns=start, duration_ns=duration, stats=list(stats.items()))


def trace(*planes):
    return SimpleNamespace(planes=[SimpleNamespace(name=n, lines=[SimpleNamespace(name=ln, events=evs)
                                                                  for ln, evs in lines]) for n, lines in planes])


def test_hlo_index_names_the_kind_and_scope_of_gpu_operations():
    index = gpu_sections.hlo_index(GPU_HLO)
    assert index["custom-call.3"] == ("matmul", "mlp", "forward")
    assert index["custom-call.7"] == ("attention kernel (cuDNN)", "attention kernel", "forward")
    assert index["gemm_fusion.2"] == ("matmul", "mlp", "backward")
    assert index["loop_add_fusion"] == ("fusion (elementwise, reduce)", "optimizer + other", "forward")
    assert index["tuple.1"][1] == "unattributed"
    assert index["select_fusion.4"] == ("fusion (elementwise, reduce)", "mlp", "backward")  # not a transpose
    assert index["copy.5"] == ("copy / transpose", "mlp", "forward")


def test_breakdown_reads_a_gpu_trace_by_xla_ops_or_by_kernels_on_streams():
    index = gpu_sections.hlo_index(GPU_HLO)
    ops = [event("custom-call.3", 0, 6_000_000), event("custom-call.7", 6_000_000, 3_000_000),
           event("loop_add_fusion", 9_000_000, 1_000_000), event("custom-call.3", 20_000_000, 6_000_000),
           event("custom-call.7", 26_000_000, 3_000_000), event("loop_add_fusion", 29_000_000, 1_000_000)]
    host = ("/host:CPU", [("python", [event("PjitFunction(step_fn)", 0, 40_000_000)])])
    b = gpu_sections.breakdown_of(trace(host, ("/device:GPU:0", [("XLA Modules", [event("jit_step_fn", 0, 10)]),
                                                                 ("XLA Ops", ops)])), index, steps=2)
    assert b["source"] == "jax.profiler trace, /device:GPU:0 XLA Ops"
    assert b["ms_per_step"] == pytest.approx(10.0)
    assert b["by_kind"] == {"matmul": 6.0, "attention kernel (cuDNN)": 3.0, "fusion (elementwise, reduce)": 1.0}
    assert b["by_scope"] == {"mlp": 6.0, "attention kernel": 3.0, "optimizer + other": 1.0}
    assert [(r["op"], r["share"]) for r in b["top"]] == [("custom-call.3", 0.6), ("custom-call.7", 0.3),
                                                         ("loop_add_fusion", 0.1)]
    # without the derived line: kernels on two streams, named by their hlo_op stat where they have one
    kernels = [("Stream #13(Compute)", [event("sm90_xmma_gemm_bf16", 0, 4_000_000, hlo_op="custom-call.3"),
                                        event("cudnn_flash_fprop", 4_000_000, 2_000_000)]),
               ("Stream #14(MemcpyD2D)", [event("Memcpy DtoD", 0, 1_000_000)])]
    b = gpu_sections.breakdown_of(trace(("/device:GPU:0", kernels)), index, steps=1)
    assert b["source"] == "jax.profiler trace, /device:GPU:0 kernels on 2 streams"
    assert b["by_kind"] == {"matmul": 4.0, "attention kernel (cuDNN)": 2.0, "copy / transpose": 1.0}


def test_self_times_subtract_nested_events():
    # XLA:CPU's threads: a while loop's event holds its body's operations
    line = [event("while.6", 0, 100), event("dot.1", 10, 30), event("fusion.2", 50, 20), event("copy.3", 200, 5)]
    assert gpu_sections.self_times(line) == {"while.6": 50, "dot.1": 30, "fusion.2": 20, "copy.3": 5}


def test_a_variant_runs_at_the_batch_its_own_memory_allows():
    gib = 2**30
    assert gpu_sections.fitting_batch(16, 100 * gib, 120 * gib, 20 * gib) == 16  # fits: unchanged
    assert gpu_sections.fitting_batch(16, 100 * gib, None, 20 * gib) == 16  # no budget known
    # 5 GiB a sequence above 20 fixed: 120 GiB holds 20, but a variant never grows past the main step's batch
    assert gpu_sections.fitting_batch(16, 180 * gib, 120 * gib, 20 * gib) == 16 * 100 // 160
    assert gpu_sections.fitting_batch(16, 500 * gib, 40 * gib, 20 * gib) == 0

    def compiler(per_sequence, quick_error=0.0, real_extra=0):
        """A step of 20 GiB fixed and `per_sequence` a sequence; a quick compile misjudges the sequences' part by
        quick_error, and the real one takes real_extra bytes more that do not depend on the batch."""
        calls = []

        def compile(cfg, batch, device, quick=False):
            calls.append((batch, quick))
            mem = 20 * gib + batch * per_sequence * (1 + (quick_error if quick else 0)) + (0 if quick else real_extra)
            return "run", None if quick else f"program at {batch}", mem, 1.0
        return compile, calls

    def fit(compile, quick):
        return gpu_sections.fit_variant("cfg", 16, "dev", 120 * gib, 20 * gib, quick, compile)

    compile, calls = compiler(5 * gib)
    assert fit(compile, True) == (16, "run", "program at 16", 100 * gib, 2.0, "")
    assert calls == [(16, True), (16, False)]
    compile, calls = compiler(10 * gib)  # remat=none keeping twice as much: 10 sequences fit
    b, _, program, mem, secs, note = fit(compile, True)
    assert (b, program, mem, secs, note) == (10, "program at 10", 120 * gib, 2.0, "")
    assert calls == [(16, True), (10, False)]
    compile, calls = compiler(10 * gib)  # without the quick compile: the real one at 16, then at 10
    assert fit(compile, False)[:3] == (10, "run", "program at 10") and calls == [(16, False), (10, False)]
    compile, calls = compiler(10 * gib, quick_error=-0.2)  # the quick compile said 12; the real one lowers it once
    assert fit(compile, True)[0] == 10 and calls == [(16, True), (12, False), (10, False)]
    compile, calls = compiler(10 * gib, quick_error=-0.5)  # the quick compile said 16 fits; the real one says 10
    assert fit(compile, True)[0] == 10 and calls == [(16, True), (16, False), (10, False)]
    compile, calls = compiler(5 * gib, real_extra=60 * gib)  # still over after two real compiles: run, and say so
    assert fit(compile, True)[::5] == (11, "over the memory budget after two compiles")
    assert calls == [(16, True), (16, False), (11, False)]
    compile, calls = compiler(150 * gib)
    b, _, program, _, _, note = fit(compile, True)
    assert (b, program, note) == (0, None, "does not fit at batch 1 (about 170.00 GiB of 120.00)") and len(calls) == 1


def test_summary_computes_mfu_and_bandwidth_utilization_from_the_yardsticks():
    losses = [4.0] * 90 + [2.0] * 10
    figures = {
        "yardsticks": dict(device="NVIDIA H200", platform="gpu", jax="0.11.2", peak_bf16_spec=989e12,
                           matmul_bf16=790e12, hbm_copy=4.3e12, hbm_spec=4.8e12),
        "train": dict(train_flops_per_token=9e9, train_runs=[
            dict(label="auto", batch=16, tokens_per_step=131072, step_s=2.62144, tokens_per_s=50000.0, bytes=2**37),
            dict(label="remat=none", batch=16, tokens_per_step=131072, note="does not fit at batch 1")]),
        "precision": dict(precision_runs={"cpu_float32": dict(losses=losses),
                                          "device_bfloat16": dict(losses=[x + 0.01 for x in losses])}),
        "quant": dict(quant_runs={"bfloat16": dict(tokens_per_s=1000.0, final_loss=2.0),
                                  "fp8": dict(tokens_per_s=1500.0, final_loss=2.03)}),
        "decode": dict(decode_weight_bytes=2.4e9, decode_kv_bytes_per_step=0.1e9,
                       decode_runs={"1": dict(step_ms=1.0, decode_tokens_per_s=1000.0)}),
        "serve": dict(serve_concurrency=64, serve_rounds=[dict(output_tokens_per_s=1.0)] * 3),
        "attention": dict(attention_cases={"causal": "not a dict"}),  # malformed: its own error line, nothing lost
    }
    status = {n: dict(state="ok", seconds=1.0, limit_s=2.0) for n in figures}
    kv = dict(line.split("=", 1) for line in gpu.summary(figures, status, 400.0, tiny=False) if "=" in line
              and " " not in line.split("=")[0])
    assert float(kv["train_tflops"]) == pytest.approx(450)
    assert float(kv["train_mfu"]) == pytest.approx(450 / 989, rel=1e-3)
    assert float(kv["train_mfu_vs_matmul"]) == pytest.approx(450 / 790, rel=1e-3)
    assert float(kv["train_memory_gib"]) == 128
    assert float(kv["precision_bf16_vs_f32_final"]) == pytest.approx(0.01)
    assert kv["precision_bf16_tracks_f32"] == "true"
    assert float(kv["quant_fp8_speed_vs_bf16"]) == 1.5 and kv["quant_fp8_loss_within_0.02"] == "false"
    assert float(kv["decode_b1_mbu"]) == pytest.approx(2.5e12 / 4.3e12, rel=1e-3)
    assert float(kv["decode_b1_mbu_spec"]) == pytest.approx(2.5e12 / 4.8e12, rel=1e-3)
    assert float(kv["serve_c64_output_tokens_per_s"]) == 1.0
    assert kv["attention_summary_error"].startswith("AttributeError")
