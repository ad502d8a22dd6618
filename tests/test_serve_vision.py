"""`jaxlm serve` with images: a tiny random Gemma 3 VLM (tests/test_vision.py's, its local window 8) behind the
HTTP server and the openai client. Images sent as data URLs give `jaxlm generate --image`'s greedy text, over the
paged cache (pages of 4 positions; an image prompt within the window and one past it) and the slot cache; 16
concurrent image requests each get their own image's answer; a bad image, a bad data URL, too many images or
pixels, a remote URL, image token strings in the text and an image sent to a server without a vision tower are
400 with one line naming the part, while a good request runs beside them; with the prefix cache on, the same
prompt with another image gets that image's answer and the same image again reuses the cached prompt."""

import base64
import concurrent.futures
import dataclasses
import io
import time

import httpx
import pytest

from conftest import require

openai = require("openai")
require("fastapi")
transformers = require("transformers", "hf")

import jaxlm  # noqa: E402
from jaxlm import cli, serve  # noqa: E402
from jaxlm.config import ServeConfig  # noqa: E402
from jaxlm.store import convert  # noqa: E402
from test_vision import gemma3_config, randomize, word_tokenizer  # noqa: E402

# Gemma 3's chat template places an image part as <start_of_image>; this one writes the parts and nothing else
TEMPLATE = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
            "{% for c in m['content'] %}{% if c['type'] == 'image' %}<start_of_image>{% else %}{{ c['text'] }}"
            "{% endif %}{% endfor %}{% endif %}{% endfor %}")
AFTER = " w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 w17 w18"  # text after the image: prompts of more than 16 tokens
COLOURS = ((255, 0, 0), (0, 0, 255), (0, 255, 0))
TOKENS = 8
pytestmark = [pytest.mark.slow, pytest.mark.in_ci]


