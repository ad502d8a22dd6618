"""Training a vision-language model with images: chat data whose contents hold images prepared into a folder
(tokens in Gemma 3's image layout, the loss on the answers, the images beside the shards; bad images skipped and
counted or the run stopped, naming file and line), and a tiny random VLM fine-tuned on drawn shapes that answers
"a red circle" from the image (>= 90% held-out greedy accuracy) and is at chance given a blank image, with its
vision tower frozen (bit-identical, no optimizer state)."""

from __future__ import annotations

import base64
import dataclasses
import io
import json

import jax
import numpy as np
import pytest

import jaxlm
from conftest import tiny_config
from jaxlm.config.model_schema import VisionConfig
from jaxlm import params as P
from jaxlm.data import images, loader as loader_lib, tokenizer as tokenizer_lib, vision_data
from jaxlm.data.errors import DataError
from jaxlm.train import loop, run as run_lib

PIL = pytest.importorskip("PIL")
pytest.importorskip("tokenizers")

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220)}
SHAPES = ("circle", "square", "triangle")
SPECIALS = ["<pad>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<image_soft_token>",
            "<end_of_image>"]
WORDS = ["<unk>", "user", "model", "What", "is", "in", "the", "image", "?", "a", *COLOURS, *SHAPES]
SIDE, SOFT = 32, 16
TEMPLATE = ("{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
            "{{ m.content }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
QUESTION = "What is in the image?"


def vision() -> VisionConfig:
    ids = {t: i for i, t in enumerate(SPECIALS)}
    return VisionConfig(image_size=SIDE, patch_size=4, d_model=32, n_layers=1, n_heads=2, d_ff=64,
                        tokens_per_image=SOFT, image_token_id=ids["<image_soft_token>"],
                        boi_token_id=ids["<start_of_image>"], eoi_token_id=ids["<end_of_image>"])


def make_tokenizer(folder):
    """A word-level tokenizer.json with Gemma 3's turn and image tokens as special tokens, and a chat template."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "chat_template": TEMPLATE}))
    (folder / "preprocessor_config.json").write_text("{}")  # the released models' image settings at SIDE
    return folder


def draw(colour: str, shape: str, rng, blank: bool = False):
    """A 32x32 picture: the shape in its colour at a jittered place and size on white."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (SIDE, SIDE), (255, 255, 255))
    if blank:
        return img
    d = ImageDraw.Draw(img)
    cx, cy = rng.integers(14, 19, 2)
    r = int(rng.integers(9, 12))
    box = [cx - r, cy - r, cx + r, cy + r]
    fill = tuple(int(np.clip(c + rng.integers(-20, 21), 0, 255)) for c in COLOURS[colour])
    if shape == "circle":
        d.ellipse(box, fill=fill)
    elif shape == "square":
        d.rectangle(box, fill=fill)
    else:
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    return img


def data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def record(image_part: dict, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": [image_part, {"type": "text", "text": QUESTION}]},
                         {"role": "assistant", "content": answer}]}


