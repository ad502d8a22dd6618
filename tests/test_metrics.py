import dataclasses
import re
import time
import types

import jax
import numpy as np
import pytest

from conftest import tiny_config
from jaxlm import config as config_lib
from jaxlm.train import loop as train, metrics, run as run_lib
from jaxlm.model import flops, param_specs


def _gqa_swiglu_untied():
    return config_lib.ModelConfig(vocab_size=100, block_size=32, n_layers=2, n_heads=4, n_kv_heads=2, d_model=64,
                                  d_ff=172, glu=True, tie_embeddings=False)


def test_flops_per_token_match_a_hand_count():
    # GPT-2 124M (the openwebtext preset): per layer q, k, v, o 4 * 768^2 and MLP 8 * 768^2 = 7,077,888,
    # times 12 layers = 84,934,656, plus the tied output projection 768 * 50304 = 38,633,472: 123,568,128
    # matmul weights; 6 x that = 741,408,768. Attention, full square: 12 * 12 layers * 12 heads * 64 * 1024
    # = 113,246,208. (nanoGPT's 6N + 12LHQT differs only by its 85,248 LayerNorm and bias weights.)
    gpt2 = config_lib.load_base("openwebtext").model
    assert flops.matmul_weights(gpt2) == 123_568_128
    assert flops.flops_per_token(gpt2) == 741_408_768 + 113_246_208
    assert flops.flops_per_token(gpt2, causal=True) == 741_408_768 + 113_246_208 // 2
    # Llama-style: GQA (4 query, 2 kv heads of 16), SwiGLU 172 wide, untied head. Per layer q 64*4*16 = 4,096,
    # k and v 64*2*16 = 2,048 each, o 4,096, MLP 3*64*172 = 33,024: 45,312; x 2 layers + head 64*100 = 6,400
    # -> 97,024; 6 x = 582,144. Attention: 12 * 2 * 4 * 16 * 32 = 49,152 full, 24,576 causal.
    llama = _gqa_swiglu_untied()
    assert flops.matmul_weights(llama) == 97_024
    assert flops.flops_per_token(llama) == 582_144 + 49_152
    assert flops.flops_per_token(llama, causal=True) == 582_144 + 24_576


@pytest.mark.parametrize("cfg", [config_lib.load_base("openwebtext").model, _gqa_swiglu_untied()])
def test_matmul_weights_equal_the_declared_matmul_parameters(cfg):
    specs = param_specs(cfg)
    head = specs["lm_head"] if "lm_head" in specs else specs["embed"]["tokens"]
    matrices = [specs["layers"]["attn"][k] for k in ("q", "k", "v", "o")] + \
        [v for k, v in specs["layers"]["mlp"].items() if not k.endswith("bias")] + [head]
    assert flops.matmul_weights(cfg) == sum(int(np.prod(s.shape)) for s in matrices)


@pytest.mark.parametrize("kind, dtype, peak", [
    ("TPU v4", "bfloat16", 275e12), ("TPU v5 lite", "bfloat16", 197e12), ("TPU v5p", "bfloat16", 459e12),
    ("TPU v6 lite", "float32", 918e12), ("NVIDIA A100-SXM4-80GB", "float32", 156e12),
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989e12), ("NVIDIA H200", "float32", 494.5e12),
    ("NVIDIA B200", "bfloat16", 2250e12),
])
def test_peak_table_finds_known_chips(kind, dtype, peak):
    device = types.SimpleNamespace(platform="tpu" if "TPU" in kind else "gpu", device_kind=kind)
    got, source = metrics.peak_flops_per_device(device, dtype, n_local_devices=4)
    assert got == peak and "spec sheet" in source


def test_goodput_buckets_are_the_phases_and_the_rest():
    g = metrics.Goodput()
    time.sleep(0.05)
    g.charge_unaccounted("init")
    with g.phase("compute"):
        time.sleep(0.1)
    time.sleep(0.03)
    s = g.summary()
    assert s["goodput_init_s"] == pytest.approx(0.05, abs=0.03)
    assert s["goodput_compute_s"] == pytest.approx(0.1, abs=0.03)
    assert s["goodput_other_s"] == pytest.approx(0.03, abs=0.03)
    assert sum(v for k, v in s.items() if k.endswith("_s") and k != "goodput_wall_s") == pytest.approx(s["goodput_wall_s"])


