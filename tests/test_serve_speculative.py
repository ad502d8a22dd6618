"""Speculative decoding in the server's engine (serve/speculate.py; `jaxlm serve MODEL decode.draft=PATH`): greedy
tokens and their log-probabilities equal the engine's without a draft (stop tokens, max_tokens, shared prompt
prefixes, preemption in a small pool of pages, rows of a call at different points), a draft equal to the model
keeps every token it proposes, pages all come back, and sampled tokens keep the model's distribution: a
chi-square test of 3-token continuations against the exact distribution, which the draft's fails. (The command's
path, decode.draft through serve.build and HTTP, is in test_serve.py.)"""

import dataclasses

import jax
import numpy as np
import pytest

from jaxlm import params as P, sharding
from jaxlm.config import ConfigError, MeshConfig, ModelConfig, ServeConfig
from jaxlm.model import param_specs
from jaxlm.serve.engine import Engine
from jaxlm.serve.requests import Sequence
from jaxlm.infer.speculative import Draft

import test_speculative
from test_speculative import chi_square_quantile



def make(seed: int, **kw):
    cfg = ModelConfig(**{**dict(vocab_size=50, block_size=128, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32,
                                sliding_window=8, layer_pattern="local,global", init_std=0.3), **kw})
    return P.init(param_specs(cfg), jax.random.key(seed), sharding.make_mesh(MeshConfig(), jax.devices()[:1])), cfg


def run(engine, seqs, timeout=300):
    events = engine.run(seqs, timeout)
    assert engine.pages_used() == 0 and not any(engine.slots)
    return [([t for e in ev if e[0] == "tokens" for t in e[1]],
             [lp for e in ev if e[0] == "tokens" for lp in (e[2] or [])], ev[-1]) for ev in events]


def seven_sequences():
    """Seven greedy prompts of a 50-token vocabulary (two sharing a two-page prefix of 4-position pages), their
    max_tokens, and `seqs(stop)` making their Sequences (the third stops at `stop`, the fifth wants no
    log-probabilities)."""
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 50, 9).tolist()
    prompts = [rng.integers(0, 50, n).tolist() for n in (5, 13, 3, 11, 2)] + [shared + [7], shared + [8, 9]]
    max_tokens = [30, 14, 24, 1, 20, 16, 12]

    def seqs(stop=()):
        return [Sequence(p, max_tokens[i], 0.0, 0, 1.0, i, 0, stop if i == 2 else (), None, logprobs=i != 4)
                for i, p in enumerate(prompts)]

    return rng, max_tokens, seqs


def test_greedy_tokens_and_logprobs_equal_the_engine_without_a_draft():
    """Seven greedy sequences (two sharing a two-page prompt prefix, one stopping at a stop token, one without
    log-probabilities, max_tokens 1 to 30) in 3 slots and a pool of 14 pages of 4 positions, so that sequences
    are preempted and prefilled again: with a small draft (3 proposals per pass) each gets the tokens, ending
    and log-probabilities (to 1e-4) of the engine without one; with the model itself as the draft every proposal
    is kept, in fewer decode calls."""
    params, cfg = make(0)
    draft, draft_cfg = make(1, n_layers=1, d_model=16, n_heads=2, n_kv_heads=1, layer_pattern="local")
    _, max_tokens, seqs = seven_sequences()

    def engine(d):
        return Engine(params, cfg, ServeConfig(max_slots=3, max_queue=16, prefill_chunk=8, prefix_cache=2,
                                               decode_steps=4, page_size=4), 48, cache_pages=14, draft=d)

    plain = engine(None)
    want = run(plain, seqs())
    stop = want[2][0][6]
    want[2] = (want[2][0][:want[2][0].index(stop) + 1], want[2][1][:want[2][0].index(stop) + 1], ("done", "stop"))
    for d in (Draft(draft, draft_cfg, 3), Draft(params, cfg, 3)):
        e = engine(d)
        got = run(e, seqs((stop,)))
        assert e.preempted_total > 0 and e.prefix_hits_total > 0
        for (tg, lg, end_g), (tw, lw, end_w), m in zip(got, want, max_tokens):
            assert tg == tw and end_g == end_w
            np.testing.assert_allclose(lg, lw, rtol=0, atol=1e-4)
        assert [len(t) for t, _, _ in got[:2]] == max_tokens[:2] and got[4][1] == []
        if d.params is params:
            assert e.draft_accepted_total == e.draft_proposed_total > 0
            assert e.calls_total < plain.calls_total
        else:
            assert 0 < e.draft_accepted_total < e.draft_proposed_total
    with pytest.raises(ValueError, match="paged KV cache"):
        Engine(params, cfg, ServeConfig(max_slots=3, max_queue=4, prefix_cache=0, page_size=0), 48,
               draft=Draft(draft, draft_cfg, 3))
    with pytest.raises(ValueError, match="vocabulary"):
        Engine(params, cfg, ServeConfig(max_slots=3, max_queue=4, prefix_cache=0, page_size=4), 48,
               draft=Draft(*make(2, vocab_size=60), 3))
    learned = make(3, n_layers=1, layer_pattern="global", position="learned", block_size=32)
    with pytest.raises(ValueError, match="learned positions up to 32"):
        Engine(params, cfg, ServeConfig(max_slots=3, max_queue=4, prefix_cache=0, page_size=4), 48,
               draft=Draft(*learned, 3))


