"""GRPO (training.objective=grpo): each loss type's loss and gradient against TRL's formulas written out
independently, the ratio exactly 1 with one update per batch, no reference pass without a KL term, a tiny model
learning a task from rewards (greedy evaluation before and after), exact resume, 8 devices and LoRA giving the
one-device figures, rollouts on the trainer's own buffers, and bad input failing in one line."""

import json
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import SHAKESPEARE  # noqa: F401 - the suite's corpus check runs for every module
from jaxlm import cli, config as config_lib
from jaxlm.train import grpo as rl, loop as train, objectives, run as run_lib, state as state_lib, step as step_lib
from jaxlm.data import prepare
from jaxlm.model import forward

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


# ---- the loss against TRL's formulas ---------------------------------------------------------------------------

def trl_loss(logits_BTV, batch, loss_type, beta, eps_low, eps_high, max_completion, temperature, num_items):
    """GRPOTrainer._compute_loss's arithmetic, transcribed: per-token log-probabilities of the completion, the
    clipped surrogate, the k3 KL, and the normalization of each loss type (num_items: the completion tokens of
    the whole step, for dapo)."""
    logps = jax.nn.log_softmax(logits_BTV / temperature, axis=-1)
    per_token_logps = jnp.take_along_axis(logps, batch["targets"][..., None], axis=-1)[..., 0]
    mask = batch["weights"]
    old = batch.get("old_logps", jax.lax.stop_gradient(per_token_logps))
    coef_1 = jnp.exp(per_token_logps - old)
    coef_2 = jnp.clip(coef_1, 1 - eps_low, 1 + eps_high)
    advantages = batch["advantages"][:, :1]  # one per sequence, as TRL holds them
    per_token_loss = -jnp.minimum(coef_1 * advantages, coef_2 * advantages)
    if beta:
        ref = batch["ref_logps"]
        per_token_kl = jnp.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / jnp.clip(mask.sum(-1), 1.0)).mean()
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / jnp.clip(mask.sum(), 1.0)
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.shape[0] * max_completion)
    return (per_token_loss * mask).sum() / num_items


def fixed_batch(rng, A, B, T, V, with_old, with_ref):
    """Rows of a prompt then a completion of varying length (one row with none), advantages per row, and old and
    reference log-probabilities a little off the current ones."""
    tokens = rng.integers(0, V, (A, B, T + 1)).astype(np.int32)
    weights = np.zeros((A, B, T), np.float32)
    for a in range(A):
        for b in range(B):
            start = int(rng.integers(2, 6))
            end = start if (a, b) == (0, 1) else int(rng.integers(start + 1, T))
            weights[a, b, start:end] = 1.0
    batch = {"inputs": tokens[..., :-1], "targets": tokens[..., 1:], "weights": weights,
             "advantages": np.repeat(rng.normal(size=(A, B, 1)).astype(np.float32), T, axis=-1)}
    if with_old:
        batch["old_logps"] = (rng.normal(size=(A, B, T)) * 0.3 - 4.0).astype(np.float32)
    if with_ref:
        batch["ref_logps"] = (rng.normal(size=(A, B, T)) * 0.3 - 4.0).astype(np.float32)
    return batch


