import json
import random
import shutil

import numpy as np
import pytest

from jaxlm.data import loader as loader_lib, prepare, tokenizer
from jaxlm.data.errors import DataError


def test_shakespeare_char_token_counts(char_data, shakespeare_file):
    meta = json.loads((char_data / "meta.json").read_text())
    # nanoGPT's data/shakespeare_char/prepare.py reports these figures for the same file.
    assert meta["vocab_size"] == 65
    assert (meta["train_tokens"], meta["val_tokens"]) == (1_003_854, 111_540)
    assert (char_data / "train.bin").stat().st_size == 2 * 1_003_854
    text = shakespeare_file.read_text()
    tok = tokenizer.from_meta(meta)
    train = np.fromfile(char_data / "train.bin", dtype=np.uint16)
    assert tok.decode(train[:200].tolist()) == text[:200]
    assert tok.encode(text[:50]) == train[:50].tolist()
    assert 0 < meta["unigram_entropy"] < np.log(65)


def test_text_byte_and_char_vocab(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("héllo wörld\n" * 50)
    meta = prepare.prepare_text([f], tmp_path / "byte", vocab="byte")
    assert meta["vocab_size"] == 256 and meta["train_tokens"] + meta["val_tokens"] == len(f.read_bytes())
    meta = prepare.prepare_text([f], tmp_path / "char", vocab="char")
    assert meta["vocab_size"] == len(set(f.read_text()))
    assert meta["train_tokens"] == int(0.9 * len(f.read_text()))


def test_python_stdlib_corpus_is_deterministic(tmp_path):
    a = prepare.prepare_python_stdlib(tmp_path / "a", max_bytes=200_000)
    b = prepare.prepare_python_stdlib(tmp_path / "b", max_bytes=200_000)
    assert a == b and 150_000 < a["train_tokens"] + a["val_tokens"] <= 200_000
    assert (tmp_path / "a" / "train.bin").read_bytes() == (tmp_path / "b" / "train.bin").read_bytes()


def test_large_vocab_uses_uint32(tmp_path):
    ids = np.arange(70_000) % 70_000
    meta = prepare.write_split(tmp_path, ids, 70_000, {"kind": "byte"}, "test")
    assert meta["dtype"] == "uint32"
    ds = loader_lib.Dataset(tmp_path)
    assert int(ds.splits["train"].tokens_S[0].max()) == 62_999


def test_loader_windows_are_shifted_and_resumable(char_data):
    ds = loader_lib.Dataset(char_data)
    data = ds.splits["train"]
    a = loader_lib.Loader(data, 16, 4, 2, seed=3)

    def read(plan):
        b = plan.read(data, (slice(None), slice(None)), slice(None), ("inputs", "targets"), 16)
        return b["inputs"], b["targets"]

    x, y = read(a.next())
    assert x.shape == y.shape == (2, 4, 16) and x.dtype == np.int32
    np.testing.assert_array_equal(x[..., 1:], y[..., :-1])
    state = a.state()
    json.dumps(state)  # the state goes into a JSON checkpoint item
    expected = [read(a.next()) for _ in range(3)]
    b = loader_lib.Loader(data, 16, 4, 2, seed=999)
    b.restore(json.loads(json.dumps(state)))
    for (ex, ey), (gx, gy) in zip(expected, [read(b.next()) for _ in range(3)]):
        np.testing.assert_array_equal(ex, gx)
        np.testing.assert_array_equal(ey, gy)


def test_bad_data_fails_clearly(tmp_path, char_data):
    with pytest.raises(DataError, match="meta.json is missing"):
        loader_lib.Dataset(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("meta.json", "val.bin"):
        (broken / name).write_bytes((char_data / name).read_bytes())
    (broken / "train.bin").write_bytes((char_data / "train.bin").read_bytes()[:-1])
    with pytest.raises(DataError, match="not a whole number"):
        loader_lib.Dataset(broken)
    (broken / "train.bin").write_bytes((char_data / "train.bin").read_bytes()[:-2])
    with pytest.raises(DataError, match="meta.json says 1003854"):
        loader_lib.Dataset(broken)
    with pytest.raises(DataError, match="model.block_size=200000 is too large"):
        loader_lib.Dataset(char_data).check_block_size(200_000)
    with pytest.raises(DataError, match="does not exist"):
        prepare.prepare_text([tmp_path / "nope.txt"], tmp_path / "out")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match="no text"):
        prepare.prepare_text([empty], tmp_path / "out")


def test_char_tokenizer_rejects_unknown_characters(char_data):
    tok = tokenizer.from_meta(json.loads((char_data / "meta.json").read_text()))
    with pytest.raises(tokenizer.TokenizerError, match="not in this char-level vocabulary"):
        tok.encode("日本")


def reference_invalid_utf8(data: bytes) -> int:
    """Invalid sequences as Python's decoder reports them, counted through an error handler."""
    import codecs

    count = [0]

    def handler(e):
        count[0] += 1
        return "", e.end

    codecs.register_error("test_reliability.count", handler)
    data.decode("utf-8", errors="test_reliability.count")
    return count[0]


def bad_inputs(rng: random.Random) -> list[bytes]:
    text = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n".encode()
    invalid = [b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf0\x9f", b"\x80\x80", b"\xfe\xfe\xff"]
    out = [b"", b"\n", b"\xff", b"a", "\ufffd".encode() + b"\xff" + "\ufffd".encode(), b"\x00" * 100,
           b"x" * (3 << 20), b"\xef\xbb\xbf" + text, bytes(rng.randrange(256) for _ in range(5000))]
    for _ in range(25):
        pieces = [text[rng.randrange(len(text)):] for _ in range(rng.randrange(1, 6))]
        for _ in range(rng.randrange(4)):
            pieces.insert(rng.randrange(len(pieces) + 1), rng.choice(invalid + [b"\x00"]))
        out.append(b"".join(pieces))
    return out


def test_prepare_survives_bad_input_and_reports_counts(tmp_path, capsys):
    from jaxlm import cli

    rng = random.Random(0)
    tried = clear = 0
    for i, data in enumerate(bad_inputs(rng)):
        src = tmp_path / f"in{i}.txt"
        src.write_bytes(data)
        invalid = reference_invalid_utf8(data)
        for errors in prepare.UTF8_ERRORS:
            vocab = rng.choice(["char", "byte"])
            text = data.decode("utf-8", errors={"skip": "ignore"}.get(errors, errors)) if errors != "strict" or \
                not invalid else None
            out = tmp_path / f"out{i}_{errors}"
            tried += 1
            try:
                meta = prepare.prepare_text([src], out, vocab, errors)
            except DataError as e:
                msg = str(e)
                assert "\n" not in msg, msg
                if errors == "strict" and invalid:
                    assert "invalid UTF-8 at byte" in msg and str(src) in msg
                else:
                    assert ("no text" in msg and not text) or ("at least 2" in msg and len(text) < 2), msg
                clear += 1
                continue
            n_tokens = len(text) if vocab == "char" else len(text.encode())
            stats = meta["input"]
            assert (stats["bytes"], stats["invalid_utf8"], stats["nul_bytes"]) == (len(data), invalid, data.count(0))
            assert stats["longest_line"] == max(len(line) for line in data.split(b"\n"))
            assert meta["train_tokens"] + meta["val_tokens"] == n_tokens
            ds = loader_lib.Dataset(out)  # the files agree with their meta (sizes, ids within the vocabulary)
            tokens = np.concatenate([ds.splits["train"].tokens_S[0], ds.splits["val"].tokens_S[0]])
            if vocab == "byte":
                assert tokens.tobytes() == np.frombuffer(text.encode(), np.uint8).astype(np.uint16).tobytes()
    assert tried >= 100 and clear >= 5

    # The command line prints the counts; several files, one of them empty.
    (tmp_path / "empty.txt").write_bytes(b"")
    code = cli.main(["prepare", "text", str(tmp_path / "in4.txt"), str(tmp_path / "empty.txt"), "--errors", "skip",
                     "--out", str(tmp_path / "cli")])
    out = capsys.readouterr().out
    assert code == 0 and "read 2 file(s) (1 empty)" in out and "1 invalid UTF-8 sequences dropped" in out, out
    code = cli.main(["prepare", "text", str(tmp_path / "in4.txt"), "--errors", "strict", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "invalid UTF-8 at byte 3" in err, err


def test_data_files_that_do_not_match_their_meta_fail_clearly(char_data, tmp_path):
    meta = json.loads((char_data / "meta.json").read_text())
    train_bin = (char_data / "train.bin").read_bytes()

    def broken(meta_changes=None, train=None, meta_text=None, drop=()):
        d = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        text = meta_text if meta_text is not None else json.dumps({**meta, **(meta_changes or {})})
        (d / "meta.json").write_text(text)
        (d / "train.bin").write_bytes(train if train is not None else train_bin)
        shutil.copy(char_data / "val.bin", d / "val.bin")
        for name in drop:
            (d / name).unlink()
        return d

    poisoned = bytearray(train_bin)
    poisoned[2 * 1234: 2 * 1235] = np.uint16(65).tobytes()
    cases = [
        (broken({"vocab_size": 10}), "holds token id"),
        (broken(train=bytes(poisoned)), "holds token id 65 at position 1234, but meta.json's vocab_size is 65"),
        (broken({"vocab_size": 0}), "vocab_size 0 must be > 0"),
        (broken({"vocab_size": 70_000}), "does not fit in uint16"),
        (broken({"dtype": "float32"}), "dtype float32 is not supported"),
        (broken({"train_tokens": meta["train_tokens"] + 1}), "meta.json says 1003855"),
        (broken(train=train_bin[:-1]), "not a whole number of uint16 tokens"),
        (broken(meta_text="{not json"), "not a valid meta.json"),
        (broken(meta_text=json.dumps({"dtype": "uint16"})), "not a valid meta.json"),
        (broken(drop=["val.bin"]), "val.bin is missing"),
        (broken({"train_tokens": 0}, train=b""), "train.bin is empty"),
    ]
    for d, fragment in cases:
        with pytest.raises(DataError) as e:
            loader_lib.Dataset(d)
        assert fragment in str(e.value) and "\n" not in str(e.value), (fragment, str(e.value))
    with pytest.raises(DataError, match="does not fit in uint32"):
        prepare.write_split(tmp_path / "huge", np.arange(3), 2**32 + 1, {"kind": "byte"}, "test")


def test_tests_that_need_the_corpus_fail_in_one_line_without_it(tmp_path):
    """A clone without ../shared must not pass by skipping the tests that read the corpus."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    missing = tmp_path / "nowhere" / "input.txt"
    env = dict(os.environ, JAXLM_TEST_SHAKESPEARE=str(missing))
    env.pop("PYTEST_XDIST_WORKER", None)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                        f"--basetemp={tmp_path / 't'}", "tests/test_data.py::test_shakespeare_char_token_counts"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr
    summary = p.stdout.strip().splitlines()[-1]
    assert "1 error" in summary and "skipped" not in summary, p.stdout
    lines = [line for line in p.stdout.splitlines() if f"{missing} not found" in line]
    assert lines and all("tiny Shakespeare corpus" in line and "JAXLM_TEST_SHAKESPEARE" in line for line in lines)
    assert "Traceback" not in p.stdout and "def shakespeare_file" not in p.stdout, p.stdout
