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
    assert str(storage.orbax_dir("gs://bucket/run")) == "gs://bucket/run"


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
