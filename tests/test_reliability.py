"""Reliability: exact resume, sealed checkpoints and their corruption, kills mid-save, preemption, steps that
are not finite, restore on other meshes, failing saves, and bad configs and input data."""

import contextlib
import errno
import hashlib
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from conftest import tiny_config, xla_flags
from jaxlm import config as config_lib
from jaxlm.store import checkpoint as ckpt
from jaxlm.train import batches as batch_lib, loop as train, optim, run as run_lib, state as state_lib, step as step_lib
from jaxlm.config import CheckpointConfig
from jaxlm.data import loader as loader_lib

TESTS = Path(__file__).resolve().parent

# One schedule for runs of 20 and 40 steps, so that a run stopped at 20 and resumed continues the 40-step one.
RUN = {"training.steps": 40, "optimizer.decay_steps": 40, "checkpoint.interval": 10, "checkpoint.keep": 10,
       "training.eval_interval": 0}


def quiet(_):
    pass


def restore_step(cfg, run_dir: Path, step: int) -> dict:
    """The train state of one checkpoint, read without the jaxlm checks (a test's independent reader)."""
    run = run_lib.setup(cfg)
    options = ocp.CheckpointManagerOptions(read_only=True, create=False)
    with ocp.CheckpointManager((run_dir / "checkpoints").absolute(), options=options) as mngr:
        out = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(run.abstract_state)))
    return jax.device_get(out["state"])


