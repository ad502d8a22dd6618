"""gpt2-large: the published architecture and size (jaxlm train gpt2-large checkpoint.init_from=CONVERTED)."""

from jaxlm.configs._models import preset


def config():
    return preset("gpt2_large")
