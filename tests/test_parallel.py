"""Pipeline parallelism on 8 fake CPU devices: the schedule, losses equal to one device, checkpoints across
layouts, and the collectives in the compiled step."""

import contextlib
import hashlib
import io
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import tiny_config, train_losses, xla_flags
from jaxlm import config as config_lib, sharding
from jaxlm.store import checkpoint as ckpt
from jaxlm.train import batches as batch_lib, loop as train, run as run_lib, state as state_lib, step as step_lib
from jaxlm.config import ConfigError
from jaxlm.data import loader as loader_lib
from jaxlm.model import pipeline

LAYERS = 8
# The suite runs three of the layouts that benchmarks/pipeline.py --equality checks (stage2 and stage4, with and
# without repeats, and stage2 x fsdp2 x data2).
PIPELINES = {
    "stage2": {"mesh.ici_data": 4, "mesh.ici_stage": 2},
    "stage4_circular": {"mesh.ici_data": 2, "mesh.ici_stage": 4, "training.pipeline_repeats": 2},
    # with FSDP, 4 micro-batches, gradient accumulation and remat
    "stage2_fsdp2_data2": {"mesh.ici_data": 2, "mesh.ici_fsdp": 2, "mesh.ici_stage": 2,
                           "training.pipeline_microbatches": 4, "training.grad_accum": 2, "model.remat": "full"},
}


@pytest.mark.parametrize("S,M,R", [(2, 2, 1), (4, 8, 1), (4, 4, 2), (3, 5, 3)])
def test_schedule_runs_every_chunk_once_in_order(S, M, R):
    table = pipeline.schedule(S, M, R)
    seen = {}
    for t, row in enumerate(table):
        for s, (m, r) in enumerate(row):
            if m >= 0:
                assert (m, r, s) not in seen
                seen[(m, r, s)] = t
    # Every micro-batch runs chunk r * S + s of every repeat r and stage s, one after the other in that order.
    assert len(seen) == S * M * R
    for m in range(M):
        times = [seen[(m, r, s)] for r in range(R) for s in range(S)]
        assert times == sorted(times) and len(set(times)) == len(times)
    assert pipeline.bubble_fraction(table) == pytest.approx((S - 1) / (R * M + S - 1))


def _losses(char_data, tmp_path, devices, steps=20, **overrides):
    def batch_of(rng, run):  # the same 16 rows each step: two accumulated micro-batches of 8, or one batch
        starts = rng.integers(0, 100_000, size=16).reshape(run.cfg.training.grad_accum, -1)
        return batch_lib.device_batch(run, "train", loader_lib.Windows(starts))

    cfg = tiny_config(char_data, tmp_path, **{"model.vocab_size": 128, "model.n_layers": LAYERS, **overrides})
    return train_losses(cfg, devices, batch_of, steps)


@pytest.fixture(scope="module")
def reference(char_data, tmp_path_factory):
    return _losses(char_data, tmp_path_factory.mktemp("ref"), jax.devices()[:1], **{"training.batch_size": 16})


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.in_ci) if n == "stage2" else n
                                  for n in PIPELINES])
def test_pipeline_matches_one_device(name, char_data, tmp_path, reference):
    overrides = {"training.batch_size": 8 if PIPELINES[name].get("training.grad_accum") == 2 else 16,
                 **PIPELINES[name]}
    ref_losses, ref_state = reference
    losses, state = _losses(char_data, tmp_path, jax.devices(), **overrides)
    assert ref_losses[-1] < ref_losses[0] - 0.3
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(jax.device_get(state["params"])),
                    jax.tree.leaves(jax.device_get(ref_state["params"]))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


