"""Every vision tower sharded like the text layers (docs/vision.md, "Sharding"): a train step with images and the
tower trained, on 8 devices as FSDP 4 x tensor 2, gives the losses of one device, and the tower's weights are
split over both axes, not replicated."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from conftest import tiny_config, train_losses
from jaxlm import config as config_lib
from jaxlm.data import vision_data
from jaxlm.train import batches

import test_vision_train as gemma
import test_vision_train_kinds as kinds

pytest.importorskip("PIL")
pytest.importorskip("tokenizers")


def prepared_config(tmp_path, kind: str):
    """Twelve conversations with a drawn shape each, prepared for the tower `kind`, and a config that trains the
    tower too; Gemma 3's SigLIP as test_vision_train writes it, the others as test_vision_train_kinds."""
    settings = {"training.batch_size": 4, "training.freeze_vision": False, "data.images_per_row": 1,
                "optimizer.lr": 3e-3, "optimizer.warmup_steps": 1,
                "model.vocab_size": 32}  # the vocabulary padded to split over the tensor axis
    if kind != "siglip":
        kinds.prepared(tmp_path, kind, n=12, grids=kind == "qwen3")  # Qwen3-VL's at their own grids, padded
        return kinds.config(tmp_path, kind, **settings)
    tok = gemma.make_tokenizer(tmp_path / "model")
    recs = [gemma.record({"type": "image_url", "image_url": {"url": gemma.data_url(img)}}, answer)
            for img, answer in kinds.pictures(12, 0)]
    src = gemma.write_jsonl(tmp_path / "chat.jsonl", recs)
    v = gemma.vision()
    vision_data.prepare_vision_chat([src], tmp_path / "data", tok, v, val_fraction=0.25)
    return tiny_config(tmp_path / "data", tmp_path / "run", **{
        "model.vision": v.__dict__, "model.d_model": 64,
        "model.block_size": 40, "data.tokenizer": str(tok), **settings})


def batches_in_order(rng, run):
    """The run's loader's next batch (each run has its own loader, so every layout sees the same batches)."""
    if not hasattr(run, "_test_loader"):
        run._test_loader = batches.make_loader(run, grad_accum=1)
    return batches.device_batch(run, "train", run._test_loader.next())


def split_axes(leaf) -> set:
    spec = leaf.sharding.spec
    return {a for part in spec if part for a in (part if isinstance(part, tuple) else (part,))}


@pytest.mark.parametrize("kind", ["siglip", "llama4", "qwen2_5", "qwen3"])
def test_a_step_with_images_on_fsdp_and_tensor_gives_one_devices_losses(tmp_path, kind):
    cfg = prepared_config(tmp_path, kind)
    one, _ = train_losses(cfg, jax.devices()[:1], batches_in_order, steps=3)
    mesh = {"mesh.ici_data": 1, "mesh.ici_fsdp": 4, "mesh.ici_tensor": 2}
    many, state = train_losses(config_lib.apply_overrides(cfg, mesh), jax.devices(), batches_in_order,
                               steps=3)
    print(f"{kind}: losses one device {np.round(one, 6).tolist()}, fsdp 4 x tensor 2 {np.round(many, 6).tolist()}")
    assert one[-1] < one[0]
    np.testing.assert_allclose(many, one, rtol=2e-5)
    axes = set().union(*(split_axes(leaf) for leaf in jax.tree.leaves(state["params"]["vision"])))
    assert {"fsdp", "tensor"} <= axes, axes
