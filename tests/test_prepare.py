"""`jaxlm prepare corpus|chat`: every input kind yields the same documents, chat records get a loss mask on the
assistant's tokens, and each kind of bad input is a one-line error naming file and line or a counted skip, with
nothing complete-looking left behind."""

import gzip
import json
import re

import numpy as np
import pytest

import jaxlm
from conftest import require
from jaxlm import cli
from jaxlm.data import bpe, prepare, shards, tokenizer
from jaxlm.data.errors import DataError

DOCS = ["First Citizen: Before we proceed", "héllo wörld, twice\nover", "All: Speak, speak."]
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def documents(out, split="train") -> list[bytes]:
    meta = json.loads((out / "meta.json").read_text())
    s = shards.Split(out, meta, split)
    return [bytes(s.document(i).astype(np.uint8)) for i in range(s.n_documents)]


def corpus(inputs, out, **kw) -> dict:
    return prepare.prepare_corpus([str(i) for i in inputs], out, "byte", val_fraction=0, workers=0, progress=False,
                                  **kw)


def test_every_input_kind_gives_the_same_documents(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    src = tmp_path / "src"
    src.mkdir()
    jsonl = "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)).encode()
    (src / "a.jsonl").write_bytes(jsonl)
    (src / "b.json").write_text(json.dumps([{"body": d} for d in DOCS]))
    (src / "c.jsonl.gz").write_bytes(gzip.compress(jsonl))
    (src / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl))
    pq.write_table(pa.table({"text": DOCS}), src / "e.parquet")
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "hfds"))
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "train.jsonl").write_bytes(jsonl)
    expected = [d.encode() for d in DOCS]
    for inputs, kw in [([src / "a.jsonl"], {}), ([src / "b.json"], {"field": "body"}), ([src / "c.jsonl.gz"], {}),
                       ([src / "d.jsonl.zst"], {}), ([src / "e.parquet"], {}), ([f"datasets:{tmp_path / 'hfds'}"], {}),
                       ([f"datasets:{tmp_path / 'files'}"], {"streaming": True}), ([f"{src}/*.jsonl*"], {})]:
        out = tmp_path / "out"
        corpus(inputs, out, **kw)
        got = documents(out)
        assert got == expected * (3 if "*" in str(inputs[0]) else 1), inputs
    # a folder: its files in sorted order (a, c, d, e; b.json has no `text` field and is named in the error)
    with pytest.raises(DataError, match=r"b.json:record 1: the record has no field 'text' \(fields: body\)"):
        corpus([src], tmp_path / "out")
    # text files: one document per file, or one per line; a memory:// URL goes through fsspec like s3:// and gs://
    import fsspec

    with fsspec.open("memory://corpus/t.txt", "w") as f:
        f.write("\n".join(DOCS[:1] + ["", "second line"]))
    corpus(["memory://corpus/t.txt"], tmp_path / "out", per_line=True)
    assert documents(tmp_path / "out") == [DOCS[0].encode(), b"second line"]
    meta = corpus(["memory://corpus/"], tmp_path / "out")
    assert documents(tmp_path / "out") == [f"{DOCS[0]}\n\nsecond line".encode()]
    assert meta["skipped"]["files"] == 1


def test_shards_split_and_workers(tmp_path):
    f = tmp_path / "lines.txt"
    f.write_text("".join(f"line {i} " * (i % 7 + 1) + "\n" for i in range(400)))
    a = prepare.prepare_corpus([str(f)], tmp_path / "a", "byte", per_line=True, val_fraction=0.1, workers=0,
                               shard_tokens=1000, progress=False)
    b = prepare.prepare_corpus([str(f)], tmp_path / "b", "byte", per_line=True, val_fraction=0.1, workers=2,
                               shard_tokens=1000, progress=False)
    assert a["splits"] == b["splits"] and (a["splits"]["train"]["documents"], a["splits"]["val"]["documents"]) == \
        (360, 40)
    assert len(a["splits"]["train"]["shards"]) > 5
    assert all(s["tokens"] < 1000 + 60 for s in a["splits"]["train"]["shards"])  # closed at the first boundary past
    lines = f.read_text().splitlines()
    assert documents(tmp_path / "b", "val") == [lines[i].encode() for i in range(9, 400, 10)]
    assert documents(tmp_path / "a") == documents(tmp_path / "b")
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text(json.dumps({"text": "held out"}) + "\n")
    c = prepare.prepare_corpus([str(f)], tmp_path / "c", "byte", val=[str(held_out)], per_line=True, workers=0,
                               progress=False)
    assert c["splits"]["train"]["documents"] == 400 and documents(tmp_path / "c", "val") == [b"held out"]


