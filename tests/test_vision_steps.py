"""The training side of vision-language models beyond one conversation per row: `jaxlm compile` of a step whose
batch carries images (its memory report shows the tower and the images; a saved step trains like the jitted one),
conversations with images packed into rows (the loss equals the unpacked conversations' on the same answer tokens;
packed training learns the shapes task), and DPO on preference pairs whose prompts hold images (the margin rises
with the images, not without them)."""

from __future__ import annotations

import importlib.util
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlm
from conftest import tiny_config
from jaxlm import config as config_lib, params as P
from jaxlm.data import loader as loader_lib, tokenizer as tokenizer_lib, vision_data
from jaxlm.model import vision as vision_lib
from jaxlm.model.loss import loss_fn
from jaxlm.params import count
from jaxlm.train import aot, batches as batch_lib, loop, run as run_lib

pytest.importorskip("PIL")
pytest.importorskip("tokenizers")
from test_vision_train import (COLOURS, QUESTION, SHAPES, SIDE, SPECIALS, WORDS, data_url, draw,  # noqa: E402
                               greedy_accuracy, make_tokenizer, shapes_data, vision, write_jsonl)

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None


def vlm_config(data_dir, run_dir, tok_dir, **kw):
    return tiny_config(data_dir, run_dir, **{
        "model.vision": vision().__dict__, "model.vocab_size": len(SPECIALS) + len(WORDS), "model.d_model": 64,
        "model.block_size": 40, "data.tokenizer": str(tok_dir), "checkpoint.enabled": False, **kw})


def test_compile_a_step_with_images_and_train_with_it(tmp_path):
    tok_dir = make_tokenizer(tmp_path / "tok")
    files = shapes_data(tmp_path, 36, 9)
    vision_data.prepare_vision_chat([files["train"][0]], tmp_path / "data", tok_dir, vision(), val=[files["val"][0]])
    cfg = vlm_config(tmp_path / "data", tmp_path / "jit", tok_dir, **{
        "training.steps": 4, "training.batch_size": 8, "training.eval_interval": 0, "optimizer.warmup_steps": 1,
        "compile.topology": "cpu-8"})
    r = aot.compile_for(cfg, aot.target(cfg.compile))  # from abstract shapes: no data read
    assert r.fits and r.run.image_slots == 1
    shares = aot.argument_shares(r.run)
    # 8 rows of one image slot each, split over the 8 devices that split the batch: one 32x32x3 float32 image each.
    assert shares["images"] == SIDE * SIDE * 3 * 4
    assert shares["vision tower (frozen)"] == count(vision_lib.specs(r.run.cfg.model)) * 4  # replicated (data axis)
    lines = aot.report(r)
    assert "x 40 tokens, 1 image of 32x32 per row (16 tokens each; tower of 1 layers, width 32)" in lines[1]
    assert "vision tower (frozen)" in lines[3] and "images 0.01 MiB" in lines[3]
    assert r.memory.arguments == r.argument_bytes  # the images are among the compiled step's arguments

    # Two image slots per row: the images' share doubles, and so does what the step takes.
    two = aot.compile_for(config_lib.apply_overrides(cfg, {"data.images_per_row": 2}), aot.target(cfg.compile))
    assert aot.argument_shares(two.run)["images"] == 2 * shares["images"]
    assert two.memory.arguments - r.memory.arguments == shares["images"]

    # An image's tokens attend to one another: the sequence split over devices is refused in one line.
    with pytest.raises(config_lib.ConfigError, match=r"image data needs the `length` axis on one device"):
        aot.compile_for(config_lib.apply_overrides(cfg, {"mesh.ici_sequence": 2}), aot.target(cfg.compile))

    # The saved step trains on the prepared images exactly as the jitted step does.
    path = aot.save(tmp_path / "step.jaxlm", r)
    loop.train(cfg, log=lambda s: None)
    loaded = cfg.replace(run_dir=str(tmp_path / "aot"), compile=config_lib.CompileConfig(load=str(path)))
    lines = []
    loop.train(loaded, log=lines.append)
    assert any("train step loaded from" in line for line in lines)
    jitted, saved = loop.losses_by_step(tmp_path / "jit"), loop.losses_by_step(tmp_path / "aot")
    assert sorted(jitted) == [1, 2, 3, 4] and saved == jitted


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed (pip install 'jaxlm[tpu]')")
def test_compile_a_step_with_images_for_a_tpu_slice(tmp_path):
    """A v5e-8 slice with FSDP: the tower's attention runs on each device's own images (pinned like the batch),
    so 8 images of 112 pixels per row cost each device what one row's images cost, not the whole batch's."""
    big = {**vision().__dict__, "image_size": 112, "patch_size": 4}  # 784 patches an image
    cfg = vlm_config(tmp_path / "none", None, tmp_path / "tok", **{
        "model.vision": big, "training.per_device_batch_size": 1, "compile.topology": "v5e-8", "mesh.ici_data": 1,
        "mesh.ici_fsdp": -1, "model.remat": "full"})

    def temporaries(images: int) -> int:
        r = aot.compile_for(config_lib.apply_overrides(cfg, {"data.images_per_row": images}), aot.target(cfg.compile))
        assert r.fits and r.run.image_slots == images
        return r.memory.temporaries

    one, eight = temporaries(1), temporaries(8)
    # The attention of one image is 2 heads x 784 x 784 float32 (4.7 MiB); eight a device, not 64.
    assert eight - one < 8 * 2 * 784 * 784 * 4 * 2


