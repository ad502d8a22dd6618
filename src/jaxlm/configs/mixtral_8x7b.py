"""mixtral-8x7b: the published architecture and size (jaxlm train mixtral-8x7b checkpoint.init_from=CONVERTED)."""

from jaxlm.configs._models import preset


def config():
    return preset("mixtral_8x7b")
