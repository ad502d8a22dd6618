"""`jaxlm prepare corpus --ray` on a real two-node Ray cluster on this machine (`ray start --head` and a second
`ray start --address`, one CPU each): the same shards and meta.json, byte for byte, as the local prepare for
JSON lines (cut into pieces), zstd, parquet and JSON-list inputs; the same after a Ray worker process is killed
mid-run, and after the driver is killed and the command run again, which encodes only the units not saved
before the kill; and each error in one line, bad input as the local prepare words it."""

import filecmp
import gzip
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from conftest import require
from slurm_cluster import free_ports
from jaxlm import cli
from jaxlm.data import bpe, prepare, ray_prepare
from jaxlm.data.errors import DataError

RAY = Path(sys.executable).with_name("ray")
ROOT = Path(__file__).resolve().parents[1]


def _processes() -> list[tuple[int, int, int, bytes]]:
    """(pid, parent pid, process group, command line) of every process on the machine."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
                cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            out.append((int(name), int(fields[1]), int(fields[2]), cmdline))
    return out


class Cluster:
    """A head node and a second node, each started by `ray start` in a session of its own: stop() ends those
    sessions' processes and their worker processes (the raylets' children, in sessions of their own), and no
    other Ray process on the machine."""

    def __init__(self):
        self.temp = tempfile.mkdtemp(prefix="jaxlm-ray-")  # short: Ray's socket paths have a length limit
        port, client, agent1, agent2 = free_ports(4)
        self.address = f"127.0.0.1:{port}"
        self.groups: list[int] = []
        self.nodes = [["--head", f"--port={port}", f"--temp-dir={self.temp}", "--include-dashboard=false",
                       f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent1}"],
                      [f"--address={self.address}", f"--dashboard-agent-listen-port={agent2}"]]

    def start(self) -> None:
        for args in self.nodes:
            p = subprocess.Popen([str(RAY), "start", "--num-cpus=1", "--node-ip-address=127.0.0.1",
                                  "--object-store-memory=100000000", "--disable-usage-stats", *args],
                                 start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            self.groups.append(p.pid)
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0, out.decode()[-2000:]
        import ray

        ray.init(address=self.address, logging_level="ERROR")
        try:
            deadline = time.time() + 60
            while ray.cluster_resources().get("CPU", 0) < 2:
                assert time.time() < deadline, f"the second node did not join: {ray.cluster_resources()}"
                time.sleep(0.2)
        finally:
            ray.shutdown()

    def raylets(self) -> set[int]:
        return {pid for pid, _, group, cmd in _processes() if group in self.groups and b"raylet" in cmd.split(b"\0")[0]}

    def workers(self, title: bytes = b"ray::") -> list[int]:
        """Worker processes of this cluster whose title starts with `title` (Ray names them ray::TASK_NAME)."""
        raylets = self.raylets()
        return [pid for pid, parent, _, cmd in _processes() if parent in raylets and cmd.startswith(title)]

    def stop(self) -> None:
        workers = self.workers()
        for group in self.groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["rm", "-rf", self.temp])


@pytest.fixture(scope="module")
def cluster():
    require("ray")
    with pytest.MonkeyPatch.context() as env:
        # A local ray.init() (`--ray` without an address) writes ~/.ray/auth_token, and a head started where one
        # exists turns token authentication on, which a second node started the same way then fails: no tokens here.
        env.setenv("RAY_AUTH_MODE", "disabled")
        c = Cluster()
        try:
            c.start()
            yield c
        finally:
            c.stop()


@pytest.fixture(scope="module")
def tok(tmp_path_factory, shakespeare_file) -> str:
    return str(bpe.train_bpe([str(shakespeare_file)], 320, tmp_path_factory.mktemp("bpe")))


def _paragraphs(shakespeare_file, n: int, seed: int) -> list[str]:
    paragraphs = [p for p in Path(shakespeare_file).read_text().split("\n\n") if p.strip()]
    rng = random.Random(seed)
    return [rng.choice(paragraphs) + f" ({i})" for i in range(n)]


def _jsonl(texts: list[str]) -> bytes:
    return "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, shakespeare_file) -> list[str]:
    """JSON lines (with a blank line, an empty document, CRLF ends and no newline at the end), zstd, parquet,
    gzip and a JSON list: the first file is cut into pieces at 50,000 bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    d = tmp_path_factory.mktemp("mixed")
    lines = _jsonl(_paragraphs(shakespeare_file, 1200, 0)).split(b"\n")
    lines[10], lines[11] = b"", json.dumps({"text": " "}).encode()
    (d / "a.jsonl").write_bytes(b"\r\n".join(lines[:300]) + b"\r\n" + b"\n".join(lines[300:]).rstrip(b"\n"))
    (d / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl(_paragraphs(shakespeare_file, 300, 1))))
    pq.write_table(pa.table({"text": _paragraphs(shakespeare_file, 300, 2)}), d / "c.parquet")
    (d / "d.jsonl.gz").write_bytes(gzip.compress(_jsonl(_paragraphs(shakespeare_file, 200, 3))))
    (d / "e.json").write_text(json.dumps([{"text": t} for t in _paragraphs(shakespeare_file, 100, 4)]))
    return [str(d / n) for n in ("a.jsonl", "b.jsonl.zst", "c.parquet", "d.jsonl.gz", "e.json")]


