"""TPU tier: post-training on the chip, in the tier's own process (`make test-tpu`; docs/tpu.md). LoRA and QLoRA
(nf4 base) steps against the same steps in float32 on the CPU beside the chip, with only the adapters moving; DPO on
pairs this module makes; GRPO updates whose rollouts come from the serving engine (its paged cache read by JAX's
Pallas paged-attention kernel), the engine's log-probabilities against the training forward's; int8 training
against float training. The chip's float32 matmuls take their operands in bfloat16 passes (JAX's default precision
there), so figures are compared within tolerances that say what they allow for; each test prints what it measured."""

import math

import jax
import numpy as np
import pytest

from conftest import tiny_config, train_losses
from jaxlm import config as config_lib
from jaxlm.model import quant
from jaxlm.train import (batches as batch_lib, grpo as rl, loop as train, run as run_lib, state as state_lib,
                         step as step_lib)
from jaxlm.data import loader as loader_lib
from jaxlm.model import paged, ragged_paged
from test_lora import lora_run, make_base, random_batch
from test_paged import page_kernel  # noqa: F401 - a fixture: JAX's Pallas paged-attention kernel, counting its traces
from test_preference import prepare_pairs, random_records, small_config
from test_rl import digit_run, grpo_args

pytestmark = pytest.mark.tpu


def cpu():
    """The CPU beside the chip: reference figures in float32 at full precision."""
    return jax.devices("cpu")[0]


def finite(values) -> bool:
    return bool(np.all(np.isfinite(np.asarray(values, np.float64))))


# ---- LoRA and QLoRA -------------------------------------------------------------------------------------------

LORA_STEPS = 20
# The chip's losses against the CPU's float32 ones over the 20 steps: the chip's matmuls round their operands to
# bfloat16 (2^-9 relative). Coarser rounding, model.compute_dtype=bfloat16 on the CPU (activations rounded too), moved
# these losses by at most 0.0016 (float base) and 0.0023 (nf4) from float32's; the bound is four times that.
LORA_TRACKS_CPU = 0.01


def lora_steps(cfg, device):
    """LORA_STEPS train steps of the adapters on one batch on `device`: the losses, the adapters before and after
    (host copies), the frozen base before (a host copy) and the frozen base itself after the steps."""
    with jax.default_device(device):
        run = run_lib.setup(cfg, [device])
        frozen = state_lib.load_frozen(run)
        base_before = jax.tree.map(np.array, frozen)
        state = state_lib.init_state(run, 0)
        adapters_before = jax.tree.map(np.array, state["params"])
        step = step_lib.make_train_step(run.cfg, run.optimizer, run.mesh, run.abstract_state, run.act_rules)
        batch = random_batch(np.random.default_rng(0))
        losses = []
        for _ in range(LORA_STEPS):
            state, m = step(state, batch, frozen)
            losses.append(m["loss"])
        losses = np.asarray(jax.device_get(losses), np.float64)
        return losses, adapters_before, jax.tree.map(np.array, state["params"]), base_before, frozen


@pytest.mark.parametrize("base", ["float", "nf4"])
def test_lora_and_qlora_steps_train_the_adapters_only_and_track_the_cpu(base, tpu, char_data, tmp_path):
    """20 steps of rank-4 adapters (every attention and MLP weight) on one batch, over a float32 base or the same
    base quantized to nf4 (QLoRA): on the chip the loss falls, every adapter moves, the base stays bit for bit and
    (nf4) stays quantized; the losses follow the same steps in float32 on the CPU."""
    make_base(tmp_path / "base", d_model=64, n_heads=4)
    settings = {"model.d_model": 64, "optimizer.lr": 1e-2}
    if base == "nf4":
        settings["lora.base_quantization"] = "nf4"
    cfg = lora_run(char_data, tmp_path, tmp_path / "base", **settings)
    losses, before, after, base_before, frozen = lora_steps(cfg, tpu)
    reference = lora_steps(cfg, cpu())[0]
    print(f"{base} base: chip losses {losses[0]:.4f} -> {losses[-1]:.4f}, cpu {reference[0]:.4f} -> "
          f"{reference[-1]:.4f}; largest difference {np.abs(losses - reference).max():.2g}")
    assert finite(losses) and losses[-1] < 0.9 * losses[0], losses
    np.testing.assert_allclose(losses, reference, rtol=0, atol=LORA_TRACKS_CPU)
    if base == "nf4":
        assert isinstance(frozen["layers"]["attn"]["q"], quant.NF4Weight)
        assert isinstance(frozen["layers"]["mlp"]["down"], quant.NF4Weight)
    for was, now in zip(jax.tree.leaves(base_before), jax.tree.leaves(frozen)):
        assert np.array_equal(was, np.asarray(now))
    assert {(blk, name) for blk in after["layers"] for name in after["layers"][blk]} == {
        ("attn", "q"), ("attn", "k"), ("attn", "v"), ("attn", "o"), ("mlp", "up"), ("mlp", "down")}
    moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), before, after)
    assert all(jax.tree.leaves(moved)), moved  # A and B of each (B starts at zero)


