"""Throughput of `jaxlm prepare corpus --ray` on a two-node Ray cluster on this machine (`ray start --head` and a
second `ray start --address`, one CPU each), with one and then two tasks at a time, against the local prepare
(--workers 2), in one run; each Ray output is checked equal, file by file and byte for byte, to the local one.

The corpus is --mb MB (default 200) of zstd JSON-lines files of --file-words words each (about 3.5 MB),
documents of 20 to 600 words drawn independently from tiny Shakespeare's word frequencies; the tokenizer a
byte-level BPE of --vocab-size tokens trained on tiny Shakespeare. Prints `local_tokens_per_s`,
`ray_1_tokens_per_s`, `ray_2_tokens_per_s`, `ray_2_over_1` (issue 45 asks >= 1.6) and `ray_2_vs_local`. On a
2-core machine the driver and Ray's own processes share the two cores with the two tasks, which bounds
ray_2_over_1 below 2.
"""

import argparse
import filecmp
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxlm.data import bpe, prepare, ray_prepare

SHAKESPEARE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tinyshakespeare" / "input.txt"


def make_corpus(folder: Path, source: Path, mb: float, file_words: int) -> list[Path]:
    """zstd JSON-lines files of `file_words` generated words each, until they hold `mb` MB."""
    import zstandard

    words, counts = np.unique(re.findall(r"\S+", source.read_text()), return_counts=True)
    rng = np.random.default_rng(0)
    out, total = [], 0
    compress = zstandard.ZstdCompressor(level=3)
    while total < mb * 1e6:
        picks = words[rng.choice(len(words), size=file_words, p=counts / counts.sum())].tolist()
        ends = np.cumsum(rng.integers(20, 600, size=len(picks) // 20))
        ends = ends[ends < len(picks)]
        docs = [" ".join(picks[a:b]) for a, b in zip(np.concatenate([[0], ends[:-1]]), ends)]
        data = compress.compress("".join(json.dumps({"text": d}) + "\n" for d in docs).encode())
        out.append(folder / f"part-{len(out):04d}.jsonl.zst")
        out[-1].write_bytes(data)
        total += len(data)
    return out


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def start_cluster(temp: Path) -> tuple[str, list[int]]:
    """A head and a second node, one CPU each, each in a session of its own: (address, their process groups)."""
    port, client, agent1, agent2 = _free_ports(4)
    address = f"127.0.0.1:{port}"
    ray = Path(sys.executable).with_name("ray")
    groups = []
    for args in (["--head", f"--port={port}", f"--temp-dir={temp}", "--include-dashboard=false",
                  f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent1}"],
                 [f"--address={address}", f"--dashboard-agent-listen-port={agent2}"]):
        p = subprocess.Popen([str(ray), "start", "--num-cpus=1", "--node-ip-address=127.0.0.1",
                              "--object-store-memory=500000000", "--disable-usage-stats", *args],
                             start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        groups.append(p.pid)
        out, _ = p.communicate(timeout=180)
        if p.returncode:
            stop_cluster(groups)
            sys.exit(f"ray start failed:\n{out.decode()[-3000:]}")
    return address, groups


def stop_cluster(groups: list[int]) -> None:
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass


def same_folder(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir() if p.is_file())
    return names == sorted(p.name for p in b.iterdir() if p.is_file()) and all(
        filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=200, help="MB of .jsonl.zst files")
    ap.add_argument("--file-words", type=int, default=1_500_000)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--input", default=str(SHAKESPEARE))
    a = ap.parse_args()
    os.environ["RAY_AUTH_MODE"] = "disabled"  # the cluster and this driver alike: no token in ~/.ray
    with tempfile.TemporaryDirectory(prefix="jaxlm-ray-bench-") as tmp:
        tmp = Path(tmp)
        (tmp / "corpus").mkdir()
        t = time.perf_counter()
        files = [str(f) for f in make_corpus(tmp / "corpus", Path(a.input), a.mb, a.file_words)]
        mb = sum(os.path.getsize(f) for f in files) / 1e6
        print(f"made {mb:.1f} MB in {len(files)} .jsonl.zst files in {time.perf_counter() - t:.1f} s", flush=True)
        tok = str(bpe.train_bpe([a.input], a.vocab_size, tmp / "tok"))
        seconds = {}
        t = time.perf_counter()
        meta = prepare.prepare_corpus(files, tmp / "local", tok, val_fraction=0.001, workers=2, progress=False)
        seconds["local"] = time.perf_counter() - t
        tokens = meta["train_tokens"] + meta["val_tokens"]
        print(f"local: {seconds['local']:.1f} s, {tokens:,} tokens", flush=True)
        address, groups = start_cluster(tmp / "ray")
        try:
            for workers in (1, 2):
                out = tmp / f"ray_{workers}"
                t = time.perf_counter()
                ray_prepare.prepare_corpus(files, out, tok, address, val_fraction=0.001, workers=workers,
                                           progress=False)
                seconds[f"ray_{workers}"] = time.perf_counter() - t
                equal = same_folder(tmp / "local", out)
                print(f"ray, {workers} task(s) at a time: {seconds[f'ray_{workers}']:.1f} s, equal to the local "
                      f"prepare: {equal}", flush=True)
                if not equal:
                    sys.exit(f"the output of --ray with {workers} worker(s) differs from the local prepare's")
        finally:
            stop_cluster(groups)
    docs = meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"]
    print(f"corpus {mb:.1f} MB of .jsonl.zst in {len(files)} files, {docs:,} documents, {tokens:,} tokens; load "
          f"average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for name, s in seconds.items():
        print(f"{name}_tokens_per_s={tokens / s:,.0f}")
    print(f"ray_2_over_1={seconds['ray_1'] / seconds['ray_2']:.2f}")
    print(f"ray_2_vs_local={seconds['local'] / seconds['ray_2']:.2f}")


if __name__ == "__main__":
    main()
