"""The decoder-only transformer: layers, attention and the stacked forward pass."""

from jaxlm.model.transformer import forward, forward_with_aux, loss_fn, param_specs

__all__ = ["forward", "forward_with_aux", "loss_fn", "param_specs"]
