"""Context parallelism on 8 fake CPU devices (model/ring.py): a tiny Llama with 1,024-token sequences and a
sliding-window layer trains as on one device with the sequence split 4 ways, by ring or all-gather, packed or
not; the compiled step holds the ring's permutes or the gather; attention memory per device falls with the
split; checkpoints restore across layouts."""

import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config, train_losses
from jaxlm import config as config_lib, params as P, sharding
from jaxlm.store import checkpoint as ckpt
from jaxlm.train import batches as batch_lib, loop as train, run as run_lib, step as step_lib
from jaxlm.config import ConfigError
from jaxlm.data import loader as loader_lib
from jaxlm.model import attention, loss_fn, param_specs, ring
from test_parallel import _state_hash

T = 1024
# A tiny Llama (RMSNorm, rotary, SwiGLU, grouped-query attention) whose first layer of each pair is local.
LLAMA = {"model.vocab_size": 128, "model.block_size": T, "model.n_layers": 2, "model.d_model": 32,
         "model.n_heads": 4, "model.n_kv_heads": 2, "model.norm": "rmsnorm", "model.position": "rotary",
         "model.glu": True, "model.activation": "silu", "model.layer_pattern": "local,global",
         "model.sliding_window": 200, "model.attention_block": 128, "training.batch_size": 4}
CONTEXT4 = {"mesh.ici_data": 2, "mesh.ici_sequence": 4}


def _packed(rng, B: int) -> dict[str, np.ndarray]:
    """Segment ids of documents packed into [1, B, T] rows, positions restarting at each, and weights that leave
    out each document's last token."""
    segments = np.cumsum(rng.random((B, T)) < 0.004, axis=1).astype(np.int32)
    first = np.concatenate([np.ones((B, 1), bool), segments[:, 1:] != segments[:, :-1]], axis=1)
    positions = (np.arange(T) - np.maximum.accumulate(np.where(first, np.arange(T), 0), axis=1)).astype(np.int32)
    weights = np.concatenate([~first[:, 1:], np.ones((B, 1), bool)], axis=1).astype(np.float32)
    return {"segment_ids": segments[None], "positions": positions[None], "weights": weights[None]}


def _losses(char_data, tmp_path, devices, packed=False, steps=14, **overrides):
    def batch_of(rng, run):
        batch = batch_lib.device_batch(run, "train", loader_lib.Windows(rng.integers(0, 100_000, size=(1, 4))))
        if packed:
            batch |= {k: batch_lib.put_batch(run.mesh, v, 1, run.act_rules) for k, v in _packed(rng, 4).items()}
        return batch

    return train_losses(tiny_config(char_data, tmp_path, **{**LLAMA, **overrides}), devices, batch_of, steps)


@pytest.fixture(scope="module")
def references(char_data, tmp_path_factory):
    """The one-device runs (dot_product attention over the whole sequence), plain and packed, each made when a
    test first asks for it."""
    made = {}

    def reference(packed: bool):
        if packed not in made:
            made[packed] = _losses(char_data, tmp_path_factory.mktemp("ref"), jax.devices()[:1], packed)
        return made[packed]

    return reference


@pytest.mark.slow
@pytest.mark.parametrize("method,packed", [pytest.param("ring", False, marks=pytest.mark.in_ci),
                                           ("all_gather", False), ("ring", True), ("all_gather", True)])
