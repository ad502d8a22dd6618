"""Training: the jitted train step (gradient accumulation by scan), evaluation, and the loop that ties
data, checkpoints, metrics and the end-of-run sample together.

Flow: config -> data + vocab -> mesh -> abstract state (shapes + shardings, nothing allocated)
-> restore or sharded init -> jitted steps -> checkpoints, metrics.jsonl, TensorBoard, a sample.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxlm import checkpoint as ckpt
from jaxlm import config as config_lib
from jaxlm import generate, metrics, optim, params as P, quant, sharding
from jaxlm.config import Config, ConfigError
from jaxlm.data import loader as loader_lib, prepare, tokenizer as tokenizer_lib
from jaxlm.model import loss_fn, param_specs


@dataclasses.dataclass
class Run:
    """Everything a training run needs, resolved from the config before anything is compiled."""

    cfg: Config
    run_dir: Path
    dataset: loader_lib.Dataset
    mesh: jax.sharding.Mesh
    specs: dict
    optimizer: optax.GradientTransformation
    abstract_state: dict


def resolve_data_dir(cfg: Config) -> Path:
    return Path(cfg.data.dir) if cfg.data.dir else Path("data") / cfg.data.dataset


def setup(cfg: Config, devices=None) -> Run:
    """Check data, vocabulary, mesh and shardings; fails with a ConfigError/DataError before compiling."""
    data_dir = prepare.ensure_prepared(cfg.data.dataset, resolve_data_dir(cfg), cfg.data.input)
    dataset = loader_lib.Dataset(data_dir)
    dataset.check_block_size(cfg.model.block_size)
    vocab = cfg.model.vocab_size
    if vocab is None:
        cfg = cfg.replace(model=dataclasses.replace(cfg.model, vocab_size=dataset.vocab_size))
    elif vocab < dataset.vocab_size:
        raise ConfigError(f"model.vocab_size={vocab} is smaller than the data's vocabulary "
                          f"({dataset.vocab_size}, from {data_dir / 'meta.json'})")
    mesh = sharding.make_mesh(cfg.mesh, devices)
    n_batch = mesh.shape["data"] * mesh.shape["fsdp"]
    if cfg.training.batch_size % n_batch:
        raise ConfigError(f"training.batch_size={cfg.training.batch_size} must be a multiple of the "
                          f"{n_batch} devices that split the batch (mesh data x fsdp)")
    specs = param_specs(cfg.model)
    optimizer = optim.make(cfg.optimizer, cfg.training.steps)
    abstract_state = make_abstract_state(specs, mesh, optimizer)
    run_dir = Path(cfg.run_dir) if cfg.run_dir else Path("outputs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Run(cfg, run_dir, dataset, mesh, specs, optimizer, abstract_state)


def _init_state_fn(optimizer):
    return lambda params: {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}


def make_abstract_state(specs, mesh, optimizer) -> dict:
    """Shapes, dtypes and shardings of the full train state, derived without allocating it."""
    p_shardings = P.shardings(specs, mesh)
    p_abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              P.abstract(specs), p_shardings)
    init = jax.jit(_init_state_fn(optimizer))
    out_shardings = init.lower(p_abstract).compile().output_shardings
    shapes = jax.eval_shape(init, p_abstract)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, out_shardings)


def shardings_of(abstract_tree):
    return jax.tree.map(lambda a: a.sharding, abstract_tree)


def init_state(run: Run, seed: int) -> dict:
    params = P.init(run.specs, jax.random.key(seed), run.mesh)
    init = jax.jit(_init_state_fn(run.optimizer), out_shardings=shardings_of(run.abstract_state))
    return init(params)


def make_train_step(cfg: Config, optimizer, mesh, abstract_state) -> Callable:
    """(state, x[A,B,T], y[A,B,T]) -> (state, {loss, grad_norm, lr}); A micro-batches are accumulated."""
    model_cfg = cfg.model
    lr_at = optim.schedule(cfg.optimizer, cfg.training.steps)
    base_key = jax.random.key(cfg.seed + 1)
    grad_fn = jax.value_and_grad(loss_fn)

    def step_fn(state, x_ABT, y_ABT):
        params = state["params"]
        key = jax.random.fold_in(base_key, state["step"])
        A = x_ABT.shape[0]
        with sharding.activation_sharding(mesh):
            if A == 1:
                loss, grads = grad_fn(params, x_ABT[0], y_ABT[0], model_cfg, key)
            else:
                def micro(acc, inputs):
                    x_BT, y_BT, i = inputs
                    loss, grads = grad_fn(params, x_BT, y_BT, model_cfg, jax.random.fold_in(key, i))
                    return jax.tree.map(jnp.add, acc, (loss, grads)), None

                zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
                (loss, grads), _ = jax.lax.scan(micro, zeros, (x_ABT, y_ABT, jnp.arange(A)))
                loss, grads = jax.tree.map(lambda g: g / A, (loss, grads))
        updates, opt_state = optimizer.update(grads, state["opt_state"], params)
        new_state = {"params": optax.apply_updates(params, updates), "opt_state": opt_state,
                     "step": state["step"] + 1}
        return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": lr_at(state["step"])}

    state_sh = shardings_of(abstract_state)
    return jax.jit(step_fn, donate_argnums=0, out_shardings=(state_sh, None))


def make_eval_step(cfg: Config, mesh) -> Callable:
    def eval_fn(params, x_BT, y_BT):
        with sharding.activation_sharding(mesh):
            return loss_fn(params, x_BT, y_BT, cfg.model)

    return jax.jit(eval_fn)


def put_batch(mesh, x: np.ndarray, leading: int) -> jax.Array:
    return jax.device_put(x, sharding.batch_sharding(mesh, x.ndim, leading))


def evaluate(eval_step, params, mesh, batches: dict) -> dict:
    out = {}
    for split, (xs, ys) in batches.items():
        losses = [eval_step(params, put_batch(mesh, x, 0), put_batch(mesh, y, 0)) for x, y in zip(xs, ys)]
        out[split] = float(np.mean(jax.device_get(losses)))
    return out


def check_resume_config(run_dir: Path, cfg: Config) -> None:
    """A run directory's checkpoint only fits a model with the same settings."""
    path = run_dir / "config.json"
    if not path.exists():
        return
    saved = json.loads(path.read_text()).get("model", {})
    for k, v in dataclasses.asdict(cfg.model).items():
        if k in saved and saved[k] != v and k not in ("dropout", "remat", "scan_layers", "compute_dtype",
                                                      "quantization", "quant_logits", "quant_stochastic_rounding"):
            raise ConfigError(f"run_dir {run_dir} holds a checkpoint of a different model (model.{k}={saved[k]!r} "
                              f"there, {v!r} here); use another run_dir or the same model settings")


