"""Preference tuning: `jaxlm prepare preference` stores whole pairs with masks on the replies, the loader never
splits a pair and resumes exactly, the dpo/ipo/orpo losses, rewards and log-probabilities of a first step equal
PyTorch's on the same Hugging Face model (TRL's formulas), accumulation and sharding do not change them, runs
resume exactly, a LoRA run's base is its reference, DPO moves a model's answers, and bad input fails in one line."""

import json
import math

import jax
import numpy as np
import pytest

from conftest import require, tiny_config
from jaxlm import cli, config as config_lib
from jaxlm.train import (batches as batch_lib, loop as train, objectives, reference, run as run_lib, state as state_lib,
                         step as step_lib)
from jaxlm.data import bpe, loader as loader_lib, preference, prepare, shards, tokenizer
from jaxlm.data.errors import DataError

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def write_records(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def random_records(n, seed=0, prompt=(3, 12), reply=(1, 9)):
    """Pairs of random lowercase text: prompts and replies of random lengths, chosen != rejected."""
    rng = np.random.default_rng(seed)
    word = lambda lo, hi: "".join(rng.choice(list("abcdefghij "), rng.integers(lo, hi)))  # noqa: E731
    out = []
    for _ in range(n):
        chosen, rejected = word(*reply), word(*reply)
        out.append({"prompt": "q:" + word(*prompt), "chosen": chosen, "rejected": rejected + "!"})
    return out


def prepare_pairs(tmp_path, records, name="pairs", **kw):
    kw = {"val_fraction": 0.2, "workers": 0, "progress": False, **kw}
    out = tmp_path / name
    prepare.prepare_preference([str(write_records(tmp_path / f"{name}.jsonl", records))], out, "byte", **kw)
    return out


def pairs_of(folder, split="train"):
    """Each stored pair as ((ids, mask) of prompt + chosen, (ids, mask) of prompt + rejected)."""
    meta = json.loads((folder / "meta.json").read_text())
    s = shards.Split(folder, meta, split)
    docs = [(s.document(i), s.take(np.arange(s.doc_starts_D1[i], s.doc_starts_D1[i + 1]), mask=True))
            for i in range(s.n_documents)]
    return list(zip(docs[::2], docs[1::2]))


# ---- prepare ----------------------------------------------------------------------------------------------------

@pytest.fixture
def chat_tok(tmp_path):
    """A byte-level BPE saved with a tokenizer_config.json and this file's chat template."""
    text = tmp_path / "t.txt"
    text.write_text("the user asks and the assistant answers\n" * 50)
    d = bpe.train_bpe([str(text)], 300, tmp_path / "tok", special_tokens=("</s>",))
    cfg = json.loads((d / "tokenizer_config.json").read_text()) | {"chat_template": TEMPLATE}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_text_records_store_prompt_plus_reply_with_the_reply_masked(tmp_path):
    recs = [{"prompt": "ask", "chosen": " yes", "rejected": " no"}, {"prompt": "Q?", "chosen": "ab", "rejected": "b"}]
    out = prepare_pairs(tmp_path, recs, val_fraction=0)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["kind"] == "preference" and meta["has_loss_mask"] and meta["splits"]["train"]["documents"] == 4
    got = [[(bytes(ids.astype(np.uint8)), bytes(ids[mask > 0].astype(np.uint8))) for ids, mask in pair]
           for pair in pairs_of(out)]
    assert got == [[(b"ask yes", b" yes"), (b"ask no", b" no")], [(b"Q?ab", b"ab"), (b"Q?b", b"b")]]


def test_chat_records_mask_the_reply_turn_only(tmp_path, chat_tok):
    hi, ask = {"role": "user", "content": "hi"}, {"role": "user", "content": "and?"}
    said = {"role": "assistant", "content": "the answer"}
    recs = [  # an explicit prompt (replies as a string and as messages), and whole conversations sharing turns
        {"prompt": [hi], "chosen": "the answer", "rejected": [{"role": "assistant", "content": "more"}]},
        {"chosen": [hi, said, ask, {"role": "assistant", "content": "yes"}],
         "rejected": [hi, said, ask, {"role": "assistant", "content": "no"}]}]
    out = tmp_path / "o"
    prepare.prepare_preference([str(write_records(tmp_path / "c.jsonl", recs))], out, str(chat_tok), val_fraction=0,
                               workers=0, progress=False)
    tok = tokenizer.load(chat_tok)
    replies = [[tok.decode(ids[mask > 0].tolist()) for ids, mask in pair] for pair in pairs_of(out)]
    assert replies == [["the answer</s>", "more</s>"], ["yes</s>", "no</s>"]]
    ids, _ = pairs_of(out)[1][0]
    assert tok.decode(ids.tolist()) == "<user>hi</s><assistant>the answer</s><user>and?</s><assistant>yes</s>"


def test_validation_pairs_stay_whole(tmp_path):
    out = prepare_pairs(tmp_path, random_records(50), val_fraction=0.2)
    train_pairs, val_pairs = pairs_of(out), pairs_of(out, "val")
    assert (len(train_pairs), len(val_pairs)) == (40, 10)
    for (c_ids, c_mask), (r_ids, r_mask) in train_pairs + val_pairs:  # the same prompt before both replies
        p = int(np.argmax(c_mask))
        assert p == int(np.argmax(r_mask)) and np.array_equal(c_ids[:p], r_ids[:p]) and not c_mask[:p].any()


def run_cli(args, capsys):
    code = cli.main(args)
    return code, capsys.readouterr().err.strip()


BAD = {  # name -> (records, extra arguments, the error after "error: FILE:LINE: ")
    "missing field": ([{"prompt": "a", "chosen": "b"}], [],
                      "a preference record needs `prompt`, `chosen` and `rejected` (`prompt` may be left out when "
                      "chosen and rejected are conversations sharing their first turns); fields: prompt, chosen"),
    "chosen equals rejected": ([{"prompt": "a", "chosen": "same", "rejected": "same"}], [],
                               "`chosen` and `rejected` are the same reply, so the pair prefers neither; fix or drop "
                               "the record"),
    "prompt longer than the block": ([{"prompt": "x" * 100, "chosen": "a", "rejected": "b"}], ["--max-tokens", "64"],
                                     "the pair is 202 tokens (prompt twice and both replies) and --max-tokens is 64; "
                                     "a pair is never cut: raise --max-tokens (and model.block_size), or drop such "
                                     "pairs with --drop-long"),
    "same conversations": ([{"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                             "rejected": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}],
                           [], "`chosen` and `rejected` are the same conversation, so the pair prefers neither; fix "
                               "or drop the record"),
    "reply is not the assistant's": ([{"prompt": [{"role": "user", "content": "a"}],
                                       "chosen": [{"role": "user", "content": "b"}], "rejected": "c"}], [],
                                     "`chosen`'s reply must start with an assistant turn after the prompt's turns, "
                                     "and it starts with a user turn"),
    "messages without a chat template": ([{"prompt": [{"role": "user", "content": "a"}], "chosen": "b",
                                           "rejected": "c"}], [],
                                         "the tokenizer byte has no chat template; give one with --chat-template "
                                         "FILE (a Jinja template as in tokenizer_config.json)"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_preference_input_is_one_line_and_leaves_nothing_finished(tmp_path, capsys, name):
    records, extra, message = BAD[name]
    good = {"prompt": "ok", "chosen": "fine", "rejected": "bad"}
    f = write_records(tmp_path / "p.jsonl", [good, *records, good])
    out = tmp_path / "out"
    code, err = run_cli(["prepare", "preference", str(f), "--tokenizer", "byte", "--out", str(out), "--workers", "0",
                         "--val-fraction", "0", "--no-progress", *extra], capsys)
    assert code == 2 and err == f"error: {f}:2: {message}"
    assert not (out / "meta.json").exists() and not list(out.glob("*.bin"))


def test_drop_long_drops_and_counts(tmp_path, capsys):
    f = write_records(tmp_path / "p.jsonl", [{"prompt": "ok", "chosen": "fine", "rejected": "bad"},
                                             {"prompt": "x" * 100, "chosen": "a", "rejected": "b"}])
    assert cli.main(["prepare", "preference", str(f), "--tokenizer", "byte", "--out", str(tmp_path / "o"),
                     "--workers", "0", "--val-fraction", "0", "--max-tokens", "64", "--drop-long"]) == 0
    out = capsys.readouterr().out
    assert f"1 pairs over --max-tokens dropped, first dropped: {f}:2 (202 tokens > 64)" in out
    assert "wrote {}: train 1 pairs".format(tmp_path / "o") in out
    meta = json.loads((tmp_path / "o" / "meta.json").read_text())
    assert meta["splits"]["train"]["documents"] == 2 and meta["skipped"]["long_pairs_dropped"] == 1


def test_runs_refuse_data_of_the_other_kind_and_pairs_longer_than_the_block(tmp_path, char_data, capsys):
    pairs = prepare_pairs(tmp_path, random_records(20, prompt=(30, 31), reply=(3, 4)), val_fraction=0.2)
    common = ["quickstart", "model.n_layers=1", "model.d_model=32", "model.n_heads=2", "training.batch_size=4",
              "logging.progress=false", "optimizer.warmup_steps=1", "training.steps=2"]
    cases = [([f"data.dir={char_data}", "training.objective=dpo"],
              f"error: training.objective=dpo trains on preference pairs, and {char_data} holds none (its meta.json "
              "has no kind=preference); prepare them with `jaxlm prepare preference`"),
             ([f"data.dir={pairs}", "model.block_size=64"],
              f"error: {pairs} holds preference pairs (`jaxlm prepare preference`), which "
              "training.objective=next_token does not read; train on them with training.objective=dpo, ipo or orpo"),
             ([f"data.dir={pairs}", "model.block_size=64", "training.objective=orpo"],
              f"error: pair 0 of the train split of {pairs} is 71 tokens (prompt twice and both replies), more than a "
              "row of model.block_size=64 holds; a pair is never cut: set model.block_size to at least 70, or "
              "prepare the data again with --max-tokens 64 --drop-long")]
    for settings, message in cases:
        run_dir = tmp_path / "run"
        code, err = run_cli(["train", *common, *settings, f"run_dir={run_dir}"], capsys)
        assert code == 2 and err == message
        assert not run_dir.exists()


# ---- the loader ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pairs_data(tmp_path_factory):
    return prepare_pairs(tmp_path_factory.mktemp("pairs"), random_records(60, seed=1), val_fraction=0.1)


@pytest.mark.parametrize("packed", [False, True])
def test_rows_hold_whole_pairs_as_two_segments(pairs_data, packed):
    meta = json.loads((pairs_data / "meta.json").read_text())
    split = shards.Split(pairs_data, meta, "train")
    stored = pairs_of(pairs_data)
    T, B = 48, 4
    loader = preference.PairLoader(split, T, B, 2, seed=3, packed=packed)
    seen = []
    for _ in range(4):
        plan = loader.next()
        b = plan.read(split, (slice(None), slice(None)), slice(None), loader_lib.batch_keys(True, True), T)
        rows = plan.rows(split, np.arange(2 * B), T)
        for r in range(2 * B):
            tokens, seg, pos = rows["tokens"][r], rows["segment_ids"][r], rows["positions"][r]
            n_pairs = int(seg.max() + 1) // 2
            assert n_pairs >= 1 and (n_pairs == 1 or packed)
            for k in range(n_pairs):
                docs = []
                for s in (2 * k + 1, 2 * k + 2):
                    at = np.flatnonzero(seg == s)
                    assert np.array_equal(at, np.arange(at[0], at[-1] + 1))  # one run of columns
                    assert np.array_equal(pos[at], np.arange(len(at)))
                    docs.append(tokens[at])
                match = [i for i, (c, rj) in enumerate(stored) if np.array_equal(c[0], docs[0])
                         and np.array_equal(rj[0], docs[1])]
                assert len(match) == 1  # a stored pair, whole: its chosen then its rejected document
                seen.append(match[0])
                c_mask, r_mask = stored[match[0]][0][1], stored[match[0]][1][1]
                # weights: 1 exactly on the targets that are reply tokens of their own segment
                flat = b["weights"].reshape(2 * B, T)[r]
                for s, mask in ((2 * k + 1, c_mask), (2 * k + 2, r_mask)):
                    at = np.flatnonzero(seg[:T + 1] == s)
                    assert np.array_equal(flat[at[:-1]], mask[1:].astype(np.float32))
            assert not b["weights"].reshape(2 * B, T)[r][seg[1:] == 0].any()
    counts = np.bincount(seen, minlength=len(stored))
    assert counts.max() - counts.min() <= 1 if not packed else counts.max() <= 2  # epochs of a permutation


def test_loader_resumes_exactly(pairs_data):
    meta = json.loads((pairs_data / "meta.json").read_text())
    split = shards.Split(pairs_data, meta, "train")
    whole = preference.PairLoader(split, 40, 3, 2, seed=5, packed=True)
    plans = [whole.next().pieces for _ in range(7)]
    part = preference.PairLoader(split, 40, 3, 2, seed=5, packed=True)
    for _ in range(3):
        part.next()
    state = json.loads(json.dumps(part.state()))  # as a checkpoint stores it
    again = preference.PairLoader(split, 40, 3, 2, seed=0, packed=True)
    again.restore(state)
    assert [again.next().pieces for _ in range(4)] == plans[3:]
    padded = preference.PairLoader(split, 40, 3, 2, seed=5, packed=False)
    with pytest.raises(DataError, match=r"data.packing True there, False here"):
        padded.restore(state)


# ---- the objectives against PyTorch -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """Two tiny random Llamas made with transformers (the policy and another model to serve as reference),
    each converted with `jaxlm convert from-hf`, and preference data in their byte vocabulary."""
    torch = require("torch")
    transformers = require("transformers", "hf")
    from jaxlm.store import convert

    d = tmp_path_factory.mktemp("hf")
    hf_cfg = transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      hidden_size=64, intermediate_size=96, vocab_size=256,
                                      max_position_embeddings=128)
    models = {}
    for seed, name in enumerate(("policy", "reference")):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager").eval()
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # weights large enough that the two models' log-probabilities differ a lot
            for p in model.parameters():
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if p.ndim == 1
                        else 0.08 * torch.randn(p.shape, generator=g))
        model.save_pretrained(d / name)
        convert.from_hf(str(d / name), d / f"{name}-jx", log=lambda s: None)
        models[name] = model
    data = prepare_pairs(d, random_records(40, seed=2), val_fraction=0.2)
    return d, models, data


def torch_reply_logps(model, ids, mask):
    """Sum and mean of log p(token) over the reply's tokens of one document, as TRL's DPOTrainer computes a
    completion's log-probability (log_softmax of the logits, gathered at the labels, masked to the completion)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor(ids[None].astype(np.int64))).logits[0, :-1].double()
    logps = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:].astype(np.int64))[:, None])[:, 0].numpy()
    m = mask[1:] > 0
    return logps[m].sum(), logps[m].mean()


def torch_losses(objective, pol_c, pol_r, ref_c, ref_r, beta, eps, lam):
    """Per pair: the loss and TRL's metrics, from the papers' formulas (numpy, float64)."""
    logsig = lambda x: -np.logaddexp(0, -x)  # noqa: E731
    if objective == "orpo":
        log_odds = (pol_c - pol_r) - (np.log1p(-np.exp(pol_c)) - np.log1p(-np.exp(pol_r)))
        ratio = logsig(log_odds)
        return {"loss": -pol_c - lam * ratio, "rewards/chosen": lam * pol_c, "rewards/rejected": lam * pol_r,
                "log_odds_ratio": ratio, "log_odds_chosen": log_odds, "nll_loss": -pol_c}
    h = (pol_c - pol_r) - (ref_c - ref_r)
    loss = ((1 - eps) * -logsig(beta * h) - eps * logsig(-beta * h) if objective == "dpo"
            else (h - 1 / (2 * beta)) ** 2)
    return {"loss": loss, "rewards/chosen": beta * (pol_c - ref_c), "rewards/rejected": beta * (pol_r - ref_r)}


def preference_run(folder, data, run_dir, devices=None, **settings):
    cfg = config_lib.load(str(folder / "config.json"), {
        "data.dir": str(data), "run_dir": str(run_dir), "model.block_size": 64, "training.batch_size": 4,
        "training.steps": 10, "training.eval_interval": 5, "training.eval_batches": 1, "training.log_interval": 1,
        "training.sample_tokens": 0, "optimizer.warmup_steps": 1, "optimizer.lr": 1e-3, "logging.progress": False,
        "logging.tensorboard": False, "data.packing": True, **settings})
    return run_lib.setup(cfg, devices or jax.devices()[:1])


@pytest.mark.parametrize("objective", ["dpo", "ipo", "orpo"])
def test_first_step_equals_pytorch_on_the_same_model(hf_pair, tmp_path, objective):
    """One train step on the first batch of a packed run: its loss, rewards and log-probabilities equal TRL's
    formulas evaluated in PyTorch on the transformers models, each reply scored as a sequence of its own."""
    from jaxlm.store import weights

    d, models, data = hf_pair
    beta, eps, lam = 0.2, 0.1 if objective == "dpo" else 0.0, 0.3
    run = preference_run(d / "policy-jx", data, tmp_path / "run", **{
        "training.objective": objective, "dpo.beta": beta, "dpo.label_smoothing": eps, "orpo.lambda": lam})
    state = state_lib.init_state_from(run, str(d / "policy-jx"))
    if run_lib.reference_in_batch(run.cfg):  # the reference pass, run with the other model
        run.reference = reference.compute(run, weights.restore_params(str(d / "reference-jx"),
                                                                      run.abstract_state["params"]), lambda s: None)
    plan = batch_lib.make_loader(run).next()
    batch = batch_lib.device_batch(run, "train", plan)
    step = step_lib.make_train_step(run.cfg, run.optimizer, run.mesh, run.abstract_state, run.act_rules)
    _, got = step(state, batch)

    split = run.dataset.splits["train"]
    docs = [(split.take(np.arange(s, s + n)), split.take(np.arange(s, s + n), mask=True))
            for row in plan.pieces for s, n in row]
    assert len(docs) >= 2 * 4 + 2  # packed: some row holds more than one pair
    average = objective != "dpo"
    score = lambda model: np.array([torch_reply_logps(model, ids, m)[average] for ids, m in docs])  # noqa: E731
    pol = score(models["policy"])
    ref = score(models["reference"]) if objective != "orpo" else np.zeros_like(pol)
    want = torch_losses(objective, pol[0::2], pol[1::2], ref[0::2], ref[1::2], beta, eps, lam)
    want.update({"logps/chosen": pol[0::2], "logps/rejected": pol[1::2]})
    want["rewards/margins"] = want["rewards/chosen"] - want["rewards/rejected"]
    want["rewards/accuracies"] = (want["rewards/chosen"] > want["rewards/rejected"]).astype(float)
    assert np.abs(want["rewards/chosen"]).max() > 0.01 and np.abs(want["rewards/margins"]).min() > 1e-4  # not ~0
    want = {k: float(np.mean(v)) for k, v in want.items()}
    got = {k: float(got[k]) for k in want}
    diff = max(abs(got[k] - want[k]) for k in want)
    print(f"{objective}: max |jaxlm - PyTorch| over {sorted(want)} = {diff:.2e}")
    assert diff <= 1e-4, (got, want)


@pytest.mark.slow
def test_a_lora_run_takes_its_base_as_the_reference(hf_pair, tmp_path):
    """A LoRA dpo run reads no reference log-probabilities: its base, the adapters switched off, is the
    reference. Its first step is ln 2 (the adapters start at zero), and with trained adapters its step equals a
    full-weight step on the merged weights whose reference pass ran on the base."""
    from jaxlm.store import weights
    from jaxlm.model import lora

    d, _, data = hf_pair
    settings = {"training.objective": "dpo", "dpo.beta": 0.5}
    run = preference_run(d / "policy-jx", data, tmp_path / "lora", **settings, **{"lora.rank": 4, "lora.alpha": 8.0})
    assert not run_lib.reference_in_batch(run.cfg) and "ref_logps" not in run_lib.batch_keys(run.cfg)
    state, frozen = state_lib.init_state_from(run, str(d / "policy-jx")), state_lib.load_frozen(run)
    plan = batch_lib.make_loader(run).next()
    step = step_lib.make_train_step(run.cfg, run.optimizer, run.mesh, run.abstract_state, run.act_rules)
    _, first = step(jax.tree.map(jax.numpy.copy, state), batch_lib.device_batch(run, "train", plan), frozen)
    assert abs(float(first["loss"]) - math.log(2)) < 1e-6 and float(first["rewards/chosen"]) == 0

    key = jax.random.key(3)
    adapters = jax.tree.map(lambda a: 0.2 * jax.random.normal(jax.random.fold_in(key, a.size), a.shape),
                            state["params"])
    merged = lora.merge(frozen, adapters, run.cfg)
    _, got = step(dict(state, params=adapters), batch_lib.device_batch(run, "train", plan), frozen)
    full = preference_run(d / "policy-jx", data, tmp_path / "full", **settings)
    full.reference = reference.compute(full, weights.restore_params(str(d / "policy-jx"),
                                                                    full.abstract_state["params"]), lambda s: None)
    full_state = state_lib.init_state_from(full, str(d / "policy-jx"))
    full_state = dict(full_state, params=merged)
    full_step = step_lib.make_train_step(full.cfg, full.optimizer, full.mesh, full.abstract_state, full.act_rules)
    _, want = full_step(full_state, batch_lib.device_batch(full, "train", plan))
    assert abs(float(want["rewards/margins"])) > 0.01
    for k in ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        assert abs(float(got[k]) - float(want[k])) < 1e-4, (k, got[k], want[k])


def small_config(data, run_dir, **settings):
    """A tiny model trained from a fresh initialization on the byte-level pairs."""
    return tiny_config(data, run_dir, **{"model.block_size": 48, "model.vocab_size": 256, "training.objective": "dpo",
                                         "data.packing": True, "optimizer.lr": 3e-3, "optimizer.warmup_steps": 1,
                                         "training.eval_batches": 1, "training.log_interval": 1, **settings})


def small_run(data, run_dir, devices=None, **settings):
    return run_lib.setup(small_config(data, run_dir, **settings), devices or jax.devices()[:1])


@pytest.mark.slow
def test_accumulation_and_eight_devices_give_the_one_device_steps(pairs_data, tmp_path):
    """The same rows as one micro-batch of 8 on one device, as 2 micro-batches of 4 (packed rows: the pairs fall
    unevenly between them), and over 8 devices (data 2 x fsdp 4): the same losses and metrics step by step; the
    reference pass over the 8 devices gives the one-device values."""
    from jaxlm import params as P

    objective = "dpo"
    layouts = {"one": ({}, jax.devices()[:1]), "accumulated": ({"training.batch_size": 4, "training.grad_accum": 2},
                                                              jax.devices()[:1]),
               "fsdp": ({"mesh.ici_data": 2, "mesh.ici_fsdp": 4}, jax.devices())}
    runs = {name: small_run(pairs_data, tmp_path / name, devices, **{"training.objective": objective, **settings})
            for name, (settings, devices) in layouts.items()}
    one = runs["one"]
    plans = [batch_lib.make_loader(one).next() for _ in range(4)]
    if run_lib.reference_in_batch(one.cfg):
        start = P.init(one.specs, jax.random.key(one.cfg.seed), one.mesh, one.param_rules)
        for name, run in runs.items():
            run.reference = reference.compute(run, jax.device_put(start, state_lib.shardings_of(
                run.abstract_state["params"])), lambda s: None)
        for split in ("train", "val"):
            np.testing.assert_allclose(runs["fsdp"].reference[split], one.reference[split], atol=1e-5)
    keys = run_lib.batch_keys(one.cfg)
    split = one.dataset.splits["train"]
    results = {}
    for name, run in runs.items():
        state = state_lib.init_state(run, run.cfg.seed)
        step = step_lib.make_train_step(run.cfg, run.optimizer, run.mesh, run.abstract_state, run.act_rules)
        A, B = run.cfg.training.grad_accum, run.cfg.training.batch_size
        out = []
        for plan in plans:
            host = plan.read(split, (slice(None), slice(None)), slice(None), keys, 48,
                             **({"reference": one.reference["train"]} if "ref_logps" in keys else {}))
            batch = {k: batch_lib.put_batch(run.mesh, v.reshape(A, B, 48), 1, run.act_rules) for k, v in host.items()}
            state, m = step(state, batch)
            out.append(jax.device_get(m))
        results[name] = out
    first = plans[0].read(split, (slice(None), slice(None)), slice(None), keys, 48, **(
        {"reference": one.reference["train"]} if "ref_logps" in keys else {}))
    halves = [int(objectives.get(objective).units({"segment_ids": first["segment_ids"][0, h * 4:h * 4 + 4]}, one.cfg))
              for h in range(2)]
    assert halves[0] != halves[1] and sum(halves) > 8  # packed rows: the micro-batches hold unequal numbers of pairs
    # rewards/accuracies counts margins > 0: a step function of figures that agree within rounding
    names = [k for k in results["one"][0] if k.startswith(("loss", "rewards/", "logps/", "grad_norm", "log_odds",
                                                           "nll")) and k != "rewards/accuracies"]
    for name in ("accumulated", "fsdp"):
        for s, (a, b) in enumerate(zip(results["one"], results[name])):
            for k in names:
                np.testing.assert_allclose(b[k], a[k], rtol=2e-5, atol=2e-6, err_msg=f"{name} step {s + 1} {k}")
    assert results["one"][-1]["loss"] < results["one"][0]["loss"]


@pytest.mark.slow
def test_dpo_run_resumes_exactly(pairs_data, tmp_path):
    """A DPO run stopped after its checkpoint at step 5 and resumed (its reference files deleted in between, so
    the resumed run computes them again from the starting weights) records the losses and rewards of a run that
    went through; its first loss is ln 2; `jaxlm eval` gives the run's last evaluation."""
    from jaxlm.eval import heldout as evaluate

    common = {"training.steps": 10, "optimizer.decay_steps": 10, "checkpoint.interval": 5,
              "training.eval_interval": 5}
    whole = small_config(pairs_data, tmp_path / "whole", **common)
    train.train(whole, jax.devices()[:1], log=lambda s: None)
    part = small_config(pairs_data, tmp_path / "part", **{**common, "training.steps": 5})
    train.train(part, jax.devices()[:1], log=lambda s: None)
    assert (tmp_path / "part" / "reference" / "train.logps.f32").stat().st_size == 4 * pairs_data_tokens(pairs_data)
    import shutil

    shutil.rmtree(tmp_path / "part" / "reference")
    said = []
    train.train(part.replace(training=whole.training), jax.devices()[:1], log=said.append)
    assert any(line.startswith("resumed from") for line in said)
    assert ("reference log-probabilities: computing them from the initialization of seed=1337 (none stored yet)"
            in said)
    a, b = (train.read_metrics(tmp_path / name) for name in ("whole", "part"))
    by_step = lambda records, key: {r["step"]: r[key] for r in records if key in r}  # noqa: E731
    for key in ("loss", "rewards/margins", "logps/chosen", "val_loss"):
        assert by_step(a, key) == by_step(b, key) and len(by_step(a, key)) >= 2, key
    assert abs(by_step(a, "loss")[1] - math.log(2)) < 1e-6 and by_step(a, "rewards/chosen")[1] == 0
    assert by_step(a, "val_rewards/accuracies")[10] > 0.5
    summary = evaluate.evaluate_run(tmp_path / "whole", {"training.sample_tokens": 0}, jax.devices()[:1],
                                    log=lambda s: None)
    assert summary["val_loss"] == pytest.approx(by_step(a, "val_loss")[10], abs=1e-6)


def pairs_data_tokens(folder):
    return json.loads((folder / "meta.json").read_text())["splits"]["train"]["tokens"]


@pytest.mark.slow
def test_dpo_makes_a_model_prefer_one_of_two_equally_likely_replies(tmp_path):
    """A tiny byte-level model is taught to answer `name xxxx? ` with `A.` or `B.` (each prompt seen with both),
    so after this SFT it gives either with about equal probability; DPO on pairs that prefer the reply its greedy
    answers pick less often makes greedy answers to held-out prompts give the preferred reply, and its
    rewards/accuracies climb above 0.9."""
    import jaxlm

    rng = np.random.default_rng(0)
    names = list(dict.fromkeys("".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 4)) for _ in range(400)))
    train_names, held_out = names[:256], names[256:320]
    prompt = lambda name: f"name {name}? "  # noqa: E731
    replies = ("A.", "B.")
    (tmp_path / "sft.txt").write_text("".join(f"{prompt(n)}{r}\n" for n in train_names for r in replies))
    prepare.prepare_corpus([str(tmp_path / "sft.txt")], tmp_path / "sft", "byte", per_line=True, val_fraction=0.05,
                           workers=0, progress=False)
    common = {"model.block_size": 32, "model.n_layers": 2, "model.d_model": 64, "model.n_heads": 4,
              "model.vocab_size": 256, "data.packing": True, "training.eval_interval": 0, "training.eval_batches": 1,
              "training.log_interval": 1, "checkpoint.interval": 0}
    train.train(tiny_config(tmp_path / "sft", tmp_path / "sft-run", **common, **{
        "training.steps": 100, "training.batch_size": 32, "optimizer.lr": 3e-3, "optimizer.warmup_steps": 10}),
        jax.devices()[:1], log=lambda s: None)

    def answers(run):
        """Greedy replies' shares and the mean probability of each reply's first token, over held-out prompts."""
        model = jaxlm.load(run)
        texts = model.generate_text([prompt(n) for n in held_out], max_new_tokens=2, temperature=0)
        logits = model.logits(np.array([list(prompt(n).encode()) for n in held_out]))[:, -1]
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        return ({r: np.mean([t == r for t in texts]) for r in replies},
                {r: float(np.mean(p[:, ord(r[0])])) for r in replies})

    greedy, prob = answers(tmp_path / "sft-run")
    assert all(0.35 < prob[r] < 0.65 for r in replies), prob  # either reply about equally likely
    preferred = min(replies, key=lambda r: greedy[r])  # the one its greedy answers give less often
    other = next(r for r in replies if r != preferred)
    write_records(tmp_path / "pairs.jsonl", [{"prompt": prompt(n), "chosen": preferred, "rejected": other}
                                            for n in train_names])
    prepare.prepare_preference([str(tmp_path / "pairs.jsonl")], tmp_path / "pairs", "byte", val_fraction=0.05,
                               workers=0, progress=False)
    train.train(tiny_config(tmp_path / "pairs", tmp_path / "dpo-run", **common, **{
        "training.objective": "dpo", "dpo.beta": 0.1, "checkpoint.init_from": str(tmp_path / "sft-run"),
        "training.steps": 30, "training.batch_size": 16, "optimizer.lr": 1e-4, "optimizer.min_lr": 1e-5,
        "optimizer.warmup_steps": 2}), jax.devices()[:1], log=lambda s: None)
    greedy_after, prob_after = answers(tmp_path / "dpo-run")
    records = train.read_metrics(tmp_path / "dpo-run")
    accuracies = [r["rewards/accuracies"] for r in records if "rewards/accuracies" in r]
    val_accuracy = [r["val_rewards/accuracies"] for r in records if "val_rewards/accuracies" in r][-1]
    print(f"after SFT: greedy shares {greedy}, first-token probabilities {prob}; preferred {preferred!r}: greedy "
          f"share {greedy[preferred]:.3f} -> {greedy_after[preferred]:.3f}, first-token probability "
          f"{prob[preferred]:.3f} -> {prob_after[preferred]:.3f} (other {prob_after[other]:.3f}); rewards/accuracies "
          f"{accuracies[0]:.2f} -> {np.mean(accuracies[-5:]):.2f} (last 5 steps), val {val_accuracy:.2f}")
    assert greedy[preferred] <= 0.5 and greedy_after[preferred] >= 0.9
    assert np.mean(accuracies[-5:]) > 0.9 and val_accuracy > 0.9