def packed_batch_and_conversations(tmp_path):
    """A packed micro-batch of drawn-shape conversations (3 a row, 3 image slots a row), with the settings."""
    tok_dir = make_tokenizer(tmp_path / "tok")
    files = shapes_data(tmp_path, 24, 9)
    vision_data.prepare_vision_chat([files["train"][0]], tmp_path / "data", tok_dir, vision(), val=[files["val"][0]])
    cfg = vlm_config(tmp_path / "data", tmp_path / "run", tok_dir, **{
        "data.packing": True, "data.images_per_row": 3, "model.block_size": 100, "training.batch_size": 2})
    run = run_lib.setup(cfg, jax.devices()[:1])
    plan = batch_lib.make_loader(run).next()
    return run, plan, batch_lib.device_batch(run, "train", plan)


def test_a_packed_batch_with_images_scores_as_its_conversations_alone(tmp_path):
    run, plan, batch = packed_batch_and_conversations(tmp_path)
    cfg, split, store = run.cfg.model, run.dataset.splits["train"], run.images["train"]
    pieces = plan.packed.pieces[:2]  # the first micro-batch's two rows
    assert [len(row) for row in pieces] == [3, 3] and batch["images"].shape == (1, 6, SIDE, SIDE, 3)
    assert int(jnp.max(batch["segment_ids"][0])) == 3
    params = P.init(run.specs, jax.random.key(0), run.mesh)

    def summed(b, images):  # the cross-entropy summed over the answer tokens (normalizer 1)
        return float(loss_fn(params, b["inputs"], b["targets"], cfg, None, b.get("positions"), b.get("segment_ids"),
                             b["weights"], 1.0, images))

    packed = summed({k: v[0] for k, v in batch.items()}, batch["images"][0])
    alone, answers = 0.0, 0
    for start, length in (piece for row in pieces for piece in row):
        d = int(np.searchsorted(split.doc_starts_D1, start, side="right")) - 1
        ids, mask = split.take(np.arange(start, start + length)), split.take(np.arange(start, start + length), mask=True)
        one = {"inputs": ids[None, :-1], "targets": ids[None, 1:], "weights": mask[None, 1:].astype(np.float32)}
        alone += summed(one, store.read(np.asarray(list(store.of(d)))))
        answers += int(mask[1:].sum())
    assert int(jnp.sum(batch["weights"][0])) == answers > 0
    print(f"packed {packed:.6f}, conversations alone {alone:.6f}")
    assert packed == pytest.approx(alone, rel=2e-5)
    # The images in another order score otherwise: the slots follow the image tokens.
    swapped = summed({k: v[0] for k, v in batch.items()}, batch["images"][0][::-1])
    assert abs(swapped - alone) > 100 * abs(packed - alone) + 1e-4


def test_a_tiny_vlm_learns_the_shapes_from_packed_conversations(tmp_path):
    tok_dir = make_tokenizer(tmp_path / "tok")
    files = shapes_data(tmp_path, 1440, 90)
    v = vision()
    vision_data.prepare_vision_chat([files["train"][0]], tmp_path / "data", tok_dir, v, val=[files["val"][0]])
    cfg = vlm_config(tmp_path / "data", tmp_path / "run", tok_dir, **{
        "data.packing": True, "data.images_per_row": 3, "model.block_size": 100, "training.steps": 400,
        "training.batch_size": 8, "training.eval_interval": 400, "optimizer.lr": 3e-3, "optimizer.warmup_steps": 10,
        "checkpoint.enabled": True, "checkpoint.interval": 400})
    start = time.perf_counter()
    loop.train(cfg, devices=jax.devices()[:1], log=lambda s: None)
    seconds = time.perf_counter() - start
    model, tok = jaxlm.load(tmp_path / "run"), tokenizer_lib.load(tok_dir)
    _, answers, pictures = files["val"]
    seen = greedy_accuracy(model, tok, v, pictures, answers)
    blind = greedy_accuracy(model, tok, v, pictures, answers, blank=True)
    print(f"packed: held-out greedy accuracy {seen:.3f} with the image, {blind:.3f} with a blank one; {seconds:.1f} s")
    assert seen >= 0.9 and blind <= 2 / 9


