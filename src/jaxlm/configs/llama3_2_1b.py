"""llama3.2-1b: the published architecture and size (jaxlm train llama3.2-1b checkpoint.init_from=CONVERTED)."""

from jaxlm.configs._models import preset


def config():
    return preset("llama3_2_1b")
