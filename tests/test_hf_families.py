"""The 2025-26 families against transformers: Qwen3-MoE, Gemma 3, gpt-oss, Llama 4 and DeepSeek-V3 (with its
multi-token prediction module). Each is a tiny random model made with transformers' own config class, with
layers enough for every kind to appear (dense and MoE layers, local and global, chunked and no-rope, a last
partial repeat of the pattern); it is imported with `convert.from_hf` and its logits compared, exported with
`convert.to_hf` and reloaded by transformers and compared again (float32, max |diff| <= 1e-4). Greedy
generation equals transformers' `generate` for 32 tokens, and the serving engine gives the same tokens."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import jaxlm
from jaxlm.store import convert
from conftest import require

torch = require("torch")
transformers = require("transformers", "hf")

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
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if p.ndim == 1 else scale * noise)
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
    from jaxlm.config import ServeConfig
    from jaxlm.serve.engine import Engine
    from jaxlm.serve.requests import Sequence

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

    e = Engine(ours.params, ours.config.model,
               ServeConfig(max_slots=2, max_queue=4, prefill_chunk=8, prefix_cache=0, decode_steps=4), 64)
    events = e.run([Sequence(list(prompt), 32, 0.0, 0, 1.0, i, 0, (), None) for i, prompt in enumerate(PROMPTS)],
                   timeout=300)
    for ev, want in zip(events, wants):
        assert [t for kind, *rest in ev if kind == "tokens" for t in rest[0]] == want


# Options each family's import turns on, and how to turn one off (a config change, or a weight removed):
# every one must change the logits, or the comparisons above would pass without it.
def _drop(*path):
    def drop(params):
        node = params
        for k in path[:-1]:
            node = node[k]
        del node[path[-1]]
    return drop


FEATURES = {
    "qwen3_moe": {"router_norm_topk": {"router_norm_topk": False}},
    "gemma3": {"local_rope_theta": {"local_rope_theta": None}, "linear rope scaling": {"rope_scaling": "none"},
               "sliding window": {"layer_pattern": "global"}},
    "gpt_oss": {"sinks": _drop("layers", "attn", "sinks"), "clamped SwiGLU": {"swiglu_limit": None},
                "yarn": {"rope_scaling": "none"}, "router bias": _drop("layers", "mlp", "router_bias")},
    "llama4": {"chunks": {"layer_pattern": "global,global,global,nope"}, "L2 QK-norm": {"qk_l2_norm": False},
               "temperature tuning": {"attn_temperature_tuning": False},
               "weights on the input": {"router_weights_input": False}},
    "deepseek_v3": {"group-limited routing": {"router_groups": 1, "router_topk_groups": 1},
                    "yarn mscale": {"rope_yarn_mscale_all_dim": 0.0}, "routed scale": {"router_scale": 1.0},
                    "balancing bias": _drop("layers", "mlp", "balance_bias")},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", FEATURES)
def test_features_under_test_change_the_logits(name, tmp_path):
    import dataclasses

    import jax

    converted(name, tmp_path, 0.08)
    model = jaxlm.load(tmp_path / "jx")
    tokens = np.random.default_rng(0).integers(0, 128, (2, T))
    base = model.logits(tokens)
    for feature, change in FEATURES[name].items():
        cfg, params = model.config.model, jax.tree.map(lambda a: a, model.params)
        if callable(change):
            change(params)
        else:
            cfg = dataclasses.replace(cfg, **change)
        other = jaxlm.infer.api.Model(model.config.replace(model=cfg), params, model.path).logits(tokens)
        assert np.abs(other - base).max() > 1e-3, feature


def run_cli(argv, capsys):
    from jaxlm import cli

    capsys.readouterr()
    code = cli.main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


def test_unsupported_options_and_missing_experts_stop_the_import_in_one_line(tmp_path, capsys):
    """A rope type jaxlm lacks, a quantized checkpoint and Qwen3-MoE dense layers that are not the first ones
    are named; so is a missing expert's tensor, per-expert (Qwen3-MoE) or fused (gpt-oss)."""
    import json

    converted("qwen3_moe", tmp_path / "q", 0.08)
    converted("gpt_oss", tmp_path / "g", 0.08)
    hf = json.loads((tmp_path / "q" / "hf" / "config.json").read_text())

    def variant(folder, name, config=None, without=None):
        out = tmp_path / name
        shutil.copytree(tmp_path / folder / "hf", out)
        if config is not None:
            (out / "config.json").write_text(json.dumps(config))
        if without is not None:
            header, start = convert.read_header(out / "model.safetensors")
            with open(out / "model.safetensors", "rb") as f:
                tensors = {n: convert.read_tensor(f, info, start, n) for n, info in header.items() if n != without}
            convert.write_safetensors(out / "model.safetensors", [(n, a.shape, a.dtype) for n, a in tensors.items()],
                                      lambda n: tensors[n])
        return str(out)

    cases = [
        (variant("q", "rope", {**hf, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e6}}),
         "config.json rope scaling type 'longrope' is not supported (supported: default, llama3, linear, yarn)"),
        (variant("q", "mxfp4", {**hf, "quantization_config": {"quant_method": "mxfp4"}}),
         "config.json quantization_config.quant_method='mxfp4' is not supported"),
        (variant("q", "sparse", {**hf, "mlp_only_layers": [1]}), "config.json mlp_only_layers=[1] is not supported"),
        (variant("q", "expert", without="model.layers.2.mlp.experts.3.down_proj.weight"),
         "lacks tensor model.layers.2.mlp.experts.3.down_proj.weight (expected shape (64, 32))"),
        (variant("g", "fused", without="model.layers.1.mlp.experts.gate_up_proj"),
         "lacks tensor model.layers.1.mlp.experts.gate_up_proj (expected shape (4, 64, 192))"),
    ]
    for src, message in cases:
        code, err = run_cli(["convert", "from-hf", src, str(tmp_path / "out" / src.rsplit("/", 1)[-1])], capsys)
        assert code == 2 and len(err) == 1 and message in err[0], err


