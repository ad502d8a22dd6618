"""Speculative decoding (speculative.py, sampling.speculative_accept): greedy tokens identical to `generate`'s
whatever the draft (local layers whose window the sequences outgrow included), every draft token kept when the
draft is the model itself, and sampled tokens distributed as the model's own: a chi-square test of 3-token
continuations against the exact distribution, which the draft's distribution fails."""

import jax
import numpy as np
import pytest

from jaxlm import params as P, sharding
from jaxlm.infer import generate, sampling, speculative
from jaxlm.config import ConfigError, DecodeConfig, MeshConfig, ModelConfig
from jaxlm.model import decode, forward, paged, param_specs
from jaxlm.model.mtp import mtp_logits, mtp_pool, mtp_weights, paged_mtp



def make(seed: int, **kw):
    cfg = ModelConfig(**{**dict(vocab_size=50, block_size=128, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32,
                                sliding_window=8, layer_pattern="local,global", init_std=0.3), **kw})
    return P.init(param_specs(cfg), jax.random.key(seed), sharding.make_mesh(MeshConfig(), jax.devices()[:1])), cfg


def test_greedy_tokens_equal_generate_and_a_perfect_draft_is_always_kept():
    params, cfg = make(0)
    draft, draft_cfg = make(1, n_layers=1, d_model=16, n_heads=2, n_kv_heads=1, layer_pattern="local")
    prompts = [[1, 2, 3], [5], list(range(7, 30))]
    d = DecodeConfig(max_new_tokens=40, temperature=0.0, draft_tokens=3)
    want = generate.generate(params, cfg, prompts, d).tokens
    stop = want[0][17]
    got = speculative.generate_speculative(params, cfg, draft, draft_cfg, prompts, d, stop_ids=[stop])
    for g, w in zip(got.tokens, want):
        assert g == w[:w.index(stop) + 1] if stop in w else g == w
    streamed = []
    got = speculative.generate_speculative(params, cfg, draft, draft_cfg, prompts, d,
                                           on_tokens=lambda tokens, live: streamed.append((tokens, live)))
    assert got.tokens == want and got.proposed > 0 and got.accepted < got.proposed
    assert [[int(t[b]) for t, live in streamed if live[b]] for b in range(3)] == want
    same = speculative.generate_speculative(params, cfg, params, cfg, prompts, d)
    assert same.tokens == want and same.acceptance == 1.0 and same.passes == 10  # 1 + 39 tokens in passes of 4
    with pytest.raises(ConfigError, match="vocabulary"):
        speculative.generate_speculative(params, cfg, *make(2, vocab_size=60), prompts, d)


# a DeepSeek-V3 in miniature: latent attention, a dense layer then experts with a shared one, one multi-token
# prediction module (an MoE block)
DEEPSEEK = dict(n_layers=3, layer_pattern="global", sliding_window=None, qk_norm=False, kv_lora_rank=8,
                q_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_experts=4,
                first_dense_layers=1, n_shared_experts=1, router_score="sigmoid", router_groups=2,
                router_topk_groups=1, glu=True, activation="silu", mtp_layers=1)