def write_jsonl(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_prepare_writes_the_image_layout_the_mask_and_the_pixels(tmp_path):
    tok_dir = make_tokenizer(tmp_path / "tok")
    rng = np.random.default_rng(0)
    red, blue = draw("red", "circle", rng), draw("blue", "square", rng)
    blue.save(tmp_path / "blue.png")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot a png")
    recs = [record({"type": "image_url", "image_url": {"url": data_url(red)}}, "a red circle"),
            record({"type": "image", "path": "blue.png"}, "a blue square"),  # relative to the file's folder
            record({"type": "image", "image": "missing.png"}, "a red square"),
            record({"type": "image_url", "image_url": {"url": "broken.png"}}, "a red square"),
            {"messages": [{"role": "user", "content": "What is in the image?"},
                          {"role": "assistant", "content": "a green triangle"}]}]
    src = write_jsonl(tmp_path / "chat.jsonl", recs)
    meta = vision_data.prepare_vision_chat([src], tmp_path / "out", tok_dir, vision(), val_fraction=0.5)
    assert meta["skipped"]["bad_images_skipped"] == 2
    assert meta["skipped"]["first_bad_image"].startswith(f"{src}:3: image {tmp_path / 'missing.png'} does not exist")
    assert meta["images"]["max_per_document"] == 1 and meta["images"]["counts"] == {"train": 1, "val": 1}

    ds = loader_lib.Dataset(tmp_path / "out")
    split = ds.splits["train"]
    tok = tokenizer_lib.load(tok_dir)
    ids = split.document(0).tolist()
    v = vision()
    # "\n\n" is whitespace to this tokenizer, so the image is boi, SOFT image tokens, eoi.
    want = tok.encode_rendered("<start_of_turn>user\n<start_of_image>" + "<image_soft_token>" * SOFT
                               + "<end_of_image>What is in the image?<end_of_turn>\n<start_of_turn>model\n"
                               "a red circle<end_of_turn>\n")
    assert ids == want and ids.count(v.image_token_id) == SOFT
    mask = split.take(np.arange(len(ids)), mask=True)
    trained = [t for t, m in zip(ids, mask) if m]
    assert trained == tok.encode_rendered("a red circle<end_of_turn>")
    stored = vision_data.open_images(ds)
    assert np.array_equal(stored["train"].pixels[0], images.resized(red, images.Processor(size=SIDE)))
    assert np.array_equal(stored["val"].pixels[0], images.resized(blue, images.Processor(size=SIDE)))
    assert ds.splits["train"].n_documents == 2 and list(stored["train"].of(1)) == []  # the text-only one

    with pytest.raises(images.ImageError, match=rf"^{src}:3: image .*missing.png does not exist \(bad_images=stop"):
        vision_data.prepare_vision_chat([src], tmp_path / "out2", tok_dir, vision(), bad_images="stop")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": [{"type": "video"}]}]}])
    with pytest.raises(DataError, match=rf"^{bad}:1: a content part must be"):
        vision_data.prepare_vision_chat([bad], tmp_path / "out3", tok_dir, vision())


def shapes_data(tmp_path, n_train: int, n_val: int, seed: int = 0):
    """Drawn shapes as chat records, every (colour, shape) equally often, in a train and a val file."""
    rng = np.random.default_rng(seed)
    classes = [(c, s) for c in COLOURS for s in SHAPES]
    files = {}
    for name, n in (("train", n_train), ("val", n_val)):
        recs, answers, pictures = [], [], []
        for i in range(n):
            c, s = classes[i % len(classes)]
            img = draw(c, s, rng)
            recs.append(record({"type": "image_url", "image_url": {"url": data_url(img)}}, f"a {c} {s}"))
            answers.append(f"a {c} {s}")
            pictures.append(img)
        files[name] = (write_jsonl(tmp_path / f"{name}.jsonl", recs), answers, pictures)
    return files


def greedy_accuracy(model, tok, v, pictures, answers, blank=False) -> float:
    marker = tok.decode([v.boi_token_id])
    text = tok.apply_chat_template([{"role": "user", "content": marker + QUESTION}], add_generation_prompt=True)
    prompt = tok.encode_rendered(images.prompt_text(text, tok, v, 1))
    end = tok.encode_rendered("<end_of_turn>")
    processor = images.Processor(size=v.image_size)
    rng = np.random.default_rng(0)
    right = 0
    for img, answer in zip(pictures, answers):
        pixels = images.preprocess(draw("red", "circle", rng, blank=True) if blank else img, processor)[None]
        out = model.generate(prompt, new_tokens=4, temperature=0.0, stop_ids=tuple(end), images=pixels)
        right += tok.decode([t for t in out if t not in end]).split() == answer.split()
    return right / len(answers)


@pytest.mark.slow
@pytest.mark.in_ci
def test_jaxlm_prepare_chat_images_writes_what_the_function_writes(tmp_path, capsys):
    """`jaxlm prepare chat FILE --images --tokenizer MODEL_FOLDER`: model.vision from the folder's config.json, the
    same folder as prepare_vision_chat's; a bad image with --bad-images stop is one line and exit code 1."""
    import filecmp

    from jaxlm import cli

    tok_dir = make_tokenizer(tmp_path / "model")
    (tok_dir / "config.json").write_text(json.dumps({"model": {"vision": vision().__dict__}}))
    rng = np.random.default_rng(1)
    recs = [record({"type": "image_url", "image_url": {"url": data_url(draw(c, s, rng))}}, f"a {c} {s}")
            for c in COLOURS for s in SHAPES] + [record({"type": "image", "path": "missing.png"}, "a red circle")]
    src = write_jsonl(tmp_path / "chat.jsonl", recs)
    want = vision_data.prepare_vision_chat([src], tmp_path / "want", tok_dir, vision(), max_tokens=64,
                                           val_fraction=0.2)
    assert cli.main(["prepare", "chat", str(src), "--images", "--tokenizer", str(tok_dir), "--max-tokens", "64",
                     "--val-fraction", "0.2", "--out", str(tmp_path / "got"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert want["skipped"]["bad_images_skipped"] == 1
    assert "1 conversations with a missing, corrupt or oversized image left out" in out and "missing.png" in out
    files = sorted(p.name for p in (tmp_path / "want").iterdir() if p.is_file() and p.name != "meta.json")
    assert files and filecmp.cmpfiles(tmp_path / "want", tmp_path / "got", files, shallow=False)[0] == files
    got = json.loads((tmp_path / "got" / "meta.json").read_text())
    assert got["splits"] == want["splits"] and got["images"] == want["images"]
    assert cli.main(["prepare", "chat", str(src), "--images", "--tokenizer", str(tok_dir), "--max-tokens", "64",
                     "--bad-images", "stop", "--out", str(tmp_path / "stopped"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{src}:10: image" in err[0] and "missing.png does not exist" in err[0]


def test_a_tiny_vlm_learns_to_name_the_drawn_shape(tmp_path):
    import time

    tok_dir = make_tokenizer(tmp_path / "tok")
    files = shapes_data(tmp_path, 1440, 90)
    v = vision()
    vision_data.prepare_vision_chat([files["train"][0]], tmp_path / "data", tok_dir, v, val=[files["val"][0]])
    cfg = tiny_config(tmp_path / "data", tmp_path / "run", **{
        "model.vision": v.__dict__, "model.vocab_size": len(SPECIALS) + len(WORDS), "model.d_model": 64,
        "model.block_size": 40, "training.steps": 400, "training.batch_size": 16, "training.eval_interval": 400,
        "optimizer.lr": 3e-3, "optimizer.warmup_steps": 10, "checkpoint.interval": 400, "data.tokenizer": str(tok_dir)})
    start = time.perf_counter()
    loop.train(cfg, devices=jax.devices()[:1], log=lambda s: None)
    seconds = time.perf_counter() - start

    model = jaxlm.load(tmp_path / "run")
    tok = tokenizer_lib.load(tok_dir)
    _, answers, pictures = files["val"]
    seen = greedy_accuracy(model, tok, v, pictures, answers)
    blind = greedy_accuracy(model, tok, v, pictures, answers, blank=True)
    print(f"held-out greedy accuracy {seen:.3f} with the image, {blind:.3f} with a blank one; {seconds:.1f} s")
    assert seen >= 0.9 and blind <= 2 / 9

    # The tower was frozen: bit-identical to its initialization, and no optimizer state of its own.
    run = run_lib.setup(cfg, jax.devices()[:1], data=False)
    fresh = jax.device_get(P.init(run.specs, jax.random.key(cfg.seed), run.mesh)["vision"])
    for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(jax.device_get(model.params["vision"]))):
        assert np.array_equal(a, b)
    tower = sum(leaf.size for leaf in jax.tree.leaves(run.abstract_state["params"]["vision"]))

    def moments(settings) -> int:
        return sum(leaf.size for leaf in jax.tree.leaves(settings.abstract_state["opt_state"]))

    # Adam's two moments of the language model only; training the tower adds two of its own.
    trainable = run_lib.setup(cfg.replace(training=dataclasses.replace(cfg.training, freeze_vision=False)),
                              jax.devices()[:1], data=False)
    assert tower > 0 and moments(trainable) - moments(run) == 2 * tower

    # LoRA of the language model on the same data: the tower rides in the frozen base, unchanged.
    lora_cfg = cfg.replace(run_dir=str(tmp_path / "lora"), lora=dataclasses.replace(cfg.lora, rank=4),
                           checkpoint=dataclasses.replace(cfg.checkpoint, init_from=str(tmp_path / "run")),
                           training=dataclasses.replace(cfg.training, steps=10, eval_interval=10))
    out = loop.train(lora_cfg, devices=jax.devices()[:1], log=lambda s: None)
    assert out["val_loss"] < 0.1
    adapted = jaxlm.load(tmp_path / "lora").params["vision"]
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(jax.device_get(adapted))))
