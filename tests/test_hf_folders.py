"""Model folders as transformers 5 writes them, through `jaxlm convert from-hf` and `to-hf` and back: for every
model type with a Hugging Face mapping, a tiny random model saved with its tokenizer (and, with a vision tower, its
processor) by transformers' own save_pretrained, its special ids set away from transformers' defaults. Every key of
the source's config.json and generation_config.json comes back in the export (or is on convert.REWRITTEN), and the
export's logits equal the source's (max |diff| <= 1e-4, with images). The image settings are read from
processor_config.json alone (pixel values equal to the processor's, max |diff| 0, and the same prompt tokens, at
settings away from the defaults); a folder without them is refused. The same for the layout of the hub's
checkpoints (ids at the top of config.json, preprocessor_config.json). `Model.generate` stops at the EOS that only
generation_config.json names. (53 s on a 2-core machine, 32 tests.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import jaxlm
from jaxlm.store import convert
from conftest import require
from vision_models import randomize

torch = require("torch")
transformers = require("transformers", "hf")

import test_convert  # noqa: E402
import test_hf_families  # noqa: E402
import test_vision  # noqa: E402
import test_vision_llama4  # noqa: E402
import test_vision_qwen  # noqa: E402
import test_vision_qwen3  # noqa: E402
import test_vision_qwen3_moe  # noqa: E402

# Special ids away from every family's default: bos, eos (a list, as Gemma 3's and Llama 3's) and pad.
IDS = {"bos_token_id": 5, "eos_token_id": [6, 7], "pad_token_id": 4}
TEXT = {**{k: v for k, v in test_convert.CASES.items() if k in ("gpt2", "llama", "mistral-window-5", "qwen2",
                                                                  "qwen3", "gemma", "gemma2-softcap", "mixtral")},
        **{{"gemma3": "gemma3_text", "llama4": "llama4_text"}.get(k, k): v for k, v in test_hf_families.CASES.items()}}
# Vision cases: (config, model class, the processor's image processor at settings away from its defaults, the
# tokenizer's special tokens, a prompt with one image marker, the vision test module's hf_logits and its inputs).
VISION = {
    "gemma3": (test_vision.gemma3_config, "Gemma3ForConditionalGeneration"),
    "qwen2_5_vl": (test_vision_qwen.qwen_config, "Qwen2_5_VLForConditionalGeneration"),
    "qwen3_vl": (test_vision_qwen3.qwen3_config, "Qwen3VLForConditionalGeneration"),
    "qwen3_vl_moe": (test_vision_qwen3_moe.moe_config, "Qwen3VLMoeForConditionalGeneration"),
    "llama4": (test_vision_llama4.llama4_config, "Llama4ForConditionalGeneration"),
}
QWEN_SPECIALS = {"<|vision_start|>": 297, "<|vision_end|>": 298, "<|image_pad|>": 299, "<|video_pad|>": 296}
SPECIALS = {
    "gemma3": {"<start_of_image>": 297, "<end_of_image>": 298, "<image_soft_token>": 299, "\n\n": 296},
    "qwen2_5_vl": QWEN_SPECIALS, "qwen3_vl": QWEN_SPECIALS, "qwen3_vl_moe": QWEN_SPECIALS,
    "llama4": {"<|image_start|>": 297, "<|image_end|>": 298, "<|patch|>": 299, "<|image|>": 296,
               "<|tile_x_separator|>": 295, "<|tile_y_separator|>": 294},
}
PROMPTS = {"gemma3": "w8 w9 <start_of_image> w10", "llama4": "w8 w9 <|image|> w10",
           **{k: "w8 w9 <|vision_start|><|image_pad|><|vision_end|> w10" for k in ("qwen2_5_vl", "qwen3_vl",
                                                                                  "qwen3_vl_moe")}}


def tokenizer(vocab: int, specials: dict[str, int], extra: dict | None = None):
    """A transformers tokenizer of words w0.. with `specials` (strings: ids) among them."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(vocab) if i not in specials.values()} | specials
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials if s != "\n\n"])
    tok.add_tokens([AddedToken(s, normalized=False) for s in specials if s == "\n\n"])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, extra_special_tokens=extra or {},
                                                eos_token="w6", bos_token="w5", pad_token="w4")


def processor(name: str):
    """The model type's processor with its image processor away from the defaults: Gemma 3's mean and std, Qwen-VL's
    pixel bounds, Llama 4's tiles."""
    tok = tokenizer(300, SPECIALS[name], {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                          "image_token": "<image_soft_token>"} if name == "gemma3" else None)
    if name == "gemma3":
        return transformers.Gemma3Processor(image_processor=transformers.Gemma3ImageProcessorPil(
            size={"height": 28, "width": 28}, image_mean=[0.4, 0.5, 0.6], image_std=[0.3, 0.2, 0.25]),
            tokenizer=tok, image_seq_length=4)
    if name == "llama4":
        require("torchvision", "hf")
        return transformers.Llama4Processor(image_processor=transformers.Llama4ImageProcessor(
            size={"height": 28, "width": 28}, max_patches=3), tokenizer=tok, patch_size=7, pixel_shuffle_ratio=0.5)
    require("torchvision", "hf")
    images = transformers.Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                                                   size={"shortest_edge": 24 * 24, "longest_edge": 40 * 40})
    video_class = transformers.Qwen2VLVideoProcessor if name == "qwen2_5_vl" else transformers.Qwen3VLVideoProcessor
    processor_class = transformers.Qwen2_5_VLProcessor if name == "qwen2_5_vl" else transformers.Qwen3VLProcessor
    return processor_class(image_processor=images, tokenizer=tok,
                           video_processor=video_class(patch_size=4, merge_size=2, temporal_patch_size=2))


