"""Does the step fit the device? `jaxlm train` compiles its step for its own devices before any state exists (no
weights initialized or loaded) and stops a step that cannot fit in one line: the bytes it needs, settings that
fit together (found by compiling them: `jaxlm train openwebtext` on one v5e names bf16, remat minimal and a
halved batch) and the settings that shrink it. The compiled step is then the one the loop runs, so nothing is
compiled twice.

The verdict is the compiler's where it gives one: XLA:TPU refuses to compile a step whose buffers do not fit the
chip, naming the bytes. A step it accepts runs (on a v5e, llama3.1-8b QLoRA at 49,152 tokens ran although
memory_analysis()'s peak_memory_in_bytes said 17.8 GiB: that figure counts the layer inputs offloaded to host
memory too). Elsewhere (GPU) the device parts of memory_analysis() are summed, an upper bound, against the device.
"""

from __future__ import annotations

import math
import re

import jax

from jaxlm import config as config_lib
from jaxlm.config import ConfigError
from jaxlm.model import lora
from jaxlm.train import run as run_lib, step as step_lib

GiB = 2**30
LONG_CONTEXT = 8192  # from this many tokens a sequence, the layers' saved inputs are worth offloading


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def device_limit(device) -> int | None:
    """The device's memory in bytes as its runtime reports it (TPU, GPU); None where it reports none (CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory statistics raise rather than return None
        return None
    return (stats or {}).get("bytes_limit")


def peak_bytes(m) -> int:
    """The compiler's peak bytes per device (compiled.memory_analysis()): XLA's heap simulation of the scheduled
    step, the host memory of offloaded activations included; the sum of the parts where it gives none."""
    return getattr(m, "peak_memory_in_bytes", 0) or device_bytes(m)


def device_bytes(m) -> int:
    """An upper bound of the step's device memory: arguments, outputs, temporaries and code, less the outputs
    written over donated arguments (buffers the compiler reuses are counted each time)."""
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            + m.generated_code_size_in_bytes - m.alias_size_in_bytes)


def _shard_bytes(a) -> int:
    return math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize


def fitting_batch(pdb: float, need: int | None, argument_bytes: int | None, limit: int | None) -> int | None:
    """The largest power-of-two per-device batch below `pdb` whose step would fit `limit` (with a tenth spare),
    taking the bytes beyond the step's arguments (the state and the batch) as activations that scale with the
    batch; None without the figures, or where even a batch of one would not fit beside the state."""
    if not (need and argument_bytes and limit) or pdb <= 1:
        return None
    per_row = (need - argument_bytes) / pdb
    room = 0.9 * limit - argument_bytes
    if per_row <= 0 or room < per_row:
        return None
    fits = min(math.floor(room / per_row), math.ceil(pdb) - 1)
    return 2 ** int(math.log2(fits))


def remedies(run, devices_per_slice: int, need: int | None = None, argument_bytes: int | None = None,
             limit: int | None = None) -> list[str]:
    """Settings that make the run's step smaller per device, from what the run uses, largest effect first; with
    the step's bytes (need, of which argument_bytes are its arguments) and the device's limit, the batch that would
    fit (fitting_batch)."""
    cfg, mesh = run.cfg, run.mesh
    m, t = cfg.model, cfg.training
    out = []
    state = sum(_shard_bytes(a) for a in jax.tree.leaves(run.abstract_state))
    if m.param_dtype == "float32":
        out.append(f"model.param_dtype=bfloat16 (weights and optimizer moments in bf16: the train state from "
                   f"{gib(state)} to about {gib(state / 2)})")
    if not lora.enabled(cfg):
        out.append("lora.rank=16 lora.base_quantization=nf4 when fine-tuning (adapters train over a frozen 4-bit "
                   "base: docs/finetune.md)")
    elif cfg.lora.base_quantization == "none":
        out.append("lora.base_quantization=nf4 (the frozen base in 4 bits)")
    if m.remat not in ("full", "offload_layer_inputs"):
        out.append(f"model.remat=full (now {m.remat})")
    elif m.remat == "full" and m.block_size >= LONG_CONTEXT and mesh.devices.flat[0].platform == "tpu":
        out.append("model.remat=offload_layer_inputs (the layers' saved inputs in host memory)")
    pdb = t.per_device_batch_size
    fits = fitting_batch(pdb, need, argument_bytes, limit)
    if fits:
        out.append(f"training.per_device_batch_size={fits} (now {pdb:g}; the activations take about "
                   f"{gib((need - argument_bytes) / pdb)} a row beside {gib(argument_bytes)} of state and batch; "
                   "raise training.grad_accum to keep the global batch)")
    elif pdb > 1:
        out.append(f"training.per_device_batch_size={max(1, math.floor(pdb / 2))} (now {pdb:g}; raise "
                   "training.grad_accum to keep the global batch)")
    if mesh.shape["fsdp"] < devices_per_slice:
        out.append(f"mesh.ici_data=1 mesh.ici_fsdp=-1 (FSDP over all {devices_per_slice} devices; now "
                   f"{mesh.shape['fsdp']})")
    out.append("more devices (FSDP shards the state over them)")
    return out


def no_fit_line(run, need: int | None, limit: int, device_kind: str, how: str,
                argument_bytes: int | None = None, fits: str = "") -> str:
    """One line: what the step needs against the device's memory, the settings `fits` that a compile showed to
    fit (fitting_settings), and the settings that shrink it."""
    per_slice = run.mesh.devices.size
    need_s = f"needs {gib(need)} per device ({how})" if need else f"does not fit ({how})"
    first = f"these fit together: {fits}; or " if fits else ""
    return (f"the train step {need_s} and a {device_kind} has {gib(limit)}: {first}make it fit with "
            + "; or ".join(remedies(run, per_slice, need, argument_bytes, limit))
            + "; `jaxlm compile` with compile.topology= lists its largest buffers")


def oom_need(message: str, argument_bytes: int) -> int | None:
    """Bytes per device an out-of-memory compile error says the step needs: XLA:TPU reports either the total
    ("Used 40.5G of 15.75G hbm") or the temporaries alone, to which the arguments are added."""
    size = r"([\d.]+)\s*([KMGT]i?B?|B)?"
    units = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    as_bytes = lambda n, u: int(float(n) * units[(u or "")[:1]])  # noqa: E731
    if m := re.search(r"Used " + size + r" of", message):
        return as_bytes(m[1], m[2])
    if m := re.search(r"temporaries \(" + size + r"\)", message):
        return argument_bytes + as_bytes(m[1], m[2])
    return None


def _compiled_bytes(run, limit: int) -> int | None:
    """The bytes per device of the run's compiled step, None where the compiler refuses it for want of memory."""
    try:
        compiled = step_lib.lower_train_step(run).compile()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return None
    need = device_bytes(compiled.memory_analysis())
    return None if run.mesh.devices.flat[0].platform != "tpu" and need > limit else need


