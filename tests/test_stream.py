"""Training from prepared shards on object storage (data/remote.py), without a local copy: the batches and losses
equal those from the local folder (against real emulators: fake-gcs-server and moto), a run killed and resumed
continues the same data order, memory stays within the block budget whatever the corpus size, transient read
errors are retried, and what a user can get wrong (a missing bucket, folder or shard, a short shard, an endpoint
nothing listens on) fails in one line naming the URL."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import fsspec
import numpy as np
import pytest

from conftest import s3_endpoint_nothing_listens_on, tiny_config
from jaxlm.config import ConfigError, DataConfig
from jaxlm.data import loader as loader_lib, packing, prepare, remote, shards
from jaxlm.data.errors import DataError

TESTS = str(Path(__file__).resolve().parent)


def _random_folder(out: Path, docs: int, seed: int = 0, shard_tokens: int = 40_000) -> Path:
    """A format-2 folder with a loss mask: documents of 1-3,000 random tokens (vocabulary 1,000) in both splits."""
    rng = np.random.default_rng(seed)
    shards.begin(out)
    entries = {}
    for split in ("train", "val"):
        w = shards.ShardWriter(out, split, np.uint16, shard_tokens, loss_mask=True)
        for n in rng.integers(1, 3000, size=docs):
            w.add(rng.integers(0, 1000, size=n), rng.integers(0, 2, size=n))
        entries[split] = w.close()
    shards.write_meta(out, {"vocab_size": 1000, "dtype": "uint16", "format": shards.FORMAT, "has_loss_mask": True,
                            "splits": entries})
    return out


def _upload(fs, folder: Path, dest: str) -> None:
    for f in sorted(folder.iterdir()):
        fs.put_file(str(f), f"{dest}/{f.name}")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, shakespeare_file) -> Path:
    """Tiny Shakespeare, one document a line, byte-level, in shards of 150,000 tokens (7 train shards): documents
    and windows cross shard boundaries of the reads."""
    out = tmp_path_factory.mktemp("stream") / "prepared"
    prepare.prepare_corpus([str(shakespeare_file)], out, "byte", per_line=True, val_fraction=0.05, workers=0,
                           shard_tokens=150_000, progress=False)
    return out


def test_a_folder_at_a_url_reads_what_the_local_folder_holds_within_its_budget(tmp_path):
    """Tokens, loss masks, document boundaries, random windows and packed rows read from memory:// equal the
    local folder's; the blocks held never exceed the budget, even for a read that touches more blocks than fit."""
    local = loader_lib.Dataset(_random_folder(tmp_path / "ds", docs=150))
    fs = fsspec.filesystem("memory")
    _upload(fs, tmp_path / "ds", "/jaxlm-test-stream/ds")
    url = "memory://jaxlm-test-stream/ds"
    there = loader_lib.Dataset(url, DataConfig(cache_mb=1, block_kb=4))
    assert there.streamed and not local.streamed and there.describe() == local.describe()
    rng = np.random.default_rng(1)
    for name in ("train", "val"):
        a, b = local.splits[name], there.splits[name]
        assert len(b.tokens_S) > 3 and isinstance(b.tokens_S[0], remote.RemoteArray)
        np.testing.assert_array_equal(a.doc_starts_D1, b.doc_starts_D1)
        for shape in [(3, 5, 7), (700_000,)]:  # the second touches ~340 blocks of 4 KiB each file: > 1 MiB
            idx = rng.integers(0, len(a), size=shape)
            np.testing.assert_array_equal(b.take(idx), a.take(idx))
            np.testing.assert_array_equal(b.take(idx, mask=True), a.take(idx, mask=True))
        np.testing.assert_array_equal(b.document(7), a.document(7))
        loaders = [packing.PackedLoader(s, 64, 8, 2, 3, loss_mask=True) for s in (a, b)]
        for _ in range(3):
            plans = [ld.next() for ld in loaders]
            got = [p.read(s, (slice(None), slice(None)), slice(None), loader_lib.batch_keys(True, True), 64)
                   for p, s in zip(plans, (a, b))]
            for k in got[0]:
                np.testing.assert_array_equal(got[1][k], got[0][k])
    cache = there.splits["train"].tokens_S[0].cache
    assert 0 < cache.held <= cache.peak <= cache.budget == 1 << 20
    assert cache.fetched > cache.budget  # blocks were let go to stay within it


