"""One mixture-of-experts layer's forward and backward compiled for a TPU from this host (libtpu; no chip needed),
at a shape of benchmarks/tpu_sections.py's MOE_SHAPES and a dispatch (model.moe_matmul): the compiler's FLOPs and
bytes accessed (cost_analysis) and the optimized HLO's ops that move or reorder token copies, so that a chip run's
step times can be read against them (docs/performance.md, "Mixtures of experts").

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 PYTHONPATH=src python benchmarks/moe_hlo.py --shape qwen3_moe --matmul megablox
    ... --remat         the forward recomputed in the backward, as model.remat=full does in the train step
                        (transformer.remat_policy: the routing indices kept)
    ... --hlo FILE      also write the optimized HLO there
    ... --tiles 256,1024,1024   megablox's largest tiles (rows, contracted, out; model.moe_tiles) instead of
                                layers.MEGABLOX_TILES

The layer is moe.moe on [batch, block, d_model] bf16 activations with bf16 weights (the section's settings); its
backward is the VJP of the output and of the routing statistics, so the router's gradient is in it too.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

SIZES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4}


def nbytes(rtype: str) -> int:
    """The bytes of an HLO result type (a shape or a tuple of shapes: `bf16[8,128]{1,0}`, `(f32[4], s32[])`)."""
    total = 0
    for dt, dims in re.findall(r"\b(" + "|".join(SIZES) + r")\[([\d,]*)\]", rtype):
        n = SIZES[dt]
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n
    return total
SCOPES = ("router", "dispatch", "experts", "combine", "shared_experts")
# Ops that move no data of their own: views, tuples, the ends of asynchronous copies (their starts are counted).
FAMILIES = ("sort", "gather", "scatter", "select", "convert", "copy", "transpose")
QUIET = {"parameter", "constant", "get-tuple-element", "bitcast", "tuple", "copy-done", "slice-done", "after-all",
         "add-dependency", "opt-barrier"}


def layer(shape: str, block: int, batch: int | None):
    """(model config, router, activation) of one MoE layer at a MOE_SHAPES shape."""
    from jaxlm import config as config_lib
    from jaxlm.model import layers, moe
    from tpu_sections import MOE_SHAPES, MOE_TRAIN

    (preset, settings), = [(p, s) for key, _, p, s in MOE_SHAPES if key == shape]
    over = {**MOE_TRAIN, **settings, "model.block_size": block}
    if batch:
        over["training.batch_size"] = batch
    cfg = config_lib.load(preset, over)
    return cfg, moe.router_of(cfg.model), layers.activation_of(cfg.model)


def ops_of(hlo: str, rows_at_least: int = 1 << 14) -> list[dict]:
    """The entry computation's instructions (the fusions and kernels that run, in order): name, opcode, result
    bytes, the compiler's estimated cycles (none for custom calls: the grouped-matmul kernels), forward or
    backward, the layer's named scope (router, dispatch, experts, combine) from the op's metadata, and whether it
    writes a float32 array of at least rows_at_least rows (a token copy's or a token's)."""
    body = hlo[hlo.index("\nENTRY"):]
    out = []
    for line in body.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][\w-]*)\(", line)
        if not m or m[3] in QUIET:
            continue
        name, rtype, op = m.groups()
        size = nbytes(rtype)
        op_name = (re.search(r'op_name="([^"]*)"', line) or [None, ""])[1]
        cycles = re.search(r'"estimated_cycles":"(\d+)"', line)
        target = re.search(r'custom_call_target="([^"]*)"', line)
        scope = next((s for s in SCOPES if f"({s})" in op_name or f"/{s}/" in op_name), "other")
        out.append(dict(name=name, op=op, kind=re.sub(r"\.\d+$", "", name) if op in ("fusion", "custom-call") else op,
                        target=target[1] if target else "", bytes=size, cycles=int(cycles[1]) if cycles else 0,
                        phase="backward" if "transpose(" in op_name else "forward", scope=scope,
                        f32_rows=bool(re.search(r"f32\[(\d+),", rtype)) and int(re.search(r"f32\[(\d+),", rtype)[1]) >=
                        rows_at_least,
                        shape=re.sub(r"\{[^{}]*\}", "", re.sub(r"\([\d,]*\)", "", rtype))))
    return out


def figures(compiled) -> dict:
    """The compile's headline figures: GFLOPs, GiB accessed, GiB of temporaries, and the count of the entry's
    ops by family (a fusion counts in each family its name names: XLA names fusions after the ops in them)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    ops = ops_of(compiled.as_text())
    out = {"GFLOP": cost.get("flops", 0) / 1e9, "GiB accessed": cost.get("bytes accessed", 0) / 2**30,
           "GiB temporaries": compiled.memory_analysis().temp_size_in_bytes / 2**30, "ops": len(ops)}
    for family in FAMILIES:
        out[family] = sum(family in o["kind"] or family == o["op"] for o in ops)
    out["f32 [A, *] MiB"] = sum(o["bytes"] for o in ops if o["f32_rows"]) / 2**20
    return out


