"""Run directories as URLs: paths and file:// map to local disk, other schemes go through fsspec (an
in-memory filesystem, and a local S3-compatible server: moto), a URL run's append-only files reach it through a
local mirror, and checkpoints on s3:// are written, verified, rejected and restored there."""

import json
import os
import signal
import sys
from pathlib import Path

import fsspec
import pytest

from jaxlm import storage
from jaxlm.config import ConfigError


def test_paths_and_file_urls_are_local(tmp_path):
    assert storage.local_path(str(tmp_path)) == tmp_path
    assert storage.local_path(f"file://{tmp_path}") == tmp_path
    assert storage.local_path("memory://runs/a") is None
    assert storage.join(str(tmp_path), "a", "b") == str(tmp_path / "a" / "b")
    assert storage.join("gs://bucket/runs/", "config.json") == "gs://bucket/runs/config.json"
    assert storage.orbax_dir(f"file://{tmp_path}/run") == tmp_path / "run"
    assert str(storage.orbax_dir("s3://bucket/run")) == "s3://bucket/run"


def test_text_files_on_an_fsspec_filesystem():
    url = "memory://jaxlm-test-storage/run"
    storage.makedirs(url)
    storage.write_text(storage.join(url, "config.json"), "{}")
    assert storage.exists(storage.join(url, "config.json"))
    assert storage.read_text(storage.join(url, "config.json")) == "{}"
    assert not storage.exists(storage.join(url, "nothing"))


def test_unusable_urls_fail_with_one_line():
    with pytest.raises(ConfigError, match="no filesystem for nosuchfs:// URLs"):
        storage.exists("nosuchfs://x/y")
    with pytest.raises(ConfigError, match="checkpoints cannot be written to memory://x"):
        storage.orbax_dir("memory://x")


