"""The train step and what it runs on: the run's resolved settings (data, vocabulary, mesh, shardings), the
train state and its abstract shapes, sharded initialization or restore of the weights, the jitted train and
eval steps, and the batches they take. `jaxlm train` (train.py, the loop), `jaxlm compile` (aot.py), `jaxlm eval`
and the benchmarks import it.

Flow: config -> data + vocab -> mesh -> abstract state (shapes + shardings, nothing allocated) -> restore or
sharded init -> jitted steps. What the step minimizes is the run's objective (objectives.py,
`training.objective`); the step itself never names a loss.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxlm import config as config_lib
from jaxlm import params as P, runtime, sharding, storage
from jaxlm.infer import generate
from jaxlm.model import lora
from jaxlm.train import metrics, objectives, optim
from jaxlm.config import Config, ConfigError
from jaxlm.data import loader as loader_lib, mixture, packing, preference, prepare, tokenizer as tokenizer_lib
from jaxlm.model import param_specs, ring, transformer


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. the loss stays NaN, a reward function fails); the message says at which step
    and why."""


@dataclasses.dataclass
class Run:
    """Everything a training run needs, resolved from the config before anything is compiled."""

    cfg: Config
    run_dir: Path | str  # a local path, or a URL (storage.py) for storage every host sees
    # None only for an ahead-of-time compile that needs no data
    dataset: loader_lib.Dataset | mixture.MixtureDataset | None
    mesh: jax.sharding.Mesh
    param_rules: sharding.Rules
    act_rules: sharding.Rules
    specs: dict  # the trained weights: the model's, or a LoRA run's adapters
    optimizer: optax.GradientTransformation
    abstract_state: dict
    tokenizer: tokenizer_lib.Tokenizer | None = None  # None only where there is no dataset (a compile)
    # A LoRA run's frozen base as it is stored (lora.frozen_specs), with its shardings; None otherwise.
    abstract_frozen: dict | None = None
    # A dpo/ipo run's reference log-probabilities per split, one float32 per token of the split (reference.py);
    # set once its pass has run, None otherwise.
    reference: dict | None = None


def resolve_data_dir(cfg: Config) -> Path:
    return Path(cfg.data.dir) if cfg.data.dir else Path("data") / cfg.data.dataset


