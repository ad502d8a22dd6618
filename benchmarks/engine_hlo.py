"""The serving engine's paged decode program (serve/programs.py's paged_decode_loop) against generate's decode loop
(infer/generate.py's _decode), both compiled for a TPU from this host (libtpu; no chip needed) at the 1B shape's
widths (Llama-3.2-1B: d_model 2048, 32 heads on 8 kv heads of 64, d_ff 8192, vocab 128,256, bf16) with fewer
layers, so that a chip run's step times can be read against what each program does per step and per call
(docs/serve.md, "The engine's step against generate's").

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 PYTHONPATH=src python benchmarks/engine_hlo.py [--layers 2] [--hlo DIR]
    ... --rows 64 --prompt 128 --new 128 --steps 8     the serve row's workload (benchmarks/tpu.py --only serve)
    ... --kernel ragged|jax|flat                       the pool's page-attention kernel (serve.attention_kernel)
    ... --options lanes_in_kernel=1                    the ragged kernel's settings (serve.attention_kernel_options)
    ... --call-rows 32                                 the engine's call over a bucket of fewer rows than slots
    ... --layers 16                                    the whole model (about a minute of compiles)

Both loops run the same step (embed, the layers, the output layer, sampling) over 64 rows whose keys reach
prompt + new positions: generate over its slot cache (one segment of prompt + new slots), the engine over the
paged pool (pages of the kernel's format). The compiler's cost analysis counts a while loop's body once, so
`GFLOP` and `GB accessed` are one step plus what a call does once. The loop body's instructions are grouped
by what they do, with the compiler's estimated cycles (none for custom calls: the Pallas kernel, or for
scatters), the bytes of their results (a scatter's: what it writes) and, for the cache writes, how many vectors
a step scatters; then the call's own instructions outside the loop (a loop of the call's, as the row-by-row
scatter of logits, counted over its trips). Estimated cycles compare across programs only roughly: where XLA
prefetches a weight into VMEM (an async copy, not estimated) its matmul's estimate leaves the weight's read out.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from moe_hlo import QUIET, SIZES, nbytes  # noqa: E402

GROUPS = ("output layer", "mlp matmuls", "attention matmuls", "attention (XLA)", "attention kernel", "cache write",
          "logits gather/scatter", "async copies", "other")


def computations(hlo: str) -> dict[str, list[str]]:
    """Each computation's instruction lines by name; "__entry__" names the entry computation."""
    out, name, body = {}, None, []
    for line in hlo.splitlines():
        m = re.match(r"(ENTRY )?%(\S+) \(.*\{$", line)
        if m:
            name, body = m[2], []
            if m[1]:
                out["__entry__"] = name
        elif line == "}" and name:
            out[name], name = body, None
        elif name:
            body.append(line)
    return out


