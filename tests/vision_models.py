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
    """(the transformers model with random weights, its jaxlm import, the folder holding hf/ and jx/). The folder's
    image processor settings are `{}`: the released models' at the tower's sizes (data/hf_folder.py)."""
    tmp = tmp_path_factory.mktemp(name)
    model = randomize(model_class(config).eval(), scale)
    model.save_pretrained(tmp / "hf")
    (tmp / "hf" / "preprocessor_config.json").write_text("{}")
    convert.from_hf(str(tmp / "hf"), tmp / "jx", log=lambda s: None)
    return model, jaxlm.load(tmp / "jx"), tmp


def logits_match_both_ways(imported_model, model_class, hf_logits, tokens, images):
    """Our logits with the images (returned) against transformers' (max |diff| <= 1e-4), and against transformers
    running our export of the model (`jaxlm convert to-hf`) the same way. hf_logits(model, tokens, images)."""
    import numpy as np

    model, ours, tmp = imported_model
    want = hf_logits(model, tokens, images)
    got = np.asarray(ours.logits(tokens, images=images))
    assert got.shape == want.shape and np.abs(want).max() > 0.5
    assert np.abs(got - want).max() <= 1e-4
    convert.to_hf(tmp / "jx", tmp / "back", log=lambda s: None)
    back = model_class.from_pretrained(tmp / "back").eval()
    assert np.abs(hf_logits(back, tokens, images) - got).max() <= 1e-4
    return got
