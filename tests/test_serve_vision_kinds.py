"""Images for Llama 4, Qwen2.5-VL and Qwen3-VL through `jaxlm generate --image` and `jaxlm serve`: tiny random models
(tests/test_vision_llama4.py's, tests/test_vision_qwen.py's and tests/test_vision_qwen3.py's) with word tokenizers. The CLI prints the tokens
Model.generate gives with the images its kind prepares (Llama 4: tiles; Qwen: a patch grid); over HTTP (openai client,
data URLs, paged and slot caches) greedy answers equal the CLI's, for images of different tile counts and grid shapes,
with Qwen's M-RoPE continuing at plain positions; a text prompt that starts as an image prompt did is not served the
image prompt's shifted keys; a bad image and too many images are 400 in one line while a streamed request completes."""

import base64
import io
import json

import httpx
import numpy as np
import pytest

from conftest import require

openai = require("openai")
require("fastapi")
transformers = require("transformers", "hf")

import jaxlm  # noqa: E402
from jaxlm import cli, serve  # noqa: E402
from jaxlm.store import convert  # noqa: E402
import test_vision_llama4 as l4  # noqa: E402
import test_vision_qwen as qw  # noqa: E402
from test_vision_qwen3 import qwen3_config  # noqa: E402

TOKENS = 8
AFTER = " w7 w8 w9 w10"
LONG = "w1 w2 w3 w4 w5 w6 "  # text before an image: more than a page of 4
SIZES = ((40, 30), (20, 20), (32, 28))  # Llama 4 (28-pixel tiles): 2 x 2 tiles and the global one, 1 tile; Qwen:
# 14x18, 14x14 and 14x16 patch grids (63, 49 and 56 soft tokens)
pytestmark = [pytest.mark.slow, pytest.mark.in_ci]  # 9 tests over three converted models: about 3.5 minutes
MARKERS = {"llama4": "<|image|>", "qwen2_5": "<|vision_start|><|image_pad|><|vision_end|>"}
MARKERS["qwen3"] = MARKERS["qwen2_5"]
# Qwen3-VL's preprocessing with Qwen2.5-VL's pixel bounds (its own, 65,536 at least, make a thousand tokens an image)
QWEN3_PREPROCESSOR = {"patch_size": qw.PATCH, "merge_size": qw.MERGE, "temporal_patch_size": qw.TEMPORAL,
                      "min_pixels": 56 * 56, "max_pixels": 100_000, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}


def template(marker: str) -> str:
    """A chat template that writes the parts (an image part as the model's marker) and nothing else."""
    return ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
            "{% for c in m['content'] %}{% if c['type'] == 'image' %}" + marker + "{% else %}{{ c['text'] }}"
            "{% endif %}{% endfor %}{% endif %}{% endfor %}")


def llama4_tokenizer(folder):
    """A tokenizer.json of words w0..w299 with Llama 4's image token strings at their ids, and image processor
    settings `{}` (the released models' at the tower's tile size)."""
    import json

    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    specials = {"<|image_start|>": l4.BOI, "<|image_end|>": l4.EOI, "<|patch|>": l4.IMAGE, "<|image|>": l4.MARK,
                "<|tile_x_separator|>": l4.SEP_X, "<|tile_y_separator|>": l4.SEP_Y}
    vocab = {f"w{i}": i for i in range(l4.V) if i not in specials.values()} | specials
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({}))
    (folder / "preprocessor_config.json").write_text("{}")


def png(seed: int, size) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(
        out, "PNG")
    return out.getvalue()


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


