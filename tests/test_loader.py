"""The reading side: format-2 datasets, packed rows, loss weights, exact averaging and resumable positions."""

import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import tiny_config, xla_flags
from jaxlm import config as config_lib, sharding
from jaxlm.train import (aot, batches as batch_lib, loop as train, objectives, run as run_lib, saved_step,
                         state as state_lib, step as step_lib)
from jaxlm.config import ConfigError
from jaxlm.data import loader as loader_lib, packing, shards
from jaxlm.data.errors import DataError
from jaxlm.model import forward

VOCAB = 64


def write_dataset(path, docs: dict, masks: dict | None = None, shard_tokens: int = 60, vocab: int = VOCAB):
    """A format-2 folder written with shards.ShardWriter: docs = {split: [ids, ...]}, masks likewise."""
    shards.begin(path)
    meta = {"format": shards.FORMAT, "vocab_size": vocab, "dtype": "uint16", "tokenizer": {"kind": "byte"},
            "has_loss_mask": masks is not None, "splits": {}}
    for split, split_docs in docs.items():
        w = shards.ShardWriter(path, split, np.uint16, shard_tokens, loss_mask=masks is not None)
        for i, d in enumerate(split_docs):
            w.add(np.asarray(d), None if masks is None else masks[split][i])
        meta["splits"][split] = w.close()
    shards.write_meta(path, meta)
    return path


def random_docs(rng, n, lo=2, hi=30, long_every=0, long_len=0):
    docs = [rng.integers(1, VOCAB, rng.integers(lo, hi)) for _ in range(n)]
    if long_every:
        for i in range(0, n, long_every):
            docs[i] = rng.integers(1, VOCAB, long_len)
    return docs


@pytest.fixture(scope="module")
def docs_data(tmp_path_factory):
    rng = np.random.default_rng(0)
    docs = {"train": random_docs(rng, 120, long_every=17, long_len=40), "val": random_docs(rng, 40)}
    masks = {s: [rng.integers(0, 2, len(d)).astype(np.uint8) for d in ds] for s, ds in docs.items()}
    plain = write_dataset(tmp_path_factory.mktemp("plain"), docs)
    masked = write_dataset(tmp_path_factory.mktemp("masked"), docs, masks)
    return docs, masks, plain, masked


def read_all(plan, split, keys=("inputs", "targets", "positions", "segment_ids", "weights"), T=16):
    return plan.read(split, tuple(slice(None) for _ in plan.shape), slice(None), keys, T)


def test_format2_dataset_reads_every_shard_and_checks_ids(docs_data, tmp_path):
    docs, _, plain, _ = docs_data
    ds = loader_lib.Dataset(plain)
    split = ds.splits["train"]
    assert len(split.tokens_S) > 5 and split.n_documents == 120  # 60-token shards
    np.testing.assert_array_equal(split.take(np.arange(split.n_tokens)), np.concatenate(docs["train"]))
    assert "120 documents" in ds.describe()
    bad = {"train": [np.array([1, 2, 3]), np.array([4, VOCAB + 5, 6])], "val": [np.array([1, 2, 3])]}
    write_dataset(tmp_path / "bad", bad, shard_tokens=3)
    with pytest.raises(DataError) as e:
        loader_lib.Dataset(tmp_path / "bad")
    assert f"train-00001.bin holds token id {VOCAB + 5} at position 1" in str(e.value) and "\n" not in str(e.value)


def test_random_windows_cross_shards_and_weights_follow_the_mask(docs_data):
    docs, masks, _, masked = docs_data
    split = loader_lib.Dataset(masked).splits["train"]
    tokens, mask = np.concatenate(docs["train"]), np.concatenate(masks["train"])
    plan = loader_lib.Loader(split, 16, 4, 2, seed=1).next()
    b = read_all(plan, split, ("inputs", "targets", "weights"))
    for (a, r), start in np.ndenumerate(plan.starts):
        np.testing.assert_array_equal(b["inputs"][a, r], tokens[start:start + 16])
        np.testing.assert_array_equal(b["targets"][a, r], tokens[start + 1:start + 17])
        np.testing.assert_array_equal(b["weights"][a, r], mask[start + 1:start + 17])


