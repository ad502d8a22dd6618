"""benchmarks/tpu.py: the whole script at tiny sizes on the CPU (the path CI keeps working; its real sizes run on a
TPU v5e chip, docs/performance.md), and on hand-made inputs what only a chip exercises: XLA:TPU's fused matmuls
and Pallas calls in the HLO, a TPU trace's device plane, the MFU arithmetic of both counts."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import first_run_environment, xla_flags
from test_gpu_benchmark import event, trace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_sections  # noqa: E402
import tpu  # noqa: E402


@pytest.mark.slow
@pytest.mark.in_ci  # the script runs in CI at tiny sizes
def test_every_section_runs_at_tiny_sizes_on_cpu(tmp_path):
    env = first_run_environment(XLA_FLAGS=xla_flags(), PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tpu.py"), "--tiny", "--json",
                        str(tmp_path / "tpu.json")], capture_output=True, text=True, env=env, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    text = p.stdout.split("==== jaxlm TPU benchmark summary (benchmarks/tpu.py) ====")[1]
    kv = dict(line.split("=", 1) for line in text.splitlines() if "=" in line and " " not in line.split("=")[0])
    assert {kv[f"section_{name}"] for name in tpu.BUDGET_S} == {"ok"}, kv
    assert kv["platform"] == "cpu" and kv["sizes"] == "tiny" and float(kv["matmul_bf16_tflops"]) > 0
    figures = json.loads((tmp_path / "tpu.json").read_text())["figures"]
    rows = {r["label"]: r for r in figures["maxtext"]["maxtext_runs"]}
    # the rows the tiny sizes choose (MAXTEXT_ROWS 0, 2, 4 and 7; the others differ from them by values alone)
    assert list(rows) == [tpu_sections().MAXTEXT_ROWS[i][0] for i in (0, 2, 4, 7)]
    preset, fast, accum = (rows[list(rows)[i]] for i in (0, 1, 2))
    assert (preset["param_dtype"], preset["remat"]) == ("float32", "full")  # what `jaxlm train maxtext_base` runs
    assert (fast["param_dtype"], fast["remat"]) == ("bfloat16", "minimal")
    assert [r["label"] for r in figures["gpt2"]["gpt2_runs"]] == [tpu_sections().GPT2_ROWS[i][0] for i in (0, 2, 4)]
    for r in [*rows.values(), *figures["gpt2"]["gpt2_runs"], *figures["long"]["long_runs"]]:
        assert r["tokens_per_s"] > 0 and r["bytes"] > 0 and r["flops_maxtext"] > r["flops_causal"] > 0, r
    assert fast["breakdown"]["source"].startswith("jax.profiler trace") and fast["breakdown"]["by_kind"]["matmul"] > 0
    assert figures["long"]["long_runs"][0]["block"] == 256
    # 4 micro-batches a step: the step's tokens (and so tokens/s) count all four
    assert accum["grad_accum"] == 4 and accum["tokens_per_step"] == 4 * accum["batch"] * accum["block"]
    assert accum["breakdown"]["by_kind"]["matmul"] > 0
    named = rows[list(rows)[-1]]  # the maxtext_base_v5e preset, by name: 16 micro-batches of bf16, remat minimal
    assert (named["grad_accum"], named["param_dtype"], named["remat"]) == (16, "bfloat16", "minimal")
    assert named["tokens_per_step"] == 16 * named["batch"] * named["block"]
    assert named["breakdown"]["by_kind"]["matmul"] > 0
    lora_rows = figures["lora"]["lora_runs"]
    assert [r["base_quantization"] for r in lora_rows] == ["nf4", "nf4", "none"] and all(r["rank"] == 16 for r in lora_rows)
    assert all(r["tokens_per_s"] > 0 and r["bytes"] > 0 and r["predicted_peak_bytes"] > 0 for r in lora_rows), lora_rows
    assert len(lora_rows[0]["losses"]) == 3 and float(kv["lora_3b_tokens_per_s"]) > 0
    (vlm,) = figures["vision"]["vision_runs"]
    assert vlm["images_per_row"] == 1 and vlm["tokens_per_s"] > 0 and float(kv["vision_4b_tokens_per_s"]) > 0
    assert kv["quant_int8_loss_within_0.02"] == "true" and float(kv["quant_int8_speed_vs_bf16"]) > 0
    assert list(figures["quant"]["quant_runs"]) == ["bfloat16", "int8"]  # the tiny sizes' modes
    # the quant section's step rows the tiny sizes choose (QUANT_ROWS 0 and 2): the bf16 preset, int8 remat minimal
    qrows = figures["quant"]["quant_rows"]
    assert [(r["quantization"], r["remat"], r["grad_accum"]) for r in qrows] == [("none", "minimal", 16),
                                                                               ("int8", "minimal", 16)]
    assert all(r["tokens_per_s"] > 0 for r in qrows) and float(kv["quant_best_vs_bf16_preset"]) > 0
    # mixtures of experts: both dispatches train alike from one initialization (bf16 rounding apart); the dense row
    # of equal active parameters has the MoE rows' active count and FLOPs per token
    moe_rows = {(r["shape"], r["dispatch"]): r for r in figures["moe"]["moe_runs"]}
    # and the extra rows the tiny sizes ask for: 2 micro-batches a step (JAXLM_BENCH_MOE_ACCUM)
    assert set(moe_rows) == {("qwen3_moe", "ragged_dot"), ("qwen3_moe", "megablox"), ("qwen3_moe", "dense"),
                             ("mixtral", "megablox"), ("qwen3_moe", "auto_accum2"), ("qwen3_moe", "dense_accum2")}
    ragged, mega, dense = (moe_rows["qwen3_moe", d] for d in ("ragged_dot", "megablox", "dense"))
    assert (ragged["moe_matmul"], mega["moe_matmul"], dense["n_experts"]) == ("ragged_dot", "megablox", 0)
    accum, dense2 = moe_rows["qwen3_moe", "auto_accum2"], moe_rows["qwen3_moe", "dense_accum2"]
    assert accum["moe_matmul"] == "ragged_dot" and accum["grad_accum"] == dense2["grad_accum"] == 2  # auto off a TPU
    assert accum["tokens_per_step"] == 2 * accum["batch"] * accum["block"] == 2 * mega["tokens_per_step"]
    assert float(kv["moe_qwen3_moe_auto_accum2_vs_dense"]) > 0
    for r in moe_rows.values():
        assert r["tokens_per_s"] > 0 and r["predicted_peak_bytes"] > 0 and len(r["losses"]) == 4, r
    assert ragged["params_active"] < ragged["params_total"] and dense["params_active"] == dense["params_total"]
    assert abs(dense["flops_causal"] / ragged["flops_causal"] - 1) < 0.02  # the router's matmul apart
    assert abs(mega["losses"][-1] - ragged["losses"][-1]) < 2e-3 and mega["losses"][-1] < mega["losses"][0] - 0.01
    assert abs(float(kv["moe_qwen3_moe_loss_last_megablox_minus_ragged_dot"])) < 2e-3
    assert float(kv["moe_qwen3_moe_megablox_vs_ragged_dot"]) > 0 and float(kv["moe_mixtral_megablox_mfu_vs_matmul"]) > 0
    # where the MoE step's time goes, traced for the megablox and dense rows (not ragged_dot's: budget)
    assert mega["breakdown"]["source"].startswith("jax.profiler trace") and dense["breakdown"]["by_kind"]["matmul"] > 0
    assert "breakdown" not in ragged and "step time by operation" in text.split("Mixtures of experts")[1]
    # the decode and serve sections' 1B rows are benchmarks/gpu.py's decode and serve sections (gpu_sections.decode
    # and .serve at the same tiny sizes, summed up by gpu._decode and gpu._serve): tests/test_gpu_benchmark.py leaves
    # them to this run
    assert float(kv["generate_b1_decode_tokens_per_s"]) > 0 and float(kv["generate_b4_decode_tokens_per_s"]) > 0
    assert 0 < float(kv["decode_b1_mbu"])
    assert float(kv["serve_c4_output_tokens_per_s"]) > 0 and "serve_note" not in kv
    prof = figures["serve"]["serve_profile"]  # one round under the profiler: the engine's operations by kind
    assert prof["ms_per_step"] > 0 and sum(prof["by_kind"].values()) > 0 and prof["output_tokens_per_s"] > 0
    assert "serving engine, one round under the profiler" in text
    # the engine against generate at its batch; llama3.1-8b's shape (tiny here) with int8 weights, decoded and served
    assert float(kv["serve_vs_generate_decode"]) > 0 and float(kv["serve_vs_generate_with_prefill"]) > 0
    # generate's largest batch and the engine's round profiled, their operations named from their programs' HLO
    assert float(kv["decode_b4_profile_device_ms"]) > 0 and float(kv["decode_b4_profile_matmul_ms"]) > 0
    assert int(kv["decode_b4_profile_hlo_programs"]) == 2 and int(kv["serve_profile_hlo_programs"]) >= 2
    assert float(kv["serve_profile_matmul_ms"]) > 0 and "generate, batch 4, one call under the profiler" in text
    assert float(kv["decode8b_int8_b1_tokens_per_s"]) > 0 and float(kv["decode8b_int8_b1_bandwidth_vs_copy"]) > 0
    assert float(kv["serve8b_int8_c4_output_tokens_per_s"]) > 0
    assert "maxtext_best_mfu_maxtext" not in kv  # no spec-sheet peak for a CPU: MFU only against the matmul
    assert float(kv["maxtext_best_mfu_maxtext_vs_matmul"]) > 0


def tpu_sections():
    import tpu_sections

    return tpu_sections


def test_moe_extra_rows_by_their_variables():
    """JAXLM_BENCH_MOE_TILES / _ACCUM's values: the extra rows of the moe section, by shape, in order."""
    extras = tpu_sections().moe_extras
    assert extras("", "") == []
    assert extras("256,1024,1024/mixtral:512,512,2048", "") == [
        ("qwen3_moe", "megablox_tiles_256_1024_1024", {"model.moe_tiles": "256,1024,1024"}),
        ("mixtral", "megablox_tiles_256_1024_1024", {"model.moe_tiles": "256,1024,1024"}),
        ("mixtral", "megablox_tiles_512_512_2048", {"model.moe_tiles": "512,512,2048"})]
    every = [(k, d) for k, d, _ in extras("all", "qwen3_moe:4")]
    assert every == [("qwen3_moe", "megablox_tiles_" + t.replace(",", "_")) for t in tpu_sections().MOE_TILES[
        "qwen3_moe"]] + [("qwen3_moe", "auto_accum4"), ("qwen3_moe", "dense_accum4")] + [
        ("mixtral", "megablox_tiles_" + t.replace(",", "_")) for t in tpu_sections().MOE_TILES["mixtral"]]
    assert extras("", "", "mixtral:1") == [("mixtral", "auto_unrolled", {"model.scan_layers": False}),
                                           ("mixtral", "dense_unrolled", {"model.scan_layers": False})]
    assert [(k, d) for k, d, _ in extras("", "2", "1")] == [
        (k, d) for k in ("qwen3_moe", "mixtral") for d in ("auto_accum2", "dense_accum2", "auto_unrolled",
                                                          "dense_unrolled")]
    # each MoE row against the dense row of its own settings
    rows = [dict(shape="mixtral", label="Mixtral", dispatch=d, tokens_per_s=t, flops_causal=1.0) for d, t in (
        ("megablox", 60.0), ("dense", 100.0), ("auto_unrolled", 90.0), ("dense_unrolled", 120.0),
        ("auto_accum2", 80.0), ("dense_accum2", 100.0))]
    kv = {}
    import tpu

    tpu.mixtures(rows, None, None, kv, [])
    assert kv["moe_mixtral_megablox_vs_dense"] == 0.6 and kv["moe_mixtral_auto_unrolled_vs_dense"] == 0.75
    assert kv["moe_mixtral_auto_accum2_vs_dense"] == 0.8


