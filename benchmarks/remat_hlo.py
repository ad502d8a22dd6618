"""A training step's fit and cost compiled for a TPU from this host (libtpu; no chip needed), to choose among remat
policies, batch sizes and micro-batches before a chip run: whether XLA:TPU places the step and its peak bytes; per
token the matmul FLOPs of the optimized HLO (the recomputed forward included; int8 ones, int32 results, apart, and
the bf16-equivalent count with int8 at twice the rate), the bytes its ops write, and the compiler's estimated time
of the step by kind (docs/performance.md, "Remat and batch from the compile").

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 PYTHONPATH=src python benchmarks/remat_hlo.py v5e-1 maxtext_base_v5e \\
        model.quantization=int8 -- model.remat=full -- model.remat=minimal [--hlo-dir DIR]

Settings before the first `--` apply to every row; each `--` starts a row (its settings over those). One JSON
line a row. The optimized HLO's while loops (micro-batches, the layers' scans, loss chunks) count by the trip
count of their condition's constant; estimated milliseconds are the compiler's cycles at v5e's 1.5 GHz; the
splash kernel (a custom call) has no FLOPs or estimate here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from collections import defaultdict
from pathlib import Path

from layout_hlo import computations  # noqa: E402 - benchmarks/ is the script's folder
from moe_hlo import QUIET, nbytes  # noqa: E402


def trip_counts(hlo: str) -> dict[str, int]:
    """How often a step runs each computation that is not a fusion's body: while bodies by the constant their
    condition compares the counter with, nested loops multiplied."""
    comps = computations(hlo)
    calls = defaultdict(list)
    for name, lines in comps.items():
        for line in lines:
            if " while(" in line:
                cond, body = re.search(r"condition=%([\w.-]+)", line)[1], re.search(r"body=%([\w.-]+)", line)[1]
                consts = [int(c) for c in re.findall(r"s32\[\][^=]*constant\((\d+)\)", "\n".join(comps[cond]))]
                calls[name].append((body, max(consts) if consts else 1))
            for callee in re.findall(r"(?:to_apply|true_computation|false_computation)=%([\w.-]+)", line):
                calls[name].append((callee, 1))
            for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
                calls[name].extend((c.strip().lstrip("%"), 1) for c in group.split(","))
    entry = re.search(r"^ENTRY %(\S+) ", hlo, re.M)[1]
    times, stack = {}, [(entry, 1)]
    while stack:
        name, n = stack.pop()
        if times.get(name, 0) >= n:
            continue
        times[name] = n
        stack.extend((c, n * k) for c, k in calls.get(name, ()))
    return times


def cycles(hlo: str) -> dict[str, float]:
    """The compiler's estimated cycles a step, by kind: int8 matmuls (a convolution with an int32 result, alone or
    in a fusion), other matmuls, everything else; each op times its computation's trip count."""
    comps, times = computations(hlo), trip_counts(hlo)
    conv_kind = {}
    for name, lines in comps.items():
        kinds = {"int8_matmul" if re.search(r"= s32\[", l) else "matmul" for l in lines if " convolution(" in l}
        if kinds:
            conv_kind[name] = "int8_matmul" if "int8_matmul" in kinds else "matmul"
    out = defaultdict(float)
    for name, n in times.items():
        for line in comps.get(name, ()):
            c = re.search(r'"estimated_cycles":"(\d+)"', line)
            if not c:
                continue
            callee = re.search(r"calls=%([\w.-]+)", line)
            kind = ("int8_matmul" if re.search(r"= s32\[", line) else "matmul") if " convolution(" in line else (
                conv_kind.get(callee[1], "other") if callee else "other")
            out[kind] += n * int(c[1])
    return out


def _dims(rtype: str) -> list[int]:
    m = re.match(r"\w+\[([\d,]*)\]", rtype)
    return [int(d) for d in m[1].split(",") if d] if m else []