def reference_rows(docs, order, T):
    """A naive packer over documents in `order`, written independently of packing.py's bookkeeping: rows of
    T + 1 (doc, offset) slots; a document that fits a row but not the rest of this one starts a new row; a
    longer one fills the rest and continues one token back."""
    R, rows, row, used = T + 1, [], [], 0
    for d in order:
        n, off = len(docs[d]), 0
        if n <= R and used + n > R:
            rows.append(row)
            row, used = [], 0
        while True:
            take = min(n - off, R - used)
            row.append((d, off, take))
            used += take
            if off + take == n:
                break
            off += take - 1
            rows.append(row)
            row, used = [], 0
        if used >= R - 1:
            rows.append(row)
            row, used = [], 0
    return rows


def test_packed_rows_match_a_naive_packer_and_cover_each_document_once(docs_data):
    docs, masks, _, masked = docs_data
    split = loader_lib.Dataset(masked).splits["train"]
    T = 16
    loader = packing.PackedLoader(split, T, 1, 1, seed=3, loss_mask=True)
    order = np.random.Generator(np.random.PCG64([3, 0])).permutation(len(docs["train"]))
    expected = reference_rows(docs["train"], order, T)[:-1]  # the last row may continue into epoch 1
    counted = {}
    for want in expected:
        b = read_all(loader.next(), split)
        tok = np.concatenate([b["inputs"][0, 0], b["targets"][0, 0, -1:]])
        col = 0
        for k, (d, off, n) in enumerate(want):
            np.testing.assert_array_equal(tok[col:col + n], docs["train"][d][off:off + n])
            seg = b["segment_ids"][0, 0, col:min(col + n, T)]
            assert (seg == k + 1).all()
            np.testing.assert_array_equal(b["positions"][0, 0, col:min(col + n, T)], np.arange(len(seg)))
            for j in range(1, n):  # target j of this piece is the input at column col + j - 1
                w = b["weights"][0, 0, col + j - 1]
                assert w == masks["train"][d][off + j], (d, off, j)
                counted[(d, off + j)] = counted.get((d, off + j), 0) + 1
            col += n
        assert (b["weights"][0, 0, max(col - 1, 0):] == 0).all() and (b["segment_ids"][0, 0, col:] == 0).all()
    seen = {d for row in expected for d, _, _ in row}
    assert len(seen) >= len(docs["train"]) - 2
    # Every target of every document packed is trained at most once, none lost at a split (overlap).
    assert max(counted.values()) == 1
    for d in seen - {expected[-1][-1][0]}:
        assert all((d, j) in counted for j in range(1, len(docs["train"][d])))


def test_streams_read_disjoint_documents_and_resume_exactly(docs_data):
    docs, _, plain, _ = docs_data
    split = loader_lib.Dataset(plain).splits["train"]
    doc_of = lambda start: int(np.searchsorted(split.doc_starts_D1, start, side="right") - 1)  # noqa: E731
    loader = packing.PackedLoader(split, 16, 4, 2, seed=7)
    by_stream = {b: set() for b in range(4)}
    for _ in range(4):  # about half an epoch
        plan = loader.next()
        for flat, pieces in enumerate(plan.pieces):
            by_stream[flat % 4].update(doc_of(s) for s, _ in pieces)
    assert sum(len(v) for v in by_stream.values()) == len(set().union(*by_stream.values()))
    state = json.loads(json.dumps(loader.state()))
    expected = [loader.next().pieces for _ in range(30)]  # well into the second epoch
    other = packing.PackedLoader(split, 16, 4, 2, seed=999)
    other.restore(state)
    assert [other.next().pieces for _ in range(30)] == expected
    with pytest.raises(DataError, match=r"training.grad_accum 2 there, 1 here"):
        packing.PackedLoader(split, 16, 4, 1, seed=7).restore(state)
    with pytest.raises(DataError, match="saved by packing .* this run reads random windows"):
        loader_lib.Loader(split, 16, 4, 2, seed=7).restore(state)


