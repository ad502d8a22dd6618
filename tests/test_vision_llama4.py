"""Llama 4 with its vision tower against transformers: a tiny random Llama4ForConditionalGeneration (float32; dense
and MoE layers, chunked rotary layers and a no-rope one; two vision layers) with text before and after an image of
several tiles, imported and exported (max |logit diff| <= 1e-4 both ways); causal attention over image tokens; 32
greedy tokens with the image equal to transformers' generate; the prompt layout and the preprocessing against
transformers' Llama 4 processor."""

from __future__ import annotations

import numpy as np
import pytest

import jaxlm
from jaxlm.store import convert
from conftest import require
from vision_models import imported, logits_match_both_ways, randomize

torch = require("torch")
transformers = require("transformers", "hf")

V, IMAGE, BOI, EOI, MARK, SEP_X, SEP_Y = 300, 299, 297, 298, 296, 295, 294
SIDE, PATCH, SOFT = 28, 7, 4  # 16 patches a tile, pixel-shuffled 2 x 2 to 4 soft tokens


def llama4_config():
    return transformers.Llama4Config(
        text_config=transformers.Llama4TextConfig(
            vocab_size=V, hidden_size=64, num_attention_heads=4, num_hidden_layers=4, num_key_value_heads=2,
            head_dim=16, num_local_experts=4, intermediate_size=48, intermediate_size_mlp=80,
            interleave_moe_layer_step=2, attention_chunk_size=8, floor_scale=4, attn_scale=0.5),
        vision_config=transformers.Llama4VisionConfig(
            hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=SIDE,
            patch_size=PATCH, vision_output_dim=48, projector_input_dim=48, projector_output_dim=48),
        image_token_index=IMAGE, boi_token_index=BOI, eoi_token_index=EOI)



def image_ids(rows, cols):
    """One image's tokens as Llama 4's processor lays them out (ids for its special tokens)."""
    tile = [IMAGE] * SOFT
    grid = [t for _ in range(rows) for c in range(cols) for t in tile + ([SEP_X] if c < cols - 1 else [SEP_Y])]
    return [BOI, *(grid if rows * cols > 1 else []), MARK, *tile, EOI]


def prompt(before, after, canvas=(1, 2)):
    rng = np.random.default_rng(before)
    return list(rng.integers(0, 290, before)) + image_ids(*canvas) + list(rng.integers(0, 290, after))


def hf_logits(model, tokens, pixels):
    with torch.no_grad():
        return model(input_ids=torch.tensor(tokens),
                     pixel_values=torch.tensor(pixels).permute(0, 3, 1, 2)).logits.float().numpy()


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    """(transformers model, imported jaxlm Model, folder)."""
    return imported(tmp_path_factory, "llama4", transformers.Llama4ForConditionalGeneration, llama4_config(), 0.1)


def test_import_and_export_match_transformers_with_an_image(llama4):
    model, ours, tmp = llama4
    assert ours.config.model.vision.kind == "llama4" and ours.config.model.vision.tokens_per_image == SOFT
    tokens = np.array([prompt(7, 9)])  # an image of 1 x 2 tiles and its global tile: 3 tiles
    pixels = np.random.default_rng(1).normal(size=(3, SIDE, SIDE, 3)).astype(np.float32)
    got = logits_match_both_ways(llama4, transformers.Llama4ForConditionalGeneration, hf_logits, tokens, pixels)
    # Attention over the image's tokens is causal: the positions before the image do not see it; after it,
    # another image (the tiles reversed) or none changes the logits.
    first = tokens[0].tolist().index(IMAGE)
    other = np.asarray(ours.logits(tokens, images=pixels[::-1]))
    assert np.abs(other - got)[:, :first].max() == 0 and np.abs(other - got)[:, first:].max() > 1e-2
    assert np.abs(np.asarray(ours.logits(tokens)) - got)[:, first:].max() > 1e-2


def test_configs_it_cannot_represent_are_refused_in_one_line(llama4):
    from jaxlm.families import llama4 as family
    from jaxlm.families.rules import ConvertError

    good = llama4_config().to_dict()
    for key, value, says in (("pixel_shuffle_ratio", 0.3, "pixel_shuffle_ratio=0.3"),
                             ("intermediate_size", 64, "intermediate_size=64"),
                             ("vision_output_dim", 40, "vision_output_dim=40"),
                             ("multi_modal_projector_bias", True, "multi_modal_projector_bias=True")):
        bad = {**good, "vision_config": {**good["vision_config"], key: value}}
        with pytest.raises(ConvertError, match=says) as e:
            family.config_from_hf(bad)
        assert "\n" not in str(e.value)