def tiny(**overrides):
    settings = {"model.vocab_size": 40, "model.block_size": 16, "model.n_layers": 2, "model.d_model": 32,
                "model.n_heads": 4, "training.objective": "grpo", "data.prompts": "unused.jsonl",
                "grpo.reward": "jaxlm.rewards:exact_answer", "training.batch_size": 4, "grpo.group_size": 2,
                "grpo.max_completion_tokens": 8, "optimizer.warmup_steps": 1, "model.loss_chunk_tokens": 8,
                **overrides}
    return config_lib.apply_overrides(config_lib.Config(), settings)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_each_loss_and_gradient_equal_trl_formulas(loss_type):
    cfg = tiny(**{"grpo.loss_type": loss_type, "grpo.beta": 0.04, "grpo.iterations": 2, "grpo.epsilon": 0.2,
                  "grpo.epsilon_high": 0.28, "grpo.temperature": 0.7, "training.grad_accum": 2})
    config_lib.validate(cfg)
    run = run_lib.setup(cfg, jax.devices()[:1], data=False)
    params = state_lib.init_state(run, 0)["params"]
    rng = np.random.default_rng(0)
    A, B, T = 2, 4, 16
    batch = fixed_batch(rng, A, B, T, 40, with_old=True, with_ref=True)
    # ours: the train step's accumulation over A micro-batches, the objective's chunked log-probabilities
    (loss, metrics), grads = step_lib.loss_and_grads(objectives.get("grpo"), params, batch, run.cfg,
                                                             jax.random.key(0))

    num_items = float(batch["weights"].sum())

    def reference(p):  # TRL: each micro-batch's loss (dapo over the step's tokens), averaged over micro-batches
        total = 0.0
        for a in range(A):
            micro = {k: v[a] for k, v in batch.items()}
            logits = forward(p, micro["inputs"], run.cfg.model)
            total = total + trl_loss(logits, micro, loss_type, 0.04, 0.2, 0.28, 8, 0.7, num_items / A)
        return total / A

    want, want_grads = jax.value_and_grad(reference)(params)
    grad_diff = max(float(np.abs(np.asarray(g) - np.asarray(w)).max())
                    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)))
    scale = max(float(np.abs(np.asarray(w)).max()) for w in jax.tree.leaves(want_grads))
    print(f"{loss_type}: loss {float(loss):.7f} trl {float(want):.7f}; gradient max abs diff {grad_diff:.2g} "
          f"(largest entry {scale:.2g})")
    assert abs(float(loss) - float(want)) <= 1e-5 and grad_diff <= 1e-5
    assert float(metrics["clip_ratio"]) > 0 and float(metrics["kl"]) > 0


def test_one_update_per_batch_has_ratio_one_and_no_clip():
    cfg = tiny(**{"grpo.epsilon": 1e-6})  # any ratio off 1 would be clipped
    run = run_lib.setup(cfg, jax.devices()[:1], data=False)
    params = state_lib.init_state(run, 0)["params"]
    batch = {k: v[0] for k, v in fixed_batch(np.random.default_rng(1), 1, 4, 16, 40, False, False).items()}
    loss, metrics = objectives.grpo(params, batch, run.cfg, None)
    assert float(metrics["clip_ratio"]) == 0.0
    # ratio 1: the loss is -mean(advantage) over the completion tokens, and the gradient the policy gradient's
    w, adv = batch["weights"], batch["advantages"]
    assert float(loss) == pytest.approx(float(-(adv * w).sum() / w.sum()), rel=1e-6)
    g = jax.grad(lambda p: objectives.grpo(p, batch, run.cfg, None)[0])(params)
    assert float(optax_norm(g)) > 0
    assert run_lib.batch_keys(run.cfg) == ("inputs", "targets", "weights", "advantages")  # no old, no reference


def optax_norm(tree):
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


def test_a_grpo_step_compiles_ahead_of_time_for_8_devices():
    from jaxlm.train import aot

    cfg = tiny(**{"compile.topology": "cpu-8", "mesh.ici_data": 2, "mesh.ici_fsdp": 4, "training.batch_size": 8,
                  "grpo.group_size": 4, "grpo.iterations": 2, "grpo.beta": 0.1, "training.steps": 2,
                  "checkpoint.interval": 2})
    config_lib.validate(cfg)
    r = aot.compile_for(cfg, aot.target(cfg.compile))
    assert r.fits and set(step_lib.abstract_batch(r.run)) == {"inputs", "targets", "weights", "advantages",
                                                               "old_logps", "ref_logps"}


# ---- a task a CPU learns in a minute ---------------------------------------------------------------------------

