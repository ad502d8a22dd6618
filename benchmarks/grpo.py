"""GRPO's rollouts against the serving engine alone, on the same model, prompts, group size and lengths, in one run.

Trains `training.objective=grpo` for a few steps (a Llama-shaped model with random weights, byte tokenizer, prompts
of 16-48 characters, grpo.group_size completions of grpo.max_completion_tokens tokens each, the byte vocabulary
having no end-of-text so that every completion runs to its length) and reads each step's rollout tokens/s and
time split from metrics.jsonl; then runs the same prompts through one long-lived, warmed-up engine (as `jaxlm
serve` holds it) over the same weights, several times, for its tokens/s.

The update accumulates the step's rows over micro-batches of --micro-batch rows (training.grad_accum): the
step's activations scale with the rows of one micro-batch (all 64 rows at once took 9.9 GiB of temporaries).

Prints key=value lines: grpo_rollout_tok_per_s (median over the steps after the first two), engine_tok_per_s (median),
rollout_over_engine (the issue's figure, aim >= 0.8), the median step split rollout_s, logprob_s, update_s, and the
process's peak resident memory, during the GRPO run (grpo_peak_rss_gib) and over the whole script (peak_rss_gib).

    python benchmarks/grpo.py [--steps 8] [--d-model 512 --layers 8 --prompts 8 --group 8 --completion 128]
                              [--micro-batch 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import random
import resource
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from jaxlm import config as config_lib, runtime
from jaxlm.train import grpo as rl, loop as train, run as run_lib, state as state_lib

REWARD = "def length(completions, **_):\n    return [len(c) / 100 for c in completions]\n"


def settings(a, tmp: Path) -> list[str]:
    return [f"model.d_model={a.d_model}", f"model.n_layers={a.layers}", f"model.n_heads={a.d_model // 64}",
            "model.vocab_size=256", f"model.block_size={a.completion + 64}", "model.glu=true",
            "model.activation=silu", "data.tokenizer=byte", "training.objective=grpo",
            f"data.prompts={tmp / 'prompts.jsonl'}", f"grpo.reward={tmp / 'reward.py'}:length",
            f"grpo.group_size={a.group}", f"grpo.max_completion_tokens={a.completion}",
            f"training.batch_size={micro_batch(a)}", f"training.grad_accum={a.prompts * a.group // micro_batch(a)}",
            f"training.steps={a.steps}", "training.eval_interval=0",
            "checkpoint.enabled=false", "logging.progress=false", "logging.tensorboard=false",
            "training.sample_tokens=0", "optimizer.name=adamw", "optimizer.warmup_steps=1", f"run_dir={tmp / 'run'}"]


def micro_batch(a) -> int:
    """Rows of one micro-batch of the update: the step's prompts x group rows are accumulated over micro-batches
    of at most --micro-batch rows (the update's temporaries on a CPU: 9.9 GiB for all 64 rows at once, 0.9 GiB for
    micro-batches of 4; docs/rl.md, Memory)."""
    return math.gcd(a.prompts * a.group, a.micro_batch)


def peak_rss_gib() -> float:
    """This process's peak resident memory so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def engine_alone(params, cfg, prompts: list[list[int]], group: int, repeats: int) -> list[float]:
    """Tokens/s of one warmed engine over the same sequences, `repeats` times: the rollouts' own engine
    (rl.rollout_engine, the same cache settings) with its cache kept and its programs compiled up front."""
    from jaxlm.serve.requests import Sequence

    g = cfg.grpo
    rows = len(prompts) * group
    # the same prompts every repeat: with prefix sharing the later repeats would take the earlier ones' pages
    # instead of prefilling, which rollouts (a fresh cache per batch, every row admitted at once) never do
    e = rl.rollout_engine(params, dataclasses.replace(cfg, serve=dataclasses.replace(cfg.serve, prefix_cache=0)), rows)
    e.reserve_cache()
    e.warm_up()
    e.start()
    out = []
    try:
        for r in range(repeats):
            start = time.perf_counter()
            got = e.run([Sequence(list(ids), g.max_completion_tokens, g.temperature, g.top_k, g.top_p, r, k, (), None,
                                  logprobs=True, alternatives=1) for ids in prompts for k in range(group)])
            out.append(sum(len(ev[1]) for events in got for ev in events if ev[0] == "tokens")
                       / (time.perf_counter() - start))
    finally:
        e.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--completion", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    a = ap.parse_args()
    if runtime.platform() == "cpu":
        runtime.tune_for_xla_cpu()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        words = "the model samples a group of completions for every prompt and learns from their rewards".split()
        (tmp / "prompts.jsonl").write_text("".join(
            json.dumps({"prompt": " ".join(rng.choice(words) for _ in range(rng.randint(3, 8)))[:48]}) + "\n"
            for _ in range(64)))
        (tmp / "reward.py").write_text(REWARD)
        cfg = config_lib.load("quickstart", settings(a, tmp))
        train.train(cfg, jax.devices()[:1], log=lambda s: None)
        grpo_peak = peak_rss_gib()
        gc.collect()  # the run's train state and engine, before the engine alone
        runtime.release_free_memory()
        records = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in records if "rollout_tokens_per_s" in r][2:]  # prompts of new lengths compile at first
        print("rollout_s by step: " + " ".join(f"{r['rollout_s']:.3f}" for r in records if "rollout_s" in r))
        run = run_lib.setup(cfg, jax.devices()[:1])
        params = state_lib.init_state(run, cfg.seed)["params"]
        source = rl.RolloutBatches(run)
        prompts = [source.prompts[i].ids for i in range(a.prompts)]
        alone = engine_alone(params, run.cfg, prompts, a.group, max(3, len(steps)))
    grpo_tps = float(np.median([r["rollout_tokens_per_s"] for r in steps]))
    engine_tps = float(np.median(alone[1:]))
    print(f"model: d {a.d_model}, {a.layers} layers; {a.prompts} prompts x {a.group} completions x {a.completion} "
          f"tokens per step, updated in micro-batches of {micro_batch(a)}")
    print(f"grpo_rollout_tok_per_s={grpo_tps:.0f}")
    print(f"engine_tok_per_s={engine_tps:.0f}")
    for key in ("rollout_s", "logprob_s", "update_s"):
        print(f"{key}={np.median([r[key] for r in steps]):.3f}")
    print(f"rollout_over_engine={grpo_tps / engine_tps:.3f}")
    print(f"grpo_peak_rss_gib={grpo_peak:.2f}")
    print(f"peak_rss_gib={peak_rss_gib():.2f}")


if __name__ == "__main__":
    main()
