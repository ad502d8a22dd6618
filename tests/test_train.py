import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import tiny_config, xla_flags
from jaxlm.train import loop as train, run as run_lib, state as state_lib, step as step_lib


def test_loss_falls_on_a_fixed_batch(char_data, tmp_path):
    cfg = tiny_config(char_data, tmp_path / "run", **{"optimizer.lr": 1e-2, "optimizer.schedule": "constant",
                                                             "checkpoint.enabled": False})
    run = run_lib.setup(cfg, jax.devices()[:1])
    state = state_lib.init_state(run, 0)
    step = step_lib.make_train_step(run.cfg, run.optimizer, run.mesh, run.abstract_state, run.act_rules)
    x = np.random.default_rng(0).integers(0, 65, (1, 8, 32)).astype(np.int32)
    y = np.roll(x, -1, axis=-1)
    losses = []
    for _ in range(40):
        state, m = step(state, {"inputs": x, "targets": y})
        losses.append(float(m["loss"]))
    assert losses[0] == pytest.approx(np.log(65), rel=0.1)
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.slow
def test_one_and_eight_devices_give_equal_losses(char_data, tmp_path):
    runs = {}
    for name, devices, mesh in [("1", jax.devices()[:1], {}), ("dp8", jax.devices(), {"mesh.ici_data": 8}),
                                ("fsdp8", jax.devices(), {"mesh.ici_data": 1, "mesh.ici_fsdp": 8})]:
        cfg = tiny_config(char_data, tmp_path / name, **mesh, **{"checkpoint.enabled": False,
                                                                  "training.grad_accum": 2})
        train.train(cfg, devices=devices, log=lambda s: None)
        runs[name] = train.losses_by_step(tmp_path / name)
    ref = np.array([runs["1"][s] for s in sorted(runs["1"])])
    assert len(ref) == 20 and ref[-1] < ref[0]
    for name in ("dp8", "fsdp8"):
        got = np.array([runs[name][s] for s in sorted(runs[name])])
        np.testing.assert_allclose(got, ref, rtol=1e-5)


def test_resume_with_a_different_model_fails_clearly(char_data, tmp_path):
    train.train(tiny_config(char_data, tmp_path / "r", **{"training.steps": 2, "optimizer.warmup_steps": 1}), log=lambda s: None)
    with pytest.raises(train.ConfigError, match="different model"):
        train.train(tiny_config(char_data, tmp_path / "r", **{"model.n_layers": 3, "optimizer.warmup_steps": 1}), log=lambda s: None)


def test_batch_that_does_not_split_over_devices_fails_before_compiling(char_data, tmp_path):
    cfg = tiny_config(char_data, tmp_path / "r", **{"training.batch_size": 12, "mesh.ici_data": 8})
    with pytest.raises(train.ConfigError, match="training.batch_size=12 must be a multiple of the 8 devices that split"):
        run_lib.setup(cfg, jax.devices())
    cfg = tiny_config(char_data, tmp_path / "r", **{"mesh.ici_data": 3})
    with pytest.raises(train.ConfigError, match="multiply to 3 devices but 8 are available"):
        run_lib.setup(cfg, jax.devices())


