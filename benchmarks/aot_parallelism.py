"""Ahead-of-time compiles of the parallel layouts for TPU targets on this CPU host (needs the `tpu` extra):
memory per device against the chip's HBM, from the compiler itself. Minutes per case; not part of the tests.

Prints one line per case:  case=NAME bytes_per_device=N hbm_bytes=N fits=true|false compile_s=S

    python benchmarks/aot_parallelism.py [--only NAME]
"""

from __future__ import annotations

import argparse

from jaxlm import config as config_lib
from jaxlm.train import aot

LLAMA2_70B = ["compile.topology=v5e-256", "compile.num_slices=2", "mesh.ici_data=1", "mesh.ici_fsdp=-1",
              "model.block_size=2048", "training.per_device_batch_size=4", "model.remat=full"]
CASES = {
    # two v5e-256 slices, one pipeline stage per slice, FSDP inside each, 4 x 2048 tokens per chip; 8
    # micro-batches (each stage reruns its 40 layers for one micro-batch of 1 x 2048 tokens per chip in the
    # backward pass) and the loss 512 positions at a time (the batch is not split over `stage`, so each chip
    # computes the logits of 8 sequences)
    "llama2-70b_2xv5e-256_dcn_stage2": ("llama2-70b", [*LLAMA2_70B, "mesh.dcn_stage=2",
                                                       "training.pipeline_microbatches=8",
                                                       "model.loss_chunk_tokens=512"]),
    # the same slices and batch with data parallelism across them, for comparison
    "llama2-70b_2xv5e-256_dcn_data2": ("llama2-70b", [*LLAMA2_70B, "mesh.dcn_data=2"]),
    # mixtral-8x7b on one v5e-256 with expert parallelism: each group of 8 chips holds one expert per chip, FSDP
    # over the 32 groups, 2 x 4096 tokens per chip; a capacity factor of 1.25 bounds the all-to-all buffers
    "mixtral-8x7b_v5e-256_expert8": ("mixtral-8x7b", [
        "compile.topology=v5e-256", "mesh.ici_data=1", "mesh.ici_fsdp=-1", "mesh.ici_expert=8", "model.block_size=4096",
        "training.per_device_batch_size=2", "model.remat=full", "model.expert_capacity_factor=1.25"]),
    # the same, dropless: buckets sized for the worst case (every token of 8 chips to one expert), exchanged in
    # 16 steps of 4,096 rows
    "mixtral-8x7b_v5e-256_expert8_dropless": ("mixtral-8x7b", [
        "compile.topology=v5e-256", "mesh.ici_data=1", "mesh.ici_fsdp=-1", "mesh.ici_expert=8", "model.block_size=4096",
        "training.per_device_batch_size=2", "model.remat=full"]),
    # dropless on a v6e-256, whose 32 GiB chips hold the worst-case buffers, with ragged_all_to_all
    "mixtral-8x7b_v6e-256_expert8_dropless": ("mixtral-8x7b", [
        "compile.topology=v6e-256", "mesh.ici_data=1", "mesh.ici_fsdp=-1", "mesh.ici_expert=8", "model.block_size=4096",
        "training.per_device_batch_size=2", "model.remat=full"]),
    # one 131,072-token sequence per 16 chips: the sequence split 16 ways (ring attention over blockwise tiles),
    # FSDP over the other 16
    "llama3.1-8b_v5e-256_context16_128k": ("llama3.1-8b", [
        "compile.topology=v5e-256", "mesh.ici_data=1", "mesh.ici_sequence=16", "mesh.ici_fsdp=-1",
        "model.block_size=131072", "training.per_device_batch_size=0.0625", "model.remat=full",
        "model.loss_chunk_tokens=4096", "model.context_parallel=ring"]),
    # the same with keys and values all-gathered over the 16 sequence devices instead of passed round a ring
    "llama3.1-8b_v5e-256_context16_128k_all_gather": ("llama3.1-8b", [
        "compile.topology=v5e-256", "mesh.ici_data=1", "mesh.ici_sequence=16", "mesh.ici_fsdp=-1",
        "model.block_size=131072", "training.per_device_batch_size=0.0625", "model.remat=full",
        "model.loss_chunk_tokens=4096", "model.context_parallel=all_gather"]),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=list(CASES))
    args = parser.parse_args()
    for name, (preset, overrides) in CASES.items():
        if args.only and name != args.only:
            continue
        cfg = config_lib.load(preset, overrides)
        r = aot.compile_for(cfg, aot.target(cfg.compile))
        print(f"case={name} bytes_per_device={r.bytes_per_device} hbm_bytes={r.target.hbm_bytes} "
              f"fits={str(r.fits).lower()} compile_s={r.seconds:.1f}", flush=True)


if __name__ == "__main__":
    main()