@pytest.mark.slow
def test_multimodal_checkpoints_import_their_language_model(tmp_path):
    """Gemma 3 and Llama 4 checkpoints with a vision tower (Gemma3ForConditionalGeneration,
    Llama4ForConditionalGeneration): on text alone, the imported model's logits equal transformers' language
    model's (both import their vision towers too: tests/test_vision.py, tests/test_vision_llama4.py)."""
    C2 = {**C, "vocab_size": 300}
    models = {
        "gemma3": transformers.Gemma3Config(
            text_config=transformers.Gemma3TextConfig(**C2, num_hidden_layers=2, num_key_value_heads=2, head_dim=16,
                                                      sliding_window=4),
            vision_config=transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                          num_attention_heads=2, image_size=28, patch_size=14),
            mm_tokens_per_image=4, image_token_index=299, boi_token_index=297, eoi_token_index=298),
        "llama4": transformers.Llama4Config(
            text_config=transformers.Llama4TextConfig(**C2, num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
                                                      num_local_experts=4, intermediate_size_mlp=80,
                                                      interleave_moe_layer_step=2, attention_chunk_size=8, floor_scale=4),
            vision_config=transformers.Llama4VisionConfig(hidden_size=32, intermediate_size=128, num_hidden_layers=1,
                                                          num_attention_heads=2, image_size=28, patch_size=14,
                                                          vision_output_dim=32, projector_input_dim=32,
                                                          projector_output_dim=32),
            image_token_index=299, boi_token_index=297, eoi_token_index=298),
    }
    tokens = np.random.default_rng(0).integers(0, 290, (2, T))
    for name, cfg in models.items():
        model = randomize(transformers.AutoModelForImageTextToText.from_config(cfg).eval(), 0.08)
        model.save_pretrained(tmp_path / name / "hf")
        with torch.no_grad():
            lm = getattr(model, "language_model", None) or model.model.language_model  # Llama 4's has a head
            out = lm(input_ids=torch.tensor(tokens))
            hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits
            want = (hidden if hidden.shape[-1] == 300 else model.lm_head(hidden)).float().numpy()
        convert.from_hf(str(tmp_path / name / "hf"), tmp_path / name / "jx", log=lambda s: None)
        ours = jaxlm.load(tmp_path / name / "jx").logits(tokens)
        assert np.abs(ours - want).max() <= 1e-4, name