def _valid_pairs(out: int, window: int, size: int, lo: int, stride: int = 1) -> int:
    """(output position, window position) pairs of one spatial dimension that land inside the unpadded input."""
    return sum(max(0, min(window, size + lo - j * stride) - max(0, lo - j * stride)) for j in range(out))


def conv_flops(line: str, shapes: dict[str, str]) -> int:
    """2 x multiply-adds of one HLO convolution (XLA:TPU writes every matmul as one), padding excluded: each output
    element sums over the input features and the window positions that fall inside the input."""
    lhs_name = re.search(r"convolution\(%([\w.-]+)", line)[1]
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", line)
    lhs_l, rhs_l, out_l = labels.groups()
    lhs, out = _dims(shapes[lhs_name]), _dims(re.search(r"= (\w+\[[\d,]*\])", line)[1])
    win = re.search(r"window=\{([^}]*)\}", line)
    size = [int(x) for x in re.search(r"size=([\dx]+)", win[1])[1].split("x")] if win else []
    pad = [int(p.split("_")[0]) for p in re.search(r"pad=([\d_x-]+)", win[1])[1].split("x")] if win and "pad=" in \
        win[1] else [0] * len(size)
    stride = [int(x) for x in re.search(r"stride=([\dx]+)", win[1])[1].split("x")] if win and "stride=" in \
        win[1] else [1] * len(size)
    macs = math.prod(out) * lhs[lhs_l.index("f")]
    groups = re.search(r"feature_group_count=(\d+)", line)
    macs //= int(groups[1]) if groups else 1
    for d in range(len(size)):
        o, s = out[out_l.index(str(d))], lhs[lhs_l.index(str(d))]
        macs = macs // o * _valid_pairs(o, size[d], s, pad[d], stride[d])
    return 2 * macs


def matmul_flops(hlo: str) -> dict[str, float]:
    """FLOPs a step of the HLO's convolutions (its matmuls), int8 ones (int32 results) apart, each times its
    computation's trip count (a fusion's body counts where the fusion runs)."""
    comps, times = computations(hlo), trip_counts(hlo)
    shapes = dict(re.findall(r"%([\w.-]+) = (\w+\[[\d,]*\])", hlo))
    for name, lines in comps.items():  # fusion parameters' shapes, by the parameter's own name
        for line in lines:
            m = re.match(r"\s*%([\w.-]+) = (\w+\[[\d,]*\])", line)
            if m:
                shapes[m[1]] = m[2]
    def own(name: str, seen=()) -> dict[str, float]:  # a computation's convolutions, its fusions' (nested) included
        flops = defaultdict(float)
        for line in comps.get(name, ()):
            if " convolution(" in line:
                flops["int8" if re.search(r"= s32\[", line) else "float"] += conv_flops(line, shapes)
            for callee in re.findall(r"calls=%([\w.-]+)", line):
                if callee not in seen:
                    for k, v in own(callee, (*seen, name)).items():
                        flops[k] += v
        return flops

    out = defaultdict(float)
    for name, n in times.items():
        for k, v in own(name).items():
            out[k] += n * v
    return out


def bytes_written(hlo: str) -> float:
    """Bytes a step's ops write (each top-level op's result, times its computation's trip count; views, tuples and
    loop plumbing excluded): the HBM traffic that remat and batch size change, read at least as often."""
    comps, times = computations(hlo), trip_counts(hlo)
    # in-place updates (a fusion's root or a root tuple's element made by one): their result type is the whole
    # buffer (a layers' stack), so they count nothing
    in_place = {}
    for name, lines in comps.items():
        ops = dict(re.findall(r"%([\w.-]+) = \S+ ([a-z][\w-]*)\(", "\n".join(lines)))
        root = next((l for l in lines if l.lstrip().startswith("ROOT")), "")
        elements = re.search(r" tuple\((.*)\)", root)
        names = re.findall(r"%([\w.-]+)", elements[1]) if elements else [re.search(r"%([\w.-]+)", root)[1]] \
            if root else []
        in_place[name] = [ops.get(n) == "dynamic-update-slice" for n in names]
    total = 0.0
    for name, n in times.items():
        for line in comps.get(name, ()):
            m = re.match(r"\s*(?:ROOT )?%\S+ = (.+?) ([a-z][\w-]*)\(", line)
            if not m or m[2] in QUIET | {"while", "dynamic-update-slice"}:
                continue
            callee = re.search(r"calls=%([\w.-]+)", line)
            skip = in_place.get(callee[1], []) if callee else []
            shapes = re.findall(r"\w+\[[\d,]*\]", m[1])
            total += n * sum(nbytes(t) for i, t in enumerate(shapes) if not (i < len(skip) and skip[i]))
    return total


