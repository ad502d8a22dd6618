"""llama4-maverick: the published architecture and size (jaxlm train llama4-maverick checkpoint.init_from=CONVERTED)."""

from jaxlm.configs._models import preset


def config():
    return preset("llama4_maverick")
