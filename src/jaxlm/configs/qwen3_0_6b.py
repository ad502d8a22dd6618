"""qwen3-0.6b: the published architecture and size (jaxlm train qwen3-0.6b checkpoint.init_from=CONVERTED)."""

from jaxlm.configs._models import preset


def config():
    return preset("qwen3_0_6b")
