import json
import subprocess
import sys

import pytest

from jaxlm import config as config_lib
from jaxlm.config import ConfigError


def test_presets_load_and_validate():
    for name in config_lib.preset_names():
        cfg = config_lib.load(name)
        assert cfg.model.n_layers > 0
    cfg = config_lib.load("shakespeare_char")
    m, o, t = cfg.model, cfg.optimizer, cfg.training
    assert (m.n_layers, m.n_heads, m.d_model, m.block_size, m.dropout) == (6, 6, 384, 256, 0.2)
    assert (t.batch_size, o.lr, o.min_lr, o.warmup_steps, o.decay_steps, o.beta2) == (64, 1e-3, 1e-4, 100, 5000, 0.99)
    assert (o.weight_decay, o.weight_decay_mode) == (1e-4, "independent")
    cpu = config_lib.load("shakespeare_char_cpu")
    assert (cpu.model.n_layers, cpu.model.n_heads, cpu.model.d_model, cpu.model.block_size) == (4, 4, 128, 64)
    assert (cpu.training.batch_size, cpu.training.steps, cpu.optimizer.decay_steps, cpu.model.dropout) == (12, 2000, 2000, 0.0)
    owt = config_lib.load("openwebtext")
    assert (owt.model.vocab_size, owt.model.block_size, owt.training.batch_size, owt.training.grad_accum) == (50304, 1024, 128, 16)


def test_overrides_are_typed():
    cfg = config_lib.load("quickstart", ["model.n_layers=3", "optimizer.lr=3e-4", "model.bias=true",
                                         "model.vocab_size=none", "run_dir=/tmp/x", "training.steps=1e3"])
    assert cfg.model.n_layers == 3 and cfg.optimizer.lr == 3e-4 and cfg.model.bias is True
    assert cfg.model.vocab_size is None and cfg.run_dir == "/tmp/x" and cfg.training.steps == 1000


@pytest.mark.parametrize("args, fragments", [
    (["model.n_layer=4"], ["unknown setting 'model.n_layer'", "did you mean 'model.n_layers'"]),
    (["modle.n_layers=4"], ["unknown setting", "model.n_layers"]),
    (["model.n_layers=four"], ["model.n_layers='four'", "not a valid int"]),
    (["model.n_layers=2.5"], ["model.n_layers='2.5'", "not a valid int"]),
    (["model.norm=rmsnrom"], ["model.norm='rmsnrom'", "did you mean 'rmsnorm'", "layernorm"]),
    (["model.n_heads=5"], ["model.n_heads=5", "must divide model.d_model=128"]),
    (["model.dropout=1.5"], ["model.dropout=1.5", "[0, 1)"]),
    (["optimizer.lr=-1"], ["optimizer.lr=-1.0", "> 0"]),
    (["optimizer.min_lr=1"], ["optimizer.min_lr=1.0"]),
    (["training.batch_size=0"], ["training.batch_size=0", "> 0"]),
    (["mesh.ici_data=-1", "mesh.ici_fsdp=-1"], ["at most one ici axis"]),
    (["model.bias=maybe"], ["model.bias='maybe'", "bool"]),
    (["steps=100"], ["unknown setting 'steps'"]),
    (["training.steps"], ["expected key=value"]),
])
def test_config_errors_are_one_clear_line(args, fragments):
    with pytest.raises(ConfigError) as e:
        config_lib.load("quickstart", args)
    msg = str(e.value)
    assert "\n" not in msg
    for f in fragments:
        assert f in msg, (f, msg)


def test_unknown_preset_suggests():
    with pytest.raises(ConfigError, match="did you mean 'shakespeare_char'"):
        config_lib.load("shakespear_char")


def test_yaml_and_json_files(tmp_path):
    y = tmp_path / "run.yaml"
    y.write_text("base: shakespeare_char_cpu\nmodel:\n  n_layers: 2\ntraining:\n  steps: 7\n")
    cfg = config_lib.load(str(y))
    assert cfg.model.n_layers == 2 and cfg.training.steps == 7 and cfg.model.d_model == 128
    j = tmp_path / "run.json"
    j.write_text(json.dumps({"model": {"d_model": 64, "n_heads": 2}}))
    assert config_lib.load(str(j), ["model.n_layers=1"]).model.d_model == 64
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  n_layerz: 2\n")
    with pytest.raises(ConfigError, match="did you mean 'model.n_layers'"):
        config_lib.load(str(bad))


def test_round_trip_through_json():
    cfg = config_lib.load("shakespeare_char")
    assert config_lib.from_dict(json.loads(config_lib.to_json(cfg))) == cfg


def test_cli_help_lists_every_key():
    out = subprocess.run([sys.executable, "-m", "jaxlm.cli", "train", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for key, *_ in config_lib.all_keys():
        assert f"  {key}: " in out
    assert "training.steps: int = 5000" in out


def test_cli_error_is_one_line_without_traceback():
    r = subprocess.run([sys.executable, "-m", "jaxlm.cli", "train", "quickstart", "model.n_layer=2"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr
    assert "did you mean 'model.n_layers'" in r.stderr
