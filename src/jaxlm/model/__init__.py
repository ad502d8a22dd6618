"""The decoder-only transformer: layers, attention and the stacked forward pass."""

from jaxlm.model.loss import loss_fn
from jaxlm.model.transformer import forward, forward_with_aux, images_as_input, param_specs

__all__ = ["forward", "forward_with_aux", "images_as_input", "loss_fn", "param_specs"]
