import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxlm
from conftest import tiny_config, users_environment, xla_flags
from jaxlm import config as config_lib
from jaxlm.launch import topology
from jaxlm.train import aot, saved_step, loop as train
from jaxlm.config import Config, ConfigError

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
SRC = str(Path(__file__).resolve().parents[1] / "src")


def _cfg(data, run_dir=None, **kw):
    return tiny_config(data, run_dir, **{"training.steps": 6, "training.eval_interval": 0, "optimizer.warmup_steps": 2,
                                         "checkpoint.enabled": False, **kw})


def test_tpu_slice_names_map_to_chip_grids():
    # Cloud TPU's published slice shapes: v5e-8 is 2x4, v5e-256 16x16, v4-8 (4 chips) 2x2x1, v5p-128 4x4x4.
    assert [topology.tpu_grid(2, n) for n in (1, 4, 8, 16, 32, 64, 128, 256)] == [
        (1, 1), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16)]
    assert [topology.tpu_grid(3, n) for n in (4, 8, 16, 32, 64, 128, 256, 512)] == [
        (2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4), (4, 4, 4), (4, 4, 8), (4, 8, 8), (8, 8, 8)]
    for rank, n in ((2, 12), (2, 512), (3, 2)):
        with pytest.raises(ValueError):
            topology.tpu_grid(rank, n)
    with pytest.raises(ConfigError, match="compile.topology='v9-8' is not a known target"):
        aot.target(config_lib.CompileConfig(topology="v9-8"))
    with pytest.raises(ConfigError, match="v4 slices with a power-of-two chip grid"):
        aot.target(config_lib.CompileConfig(topology="v4-6"))
    with pytest.raises(ConfigError, match="cpu-64 needs 64 CPU devices and this process has 8"):
        aot.target(config_lib.CompileConfig(topology="cpu-64"))
    if not any(d.platform == "gpu" for d in jax.devices()):
        with pytest.raises(ConfigError, match=r"a3 \(8 x H100 per host\) compiles on a host with those GPUs"):
            aot.target(config_lib.CompileConfig(topology="a3"))
    assert aot.hbm_gib("TPU v5 lite") == 16 and aot.hbm_gib("TPU v5") == 95 and aot.hbm_gib("TPU v6 lite") == 32
    assert aot.hbm_gib("NVIDIA A100-SXM4-80GB") == 80 and aot.hbm_gib("NVIDIA A100-SXM4-40GB") == 40
    # The two forms XLA:TPU reports an out-of-memory compile in: the total, or the temporaries alone.
    assert aot.oom_bytes("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 40.50G of 15.75G hbm.",
                         7) == int(40.5 * 2**30)
    assert aot.oom_bytes("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
                         "temporaries (56.02G) exceeds available HBM (15.75G).", 100) == 100 + int(56.02 * 2**30)


def test_compile_settings_are_validated():
    for key, value, fragment in [("compile.num_slices", "0", "compile.num_slices=0 must be >= 1"),
                                 ("compile.hbm_gib", "-1", "compile.hbm_gib=-1.0 must be > 0"),
                                 ("compile.max_batch_size", "0", "compile.max_batch_size=0 must be >= 1")]:
        with pytest.raises(ConfigError, match=fragment):
            config_lib.load("shakespeare_char", [f"{key}={value}"])


