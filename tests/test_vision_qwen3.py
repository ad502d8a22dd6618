"""Qwen3-VL with its vision tower against transformers: a tiny random Qwen3VLForConditionalGeneration (float32; 3
text layers, a 3-layer tower with deepstack from layers 0 and 1, interleaved M-RoPE) with text before and after
images of different grids, imported and exported (max |logit diff| <= 1e-4 both ways); 32 greedy tokens against
transformers' generate; the preprocessing at Qwen3-VL's settings against Qwen2VLImageProcessorPil (max |diff| <=
1e-6); `jaxlm generate --image`; config round trip and one-line refusals."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlm
from jaxlm.model import forward
from jaxlm.store import convert
from conftest import require
from vision_models import imported, logits_match_both_ways, randomize
from test_vision_qwen import (END, GRIDS, IMAGE, MERGE, PATCH, ROWS, START, TEMPORAL, V, Q, grid, hf_inputs, hf_logits,
                               prompt, word_tokenizer)

torch = require("torch")
transformers = require("transformers", "hf")


def qwen3_config(config_class=None, text_changes=(), **vision_changes):
    """The tiny Qwen3VLConfig (or config_class's: Qwen3VLMoeConfig) with text_changes (pairs) and vision_changes."""
    text = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, head_dim=16,
                num_key_value_heads=2, vocab_size=V,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True})
    text.update(text_changes)
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, out_hidden_size=64,
                  num_position_embeddings=16, deepstack_visual_indexes=[0, 1], **vision_changes)
    return (config_class or transformers.Qwen3VLConfig)(
        text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=296, vision_start_token_id=START,
        vision_end_token_id=END)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """(transformers model, imported jaxlm Model, folder)."""
    return imported(tmp_path_factory, "qwen3vl", transformers.Qwen3VLForConditionalGeneration, qwen3_config(), 0.08)


# test_vision_qwen's two rows: an 8 x 6 patch grid (12 soft tokens) and a 4 x 16 one (16 soft tokens); the learned
# positions' 4 x 4 table is resampled to each.


def test_import_and_export_match_transformers_with_images(qwen3):
    cfg = qwen3[1].config.model
    assert cfg.vision.kind == "qwen3" and cfg.vision.deepstack == (0, 1) and cfg.vision.mrope_interleaved
    logits_match_both_ways(qwen3, transformers.Qwen3VLForConditionalGeneration, hf_logits, np.array(ROWS), GRIDS)


def test_images_deepstack_and_interleaving_matter_and_text_only_is_untouched(qwen3):
    _, ours, _ = qwen3
    cfg, tokens = ours.config.model, jnp.asarray(ROWS)
    got = np.asarray(forward(ours.params, tokens, cfg, images=tuple(GRIDS)))
    assert np.abs(np.asarray(forward(ours.params, tokens, cfg)) - got)[:, 8:].max() > 1e-2
    # Deepstack: the mergers' outputs zeroed (their biases and weights), the logits at and after the images move.
    vision = dict(ours.params["vision"])
    vision["deepstack"] = jax.tree.map(jnp.zeros_like, vision["deepstack"])
    flat = np.asarray(forward({**ours.params, "vision": vision}, tokens, cfg, images=tuple(GRIDS)))
    assert np.abs(flat - got).max() > 1e-3 and np.abs(flat - got)[:, :3].max() < 1e-6
    # M-RoPE in sections instead of interleaved: other logits.
    sections = dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, mrope_interleaved=False))
    assert np.abs(np.asarray(forward(ours.params, tokens, sections, images=tuple(GRIDS))) - got).max() > 1e-3
    # Without images the pass is the text model's, bit for bit.
    text_only = {k: v for k, v in ours.params.items() if k != "vision"}
    assert (np.asarray(forward(text_only, tokens, dataclasses.replace(cfg, vision=None)))
            == np.asarray(forward(ours.params, tokens, cfg))).all()


def test_greedy_generation_with_images_matches_transformers(tmp_path):
    """32 greedy tokens of `Model.generate` with an image (tower and deepstack in the prefill, M-RoPE positions,
    then the cached decode loop) equal transformers' `generate`; without the image they differ."""
    greedy_with_an_image_matches(tmp_path, transformers.Qwen3VLForConditionalGeneration, qwen3_config())


def greedy_with_an_image_matches(tmp_path, model_class, config):
    """The greedy check above for a transformers model class and config (Qwen3-VL, Qwen3-VL-MoE)."""
    model = randomize(model_class(config).eval(), 0.18, seed=1)
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


