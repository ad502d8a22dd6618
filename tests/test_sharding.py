import hashlib
import json
import os
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
from jaxlm.train import batches as batch_lib, loop as train, run as run_lib, step as step_lib
from jaxlm.config import ConfigError, MeshConfig
from jaxlm.data import loader as loader_lib

STRATEGIES = {
    "data8": {"mesh.ici_data": 8},
    "fsdp8": {"mesh.ici_data": 1, "mesh.ici_fsdp": 8},
    "tensor4_data2": {"mesh.ici_data": 2, "mesh.ici_tensor": 4},
    "sequence2_fsdp4": {"mesh.ici_data": 1, "mesh.ici_sequence": 2, "mesh.ici_fsdp": 4},
    "data2_fsdp2_tensor2": {"mesh.ici_data": 2, "mesh.ici_fsdp": 2, "mesh.ici_tensor": 2},
}


def step_losses(char_data, tmp_path, devices, steps=20, **overrides):
    def batch_of(rng, run):
        starts = rng.integers(0, 100_000, size=(1, run.cfg.training.batch_size))
        return batch_lib.device_batch(run, "train", loader_lib.Windows(starts))

    return train_losses(tiny_config(char_data, tmp_path, **{"model.vocab_size": 128, **overrides}), devices, batch_of,
                        steps)


@pytest.fixture(scope="module")
def reference(char_data, tmp_path_factory):
    return step_losses(char_data, tmp_path_factory.mktemp("ref"), jax.devices()[:1])


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("data8", "tensor4_data2") else n
                                  for n in STRATEGIES])  # the other three cover every axis in CI's tier
def test_strategy_matches_one_device(name, char_data, tmp_path, reference):
    ref_losses, ref_state = reference
    losses, state = step_losses(char_data, tmp_path, jax.devices(), **STRATEGIES[name])
    assert ref_losses[-1] < ref_losses[0]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(jax.device_get(state["params"])), jax.tree.leaves(jax.device_get(ref_state["params"]))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def _argument_bytes(cfg, devices):
    run = run_lib.setup(cfg, devices)
    step = step_lib.make_train_step(run.cfg, run.optimizer, run.mesh, run.abstract_state, run.act_rules)
    tok = jax.ShapeDtypeStruct((1, run.cfg.training.batch_size, run.cfg.model.block_size), np.int32,
                               sharding=sharding.batch_sharding(run.mesh, 3, 1, run.act_rules))
    compiled = step.lower(run.abstract_state, {"inputs": tok, "targets": tok}).compile()
    state_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(run.abstract_state))
    return compiled.memory_analysis().argument_size_in_bytes, state_bytes


@pytest.mark.parametrize("mesh", [{"mesh.ici_data": 1, "mesh.ici_fsdp": 8}, {"mesh.ici_data": 1, "mesh.ici_tensor": 8}])
def test_sharded_state_bytes_per_device(mesh, char_data, tmp_path):
    big = {"model.vocab_size": 256, "model.d_model": 256, "model.n_heads": 8}
    unsharded, total = _argument_bytes(tiny_config(char_data, tmp_path, **big), jax.devices()[:1])
    sharded, _ = _argument_bytes(tiny_config(char_data, tmp_path, **big, **mesh), jax.devices())
    assert unsharded >= total  # params + optimizer state + the token batch
    # Only norm scales (and, for tensor parallelism, width-sized vectors) stay replicated.
    assert sharded <= unsharded / 8 * 1.05, (sharded, unsharded)


def test_mesh_errors_are_clear(char_data, tmp_path):
    with pytest.raises(ConfigError, match=r"mesh.ici_data=3 multiply to 3 devices but 8 are available"):
        run_lib.setup(tiny_config(char_data, tmp_path, **{"mesh.ici_data": 3}), jax.devices())
    with pytest.raises(ConfigError, match=r"heads' dimension of size 4 is sharded over mesh axes tensor \(8 devices\)"):
        run_lib.setup(tiny_config(char_data, tmp_path, **{"mesh.ici_data": 1, "mesh.ici_tensor": 8,
                                                        "model.vocab_size": 128}), jax.devices())
    with pytest.raises(ConfigError, match="training.per_device_batch_size=0.3 times 8 devices is 2.4"):
        run_lib.setup(tiny_config(char_data, tmp_path, **{"training.per_device_batch_size": 0.3}), jax.devices())
    with pytest.raises(ConfigError, match="unknown mesh axis 'tensr'"):
        sharding.rules_from_config(MeshConfig(rules="param.mlp=tensr"))