@pytest.fixture(scope="module")
def many(tmp_path_factory, shakespeare_file, tok) -> tuple[list[str], Path]:
    """Eight zstd JSON-lines files of about 0.6 MB each (one unit each, a fraction of a second to encode), and
    the local prepare of them."""
    import zstandard

    d = tmp_path_factory.mktemp("many")
    files = []
    for i in range(8):
        files.append(d / f"part-{i}.jsonl.zst")
        files[-1].write_bytes(zstandard.ZstdCompressor().compress(_jsonl(_paragraphs(shakespeare_file, 2000, 10 + i))))
    reference = d / "local"
    prepare.prepare_corpus([str(f) for f in files], reference, tok, val_fraction=0.01, shard_tokens=100_000,
                           workers=2, progress=False)
    return [str(f) for f in files], reference


def assert_same_folder(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        if (a / name).is_file():
            assert filecmp.cmp(a / name, b / name, shallow=False), name
    assert filecmp.cmp(a / "tokenizer" / "tokenizer.json", b / "tokenizer" / "tokenizer.json", shallow=False)


@pytest.mark.slow
@pytest.mark.in_ci  # issue 45: the Ray cluster runs in CI
def test_ray_gives_the_local_prepares_folder(cluster, mixed, tok, tmp_path):
    kw = dict(val_fraction=0.05, shard_tokens=20_000, progress=False)
    local = prepare.prepare_corpus(mixed, tmp_path / "local", tok, workers=0, **kw)
    on_ray = ray_prepare.prepare_corpus(mixed, tmp_path / "ray", tok, cluster.address, workers=2, unit_bytes=50_000,
                                        **kw)
    assert on_ray == local and local["splits"]["val"]["documents"] > 50 and len(local["splits"]["train"]["shards"]) > 5
    assert local["skipped"] == {"files": 5, "empty_documents": 1}
    assert_same_folder(tmp_path / "local", tmp_path / "ray")  # meta.json too, byte for byte
    units = ray_prepare.plan(mixed, None, 50_000)[0]
    pieces = [(u.start, u.end) for u in units if u.path == mixed[0]]  # the first file in pieces cut after newlines
    data = Path(mixed[0]).read_bytes()
    assert len(pieces) >= 4 and pieces[0][0] == 0 and pieces[-1][1] == len(data) and len(units) == len(pieces) + 4
    assert all(a[1] == b[0] and data[b[0] - 1:b[0]] == b"\n" for a, b in zip(pieces, pieces[1:]))
    # separate validation inputs
    prepare.prepare_corpus(mixed[:2], tmp_path / "local_val", tok, val=mixed[2:], workers=0, progress=False)
    ray_prepare.prepare_corpus(mixed[:2], tmp_path / "ray_val", tok, cluster.address, val=mixed[2:],
                               unit_bytes=50_000, progress=False)
    assert_same_folder(tmp_path / "local_val", tmp_path / "ray_val")


@pytest.mark.slow
@pytest.mark.in_ci
def test_a_killed_worker_process_is_replaced_and_the_output_is_the_same(cluster, many, tok, tmp_path):
    files, reference = many
    killed: list[int] = []
    done = threading.Event()

    def kill_one_task():
        while not done.is_set() and not killed:
            for pid in cluster.workers(b"ray::prepare unit"):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                break
            time.sleep(0.01)

    watcher = threading.Thread(target=kill_one_task)
    watcher.start()
    try:
        ray_prepare.prepare_corpus(files, tmp_path / "ray", tok, cluster.address, val_fraction=0.01,
                                   shard_tokens=100_000, progress=False)
    finally:
        done.set()
        watcher.join()
    assert killed, "no task was seen running"
    assert_same_folder(reference, tmp_path / "ray")


@pytest.mark.slow
@pytest.mark.in_ci
def test_a_killed_driver_resumes_without_encoding_a_unit_twice(cluster, many, tok, tmp_path, capsys, monkeypatch):
    files, reference = many
    out = tmp_path / "ray"
    args = ["prepare", "corpus", *files, "--tokenizer", tok, "--out", str(out), "--val-fraction", "0.01",
            "--shard-tokens", "100000", "--workers", "1", "--no-progress", "--ray", cluster.address]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    driver = subprocess.Popen([sys.executable, "-m", "jaxlm.cli", *args], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
    work = out / ray_prepare.WORK
    deadline = time.time() + 120
    while len(list(work.glob("unit-*.json"))) < 2:
        assert driver.poll() is None, driver.stdout.read().decode()
        assert time.time() < deadline
        time.sleep(0.02)
    driver.kill()
    driver.wait()
    saved = {int(p.name[5:-5]) for p in work.glob("unit-*.json")}
    assert 2 <= len(saved) < len(files) and not (out / "meta.json").exists()
    damaged = work / f"unit-{min(saved):06d}.npz"  # a saved result whose bytes changed is encoded again
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 1
    damaged.write_bytes(data)

    encoded = []
    save = ray_prepare.Work.save
    monkeypatch.setattr(ray_prepare.Work, "save", lambda self, k, result: (encoded.append(k), save(self, k, result)))
    capsys.readouterr()
    assert cli.main(args) == 0
    err = capsys.readouterr().err
    assert f"resuming from {work}: {len(saved)} of {len(files)} units already encoded" in err
    assert sorted(encoded) == sorted(set(range(len(files))) - saved | {min(saved)})  # the others: once in all
    assert not work.exists()
    assert_same_folder(reference, out)


@pytest.mark.slow
@pytest.mark.in_ci
def test_bad_input_fails_as_in_the_local_prepare(cluster, tmp_path, capsys):
    lines = _jsonl([f"document {i} " * 10 for i in range(3000)]).split(b"\n")
    lines[2500] = b'{"text": "cut'
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\n".join(lines))
    messages = []
    for run in (lambda: prepare.prepare_corpus([str(bad)], tmp_path / "local", "byte", workers=0, progress=False),
                lambda: ray_prepare.prepare_corpus([str(bad)], tmp_path / "ray", "byte", cluster.address,
                                                   unit_bytes=20_000, progress=False)):
        with pytest.raises(DataError) as e:
            run()
        messages.append(str(e.value))
    assert messages[0] == messages[1] == f"{bad}:2501: broken JSON line (Unterminated string starting at column 10)"
    assert not (tmp_path / "ray" / "meta.json").exists()
    # a token id past the model's vocabulary, in a later piece, named by its line too
    lines[2500] = json.dumps({"text": "é"}).encode()
    bad.write_bytes(b"\n".join(lines))
    code = cli.main(["prepare", "corpus", str(bad), "--tokenizer", "byte", "--out", str(tmp_path / "ray"),
                     "--vocab-size", "150", "--no-progress", "--ray", cluster.address])
    err = capsys.readouterr().err
    assert code == 2 and "starting over" in err
    assert err.splitlines()[-1] == (f"error: {bad}:2501: token id 195 is at or above the vocabulary size 150; the "
                                    "tokenizer does not match the model (check --tokenizer and --vocab-size)")


def test_errors_in_one_line(tmp_path, capsys, monkeypatch):
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps({"text": "a document"}) + "\n")
    base = ["prepare", "corpus", str(f), "--tokenizer", "byte", "--out", str(tmp_path / "o"), "--ray"]
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    assert cli.main(base + [f"127.0.0.1:{closed}"]) == 2
    assert re.fullmatch(rf"error: --ray 127.0.0.1:{closed}: no Ray cluster answers there \(ConnectionRefusedError\); "
                        r"give the head's host:port .*\n", capsys.readouterr().err)
    assert cli.main(["prepare", "corpus", "datasets:wikitext", "--tokenizer", "byte", "--out", str(tmp_path / "o"),
                     "--ray", "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err == ("error: --ray reads files (local, s3://, gs://), not datasets:wikitext: prepare "
                                       "it without --ray\n")
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    assert cli.main(base) == 2
    assert capsys.readouterr().err == "error: --ray needs Ray: pip install 'jaxlm[ray]'\n"
    assert not (tmp_path / "o").exists()
