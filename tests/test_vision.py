"""Gemma 3 with its vision tower against transformers: a tiny random Gemma3ForConditionalGeneration (float32; local
and global layers and a last partial repeat of the pattern; two SigLIP layers) with text before and after an
image, imported and exported (max |logit diff| <= 1e-4 both ways); the attention mask of an image's tokens; and
the image preprocessing against the Hugging Face processor (max |pixel diff| <= 1e-6)."""

from __future__ import annotations

import numpy as np
import pytest

import jaxlm
from jaxlm.store import convert
from conftest import require
from vision_models import imported, logits_match_both_ways, randomize

torch = require("torch")
transformers = require("transformers", "hf")

V, IMAGE, BOI, EOI = 300, 299, 297, 298
SIDE, PATCH, SOFT = 28, 7, 4  # 16 patches pooled to 4 soft tokens


def gemma3_config(**text):
    return transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(
            num_attention_heads=4, hidden_size=64, intermediate_size=96, vocab_size=V, num_hidden_layers=7,
            num_key_value_heads=2, head_dim=16, sliding_window=4, query_pre_attn_scalar=24,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, **text),
        vision_config=transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                      num_attention_heads=2, image_size=SIDE, patch_size=PATCH),
        mm_tokens_per_image=SOFT, image_token_index=IMAGE, boi_token_index=BOI, eoi_token_index=EOI)



def prompt(before, after, images=1):
    """Text, then per image the processor's layout (boi, the soft tokens, eoi), then more text."""
    rng = np.random.default_rng(before)
    ids = list(rng.integers(0, 290, before))
    for _ in range(images):
        ids += [BOI] + [IMAGE] * SOFT + [EOI]
    return ids + list(rng.integers(0, 290, after))


