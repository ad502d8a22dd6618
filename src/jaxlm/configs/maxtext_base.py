"""maxtext_base: MaxText's default decoder (llama2-style, width 2048, 16 heads of 128, MLP 7168, 16 layers,
32,000 tokens, untied output layer), grown with model.global_parameter_scale as MaxText's README tables are:
`jaxlm compile maxtext_base model.global_parameter_scale=16 compile.topology=v5e-256 ...` (16B; 32B at 32, 64B at
64, 128B at 128). No released weights: it is for compiles, benchmarks and training from scratch."""

from jaxlm.configs._models import preset


def config():
    return preset("maxtext_base")
