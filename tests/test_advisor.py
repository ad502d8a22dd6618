"""The out-of-memory advisor names the largest buffers of a step that does not fit by name scope."""

import pytest

from conftest import tiny_config
from jaxlm.train import advisor, aot


def _advice(char_data, attention):
    cfg = tiny_config(char_data, None, **{
        "model.block_size": 512, "model.n_layers": 1, "model.n_heads": 8, "model.d_model": 64,
        "model.attention": attention, "model.attention_block": 128, "training.per_device_batch_size": 2,
        "compile.topology": "cpu-1", "compile.hbm_gib": 0.001})
    tgt = aot.target(cfg.compile)
    r = aot.compile_for(cfg, tgt)
    assert not r.fits
    logs = []
    return advisor.advise(r, aot.compile_for, aot.target, logs.append), logs


@pytest.mark.slow
def test_advisor_names_the_attention_scores_and_the_setting_that_removes_them(char_data):
    lines, logs = _advice(char_data, "dot_product")
    assert logs == ["advisor: attributing the memory from a compile at per_device_batch_size=1, scaled x2 ..."]
    assert lines[0].startswith("largest buffers per device (from a compile at per_device_batch_size=1, scaled x2)")
    scope, gib = lines[1].split()[:2]
    # The [B, N, T, T] float32 scores of one layer at batch 1, doubled: 2 x 8 x 512 x 512 x 4 bytes.
    assert scope == "attention" and float(gib) == round(2 * 8 * 512 * 512 * 4 / 2**30, 2)
    assert "8,512,512]" in lines[1] and "model.attention=blockwise" in lines[1]
    lines, _ = _advice(char_data, "blockwise")
    assert all("512,512]" not in line for line in lines)


def test_largest_buffers_skip_fusion_bodies_and_read_scopes():
    hlo = "\n".join([
        "%fused_computation.1 (p: f32[4,4]) -> f32[64,64] {",
        '  %big = f32[64,64]{1,0} broadcast(%p), metadata={op_name="jit(f)/attention/x"}',
        "}",
        "ENTRY %main (a: f32[4,4]) -> f32[64,64] {",
        '  %fusion = f32[8,8]{1,0} fusion(%a), kind=kLoop, metadata={op_name="jit(f)/attn_block/attention/mul"}',
        '  ROOT %out = bf16[16,8]{1,0} convert(%fusion), metadata={op_name="jit(f)/logits/convert"}',
        "}"])
    got = [(b.scope, b.dtype, b.shape, b.bytes) for b in advisor.largest_buffers(hlo)]
    assert got == [("attention", "f32", (8, 8), 256), ("logits", "bf16", (16, 8), 256)]


def test_a_tpu_step_the_compiler_accepts_fits_while_its_temporaries_do():
    class TPU:
        platform, device_kind = "tpu", "TPU v5 lite"

    GiB = 2**30
    tgt = aot.Target("v5e-1", (TPU(),), 1, 16 * GiB, "TPU v5 lite HBM")

    def result(arguments, temporaries, compiled=True, target=tgt):
        memory = aot.Memory(arguments, arguments, temporaries, 0, arguments)
        return aot.Result(None, target, 1.0, object() if compiled else None, memory, arguments)

    assert result(3 * GiB, 15 * GiB).fits  # the sum, 18 GiB, is an upper bound
    assert not result(1 * GiB, 17 * GiB).fits  # the temporaries alone are over
    assert not result(1 * GiB, 1 * GiB, compiled=False).fits  # the compiler ran out of memory
    budget = aot.Target("v5e-1", (TPU(),), 1, 16 * GiB, "compile.hbm_gib")
    assert not result(3 * GiB, 15 * GiB, target=budget).fits  # a budget of one's own is checked against the sum
