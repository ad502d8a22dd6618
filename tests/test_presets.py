"""The maxtext_base preset grown by global_parameter_scale matches MaxText's models."""

import pytest

from jaxlm import config as C, params as P
from jaxlm.model import param_specs


@pytest.mark.parametrize("scale,width,heads,mlp,layers", [
    (1, 2048, 16, 7168, 16), (16, 4096, 64, 28672, 32), (32, 8192, 64, 28672, 32), (64, 8192, 64, 28672, 64),
    (128, 8192, 128, 57344, 64)])
def test_maxtext_base_scales_to_maxtexts_models(scale, width, heads, mlp, layers):
    m = C.apply_parameter_scale(C.load("maxtext_base", {"model.global_parameter_scale": str(scale)}).model)
    assert (m.d_model, m.n_heads, m.kv_heads, m.hd, m.ff, m.n_layers) == (width, heads, heads, 128, mlp, layers)
    # MaxText's llama2 decoder: embedding and output layer, per layer q/k/v/o, gated MLP and two RMSNorm scales,
    # and the final norm.
    per_layer = 4 * width * heads * 128 + 3 * width * mlp + 2 * width
    assert P.count(param_specs(m)) == 2 * 32000 * width + layers * per_layer + width
    assert m.vocab_size == 32000 and m.glu and m.activation == "silu" and not m.tie_embeddings


def test_maxtext_base_16b_has_15_8_billion_parameters():
    m = C.apply_parameter_scale(C.load("maxtext_base", {"model.global_parameter_scale": "16"}).model)
    assert P.count(param_specs(m)) == 15_831_666_688
