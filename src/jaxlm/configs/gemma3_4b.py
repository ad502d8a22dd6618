"""gemma3-4b: the published architecture and size (jaxlm train gemma3-4b checkpoint.init_from=CONVERTED)."""

from jaxlm.configs._models import preset


def config():
    return preset("gemma3_4b")
