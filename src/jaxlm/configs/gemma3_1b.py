"""gemma3-1b: the published architecture and size (jaxlm train gemma3-1b checkpoint.init_from=CONVERTED)."""

from jaxlm.configs._models import preset


def config():
    return preset("gemma3_1b")