def test_json_lines_are_parsed_in_blocks_where_they_are_tokenized(tmp_path, monkeypatch):
    """A JSON-lines file is read in blocks of whole lines that the workers parse: the same documents, places,
    validation split and counts as reading it record by record, however the blocks fall."""
    from collections import Counter

    from jaxlm.data import sources

    rng = np.random.default_rng(0)
    lines = [json.dumps({"text": "x" * int(rng.integers(1, 90)) + f" {i} é"}).encode() for i in range(300)]
    lines[7], lines[50], lines[51] = json.dumps({"text": " "}).encode(), b"", b'{"text": "bad \xff\xfe"}'
    f = tmp_path / "c.jsonl"  # CRLF and LF line ends, a blank line, no newline after the last line
    f.write_bytes(b"\r\n".join(lines[:100]) + b"\n" + b"\n".join(lines[100:]))
    stats_ref, stats = Counter(), Counter()
    reference = [(t.encode(), w) for t, w in sources.texts([str(f)], errors="replace", stats=stats_ref)]
    items = list(sources.text_blocks([str(f)], errors="replace", stats=stats, block_bytes=500))
    blocks = [b for b in items if isinstance(b, sources.JsonLines)]
    assert len(blocks) > 20 and len(blocks) == len(items)
    got = [(t.encode(), w) for b in blocks for t, w in zip(*sources.block_texts(b, stats))]
    assert got == reference and stats == stats_ref
    assert stats["empty_documents"] == 1 and stats["invalid_utf8_records"] == 1
    # blocks of valid lines take the one-pass path (places made when asked for), the block with bad UTF-8 the
    # line-by-line one: both give what reading record by record gives
    kinds = [type(sources.block_texts(b, Counter())[1]) for b in blocks]
    assert kinds.count(sources.Places) >= len(blocks) - 2 and list in kinds
    monkeypatch.setattr(sources, "BLOCK_BYTES", 700)
    metas = [prepare.prepare_corpus([str(f)], tmp_path / f"w{w}", "byte", val_fraction=0.1, workers=w,
                                    shard_tokens=2000, progress=False) for w in (0, 2)]
    assert metas[0]["splits"] == metas[1]["splits"] and metas[0]["skipped"] == metas[1]["skipped"]
    assert metas[0]["skipped"]["empty_documents"] == 1 and metas[0]["skipped"]["invalid_utf8"] == 2
    train, val = documents(tmp_path / "w2"), documents(tmp_path / "w2", "val")
    assert documents(tmp_path / "w0") == train and documents(tmp_path / "w0", "val") == val
    texts = [t for t, _ in reference]
    assert val == texts[9::10] and train == [t for i, t in enumerate(texts) if i % 10 != 9]


@pytest.fixture
def chat_tok(tmp_path):
    """A byte-level BPE saved with a tokenizer_config.json and this file's chat template."""
    text = tmp_path / "t.txt"
    text.write_text("the user asks and the assistant answers\n" * 50)
    d = bpe.train_bpe([str(text)], 300, tmp_path / "tok", special_tokens=("</s>",))
    cfg = json.loads((d / "tokenizer_config.json").read_text()) | {"chat_template": TEMPLATE}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_chat_mask_is_one_on_assistant_tokens_only(tmp_path, chat_tok):
    f = tmp_path / "chat.jsonl"
    recs = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the answer"},
                          {"role": "user", "content": "and?"}, {"role": "assistant", "content": "more"}]},
            {"prompt": "ask", "completion": "answers", "system": "be brief"}]
    f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    meta = prepare.prepare_chat([str(f)], tmp_path / "out", str(chat_tok), max_tokens=512, val_fraction=0,
                                workers=0, progress=False)
    assert meta["has_loss_mask"] and meta["splits"]["train"]["documents"] == 2
    tok = tokenizer.load(chat_tok)
    s = shards.Split(tmp_path / "out", meta, "train")
    starts = s.doc_starts_D1
    trained = []
    for i in range(2):
        ids = s.document(i)
        mask = s.take(np.arange(starts[i], starts[i + 1]), mask=True)
        # the masked runs, decoded, are exactly the assistant turns with their end-of-turn token
        runs = np.split(np.arange(len(ids)), np.flatnonzero(np.diff(mask.astype(int))) + 1)
        trained.append([tok.decode(ids[r].tolist()) for r in runs if mask[r[0]]])
        assert tok.decode(ids.tolist()) == tok.apply_chat_template(
            recs[0]["messages"] if i == 0 else [{"role": "system", "content": "be brief"},
                                                {"role": "user", "content": "ask"},
                                                {"role": "assistant", "content": "answers"}], False)
    assert trained == [["the answer</s>", "more</s>"], ["answers</s>"]]


