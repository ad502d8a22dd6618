"""The benchmarks run end to end at tiny sizes (their figures mean nothing here; the real sizes are measured by
hand: docs/serve.md, docs/finetune.md, docs/rl.md): benchmarks/serve.py (every part: the server's levels,
transformers' generate and continuous batching, the engine alone, paged against slot cache, the toy model;
and the server on a unix socket with torch hidden, as on a TPU machine),
benchmarks/multi_lora.py (8 adapters mixed against the base), benchmarks/speculative.py (two models trained a
few steps, with and without the draft), the post-training benchmarks printing the figures their docstrings
name."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import first_run_environment, require, xla_flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def run(script: str, *args: str) -> dict[str, str]:
    env = first_run_environment(XLA_FLAGS=xla_flags(), PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True,
                       env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return dict(line.split("=", 1) for line in p.stdout.splitlines() if "=" in line and " " not in line.split("=")[0])


@pytest.mark.slow
def test_serve_benchmark_runs_every_part_at_a_tiny_size(tmp_path):
    require("transformers", "hf")
    require("fastapi")
    import serve as serve_bench

    report = serve_bench.main(["--size", "tiny", "--requests", "8", "--model-dir", str(tmp_path),
                               "--tuned", "decode.quantize_kv_cache=true"])
    s = report["summary"]
    for key in ("vs_generate_real", "vs_generate_batch_real", "roofline_frac", "paged_vs_slot_sequences",
                "vs_transformers_toy", "time_prefill", "time_decode", "roofline_frac_tuned", "engine_roofline_frac",
                "server_vs_engine", "uniform_vs_generate"):
        assert s[key] > 0, key
    assert s["transport"] == report["transport"] == "tcp"
    u = report["uniform"]  # every prompt and output one length, the server at its concurrency
    assert (u["prompt"], u["output"], u["requests"], u["concurrency"]) == (16, 8, 8, 4)
    assert u["serve"]["requests"] == 8 and u["transformers_generate_batch16"] > 0
    assert report["slots"]["paged"]["in_flight"] > report["slots"]["slot"]["in_flight"] == 1
    assert set(report["serve"]) == {1, 4} and report["serve"][4]["requests"] == 8
    tuned = report["serve_tuned"]
    assert tuned["requests"] == 8 and tuned["settings"] == "decode.quantize_kv_cache=true"


@pytest.mark.slow
@pytest.mark.in_ci  # ~60 s: the path a TPU machine takes (no TCP socket, no torch), which CI has no chip to run
def test_serve_benchmark_runs_on_a_unix_socket_without_torch(tmp_path):
    """--uds (a TPU machine opens no TCP socket, and has no torch): the server on serve.uds, the clients through
    the socket; torch and transformers are made to fail at import in the benchmark and the server it starts."""
    require("fastapi")
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    for name in ("torch", "transformers"):
        (hidden / f"{name}.py").write_text(f"raise RuntimeError('{name} imported')\n")
    env = first_run_environment(XLA_FLAGS=xla_flags(), PYTHONPATH=f"{hidden}:{ROOT / 'src'}", JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--size", "tiny", "--parts",
                        "serve,engine", "--uds", "--requests", "8", "--model-dir", str(tmp_path / "model"),
                        "--tuned", "serve.decode_steps=4"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(p.stdout.splitlines()[-1])
    s = report["summary"]
    assert s["transport"] == report["transport"] == "uds" and "transport=uds" in p.stdout.splitlines()
    for key in ("roofline_frac", "time_prefill", "time_decode", "server_vs_engine", "engine_roofline_frac"):
        assert s[key] > 0, key
    assert set(report["serve"]) == {"1", "4"} and report["serve"]["4"]["requests"] == 8
    for level in report["serve"].values():
        assert level["output_tok_per_s"] > 0 and level["ttft_p50_ms"] > 0 and level["wall_s"] > 0
    assert report["engine"]["alone"]["output_tok_per_s"] > 0 and report["engine"]["alone"]["in_flight"] == 4
    # --tuned with the serve part alone: the server with those settings at the top concurrency too
    assert report["serve_tuned"]["requests"] == 8 and report["serve_tuned"]["settings"] == "serve.decode_steps=4"
    assert s["roofline_frac_tuned"] > 0


def test_tuned_settings_keep_the_commas_of_a_value():
    import serve as serve_bench

    assert serve_bench.tuned_settings("serve.attention_kernel_options=block_tokens=256,page_steps=0,"
                                      "decode.quantize_kv_cache=true") == (
        "serve.attention_kernel_options=block_tokens=256,page_steps=0", "decode.quantize_kv_cache=true")
    assert serve_bench.tuned_settings("serve.decode_steps=4") == ("serve.decode_steps=4",)
    assert serve_bench.tuned_settings("") == ()


@pytest.mark.slow
def test_multi_lora_benchmark_runs_at_a_tiny_size(tmp_path):
    require("transformers", "hf")
    import multi_lora

    report = multi_lora.main(["--size", "tiny", "--requests", "8", "--concurrency", "4", "--rounds", "2",
                              "--model-dir", str(tmp_path)])
    assert report["multi_lora_vs_base"] > 0 and report["mixed"]["in_flight"] == 4
    assert report["multi_lora_vs_base_cpu"] > 0 and report["base"]["output_tok_per_s"] > 0


@pytest.mark.slow
def test_speculative_benchmark_runs_at_a_tiny_size(shakespeare_file):
    import speculative as spec_bench

    results = spec_bench.main(["--tiny", "--corpus", str(shakespeare_file)])
    assert set(results) == {"greedy", "sampled", "serve_greedy", "serve_sampled"} | {
        f"mtp_{mode}_k{k}" for mode in ("greedy", "sampled") for k in (1, 2, 4)}
    assert all(r.get("tokens_per_pass", 1) >= 1 and 0 <= r["acceptance"] <= 1 for r in results.values())


@pytest.mark.slow
def test_lora_step_benchmark_prints_its_ratio():
    out = run("lora_step.py", "--d-model", "192", "--layers", "2", "--block", "32", "--batch", "2", "--rounds", "1",
              "--steps", "1")
    assert {"full_step_s", "lora_step_s", "lora_over_full", "lora_tok_per_s", "qlora_nf4_over_full"} <= set(out)
    assert float(out["lora_over_full"]) > 0


@pytest.mark.slow
def test_grpo_benchmark_prints_rollouts_over_engine():
    out = run("grpo.py", "--steps", "4", "--d-model", "64", "--layers", "2", "--prompts", "2", "--group", "4",
              "--completion", "8")
    assert {"grpo_rollout_tok_per_s", "engine_tok_per_s", "rollout_over_engine", "rollout_s", "update_s"} <= set(out)
    assert float(out["rollout_over_engine"]) > 0


@pytest.mark.slow
@pytest.mark.in_ci  # ~40 s: the hardened surface under mixed and hostile load, through the soak's own checks
def test_soak_runs_briefly_with_no_5xx_and_the_server_idle_after():
    """benchmarks/soak.py for 20 s with 4 clients, each hostile kind drawn at least once (--each-hostile): every
    good request answered 200, every bad one 400, each hostile kind its expected answer (the script exits 1
    otherwise, or when slots, queue or pages are not back to zero after); its memory checks need 2 minutes of load
    and are measured by hand (docs/serve.md, Soak)."""
    env = first_run_environment(XLA_FLAGS=xla_flags(), PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--seconds", "20", "--clients", "4",
                        "--each-hostile"], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0 and "soak passed" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in p.stdout.splitlines() if " " in line)
    answers = {k: dict(x.split("=") for x in v.split()) for k, v in lines.items()
               if k in ("status", "bad_requests_status") or k.startswith("hostile_")}
    assert set(answers["status"]) == {"200"} and int(answers["status"]["200"]) > 20
    assert set(answers["bad_requests_status"]) == {"400"} and int(answers["bad_requests_status"]["400"]) > 0
    allowed = {"never_fits": {"400"}, "tokenize_big": {"413"}, "big_header": {"431", "closed"}, "dup_host": {"400"},
               "slowloris": {"408", "closed"}}
    for kind, statuses in allowed.items():
        counts = answers[f"hostile_{kind}"]
        assert counts and set(counts) <= statuses and all(int(v) > 0 for v in counts.values()), (kind, counts)
    extreme = answers["hostile_extreme"]
    assert extreme and all(k == "200" or k.startswith("4") and len(k) == 3 for k in extreme), extreme
    out = dict(word.split("=", 1) for line in p.stdout.splitlines() if "=" in line.split(" ")[0]
               for word in line.split() if "=" in word)
    assert 0 < float(out["slowloris_worst_close_s"]) <= 15
    assert float(out["worst_stream_gap_ms"]) >= float(out["p99_stream_gap_ms"]) >= 0
    assert float(out["worst_stream_gap_ms"]) > 0
    assert lines["after"] == "busy_slots=0 queue_depth=0 kv_pages_used=0"
    assert "maps_growth" in out and "rss_growth" in out


@pytest.mark.slow
def test_stream_gaps_runs_each_kind_and_gets_its_answers():
    """benchmarks/stream_gaps.py at phases of 12 s: a line per phase with its gaps, and the answers each kind
    is owed (413 past serve.max_tokenize_chars, 200 under it, 400 for the chat past the context, the long header
    cut off, the slowloris connections closed at serve.header_timeout_s)."""
    env = first_run_environment(XLA_FLAGS=xla_flags(), PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "stream_gaps.py"), "--phase-seconds", "12"],
                       capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = {line.split()[0]: line for line in p.stdout.splitlines() if "worst_gap_ms=" in line}
    assert set(lines) == {"baseline", "tokenize_7mb", "tokenize_1m_chars", "chat_6mb", "header_256mb",
                          "slowloris_100"}, p.stdout
    for kind, answer in (("tokenize_7mb", "[413 x"), ("tokenize_1m_chars", "[200 x"), ("chat_6mb", "[400 x"),
                         ("header_256mb", "[closed x"), ("slowloris_100", "[closed after 10 s x")):
        assert answer in lines[kind], lines[kind]
    for line in lines.values():
        words = dict(w.split("=", 1) for w in line.split() if "=" in w and not w.startswith("answers"))
        assert float(words["worst_gap_ms"]) >= float(words["p99_gap_ms"]) > 0 and int(words["chunks"]) > 100


def test_a_benchmark_run_writes_its_json_after_each_section(tmp_path):
    """benchmarks/gpu.py's runner (benchmarks/tpu.py's too) hands each finished section's figures to `done`, so a
    run stopped from outside (a chip call's time limit) keeps the sections it finished: here the second section
    hangs past its budget and the first one's figures are already out."""
    import gpu

    script = tmp_path / "sections.py"
    script.write_text("import json, sys, time\n"
                      "name, results = sys.argv[1], sys.argv[sys.argv.index('--results') + 1]\n"
                      "open(results, 'w').write(json.dumps({name + '_figure': 7}) + '\\n')\n"
                      "time.sleep(60 if name == 'slow' else 0)\n")
    seen = []
    figures, status, _ = gpu.run_sections(["quick", "slow"], False, 1.0, lambda s: None, script,
                                          {"quick": 2, "slow": 1}, "t",
                                          lambda f, s, w: seen.append((json.loads(json.dumps(f)), dict(s))))
    assert seen[0][0] == {"quick": {"quick_figure": 7}} and seen[0][1]["quick"]["state"] == "ok"
    assert len(seen) == 2 and figures["slow"] == {"slow_figure": 7}
    assert status["slow"]["state"].startswith("timed out")
