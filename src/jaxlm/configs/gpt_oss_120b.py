"""gpt-oss-120b: the published architecture and size (jaxlm train gpt-oss-120b checkpoint.init_from=CONVERTED)."""

from jaxlm.configs._models import preset


def config():
    return preset("gpt_oss_120b")