# ---- int8 training --------------------------------------------------------------------------------------------

def test_int8_training_tracks_float_training(tpu, char_data, tmp_path):
    """30 steps with model.quantization=int8 (int8 matmuls forward and backward, stochastic rounding of the
    gradients) on the chip, and the same steps on the same rows in float: the float run learns, the int8 run
    ends within 0.05 of it (as on the CPU: tests/test_quant.py) and is not the float run."""
    def batch_of(rng, run):
        return batch_lib.device_batch(run, "train", loader_lib.Windows(rng.integers(0, 100_000, size=(1, 8))))

    losses = {}
    for mode in ("none", "int8"):
        cfg = tiny_config(char_data, tmp_path / mode, **{"model.quantization": mode, "optimizer.lr": 1e-2,
                                                         "training.steps": 30, "checkpoint.enabled": False})
        losses[mode] = np.asarray(train_losses(cfg, [tpu], batch_of, steps=30)[0], np.float64)
    print(f"float {losses['none'][0]:.4f} -> {losses['none'][-1]:.4f}, int8 {losses['int8'][0]:.4f} -> "
          f"{losses['int8'][-1]:.4f}")
    assert finite(losses["none"]) and finite(losses["int8"])
    assert losses["none"][-1] < losses["none"][0] - 0.5
    assert abs(losses["int8"][-1] - losses["none"][-1]) < 0.05
    assert not np.array_equal(losses["int8"], losses["none"])


# ---- DPO ------------------------------------------------------------------------------------------------------

def test_dpo_steps_raise_the_reward_margin(tpu, tmp_path):
    """`training.objective=dpo` on byte-level pairs (random replies; the rejected ones end in "!") through
    train.train on the chip, from a fresh model that is its own reference: the first loss is ln 2 (the policy is
    the reference, computed by another program on the chip: equal to its rounding), and over 12 steps the loss
    falls while the reward margin and the share of pairs ranked right grow."""
    data = prepare_pairs(tmp_path, random_records(60, seed=1), val_fraction=0.1)
    cfg = small_config(data, tmp_path / "dpo", **{"training.steps": 12, "optimizer.decay_steps": 12,
                                                   "training.eval_interval": 0, "checkpoint.enabled": False})
    train.train(cfg, [tpu], log=lambda s: None)
    records = [r for r in train.read_metrics(tmp_path / "dpo") if "rewards/margins" in r]
    assert [r["step"] for r in records] == list(range(1, 13))
    loss, margin, accuracy = ([r[k] for r in records] for k in ("loss", "rewards/margins", "rewards/accuracies"))
    print(f"loss {loss[0]:.5f} -> {loss[-1]:.5f}, margin {margin[0]:.4f} -> {margin[-1]:.4f}, accuracy "
          f"{accuracy[0]:.2f} -> {np.mean(accuracy[-3:]):.2f} (last 3)")
    assert finite(loss) and finite(margin)
    # the policy's and the reference's log-probabilities of the same weights by two programs: the same operands
    # rounded alike, summed in other orders (float32 ulps); 2e-4 allows 4e-3 nats a pair (beta / 2 = 0.05)
    assert abs(loss[0] - math.log(2)) < 2e-4, loss[0]
    assert np.mean(loss[-3:]) < loss[0] - 0.02
    # on the CPU: the last three steps' loss 0.645, margin 0.100, accuracy 0.90 (the first two steps' learning
    # rate is 0: warmup)
    assert np.mean(margin[-3:]) > margin[0] + 0.05 and np.mean(accuracy[-3:]) > 0.7


# ---- GRPO with rollouts from the serving engine --------------------------------------------------------------

# The engine's log-probabilities against the training forward's, both on the chip: two programs over the same
# weights whose float32 matmuls round their operands to bfloat16 in other shapes and orders (the engine: a prompt
# chunk, then decode steps; the trainer: whole rows), so they may differ by four times the trainer's distance from
# exact float32 (the same forward on the CPU at full precision). And the decode steps' paged kernel, JAX's Pallas
# paged_attention, takes keys and values in bfloat16 whatever the pool's dtype (its
# MultiPageAsyncCopyDescriptor.wait_and_get_loaded casts them): that alone moved these log-probabilities by up to
# 9e-4 in interpret mode on the CPU, where everything else is float32; the floor allows 3e-3. (A page read from the
# wrong place or a key missed moves them by tenths.)
ENGINE_VS_FORWARD_FACTOR, ENGINE_VS_FORWARD_FLOOR = 4.0, 3e-3


