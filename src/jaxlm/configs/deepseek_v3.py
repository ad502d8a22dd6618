"""deepseek-v3: the published architecture and size (jaxlm train deepseek-v3 checkpoint.init_from=CONVERTED)."""

from jaxlm.configs._models import preset


def config():
    return preset("deepseek_v3")
