"""The decoder-only transformer: layers, attention and the stacked forward pass."""

from jaxlm.model.transformer import forward, loss_fn, param_specs

__all__ = ["forward", "loss_fn", "param_specs"]
