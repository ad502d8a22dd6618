"""Generation: cached prefill + decode against the full forward pass for every family, sampling rules against
numpy references, greedy generation against transformers' `generate`, and the `jaxlm generate` command."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import require
from jaxlm import config as config_lib, params as P, sharding
from jaxlm.infer import generate, sampling
from jaxlm.config import ConfigError, DecodeConfig, MeshConfig
from jaxlm.configs._models import MODELS
from jaxlm.model import decode, forward, param_specs

TINY = dict(vocab_size=64, block_size=64, n_heads=4, n_kv_heads=2, d_model=32, head_dim=8, d_ff=48,
            sliding_window=5, compute_dtype="float32", param_dtype="float32", init_std=0.2)
FAMILIES = {"gpt2": 2, "llama3_1_8b": 2, "mistral_7b": 2, "mixtral_8x7b": 2, "gemma_2b": 2, "gemma2_2b": 4,
            "qwen3_0_6b": 2}  # preset -> layers (Gemma 2 alternates local and global, twice)


def tiny(name: str, **kw):
    kw = {**TINY, "n_layers": FAMILIES[name], **kw}
    if MODELS[name].rope_scaling == "llama3":
        kw["rope_original_context"] = 8
    return dataclasses.replace(MODELS[name], **kw)


def init(cfg, seed=0):
    mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
    return P.init(param_specs(cfg), jax.random.key(seed), mesh)


def cached_logits(params, cfg, tokens_BT, prompt_lengths, quantize=False):
    """Logits at every position after the prompt, by prefill of the prompts then one decode step per token."""
    B, T = tokens_BT.shape
    P0 = max(prompt_lengths)
    prompts = np.zeros((B, P0), np.int32)
    for b, n in enumerate(prompt_lengths):
        prompts[b, :n] = tokens_BT[b, :n]
    lengths = jnp.asarray(prompt_lengths, jnp.int32)
    logits, cache = jax.jit(decode.prefill, static_argnums=(3, 4, 5))(
        params, jnp.asarray(prompts), lengths, cfg, T, quantize)
    step = jax.jit(decode.decode_step, static_argnums=3)
    out = [[] for _ in range(B)]
    for i in range(T - min(prompt_lengths) + 1):
        for b, n in enumerate(prompt_lengths):
            if n + i <= T:
                out[b].append(np.asarray(logits[b]))
        if i == T - min(prompt_lengths):
            break
        pos = np.minimum(np.asarray(prompt_lengths) + i, T - 1)
        logits, cache = step(params, jnp.asarray(tokens_BT[np.arange(B), pos]), cache, cfg)
    return out


# Gemma 2 (local and global layers, soft-caps, post-norms) runs by default; the rest compile for a minute each
# on a shared 2-core CPU, so they are slow tests.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.default_settings) if n == "gemma2_2b" else
                                  pytest.param(n, marks=pytest.mark.slow) for n in FAMILIES])
def test_cached_decoding_equals_full_forward(name):
    cfg = tiny(name)
    params = init(cfg)
    T = 12  # longer than the window of 5: the ring buffer wraps
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (3, T)).astype(np.int32)
    full = np.asarray(jax.jit(forward, static_argnums=2)(params, jnp.asarray(tokens), cfg))
    lengths = [3, 7, 1]  # prompts of different lengths in one batch, one of them a single token
    got = cached_logits(params, cfg, tokens, lengths)
    for b, n in enumerate(lengths):
        want = full[b, n - 1:]
        assert len(got[b]) == len(want) == T - n + 1
        np.testing.assert_allclose(np.stack(got[b]), want, atol=1e-5, rtol=0)
    assert np.abs(np.diff(full, axis=1)).max() > 0.1  # positions differ: the check above is not vacuous


@pytest.mark.slow
def test_int8_cache_stays_close_to_full_forward():
    cfg = tiny("gemma2_2b")
    params = init(cfg)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 10)).astype(np.int32)
    full = np.asarray(jax.jit(forward, static_argnums=2)(params, jnp.asarray(tokens), cfg))
    got = cached_logits(params, cfg, tokens, [4, 6], quantize=True)
    err = max(np.abs(np.stack(got[b]) - full[b, n - 1:]).max() for b, n in enumerate([4, 6]))
    assert 0 < err < 0.05 * np.abs(full).max()  # int8 rounding shows, but stays small


# ---- sampling ----------------------------------------------------------------------------------------------------

def draws(logits_V, n=2000, **kw):
    settings = dict(temperature=1.0, top_k=0, top_p=1.0) | kw
    logits_BV = jnp.broadcast_to(jnp.asarray(logits_V, jnp.float32), (n, len(logits_V)))
    fn = jax.jit(sampling.sample_tokens)
    return np.asarray(fn(logits_BV, jax.random.key(0), settings["temperature"], settings["top_k"], settings["top_p"]))


LOGITS = np.log(np.array([0.3, 0.05, 0.2, 0.15, 0.01, 0.1, 0.04, 0.12, 0.03]))


def test_top_k_samples_only_the_k_most_likely():
    assert set(draws(LOGITS, top_k=3).tolist()) == {0, 2, 3}
    assert set(draws(LOGITS, top_k=1).tolist()) == {0}


def test_top_p_samples_only_the_nucleus():
    order = np.argsort(-LOGITS, kind="stable")
    probs = np.exp(LOGITS)[order]
    for top_p in (0.3, 0.5, 0.62, 0.9):
        n = int(np.searchsorted(np.cumsum(probs), top_p - 1e-9) + 1)  # smallest prefix with mass >= top_p
        assert set(draws(LOGITS, top_p=top_p).tolist()) == set(order[:n].tolist())
    assert len(set(draws(LOGITS, top_p=0.7).tolist())) == 4
    assert set(draws(LOGITS, top_p=0.7, top_k=2).tolist()) == {0, 2}  # combined: top-k, then top-p of the rest


def test_keep_mask_equals_a_sorting_reference():
    """The bisection cutoffs of top-k and top-p keep exactly the tokens a sort keeps (ties at the k-th value
    all kept, as transformers keeps them)."""
    rng = np.random.default_rng(0)
    logits = np.round(rng.normal(size=(6, 1000)) * 3, 1).astype(np.float32)  # rounded: many ties
    logits[0, :5] = 40.0  # one row whose mass sits in a few tied tokens
    fn = jax.jit(sampling.keep_mask)
    for top_k, top_p in ((0, 0.9), (50, 1.0), (50, 0.5), (1, 1.0), (3, 0.99), (0, 0.3), (999, 0.97), (0, 1e-4)):
        want = np.zeros_like(logits, bool)
        for b, row in enumerate(logits.astype(np.float64)):
            desc = -np.sort(-row)
            kth = desc[min(top_k, len(row)) - 1] if top_k > 0 else desc[-1]
            w = np.where(row >= kth, np.exp(row - row.max()), 0)
            cut = min(v for v in np.unique(row[row >= kth]) if w[row > v].sum() < top_p * w.sum())
            want[b] = row >= cut
        got = np.asarray(fn(jnp.asarray(logits), top_k, top_p))
        np.testing.assert_array_equal(got, want, err_msg=f"top_k={top_k} top_p={top_p}")
    assert np.asarray(fn(jnp.asarray(logits), 2, 1.0))[0].sum() == 5  # the tie at the 2nd value: all 5 kept


def test_zero_temperature_is_greedy_and_seeds_reproduce():
    logits = jax.random.normal(jax.random.key(1), (16, 50))
    greedy = np.argmax(np.asarray(logits), -1)
    fn = jax.jit(sampling.sample_tokens)
    np.testing.assert_array_equal(fn(logits, jax.random.key(0), 0.0, 0, 1.0), greedy)
    np.testing.assert_array_equal(fn(logits, jax.random.key(0), 1e-6, 0, 1.0), greedy)
    hot = [np.asarray(fn(logits, jax.random.key(s), 1.0, 0, 1.0)) for s in (0, 0, 1)]
    np.testing.assert_array_equal(hot[0], hot[1])
    assert (hot[0] != greedy).any() and (hot[0] != hot[2]).any()


def test_greedy_tokens_equal_argmax_with_ties_infinities_and_nans():
    logits = np.array(jax.random.normal(jax.random.key(2), (8, 300)))
    logits[0, [5, 9, 200]] = 9.0  # a tie: the first
    logits[1, :] = -np.inf  # every logit -inf: index 0
    logits[2, [3, 77]] = np.inf
    logits[3, [40, 41]] = np.nan  # a NaN counts as the largest: the first NaN
    logits[4, 299] = 50.0  # the last index
    want = np.asarray(jnp.argmax(jnp.asarray(logits), axis=-1))
    np.testing.assert_array_equal(want[:5], [5, 0, 3, 40, 299])
    for fn in (sampling.greedy_tokens, jax.jit(sampling.greedy_tokens)):
        np.testing.assert_array_equal(fn(jnp.asarray(logits)), want)
        np.testing.assert_array_equal(fn(jnp.asarray(logits[4])), want[4])  # one row, no batch axis


def test_plain_sampling_draws_from_the_softmax():
    """top_k 0 (or >= vocab) and top_p 1 take the branch that draws without sorting: frequencies follow the
    softmax of logits / temperature, every token included."""
    for kw, temperature in ((dict(top_k=0), 1.0), (dict(top_k=len(LOGITS)), 1.0), (dict(top_k=0), 0.5)):
        got = np.bincount(draws(LOGITS, n=20000, temperature=temperature, **kw), minlength=len(LOGITS)) / 20000
        want = np.exp(LOGITS / temperature) / np.exp(LOGITS / temperature).sum()
        np.testing.assert_allclose(got, want, atol=0.012)


@pytest.mark.parametrize("bad, match", [(dict(temperature=-1.0), "temperature=-1.0 must be >= 0"),
                                        (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
                                        (dict(top_p=1.5), "top_p=1.5"), (dict(top_k=-2), "top_k=-2 must be >= 0")])
def test_bad_sampling_settings_fail_with_one_line(bad, match):
    with pytest.raises(ConfigError, match=match):
        config_lib.validate_decode(DecodeConfig(**bad))


def test_generate_stops_per_sequence_and_reproduces():
    cfg = tiny("llama3_1_8b")
    params = init(cfg)
    prompts = [[1, 2, 3], [5], [7, 8, 9, 10, 11]]
    d = DecodeConfig(max_new_tokens=12, temperature=1.0, seed=3)
    a = generate.generate(params, cfg, prompts, d)
    assert a.tokens == generate.generate(params, cfg, prompts, d).tokens
    assert [len(t) for t in a.tokens] == [12, 12, 12]
    stop = a.tokens[1][4]
    b = generate.generate(params, cfg, prompts, d, stop_ids=[stop])
    for got, full in zip(b.tokens, a.tokens):
        n = full.index(stop) + 1 if stop in full else len(full)
        assert got == full[:n]  # each sequence ends at its own stop token, the others go on
    with pytest.raises(ConfigError, match="longer than decode.cache_length=4"):
        generate.generate(params, cfg, prompts, dataclasses.replace(d, cache_length=4))


def test_decode_segments_cover_the_steps_and_hold_their_positions():
    assert generate.segments(16, 272, 256) == [(64, 48), (128, 112), (256, 240), (272, 256)]
    assert generate.segments(80, 100, 20) == [(100, 20)]  # no segment shorter than the prompt
    assert generate.segments(16, 1000, 30) == [(128, 30)]  # done before the cache is full length
    assert generate.segments(16, 2064, 2048) == [(512, 496), (1024, 1008), (2048, 2032), (2064, 2048)]
    for T, length, N in ((16, 272, 256), (48, 300, 252), (130, 200, 70), (16, 5000, 4984), (1024, 1100, 76)):
        ends = [0] + [end for _, end in generate.segments(T, length, N)]
        assert ends[-1] == N and all(a < b for a, b in zip(ends, ends[1:]))
        assert len(ends) <= 1 + generate.MAX_SEGMENTS
        for (S, end) in generate.segments(T, length, N)[:-1]:
            assert T + end - 1 < S  # the last step of a segment writes position < T + end


@pytest.mark.parametrize("name,quantize,unroll", [
    pytest.param("gemma2_2b", False, True, marks=[pytest.mark.default_settings, pytest.mark.slow])]
    + [pytest.param(n, n == "llama3_1_8b", True, marks=pytest.mark.slow)
       for n in ("llama3_1_8b", "gpt2", "mixtral_8x7b", "qwen3_0_6b")]
    + [pytest.param(n, q, False, marks=pytest.mark.slow) for n, q in (("gemma2_2b", False), ("llama3_1_8b", True))])
def test_generate_equals_the_stacked_decode_step(name, quantize, unroll, monkeypatch):
    """generate's loop (the cache growing over three segments; layers and cache taken apart, keys transposed,
    or, for deep models, the scan over stacked layers) samples the tokens of decode.decode_step over the
    stacked full-length cache, step by step, with the same keys (row b's i-th token from key(seed) folded with b
    and i, as the server draws choice b; sampled, not greedy: a tiny random model's greedy output soon repeats
    one token)."""
    monkeypatch.setattr(generate, "UNROLL_LAYERS", 1000 if unroll else 0)
    monkeypatch.setattr(generate, "_EXECUTABLES", {})
    cfg = tiny(name, block_size=160)  # gpt2's learned positions cover the whole cache
    params = init(cfg)
    prompts = [[1, 2, 3], [5], list(range(7, 23))]  # the longest fills its padded length: no slack at the ends
    N = 120  # prompts padded to 16: segments of 64, 128 and 136 slots
    assert len(generate.segments(16, 16 + N, N)) == 3
    got = generate.generate(params, cfg, prompts, DecodeConfig(max_new_tokens=N, temperature=1.0, seed=5,
                                                               quantize_kv_cache=quantize)).tokens
    prompts_BT = np.zeros((3, 16), np.int32)
    for b, p in enumerate(prompts):
        prompts_BT[b, :len(p)] = p
    logits, cache = jax.jit(decode.prefill, static_argnums=(3, 4, 5))(
        params, prompts_BT, np.array([len(p) for p in prompts], np.int32), cfg, 16 + N, quantize)
    step = jax.jit(decode.decode_step, static_argnums=3)
    draw = jax.jit(jax.vmap(lambda logits_V, key: sampling.sample_tokens(logits_V[None], key, 1.0, 0, 1.0)[0]))
    rows, want = sampling.choice_keys(np.full(3, 5, np.uint32), np.arange(3)), []
    for i in range(N):
        want.append(draw(logits, sampling.row_keys(rows, np.full(3, i))))
        logits, cache = step(params, want[-1], cache, cfg)
    assert got == np.stack(want, axis=1).tolist()
    assert min(len(set(t)) for t in got) > 10


# ---- against transformers, and the command line ------------------------------------------------------------------

def test_greedy_generation_matches_transformers(tmp_path):
    torch = require("torch")
    transformers = require("transformers", "hf")
    import jaxlm
    from jaxlm.store import convert

    hf_cfg = transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      hidden_size=64, intermediate_size=96, vocab_size=128, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if p.ndim == 1 else 0.3 * torch.randn(p.shape, generator=g))
    model.save_pretrained(tmp_path / "hf")
    convert.from_hf(str(tmp_path / "hf"), tmp_path / "jx", log=lambda s: None)
    ours = jaxlm.load(tmp_path / "jx")
    for prompt in ([5, 17, 99, 3], [42]):
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                                  pad_token_id=0)[0, len(prompt):].tolist()
        got = ours.generate(prompt, 20, temperature=0.0, stop_ids=(2,))
        assert got == want and len(set(got)) > 3


def test_cli_generates_from_a_run_streams_and_matches_the_python_api(char_data, tmp_path, capsys):
    """`jaxlm generate RUN --prompt ... --prompt-file ... --num-samples 2`: the first sample streams, the others
    follow, timings go to stderr; the texts equal `jaxlm.generate(...)`'s, which works after a bare `import jaxlm`."""
    import subprocess
    import sys

    import jaxlm
    from conftest import tiny_config
    from jaxlm import cli
    from jaxlm.train import loop as train

    run = tmp_path / "run"
    train.train(tiny_config(char_data, run, **{"training.steps": 10}), log=lambda s: None)
    (tmp_path / "prompt.txt").write_text("KING:\n")
    settings = ["max_new_tokens=12", "temperature=0.8", "seed=3"]
    assert cli.main(["generate", str(run), "--prompt", "To be", "--prompt-file", str(tmp_path / "prompt.txt"),
                     "--num-samples", "2", *settings]) == 0
    out, err = capsys.readouterr()
    want = jaxlm.generate(run, ["To be", "KING:\n"], num_samples=2, max_new_tokens=12, temperature=0.8, seed=3)
    assert len(want) == 4 and all(len(t) == 12 for t in want)  # a char vocabulary has no EOS: 12 tokens each
    assert out == "".join(f"--- sample {i + 1} of 4\n{prompt}{text}\n"
                          for i, (prompt, text) in enumerate(zip(["To be"] * 2 + ["KING:\n"] * 2, want)))
    assert len(set(want[:2])) == 2  # two different samples of the same prompt
    assert "prefill" in err and "ms (4 x 6 tokens)" in err and "tokens/s" in err
    bare = subprocess.run([sys.executable, "-c", "import jaxlm; assert callable(jaxlm.generate)"],
                          capture_output=True, text=True)
    assert bare.returncode == 0, bare.stderr
    # mesh.* keys shard the weights (here FSDP over 4 devices); greedy text equals the one-device text (the
    # one-device programs are those compiled above: the temperature is not compiled in).
    greedy = ["--prompt", "To be", "--prompt-file", str(tmp_path / "prompt.txt"), "--num-samples", "2",
              "max_new_tokens=12", "temperature=0"]
    assert cli.main(["generate", str(run), *greedy]) == 0
    one = capsys.readouterr().out
    assert cli.main(["generate", str(run), *greedy, "mesh.ici_data=1", "mesh.ici_fsdp=4"]) == 0
    assert capsys.readouterr().out == one
    model = jaxlm.load(run, config_lib.MeshConfig(ici_data=1, ici_fsdp=4))
    assert len(model.params["embed"]["tokens"].sharding.device_set) == 4
    assert cli.main(["generate", str(run), *greedy, "mesh.ici_data=1", "mesh.ici_fsdp=16"]) == 2
    assert capsys.readouterr().err.startswith("error: the mesh.* axes multiply to 16 devices but 8 are available")