def row(cfg, hlo_file: str | None = None) -> dict:
    """One compile's figures (fits, peak GiB; per token matmul GFLOPs, int8 ones and the bf16-equivalent count,
    KB written; the compiler's estimated ms a step by kind), its optimized HLO written to `hlo_file` if given."""
    from jaxlm.train import aot, preflight

    tgt = aot.target(cfg.compile)
    r = aot.compile_for(cfg, tgt)
    m, t = cfg.model, cfg.training
    tokens = t.batch_size * t.grad_accum * m.block_size
    out = dict(remat=m.remat, quantization=m.quantization, batch=t.batch_size, grad_accum=t.grad_accum,
               loss_chunk_tokens=m.loss_chunk_tokens, tokens_per_step=tokens, compile_s=round(r.seconds, 1))
    if r.executable is None:
        return dict(out, fits=False, needs_gib=round((r.oom_bytes or 0) / 2**30, 2), message=r.oom[:200])
    hlo = r.executable.as_text()
    if hlo_file:
        Path(hlo_file).write_text(hlo)
    ms = {k: round(v / 1.5e6, 1) for k, v in cycles(hlo).items()}
    fl = matmul_flops(hlo)
    return dict(out, fits=True, peak_gib=round(preflight.peak_bytes(r.executable.memory_analysis()) / 2**30, 2),
                # bf16-equivalent: an int8 matmul runs at twice the rate on v5e
                gflop_per_token=round((fl["float"] + fl["int8"]) / tokens / 1e9, 3),
                int8_gflop_per_token=round(fl["int8"] / tokens / 1e9, 3),
                mxu_gflop_per_token=round((fl["float"] + fl["int8"] / 2) / tokens / 1e9, 3),
                kb_written_per_token=round(bytes_written(hlo) / tokens / 1e3, 1),
                est_ms=ms, est_ms_total=round(sum(ms.values()), 1),
                # the compiler prices elementwise work at about half the chip's copy rate (docs/quantization.md):
                # the other ops at twice its rate put int8 remat full within 2% of the chip's step
                est_ms_other_halved=round(sum(ms.values()) - ms.get("other", 0) / 2, 1))


def main() -> None:
    from jaxlm import config as config_lib
    from jaxlm.train import aot

    args = sys.argv[1:]
    hlo_dir = None
    if "--hlo-dir" in args:  # also write each row's optimized HLO there, named after its settings
        i = args.index("--hlo-dir")
        hlo_dir, args = args[i + 1], args[:i] + args[i + 2:]
    topology, preset, *rest = args
    common, *rows = " ".join(rest).split("--") if "--" in rest else (" ".join(rest), "")
    for settings in rows or [""]:
        overrides = dict(a.split("=", 1) for a in (common.split() + settings.split()))
        cfg = config_lib.load(preset, overrides)
        cfg = cfg.replace(compile=dataclasses.replace(cfg.compile, topology=topology))
        aot.prepare_process(cfg.compile)
        name = re.sub(r"[^\w.=-]+", "_", f"{preset} {common} {settings}".strip()) + ".hlo"
        print(json.dumps(dict(row(cfg, hlo_dir and str(Path(hlo_dir, name))), settings=settings.strip())),
              flush=True)


if __name__ == "__main__":
    main()
