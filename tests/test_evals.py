"""`jaxlm eval --tasks` (evals.py): lm-evaluation-harness through the server scores what the model's own logits
score. A perplexity task (rolling log-likelihoods, the first token of each document scored after the tokenizer's
end-of-text token, documents longer than the context in several windows) equals the same sums taken from
`jaxlm.load(...).logits`; log-likelihoods' greedy flags compare token ids. The model is a tiny random Llama
converted from transformers with a byte-level tokenizer whose end-of-text token is its 257th."""

import json

import numpy as np
import pytest

import jaxlm

from conftest import require

require("lm_eval")
require("fastapi")
torch = require("torch")
transformers = require("transformers", "hf")

EOT = "<|endoftext|>"
CONTEXT = 32  # the server's positions (decode.cache_length): the longer documents take several windows
PPL_TASK = """task: jaxlm_test_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
"""


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    """A converted 2-layer random Llama of 257 tokens: the 256 bytes and EOT, the tokenizer's eos_token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from jaxlm.store import convert

    root = tmp_path_factory.mktemp("evals")
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64), attn_implementation="eager").eval()
    with torch.no_grad():  # logits far from uniform, so that scores and greedy tokens differ between positions
        hf.lm_head.weight.mul_(40)
    hf.save_pretrained(root / "hf")
    folder = root / "jx"
    convert.from_hf(str(root / "hf"), folder, log=lambda s: None)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOT, special=True)])
    (folder / "tokenizer").mkdir(exist_ok=True)
    tok.save(str(folder / "tokenizer" / "tokenizer.json"))
    (folder / "tokenizer" / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOT}))
    return folder


def rolling_reference(logits_of, tokens: list[int], prefix: int, window: int) -> float:
    """Sum of log p(token | the tokens before it) over a document, as lm-eval's rolling windows cut it: blocks of
    `window` targets, each after the `window` inputs right before its last target (the first block's inputs
    start with the prefix token)."""
    s = [prefix] + tokens
    total = 0.0
    for first in range(0, len(tokens), window):
        last = min(first + window, len(tokens))  # targets s[first + 1 .. last]
        start = max(0, last - window)
        inputs = s[start:last]
        lp = logits_of(inputs)
        lp = lp - np.logaddexp.reduce(lp, axis=-1, keepdims=True)
        total += sum(lp[j - 1 - start, s[j]] for j in range(first + 1, last + 1))
    return total


@pytest.mark.slow
def test_perplexity_through_jaxlm_eval_equals_the_models_own_logits(byte_model, tmp_path):
    from jaxlm import cli, serve
    from jaxlm.eval import harness as evals

    model = jaxlm.load(byte_model)
    tok = model.tokenizer()
    eot = tok.eos_id
    assert eot == 256 and tok.bos_id is None
    rng = np.random.default_rng(0)
    words = ["the", "king", "queen", "of", "a", "night", "sword", "and", "crown", "said"]
    docs = [" ".join(rng.choice(words, n)) for n in (3, 12, 25)]  # 11 to ~110 bytes: 1 to 4 windows
    data = tmp_path / "ppl.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "ppl.yaml").write_text(PPL_TASK.format(data=data))
    out = tmp_path / "results.json"
    assert cli.main(["eval", str(byte_model), "--tasks", "jaxlm_test_ppl", "--include-path", str(tasks),
                     "--output", str(out), f"decode.cache_length={CONTEXT}", "serve.max_slots=2"]) == 0
    got = json.loads(out.read_text())["results"]["jaxlm_test_ppl"]

    def logits_of(ids):
        return model.logits(np.asarray([ids]))[0].astype(np.float64)

    lls = [rolling_reference(logits_of, tok.encode(d), eot, CONTEXT - 1) for d in docs]
    n_words = sum(len(d.split()) for d in docs)
    n_bytes = sum(len(d.encode()) for d in docs)
    assert got["word_perplexity,none"] == pytest.approx(np.exp(-sum(lls) / n_words), rel=1e-4)
    assert got["bits_per_byte,none"] == pytest.approx(-sum(lls) / n_bytes / np.log(2), rel=1e-4)

    # Through the lm-eval model class: an empty context is the prefix token; greedy flags compare ids.
    cfg = serve.settings_config({"decode.cache_length": CONTEXT, "serve.max_slots": 2})
    server = serve.Server(serve.build(byte_model, cfg, log=lambda s: None), "127.0.0.1", 0).start()
    try:
        lm = evals.server_lm(f"http://127.0.0.1:{server.port}")
        assert lm.prefix_token_id == eot

        class Req:
            def __init__(self, *args):
                self.args = args

        def greedy_text(c):  # the most likely next token's text, if it encodes back to that token alone
            g = int(np.argmax(logits_of(tok.encode(c))[-1]))
            return tok.decode([g]) if tok.encode(tok.decode([g])) == [g] else None

        context = next(c for c in (" ".join(rng.choice(words, 3)) for _ in range(500)) if greedy_text(c))
        greedy_next = greedy_text(context)
        pairs = [("", "the"), (context, greedy_next), (context, greedy_next + " queen")]
        got = lm.loglikelihood([Req(*p) for p in pairs])
        for (context, continuation), (ll, greedy) in zip(pairs, got):
            ids = ([eot] if not context else tok.encode(context)) + tok.encode(continuation)
            n = len(tok.encode(continuation))
            lp = logits_of(ids[:-1])
            lp = lp - np.logaddexp.reduce(lp, axis=-1, keepdims=True)
            assert ll == pytest.approx(sum(lp[j - 1, ids[j]] for j in range(len(ids) - n, len(ids))), abs=1e-4)
            assert greedy == all(np.argmax(lp[j - 1]) == ids[j] for j in range(len(ids) - n, len(ids)))
        assert got[1][1] and not got[2][1]
        rolled = lm.loglikelihood_rolling([Req(d) for d in docs])
        assert rolled == pytest.approx(lls, abs=1e-3)
    finally:
        server.stop()