def _run(data, tmp_path, devices=None, **overrides):
    cfg = tiny_config(data, tmp_path, **{"model.compute_dtype": "float32", "model.block_size": 16,
                                         "data.packing": True, **overrides})
    return run_lib.setup(cfg, devices or jax.devices()[:1])


def test_each_document_in_a_packed_row_gets_its_own_logits(docs_data, tmp_path):
    docs, _, plain, _ = docs_data
    run = _run(plain, tmp_path)
    params = state_lib.init_state(run, 0)["params"]
    plan = batch_lib.make_loader(run).next()
    batch = jax.device_get(batch_lib.device_batch(run, "train", plan))
    b = {k: v[0] for k, v in batch.items()}
    logits = np.asarray(forward(params, b["inputs"], run.cfg.model, positions_BT=b["positions"],
                                segment_ids_BT=b["segment_ids"]))
    # Each document alone, at the start of its own row (zeros after it cannot reach it: attention is causal).
    where = [(r, np.flatnonzero(b["segment_ids"][r] == k)) for r in range(len(b["inputs"]))
             for k in range(1, int(b["segment_ids"][r].max()) + 1)]
    alone_PT = np.zeros((len(where), b["inputs"].shape[1]), np.int32)
    for i, (r, cols) in enumerate(where):
        alone_PT[i, :len(cols)] = b["inputs"][r, cols]
    alone = np.asarray(forward(params, alone_PT, run.cfg.model))
    worst = max(float(np.abs(alone[i, :len(cols)] - logits[r, cols]).max()) for i, (r, cols) in enumerate(where))
    assert len(where) > len(b["inputs"]) and any(cols[0] > 0 for _, cols in where)  # several documents a row
    print(f"packed_vs_alone_max_abs_logit_diff={worst:.3g} over {len(where)} documents")
    assert worst <= 1e-5, worst


def _loss_and_grads(run, params, batch):
    """The train step's loss and gradient (no metrics) of the next-token objective."""
    (loss, _), grads = step_lib.loss_and_grads(objectives.get("next_token"), params, batch, run.cfg,
                                               jax.random.key(0))
    return loss, grads


def test_a_masked_target_changes_no_gradient(docs_data, tmp_path):
    _, _, _, masked = docs_data
    run = _run(masked, tmp_path)
    assert run_lib.batch_keys(run.cfg) == ("inputs", "targets", "positions", "segment_ids", "weights")
    params = state_lib.init_state(run, 0)["params"]
    batch = jax.device_get(batch_lib.device_batch(run, "train", batch_lib.make_loader(run).next()))
    grads = jax.jit(lambda p, b: _loss_and_grads(run, p, b))
    loss, g = grads(params, batch)
    zero = np.argwhere(batch["weights"] == 0)
    changed = dict(batch, targets=np.array(batch["targets"]))
    for a, r, t in zero:
        changed["targets"][a, r, t] = (changed["targets"][a, r, t] + 7) % VOCAB
    loss2, g2 = grads(params, changed)
    assert len(zero) > 50 and float(loss) == float(loss2)
    assert all((np.asarray(x) == np.asarray(y)).all() for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(g2)))
    # ... while a counted target does change it.
    a, r, t = np.argwhere(batch["weights"] == 1)[0]
    changed["targets"][a, r, t] = (changed["targets"][a, r, t] + 7) % VOCAB
    assert float(grads(params, changed)[0]) != float(loss)


