"""Qwen3-VL-MoE against transformers: test_vision_qwen3's tiny model with Qwen3-MoE's language model (4 experts, top
2, the experts of a layer fused in two tensors; a dense first layer, or MoE every second layer), imported and
exported (max |logit diff| <= 1e-4 both ways, no missing or unexpected keys in transformers), the released
checkpoints' transposed expert layout read alike, 32 greedy tokens with an image against transformers' generate,
config round trip and one-line refusals, `jaxlm generate --image`."""

from __future__ import annotations

import numpy as np
import pytest

import jaxlm
from jaxlm.store import convert
from conftest import require
from vision_models import imported, logits_match_both_ways
from test_vision_qwen import GRIDS, ROWS, hf_logits
from test_vision_qwen3 import generate_cli_matches, greedy_with_an_image_matches, qwen3_config

torch = require("torch")
transformers = require("transformers", "hf")

MOE = dict(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)


def moe_config(**text_changes):
    """Layer 0 dense (mlp_only_layers), layers 1 and 2 MoE; deepstack feeds layers 0 and 1, so both kinds."""
    return qwen3_config(transformers.Qwen3VLMoeConfig, {**MOE, "mlp_only_layers": [0], **text_changes}.items())


@pytest.fixture(scope="module")
def qmoe(tmp_path_factory):
    """(transformers model, imported jaxlm Model, folder)."""
    return imported(tmp_path_factory, "qwen3vlmoe", transformers.Qwen3VLMoeForConditionalGeneration, moe_config(),
                    0.08)


def test_import_and_export_match_transformers_with_images(qmoe):
    model, ours, tmp = qmoe
    cfg = ours.config.model
    assert (cfg.n_experts, cfg.experts_per_token, cfg.expert_ff, cfg.first_dense_layers) == (4, 2, 24, 1)
    assert cfg.router_norm_topk and cfg.vision.kind == "qwen3" and cfg.vision.deepstack == (0, 1)
    logits_match_both_ways(qmoe, transformers.Qwen3VLMoeForConditionalGeneration, hf_logits, np.array(ROWS), GRIDS)
    _, info = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp / "back", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    # Each expert's own weights, not a permutation: expert 1 of layer 1 (the first MoE layer) as transformers has it.
    experts = model.model.language_model.layers[1].mlp.experts
    gate_up, down = experts.gate_up_proj[1].detach().numpy(), experts.down_proj[1].detach().numpy()
    mlp = ours.params["layers"]["mlp"]
    assert np.array_equal(np.asarray(mlp["gate"][0, 1]), gate_up[:24].T)
    assert np.array_equal(np.asarray(mlp["up"][0, 1]), gate_up[24:].T)
    assert np.array_equal(np.asarray(mlp["down"][0, 1]), down.T)


def test_released_expert_layout_imports_alike(qmoe, tmp_path):
    """The released checkpoints store gate_up_proj [E, D, 2F] and down_proj [E, F, D] (transformers transposes them
    on load); the same model saved so imports to the same weights. A shape that is neither is one line."""
    from safetensors.numpy import load_file, save_file

    _, ours, tmp = qmoe
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "config.json").write_text((tmp / "hf" / "config.json").read_text())
    tensors = load_file(tmp / "hf" / "model.safetensors")
    fused = [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(fused) == 4
    save_file({n: np.ascontiguousarray(a.swapaxes(1, 2)) if n in fused else a for n, a in tensors.items()},
              tmp_path / "hub" / "model.safetensors")
    convert.from_hf(str(tmp_path / "hub"), tmp_path / "jx", log=lambda s: None)
    again = jaxlm.load(tmp_path / "jx")
    for key in ("gate", "up", "down", "router"):
        assert np.array_equal(np.asarray(again.params["layers"]["mlp"][key]),
                              np.asarray(ours.params["layers"]["mlp"][key])), key
    cut = next(n for n in fused if n.endswith("gate_up_proj"))
    tensors[cut] = tensors[cut][:, :40]
    save_file(tensors, tmp_path / "hub" / "model.safetensors")
    with pytest.raises(convert.ConvertError, match="experts.gate_up_proj has shape"):
        convert.from_hf(str(tmp_path / "hub"), tmp_path / "jx2", log=lambda s: None)


def test_greedy_generation_with_images_matches_transformers(tmp_path):
    """32 greedy tokens with an image equal transformers' generate, on 4 layers with experts every second layer
    (decoder_sparse_step 2: layers 1 and 3)."""
    greedy_with_an_image_matches(tmp_path, transformers.Qwen3VLMoeForConditionalGeneration,
                                 moe_config(num_hidden_layers=4, mlp_only_layers=[], decoder_sparse_step=2))


def test_config_round_trip_refusals_and_describe(qmoe, capsys):
    import dataclasses

    from jaxlm import cli
    from jaxlm import config as config_lib
    from jaxlm.families import qwen3_vl

    _, ours, tmp = qmoe
    cfg = ours.config.model
    assert qwen3_vl.config_from_hf(qwen3_vl.config_to_hf(cfg, "qwen3_vl_moe")) == cfg
    assert qwen3_vl.config_from_hf(moe_config().to_dict()) == cfg
    for change, message in ((dict(norm_topk_prob=False), "norm_topk_prob=False"),
                            (dict(mlp_only_layers=[1]), r"mlp_only_layers=\[1\] is not supported"),
                            (dict(num_experts=0), "needs experts")):
        bad = moe_config().to_dict()
        bad["text_config"].update(change)
        bad["text_config"].pop("num_local_experts") if "num_experts" in change else None
        with pytest.raises(config_lib.ConfigError, match=message):
            qwen3_vl.config_from_hf(bad)
    with pytest.raises(config_lib.ConfigError, match="router_norm_topk=false cannot be exported"):
        qwen3_vl.config_to_hf(dataclasses.replace(cfg, router_norm_topk=False), "qwen3_vl_moe")
    assert cli.main(["describe", str(tmp / "jx" / "config.json")]) == 0
    out = capsys.readouterr().out
    assert "4 experts of 24 (top 2) in 2 layers" in out and "vision tower (Qwen3-VL)" in out, out


def test_generate_cli_with_an_image(qmoe, tmp_path, capsys):
    """`jaxlm generate --image FILE` on the MoE model prints `Model.generate`'s tokens (test_vision_qwen3's check)."""
    generate_cli_matches(qmoe, tmp_path, capsys)