def test_per_device_batch_size_may_be_fractional(char_data, tmp_path):
    cfg = tiny_config(char_data, tmp_path, **{"mesh.ici_data": 1, "mesh.ici_sequence": 2, "mesh.ici_fsdp": 4,
                                              "training.per_device_batch_size": 0.5})
    run = run_lib.setup(cfg, jax.devices())
    assert run.cfg.training.batch_size == 4 and run.cfg.training.per_device_batch_size == 0.5


def test_rules_override_and_hybrid_mesh_shape():
    param, act = sharding.rules_from_config(MeshConfig(rules="param.embed=fsdp; act.length="))
    assert param["embed"] == ("fsdp",) and act["length"] == ()
    ici, dcn = sharding.mesh_shape(MeshConfig(ici_data=1, ici_fsdp=-1, dcn_data=2), 8)
    assert ici["fsdp"] == 4 and dcn["data"] == 2


def test_global_parameter_scale_multiplies_non_embedding_params():
    from jaxlm.model import flops

    base = config_lib.load("openwebtext").model
    n = flops.non_embedding_params(base)
    for scale in (2, 4, 8, 16):
        m = config_lib.apply_parameter_scale(config_lib.ModelConfig(**{**base.__dict__, "global_parameter_scale": scale}))
        assert flops.non_embedding_params(m) / n == pytest.approx(scale, rel=0.02)
        assert m.hd == base.hd


ROOT = Path(__file__).resolve().parents[1]


