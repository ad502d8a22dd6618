"""The serving benchmarks' code paths, at tiny sizes (their figures mean nothing here): benchmarks/serve.py (every
part: the server's levels, transformers' generate and continuous batching, the engine alone, paged against slot
cache, the toy model) and benchmarks/speculative.py (two models trained a few steps, with and without the draft)."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("fastapi")
sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))


@pytest.mark.slow
def test_serve_benchmark_runs_every_part_at_a_tiny_size(tmp_path):
    import serve as serve_bench

    report = serve_bench.main(["--size", "tiny", "--requests", "8", "--model-dir", str(tmp_path)])
    s = report["summary"]
    for key in ("vs_generate_real", "vs_generate_batch_real", "roofline_frac", "paged_vs_slot_sequences",
                "vs_transformers_toy", "time_prefill", "time_decode"):
        assert s[key] > 0, key
    assert report["slots"]["paged"]["in_flight"] > report["slots"]["slot"]["in_flight"] == 1
    assert set(report["serve"]) == {1, 4} and report["serve"][4]["requests"] == 8


@pytest.mark.slow
def test_speculative_benchmark_runs_at_a_tiny_size(shakespeare_file):
    import speculative as spec_bench

    results = spec_bench.main(["--tiny", "--corpus", str(shakespeare_file)])
    assert set(results) == {"greedy", "sampled"}
    assert all(r["tokens_per_pass"] >= 1 and 0 <= r["acceptance"] <= 1 for r in results.values())
