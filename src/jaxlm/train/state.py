"""The train state: its layout ({params, opt_state, step, guard}), its abstract shapes and shardings (nothing
allocated), and its sharded initialization: fresh from a seed, from a converted model or another run
(checkpoint.init_from), or a restored one given a fresh optimizer; a LoRA run's frozen base and the weights the
forward pass takes. `run` is the run's settings (run.Run).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlm import params as P, sharding
from jaxlm.model import lora, quant
from jaxlm.train import optim
from jaxlm.config import Config
from jaxlm.model import param_specs


def _init_guard() -> dict:
    """Scalars the train step keeps about updates it refused: the running loss average (0 = none yet), how
    many steps were skipped for a NaN/inf loss or gradient norm or for a loss spike, and the current run of
    non-finite steps. They live in the state so a resumed run continues them exactly."""
    i32 = lambda: jnp.zeros((), jnp.int32)  # noqa: E731
    return {"loss_avg": jnp.zeros((), jnp.float32), "nonfinite_skips": i32(), "spike_skips": i32(),
            "skips_in_a_row": i32()}


def _init_state_fn(optimizer):
    return lambda params: {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32),
                           "guard": _init_guard()}


def placed(specs, mesh, param_rules=sharding.PARAM_RULES) -> dict:
    """Shapes, dtypes and shardings of the weights `specs` declares (nothing allocated)."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), P.abstract(specs),
                        P.shardings(specs, mesh, param_rules))


def make_abstract_state(specs, mesh, optimizer, param_rules=sharding.PARAM_RULES) -> dict:
    """Shapes, dtypes and shardings of the full train state, derived without allocating it. Optimizer
    moments take the sharding of the parameter they belong to (found by tree path), so FSDP and tensor
    parallelism shard them too; scalars such as step counts are replicated."""
    p_abstract = placed(specs, mesh, param_rules)
    by_path = {jax.tree_util.keystr(path): a for path, a in jax.tree_util.tree_flatten_with_path(p_abstract)[0]}
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def place(path, leaf):
        key = jax.tree_util.keystr(path)
        for p_key, p in by_path.items():
            if key.endswith(p_key) and leaf.shape == p.shape:
                return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=p.sharding)
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=replicated)

    shapes = jax.eval_shape(_init_state_fn(optimizer), p_abstract)
    return jax.tree_util.tree_map_with_path(place, shapes)


def shardings_of(abstract_tree):
    return jax.tree.map(lambda a: a.sharding, abstract_tree)


def _state_from_params(run):
    """params -> the train state around them. The weights are donated: they become the state's own, not a copy
    beside it (maxtext_base's float32 weights and copy with the Adam moments took 16.45 GiB, more than its step)."""
    return jax.jit(_init_state_fn(run.optimizer), out_shardings=shardings_of(run.abstract_state), donate_argnums=0)


def init_state(run, seed: int) -> dict:
    """A fresh state: the weights (a LoRA run's adapters) initialized from `seed`, the optimizer's state."""
    params = P.init(run.specs, jax.random.key(seed), run.mesh, run.param_rules)
    return _state_from_params(run)(params)


def with_fresh_optimizer(run, state: dict) -> dict:
    """A restored train state without optimizer state (checkpoint.restore_without_optimizer) completed by a fresh
    one whose learning-rate schedule stands at the updates the weights have had (steps minus skipped ones)."""
    applied = state["step"] - state["guard"]["nonfinite_skips"] - state["guard"]["spike_skips"]
    init = jax.jit(lambda p, n: optim.schedule_at(run.optimizer.init(p), n),
                   out_shardings=shardings_of(run.abstract_state["opt_state"]))
    return {**state, "opt_state": init(state["params"], applied)}