def _launch(args, cwd):
    env = dict(os.environ, XLA_FLAGS=xla_flags())
    return subprocess.run([sys.executable, "-m", "jaxlm.cli", "launch", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


def _recorded_step(run_dir) -> int:
    path = run_dir / "metrics.jsonl"
    steps = [0]
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            steps.append(json.loads(line)["step"])
        except ValueError:  # a line being written
            pass
    return max(steps)


def _sigterm_one_process(args, cwd, run_dir):
    """Launch 2 processes and SIGTERM the second once step 3 is recorded: (exit status, output, seconds from
    the signal to the exit of all processes)."""
    env = dict(os.environ, XLA_FLAGS=xla_flags())
    p = subprocess.Popen([sys.executable, "-m", "jaxlm.cli", "launch", *args], cwd=cwd, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 600
    while time.time() < deadline and p.poll() is None and _recorded_step(run_dir) < 3:
        time.sleep(0.05)
    children = [int(c) for c in Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()]
    assert len(children) == 2, children
    sent = time.time()
    os.kill(children[1], signal.SIGTERM)
    out = p.communicate(timeout=120)[0]
    return p.returncode, out, time.time() - sent


@pytest.mark.slow
@pytest.mark.default_settings  # several processes, compiled as users' runs are
def test_two_processes_match_one_and_resume_exactly_after_sigterm_to_one(char_data, tmp_path):
    common = ["shakespeare_char_cpu", f"data.dir={char_data}", "model.n_layers=2", "model.d_model=32",
              "model.block_size=32", "model.vocab_size=128", "training.batch_size=8", "optimizer.name=adamw",
              "optimizer.warmup_steps=2", "optimizer.decay_steps=12", "checkpoint.interval=6",
              "training.eval_interval=6", "training.eval_batches=2", "training.sample_tokens=0",
              "logging.progress=false", "training.log_interval=1", "mesh.ici_data=1", "mesh.ici_fsdp=8"]
    two_procs = ["--processes", "2", "--devices-per-process", "4", "--", "train", *common]
    # SIGTERM to one of two processes: both stop after the same step S, save it and exit 0.
    code, out, seconds = _sigterm_one_process([*two_procs, "training.steps=100000", f"run_dir={tmp_path / 'part'}"],
                                              tmp_path, tmp_path / "part")
    assert code == 0 and seconds < 30, out
    stops = {line[1]: int(line.split("after step ")[1].split(";")[0]) for line in out.splitlines()
             if "stopped for preemption after step" in line}
    assert set(stops) == {"0", "1"} and len(set(stops.values())) == 1, out
    S = stops["0"]
    assert ckpt.step_numbers(tmp_path / "part" / "checkpoints")[-1] == S
    assert ckpt.verify(tmp_path / "part" / "checkpoints" / str(S)) is None
    T = max(12, S + 4)
    # One process with 8 devices: this one (the launch of another costs the start-up of JAX).
    train.train(config_lib.load(common[0], [*common[1:], "training.steps=12", f"run_dir={tmp_path / 'one'}"]),
                jax.devices(), log=lambda s: None)
    two = _launch([*two_procs, f"training.steps={T}", f"run_dir={tmp_path / 'two'}"], tmp_path)
    assert two.returncode == 0, two.stdout + two.stderr
    assert "in 2 process(es)" in two.stdout
    a, b = train.losses_by_step(tmp_path / "one"), train.losses_by_step(tmp_path / "two")
    assert sorted(a) == list(range(1, 13)) and sorted(b) == list(range(1, T + 1))
    np.testing.assert_allclose([b[s] for s in range(1, 13)], [a[s] for s in range(1, 13)], rtol=1e-6)
    # Resume the preempted run: steps S+1..T repeat the uninterrupted two-process run exactly.
    rest = _launch([*two_procs, f"training.steps={T}", f"run_dir={tmp_path / 'part'}"], tmp_path)
    assert rest.returncode == 0 and f"at step {S}" in rest.stdout, rest.stdout + rest.stderr
    c = train.losses_by_step(tmp_path / "part")
    assert [c[s] for s in range(1, T + 1)] == [b[s] for s in range(1, T + 1)]

    # Both runs' final checkpoints, written by 2 processes, restore in this one (8 devices) on the saving
    # mesh, on fsdp4 x tensor2 and on 4 devices: the same bits every time, and the same in both runs.
    hashes = set()
    for mesh, devices in ((["mesh.ici_fsdp=8"], 8), (["mesh.ici_fsdp=4", "mesh.ici_tensor=2"], 8),
                          (["mesh.ici_fsdp=4"], 4)):
        run = run_lib.setup(config_lib.load(common[0], common[1:] + mesh), jax.devices()[:devices])
        for name in ("two", "part"):
            state = ckpt.restore_newest(tmp_path / name, run.abstract_state, log=lambda s: None)[1]
            hashes.add(hashlib.sha256(b"".join(np.asarray(x).tobytes()
                                               for x in jax.tree.leaves(jax.device_get(state)))).hexdigest())
    assert len(hashes) == 1


READER = """
import json, sys
import numpy as np
from jaxlm.launch import distributed
from jaxlm.train import batches as batch_lib, loop as train, run as run_lib
from jaxlm.data import loader
from jaxlm.config import DistributedConfig, apply_overrides, Config
distributed.initialize(DistributedConfig())
cfg = apply_overrides(Config(), {"data.dir": sys.argv[1], "model.block_size": 16, "model.n_layers": 1,
                                 "model.d_model": 16, "model.n_heads": 2, "training.batch_size": 8,
                                 "run_dir": sys.argv[2]})
run = run_lib.setup(cfg)

class Recording:
    def __init__(self, data):
        self.data, self.rows = data, set()
    def __len__(self):
        return len(self.data)
    def take(self, idx, mask=False):
        self.rows.update(int(v) // 1000 for v in np.asarray(idx)[..., 0].ravel())
        return self.data.take(idx, mask)

rec = run.dataset.splits["train"] = Recording(run.dataset.splits["train"])
batch = batch_lib.device_batch(run, "train", loader.Windows(np.arange(8).reshape(1, 8) * 1000))
assert batch["inputs"].shape == (1, 8, 16)
print("ROWS", json.dumps(sorted(rec.rows)))
"""


@pytest.mark.slow
def test_processes_read_disjoint_examples(char_data, tmp_path):
    script = tmp_path / "reader.py"
    script.write_text(READER)
    env = dict(os.environ, XLA_FLAGS=xla_flags())
    from jaxlm.launch.local import free_port

    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script), str(char_data), str(tmp_path / "r")],
                              env=dict(env, JAXLM_COORDINATOR=f"127.0.0.1:{port}", JAXLM_NUM_PROCESSES="2",
                                       JAXLM_PROCESS_ID=str(i), JAX_PLATFORMS="cpu",
                                       XLA_FLAGS=xla_flags(4)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    rows = [json.loads(next(l for l in o.splitlines() if l.startswith("ROWS"))[5:]) for o in outs]
    # Each process read 4 of the 8 rows of the global batch; none was read by both.
    assert len(rows[0]) == len(rows[1]) == 4, outs
    assert not set(rows[0]) & set(rows[1])
    assert sorted(rows[0] + rows[1]) == list(range(8))
