import json

import numpy as np
import pytest

from jaxlm.data import shards


def _write(tmp_path, docs, shard_tokens, masks=None):
    out = shards.begin(tmp_path / "ds")
    w = shards.ShardWriter(out, "train", np.uint16, shard_tokens, loss_mask=masks is not None)
    for i, d in enumerate(docs):
        w.add(np.asarray(d), None if masks is None else masks[i])
    meta = {"vocab_size": 100, "dtype": "uint16", "format": shards.FORMAT, "has_loss_mask": masks is not None,
            "splits": {"train": w.close()}}
    shards.write_meta(out, meta)
    return out, meta


def test_shards_close_at_document_boundaries_and_read_back_as_one_sequence(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 100, size=n) for n in (3, 9, 1, 14, 5, 2, 7)]
    masks = [rng.integers(0, 2, size=len(d)) for d in docs]
    out, meta = _write(tmp_path, docs, shard_tokens=10, masks=masks)
    entry = meta["splits"]["train"]
    assert [s["tokens"] for s in entry["shards"]] == [12, 15, 14]  # each closed at the first boundary past 10
    assert entry["documents"] == 7 and not list(out.glob(".*"))  # no temporary files left
    split = shards.Split(out, json.loads((out / "meta.json").read_text()), "train")
    flat, flat_mask = np.concatenate(docs), np.concatenate(masks)
    idx = rng.integers(0, len(flat), size=(4, 6))
    np.testing.assert_array_equal(split.take(idx), flat[idx])
    np.testing.assert_array_equal(split.take(idx, mask=True), flat_mask[idx])
    assert split.n_documents == 7
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(split.document(i), d)


def test_adding_documents_in_groups_writes_the_same_shards_as_one_at_a_time(tmp_path):
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 100, size=n) for n in rng.integers(1, 30, size=60)]
    masks = [rng.integers(0, 2, size=len(d)) for d in docs]
    one, meta_one = _write(tmp_path / "one", docs, shard_tokens=50, masks=masks)
    out = shards.begin(tmp_path / "groups" / "ds")
    w = shards.ShardWriter(out, "train", np.uint16, 50, loss_mask=True)
    cuts = [0, 1, 2, 9, 10, 33, 34, 60]
    for a, b in zip(cuts, cuts[1:]):
        w.add_many(docs[a:b], masks[a:b])
    assert w.close() == meta_one["splits"]["train"]
    for f in sorted(one.iterdir()):
        if f.name != "meta.json":
            assert (out / f.name).read_bytes() == f.read_bytes(), f.name
    with pytest.raises(ValueError, match="mask of its own length"):
        w.add_many(docs[:2], masks[:1])


def test_an_interrupted_prepare_leaves_no_meta_and_no_finished_looking_shard(tmp_path):
    out, _ = _write(tmp_path, [np.arange(5)], shard_tokens=100)
    out = shards.begin(out)  # a second prepare into the same folder starts
    w = shards.ShardWriter(out, "train", np.uint16, 100)
    w.add(np.arange(7))
    w.abort()
    assert not (out / "meta.json").exists() and not list(out.glob(".*"))


def test_format_1_folders_stay_readable_and_mismatches_name_the_file(tmp_path):
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "train.bin")
    split = shards.Split(tmp_path, {"vocab_size": 10, "train_tokens": 10}, "train")
    assert len(split) == 10 and split.n_documents is None
    with pytest.raises(shards.FormatError, match="val.bin holds 10 tokens but meta.json says 11"):
        np.arange(10, dtype=np.uint16).tofile(tmp_path / "val.bin")
        shards.Split(tmp_path, {"vocab_size": 10, "val_tokens": 11}, "val")