def test_a_row_runs_its_preset_its_named_preset_or_a_preset_with_settings(tmp_path, monkeypatch):
    """rows(): settings over the section's preset, a preset's name alone, or (name, settings); the unrolled rows."""
    ts = tpu_sections()
    loaded = []
    monkeypatch.setattr(ts, "load", lambda name, ctx, settings: loaded.append((name, settings)) or name)
    monkeypatch.setattr(ts, "train_row", lambda ctx, label, cfg, steps, profile=False: dict(label=label, cfg=cfg))
    monkeypatch.delenv("JAXLM_BENCH_MAXTEXT_ROWS", raising=False)
    ctx = gpu_sections.Ctx(str(tmp_path / "figures.jsonl"), deadline=time.time() + 600, tiny=True)
    table = [("a", {"model.remat": "full"}), ("b", "maxtext_base_v5e"),
             ("c", ("maxtext_base_v5e", {"model.scan_layers": False}))]
    ts.rows(ctx, "maxtext_runs", "maxtext_base", table, 1, {"training.batch_size": 2})
    assert loaded == [("maxtext_base", {"training.batch_size": 2, "model.remat": "full"}),
                      ("maxtext_base_v5e", {"training.batch_size": 2}),
                      ("maxtext_base_v5e", {"training.batch_size": 2, "model.scan_layers": False})]
    assert ts.MAXTEXT_ROWS[8][1] == ("maxtext_base_v5e", {"model.scan_layers": False})
    assert [r[1]["model.scan_layers"] for r in ts.GPT2_ROWS[10:]] == [False, False]