def test_grpo_updates_with_rollouts_from_the_engine_through_the_paged_kernel(tpu, page_kernel, tmp_path,
                                                                             monkeypatch):
    """A model taught the digit task for 100 steps (tests/test_rl.py), then two GRPO updates of 32 rollouts (4
    prompts x 8) on the chip. The rollouts are sampled by the serving engine over the trainer's weights, its paged
    pool in the chip's format (128 lanes, decode steps through JAX's Pallas paged-attention kernel; in a dry run the
    kernel in TPU interpret mode). Each batch's sampled tokens have, under the engine, the log-probabilities the
    training forward gives them (within the chip's rounding); rewards, advantages, loss and gradient are finite, each
    update moves the weights, and at least one is a policy gradient (a group whose rewards differ)."""
    folder = digit_run(tmp_path / "digits", 100)
    fmt = paged.pool_format(tpu.platform)
    if tpu.platform == "tpu":
        assert fmt.lane == 128 and isinstance(fmt.kernel, ragged_paged.Kernel), fmt  # the default: ours
    monkeypatch.setattr(paged, "pool_format", lambda platform, *_: paged.PoolFormat(128, page_kernel))
    R = 32
    cfg = config_lib.load("quickstart", grpo_args(folder, tmp_path / "rl", f"training.batch_size={R}",
                                                  "grpo.group_size=8", "training.steps=2"))
    run = run_lib.setup(cfg, [tpu])
    state = state_lib.init_state_from(run, cfg.checkpoint.init_from)
    source = rl.RolloutBatches(run)
    step = step_lib.make_train_step(run.cfg, run.optimizer, run.mesh, run.abstract_state, run.act_rules)
    logprobs = rl.token_logprobs_fn(run.cfg, run.mesh, run.act_rules, 1.0)
    on_cpu = run_lib.setup(cfg, [cpu()])
    exact_logprobs = rl.token_logprobs_fn(on_cpu.cfg, on_cpu.mesh, on_cpu.act_rules, 1.0)
    gradient_norms = []
    for update in range(2):
        batch = source.next(state)
        weights = np.asarray(batch["weights"]).reshape(R, -1).astype(bool)
        engine = np.array([lp for _, _, c, _, _ in source.last_rollout for lp in c.logprobs])
        ours = np.asarray(logprobs(state["params"], batch)).reshape(R, -1)[weights]
        with jax.default_matmul_precision("highest"):
            args = jax.device_put(jax.tree.map(np.asarray, (state["params"], batch)), cpu())
            exact = np.asarray(exact_logprobs(*args)).reshape(R, -1)[weights]
        rewards = np.array([r for _, _, _, r, _ in source.last_rollout])
        advantages = np.array([a for _, _, _, _, a in source.last_rollout])
        before = jax.tree.map(np.array, state["params"])
        state, m = step(state, batch)
        diff, chip_error = float(np.abs(engine - ours).max()), float(np.abs(ours - exact).max())
        print(f"update {update + 1}: {len(engine)} sampled tokens, engine vs forward max |d logprob| {diff:.3g}, "
              f"forward vs exact float32 {chip_error:.3g}; reward {rewards.mean():.3f}, loss {float(m['loss']):.4g}, "
              f"grad_norm {float(m['grad_norm']):.4g}, kernel traces {len(page_kernel.calls)}")
        assert len(engine) == len(ours) == weights.sum() > 0
        assert diff <= ENGINE_VS_FORWARD_FACTOR * chip_error + ENGINE_VS_FORWARD_FLOOR, (diff, chip_error)
        assert finite(rewards) and set(np.unique(rewards)) <= {0.0, 1.0} and finite(advantages)
        assert finite([m["loss"], m["grad_norm"]]) and int(m["nonfinite_skips"]) == 0
        assert any(not np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(before),
                                                                        jax.tree.leaves(state["params"])))
        gradient_norms.append(float(m["grad_norm"]) if np.abs(advantages).max() > 0 else None)
    assert any(gradient_norms) and all(g is None or g > 0 for g in gradient_norms), gradient_norms
    assert page_kernel.calls, "no decode step went through the paged-attention kernel"
    engine = source.engines["rollouts"]
    assert engine.kv.page_format.kernel is page_kernel and engine.kv.page_size > 0
