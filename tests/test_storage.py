"""Run directories as URLs: paths and file:// map to local disk, other schemes go through fsspec (an
in-memory filesystem here), and a URL run's append-only files reach it through a local mirror."""

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
    from jaxlm import train

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
