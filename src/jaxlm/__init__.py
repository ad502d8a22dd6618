"""jaxlm: pretrain, fine-tune and serve decoder-only language models in pure JAX."""

__version__ = "0.1.0"


def load(path):
    """A trained or converted model for notebooks and scripts: `jaxlm.load(PATH).logits(tokens)`.
    PATH is a run directory or a `jaxlm convert from-hf` folder (see jaxlm.api.Model)."""
    from jaxlm.api import load as _load

    return _load(path)

