"""Hugging Face import/export, checked against transformers itself: tiny random models built with each
family's own config class, imported, compared logit by logit, exported, reloaded by transformers, compared
again. Also: one-line errors for bad checkpoints, fine-tuning an imported model, tokenizer files and hub ids.
(The import's peak memory is measured by benchmarks/convert_memory.py.)"""

import json
from pathlib import Path

import numpy as np
import pytest

import jaxlm
from jaxlm import cli
from jaxlm.store import convert
from jaxlm.train import loop as train

from conftest import require

torch = require("torch")
transformers = require("transformers", "hf")

C = dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=64, intermediate_size=96, vocab_size=128)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
CASES = {  # GQA ratios: llama 1 (4 kv heads), mistral 2, llama3 4
    "gpt2": lambda: transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=128, n_positions=64),
    "gpt2-untied": lambda: transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=128, n_positions=64,
                                                   tie_word_embeddings=False),
    "llama": lambda: transformers.LlamaConfig(**C, num_key_value_heads=4),
    "llama3-rope-scaling": lambda: transformers.LlamaConfig(**C, num_key_value_heads=1, rope_parameters=LLAMA3_ROPE),
    "mistral-window-5": lambda: transformers.MistralConfig(**C, num_key_value_heads=2, sliding_window=5),
    "qwen2": lambda: transformers.Qwen2Config(**C, num_key_value_heads=2),
    "qwen3": lambda: transformers.Qwen3Config(**C, num_key_value_heads=2, head_dim=16),
    "gemma": lambda: transformers.GemmaConfig(**C, num_key_value_heads=1, head_dim=32),
    "gemma2-softcap": lambda: transformers.Gemma2Config(**C, num_key_value_heads=2, head_dim=16, sliding_window=4,
                                                        attn_logit_softcapping=2.0, final_logit_softcapping=1.5,
                                                        query_pre_attn_scalar=24),
    "mixtral": lambda: transformers.MixtralConfig(**C, num_key_value_heads=2, num_local_experts=4),
    # jaxlm's default GPT: rotary, RMSNorm, per-head QK RMSNorm, an ungated GELU MLP
    "apertus-gelu": lambda: transformers.ApertusConfig(**C, num_key_value_heads=4, hidden_act="gelu",
                                                       tie_word_embeddings=True,
                                                       rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
}
T = 24  # longer than the Mistral and Gemma 2 windows


def save_random(hf_cfg, path: Path, seed=0):
    """A transformers model with every weight random (norms around 1) saved with save_pretrained."""
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if p.ndim == 1 else 0.08 * torch.randn(p.shape, generator=g))
    model.save_pretrained(path)
    return model


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


@pytest.mark.parametrize("name", CASES)
def test_import_and_export_match_transformers(name, tmp_path):
    hf_cfg = CASES[name]()
    model = save_random(hf_cfg, tmp_path / "hf")
    tokens = np.random.default_rng(0).integers(0, hf_cfg.vocab_size, (2, T))
    if name == "mixtral":  # the router must actually send tokens unevenly
        x = model.model.embed_tokens(torch.tensor(tokens)).reshape(-1, 64)
        chosen = torch.topk(x @ model.model.layers[0].mlp.gate.weight.T, 2).indices
        counts = torch.bincount(chosen.flatten(), minlength=4)
        assert counts.max() > counts.min()
    want = hf_logits(model, tokens)
    convert.from_hf(str(tmp_path / "hf"), tmp_path / "jaxlm", log=lambda s: None)
    ours = jaxlm.load(tmp_path / "jaxlm").logits(tokens)
    assert ours.shape == (2, T, hf_cfg.vocab_size) and ours.dtype == np.float32
    assert np.abs(ours - want).max() <= 1e-4
    convert.to_hf(tmp_path / "jaxlm", tmp_path / "back", log=lambda s: None)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    assert type(back) is type(model)
    assert np.abs(hf_logits(back, tokens) - ours).max() <= 1e-4