def test_lora_rows_without_the_yardsticks_section():
    """`--only lora`: MFU from the spec peak the section recorded itself; the loss as means of five steps."""
    losses = [14.0, 13.0, 13.5, 14.5, 13.0, *[9.0] * 40, 6.0, 5.0, 6.5, 5.5, 8.0]
    row = dict(label="llama3.1-8b QLoRA, nf4 base, 1 x 2,048", block=2048, tokens_per_s=2_000, flops_causal=3e10,
               peak_bytes_in_use=2**30, predicted_peak_bytes=2**31, losses=losses)
    lines = tpu.summary({"lora": {"lora_runs": [row], "peak_bf16_spec": 197e12}}, {"lora": {"state": "ok"}}, 1.0,
                        False)
    kv = dict(line.split("=", 1) for line in lines if "=" in line and " " not in line.split("=")[0])
    assert float(kv["qlora_8b_2048_mfu"]) == pytest.approx(2_000 * 3e10 / 197e12, rel=1e-3)
    assert float(kv["qlora_8b_2048_loss_first5_mean"]) == pytest.approx(13.6)
    assert float(kv["qlora_8b_2048_loss_last5_mean"]) == pytest.approx(6.2)
    assert any("13.600 -> 6.200 (means of the first and last 5 of 50 steps)" in line for line in lines)


