"""LoRA adapters of a vision-language model in PEFT's format (docs/vision.md, "Adapters"): an adapter that peft
writes for a tiny Gemma 3 or Qwen2.5-VL imports beside its base with peft's logits on a prompt with an image, and
jaxlm's adapter-only export of it loads back in peft with the same logits; its target_modules reach the language
model's modules only, never the vision tower's like-named ones; an adapter of the tower is refused in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

import jaxlm
from conftest import require
from jaxlm.families.rules import ConvertError
from jaxlm.store import adapters, convert

import test_vision as gemma
import test_vision_qwen as qwen
from vision_models import randomize

torch = require("torch")
transformers = require("transformers", "hf")
peft = require("peft", "hf")

LANGUAGE = r".*language_model.*\.(q_proj|v_proj|down_proj)"


def case(kind: str):
    """(model class, its config, tokens, images as jaxlm takes them, hf logits function)."""
    if kind == "gemma3":
        tokens = np.array([gemma.prompt(7, 9), gemma.prompt(3, 13)])
        pixels = np.random.default_rng(1).normal(size=(2, gemma.SIDE, gemma.SIDE, 3)).astype(np.float32)
        return transformers.Gemma3ForConditionalGeneration, gemma.gemma3_config(), tokens, pixels, gemma.hf_logits
    return (transformers.Qwen2_5_VLForConditionalGeneration, qwen.qwen_config(), np.array(qwen.ROWS), qwen.GRIDS,
            qwen.hf_logits)


@pytest.mark.parametrize("kind", ["gemma3", "qwen2_5"])
def test_a_peft_adapter_of_a_vlm_imports_and_exports_with_peft_logits(tmp_path, kind):
    model_class, config, tokens, images, hf_logits = case(kind)
    randomize(model_class(config).eval(), 0.08).save_pretrained(tmp_path / "hf")
    torch.manual_seed(1)
    tuned = peft.get_peft_model(model_class.from_pretrained(tmp_path / "hf"), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=LANGUAGE, init_lora_weights=False))
    tuned.save_pretrained(tmp_path / "adapter")
    want = hf_logits(tuned.eval(), tokens, images)
    base = hf_logits(model_class.from_pretrained(tmp_path / "hf").eval(), tokens, images)

    convert.from_hf(str(tmp_path / "hf"), tmp_path / "jx", log=lambda s: None)
    adapters.import_peft(tmp_path / "jx", tmp_path / "adapter", log=lambda s: None)
    got = np.asarray(jaxlm.load(tmp_path / "jx").logits(tokens, images=images))
    imported = float(np.abs(got - want).max())

    adapters.write_peft(tmp_path / "jx", tmp_path / "back", log=lambda s: None)
    written = json.loads((tmp_path / "back" / "adapter_config.json").read_text())
    back = peft.PeftModel.from_pretrained(model_class.from_pretrained(tmp_path / "hf"), tmp_path / "back").eval()
    adapted = [name for name, m in back.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    exported = float(np.abs(hf_logits(back, tokens, images) - got).max())
    print(f"{kind}: imported adapter vs peft max |logit diff| {imported:.3g}, the export loaded by peft "
          f"{exported:.3g}; the adapter moves the logits by {np.abs(want - base).max():.3g}; "
          f"target_modules {written['target_modules']!r}, {len(adapted)} modules adapted")
    assert imported <= 1e-4 and exported <= 1e-4 and np.abs(want - base).max() > 100 * imported
    assert adapted and all("language_model" in name for name in adapted)


def test_an_adapter_of_the_vision_tower_is_refused_in_one_line(tmp_path):
    model_class, config, *_ = case("gemma3")
    randomize(model_class(config).eval(), 0.08).save_pretrained(tmp_path / "hf")
    # "q_proj" names SigLIP's attention projections as well as the language model's
    peft.get_peft_model(model_class.from_pretrained(tmp_path / "hf"), peft.LoraConfig(
        r=4, target_modules=["q_proj"], init_lora_weights=False)).save_pretrained(tmp_path / "adapter")
    convert.from_hf(str(tmp_path / "hf"), tmp_path / "jx", log=lambda s: None)
    with pytest.raises(ConvertError, match="vision") as e:
        adapters.import_peft(tmp_path / "jx", tmp_path / "adapter", log=lambda s: None)
    assert "\n" not in str(e.value)