def run_cli(args, capsys) -> tuple[int, str]:
    code = cli.main(args)
    err = capsys.readouterr().err.strip()
    return code, err


def test_chat_without_template_fails_in_one_line(tmp_path, capsys):
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    code, err = run_cli(["prepare", "chat", str(f), "--tokenizer", "byte", "--max-tokens", "64", "--out",
                         str(tmp_path / "o")], capsys)
    assert code == 2 and err == ("error: the tokenizer byte has no chat template; give one with --chat-template FILE "
                                 "(a Jinja template as in tokenizer_config.json)")
    t = tmp_path / "t.jinja"
    t.write_text(TEMPLATE)
    code, err = run_cli(["prepare", "chat", str(f), "--tokenizer", "byte", "--max-tokens", "64", "--val-fraction",
                         "0", "--chat-template", str(t), "--out", str(tmp_path / "o"), "--workers", "0"], capsys)
    meta = json.loads((tmp_path / "o" / "meta.json").read_text())
    assert code == 0 and meta["tokenizer"]["chat_template"] == TEMPLATE


BAD = {  # file name -> (content, extra CLI arguments, the error's location and text)
    "broken.jsonl": (b'{"text": "ok"}\n{"text": "cut\n', [], r"broken.jsonl:2: broken JSON line"),
    "missing.jsonl": (b'{"text": "ok"}\n\n{"body": "x"}\n', [], r"missing.jsonl:3: the record has no field 'text'"),
    "utf8.jsonl": (b'{"text": "ok"}\n{"text": "bad \xff byte"}\n', ["--errors", "strict"],
                   r"utf8.jsonl:2: invalid UTF-8 at byte 14"),
    "vocab.jsonl": (b'{"text": "abc"}\n{"text": "z"}\n', ["--vocab-size", "110"],
                    r"vocab.jsonl:2: token id 122 is at or above the vocabulary size 110"),
}


@pytest.mark.parametrize("workers", ["0", "2"])
@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_corpus_input_names_file_and_line(tmp_path, capsys, name, workers):
    content, extra, message = BAD[name]
    f = tmp_path / name
    f.write_bytes(content)
    out = tmp_path / "out"
    code, err = run_cli(["prepare", "corpus", str(f), "--tokenizer", "byte", "--out", str(out), "--workers", workers,
                         "--val-fraction", "0", "--no-progress", *extra], capsys)
    assert code == 2 and len(err.splitlines()) == 1
    assert re.search(message, err), err
    assert str(f) in err
    assert not (out / "meta.json").exists() and not list(out.glob("*.bin"))  # nothing that looks finished


def test_skips_are_counted(tmp_path, capsys):
    f = tmp_path / "c.jsonl"
    f.write_bytes(b'{"text": "ok"}\n{"text": ""}\n{"text": "  \\n"}\n{"text": "bad \xff\xfe"}\n')
    code, _ = run_cli(["prepare", "corpus", str(f), "--tokenizer", "byte", "--out", str(tmp_path / "o"),
                       "--workers", "0", "--val-fraction", "0"], capsys)
    meta = json.loads((tmp_path / "o" / "meta.json").read_text())
    assert code == 0 and meta["skipped"]["empty_documents"] == 2 and meta["skipped"]["invalid_utf8"] == 2
    assert documents(tmp_path / "o") == [b"ok", "bad \ufffd\ufffd".encode()]


def test_bad_chat_input(tmp_path, capsys, chat_tok):
    f = tmp_path / "c.jsonl"
    good = json.dumps({"prompt": "ask", "completion": "answers"})
    f.write_text(good + "\n" + json.dumps({"messages": [{"role": "wizard", "content": "x"}]}) + "\n")
    args = ["prepare", "chat", str(f), "--tokenizer", str(chat_tok), "--out", str(tmp_path / "o"), "--workers", "0",
            "--val-fraction", "0"]
    code, err = run_cli(args + ["--max-tokens", "512"], capsys)
    assert code == 2 and err == (f"error: {f}:2: message 1 has the unknown role 'wizard' (allowed: system, user, "
                                 "assistant, tool)")
    long = json.dumps({"prompt": "ask " * 40, "completion": "answers"})
    f.write_text(good + "\n" + long + "\n" + good + "\n")
    code = cli.main(args + ["--max-tokens", "40"])
    meta = json.loads((tmp_path / "o" / "meta.json").read_text())
    assert code == 0 and meta["splits"]["train"]["documents"] == 2
    assert meta["skipped"]["too_long_dropped"] == 1 and meta["skipped"]["first_too_long"].startswith(f"{f}:2 (")
    assert "1 chat documents over --max-tokens dropped" in capsys.readouterr().out


