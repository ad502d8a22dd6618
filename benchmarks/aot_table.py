"""MaxText's v5e-256 table rows compiled ahead of time on this host: `maxtext_base` grown by
global_parameter_scale 16 / 32 / 64 with per-device batch 6 / 4 / 2, full remat, 2,048 tokens, FSDP over all
256 chips (attention `auto`: splash on TPU). Needs libtpu (the `tpu` extra); each compile takes minutes.

Prints one line per row: scale, params=, bytes_per_device= (the sum of memory_analysis()'s figures, an upper
bound), fits= (XLA:TPU's verdict: the compile did not run out of memory), temporaries= and compile_s=.
"""

import argparse

from jaxlm import config as config_lib, params as P
from jaxlm.train import aot
from jaxlm.model import param_specs

ROWS = {16: 6, 32: 4, 64: 2}  # global_parameter_scale: per_device_batch_size


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scales", default="16,32,64")
    ap.add_argument("--topology", default="v5e-256")
    ap.add_argument("overrides", nargs="*", help="extra key=value settings, e.g. model.loss_chunk_tokens=1024")
    args = ap.parse_args()
    for scale in (int(s) for s in args.scales.split(",")):
        cfg = config_lib.load("maxtext_base", [
            f"model.global_parameter_scale={scale}", f"training.per_device_batch_size={ROWS[scale]}",
            "model.block_size=2048", "model.remat=full", "mesh.ici_data=1", "mesh.ici_fsdp=-1",
            f"compile.topology={args.topology}", *args.overrides])
        n_params = P.count(param_specs(config_lib.apply_parameter_scale(cfg.model)))
        r = aot.compile_for(cfg, aot.target(cfg.compile))
        temps = r.memory.temporaries if r.memory is not None else None
        print(f"scale={scale} per_device_batch_size={ROWS[scale]} params={n_params} "
              f"bytes_per_device={r.bytes_per_device} fits={'true' if r.fits else 'false'} "
              f"temporaries={temps} arguments={r.argument_bytes} compile_s={r.seconds:.0f}", flush=True)


if __name__ == "__main__":
    main()
