"""What the vision parity tests share: random weights for a tiny transformers model, and that model saved and
imported as a jaxlm model folder."""

import torch

import jaxlm
from jaxlm.store import convert


def randomize(model, scale, seed=0):
    """Every weight random: vectors (norms, biases, a class token) around 1, matrices normal times `scale`."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if p.ndim == 1 else scale * noise)
    return model


def imported(tmp_path_factory, name: str, model_class, config, scale=0.08):
    """(the transformers model with random weights, its jaxlm import, the folder holding hf/ and jx/)."""
    tmp = tmp_path_factory.mktemp(name)
    model = randomize(model_class(config).eval(), scale)
    model.save_pretrained(tmp / "hf")
    convert.from_hf(str(tmp / "hf"), tmp / "jx", log=lambda s: None)
    return model, jaxlm.load(tmp / "jx"), tmp