def test_cli_errors_are_one_line(tmp_path, capsys):
    from jaxlm import cli

    assert cli.main(["generate", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
    assert cli.main(["generate", str(tmp_path), "--prompt", "x", "temperature=-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: decode.temperature=-1.0 must be >= 0") and err.count("\n") == 1


def test_generation_on_a_mesh_shards_the_cache_and_matches_one_device():
    """Batch over `data`, kv heads over `tensor` (8 fake devices): the cache is laid out by the logical rules
    and greedy tokens equal those of the one-device run."""
    cfg = tiny("llama3_1_8b")
    prompts = [[1, 2, 3], [5], [7, 8, 9, 10, 11], [4, 4]]
    d = DecodeConfig(max_new_tokens=10, temperature=0.0)
    want = generate.generate(init(cfg), cfg, prompts, d).tokens
    mesh = sharding.make_mesh(MeshConfig(ici_data=4, ici_tensor=2), jax.devices())
    params = P.init(param_specs(cfg), jax.random.key(0), mesh)
    streamed = []  # tokens streamed to the host step by step, as `jaxlm generate` prints them
    got = generate.generate(params, cfg, prompts, d, mesh=mesh,
                            on_tokens=lambda tok, live: streamed.append(np.where(live, tok, -1))).tokens
    assert got == want
    assert [[int(t) for t in col if t >= 0] for col in np.array(streamed).T] == want
    _, cache = generate._prefill(params, np.array([[1, 2], [3, 4], [5, 6], [7, 8]], np.int32),
                                 np.array([2, 2, 1, 2], np.int32), cfg, 16, False, sharding.layout(mesh))
    k = cache.kinds[0].k  # [R, B, K, S, H]
    assert k.sharding.spec[1:3] == ("data", "tensor")  # slots and head width whole
    assert len(k.sharding.device_set) == 8
    assert k.addressable_shards[0].data.shape == (k.shape[0], 1, 1, 16, k.shape[4])


# Tiny models with the options of the 2025-26 families (docs/families.md), for the cached decoders.
TINY_2025 = {
    "gemma3": dict(layer_pattern="local,local,global", n_layers=4, local_rope_theta=100.0, rope_scaling="linear",
                   rope_scaling_factor=4.0, qk_norm=True, norm_plus_one=True, post_norms=True, glu=True),
    "gpt_oss": dict(layer_pattern="local,global", n_layers=2, qkv_bias=True, attn_out_bias=True, attn_sinks=True,
                    n_experts=4, router_bias=True, expert_bias=True, swiglu_limit=7.0, glu=True, activation="silu",
                    rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_context=8),
    "llama4": dict(layer_pattern="chunked,nope", attention_chunk=4, n_layers=4, qk_l2_norm=True, qk_norm=False,
                   attn_temperature_tuning=True, attn_temperature_floor=3, n_experts=4, experts_per_token=1,
                   moe_layer_interval=2, n_shared_experts=1, router_score="sigmoid", router_norm_topk=False,
                   router_weights_input=True, glu=True, activation="silu"),
    "deepseek_v3": dict(n_layers=3, qk_norm=False, kv_lora_rank=8, q_lora_rank=8, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=8, n_experts=4, first_dense_layers=1, n_shared_experts=1,
                        router_score="sigmoid", router_groups=2, router_topk_groups=1, router_balance_bias=True,
                        rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_context=8,
                        rope_yarn_mscale_all_dim=1.0, glu=True, activation="silu"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", TINY_2025)
@pytest.mark.parametrize("quantize", [False, True])
def test_cached_decoding_of_2025_families_equals_full_forward(name, quantize):
    """Prefill then decode_step (the scan over stacked layers, caches in the carry: ring buffers of windows
    and chunks, latents and rotary keys, unrolled first and last layers) give the full forward pass's logits
    at every position; with an int8 cache they stay close."""
    from jaxlm.config import ModelConfig

    cfg = ModelConfig(**{**TINY, "sliding_window": 3, **TINY_2025[name]})
    params = init(cfg)
    T = 12  # past the window of 3 and the chunks of 4
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (3, T)).astype(np.int32)
    full = np.asarray(jax.jit(forward, static_argnums=2)(params, jnp.asarray(tokens), cfg))
    lengths = [3, 7, 1]
    got = cached_logits(params, cfg, tokens, lengths, quantize)
    for b, n in enumerate(lengths):
        err = np.abs(np.stack(got[b]) - full[b, n - 1:]).max()
        assert err < (0.05 * np.abs(full).max() if quantize else 1e-5), (b, err)
    assert np.abs(np.diff(full, axis=1)).max() > 0.1
