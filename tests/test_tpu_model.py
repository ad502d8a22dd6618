"""TPU tier: the model on the chip, in the tier's own process (`make test-tpu`; docs/tpu.md). A Llama-shaped model
trained with splash attention, gradient accumulation and remat against the same steps with materialized attention;
greedy decoding on the chip against a float32 run of the same weights on the CPU beside it; speculative decoding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config, train_losses
from jaxlm.infer import api, generate, speculative
from jaxlm.config import DecodeConfig
from jaxlm.model import forward

pytestmark = pytest.mark.tpu

LLAMA_SHAPED = {  # Llama's choices (RMSNorm, SwiGLU, rotary, grouped-query attention, untied output) at a small size,
    "model.block_size": 256, "model.n_layers": 4, "model.d_model": 512, "model.n_heads": 4, "model.n_kv_heads": 2,
    "model.activation": "silu", "model.glu": True, "model.qk_norm": False, "model.tie_embeddings": False,
    "model.compute_dtype": "bfloat16", "training.batch_size": 8, "training.grad_accum": 2, "model.remat": "full",
    "optimizer.warmup_steps": 2, "optimizer.lr": 1e-3,
}


def test_llama_shaped_splash_with_accumulation_and_remat_trains_as_materialized_attention(tpu, char_data, tmp_path):
    """12 steps (2 micro-batches each, full remat, bf16 compute) with splash attention on the chip, then the same
    steps on the same rows with dot_product attention: the losses agree to bf16 accuracy, and fall."""
    from jaxlm.train import batches as batch_lib
    from jaxlm.data import loader as loader_lib

    def batch_of(rng, run):
        starts = rng.integers(0, 100_000, size=8).reshape(run.cfg.training.grad_accum, -1)
        return batch_lib.device_batch(run, "train", loader_lib.Windows(starts))

    def losses(attention):
        cfg = tiny_config(char_data, tmp_path / attention, **{**LLAMA_SHAPED, "model.attention": attention})
        return train_losses(cfg, [tpu], batch_of, steps=12)[0]

    splash_losses, dense_losses = losses("splash"), losses("dot_product")
    assert np.all(np.isfinite(splash_losses)) and splash_losses[-1] < splash_losses[0] - 0.5, splash_losses
    np.testing.assert_allclose(splash_losses, dense_losses, atol=0.03, rtol=0)


TIE = 0.1  # logits apart: a near tie (probabilities within ~10% of each other)


def reference_logits(model, ids: list[int]) -> np.ndarray:
    """The next-token logits after `ids` by the model's weights in float32 on the CPU at full precision."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu), jax.default_matmul_precision("highest"):
        params = jax.tree.map(lambda a: jax.device_put(np.asarray(a), cpu), model.params)
        tokens = jnp.asarray([ids], jnp.int32)
        return np.asarray(jax.jit(forward, static_argnames="cfg")(params, tokens, cfg=model.config.model))[0, -1]


def assert_same_or_near_tie(model, prompt: list[int], a: list[int], b: list[int]) -> None:
    """Two greedy decodings of `prompt` are equal, or where they first part both tokens are within TIE of the
    reference's best logit there (the chip's float32 products round their operands to bfloat16, ~2^-8 relative
    in each: a tie can fall either way, and the texts then go apart)."""
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is None:
        assert len(a) == len(b), (a, b)
        return
    logits = reference_logits(model, prompt + a[:first])
    top = logits.max()
    assert top - logits[a[first]] <= TIE and top - logits[b[first]] <= TIE, (
        f"parted at token {first} without a tie: logits {logits[a[first]]:.4f} and {logits[b[first]]:.4f}, best "
        f"{top:.4f}", a, b)


def test_greedy_tokens_equal_a_float32_cpu_run_or_part_at_a_tie(tpu, tpu_quickstart_run):
    """64 greedy tokens of the quickstart model on the chip against the same weights in float32 on the CPU at
    full precision: equal, or parted at a near tie."""
    run, _ = tpu_quickstart_run
    model = api.load(run)
    prompt = list(b"def read_config(path):\n    ")
    d = DecodeConfig(max_new_tokens=64, temperature=0.0)
    on_chip = generate.generate(model.params, model.config.model, [prompt], d).tokens[0]
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu), jax.default_matmul_precision("highest"):
        params_cpu = jax.tree.map(lambda a: jax.device_put(np.asarray(a), cpu), model.params)
        on_cpu = generate.generate(params_cpu, model.config.model, [prompt], d).tokens[0]
    assert len(on_chip) == len(on_cpu) == 64
    assert_same_or_near_tie(model, prompt, on_chip, on_cpu)


def test_speculative_decoding_with_the_model_as_its_own_draft_keeps_greedy_text(tpu, tpu_quickstart_run):
    """The model drafting for itself: every proposal is accepted, and the text is greedy decoding's."""
    run, _ = tpu_quickstart_run
    model = api.load(run)
    cfg = model.config.model
    prompts = [list(b"import os\n"), list(b"class Reader:\n    def ")]
    d = DecodeConfig(max_new_tokens=40, temperature=0.0, draft_tokens=3)
    plain = generate.generate(model.params, cfg, prompts, d).tokens
    spec = speculative.generate_speculative(model.params, cfg, model.params, cfg, prompts, d)
    assert spec.tokens == plain
    assert spec.acceptance > 0.95 and spec.passes < 40, (spec.acceptance, spec.passes)
