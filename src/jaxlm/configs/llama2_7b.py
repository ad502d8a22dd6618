"""llama2-7b: the published architecture and size (jaxlm train llama2-7b checkpoint.init_from=CONVERTED)."""

from jaxlm.configs._models import preset


def config():
    return preset("llama2_7b")
