"""llama3.2-3b: the published architecture and size (jaxlm train llama3.2-3b checkpoint.init_from=CONVERTED)."""

from jaxlm.configs._models import preset


def config():
    return preset("llama3_2_3b")