def hf_logits(model, tokens, pixels):
    ids = torch.tensor(tokens)
    with torch.no_grad():
        return model(input_ids=ids, pixel_values=torch.tensor(pixels).permute(0, 3, 1, 2),
                     token_type_ids=(ids == IMAGE).long()).logits.float().numpy()


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(transformers model, imported jaxlm Model, folder)."""
    return imported(tmp_path_factory, "gemma3", transformers.Gemma3ForConditionalGeneration, gemma3_config(), 0.08)


def test_import_and_export_match_transformers_with_an_image(gemma3):
    model, ours, tmp = gemma3
    tokens = np.array([prompt(7, 9), prompt(3, 13)])  # two rows, one image each
    pixels = np.random.default_rng(1).normal(size=(2, SIDE, SIDE, 3)).astype(np.float32)
    got = logits_match_both_ways(gemma3, transformers.Gemma3ForConditionalGeneration, hf_logits, tokens, pixels)
    # The image matters, and its tokens see each other: the text-only pass (causal, image tokens embedded as
    # tokens) differs after the image, and another image changes the logits there.
    assert np.abs(ours.logits(tokens) - got)[:, 8:].max() > 1e-2
    assert np.abs(ours.logits(tokens, images=pixels[::-1]) - got).max() > 1e-2


def pictures(tmp):
    """Images of several sizes, aspect ratios and modes (saved as PNG/JPEG files): landscape RGB, portrait RGBA
    with transparency, a square, a tiny greyscale one, a palette one."""
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for name, (w, h), mode in (("wide.png", (640, 480), "RGB"), ("tall.png", (300, 900), "RGBA"),
                                ("square.jpg", (896, 896), "RGB"), ("tiny.png", (57, 23), "L"),
                                ("palette.png", (120, 200), "P")):
        bands = {"RGB": 3, "RGBA": 4, "L": 1, "P": 1}[mode]
        a = rng.integers(0, 256, (h, w, bands), dtype=np.uint8)
        img = Image.fromarray(a[..., 0] if bands == 1 else a, mode if mode != "P" else "L")
        if mode == "P":
            img = img.convert("P")
        img.save(tmp / name)
        out.append(tmp / name)
    return out


def test_preprocessing_equals_the_hf_processor(tmp_path):
    """Pixel values of data/images.py equal transformers' Gemma 3 image processor's (Pillow backend, the
    released models' settings) for every picture, read from its file and from a data URL."""
    import base64

    from PIL import Image

    from jaxlm.data import images

    hf = transformers.Gemma3ImageProcessorPil(size={"height": 896, "width": 896}, image_mean=[0.5] * 3,
                                               image_std=[0.5] * 3, resample=2, rescale_factor=1 / 255)
    processor = images.Processor.from_hf(hf.to_dict())
    assert processor == images.Processor()
    for path in pictures(tmp_path):
        want = hf(Image.open(path), return_tensors="np")["pixel_values"][0].transpose(1, 2, 0)
        ours = images.pixels([path], processor)[0]
        assert ours.shape == (896, 896, 3) and ours.dtype == np.float32
        assert np.abs(ours - want).max() <= 1e-6, path.name
        url = f"data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()}"
        assert np.array_equal(images.pixels([url], processor)[0], ours)
    small = images.Processor(size=SIDE)
    hf_small = transformers.Gemma3ImageProcessorPil(size={"height": SIDE, "width": SIDE}, image_mean=[0.5] * 3,
                                                     image_std=[0.5] * 3)
    want = hf_small(Image.open(tmp_path / "tall.png"), return_tensors="np")["pixel_values"][0].transpose(1, 2, 0)
    assert np.abs(images.pixels([tmp_path / "tall.png"], small)[0] - want).max() <= 1e-6


def test_pan_and_scan_equals_the_hf_processor(tmp_path):
    """With do_pan_and_scan: the crops (how many, and each one's pixel values after the whole image's) equal
    transformers' Gemma 3 image processor's for wide, tall, square and small pictures and several settings, and the
    prompt's text for an image with crops is Gemma3Processor's."""
    from PIL import Image

    from jaxlm.data import image_kinds, images

    rng = np.random.default_rng(3)
    shapes = [(1200, 300), (300, 1000), (700, 600), (640, 480), (520, 200), (2000, 270), (400, 400), (257, 700)]
    for settings in (dict(pan_and_scan_min_crop_size=256, pan_and_scan_max_num_crops=4,
                          pan_and_scan_min_ratio_to_activate=1.2),
                     dict(pan_and_scan_min_crop_size=100, pan_and_scan_max_num_crops=3,
                          pan_and_scan_min_ratio_to_activate=1.05)):
        hf = transformers.Gemma3ImageProcessorPil(size={"height": 56, "width": 56}, image_mean=[0.5] * 3,
                                                   image_std=[0.5] * 3, resample=2, rescale_factor=1 / 255,
                                                   do_pan_and_scan=True, **settings)
        processor = images.Processor.from_hf(hf.to_dict())
        assert processor.pan_and_scan and processor.size == 56
        seen = set()
        for w, h in shapes:
            img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            want = hf(img, return_tensors="np")
            got = image_kinds.KINDS["siglip"].prepare(img, processor, dataclass_vision())
            assert got.layout == int(want["num_crops"][0]), (w, h, settings)
            assert np.abs(got.pixels - want["pixel_values"].transpose(0, 2, 3, 1)).max() <= 1e-6, (w, h)
            seen.add(got.layout)
        assert {0, 2} <= seen and max(seen) >= 3  # none, two, and more crops were all compared
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=_word_tokenizer_object(),
                                               extra_special_tokens={"boi_token": "<start_of_image>",
                                                                     "eoi_token": "<end_of_image>",
                                                                     "image_token": "<image_soft_token>"})
    hf_proc = transformers.Gemma3Processor(image_processor=hf, tokenizer=tok, image_seq_length=SOFT)
    pictures_ = [Image.fromarray(rng.integers(0, 256, (200, 520, 3), dtype=np.uint8)),
                 Image.fromarray(rng.integers(0, 256, (300, 300, 3), dtype=np.uint8))]
    text = "w1 <start_of_image> w2 <start_of_image> w3"
    want = hf_proc(text=text, images=[pictures_], return_tensors="np", do_pan_and_scan=True, **settings)
    ours = _TextTok()
    prepared = [image_kinds.KINDS["siglip"].prepare(p, processor, dataclass_vision()) for p in pictures_]
    written = image_kinds.KINDS["siglip"].expand(text, ours, dataclass_vision(), prepared)
    assert tok(written)["input_ids"] == want["input_ids"][0].tolist()
    assert [p.layout for p in prepared] == [3, 0]  # the crops of the wide picture are in the compared tokens


def dataclass_vision():
    from jaxlm.config.model_schema import VisionConfig

    return VisionConfig(image_size=56, patch_size=7, d_model=32, d_ff=64, n_layers=1, n_heads=2,
                        tokens_per_image=SOFT, image_token_id=IMAGE, boi_token_id=BOI, eoi_token_id=EOI)


class _TextTok:
    """The one method prompt_text asks of a tokenizer: the text of the image tokens."""

    def decode(self, ids):
        return {BOI: "<start_of_image>", EOI: "<end_of_image>", IMAGE: "<image_soft_token>"}[ids[0]]


