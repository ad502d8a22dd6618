"""qwen3-8b: the published architecture and size (jaxlm train qwen3-8b checkpoint.init_from=CONVERTED)."""

from jaxlm.configs._models import preset


def config():
    return preset("qwen3_8b")