def digit_corpus(folder):
    """Lines `NN=D`: the answer D is the number's last digit 30% of the time, 0 40% and any digit otherwise, so a
    model trained on them answers 0 greedily and the last digit about a third of the time."""
    rng = random.Random(0)

    def answer(n):
        u = rng.random()
        return n % 10 if u < 0.3 else 0 if u < 0.7 else rng.randrange(10)

    lines = [f"{n:02d}={answer(n)}\n" for n in range(100) for _ in range(40)]
    rng.shuffle(lines)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corpus.txt").write_text("".join(lines))
    prepare.prepare_text([folder / "corpus.txt"], folder / "data", vocab="char")
    held = [n for n in range(100) if (n // 10 + n) % 5 == 0]  # 20 numbers, two of each last digit
    for name, numbers in (("prompts", [n for n in range(100) if n not in held]), ("eval", held)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": f"{n:02d}=", "answer": str(n % 10)}) + "\n"
                                                      for n in numbers))
    return folder


# The rates below were tuned with AdamW, the quickstart's optimizer when these tests were written.
COMMON = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.block_size=32", "logging.progress=false",
          "logging.tensorboard=false", "training.sample_tokens=0", "optimizer.name=adamw"]


def digit_run(folder, steps):
    """The digit corpus in `folder` and a model trained on it for `steps` next-token steps (folder/sft)."""
    digit_corpus(folder)
    cfg = config_lib.load("quickstart", COMMON + [f"data.dir={folder / 'data'}", f"run_dir={folder / 'sft'}",
                                                  f"training.steps={steps}", "training.batch_size=16",
                                                  "optimizer.lr=3e-3", f"optimizer.warmup_steps={min(20, steps)}",
                                                  f"training.eval_interval={steps}"])
    train.train(cfg, jax.devices()[:1], log=lambda s: None)
    return folder


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """The digit corpus and a model trained on it for 30 steps: a start for the tests of resume, devices, buffers
    and bad input, which compare runs with each other and need no skill."""
    return digit_run(tmp_path_factory.mktemp("digits"), 30)


@pytest.fixture(scope="module")
def digits_learned(tmp_path_factory):
    """The digit corpus and a model trained on it for 1,000 steps: it answers 0 greedily and the last digit about
    a third of the time, the start from which GRPO learns the task."""
    return digit_run(tmp_path_factory.mktemp("digits_learned"), 1000)


def grpo_args(folder, run_dir, *extra):
    return COMMON + [f"data.dir={folder / 'data'}", f"run_dir={run_dir}", f"checkpoint.init_from={folder / 'sft'}",
                     "model.vocab_size=12", "training.objective=grpo", f"data.prompts={folder / 'prompts.jsonl'}",
                     f"data.eval_prompts={folder / 'eval.jsonl'}", "grpo.reward=jaxlm.rewards:exact_answer",
                     "grpo.group_size=8", "grpo.max_completion_tokens=2", "training.batch_size=64",
                     "optimizer.lr=3e-3", "optimizer.warmup_steps=0", "optimizer.schedule=constant",
                     "training.log_interval=5", *extra]


def greedy_reward(cfg, params, folder) -> float:
    """Mean exact-answer reward of greedy answers to the held-out prompts."""
    run = run_lib.setup(cfg, jax.devices()[:1])
    source = rl.RolloutBatches(run)
    return source.evaluate({"params": params})["eval_reward"]


