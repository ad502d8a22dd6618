"""Qwen2.5-VL with its vision tower against transformers: a tiny random Qwen2_5_VLForConditionalGeneration (float32;
windowed and full-attention tower layers, 2 text layers) with text before and after images of different grids,
imported and exported (max |logit diff| <= 1e-4 both ways); M-RoPE positions against get_rope_index; 32 greedy
tokens against transformers' generate; the preprocessing against Qwen2VLImageProcessorPil (max |diff| <= 1e-6)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import jaxlm
from jaxlm.model import forward
from jaxlm.store import convert
from conftest import require
from vision_models import imported, logits_match_both_ways, randomize

torch = require("torch")
transformers = require("transformers", "hf")

V, IMAGE, START, END = 300, 299, 297, 298
PATCH, MERGE, TEMPORAL = 4, 2, 2
Q = 3 * TEMPORAL * PATCH * PATCH


def qwen_config():
    text = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=V, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                       "mrope_section": [2, 3, 3]})
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, window_size=16, out_hidden_size=64,
                  fullatt_block_indexes=[1])
    return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE,
                                         video_token_id=296, vision_start_token_id=START, vision_end_token_id=END)



def grid(h, w, seed):
    """A random patch grid [1, h, w, Q] (h, w in patches)."""
    return np.random.default_rng(seed).normal(size=(1, h, w, Q)).astype(np.float32)


def prompt(before, after, grids):
    """Text, then per image vision_start, its soft tokens' pads, vision_end, then more text."""
    rng = np.random.default_rng(before)
    ids = list(rng.integers(0, 290, before))
    for g in grids:
        ids += [START] + [IMAGE] * (g.shape[1] * g.shape[2] // MERGE ** 2) + [END]
    return ids + list(rng.integers(0, 290, after))


def hf_inputs(tokens, grids):
    from jaxlm.data import images_qwen

    ids = torch.tensor(tokens)
    return dict(input_ids=ids, mm_token_type_ids=(ids == IMAGE).int(),
                pixel_values=torch.tensor(np.concatenate([images_qwen.hf_order(g, MERGE) for g in grids])),
                image_grid_thw=torch.tensor([g.shape[:3] for g in grids]))


def hf_logits(model, tokens, grids):
    with torch.no_grad():
        return model(**hf_inputs(tokens, grids)).logits.float().numpy()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(transformers model, imported jaxlm Model, folder)."""
    return imported(tmp_path_factory, "qwen25vl", transformers.Qwen2_5_VLForConditionalGeneration, qwen_config(), 0.08)


# Two rows of one length: an 8 x 6 patch grid (12 soft tokens, 2 x 2 windows, the last column cut) and a 4 x 16 one
# (16 soft tokens, 1 x 4 windows).
GRIDS = [grid(8, 6, 1), grid(4, 16, 2)]
ROWS = [prompt(5, 9, GRIDS[:1]), prompt(3, 7, GRIDS[1:])]


def test_import_and_export_match_transformers_with_images(qwen):
    model, ours, tmp = qwen
    assert ours.config.model.vision.kind == "qwen2_5" and ours.config.model.vision.full_layers == (1,)
    tokens = np.array(ROWS)
    got = logits_match_both_ways(qwen, transformers.Qwen2_5_VLForConditionalGeneration, hf_logits, tokens, GRIDS)
    # The images matter: without them (pads embedded as tokens, plain positions) and with other pixels the
    # logits after the images differ.
    assert np.abs(ours.logits(tokens) - got)[:, 8:].max() > 1e-2
    assert np.abs(ours.logits(tokens, images=[g[:, ::-1] for g in GRIDS]) - got).max() > 1e-2
    # The windows matter: every tower layer attending over the whole image gives other logits.
    cfg = ours.config.model
    everywhere = dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, full_attention_layers="0,1,2"))
    assert np.abs(np.asarray(forward(ours.params, jnp.asarray(tokens), everywhere, images=tuple(GRIDS))) - got
                  ).max() > 1e-3


def test_mrope_positions_are_get_rope_index_shifted(qwen):
    """Our M-RoPE positions are transformers' get_rope_index plus one offset per row, which puts the tokens after
    the last image at their own index (what the decode steps use); two images in one row included."""
    from jaxlm.model import vision_qwen

    model, ours, _ = qwen
    two = [grid(4, 4, 3), grid(6, 2, 4)]
    rows = [prompt(4, 3, two), prompt(2, 2, two[:1]) + [7] * 8]
    grids = two + two[:1]
    tokens = np.array(rows)
    inputs = hf_inputs(tokens, grids)
    want, _ = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"])
    want = want.numpy().transpose(1, 2, 0)
    got = np.asarray(vision_qwen.rope_positions(jnp.asarray(tokens), tuple(grids), ours.config.model))
    shift = got - want
    assert (shift == shift[:, :1, :1]).all() and (shift[:, 0, 0] > 0).all()
    assert (got[:, -1] == tokens.shape[1] - 1).all()
    assert (want[..., 1] != want[..., 2]).any()  # a grid taller than wide: height and width positions differ


def test_config_round_trip_and_refusals(qwen):
    from jaxlm.families import qwen_vl
    from jaxlm.families.rules import ConvertError

    _, ours, tmp = qwen
    cfg = ours.config.model
    assert qwen_vl.config_from_hf(qwen_vl.config_to_hf(cfg, "qwen2_5_vl")) == cfg
    hf = qwen_config().to_dict()
    for change, message in ((lambda h: h["vision_config"].update(hidden_act="gelu"), "hidden_act"),
                            (lambda h: h["vision_config"].update(out_hidden_size=32), "out_hidden_size"),
                            (lambda h: h["text_config"]["rope_parameters"].update(mrope_section=[2, 2, 2]),
                             "must sum to head_dim / 2")):
        bad = qwen_config().to_dict()
        change(bad)
        with pytest.raises(ConvertError, match=message):
            qwen_vl.config_from_hf(bad)
    assert qwen_vl.config_from_hf(hf) == cfg
    from jaxlm import config as config_lib

    for change, message in (({"mrope_section": "2,3"}, "three comma-separated"),
                            ({"full_attention_layers": "0,7"}, "names a layer past"),
                            ({"full_attention_layers": "a"}, "comma-separated whole numbers"),
                            ({"window_size": 12}, "multiple of patch_size x spatial_merge")):
        with pytest.raises(config_lib.ConfigError, match=message):
            dataclasses.replace(cfg.vision, **change)
    odd = dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, mrope_section="2,2,2"))
    with pytest.raises(config_lib.ConfigError, match="must sum to the language model's head_dim / 2 = 8"):
        config_lib.validate(ours.config.replace(model=odd))


def test_describe_shows_the_tower(qwen, capsys):
    from jaxlm import cli

    _, _, tmp = qwen
    assert cli.main(["describe", str(tmp / "jx" / "config.json")]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if "vision tower" in x][0]
    assert "3 layers (full attention: 1; the others in 16-pixel windows), width 32" in line, line
    assert "2x2 merged into soft tokens of width 64; M-RoPE 2,3,3" in line, line


@pytest.mark.slow
def test_greedy_generation_with_images_matches_transformers(tmp_path):
    """32 greedy tokens of `Model.generate` with an image (encoded in the prefill, M-RoPE positions, then the
    cached decode loop at plain positions) equal transformers' `generate`; without the image they differ."""
    model = randomize(transformers.Qwen2_5_VLForConditionalGeneration(qwen_config()).eval(), 0.25)
    model.save_pretrained(tmp_path / "hf")
    convert.from_hf(str(tmp_path / "hf"), tmp_path / "jx", log=lambda s: None)
    ours = jaxlm.load(tmp_path / "jx")
    grids = [grid(8, 6, 5)]
    ids = prompt(5, 6, grids)
    with torch.no_grad():
        want = model.generate(**hf_inputs([ids], grids), max_new_tokens=32, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(ids):].tolist()
    assert len(set(want)) > 8
    assert ours.generate(ids, 32, temperature=0.0, stop_ids=(), images=grids) == want
    assert ours.generate(ids, 32, temperature=0.0, stop_ids=()) != want


def test_preprocessing_equals_the_hf_processor(tmp_path):
    """Patch grids of data/images_qwen.py, flattened in transformers' order, equal Qwen2VLImageProcessorPil's
    pixel_values and image_grid_thw for pictures of several sizes, aspect ratios and modes, at the released
    models' settings and at small min/max pixels (both limits reached)."""
    from PIL import Image

    from jaxlm.data import images_qwen

    rng = np.random.default_rng(0)
    paths = []
    for name, (w, h), mode in (("wide.png", (640, 480), "RGB"), ("tall.png", (300, 900), "RGBA"),
                                ("square.jpg", (448, 448), "RGB"), ("tiny.png", (57, 23), "L"),
                                ("huge.png", (1900, 1200), "RGB")):
        bands = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
        a = rng.integers(0, 256, (h, w, bands), dtype=np.uint8)
        Image.fromarray(a[..., 0] if bands == 1 else a, mode).save(tmp_path / name)
        paths.append(tmp_path / name)
    for kw in ({}, {"min_pixels": 64 * 64, "max_pixels": 160 * 160}):
        hf = transformers.Qwen2VLImageProcessorPil(**kw)
        processor = images_qwen.Processor.from_hf(hf.to_dict())
        for path in paths:
            want = hf(Image.open(path), return_tensors="np")
            (got,) = images_qwen.grids([path], processor)
            assert list(got.shape[:3]) == want["image_grid_thw"][0].tolist(), path.name
            assert np.abs(images_qwen.hf_order(got, 2) - want["pixel_values"]).max() <= 1e-6, path.name


def word_tokenizer(folder):
    """A tokenizer.json of words w0..w299 with Qwen-VL's image token strings at their ids, and image processor
    settings `{}` (the released models' at the tower's patch sizes)."""
    import json

    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    specials = {"<|vision_start|>": START, "<|vision_end|>": END, "<|image_pad|>": IMAGE}
    vocab = {f"w{i}": i for i in range(V) if i not in specials.values()} | specials
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({}))
    (folder / "preprocessor_config.json").write_text("{}")


