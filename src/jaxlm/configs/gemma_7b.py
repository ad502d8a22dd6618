"""gemma-7b: the published architecture and size (jaxlm train gemma-7b checkpoint.init_from=CONVERTED)."""

from jaxlm.configs._models import preset


def config():
    return preset("gemma_7b")