def train(cfg: Config, devices=None, log: Callable[[str], None] = print) -> dict:
    """Train (or resume) a run; returns a summary with the final losses and throughput."""
    t_start = time.perf_counter()
    if cfg.model.quantization == "int8_weights":
        raise ConfigError("model.quantization=int8_weights is for inference and cannot be trained; train with "
                          "none, int8 or fp8, then `jaxlm eval RUN_DIR model.quantization=int8_weights`")
    run = setup(cfg, devices)
    cfg, run_dir, mesh = run.cfg, run.run_dir, run.mesh
    t_cfg, m_cfg = cfg.training, cfg.model
    run_dir.mkdir(parents=True, exist_ok=True)
    check_resume_config(run_dir, cfg)
    (run_dir / "config.json").write_text(config_lib.to_json(cfg))

    n_params = P.count(run.specs)
    tokens_per_step = t_cfg.batch_size * t_cfg.grad_accum * m_cfg.block_size
    flops_per_step = metrics.flops_per_token(m_cfg) * tokens_per_step
    log(f"run_dir {run_dir} | {n_params:,} parameters | mesh {dict(mesh.shape)} on {mesh.devices.size} "
        f"{jax.devices()[0].platform} devices | {tokens_per_step:,} tokens/step")
    log(f"data {run.dataset.dir}: {prepare.describe(run.dataset.meta)}")
    if m_cfg.quantization == "fp8" and (note := quant.fp8_fallback_message(mesh.devices.flat[0])):
        log(note)

    use_ckpt = cfg.checkpoint.enabled and not cfg.debug
    checkpointer = ckpt.Checkpointer(run_dir, cfg.checkpoint) if use_ckpt else None
    loader = loader_lib.Loader(run.dataset.splits["train"], m_cfg.block_size, t_cfg.batch_size, t_cfg.grad_accum,
                               cfg.seed)
    latest = checkpointer.latest_step() if checkpointer else None
    if latest is not None:
        state, loader_state = checkpointer.restore(latest, run.abstract_state)
        loader.restore(loader_state)
        log(f"resumed from {checkpointer.dir / str(latest)} at step {latest}")
    else:
        state = init_state(run, cfg.seed)
    start = int(jax.device_get(state["step"]))

    train_step = make_train_step(cfg, run.optimizer, mesh, run.abstract_state)
    eval_step = make_eval_step(cfg, mesh)
    eval_batches = {split: loader_lib.fixed_batches(run.dataset.splits[split], m_cfg.block_size, t_cfg.batch_size,
                                                    t_cfg.eval_batches, cfg.seed + 2)
                    for split in ("train", "val")}
    writer = metrics.MetricWriter(run_dir, tensorboard=cfg.logging.tensorboard)
    progress = metrics.Progress(t_cfg.steps, start, cfg.logging.progress)
    profile_window = (start + 3, min(start + 8, t_cfg.steps)) if cfg.debug else None

    pending: list[tuple[int, dict]] = []
    last_eval: dict = {}
    window_start, window_steps, timed_steps, timed_seconds = time.perf_counter(), 0, 0, 0.0
    compile_seconds = 0.0
    for step in range(start, t_cfg.steps):
        if profile_window and step == profile_window[0]:
            jax.profiler.start_trace(str(run_dir / "profile"))
        x, y = loader.next()
        state, step_metrics = train_step(state, put_batch(mesh, x, 1), put_batch(mesh, y, 1))
        done = step + 1
        pending.append((done, step_metrics))
        window_steps += 1
        if profile_window and done == profile_window[1]:
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
            log(f"profiler trace of steps {profile_window[0] + 1}-{done} written to {run_dir / 'profile'}")
        is_eval = done == t_cfg.steps or (t_cfg.eval_interval and done % t_cfg.eval_interval == 0)
        is_ckpt = use_ckpt and (done == t_cfg.steps or (cfg.checkpoint.interval and done % cfg.checkpoint.interval == 0))
        if done == start + 1 or done % t_cfg.log_interval == 0 or is_eval or is_ckpt:
            fetched = jax.device_get([m for _, m in pending])
            elapsed = time.perf_counter() - window_start
            if done == start + 1:
                compile_seconds = elapsed  # the first step includes compilation; keep it out of throughput
            else:
                timed_steps += window_steps
                timed_seconds += elapsed
            tok_s = tokens_per_step * window_steps / elapsed
            for (s, _), m in zip(pending, fetched):
                record = {"step": s, "loss": float(m["loss"]), "lr": float(m["lr"]),
                          "grad_norm": float(m["grad_norm"])}
                if s == done:
                    record.update(tokens_per_s=tok_s, tflops_per_s=flops_per_step * window_steps / elapsed / 1e12)
                    if is_eval:
                        last_eval = evaluate(eval_step, state["params"], mesh, eval_batches)
                        record.update(train_loss=last_eval["train"], val_loss=last_eval["val"])
                        progress.write(f"step {s}: train loss {last_eval['train']:.4f}, val loss "
                                       f"{last_eval['val']:.4f}")
                writer.write(record)
            writer.flush()
            last = fetched[-1]
            progress.update(window_steps, {"loss": f"{float(last['loss']):.4f}", "lr": f"{float(last['lr']):.2e}",
                                           "tok/s": f"{tok_s:,.0f}",
                                           "TFLOP/s": f"{flops_per_step * window_steps / elapsed / 1e12:.3f}"})
            if is_ckpt:
                checkpointer.save(done, state, loader.state())
            pending.clear()
            window_steps = 0
            window_start = time.perf_counter()  # evaluation and checkpointing stay out of the throughput
    progress.close()
    if checkpointer:
        checkpointer.close()
    writer.close()

    summary = {"run_dir": str(run_dir), "steps": t_cfg.steps, "start_step": start,
               "wall_seconds": time.perf_counter() - t_start, "compile_seconds": compile_seconds,
               "train_loss": last_eval.get("train"), "val_loss": last_eval.get("val"),
               "unigram_entropy": run.dataset.meta.get("unigram_entropy")}
    if timed_steps:
        summary["tokens_per_s"] = tokens_per_step * timed_steps / timed_seconds
        summary["model_tflops_per_s"] = flops_per_step * timed_steps / timed_seconds / 1e12
    if start < t_cfg.steps:
        log(f"trained steps {start + 1}-{t_cfg.steps} in {summary['wall_seconds']:.1f} s "
            f"(first step with compile {compile_seconds:.1f} s); "
            + (f"{summary['tokens_per_s']:,.0f} tokens/s, {summary['model_tflops_per_s']:.4f} model TFLOP/s"
               if timed_steps else ""))
    if last_eval:
        ent = summary["unigram_entropy"]
        log(f"final train loss {last_eval['train']:.4f}, val loss {last_eval['val']:.4f}"
            + (f" (unigram entropy of the corpus: {ent:.4f})" if ent else ""))
    if t_cfg.sample_tokens:
        summary["sample"] = sample_text(state["params"], cfg, run.dataset.meta, t_cfg.sample_prompt,
                                        t_cfg.sample_tokens, t_cfg.sample_temperature, t_cfg.sample_top_k)
        log("sample:\n" + t_cfg.sample_prompt + summary["sample"])
    return summary


def sample_text(params, cfg: Config, meta: dict, prompt: str, new_tokens: int, temperature: float,
                top_k: int) -> str:
    tok = tokenizer_lib.from_meta(meta)
    ids = tok.encode(prompt) or [0]
    out = generate.sample(params, cfg.model, ids, new_tokens, jax.random.key(cfg.seed), temperature, top_k)
    return tok.decode(out)


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses_by_step(run_dir: str | Path) -> dict[int, float]:
    """Last recorded training loss of each step (a resumed run re-records the steps after its checkpoint)."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir)}