@pytest.mark.slow
def test_deepseek_mtp_module_matches_transformers_and_round_trips(tmp_path):
    """A DeepSeek-V3 checkpoint with its multi-token prediction module (made with transformers' MtpModel and
    stored as the layers after the last, as the released checkpoints store it): the import keeps it, its
    logits (mtp_logits: module 0 at position t, from the embedding of token t + 1) equal
    MtpModel's, and the export writes every tensor back bit for bit, but the module's copies of the embedding
    and output tables (transformers ties them to the main model's)."""
    import jax.numpy as jnp
    from safetensors.torch import load_file, save_file
    from transformers.modeling_layers import MtpModel

    from jaxlm.model.mtp import mtp_logits

    cfg = CASES["deepseek_v3"]()
    cfg.num_hidden_layers, cfg.first_k_dense_replace, cfg.num_nextn_predict_layers = 2, 1, 1
    model = randomize(transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval(), 0.08)
    mtp = randomize(MtpModel(model, 1).eval(), 0.08, seed=1)
    mtp.tie_with_main_model(model)
    model.save_pretrained(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    L, F = cfg.num_hidden_layers, cfg.moe_intermediate_size
    for key, v in mtp.state_dict().items():  # MtpModel's names -> the checkpoints' model.layers.{L}.*
        if not key.startswith("layers.0."):
            continue
        name = f"model.layers.{L}." + key[len("layers.0."):].replace("mtp_block.", "").replace(
            "post_norm.", "shared_head.norm.")
        if name.endswith("experts.gate_up_proj"):
            for e in range(v.shape[0]):
                tensors[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = v[e, :F].contiguous()
                tensors[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = v[e, F:].contiguous()
        elif name.endswith("experts.down_proj"):
            for e in range(v.shape[0]):
                tensors[name.replace("down_proj", f"{e}.down_proj.weight")] = v[e].contiguous()
        else:
            tensors[name] = v.contiguous()
    tensors[f"model.layers.{L}.embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    tensors[f"model.layers.{L}.shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})

    tokens = np.random.default_rng(0).integers(0, 128, (2, 16))
    with torch.no_grad():
        t = torch.tensor(tokens)
        hidden = model.model(t).last_hidden_state
        positions = torch.arange(1, 16)[None].expand(2, -1)
        want = mtp._project_to_logits(mtp.forward_layer(0, hidden[:, :-1], positions, None, input_ids=t[:, 1:]))
    convert.from_hf(str(tmp_path / "hf"), tmp_path / "jx", log=lambda s: None)
    ours = jaxlm.load(tmp_path / "jx")
    assert ours.config.model.mtp_layers == 1
    got = np.asarray(mtp_logits(ours.params, jnp.asarray(tokens), ours.config.model))[0, :, :-1]
    assert np.abs(got - want.float().numpy()).max() <= 1e-4 and np.abs(want.numpy()).max() > 0.5
    convert.to_hf(tmp_path / "jx", tmp_path / "back", log=lambda s: None)
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert set(tensors) - set(back) == {f"model.layers.{L}.embed_tokens.weight",
                                        f"model.layers.{L}.shared_head.head.weight"}
    assert all(torch.equal(back[k], tensors[k]) for k in back)