def test_a_format_1_folder_streams_too(char_data):
    """nanoGPT's train.bin and val.bin at a URL: one shard a split, no document boundaries, the same tokens."""
    _upload(fsspec.filesystem("memory"), char_data, "/jaxlm-test-format1/ds")
    local, there = loader_lib.Dataset(char_data), loader_lib.Dataset("memory://jaxlm-test-format1/ds")
    idx = np.random.default_rng(0).integers(0, len(local.splits["train"]), size=(8, 33))
    np.testing.assert_array_equal(there.splits["train"].take(idx), local.splits["train"].take(idx))
    assert there.without_documents() == "memory://jaxlm-test-format1/ds" and there.describe() == local.describe()


def test_transient_read_errors_are_retried_and_lasting_ones_fail_in_one_line(tmp_path, monkeypatch):
    _upload(fsspec.filesystem("memory"), _random_folder(tmp_path / "ds", docs=20), "/jaxlm-test-retry/ds")
    ds = loader_lib.Dataset("memory://jaxlm-test-retry/ds", DataConfig(block_kb=4))
    split = ds.splits["train"]
    fs = split.tokens_S[0].cache.fs
    monkeypatch.setattr(remote, "BACKOFF_S", 0.0)
    real, calls = fs.cat_ranges, []

    def flaky(paths, starts, ends, **kwargs):  # every range fails on the first two calls
        calls.append(len(paths))
        out = real(paths, starts, ends, **kwargs)
        return [ConnectionResetError("connection reset by peer")] * len(out) if len(calls) <= 2 else out

    monkeypatch.setattr(fs, "cat_ranges", flaky)
    idx = np.arange(0, len(split), 5000)
    expected = loader_lib.Dataset(tmp_path / "ds").splits["train"].take(idx)
    np.testing.assert_array_equal(split.take(idx), expected)
    assert len(calls) == 3 and calls[0] == calls[2]

    monkeypatch.setattr(fs, "cat_ranges", lambda paths, *a, **k: [TimeoutError("timed out")] * len(paths))
    with pytest.raises(DataError) as e:
        split.take(np.array([len(split) - 1]))
    assert str(e.value).startswith("reading memory://jaxlm-test-retry/ds/train-0000") and "\n" not in str(e.value)
    assert f"failed {remote.RETRIES + 1} times (TimeoutError: timed out)" in str(e.value)


def test_a_shard_deleted_or_truncated_during_the_run_stops_it_in_one_line(tmp_path):
    fs = fsspec.filesystem("memory")
    _upload(fs, _random_folder(tmp_path / "ds", docs=60), "/jaxlm-test-gone/ds")
    split = loader_lib.Dataset("memory://jaxlm-test-gone/ds", DataConfig(block_kb=4)).splits["train"]
    end = int(split.offsets_S1[1])  # the first shard's last token
    fs.pipe_file("/jaxlm-test-gone/ds/train-00000.bin", fs.cat_file("/jaxlm-test-gone/ds/train-00000.bin")[:-4096])
    with pytest.raises(DataError, match=r"^memory://jaxlm-test-gone/ds/train-00000.bin ends at byte [\d,]+, before "
                                        r"byte [\d,]+ that its listing and meta.json promise"):
        split.take(np.array([end - 1]))
    fs.rm("/jaxlm-test-gone/ds/train-00001.bin")
    with pytest.raises(DataError, match=r"^memory://jaxlm-test-gone/ds/train-00001.bin cannot be read "
                                        r"\(FileNotFoundError\) though it was there when the run started"):
        split.take(np.array([end]))


def test_token_ids_past_the_vocabulary_fail_when_their_block_arrives(tmp_path):
    folder = _random_folder(tmp_path / "ds", docs=20)
    meta = json.loads((folder / "meta.json").read_text())
    shards.write_meta(folder, {**meta, "vocab_size": 900})
    _upload(fsspec.filesystem("memory"), folder, "/jaxlm-test-ids/ds")
    ds = loader_lib.Dataset("memory://jaxlm-test-ids/ds")  # not read whole before training, as a local one is
    with pytest.raises(DataError, match=r"^memory://jaxlm-test-ids/ds/train-00000.bin holds token id 9\d\d at "
                                        r"position \d+, but meta.json's vocab_size is 900"):
        ds.splits["train"].take(np.arange(5000))


