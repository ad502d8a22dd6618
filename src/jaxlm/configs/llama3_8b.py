"""llama3-8b: the published architecture and size (jaxlm train llama3-8b checkpoint.init_from=CONVERTED)."""

from jaxlm.configs._models import preset


def config():
    return preset("llama3_8b")
