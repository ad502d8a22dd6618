"""gemma2-27b: the published architecture and size (jaxlm train gemma2-27b checkpoint.init_from=CONVERTED)."""

from jaxlm.configs._models import preset


def config():
    return preset("gemma2_27b")