def _cfg(data, run_dir, **overrides):
    return tiny_config(data, run_dir, **{"training.eval_interval": 20, "checkpoint.interval": 10, **overrides})


KILL_AFTER_SEALED_SAVE = """
import json, os, signal, sys
sys.path.insert(0, sys.argv[1])
from conftest import tiny_config
from jaxlm.store import checkpoint
from jaxlm.train import loop as train

save = checkpoint.Checkpointer.save

def save_then_die(self, step, *args):
    save(self, step, *args)
    if step == int(sys.argv[4]):
        self.wait()  # sealed: the rerun resumes from this step, with the batches of later steps read ahead
        os.kill(os.getpid(), signal.SIGKILL)

checkpoint.Checkpointer.save = save_then_die
train.train(tiny_config(sys.argv[2], sys.argv[3], **json.loads(sys.argv[5])), log=lambda s: None)
"""


@pytest.mark.slow  # about 20 s on 2 cores: three 60-step trainings of a tiny model, one killed with SIGKILL at 30
@pytest.mark.in_ci
def test_sixty_steps_from_a_gcs_emulator_equal_the_local_run_also_killed_and_resumed(gcs, corpus, tmp_path):
    """Packed rows (document boundaries from the .idx files) read from fake-gcs-server give the losses of the run
    from the local folder bit for bit; a run killed at step 30 (its next batches read ahead) resumes at 30 and
    repeats the uninterrupted run's losses."""
    from jaxlm.train import loop as train

    _upload(gcs, corpus, "jaxlm-test/prepared")
    url = "gs://jaxlm-test/prepared"
    run = {"training.steps": 60, "optimizer.decay_steps": 60, "data.packing": True}
    train.train(_cfg(corpus, tmp_path / "local", **run), log=lambda s: None)
    ref = train.losses_by_step(tmp_path / "local")
    lines = []
    train.train(_cfg(url, tmp_path / "gcs", **run), log=lines.append)
    assert any(line.startswith(f"data {url}: train ") for line in lines), lines
    got = train.losses_by_step(tmp_path / "gcs")
    assert sorted(got) == list(range(1, 61)) and got == ref

    killed = tmp_path / "killed"
    p = subprocess.run([sys.executable, "-c", KILL_AFTER_SEALED_SAVE, TESTS, url, str(killed), "30",
                        json.dumps({**run, "training.eval_interval": 20, "checkpoint.interval": 10})],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr[-3000:]
    lines = []
    summary = train.train(_cfg(url, killed, **run), log=lines.append)
    assert summary["start_step"] == 30, lines
    got = train.losses_by_step(killed)
    assert sorted(got) == list(range(1, 61)) and got == ref


def test_a_run_from_an_s3_server_equals_the_local_run_and_bad_folders_fail_in_one_line(s3, corpus, tmp_path):
    """Random windows from moto's S3 server: the losses of the run from the local folder. A missing bucket,
    folder or shard, and a shard shorter than meta.json says, stop the run before it compiles, in one line."""
    from jaxlm.train import loop as train, run as run_lib

    _upload(s3, corpus, "jaxlm-test/prepared")
    url = "s3://jaxlm-test/prepared"
    train.train(_cfg(corpus, tmp_path / "local"), log=lambda s: None)
    train.train(_cfg(url, tmp_path / "s3"), log=lambda s: None)
    ref, got = train.losses_by_step(tmp_path / "local"), train.losses_by_step(tmp_path / "s3")
    assert sorted(got) == list(range(1, 21)) and got == ref

    def error(data_url: str) -> str:
        with pytest.raises((ConfigError, DataError)) as e:
            run_lib.setup(_cfg(data_url, tmp_path / "never"))
        assert "\n" not in str(e.value)
        return str(e.value)

    assert error("s3://no-such-bucket/prepared") == ("data.dir s3://no-such-bucket/prepared: bucket no-such-bucket "
                                                     "does not exist; create it or fix the URL")
    assert error("s3://jaxlm-test/nothing/") == ("s3://jaxlm-test/nothing/meta.json is missing; prepare the data "
                                                 "first (`jaxlm prepare ...`)")
    s3.rm("jaxlm-test/prepared/train-00002.bin")
    assert error(url).startswith(f"{url}/train-00002.bin is missing")
    _upload(s3, corpus, "jaxlm-test/prepared")
    s3.pipe_file("jaxlm-test/prepared/val-00000.bin", (corpus / "val-00000.bin").read_bytes()[:-100])
    n = len((corpus / "val-00000.bin").read_bytes()) // 2
    assert error(url) == (f"{url}/val-00000.bin holds {n - 50} tokens but meta.json says {n}; re-run `jaxlm "
                          "prepare`")


def test_an_endpoint_nothing_listens_on_fails_in_one_line(monkeypatch, corpus, tmp_path):
    from jaxlm.train import run as run_lib

    with s3_endpoint_nothing_listens_on(monkeypatch), pytest.raises(ConfigError) as e:
        run_lib.setup(_cfg("s3://jaxlm-test/prepared", tmp_path / "never"))
    message = str(e.value)
    assert message.startswith("data.dir s3://jaxlm-test/prepared: its storage cannot be reached")
    assert "\n" not in message and "127.0.0.1:9" in message


PEAK_RSS = """
import json, resource, sys
sys.path.insert(0, sys.argv[1])
from conftest import tiny_config
from jaxlm.data import remote
from jaxlm.train import loop as train

caches = []
init = remote.BlockCache.__init__

def kept(self, *args):
    init(self, *args)
    caches.append(self)

remote.BlockCache.__init__ = kept
train.train(tiny_config(sys.argv[2], sys.argv[3], **json.loads(sys.argv[4])), log=lambda s: None)
c = caches[0]
print(json.dumps({"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "held_peak": c.peak,
                  "budget": c.budget, "fetched": c.fetched}))
"""


@pytest.mark.slow  # about 15 s on 2 cores: a 256 MB upload and three short trainings in processes of their own
@pytest.mark.in_ci
def test_peak_memory_does_not_grow_with_the_corpus(gcs, tmp_path):
    """The same training from a 2 MB and a 256 MB corpus on the GCS emulator: the larger one's peak RSS is within
    a few MB of the smaller one's (not its 254 MB more), and the blocks held stay within data.cache_mb."""
    sizes = {}
    for name, docs in (("small", 1), ("large", 128)):
        folder, rng = tmp_path / name, np.random.default_rng(0)
        shards.begin(folder)
        entries = {}
        for split in ("train", "val"):
            w = shards.ShardWriter(folder, split, np.uint16, 1 << 25)
            for _ in range(docs if split == "train" else 1):
                w.add(rng.integers(0, 256, size=1 << 20))  # documents of 1M tokens: the indexes stay small
            entries[split] = w.close()
        shards.write_meta(folder, {"vocab_size": 256, "dtype": "uint16", "format": shards.FORMAT,
                                   "tokenizer": {"kind": "byte"}, "splits": entries})
        _upload(gcs, folder, f"jaxlm-test/{name}")
        sizes[name] = sum(f.stat().st_size for f in folder.iterdir())
    stats = {}
    run = {"training.steps": 8, "training.eval_interval": 0, "checkpoint.enabled": False, "data.cache_mb": 4,
           "data.block_kb": 64}
    for name in ("small", "small", "large"):  # the first one compiles the step, the others load it from the cache
        p = subprocess.run([sys.executable, "-c", PEAK_RSS, TESTS, f"gs://jaxlm-test/{name}", str(tmp_path / name /
                            "run"), json.dumps(run)], capture_output=True, text=True, timeout=600, env=os.environ)
        assert p.returncode == 0, p.stdout + p.stderr[-3000:]
        stats[name] = json.loads(p.stdout.strip().splitlines()[-1])
    assert sizes["large"] - sizes["small"] > 250e6
    grown = stats["large"]["peak_rss"] - stats["small"]["peak_rss"]
    assert grown < 0.05 * (sizes["large"] - sizes["small"]), (grown, stats)
    for s in stats.values():
        assert 0 < s["held_peak"] <= s["budget"] == 4 << 20
