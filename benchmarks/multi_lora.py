"""Several LoRA adapters served over one base (serve.adapters): the engine's throughput with 8 adapters mixed in
its decode steps, against the base alone, on the same requests, measured in one run.

The model is benchmarks/serve.py's Llama of --size (random weights; `small` by default: 512 wide, 8 layers,
vocabulary 32,000, 58M parameters), the requests its long-tailed workload (fixed seed). Eight adapters of rank
--rank on --targets, random A and B, are stacked over the base (lora.serving_weights, as `jaxlm serve` does);
request i runs with adapter i mod 8, so every decode step holds rows of several adapters. Both runs are the
engine alone in this process (no HTTP: benchmarks/serve.py's engine_run), the server's default paged cache, at
--concurrency sequences; they alternate (base, mixed, base, ..., --rounds of each) and the fastest of each is
compared: the first of each compiles the shapes its warm-up pass missed, and a machine whose load changes under
the run weighs on both.

Prints `multi_lora_vs_base=` (the mixed adapters' output tokens/s over the base's, wall time) and
`multi_lora_vs_base_cpu=` (the same from this process's CPU time, the least of each: on a machine shared with
other work the wall time measures the others' load too). --size tiny runs the code path only (tests).

    python benchmarks/multi_lora.py [--size small] [--requests 64] [--concurrency 32] [--adapters 8] [--rank 16]
        [--targets q,k,v,o] [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).parent))
import serve as serve_bench  # noqa: E402

from jaxlm import config as config_lib, params as P
from jaxlm.infer import api
from jaxlm.model import lora  # noqa: E402
from jaxlm.config import ServeConfig  # noqa: E402
from jaxlm.serve import cache_pages  # noqa: E402


def random_adapters(cfg, n: int) -> list[tuple[dict, float]]:
    """n adapters of lora.specs(cfg) with small random A and B (B is zero at initialization), each with its
    scale."""
    out = []
    for i in range(n):
        keys = iter(jax.random.split(jax.random.key(i), 64))
        tree = jax.tree.map(lambda s: 0.02 * jax.random.normal(next(keys), s.shape, jax.numpy.dtype(s.dtype)),
                            lora.specs(cfg), is_leaf=lambda s: isinstance(s, P.ParamSpec))
        out.append((tree, lora.scale(cfg)))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=list(serve_bench.SIZES), default="small")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default="q,k,v,o")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each, alternating")
    ap.add_argument("--model-dir", help="keep the built model here for later runs (default: a temporary folder)")
    a = ap.parse_args(argv)
    report: dict = {"load_avg_start": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(a.model_dir or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        _, jx = serve_bench.build(folder, a.size)
        model = api.load(jx)
        m = model.config.model
        cfg = config_lib.apply_overrides(model.config, {"lora.rank": a.rank, "lora.alpha": 2.0 * a.rank,
                                                        "lora.targets": a.targets})
        served = lora.serving_weights(model.params, random_adapters(cfg, a.adapters))
        requests = serve_bench.workload(a.size, a.requests, seed=0)
        mixed = [dataclasses.replace(r, adapter=i % a.adapters) for i, r in enumerate(requests)]
        print("workload " + serve_bench.describe(requests), flush=True)
        pages = cache_pages(m, ServeConfig(), m.block_size, False)
        runs, base, mixed_runs = {}, [], []
        for name, reqs, params in [("base", requests, None), ("mixed", mixed, served)] * a.rounds:
            run = serve_bench.engine_run(model, reqs, a.concurrency, params=params, cache_pages=pages)
            print(f"{name} " + serve_bench.line(run), flush=True)
            (base if name == "base" else mixed_runs).append(run)
            if run["output_tok_per_s"] > runs.get(name, {}).get("output_tok_per_s", 0):
                runs[name] = run
    report.update(runs, load_avg_end=os.getloadavg())
    report["multi_lora_vs_base"] = runs["mixed"]["output_tok_per_s"] / runs["base"]["output_tok_per_s"]
    report["multi_lora_vs_base_cpu"] = min(r["cpu_s"] for r in base) / min(r["cpu_s"] for r in mixed_runs)
    print(f"adapters={a.adapters} rank={a.rank} targets={a.targets} concurrency={a.concurrency}")
    print(f"multi_lora_vs_base={report['multi_lora_vs_base']:.2f}")
    print(f"multi_lora_vs_base_cpu={report['multi_lora_vs_base_cpu']:.2f}")
    print(json.dumps(report, default=float))
    return report


if __name__ == "__main__":
    main()