def test_features_under_test_change_the_logits(tmp_path):
    """The odd cases above would pass vacuously if the feature did nothing: turning it off must change logits."""
    hf_cfg = CASES["llama3-rope-scaling"]()
    save_random(hf_cfg, tmp_path / "hf")
    convert.from_hf(str(tmp_path / "hf"), tmp_path / "jx", log=lambda s: None)
    model = jaxlm.load(tmp_path / "jx")
    tokens = np.random.default_rng(0).integers(0, 128, (1, T))
    import dataclasses
    plain = jaxlm.infer.api.Model(model.config.replace(model=dataclasses.replace(model.config.model, rope_scaling="none")),
                            model.params, model.path)
    assert np.abs(plain.logits(tokens) - model.logits(tokens)).max() > 1e-3


def run_cli(argv, capsys):
    capsys.readouterr()  # drop transformers' progress bars from saving the model
    code = cli.main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


def test_missing_and_mismatched_tensors_are_one_line(tmp_path, capsys):
    save_random(CASES["llama"](), tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    header, start = convert.read_header(path)
    with open(path, "rb") as f:
        tensors = {n: convert.read_tensor(f, info, start, n) for n, info in header.items()}
    dt = np.dtype(np.float32)

    def write(ts, folder):
        folder.mkdir()
        (folder / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
        convert.write_safetensors(folder / "model.safetensors", [(n, a.shape, dt) for n, a in ts.items()],
                                  lambda n: ts[n])

    missing = dict(tensors)
    del missing["model.layers.1.self_attn.k_proj.weight"]
    write(missing, tmp_path / "missing")
    code, err = run_cli(["convert", "from-hf", str(tmp_path / "missing"), str(tmp_path / "o1")], capsys)
    assert code == 2 and len(err) == 1
    assert "lacks tensor model.layers.1.self_attn.k_proj.weight (expected shape (64, 64))" in err[0]

    bad = dict(tensors)
    bad["model.layers.0.mlp.up_proj.weight"] = np.zeros((95, 64), np.float32)
    write(bad, tmp_path / "bad")
    code, err = run_cli(["convert", "from-hf", str(tmp_path / "bad"), str(tmp_path / "o2")], capsys)
    assert code == 2 and len(err) == 1
    assert "model.layers.0.mlp.up_proj.weight has shape (95, 64), expected (96, 64)" in err[0]

    code, err = run_cli(["convert", "to-hf", str(tmp_path / "nothing"), str(tmp_path / "o3")], capsys)
    assert code == 2 and len(err) == 1 and "no config.json" in err[0]


def test_hub_id_download_and_tokenizer_files_travel_both_ways(tmp_path, monkeypatch):
    """A hub id is fetched with huggingface_hub (replaced here by a local folder: no network in tests); the
    tokenizer files come along on import, serve `jaxlm.load(...).tokenizer()` and go back out on export."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf_dir = tmp_path / "hub-snapshot"
    save_random(CASES["gpt2"](), hf_dir)
    words = ["<unk>", "<eos>", "to", "be", "or", "not"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(hf_dir)
    asked = []

    def snapshot_download(repo_id, allow_patterns):
        asked.append((repo_id, allow_patterns))
        return str(hf_dir)

    import huggingface_hub
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    convert.from_hf("gpt2", tmp_path / "jx", log=lambda s: None)  # an id without an organisation
    assert asked[0][0] == "gpt2" and "tokenizer.json" in asked[0][1] and "*.safetensors" in asked[0][1]
    assert (tmp_path / "jx" / "tokenizer" / "tokenizer.json").is_file()
    assert jaxlm.load(tmp_path / "jx").tokenizer().encode("to be or not") == [2, 3, 4, 5]
    convert.to_hf(tmp_path / "jx", tmp_path / "back", log=lambda s: None)
    back = transformers.AutoTokenizer.from_pretrained(tmp_path / "back")
    assert back("to be or not", add_special_tokens=False).input_ids == [2, 3, 4, 5]

    def offline(repo_id, allow_patterns):
        raise OSError("We couldn't connect to 'https://huggingface.co'\nmore detail")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(convert.ConvertError, match=r"^org/missing is not a local folder, and downloading it from "
                                                   r"the hub failed: We couldn't connect"):
        convert.from_hf("org/missing", tmp_path / "jx2", log=lambda s: None)
    with pytest.raises(convert.ConvertError, match="neither a Hugging Face model folder nor a hub id"):
        convert.from_hf("not/a/hub/id", tmp_path / "jx3", log=lambda s: None)


def test_sharded_export_reimports_identically(tmp_path):
    save_random(CASES["qwen3"](), tmp_path / "hf")
    convert.from_hf(str(tmp_path / "hf"), tmp_path / "jx", log=lambda s: None)
    convert.to_hf(tmp_path / "jx", tmp_path / "sharded", shard_bytes=100_000, log=lambda s: None)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    convert.from_hf(str(tmp_path / "sharded"), tmp_path / "jx2", log=lambda s: None)
    tokens = np.arange(20).reshape(2, 10)
    np.testing.assert_array_equal(jaxlm.load(tmp_path / "jx").logits(tokens), jaxlm.load(tmp_path / "jx2").logits(tokens))


def test_the_quickstarts_run_exports_with_its_tokenizer(tmp_path, shakespeare_file, capsys):
    # `jaxlm convert to-hf outputs/run1 out/hf` on the quickstart's run (jaxlm's default GPT) was refused as
    # "model.glu=False cannot be expressed as a Hugging Face qwen3 model"; it exports as Apertus, the architecture
    # that is that model exactly, with Hugging Face tokenizer files equal to its byte vocabulary.
    run = tmp_path / "run"
    code = cli.main(["train", "quickstart", f"data.input={shakespeare_file}", f"data.dir={tmp_path / 'bytes'}",
                     f"run_dir={run}", "model.n_layers=2", "model.block_size=32", "training.steps=3",
                     "training.batch_size=8", "training.eval_interval=3",
                     "training.eval_batches=1", "training.sample_tokens=0", "logging.progress=false",
                     "logging.tensorboard=false"])
    assert code == 0
    code, err = run_cli(["convert", "to-hf", str(run), str(tmp_path / "hf")], capsys)
    assert code == 0, err
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    assert type(model).__name__ == "ApertusForCausalLM"
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "def é(x):\n    return x  # ü"
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode()) and tok.decode(ids) == text
    tokens = np.array([ids, ids[::-1]])
    assert np.abs(hf_logits(model, tokens) - jaxlm.load(run).logits(tokens)).max() <= 1e-4


def test_a_model_no_architecture_expresses_is_refused_naming_the_setting(tmp_path):
    # The default GPT without its QK-norm has no Hugging Face twin: the refusal names the setting that would make it
    # exportable (the user never chose a family, so "qwen3" alone told them nothing).
    from jaxlm.config import ModelConfig
    from jaxlm.families.rules import ConvertError

    with pytest.raises(ConvertError, match=r"^model.qk_norm=False has no equivalent in Hugging Face's apertus, the "
                                           r"architecture closest to this model \(it would load as True\): a model "
                                           r"trained with model.qk_norm=True exports; docs/families.md"):
        convert._family_of(ModelConfig(vocab_size=256, qk_norm=False))
    assert convert._family_of(ModelConfig(vocab_size=256))[1] == "apertus"
    assert convert._family_of(ModelConfig(vocab_size=256, glu=True, activation="silu", qk_norm=False))[1] == "llama"


@pytest.mark.slow
def test_finetune_imported_model_loss_falls_then_exports(tmp_path, char_data, capsys):
    save_random(CASES["qwen3"](), tmp_path / "hf")  # vocabulary 128 covers the 65 characters of the corpus
    assert cli.main(["convert", "from-hf", str(tmp_path / "hf"), str(tmp_path / "jx")]) == 0
    run = tmp_path / "run"
    code = cli.main(["train", str(tmp_path / "jx" / "config.json"), f"data.dir={char_data}", f"run_dir={run}",
                     "model.block_size=32", "training.steps=30", "training.batch_size=8", "training.eval_interval=30",
                     "training.eval_batches=2", "training.sample_tokens=0", "optimizer.lr=3e-3",
                     "optimizer.warmup_steps=5", "logging.progress=false", "logging.tensorboard=false",
                     "checkpoint.interval=30"])
    assert code == 0
    assert "initialized the weights from" in capsys.readouterr().out
    by_step = train.losses_by_step(run)
    losses = [by_step[s] for s in sorted(by_step)]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5
    assert cli.main(["convert", "to-hf", str(run), str(tmp_path / "tuned")]) == 0
    tuned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tuned").eval()
    tokens = np.arange(30).reshape(1, 30)
    assert np.abs(hf_logits(tuned, tokens) - jaxlm.load(run).logits(tokens)).max() <= 1e-4