def tree_hash(tree) -> str:
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        a = np.asarray(leaf)
        h.update(str((a.shape, a.dtype)).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def tmp_dirs(run_dir: Path) -> list[str]:
    return [p.name for p in (run_dir / "checkpoints").iterdir() if "tmp" in p.name]


@pytest.fixture(scope="module")
def reference(char_data, tmp_path_factory):
    """An uninterrupted 40-step run with checkpoints at 10, 20, 30 and 40."""
    run_dir = tmp_path_factory.mktemp("reliability") / "reference"
    cfg = tiny_config(char_data, run_dir, **RUN)
    train.train(cfg, log=quiet)
    return cfg, run_dir, train.losses_by_step(run_dir)


def test_clean_resume_is_bitwise_exact(reference, char_data, tmp_path):
    cfg, ref_dir, ref = reference
    part = tmp_path / "part"
    train.train(tiny_config(char_data, part, **{**RUN, "training.steps": 20}), log=quiet)
    summary = train.train(tiny_config(char_data, part, **RUN), log=quiet)
    assert summary["start_step"] == 20
    got = train.losses_by_step(part)
    assert sorted(got) == sorted(ref) == list(range(1, 41))
    assert [got[s] for s in range(1, 41)] == [ref[s] for s in range(1, 41)]
    assert ref[40] < ref[1]
    assert summary["val_loss"] == [r for r in train.read_metrics(ref_dir) if "val_loss" in r][-1]["val_loss"]
    a, b = restore_step(cfg, ref_dir, 40), restore_step(cfg, part, 40)
    assert tree_hash(a["params"]) == tree_hash(b["params"])
    assert tree_hash(a) == tree_hash(b)  # optimizer state, step and skip counters too


KILL_AFTER_SAVE = """
import json, os, signal, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from conftest import tiny_config
from jaxlm.store import checkpoint
from jaxlm.train import loop as train

kill_at = int(sys.argv[4])
save = checkpoint.Checkpointer.save

def save_then_die(self, step, *args):
    save(self, step, *args)  # returns once the async save has started
    if step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)

checkpoint.Checkpointer.save = save_then_die
train.train(tiny_config(Path(sys.argv[2]), Path(sys.argv[3]), **json.loads(sys.argv[5])), log=lambda s: None)
"""


@pytest.mark.slow
def test_sigkill_right_after_an_async_save_starts(reference, char_data, tmp_path):
    cfg, ref_dir, ref = reference
    run_dir = tmp_path / "killed"
    p = subprocess.run([sys.executable, "-c", KILL_AFTER_SAVE, str(TESTS), str(char_data), str(run_dir), "30",
                        json.dumps(RUN)], capture_output=True, text=True, timeout=600)
    assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr
    assert ckpt.step_numbers(run_dir / "checkpoints")[-1] <= 30
    lines = []
    summary = train.train(tiny_config(char_data, run_dir, **RUN), log=lines.append)
    assert summary["start_step"] == 20, lines
    assert not tmp_dirs(run_dir)
    got = train.losses_by_step(run_dir)
    assert [got[s] for s in range(21, 41)] == [ref[s] for s in range(21, 41)]
    assert tree_hash(restore_step(cfg, run_dir, 40)) == tree_hash(restore_step(cfg, ref_dir, 40))


SAVE_AND_KILL = """
import json, os, random, signal, sys, time
from pathlib import Path
from jaxlm.store import checkpoint  # imports jax and orbax but touches no device, so forking is safe
from jaxlm.config import CheckpointConfig

run_dir, results, kills, seed = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
N = 1 << 18


def values(step):
    import numpy as np
    return np.random.default_rng(step).standard_normal(N, dtype=np.float32)


def child(last):
    import jax, jax.numpy as jnp, numpy as np
    said = []
    ck = checkpoint.Checkpointer(run_dir, CheckpointConfig(keep=2), log=said.append)
    rec = {"restored": ck.latest, "tmp_left": [p.name for p in Path(ck.dir).iterdir() if "tmp" in p.name],
           "interrupted_save": any("unfinished save" in s or "did not finish" in s for s in said)}
    if ck.latest is not None:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract = {"x": jax.ShapeDtypeStruct((N,), jnp.float32, sharding=dev),
                    "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=dev)}
        state, loader = ck.restore(ck.latest, abstract)
        rec["complete"] = bool(int(state["step"]) == ck.latest and loader == {"step": ck.latest}
                               and np.array_equal(np.asarray(state["x"]), values(ck.latest)))
    with open(results, "a") as f:
        f.write(json.dumps(rec) + "\\n")
    step = ck.latest or 0
    while not last:
        step += 1
        ck.save(step, {"x": jnp.asarray(values(step)), "step": jnp.int32(step)}, {"step": step})
    ck.close()


rng = random.Random(seed)
for i in range(kills + 1):
    pid = os.fork()
    if pid == 0:
        try:
            child(last=i == kills)
        finally:
            os._exit(0)
    if i < kills:
        time.sleep(rng.uniform(0.5, 2.0))  # anywhere in start-up, restore, a save, its commit or clean-up
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
"""


def kill_during_saves(tmp_path: Path, kills: int, seed: int) -> list[dict]:
    """A process that saves checkpoint after checkpoint of known values, SIGKILLed at random moments and
    restarted each time (forked, so a restart costs no import); one record per restart."""
    results = tmp_path / "restores.jsonl"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags())
    p = subprocess.run([sys.executable, "-c", SAVE_AND_KILL, str(tmp_path / "run"), str(results), str(kills),
                        str(seed)], env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads(line) for line in results.read_text().splitlines()]


@pytest.mark.slow
def test_random_kills_never_restore_an_incomplete_checkpoint(tmp_path):
    records = kill_during_saves(tmp_path, kills=20, seed=0)
    assert len(records) == 21
    restored = [r["restored"] for r in records if r["restored"] is not None]
    assert len(set(restored)) >= 3  # checkpoints were committed between kills...
    assert sum(r["interrupted_save"] for r in records) >= 3  # ...and kills often cut a save short
    assert all(r["complete"] for r in records if r["restored"] is not None)
    assert restored == sorted(restored)  # a committed checkpoint is never lost to a later kill
    assert not any(r["tmp_left"] for r in records)
    assert not tmp_dirs(tmp_path / "run")


# ---- corruption -------------------------------------------------------------------------------------------------

