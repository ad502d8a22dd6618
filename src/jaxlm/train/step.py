"""The jitted train and eval steps: micro-batches accumulated by scan, the step guard (a NaN/inf or spiking loss
is not applied), MuonClip's QK-clip, zig-zag batches for context parallelism; the step's abstract arguments
for `jaxlm compile`; and the text sample at the end of a run. What the step minimizes is the run's objective
(objectives.py, `training.objective`); the step itself never names a loss.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

from jaxlm import sharding
from jaxlm.infer import generate
from jaxlm.train import objectives, optim
from jaxlm.train.run import Run, batch_keys, vision_frozen
from jaxlm.train.state import model_params, shardings_of
from jaxlm.config import Config, ConfigError
from jaxlm.data import tokenizer as tokenizer_lib
from jaxlm.model import quant, ring, transformer


# Running average of the loss for spike detection: an exponential average over about the last 100 steps.
LOSS_AVG_DECAY = 0.99


def loss_and_grads(objective: objectives.Objective, params, batch: dict, cfg: Config, key, frozen: dict | None = None
                   ) -> tuple[tuple[jax.Array, dict], dict]:
    """((loss, metrics), gradient) of the step from a batch of [A, B, T] arrays, accumulating A micro-batches by
    scan. The objective's units over the whole step / A are every micro-batch's normalizer (objectives.py), so
    the mean over micro-batches is exactly the mean over the step's units, however unevenly they fall (a
    micro-batch with few counted tokens weighs no more than its tokens). The sums run over the global batch, so
    the same holds across devices. With a LoRA run's `frozen` base, `params` are the adapters, the only weights
    differentiated; a frozen vision tower (training.freeze_vision) gets zero gradients."""
    A = batch["inputs"].shape[0]
    units = objective.units(batch, cfg)
    normalizer = None if units is None else jnp.maximum(units, 1e-9) / A
    loss = objective.loss if frozen is None else (
        lambda p, b, c, k: objective.loss(model_params(p, frozen, c, k), b, c, k))
    if frozen is None and vision_frozen(cfg):
        loss = tower_held(loss)
    if frozen is None and cfg.model.quantization == "int8" and sharding.pipeline() is None:
        # the block weights' int8 values and scales made once a step, not once a micro-batch (quant.step_weights;
        # pipeline stages slice the weights by their specs, and quantize them where they multiply)
        made, per_micro = quant.step_weights(params, cfg.model), loss
        loss = lambda p, b, c, k: per_micro(quant.with_step_weights(p, made), b, c, k)  # noqa: E731
    with_normalizer = lambda b: b if normalizer is None else {**b, "normalizer": normalizer}  # noqa: E731

    if A == 1:
        b = with_normalizer(jax.tree.map(lambda v: v[0], batch))
        return jax.value_and_grad(loss, has_aux=True)(params, b, cfg, key)

    # The gradients of all micro-batches are added in place into one buffer per weight (a mutable ref that the
    # backward pass writes into): each layer's weight gradient is added to its slice of the accumulator as the
    # layer's backward step makes it. Summed into a fresh gradient, as a scan of value_and_grad does, every
    # micro-batch would also write zeros over a whole gradient's bytes and then read the gradient and the
    # accumulator and write the sum: ~3 more reads and writes of the weights' size a micro-batch, the same sums.
    acc = jax.tree.map(lambda p: jax.new_ref(jnp.zeros_like(p)), params)

    def micro(totals, inputs):
        b, i = inputs
        out, f_vjp, extra = jax.vjp(lambda p: loss(p, with_normalizer(b), cfg, jax.random.fold_in(key, i)), params,
                                    has_aux=True)
        f_vjp.with_refs(acc)(jnp.ones_like(out))
        return jax.tree.map(jnp.add, totals, (out, extra)), None

    first = jax.eval_shape(lambda b: loss(params, with_normalizer(b), cfg, key), jax.tree.map(lambda v: v[0], batch))
    totals, _ = jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, first), (batch, jnp.arange(A)))
    return jax.tree.map(lambda v: v / A, (totals, jax.tree.map(jax.freeze, acc)))


def tower_held(loss: Callable) -> Callable:
    """`loss` with no gradient into the vision tower: the tower's backward pass is never built."""
    def held(params, batch, cfg, key):
        return loss({**params, "vision": jax.lax.stop_gradient(params["vision"])}, batch, cfg, key)

    return held


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
    """Shape, dtype and sharding of a train step's batch arrays [A, B, T], as device_batch makes them, and of its
    images [A, B * K, *image] when the run has K = run.image_slots per row (image: run.image_shape; Qwen-VL's a
    dict of padded patches and grids, image_structs)."""
    t = run.cfg.training
    shape = (t.grad_accum, t.batch_size, run.cfg.model.block_size)
    sh = sharding.batch_sharding(run.mesh, 3, 1, run.act_rules)
    out = {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k in FLOAT_KEYS else jnp.int32, sharding=sh)
           for k in batch_keys(run.cfg)}
    if run.image_slots:
        out["images"] = image_structs(run, (t.grad_accum, t.batch_size * run.image_slots), run.image_shape)
    return out


def image_structs(run: Run, lead: tuple, shape):
    """The abstract images of a batch [*lead, *image] by an image's shape: a tuple (one float32 array), or a dict of
    them (padded: Llama 4's {"tiles": float32, "canvas": int32}, Qwen-VL's {"patches": float32, "grid": int32}),
    each sharded as image_sharding."""
    if isinstance(shape, dict):
        return {k: image_structs(run, lead, s) if k not in ("grid", "canvas") else
                jax.ShapeDtypeStruct(lead + s, jnp.int32, sharding=image_sharding(run, len(lead) - 1, len(s)))
                for k, s in shape.items()}
    return jax.ShapeDtypeStruct(lead + shape, jnp.float32, sharding=image_sharding(run, len(lead) - 1, len(shape)))


def image_sharding(run: Run, lead: int, image_dims: int = 3) -> jax.sharding.NamedSharding:
    """The sharding of a batch's images [*lead dims, B * K, *image dims]: the image slots split over the devices
    that split the batch (each micro-batch's images in the order of its image tokens: batches.image_batch)."""
    batch_axes = sharding.spec(("batch",), run.act_rules)[0]
    spec = jax.sharding.PartitionSpec(*(None,) * lead, batch_axes, *(None,) * image_dims)
    return jax.sharding.NamedSharding(run.mesh, spec)


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


def sample_text(params, cfg: Config, tok: tokenizer_lib.Tokenizer, prompt: str, new_tokens: int,
                temperature: float, top_k: int) -> str:
    ids = tok.encode(prompt) or [0]
    out = generate.sample(params, cfg.model, ids, new_tokens, jax.random.key(cfg.seed), temperature, top_k)
    return tok.decode(out)
