"""jaxlm: pretrain, fine-tune and serve decoder-only language models in pure JAX.

The Python API: `jaxlm.load(PATH)` and `jaxlm.generate(PATH, "def ")` (both in jaxlm.infer.api). Imported on
first call, so that `import jaxlm` stays light."""

__version__ = "0.2.0"


def load(path, mesh=None):
    """A trained or converted model for notebooks and scripts: `jaxlm.load(PATH).logits(tokens)`.
    PATH is a run directory or a `jaxlm convert from-hf` folder; `mesh` (a jax Mesh or a config.MeshConfig)
    shards it over devices (see jaxlm.infer.api.load and jaxlm.infer.api.Model)."""
    from jaxlm.infer.api import load as _load

    return _load(path, mesh)


def generate(src, prompt, **settings):
    """`jaxlm.generate(PATH_OR_MODEL, prompt, temperature=0.7, ...)`: the sampled continuation(s) as text
    (jaxlm.infer.api.generate_text)."""
    from jaxlm.infer.api import generate_text

    return generate_text(src, prompt, **settings)
