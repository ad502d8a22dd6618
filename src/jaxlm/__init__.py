"""jaxlm: pretrain, fine-tune and serve decoder-only language models in pure JAX."""

__version__ = "0.1.0"


def load(path):
    """A trained or converted model for notebooks and scripts: `jaxlm.load(PATH).logits(tokens)`.
    PATH is a run directory or a `jaxlm convert from-hf` folder (see jaxlm.api.Model)."""
    from jaxlm.api import load as _load

    return _load(path)


def generate(src, prompt, **settings):
    """Sampled text after `prompt` (a string or a list of strings) from a model: `src` is a run directory, a
    `jaxlm convert from-hf` folder or a loaded model; settings are decode keys (max_new_tokens=100,
    temperature=0.7, top_k, top_p, seed, num_samples, ...). See docs/generate.md."""
    from jaxlm.api import generate_text

    return generate_text(src, prompt, **settings)
