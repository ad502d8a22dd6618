"""LoRA and QLoRA: the adapted model starts as its base exactly, the adapters' gradients are the chain rule's,
only adapters change and only they have optimizer state, runs resume exactly and shard like full runs, the
quantized bases stay close to the float one and are read a layer at a time (the codes of the whole at once,
never the float base on the devices), and bad settings fail in one line."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
import jaxlm
from jaxlm import cli, config as config_lib, params as P, sharding
from jaxlm.store import checkpoint as ckpt, weights
from jaxlm.model import lora, quant
from jaxlm.train import objectives
from jaxlm.train import loop as train, run as run_lib, state as state_lib, step as step_lib
from jaxlm.model import forward, layers, param_specs

VOCAB = 66  # the characters of the corpus (65) and one more, so that tensor parallelism splits it


def make_base(folder, seed=0, **model):
    """A converted-style folder (config.json + params/) holding a randomly initialized tiny model."""
    cfg = tiny_config(folder, None, **{"model.vocab_size": VOCAB, **{f"model.{k}": v for k, v in model.items()}})
    params = P.init(param_specs(cfg.model), jax.random.key(seed), sharding.make_mesh(cfg.mesh, jax.devices()[:1]))
    folder.mkdir(parents=True, exist_ok=True)
    weights.save_params(folder / "params", params)
    (folder / "config.json").write_text(config_lib.to_json(cfg.replace(
        checkpoint=cfg.checkpoint.__class__(init_from=str(folder)))))
    return cfg, params


def lora_run(char_data, tmp_path, base, **overrides):
    settings = {"lora.rank": 4, "lora.alpha": 8.0, "checkpoint.init_from": str(base), "model.vocab_size": VOCAB,
                **overrides}
    return tiny_config(char_data, tmp_path / "run", **settings)


def random_batch(rng, A=1, B=8, T=32):
    x = rng.integers(0, VOCAB, (A, B, T + 1)).astype(np.int32)
    return {"inputs": x[..., :-1], "targets": x[..., 1:]}


def test_starts_as_the_base_and_only_adapters_train(char_data, tmp_path):
    base_cfg, base_params = make_base(tmp_path / "base")
    run = run_lib.setup(lora_run(char_data, tmp_path, tmp_path / "base", **{"optimizer.lr": 1e-2}),
                        jax.devices()[:1])
    state = state_lib.init_state(run, 0)
    frozen = state_lib.load_frozen(run)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 32))
    adapted = forward(state_lib.model_params(state["params"], frozen, run.cfg), tokens, run.cfg.model)
    assert np.array_equal(np.asarray(adapted), np.asarray(forward(base_params, tokens, run.cfg.model)))

    before = jax.tree.map(np.array, frozen)
    step = step_lib.make_train_step(run.cfg, run.optimizer, run.mesh, run.abstract_state, run.act_rules)
    rng = np.random.default_rng(1)
    losses = []
    for _ in range(50):
        state, m = step(state, random_batch(rng), frozen)
        losses.append(float(m["loss"]))
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(frozen)))
    assert losses[-1] < losses[0]
    adapter_shapes = {tuple(s.shape) for s in jax.tree.leaves(run.specs, is_leaf=P.is_spec)}
    assert all(np.abs(np.asarray(b)).max() > 0 for b in jax.tree.leaves(
        jax.tree.map(lambda ad: ad["b"], state["params"]["layers"], is_leaf=lambda d: "b" in d)))
    # The state holds adapters and their moments only: no array the size of a base weight.
    base_shapes = {a.shape for a in jax.tree.leaves(base_params)}
    for leaf in jax.tree.leaves(state["opt_state"]) + jax.tree.leaves(state["params"]):
        assert leaf.ndim == 0 or (tuple(leaf.shape) in adapter_shapes and leaf.shape not in base_shapes), leaf.shape


def test_adapter_gradients_are_the_chain_rule(char_data, tmp_path):
    make_base(tmp_path / "base", glu=True, activation="silu")
    cfg = lora_run(char_data, tmp_path, tmp_path / "base", **{"model.glu": True, "model.activation": "silu",
                                                               "lora.rank": 3, "lora.alpha": 6.0})
    run = run_lib.setup(cfg, jax.devices()[:1])
    frozen = state_lib.load_frozen(run)
    key = jax.random.key(3)
    adapters = jax.tree.map(lambda a: 0.1 * jax.random.normal(jax.random.fold_in(key, a.size), a.shape),
                            state_lib.init_state(run, 0)["params"])  # B != 0, so that A's gradient is not zero
    batch = random_batch(np.random.default_rng(2))
    objective = objectives.get("next_token")
    (_, _), grads = step_lib.loss_and_grads(objective, adapters, batch, run.cfg, None, frozen)

    merged = lora.merge(frozen, adapters, run.cfg)
    (_, _), full = step_lib.loss_and_grads(objective, merged, batch, run.cfg, None)
    s = lora.scale(run.cfg)
    for blk, names in adapters["layers"].items():
        for name, ad in names.items():
            k = lora.n_in(name)
            a, b = np.asarray(ad["a"]), np.asarray(ad["b"])
            L, r = a.shape[0], a.shape[-1]
            g = np.asarray(full["layers"][blk][name]).reshape(L, a[0].size // r, -1)  # dW_eff [L, in, out]
            want_a = s * g @ b.reshape(L, r, -1).transpose(0, 2, 1)
            want_b = s * a.reshape(L, -1, r).transpose(0, 2, 1) @ g
            got_a, got_b = (np.asarray(grads["layers"][blk][name][x]) for x in ("a", "b"))
            assert k in (1, 2)
            np.testing.assert_allclose(got_a.reshape(want_a.shape), want_a, rtol=2e-4, atol=1e-7)
            np.testing.assert_allclose(got_b.reshape(want_b.shape), want_b, rtol=2e-4, atol=1e-7)


@pytest.mark.slow
def test_run_resumes_exactly_and_loads_merged(char_data, tmp_path):
    make_base(tmp_path / "base")
    common = {"training.steps": 12, "optimizer.decay_steps": 12, "checkpoint.interval": 6, "lora.dropout": 0.1,
              "optimizer.lr": 1e-2}
    whole = lora_run(char_data, tmp_path / "whole", tmp_path / "base", **common)
    train.train(whole, jax.devices()[:1], log=lambda s: None)
    part = lora_run(char_data, tmp_path / "part", tmp_path / "base", **{**common, "training.steps": 6})
    train.train(part, jax.devices()[:1], log=lambda s: None)
    train.train(part.replace(training=whole.training), jax.devices()[:1], log=lambda s: None)
    a, b = train.losses_by_step(tmp_path / "whole" / "run"), train.losses_by_step(tmp_path / "part" / "run")
    assert sorted(a) == list(range(1, 13)) and a == b

    # The checkpoint holds adapters only; loading the run merges them into the base it points at.
    run = run_lib.setup(whole, jax.devices()[:1])
    restored = ckpt.restore_newest(tmp_path / "whole" / "run", run.abstract_state, print)
    adapters = restored[1]["params"]
    assert set(adapters["layers"]["attn"]) == {"q", "k", "v", "o"}
    model = jaxlm.load(tmp_path / "whole" / "run")
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 32))
    want = forward(state_lib.model_params(adapters, state_lib.load_frozen(run), run.cfg), tokens, run.cfg.model)
    np.testing.assert_allclose(model.logits(tokens), np.asarray(want), atol=1e-5)


@pytest.mark.slow
def test_sharded_lora_equals_one_device(char_data, tmp_path):
    make_base(tmp_path / "base")
    losses = {}
    for name, devices, mesh in [("one", jax.devices()[:1], {}),
                                ("fsdp", jax.devices(), {"mesh.ici_data": 2, "mesh.ici_fsdp": 2, "mesh.ici_tensor": 2})]:
        cfg = lora_run(char_data, tmp_path / name, tmp_path / "base", **mesh, **{
            "checkpoint.enabled": False, "training.steps": 8, "training.grad_accum": 2})
        train.train(cfg, devices, log=lambda s: None)
        losses[name] = train.losses_by_step(tmp_path / name / "run")
    np.testing.assert_allclose([losses["fsdp"][s] for s in range(1, 9)], [losses["one"][s] for s in range(1, 9)],
                               rtol=1e-5)


@pytest.mark.parametrize("mode, tolerance", [("int8", 0.02), ("nf4", 0.15)])
def test_quantized_base_stays_close_and_trains(mode, tolerance, char_data, tmp_path):
    _, base_params = make_base(tmp_path / "base", d_model=64, n_heads=4)
    cfg = lora_run(char_data, tmp_path, tmp_path / "base", **{"model.d_model": 64, "lora.base_quantization": mode,
                                                               "optimizer.lr": 1e-2})
    run = run_lib.setup(cfg, jax.devices()[:1])
    frozen = state_lib.load_frozen(run)
    kind = quant.QWeight if mode == "int8" else quant.NF4Weight
    assert isinstance(frozen["layers"]["attn"]["q"], kind) and isinstance(frozen["layers"]["mlp"]["down"], kind)
    stored = quant.nbytes(frozen["layers"]) / quant.nbytes(base_params["layers"])
    assert stored < (0.3 if mode == "int8" else 0.2), stored
    for blk, name in (("attn", "q"), ("attn", "o"), ("mlp", "up"), ("mlp", "down")):
        w = np.asarray(base_params["layers"][blk][name])
        back = np.asarray(quant.dequantize_base(frozen["layers"][blk][name], jnp.float32))
        rel = np.sqrt(np.mean((back - w) ** 2)) / np.std(w)
        assert rel < tolerance, (blk, name, rel)
    state = state_lib.init_state(run, 0)
    step = step_lib.make_train_step(run.cfg, run.optimizer, run.mesh, run.abstract_state, run.act_rules)
    rng = np.random.default_rng(0)
    batch = random_batch(rng)
    losses = []
    for _ in range(30):
        state, m = step(state, batch, frozen)
        losses.append(float(m["loss"]))
    assert losses[-1] < 0.9 * losses[0]


def run_cli(args, capsys):
    code = cli.main(args)
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("settings, message", [
    (["lora.rank=4", "lora.targets=gate"], "lora.targets='gate' names no weight of this model"),
    (["lora.rank=4", "lora.targets=q_proj"], "'q_proj' is not a weight jaxlm adapts (did you mean 'q'?)"),
    (["lora.rank=4", "checkpoint.init_from=None"], "lora.rank=4 trains adapters on frozen base weights"),
    (["lora.base_quantization=nf4"], "set lora.rank too"),
])
def test_bad_lora_settings_fail_in_one_line(settings, message, char_data, tmp_path, capsys):
    make_base(tmp_path / "base")
    args = ["train", "quickstart", f"data.dir={char_data}", f"run_dir={tmp_path / 'run'}", "model.n_layers=2",
            "model.d_model=32", "model.block_size=32", f"model.vocab_size={VOCAB}", "logging.progress=false",
            f"checkpoint.init_from={tmp_path / 'base'}", *settings]
    code, err = run_cli(args, capsys)
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_config_json_records_lora_and_a_resume_must_match_it(char_data, tmp_path):
    make_base(tmp_path / "base")
    cfg = lora_run(char_data, tmp_path, tmp_path / "base", **{"training.steps": 2, "checkpoint.interval": 2,
                                                               "optimizer.warmup_steps": 1})
    train.train(cfg, jax.devices()[:1], log=lambda s: None)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["lora"]["rank"] == 4 and saved["checkpoint"]["init_from"] == str(tmp_path / "base")
    make_base(tmp_path / "other", seed=1)
    for change, message in [({"lora.rank": 8}, "trained with lora.rank=4"),
                            ({"checkpoint.init_from": str(tmp_path / "other")}, "trained with checkpoint.init_from=")]:
        with pytest.raises(config_lib.ConfigError, match=message):
            train.train(config_lib.apply_overrides(cfg, change), jax.devices()[:1], log=lambda s: None)


def random_adapters(cfg, seed: int, scale: float = 0.3) -> dict:
    """Adapters of lora.specs(cfg) with A and B both random (B is zero at initialization: no effect to test)."""
    specs = lora.specs(cfg)
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    return jax.tree.map(lambda s: scale * jax.random.normal(next(keys), s.shape, jnp.float32), specs,
                        is_leaf=lambda s: isinstance(s, P.ParamSpec))


def test_each_row_runs_its_own_adapter_as_the_merged_weights_do(tmp_path):
    """Three adapters of different ranks, scales and targets stacked over one base (lora.serving_weights): rows
    of one batch picking adapters 0, 1, 2 and the base (-1) each get the logits of the weights with that adapter
    merged (lora.merge), and of the base; rows of another batch in the other order get them too."""
    cfg = tiny_config(tmp_path, None, **{"model.vocab_size": VOCAB})
    base = P.init(param_specs(cfg.model), jax.random.key(0), sharding.make_mesh(cfg.mesh, jax.devices()[:1]))
    cfgs = [config_lib.apply_overrides(cfg, over) for over in (
        {"lora.rank": 4, "lora.alpha": 8.0}, {"lora.rank": 2, "lora.alpha": 16.0, "lora.targets": "q,v"},
        {"lora.rank": 3, "lora.alpha": 3.0, "lora.targets": "o,up,down"})]
    trees = [random_adapters(c, seed=i + 1) for i, c in enumerate(cfgs)]
    served = lora.serving_weights(base, [(t, lora.scale(c)) for t, c in zip(trees, cfgs)])
    q = served["layers"]["attn"]["q"]
    assert isinstance(q, layers.RowLoraWeight) and q.a.shape[-2:] == (3, 4) and q.b.shape[1:3] == (3, 4)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (4, 16)).astype(np.int32)
    wants = [forward(lora.merge(base, t, c), tokens, cfg.model) for t, c in zip(trees, cfgs)]
    wants.append(forward(base, tokens, cfg.model))
    for rows in ([0, 1, 2, -1], [-1, 2, 1, 0]):
        got = jax.jit(lambda p, r: forward(layers.with_rows(p, r), tokens, cfg.model))(served, np.asarray(rows))
        for b, k in enumerate(rows):
            np.testing.assert_allclose(got[b], wants[k][b], rtol=0, atol=2e-5)
    assert min(float(jnp.abs(w - wants[-1]).max()) for w in wants[:-1]) > 0.05  # every adapter changes the logits


# ---- the frozen base read a layer at a time (issue 54) --------------------------------------------------------

def whole_then_quantized(run) -> dict:
    """The frozen base as it was loaded before: the whole float base restored onto the devices, then quantized by
    one jit (the reference the layer-at-a-time load must equal bit for bit)."""
    path, cfg = run.cfg.checkpoint.init_from, run.cfg
    dense = state_lib.placed(param_specs(cfg.model), run.mesh, run.param_rules)
    base = (weights.restore_base_params(path, weights.load_config(path), dense) if weights.has_adapter_dir(path)
            else weights.restore_params(path, dense))
    quantize = jax.jit(lambda p: lora.quantize_base(p, cfg), out_shardings=state_lib.shardings_of(run.abstract_frozen))
    return quantize(base)


def assert_same_bits(got, want):
    got_leaves, got_def = jax.tree.flatten(got)
    want_leaves, want_def = jax.tree.flatten(want)
    assert got_def == want_def
    for g, w in zip(got_leaves, want_leaves):
        assert g.dtype == w.dtype and g.shape == w.shape and g.sharding.is_equivalent_to(w.sharding, g.ndim)
        assert np.asarray(g).tobytes() == np.asarray(w).tobytes()


def watch_float_bases(monkeypatch, run) -> list:
    """Each time a weight is quantized (while its program is traced, the load's arrays all live), the float arrays
    of a whole stacked base weight's shape [L, *in, *out] that the devices then hold, made since the call."""
    specs = param_specs(run.cfg.model)["layers"]
    shapes = {tuple(specs[blk][name].shape) for blk, name in lora.quantized_weights(run.cfg)}
    before = list(jax.live_arrays())  # kept, so that their ids are not reused
    old = {id(a) for a in before}
    seen = []
    for name in ("quantize", "quantize_nf4"):
        def hooked(*args, _real=getattr(quant, name), **kwargs):
            seen.append(sorted(tuple(a.shape) for a in jax.live_arrays() if id(a) not in old
                               and tuple(a.shape) in shapes and jnp.issubdtype(a.dtype, jnp.floating)))
            return _real(*args, **kwargs)
        monkeypatch.setattr(quant, name, hooked)
    return seen


@pytest.mark.parametrize("mode", ["int8", "nf4"])
def test_the_quantized_base_is_read_a_layer_at_a_time(mode, char_data, tmp_path, monkeypatch):
    """load_frozen gives the codes the whole-base load gave, bit for bit, without the devices ever holding a whole
    float base weight; the whole-base load held every one of them while quantizing (what the check catches)."""
    make_base(tmp_path / "base", d_model=64, n_heads=4, n_layers=3)
    cfg = lora_run(char_data, tmp_path, tmp_path / "base", **{
        "model.d_model": 64, "model.n_layers": 3, "model.compute_dtype": "bfloat16", "lora.base_quantization": mode})
    run = run_lib.setup(cfg, jax.devices()[:1])
    seen = watch_float_bases(monkeypatch, run)
    frozen = state_lib.load_frozen(run)
    n = len(lora.quantized_weights(run.cfg))
    assert n == 6 and len(seen) == n and not any(seen), seen  # q, k, v, o, up, down
    seen.clear()
    want = whole_then_quantized(run)
    assert len(seen) == n and all(len(s) == n for s in seen), seen  # the whole float base was live, each time
    assert_same_bits(frozen, want)
    assert frozen["embed"]["tokens"].dtype == jnp.bfloat16


def test_the_sharded_quantized_base_is_read_a_layer_at_a_time(char_data, tmp_path):
    make_base(tmp_path / "base", d_model=64, n_heads=4)
    cfg = lora_run(char_data, tmp_path, tmp_path / "base", **{
        "model.d_model": 64, "lora.base_quantization": "nf4", "mesh.ici_data": 2, "mesh.ici_fsdp": 2,
        "mesh.ici_tensor": 2})
    run = run_lib.setup(cfg, jax.devices())
    frozen = state_lib.load_frozen(run)
    codes = frozen["layers"]["mlp"]["up"].codes
    assert len(codes.sharding.device_set) == 8 and not codes.sharding.is_fully_replicated
    assert_same_bits(frozen, whole_then_quantized(run))


def test_a_base_with_an_imported_adapter_is_read_a_piece_at_a_time(char_data, tmp_path):
    """A converted folder with an adapter/ (`convert from-hf --adapter`): a QLoRA run from it gets its unmerged
    base, and the folder read a piece at a time merged (as a LoRA run's base is) equals restore_params, bit for
    bit."""
    import shutil

    base_cfg, _ = make_base(tmp_path / "base", d_model=64, n_heads=4)
    folder = tmp_path / "with-adapter"
    shutil.copytree(tmp_path / "base" / "params", folder / "params")
    ad_cfg = config_lib.apply_overrides(base_cfg, {"lora.rank": 4, "lora.alpha": 8.0,
                                                   "checkpoint.init_from": str(folder)})
    (folder / "config.json").write_text(config_lib.to_json(ad_cfg))
    weights.save_params(folder / weights.ADAPTER_DIR, random_adapters(ad_cfg, seed=5))

    cfg = lora_run(char_data, tmp_path, folder, **{"model.d_model": 64, "lora.base_quantization": "nf4"})
    run = run_lib.setup(cfg, jax.devices()[:1])
    assert_same_bits(state_lib.load_frozen(run), whole_then_quantized(run))

    dense = state_lib.placed(param_specs(run.cfg.model), run.mesh, run.param_rules)
    want = weights.restore_params(folder, dense)
    read = weights.piece_reader(folder, jax.sharding.NamedSharding(run.mesh, jax.sharding.PartitionSpec()))
    got = jax.tree_util.tree_map_with_path(
        lambda path, a: read(tuple(k.key for k in path), None, a, a.dtype), dense)
    assert_same_bits(got, want)
    q = dense["layers"]["attn"]["q"]
    layer = jax.ShapeDtypeStruct((1, *q.shape[1:]), q.dtype, sharding=q.sharding)
    one = read(("layers", "attn", "q"), slice(1, 2), layer, q.dtype)
    assert np.asarray(one).tobytes() == np.asarray(want["layers"]["attn"]["q"][1:2]).tobytes()
    merged_away = np.abs(np.asarray(want["layers"]["attn"]["q"]) - np.asarray(run_base_q(tmp_path))).max()
    assert merged_away > 1e-3  # the adapter did change the weight it adapts


def run_base_q(tmp_path):
    _, base = weights.load_params(tmp_path / "base")
    return base["layers"]["attn"]["q"]


@pytest.mark.slow
def test_run_directories_as_the_base_are_read_a_layer_at_a_time(char_data, tmp_path):
    """A QLoRA run from a full fine-tune's run directory (its newest checkpoint's params) and from a LoRA run's
    (its base with its adapters merged, a piece at a time) loads the codes the whole-base load gave."""
    make_base(tmp_path / "base", d_model=64, n_heads=4)
    short = {"model.d_model": 64, "training.steps": 2, "checkpoint.interval": 2, "optimizer.warmup_steps": 1,
             "optimizer.lr": 1e-2}
    full = tiny_config(char_data, tmp_path / "full", **{"model.vocab_size": VOCAB, **short,
                                                         "checkpoint.init_from": str(tmp_path / "base")})
    train.train(full, jax.devices()[:1], log=lambda s: None)
    train.train(lora_run(char_data, tmp_path / "lora", tmp_path / "base", **short), jax.devices()[:1],
                log=lambda s: None)
    for source in (tmp_path / "full", tmp_path / "lora" / "run"):
        cfg = lora_run(char_data, tmp_path / "q", source, **{"model.d_model": 64, "lora.base_quantization": "int8"})
        run = run_lib.setup(cfg, jax.devices()[:1])
        assert_same_bits(state_lib.load_frozen(run), whole_then_quantized(run))
