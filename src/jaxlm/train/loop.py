"""`jaxlm train`: the loop that runs the train step (step.py) over the run's batches and ties them to
checkpoints, evaluation, metrics, the progress bar and the end-of-run sample.

Flow: run.setup -> the first state (newest checkpoint, checkpoint.init_from, or a fresh init) -> for dpo and ipo,
the reference log-probabilities (reference.py: computed from the starting weights once, then reused) -> train steps,
a few in flight -> every log interval: metrics.jsonl, TensorBoard, progress; every eval interval: held-out
losses; every checkpoint interval: state + the loader's position -> the run's summary and a sample.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import time
from pathlib import Path
from typing import Callable

import jax

from jaxlm.store import checkpoint as ckpt
from jaxlm import config as config_lib
from jaxlm import params as P
from jaxlm.train import diagnostics, metrics, objectives, optim, grpo, reference
from jaxlm.launch import distributed
from jaxlm.model import lora, quant
from jaxlm import storage
from jaxlm.train import batches as batch_lib, preflight, run as run_lib, saved_step, state as state_lib, step as step_lib
from jaxlm.config import Config, ConfigError
from jaxlm.train.run import TrainingError
from jaxlm.model import attention, flops
from jaxlm.model.loss import describe_loss

# Steps dispatched ahead of the host before it waits for the oldest: enough to keep any device busy, few
# enough to bound the memory of queued batches (and XLA:CPU's in-process collectives can stall when many
# multi-device steps are queued at once).
MAX_STEPS_IN_FLIGHT = 8


# The train step's own metrics; whatever else it returns is the objective's, recorded under its own name.
STEP_GUARD_METRICS = ("loss", "lr", "grad_norm", "loss_avg", "nonfinite_skips", "spike_skips", "skips_in_a_row")


def _report_skips(step: int, m: dict, seen: dict, t_cfg: config_lib.TrainingConfig, say) -> str | None:
    """Say which steps were not applied; return why the run must stop, if it must. `seen` holds the
    counters as of the previous step and is brought up to date."""
    failure = None
    row = int(m["skips_in_a_row"])
    if int(m["nonfinite_skips"]) > seen["nonfinite_skips"]:
        what = (f"step {step}: the loss ({float(m['loss']):.6g}) or gradient norm ({float(m['grad_norm']):.6g}) "
                f"is not finite")
        if t_cfg.on_nonfinite == "stop":
            failure = f"{what}; the update was not applied and training.on_nonfinite=stop ends the run"
        elif row > t_cfg.max_consecutive_skips:
            failure = (f"{what}, {row} steps in a row (more than training.max_consecutive_skips="
                       f"{t_cfg.max_consecutive_skips}); lower optimizer.lr or check the data")
        else:
            say(f"{what}; update skipped ({row} in a row)")
    if int(m["spike_skips"]) > seen["spike_skips"]:
        say(f"step {step}: loss {float(m['loss']):.4f} is over {t_cfg.spike_threshold:g}x the running average "
            f"{float(m['loss_avg']):.4f}; update skipped ({int(m['spike_skips'])} so far)")
    seen.update(nonfinite_skips=int(m["nonfinite_skips"]), spike_skips=int(m["spike_skips"]))
    return failure


def _describe_run(run: run_lib.Run, log: Callable[[str], None]):
    """Log what the run is (parameters, mesh, batch, FLOPs, attention, data); returns its throughput meter, the
    peak FLOP/s per device and where that figure comes from, and the model FLOPs per token."""
    cfg, run_dir, mesh = run.cfg, run.run_dir, run.mesh
    t_cfg, m_cfg = cfg.training, cfg.model
    n_params = P.count(run.specs)
    tokens_per_step = t_cfg.batch_size * t_cfg.grad_accum * m_cfg.block_size
    flops_per_token = full = flops.flops_per_token(m_cfg, causal=True)
    base_reference = lora.enabled(cfg) and cfg.training.objective in objectives.NEEDS_REFERENCE
    if lora.enabled(cfg):
        flops_per_token = lora.flops_per_token(cfg, flops_per_token)
    if base_reference:  # the base's forward pass once more, as the reference (a third of a training step's)
        flops_per_token += full / 3
    flops_per_step = flops_per_token * tokens_per_step
    n_devices = mesh.devices.size
    local_devices = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
    peak, peak_source = metrics.peak_flops_per_device(mesh.devices.flat[0], m_cfg.compute_dtype, local_devices)
    meter = metrics.Throughput(tokens_per_step, flops_per_step, n_devices, peak)
    shape = {k: v for k, v in mesh.shape.items() if v > 1} or {"data": 1}
    log(f"run_dir {run_dir} | {n_params:,} parameters | mesh {shape} on {n_devices} "
        f"{jax.devices()[0].platform} devices in {jax.process_count()} process(es)")
    if lora.enabled(cfg):
        log(lora.describe(cfg))
    log(f"batch: {t_cfg.batch_size} sequences global ({t_cfg.per_device_batch_size:g} per device) x "
        f"{t_cfg.grad_accum} accumulation = {tokens_per_step:,} tokens/step")
    log(optim.describe(cfg.optimizer, run.specs, adapters=lora.enabled(cfg)) + (
        f" | MuonClip: QK-clip at attention logits over {cfg.optimizer.qk_clip:g}" if cfg.optimizer.qk_clip else ""))
    log(f"model FLOPs {flops_per_token:,.0f} per token (causal attention counted as half"
        + ("; no weight gradients for the frozen base" if lora.enabled(cfg) else
           f"; {flops.flops_per_token(m_cfg):,.0f} by MaxText's count, the attention square whole")
        + ("; its forward pass again as the reference" if base_reference else "") + ") | peak "
        f"{peak / 1e12:.3f} TFLOP/s per device ({peak_source})"
        + (f"; {m_cfg.quantization} matmuls run faster than that peak, so MFU can pass 100%"
           if m_cfg.quantization in ("int8", "fp8") else ""))
    log(attention.describe(m_cfg, mesh.devices.flat[0].platform, mesh=mesh, rules=run.act_rules)
        + describe_loss(m_cfg))
    if run.dataset is not None:
        log(f"data {run.dataset.dir}: {run.dataset.describe()}" + (" | packed rows" if cfg.data.packing else "")
            + (" | loss mask on" if cfg.data.loss_mask == "on" else ""))
    else:
        log(f"prompts {cfg.data.prompts}: {t_cfg.batch_size * t_cfg.grad_accum // cfg.grpo.group_size} per step x "
            f"{cfg.grpo.group_size} completions of up to {cfg.grpo.max_completion_tokens} tokens; rewards "
            f"{cfg.grpo.reward}")
    if cfg.training.objective != "next_token":
        log(objectives.describe(cfg))
    if m_cfg.quantization == "fp8" and (note := quant.fp8_fallback_message(mesh.devices.flat[0])):
        log(note)
    return meter, peak, peak_source, flops_per_token


def _first_state(run: run_lib.Run, checkpointer, batches, log: Callable[[str], None]) -> dict:
    """The train state to start from: the newest checkpoint (and the loader's position in it), else the weights
    of checkpoint.init_from, else a fresh initialization."""
    cfg = run.cfg
    latest = checkpointer.latest if checkpointer else None
    if latest is not None:
        where = storage.join(checkpointer.dir, str(latest))
        try:
            state, loader_state = checkpointer.restore(latest, run.abstract_state)
        except ckpt.CheckpointError as e:
            # The weights fit but the optimizer state does not: the run goes on with another optimizer
            # (optimizer.name=adamw before, muon now). Anything else fails as it did above.
            try:
                state, loader_state = checkpointer.restore_without_optimizer(latest, run.abstract_state)
            except ckpt.CheckpointError:
                raise e from None
            state = state_lib.with_fresh_optimizer(run, state)
            log(f"{where} holds another optimizer's state: continuing its weights and data position with a fresh "
                f"{cfg.optimizer.name} state (new moments; the learning-rate schedule continues at step {latest})")
        batches.restore(loader_state)
        log(f"resumed from {where} at step {latest}")
        return state
    if cfg.checkpoint.init_from:
        log(f"initialized the weights from {cfg.checkpoint.init_from}")
        return state_lib.init_state_from(run, cfg.checkpoint.init_from)
    return state_lib.init_state(run, cfg.seed)


def _schedule_change(o: config_lib.OptimizerConfig, before: int, now: int, start: int) -> str:
    """One line for a run resumed at `start` with training.steps changed from `before` to `now`: where its
    learning-rate schedule goes from here, and whether it continues the first run's exactly."""
    head = f"training.steps {before} -> {now} at step {start}: "
    if o.schedule == "wsd":
        (was, _), (begins, ends) = optim.wsd_phases(o, before), optim.wsd_phases(o, now)
        if start <= min(was, begins):
            return head + f"still in the stable phase, the cooldown now runs from step {begins} to {ends} (was {was})"
        where = f"the cooldown had begun at step {was}" if start > was else f"the new cooldown began at step {begins}"
        return head + (f"{where}; from here the rate follows the new schedule ({begins} to {ends}), "
                       f"{'rising' if start < begins else 'jumping'} from the first run's")
    if o.schedule in ("cosine", "linear") and o.decay_steps is None:
        return head + (f"the {o.schedule} decay now ends at step {now}, so the learning rate from here differs from "
                       "the first run's (optimizer.schedule=wsd extends a run exactly)")
    return head + f"the {o.schedule} schedule is unchanged by it"


def _report_end(summary: dict, last_eval: dict, log: Callable[[str], None]) -> None:
    """The closing lines of a run from its summary: skipped updates, the steps trained and their throughput,
    the final losses."""
    start, steps = summary["start_step"], summary["steps"]
    if summary["nonfinite_skips"] or summary["spike_skips"]:
        log(f"updates skipped: {summary['nonfinite_skips']} for a non-finite loss or gradient norm, "
            f"{summary['spike_skips']} for a loss spike")
    if start < steps:
        log(f"trained steps {start + 1}-{summary['preempted_at'] or steps} in {summary['wall_seconds']:.1f} s "
            f"(first step with compile {summary['compile_seconds']:.1f} s); "
            + (f"{summary['tokens_per_s']:,.0f} tokens/s ({summary['tokens_per_s_per_device']:,.0f} per device), "
               f"{summary['model_tflops_per_s_per_device']:.4f} model TFLOP/s per device, "
               f"MFU {100 * summary['mfu']:.2f}%" + (f" ({100 * summary['mfu_maxtext']:.2f}% by MaxText's count)"
                                                       if "mfu_maxtext" in summary else "")
               if "tokens_per_s" in summary else ""))
    if "val_loss" in last_eval:
        ent = summary["unigram_entropy"]
        log(f"final train loss {last_eval['train_loss']:.4f}, val loss {last_eval['val_loss']:.4f}"
            + (f" (unigram entropy of the corpus: {ent:.4f})" if ent else ""))
    elif last_eval:
        log("final " + ", ".join(f"{k.replace('_', ' ')} {v:.4f}" for k, v in last_eval.items()))


@dataclasses.dataclass
class _Windows:
    """Throughput of the steps between two logged steps (a window) and of all the windows past the first step,
    which compiles: evaluation and checkpointing run between windows and stay out of both."""
    meter: metrics.Throughput
    opened: float = dataclasses.field(default_factory=time.perf_counter)
    steps: int = 0
    timed_steps: int = 0
    timed_seconds: float = 0.0
    compile_seconds: float = 0.0

    def close(self, first: bool) -> tuple[float, dict]:
        """End the window: its seconds and the meter's figures (the first step's seconds are compile time)."""
        elapsed = time.perf_counter() - self.opened
        if first:
            self.compile_seconds = elapsed
        else:
            self.timed_steps += self.steps
            self.timed_seconds += elapsed
        return elapsed, self.meter.window(self.steps, elapsed)

    def reopen(self) -> None:
        self.steps, self.opened = 0, time.perf_counter()

    def overall(self) -> dict:
        """The timed steps' throughput under the run summary's names (nothing when no step was timed)."""
        if not self.timed_steps:
            return {}
        o = self.meter.window(self.timed_steps, self.timed_seconds)
        return dict(tokens_per_s=o["tokens_per_s"], tokens_per_s_per_device=o["tokens_per_s_per_device"],
                    model_tflops_per_s=o["tflops_per_s"], model_tflops_per_s_per_device=o["tflops_per_s_per_device"],
                    mfu=o["mfu"])


def _record(step: int, m: dict, host: dict) -> dict:
    """A step's line of metrics.jsonl: its metrics fetched from the device (the step guard's skip counters as
    ints, the rest as floats) and its batch's metrics from the host."""
    return {"step": step, "loss": float(m["loss"]), "lr": float(m["lr"]), "grad_norm": float(m["grad_norm"]),
            "nonfinite_skips": int(m["nonfinite_skips"]), "spike_skips": int(m["spike_skips"]),
            **{k: float(v) for k, v in m.items() if k not in STEP_GUARD_METRICS}, **host}


@dataclasses.dataclass
class _Output:
    """Where the loop's windows end: each step's metrics line, the window's throughput, an evaluation and a
    checkpoint when due, the progress bar; `pending` holds the steps dispatched since the last window."""
    t_cfg: config_lib.TrainingConfig
    batches: object
    writer: metrics.MetricWriter
    progress: metrics.Progress
    say: Callable[[str], None]
    skips: dict  # the step guard's counters as of the last step reported
    checkpointer: ckpt.Checkpointer | None
    goodput: metrics.Goodput
    windows: _Windows
    pending: list = dataclasses.field(default_factory=list)  # (step, its metrics on device, the batch's on host)
    last_eval: dict = dataclasses.field(default_factory=dict)

    def end_window(self, state: dict, done: int, first: bool, is_eval: bool, is_ckpt: bool) -> None:
        """Fetch the window's metrics and write a line per step (the last with the window's throughput, or its
        compile time for the first step, and an evaluation when due); raise TrainingError when a step failed
        the guard; then the progress bar, and a checkpoint of step `done` when due."""
        with self.goodput.phase("compute"):
            fetched = jax.device_get([m for _, m, _ in self.pending])
        elapsed, window = self.windows.close(first=first)
        failure = None
        for (s, _, host), m in zip(self.pending, fetched):
            record = _record(s, m, host)
            failure = failure or _report_skips(s, m, self.skips, self.t_cfg, self.say)
            if s == done:
                record.update({"compile_s": elapsed} if first else window)
                if is_eval and not failure:
                    with self.goodput.phase("eval"):
                        self.last_eval = self.batches.evaluate(state)
                    record.update(self.last_eval)
                    if self.last_eval:
                        self.say(f"step {s}: " + ", ".join(f"{k.replace('_', ' ')} {v:.4f}" for k, v in
                                                           self.last_eval.items() if "/" not in k))
            self.writer.write(record)
        self.writer.append("completions.jsonl", getattr(self.batches, "take_samples", list)())
        self.writer.flush()
        if failure:
            raise TrainingError(failure + (f"; the newest checkpoint is in {self.checkpointer.dir}"
                                           if self.checkpointer else ""))
        last = fetched[-1]
        self.progress.update(self.windows.steps, {"loss": f"{float(last['loss']):.4f}",
                                                  "lr": f"{float(last['lr']):.2e}",
                                                  "tok/s": f"{window['tokens_per_s']:,.0f}",
                                                  "MFU": f"{100 * window['mfu']:.1f}%"})
        if self.checkpointer:
            self.checkpointer.check()
        if is_ckpt:
            with self.goodput.phase("checkpoint"):
                self.checkpointer.save(done, state, self.batches.state())
        self.pending.clear()
        self.windows.reopen()


def _summary(run: run_lib.Run, start: int, preempted_at: int | None, out: _Output, described: tuple) -> dict:
    """The run's summary (before its sample and goodput): steps, skipped updates, time, final losses and the
    timed windows' throughput against the peak (`described`: _describe_run's peak, its source, FLOPs per token)."""
    t_cfg, skips = run.cfg.training, out.skips
    summary = {"run_dir": str(run.run_dir), "steps": t_cfg.steps, "start_step": start, "preempted_at": preempted_at,
               "nonfinite_skips": skips["nonfinite_skips"], "spike_skips": skips["spike_skips"],
               "wall_seconds": time.perf_counter() - out.goodput.start,
               "compile_seconds": out.windows.compile_seconds,
               "train_loss": out.last_eval.get("train_loss"), "val_loss": out.last_eval.get("val_loss"),
               # a yardstick for next-token losses only
               "unigram_entropy": run.dataset.meta.get("unigram_entropy") if t_cfg.objective == "next_token" else None}
    peak, peak_source, flops_per_token = described
    summary.update(peak_flops_per_device=peak, peak_source=peak_source, flops_per_token=flops_per_token,
                   **out.windows.overall())
    if "mfu" in summary and not lora.enabled(run.cfg):  # as MaxText counts it: the attention square whole
        summary["mfu_maxtext"] = summary["mfu"] * flops.flops_per_token(run.cfg.model) / flops_per_token
    return summary


def _close_on_error(closers, writer, checkpointer, log) -> None:
    """Whatever ended the loop: a save already under way is committed (it holds a good state) and the metrics
    recorded so far reach the disk."""
    for close in (*closers, writer.close):
        close()
    if checkpointer:
        try:
            checkpointer.close()
        except ckpt.CheckpointError as e:
            log(f"warning: {e}")


def _prepare(cfg: Config, devices, main_process: bool) -> tuple[run_lib.Run, object, dict | None]:
    """The run's settings, its saved step (compile.load) checked against them before any state exists (so a
    mismatch costs nothing), and its run directory with config.json; returns the settings the directory was
    last trained with (None for a new run)."""
    if cfg.model.quantization == "int8_weights":
        raise ConfigError("model.quantization=int8_weights is for inference and cannot be trained; train with "
                          "none, int8 or fp8, then `jaxlm eval RUN_DIR model.quantization=int8_weights`")
    run = run_lib.setup(cfg, devices)
    cfg, run_dir = run.cfg, run.run_dir
    loaded_step = None
    if cfg.compile.load:
        loaded_step = saved_step.load(cfg.compile.load, cfg, run.mesh, step_lib.step_args(run))
    storage.makedirs(run_dir)
    saved = run_lib.check_resume_config(run_dir, cfg)
    if main_process:  # atomically: the other processes may be reading it in check_resume_config
        storage.write_text(storage.join(run_dir, "config.json"), config_lib.to_json(cfg))
    return run, loaded_step, saved


def _start(run: run_lib.Run, checkpointer, saved: dict | None, log: Callable[[str], None]):
    """A LoRA run's frozen base, the batch source and the state to start from (for dpo and ipo with the
    reference log-probabilities ready); a resumed run whose training.steps changed says where its schedule goes."""
    cfg, t_cfg = run.cfg, run.cfg.training
    frozen = state_lib.load_frozen(run)
    batches = grpo.RolloutBatches(run, frozen) if t_cfg.objective == "grpo" else batch_lib.train_batches(run, frozen)
    state = _first_state(run, checkpointer, batches, log)
    if run_lib.reference_in_batch(cfg):  # dpo, ipo: the starting weights' log-probabilities, before any step
        reference.ensure(run, state, log)
    start = int(jax.device_get(state["step"]))
    if start and saved and (before := saved.get("training", {}).get("steps", t_cfg.steps)) != t_cfg.steps:
        log(_schedule_change(cfg.optimizer, before, t_cfg.steps, start))
    return frozen, batches, state, start


def _train_step(run: run_lib.Run, loaded_step, log: Callable[[str], None]) -> Callable:
    """The step the loop runs: the one saved ahead of time (compile.load), else the jitted one."""
    cfg = run.cfg
    if loaded_step is not None:
        log(f"train step loaded from {cfg.compile.load} (compiled ahead of time; not compiled here)")
        return loaded_step
    if preflight.device_limit(run.mesh.devices.flat[0]):
        return preflight.check(run)
    return step_lib.make_train_step(cfg, run.optimizer, run.mesh, run.abstract_state, run.act_rules)


def _run_steps(run: run_lib.Run, state: dict, start: int, train_step, frozen: dict | None, out: _Output,
               profiler: diagnostics.Profiler, monitor: diagnostics.Monitor,
               preemption: distributed.Preemption) -> tuple[dict, int | None]:
    """The steps from `start` on, a few in flight, each window ended by `out`; returns the last state and the
    step a preemption stopped the run after (None when it ran to the end)."""
    cfg, t_cfg, batches, goodput = run.cfg, run.cfg.training, out.batches, out.goodput
    use_ckpt = out.checkpointer is not None
    step_args = (lambda state, batch: (state, batch)) if frozen is None else (
        lambda state, batch: (state, batch, frozen))
    for step in range(start, t_cfg.steps):
        profiler.before(step)
        with jax.profiler.StepTraceAnnotation("train", step_num=step):
            with goodput.phase("data"):
                batch = batches.next(state)
            with goodput.phase("compile" if step == start else "compute"):
                state, step_metrics = train_step(*step_args(state, batch))
                if step == start:
                    jax.block_until_ready(step_metrics)  # the first call compiles; keep that out of compute
        done = step + 1
        profiler.after(done, state)
        out.pending.append((done, step_metrics, batches.metrics()))
        if len(out.pending) > MAX_STEPS_IN_FLIGHT:
            with goodput.phase("compute"):
                jax.block_until_ready(out.pending[-MAX_STEPS_IN_FLIGHT][1])
        out.windows.steps += 1
        stop = preemption.reached(done) and batches.boundary(done)
        is_eval = not stop and (done == t_cfg.steps or (t_cfg.eval_interval and done % t_cfg.eval_interval == 0))
        is_ckpt = use_ckpt and batches.boundary(done) and (
            stop or done == t_cfg.steps or (cfg.checkpoint.interval and done % cfg.checkpoint.interval == 0))
        if done == start + 1 or done % t_cfg.log_interval == 0 or is_eval or is_ckpt:
            out.end_window(state, done, done == start + 1, is_eval, is_ckpt)
        monitor.beat(done)
        if stop:
            return state, done
    return state, None


def _finish(run: run_lib.Run, state: dict, frozen: dict | None, start: int, preempted_at: int | None, out: _Output,
            described: tuple, log: Callable[[str], None]) -> dict:
    """The run's summary and closing lines, the end-of-run sample (not after a preemption), and the goodput
    line that closes metrics.jsonl."""
    cfg, t_cfg, goodput = run.cfg, run.cfg.training, out.goodput
    summary = _summary(run, start, preempted_at, out, described)
    _report_end(summary, out.last_eval, log)
    if t_cfg.sample_tokens and preempted_at is None:
        with goodput.phase("eval"):
            summary["sample"] = step_lib.sample_text(
                state_lib.model_params(state["params"], frozen, cfg), cfg, run.tokenizer, t_cfg.sample_prompt,
                t_cfg.sample_tokens, t_cfg.sample_temperature, t_cfg.sample_top_k)
        log("sample:\n" + t_cfg.sample_prompt + summary["sample"])
    summary["goodput"] = goodput.summary()
    out.writer.write({"step": preempted_at or t_cfg.steps, **summary["goodput"]})  # the last step run
    out.writer.close()
    log(metrics.Goodput.describe(summary["goodput"]))
    return summary


def train(cfg: Config, devices=None, log: Callable[[str], None] = print) -> dict:
    """Train (or resume) a run; returns a summary with the final losses and throughput."""
    goodput = metrics.Goodput()
    distributed.initialize(cfg.distributed)
    main_process = distributed.is_main()
    if not main_process:
        log = lambda s: None  # noqa: E731 - only process 0 speaks
    run, loaded_step, saved = _prepare(cfg, devices, main_process)
    cfg, run_dir, t_cfg = run.cfg, run.run_dir, run.cfg.training
    meter, peak, peak_source, flops_per_token = _describe_run(run, log)
    # On a device that reports its memory, the step is compiled before any state exists: one that cannot fit
    # stops here in one line, before the init or the base's load could run out of memory themselves.
    with goodput.phase("compile"):
        train_step = _train_step(run, loaded_step, log)

    use_ckpt = cfg.checkpoint.enabled and not cfg.debug
    checkpointer = ckpt.Checkpointer(run_dir, cfg.checkpoint, log) if use_ckpt else None
    frozen, batches, state, start = _start(run, checkpointer, saved, log)
    skips = {k: int(v) for k, v in jax.device_get(state["guard"]).items()}
    writer = metrics.MetricWriter(run_dir, tensorboard=cfg.logging.tensorboard, enabled=main_process,
                                  wandb_run=metrics.start_wandb(cfg, run_dir) if cfg.logging.wandb and main_process
                                  else None)
    progress = metrics.Progress(t_cfg.steps, start, cfg.logging.progress and main_process)
    say = progress.write if cfg.logging.progress and main_process else log
    profiler = diagnostics.Profiler(cfg, run_dir, start, log)
    monitor = diagnostics.Monitor(cfg, run_dir, progress.write)
    preemption = distributed.Preemption(use_ckpt and cfg.checkpoint.save_on_preemption, say)
    goodput.charge_unaccounted("init")

    out = _Output(t_cfg, batches, writer, progress, say, skips, checkpointer, goodput, _Windows(meter))
    closers = (preemption.close, monitor.close, profiler.close, progress.close)  # the writer closes last
    try:
        state, preempted_at = _run_steps(run, state, start, train_step, frozen, out, profiler, monitor, preemption)
    except BaseException:
        _close_on_error(closers, writer, checkpointer, log)
        raise
    for close in closers:
        close()
    if checkpointer:
        with goodput.phase("checkpoint"):
            checkpointer.close()
    if preempted_at is not None:
        # Every process says it: in a multi-host job the logs show that all of them stopped at one step.
        (log if main_process else print)(
            f"process {jax.process_index()}: stopped for preemption after step {preempted_at}; its checkpoint "
            f"is committed in {storage.join(checkpointer.dir, str(preempted_at))}")
    summary = _finish(run, state, frozen, start, preempted_at, out, (peak, peak_source, flops_per_token), log)
    if checkpointer and preempted_at is None:
        log(next_commands(run_dir, t_cfg.sample_prompt))
    return summary


def next_commands(run_dir, prompt: str) -> str:
    """The closing line of a finished run: where it is, and the commands that use it (README, Quickstart)."""
    d = shlex.quote(str(run_dir))
    return (f"saved in {run_dir}; next: jaxlm generate {d} --prompt {shlex.quote(prompt)} | jaxlm serve {d} | "
            f"jaxlm eval {d} | jaxlm convert to-hf {d} OUT")


def read_metrics(run_dir: str | Path) -> list[dict]:
    text = storage.read_text(storage.join(run_dir, "metrics.jsonl"))
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def losses_by_step(run_dir: str | Path) -> dict[int, float]:
    """Last recorded training loss of each step (a resumed run re-records the steps after its checkpoint)."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}

