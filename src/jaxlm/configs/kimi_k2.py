"""kimi-k2: the published architecture and size (jaxlm train kimi-k2 checkpoint.init_from=CONVERTED)."""

from jaxlm.configs._models import preset


def config():
    return preset("kimi_k2")