@pytest.fixture(scope="module", params=["llama4", "qwen2_5", "qwen3"])
def vlm(request, tmp_path_factory):
    """(kind, folder) of a converted random model of that kind with its tokenizer, chat template and two images."""
    kind = request.param
    tmp = tmp_path_factory.mktemp(kind)
    if kind == "llama4":
        model = l4.randomize(transformers.Llama4ForConditionalGeneration(l4.llama4_config()).eval(), 0.2, seed=1)
        model.save_pretrained(tmp / "hf")
        llama4_tokenizer(tmp / "hf")
    else:
        model = (transformers.Qwen2_5_VLForConditionalGeneration(qw.qwen_config()) if kind == "qwen2_5" else
                 transformers.Qwen3VLForConditionalGeneration(qwen3_config()))
        qw.randomize(model.eval(), *((0.15, 0) if kind == "qwen2_5" else (0.18, 1))).save_pretrained(tmp / "hf")
        qw.word_tokenizer(tmp / "hf")
        if kind == "qwen3":
            (tmp / "hf" / "preprocessor_config.json").write_text(json.dumps(QWEN3_PREPROCESSOR))
    convert.from_hf(str(tmp / "hf"), tmp / "jx", log=lambda s: None)
    (tmp / "chat.jinja").write_text(template(MARKERS[kind]))
    for i, size in enumerate(SIZES):
        (tmp / f"{i}.png").write_bytes(png(i, size))
    return kind, tmp


GENERATED: dict = {}  # (folder, text, images) -> the answer: the two caches' tests compare with the same commands


def generated(folder, capsys, text: str, images: list) -> str:
    """What `jaxlm generate --image` prints after the prompt, greedy (run once for each prompt and images)."""
    key = (str(folder), text, tuple(images))
    if key not in GENERATED:
        GENERATED[key] = _generated(folder, capsys, text, images)
    return GENERATED[key]


def _generated(folder, capsys, text: str, images: list) -> str:
    capsys.readouterr()
    argv = ["generate", str(folder / "jx"), "--prompt", text, f"max_new_tokens={TOKENS}", "temperature=0",
            "stop_at_eos=false"]
    for i in images:
        argv += ["--image", str(folder / f"{i}.png")]
    assert cli.main(argv) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert line.startswith(text)
    return line[len(text):]


def test_generate_cli_with_an_image_equals_the_api(vlm, capsys):
    """`jaxlm generate --image` writes each image's tokens as the kind's processor does (Llama 4: 5 tiles of 4
    patches with separators, then 1 tile; Qwen: one pad per soft token of each grid) and prints the tokens
    Model.generate gives with those images; other images give other tokens."""
    from jaxlm.data import image_kinds
    from jaxlm.store import weights

    kind, tmp = vlm
    model = jaxlm.load(tmp / "jx")
    tok, v = model.tokenizer(), model.config.model.vision
    text = "w5 w6 " + MARKERS[kind] + " w3" + MARKERS[kind] + AFTER
    handling = image_kinds.of(v)
    processor = handling.processor(weights.tokenizer_source(model.path, model.config), v)
    prepared = image_kinds.prepare_all([tmp / "0.png", tmp / "1.png"], v, processor)
    ids = tok.encode_rendered(handling.expand(text, tok, v, prepared))
    if kind == "llama4":
        assert [p.layout for p in prepared] == [(2, 2), (1, 1)] and ids.count(l4.IMAGE) == (5 + 1) * l4.SOFT
        assert ids.count(l4.SEP_Y) == 2 and ids.count(l4.SEP_X) == 2
    else:
        assert [p.pixels.shape[:3] for p in prepared] == [(1, 14, 18), (1, 14, 14)]
        assert ids.count(qw.IMAGE) == 63 + 49
    want = model.generate(ids, TOKENS, temperature=0.0, stop_ids=(), images=handling.batch(prepared))
    assert len(set(want)) > 1  # not one token repeated: the comparisons below would prove little
    assert generated(tmp, capsys, text, [0, 1]) == tok.decode(want)
    assert generated(tmp, capsys, text, [1, 0]) != tok.decode(want)