FAMILIES = {
    # Gemma 2's alternating local/global layers, post-norms and soft-caps
    "local_global": {"model.layer_pattern": "local,global", "model.sliding_window": 8, "model.post_norms": True,
                     "model.attn_logit_softcap": 50.0, "model.final_logit_softcap": 30.0, "model.norm": "rmsnorm",
                     "model.position": "rotary", "model.glu": True, "model.activation": "gelu"},
    # a Mixtral-like mixture of experts: the load-balancing loss is a mean over tokens and layers
    "moe": {"model.n_experts": 4, "model.experts_per_token": 2, "model.norm": "rmsnorm", "model.position": "rotary",
            "model.glu": True, "model.activation": "silu", "model.scan_layers": False},
}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_pipeline_loss_and_grads_match_for_families(family, char_data, tmp_path):
    """One loss and gradient, with packed documents (segment ids, restarting positions) and dropout off."""
    from jaxlm.model import loss_fn
    results = []
    piped = {"local_global": ({"mesh.ici_data": 4, "mesh.ici_stage": 2}, (4, 2)),  # chunks of 2 layers
             "moe": ({"mesh.ici_data": 2, "mesh.ici_stage": 4}, (4, 2))}[family]
    for mesh, pipe in (({"mesh.ici_data": 1}, (0, 1)), piped):
        cfg = tiny_config(char_data, tmp_path, **{"model.vocab_size": 128, "model.n_layers": LAYERS,
                                                  **FAMILIES[family], **mesh})
        devices = jax.devices()[:1] if mesh["mesh.ici_data"] == 1 else jax.devices()
        run = run_lib.setup(cfg, devices)
        state = state_lib.init_state(run, 0)
        rng = np.random.default_rng(1)
        tokens = rng.integers(0, 128, size=(8, 32)).astype(np.int32)
        segments = np.cumsum(rng.random((8, 32)) < 0.1, axis=1).astype(np.int32)
        starts = np.maximum.accumulate(np.where(np.concatenate(
            [np.ones((8, 1), bool), segments[:, 1:] != segments[:, :-1]], axis=1), np.arange(32), 0), axis=1)
        positions = (np.arange(32) - starts).astype(np.int32)

        def f(params):
            with sharding.activation_sharding(run.mesh, run.act_rules, pipe):
                return loss_fn(params, tokens, np.roll(tokens, -1, 1), run.cfg.model, positions_BT=positions,
                               segment_ids_BT=segments)

        results.append(jax.device_get(jax.jit(jax.value_and_grad(f))(state["params"])))
    (loss_a, grads_a), (loss_b, grads_b) = results
    np.testing.assert_allclose(loss_b, loss_a, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


def _state_hash(state) -> str:
    return hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves(jax.device_get(state)))
                          ).hexdigest()


@pytest.mark.slow
def test_checkpoints_restore_across_pipeline_layouts(char_data, tmp_path):
    """A run on 4 stages saves at step 10 and 20; a run without a pipeline resumes from its step 10 and ends
    on the losses of the pipelined run; every layout restores the same bits."""
    common = {"model.vocab_size": 128, "model.n_layers": LAYERS, "training.batch_size": 16,
              "training.eval_interval": 0}
    piped = {"mesh.ici_data": 2, "mesh.ici_stage": 4, "training.pipeline_repeats": 2}
    train.train(tiny_config(char_data, tmp_path / "piped", **common, **piped), jax.devices(), log=lambda s: None)
    layouts = (({"mesh.ici_data": 8}, 8), (piped, 8), ({"mesh.ici_data": 1}, 1),
               ({"mesh.ici_data": 1, "mesh.ici_fsdp": 2, "mesh.ici_stage": 2}, 4))
    hashes = set()
    for mesh, devices in layouts:
        run = run_lib.setup(tiny_config(char_data, tmp_path / "piped", **common, **mesh), jax.devices()[:devices])
        hashes.add(_state_hash(ckpt.restore_newest(tmp_path / "piped", run.abstract_state, log=lambda s: None)[1]))
    assert len(hashes) == 1
    # The pipelined run's step-10 checkpoint, resumed without a pipeline.
    shutil.copytree(tmp_path / "piped" / "checkpoints" / "10", tmp_path / "resumed" / "checkpoints" / "10")
    train.train(tiny_config(char_data, tmp_path / "resumed", **common, **{"mesh.ici_data": 8}), jax.devices(),
                log=lambda s: None)
    a, b = train.losses_by_step(tmp_path / "piped"), train.losses_by_step(tmp_path / "resumed")
    assert sorted(b) == list(range(11, 21))
    np.testing.assert_allclose([b[s] for s in range(11, 21)], [a[s] for s in range(11, 21)], rtol=1e-5)


