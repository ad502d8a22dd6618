"""qwen3-30b-a3b: the published architecture and size (jaxlm train qwen3-30b-a3b checkpoint.init_from=CONVERTED)."""

from jaxlm.configs._models import preset


def config():
    return preset("qwen3_30b_a3b")
