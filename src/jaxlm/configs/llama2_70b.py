"""llama2-70b: the published architecture and size (jaxlm train llama2-70b checkpoint.init_from=CONVERTED)."""

from jaxlm.configs._models import preset


def config():
    return preset("llama2_70b")