def test_accumulation_and_devices_average_exactly_over_counted_tokens(docs_data, tmp_path):
    """Micro-batches with very different numbers of counted tokens: 4 x 2 rows equal 1 x 8 rows, and 8 devices
    equal 1, in the loss and in every gradient."""
    _, _, _, masked = docs_data
    one = _run(masked, tmp_path / "a", **{"training.grad_accum": 4, "training.batch_size": 2})
    batch = {k: np.array(v) for k, v in jax.device_get(batch_lib.device_batch(one, "train",
                                                                           batch_lib.make_loader(one).next())).items()}
    batch["weights"][0] = 0  # micro-batch 0 counts nothing, micro-batch 1 one token, 2 and 3 their mask
    batch["weights"][1] = 0
    batch["weights"][1, 0, 3] = 1
    counts = batch["weights"].sum(axis=(1, 2))
    assert counts[0] == 0 and counts[1] == 1 and counts[2] > 10
    params = jax.device_get(state_lib.init_state(one, 0)["params"])

    def result(run, b):
        fn = jax.jit(lambda p, x: _loss_and_grads(run, p, x))
        p = jax.device_put(params, state_lib.shardings_of(run.abstract_state["params"]))
        with sharding.activation_sharding(run.mesh, run.act_rules):
            loss, g = fn(p, b)
        return float(loss), np.concatenate([np.ravel(x) for x in jax.tree.leaves(jax.device_get(g))])

    flat = {k: v.reshape((1, 8, 16)) for k, v in batch.items()}
    ref_loss, ref = result(_run(masked, tmp_path / "b", **{"training.batch_size": 8}), flat)
    w = flat["weights"][0]
    # The reference itself is the mean cross-entropy over counted tokens (an independent check of the sums).
    logits = forward(params, flat["inputs"][0], one.cfg.model, positions_BT=flat["positions"][0],
                     segment_ids_BT=flat["segment_ids"][0])
    ce = -np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), flat["targets"][0][..., None], -1)[..., 0]
    assert ref_loss == pytest.approx(float((ce * w).sum() / w.sum()), rel=1e-6)
    acc_loss, acc = result(one, batch)
    eight = _run(masked, tmp_path / "c", jax.devices(), **{"training.batch_size": 8, "mesh.ici_data": 8})
    on_eight = sharding.batch_sharding(eight.mesh, 3, 1, eight.act_rules)
    dev_loss, dev = result(eight, {k: jax.device_put(v, on_eight) for k, v in flat.items()})
    norm = np.linalg.norm(ref)
    print(f"grad_accum4_rel_diff={np.linalg.norm(acc - ref) / norm:.3g} "
          f"devices8_rel_diff={np.linalg.norm(dev - ref) / norm:.3g} loss {ref_loss:.7f} {acc_loss:.7f} {dev_loss:.7f} counted per micro-batch {counts.tolist()}")
    assert acc_loss == pytest.approx(ref_loss, rel=1e-6) and dev_loss == pytest.approx(ref_loss, rel=1e-6)
    assert np.linalg.norm(acc - ref) <= 1e-6 * norm, np.linalg.norm(acc - ref) / norm
    assert np.linalg.norm(dev - ref) <= 1e-6 * norm, np.linalg.norm(dev - ref) / norm


def test_settings_that_cannot_work_fail_in_one_line(docs_data, char_data, tmp_path):
    _, _, plain, masked = docs_data
    with pytest.raises(DataError, match="data.packing=true needs document boundaries"):
        run_lib.setup(tiny_config(char_data, tmp_path, **{"data.packing": True}), jax.devices()[:1])
    with pytest.raises(DataError, match="data.loss_mask=on but .* has no loss mask"):
        _run(plain, tmp_path, **{"data.loss_mask": "on"})
    with pytest.raises(ConfigError, match="data.loss_mask='yes' is not allowed"):
        tiny_config(masked, tmp_path, **{"data.loss_mask": "yes"})
    assert _run(masked, tmp_path).cfg.data.loss_mask == "on"
    assert run_lib.batch_keys(_run(masked, tmp_path, **{"data.loss_mask": "off"}).cfg) == (
        "inputs", "targets", "positions", "segment_ids", "weights")
    assert run_lib.batch_keys(_run(masked, tmp_path, **{"data.packing": False}).cfg) == ("inputs", "targets", "weights")
    assert run_lib.batch_keys(_run(plain, tmp_path, **{"data.packing": False}).cfg) == ("inputs", "targets")