def test_the_models_multi_token_prediction_module_drafts():
    """decode.draft=mtp: paged_mtp position by position over its pool gives the logits of
    mtp_logits (the training forward); greedy tokens equal `generate`'s with 1 (decode.draft_tokens'
    default for the module) and 3 draft tokens; with one draft token per pass, the passes and the proposals kept
    are exactly those that the module's greedy tokens over the final text (mtp_logits) give, so the module's cache
    held the right entries at every pass; a model without modules is refused in one line."""
    params, cfg = make(0, vocab_size=12, **DEEPSEEK)
    prompts = [[1, 2, 3], [5], list(range(1, 11)) * 2]
    for k in (None, 3):  # None: the default for the module, one proposal per pass
        d = DecodeConfig(max_new_tokens=60, temperature=0.0, draft_tokens=k)
        want_tokens = generate.generate(params, cfg, prompts, d).tokens
        got = speculative.generate_speculative(params, cfg, None, None, prompts, d)
        assert got.tokens == want_tokens and got.proposed > 0
        if k is None:
            ones = got, want_tokens
    # The training forward's module logits of every text at once (one program: the forward is causal and the
    # experts dropless, so the zeros after a shorter text change none of its positions): the sequence below, then
    # each prompt with its greedy tokens.
    seq = np.asarray([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 3, 2, 1, 0, 5, 6, 7, 1, 2]], np.int32)
    T = seq.shape[1]
    texts = [seq[0].tolist()] + [prompt + new for prompt, new in zip(prompts, ones[1])]
    padded = np.zeros((len(texts), max(map(len, texts))), np.int32)
    for i, text in enumerate(texts):
        padded[i, :len(text)] = text
    module_logits = np.asarray(jax.jit(mtp_logits, static_argnums=2)(params, padded, cfg))[0]

    want = module_logits[0, :T]
    table, zero = np.arange(2, dtype=np.int32)[None], np.zeros((1,), np.int32)
    _, h_BTD, _ = jax.jit(decode.paged_forward, static_argnums=6, static_argnames="hidden")(
        params, paged.init(cfg, 2, 16), seq, zero, zero + T, table, cfg, hidden=True)
    weights, pool = mtp_weights(params, cfg), mtp_pool(cfg, 2, 16)
    half = T // 2  # a chunk, then position by position (compiled, as the engine runs it)
    step = jax.jit(paged_mtp, static_argnums=8)
    logits, _, pool = step(params, weights, pool, seq[:, 1:half + 1], h_BTD[:, :half], zero, zero + half, table, cfg)
    got = [np.asarray(logits[0])]
    for t in range(half, T - 1):
        logits, _, pool = step(params, weights, pool, seq[:, t + 1:t + 2], h_BTD[:, t:t + 1], zero + t,
                               zero + t + 1, table, cfg)
        got.append(np.asarray(logits[0]))
    np.testing.assert_allclose(np.stack(got), want[half - 1:T - 1], atol=1e-4)

    got, want_tokens = ones
    proposed = kept = 0
    for i, (prompt, new) in enumerate(zip(prompts, want_tokens)):
        text = prompt + new
        greedy = np.argmax(module_logits[i + 1, :len(text)], -1)
        at = len(prompt)  # a pass from the pending token at `at`: the module's token after it is proposed
        while at - len(prompt) + 1 < len(new):
            ok = int(greedy[at - 1] == text[at + 1])
            proposed, kept, at = proposed + 1, kept + ok, at + 1 + ok
    assert (got.proposed, got.accepted) == (proposed, kept) and 0 < kept < proposed
    with pytest.raises(ConfigError, match="no.*multi-token prediction|multi-token prediction.*none"):
        speculative.generate_speculative(*make(0), None, None, prompts, d)


def chi_square_quantile(dof: int, z: float = 3.09) -> float:
    """The chi-square distribution's quantile at the standard normal's z (3.09: p = 0.001), Wilson-Hilferty."""
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def exact_distribution(params, cfg, V: int) -> np.ndarray:
    """[V, V, V]: the probability of each 3-token continuation of the prompt [1, 2] under the model's sampling at
    temperature 0.8 and top_k 3 (its own forward pass, filtered as sampling.probabilities filters it)."""
    prefixes = [(a, b) for a in range(V) for b in range(V)]
    logits = forward(params, np.asarray([[1, 2, a, b] for a, b in prefixes], np.int32), cfg)[:, 1:]
    probs = np.asarray(sampling.probabilities(logits.reshape(-1, V), *(np.full(len(prefixes) * 3, x)
                                                                       for x in (0.8, 3, 1.0))), np.float64)
    probs = probs.reshape(len(prefixes), 3, V)
    out = np.zeros((V,) * 3)
    for i, (a, b) in enumerate(prefixes):
        out[a, b] = probs[i, 0, a] * probs[i, 1, b] * probs[i, 2]
    return out


def chi_square(counts: np.ndarray, pr: np.ndarray, n: int) -> tuple[float, int]:
    """Pearson's statistic of `counts` (n draws) against probabilities `pr`, cells expecting fewer than 5 merged
    into one, and its degrees of freedom."""
    big = n * pr >= 5
    rest = n * pr[~big].sum()
    stat = (((counts - n * pr)[big] ** 2 / (n * pr)[big])).sum()
    if rest > 0:
        stat += (counts[~big].sum() - rest) ** 2 / rest
    return stat, int(big.sum()) + (rest > 0) - 1