def instructions(lines: list[str], comps: dict) -> list[dict]:
    """The instructions that run (not views, tuples, parameters): name, opcode, result bytes, estimated cycles,
    the ops fused in, the op_name metadata, the callee (a while's body) and, for a scatter, its index count."""
    out = []
    for line in lines:
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][\w-]*)\(", line)
        if not m or m[3] in QUIET:
            continue
        calls = re.search(r"calls=%([\w.\-]+)", line)
        fused = comps.get(calls[1], []) if calls else []
        kinds = {k[1] for k in (re.match(r"\s*(?:ROOT )?%\S+ = .+? ([a-z][\w-]*)\(", f) for f in fused) if k}
        scattered = written = 0
        for f in fused:
            s = re.match(r"\s*(?:ROOT )?%\S+ = .+? scatter\(%[\w.\-]+, %([\w.\-]+), %([\w.\-]+)\)", f)
            if s:  # the indices' leading dims: one vector (window) each; the updates' bytes
                idx, upd = (next((g for g in fused if re.match(rf"\s*(?:ROOT )?%{re.escape(x)} = ", g)), "")
                            for x in (s[1], s[2]))
                dims = re.search(r"\[([\d,]*)\]", idx)
                shape = [int(d) for d in dims[1].split(",") if d] if dims else []
                scattered = 1
                for d in shape[:-1] or shape:
                    scattered *= d
                written = nbytes(upd.split(" = ", 1)[1].split(" ", 1)[0]) if upd else 0
        cycles = re.search(r'"estimated_cycles":"(\d+)"', line)
        body = re.search(r"body=%([\w.\-]+)", line)
        # an asynchronous copy's or slice's result holds its source too: count the first array alone
        first = re.search(r"\b(?:" + "|".join(SIZES) + r")\[[\d,]*\]", m[2])
        size = nbytes(first[0] if first and m[3].endswith("-start") else m[2])
        if scattered:  # in place: what it writes, not the whole buffer it returns
            size = written
        out.append(dict(name=m[1], op=m[3], bytes=size, cycles=int(cycles[1]) if cycles else 0,
                        kinds=kinds, scattered=scattered, body=body[1] if body else None,
                        op_name=(re.search(r'op_name="([^"]*)"', line) or [None, ""])[1],
                        target=(re.search(r'custom_call_target="([^"]*)"', line) or [None, ""])[1]))
    return out


def group(o: dict) -> str:
    name, kinds = o["op_name"], o["kinds"]
    if o["target"] == "tpu_custom_call":
        return "attention kernel"
    if o["op"].endswith("-start") or o["target"] == "ConcatBitcast":  # the pieces of a sliced copy put together
        return "async copies"
    if ("_take" in name or name.endswith("/scatter")) and "attention" not in name and o["bytes"] > 1 << 20:
        return "logits gather/scatter"
    if "scatter" in kinds and "attention" in name:
        return "cache write"
    if "convolution" in kinds:
        if "BTD,VD->BTV" in name:
            return "output layer"
        if "mlp_block" in name:
            return "mlp_matmuls".replace("_", " ")
        if re.search(r"BKGH|BKGS|BKHS", name):
            return "attention (XLA)"
        return "attention matmuls"
    if re.search(r"attention/(sub|exp|reduce|div|BK)", name) and o["bytes"] > 1 << 19:
        return "attention (XLA)"
    return "other"


def main_loop(comps: dict) -> str:
    """The entry's while loop whose body has the most estimated cycles: the decode steps."""
    best = None
    for o in instructions(comps[comps["__entry__"]], comps):
        if o["op"] == "while":
            c = sum(x["cycles"] for x in instructions(comps[o["body"]], comps))
            if best is None or c > best[1]:
                best = (o["body"], c)
    return best[0]


def summary(compiled) -> dict:
    """Cost analysis, memory, and the loop body's and the entry's instructions by group."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    out = instructions_by_group(compiled.as_text())
    out.update(gflop=cost.get("flops", 0) / 1e9, gb=cost.get("bytes accessed", 0) / 1e9,
               temp_mib=compiled.memory_analysis().temp_size_in_bytes / 2**20)
    return out


def instructions_by_group(hlo: str) -> dict:
    """The loop body's (`step`) and the entry's (`call`) instructions by group (GROUPS)."""
    comps = computations(hlo)
    loop = main_loop(comps)
    steps = instructions(comps[loop], comps)
    entry = [o for o in instructions(comps[comps["__entry__"]], comps) if o["body"] != loop]
    for o in entry:  # a while of the entry other than the steps (a row-by-row scatter): its body's cycles
        if o["op"] == "while" and o["body"]:
            line = next(x for x in comps[comps["__entry__"]]
                        if re.match(rf"\s*(?:ROOT )?%{re.escape(o['name'])} = ", x))
            cond = comps.get(re.search(r"condition=%([\w.\-]+)", line)[1], [])
            trips = re.findall(r"constant\((\d+)\)", "\n".join(cond))  # i < n: the loop's count
            o["cycles"] = sum(x["cycles"] for x in instructions(comps[o["body"]], comps)) * (
                int(trips[-1]) if trips else 1)

    def by_group(ops):
        out = {g: dict(ops=0, cycles=0, bytes=0, scattered=0) for g in GROUPS}
        for o in ops:
            g = out[group(o)]
            g["ops"] += 1
            g["cycles"] += o["cycles"]
            g["bytes"] += o["bytes"]
            g["scattered"] += o["scattered"]
        return out

    return dict(step=by_group(steps), call=by_group(entry), step_ops=len(steps), hlo=hlo)


def build(a):
    """(engine's compiled decode program, generate's compiled decode loop, model config)."""
    import jax
    import numpy as np
    from jax.sharding import SingleDeviceSharding

    from jaxlm import config as config_lib, params as P
    from jaxlm.infer import generate, sampling
    from jaxlm.model import decode, paged, param_specs
    from jaxlm.serve import programs
    from jaxlm.train import aot

    S = a.prompt + a.new
    cfg = config_lib.load("llama3.2-1b", {"mesh.ici_data": 1, "model.block_size": S, "model.n_layers": a.layers,
                                          "model.param_dtype": "bfloat16", "model.compute_dtype": "bfloat16"}).model
    device = aot.tpu_topology(a.topology, 1)[0]
    placed = SingleDeviceSharding(device)
    on = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed), tree)
    arr = lambda shape, dt: on(jax.ShapeDtypeStruct(shape, dt))  # noqa: E731
    params = on(P.abstract(param_specs(cfg)))

    def rows(b):
        return sampling.RowSampling(arr((b,), np.int32), arr((b, 4), np.int32), arr((b,), bool),
                                    arr((b,), np.uint32), arr((b,), np.int32), arr((b,), np.int32),
                                    arr((b,), np.float32), arr((b,), np.int32), arr((b,), np.float32))

    B, b = a.rows, a.call_rows or a.rows
    fmt = paged.pool_format(device.platform, a.kernel, a.options)
    M = -(-S // fmt.page)
    layer_params = on(jax.eval_shape(lambda p: decode.layer_weights(p, cfg), params))
    pool = on(jax.eval_shape(lambda: paged.init(cfg, B * M, fmt.page, fmt=fmt)))
    t = time.time()
    engine = programs.paged_decode_loop.lower(
        params, layer_params, pool, arr((B, cfg.vocab_size), np.float32), arr((b,), np.int32), arr((b,), np.int32),
        arr((), np.int32), arr((b,), bool), arr((b,), np.int32), arr((b, M), np.int32), rows(b), cfg=cfg,
        max_steps=a.steps).compile()
    engine_s = time.time() - t
    logits, cache = jax.eval_shape(lambda p, x, n: decode.prefill(p, x, n, cfg, S, False, None), params,
                                   arr((B, a.prompt), np.int32), arr((B,), np.int32))
    assert generate.segments(a.prompt, S, a.new) == [(S, a.new)]  # one loop over a cache of S slots
    t = time.time()
    gen = generate._decode.lower(params, on(logits), on(cache), rows(B), np.int32(0), cfg, a.new, False, a.prompt, S,
                                 cfg.n_layers <= generate.UNROLL_LAYERS, None).compile()
    return engine, gen, cfg, engine_s, time.time() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2, help="layers of the 1B shape (16 compiles in about a minute)")
    ap.add_argument("--rows", type=int, default=64, help="the engine's slots and generate's batch")
    ap.add_argument("--call-rows", type=int, default=0, help="rows of the engine's call (default: all slots)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8, help="the engine's decode steps a call (serve.decode_steps)")
    ap.add_argument("--kernel", default="ragged", help="serve.attention_kernel")
    ap.add_argument("--options", default="", help="serve.attention_kernel_options (with --kernel ragged)")
    ap.add_argument("--topology", default="v5e:1x1")
    ap.add_argument("--hlo", default=None, help="a folder to write both programs' optimized HLO into")
    a = ap.parse_args()
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    engine, gen, cfg, engine_s, gen_s = build(a)
    print(f"1B shape, {a.layers} layers, vocab {cfg.vocab_size}, {a.rows} rows, keys up to {a.prompt + a.new}, on "
          f"{a.topology} (compiled in {engine_s:.0f} s and {gen_s:.0f} s); kernel {a.kernel} {a.options}, "
          f"engine call of {a.call_rows or a.rows} rows, {a.steps} steps")
    figures = {"engine": summary(engine), "generate": summary(gen)}
    if a.hlo:
        Path(a.hlo).mkdir(parents=True, exist_ok=True)
        for name, f in figures.items():
            (Path(a.hlo) / f"{name}.hlo").write_text(f["hlo"])
    print(f"  {'':9} {'GFLOP':>7} {'GB accessed':>12} {'temp MiB':>9} {'step ops':>9} {'step Mcycles':>13}"
          f" {'call Mcycles':>13}")
    for name, f in figures.items():
        print(f"  {name:9} {f['gflop']:7.2f} {f['gb']:12.3f} {f['temp_mib']:9.1f} {f['step_ops']:9d}"
              f" {sum(g['cycles'] for g in f['step'].values()) / 1e6:13.3f}"
              f" {sum(g['cycles'] for g in f['call'].values()) / 1e6:13.3f}")
    for part in ("step", "call"):
        print(f"  per {part}: ops, estimated M cycles (none for custom calls and scatters), MiB of results"
              " (scatters: written), vectors scattered")
        for g in GROUPS:
            e, n = figures["engine"][part][g], figures["generate"][part][g]
            if e["ops"] or n["ops"]:
                print(f"    {g:22} engine {e['ops']:4d} {e['cycles'] / 1e6:7.3f} {e['bytes'] / 2**20:8.1f}"
                      f" {e['scattered']:6d}   generate {n['ops']:4d} {n['cycles'] / 1e6:7.3f}"
                      f" {n['bytes'] / 2**20:8.1f} {n['scattered']:6d}")


if __name__ == "__main__":
    main()
