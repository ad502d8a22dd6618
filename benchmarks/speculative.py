"""Speculative decoding at batch 1: a target and a draft model trained here on the same data (tiny Shakespeare,
characters), then `jaxlm generate`'s decoder with and without the draft (decode.draft), measured in one run.

Trains the target (default 6 layers, 384 wide, 10.7M parameters) and the draft (1 layer, 96 wide) for
--target-steps and --draft-steps on the same prepared corpus, then generates --new-tokens after a prompt from
the held-out text at batch 1, greedy and sampled (temperature 0.8), each warmed up first and timed --repeats
times (the fastest counts, prefill included). Prints one line per setting
    mode=greedy plain_tok_per_s=X speculative_tok_per_s=Y speedup=Y/X acceptance=A tokens_per_pass=P
with A the share of draft tokens kept and P the tokens one pass of the target gives, then
    speculative_speedup=S acceptance=A (greedy, batch 1)
and checks that greedy speculative text equals the text without the draft. Then the same for the server's
engine (`jaxlm serve MODEL decode.draft=DRAFT`, its default serve settings, one request at a time, from
submission to the last token: mode=serve_greedy, serve_sampled), with its greedy tokens checked against the
engine's without the draft, and
    serve_speculative_speedup=S acceptance=A (greedy, one request)
Then DeepSeek-V3's way (decode.draft=mtp): a third model, the target's shape with one multi-token prediction
module trained beside it (model.mtp_layers=1, --target-steps), drafting for itself at 1, 2 and 4 draft tokens
(the module reused for the drafts after the first), against the same model without a draft:
    mode=mtp_greedy_k1 ... then mtp_speculative_speedup=S acceptance=A (greedy, batch 1, 1 draft token)
--tiny trains tiny models for a few steps (the benchmark's code path in seconds; the figures mean nothing).

    python benchmarks/speculative.py [--target-steps 600] [--draft-steps 2000] [--new-tokens 256] [--draft-tokens 4]
                                     [--models-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

import jax

from jaxlm import api, config as config_lib, generate, speculative, train
from jaxlm.config import DecodeConfig
from jaxlm.data import prepare
from jaxlm.serve import engine as engine_lib

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


def timed(fn, repeats: int):
    fn()  # compile and warm up
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def against_generate(params, cfg, draft_params, draft_cfg, prompt: list[list[int]], d: DecodeConfig, repeats: int,
                     mode: str) -> dict:
    """`generate` without and with the draft (None: the model's MTP module), the fastest of `repeats` each,
    greedy text checked equal; prints and returns the figures."""
    plain_s, plain = timed(lambda: generate.generate(params, cfg, prompt, d), repeats)
    spec_s, spec = timed(lambda: speculative.generate_speculative(params, cfg, draft_params, draft_cfg, prompt, d),
                         repeats)
    if d.temperature == 0:
        assert spec.tokens == plain.tokens, f"{mode}: greedy speculative text differs from generate's"
    n_plain, n_spec = len(plain.tokens[0]), len(spec.tokens[0])
    r = dict(plain_tok_per_s=n_plain / plain_s, speculative_tok_per_s=n_spec / spec_s,
             speedup=(n_spec / spec_s) / (n_plain / plain_s), acceptance=spec.acceptance,
             tokens_per_pass=(n_spec - 1) / max(spec.passes, 1))
    print(f"mode={mode} " + " ".join(f"{k}={v:.3f}" if k in ("acceptance", "speedup", "tokens_per_pass")
                                    else f"{k}={v:.1f}" for k, v in r.items()), flush=True)
    return r


def served(model, draft, prompt: list[int], d: DecodeConfig, repeats: int):
    """Tokens per second of the server's engine (serve.* defaults, a paged cache of 4 sequences of the whole
    context) on one request at a time, with `draft` proposing d.draft_tokens (None: without), the fastest of
    `repeats` after a warm-up; its tokens and the draft's acceptance."""
    sc = config_lib.ServeConfig()
    e = engine_lib.Engine(model.params, model.config.model, 4, len(prompt) + d.max_new_tokens, 8,
                          decode_steps=sc.decode_steps, page_size=sc.page_size, prefill_chunk=sc.prefill_chunk,
                          prefix_cache=0, draft=None if draft is None else (draft.params, draft.config.model,
                                                                            d.draft_tokens))
    e.warm_up()
    e.start()
    try:
        def once():
            events, done = [], threading.Event()
            e.submit(engine_lib.Sequence(prompt, d.max_new_tokens, d.temperature, 0, 1.0, d.seed, 0, (),
                                         lambda ev: (events.append(ev), ev[0] == "done" and done.set()),
                                         logprobs=False))
            assert done.wait(600), "the engine did not finish"
            return [t for ev in events if ev[0] == "tokens" for t in ev[1]]

        seconds, tokens = timed(once, repeats)
    finally:
        e.stop()
    return len(tokens) / seconds, tokens, e.draft_accepted_total / max(e.draft_proposed_total, 1)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default=os.environ.get("JAXLM_SHAKESPEARE", str(CORPUS)))
    ap.add_argument("--target-steps", type=int, default=600)
    ap.add_argument("--draft-steps", type=int, default=2000, help="the draft's training is cheap (1 layer)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="tiny models, a few steps: the code path only")
    ap.add_argument("--models-dir", help="train the models here, or reuse the ones an earlier run trained here")
    a = ap.parse_args(argv)
    target = dict(layers=6, width=384, heads=6, block=128)
    draft = dict(layers=1, width=96, heads=2, block=128)
    if a.tiny:
        target, draft = dict(layers=2, width=32, heads=2, block=64), dict(layers=1, width=16, heads=2, block=64)
        a.target_steps, a.draft_steps, a.new_tokens, a.repeats = 4, 4, 16, 1
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = a.models_dir or tmp
        data = Path(tmp) / "data"
        if not (data / "meta.json").exists():
            prepare.prepare_shakespeare_char(data, Path(a.corpus))
        for name, steps, shape in (("target", a.target_steps, target), ("draft", a.draft_steps, draft),
                                   ("target_mtp", a.target_steps, dict(target, mtp=1))):
            saved = Path(tmp) / name / "checkpoints"
            if a.models_dir and saved.is_dir() and any(saved.iterdir()):  # a finished run (it saves at its end)
                print(f"reusing {Path(tmp) / name}", flush=True)
            else:
                train_model(data, Path(tmp) / name, steps, **shape)
        model, small = api.load(Path(tmp) / "target"), api.load(Path(tmp) / "draft")
        tok = model.tokenizer()
        text = Path(a.corpus).read_text()
        prompt = [tok.encode(text[-2000:-1900])]
        for mode, temperature in (("greedy", 0.0), ("sampled", 0.8)):
            d = DecodeConfig(max_new_tokens=a.new_tokens, temperature=temperature, seed=1,
                             draft_tokens=a.draft_tokens)
            results[mode] = against_generate(model.params, model.config.model, small.params, small.config.model,
                                             prompt, d, a.repeats, mode)
        for mode, temperature in (("serve_greedy", 0.0), ("serve_sampled", 0.8)):
            d = DecodeConfig(max_new_tokens=a.new_tokens, temperature=temperature, seed=1,
                             draft_tokens=a.draft_tokens)
            plain_rate, plain, _ = served(model, None, prompt[0], d, a.repeats)
            spec_rate, spec, acceptance = served(model, small, prompt[0], d, a.repeats)
            if temperature == 0:
                assert spec == plain, "the server's greedy speculative tokens differ from its tokens without a draft"
            r = dict(plain_tok_per_s=plain_rate, speculative_tok_per_s=spec_rate, speedup=spec_rate / plain_rate,
                     acceptance=acceptance)
            results[mode] = r
            print(f"mode={mode} " + " ".join(f"{k}={v:.3f}" if k in ("acceptance", "speedup") else f"{k}={v:.1f}"
                                            for k, v in r.items()), flush=True)
        mtp_model = api.load(Path(tmp) / "target_mtp")
        for k in (1, 2, 4):
            for mode, temperature in (("greedy", 0.0), ("sampled", 0.8)):
                d = DecodeConfig(max_new_tokens=a.new_tokens, temperature=temperature, seed=1, draft_tokens=k)
                name = f"mtp_{mode}_k{k}"
                results[name] = against_generate(mtp_model.params, mtp_model.config.model, None, None, prompt, d,
                                                 a.repeats, name)
    print(f"speculative_speedup={results['greedy']['speedup']:.2f} acceptance={results['greedy']['acceptance']:.3f} "
          f"(greedy, batch 1, {a.draft_tokens} draft tokens)")
    print(f"serve_speculative_speedup={results['serve_greedy']['speedup']:.2f} "
          f"acceptance={results['serve_greedy']['acceptance']:.3f} (greedy, one request)")
    best = max((1, 2, 4), key=lambda k: results[f"mtp_greedy_k{k}"]["speedup"])
    print(f"mtp_speculative_speedup={results['mtp_greedy_k1']['speedup']:.2f} "
          f"acceptance={results['mtp_greedy_k1']['acceptance']:.3f} (greedy, batch 1, 1 draft token; "
          f"best at {best} draft tokens: {results[f'mtp_greedy_k{best}']['speedup']:.2f})")
    return results


if __name__ == "__main__":
    main()