@pytest.mark.slow
@pytest.mark.in_ci  # 10-15 s each
@pytest.mark.parametrize("drafter", ["model", "mtp"])
def test_sampled_tokens_keep_the_models_distribution(drafter):
    """3000 continuations of 3 tokens from a 4-token vocabulary at temperature 0.8 and top_k 3, two draft tokens
    per pass from a draft that disagrees often (a small model; or the model's own multi-token prediction module,
    random): the 64 outcomes' frequencies pass a chi-square test (p > 0.001, cells expecting fewer than 5
    merged) against the model's exact distribution (its own forward pass, filtered as sampling.probabilities
    filters it), and fail it against the draft model's."""
    V, n = 4, 3000
    d = DecodeConfig(max_new_tokens=3, temperature=0.8, top_k=3, draft_tokens=2, seed=7)
    if drafter == "mtp":
        params, cfg = make(2, vocab_size=V, init_std=0.15, **DEEPSEEK)
        draft = draft_cfg = None
    else:
        params, cfg = make(2, vocab_size=V, init_std=0.15)
        draft, draft_cfg = make(3, vocab_size=V, n_layers=1, layer_pattern="global", init_std=0.5)
    out = speculative.generate_speculative(params, cfg, draft, draft_cfg, [[1, 2]] * n, d)
    assert 0.2 < out.acceptance < 0.9, out.acceptance
    counts = np.zeros((V,) * 3)
    for s in out.tokens:
        counts[tuple(s)] += 1

    stat, dof = chi_square(counts, exact_distribution(params, cfg, V), n)
    assert dof >= 20 and stat < chi_square_quantile(dof), (stat, dof)
    if draft is not None:
        stat, dof = chi_square(counts, exact_distribution(draft, draft_cfg, V), n)
        assert stat > 10 * chi_square_quantile(dof)


def test_decode_draft_mtp_through_the_commands(char_data, tmp_path, capsys):
    """`jaxlm generate RUN decode.draft=mtp` and `jaxlm serve RUN decode.draft=mtp` on a run trained with a
    multi-token prediction module: greedy text equals the text without the draft (2 draft tokens, and the
    default of 1 in the server), the end line counts the proposals; a run without modules is refused in one
    line."""
    import httpx

    from conftest import tiny_config
    from jaxlm import cli, serve
    from jaxlm.train import loop as train

    run, plain_run = tmp_path / "mtp", tmp_path / "plain"
    train.train(tiny_config(char_data, run, **{"model.mtp_layers": 1, "training.steps": 10}), log=lambda s: None)
    greedy = ["--prompt", "To be", "max_new_tokens=24", "temperature=0"]
    assert cli.main(["generate", str(run), *greedy]) == 0
    want = capsys.readouterr().out
    assert cli.main(["generate", str(run), *greedy, "decode.draft=mtp", "decode.draft_tokens=2"]) == 0
    out, err = capsys.readouterr()
    assert out == want and "draft tokens accepted" in err
    cfg = serve.settings_config({"serve.max_slots": 2, "max_new_tokens": 24, "decode.draft": "mtp"})
    srv = serve.Server(serve.build(run, cfg, log=lambda s: None), "127.0.0.1", 0).start()
    try:
        assert srv.served.engine.draft.k == 1  # decode.draft_tokens' default for the module
        r = httpx.post(f"http://127.0.0.1:{srv.port}/v1/completions", timeout=120, json={
            "prompt": "To be", "max_tokens": 24, "temperature": 0})
        assert "To be" + r.json()["choices"][0]["text"] == want.split("\n", 1)[1].rstrip("\n")
        assert srv.served.engine.draft_proposed_total > 0
    finally:
        srv.stop()
    train.train(tiny_config(char_data, plain_run, **{"training.steps": 5}), log=lambda s: None)
    assert cli.main(["generate", str(plain_run), *greedy, "decode.draft=mtp"]) == 2
    err = capsys.readouterr().err
    assert "multi-token prediction" in err and err.count("\n") == 1
