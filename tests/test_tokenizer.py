"""Tokenizers against the libraries' own encoders: a byte-level BPE trained here and saved through transformers (with
a chat template), a SentencePiece model trained here on tiny Shakespeare, a local .tiktoken file; the resolver's
precedence and its one-line refusals."""

import base64
import json

import numpy as np
import pytest

from conftest import require
from jaxlm import cli
from jaxlm.data import chat, prepare, shards, tokenizer
from jaxlm.data.tokenizer import TokenizerError

# ChatML with transformers' generation tags around the assistant text, so transformers computes an assistant mask
# to compare ours (found by prefixes) against.
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
            "{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CONVERSATION = [{"role": "system", "content": "Speak as a Roman."},
                {"role": "user", "content": "Who art thou?"},
                {"role": "assistant", "content": "A citizen of Rome, sir."},
                {"role": "user", "content": "And <|im_end|> what now?"},
                {"role": "assistant", "content": "Now we speak, and\nthen we part."}]


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory, shakespeare_file):
    """A byte-level BPE trained by `jaxlm tokenizer train`, then saved through transformers with a chat template."""
    transformers = require("transformers", "hf")
    raw = tmp_path_factory.mktemp("bpe")
    args = ["tokenizer", "train", str(shakespeare_file), "--vocab-size", "600", "--out", str(raw), "--per-line"]
    assert cli.main(args + [a for s in SPECIALS for a in ("--special-token", s)]) == 0
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(raw / "tokenizer.json"), eos_token="<|endoftext|>",
                                              chat_template=TEMPLATE)
    out = tmp_path_factory.mktemp("hf_tokenizer")
    hf.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def sp_model(tmp_path_factory, shakespeare_file):
    spm = require("sentencepiece")
    prefix = tmp_path_factory.mktemp("sp") / "shakespeare"
    spm.SentencePieceTrainer.train(input=str(shakespeare_file), model_prefix=str(prefix), vocab_size=300,
                                   model_type="bpe", character_coverage=1.0, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, input_sentence_size=20000,
                                   shuffle_input_sentence=False, minloglevel=2, unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    return prefix.with_suffix(".model")


def lines(path) -> list[str]:
    return [t for t in path.read_text().split("\n") if t.strip()]


def test_hf_prepare_writes_the_library_encoding_of_every_document(hf_dir, shakespeare_file, tmp_path):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(hf_dir)
    out = tmp_path / "ds"
    meta = prepare.prepare_corpus([str(shakespeare_file)], out, str(hf_dir), per_line=True, val_fraction=0.01,
                                  workers=2, progress=False)
    docs = lines(shakespeare_file)
    expected = ref(docs, add_special_tokens=False)["input_ids"]
    eos = ref.convert_tokens_to_ids("<|endoftext|>")
    assert meta["eos_id"] == eos and meta["bos_id"] is None
    got = {s: shards.Split(out, meta, s) for s in ("train", "val")}
    assert sum(g.n_documents for g in got.values()) == len(docs) == 32_777
    assert got["val"].n_documents == len(docs) // 100
    tok = tokenizer.load(hf_dir)
    n = {"train": 0, "val": 0}
    for i, (text, ids) in enumerate(zip(docs, expected)):
        split = "val" if (i + 1) // 100 > i // 100 else "train"
        written = got[split].document(n[split]).tolist()
        n[split] += 1
        assert written == ids + [eos], (i, text)
        assert tok.decode(written[:-1]) == text
    # the bar's byte count and the summary's counts come from the same documents
    assert meta["train_tokens"] + meta["val_tokens"] == sum(map(len, expected)) + len(docs)


def test_plain_text_never_yields_special_tokens(hf_dir):
    tok = tokenizer.load(hf_dir)
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(hf_dir)
    text = "Hark <|endoftext|> and <|im_start|>"
    ids = tok.encode(text)
    assert tok.eos_id not in ids and tok.decode(ids) == text
    assert ref(text, add_special_tokens=False)["input_ids"] != ids  # transformers reads them as special tokens
    assert tok.encode_rendered(text) == ref(text, add_special_tokens=False)["input_ids"]


def test_a_long_text_is_encoded_as_a_short_one_is(hf_dir, shakespeare_file):
    """From tokenizer.LONG_TEXT_CHARS characters the HF tokenizer encodes through encode_batch (which lets other
    threads run): the same ids as the Rust tokenizer's encode, specials in the text staying plain text."""
    from tokenizers import Tokenizer as RustTokenizer

    tok = tokenizer.load(hf_dir)
    rust = RustTokenizer.from_file(str(hf_dir / "tokenizer.json"))
    rust.encode_special_tokens = True
    text = shakespeare_file.read_text()[:3 * tokenizer.LONG_TEXT_CHARS] + " <|endoftext|>"
    assert len(text) >= tokenizer.LONG_TEXT_CHARS
    assert tok.encode(text) == rust.encode(text, add_special_tokens=False).ids
    assert tok.eos_id not in tok.encode(text)


def test_chat_template_and_assistant_mask_match_transformers(hf_dir):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(hf_dir)
    tok = tokenizer.load(hf_dir)
    for gen in (True, False):
        assert tok.apply_chat_template(CONVERSATION, add_generation_prompt=gen) == ref.apply_chat_template(
            CONVERSATION, add_generation_prompt=gen, tokenize=False)
    ids, mask = chat.encode_chat(tok, CONVERSATION)
    r = ref.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ids.tolist() == list(r["input_ids"])
    np.testing.assert_array_equal(mask, np.asarray(r["assistant_masks"]))
    assert mask.sum() > 0 and tok.decode(ids[mask == 1].tolist()).startswith("A citizen of Rome, sir.<|im_end|>")


def test_sentencepiece_prepare_adds_bos_and_eos_and_round_trips(sp_model, shakespeare_file, tmp_path):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    out = tmp_path / "ds"
    model = tmp_path / "elsewhere" / sp_model.name
    model.parent.mkdir()
    model.write_bytes(sp_model.read_bytes())
    meta = prepare.prepare_corpus([str(shakespeare_file)], out, str(model), per_line=True, val_fraction=0,
                                  workers=0, progress=False)
    model.unlink()  # the dataset keeps a copy of the tokenizer it was prepared with
    assert meta["tokenizer"]["copy"] == f"tokenizer/{sp_model.name}"
    assert tokenizer.load(out).encode("Before we proceed") == sp.encode("Before we proceed")
    with pytest.raises(TokenizerError, match="does not exist"):
        tokenizer.from_meta(meta)  # without the folder, only the original path is known
    assert (meta["bos_id"], meta["eos_id"]) == (1, 2) and meta["tokenizer"]["kind"] == "sentencepiece"
    split = shards.Split(out, meta, "train")
    docs = lines(shakespeare_file)
    assert split.n_documents == len(docs)
    for i, (text, ids) in enumerate(zip(docs, sp.encode(docs))):
        written = split.document(i).tolist()
        assert written == [1] + ids + [2], i
        assert sp.decode(written) == text


def test_local_tiktoken_file_matches_tiktoken(tmp_path):
    tiktoken = require("tiktoken")
    merges = [b"th", b"he", b"the", b" the", b"an", b"and"]
    ranks = {bytes([b]): b for b in range(256)} | {m: 256 + i for i, m in enumerate(merges)}
    path = tmp_path / "mini.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    tok = tokenizer.load(str(path))
    from tiktoken_ext.openai_public import r50k_pat_str

    ref = tiktoken.Encoding("mini", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": len(ranks)})
    text = "and the thane <|endoftext|> thé"
    assert tok.encode(text) == ref.encode_ordinary(text) and tok.decode(tok.encode(text)) == text
    assert tok.eos_id == len(ranks) and tok.vocab_size == len(ranks) + 1
    assert tok.encode_document("the") == ref.encode_ordinary("the") + [len(ranks)]
    assert tokenizer.from_spec(tok.spec).encode(text) == tok.encode(text)


def test_precedence_and_mismatch_are_refused_in_one_line(hf_dir, sp_model, tmp_path):
    model = tmp_path / "converted"
    (model / "tokenizer").mkdir(parents=True)
    for f in hf_dir.iterdir():
        (model / "tokenizer" / f.name).write_bytes(f.read_bytes())
    (model / "hf_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    hf_tok = tokenizer.load(hf_dir)
    meta = {"tokenizer": hf_tok.spec}
    # 1. explicit beats the model folder; 2. the model folder beats meta.json; 3. meta.json alone.
    assert tokenizer.resolve(str(hf_dir), model, meta).fingerprint == hf_tok.fingerprint
    from_model = tokenizer.resolve(None, model, meta)
    assert from_model.fingerprint == hf_tok.fingerprint and from_model.eos_ids == (0, 2)
    assert tokenizer.resolve(None, None, meta).fingerprint == hf_tok.fingerprint
    with pytest.raises(TokenizerError, match=r"the dataset was prepared with the tokenizer huggingface:.* but "
                                             r"--tokenizer/data.tokenizer .*shakespeare.model uses sentencepiece"):
        tokenizer.resolve(str(sp_model), None, meta)
    with pytest.raises(TokenizerError) as e:
        tokenizer.check_same({"kind": "byte", "fingerprint": "byte"}, from_model)
    assert "\n" not in str(e.value) and "prepare the data again" in str(e.value)
    with pytest.raises(TokenizerError, match="unknown tokenizer 'nope.txt'"):
        tokenizer.load("nope.txt")
    with pytest.raises(TokenizerError, match="has no chat template; give one with --chat-template"):
        tokenizer.load(sp_model).apply_chat_template(CONVERSATION)


def test_prompts_follow_the_document_rule(hf_dir, sp_model):
    """generate and the Python API encode a prompt as prepare starts a document (BOS when the tokenizer uses one);
    a prompt rendered by the chat template keeps its special tokens."""
    from jaxlm.infer import api

    sp = tokenizer.load(sp_model)
    assert api.encode_prompt(sp, "Hark") == sp.encode_document("Hark")[:-1] == [1] + sp.encode("Hark")
    hf = tokenizer.load(hf_dir)
    rendered = hf.apply_chat_template([{"role": "user", "content": "Hark"}])
    ids = api.encode_prompt(hf, rendered, rendered=True)
    assert ids == hf.encode_rendered(rendered) and ids[0] == hf.special_tokens["<|im_start|>"]
    assert api.encode_prompt(hf, rendered) == hf.encode(rendered) != ids  # typed text: special strings stay text
    assert hf.decode(ids) == rendered == "<|im_start|>user\nHark<|im_end|><|im_start|>assistant\n"  # trim_blocks


def test_a_post_processor_bos_is_the_bos(hf_dir, tmp_path):
    """A tokenizer whose post-processor puts a BOS before each text (as Llama 3's does): documents and prompts start
    with it, as transformers' encode(add_special_tokens=True) does."""
    from tokenizers import Tokenizer as RustTokenizer, processors
    from transformers import AutoTokenizer

    rust = RustTokenizer.from_file(str(hf_dir / "tokenizer.json"))
    bos = rust.token_to_id("<|im_start|>")
    rust.post_processor = processors.TemplateProcessing(single="<|im_start|> $A",
                                                        special_tokens=[("<|im_start|>", bos)])
    out = tmp_path / "with_bos"
    out.mkdir()
    rust.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "bos_token": "<|im_start|>", "eos_token": "<|endoftext|>"}))
    ref = AutoTokenizer.from_pretrained(out)
    tok = tokenizer.load(out)
    text = "Before we proceed any further"
    assert tok.bos_id == bos and tok.encode(text) == ref(text, add_special_tokens=False)["input_ids"]
    assert tok.encode_document(text) == ref(text)["input_ids"] + [ref.eos_token_id] == \
        tok.encode_documents([text])[0]
    assert ref(text)["input_ids"][0] == bos
    from jaxlm.infer import api

    assert api.encode_prompt(tok, text) == ref(text)["input_ids"]


def test_hub_ids_download_the_tokenizer_files(hf_dir, monkeypatch):
    """A hub id is fetched with huggingface_hub (replaced here by a local folder: no network in tests)."""
    import huggingface_hub

    asked = []

    def snapshot_download(repo_id, allow_patterns):
        asked.append((repo_id, allow_patterns))
        return str(hf_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    tok = tokenizer.load("org/shakespeare-bpe")
    assert asked[0][0] == "org/shakespeare-bpe" and "tokenizer.json" in asked[0][1]
    assert tok.spec["path"] == "org/shakespeare-bpe" and tok.fingerprint == tokenizer.load(hf_dir).fingerprint

    def offline(repo_id, allow_patterns):
        raise OSError("We couldn't connect to 'https://huggingface.co'\nmore detail")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(TokenizerError, match=r"^cannot fetch the tokenizer of org/missing from the Hugging Face hub "
                                             r"\(offline\? give a local folder\): We couldn't connect[^\n]*$"):
        tokenizer.load("org/missing")