def test_mfu_by_maxtexts_count_and_by_the_causal_count():
    rows = [dict(tokens_per_s=16_000, flops_maxtext=7.0e9, flops_causal=6.6e9), dict(tokens_per_s=None,
                                                                                     flops_maxtext=1, flops_causal=1)]
    tpu.derive_rows(rows, peak=197e12, matmul=165e12)
    assert rows[0]["mfu_maxtext"] == pytest.approx(16_000 * 7.0e9 / 197e12)
    assert rows[0]["mfu_causal"] == pytest.approx(16_000 * 6.6e9 / 197e12)
    assert rows[0]["mfu_maxtext_vs_matmul"] == pytest.approx(16_000 * 7.0e9 / 165e12)
    assert rows[1]["mfu_maxtext"] is None and rows[1]["tflops_causal"] is None


TPU_HLO = """HloModule jit_step
%fused_computation.1 (param_0: bf16[8,2048], param_1: bf16[2048,7168]) -> bf16[8,7168] {
  %param_0 = bf16[8,2048]{1,0} parameter(0)
  %param_1 = bf16[2048,7168]{1,0} parameter(1)
  ROOT %convolution.3 = bf16[8,7168]{1,0} convolution(%param_0, %param_1), dim_labels=bf_io->bf
}
%fused_computation.2 (param_0: f32[8]) -> f32[8] {
  %param_0 = f32[8]{0} parameter(0)
  ROOT %add.1 = f32[8]{0} add(%param_0, %param_0)
}
ENTRY %main (a: bf16[8,2048], b: bf16[2048,7168], c: f32[8]) -> f32[8] {
  %fusion.1 = bf16[8,7168]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused_computation.1, metadata={op_name="jit(step)/mlp_block/dot_general"}
  %fusion.2 = f32[8]{0} fusion(%c), kind=kLoop, calls=%fused_computation.2, metadata={op_name="jit(step)/mlp_block/mul"}
  ROOT %custom-call.5 = f32[8]{0} custom-call(%fusion.2), custom_call_target="tpu_custom_call", metadata={op_name="jit(step)/attn_block/splash_attention/fwd"}
}
"""


