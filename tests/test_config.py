import dataclasses
import json
import random
import subprocess
import sys
import types
import typing

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
    assert (config_lib.load("quickstart").optimizer.name, config_lib.load("quickstart").optimizer.lr) == ("muon", 8e-3)
    o = cpu.optimizer  # the recipe benchmarks/sweep.py found (docs/optimizers.md)
    assert (o.name, o.lr, o.min_lr, o.warmup_steps, o.schedule, o.weight_decay) == ("muon", 8e-3, 1e-4, 30, "cosine", 0.1)
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
        assert f"  {config_lib.spelled(key)}: " in out
    assert "training.steps: int = 5000" in out
    assert "  orpo.lambda: float = 0.1" in out  # the field orpo.lambda_, as users write it


def test_cli_error_is_one_line_without_traceback():
    r = subprocess.run([sys.executable, "-m", "jaxlm.cli", "train", "quickstart", "model.n_layer=2"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr
    assert "did you mean 'model.n_layers'" in r.stderr


BAD_VALUES = {bool: ["maybe", "2"], int: ["four", "2.5", "-7"], float: ["abc", "nan", "inf", "-3.5"],
              "literal": ["bogus"]}
BAD_STRINGS = {"model.layer_pattern": ["sideways", "global,,local"], "mesh.rules": ["param.embed=tensr", "garbage"],
               "decode.stop_tokens": ["a,b", "-1"], "logging.wandb_project": [""], "run_dir": [""],
               "checkpoint.init_from": ["/nonexistent/run"], "data.dir": ["/nonexistent/data"],
               "distributed.coordinator_address": ["127.0.0.1:1234"], "training.sample_prompt": ["\u65e5\u672c"],
               "compile.load": ["/nonexistent/step.jaxlm"]}
# Settings that are each fine but impossible together (or with this data and 8 devices); the key to name.
COMBOS = [
    (["model.n_heads=5"], "model.n_heads"), (["model.n_kv_heads=3"], "model.n_kv_heads"),
    (["mesh.ici_data=3"], "mesh.ici_data"), (["training.batch_size=12", "mesh.ici_data=8"], "training.batch_size"),
    (["optimizer.warmup_steps=50", "optimizer.decay_steps=10"], "optimizer.decay_steps"),
    (["model.layer_pattern=local,global"], "model.sliding_window"),
    (["model.layer_pattern=local,global,local", "model.sliding_window=8", "model.n_layers=2"], "model.n_layers"),
    (["model.n_experts=8", "model.router_groups=3"], "model.router_groups"),
    (["model.kv_lora_rank=16"], "model.qk_nope_head_dim"), (["model.q_lora_rank=8"], "model.q_lora_rank"),
    (["diagnostics.hang_exit=true"], "diagnostics.hang_exit"),
    (["profiler.mode=xplane", "profiler.skip_steps=100"], "profiler.skip_steps"),
    (["distributed.num_processes=2", "distributed.process_id=2", "distributed.coordinator_address=127.0.0.1:1"],
     "distributed.process_id"),
    (["model.n_experts=4", "model.experts_per_token=5"], "model.experts_per_token"),
    (["model.quantization=int8_weights"], "model.quantization"),
    (["training.per_device_batch_size=0.3"], "training.per_device_batch_size"),
    (["model.global_parameter_scale=3"], "model.global_parameter_scale"),
    (["model.rope_scaling=llama3", "model.rope_low_freq_factor=5"], "model.rope_low_freq_factor"),
    (["optimizer.min_lr=0.1", "optimizer.lr=0.01"], "optimizer.min_lr"),
    (["model.block_size=2000000"], "model.block_size"), (["model.vocab_size=10"], "model.vocab_size"),
    (["mesh.ici_data=1", "mesh.ici_tensor=8"], "mesh.ici_tensor"),
    (["mesh.ici_data=-1", "mesh.ici_fsdp=-1"], "mesh.ici_fsdp"),
    (["model.d_model=36", "model.n_heads=4"], "model.d_model"),
    (["training.spike_threshold=0.5"], "training.spike_threshold"),
    (["model.dropout=1.0"], "model.dropout"), (["decode.top_p=0"], "decode.top_p"),
]


def _kind(t):
    args = [a for a in typing.get_args(t) if a is not type(None)]
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        return _kind(args[0])
    return "literal" if typing.get_origin(t) is typing.Literal else t


def config_mutations(seed: int = 0) -> list[tuple[list[str], str]]:
    """Invalid settings, one per case, with the key each error must name: every key with values of the wrong
    type or out of range, typos of keys, and impossible combinations."""
    rng = random.Random(seed)
    keys = [config_lib.spelled(k) for k, *_ in config_lib.all_keys()]  # as users write them (orpo.lambda)
    cases = []
    for key, t, _, _ in config_lib.all_keys():
        key = config_lib.spelled(key)
        for value in BAD_VALUES.get(_kind(t), []) + BAD_STRINGS.get(key, []):
            cases.append(([f"{key}={value}"], key))
    for key in rng.sample(keys, 40):
        i = rng.randrange(len(key))
        typo = rng.choice([key[:i] + key[i + 1:], key[:i] + "x" + key[i:], key + "s"])
        if typo not in keys:
            cases.append(([f"{typo}=1"], typo))
    cases += COMBOS
    rng.shuffle(cases)
    return cases


def test_config_fuzz_fails_before_compiling_with_one_line_naming_the_key(char_data, tmp_path, monkeypatch, capsys):
    from jaxlm import cli
    from jaxlm.train import state as state_lib, step as step_lib

    def compiled(*args, **kwargs):
        raise AssertionError("a bad config got as far as compiling")

    for module, name in ((state_lib, "init_state"), (state_lib, "init_state_from"), (step_lib, "make_train_step"),
                         (step_lib, "make_eval_step")):
        monkeypatch.setattr(module, name, compiled)
    base = ["shakespeare_char_cpu", f"data.dir={char_data}", "model.n_layers=2", "model.d_model=32",
            "model.n_heads=4", "model.block_size=32", "training.batch_size=8", "training.steps=20",
            "optimizer.warmup_steps=5", "logging.progress=false", "logging.tensorboard=false"]
    cases = config_mutations()
    assert len(cases) >= 200
    for i, (args, key) in enumerate(cases):
        run_dir = f"run_dir={tmp_path / str(i)}"
        code = cli.main(["train", *base, run_dir, *args] if not args[0].startswith("run_dir=") else
                        ["train", *base, *args])
        err = capsys.readouterr().err
        assert code == 2, (args, err)
        assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, (args, err)
        assert key in err, (args, err)


def test_a_run_shorter_than_its_presets_warmup_trains_with_the_warmup_cut(tmp_path, capsys):
    # `jaxlm train quickstart training.steps=6`, a first run on a new machine: the preset's 50 warmup steps are cut
    # to a tenth of the run, with one line saying so; a warmup the user wrote is theirs (refused if too long).
    cfg = config_lib.load("quickstart", ["training.steps=6"])
    assert cfg.optimizer.warmup_steps == 0 and cfg.training.steps == 6
    err = capsys.readouterr().err
    assert err == ("note: optimizer.warmup_steps=50 is longer than this run's 6 steps: warmup cut to 0 "
                   "(a tenth of them); set optimizer.warmup_steps to choose\n")
    assert config_lib.load("quickstart", ["training.steps=40"]).optimizer.warmup_steps == 4
    assert config_lib.load("quickstart", ["training.steps=60"]).optimizer.warmup_steps == 50  # long enough: kept
    assert capsys.readouterr().err.count("note:") == 1
    with pytest.raises(ConfigError, match=r"^training.steps=6 must be >= optimizer.warmup_steps=10 "):
        config_lib.load("quickstart", ["training.steps=6", "optimizer.warmup_steps=10"])
    run = tmp_path / "run.yaml"  # a file's warmup is written too
    run.write_text("base: quickstart\noptimizer:\n  warmup_steps: 10\ntraining:\n  steps: 6\n")
    with pytest.raises(ConfigError, match=r"optimizer.warmup_steps=10"):
        config_lib.load(str(run))
    assert config_lib.load("quickstart", ["training.steps=6", "optimizer.schedule=constant"]).optimizer.warmup_steps \
        == 50  # a constant schedule has no decay to fit in


def test_a_short_run_of_a_preset_with_its_own_decay_length_cuts_the_warmup(capsys):
    # shakespeare_char_cpu sets decay_steps=2000 with its 30-step warmup: `training.steps=6` kept the warmup, and the
    # learning rate never passed 6/30 of its peak. The run is what is shorter than the warmup, not the decay.
    cfg = config_lib.load("shakespeare_char_cpu", ["training.steps=6"])
    assert cfg.optimizer.warmup_steps == 0 and cfg.optimizer.decay_steps == 2000
    assert capsys.readouterr().err == ("note: optimizer.warmup_steps=30 is longer than this run's 6 steps: warmup cut "
                                       "to 0 (a tenth of them); set optimizer.warmup_steps to choose\n")
    assert config_lib.load("shakespeare_char_cpu", ["training.steps=200"]).optimizer.warmup_steps == 30
    # A decay the user set past the run's end is a longer schedule's first leg: its warmup stays, to resume into.
    cfg = config_lib.load("shakespeare_char_cpu", ["training.steps=6", "optimizer.decay_steps=1000"])
    assert cfg.optimizer.warmup_steps == 30 and "note:" not in capsys.readouterr().err


def test_a_short_run_from_a_saved_config_json_cuts_the_warmup_it_holds(tmp_path, capsys):
    # `jaxlm train out/tiny/config.json training.steps=5`: a run's config.json holds every setting jaxlm resolved;
    # its warmup was refused as if the user had written it. It is cut like a preset's; a file of chosen settings
    # keeps its warmup (the test above).
    saved = tmp_path / "config.json"
    saved.write_text(config_lib.to_json(config_lib.load("quickstart")))
    capsys.readouterr()
    cfg = config_lib.load(str(saved), ["training.steps=5"])
    assert cfg.optimizer.warmup_steps == 0 and cfg.model.d_model == 128 and cfg.optimizer.name == "muon"
    assert capsys.readouterr().err.startswith("note: optimizer.warmup_steps=50 is longer than this run's 5 steps")
    with pytest.raises(ConfigError, match=r"^training.steps=5 must be >= optimizer.warmup_steps=10 "):
        config_lib.load(str(saved), ["training.steps=5", "optimizer.warmup_steps=10"])  # written here: kept


def test_preference_tuning_from_a_saved_config_takes_its_datas_mask(tmp_path):
    # README: `jaxlm train runs/sft/config.json ... data.dir=data/pairs training.objective=dpo` was refused, the SFT
    # run's config.json holding data.loss_mask=off (what `auto` resolved to on plain text). A mask the user sets is
    # theirs.
    saved = tmp_path / "config.json"
    sft = config_lib.load("quickstart")
    saved.write_text(config_lib.to_json(sft.replace(data=dataclasses.replace(sft.data, loss_mask="off"))))
    assert config_lib.load(str(saved), ["training.objective=dpo"]).data.loss_mask == "auto"
    assert config_lib.load(str(saved)).data.loss_mask == "off"
    with pytest.raises(ConfigError, match="scores the replies"):
        config_lib.load(str(saved), ["training.objective=dpo", "data.loss_mask=off"])