def test_greedy_generation_with_an_image_matches_transformers(llama4):
    """32 greedy tokens of `Model.generate` with an image of 2 x 2 tiles (5 tiles with the global one) equal
    transformers' `generate`, and differ without the image."""
    _, _, tmp = llama4
    model = randomize(transformers.Llama4ForConditionalGeneration(llama4_config()).eval(), 0.2, seed=1)
    model.save_pretrained(tmp / "hf_gen")
    convert.from_hf(str(tmp / "hf_gen"), tmp / "jx_gen", log=lambda s: None)
    ours = jaxlm.load(tmp / "jx_gen")
    ids = prompt(5, 6, canvas=(2, 2))
    pixels = np.random.default_rng(2).normal(size=(5, SIDE, SIDE, 3)).astype(np.float32)
    with torch.no_grad():
        want = model.generate(input_ids=torch.tensor([ids]), pixel_values=torch.tensor(pixels).permute(0, 3, 1, 2),
                              max_new_tokens=32, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(ids):].tolist()
    assert len(set(want)) > 8
    assert ours.generate(ids, 32, temperature=0.0, stop_ids=(), images=pixels) == want
    assert ours.generate(ids, 32, temperature=0.0, stop_ids=()) != want


class Words:
    """A tokenizer's decode for the image tokens' ids."""
    names = {BOI: "<|image_start|>", EOI: "<|image_end|>", IMAGE: "<|patch|>"}

    def decode(self, ids):
        return "".join(self.names[i] for i in ids)


def test_prompt_layout_equals_the_processor():
    from jaxlm.config.model_schema import VisionConfig
    from jaxlm.data import images_llama4

    vision = VisionConfig(kind="llama4", image_size=SIDE, patch_size=PATCH, d_model=32, n_heads=2, tokens_per_image=4,
                          image_token_id=IMAGE, boi_token_id=BOI, eoi_token_id=EOI)
    canvases = [(1, 1), (2, 3), (4, 1)]
    got = images_llama4.prompt_text("a<|image|>b<|image|><|image|>c", Words(), vision, canvases)
    split = transformers.Llama4Processor._prompt_split_image  # uses only its arguments
    assert got == "a" + split(None, canvases[0], 4) + "b" + split(None, canvases[1], 4) + split(None, canvases[2], 4) + "c"
    with pytest.raises(images_llama4.ImageError, match="marks 1 image"):
        images_llama4.prompt_text("a<|image|>", Words(), vision, canvases)


def test_resize_equals_torch_antialiased_bilinear():
    """The uint8 resize equals torch's (what transformers' processor calls through torchvision), up and down."""
    from jaxlm.data import images_llama4

    rng = np.random.default_rng(0)
    for h, w, nh, nw in ((50, 70, 40, 56), (200, 300, 28, 28), (13, 90, 28, 193), (3, 7, 28, 28), (640, 480, 336, 252)):
        a = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        want = torch.nn.functional.interpolate(torch.tensor(a).permute(2, 0, 1)[None], size=[nh, nw], mode="bilinear",
                                               antialias=True)[0].permute(1, 2, 0).numpy()
        assert np.array_equal(images_llama4.resize(a, nh, nw), want)


def test_preprocessing_equals_the_hf_processor(tmp_path):
    """Tiles of images of several sizes, aspect ratios and modes (one tile, several tiles and the global one)
    equal Llama4ImageProcessor's pixel values (bfloat16) and canvases."""
    require("torchvision", "hf")
    from PIL import Image

    from jaxlm.data import images_llama4

    rng = np.random.default_rng(0)
    hf = transformers.Llama4ImageProcessor(size={"height": SIDE, "width": SIDE}, max_patches=6)
    ours = images_llama4.TileProcessor(size=SIDE, max_tiles=6)
    for h, w, mode in ((20, 20, "RGB"), (50, 70, "RGB"), (70, 50, "RGBA"), (13, 90, "L"), (100, 33, "RGB"),
                       (57, 57, "P"), (200, 300, "RGB"), (29, 30, "RGB")):
        image = Image.fromarray(rng.integers(0, 256, (h, w, 4), dtype=np.uint8), "RGBA")
        image = image if mode == "RGBA" else image.convert(mode)
        image.save(tmp_path / "x.png")
        out = hf(Image.open(tmp_path / "x.png"), return_tensors="pt")
        got, canvases = images_llama4.pixels([tmp_path / "x.png"], ours)
        assert canvases == [tuple(out["aspect_ratios"][0].tolist())]
        assert np.abs(got - out["pixel_values"].float().permute(0, 2, 3, 1).numpy()).max() <= 1e-6