def test_a_saved_step_records_the_batch_arrays_and_refuses_others(docs_data, tmp_path):
    _, _, plain, _ = docs_data
    packed, windows = _run(plain, tmp_path), _run(plain, tmp_path, **{"data.packing": False})
    sig = aot.signature(packed)
    assert sig["settings"]["data.packing"] is True and sig["settings"]["data.loss_mask"] == "off"
    args = {a[0]: a[1:3] for a in sig["args"]}
    assert args["['batch']['weights']"] == [[1, 8, 16], "float32"] and args["['batch']['inputs']"][1] == "int32"
    with pytest.raises(ConfigError) as e:
        saved_step.check_signature(sig, aot.signature(windows), "step.bin")
    assert "compiled with the batch array ['batch']['positions']" in str(e.value) and "\n" not in str(e.value)


KILL_DURING_PACKED_RUN = """
import json, os, signal, sys, time
from pathlib import Path
from jaxlm import config as config_lib
from jaxlm.train import batches as batch_lib, loop as train

cfg = config_lib.from_dict(json.loads(sys.argv[1]))
run_dir, real, n = Path(cfg.run_dir), batch_lib.device_batch, [0]

def batch(run, split, plan):
    if len(plan.shape) == 2:  # the loop's batches; evaluation's are [B]
        n[0] += 1
        if n[0] == 14:  # checkpoint 10 committed, steps 11-13 done and not saved: die without warning
            while not (run_dir / "checkpoints" / "10" / "jaxlm_manifest.json").exists():
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
    return real(run, split, plan)

batch_lib.device_batch = batch
train.train(cfg, log=lambda s: None)
"""

PACKED_RUN = {"data.packing": True, "model.block_size": 16, "model.n_layers": 1, "training.steps": 20,
              "checkpoint.interval": 10, "training.grad_accum": 2, "training.eval_interval": 0,
              "training.eval_batches": 1, "training.log_interval": 1}


@pytest.mark.slow
def test_sigkill_during_a_packed_shuffled_run_then_rerun_continues_exactly(docs_data, tmp_path):
    """20 steps of 2 x 8 packed rows go through the 120 documents about 2.5 times (new shuffles included).
    One device in both processes (the killed run is a process of its own)."""
    _, _, _, masked = docs_data
    one = jax.devices()[:1]
    train.train(tiny_config(masked, tmp_path / "ref", **PACKED_RUN), devices=one, log=lambda s: None)
    ref = train.losses_by_step(tmp_path / "ref")
    cfg = tiny_config(masked, tmp_path / "killed", **PACKED_RUN)
    p = subprocess.run([sys.executable, "-c", KILL_DURING_PACKED_RUN, config_lib.to_json(cfg)], capture_output=True,
                       text=True, timeout=600, env=dict(os.environ, XLA_FLAGS=xla_flags()))
    assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr
    assert max(train.losses_by_step(cfg.run_dir)) >= 13  # steps past the checkpoint were run, and are lost
    summary = train.train(cfg, devices=one, log=lambda s: None)
    assert summary["start_step"] == 10
    got = train.losses_by_step(cfg.run_dir)
    assert [got[s] for s in range(1, 21)] == [ref[s] for s in range(1, 21)]
    assert len(set(ref.values())) == 20 and ref[20] < ref[1]


PACKED_READER = """
import json, sys
import numpy as np
from jaxlm.launch import distributed
from jaxlm.train import batches as batch_lib, loop as train, run as run_lib
from jaxlm.config import DistributedConfig, apply_overrides, Config
distributed.initialize(DistributedConfig())
cfg = apply_overrides(Config(), {"data.dir": sys.argv[1], "data.packing": True, "model.block_size": 16,
                                 "model.n_layers": 1, "model.d_model": 16, "model.n_heads": 2, "model.vocab_size": 64,
                                 "training.batch_size": 8, "run_dir": sys.argv[2]})
run = run_lib.setup(cfg)
split = run.dataset.splits["train"]
read = set()

class Recording:
    def __init__(self, data):
        self.data = data
    def __getattr__(self, name):
        return getattr(self.data, name)
    def take(self, idx, mask=False):
        read.update(np.searchsorted(split.doc_starts_D1, np.ravel(idx), side="right") - 1)
        return self.data.take(idx, mask)

run.dataset.splits["train"] = Recording(split)
loader = batch_lib.make_loader(run)
for _ in range(3):
    batch = batch_lib.device_batch(run, "train", loader.next())
    assert batch["inputs"].shape == (1, 8, 16)
print("DOCS", json.dumps(sorted(int(d) for d in read)))
"""


