"""The layout copies and transposes of a whole training step compiled for a TPU from this host (libtpu; no chip
needed): every copy or transpose the optimized HLO runs (a plain op, or a fusion XLA named after one), with its
result bytes, the compiler's estimated cycles, forward or backward, and the source op it came from, so that
the attention's layout traffic can be read before and after a change (docs/performance.md, "Attention").

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 PYTHONPATH=src python benchmarks/layout_hlo.py v5e-1 maxtext_base \\
        model.param_dtype=bfloat16 model.remat=minimal model.loss_chunk_tokens=4096 training.batch_size=2
    ... --hlo FILE      also write the optimized HLO there
    ... --top N         rows of the largest-ops list

Ops inside the layers' scan body run once a layer: the totals count them once per layer, so they are per step.
Estimated milliseconds are the compiler's estimated cycles at v5e's 1.5 GHz.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
from pathlib import Path

from moe_hlo import nbytes  # noqa: E402 - benchmarks/ is the script's folder


def computations(hlo: str) -> dict[str, list[str]]:
    """The HLO's computations by name: their instruction lines."""
    out, name = {}, None
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%(\S+) ", line)
        if m and line.rstrip().endswith("{"):
            name = m[1]
            out[name] = []
        elif name and line.startswith("  "):
            out[name].append(line)
    return out


def layout_ops(hlo: str, layers: int, every: bool = False) -> list[dict]:
    """Every copy or transpose that runs (not the ops inside fusions: the fusions themselves), each with `times`,
    how often a step runs it: `layers` times in a while loop whose carry stacks arrays of `layers` rows (the
    layers' scan; the optimized HLO keeps no trip counts), else once. Ops without metadata of their own take
    the phase (forward, backward) of the loop around them. every: all the ops that run, not only those."""
    comps = computations(hlo)
    fused, calls = set(), collections.defaultdict(list)  # calls: computation -> [(callee, trips, phase)]
    for name, lines in comps.items():
        for line in lines:
            for callee in re.findall(r"calls=%([\w.-]+)", line):
                fused.add(callee)
            if " while(" in line:
                body = re.search(r"body=%([\w.-]+)", line)
                head = line.split(" while(")[0]
                phase = "backward" if "transpose(" in (re.search(r'op_name="([^"]*)"', line) or [0, ""])[1] else None
                if body:
                    calls[name].append((body[1], layers if f"[{layers}," in head else 1, phase))
            for callee in re.findall(r"(?:to_apply|branch_computations=\{|true_computation|false_computation)=?%"
                                     r"([\w.-]+)", line):
                calls[name].append((callee, 1, None))
    times, phases = {}, {}
    entry = re.search(r"^ENTRY %(\S+) ", hlo, re.M)[1]
    stack = [(entry, 1, "forward")]
    while stack:
        name, n, phase = stack.pop()
        if times.get(name, 0) >= n:
            continue
        times[name], phases[name] = n, phase
        stack.extend((callee, n * trips, p or phase) for callee, trips, p in calls.get(name, ()))
    out = []
    for name, lines in comps.items():
        if name in fused or name not in times:
            continue
        for line in lines:
            m = re.match(r"\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][\w-]*)\(", line)
            if not m:
                continue
            iname, rtype, op = m.groups()
            base = re.sub(r"[._]\d+$", "", iname)
            is_layout = op in ("copy", "transpose", "copy-start") or (
                op == "fusion" and re.match(r"(copy|transpose)", base))
            if not is_layout and not every:
                continue
            op_name = (re.search(r'op_name="([^"]*)"', line) or [None, ""])[1]
            cycles = re.search(r'"estimated_cycles":"(\d+)"', line)
            out.append(dict(name=iname, op=op, bytes=nbytes(rtype), cycles=int(cycles[1]) if cycles else 0,
                            times=times[name], phase="backward" if "transpose(" in op_name else (
                                "forward" if op_name else phases[name]),
                            shape=re.sub(r"\{[^{}]*\}", "", rtype) if "{" in rtype else rtype,
                            layout=rtype, source=op_name))
    return out


def summary(ops: list[dict], ghz: float = 1.5) -> str:
    """Totals per step by phase: ops, GiB written, estimated ms (cycles at `ghz`, v5e's TensorCore clock).
    Asynchronous copies (copy-start: moves between memory spaces that overlap compute) are counted apart."""
    rows = []
    for phase in ("forward", "backward", "async"):
        sel = [o for o in ops if (o["op"] == "copy-start") == (phase == "async") and (
            phase == "async" or o["phase"] == phase)]
        n = sum(o["times"] for o in sel)
        b = sum(o["bytes"] * o["times"] for o in sel) / 2**30
        c = sum(o["cycles"] * o["times"] for o in sel)
        rows.append(f"{phase} {n} ops {b:.2f} GiB ~{c / ghz / 1e6:.2f} ms")
    return "; ".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("topology")
    ap.add_argument("preset")
    ap.add_argument("overrides", nargs="*", help="key=value settings")
    ap.add_argument("--hlo", default=None)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--min-mib", type=float, default=1.0, help="list ops of at least this many MiB")
    a = ap.parse_args()
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jaxlm import config as config_lib
    from jaxlm.train import aot

    cfg = config_lib.load(a.preset, dict(o.split("=", 1) for o in a.overrides))
    cfg = cfg.replace(compile=dataclasses.replace(cfg.compile, topology=a.topology))
    aot.prepare_process(cfg.compile)
    r = aot.compile_for(cfg, aot.target(cfg.compile))
    if r.executable is None:
        print("does not compile / fit:", r.oom)
        return
    mem = r.executable.memory_analysis()
    hlo = r.executable.as_text()
    if a.hlo:
        Path(a.hlo).write_text(hlo)
    peak = getattr(mem, "peak_memory_in_bytes", 0) / 2**30
    print(f"{a.preset} {' '.join(a.overrides)} on {a.topology}: temporaries {mem.temp_size_in_bytes / 2**30:.2f} GiB,"
          f" the compiler's peak {peak:.2f} GiB")
    ops = layout_ops(hlo, cfg.model.n_layers)
    big = [o for o in ops if o["bytes"] >= a.min_mib * 2**20]
    every = layout_ops(hlo, cfg.model.n_layers, every=True)
    total = sum(o["cycles"] * o["times"] for o in every)
    print(f"every op the compiler estimates (not the custom calls: the splash kernels): ~{total / 1.5e6:.1f} ms")
    print("all copies/transposes:", summary(ops))
    print(f"those of >= {a.min_mib:g} MiB:", summary(big))
    print(f"the {a.top} largest synchronous ones (MiB, est. M cycles, runs per step):")
    sync = [o for o in big if o["op"] != "copy-start"]
    for o in sorted(sync, key=lambda o: -o["bytes"] * o["times"])[:a.top]:
        print(f"  {o['bytes'] / 2**20:7.1f} {o['cycles'] / 1e6:6.3f} x{o['times']:<3} {o['phase']:8} {o['op']:9}"
              f" {o['layout'][:60]:60} {o['source'][-110:]}")


if __name__ == "__main__":
    main()
