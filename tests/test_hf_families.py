"""The 2025-26 families against transformers: Qwen3-MoE, Gemma 3, gpt-oss, Llama 4 and DeepSeek-V3 (with its
multi-token prediction module). Each is a tiny random model made with transformers' own config class, with
layers enough for every kind to appear (dense and MoE layers, local and global, chunked and no-rope, a last
partial repeat of the pattern); it is imported with `convert.from_hf` and its logits compared, exported with
`convert.to_hf` and reloaded by transformers and compared again (float32, max |diff| <= 1e-4). Greedy
generation equals transformers' `generate` for 32 tokens, and the serving engine gives the same tokens."""

from __future__ import annotations

import time

import numpy as np
import pytest

import jaxlm
from jaxlm import convert

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

C = dict(num_attention_heads=4, hidden_size=64, intermediate_size=96, vocab_size=128)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
CASES = {
    # one dense layer before two MoE layers; top-k weights renormalized
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **C, num_hidden_layers=3, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, mlp_only_layers=[0], norm_topk_prob=True),
    # 8 layers of a 6-layer pattern (5 local, 1 global; two local left over); global layers linearly scaled
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **C, num_hidden_layers=8, num_key_value_heads=2, head_dim=16, sliding_window=4, query_pre_attn_scalar=24,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    # sliding and full layers, sinks, biases, clamped SwiGLU, YaRN (its defaults: factor 32 over 4096)
    "gpt_oss": lambda: transformers.GptOssConfig(
        **C, num_hidden_layers=2, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=4),
    # dense, MoE, dense, MoE; chunked rotary layers and a no-rope layer with temperature tuning (floor 4)
    "llama4": lambda: transformers.Llama4TextConfig(
        **C, num_hidden_layers=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, intermediate_size_mlp=80,
        interleave_moe_layer_step=2, attention_chunk_size=8, floor_scale=4, attn_scale=0.5),
    # latent attention with YaRN; one dense layer, then MoE with a shared expert and group-limited routing
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **C, num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        routed_scaling_factor=2.5, max_position_embeddings=64, rope_parameters=YARN),
}
T = 24  # longer than the windows (4) and chunks (8)


def randomize(model, scale, seed=0):
    """Every weight random: vectors (norms, biases, sinks) around 1, matrices normal times `scale`; DeepSeek's
    score-correction biases small, so that they tilt the routing without deciding it."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if p.ndim == 1 else scale * torch.randn(p.shape, generator=g))
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.copy_(0.1 * torch.randn(m.e_score_correction_bias.shape, generator=g))
    return model


def converted(name: str, tmp, scale: float):
    """A random transformers model of the family (weights normal times `scale`) saved and imported: (model,
    folder holding hf/ and jx/)."""
    model = randomize(transformers.AutoModelForCausalLM.from_config(CASES[name](), attn_implementation="eager").eval(),
                      scale)
    model.save_pretrained(tmp / "hf")
    convert.from_hf(str(tmp / "hf"), tmp / "jx", log=lambda s: None)
    return model


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


@pytest.mark.parametrize("name", CASES)
def test_import_and_export_match_transformers(name, tmp_path):
    model = converted(name, tmp_path, 0.08)
    tokens = np.random.default_rng(0).integers(0, 128, (2, T))
    want = hf_logits(model, tokens)
    ours = jaxlm.load(tmp_path / "jx").logits(tokens)
    assert ours.shape == (2, T, 128) and np.abs(want).max() > 0.5
    assert np.abs(ours - want).max() <= 1e-4
    convert.to_hf(tmp_path / "jx", tmp_path / "back", log=lambda s: None)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    assert type(back) is type(model)
    assert np.abs(hf_logits(back, tokens) - ours).max() <= 1e-4


PROMPTS = ([5, 17, 99, 3, 44, 12, 7, 8, 9, 10, 11], [42])


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_greedy_generation_and_serving_match_transformers(name, tmp_path):
    """32 greedy tokens of `Model.generate` (prefill, then cached decoding over the ring buffers, chunks and
    latents) equal transformers' `generate`; the serving engine (chunked prefill of 8 tokens, several decode
    steps per call) gives the same tokens for both prompts decoded together. The weights are large enough
    (0.3) for greedy decoding to wander instead of repeating one token."""
    from jaxlm.serve import engine as engine_lib

    model = converted(name, tmp_path, 0.3 if name != "gemma3" else 0.15)
    ours = jaxlm.load(tmp_path / "jx")
    wants = []
    for prompt in PROMPTS:
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(prompt):].tolist()
        assert ours.generate(prompt, 32, temperature=0.0, stop_ids=()) == want
        wants.append(want)
    assert max(len(set(w)) for w in wants) > 8  # not one token repeated

    e = engine_lib.Engine(ours.params, ours.config.model, 2, 64, max_queue=4, prefill_chunk=8, decode_steps=4)
    events = [[] for _ in PROMPTS]
    for i, prompt in enumerate(PROMPTS):
        e.submit(engine_lib.Sequence(list(prompt), 32, 0.0, 0, 1.0, i, 0, (), events[i].append))
    e.start()
    deadline = time.monotonic() + 300
    try:
        while not all(ev and ev[-1][0] == "done" for ev in events):
            assert time.monotonic() < deadline, "the engine did not finish in time"
            time.sleep(0.01)
    finally:
        e.stop()
    for ev, want in zip(events, wants):
        assert [t for kind, *rest in ev if kind == "tokens" for t in rest[0]] == want