def test_generate_cli_with_an_image(qwen, tmp_path, capsys):
    """`jaxlm generate --image FILE` writes the image into the prompt as Qwen2.5-VL's processor does (one pad per
    soft token of its grid) and prints the tokens `Model.generate` gives with the image's patch grid."""
    from PIL import Image

    from jaxlm import cli
    from jaxlm.data import images_qwen

    _, ours, tmp = qwen
    word_tokenizer(tmp / "jx" / "tokenizer")
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (50, 70, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    text = "w5 w6 <|vision_start|><|image_pad|><|vision_end|> w7 w8"
    tok = ours.tokenizer()
    grids = images_qwen.grids([tmp_path / "a.png"], images_qwen.Processor.defaults(ours.config.model.vision))
    assert grids[0].shape == (1, 12, 18, Q)  # 50 x 70 pixels resized to 48 x 72
    ids = tok.encode_rendered(images_qwen.prompt_text(text, tok, ours.config.model.vision, grids))
    assert ids == [5, 6, START, *[IMAGE] * 54, END, 7, 8]
    want = ours.generate(ids, 8, temperature=0.0, stop_ids=(), images=grids)
    capsys.readouterr()
    assert cli.main(["generate", str(tmp / "jx"), "--prompt", text, "--image", str(tmp_path / "a.png"),
                     "max_new_tokens=8", "temperature=0", "stop_at_eos=false"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == text + tok.decode(want)


def test_images_that_do_not_fit_the_prompt_are_one_line_errors(qwen):
    _, ours, _ = qwen
    tokens = np.array(ROWS)
    with pytest.raises(ValueError, match=r"the prompts hold 28 image tokens but their 2 image\(s\) make 36 soft"):
        ours.logits(tokens, images=GRIDS[:1] + [grid(8, 12, 0)])
    with pytest.raises(ValueError, match=r"image 1 has shape \(1, 4, 5, 96\); this tower takes patch grids"):
        ours.logits(tokens, images=GRIDS[:1] + [grid(4, 5, 0)])
