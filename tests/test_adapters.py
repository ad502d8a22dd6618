"""PEFT interop both ways, checked with Hugging Face's own code: a tiny random Llama made with transformers ->
`convert from-hf` -> LoRA SFT -> `convert to-hf --adapter-only` loads in peft on the transformers base with
jaxlm's logits, the merged export gives them through transformers alone, an adapter written by peft imports
with peft's logits and goes on training, a PEFT folder served over the base (serve.adapters) gives peft's
logits on the rows that pick it, and adapters that do not fit stop in one line."""

import json

import jax
import numpy as np
import pytest

from conftest import require

peft = require("peft")
torch = require("torch")
transformers = require("transformers", "hf")

import jaxlm  # noqa: E402
from jaxlm import cli
from jaxlm.train import run as run_lib, state as state_lib  # noqa: E402
from jaxlm import config as config_lib  # noqa: E402
from jaxlm.model import forward  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def hf_llama(folder, hidden=32, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(folder)
    return model


def logits_of(model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()


def convert(capsys, *args):
    code = cli.main(["convert", *map(str, args)])
    return code, capsys.readouterr().err.strip()


@pytest.fixture(scope="module")
def lora_round_trip(tmp_path_factory, char_data):
    """A LoRA SFT run of 30 steps on a converted tiny Llama (the data's 65 characters within its 96 ids)."""
    tmp = tmp_path_factory.mktemp("peft")
    hf_llama(tmp / "hf")
    assert cli.main(["convert", "from-hf", str(tmp / "hf"), str(tmp / "base")]) == 0
    assert cli.main(["train", str(tmp / "base" / "config.json"), f"data.dir={char_data}", f"run_dir={tmp / 'run'}",
                     "model.block_size=32", "training.batch_size=8", "training.steps=30", "training.eval_interval=30",
                     "training.eval_batches=1", "training.sample_tokens=0", "optimizer.lr=1e-2",
                     "optimizer.warmup_steps=5", "lora.rank=4", "lora.alpha=8", "logging.progress=false",
                     "logging.tensorboard=false"]) == 0
    return tmp


def test_adapter_only_export_loads_in_peft_with_jaxlm_logits(lora_round_trip, capsys):
    tmp = lora_round_trip
    code, err = convert(capsys, "to-hf", tmp / "run", tmp / "peft", "--adapter-only")
    assert code == 0, err
    saved = json.loads((tmp / "peft" / "adapter_config.json").read_text())
    assert saved["r"] == 4 and saved["lora_alpha"] == 8 and sorted(saved["target_modules"]) == sorted(TARGETS)
    model = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(tmp / "hf"), tmp / "peft")
    tokens = np.random.default_rng(0).integers(0, 96, (2, 24))
    ours = jaxlm.load(tmp / "run").logits(tokens)
    theirs = logits_of(model.eval(), tokens)
    base = logits_of(transformers.LlamaForCausalLM.from_pretrained(tmp / "hf").eval(), tokens)
    code, err = convert(capsys, "to-hf", tmp / "run", tmp / "merged")
    assert code == 0, err
    merged = logits_of(transformers.LlamaForCausalLM.from_pretrained(tmp / "merged").eval(), tokens)
    diff, moved = float(np.abs(theirs - ours).max()), float(np.abs(theirs - base).max())
    print(f"peft_vs_jaxlm_max_abs_logit_diff={diff:.3g} (the adapter moves them by {moved:.3g}) "
          f"merged_vs_jaxlm_max_abs_logit_diff={np.abs(merged - ours).max():.3g}")
    assert diff <= 1e-4 and moved > 100 * diff
    assert np.abs(merged - ours).max() <= 1e-4


def test_an_adapter_written_by_peft_imports_with_peft_logits_and_trains_on(tmp_path, char_data, capsys):
    hf_llama(tmp_path / "hf")
    torch.manual_seed(1)
    model = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf"), peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False))
    model.save_pretrained(tmp_path / "adapter")
    code, err = convert(capsys, "from-hf", tmp_path / "hf", tmp_path / "out", "--adapter", tmp_path / "adapter")
    assert code == 0, err
    tokens = np.random.default_rng(0).integers(0, 96, (2, 24))
    theirs = logits_of(model.eval(), tokens)
    loaded = jaxlm.load(tmp_path / "out")
    assert loaded.config.lora.rank == 8 and loaded.config.lora.targets == "q,v,down"
    print(f"imported_peft_max_abs_logit_diff={np.abs(loaded.logits(tokens) - theirs).max():.3g}")
    assert np.abs(loaded.logits(tokens) - theirs).max() <= 1e-4

    # Training from the folder starts from the imported adapter, on the unmerged base.
    cfg = config_lib.load(str(tmp_path / "out" / "config.json"), [f"data.dir={char_data}", "model.block_size=32",
                                                                  f"run_dir={tmp_path / 'run'}"])
    run = run_lib.setup(cfg, jax.devices()[:1])
    state = state_lib.init_state_from(run, cfg.checkpoint.init_from)
    start = forward(state_lib.model_params(state["params"], state_lib.load_frozen(run), run.cfg), tokens, run.cfg.model)
    assert np.abs(np.asarray(start) - theirs).max() <= 1e-4


def test_adapters_that_do_not_fit_fail_in_one_line(tmp_path, capsys):
    hf_llama(tmp_path / "hf")
    hf_llama(tmp_path / "wide", hidden=64)
    peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "wide"),
                        peft.LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(tmp_path / "wide_adapter")
    peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf"),
                        peft.LoraConfig(r=4, target_modules=["q_proj"], use_rslora=True)).save_pretrained(
        tmp_path / "rslora")
    cases = [(tmp_path / "wide_adapter", "the adapter was made for a model of another size"),
             (tmp_path / "rslora", "use_rslora=True is not supported"),
             (tmp_path / "hf", "has no adapter_config.json")]
    capsys.readouterr()  # what saving the models above printed
    for i, (adapter, message) in enumerate(cases):
        code, err = convert(capsys, "from-hf", tmp_path / "hf", tmp_path / f"out{i}", "--adapter", adapter)
        assert code == 2 and message in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / f"out{i}").exists()  # refused before the base was converted
    code, err = convert(capsys, "from-hf", tmp_path / "hf", tmp_path / "plain")
    code, err = convert(capsys, "to-hf", tmp_path / "plain", tmp_path / "x", "--adapter-only")
    assert code == 2 and "is not a LoRA run" in err, err