@pytest.mark.slow
def test_saved_step_trains_like_the_jitted_step_and_refuses_other_runs(char_data, tmp_path):
    mesh = {"mesh.ici_data": 2, "mesh.ici_fsdp": 4}  # sharded state, so the saved layouts matter
    cfg = _cfg(char_data, tmp_path / "jit", **mesh, **{"compile.topology": "cpu-8"})
    r = aot.compile_for(cfg, aot.target(cfg.compile))
    # Per-device arguments as the compiler counts them equal the shards' bytes counted from the shardings.
    assert r.memory.arguments == r.argument_bytes > 0
    assert r.bytes_per_device == (r.memory.arguments + r.memory.outputs + r.memory.temporaries
                                  + r.memory.generated_code - r.memory.aliased)
    assert r.memory.aliased > 0.9 * r.memory.arguments  # the donated state is updated in place
    # The suite's persistent cache holds the step now: compiled again, it is read back from the cache, and
    # save() must compile it afresh to write its code (issue 18).
    jax.clear_caches()
    path = aot.save(tmp_path / "step.jaxlm", aot.compile_for(cfg, aot.target(cfg.compile)))

    train.train(cfg, log=lambda s: None)
    loaded = cfg.replace(run_dir=str(tmp_path / "aot"), compile=config_lib.CompileConfig(load=str(path)))
    lines = []
    train.train(loaded, log=lines.append)
    assert any("train step loaded from" in line for line in lines)
    jitted, aot_losses = train.losses_by_step(tmp_path / "jit"), train.losses_by_step(tmp_path / "aot")
    assert sorted(jitted) == list(range(1, 7)) and jitted[6] < jitted[1]
    assert aot_losses == jitted  # bit for bit: the same executable

    def fails(message, devices=None, **kw):
        bad = _cfg(char_data, tmp_path / "bad", **{**mesh, "compile.load": str(path), **kw})
        with pytest.raises(ConfigError, match=message):
            train.train(bad, devices=devices, log=lambda s: None)

    fails(r"expects \['batch'\]\['inputs'\] of shape \(1, 8, 32\) int32, given \(1, 16, 32\) int32: training.batch_size",
          **{"training.per_device_batch_size": 2})
    fails(r"was compiled for 8 cpu devices \(cpu-8\) but this run has 4 cpu devices",
          devices=jax.devices()[:4], **{"mesh.ici_fsdp": 2})
    fails(r"was compiled with optimizer.lr=0.001 and this run has 0.002; the step holds it fixed",
          **{"optimizer.lr": 0.002})
    fails(r"was compiled with training.steps=6 and this run has 7", **{"training.steps": 7})
    (tmp_path / "p.jsonl").write_text('{"prompt": "ab"}\n')
    fails(r"is a step of training.objective=next_token and this run has grpo; compile the step for this objective",
          **{"training.objective": "grpo", "data.prompts": str(tmp_path / "p.jsonl"), "model.vocab_size": 65,
             "grpo.group_size": 4, "grpo.reward": "jaxlm.rewards:exact_answer", "grpo.max_completion_tokens": 8})
    (tmp_path / "junk").write_bytes(b"not a step\n")
    fails("is not a step saved by `jaxlm compile", **{"compile.load": str(tmp_path / "junk")})


