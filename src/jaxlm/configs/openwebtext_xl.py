"""GPT-2 XL (1.5B) on OpenWebText: 48 layers, 25 heads, 1600 wide, block 1024, with remat to fit memory."""

import dataclasses

from jaxlm.config import Config
from jaxlm.configs import openwebtext


def config() -> Config:
    base = openwebtext.config()
    return base.replace(
        model=dataclasses.replace(base.model, n_layers=48, n_heads=25, d_model=1600, remat="minimal"),
        optimizer=dataclasses.replace(base.optimizer, lr=2e-4, min_lr=2e-5),
    )