def test_a_tpu_fusion_holding_a_matmul_is_a_matmul_and_a_pallas_call_its_own_kind():
    index = gpu_sections.hlo_index(TPU_HLO)
    assert index["fusion.1"] == ("matmul", "mlp", "forward")  # XLA:TPU's fusion line names no dot
    assert index["fusion.2"] == ("fusion (elementwise, reduce)", "mlp", "forward")
    assert index["custom-call.5"] == ("Pallas kernel (TPU)", "attention kernel", "forward")
    ms = 1_000_000
    # A TPU's XLA Ops events are named by the whole instruction, as a v5e's trace wrote them
    ops = [("fusion.1 = bf16[2,2048,7168]{2,1,0:T(8,128)(2,1)} fusion(%p0, %p1), kind=kOutput, calls=%f1", 60),
           ("fusion.2", 10), ("custom-call.5 = (f32[2,512]) custom-call(%q), custom_call_target=\"tpu_custom_call\"",
                              25), ("copy.9 = bf16[8]{0} copy(%x)", 5)]
    events, t = [], 0
    for name, dur in ops:
        events.append(event(name, t, dur * ms))
        t += dur * ms
    b = gpu_sections.breakdown_of(trace(("/device:TPU:0", [("XLA Ops", events)])), index, steps=1)
    assert b["source"] == "jax.profiler trace, /device:TPU:0 XLA Ops"
    assert b["by_kind"] == {"matmul": 60, "Pallas kernel (TPU)": 25, "fusion (elementwise, reduce)": 10,
                            "copy / transpose": 5}  # copy.9 is not in the HLO: its kind from the event's text
    assert b["by_scope"] == {"mlp": 70, "attention kernel": 25, "unattributed": 5}
    assert [r["op"] for r in b["top"]] == ["fusion.1", "custom-call.5", "fusion.2", "copy.9"]
    # Without the program's HLO (the serving engine's round runs several programs) a fusion's text hides its
    # matmul: the event's own category says it, where the trace has one; the stats seen are listed
    events = [event("fusion.7 = f32[64,1024]{1,0} fusion(%w, %x), kind=kOutput, calls=%f7", 0, 40 * ms,
                    hlo_category="convolution fusion"),
              event("fusion.8 = f32[64]{0} fusion(%y), kind=kLoop", 40 * ms, 10 * ms, hlo_category="loop fusion"),
              event("fusion.9 = f32[64]{0} fusion(%z), kind=kLoop", 50 * ms, 5 * ms),
              event("custom-call.3 = (f32[2,512]) custom-call(%q), custom_call_target=\"tpu_custom_call\"", 55 * ms,
                    20 * ms, hlo_category="custom-call")]
    b = gpu_sections.breakdown_of(trace(("/device:TPU:0", [("XLA Ops", events)])), {}, steps=1)
    assert b["by_kind"] == {"matmul": 40, "Pallas kernel (TPU)": 20, "fusion (elementwise, reduce)": 15}
    assert b["event_stats"] == ["hlo_category"]


