"""GRPO's rollouts against the serving engine alone, on the same model, prompts, group size and lengths, in one run.

Trains `training.objective=grpo` for a few steps (a Llama-shaped model with random weights, byte tokenizer, prompts
of 16-48 characters, grpo.group_size completions of grpo.max_completion_tokens tokens each, the byte vocabulary
having no end-of-text so that every completion runs to its length) and reads each step's rollout tokens/s and
time split from metrics.jsonl; then runs the same prompts through one long-lived, warmed-up engine (as `jaxlm
serve` holds it) over the same weights, several times, for its tokens/s.

Prints key=value lines: grpo_rollout_tok_per_s (median over the steps after the first two), engine_tok_per_s (median),
rollout_over_engine (the issue's figure, aim >= 0.8), and the median step split rollout_s, logprob_s, update_s.

    python benchmarks/grpo.py [--steps 6] [--d-model 512 --layers 8 --prompts 8 --group 8 --completion 128]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time
from pathlib import Path

import jax
import numpy as np

from jaxlm import config as config_lib, rl, runtime, step as step_lib, train

REWARD = "def length(completions, **_):\n    return [len(c) / 100 for c in completions]\n"


def settings(a, tmp: Path) -> list[str]:
    return [f"model.d_model={a.d_model}", f"model.n_layers={a.layers}", f"model.n_heads={a.d_model // 64}",
            "model.vocab_size=256", f"model.block_size={a.completion + 64}", "model.glu=true",
            "model.activation=silu", "data.tokenizer=byte", "training.objective=grpo",
            f"data.prompts={tmp / 'prompts.jsonl'}", f"grpo.reward={tmp / 'reward.py'}:length",
            f"grpo.group_size={a.group}", f"grpo.max_completion_tokens={a.completion}",
            f"training.batch_size={a.prompts * a.group}", f"training.steps={a.steps}", "training.eval_interval=0",
            "checkpoint.enabled=false", "logging.progress=false", "logging.tensorboard=false",
            "training.sample_tokens=0", "optimizer.name=adamw", "optimizer.warmup_steps=1", f"run_dir={tmp / 'run'}"]


def engine_alone(params, cfg, prompts: list[list[int]], group: int, repeats: int) -> list[float]:
    """Tokens/s of one warmed engine over the same sequences, `repeats` times."""
    from jaxlm.serve import engine as engine_lib

    g = cfg.grpo
    rows = len(prompts) * group
    e = engine_lib.Engine(params, cfg.model, rows, cfg.model.block_size, rows, decode_steps=cfg.serve.decode_steps,
                          prefill_chunk=cfg.serve.prefill_chunk)
    e.warm_up()
    e.start()
    out = []
    try:
        for r in range(repeats):
            done = threading.Semaphore(0)
            counts = [0] * rows

            def emit(ev, i):
                if ev[0] == "tokens":
                    counts[i] += len(ev[1])
                elif ev[0] in ("done", "error"):
                    done.release()

            start = time.perf_counter()
            for p, ids in enumerate(prompts):
                for k in range(group):
                    i = p * group + k
                    e.submit(engine_lib.Sequence(list(ids), g.max_completion_tokens, g.temperature, g.top_k, g.top_p,
                                                 r, k, (), lambda ev, i=i: emit(ev, i), logprobs=True, alternatives=1))
            for _ in range(rows):
                done.acquire()
            out.append(sum(counts) / (time.perf_counter() - start))
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
    a = ap.parse_args()
    if jax.default_backend() == "cpu":
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
        records = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in records if "rollout_tokens_per_s" in r][2:]  # prompts of new lengths compile at first
        print("rollout_s by step: " + " ".join(f"{r['rollout_s']:.3f}" for r in records if "rollout_s" in r))
        run = step_lib.setup(cfg, jax.devices()[:1])
        state = step_lib.init_state(run, cfg.seed)
        source = rl.RolloutBatches(run)
        prompts = [source.prompts[i].ids for i in range(a.prompts)]
        alone = engine_alone(state["params"], run.cfg, prompts, a.group, max(3, len(steps)))
    grpo_tps = float(np.median([r["rollout_tokens_per_s"] for r in steps]))
    engine_tps = float(np.median(alone[1:]))
    print(f"model: d {a.d_model}, {a.layers} layers; {a.prompts} prompts x {a.group} completions x {a.completion} "
          f"tokens per step")
    print(f"grpo_rollout_tok_per_s={grpo_tps:.0f}")
    print(f"engine_tok_per_s={engine_tps:.0f}")
    for key in ("rollout_s", "logprob_s", "update_s"):
        print(f"{key}={np.median([r[key] for r in steps]):.3f}")
    print(f"rollout_over_engine={grpo_tps / engine_tps:.3f}")


if __name__ == "__main__":
    main()
