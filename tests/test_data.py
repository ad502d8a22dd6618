import json

import numpy as np
import pytest

from jaxlm.data import loader as loader_lib, prepare, tokenizer
from jaxlm.data.prepare import DataError


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
    assert int(ds.splits["train"].max()) == 62_999


def test_loader_windows_are_shifted_and_resumable(char_data):
    ds = loader_lib.Dataset(char_data)
    data = ds.splits["train"]
    a = loader_lib.Loader(data, 16, 4, 2, seed=3)
    x, y = a.next()
    assert x.shape == y.shape == (2, 4, 16) and x.dtype == np.int32
    np.testing.assert_array_equal(x[..., 1:], y[..., :-1])
    state = a.state()
    json.dumps(state)  # the state goes into a JSON checkpoint item
    expected = [a.next() for _ in range(3)]
    b = loader_lib.Loader(data, 16, 4, 2, seed=999)
    b.restore(json.loads(json.dumps(state)))
    for (ex, ey), (gx, gy) in zip(expected, [b.next() for _ in range(3)]):
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