def test_config_round_trip_and_refusals(qwen3):
    from jaxlm import config as config_lib
    from jaxlm.families import qwen3_vl
    from jaxlm.families.rules import ConvertError

    _, ours, _ = qwen3
    cfg = ours.config.model
    assert qwen3_vl.config_from_hf(qwen3_vl.config_to_hf(cfg, "qwen3_vl")) == cfg
    assert qwen3_vl.config_from_hf(qwen3_config().to_dict()) == cfg
    for change, message in ((lambda h: h["vision_config"].update(hidden_act="relu"), "hidden_act='relu'"),
                            (lambda h: h["vision_config"].update(out_hidden_size=32), "out_hidden_size"),
                            (lambda h: h["vision_config"].update(deepstack_visual_indexes=[0, 1, 2, 0]),
                             "feeds more layers"),
                            (lambda h: h["vision_config"].update(deepstack_visual_indexes=[1, 0]), "increasing order"),
                            (lambda h: h["vision_config"].update(num_position_embeddings=15), "square number"),
                            (lambda h: h["text_config"]["rope_parameters"].update(mrope_section=[2, 2, 2]),
                             "summing to head_dim / 2")):
        bad = qwen3_config().to_dict()
        change(bad)
        with pytest.raises(config_lib.ConfigError, match=message):
            qwen3_vl.config_from_hf(bad)
    sections = dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, mrope_interleaved=False))
    with pytest.raises(ConvertError, match="mrope_interleaved=false cannot be exported"):
        qwen3_vl.config_to_hf(sections, "qwen3_vl")
    with pytest.raises(config_lib.ConfigError, match="names encoder layers|must name encoder layers"):
        dataclasses.replace(cfg.vision, deepstack_layers="0,3")


def test_describe_shows_the_tower(qwen3, capsys):
    from jaxlm import cli

    _, _, tmp = qwen3
    assert cli.main(["describe", str(tmp / "jx" / "config.json")]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if "vision tower" in x][0]
    assert "vision tower (Qwen3-VL)" in line and "deepstack from layers 0,1" in line, line


def test_preprocessing_at_qwen3_settings_equals_the_hf_processor(tmp_path):
    """Patch grids of data/images_qwen.py at Qwen3-VL's settings (16-pixel patches, mean and std 0.5, its pixel
    bounds; also small bounds that both bind) equal Qwen2VLImageProcessorPil's pixel_values and grids."""
    from PIL import Image

    from jaxlm.data import images_qwen

    rng = np.random.default_rng(0)
    paths = []
    for name, (w, h), mode in (("wide.png", (640, 480), "RGB"), ("tall.png", (300, 900), "RGBA"),
                                ("square.jpg", (512, 512), "RGB"), ("tiny.png", (57, 23), "L"),
                                ("odd.png", (1000, 333), "RGB")):
        bands = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
        a = rng.integers(0, 256, (h, w, bands), dtype=np.uint8)
        Image.fromarray(a[..., 0] if bands == 1 else a, mode).save(tmp_path / name)
        paths.append(tmp_path / name)
    settings = dict(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    for size in ({"shortest_edge": 65536, "longest_edge": 16777216}, {"shortest_edge": 64 * 64,
                                                                       "longest_edge": 200 * 200}):
        hf = transformers.Qwen2VLImageProcessorPil(size=size, **settings)
        processor = images_qwen.Processor.from_hf(hf.to_dict())
        for path in paths:
            want = hf(Image.open(path), return_tensors="np")
            (got,) = images_qwen.grids([path], processor)
            assert list(got.shape[:3]) == want["image_grid_thw"][0].tolist(), path.name
            assert np.abs(images_qwen.hf_order(got, 2) - want["pixel_values"]).max() <= 1e-6, path.name
    vision = type("V", (), {"kind": "qwen3", "patch_size": 16, "spatial_merge": 2, "temporal_patch": 2})
    default = images_qwen.Processor.defaults(vision)
    assert (default.mean, default.min_pixels, default.max_pixels) == ((0.5,) * 3, 65536, 16777216)


def test_generate_cli_with_an_image(qwen3, tmp_path, capsys):
    """`jaxlm generate --image FILE` with Qwen3-VL: the image written into the prompt as its processor does (one
    pad per soft token), preprocessed at Qwen3-VL's defaults (mean and std 0.5, at least 65,536 pixels), and the
    tokens printed are `Model.generate`'s with that patch grid."""
    generate_cli_matches(qwen3, tmp_path, capsys)


def generate_cli_matches(imported_model, tmp_path, capsys):
    """The `jaxlm generate --image` check above on an imported model (Qwen3-VL, Qwen3-VL-MoE)."""
    from PIL import Image

    from jaxlm import cli
    from jaxlm.data import images_qwen

    _, ours, tmp = imported_model
    word_tokenizer(tmp / "jx" / "tokenizer")
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (50, 70, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    text = "w5 w6 <|vision_start|><|image_pad|><|vision_end|> w7 w8"
    tok = ours.tokenizer()
    grids = images_qwen.grids([tmp_path / "a.png"], images_qwen.Processor.defaults(ours.config.model.vision))
    assert grids[0].shape == (1, 56, 76, Q)  # 50 x 70 pixels scaled up to 224 x 304 (>= 65,536 pixels)
    ids = tok.encode_rendered(images_qwen.prompt_text(text, tok, ours.config.model.vision, grids))
    assert ids == [5, 6, START, *[IMAGE] * 1064, END, 7, 8]
    want = ours.generate(ids, 8, temperature=0.0, stop_ids=(), images=grids)
    capsys.readouterr()
    assert cli.main(["generate", str(tmp / "jx"), "--prompt", text, "--image", str(tmp_path / "a.png"),
                     "max_new_tokens=8", "temperature=0", "stop_at_eos=false"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == text + tok.decode(want)