@pytest.mark.slow
def test_saved_step_at_default_compiler_settings_trains_like_the_jitted_run(char_data, tmp_path):
    # The commands of issue 18 as a user runs them: XLA's default compiler settings, the CLI's own compilation
    # cache (empty at first, as on a new machine), the `jaxlm` command's huge-page restart. The jitted run caches
    # its step, so `jaxlm compile` finds the same program in the cache: the saved step must still hold its code.
    # JAX caches only programs that took a second to compile; this tiny step is cached as users' larger ones are.
    tiny = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.block_size=32", "training.batch_size=8",
            f"data.dir={char_data}", f"compile.cache_dir={tmp_path / 'xla'}",
            "training.steps=8"]  # the schedule (a short run's cut warmup) is compiled into the step
    run = ["training.eval_interval=0", "training.sample_tokens=0", "checkpoint.enabled=false",
           "logging.progress=false", "logging.tensorboard=false"]
    env = users_environment(XLA_FLAGS="--xla_force_host_platform_device_count=8",
                            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                            PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])))

    def jaxlm(*args):
        p = subprocess.run([sys.executable, "-m", "jaxlm.cli", *args], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        return p.stdout

    jaxlm("train", "shakespeare_char_cpu", *tiny, *run, f"run_dir={tmp_path / 'jit'}")
    assert "saved the compiled step to step.jaxlm" in jaxlm("compile", "shakespeare_char_cpu", *tiny,
                                                            "compile.topology=cpu-8", "compile.output=step.jaxlm")
    out = jaxlm("train", "shakespeare_char_cpu", *tiny, *run, "compile.load=step.jaxlm", f"run_dir={tmp_path / 'aot'}")
    assert "train step loaded from step.jaxlm" in out
    jitted, aot_losses = train.losses_by_step(tmp_path / "jit"), train.losses_by_step(tmp_path / "aot")
    assert sorted(jitted) == list(range(1, 9)) and jitted[8] < jitted[1]
    assert aot_losses == jitted  # bit for bit


def test_cpu_steps_saved_in_format_1_are_refused(tmp_path):
    # Format 1 could hold a CPU step read back from the compilation cache, without its code (issue 18): it is
    # refused in one line before anything is unpickled; a TPU step of that format still loads.
    old = tmp_path / "old.jaxlm"
    old.write_bytes(saved_step.HEADER_1 + b'{"platform": "cpu"}\n')
    with pytest.raises(ConfigError, match="saved by an earlier jaxlm that could save a CPU step without its "
                                          "compiled code; compile it again"):
        saved_step.read_signature(old)
    old.write_bytes(saved_step.HEADER_1 + b'{"platform": "tpu"}\n')
    assert saved_step.read_signature(old) == ({"platform": "tpu"}, len(saved_step.HEADER_1) + 20)


def test_steps_saved_by_another_jaxlm_are_refused_before_unpickling(tmp_path):
    # A step saved by another jaxlm (here 0.1.0, whose pickled paths name modules since moved) is refused in one
    # line naming both versions; its payload, not a pickle at all, is never read. Everything else matches.
    cfg, mesh = Config(), jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    here = saved_step.signature(cfg, mesh, {})
    assert here["jaxlm"] == jaxlm.__version__ == "0.2.0"
    path = tmp_path / "old.jaxlm"
    for version in ("0.1.0", None):  # None: a format-2 file from before the version was recorded
        sig = {**here, "jaxlm": version} if version else {k: v for k, v in here.items() if k != "jaxlm"}
        path.write_bytes(saved_step.HEADER + json.dumps(sig).encode() + b"\nnot a pickle")
        with pytest.raises(ConfigError) as e:
            saved_step.load(path, cfg, mesh, {})
        msg = str(e.value)
        assert "\n" not in msg and f"was saved by jaxlm {version or '0.1.0 or earlier'} and this is jaxlm 0.2.0" in msg


@pytest.mark.slow
def test_fit_search_returns_the_largest_batch_that_fits(char_data):
    cfg = _cfg(char_data, **{"compile.topology": "cpu-1", "model.n_layers": 1, "training.per_device_batch_size": 1})
    # Activations grow with the batch and the state does not: room for a few sequences per device.
    budget = 1.8 * aot.compile_for(cfg, aot.target(cfg.compile)).bytes_per_device
    cfg = cfg.replace(compile=config_lib.CompileConfig(topology="cpu-1", find_batch_size=True,
                                                       hbm_gib=budget / 2**30))
    lines = []
    best, tried = aot.find_batch_size(cfg, aot.target(cfg.compile), lines.append)
    b = best.run.cfg.training.per_device_batch_size
    by_batch = {r.run.cfg.training.per_device_batch_size: r for r in tried}
    assert best.fits and best.bytes_per_device <= budget
    assert b + 1 in by_batch and not by_batch[b + 1].fits and by_batch[b + 1].bytes_per_device > budget
    assert all(r.fits == (k <= b) for k, r in by_batch.items())
    assert len(lines) == 2 + len(tried)  # the table: a title, a header and one row per compile


def _cli(args, cwd):
    env = dict(os.environ, XLA_FLAGS=xla_flags(),
               PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "jaxlm.cli", "compile", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_compile_command_prints_the_report(tmp_path):
    tiny = ["model.vocab_size=65", "model.block_size=32", "model.n_layers=1", "model.n_heads=2", "model.d_model=32",
            "training.per_device_batch_size=1", "compile.topology=cpu-4"]
    # The test process has 8 CPU devices; the command starts with one and makes the 4 of its target itself.
    p = _cli(["shakespeare_char", *tiny, "compile.hbm_gib=0.0001"], tmp_path)
    out = p.stdout.splitlines()
    assert p.returncode == 1, p.stdout + p.stderr
    assert out[0].startswith("train step for cpu-4 (4 x cpu): lowered and compiled in")
    assert out[1].startswith("mesh {'data': 4} | batch 4 sequences (1 per device)")
    assert out[-4].startswith("does not fit: needs ") and "over the 0.10 MiB of compile.hbm_gib" in out[-4]
    assert "training.per_device_batch_size" not in out[-4] and "model.remat=full (now none)" in out[-4]
    assert "mesh.ici_data=1 mesh.ici_fsdp=-1 (FSDP over all 4 devices; now 1)" in out[-4]
    fields = dict(line.split("=", 1) for line in out[-3:])
    assert fields["hbm_bytes"] == str(int(0.0001 * 2**30)) and fields["fits"] == "false"
    assert int(fields["bytes_per_device"]) > int(fields["hbm_bytes"])
    p = _cli(["shakespeare_char", *tiny[:-1], "compile.topology=v9-8"], tmp_path)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith(
        "error: compile.topology='v9-8' is not a known target")


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed (pip install 'jaxlm[tpu]')")
def test_compile_for_a_tpu_slice_on_this_host(char_data):
    small = {"model.vocab_size": 256, "model.block_size": 64, "model.n_layers": 2, "model.n_heads": 4,
             "model.d_model": 64, "model.remat": "full", "training.per_device_batch_size": 1,
             "compile.topology": "v5e-8", "mesh.ici_data": 2, "mesh.ici_fsdp": 2, "mesh.ici_tensor": 2}
    cfg = _cfg(char_data, **small)
    tgt = aot.target(cfg.compile)
    assert len(tgt.devices) == 8 and tgt.device_kind == "TPU v5 lite" and tgt.hbm_bytes == 16 * 2**30
    r = aot.compile_for(cfg, tgt)
    assert r.fits and r.memory.arguments >= r.argument_bytes  # TPU layouts pad small arrays to whole tiles
    lines = aot.report(r) + aot.machine_lines(r)
    assert lines[0].startswith("train step for v5e-8 (8 x TPU v5 lite)")
    assert lines[1].startswith("mesh {'data': 2, 'fsdp': 2, 'tensor': 2} | batch 8 sequences (1 per device)")
    assert lines[-3:] == [f"bytes_per_device={r.bytes_per_device}", f"hbm_bytes={16 * 2**30}", "fits=true"]
    # Two such slices joined by the data-center network: the data axis spans them.
    two = _cfg(char_data, **small, **{"compile.num_slices": 2})
    with pytest.raises(ConfigError, match=r"compile.num_slices=2: set the mesh axes that span the slices"):
        aot.compile_for(two, aot.target(two.compile))
    two = _cfg(char_data, **small, **{"compile.num_slices": 2, "mesh.dcn_data": 2})
    tgt2 = aot.target(two.compile)
    assert len(tgt2.devices) == 16 and len({d.slice_index for d in tgt2.devices}) == 2
    r2 = aot.compile_for(two, tgt2)
    assert r2.fits and r2.run.mesh.shape["data"] == 4
    lines = aot.report(r2)
    assert lines[0].startswith("train step for v5e-8 (16 x TPU v5 lite, 2 slices)")
    assert lines[1].startswith("mesh {'data': 4, 'fsdp': 2, 'tensor': 2} | batch 16 sequences (1 per device)")
    # A batch the chip cannot hold: the compiler refuses it and the report says by how much and what to change.
    big = _cfg(char_data, **{**small, "training.per_device_batch_size": 4096, "model.block_size": 512,
                             "model.vocab_size": 32768, "model.remat": "none"})
    r = aot.compile_for(big, tgt)
    assert r.executable is None and "RESOURCE_EXHAUSTED" in r.oom and r.bytes_per_device > 16 * 2**30
    verdict = aot.report(r)[-1]
    assert verdict.startswith("does not fit: needs ") and "over the 16.00 GiB of TPU v5 lite HBM" in verdict
    assert "training.per_device_batch_size=2048 (now 4096" in verdict and "model.remat=full (now none)" in verdict
    assert aot.machine_lines(r)[-1] == "fits=false"


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed (pip install 'jaxlm[tpu]')")
def test_megablox_moe_step_lowers_for_a_tpu_on_this_host(char_data):
    """model.moe_matmul=auto, which is megablox on a TPU (and ragged_dot on this CPU, test_expert.py): the train step of a two-layer MoE compiles for v5e-1 here (Mosaic lowers the
    kernels), with the expert widths not multiples of the kernel's tiles: in the scan's bodies, 3 forward kernel
    calls, 2 more where remat recomputes up and gate (the backward needs no down projection's output: the routing
    weights scale its input), and 6 in the backward (gmm for the inputs' gradients, tgmm for the weights'). Two
    layers keep the scan a loop: XLA unrolls a loop of one step, and its common-subexpression pass may then merge
    the forward with its recomputation."""
    import re

    cfg = _cfg(char_data, **{"model.n_layers": 2, "model.d_model": 192, "model.n_heads": 2, "model.d_ff": 1536,
                             "model.n_experts": 4, "model.experts_per_token": 2, "model.glu": True,
                             "model.activation": "silu", "model.vocab_size": 256, "model.block_size": 128,
                             "model.attention": "dot_product", "model.remat": "full", "model.moe_matmul": "auto",
                             "model.param_dtype": "bfloat16", "training.batch_size": 2, "mesh.ici_data": 1,
                             "compile.topology": "v5e-1"})
    r = aot.compile_for(cfg, aot.target(cfg.compile))
    assert r.fits
    hlo = r.executable.as_text()
    kernels = re.findall(r'custom_call_target="tpu_custom_call".*op_name="[^"]*/experts/jit\((t?gmm)\)/pallas_call"',
                         hlo)
    assert sorted(kernels) == ["gmm"] * 8 + ["tgmm"] * 3
    assert "ragged" not in hlo