def test_context_parallel_matches_one_device(method, packed, char_data, tmp_path, references):
    ref_losses, ref_state = references(packed)
    losses, state = _losses(char_data, tmp_path, jax.devices(), packed,
                            **CONTEXT4, **{"model.context_parallel": method})
    assert ref_losses[-1] < ref_losses[0] - 0.3
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(jax.device_get(state["params"])),
                    jax.tree.leaves(jax.device_get(ref_state["params"]))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_zigzag_order_balances_causal_work():
    order = ring.zigzag_order(T, 4)
    assert sorted(order) == list(range(T))
    per_device = order.reshape(4, T // 4)
    # Device i holds chunks i and 7 - i of 128 tokens: the keys before its queries are the same in number.
    np.testing.assert_array_equal(per_device[1], np.r_[128:256, 768:896])
    work = [(positions + 1).sum() for positions in per_device]
    assert len(set(work)) == 1, work


def _attention_collectives(char_data, method: str) -> set[tuple[str, str]]:
    """(op, result shape) of the compiled train step's collectives that the attention's shard_map issues."""
    cfg = tiny_config(char_data, None, **{**LLAMA, **CONTEXT4, "model.context_parallel": method})
    run = run_lib.setup(cfg, jax.devices())
    step = step_lib.make_train_step(run.cfg, run.optimizer, run.mesh, run.abstract_state, run.act_rules)
    hlo = step.lower(run.abstract_state, step_lib.abstract_batch(run)).compile().as_text()
    return set(re.findall(rf"= \(?([a-z0-9]+\[[0-9,]*\])[^=\n]*? (all-gather|collective-permute)(?:-start)?\("
                          rf"[^\n]*op_name=\"[^\"]*{method}_attention/", hlo))


@pytest.mark.parametrize("method", ["ring", "all_gather"])
def test_compiled_step_moves_keys_and_values(method, char_data):
    """The ring passes blocks [rows per data shard, T / 4, kv heads, head width] of keys and values (and of their
    gradients) with collective permutes and gathers nothing; all_gather gathers them whole."""
    found = _attention_collectives(char_data, method)
    if method == "ring":
        assert {op for _, op in found} == {"collective-permute"}, found
        assert (f"f32[2,{T // 4},2,8]", "collective-permute") in found, found
    else:
        assert {op for _, op in found} == {"all-gather"}, found
        assert (f"f32[2,{T},2,8]", "all-gather") in found, found


@pytest.mark.parametrize("method", ["ring", "all_gather"])
def test_split_attention_equals_one_device_with_gradients(method):
    """Attention over 200 tokens split 4 ways (50 per device: tiles of 32 leave a padded tile), causal within a
    window of 70, with segment ids, soft-capped, in zig-zag order, against the one-device dot product: outputs
    and the gradients of q, k, v."""
    T, n = 200, 4
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, T, heads, 16)), jnp.float32) for heads in (4, 2, 2))
    order = ring.zigzag_order(T, n)
    positions = jnp.asarray(np.broadcast_to(np.arange(T), (2, T))[:, order], jnp.int32)
    segments = jnp.asarray((np.cumsum(rng.random((2, T)) < 0.02, axis=1))[:, order], jnp.int32)
    cfg = config_lib.ModelConfig(attention="dot_product", attention_block=32, context_parallel=method,
                                 sliding_window=70, attn_logit_softcap=30.0)
    mesh = _context4()
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "sequence"))

    def loss(q, k, v, use_mesh):
        def run():
            out = attention.self_attention(q, k, v, positions, segments, cfg, kind="local")
            return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape)))
        if not use_mesh:
            return run()
        with sharding.activation_sharding(mesh):
            return run()

    want, want_grads = jax.value_and_grad(loss, (0, 1, 2))(q, k, v, False)
    got, got_grads = jax.jit(jax.value_and_grad(lambda *a: loss(*a, True), (0, 1, 2)))(
        *(jax.device_put(x, split) for x in (q, k, v)))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def _attention_grad_temp_bytes(mesh, method: str, T: int = 4096) -> int:
    """Temporary bytes per device of the gradient of one attention call over [1, T, 8, 64] queries."""
    cfg = config_lib.ModelConfig(attention="blockwise", attention_block=64, context_parallel=method)
    # Under the mesh the arguments and gradients are split along the sequence, as the model's activations are.
    split = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "sequence"))
    q = jax.ShapeDtypeStruct((1, T, 8, 64), jnp.float32, sharding=split)
    kv = jax.ShapeDtypeStruct((1, T, 4, 64), jnp.float32, sharding=split)
    pos = jax.ShapeDtypeStruct((1, T), jnp.int32, sharding=split)

    def loss(q, k, v, positions):
        return jnp.sum(attention.self_attention(q, k, v, positions, None, cfg).astype(jnp.float32) ** 2)

    def grads(*args):
        if mesh is None:
            return jax.grad(loss, argnums=(0, 1, 2))(*args)
        with sharding.activation_sharding(mesh):
            return jax.grad(loss, argnums=(0, 1, 2))(*args)

    return jax.jit(grads, out_shardings=split).lower(q, kv, kv, pos).compile().memory_analysis().temp_size_in_bytes


def _context4():
    return sharding.make_mesh(config_lib.MeshConfig(ici_data=1, ici_sequence=4), jax.devices()[:4])


def test_ring_attention_temporaries_per_device_fall_with_context_4():
    """At 4,096 tokens, float32: one device's blockwise gradient 25.4 MB; the ring's 9.4 MB per device (0.37):
    a quarter of the output cotangent, and as much again for each of the key/value block in hand, the one in
    flight and the travelling float32 dk, dv; all_gather's 23.2 MB (0.91: every device holds all keys and
    values and their gradients)."""
    mesh = _context4()
    whole = _attention_grad_temp_bytes(None, "ring")
    ring_bytes = _attention_grad_temp_bytes(mesh, "ring")
    gathered = _attention_grad_temp_bytes(mesh, "all_gather")
    assert ring_bytes < 0.4 * whole, (ring_bytes, whole)
    assert ring_bytes < 0.45 * gathered and gathered < whole, (ring_bytes, gathered, whole)