def _word_tokenizer_object():
    """Words w0..w299 with Gemma 3's image token strings at their ids and "\n\n" at 296 (a tokenizers.Tokenizer)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    specials = {"<start_of_image>": BOI, "<end_of_image>": EOI, "<image_soft_token>": IMAGE}
    vocab = {f"w{i}": i for i in range(V) if i not in (*specials.values(), 296)} | specials | {"\n\n": 296}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    tok.add_tokens([AddedToken("\n\n", normalized=False)])
    return tok


def test_bad_images_are_one_line_errors(tmp_path):
    from jaxlm.data import images

    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20)
    wide = pictures(tmp_path)[0]
    (tmp_path / "cut.png").write_bytes(wide.read_bytes()[:2000])
    cases = [(tmp_path / "missing.png", "does not exist"), (tmp_path / "corrupt.png", "is not a readable image"),
             (tmp_path / "cut.png", "is not a readable image"), ("data:image/png;base64,%%%", "not valid base64"),
             ("data:text/plain,hello", "must look like data:image/png;base64")]
    for source, message in cases:
        with pytest.raises(images.ImageError) as e:
            images.load(source)
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(images.ImageError, match=r"is 640x480 pixels, more than the 100,000 pixels allowed"):
        images.load(wide, max_pixels=100_000)


def test_image_tokens_attend_within_their_image():
    """The masks of `attention.mask` with vision.reach equal Gemma 3's rule, written as transformers writes it:
    global layers causal OR same image; local layers (window W) inside the window AND (causal OR same image);
    two images of one row do not see each other's later tokens."""
    import jax.numpy as jnp

    from jaxlm.model import attention, vision

    row = prompt(2, 3, images=2)[:-1] + [IMAGE, IMAGE]  # two whole images, then an image cut off by the row end
    tokens = jnp.array([row])
    T = len(row)
    positions = jnp.arange(T)[None]
    group, g, prev = [], -1, False
    for t in row:
        g += t == IMAGE and not prev
        group.append(g if t == IMAGE else -1)
        prev = t == IMAGE
    reach = vision.reach(tokens, positions, IMAGE)
    for window in (None, 4):
        got = np.asarray(attention.mask(positions, positions, window, q_reach_BT=reach))[0]
        want = np.array([[(k <= q or group[q] == group[k] >= 0) and (window is None or k > q - window)
                          for k in range(T)] for q in range(T)])
        assert np.array_equal(got, want)
        assert got[3, 6] and not got[3, 10]  # first image's first token sees its last, not the next image