def test_mirror_uploads_changes_and_resumes_appending():
    url = "memory://jaxlm-test-mirror/run"
    m = storage.Mirror(url)
    assert m.remote and m.dir.is_dir()
    (m.dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (m.dir / "tensorboard").mkdir()
    (m.dir / "tensorboard" / "events").write_bytes(b"abc")
    m.sync()
    fs = fsspec.filesystem("memory")
    assert fs.cat("/jaxlm-test-mirror/run/metrics.jsonl") == b'{"step": 1}\n'
    assert fs.cat("/jaxlm-test-mirror/run/tensorboard/events") == b"abc"
    with open(m.dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 2}\n')
    m.sync()
    assert fs.cat("/jaxlm-test-mirror/run/metrics.jsonl").count(b"step") == 2
    again = storage.Mirror(url)  # a resumed run starts from the file already there
    assert (again.dir / "metrics.jsonl").read_text().count("step") == 2


def test_training_into_file_and_memory_urls(char_data, tmp_path):
    """A file:// run directory is a local one (checkpoints, resume); an fsspec URL receives config.json, metrics
    and TensorBoard events; checkpoints on a URL Orbax cannot write to fail before compiling."""
    from conftest import tiny_config
    from jaxlm.train import loop as train

    url = f"file://{tmp_path}/run"
    train.train(tiny_config(char_data, url, **{"training.steps": 10}), log=lambda s: None)
    assert (tmp_path / "run" / "checkpoints" / "10").is_dir()
    summary = train.train(tiny_config(char_data, url), log=lambda s: None)
    assert summary["start_step"] == 10 and sorted(train.losses_by_step(url)) == list(range(1, 21))

    mem = "memory://jaxlm-test-train/run"
    cfg = tiny_config(char_data, mem, **{"checkpoint.enabled": False, "logging.tensorboard": True})
    train.train(cfg, log=lambda s: None)
    fs = fsspec.filesystem("memory")
    assert fs.exists("/jaxlm-test-train/run/config.json")
    assert sorted(train.losses_by_step(mem)) == list(range(1, 21))
    assert fs.glob("/jaxlm-test-train/run/tensorboard/events.out.tfevents.*")
    with pytest.raises(ConfigError, match="checkpoints cannot be written to memory://jaxlm-test-train/other"):
        train.train(tiny_config(char_data, "memory://jaxlm-test-train/other"), log=lambda s: None)


def flip_a_bit_on_the_server(fs, step_dir: str) -> tuple[str, bytes]:
    """Flip one bit in the middle of the largest object of a checkpoint (array data): (its path, its bytes)."""
    files = {k: v["size"] for k, v in fs.find(step_dir, detail=True).items()}
    path = max(files, key=files.get)
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0x10
    fs.pipe_file(path, bytes(data))
    return path, bytes(data)


@pytest.mark.slow  # about 60 s on 2 cores: four trainings and an evaluation of the same tiny model
def test_checkpoints_on_s3_resume_exactly_and_a_corrupted_one_is_rejected(s3, char_data, tmp_path):
    """Orbax writes the checkpoints to the S3 server itself, jaxlm seals, verifies, lists, rejects and deletes
    them there: a resumed run's losses equal an uninterrupted run's, and a checkpoint damaged on the server is
    set aside (copied to rejected/, then deleted) for the previous one."""
    from conftest import tiny_config
    from jaxlm.store import checkpoint as ckpt
    from jaxlm.eval import heldout as evaluate
    from jaxlm.train import loop as train, run as run_lib

    run = {"training.steps": 20, "optimizer.decay_steps": 20, "checkpoint.interval": 5, "training.eval_interval": 0}
    train.train(tiny_config(char_data, tmp_path / "reference", **run), log=lambda s: None)
    ref = train.losses_by_step(tmp_path / "reference")

    with pytest.raises(ConfigError, match=r"^run_dir s3://no-such-bucket/run: bucket no-such-bucket does not exist"):
        run_lib.setup(tiny_config(char_data, "s3://no-such-bucket/run"))  # fsspec would create the bucket
    url, bucket_dir = "s3://jaxlm-test/run", "jaxlm-test/run"
    train.train(tiny_config(char_data, url, **{**run, "training.steps": 10}), log=lambda s: None)
    assert ckpt.step_numbers(f"{url}/checkpoints") == [5, 10]
    assert s3.exists(f"{bucket_dir}/checkpoints/10/jaxlm_manifest.json")
    assert any("ocdbt.process_0" in p for p in s3.find(f"{bucket_dir}/checkpoints/10"))
    lines = []
    summary = train.train(tiny_config(char_data, url, **run), log=lines.append)
    assert summary["start_step"] == 10 and f"resumed from {url}/checkpoints/10 at step 10" in lines
    got = train.losses_by_step(url)
    assert sorted(got) == list(range(1, 21)) and [got[s] for s in range(1, 21)] == [ref[s] for s in range(1, 21)]
    assert ckpt.step_numbers(f"{url}/checkpoints") == [10, 15, 20]  # checkpoint.keep=3: 5 was deleted

    damaged, damaged_bytes = flip_a_bit_on_the_server(s3, f"{bucket_dir}/checkpoints/20")
    lines = []
    summary = train.train(tiny_config(char_data, url, **run), log=lines.append)
    warning = next(line for line in lines if line.startswith("warning: skipping checkpoint"))
    assert f"{url}/checkpoints/20:" in warning and "checksum" in warning
    assert summary["start_step"] == 15
    # Set aside as it was (a copy, then the original deleted); step 20 was saved anew, with new data files.
    assert s3.cat_file(damaged.replace("/checkpoints/20/", "/checkpoints/rejected/20/")) == damaged_bytes
    assert not s3.exists(damaged)
    note = json.loads(s3.cat_file(f"{bucket_dir}/checkpoints/rejected/20/{ckpt.REJECTED_NOTE}"))
    assert "checksum" in note["reason"]
    assert ckpt.verify(f"{url}/checkpoints/20") is None
    got = train.losses_by_step(url)
    assert [got[s] for s in range(16, 21)] == [ref[s] for s in range(16, 21)]

    evaluated = evaluate.evaluate_run(url, {"training.sample_tokens": 0}, log=lambda s: None)
    assert evaluated["step"] == 20 and evaluated["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-6)


def test_object_store_urls_that_cannot_work_fail_with_one_line(monkeypatch, char_data):
    """A missing filesystem package names what to install; an endpoint nothing listens on fails before
    compiling, in one line."""
    from conftest import s3_endpoint_nothing_listens_on, tiny_config
    from fsspec.registry import _registry
    from jaxlm.train import run as run_lib

    monkeypatch.delitem(_registry, "s3", raising=False)
    monkeypatch.setitem(sys.modules, "s3fs", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"^run_dir s3://jaxlm-test/run: no filesystem for s3:// URLs "
                                          r"\(pip install s3fs\)$"):
        run_lib.setup(tiny_config(char_data, "s3://jaxlm-test/run"))
    monkeypatch.undo()

    with s3_endpoint_nothing_listens_on(monkeypatch), pytest.raises(ConfigError) as e:
        run_lib.setup(tiny_config(char_data, "s3://jaxlm-test/run"))
    assert "\n" not in str(e.value) and "cannot be reached" in str(e.value) and "127.0.0.1:9" in str(e.value)


KILL_AFTER_SAVE = """
import json, os, signal, sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from conftest import tiny_config
from jaxlm.store import checkpoint
from jaxlm.train import loop as train

save = checkpoint.Checkpointer.save

def save_then_die(self, step, *args):
    save(self, step, *args)  # returns once the async save has started
    if step == int(sys.argv[4]):
        os.kill(os.getpid(), signal.SIGKILL)

checkpoint.Checkpointer.save = save_then_die
train.train(tiny_config(Path(sys.argv[2]), sys.argv[3], **json.loads(sys.argv[5])), log=lambda s: None)
"""


@pytest.mark.slow  # about 70 s on 2 cores: four trainings of a tiny model, one in a process killed with SIGKILL
def test_gs_run_directory_on_an_emulator_resumes_exactly_after_sigkill_and_rejects_a_corrupted_checkpoint(
        gcs, char_data, tmp_path):
    """Everything on gs:// goes to a GCS server (an emulator here): Orbax's arrays through tensorstore, jaxlm's
    manifests, metrics and config through gcsfs. A run killed with SIGKILL right after a save started resumes from
    the last sealed checkpoint and repeats the uninterrupted run's losses; a checkpoint damaged on the server is
    set aside for the one before it."""
    import subprocess

    from conftest import TEST_XLA_FLAGS, tiny_config
    from jaxlm.store import checkpoint as ckpt
    from jaxlm.train import loop as train

    run = {"training.steps": 20, "optimizer.decay_steps": 20, "checkpoint.interval": 5, "training.eval_interval": 0}
    train.train(tiny_config(char_data, tmp_path / "reference", **run), log=lambda s: None)
    ref = train.losses_by_step(tmp_path / "reference")

    url, bucket_dir = "gs://jaxlm-test/run", "jaxlm-test/run"
    tests = str(Path(__file__).resolve().parent)
    p = subprocess.run([sys.executable, "-c", KILL_AFTER_SAVE, tests, str(char_data), url, "15", json.dumps(run)],
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, XLA_FLAGS=TEST_XLA_FLAGS))
    assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr[-3000:]
    assert gcs.exists(f"{bucket_dir}/checkpoints/10/{ckpt.MANIFEST}")
    assert not gcs.exists(f"{bucket_dir}/checkpoints/15/{ckpt.MANIFEST}")  # killed before it was sealed
    assert any("ocdbt.process_0" in f for f in gcs.find(f"{bucket_dir}/checkpoints/10"))
    lines = []
    summary = train.train(tiny_config(char_data, url, **run), log=lines.append)
    assert summary["start_step"] == 10 and f"resumed from {url}/checkpoints/10 at step 10" in lines, lines
    got = train.losses_by_step(url)
    assert sorted(got) == list(range(1, 21)) and [got[s] for s in range(1, 21)] == [ref[s] for s in range(1, 21)]
    assert gcs.exists(f"{bucket_dir}/config.json") and ckpt.verify(f"{url}/checkpoints/20") is None

    damaged, damaged_bytes = flip_a_bit_on_the_server(gcs, f"{bucket_dir}/checkpoints/20")
    lines = []
    summary = train.train(tiny_config(char_data, url, **run), log=lines.append)
    warning = next(line for line in lines if line.startswith("warning: skipping checkpoint"))
    assert f"{url}/checkpoints/20:" in warning and "checksum" in warning
    assert summary["start_step"] == 15
    assert gcs.cat_file(damaged.replace("/checkpoints/20/", "/checkpoints/rejected/20/")) == damaged_bytes
    assert ckpt.verify(f"{url}/checkpoints/20") is None
    got = train.losses_by_step(url)
    assert [got[s] for s in range(16, 21)] == [ref[s] for s in range(16, 21)]