def test_the_models_multi_token_prediction_module_drafts_in_the_engine():
    """decode.draft=mtp in the engine (a DeepSeek-V3 in miniature, test_speculative.DEEPSEEK): the seven greedy
    sequences of the test above (shared prefixes, a stop token, preemption) get the engine's tokens, endings and
    log-probabilities without a draft at 1 and 3 proposals per pass; and one sequence alone, one proposal per
    pass, keeps exactly the proposals that the module's greedy tokens over its final text (mtp_logits)
    give, so the module's pool and the state each slot keeps between calls held the right entries at every pass."""
    from jaxlm.model.mtp import mtp_logits

    params, cfg = make(0, **test_speculative.DEEPSEEK)
    rng, max_tokens, seqs = seven_sequences()

    def engine(d):
        return Engine(params, cfg, ServeConfig(max_slots=3, max_queue=16, prefill_chunk=8, prefix_cache=2,
                                               decode_steps=4, page_size=4), 48, cache_pages=14, draft=d)

    want = run(engine(None), seqs())
    stop = want[2][0][6]
    want[2] = (want[2][0][:want[2][0].index(stop) + 1], want[2][1][:want[2][0].index(stop) + 1], ("done", "stop"))
    for k in (1, 3):
        e = engine(Draft(None, None, k))
        got = run(e, seqs((stop,)))
        assert e.preempted_total > 0 and e.prefix_hits_total > 0 and e.draft_proposed_total > 0
        for (tg, lg, end_g), (tw, lw, end_w) in zip(got, want):
            assert tg == tw and end_g == end_w
            np.testing.assert_allclose(lg, lw, rtol=0, atol=1e-4)

    prompt = rng.integers(0, 50, 11).tolist()  # two chunks of prefill, then 36 tokens over 9+ calls
    e = engine(Draft(None, None, 1))  # alone in the engine (the programs of the run above, compiled once)
    (tokens, _, _), = run(e, [Sequence(prompt, 36, 0.0, 0, 1.0, 0, 0, (), None, logprobs=False)])
    text = prompt + tokens
    module_logits = jax.jit(mtp_logits, static_argnums=2)(params, np.asarray([text]), cfg)  # compiled: seconds less
    greedy = np.argmax(np.asarray(module_logits)[0, 0], -1)
    proposed = kept = 0
    at = len(prompt)  # a pass from the pending token at `at` proposes the module's token after it
    while at - len(prompt) + 1 < len(tokens):
        ok = int(greedy[at - 1] == text[at + 1])
        proposed, kept, at = proposed + 1, kept + ok, at + 1 + ok
    assert (e.draft_proposed_total, e.draft_accepted_total) == (proposed, kept) and kept > 0
    with pytest.raises(ConfigError, match="multi-token prediction"):
        Engine(params, dataclasses.replace(cfg, mtp_layers=0),
               ServeConfig(max_slots=3, max_queue=4, prefix_cache=0, page_size=4), 48, draft=Draft(None, None, 2))


def test_sampled_tokens_keep_the_models_distribution():
    """1,500 continuations of 3 tokens from a 4-token vocabulary at temperature 0.8 and top_k 3 (each its own
    seed), two proposals per pass from a draft that disagrees often, 32 slots: the 64 outcomes' frequencies
    pass a chi-square test (p > 0.001) against the model's exact distribution and fail it against the
    draft's."""
    V, n = 4, 1500
    params, cfg = make(2, vocab_size=V, init_std=0.15)
    draft, draft_cfg = make(3, vocab_size=V, n_layers=1, layer_pattern="global", init_std=0.5)
    e = Engine(params, cfg, ServeConfig(max_slots=32, max_queue=n, prefill_chunk=16, prefix_cache=0, decode_steps=2,
                                        page_size=4), 16, draft=Draft(draft, draft_cfg, 2))
    out = run(e, [Sequence([1, 2], 3, 0.8, 3, 1.0, 1000 + i, 0, (), None, logprobs=False) for i in range(n)])
    assert 0.2 < e.draft_accepted_total / e.draft_proposed_total < 0.9
    counts = np.zeros((V,) * 3)
    for tokens, _, _ in out:
        counts[tuple(tokens)] += 1
    stat, dof = test_speculative.chi_square(counts, test_speculative.exact_distribution(params, cfg, V), n)
    assert dof >= 20 and stat < chi_square_quantile(dof), (stat, dof)
    stat, dof = test_speculative.chi_square(counts, test_speculative.exact_distribution(draft, draft_cfg, V), n)
    assert stat > 10 * chi_square_quantile(dof)