def test_a_dpo_run_reads_its_pairs_from_a_url_as_from_the_local_folder(pairs_data, tmp_path):
    """Preference pairs streamed from a URL (memory:// here; s3:// and gs:// go the same way, tests/test_stream.py):
    the reference pass records the dataset's meta.json read there, the losses equal the local run's, and the trained
    model's tokenizer is the one that meta.json names."""
    import fsspec

    url = "memory://jaxlm-test-dpo/pairs"
    fs = fsspec.filesystem("memory")
    for f in sorted(p for p in pairs_data.rglob("*") if p.is_file()):
        fs.put_file(str(f), f"{url}/{f.relative_to(pairs_data).as_posix()}")
    losses = {}
    for name, data in (("local", pairs_data), ("url", url)):
        cfg = small_config(data, tmp_path / name, **{"training.steps": 4, "training.eval_interval": 0,
                                                      "checkpoint.interval": 0})
        train.train(cfg, log=lambda s: None)
        losses[name] = train.losses_by_step(tmp_path / name)
        described = json.loads((tmp_path / name / "reference" / "reference.json").read_text())
        assert described["dataset"] == str(data)
    assert sorted(losses["url"]) == [1, 2, 3, 4] and losses["url"] == losses["local"]
    from jaxlm.infer import api

    tok = api.load(tmp_path / "url").tokenizer()  # from the meta.json at the URL
    assert tok.spec == json.loads((pairs_data / "meta.json").read_text())["tokenizer"]