@pytest.mark.slow
def test_a_tiny_model_learns_from_rewards(digits_learned, tmp_path):
    digits = digits_learned
    # 100 steps: at 60 the held-out reward was 0.80 and the last steps' sampled reward 0.62 on one 2-core machine
    # (the run is deterministic per machine, not across CPUs); at 100 it was 1.00 and 0.87
    cfg = config_lib.load("quickstart", grpo_args(digits, tmp_path / "rl", "training.steps=100",
                                                  "training.eval_interval=100", "checkpoint.interval=100"))
    base = jaxlm_load(digits / "sft")
    before = greedy_reward(cfg, base.params, digits)
    summary = train.train(cfg, jax.devices()[:1], log=lambda s: None)
    records = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in records if "reward" in r]
    after = next(r["eval_reward"] for r in reversed(records) if "eval_reward" in r)
    print(f"greedy held-out reward before {before:.3f}, after {after:.3f}; sampled reward first 5 steps "
          f"{np.mean(rewards[:5]):.3f}, last 5 {np.mean(rewards[-5:]):.3f}; {summary['wall_seconds']:.0f} s")
    assert 0.05 <= before <= 0.3 and np.mean(rewards[:5]) < 0.45
    assert after >= 0.8 and np.mean(rewards[-5:]) >= 0.7
    samples = [json.loads(line) for line in (tmp_path / "rl" / "completions.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == set(range(0, 100, 10)) and len(samples) == 10 * 64


def jaxlm_load(path):
    import jaxlm

    return jaxlm.load(path)


# ---- resume, devices, LoRA, buffers ------------------------------------------------------------------------------

def record_of(run_dir):
    """Each step's (loss, grad_norm, and the reward of its batch of rollouts, None on the steps that reuse one)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            out[r["step"]] = (r["loss"], r["grad_norm"], r.get("reward"))
    return out


def test_resume_is_exact_with_several_updates_per_batch(digits, tmp_path):
    extra = ["training.batch_size=16", "grpo.group_size=4", "grpo.iterations=2", "checkpoint.interval=2",
             "training.eval_interval=0", "grpo.beta=0.05"]
    whole = config_lib.load("quickstart", grpo_args(digits, tmp_path / "whole", "training.steps=6", *extra))
    train.train(whole, jax.devices()[:1], log=lambda s: None)
    part = config_lib.load("quickstart", grpo_args(digits, tmp_path / "part", "training.steps=2", *extra))
    train.train(part, jax.devices()[:1], log=lambda s: None)
    train.train(config_lib.apply_overrides(part, {"training.steps": 6}), jax.devices()[:1], log=lambda s: None)
    a, b = record_of(tmp_path / "whole"), record_of(tmp_path / "part")
    assert sorted(a) == list(range(1, 7)) and a == b
    assert [s for s in a if a[s][2] is not None] == [1, 3, 5]  # a batch of rollouts per two updates


@pytest.mark.slow
def test_eight_devices_accumulation_and_lora_give_one_device_figures(digits, tmp_path):
    extra = ["training.steps=2", "training.batch_size=16", "grpo.group_size=4", "checkpoint.enabled=false",
             "training.eval_interval=0"]
    figures = {}
    for name, devices, more in [("one", jax.devices()[:1], []),
                                ("fsdp", jax.devices(), ["mesh.ici_data=2", "mesh.ici_fsdp=4"]),
                                ("accum", jax.devices()[:1], ["training.batch_size=8", "training.grad_accum=2"])]:
        cfg = config_lib.load("quickstart", grpo_args(digits, tmp_path / name, *extra, *more))
        train.train(cfg, devices, log=lambda s: None)
        figures[name] = record_of(tmp_path / name)
    for other in ("fsdp", "accum"):
        for s in range(1, 3):  # loss and reward within 1e-5; the gradient norm sums in another order
            (loss, norm, reward), (loss1, norm1, reward1) = figures[other][s], figures["one"][s]
            assert abs(loss - loss1) <= 1e-5 and abs(reward - reward1) <= 1e-5
            assert norm == pytest.approx(norm1, rel=1e-4)

    # LoRA: adapters only, the base with adapters off as the reference (no reference pass, no ref_logps)
    cfg = config_lib.load("quickstart", grpo_args(digits, tmp_path / "lora", *extra, "lora.rank=4", "grpo.beta=0.1"))
    assert "ref_logps" not in run_lib.batch_keys(cfg)
    train.train(cfg, jax.devices()[:1], log=lambda s: None)
    lora_records = [json.loads(line) for line in (tmp_path / "lora" / "metrics.jsonl").read_text().splitlines()]
    assert all("kl" in r for r in lora_records if "reward" in r)


def test_rollouts_run_on_the_trainers_buffers_and_engine_logprobs_match_the_forward(digits, tmp_path, monkeypatch):
    cfg = config_lib.load("quickstart", grpo_args(digits, tmp_path / "r", "training.batch_size=16",
                                                  "grpo.group_size=4"))
    run = run_lib.setup(cfg, jax.devices()[:1])
    state = state_lib.init_state_from(run, cfg.checkpoint.init_from)
    source = rl.RolloutBatches(run)
    from jaxlm.serve import engine as engine_lib

    seen = {}
    real = engine_lib.Engine.__init__

    def spy(self, params, *a, **kw):
        seen["params"] = params
        real(self, params, *a, **kw)

    monkeypatch.setattr(engine_lib.Engine, "__init__", spy)
    live_before = sum(x.nbytes for x in jax.live_arrays())
    batch = source.next(state)
    assert all(a is b for a, b in zip(jax.tree.leaves(seen["params"]), jax.tree.leaves(state["params"])))
    assert source.reference is None  # beta = 0: no reference weights were loaded
    # the engine's log-probabilities of the sampled tokens, against the trainer's forward pass (temperature 1)
    logps = np.asarray(rl.token_logprobs_fn(run.cfg, run.mesh, run.act_rules, 1.0)(state["params"], batch))
    w = np.asarray(batch["weights"]).reshape(16, -1).astype(bool)
    ours = logps.reshape(16, -1)[w]
    engine = np.array([lp for _, _, c, _, _ in source_rows(source) for lp in c.logprobs])
    diff = float(np.abs(ours - engine).max())
    print(f"engine_vs_forward_max_abs_logprob_diff={diff:.3g} over {len(engine)} tokens; live bytes before "
          f"{live_before}, after {sum(x.nbytes for x in jax.live_arrays())}")
    assert len(engine) == len(ours) and diff <= 1e-4


def source_rows(source):
    return source.last_rollout


def test_the_rollout_engine_takes_the_servers_cache_settings():
    """rl.rollout_engine's KV cache follows serve.page_size, serve.cache_gib and decode.quantize_kv_cache as `jaxlm
    serve`'s does (with the batch's rows as its slots); by default every row holds the whole context, and the
    rollouts are those of the engine rl made before it read the settings (a full-context float pool, no prefix
    sharing), token for token and log-probability for log-probability."""
    from jaxlm.config import ServeConfig
    from jaxlm.model import paged
    from jaxlm.serve import engine as engine_lib

    cfg = tiny()
    params = state_lib.init_state(run_lib.setup(cfg, jax.devices()[:1], data=False), 0)["params"]
    prompts, seeds, rows = [[1, 2, 3], [4, 5, 6, 7, 8]], [3, 4], 4

    def pool(e):  # pages, page size, bytes and dtypes of the pool a batch of rollouts takes
        e.reserve_cache()
        leaves = jax.tree.leaves(e.kv.cache)
        out = (e.pages_total(), e.kv.page_size, sum(x.nbytes for x in leaves), {str(x.dtype) for x in leaves})
        e.release_cache()
        return out

    def rollouts(e):
        got = rl.generate(e, params, cfg, prompts, seeds, 2, (5,), 1.0, 0, 1.0)
        return [(c.ids, c.logprobs, c.truncated) for c in got]

    e = rl.rollout_engine(params, cfg, rows)
    per_token = paged.bytes_per_token(cfg.model)
    assert pool(e) == (rows * 1, 16, rows * 16 * per_token, {"float32"})  # block_size 16: one page of 16 a row
    before = engine_lib.Engine(params, cfg.model, ServeConfig(max_slots=rows, max_queue=rows, prefix_cache=0,
                                                              decode_steps=cfg.serve.decode_steps,
                                                              prefill_chunk=cfg.serve.prefill_chunk),
                               cfg.model.block_size)
    before.release_cache()
    want, got = rollouts(before), rollouts(e)
    print(f"rollout lengths {[len(ids) for ids, _, _ in got]}")
    assert got == want and all(len(ids) == 8 or ids[-1] == 5 for ids, _, _ in got)

    # pages of 4 positions, int8 keys and values with scales, and 5 pages (each row needs 3 to 4): the rows wait
    # for each other's pages, and every rollout still ends
    per_token = paged.bytes_per_token(cfg.model, quantize=True)
    gib = 5.5 * 4 * per_token / 2**30
    small = tiny(**{"serve.page_size": 4, "serve.cache_gib": gib, "decode.quantize_kv_cache": True})
    e = rl.rollout_engine(params, small, rows)
    assert pool(e) == (5, 4, 5 * 4 * per_token, {"int8", "float32"}) and 5 * 4 * per_token <= gib * 2**30
    quantized = rollouts(e)
    first = max(abs(q[1][0] - w[1][0]) for q, w in zip(quantized, want))
    print(f"int8 pool of 5 pages: {e.preempted_total} preemptions, lengths {[len(ids) for ids, _, _ in quantized]}, "
          f"first tokens' log-probabilities within {first:.2g} of the float pool's")
    assert e.preempted_total > 0 and all(len(ids) == len(lps) for ids, lps, _ in quantized)
    assert all(len(ids) == 8 or ids[-1] == 5 for ids, _, _ in quantized)
    assert [q[0][0] for q in quantized] == [w[0][0] for w in want] and first <= 0.05

    slot = rl.rollout_engine(params, tiny(**{"serve.page_size": 0}), rows)
    assert slot.pages_total() == 0
    with pytest.raises(config_lib.ConfigError, match=r"serve.cache_gib=.* holds 3 pages of 4 positions"):
        rl.rollout_engine(params, tiny(**{"serve.page_size": 4, "serve.cache_gib": 3.5 * 4 * per_token / 2**30,
                                          "decode.quantize_kv_cache": True}), rows)


# ---- bad input ---------------------------------------------------------------------------------------------------

def test_bad_input_fails_in_one_line(digits, tmp_path, capsys):
    (tmp_path / "broken.jsonl").write_text('{"prompt": "12=", "answer": "2"}\n{"prompt": "13=", "answ\n')
    (tmp_path / "nan_reward.py").write_text("def nan(completions, **_):\n    return [float('nan')] * len(completions)\n")
    base = grpo_args(digits, tmp_path / "run", "training.steps=2", "training.batch_size=16", "grpo.group_size=4",
                     "training.eval_interval=0")
    cases = [([f"data.prompts={tmp_path / 'broken.jsonl'}"], f"{tmp_path / 'broken.jsonl'}:2: broken JSON line", 2),
             (["grpo.reward=no_such_module:f"], "cannot import no_such_module", 2),
             (["grpo.reward=jaxlm.rewards:no_such_function"], "jaxlm.rewards has no function 'no_such_function'", 2),
             ([f"grpo.reward={tmp_path / 'nan_reward.py'}:nan"], "reward function nan returned nan", 1),
             (["grpo.group_size=1"], "grpo.group_size=1 leaves every completion alone", 2)]
    for extra, message, status in cases:
        code = cli.main(["train", "quickstart", *base, *extra])
        err = capsys.readouterr().err.strip()
        assert code == status and message in err and len(err.splitlines()) == 1, (extra, err)


def test_rewards_that_raise_or_miscount_are_named_with_the_prompt():
    prompts = [rl.Prompt("12=", [1, 2], {"answer": "2"}), rl.Prompt("13=", [1, 3], {"answer": "3"})]

    def boom(completions, **_):
        raise KeyError("answer")

    def short(completions, **_):
        return [1.0]

    for fn, message in [(boom, "reward function boom raised KeyError: 'answer' (first prompt of the batch: '12=')"),
                        (short, "reward function short returned 1 values for 2 completions")]:
        with pytest.raises(rl.RewardError, match=message.replace("(", r"\(").replace(")", r"\)")):
            rl.score([rl.Reward(fn.__name__, fn, 1.0)], prompts, ["2", "4"], [[5], [6]])
    total, each = rl.score([rl.Reward("exact_answer", __import__("jaxlm.rewards").rewards.exact_answer, 2.0)],
                           prompts, ["so 2", "\\boxed{4}"], [[5], [6]])
    assert list(total) == [2.0, 0.0] and list(each["exact_answer"]) == [1.0, 0.0]