@pytest.mark.slow
def test_two_processes_read_disjoint_documents(docs_data, tmp_path):
    _, _, plain, _ = docs_data
    script = tmp_path / "reader.py"
    script.write_text(PACKED_READER)
    from jaxlm.launch.local import free_port

    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script), str(plain), str(tmp_path / "r")],
                              env=dict(os.environ, JAXLM_COORDINATOR=f"127.0.0.1:{port}", JAXLM_NUM_PROCESSES="2",
                                       JAXLM_PROCESS_ID=str(i), JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(4)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    docs = [set(json.loads(next(line for line in o.splitlines() if line.startswith("DOCS"))[5:])) for o in outs]
    # 3 batches of 8 rows of 17 tokens (documents of 2-29 tokens): each process reads its 4 rows' documents,
    # none read by both.
    assert len(docs[0]) > 5 and len(docs[1]) > 5 and not docs[0] & docs[1], outs


def test_a_mixture_draws_rows_by_weight_and_resumes_exactly(docs_data, tmp_path):
    docs, _, plain, _ = docs_data
    rng = np.random.default_rng(5)
    other_docs = {"train": [rng.integers(1, VOCAB, 20) for _ in range(30)], "val": [rng.integers(1, VOCAB, 20)] * 3}
    other = write_dataset(tmp_path / "other", other_docs)
    run = _run(plain, tmp_path, **{"data.mixture": f"{plain}:3,{other}:1", "training.grad_accum": 2})
    loader = batch_lib.make_loader(run)
    plans = [loader.next() for _ in range(40)]
    sources = np.array([s for p in plans for s, _ in p.items])
    assert 0.68 < np.mean(sources == 0) < 0.82  # 640 rows drawn 3:1
    # Rows of the second source hold its documents, read from its own shards.
    plan = plans[0]
    b = jax.device_get(batch_lib.device_batch(run, "train", plan))
    tokens = [np.concatenate(docs["train"]), np.concatenate(other_docs["train"])]
    assert set(s for s, _ in plan.items) == {0, 1}
    for flat, (s, pieces) in enumerate(plan.items):
        row, col = b["inputs"].reshape(-1, 16)[flat], 0
        for start, length in pieces:
            n = min(length, 16 - col)
            np.testing.assert_array_equal(row[col:col + n], tokens[s][start:start + n])
            col += length
    windows = _run(plain, tmp_path, **{"data.mixture": f"{plain}:3,{other}:1", "data.packing": False})
    plan = batch_lib.make_loader(windows).next()
    b = jax.device_get(batch_lib.device_batch(windows, "train", plan))
    for flat, (s, start) in enumerate(plan.items):
        np.testing.assert_array_equal(b["targets"].reshape(-1, 16)[flat], tokens[s][start + 1:start + 17])
    state = json.loads(json.dumps(loader.state()))
    expected = [loader.next().items for _ in range(5)]
    again = batch_lib.make_loader(run)
    again.restore(state)
    assert [again.next().items for _ in range(5)] == expected
    with pytest.raises(DataError, match="data.mixture's weights"):
        batch_lib.make_loader(_run(plain, tmp_path, **{"data.mixture": f"{plain}:1,{other}:1",
                                                    "training.grad_accum": 2})).restore(state)
    meta = json.loads((other / "meta.json").read_text())
    shards.write_meta(other, dict(meta, tokenizer={"kind": "char", "chars": "ab"}))
    with pytest.raises(DataError, match="different tokenizers"):
        _run(plain, tmp_path, **{"data.mixture": f"{plain}:3,{other}:1"})
    with pytest.raises(ConfigError, match="is not PATH:WEIGHT with a weight > 0"):
        tiny_config(plain, tmp_path, **{"data.mixture": f"{plain}:0"})
