"""maxtext_base_v5e: maxtext_base (1.1B) as one TPU v5e chip trains it fastest, a per-accelerator config as MaxText
keeps them: weights and Adam moments in bfloat16 (model.param_dtype), remat minimal (each layer's matmul outputs kept),
the loss over the micro-batch's 4,096 tokens in one chunk, and 16 micro-batches of 2 x 2,048 tokens a step, so that
the optimizer's update (reading and writing the weights and both moments) is shared by 65,536 tokens; each
micro-batch adds its gradients into the accumulator in place. The v5e-1 compile peaks at 12.0 GiB of 15.75.
On n chips give training.batch_size=2n (the same 2 rows a chip). docs/performance.md has the rows behind it."""

import dataclasses

from jaxlm.config import Config
from jaxlm.configs import maxtext_base


def config() -> Config:
    base = maxtext_base.config()
    return base.replace(
        model=dataclasses.replace(base.model, param_dtype="bfloat16", remat="minimal", loss_chunk_tokens=4096),
        training=dataclasses.replace(base.training, batch_size=2, grad_accum=16),
    )