@pytest.mark.slow
def test_cpu_run_reports_mfu_against_the_measured_peak_and_goodput_that_sums_to_wall_time(char_data, tmp_path):
    cfg = tiny_config(char_data, tmp_path / "run", **{"training.steps": 12, "training.eval_interval": 6,
                                                       "checkpoint.interval": 6, "training.sample_tokens": 8,
                                                       "training.log_interval": 3})
    logged = []
    t0 = time.perf_counter()
    summary = train.train(cfg, devices=jax.devices()[:1], log=logged.append)
    wall = time.perf_counter() - t0

    peak = summary["peak_flops_per_device"]
    assert "measured" in summary["peak_source"]
    assert peak / 3 < metrics.matmul_flops_per_second() < peak * 3  # the same yardstick, measured again
    flops_per_token = flops.flops_per_token(dataclasses.replace(cfg.model, vocab_size=65), causal=True)
    assert summary["model_tflops_per_s"] * 1e12 == pytest.approx(flops_per_token * summary["tokens_per_s"])
    assert summary["mfu"] == pytest.approx(summary["model_tflops_per_s_per_device"] * 1e12 / peak, rel=1e-12)
    (line,) = [line for line in logged if "MFU" in line]
    assert float(re.search(r"MFU ([\d.]+)%", line).group(1)) == round(100 * summary["mfu"], 2)
    # MaxText's count (the attention square whole) beside it: more FLOPs per token, the same ratio in MFU
    maxtext = flops.flops_per_token(dataclasses.replace(cfg.model, vocab_size=65))
    assert maxtext > flops_per_token and f"{maxtext:,.0f} by MaxText's count" in "\n".join(logged)
    assert summary["mfu_maxtext"] == pytest.approx(summary["mfu"] * maxtext / flops_per_token)
    assert f"({100 * summary['mfu_maxtext']:.2f}% by MaxText's count)" in line
    records = train.read_metrics(tmp_path / "run")
    timed = [r for r in records if "mfu" in r]
    assert [r["step"] for r in timed] == [3, 6, 9, 12]  # step 1's window holds the compile: compile_s instead
    for r in timed:
        assert r["mfu"] == pytest.approx(r["tflops_per_s_per_device"] * 1e12 / peak)
        assert r["tokens_per_s"] == pytest.approx(256 / r["step_time_s"])

    g = summary["goodput"]
    buckets = ("init", "compile", "data", "compute", "checkpoint", "eval", "other")
    assert sum(g[f"goodput_{b}_s"] for b in buckets) == pytest.approx(g["goodput_wall_s"], rel=1e-9)
    # the goodput clock covers train.train but for its first and last moments (a few % of this short run on a
    # loaded host)
    assert 0.9 * wall < g["goodput_wall_s"] <= wall
    assert all(g[f"goodput_{b}_s"] > 0 for b in buckets[:-1])
    assert g["goodput_other_s"] < 0.1 * wall  # the named buckets account for the run
    assert {k: records[-1][k] for k in g} == g
    assert any(line.startswith("time ") and "compile" in line for line in logged)


def test_wandb_offline_run_resumes_with_the_run_directory(tmp_path, monkeypatch):
    import wandb  # noqa: F401 - in the dev extra: a missing install fails here rather than skipping
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = config_lib.apply_overrides(config_lib.Config(), {"logging.wandb": "true", "run_dir": str(run_dir),
                                                           "logging.wandb_project": "jaxlm-test"})
    ids = []
    for steps in ((1, 2), (3, 4)):  # a first session, then the run directory resumed
        writer = metrics.MetricWriter(run_dir, tensorboard=False, wandb_run=metrics.start_wandb(cfg, run_dir))
        for s in steps:
            writer.write({"step": s, "loss": 4.0 / s, "grad_norm": 1.0})
        writer.close()
        ids.append((run_dir / "wandb_id").read_text().strip())
    assert ids[0] == ids[1] and re.fullmatch(r"[0-9a-f]{12}", ids[0])
    offline = sorted((run_dir / "wandb").glob("offline-run-*"))
    # wandb names a directory offline-run-<time>-<id>, with -1 added when both sessions start in the same second
    assert len(offline) == 2 and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{ids[0]}(-\d+)?", d.name)
                                     for d in offline), [d.name for d in offline]
    deadline = time.monotonic() + 30  # wandb's service process may still be writing the last records out
    while not all(b"grad_norm" in (d / f"run-{ids[0]}.wandb").read_bytes() for d in offline):
        assert time.monotonic() < deadline, "the offline runs' files hold no logged metrics"
        time.sleep(0.2)
    assert len(train.read_metrics(run_dir)) == 4


def test_wandb_missing_is_a_config_error(char_data, tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *a, **kw):
        if name == "wandb":
            raise ImportError(name)
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(config_lib.ConfigError, match=r"logging.wandb=true needs the wandb package"):
        run_lib.setup(tiny_config(char_data, tmp_path / "r", **{"logging.wandb": True}), jax.devices()[:1])
