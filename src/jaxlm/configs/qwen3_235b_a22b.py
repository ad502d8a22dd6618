"""qwen3-235b-a22b: the published architecture and size (jaxlm train qwen3-235b-a22b checkpoint.init_from=CONVERTED)."""

from jaxlm.configs._models import preset


def config():
    return preset("qwen3_235b_a22b")