def _model_grad_temp_bytes(T: int) -> int:
    """Temporaries per device of the gradient of a 2-layer model (scanned layers, full remat) at T tokens, the
    sequence split 4 ways (ring attention)."""
    cfg = config_lib.ModelConfig(vocab_size=128, block_size=T, n_layers=2, n_heads=4, n_kv_heads=2, d_model=64,
                                 remat="full", attention="blockwise", attention_block=64, glu=True,
                                 activation="silu", norm="rmsnorm", position="rotary")
    mesh_cfg = config_lib.MeshConfig(ici_data=1, ici_sequence=4)
    mesh, rules = sharding.make_mesh(mesh_cfg, jax.devices()[:4]), sharding.rules_from_config(mesh_cfg)[1]
    params = jax.eval_shape(lambda: P.init(param_specs(cfg), jax.random.key(0), mesh))
    tokens = jax.ShapeDtypeStruct((1, T), jnp.int32, sharding=jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(None, "sequence")))

    def grads(p, x, y):
        with sharding.activation_sharding(mesh, rules):
            return jax.grad(lambda p: loss_fn(p, x, y, cfg))(p)

    return jax.jit(grads).lower(params, tokens, tokens).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_ring_train_step_temporaries_grow_linearly_with_length():
    """Per device, at 512, 1,024 and 2,048 tokens: each doubling adds about twice what the one before added
    (measured 2.21, 3.78, 6.84 MB: 1.96). Differentiating the scan over layers would precompute everything that
    depends only on positions and segment ids, every tile's mask among it, [T, T] per layer, unless the
    kernels tie them to q, k, v: untied, each doubling added about four times as much (6.1, 18.7, 67.6 MB)."""
    b1, b2, b4 = (_model_grad_temp_bytes(T) for T in (512, 1024, 2048))
    assert 1.7 < (b4 - b2) / (b2 - b1) < 2.3, (b1, b2, b4)


def test_describe_says_what_runs_under_the_mesh():
    cfg = config_lib.ModelConfig(block_size=4096, attention_block=512, context_parallel="all_gather")
    mesh = _context4()
    rules = sharding.rules_from_config(config_lib.MeshConfig(ici_data=1, ici_sequence=4))[1]
    assert attention.describe(cfg, "cpu", mesh=mesh, rules=rules) == (
        "attention all_gather context parallelism over 4 devices (model.context_parallel=all_gather: 1024 of 4096 "
        "tokens per device, blockwise tiles of 512)")
    # Rules that keep the sequence whole: the attention of one device, as without a mesh.
    whole = attention.describe(cfg, "cpu", mesh=mesh, rules={**rules, "length": ()})
    assert whole == attention.describe(cfg, "cpu") and whole.startswith("attention blockwise"), whole


@pytest.mark.slow
def test_checkpoints_restore_across_context_layouts(char_data, tmp_path):
    """A run with the sequence split 4 ways saves at steps 10 and 20; one device resumes its step 10 and repeats
    its losses, and every layout restores the same bits of each run's checkpoints."""
    common = {**LLAMA, "training.eval_interval": 0}
    train.train(tiny_config(char_data, tmp_path / "context", **common, **CONTEXT4), jax.devices(), log=lambda s: None)
    shutil.copytree(tmp_path / "context" / "checkpoints" / "10", tmp_path / "one" / "checkpoints" / "10")
    train.train(tiny_config(char_data, tmp_path / "one", **common, **{"mesh.ici_data": 1}), jax.devices()[:1],
                log=lambda s: None)
    a, b = train.losses_by_step(tmp_path / "context"), train.losses_by_step(tmp_path / "one")
    assert sorted(b) == list(range(11, 21))
    np.testing.assert_allclose([b[s] for s in range(11, 21)], [a[s] for s in range(11, 21)], rtol=1e-5)
    for name in ("context", "one"):
        hashes = set()
        for mesh, devices in ((CONTEXT4, 8), ({"mesh.ici_data": 1}, 1), ({"mesh.ici_sequence": 8, "mesh.ici_data": 1}, 8)):
            run = run_lib.setup(tiny_config(char_data, tmp_path / name, **common, **mesh), jax.devices()[:devices])
            hashes.add(_state_hash(ckpt.restore_newest(tmp_path / name, run.abstract_state, log=lambda s: None)[1]))
        assert len(hashes) == 1, name


def test_context_parallel_setting_errors_are_one_line(char_data, tmp_path):
    with pytest.raises(ConfigError, match="model.context_parallel='rign' is not allowed.*choose one of: ring, "
                                          "all_gather"):
        tiny_config(char_data, tmp_path, **{"model.context_parallel": "rign"})
    with pytest.raises(ConfigError, match="model.dropout=0.1 drops attention probabilities, which context "
                                          "parallelism"):
        tiny_config(char_data, tmp_path, **{"model.dropout": 0.1, "mesh.ici_sequence": 4})
    # a sequence split through mesh.rules (or a -1 that fills the sequence axis) is refused when the run is set up
    with pytest.raises(ConfigError, match=r"model.dropout=0.1 .*\(the sequence split over 2 devices by the mesh"):
        run_lib.setup(tiny_config(char_data, tmp_path, **{"model.dropout": 0.1, "model.attention": "dot_product",
                                                       "mesh.ici_data": 2, "mesh.ici_fsdp": 1,
                                                       "mesh.rules": "act.length=data;act.batch="}),
                   jax.devices()[:2])
    with pytest.raises(ConfigError, match="model.block_size=36 must be a multiple of 8"):
        _losses(char_data, tmp_path, jax.devices(), steps=1,
                **{**CONTEXT4, "model.block_size": 36, "model.sliding_window": None, "model.layer_pattern": "global"})
