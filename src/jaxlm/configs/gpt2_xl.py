"""gpt2-xl: the published architecture and size (jaxlm train gpt2-xl checkpoint.init_from=CONVERTED)."""

from jaxlm.configs._models import preset


def config():
    return preset("gpt2_xl")