def _cli(args, cwd, **kw):
    env = dict(os.environ, XLA_FLAGS=xla_flags(), PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "jaxlm.cli", "train", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


@pytest.mark.slow
@pytest.mark.default_settings  # the CLI end to end and a resumed run, compiled as users' runs are
def test_sigkill_after_checkpoint_then_rerun_resumes_exactly(char_data, tmp_path):
    args = ["shakespeare_char_cpu", f"data.dir={char_data}", "model.n_layers=2", "model.d_model=64",
            "training.steps=60", "checkpoint.interval=20", "training.eval_interval=30", "training.sample_tokens=0",
            "logging.progress=false", "training.log_interval=1"]
    ref = _cli(args + [f"run_dir={tmp_path / 'ref'}"], tmp_path)
    assert ref.wait(timeout=600) == 0, ref.stdout.read()
    run_dir = tmp_path / "killed"
    p = _cli(args + [f"run_dir={run_dir}"], tmp_path)
    deadline = time.time() + 300
    # A checkpoint counts once its manifest is written (after Orbax's asynchronous commit), so wait for that.
    while time.time() < deadline and not (run_dir / "checkpoints" / "20" / "jaxlm_manifest.json").exists():
        time.sleep(0.05)
    # Let training move past the committed checkpoint, then kill without warning.
    while time.time() < deadline and not any(json.loads(l)["step"] >= 25 for l in
                                             (run_dir / "metrics.jsonl").read_text().splitlines()):
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    again = _cli(args + [f"run_dir={run_dir}"], tmp_path)
    out = again.communicate(timeout=600)[0]
    assert again.returncode == 0, out
    assert "resumed from" in out
    a, b = train.losses_by_step(tmp_path / "ref"), train.losses_by_step(run_dir)
    assert sorted(b) == list(range(1, 61))
    assert [a[s] for s in range(1, 61)] == [b[s] for s in range(1, 61)]


@pytest.fixture(scope="module")
def grad_fns(char_data, tmp_path_factory):
    """(params, jitted loss_and_grads) of a 3-layer tiny model (remat minimal, as maxtext_base's fast lines) by
    (param_dtype, A micro-batches, B rows), made once each."""
    from jaxlm.train import objectives

    made = {}

    def get(dtype: str, A: int, B: int):
        if (dtype, A, B) not in made:
            cfg = tiny_config(char_data, tmp_path_factory.mktemp("grads"), **{
                "model.n_layers": 3, "model.remat": "minimal", "model.param_dtype": dtype, "training.grad_accum": A,
                "training.batch_size": B, "checkpoint.enabled": False})
            run = run_lib.setup(cfg, jax.devices()[:1])
            fn = jax.jit(lambda p, b: step_lib.loss_and_grads(objectives.get("next_token"), p, b, run.cfg,
                                                              jax.random.key(0)))
            made[dtype, A, B] = state_lib.init_state(run, 0)["params"], fn
        return made[dtype, A, B]

    return get


def _tokens(A, B, T=32):
    x = np.random.default_rng(0).integers(0, 65, (A, B, T + 1)).astype(np.int32)
    return {"inputs": x[..., :-1], "targets": x[..., 1:]}


def test_micro_batches_add_their_gradients_in_place(grad_fns):
    """The compiled micro-batch loop neither zeroes nor adds a whole stacked gradient: each layer's weight gradient
    goes into its slice of the accumulator as the backward pass makes it (a sum of value_and_grad's results
    zeroes a fresh gradient every micro-batch, then adds it to the accumulator)."""
    params, fn = grad_fns("float32", 4, 2)
    stacked = max(jax.tree.leaves(params["layers"]), key=lambda a: a.size)
    assert stacked.shape[0] == 3 and stacked.ndim == 3, stacked.shape
    hlo = fn.lower(params, _tokens(4, 2)).compile().as_text()
    whole = re.escape(f"f32[{','.join(map(str, stacked.shape))}]") + r"\{[^}]*\} (add|broadcast)\(.*"
    ops = [m.group(0) for m in re.finditer(whole, hlo)]
    assert ops and not [op for op in ops if "while/body" in op], ops


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-6), ("bfloat16", 1e-2)])
def test_accumulated_gradients_are_the_big_batch_gradients(grad_fns, dtype, tol):
    """4 micro-batches of 2 rows give the loss and gradients of one batch of 8 rows. With bfloat16 weights the
    gradients (and so their accumulator) are bfloat16: the sums agree within its rounding (2^-8 relative a
    term, a few terms a weight); float32 ones to float32's."""
    tokens = _tokens(4, 2)
    params, accumulated = grad_fns(dtype, 4, 2)
    _, big = grad_fns(dtype, 1, 8)
    (loss, _), g = accumulated(params, tokens)
    (ref_loss, _), ref = big(params, {k: v.reshape(1, 8, -1) for k, v in tokens.items()})
    flat = lambda t: np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in jax.tree.leaves(t)])  # noqa: E731
    g, ref = flat(g), flat(ref)
    rel = np.linalg.norm(g - ref) / np.linalg.norm(ref)
    print(f"{dtype}: loss {float(loss):.6f} vs {float(ref_loss):.6f}, gradient relative difference {rel:.3g}")
    assert float(loss) == pytest.approx(float(ref_loss), rel=tol) and rel <= tol
    assert {x.dtype for x in jax.tree.leaves(accumulated(params, tokens)[1])} == {np.dtype(dtype)}
