"""llama4-scout: the published architecture and size (jaxlm train llama4-scout checkpoint.init_from=CONVERTED)."""

from jaxlm.configs._models import preset


def config():
    return preset("llama4_scout")