def test_interrupted_prepare_leaves_nothing_that_looks_finished(tmp_path):
    out = tmp_path / "o"
    corpus([_write(tmp_path / "ok.jsonl", 50)], out)  # an earlier, finished prepare in the same folder
    assert (out / "meta.json").exists()

    def items():
        for i in range(5000):
            if i == 3000:
                raise KeyboardInterrupt
            yield f"document {i}", f"x:{i}", 12

    with pytest.raises(KeyboardInterrupt):
        prepare.write_dataset(out, tokenizer.ByteTokenizer(), {"train": items()}, workers=0, shard_tokens=4096,
                              progress=False)
    left = sorted(p.name for p in out.iterdir())
    # closed shards of the interrupted run may stay, but without meta.json the folder reads as unprepared
    assert "meta.json" not in left and not [n for n in left if n.endswith(".tmp") or ".tmp." in n]
    assert len([n for n in left if n.endswith(".bin")]) >= 5  # it was interrupted after several shards closed


def test_a_refused_prepare_leaves_no_files(tmp_path, capsys):
    # `jaxlm prepare corpus FILE --tokenizer T --out D` on one text file (one document) refused an empty validation
    # split in one line, but left train-00000.bin behind in the folder it had made.
    text = tmp_path / "notes.txt"
    text.write_text("one long document\n" * 200)
    out = tmp_path / "d"
    code = cli.main(["prepare", "corpus", str(text), "--tokenizer", "byte", "--out", str(out), "--workers", "0",
                     "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "the validation split got no documents" in err, err
    assert "--per-line" in err and "--val" in err  # what to do about it
    assert not out.exists()
    corpus([_write(tmp_path / "ok.jsonl", 20)], out)  # a folder that was there keeps what it held, and no shard
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(DataError, match="the validation split got no documents"):
        prepare.prepare_corpus([str(text)], out, "byte", val_fraction=0.0005, workers=0, progress=False)
    left = sorted(p.name for p in out.iterdir())
    assert not [n for n in left if n.startswith(("train-", "val-", ".train-", ".val-"))], left
    assert "meta.json" not in left and set(left) <= set(before)


def test_data_input_never_trains_on_a_folder_prepared_from_another_corpus(tmp_path, monkeypatch, capsys,
                                                                       shakespeare_file):
    # After `jaxlm prepare shakespeare_char`, `jaxlm train shakespeare_char_cpu data.input=other.txt` printed
    # "data data/shakespeare_char: ... vocab 65" and trained on Shakespeare, while config.json named other.txt.
    monkeypatch.chdir(tmp_path)
    assert cli.main(["prepare", "shakespeare_char", "--input", str(shakespeare_file)]) == 0
    other = tmp_path / "other.txt"
    other.write_text("abcabc, another corpus entirely\n" * 300)
    capsys.readouterr()
    code = cli.main(["train", "shakespeare_char_cpu", f"data.input={other}", "training.steps=300",
                     f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: data.input={other} but data/shakespeare_char (data.dataset=shakespeare_char) "
                          f"was prepared from {shakespeare_file.resolve()}: set data.dir to a new folder"), err
    # the same file is the folder's own corpus: accepted (as a relative path too)
    meta = json.loads((tmp_path / "data/shakespeare_char/meta.json").read_text())
    prepare.check_prepared_from(meta, tmp_path / "data/shakespeare_char", "shakespeare_char", str(shakespeare_file))
    # data.dir names a new folder: prepared from data.input there, never from the other corpus
    out = prepare.ensure_prepared("shakespeare_char", tmp_path / "data/other", str(other))
    assert json.loads((out / "meta.json").read_text())["tokenizer"]["chars"] == "".join(
        sorted(set(other.read_text())))
    # the quickstart's byte-level corpus with data.input: the user's text, bytes (it was the stdlib, silently)
    q = prepare.ensure_prepared("python_stdlib", tmp_path / "data/q", str(other))
    assert json.loads((q / "meta.json").read_text())["input"]["paths"] == [str(other.resolve())]
    other.write_text("changed\n")  # the same file since changed: refused too
    with pytest.raises(DataError, match=r"has 8 bytes but .*data/q was prepared from it when it had 9,600"):
        prepare.ensure_prepared("python_stdlib", tmp_path / "data/q", str(other))


def _write(path, n):
    path.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(n)))
    return path


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.slow
def test_end_to_end_convert_prepare_train_export_with_the_models_tokenizer(tmp_path, shakespeare_file, capsys):
    """A tiny random Llama built with transformers plus a tokenizer trained here -> `jaxlm convert from-hf` ->
    prepare a text corpus and a chat jsonl with `--tokenizer` set to the converted folder -> `jaxlm train` on each
    (loss falls) -> `jaxlm convert to-hf` -> transformers loads it and generates through the same tokenizer."""
    transformers = require("transformers", "hf")
    require("torch")
    from jaxlm.store import convert

    raw = bpe.train_bpe([str(shakespeare_file)], 384, tmp_path / "bpe",
                              special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"), per_line=True)
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(raw / "tokenizer.json"),
                                                  eos_token="<|endoftext|>", chat_template=CHATML)
    hf_dir = tmp_path / "hf"
    cfg = transformers.LlamaConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, hidden_size=32,
                                   intermediate_size=64, vocab_size=len(hf_tok), eos_token_id=hf_tok.eos_token_id)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(hf_dir)
    hf_tok.save_pretrained(hf_dir)
    model = tmp_path / "jx"
    convert.from_hf(str(hf_dir), model, log=lambda s: None)
    assert (model / "tokenizer" / "chat_template.jinja").is_file()

    corpus_file = tmp_path / "corpus.txt"
    corpus_file.write_text("\n".join(shakespeare_file.read_text().splitlines()[:3000]))
    text_dir, chat_dir = tmp_path / "text", tmp_path / "chat"
    assert cli.main(["prepare", "corpus", str(corpus_file), "--per-line", "--tokenizer", str(model), "--out",
                     str(text_dir), "--val-fraction", "0.05", "--workers", "0"]) == 0
    chat_file = tmp_path / "chat.jsonl"
    lines = [t for t in corpus_file.read_text().splitlines() if t.strip()]
    chat_file.write_text("".join(json.dumps({"prompt": a, "completion": b}) + "\n" for a, b in zip(lines, lines[1:])))
    assert cli.main(["prepare", "chat", str(chat_file), "--tokenizer", str(model), "--max-tokens", "64", "--out",
                     str(chat_dir), "--val-fraction", "0.05", "--workers", "0"]) == 0

    text_meta = json.loads((text_dir / "meta.json").read_text())
    chat_meta = json.loads((chat_dir / "meta.json").read_text())
    for meta in (text_meta, chat_meta):  # the model's tokenizer and the datasets' agree (else resolve refuses)
        assert tokenizer.resolve(None, model, meta).fingerprint == meta["tokenizer"]["fingerprint"]
        assert meta["vocab_size"] == len(hf_tok) == prepare.model_vocab_size(str(model))
    train = shards.Split(text_dir, text_meta, "train")
    expected = [i for i, _ in enumerate(lines) if (i + 1) // 20 == i // 20]  # every 20th document went to val
    for k in (0, 1, len(expected) - 1):
        assert train.document(k).tolist() == hf_tok(lines[expected[k]])["input_ids"] + [hf_tok.eos_token_id]
    chats = shards.Split(chat_dir, chat_meta, "train")
    assert chats.has_mask and chats.n_documents + chat_meta["splits"]["val"]["documents"] + \
        chat_meta["skipped"].get("too_long_dropped", 0) == len(lines) - 1
    ids = chats.document(0)
    rendered = hf_tok.apply_chat_template([{"role": "user", "content": lines[0]},
                                           {"role": "assistant", "content": lines[1]}], tokenize=False)
    assert hf_tok.decode(ids.tolist()) == rendered
    mask = chats.take(np.arange(int(chats.doc_starts_D1[0]), int(chats.doc_starts_D1[1])), mask=True)
    assert hf_tok.decode(ids[mask == 1].tolist()) == f"{lines[1]}<|im_end|>\n"

    # `jaxlm generate --chat` renders the prompt with the same template and stops at the model's EOS
    capsys.readouterr()
    assert cli.main(["generate", str(model), "--chat", "--prompt", lines[0], "max_new_tokens=4", "temperature=0"]) == 0
    shown = capsys.readouterr().out.split("\n", 1)[1]
    assert shown.startswith(hf_tok.apply_chat_template([{"role": "user", "content": lines[0]}], tokenize=False,
                                                       add_generation_prompt=True))

    # The second half: train on both folders (packed text, then packed chat from the text run's weights), the loss
    # falls each time; `jaxlm convert to-hf` and transformers loads the result and generates through the tokenizer.
    from jaxlm.train import loop as train_lib

    common = ["model.block_size=64", "training.batch_size=8", "training.eval_batches=2", "training.sample_tokens=0",
              "optimizer.lr=3e-3", "optimizer.warmup_steps=5", "logging.progress=false", "logging.tensorboard=false",
              "data.packing=true"]
    byte_dir = tmp_path / "bytes"  # the same corpus through another tokenizer: training refuses it before compiling
    assert cli.main(["prepare", "corpus", str(corpus_file), "--per-line", "--tokenizer", "byte", "--out", str(byte_dir),
                     "--val-fraction", "0.05", "--workers", "0"]) == 0
    capsys.readouterr()
    assert cli.main(["train", str(model / "config.json"), f"data.dir={byte_dir}", f"run_dir={tmp_path / 'no'}",
                     *common]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "prepared with the tokenizer byte" in err and str(model / "tokenizer") in err
    text_run, chat_run = tmp_path / "text_run", tmp_path / "chat_run"
    assert cli.main(["train", str(model / "config.json"), f"data.dir={text_dir}", f"run_dir={text_run}",
                     "training.steps=40", "training.eval_interval=40", "checkpoint.interval=40", *common]) == 0
    assert cli.main(["train", str(model / "config.json"), f"data.dir={chat_dir}", f"run_dir={chat_run}",
                     f"checkpoint.init_from={text_run}", "training.steps=30", "training.eval_interval=30",
                     "checkpoint.interval=30", *common]) == 0
    assert json.loads((chat_run / "config.json").read_text())["data"]["loss_mask"] == "on"  # assistant tokens only
    for run in (text_run, chat_run):
        by_step = train_lib.losses_by_step(run)
        losses = [by_step[s] for s in sorted(by_step)]
        assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.3, (run, losses)
    assert cli.main(["convert", "to-hf", str(chat_run), str(tmp_path / "tuned")]) == 0
    tuned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tuned").eval()
    back_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "tuned")
    prompt = back_tok.apply_chat_template([{"role": "user", "content": lines[0]}], tokenize=False,
                                          add_generation_prompt=True)
    assert prompt == hf_tok.apply_chat_template([{"role": "user", "content": lines[0]}], tokenize=False,
                                                add_generation_prompt=True)
    ids = back_tok(prompt, return_tensors="pt")["input_ids"]
    out = tuned.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
    assert out and out == jaxlm.load(chat_run).generate(ids[0].tolist(), new_tokens=8, temperature=0.0)


def test_text_a_char_vocabulary_cannot_encode_names_its_line(char_data, tmp_path, capsys):
    f = tmp_path / "new.jsonl"
    f.write_text(json.dumps({"text": "To be"}) + "\n" + json.dumps({"text": "or ~not~"}) + "\n")
    code, err = run_cli(["prepare", "corpus", str(f), "--tokenizer", str(char_data), "--out", str(tmp_path / "o"),
                         "--workers", "0", "--val-fraction", "0"], capsys)
    assert code == 2 and err == f"error: {f}:2: characters not in this char-level vocabulary: '~'"


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_record(tmp_path, capsys):
    """Assistant tokens are found by rendering prefixes; a template whose output for earlier turns depends on later
    ones (here: it writes the number of messages first) cannot be split so, and says where."""
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps({"prompt": "ask", "completion": "answers"}) + "\n")
    t = tmp_path / "t.jinja"
    t.write_text("{{ messages | length }}" + TEMPLATE)
    code, err = run_cli(["prepare", "chat", str(f), "--tokenizer", "byte", "--max-tokens", "64", "--chat-template",
                         str(t), "--out", str(tmp_path / "o"), "--workers", "0", "--val-fraction", "0"], capsys)
    assert code == 2 and err == (f"error: {f}:1: the chat template's rendering up to message 2 does not tokenize to "
                                 "a prefix of the whole conversation, so its assistant tokens cannot be found exactly")