def _collectives(char_data, overrides: dict) -> dict[str, list[str]]:
    """The compiled train step's collectives: op name -> the shapes of their results."""
    cfg = tiny_config(char_data, None, **{"model.vocab_size": 128, "model.n_layers": LAYERS,
                                          "training.batch_size": 16, **overrides})
    run = run_lib.setup(cfg, jax.devices())
    step = step_lib.make_train_step(run.cfg, run.optimizer, run.mesh, run.abstract_state, run.act_rules)
    hlo = step.lower(run.abstract_state, step_lib.abstract_batch(run)).compile().as_text()
    found: dict[str, list[str]] = {}
    for shape, op in re.findall(r"= \(?([a-z0-9]+\[[0-9,]*\])[^=\n]*? (all-gather|all-to-all|collective-permute|"
                                r"all-reduce|reduce-scatter)(?:-start)?\(", hlo):
        found.setdefault(op, []).append(shape)
    return found


@pytest.mark.parametrize("repeats", [1, 2])
def test_pipeline_moves_activations_not_weights(repeats, char_data):
    """Stage activations move with collective permutes; no weight is all-gathered over `stage` (with a data
    axis and no FSDP, the step holds no all-gather at all). A circular pipeline regathers its chunks
    round-robin with all-to-alls."""
    found = _collectives(char_data, {"mesh.ici_data": 2, "mesh.ici_stage": 4, "training.pipeline_repeats": repeats})
    assert "all-gather" not in found, found["all-gather"]
    # a stage's activations [stage, micro-batch rows per device, length, width]: 16 rows / 4 micro-batches / 2
    assert "f32[1,2,32,32]" in found["collective-permute"], found
    assert ("all-to-all" in found) == (repeats > 1), found


def test_int8_training_steps_through_pipeline_stages(char_data):
    """int8 training quantizes the block weights once a step (quant.step_weights) where the layers run as one stack;
    pipeline stages slice the weights by their specs, so there the matmuls quantize them (the step's weights as
    quant.StepInt8 nodes did not match the specs' tree, and the step failed to trace)."""
    cfg = tiny_config(char_data, **{"model.vocab_size": 128, "model.n_layers": 4, "mesh.ici_data": 4,
                                    "mesh.ici_stage": 2, "model.quantization": "int8", "training.grad_accum": 2})
    lowered = step_lib.lower_train_step(run_lib.setup(cfg, jax.devices(), data=False)).as_text()
    assert re.search(r"\(tensor<[0-9x]+xi8>, tensor<[0-9x]+xi8>\) -> tensor<[0-9x]+xi32>", lowered)


def test_pipeline_setting_errors_are_one_line(char_data, tmp_path):
    with pytest.raises(ConfigError, match="training.pipeline_microbatches=3 must divide the batch of 16"):
        _losses(char_data, tmp_path, jax.devices(), steps=1, **{"training.batch_size": 16, "mesh.ici_data": 2,
                                                                "mesh.ici_stage": 4,
                                                                "training.pipeline_microbatches": 3})
    with pytest.raises(ConfigError, match="pipeline_repeats=3 must split model.n_layers=8"):
        _losses(char_data, tmp_path, jax.devices(), steps=1, **{"training.batch_size": 16, "mesh.ici_data": 2,
                                                                "mesh.ici_stage": 4, "training.pipeline_repeats": 3})
    with pytest.raises(config_lib.ConfigError, match="training.pipeline_repeats=0 must be > 0"):
        tiny_config(char_data, tmp_path, **{"training.pipeline_repeats": 0})