def test_several_programs_name_their_operations_in_one_profile_and_the_engines_are_recorded_as_they_run():
    """The serving engine's round runs several programs whose instructions share names (fusion.1 a matmul in one,
    an add in the other): hlo_index_of keys each by its result type too, so each event takes its own program's
    kind and scope; without any HLO a fusion named after its dot is a matmul. lowering_calls records the lowering
    of each shape's first call of a module's jitted functions, whose compile gives the optimized HLO."""
    other = TPU_HLO.replace("bf16[8,7168]{1,0} fusion(%a, %b), kind=kOutput", "bf16[4]{0} fusion(%c), kind=kLoop")
    other = other.replace("calls=%fused_computation.1, metadata={op_name=\"jit(step)/mlp_block/dot_general\"}",
                          "calls=%fused_computation.2, metadata={op_name=\"jit(step)/embed/add\"}")
    index = gpu_sections.hlo_index_of([TPU_HLO, other, TPU_HLO])
    assert "fusion.1" not in index and index["fusion.2"] == ("fusion (elementwise, reduce)", "mlp", "forward")
    assert index["fusion.1 bf16[8,7168]"] == ("matmul", "mlp", "forward")
    assert index["fusion.1 bf16[4]"] == ("fusion (elementwise, reduce)", "embedding", "forward")
    ms = 1_000_000
    events = [event("fusion.1 = bf16[8,7168]{1,0:T(8,128)(2,1)} fusion(%p0, %p1), kind=kOutput", 0, 30 * ms),
              event("fusion.1 = bf16[4]{0:T(256)} fusion(%p2), kind=kLoop", 30 * ms, 7 * ms),
              event("fusion.2 = f32[8]{0} fusion(%c), kind=kLoop", 37 * ms, 3 * ms),
              event("convolution_add_fusion.4 = f32[8,16]{1,0} fusion(%x, %w), kind=kOutput", 40 * ms, 11 * ms)]
    b = gpu_sections.breakdown_of(trace(("/device:TPU:0", [("XLA Ops", events)])), index, steps=1)
    assert b["by_kind"] == {"matmul": 41, "fusion (elementwise, reduce)": 10}
    assert b["by_scope"] == {"mlp": 33, "unattributed": 11, "embedding": 7}
    assert [r["type"] for r in b["top"]] == ["bf16[8,7168]", "f32[8,16]", "bf16[4]", "f32[8]"]

    import jax
    import jax.numpy as jnp
    import numpy as np
    from types import SimpleNamespace

    double = jax.jit(lambda x, n: x * n, static_argnums=1)
    module = SimpleNamespace(double=double, other=len)
    with gpu_sections.lowering_calls(module) as lowered:
        assert module.double(jnp.ones(3), 2).tolist() == [2.0] * 3 and module.double is not double
        module.double(np.ones(3, np.float32), 2)  # the same shape: not lowered again
        module.double(jnp.ones((2, 2)), 2)
        assert module.other is len
    assert module.double is double  # put back
    texts = gpu_sections.optimized_hlo(lowered)
    assert len(lowered) == 2 and len(texts) == 2 and "f32[2,2]" in texts[1] and "multiply" in texts[0]


def test_a_section_that_takes_too_much_host_memory_is_stopped_and_reported(monkeypatch):
    """A runaway section is stopped by the runner, not the whole run by the machine (a TPU host's 40 GiB once ran
    out before anything was printed): its peak is reported."""
    import gpu

    if gpu.host_memory_allowed() is None:
        pytest.skip("no /proc/meminfo: host memory is not watched here")
    monkeypatch.setattr(gpu, "host_memory_allowed", lambda: 300 * 2**20)
    grow = "import time\nx = []\nwhile True:\n    x.append(bytearray(50 * 2**20)); time.sleep(0.05)"
    rc, peak, over = gpu.watch(subprocess.Popen([sys.executable, "-c", grow]), limit=60)
    assert rc is None and over == 300 * 2**20 and 300 * 2**20 < peak < 2 * 2**30
    hold = "import time; x = bytearray(20 * 2**20); time.sleep(1)"
    rc, peak, over = gpu.watch(subprocess.Popen([sys.executable, "-c", hold]), limit=60)
    assert rc == 0 and over is None and 0 < peak < 300 * 2**20