# Steps dispatched ahead of the host before it waits for the oldest: enough to keep any device busy, few
# enough to bound the memory of queued batches (and XLA:CPU's in-process collectives can stall when many
# multi-device steps are queued at once).
def setup(cfg: Config, devices=None, data: bool = True) -> Run:
    """Check data, vocabulary, mesh and shardings; fails with a ConfigError/DataError before compiling.
    data=False (`jaxlm compile`) leaves the corpus alone unless the vocabulary size must come from it."""
    dataset, tokenizer = None, None
    if cfg.training.objective == "grpo":  # prompts instead of a token dataset (rl.py)
        if cfg.model.vocab_size is None:
            raise ConfigError("training.objective=grpo needs model.vocab_size: train the model's own config "
                              "(`jaxlm train FOLDER/config.json`) or set it")
        if data:
            tokenizer = rollout_tokenizer(cfg)
    elif data or cfg.model.vocab_size is None:
        if cfg.data.mixture:
            dataset = mixture.MixtureDataset(config_lib.parse_mixture(cfg.data.mixture))
            data_dir = dataset.dir
        else:
            data_dir = prepare.ensure_prepared(cfg.data.dataset, resolve_data_dir(cfg), cfg.data.input)
            dataset = loader_lib.Dataset(data_dir)
        if check_objective_data(cfg, dataset):
            for split in dataset.splits.values():
                preference.check_fits(split, cfg.model.block_size)
        else:
            dataset.check_block_size(cfg.model.block_size)
        vocab = cfg.model.vocab_size
        if vocab is None:
            cfg = cfg.replace(model=dataclasses.replace(cfg.model, vocab_size=dataset.vocab_size))
        elif vocab < dataset.vocab_size:
            raise ConfigError(f"model.vocab_size={vocab} is smaller than the data's vocabulary "
                              f"({dataset.vocab_size}, from {data_dir / 'meta.json'})")
        if cfg.data.packing and (flat := dataset.without_documents()) is not None:
            raise loader_lib.DataError(f"data.packing=true needs document boundaries, and {flat} has none (a "
                                       f"format-1 train.bin/val.bin); prepare it again with `jaxlm prepare`, or "
                                       f"set data.packing=false")
        if data:
            tokenizer = run_tokenizer(cfg, dataset)  # a dataset prepared with another tokenizer stops here
    if tokenizer is not None and cfg.training.sample_tokens:  # the end-of-training sample would fail hours from now
        try:
            tokenizer.encode(cfg.training.sample_prompt)
        except tokenizer_lib.TokenizerError as e:
            raise ConfigError(f"training.sample_prompt={cfg.training.sample_prompt!r} cannot be encoded: "
                              f"{e}") from None
    if data and lora.enabled(cfg) and not cfg.checkpoint.init_from:
        raise ConfigError(f"lora.rank={cfg.lora.rank} trains adapters on frozen base weights; give them with "
                          "checkpoint.init_from=FOLDER (a `jaxlm convert from-hf` output or a run directory)")
    if data and cfg.checkpoint.init_from and not Path(cfg.checkpoint.init_from).is_dir():
        raise ConfigError(f"checkpoint.init_from={cfg.checkpoint.init_from!r} is not a folder; give a run "
                          f"directory or a `jaxlm convert from-hf` output")
    cfg = cfg.replace(model=config_lib.apply_parameter_scale(cfg.model),
                      data=dataclasses.replace(cfg.data, loss_mask=resolve_loss_mask(cfg, dataset)))
    mesh = sharding.make_mesh(cfg.mesh, devices)
    if mesh.devices.flat[0].platform == "cpu":
        runtime.tune_for_xla_cpu()  # keep each step's scratch memory mapped between steps
    runtime.use_compilation_cache(cfg.compile.cache_dir)
    param_rules, act_rules = sharding.rules_from_config(cfg.mesh)
    n = ring.context_devices(mesh, act_rules)
    if cfg.model.dropout > 0 and n > 1:  # a -1 (filled) sequence axis or mesh.rules can split it too
        raise ConfigError(f"model.dropout={cfg.model.dropout} drops attention probabilities, which context parallelism "
                          f"(the sequence split over {n} devices by the mesh and mesh.rules) does not; set "
                          f"model.dropout=0 or keep the `length` axis on one device")
    cfg = cfg.replace(training=resolve_batch(cfg.training, mesh, act_rules))
    if cfg.logging.wandb:
        metrics.require_wandb()
    specs = lora.specs(cfg) if lora.enabled(cfg) else param_specs(cfg.model)
    optimizer = optim.make(cfg.optimizer, cfg.training.steps, None if lora.enabled(cfg) else specs, mesh, param_rules)
    abstract_state = make_abstract_state(specs, mesh, optimizer, param_rules)
    abstract_frozen = placed(lora.frozen_specs(cfg), mesh, param_rules) if lora.enabled(cfg) else None
    run_dir = resolve_run_dir(cfg)
    return Run(cfg, run_dir, dataset, mesh, param_rules, act_rules, specs, optimizer, abstract_state, tokenizer,
               abstract_frozen)


def check_objective_data(cfg: Config, dataset) -> bool:
    """Whether the run trains on preference pairs; a preference objective on other data, or other objectives on
    pairs, stop here in one line."""
    objective = cfg.training.objective
    folders = dataset.datasets if isinstance(dataset, mixture.MixtureDataset) else [dataset]
    pairs = [preference.is_preference(ds.meta) for ds in folders]
    if objective in objectives.PREFERENCE and not all(pairs):
        raise loader_lib.DataError(f"training.objective={objective} trains on preference pairs, and {dataset.dir} "
                                   f"holds none (its meta.json has no kind=preference); prepare them with `jaxlm "
                                   f"prepare preference`")
    if objective not in objectives.PREFERENCE and any(pairs):
        where = folders[pairs.index(True)].dir
        raise loader_lib.DataError(f"{where} holds preference pairs (`jaxlm prepare preference`), which "
                                   f"training.objective={objective} does not read; train on them with "
                                   f"training.objective=dpo, ipo or orpo")
    return objective in objectives.PREFERENCE