def png(colour, size=(40, 30)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, "PNG")
    return out.getvalue()


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def content(url: str, before: str = "w5 w6 ", after: str = AFTER) -> list:
    return [{"type": "text", "text": before}, {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": after}]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """A converted random Gemma3ForConditionalGeneration (local window 8), its chat template and images."""
    tmp = tmp_path_factory.mktemp("vlm")
    config = gemma3_config()
    config.text_config.sliding_window = 8
    model = randomize(transformers.Gemma3ForConditionalGeneration(config).eval(), 0.15)
    model.save_pretrained(tmp / "hf")
    word_tokenizer(tmp / "hf")
    convert.from_hf(str(tmp / "hf"), tmp / "jx", log=lambda s: None)
    (tmp / "chat.jinja").write_text(TEMPLATE)
    for i, colour in enumerate(COLOURS):
        (tmp / f"{i}.png").write_bytes(png(colour))
    return tmp


def start(vlm, **settings):
    cfg = serve.settings_config({"serve.max_slots": 4, "max_new_tokens": TOKENS, "cache_length": 64,
                                 "serve.chat_template": str(vlm / "chat.jinja"), "temperature": 0,
                                 "stop_at_eos": False, **settings})
    return serve.Server(serve.build(vlm / "jx", cfg, log=lambda s: None), "127.0.0.1", 0).start()


@pytest.fixture(scope="module")
def paged(vlm):
    srv = start(vlm, **{"serve.page_size": 4, "serve.max_image_pixels": 5000})
    yield srv
    srv.stop()


def client(srv):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="none", max_retries=0, timeout=120)


def ask(srv, parts) -> str:
    answer = client(srv).chat.completions.create(model="jx", messages=[{"role": "user", "content": parts}],
                                                 max_tokens=TOKENS, temperature=0)
    return answer.choices[0].message.content


GENERATED: dict = {}  # (text, image) -> the answer: the tests below ask some prompts of each other's


def generated(vlm, capsys, text: str, image: int) -> str:
    """What `jaxlm generate --image` prints after the prompt, greedy (run once for each prompt and image)."""
    if (text, image) in GENERATED:
        return GENERATED[text, image]
    capsys.readouterr()
    assert cli.main(["generate", str(vlm / "jx"), "--prompt", text, "--image", str(vlm / f"{image}.png"),
                     f"max_new_tokens={TOKENS}", "temperature=0", "stop_at_eos=false"]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert line.startswith(text)
    GENERATED[text, image] = line[len(text):]
    return GENERATED[text, image]


def metric(srv, name) -> float:
    text = httpx.get(f"http://127.0.0.1:{srv.port}/metrics").text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_answers_equal_generate_with_the_image(vlm, paged, capsys):
    """Over the paged cache: a prompt whose image tokens end within the local window (its image prefill writes
    every position) and one whose text before the image pushes them past it (the window's ring keeps the last 8),
    each as `jaxlm generate --image` answers; another image gives another answer."""
    for before in ("", "w1 w2 w3 w4 w5 "):
        want = generated(vlm, capsys, before + "<start_of_image>" + AFTER, 0)
        assert ask(paged, content(data_url(png(COLOURS[0])), before)) == want
        assert ask(paged, content(data_url(png(COLOURS[1])), before)) != want


def test_sixteen_concurrent_image_requests(vlm, paged):
    """16 requests of three images at once: all 200, each its own image's answer (as asked alone)."""
    urls = [data_url((vlm / f"{i}.png").read_bytes()) for i in range(3)]
    alone = [ask(paged, content(u)) for u in urls]
    assert len(set(alone)) == 3

    def one(k):
        t = time.perf_counter()
        return k, ask(paged, content(urls[k % 3])), time.perf_counter() - t

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        done = list(pool.map(one, range(16)))
    assert [text for _, text, _ in done] == [alone[k % 3] for k in range(16)]
    latency = sorted(s for _, _, s in done)
    print(f"16 concurrent image requests: latency median {latency[8]:.2f} s, max {latency[-1]:.2f} s")


def bad_requests(vlm) -> list:
    """(messages content, the words its 400 names) of faulty image requests."""
    good = data_url(png(COLOURS[0]))
    return [
        (content(data_url(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20)), "messages[0].content[1]: image the data URL is "
                                                                   "not a readable image"),
        (content(data_url(png(COLOURS[0]))[:-40]), "messages[0].content[1]: image the data URL is not a readable"),
        (content("data:image/png;base64,%%%"), "messages[0].content[1]: the image data URL is not valid base64"),
        (content("data:text/plain,hello"), "messages[0].content[1]: a data URL must look like"),
        (content(good) + [{"type": "image_url", "image_url": {"url": good}}] * 8, "serve.max_images_per_request=8"),
        (content(data_url(png(COLOURS[0], (100, 100)))), "messages[0].content[1]: image the data URL is 100x100 "
                                                         "pixels, more than the 5,000 pixels allowed"),
        (content("https://example.com/cat.png"), "messages[0].content[1]: this server does not fetch image URLs"),
        (content("/etc/passwd"), "messages[0].content[1]: an image URL must be a data:image/...;base64 URL"),
        (content(good, "w1 <image_soft_token> "), "image token strings of their own"),
        (content(good, "w1 <start_of_image> "), "wrote 2 image marker(s)"),
        ([{"type": "image_url"}], "messages[0].content[0]: a part must be"),
    ]


def post(srv, parts) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{srv.port}/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": parts}], "max_tokens": 4})


def test_bad_images_are_400_while_a_good_request_runs(vlm, paged):
    """Each faulty request is a 400 with one line naming what is wrong (and the part), while a streamed good
    request that started before them completes with its image's answer; the engine keeps serving."""
    want = ask(paged, content(data_url(png(COLOURS[2]))))
    stream = client(paged).chat.completions.create(
        model="jx", messages=[{"role": "user", "content": content(data_url(png(COLOURS[2])))}], max_tokens=TOKENS,
        temperature=0, stream=True)
    for parts, words in bad_requests(vlm):
        r = post(paged, parts)
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and words in message and "\n" not in message, (r.status_code, message)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want
    assert ask(paged, content(data_url(png(COLOURS[2])))) == want


def test_an_image_to_a_server_without_a_vision_tower(vlm, paged):
    """A server that takes no images (here the same engine served as a text model would be) answers 400 naming
    the part; its text requests still run."""
    no_tower = jaxlm.load(vlm / "jx")
    no_tower.config = no_tower.config.replace(model=dataclasses.replace(no_tower.config.model, vision=None))
    refused = serve.image_serving(no_tower, None, ServeConfig(), None)
    assert refused == (None, "this model has no vision tower")
    served = dataclasses.replace(paged.served, images=None, images_refused=refused[1])
    srv = serve.Server(served, "127.0.0.1", 0).start()
    try:
        r = post(srv, content(data_url(png(COLOURS[0]))))
        assert r.status_code == 400
        assert r.json()["error"]["message"] == ("messages[0].content[1]: this model has no vision tower; send text "
                                                "parts only")
        assert post(srv, [{"type": "text", "text": "w1 w2"}]).status_code == 200
    finally:
        srv.stop(engine=False)


def test_prefix_cache_keyed_by_the_image(vlm, paged, capsys):
    """With the prefix cache on (paged: registered pages; slot cache: stored prompts, reused whole when the window's
    ring is shorter than the prompt, as a conversation's next turn does), a prompt reuses a cached one only with the
    same image: each answer is its own image's (as generated alone), the same image and text again reuses it, and
    the same text with another image does not."""
    more = AFTER + " w20 w21 w22"
    asks = ((0, AFTER), (1, AFTER), (1, more), (2, more))  # the third extends the second, the fourth another image
    want = [generated(vlm, capsys, "<start_of_image>" + text, i) for i, text in asks]
    assert want[2] != want[3]
    slot = start(vlm, **{"serve.page_size": 0, "serve.max_slots": 2})
    try:
        for srv in (slot, paged):
            hits = []
            for (i, text), answer in zip(asks, want):
                before = metric(srv, "jaxlm_prefix_cache_hits_total")
                assert ask(srv, content(data_url(png(COLOURS[i])), "", text)) == answer
                hits.append(metric(srv, "jaxlm_prefix_cache_hits_total") - before)
            assert hits[2:] == [1, 0], hits  # (the paged server may hold the first two from earlier tests)
            assert srv is paged or hits == [0, 0, 1, 0]
    finally:
        slot.stop()
