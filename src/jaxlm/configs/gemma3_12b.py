"""gemma3-12b: the published architecture and size (jaxlm train gemma3-12b checkpoint.init_from=CONVERTED)."""

from jaxlm.configs._models import preset


def config():
    return preset("gemma3_12b")