def fitting_settings(run, limit: int) -> str:
    """Settings, checked by compiling them, with which the refused step fits `limit` bytes per device: bf16
    weights and moments (where float32 and not LoRA), remat minimal (where none) and the per-device batch halved,
    grad_accum doubled (the same tokens a step), until the step fits; where even one sequence a device does not
    fit so, remat full (where less) and the batch halved again from the start; '' where nothing fits. A few
    compiles, made only for a step that would not have run. Remat minimal comes first because on a v5e it ran
    faster at a smaller batch than remat full at a larger one (GPT-2: 46.85% MFU at 16 sequences against 44.4% at
    32; docs/performance.md)."""
    cfg = run.cfg
    base: dict = {}
    if cfg.model.param_dtype == "float32" and not lora.enabled(cfg):
        base["model.param_dtype"] = "bfloat16"
    remats = [{}]
    if cfg.model.remat not in ("full", "offload_layer_inputs"):
        remats = [{"model.remat": "minimal"}] * (cfg.model.remat == "none") + [{"model.remat": "full"}]
    devices = list(run.mesh.devices.flat)
    for remat in remats:
        changes = {**base, **remat}
        pdb, accum = cfg.training.per_device_batch_size, cfg.training.grad_accum
        while True:
            trial = run_lib.setup(config_lib.apply_overrides(cfg, changes), devices, data=False)
            need = _compiled_bytes(trial, limit)
            if need is not None:
                settings = " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in changes.items())
                return f"{settings} (compiled: {gib(need)} per device)"
            if pdb <= 1:
                break
            pdb, accum = max(1.0, float(pdb // 2)), accum * 2
            changes.update({"training.per_device_batch_size": pdb, "training.grad_accum": accum})
    return ""


def _refusal(run, need, limit, device, how, argument_bytes) -> ConfigError:
    return ConfigError(no_fit_line(run, need, limit, device.device_kind, how, argument_bytes,
                                   fitting_settings(run, limit)))


def check(run, limit: int | None = None):
    """The run's train step compiled for its devices (step.lower_train_step, as `train` would jit it); a step
    that cannot fit `limit` bytes per device (default: the device's own memory; no check where the device reports
    none) raises ConfigError in one line instead."""
    device = run.mesh.devices.flat[0]
    limit = limit or device_limit(device)
    lowered = step_lib.lower_train_step(run)
    if not limit:
        return lowered.compile()
    argument_bytes = sum(_shard_bytes(a) for a in jax.tree.leaves(step_lib.step_args(run)))
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        need = oom_need(str(e).strip().splitlines()[0], argument_bytes)
        raise _refusal(run, need, limit, device, "the compiler's out-of-memory figure", argument_bytes) from None
    need = device_bytes(compiled.memory_analysis())
    if device.platform != "tpu" and need > limit:  # XLA:TPU refuses a step that does not fit when compiling it
        raise _refusal(run, need, limit, device, "the compiled step's buffers", argument_bytes)
    return compiled
