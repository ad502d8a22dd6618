"""The serving engine's decode program alone (serve/programs.py's `decode_loop`, no engine thread, no HTTP) over
slot buckets and over all slots, and `jaxlm.infer.generate` on the same batch, in one run.

benchmarks/decode.py's tiny random Llama (4 layers, width 128, vocab 256) in an engine of --slots slots with an
80-position cache. A session is what benchmarks/serve.py's engine alone asks of the program: 16 rows whose
16-token prompts are in (16 busy slots of 32 run in the half bucket) each decode 64 greedy tokens with
logprobs=1, in calls of k steps. Prints, for the program with slot buckets (serve/programs.py's SLOT_DIVISORS)
and with all slots (none), one line
    slots=buckets|all k1_ms_per_step= k8_ms_per_step= per_call_ms= per_step_ms= early_ms_per_step= late_ms_per_step=
per_call and per_step are fitted from k=1 and k=8 (time = 64 steps x per_step + calls x per_call); early and
late are one call of 8 steps at lengths 8 -> 16 and 72 -> 80. Then generate's ms per step at batch 16 (prefill
included) and the ratios all/buckets. Every figure is the fastest of --repeats sessions.

    python benchmarks/decode_program.py [--repeats 15] [--slots 32]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import decode as decode_bench  # noqa: E402

from jaxlm.infer import generate  # noqa: E402
from jaxlm.infer.sampling import RowSampling  # noqa: E402
from jaxlm.config import DecodeConfig, ServeConfig  # noqa: E402
from jaxlm.serve import programs  # noqa: E402
from jaxlm.serve.engine import MIN_STOP_WIDTH, Engine  # noqa: E402

ROWS, PROMPT, NEW, LENGTH = 16, 16, 64, 80


def sessions(params, cfg, slots: int, repeats: int) -> dict:
    """ms per step of the sessions the module docstring lists, the fastest of `repeats` each."""
    e = Engine(params, cfg, ServeConfig(max_slots=slots, max_queue=64, prefix_cache=0, decode_steps=8, page_size=0),
               LENGTH)
    e.warm_up()
    rows = np.arange(0, 2 * ROWS, 2, dtype=np.int32)  # not a prefix of the slots: the bucket gathers its rows
    set_length = jax.jit(lambda c, n: dataclasses.replace(c, length=n), donate_argnums=0)

    def call(steps: int, done: int):
        b = len(rows)
        live = np.ones(b, bool)
        seeds, zeros = np.zeros(b, np.uint32), np.zeros(b, np.int32)
        *out, e.kv.logits_BV, e.kv.cache = programs.decode_loop(
            params, e.kv.cache, e.kv.logits_BV, rows, np.full(b, -1, np.int32), np.int32(steps), live, zeros,
            RowSampling(np.full(b, 1000, np.int32), np.full((b, MIN_STOP_WIDTH), -1, np.int32), live, seeds, zeros,
                        zeros + done, np.zeros(b, np.float32), zeros, np.ones(b, np.float32)),
            cfg=cfg, max_steps=8, unroll=e.kv.unroll)
        jax.device_get(out)

    def session(k: int, start: int, steps: int) -> float:
        length = np.zeros(slots, np.int32)
        length[rows] = start
        e.kv.cache = jax.block_until_ready(set_length(e.kv.cache, length))
        t0 = time.perf_counter()
        for c in range(steps // k):
            call(k, c * k)
        return (time.perf_counter() - t0) / steps * 1e3

    best = lambda *a: min(session(*a) for _ in range(repeats))  # noqa: E731
    k1, k8 = best(1, PROMPT, NEW), best(8, PROMPT, NEW)
    per_call = (k1 - k8) * NEW / (NEW - NEW // 8)
    return dict(k1_ms_per_step=k1, k8_ms_per_step=k8, per_call_ms=per_call, per_step_ms=k8 - per_call / 8,
                early_ms_per_step=best(8, 8, 8), late_ms_per_step=best(8, LENGTH - 8, 8))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--slots", type=int, default=32)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        params, cfg, _ = decode_bench.build(Path(tmp), NEW)
        params = jax.device_put(params)  # in memory before the folder goes
    results = {}
    for name, divisors in (("buckets", programs.SLOT_DIVISORS), ("all", ())):
        programs.SLOT_DIVISORS = divisors
        programs.decode_loop.clear_cache()  # the slot buckets are read when the program is traced
        results[name] = sessions(params, cfg, a.slots, a.repeats)
        print(f"slots={name} " + " ".join(f"{k}={v:.3f}" for k, v in results[name].items()), flush=True)
    prompts = np.random.default_rng(16).integers(0, cfg.vocab_size, (ROWS, PROMPT)).tolist()
    d = DecodeConfig(max_new_tokens=NEW, temperature=0.0, cache_length=LENGTH)
    generate.generate(params, cfg, prompts, d)  # compile and warm up
    gen = min((lambda g: g.prefill_s + g.decode_s)(generate.generate(params, cfg, prompts, d))
              for _ in range(a.repeats)) / NEW * 1e3
    ratios = " ".join(f"{k}={results['all'][k] / results['buckets'][k]:.2f}" for k in results["all"])
    print(f"generate_batch16_ms_per_step={gen:.3f} all_over_buckets: {ratios}", flush=True)


if __name__ == "__main__":
    main()
