"""Speculative decoding (speculative.py, sampling.speculative_accept): greedy tokens identical to `generate`'s
whatever the draft (local layers whose window the sequences outgrow included), every draft token kept when the
draft is the model itself, and sampled tokens distributed as the model's own: a chi-square test of 3-token
continuations against the exact distribution, which the draft's distribution fails."""

import jax
import numpy as np
import pytest

from jaxlm import generate, params as P, sampling, sharding, speculative
from jaxlm.config import ConfigError, DecodeConfig, MeshConfig, ModelConfig
from jaxlm.model import forward, param_specs


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
def test_sampled_tokens_keep_the_models_distribution():
    """3000 continuations of 3 tokens from a 4-token vocabulary at temperature 0.8 and top_k 3, two draft tokens
    per pass from a draft that disagrees often: the 64 outcomes' frequencies pass a chi-square test (p > 0.001,
    cells expecting fewer than 5 merged) against the model's exact distribution (its own forward pass, filtered
    as sampling.probabilities filters it), and fail it against the draft's."""
    V, n = 4, 3000
    params, cfg = make(2, vocab_size=V, init_std=0.15)
    draft, draft_cfg = make(3, vocab_size=V, n_layers=1, layer_pattern="global", init_std=0.5)
    d = DecodeConfig(max_new_tokens=3, temperature=0.8, top_k=3, draft_tokens=2, seed=7)
    out = speculative.generate_speculative(params, cfg, draft, draft_cfg, [[1, 2]] * n, d)
    assert 0.2 < out.acceptance < 0.9
    counts = np.zeros((V,) * 3)
    for s in out.tokens:
        counts[tuple(s)] += 1

    stat, dof = chi_square(counts, exact_distribution(params, cfg, V), n)
    assert dof >= 20 and stat < chi_square_quantile(dof), (stat, dof)
    stat, dof = chi_square(counts, exact_distribution(draft, draft_cfg, V), n)
    assert stat > 10 * chi_square_quantile(dof)