def test_serve_kernel_entries_carry_the_ragged_kernels_settings_into_their_own_figures(tmp_path, monkeypatch):
    """JAXLM_BENCH_SERVE_KERNELS's entries, a kernel with the ragged kernel's settings after colons, each run the
    serve row with serve.attention_kernel and serve.attention_kernel_options and write figures named by the
    whole entry, which the summary reads back (against generate's batch too); a bad or repeated entry stops the
    run in one line."""
    ts = tpu_sections()
    assert ts.kernel_entries(" ragged, ragged:block_tokens=256:heads_batched=1,jax") == [
        ("ragged", "ragged", ""),
        ("ragged_block_tokens_256_heads_batched_1", "ragged", "block_tokens=256,heads_batched=1"), ("jax", "jax", "")]
    assert ts.kernel_entries("ragged:packed_kv=1,ragged:packed_kv=1:heads_batched=1:page_steps=1:prefetch=2") == [
        ("ragged_packed_kv_1", "ragged", "packed_kv=1"),
        ("ragged_packed_kv_1_heads_batched_1_page_steps_1_prefetch_2", "ragged",
         "packed_kv=1,heads_batched=1,page_steps=1,prefetch=2")]
    for bad, says in [("ragged,raged", "'raged' unknown; choose from jax, ragged, flat"),
                      ("jax:prefetch=2", "only the ragged kernel takes settings"),
                      ("ragged:prefetch=two", "entry 'prefetch=two' must be KEY=VALUE"),
                      ("ragged:page_steps=1,ragged:page_steps=1", "'ragged:page_steps=1' given twice")]:
        with pytest.raises(SystemExit, match=says) as e:
            ts.kernel_entries(bad)
        assert "\n" not in str(e.value)
    calls = []

    def fake_serve(ctx, attention_kernel=None, kernel_options="", tag=None):
        calls.append((attention_kernel, kernel_options, tag))
        ctx.put(**{f"serve_{tag}_rounds": [dict(output_tokens_per_s=100.0 * len(calls))]}, serve_concurrency=4)
        digests = ["a", "b", "c", "d"] if len(calls) == 1 else ["a", "b", "x", "d"]  # one request's tokens differ
        outputs = [[1, 2, 3, 4]] * 4 if len(calls) == 1 else [[1, 2, 3, 4]] * 2 + [[1, 9, 3, 4], [1, 2, 3, 4]]
        return dict(round=dict(output_tokens_per_s=100.0 * len(calls), digests=digests, outputs=outputs))

    monkeypatch.setattr(ts.g, "serve", fake_serve)
    ctx = gpu_sections.Ctx(str(tmp_path / "figures.jsonl"), deadline=0, tiny=True)
    ts.serve_kernels(ctx, "ragged,ragged:heads_batched=1:page_steps=1")
    assert calls == [("ragged", "", "ragged"), ("ragged", "heads_batched=1,page_steps=1",
                                                 "ragged_heads_batched_1_page_steps_1")]
    figures = {}
    for line in (tmp_path / "figures.jsonl").read_text().splitlines():
        figures.update(json.loads(line))
    kv = {}
    tpu.serving({"serve": figures, "decode": {"decode_runs": {"4": dict(decode_tokens_per_s=400.0)}}}, kv, [])
    assert kv["serve_ragged_output_tokens_per_s"] == 100 and kv["serve_ragged_vs_generate_decode"] == 0.25
    assert kv["serve_ragged_heads_batched_1_page_steps_1_output_tokens_per_s"] == 200
    assert kv["serve_ragged_heads_batched_1_page_steps_1_vs_generate_decode"] == 0.5
    assert kv["serve_ragged_heads_batched_1_page_steps_1_same_tokens_as_first"] == 0.75
    # three requests equal to the end, one parting at its second token: (1 + 1 + 1/4 + 1) / 4
    assert kv["serve_ragged_heads_batched_1_page_steps_1_common_prefix_as_first"] == pytest.approx(13 / 16)
    assert gpu_sections.common_prefix([[5, 6], [7]], [[5, 8], [3]]) == pytest.approx(0.25)
    assert "serve_ragged_same_tokens_as_first" not in kv  # the first entry is the reference