def with_ids(config):
    """The config with IDS in the text model's config (transformers 5 keeps them there)."""
    text = config.get_text_config(decoder=True)
    for k, v in IDS.items():
        setattr(text, k, v)
    return config


def to_hub_layout(folder: Path) -> None:
    """A transformers 5 folder rewritten as the hub's checkpoints are: the special ids at the top of config.json
    only, the image processor's settings in preprocessor_config.json."""
    cfg = json.loads((folder / "config.json").read_text())
    if "text_config" in cfg:
        cfg.update({k: cfg["text_config"].pop(k) for k in IDS if k in cfg["text_config"]})
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    file = folder / "processor_config.json"
    if file.is_file():
        nested = json.loads(file.read_text())
        (folder / "preprocessor_config.json").write_text(json.dumps(nested.pop("image_processor"), indent=2))
        file.write_text(json.dumps(nested, indent=2))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A function giving (source model, folder with hf/, jx/ and back/) of a case and layout, built once."""
    cache = {}

    def build(name: str, layout: str = "transformers5"):
        if (name, layout) in cache:
            return cache[name, layout]
        tmp = tmp_path_factory.mktemp(f"{name}-{layout}")
        if name in VISION:
            config, model_class = VISION[name]
            model = randomize(getattr(transformers, model_class)(with_ids(config())).eval(), 0.08)
            processor(name).save_pretrained(tmp / "hf")
        else:
            config = with_ids(TEXT[name]())
            model = randomize(transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
                              .eval(), 0.08)
            tokenizer(config.vocab_size, {}).save_pretrained(tmp / "hf")
        model.save_pretrained(tmp / "hf")
        if layout == "hub":
            to_hub_layout(tmp / "hf")
        convert.from_hf(str(tmp / "hf"), tmp / "jx", log=lambda s: None)
        convert.to_hf(tmp / "jx", tmp / "back", log=lambda s: None)
        cache[name, layout] = model, tmp
        return model, tmp

    return build


def differences(source, export, path=""):
    """The dotted paths of source's keys whose value the export lacks or holds otherwise."""
    if isinstance(source, dict) and isinstance(export, dict):
        return [d for k, v in source.items() for d in differences(v, export.get(k, _MISSING), f"{path}{k}.")]
    return [] if source == export else [path.rstrip(".")]


_MISSING = object()


def check_round_trip(model, tmp, name):
    """config.json and generation_config.json keep every key; the export's special ids are where transformers 5 reads
    them; transformers' logits of the export equal the source's (with images for a vision tower)."""
    for file in ("config.json", "generation_config.json"):
        source, export = (json.loads((tmp / d / file).read_text()) for d in ("hf", "back"))
        assert [d for d in differences(source, export) if d not in convert.REWRITTEN] == [], file
    source = json.loads((tmp / "hf" / "config.json").read_text())
    back = type(model).from_pretrained(tmp / "back").eval()
    text = back.config.get_text_config(decoder=True)
    assert {k: getattr(text, k) for k in IDS} == IDS
    assert back.generation_config.eos_token_id == IDS["eos_token_id"]
    if name in VISION:
        tokens, images, hf_logits = vision_inputs(name)
    else:
        tokens, images = np.random.default_rng(0).integers(0, source["vocab_size"], (2, 12)), None
        hf_logits = lambda m, t, _: test_convert.hf_logits(m, t)  # noqa: E731
    want = hf_logits(model, tokens, images)
    assert np.abs(want).max() > 0.5
    assert np.abs(hf_logits(back, tokens, images) - want).max() <= 1e-4


def vision_inputs(name):
    """(tokens, images, hf_logits) of the vision test module of the model type."""
    if name == "gemma3":
        tokens = np.array([test_vision.prompt(7, 9)])
        return tokens, np.random.default_rng(1).normal(size=(1, 28, 28, 3)).astype(np.float32), test_vision.hf_logits
    if name == "llama4":
        tokens = np.array([test_vision_llama4.prompt(7, 9)])
        return (tokens, np.random.default_rng(1).normal(size=(3, 28, 28, 3)).astype(np.float32),
                test_vision_llama4.hf_logits)
    return np.array(test_vision_qwen.ROWS), test_vision_qwen.GRIDS, test_vision_qwen.hf_logits


@pytest.mark.parametrize("name", [*TEXT, *VISION])
def test_round_trip_keeps_every_key_and_the_logits(name, built):
    check_round_trip(*built(name), name)