def test_image_prompts_run_blockwise_as_dot_product(gemma3):
    """An image's bidirectional reach inside blockwise attention's tiles (what long image prompts take, and what
    replaces splash on a TPU): the attention and its gradients equal the materialized mask's, with two images in
    a row, tiles smaller than an image, a window and packed segments; and the whole model's logits with images
    equal the dot_product ones."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from jaxlm.model import attention, blockwise, forward, vision

    row = prompt(3, 5, images=2)[:-1] + [IMAGE, IMAGE]
    B, T, N, K, H = 2, len(row), 4, 2, 8
    tokens = jnp.array([row, row[::-1]])
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    segments = jnp.array([[0] * T, [0] * 9 + [1] * (T - 9)])
    reach = vision.reach(tokens, positions, IMAGE)
    q, k, v = (jax.random.normal(jax.random.key(i), (B, T, n, H)) for i, n in ((0, N), (1, K), (2, K)))
    for window in (None, 5):
        def exact(q, k, v):
            m = attention.mask(positions, positions, window, segments, segments, q_reach_BT=reach)
            return attention.attend(q, k, v, m).sum(-1)

        def tiled(q, k, v):
            return blockwise.attention(q, k, v, positions, segments, window, block_size=4, reach_BT=reach).sum(-1)

        w = jax.random.normal(jax.random.key(3), (B, T, N))
        np.testing.assert_allclose(tiled(q, k, v), exact(q, k, v), atol=1e-5)
        for got, want in zip(jax.grad(lambda *a: (tiled(*a) * w).sum(), (0, 1, 2))(q, k, v),
                             jax.grad(lambda *a: (exact(*a) * w).sum(), (0, 1, 2))(q, k, v)):
            np.testing.assert_allclose(got, want, atol=1e-5)
    _, ours, _ = gemma3
    cfg = ours.config.model
    tokens = jnp.array([prompt(7, 9), prompt(3, 13)])
    pixels = jnp.asarray(np.random.default_rng(1).normal(size=(2, SIDE, SIDE, 3)).astype(np.float32))
    logits = {impl: np.asarray(forward(ours.params, tokens, dataclasses.replace(cfg, attention=impl,
                                                                                attention_block=8), images=pixels))
              for impl in ("dot_product", "blockwise")}
    np.testing.assert_allclose(logits["blockwise"], logits["dot_product"], atol=1e-4)


def test_tower_attends_blockwise_as_dot_product():
    """The tower's attention over more patches than one tile (model.attention_block) runs blockwise, never holding
    the [I, N, P, P] scores (2 GiB in float32 for two 896x896 images): its output and gradients equal the plain
    product's over the full mask, with patches not a multiple of the tile; in bf16 too, where it stays bf16."""
    import jax
    import jax.numpy as jnp

    from jaxlm.model import attention, vision

    I, P, N, H = 2, 20, 4, 8
    q, k, v = (jax.random.normal(jax.random.key(i), (I, P, N, H)) for i in range(3))
    w = jax.random.normal(jax.random.key(3), (I, P, N, H))
    plain = lambda q, k, v: attention.attend(q, k, v, jnp.ones((I, P, P), bool))  # noqa: E731
    tiled = lambda q, k, v: vision.attend(q, k, v, None, 8)  # noqa: E731
    np.testing.assert_allclose(tiled(q, k, v), plain(q, k, v), atol=1e-5)
    for got, want in zip(jax.grad(lambda *a: (tiled(*a) * w).sum(), (0, 1, 2))(q, k, v),
                         jax.grad(lambda *a: (plain(*a) * w).sum(), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(got, want, atol=1e-5)
    assert not [line for line in str(jax.make_jaxpr(tiled)(q, k, v)).splitlines() if "20,20]" in line
                or "24,24]" in line]  # no scores of every patch pair, padded or not
    np.testing.assert_array_equal(vision.attend(q, k, v, None, 32), plain(q, k, v))  # one tile: the plain product
    low = tiled(*(a.astype(jnp.bfloat16) for a in (q, k, v)))
    assert low.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(low, np.float32), plain(q, k, v), atol=3e-2)


def word_tokenizer(folder):
    """A tokenizer.json of words w0..w299 with Gemma 3's image token strings at their ids and "\n\n" at 296, and
    image processor settings `{}` (the released models' at the tower's size)."""
    import json

    _word_tokenizer_object().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({}))
    (folder / "preprocessor_config.json").write_text("{}")


@pytest.mark.slow
def test_greedy_generation_with_an_image_matches_transformers(tmp_path, capsys):
    """32 greedy tokens of `Model.generate` with an image (the image encoded and its tokens bidirectional in
    the prefill, then the cached decode loop) equal transformers' `generate`. The weights are large enough (0.15)
    for greedy decoding to wander instead of repeating one token. `jaxlm generate --image FILE` writes the image
    into the prompt as Gemma 3's processor does and prints the same tokens as the API."""
    from PIL import Image

    from jaxlm import cli
    from jaxlm.data import images

    model = randomize(transformers.Gemma3ForConditionalGeneration(gemma3_config()).eval(), 0.15)
    model.save_pretrained(tmp_path / "hf")
    word_tokenizer(tmp_path / "hf")
    convert.from_hf(str(tmp_path / "hf"), tmp_path / "jx", log=lambda s: None)
    ours = jaxlm.load(tmp_path / "jx")
    ids = prompt(5, 6)
    pixels = np.random.default_rng(2).normal(size=(1, SIDE, SIDE, 3)).astype(np.float32)
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        want = model.generate(input_ids=input_ids, pixel_values=torch.tensor(pixels).permute(0, 3, 1, 2),
                              token_type_ids=(input_ids == IMAGE).long(), max_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert len(set(want)) > 8
    assert ours.generate(ids, 32, temperature=0.0, stop_ids=(), images=pixels) == want
    assert ours.generate(ids, 32, temperature=0.0, stop_ids=()) != want  # without the image: another answer

    Image.fromarray(np.random.default_rng(3).integers(0, 256, (50, 70, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    text = "w5 w6 <start_of_image> w7 w8"
    tok = ours.tokenizer()
    ids = tok.encode_rendered(images.prompt_text(text, tok, ours.config.model.vision, 1))
    assert ids == [5, 6, 296, BOI, *[IMAGE] * SOFT, EOI, 296, 7, 8]
    want = ours.generate(ids, 8, temperature=0.0, stop_ids=(), images=images.pixels([tmp_path / "a.png"],
                                                                                    images.Processor(size=SIDE)))
    capsys.readouterr()
    assert cli.main(["generate", str(tmp_path / "jx"), "--prompt", text, "--image", str(tmp_path / "a.png"),
                     "max_new_tokens=8", "temperature=0", "stop_at_eos=false"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == text + tok.decode(want)
