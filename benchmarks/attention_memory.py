"""Temporaries of the gradient step (compiled.memory_analysis() on this CPU) at 1k-8k tokens, per attention
implementation: blockwise should grow linearly with the length, dot_product quadratically ([T, T] scores).

A one-layer model (4 heads of 64, width 256, 256-token vocabulary, batch 1, full remat) keeps the weights and
logits small, so the attention's own memory dominates. Compiles only; nothing runs. Prints one line per
implementation and length, then the growth from each length to the next (2 = linear, 4 = quadratic).
With --policies, instead prints the device and host bytes of each remat policy for a 4-layer model at 2,048
tokens (blockwise attention). With --context N (8 fake CPU devices: XLA_FLAGS=--xla_force_host_platform_device_count=8),
instead prints, per length, one device's blockwise temporaries and, per device, those of the sequence split N ways
by ring and by all_gather context parallelism, with their ratio to one device.
"""

import argparse

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxlm import params as P, sharding
from jaxlm.config import MeshConfig, ModelConfig
from jaxlm.model import loss_fn, param_specs


def temporaries(impl: str, T: int, block: int, remat: str = "full", n_layers: int = 1, host: bool = False,
                context: int = 1, method: str = "ring"):
    cfg = ModelConfig(vocab_size=256, block_size=T, n_layers=n_layers, n_heads=4, d_model=256, remat=remat,
                      attention=impl, attention_block=block, glu=True, activation="silu", context_parallel=method)
    mesh_cfg = MeshConfig(ici_data=1, ici_sequence=context)
    mesh, rules = sharding.make_mesh(mesh_cfg, jax.devices()[:context]), sharding.rules_from_config(mesh_cfg)[1]
    params = jax.eval_shape(lambda: P.init(param_specs(cfg), jax.random.key(0), mesh))
    tokens = jax.ShapeDtypeStruct((1, T), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec(None, "sequence")))

    def grads(p, x, y):
        with sharding.activation_sharding(mesh, rules):
            return jax.grad(lambda p: loss_fn(p, x, y, cfg))(p)

    m = jax.jit(grads).lower(params, tokens, tokens).compile().memory_analysis()
    return (m.temp_size_in_bytes, m.host_temp_size_in_bytes) if host else m.temp_size_in_bytes


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048,4096,8192")
    ap.add_argument("--block", type=int, default=512, help="model.attention_block")
    ap.add_argument("--policies", action="store_true", help="compare remat policies instead")
    ap.add_argument("--context", type=int, default=1, help="compare context parallelism over this many devices")
    args = ap.parse_args()
    if args.context > 1:
        for T in (int(t) for t in args.lengths.split(",")):
            whole = temporaries("blockwise", T, args.block)
            line = f"tokens={T} one_device_bytes={whole} ({whole / 2**20:.1f} MiB)"
            for method in ("ring", "all_gather"):
                b = temporaries("blockwise", T, args.block, context=args.context, method=method)
                line += f" {method}_bytes_per_device={b} ({b / 2**20:.1f} MiB, {b / whole:.2f})"
            print(line, flush=True)
        return
    if args.policies:
        for policy in ("none", "save_dots", "minimal", "save_attention", "save_qkv_proj", "save_out_proj", "full",
                       "offload_qkv_proj", "offload_attention", "offload_layer_inputs"):
            device, host = temporaries("blockwise", 2048, args.block, policy, n_layers=4, host=True)
            print(f"remat={policy} temporaries_bytes={device} ({device / 2**20:.1f} MiB) "
                  f"host_temporaries_bytes={host} ({host / 2**20:.1f} MiB)", flush=True)
        return
    lengths = [int(t) for t in args.lengths.split(",")]
    for impl in ("blockwise", "dot_product"):
        sizes = [temporaries(impl, T, args.block) for T in lengths]
        for T, b in zip(lengths, sizes):
            print(f"attention={impl} tokens={T} temporaries_bytes={b} ({b / 2**20:.1f} MiB)", flush=True)
        growth = ", ".join(f"{b / a:.2f}" for a, b in zip(sizes, sizes[1:]))
        print(f"attention={impl} growth per doubling: {growth}", flush=True)


if __name__ == "__main__":
    main()