def init_state_from(run, path: str) -> dict:
    """Weights from a converted checkpoint or another run (fine-tuning), fresh optimizer state, step 0. A LoRA
    run takes its base from there (load_frozen) and starts fresh adapters, unless the folder holds an imported
    adapter (`jaxlm convert from-hf ... --adapter`), which it goes on training."""
    from jaxlm.store import weights

    if lora.enabled(run.cfg):
        if not weights.has_adapter_dir(path):
            return init_state(run, run.cfg.seed)
        params = weights.restore_adapters(path, run.cfg, lambda tree: shardings_of(run.abstract_state["params"]))
    else:
        params = weights.restore_params(path, run.abstract_state["params"])
    return _state_from_params(run)(params)


def load_frozen(run) -> dict | None:
    """A LoRA run's frozen base, placed and (QLoRA) quantized as run.abstract_frozen says; None otherwise. Each
    weight is read on the host and placed on its own, and each quantized one a layer at a time: read, quantized
    on the devices, written into its place in the stacked result. The devices hold the quantized base and one
    layer of one float weight, never the float base (16 GB for llama3.1-8b in bf16: more than a 16 GiB chip)."""
    from jaxlm.store import weights

    if run.abstract_frozen is None:
        return None
    path, cfg = run.cfg.checkpoint.init_from, run.cfg
    dense = placed(param_specs(cfg.model), run.mesh, run.param_rules)
    replicated = jax.sharding.NamedSharding(run.mesh, jax.sharding.PartitionSpec())
    read = weights.piece_reader(path, replicated, merged=not weights.has_adapter_dir(path))
    quantized = {("layers", blk, name) for blk, name in lora.quantized_weights(cfg)}
    dense_by_keys = dict(_leaves(dense))

    def load(path_, frozen_a):
        keys = _keys(path_)
        if keys in quantized:
            return _quantized_by_layer(read, keys, dense_by_keys[keys], frozen_a, cfg.lora.base_quantization)
        return read(keys, None, dense_by_keys[keys], frozen_a.dtype)

    return jax.tree_util.tree_map_with_path(load, run.abstract_frozen,
                                            is_leaf=lambda a: isinstance(a, (quant.QWeight, quant.NF4Weight)))


def _quantized_by_layer(read, keys: tuple, dense_a, frozen_a, mode: str):
    """One stacked weight quantized a layer at a time into a result placed as frozen_a (a QWeight or NF4Weight
    of ShapeDtypeStructs): each layer is read as dense_a says (the restored dtype), quantized on the devices and
    written in place into the result (donated)."""
    sharded = lambda sh: sh.update(spec=jax.sharding.PartitionSpec(None, *sh.spec[1:]))  # noqa: E731  a layer
    layer = jax.ShapeDtypeStruct((1, *dense_a.shape[1:]), dense_a.dtype, sharding=sharded(dense_a.sharding))
    quantize = jax.jit(lambda w: lora.quantize_weight(w, keys[-1], mode),
                       out_shardings=jax.tree.map(lambda a: sharded(a.sharding), frozen_a))
    put = jax.jit(lambda out, piece, i: jax.tree.map(lambda o, p: jax.lax.dynamic_update_slice_in_dim(o, p, i, 0),
                                                     out, piece), donate_argnums=0)
    out = jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), frozen_a),
                  out_shardings=shardings_of(frozen_a))()
    for i in range(dense_a.shape[0]):
        out = put(out, quantize(read(keys, slice(i, i + 1), layer, dense_a.dtype)), i)
    return out


def _keys(path) -> tuple[str, ...]:
    """A tree path as the names Orbax stores its leaf under."""
    return tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _leaves(tree) -> list[tuple[tuple[str, ...], object]]:
    return [(_keys(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def model_params(params: dict, frozen: dict | None, cfg: Config, key: jax.Array | None = None) -> dict:
    """The weights the forward pass takes: the trained ones, or a LoRA run's adapters attached to the frozen base
    (with `key`, for the adapters' dropout)."""
    if frozen is None:
        return params
    return lora.attach(frozen, params, cfg, None if key is None else jax.random.fold_in(key, LORA_DROPOUT_SALT))


LORA_DROPOUT_SALT = 0x10A  # the adapters' dropout keys, apart from the model's own (model.dropout)