def start(tmp, **settings):
    cfg = serve.settings_config({"serve.max_slots": 3, "max_new_tokens": TOKENS, "cache_length": 192,
                                 "serve.chat_template": str(tmp / "chat.jinja"), "temperature": 0,
                                 "stop_at_eos": False, "serve.max_images_per_request": 2, **settings})
    return serve.Server(serve.build(tmp / "jx", cfg, log=lambda s: None), "127.0.0.1", 0).start()


def ask(srv, parts, stream=False):
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="none", max_retries=0, timeout=120)
    return c.chat.completions.create(model="jx", messages=[{"role": "user", "content": parts}], max_tokens=TOKENS,
                                     temperature=0, stream=stream)


def answer(srv, parts) -> str:
    return ask(srv, parts).choices[0].message.content


def parts(before: str, images: list, after: str = AFTER) -> list:
    out = [{"type": "text", "text": before}]
    for i in images:
        out.append({"type": "image_url", "image_url": {"url": data_url(png(i, SIZES[i]))}})
    return out + [{"type": "text", "text": after}]


@pytest.mark.parametrize("page_size", [4, 0])
def test_answers_over_http_equal_generate(vlm, capsys, page_size):
    """Over the paged cache (pages of 4) and the slot cache: an image of each size, and the two together, answer as
    `jaxlm generate --image` does (for Qwen the decode steps run at plain positions after the prompt's shifted
    M-RoPE ones); a text prompt that starts as an image prompt did answers as it does alone (its shifted keys are
    not shared); a bad image and too many images are 400 in one line while a streamed request completes."""
    kind, tmp = vlm
    m = MARKERS[kind]
    cases = [(LONG, [0]), (LONG, [1]), ("w3 ", [1, 0])]
    want = [generated(tmp, capsys, before + m * len(ims) + AFTER, ims) for before, ims in cases]
    text = LONG + "w9 w9 w9 w9 w9 w9" + AFTER
    assert want[0] != want[1]  # the image matters
    if (tmp, text) not in GENERATED:  # the API's answer without an image, once for both caches' tests
        model = jaxlm.load(tmp / "jx")
        tok = model.tokenizer()
        GENERATED[tmp, text] = tok.decode(model.generate(tok.encode_rendered(text), TOKENS, temperature=0.0,
                                                         stop_ids=()))
    want_text = GENERATED[tmp, text]
    srv = start(tmp, **{"serve.page_size": page_size})
    try:
        for (before, ims), w in zip(cases, want):
            assert answer(srv, parts(before, ims)) == w
        assert answer(srv, parts(LONG, [0])) == want[0]  # again (the prefix cache may serve it)
        assert answer(srv, [{"type": "text", "text": text}]) == want_text
        stream = ask(srv, parts(LONG, [0]), stream=True)
        for bad, words in ((parts("", [0])[:1] + [{"type": "image_url", "image_url": {"url": data_url(
                b"\x89PNG\r\n\x1a\n" + b"garbage" * 20)}}], "messages[0].content[1]: image the data URL is not"),
                           (parts("", [0, 1, 0]), "serve.max_images_per_request=2")):
            r = httpx.post(f"http://127.0.0.1:{srv.port}/v1/chat/completions", timeout=60,
                           json={"messages": [{"role": "user", "content": bad}], "max_tokens": 4})
            message = r.json()["error"]["message"]
            assert r.status_code == 400 and words in message and "\n" not in message, (r.status_code, message)
        assert "".join(c.choices[0].delta.content or "" for c in stream) == want[0]
        if kind != "llama4":  # Qwen: images of other grids in one soft-token bucket (64) share the image prefill
            from jaxlm.serve import programs

            program = programs.paged_prefill_images if page_size else programs.slot_prefill_images
            assert answer(srv, parts("w3 ", [1])) == generated(tmp, capsys, "w3 " + m + AFTER, [1])
            compiled = program._cache_size()
            assert answer(srv, parts("w3 ", [2])) == generated(tmp, capsys, "w3 " + m + AFTER, [2])
            assert program._cache_size() == compiled
    finally:
        srv.stop()