def test_a_peft_folder_served_over_its_base_gives_peft_logits(tmp_path, capsys):
    """serve.adapters reads a PEFT folder as it is (adapters.for_serving): stacked with another adapter over the
    converted base (lora.serving_weights), the rows that pick it get peft's logits, the rows of the base the
    base's."""
    from jaxlm.store import adapters
    from jaxlm.model import lora
    from jaxlm.model import layers

    hf_llama(tmp_path / "hf")
    torch.manual_seed(2)
    model = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf"), peft.LoraConfig(
        r=4, lora_alpha=12, target_modules=["k_proj", "o_proj", "up_proj"], init_lora_weights=False))
    model.save_pretrained(tmp_path / "adapter")
    code, err = convert(capsys, "from-hf", tmp_path / "hf", tmp_path / "base")
    assert code == 0, err
    base = jaxlm.load(tmp_path / "base")
    one = jax.tree.leaves(base.params)[0].sharding
    mine = adapters.for_serving(tmp_path / "adapter", base.config, one)
    other = (jax.tree.map(lambda a: a + 0.1, mine[0]), 2.0)
    served = lora.serving_weights(base.params, [other, mine])
    tokens = np.random.default_rng(0).integers(0, 96, (2, 24))
    got = np.asarray(forward(layers.with_rows(served, np.asarray([1, -1])), tokens, base.config.model))
    theirs = logits_of(model.eval(), tokens)
    assert np.abs(got[0] - theirs[0]).max() <= 1e-4 and np.abs(got[1] - base.logits(tokens)[1]).max() <= 1e-4
    assert np.abs(theirs[0] - base.logits(tokens)[0]).max() > 0.01  # the adapter changes the logits
