"""Model families as data: each module maps a Hugging Face `config.json` to a ModelConfig and back, and lists
the tensors of its checkpoints with the layout change between their names and shapes and ours (families/rules.py).
"""

from __future__ import annotations

from jaxlm.config import ModelConfig
from jaxlm.families import apertus, deepseek, gemma, gpt2, gpt_oss, llama, llama4, qwen3_vl, qwen_vl
from jaxlm.families.rules import ConvertError

# The one list, in the order for_config asks: llama last, since it answers any config; qwen_vl and qwen3_vl before
# gemma, which answers any model with a vision tower; apertus (a plain, ungated MLP: jaxlm's default GPT) after the
# families whose options it does not have.
FAMILIES = (gpt2, deepseek, gpt_oss, llama4, qwen_vl, qwen3_vl, gemma, apertus, llama)


def for_model_type(model_type: str | None):
    fams = {t: m for m in FAMILIES for t in m.MODEL_TYPES}
    if model_type not in fams:
        raise ConvertError(f"config.json model_type={model_type!r} is not supported; supported: {', '.join(fams)}")
    return fams[model_type]


def for_config(cfg: ModelConfig):
    """The family and HF model_type that represent this model, chosen from its options."""
    for fam in FAMILIES:
        model_type = fam.model_type(cfg)
        if model_type:
            return fam, model_type
    raise AssertionError("unreachable: llama.model_type always answers")