def run_tokenizer(cfg: Config, dataset) -> tokenizer_lib.Tokenizer:
    """The run's tokenizer by the precedence of data/tokenizer.py: data.tokenizer, else the tokenizer/ folder of
    the converted model the run starts from (checkpoint.init_from, followed back through runs fine-tuned from
    it), else the dataset's meta.json. The dataset must have been prepared with it: one line otherwise."""
    from jaxlm.store import convert

    init = cfg.checkpoint.init_from
    model_tok = convert.tokenizer_source(Path(init), cfg) if init and Path(init).is_dir() else None
    if model_tok is not None and not any((model_tok / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        model_tok = None  # weights imported without tokenizer files: the dataset's tokenizer is the run's
    try:
        return tokenizer_lib.resolve(cfg.data.tokenizer, model_tok, dataset.meta, dataset=f"the dataset {dataset.dir}")
    except tokenizer_lib.TokenizerError as e:
        raise ConfigError(str(e)) from None


def rollout_tokenizer(cfg: Config) -> tokenizer_lib.Tokenizer:
    """A GRPO run's tokenizer: data.tokenizer, else the converted model's (checkpoint.init_from), else the one
    recorded by the prepared data in data.dir / data.dataset (the data the model was trained on)."""
    from jaxlm.store import convert

    init = cfg.checkpoint.init_from
    model_tok = convert.tokenizer_source(Path(init), cfg) if init and Path(init).is_dir() else None
    meta_file = resolve_data_dir(cfg) / "meta.json"
    meta = loader_lib.read_meta(meta_file.parent) if meta_file.is_file() and not model_tok else None
    try:
        return tokenizer_lib.resolve(cfg.data.tokenizer, model_tok, meta, dataset=f"the dataset {meta_file.parent}")
    except tokenizer_lib.TokenizerError as e:
        raise ConfigError(str(e)) from None


def resolve_loss_mask(cfg: Config, dataset: loader_lib.Dataset | None) -> str:
    """data.loss_mask as the step will use it, "on" or "off": auto follows the dataset (its meta.json alone
    when the corpus is not opened, as for `jaxlm compile`; no dataset at all reads as none)."""
    setting = cfg.data.loss_mask
    if cfg.training.objective in objectives.PREFERENCE:  # pairs are scored on their replies, which the mask marks
        return "on"
    if setting == "off" or cfg.training.objective == "grpo":  # rollouts weigh their completion tokens themselves
        return "off"
    if dataset is not None:
        has, where = dataset.has_loss_mask, dataset.dir
    else:
        folders = ([Path(p) for p, _ in config_lib.parse_mixture(cfg.data.mixture)] if cfg.data.mixture
                   else [resolve_data_dir(cfg)])
        where = folders[0]
        has = all((d / "meta.json").is_file() and bool(loader_lib.read_meta(d).get("has_loss_mask")) for d in folders)
    if setting == "on" and not has:
        raise loader_lib.DataError(f"data.loss_mask=on but {where} has no loss mask; prepare chat data with "
                                   f"`jaxlm prepare chat`, or set data.loss_mask=auto")
    return "on" if has else "off"


def batch_keys(cfg: Config) -> tuple[str, ...]:
    """The arrays of this run's batches (loader.batch_keys); the plain path takes inputs and targets only.
    Preference pairs always come as segments with weights (data/preference.py), plus the reference model's
    log-probabilities (float32 "ref_logps") when the batches carry them (reference_in_batch). GRPO's rollouts
    (rl.py) add each token's advantage and, when the objective needs them, the old policy's and the reference
    model's log-probabilities."""
    if cfg.training.objective in objectives.PREFERENCE:
        return loader_lib.batch_keys(True, True) + (("ref_logps",) if reference_in_batch(cfg) else ())
    if cfg.training.objective == "grpo":
        g = cfg.grpo
        return (("inputs", "targets", "weights", "advantages") + (("old_logps",) if g.iterations > 1 else ())
                + (("ref_logps",) if g.beta > 0 and not lora.enabled(cfg) else ()))
    return loader_lib.batch_keys(cfg.data.packing, cfg.data.loss_mask == "on")


def reference_in_batch(cfg: Config) -> bool:
    """Whether the run's batches carry the reference model's log-probabilities, computed once before training
    (reference.py): dpo and ipo, except in a LoRA run, whose base (the adapters switched off) is the reference."""
    return cfg.training.objective in objectives.NEEDS_REFERENCE and not lora.enabled(cfg)


def resolve_run_dir(cfg: Config) -> Path | str:
    """A local Path (file:// URLs included), or the URL of another filesystem, checked to be usable."""
    if not cfg.run_dir:
        return Path("outputs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    local = storage.local_path(cfg.run_dir)
    if local is not None:
        return local
    storage.check_reachable(cfg.run_dir)  # no filesystem for the scheme, or no way to reach it: one line, here
    if cfg.checkpoint.enabled and not cfg.debug:
        storage.orbax_dir(storage.join(cfg.run_dir, "checkpoints"))  # a URL Orbax cannot write to fails here too
    return cfg.run_dir


def resolve_batch(t: config_lib.TrainingConfig, mesh, act_rules) -> config_lib.TrainingConfig:
    """Global batch from per_device_batch_size (if set) and a check that the batch splits over the mesh."""
    n_dev = mesh.devices.size
    if t.per_device_batch_size is not None:
        global_batch = t.per_device_batch_size * n_dev
        if abs(global_batch - round(global_batch)) > 1e-9:
            raise ConfigError(f"training.per_device_batch_size={t.per_device_batch_size} times {n_dev} devices is "
                              f"{global_batch:g}, not a whole number of sequences")
        t = dataclasses.replace(t, batch_size=int(round(global_batch)))
    split = sharding.batch_split(mesh, act_rules)
    if t.batch_size % split:
        raise ConfigError(f"training.batch_size={t.batch_size} must be a multiple of the {split} devices that split "
                          f"the batch (mesh axes {sharding.spec(('batch',), act_rules)[0]})")
    return dataclasses.replace(t, per_device_batch_size=t.batch_size / n_dev)


# Running average of the loss for spike detection: an exponential average over about the last 100 steps.
LOSS_AVG_DECAY = 0.99


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


def init_state(run: Run, seed: int) -> dict:
    """A fresh state: the weights (a LoRA run's adapters) initialized from `seed`, the optimizer's state."""
    params = P.init(run.specs, jax.random.key(seed), run.mesh, run.param_rules)
    init = jax.jit(_init_state_fn(run.optimizer), out_shardings=shardings_of(run.abstract_state))
    return init(params)


def with_fresh_optimizer(run: Run, state: dict) -> dict:
    """A restored train state without optimizer state (checkpoint.restore_without_optimizer) completed by a fresh
    one whose learning-rate schedule stands at the updates the weights have had (steps minus skipped ones)."""
    applied = state["step"] - state["guard"]["nonfinite_skips"] - state["guard"]["spike_skips"]
    init = jax.jit(lambda p, n: optim.schedule_at(run.optimizer.init(p), n),
                   out_shardings=shardings_of(run.abstract_state["opt_state"]))
    return {**state, "opt_state": init(state["params"], applied)}


def init_state_from(run: Run, path: str) -> dict:
    """Weights from a converted checkpoint or another run (fine-tuning), fresh optimizer state, step 0. A LoRA
    run takes its base from there (load_frozen) and starts fresh adapters, unless the folder holds an imported
    adapter (`jaxlm convert from-hf ... --adapter`), which it goes on training."""
    from jaxlm.store import convert

    if lora.enabled(run.cfg):
        if not convert.has_adapter_dir(path):
            return init_state(run, run.cfg.seed)
        params = convert.restore_adapters(path, run.cfg, lambda tree: shardings_of(run.abstract_state["params"]))
    else:
        params = convert.restore_params(path, run.abstract_state["params"])
    init = jax.jit(_init_state_fn(run.optimizer), out_shardings=shardings_of(run.abstract_state))
    return init(params)


def load_frozen(run: Run) -> dict | None:
    """A LoRA run's frozen base, placed and (QLoRA) quantized as run.abstract_frozen says; None otherwise."""
    from jaxlm.store import convert

    if run.abstract_frozen is None:
        return None
    path, cfg = run.cfg.checkpoint.init_from, run.cfg
    dense = placed(param_specs(cfg.model), run.mesh, run.param_rules)
    base = (convert.restore_base_params(path, convert.load_config(path), dense) if convert.has_adapter_dir(path)
            else convert.restore_params(path, dense))
    quantize = jax.jit(lambda p: lora.quantize_base(p, cfg),
                       out_shardings=shardings_of(run.abstract_frozen))
    return quantize(base)


def model_params(params: dict, frozen: dict | None, cfg: Config, key: jax.Array | None = None) -> dict:
    """The weights the forward pass takes: the trained ones, or a LoRA run's adapters attached to the frozen base
    (with `key`, for the adapters' dropout)."""
    if frozen is None:
        return params
    return lora.attach(frozen, params, cfg, None if key is None else jax.random.fold_in(key, LORA_DROPOUT_SALT))


LORA_DROPOUT_SALT = 0x10A  # the adapters' dropout keys, apart from the model's own (model.dropout)


def loss_and_grads(objective: objectives.Objective, params, batch: dict, cfg: Config, key, frozen: dict | None = None
                   ) -> tuple[tuple[jax.Array, dict], dict]:
    """((loss, metrics), gradient) of the step from a batch of [A, B, T] arrays, accumulating A micro-batches by
    scan. The objective's units over the whole step / A are every micro-batch's normalizer (objectives.py), so
    the mean over micro-batches is exactly the mean over the step's units, however unevenly they fall (a
    micro-batch with few counted tokens weighs no more than its tokens). The sums run over the global batch, so
    the same holds across devices. With a LoRA run's `frozen` base, `params` are the adapters, the only weights
    differentiated."""
    A = batch["inputs"].shape[0]
    units = objective.units(batch, cfg)
    normalizer = None if units is None else jnp.maximum(units, 1e-9) / A
    loss = objective.loss if frozen is None else (
        lambda p, b, c, k: objective.loss(model_params(p, frozen, c, k), b, c, k))
    grad_fn = jax.value_and_grad(loss, has_aux=True)

    def micro_grads(b, k):
        return grad_fn(params, b if normalizer is None else {**b, "normalizer": normalizer}, cfg, k)

    if A == 1:
        return micro_grads(jax.tree.map(lambda v: v[0], batch), key)

    def micro(acc, inputs):
        b, i = inputs
        return jax.tree.map(jnp.add, acc, micro_grads(b, jax.random.fold_in(key, i))), None

    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(micro_grads, jax.tree.map(lambda v: v[0], batch), key))
    out, _ = jax.lax.scan(micro, zeros, (batch, jnp.arange(A)))
    return jax.tree.map(lambda g: g / A, out)


def zigzag_batch(batch: dict, mesh, act_rules) -> dict:
    """The batch [A, B, T] in zig-zag order along the sequence when the mesh splits it over n devices (context
    parallelism, model/ring.py): device i gets chunks i and 2n-1-i of every row, so causal attention gives every
    device the same work. Positions become explicit; everything but attention works token by token and
    attention masks by position and segment id, so only the order in which the loss sums its terms changes."""
    n = ring.context_devices(mesh, act_rules)
    if n == 1:
        return batch
    A, B, T = batch["inputs"].shape
    if T % (2 * n):
        raise ConfigError(f"model.block_size={T} must be a multiple of {2 * n} (twice the {n} devices that split the "
                          f"sequence, mesh.ici_sequence x mesh.dcn_sequence) for context parallelism")
    order = ring.zigzag_order(T, n)
    # One reordering of all the arrays stacked, not one per array: the single exchange feeds the embedding, so
    # every device makes it before any other collective. Separate exchanges (one for the targets, only needed
    # at the loss) may run in different orders on different devices, and XLA:CPU's in-process collectives then
    # wait on each other for ever.
    keys = list(batch)
    as_int = [jax.lax.bitcast_convert_type(batch[k], jnp.int32) for k in keys]
    moved = jnp.stack(as_int)[..., order]
    out = {k: jax.lax.bitcast_convert_type(moved[i], batch[k].dtype) for i, k in enumerate(keys)}
    if "positions" not in out:  # positions 0..T-1 in the new order: no exchange needed
        out["positions"] = jnp.broadcast_to(jnp.asarray(order, jnp.int32), (A, B, T))
    return out


def make_train_step(cfg: Config, optimizer, mesh, abstract_state, act_rules=sharding.ACTIVATION_RULES) -> Callable:
    """(state, batch) -> (state, metrics); batch: dict of [A, B, T] arrays (batch_keys), A micro-batches
    accumulated (loss_and_grads).

    A step whose loss or gradient norm is NaN/inf, or (with training.spike_threshold) whose loss exceeds
    that multiple of the running average, is not applied: params and optimizer state come out bit-for-bit
    as they went in. `step` still advances (the batch was consumed, and data order and dropout keys follow
    `step`); the optimizer's own count does not, so its schedule runs one step behind `step` per skip, and
    the `lr` metric reports the rate the optimizer used. Metrics: loss, grad_norm, lr, loss_avg and the
    guard counters nonfinite_skips, spike_skips, skips_in_a_row (totals after this step)."""
    objective = objectives.get(cfg.training.objective)
    o = cfg.optimizer
    lr_at = optim.schedule(o, cfg.training.steps)
    muon_lr_at = optim.schedule(o, cfg.training.steps, o.muon_lr) if o.name == "muon" and o.muon_lr else None
    spike = cfg.training.spike_threshold
    base_key = jax.random.key(cfg.seed + 1)
    pipeline = (cfg.training.pipeline_microbatches, cfg.training.pipeline_repeats)
    param_rules = sharding.rules_from_config(cfg.mesh)[0]

    def step_fn(state, batch, frozen=None):
        params = state["params"]
        key = jax.random.fold_in(base_key, state["step"])
        batch = zigzag_batch(batch, mesh, act_rules)
        with sharding.activation_sharding(mesh, act_rules, pipeline, param_rules):
            (loss, extra), grads = loss_and_grads(objective, params, batch, cfg, key, frozen)
            top_LN = attention_logit_max(params, batch, cfg) if o.qk_clip else None
        grad_norm = optax.tree.norm(grads)
        guard = state["guard"]
        avg = guard["loss_avg"]
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        spiked = finite & (avg > 0) & (loss > spike * avg) if spike else jnp.zeros((), bool)
        apply = finite & ~spiked
        updates, opt_state = optimizer.update(grads, state["opt_state"], params)
        keep = lambda new, old: jnp.where(apply, new, old)  # noqa: E731 - a select, fused into the update
        # A spike enters the average only up to the threshold, so a lasting rise in the loss is followed
        # within some tens of steps instead of being skipped for ever.
        seen = jnp.minimum(loss, spike * avg) if spike else loss
        new_guard = {
            "loss_avg": jnp.where(finite, jnp.where(avg > 0, LOSS_AVG_DECAY * avg + (1 - LOSS_AVG_DECAY) * seen, loss),
                                  avg),
            "nonfinite_skips": guard["nonfinite_skips"] + (~finite).astype(jnp.int32),
            "spike_skips": guard["spike_skips"] + spiked.astype(jnp.int32),
            "skips_in_a_row": jnp.where(finite, 0, guard["skips_in_a_row"] + 1),
        }
        new_params = optax.apply_updates(params, updates)
        if top_LN is not None:
            extra = {**extra, **logit_max_metrics(top_LN, o.qk_clip)}
            new_params = transformer.clip_qk(new_params, top_LN, o.qk_clip, cfg.model)
        if muon_lr_at is not None:
            extra = {**extra, "muon_lr": muon_lr_at(state["step"] - guard["nonfinite_skips"] - guard["spike_skips"])}
        new_state = {"params": jax.tree.map(keep, new_params, params),
                     "opt_state": jax.tree.map(keep, opt_state, state["opt_state"]),
                     "step": state["step"] + 1, "guard": new_guard}
        applied_before = state["step"] - guard["nonfinite_skips"] - guard["spike_skips"]
        return new_state, {"loss": loss, "grad_norm": grad_norm, "lr": lr_at(applied_before),
                           "loss_avg": avg, **{k: new_guard[k] for k in ("nonfinite_skips", "spike_skips",
                                                                         "skips_in_a_row")}, **extra}

    state_sh = shardings_of(abstract_state)
    return jax.jit(step_fn, donate_argnums=0, out_shardings=(state_sh, None))


def attention_logit_max(params: dict, batch: dict, cfg: Config) -> jax.Array:
    """The largest attention logit of each layer's query heads over all the step's micro-batches [L, N]."""
    def one(b):
        return transformer.attention_logit_max(params, b["inputs"], cfg.model, b.get("positions"),
                                               b.get("segment_ids"))

    return jnp.max(jax.lax.map(one, batch), axis=0)


def logit_max_metrics(top_LN: jax.Array, threshold: float) -> dict:
    """attn_logit_max/<layer>: each layer's largest attention logit; qk_clipped_heads: how many heads exceeded
    the threshold and were scaled down."""
    return {**{f"attn_logit_max/{i}": top_LN[i].max() for i in range(top_LN.shape[0])},
            "qk_clipped_heads": jnp.sum(top_LN > threshold)}


def step_args(run: Run) -> dict:
    """The abstract arguments of the run's train step, by name: what `jaxlm compile` lowers it for and what a
    saved step's signature lists."""
    args = {"state": run.abstract_state, "batch": abstract_batch(run)}
    return args if run.abstract_frozen is None else {**args, "frozen": run.abstract_frozen}


def abstract_batch(run: Run) -> dict[str, jax.ShapeDtypeStruct]:
    """Shape, dtype and sharding of a train step's batch arrays [A, B, T], as device_batch makes them."""
    t = run.cfg.training
    shape = (t.grad_accum, t.batch_size, run.cfg.model.block_size)
    sh = sharding.batch_sharding(run.mesh, 3, 1, run.act_rules)
    return {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k in FLOAT_KEYS else jnp.int32, sharding=sh)
            for k in batch_keys(run.cfg)}


FLOAT_KEYS = ("weights", "ref_logps", "advantages", "old_logps")  # the batch's float32 arrays; the others int32


def lower_train_step(run: Run) -> jax.stages.Lowered:
    """The train step lowered from abstract shapes, nothing allocated: what `jaxlm compile` compiles for a
    target, and what a step saved by it must match to replace make_train_step's jit in `train`."""
    step = make_train_step(run.cfg, run.optimizer, run.mesh, run.abstract_state, run.act_rules)
    return step.lower(*step_args(run).values())
def make_eval_step(cfg: Config, mesh, act_rules=sharding.ACTIVATION_RULES) -> Callable:
    """(params, batch of [B, T] arrays) -> (loss, metrics, units): the objective's mean over the batch's units
    (objectives.py) and how many there were, to weigh it against other batches."""
    objective = objectives.get(cfg.training.objective)
    pipeline = (cfg.training.pipeline_microbatches, cfg.training.pipeline_repeats)
    param_rules = sharding.rules_from_config(cfg.mesh)[0]

    def eval_fn(params, batch, frozen=None):
        with sharding.activation_sharding(mesh, act_rules, pipeline, param_rules):
            loss, extra = objective.loss(model_params(params, frozen, cfg), batch, cfg, None)
        return loss, extra, objectives.units_or_tokens(objective, batch, cfg)

    return jax.jit(eval_fn)


def put_batch(mesh, x: np.ndarray, leading: int, act_rules=sharding.ACTIVATION_RULES) -> jax.Array:
    """A host array that every process holds in full -> a global array on the mesh."""
    return jax.device_put(x, sharding.batch_sharding(mesh, x.ndim, leading, act_rules))


def device_batch(run: Run, split: str, plan) -> dict[str, jax.Array]:
    """The batch a loader planned (loader.Windows, packing.Packed or mixture.MixedPlan; [A, B] or [B] rows) as
    global arrays on the mesh. Every process reads from the shards only the rows (and, for random windows with sequence
    parallelism, the columns) of its own devices."""
    lead = plan.shape
    sh = sharding.batch_sharding(run.mesh, len(lead) + 1, len(lead) - 1, run.act_rules)
    data, T, keys = run.dataset.splits[split], run.cfg.model.block_size, batch_keys(run.cfg)
    extra = {}
    if "ref_logps" in keys:
        if run.reference is None:
            raise ConfigError(f"training.objective={run.cfg.training.objective} reads the reference model's "
                              "log-probabilities, which have not been computed for this run (reference.ensure)")
        extra["reference"] = run.reference[split]
    read: dict = {}

    def make(key: str) -> jax.Array:
        def shard(index) -> np.ndarray:
            at = (tuple((s.start, s.stop) for s in index[:-1]), index[-1].start, index[-1].stop)
            if at not in read:  # one read per device shard serves all the batch's arrays
                read[at] = plan.read(data, index[:-1], index[-1], keys, T, **extra)
            return read[at][key]

        return jax.make_array_from_callback(lead + (T,), sh, shard)

    return {k: make(k) for k in keys}


class LoaderBatches:
    """The train split's batches, planned by the run's loader and placed on the mesh: what the loop steps
    through; their position (state, restore) goes into checkpoints, and `evaluate` measures the held-out
    batches. An objective that makes its batches itself (reinforcement learning's rollouts from the state's
    weights, rl.RolloutBatches) is a source of the same shape."""

    def __init__(self, run: Run, frozen: dict | None = None):
        self.run, self.frozen, self.loader = run, frozen, make_loader(run)
        self._eval = None

    def next(self, state: dict) -> dict[str, jax.Array]:
        return device_batch(self.run, "train", self.loader.next())

    def state(self) -> dict:
        return self.loader.state()

    def restore(self, position: dict) -> None:
        self.loader.restore(position)

    def boundary(self, step: int) -> bool:
        """Whether the run may stop or save after `step` steps: after any."""
        return True

    def metrics(self) -> dict:
        """The host's figures of the last batch (none for data from a loader)."""
        return {}

    def evaluate(self, state: dict) -> dict:
        """train_loss and val_loss over the fixed held-out batches (and the objective's metrics, val_<name>)."""
        if self._eval is None:
            self._eval = make_eval_step(self.run.cfg, self.run.mesh, self.run.act_rules), eval_plans(self.run)
        losses = evaluate(self._eval[0], state["params"], self.run, self._eval[1], self.frozen)
        return {"train_loss": losses.pop("train"), "val_loss": losses.pop("val"), **losses}


def train_batches(run: Run, frozen: dict | None = None) -> LoaderBatches:
    return LoaderBatches(run, frozen)


def make_loader(run: Run, split: str = "train", grad_accum: int | None = None, seed: int | None = None):
    """The loader of a split: random windows, packed rows, or a mixture of either over several datasets; whole
    preference pairs for dpo, ipo and orpo (padded or packed, data.packing)."""
    cfg, t = run.cfg, run.cfg.training
    A = t.grad_accum if grad_accum is None else grad_accum
    seed = cfg.seed if seed is None else seed
    mask = cfg.data.loss_mask == "on"

    def one(data):
        if cfg.training.objective in objectives.PREFERENCE:
            return preference.PairLoader(data, cfg.model.block_size, t.batch_size, A, seed, cfg.data.packing)
        if cfg.data.packing:
            return packing.PackedLoader(data, cfg.model.block_size, t.batch_size, A, seed, mask)
        return loader_lib.Loader(data, cfg.model.block_size, t.batch_size, A, seed)

    data = run.dataset.splits[split]
    if isinstance(data, mixture.MixedSplit):
        return mixture.MixtureLoader([one(s) for s in data.sources], run.dataset.weights,
                                     [str(ds.dir) for ds in run.dataset.datasets], seed, cfg.data.packing, mask)
    return one(data)


def eval_plans(run: Run) -> dict[str, list]:
    """Each split's held-out batches [B]: the same at every evaluation, resume and `jaxlm eval` (seed + 2)."""
    t = run.cfg.training
    out = {}
    for split in ("train", "val"):
        loader = make_loader(run, split, grad_accum=1, seed=run.cfg.seed + 2)
        out[split] = [loader.next().only_micro_batch() for _ in range(t.eval_batches)]
    return out


def evaluate(eval_step, params, run: Run, plans: dict, frozen: dict | None = None) -> dict:
    """Each split's loss over its held-out batches (eval_plans): the mean over all their units; with the
    objective's metrics averaged alike, as {split}_{name}."""
    out = {}
    for split, batches in plans.items():
        results = jax.device_get([eval_step(params, device_batch(run, split, plan), frozen) for plan in batches])
        counts = np.array([r[2] for r in results], np.float64)
        total = max(np.sum(counts), 1e-9)
        out[split] = float(np.sum(np.array([r[0] for r in results], np.float64) * counts) / total)
        for name in results[0][1]:
            out[f"{split}_{name}"] = float(np.sum(np.array([r[1][name] for r in results], np.float64) * counts) / total)
    return out


def check_resume_config(run_dir: Path | str, cfg: Config) -> dict | None:
    """A run directory's checkpoint only fits a model with the same settings. Returns the settings the run
    directory was last trained with (its config.json as a dict; None for a new run)."""
    path = storage.join(run_dir, "config.json")
    if not storage.exists(path):
        return None
    whole = json.loads(storage.read_text(path))
    saved = whole.get("model", {})
    for k, v in dataclasses.asdict(cfg.model).items():
        if k in saved and saved[k] != v and k not in ("dropout", "remat", "attention", "attention_block",
                                                      "loss_chunk_tokens", "scan_layers", "compute_dtype",
                                                      "quantization", "quant_logits", "quant_stochastic_rounding"):
            raise ConfigError(f"run_dir {run_dir} holds a checkpoint of a different model (model.{k}={saved[k]!r} "
                              f"there, {v!r} here); use another run_dir or the same model settings")
    # A LoRA checkpoint holds adapters of one shape for one base; the dropout and the base's storage may change.
    lora_saved = whole.get("lora", {})
    here = {"lora.rank": cfg.lora.rank, "lora.alpha": cfg.lora.alpha, "lora.targets": cfg.lora.targets}
    if cfg.lora.rank or lora_saved.get("rank"):
        here["checkpoint.init_from"] = cfg.checkpoint.init_from
    for key, v in here.items():
        section, name = key.split(".")
        there = (whole.get(section) or {}).get(name, v)
        if there != v:
            raise ConfigError(f"run_dir {run_dir} holds a checkpoint trained with {key}={there!r}, and this run has "
                              f"{v!r}; resume with the same setting or use another run_dir")
    return whole


def sample_text(params, cfg: Config, tok: tokenizer_lib.Tokenizer, prompt: str, new_tokens: int,
                temperature: float, top_k: int) -> str:
    ids = tok.encode(prompt) or [0]
    out = generate.sample(params, cfg.model, ids, new_tokens, jax.random.key(cfg.seed), temperature, top_k)
    return tok.decode(out)


