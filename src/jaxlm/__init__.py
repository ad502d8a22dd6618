"""jaxlm: pretrain, fine-tune and serve decoder-only language models in pure JAX."""

import types

__version__ = "0.1.0"


def load(path, mesh=None):
    """A trained or converted model for notebooks and scripts: `jaxlm.load(PATH).logits(tokens)`.
    PATH is a run directory or a `jaxlm convert from-hf` folder; `mesh` (a jax Mesh or a config.MeshConfig)
    shards it over devices (see jaxlm.api.load and jaxlm.api.Model)."""
    from jaxlm.api import load as _load

    return _load(path, mesh)


def __getattr__(name):
    # `jaxlm.generate(PATH, "def ")`: the jaxlm.generate module is callable (see its _CallableModule). Imported on
    # first use so that `import jaxlm` stays light; importing it makes it an attribute of the package.
    if name == "generate":
        import importlib

        return importlib.import_module("jaxlm.generate")
    raise AttributeError(f"module 'jaxlm' has no attribute {name!r}")


class CallableModule(types.ModuleType):
    """The class of the jaxlm.generate module: calling it is the notebook API, jaxlm.generate(PATH, "def ",
    temperature=0.7) returns the sampled text (jaxlm.api.generate_text). A function of the same name in the
    package would be replaced by the module as soon as the module is imported."""

    def __call__(self, src, prompt, **settings):
        from jaxlm.api import generate_text

        return generate_text(src, prompt, **settings)
