"""A saved train step's file: a header line, its signature as one JSON line (devices, versions, the shape, dtype and
sharding of every argument, and the settings compiled into it), then the pickled executable; reading it checks
the signature against the run before anything is unpickled, so a mismatch is one line. `jaxlm compile` (aot.py)
writes these files; `jaxlm train ... compile.load=FILE` reads them through `load`.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import pickle
from pathlib import Path

import jax
from jax.experimental import serialize_executable

import jaxlm
from jaxlm.config import Config, ConfigError

HEADER = b"jaxlm-compiled-step 2\n"
# Format 1 was written before steps to save were compiled with the persistent cache off (aot.py): a CPU
# step in it may lack its code.
HEADER_1 = b"jaxlm-compiled-step 1\n"


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def baked_settings(cfg: Config) -> dict:
    """Settings a compiled step holds as constants or shapes: the model, the optimizer and its learning-rate
    schedule (its length included), the batch (with data.packing and data.loss_mask, which decide its arrays) and its pipeline,
    the loss-spike threshold, the dropout seed, the mesh, and the objective with its settings (dpo.*, orpo.*).
    The data, evaluation, checkpoints, logging and the number of steps run are read at run time."""
    out = {f"model.{k}": v for k, v in dataclasses.asdict(cfg.model).items()}
    out.update({f"optimizer.{k}": v for k, v in dataclasses.asdict(cfg.optimizer).items()})
    if cfg.optimizer.decay_steps is None:  # the schedule decays over training.steps
        out["training.steps"] = cfg.training.steps
    out.update({"training.batch_size": cfg.training.batch_size, "training.grad_accum": cfg.training.grad_accum,
                "training.pipeline_microbatches": cfg.training.pipeline_microbatches,
                "training.pipeline_repeats": cfg.training.pipeline_repeats,
                "training.spike_threshold": cfg.training.spike_threshold, "training.objective": cfg.training.objective,
                "seed": cfg.seed})
    out.update({f"mesh.{k}": v for k, v in dataclasses.asdict(cfg.mesh).items()})
    out.update({"data.packing": cfg.data.packing, "data.loss_mask": cfg.data.loss_mask})  # the batch's arrays
    if cfg.training.objective in ("dpo", "ipo"):  # constants of the preference losses
        out.update({"dpo.beta": cfg.dpo.beta, "dpo.label_smoothing": cfg.dpo.label_smoothing})
    elif cfg.training.objective == "orpo":
        out["orpo.lambda"] = cfg.orpo.lambda_
    return out


def signature(cfg: Config, mesh: jax.sharding.Mesh, step_args, topology: str = "", num_slices: int = 1) -> dict:
    """What a step was compiled for (its devices, versions, the shape, dtype and sharding of every argument in
    `step_args`, and the settings baked into it); a run must have the same to use it."""
    device = mesh.devices.flat[0]
    args = [[jax.tree_util.keystr(path), list(a.shape), str(a.dtype), str(a.sharding.spec)]
            for path, a in jax.tree_util.tree_flatten_with_path(step_args)[0]]
    return {"topology": topology, "num_slices": num_slices, "platform": device.platform,
            "device_kind": device.device_kind, "n_devices": int(mesh.devices.size), "mesh": dict(mesh.shape),
            "jaxlm": jaxlm.__version__, "jax": jax.__version__, "jaxlib": _version("jaxlib"),
            "libtpu": _version("libtpu") if device.platform == "tpu" else None,
            "args": args, "settings": baked_settings(cfg)}


def read_signature(path: str | Path) -> tuple[dict, int]:
    """(signature, offset of the executable) of a saved step; nothing is unpickled."""
    try:
        with open(path, "rb") as f:
            header = f.readline()
            line = f.readline()
            offset = f.tell()
    except OSError as e:
        raise ConfigError(f"compile.load={path}: cannot read it ({e.strerror})") from None
    if header not in (HEADER, HEADER_1):
        raise ConfigError(f"compile.load={path} is not a step saved by `jaxlm compile compile.output=FILE`")
    try:
        sig = json.loads(line)
    except ValueError:
        raise ConfigError(f"compile.load={path}: its signature is damaged; compile it again") from None
    if header == HEADER_1 and sig.get("platform") == "cpu":
        raise ConfigError(f"compile.load={path} was saved by an earlier jaxlm that could save a CPU step without "
                          "its compiled code; compile it again")
    return sig, offset


def _describe(sig: dict) -> str:
    where = f" ({sig['topology']})" if sig.get("topology") else ""
    return f"{sig['n_devices']} {sig['device_kind']} device{'s' if sig['n_devices'] != 1 else ''}{where}"


def check_signature(saved: dict, here: dict, path) -> None:
    """One line naming the first difference that stops `here`'s run from using the saved step. Another jaxlm
    comes first: its signature and pickled executable may name what this version no longer has."""
    if saved.get("jaxlm") != here["jaxlm"]:  # format-2 files before 0.2.0 carry no version
        raise ConfigError(f"compile.load={path} was saved by jaxlm {saved.get('jaxlm') or '0.1.0 or earlier'} and "
                          f"this is jaxlm {here['jaxlm']}; compile it again with this installation")
    if (saved["platform"], saved["device_kind"], saved["n_devices"]) != (here["platform"], here["device_kind"],
                                                                          here["n_devices"]):
        raise ConfigError(f"compile.load={path} was compiled for {_describe(saved)} but this run has "
                          f"{_describe(here)}: run it there, or compile for these devices")
    for key in ("jax", "jaxlib", "libtpu"):
        if saved.get(key) != here.get(key):
            raise ConfigError(f"compile.load={path} was compiled with {key} {saved.get(key)} and this process has "
                              f"{here.get(key)}; compile it again with this installation")
    objective = saved["settings"].get("training.objective", "next_token")
    if objective != here["settings"]["training.objective"]:  # before the arrays, which the objective decides
        raise ConfigError(f"compile.load={path} is a step of training.objective={objective} and this run has "
                          f"{here['settings']['training.objective']}; compile the step for this objective")
    saved_args, here_args = {a[0]: a for a in saved["args"]}, {a[0]: a for a in here["args"]}
    for name in list(saved_args) + [n for n in here_args if n not in saved_args]:
        if name not in here_args or name not in saved_args:
            if name.startswith("['batch']"):
                had = "with" if name in saved_args else "without"
                raise ConfigError(f"compile.load={path}: the step was compiled {had} the batch array {name} "
                                  "(data.packing / data.loss_mask differ); use the saved data settings or compile "
                                  "again")
            raise ConfigError(f"compile.load={path}: the train state differs from the compiled one at {name} "
                              "(model settings changed); compile again for these settings")
        (_, s_shape, s_dtype, s_spec), (_, h_shape, h_dtype, _) = saved_args[name], here_args[name]
        if (s_shape, s_dtype) != (h_shape, h_dtype):
            what = ("training.batch_size/per_device_batch_size, training.grad_accum and model.block_size"
                    if name.startswith("['batch']") else "the model settings")
            raise ConfigError(f"compile.load={path} expects {name} of shape {tuple(s_shape)} {s_dtype}, given "
                              f"{tuple(h_shape)} {h_dtype}: {what} must be as compiled")
    for key, value in saved["settings"].items():
        if here["settings"].get(key, value) != value:
            raise ConfigError(f"compile.load={path} was compiled with {key}={value!r} and this run has "
                              f"{here['settings'][key]!r}; the step holds it fixed (docs/aot.md): use that value "
                              "or compile again")
    for name, (_, _, _, s_spec) in saved_args.items():
        if here_args[name][3] != s_spec:
            raise ConfigError(f"compile.load={path} expects {name} sharded as {s_spec}, this run places it as "
                              f"{here_args[name][3]}; compile again for this mesh")


def load(path: str | Path, cfg: Config, mesh: jax.sharding.Mesh, step_args) -> jax.stages.Compiled:
    """The saved train step, after checking that it was compiled for this run's devices, shapes and settings
    (`step_args`: the abstract arguments the run would call it with)."""
    saved, offset = read_signature(path)
    check_signature(saved, signature(cfg, mesh, step_args), path)
    with open(path, "rb") as f:
        f.seek(offset)
        payload, in_tree, out_tree = pickle.load(f)
    return serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                     backend=mesh.devices.flat[0].platform)