def compile_layer(shape: str, matmul: str, topology: str = "v5e-1", remat: bool = False, block: int = 2048,
                  batch: int | None = None, tiles: tuple[int, int, int] | None = None):
    """The compiled executable of one layer's forward + backward and the layer's config."""
    import jax
    import jax.numpy as jnp

    from jaxlm import sharding
    from jaxlm.config import CompileConfig, MeshConfig
    from jaxlm.model import moe, transformer
    from jaxlm.train import aot

    cfg, router, act = layer(shape, block, batch)
    m = cfg.model
    aot.prepare_process(CompileConfig(topology=topology))
    devices = aot.target(CompileConfig(topology=topology)).devices[:1]
    mesh = sharding.make_mesh(MeshConfig(ici_data=1), devices)
    one = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    specs = {k: v for k, v in moe.specs(m, 1).items() if not k.startswith("shared_")}
    p = {k: jax.ShapeDtypeStruct(s.shape[1:], jnp.dtype(s.dtype), sharding=one) for k, s in specs.items()}
    B, T, D = cfg.training.batch_size, block, m.d_model
    x = jax.ShapeDtypeStruct((B, T, D), jnp.bfloat16, sharding=one)
    g_stats = jax.ShapeDtypeStruct((3, m.n_experts), jnp.float32, sharding=one)

    def fwd(x, p):
        return moe.moe(x, p, act, router, matmul=matmul, tiles=tiles)

    if remat:  # the model's policy for model.remat (full): what the train step recomputes and what it keeps
        fwd = jax.checkpoint(fwd, policy=transformer.remat_policy(m))

    def step(x, p, g_y, g_stats):
        with sharding.activation_sharding(mesh):
            (y, stats), vjp = jax.vjp(fwd, x, p)
            return y, stats, vjp((g_y, g_stats))

    t0 = time.time()
    compiled = jax.jit(step).lower(x, p, x, g_stats).compile()
    return compiled, cfg, time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3_moe", help="a MOE_SHAPES key: qwen3_moe, mixtral")
    ap.add_argument("--matmul", default="ragged_dot", help="ragged_dot or megablox")
    ap.add_argument("--topology", default="v5e-1")
    ap.add_argument("--block", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=None, help="rows (default: the shape's)")
    ap.add_argument("--remat", action="store_true")
    ap.add_argument("--hlo", default=None)
    ap.add_argument("--tiles", default=None, help="megablox's largest tiles TM,TK,TN (model.moe_tiles)")
    ap.add_argument("--top", type=int, default=15, help="rows of the kind and largest-result lists")
    a = ap.parse_args()
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jaxlm.config import ModelConfig
    from jaxlm.model import layers

    tiles = ModelConfig(moe_tiles=a.tiles or "").megablox_tiles or layers.MEGABLOX_TILES
    compiled, cfg, seconds = compile_layer(a.shape, a.matmul, a.topology, a.remat, a.block, a.batch, tiles)
    m = cfg.model
    hlo = compiled.as_text()
    if a.hlo:
        Path(a.hlo).write_text(hlo)
    A = cfg.training.batch_size * a.block * m.experts_per_token
    expert_flops = 2 * A * m.d_model * m.expert_ff * (3 if m.glu else 2) * 3  # forward + two backward products
    ops = ops_of(hlo)
    fig = figures(compiled)
    print(f"{a.shape} {a.matmul}{' remat' if a.remat else ''} on {a.topology}: {cfg.training.batch_size} x {a.block}"
          f" tokens, {m.n_experts} experts x {m.expert_ff}, top-{m.experts_per_token}, d_model {m.d_model}"
          f" (compiled in {seconds:.0f} s)")
    if a.matmul == "megablox":
        tiling = layers.MegabloxTiling(*tiles)
        D, F = m.d_model, m.expert_ff
        tm = tiling(A, D, F)[0]
        # a row tile is visited once for each group it holds rows of: up to A / tm + E - 1 visits for A / tm tiles
        print(f"  megablox tiles {tiles}: row tiles of {tm}, {A // tm} of them, up to"
              f" {A // tm + m.n_experts - 1} visits ({(A // tm + m.n_experts - 1) / (A // tm):.2f}x the rows' work);"
              f" up/gate gmm and tgmm {tiling(A, D, F)}, their input gradient's gmm {tiling(A, F, D)};"
              f" down gmm and tgmm {tiling(A, F, D)}, its input gradient's {tiling(A, D, F)}")
    print(f"  the experts' matmuls {expert_flops / 1e9:,.1f} GFLOP; estimated"
          f" {sum(o['cycles'] for o in ops) / 1e6:,.1f} M cycles outside custom calls")
    print("  " + ", ".join(f"{k} {v:,.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in fig.items()))
    print("  by scope: ops, results written, the compiler's estimated cycles (custom calls: none)")
    groups = {}
    for o in ops:
        g = groups.setdefault((o["phase"], o["scope"]), [0, 0, 0])
        g[0] += 1
        g[1] += o["bytes"]
        g[2] += o["cycles"]
    for (phase, scope), (n, b, c) in sorted(groups.items()):
        print(f"    {phase:8} {scope:15} {n:4d} ops {b / 2**20:10,.1f} MiB {c / 1e6:8.2f} M cycles")
    kinds = {}
    for o in ops:
        k = kinds.setdefault(o["kind"], [0, 0, 0])
        k[0] += 1
        k[1] += o["bytes"]
        k[2] += o["cycles"]
    print("  by kind (opcode, or the fusion's name): ops, results written, estimated cycles")
    for kind, (n, b, c) in sorted(kinds.items(), key=lambda kv: -kv[1][1])[:a.top]:
        print(f"    {kind:34} {n:4d} {b / 2**20:10,.1f} MiB {c / 1e6:8.2f} M cycles")
    print(f"  the {a.top} largest results:")
    for o in sorted(ops, key=lambda o: -o["bytes"])[:a.top]:
        print(f"    {o['bytes'] / 2**20:8,.1f} MiB {o['cycles'] / 1e6:6.2f} Mc {o['phase']:8} {o['scope']:9}"
              f" {o['name'][:30]:30} {o['shape']}")

if __name__ == "__main__":
    main()