def colour_pairs(path, n: int, seed: int, blank: bool = False):
    """Preference records over drawn shapes: the prompt's image and question, chosen = its colour and shape,
    rejected = the same shape in another colour (every colour is chosen and rejected equally often, so only the
    image tells them apart)."""
    rng = np.random.default_rng(seed)
    classes = [(c, s) for c in COLOURS for s in SHAPES]
    recs = []
    for i in range(n):
        c, s = classes[i % len(classes)]
        wrong = [x for x in COLOURS if x != c][int(rng.integers(2))]
        part = {"type": "image_url", "image_url": {"url": data_url(draw(c, s, rng, blank=blank))}}
        recs.append({"prompt": [{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}],
                     "chosen": f"a {c} {s}", "rejected": f"a {wrong} {s}"})
    return write_jsonl(path, recs)


def test_dpo_on_image_prompts_learns_the_colour_from_the_image(tmp_path):
    tok_dir = make_tokenizer(tmp_path / "tok")
    results = {}
    for name, blank in (("seen", False), ("blank", True)):
        train_file = colour_pairs(tmp_path / f"{name}-train.jsonl", 720, 0, blank)
        val_file = colour_pairs(tmp_path / f"{name}-val.jsonl", 45, 1, blank)
        meta = vision_data.prepare_vision_chat([train_file], tmp_path / name, tok_dir, vision(), val=[val_file],
                                               pairs=True)
        assert meta["kind"] == "preference" and meta["images"]["counts"] == {"train": 1440, "val": 90}
        cfg = vlm_config(tmp_path / name, tmp_path / f"{name}-run", tok_dir, **{
            "training.objective": "dpo", "dpo.beta": 0.5, "model.block_size": 72, "training.steps": 150,
            "training.batch_size": 16, "training.eval_interval": 150, "training.eval_batches": 2,
            "training.log_interval": 1, "optimizer.lr": 3e-3, "optimizer.warmup_steps": 10})
        start = time.perf_counter()
        loop.train(cfg, devices=jax.devices()[:1], log=lambda s: None)
        records = loop.read_metrics(tmp_path / f"{name}-run")
        results[name] = {"seconds": time.perf_counter() - start, "first": records[0],
                         "margin": np.mean([r["rewards/margins"] for r in records if "rewards/margins" in r][-10:]),
                         "val": [r for r in records if "val_rewards/accuracies" in r][-1]}
        if name == "seen":  # a pair's two documents carry the prompt's image, the same pixels
            with pytest.raises(config_lib.ConfigError, match=r"data.images_per_row=1: a preference pair .* has 2 "):
                run_lib.setup(config_lib.apply_overrides(cfg, {"data.images_per_row": 1}), jax.devices()[:1])
            store = vision_data.open_images(loader_lib.Dataset(tmp_path / name))["train"]
            assert list(store.of(0)) == [0] and list(store.of(1)) == [1]
            assert np.array_equal(store.pixels[0], store.pixels[1])
    for name, r in results.items():
        print(f"{name}: first loss {r['first']['loss']:.6f}, margin over the last 10 steps {r['margin']:.3f}, "
              f"val accuracy {r['val']['val_rewards/accuracies']:.3f}, val margin {r['val']['val_rewards/margins']:.3f}; "
              f"{r['seconds']:.1f} s")
    # The reference log-probabilities were computed with the images: at the start policy = reference, h = 0.
    assert abs(results["seen"]["first"]["loss"] - np.log(2)) < 1e-5
    assert results["seen"]["val"]["val_rewards/accuracies"] >= 0.9 and results["seen"]["margin"] > 1.0
    assert results["blank"]["val"]["val_rewards/accuracies"] <= 0.75
    assert results["seen"]["val"]["val_rewards/margins"] > results["blank"]["val"]["val_rewards/margins"] + 1.0
