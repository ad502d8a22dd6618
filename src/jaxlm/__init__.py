"""jaxlm: pretrain, fine-tune and serve decoder-only language models in pure JAX."""

__version__ = "0.1.0"