@pytest.mark.slow
def test_two_processes_with_stages_across_them_match_one(char_data, tmp_path):
    """2 processes x 4 devices with the two pipeline stages across the processes (mesh.dcn_stage=2) train as
    1 process x 8 devices with both stages in it."""
    common = ["shakespeare_char_cpu", f"data.dir={char_data}", "model.n_layers=4", "model.d_model=32",
              "model.block_size=32", "model.vocab_size=128", "training.batch_size=8", "training.steps=6",
              "optimizer.name=adamw", "optimizer.warmup_steps=2", "checkpoint.enabled=false",
              "training.eval_interval=0", "training.eval_batches=1", "training.sample_tokens=0",
              "logging.progress=false", "training.log_interval=1", "mesh.ici_data=4"]
    env = dict(os.environ, XLA_FLAGS=xla_flags())
    two = subprocess.run([sys.executable, "-m", "jaxlm.cli", "launch", "--processes", "2", "--devices-per-process",
                          "4", "--", "train", *common, "mesh.dcn_stage=2", f"run_dir={tmp_path / 'two'}"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert two.returncode == 0 and "in 2 process(es)" in two.stdout, two.stdout + two.stderr
    train.train(config_lib.load(common[0], [*common[1:], "mesh.ici_stage=2", f"run_dir={tmp_path / 'one'}"]),
                jax.devices(), log=lambda s: None)
    a, b = train.losses_by_step(tmp_path / "one"), train.losses_by_step(tmp_path / "two")
    assert sorted(a) == sorted(b) == list(range(1, 7))
    np.testing.assert_allclose([b[s] for s in a], [a[s] for s in a], rtol=1e-5)


def _steps_recorded(run_dir: Path) -> int:
    try:
        return len(train.losses_by_step(run_dir))
    except (OSError, ValueError):  # not written yet, or a line being written
        return 0


@pytest.mark.slow
def test_a_killed_process_is_named_and_the_rerun_resumes_exactly(char_data, tmp_path):
    """kill -9 of one of two processes (a pipeline stage on each): the survivor says in one line which process
    it lost, the launcher exits 137 naming it, and the same command run again resumes from the last checkpoint
    and repeats the lost steps' losses exactly."""
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "jaxlm.cli", "launch", "--processes", "2", "--devices-per-process", "4", "--",
            "train", "shakespeare_char_cpu", f"data.dir={char_data}", "model.n_layers=4", "model.d_model=32",
            "model.block_size=32", "model.vocab_size=128", "training.batch_size=8", "training.steps=24",
            "optimizer.name=adamw", "optimizer.warmup_steps=2", "checkpoint.interval=5",
            "training.eval_interval=0", "training.eval_batches=1", "training.sample_tokens=0", "logging.progress=false",
            "training.log_interval=1", "mesh.ici_data=4", "mesh.dcn_stage=2", f"run_dir={run_dir}"]
    env = dict(os.environ, XLA_FLAGS=xla_flags())
    p = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 600
    while time.time() < deadline and p.poll() is None and _steps_recorded(run_dir) < 12:
        time.sleep(0.05)
    children = [int(c) for c in Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()]
    assert len(children) == 2, children
    os.kill(children[1], signal.SIGKILL)
    out = p.communicate(timeout=120)[0]
    assert p.returncode == 137, out
    assert f"jaxlm launch: process 1 (pid {children[1]}) was killed by SIGKILL; exit status 137" in out, out
    lines = [line for line in out.splitlines() if line.startswith("[0] error:")]
    lost = f"process 0 stopped: process 1 (pid {children[1]}) was killed by SIGKILL"
    assert len(lines) == 1 and lost in lines[0], out
    assert "Traceback" not in out, out
    before = train.losses_by_step(run_dir)
    saved = max(ckpt.step_numbers(run_dir / "checkpoints"))
    assert saved >= 10 and max(before) > saved
    rerun = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert f"at step {saved}" in rerun.stdout, rerun.stdout
    after = train.losses_by_step(run_dir)
    assert sorted(after) == list(range(1, 25))
    redone = range(saved + 1, max(before) + 1)
    assert [after[s] for s in redone] == [before[s] for s in redone]



def test_a_survivor_stuck_where_no_error_comes_leaves_when_the_launcher_records_a_loss(tmp_path):
    """A process waiting where the lost peer's absence raises nothing (a barrier of the coordination service, a
    preemption sync point after a SIGTERM) still leaves within a second of the launcher's record, with one line
    naming the lost process."""
    events = tmp_path / "events"
    env = dict(os.environ, JAXLM_LAUNCH_EVENTS=str(events), JAXLM_NUM_PROCESSES="2", JAXLM_PROCESS_ID="0")
    stuck = subprocess.Popen([sys.executable, "-c", "import time; from jaxlm.launch.local import watch_peers\n"
                              "watch_peers(); print('waiting', flush=True); time.sleep(120)"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert stuck.stdout.readline() == "waiting\n"
    time.sleep(0.5)
    assert stuck.poll() is None  # no record yet: it keeps waiting
    events.write_text("process 1 (pid 4242) was killed by SIGKILL\n")
    start = time.monotonic()
    out = stuck.communicate(timeout=30)[0]
    assert stuck.returncode == 1 and time.monotonic() - start < 5
    assert out.splitlines() == ["error: process 0 stopped: process 1 (pid 4242) was killed by SIGKILL; rerun the "
                                "same command to resume from the last checkpoint"], out

def _stacked_activations(char_data, overrides: dict, pipe: tuple[int, int]) -> int:
    """Elements of the activations [..., length, width] that the loss's backward pass keeps stacked over
    layers or pipeline iterations (jax.ad_checkpoint.print_saved_residuals: the residuals of rank 4 and up)."""
    from jaxlm.model import loss_fn
    T, D = 40, 48  # sizes no weight has in its last two dimensions
    cfg = tiny_config(char_data, None, **{"model.vocab_size": 128, "model.n_layers": LAYERS, "model.block_size": T,
                                          "model.d_model": D, "model.remat": "full", "training.batch_size": 16,
                                          **overrides})
    run = run_lib.setup(cfg, jax.devices())
    tokens = jax.ShapeDtypeStruct((16, T), np.int32)

    def f(params, tokens_BT):
        with sharding.activation_sharding(run.mesh, run.act_rules, pipe):
            return loss_fn(params, tokens_BT, tokens_BT, run.cfg.model)

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(f, run.abstract_state["params"], tokens)
    shapes = [[int(n) for n in dims.split(",")] for dims in re.findall(r"^f32\[([\d,]+)\]", out.getvalue(), re.M)]
    return sum(math.prod(s) for s in shapes if len(s) >= 4 and s[-2:] == [T, D])


def test_pipeline_backward_keeps_only_stage_inputs(char_data):
    """The pipeline keeps one stage input per stage and iteration, [R M + S - 1, S, B / M, T, D], rerunning a
    stage's layers from it, not each of its layers' inputs for every iteration (C times as much); that is under
    half of what the unpipelined backward keeps with model.remat=full (each layer's input, [L, B, T, D])."""
    S, M = 2, 2
    piped = _stacked_activations(char_data, {"mesh.ici_data": 4, "mesh.ici_stage": S}, (M, 1))
    assert piped == (M + S - 1) * S * (16 // M) * 40 * 48
    assert piped < _stacked_activations(char_data, {"mesh.ici_data": 8}, (0, 1)) / 2