@pytest.mark.parametrize("name", VISION)
def test_hub_layout_round_trip(name, built):
    """The source with its ids at the top and preprocessor_config.json: the same keys come back, and the export has
    the ids inside text_config too, where transformers 5 reads them."""
    model, tmp = built(name, "hub")
    assert "eos_token_id" not in json.loads((tmp / "hf" / "config.json").read_text())["text_config"]
    check_round_trip(model, tmp, name)


@pytest.mark.parametrize("layout", ["transformers5", "hub"])
@pytest.mark.parametrize("name", ["gemma3", "qwen2_5_vl", "qwen3_vl", "llama4"])
def test_preprocessing_is_the_saved_processors(name, layout, built, tmp_path):
    """Pixel values and prompt tokens of `jaxlm generate --image` (api.image_prompts) for the converted folder equal
    those of the processor transformers loads from the source folder (processor_config.json alone, or
    preprocessor_config.json alone), at settings away from the defaults; without either file images are refused in
    one line naming both."""
    from PIL import Image

    from jaxlm.data.errors import DataError
    from jaxlm.infer import api

    _, tmp = built(name, layout)
    files = sorted(p.name for p in (tmp / "jx" / "tokenizer").glob("*processor*"))
    assert files == (["processor_config.json"] if layout == "transformers5"
                     else ["preprocessor_config.json", "processor_config.json"])
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (45, 70, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    # The Pillow backend, which jaxlm's preprocessing follows (Llama 4's processor has only torchvision's).
    pil = {} if name == "llama4" else {
        "image_processor": transformers.AutoImageProcessor.from_pretrained(tmp / "hf", backend="pil")}
    hf = transformers.AutoProcessor.from_pretrained(tmp / "hf", **pil)
    want = hf(text=PROMPTS[name], images=[Image.open(tmp_path / "a.png")], return_tensors="pt")
    want = {k: v.float().numpy() if v.is_floating_point() else v.numpy() for k, v in want.items()}
    ours = jaxlm.load(tmp / "jx")
    tok = ours.tokenizer()
    ids, images = api.image_prompts(ours, tok, [PROMPTS[name]], [tmp_path / "a.png"], [])
    images_before = images[0] if name.startswith("qwen") else images
    assert ids == want["input_ids"].tolist()
    if name in ("gemma3", "llama4"):
        pixels = want["pixel_values"].transpose(0, 2, 3, 1)
    else:
        from jaxlm.data import images_qwen

        pixels, images = want["pixel_values"], images_qwen.hf_order(images[0], 2)
    assert images.shape == pixels.shape and np.abs(images - pixels).max() == 0
    assert ids[0].count(ours.config.model.vision.image_token_id) >= 4  # the image's tokens are compared
    # Without the settings, the defaults would have given other pixels or another number of image tokens: refused.
    for f in (tmp / "jx" / "tokenizer").glob("*processor*"):
        shutil.move(f, tmp_path / f.name)
    try:
        with pytest.raises(DataError, match="looked for processor_config.json .* then preprocessor_config.json") as e:
            api.image_prompts(ours, tok, [PROMPTS[name]], [tmp_path / "a.png"], [])
        assert "\n" not in str(e.value)
        # `{}` asks for the released models' settings (at the tower's sizes): other pixels or another prompt.
        (tmp / "jx" / "tokenizer" / "preprocessor_config.json").write_text("{}")
        ids_default, default = api.image_prompts(ours, tok, [PROMPTS[name]], [tmp_path / "a.png"], [])
        assert ids_default != ids or np.abs(np.asarray(default[0] if name.startswith("qwen") else default)
                                            - np.asarray(images_before)).max() > 1e-3
    finally:
        (tmp / "jx" / "tokenizer" / "preprocessor_config.json").unlink(missing_ok=True)
        for f in tmp_path.glob("*processor*"):
            shutil.move(f, tmp / "jx" / "tokenizer" / f.name)


def test_generate_stops_at_the_eos_only_generation_config_names(built, tmp_path, capsys):
    """A folder whose config.json names no EOS (at the top or in text_config) and whose generation_config.json does:
    `Model.generate` stops there by default, as `jaxlm generate` does."""
    from jaxlm import cli

    _, tmp = built("llama")
    shutil.copytree(tmp / "hf", tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    del cfg["eos_token_id"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    free = jaxlm.load(tmp / "jx").generate([8, 9, 10], 8, temperature=0.0, stop_ids=())
    eos = free[2]
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [eos, 1]}))
    convert.from_hf(str(tmp_path / "hf"), tmp_path / "jx", log=lambda s: None)
    ours = jaxlm.load(tmp_path / "jx")
    assert ours.eos_ids() == (eos, 1)
    got = ours.generate([8, 9, 10], 8, temperature=0.0)
    assert got == free[:free.index(eos) + 1] and len(got) < 8
    tok = ours.tokenizer()
    capsys.readouterr()
    assert cli.main(["generate", str(tmp_path / "jx"), "--prompt", "w8 w9 w10", "max_new_tokens=8",
                     "temperature=0"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "w8 w9 w10" + tok.decode(got)