def corruptions(path: Path, rng: random.Random):
    """Each way a file can go bad, applied in turn (the file is restored after each)."""
    data = path.read_bytes()
    cut = rng.randrange(len(data)) if len(data) > 1 else 0
    bit = rng.randrange(len(data) * 8)
    flipped = bytearray(data)
    flipped[bit // 8] ^= 1 << (bit % 8)
    for name, content in (("truncated", data[:cut]), ("bit flipped", bytes(flipped)), ("emptied", b"")):
        if content == data:
            continue
        path.write_bytes(content)
        yield name
        path.write_bytes(data)


def test_every_corruption_of_every_file_is_detected_and_the_previous_checkpoint_used(reference, char_data, tmp_path):
    cfg, ref_dir, ref = reference
    run_dir = tmp_path / "run"
    for step in (30, 40):
        shutil.copytree(ref_dir / "checkpoints" / str(step), run_dir / "checkpoints" / str(step))
    step_dir = run_dir / "checkpoints" / "40"
    assert ckpt.verify(step_dir) is None
    rng = random.Random(0)
    tried = detected = 0
    files = [p for p in step_dir.rglob("*") if p.is_file() and p.name != ckpt.MANIFEST]
    assert any("ocdbt.process_0" in str(p) for p in files) and len(files) >= 8
    for path in files:
        for kind in corruptions(path, rng):
            tried += 1
            reason = ckpt.verify(step_dir)
            detected += reason is not None and str(path.relative_to(step_dir)) in reason
    assert ckpt.verify(step_dir) is None
    manifest = (step_dir / ckpt.MANIFEST).read_bytes()
    (step_dir / ckpt.MANIFEST).unlink()
    tried, detected = tried + 1, detected + (ckpt.verify(step_dir) is not None)
    assert tried >= 3 * len(files) - 2 and detected == tried

    # Resuming skips the damaged step 40 (here: one flipped bit in its largest array file), says so, sets it
    # aside and continues exactly from 30.
    (step_dir / ckpt.MANIFEST).write_bytes(manifest)
    biggest = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(biggest.read_bytes())
    data[len(data) // 2] ^= 0x10
    biggest.write_bytes(bytes(data))
    lines = []
    summary = train.train(tiny_config(char_data, run_dir, **RUN), log=lines.append)
    warning = next(line for line in lines if line.startswith("warning: skipping checkpoint"))
    assert str(step_dir) in warning and "checksum" in warning
    assert summary["start_step"] == 30 and (run_dir / "checkpoints" / "rejected" / "40").is_dir()
    got = train.losses_by_step(run_dir)
    assert [got[s] for s in range(31, 41)] == [ref[s] for s in range(31, 41)]
    assert ckpt.verify(run_dir / "checkpoints" / "40") is None


def test_no_usable_checkpoint_fails_clearly_and_unfinished_saves_are_not_errors(reference, tmp_path):
    cfg, ref_dir, _ = reference
    ckpt_dir = tmp_path / "run" / "checkpoints"
    shutil.copytree(ref_dir / "checkpoints" / "10", ckpt_dir / "10")
    (ckpt_dir / "10" / "loader" / "metadata").write_text("")
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.Checkpointer(tmp_path / "run", cfg.checkpoint, log=quiet)
    assert "\n" not in str(e.value) and "no usable checkpoint" in str(e.value) and "loader/metadata" in str(e.value)
    # A save that never got its manifest (killed after Orbax's rename) is incomplete, not damage: start over.
    (ckpt_dir / "10" / ckpt.MANIFEST).unlink()
    (ckpt_dir / "20.orbax-checkpoint-tmp").mkdir()
    lines = []
    ck = ckpt.Checkpointer(tmp_path / "run", cfg.checkpoint, log=lines.append)
    assert ck.latest is None and not tmp_dirs(tmp_path / "run") and ckpt.step_numbers(ckpt_dir) == []
    assert any("skipping checkpoint" in line and "did not finish" in line for line in lines)
    ck.close()


# ---- preemption -------------------------------------------------------------------------------------------------

def signal_at_step(monkeypatch, step: int, sig=signal.SIGTERM):
    """Send `sig` to this process while the loop fetches the batch of `step` (1-based)."""
    real, n = batch_lib.device_batch, [0]

    def batch(run, split, plan):
        if len(plan.shape) == 2:  # the loop's [grad_accum, batch]; evaluation passes [batch]
            n[0] += 1
            if n[0] == step:
                os.kill(os.getpid(), sig)
        return real(run, split, plan)

    monkeypatch.setattr(batch_lib, "device_batch", batch)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_saves_that_step_and_returns_then_resume_is_exact(sig, reference, char_data, tmp_path, monkeypatch):
    cfg, ref_dir, ref = reference
    run_dir = tmp_path / "run"
    handler = signal.getsignal(sig)
    signal_at_step(monkeypatch, 13, sig)
    lines = []
    summary = train.train(tiny_config(char_data, run_dir, **RUN), log=lines.append)
    monkeypatch.undo()
    assert summary["preempted_at"] == 13 and signal.getsignal(sig) == handler  # the handler is put back
    assert any(f"received {sig.name}" in line for line in lines) and any(
        "stopped for preemption after step 13" in line for line in lines)
    assert ckpt.step_numbers(run_dir / "checkpoints") == [10, 13]
    assert ckpt.verify(run_dir / "checkpoints" / "13") is None
    assert max(train.losses_by_step(run_dir)) == 13  # every step's metrics reached the disk
    summary = train.train(tiny_config(char_data, run_dir, **RUN), log=quiet)
    assert summary["start_step"] == 13
    got = train.losses_by_step(run_dir)
    assert [got[s] for s in range(1, 41)] == [ref[s] for s in range(1, 41)]
    assert tree_hash(restore_step(cfg, run_dir, 40)) == tree_hash(restore_step(cfg, ref_dir, 40))


# ---- non-finite steps and loss spikes ---------------------------------------------------------------------------

def poisoned(real, steps: set[int]):
    """device_batch with token ids past the vocabulary in the batches of these steps (1-based): the embedding
    lookup yields NaN."""
    n = [0]

    def batch(run, split, plan, *read):
        b = real(run, split, plan, *read)
        if len(plan.shape) == 2:  # the loop's [grad_accum, batch]; evaluation passes [batch]
            n[0] += 1
            if n[0] in steps:
                b = dict(b, inputs=b["inputs"] + run.cfg.model.vocab_size)
        return b

    return batch


def poison_steps(monkeypatch, steps: set[int]):
    monkeypatch.setattr(batch_lib, "device_batch", poisoned(batch_lib.device_batch, steps))


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """Writes past nbytes fail with EFBIG, a real write error that root cannot override either."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)


def test_train_step_leaves_state_unchanged_on_nan_and_on_spikes(char_data, tmp_path):
    cfg = tiny_config(char_data, tmp_path, **RUN, **{"training.spike_threshold": 1.5})
    run = run_lib.setup(cfg)
    step = step_lib.make_train_step(run.cfg, run.optimizer, run.mesh, run.abstract_state, run.act_rules)
    starts = np.random.default_rng(0).integers(0, 100_000, (4, 1, 8))
    batches = [batch_lib.device_batch(run, "train", loader_lib.Windows(s)) for s in starts]
    state = state_lib.init_state(run, 0)
    for b in batches[:2]:
        state, m = step(state, b)
    assert int(m["nonfinite_skips"]) == int(m["spike_skips"]) == 0 and float(m["loss_avg"]) > 0
    before = jax.device_get(state)

    b = batches[2]
    # Ids past the vocabulary: NaN embeddings.
    state, m = step(state, dict(b, inputs=b["inputs"] + run.cfg.model.vocab_size))
    after = jax.device_get(state)
    assert not np.isfinite(float(m["loss"]))
    assert (int(m["nonfinite_skips"]), int(m["skips_in_a_row"]), int(after["step"])) == (1, 1, 3)
    assert tree_hash(after["params"]) == tree_hash(before["params"])
    assert tree_hash(after["opt_state"]) == tree_hash(before["opt_state"])
    assert float(after["guard"]["loss_avg"]) == float(before["guard"]["loss_avg"])

    # A loss over 1.5x the running average: an average of 1.0 makes this batch's loss (about ln 65) a spike.
    state = dict(state, guard=dict(state["guard"], loss_avg=jnp.float32(1.0)))
    before = jax.device_get(state)
    state, m = step(state, batches[3])
    after = jax.device_get(state)
    assert float(m["loss"]) > 1.5 and (int(m["spike_skips"]), int(m["skips_in_a_row"])) == (1, 0)
    assert tree_hash(after["params"]) == tree_hash(before["params"])
    assert tree_hash(after["opt_state"]) == tree_hash(before["opt_state"])
    # The spike enters the average only up to the threshold, and `lr` is the rate of the next applied update.
    assert float(after["guard"]["loss_avg"]) == pytest.approx(0.99 * 1.0 + 0.01 * 1.5, rel=1e-6)
    assert float(m["lr"]) == pytest.approx(float(optim.schedule(cfg.optimizer, cfg.training.steps)(2)))

    state = dict(state, guard=dict(state["guard"], loss_avg=jnp.float32(4.0)))
    state, m = step(state, batches[3])
    assert int(m["spike_skips"]) == 1 and tree_hash(jax.device_get(state["params"])) != tree_hash(after["params"])


def test_nan_step_is_skipped_and_no_checkpoint_holds_nan(reference, char_data, tmp_path, monkeypatch):
    cfg, _, ref = reference
    run_dir = tmp_path / "skip"
    poison_steps(monkeypatch, {5})
    lines = []
    settings = {**RUN, "training.steps": 8, "checkpoint.interval": 1, "checkpoint.keep": 20}
    summary = train.train(tiny_config(char_data, run_dir, **settings), log=lines.append)
    assert summary["nonfinite_skips"] == 1
    assert any(line.startswith("step 5: the loss (nan)") and "update skipped" in line for line in lines)
    losses = train.losses_by_step(run_dir)
    assert np.isnan(losses[5]) and all(np.isfinite(losses[s]) for s in (1, 2, 3, 4, 6, 7, 8))
    assert [losses[s] for s in range(1, 5)] == [ref[s] for s in range(1, 5)]
    states = {s: restore_step(cfg, run_dir, s) for s in ckpt.step_numbers(run_dir / "checkpoints")}
    assert sorted(states) == list(range(1, 9))
    assert all(np.isfinite(leaf).all() for st in states.values() for leaf in jax.tree.leaves(st)
               if np.issubdtype(np.asarray(leaf).dtype, np.floating))
    assert tree_hash(states[5]["params"]) == tree_hash(states[4]["params"])
    assert tree_hash(states[5]["opt_state"]) == tree_hash(states[4]["opt_state"])
    assert tree_hash(states[6]["params"]) != tree_hash(states[5]["params"])

    # on_nonfinite=stop: the run ends at that step with one line; the checkpoints before it are committed.
    monkeypatch.undo()
    poison_steps(monkeypatch, {5})
    stop_dir = tmp_path / "stop"
    with pytest.raises(train.TrainingError, match=r"^step 5: the loss \(nan\) .* training.on_nonfinite=stop") as e:
        train.train(tiny_config(char_data, stop_dir, **settings, **{"training.on_nonfinite": "stop"}), log=quiet)
    assert "\n" not in str(e.value)
    assert ckpt.step_numbers(stop_dir / "checkpoints") == [1, 2, 3, 4]
    assert all(ckpt.verify(stop_dir / "checkpoints" / str(s)) is None for s in range(1, 5))


def test_consecutive_nonfinite_steps_stop_the_run():
    t = config_lib.TrainingConfig(max_consecutive_skips=2)
    seen = {"nonfinite_skips": 0, "spike_skips": 0}
    said = []
    nan = {"loss": float("nan"), "grad_norm": float("nan"), "loss_avg": 3.0, "spike_skips": 0}
    for step, total in ((7, 1), (8, 2)):
        assert train._report_skips(step, dict(nan, nonfinite_skips=total, skips_in_a_row=total), seen, t,
                                   said.append) is None
    failure = train._report_skips(9, dict(nan, nonfinite_skips=3, skips_in_a_row=3), seen, t, said.append)
    assert failure.startswith("step 9:") and "3 steps in a row" in failure and "max_consecutive_skips=2" in failure
    assert len(said) == 2 and "(2 in a row)" in said[1]
    # A finite step in between starts the count again.
    assert train._report_skips(10, dict(nan, loss=2.0, grad_norm=1.0, nonfinite_skips=3, skips_in_a_row=0), seen, t,
                               said.append) is None


def test_a_state_with_nan_is_never_saved(tmp_path):
    ck = ckpt.Checkpointer(tmp_path, CheckpointConfig(), log=quiet)
    good = {"w": jnp.ones(4), "step": jnp.int32(1)}
    ck.save(1, good, {"pos": 1})
    with pytest.raises(ckpt.CheckpointError, match="refusing to save step 2: the train state holds NaN"):
        ck.save(2, {"w": jnp.array([1.0, jnp.nan, 0, 0]), "step": jnp.int32(2)}, {"pos": 2})
    ck.close()
    assert ckpt.step_numbers(tmp_path / "checkpoints") == [1] and ckpt.verify(tmp_path / "checkpoints" / "1") is None


# ---- restore on another mesh ------------------------------------------------------------------------------------

def test_restore_on_other_meshes_is_bit_equal_and_the_loader_continues(char_data, tmp_path):
    base = {"model.vocab_size": 128}
    meshes = {"fsdp8": ({"mesh.ici_data": 1, "mesh.ici_fsdp": 8}, 8),
              "fsdp4_tensor2": ({"mesh.ici_data": 1, "mesh.ici_fsdp": 4, "mesh.ici_tensor": 2}, 8),
              "fsdp4_on_4": ({"mesh.ici_data": 1, "mesh.ici_fsdp": 4}, 4),
              "one_device": ({}, 1)}
    runs = {name: run_lib.setup(tiny_config(char_data, tmp_path, **base, **mesh), jax.devices()[:n])
            for name, (mesh, n) in meshes.items()}
    saved = runs["fsdp8"]
    # Random values in every leaf (init would leave the Adam moments all zero), placed on the fsdp8 shardings.
    leaves, treedef = jax.tree.flatten(saved.abstract_state)
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(a.shape).astype(a.dtype) if np.issubdtype(a.dtype, np.floating)
              else np.asarray(rng.integers(0, 1000), a.dtype) for a in leaves]
    state = jax.tree.unflatten(treedef, [jax.device_put(v, a.sharding) for v, a in zip(values, leaves)])
    assert any(len(a.sharding.device_set) == 8 and not a.sharding.is_fully_replicated for a in leaves)
    loader = loader_lib.Loader(saved.dataset.splits["train"], 32, saved.cfg.training.batch_size, 1, seed=5)
    for _ in range(3):
        loader.next_starts()
    ck = ckpt.Checkpointer(tmp_path / "run", saved.cfg.checkpoint, log=quiet)
    ck.save(7, state, loader.state())
    ck.close()
    expected_starts = [loader.next_starts() for _ in range(3)]

    for name, run in runs.items():
        ck = ckpt.Checkpointer(tmp_path / "run", run.cfg.checkpoint, log=quiet)
        assert ck.latest == 7
        restored, loader_state = ck.restore(7, run.abstract_state)
        ck.close()
        got = jax.tree.leaves(restored)
        for r, a, v in zip(got, jax.tree.leaves(run.abstract_state), values):
            assert r.sharding == a.sharding, name
            assert np.asarray(r).tobytes() == v.tobytes(), name
        resumed = loader_lib.Loader(run.dataset.splits["train"], 32, run.cfg.training.batch_size, 1, seed=0)
        resumed.restore(loader_state)
        assert all((resumed.next_starts() == s).all() for s in expected_starts), name

    # A global batch that follows the device count cannot continue the same data order: say why.
    per_device = run_lib.setup(tiny_config(char_data, tmp_path, **base, **{"training.per_device_batch_size": 1}),
                               jax.devices()[:4])
    other = loader_lib.Loader(per_device.dataset.splits["train"], 32, per_device.cfg.training.batch_size, 1, seed=0)
    with pytest.raises(loader_lib.DataError, match=r"training.batch_size \(global\) 8 there, 4 here"):
        other.restore(loader_state)


# ---- failing saves ----------------------------------------------------------------------------------------------

def test_a_save_that_fails_in_the_background_is_reported_and_loses_nothing(tmp_path):
    """A real write error (the file-size limit: EFBIG, which root cannot override either) while Orbax writes
    in the background."""
    x = np.random.default_rng(0).standard_normal(1 << 19).astype(np.float32)  # 2 MiB, incompressible
    state = {"x": jnp.asarray(x), "step": jnp.int32(0)}
    ck = ckpt.Checkpointer(tmp_path, CheckpointConfig(keep=1, on_error="stop"), log=quiet)
    ck.save(1, state, {"pos": 1})
    ck.wait()
    with file_size_limit(1 << 18):
        ck.save(2, state, {"pos": 2})
        ck.wait()
    with pytest.raises(ckpt.CheckpointError, match=r"step 2 .* failed .*File too large.*on_error=stop") as e:
        ck.check()
    assert "\n" not in str(e.value)
    ckpt_dir = tmp_path / "checkpoints"
    assert ckpt.step_numbers(ckpt_dir) == [1] and ckpt.verify(ckpt_dir / "1") is None and not tmp_dirs(tmp_path)
    ck.save(3, state, {"pos": 3})  # the next save works and only then replaces step 1
    ck.wait()
    assert ckpt.step_numbers(ckpt_dir) == [3] and ckpt.verify(ckpt_dir / "3") is None
    # The last save of a run failing is an error whatever checkpoint.on_error says.
    with file_size_limit(1 << 18):
        ck.save(4, state, {"pos": 4})
        ck.wait()
    with pytest.raises(ckpt.CheckpointError, match="step 4 .* the run's last state is not saved"):
        ck.close()
    assert ckpt.step_numbers(ckpt_dir) == [3] and ckpt.verify(ckpt_dir / "3") is None


def test_failed_save_with_on_error_continue_warns_and_training_goes_on(reference, char_data, tmp_path, monkeypatch):
    cfg, _, ref = reference
    real = ocp.CheckpointManager.save

    def save(self, step, *args, **kwargs):
        if step == 20:
            raise OSError(errno.EROFS, "Read-only file system")
        return real(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", save)
    lines = []
    run_dir = tmp_path / "run"
    train.train(tiny_config(char_data, run_dir, **{**RUN, "checkpoint.keep": 1, "checkpoint.on_error": "continue"}),
                log=lines.append)
    warning = next(line for line in lines if "warning: saving the checkpoint of step 20" in line)
    assert "Read-only file system" in warning and "checkpoint.on_error=continue" in warning
    assert ckpt.step_numbers(run_dir / "checkpoints") == [40] and ckpt.verify(run_dir / "checkpoints" / "40") is None
    got = train.losses_by_step(run_dir)
    assert [got[s] for s in range(1, 41)] == [ref[s] for s in range(1, 41)]

    # With checkpoint.on_error=stop (the default) the same failure ends the run, naming the step.
    with pytest.raises(ckpt.CheckpointError, match=r"step 20 .*Read-only file system.*on_error=stop"):
        train.train(tiny_config(char_data, tmp_path / "stop", **RUN), log=quiet)
    assert ckpt.step_numbers(tmp_path / "stop" / "checkpoints") == [10]
