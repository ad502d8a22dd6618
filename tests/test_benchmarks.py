"""The post-training benchmarks run end to end at tiny sizes and print the figures their docstrings name (the real
sizes are measured by hand: docs/finetune.md, docs/rl.md)."""

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import users_environment, xla_flags

ROOT = Path(__file__).resolve().parents[1]


def run(script: str, *args: str) -> dict[str, str]:
    env = users_environment(XLA_FLAGS=xla_flags(), PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True,
                       env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return dict(line.split("=", 1) for line in p.stdout.splitlines() if "=" in line and " " not in line.split("=")[0])


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
