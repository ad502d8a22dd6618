"""Speculative decoding at batch 1: a target and a draft model trained here on the same data (tiny Shakespeare,
characters), then `jaxlm generate`'s decoder with and without the draft (decode.draft), measured in one run.

Trains the target (default 6 layers, 384 wide, 10.7M parameters) and the draft (2 layers, 128 wide, 0.4M: 3.8% of
the target) for --target-steps and --draft-steps on the same prepared corpus, then generates
--new-tokens after each of --prompts prompts from the held-out text at batch 1, greedy and sampled (temperature
0.8), with and without the draft proposing decode.draft_tokens' default (or --draft-tokens): each prompt run
once to compile and warm up, then without and with the draft in turn --repeats times (the fastest of each
counts, prefill included), the times summed over the prompts. Prints one line per setting
    mode=greedy plain_tok_per_s=X speculative_tok_per_s=Y speedup=Y/X acceptance=A tokens_per_pass=P
with A the share of draft tokens kept and P the tokens one pass of the target gives, then
    speculative_speedup=S acceptance=A (greedy, batch 1, ...)
and checks that greedy speculative text equals the text without the draft. Then the same for the server's
engine (`jaxlm serve MODEL decode.draft=DRAFT`, its default serve settings, one request at a time, from
submission to the last token: mode=serve_greedy, serve_sampled), with its greedy tokens checked against the
engine's without the draft, and
    serve_speculative_speedup=S acceptance=A (greedy, one request at a time)
Then DeepSeek-V3's way (decode.draft=mtp): a third model, the target's shape with one multi-token prediction
module trained beside it (model.mtp_layers=1, --target-steps), drafting for itself at 1, 2 and 4 draft tokens
(the module reused for the drafts after the first), against the same model without a draft:
    mode=mtp_greedy_k1 ... then mtp_speculative_speedup=S acceptance=A (greedy, batch 1, 1 draft token)
--models-dir keeps the trained models for later runs (a model trained there with another shape or step count
is trained again, its folder replaced). --tiny trains tiny models for a few steps (the benchmark's code path in
seconds; the figures mean nothing).

    python benchmarks/speculative.py [--target-steps 600] [--draft-steps 2000] [--new-tokens 256] [--prompts 8]
                                     [--draft-tokens K] [--models-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import jax

from jaxlm import config as config_lib
from jaxlm.infer import api, generate, speculative
from jaxlm.train import loop as train
from jaxlm.config import DecodeConfig
from jaxlm.data import prepare
from jaxlm.serve.engine import Engine
from jaxlm.serve.requests import Sequence
from jaxlm.infer.speculative import Draft

CORPUS = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "tinyshakespeare" / "input.txt"


def train_model(data: Path, run: Path, steps: int, layers: int, width: int, heads: int, block: int,
                mtp: int = 0) -> None:
    cfg = config_lib.load("shakespeare_char_cpu", {
        "data.dir": str(data), "run_dir": str(run), "model.n_layers": layers, "model.d_model": width,
        "model.n_heads": heads, "model.block_size": block, "model.mtp_layers": mtp, "training.steps": steps,
        "optimizer.decay_steps": steps, "optimizer.warmup_steps": min(100, steps // 10 + 1),
        "training.eval_interval": steps, "training.eval_batches": 4, "training.sample_tokens": 0,
        "checkpoint.interval": steps, "logging.progress": False, "logging.tensorboard": False})
    t = time.perf_counter()
    train.train(cfg, jax.devices()[:1], log=lambda s: None)
    print(f"trained {run.name}: {layers} layers x {width} in {time.perf_counter() - t:.0f} s", flush=True)


def alternating(fns: dict, repeats: int) -> tuple[dict, dict]:
    """Each function once (compile and warm up; its output kept), then all of them in turn `repeats` times (so
    the machine's drift touches all alike); the fastest time of each and its first output."""
    out = {name: fn() for name, fn in fns.items()}
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    return best, out


def report(mode: str, r: dict) -> dict:
    print(f"mode={mode} " + " ".join(f"{k}={v:.3f}" if k in ("acceptance", "speedup", "tokens_per_pass")
                                    else f"{k}={v:.1f}" for k, v in r.items()), flush=True)
    return r


def against_generate(params, cfg, draft_params, draft_cfg, prompts: list[list[int]], d: DecodeConfig, repeats: int,
                     mode: str) -> dict:
    """`generate` without and with the draft (None: the model's MTP module) on each prompt at batch 1, the
    fastest of `repeats` each (alternating), summed over the prompts; greedy text checked equal; prints and
    returns the figures (acceptance: draft tokens kept over proposed, all prompts together)."""
    plain_s = spec_s = 0.0
    n_plain = n_spec = passes = kept = proposed = 0
    for prompt in prompts:
        best, out = alternating({
            "plain": lambda: generate.generate(params, cfg, [prompt], d),
            "spec": lambda: speculative.generate_speculative(params, cfg, draft_params, draft_cfg, [prompt], d)},
            repeats)
        plain, spec = out["plain"], out["spec"]
        if d.temperature == 0:
            assert spec.tokens == plain.tokens, f"{mode}: greedy speculative text differs from generate's"
        plain_s, spec_s = plain_s + best["plain"], spec_s + best["spec"]
        n_plain, n_spec = n_plain + len(plain.tokens[0]), n_spec + len(spec.tokens[0])
        passes, kept, proposed = passes + spec.passes, kept + spec.accepted, proposed + spec.proposed
    return report(mode, dict(plain_tok_per_s=n_plain / plain_s, speculative_tok_per_s=n_spec / spec_s,
                             speedup=(n_spec / spec_s) / (n_plain / plain_s), acceptance=kept / max(proposed, 1),
                             tokens_per_pass=(n_spec - len(prompts)) / max(passes, 1)))


def engine(model, draft, d: DecodeConfig, context: int):
    """The server's engine (serve.* defaults, a paged cache of 4 sequences of `context` positions), started, with
    `draft` proposing d.draft_tokens (None: without a draft)."""
    sc = config_lib.ServeConfig(max_slots=4, max_queue=8, prefix_cache=0)
    e = Engine(model.params, model.config.model, sc, context,
               draft=None if draft is None else Draft(draft.params, draft.config.model, d.draft_tokens))
    e.warm_up()
    e.start()
    return e


def served(model, draft, prompts: list[list[int]], d: DecodeConfig, repeats: int, mode: str) -> dict:
    """The server's engine without and with `draft`, one request at a time on each prompt, from submission to
    the last token, the fastest of `repeats` each (alternating), summed over the prompts; greedy tokens checked
    equal; prints and returns the figures."""
    context = max(map(len, prompts)) + d.max_new_tokens
    engines = {"plain": engine(model, None, d, context), "spec": engine(model, draft, d, context)}

    def once(e, prompt):
        events, = e.run([Sequence(prompt, d.max_new_tokens, d.temperature, 0, 1.0, d.seed, 0, (), None,
                                  logprobs=False)], timeout=600)
        return [t for ev in events if ev[0] == "tokens" for t in ev[1]]

    try:
        seconds, tokens = dict.fromkeys(engines, 0.0), dict.fromkeys(engines, 0)
        for prompt in prompts:
            best, out = alternating({name: (lambda e=e: once(e, prompt)) for name, e in engines.items()}, repeats)
            if d.temperature == 0:
                assert out["spec"] == out["plain"], f"{mode}: the engine's greedy tokens differ with the draft"
            for name in engines:
                seconds[name] += best[name]
                tokens[name] += len(out[name])
    finally:
        for e in engines.values():
            e.stop()
    e = engines["spec"]
    rate = {name: tokens[name] / seconds[name] for name in engines}
    return report(mode, dict(plain_tok_per_s=rate["plain"], speculative_tok_per_s=rate["spec"],
                             speedup=rate["spec"] / rate["plain"],
                             acceptance=e.draft_accepted_total / max(e.draft_proposed_total, 1)))


def trained(run: Path, reuse: bool, steps: int, shape: dict) -> bool:
    """Whether `run` holds a finished training of `shape` for `steps` steps that may be reused (--models-dir)."""
    saved = run / "checkpoints"
    if not (reuse and saved.is_dir() and any(saved.iterdir())):  # a finished run saves at its end
        return False
    cfg = config_lib.from_dict(json.loads((run / "config.json").read_text()))
    m = cfg.model
    same = (m.n_layers, m.d_model, m.n_heads, m.block_size, m.mtp_layers, cfg.training.steps) == (
        shape["layers"], shape["width"], shape["heads"], shape["block"], shape.get("mtp", 0), steps)
    if not same:  # the benchmark's own run: trained again from scratch
        print(f"{run} was trained with another shape or step count: training it again", flush=True)
        shutil.rmtree(run)
    return same


def held_out_prompts(tok, text: str, n: int, chars: int = 100) -> list[list[int]]:
    """n prompts of `chars` characters from the corpus's last tenth (the held-out split), evenly spaced."""
    start = len(text) - len(text) // 10
    step = (len(text) - start - chars) // n
    return [tok.encode(text[start + i * step:start + i * step + chars]) for i in range(n)]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default=os.environ.get("JAXLM_SHAKESPEARE", str(CORPUS)))
    ap.add_argument("--target-steps", type=int, default=600)
    ap.add_argument("--draft-steps", type=int, default=2000, help="the draft's training is cheap (2 small layers)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--draft-tokens", type=int, default=None,
                    help="the draft model's proposals per pass (default: decode.draft_tokens' default)")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts, each decoded at batch 1")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="tiny models, a few steps: the code path only")
    ap.add_argument("--models-dir", help="train the models here, or reuse the ones an earlier run trained here")
    a = ap.parse_args(argv)
    target = dict(layers=6, width=384, heads=6, block=128)
    draft = dict(layers=2, width=128, heads=2, block=128)
    if a.tiny:
        target, draft = dict(layers=2, width=32, heads=2, block=64), dict(layers=1, width=16, heads=2, block=64)
        a.target_steps, a.draft_steps, a.new_tokens, a.repeats, a.prompts = 4, 4, 16, 1, 2
    k = config_lib.draft_tokens(DecodeConfig(draft_tokens=a.draft_tokens), mtp=False)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = a.models_dir or tmp
        data = Path(tmp) / "data"
        if not (data / "meta.json").exists():
            prepare.prepare_shakespeare_char(data, Path(a.corpus))
        for name, steps, shape in (("target", a.target_steps, target), ("draft", a.draft_steps, draft),
                                   ("target_mtp", a.target_steps, dict(target, mtp=1))):
            if trained(Path(tmp) / name, bool(a.models_dir), steps, shape):
                print(f"reusing {Path(tmp) / name}", flush=True)
            else:
                train_model(data, Path(tmp) / name, steps, **shape)
        model, small = api.load(Path(tmp) / "target"), api.load(Path(tmp) / "draft")
        sizes = [sum(x.size for x in jax.tree.leaves(m.params)) for m in (model, small)]
        print(f"target_params={sizes[0]} draft_params={sizes[1]} draft_over_target={sizes[1] / sizes[0]:.3f} "
              f"draft_tokens={k} prompts={a.prompts} new_tokens={a.new_tokens}", flush=True)
        prompts = held_out_prompts(model.tokenizer(), Path(a.corpus).read_text(), a.prompts)
        for mode, temperature in (("greedy", 0.0), ("sampled", 0.8)):
            d = DecodeConfig(max_new_tokens=a.new_tokens, temperature=temperature, seed=1, draft_tokens=k)
            results[mode] = against_generate(model.params, model.config.model, small.params, small.config.model,
                                             prompts, d, a.repeats, mode)
        for mode, temperature in (("serve_greedy", 0.0), ("serve_sampled", 0.8)):
            d = DecodeConfig(max_new_tokens=a.new_tokens, temperature=temperature, seed=1, draft_tokens=k)
            results[mode] = served(model, small, prompts, d, a.repeats, mode)
        mtp_model = api.load(Path(tmp) / "target_mtp")
        for j in (1, 2, 4):
            for mode, temperature in (("greedy", 0.0), ("sampled", 0.8)):
                d = DecodeConfig(max_new_tokens=a.new_tokens, temperature=temperature, seed=1, draft_tokens=j)
                name = f"mtp_{mode}_k{j}"
                results[name] = against_generate(mtp_model.params, mtp_model.config.model, None, None, prompts, d,
                                                 a.repeats, name)
    print(f"speculative_speedup={results['greedy']['speedup']:.2f} acceptance={results['greedy']['acceptance']:.3f} "
          f"(greedy, batch 1, {k} draft tokens, {a.prompts} prompts)")
    print(f"serve_speculative_speedup={results['serve_greedy']['speedup']:.2f} "
          f"acceptance={results['serve_greedy']['acceptance']:.3f} (greedy, one request at a time)")
    best = max((1, 2, 4), key=lambda j: results[f"mtp_greedy_k{j}"]["speedup"])
    print(f"mtp_speculative_speedup={results['mtp_greedy_k1']['speedup']:.2f} "
          f"acceptance={results['mtp_greedy_k1']['acceptance']:.3f} (greedy, batch 1, 1 draft token; "
          f"best at {best} draft tokens: {results[f'mtp_greedy_k{best}']['speedup']:.2f})")
    return results


if __name__ == "__main__":
    main()
