"""Evaluate a trained run: restore its latest checkpoint, measure the loss on the fixed held-out batches that
training evaluated on, and sample text, optionally with quantized matmuls or int8-stored weights
(`model.quantization=int8_weights`), reporting the float figures beside them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

from jaxlm.store import checkpoint as ckpt
from jaxlm import config as config_lib
from jaxlm import storage
from jaxlm.model import lora, quant
from jaxlm.train import (batches as batch_lib, objectives, reference, run as run_lib, state as state_lib,
                         step as step_lib)
from jaxlm.config import ConfigError


def load_run_config(run_dir: str | Path, overrides: dict) -> config_lib.Config:
    path = storage.join(run_dir, "config.json")
    if not storage.exists(path):
        raise ConfigError(f"{run_dir} holds no config.json; pass the run_dir of a training run")
    cfg = config_lib.apply_overrides(config_lib.from_dict(json.loads(storage.read_text(path))), overrides)
    config_lib.validate(cfg)
    return cfg.replace(run_dir=str(run_dir))


def evaluate_run(run_dir: str | Path, overrides: dict | None = None, devices=None,
                 log: Callable[[str], None] = print) -> dict:
    """Losses (and a sample) of the run's latest checkpoint under the given overrides; with a quantization
    setting, the float losses of the same weights too. `run_dir` may be a URL (storage.py)."""
    if storage.local_path(run_dir) is None:
        storage.check_reachable(run_dir)
    cfg = load_run_config(run_dir, overrides or {})
    run = run_lib.setup(cfg, devices)
    cfg, t_cfg = run.cfg, run.cfg.training
    restored = ckpt.restore_newest(run_dir, run.abstract_state, log)
    if restored is None:
        raise ckpt.CheckpointError(f"{storage.join(run_dir, 'checkpoints')} holds no committed checkpoint to evaluate")
    step, state, _ = restored
    float_params, frozen = state["params"], None
    if lora.enabled(cfg):  # the base with the adapters merged: one set of weights for every evaluation below
        frozen = state_lib.load_frozen(run)
        float_params = lora.merge(frozen, state["params"], cfg)
    params = float_params
    if cfg.model.quantization == "int8_weights":
        params = quant.quantize_params(float_params, cfg.model)
    if run_lib.reference_in_batch(cfg):  # dpo, ipo: the run's reference log-probabilities
        reference.ensure(run, state, log)
    # A LoRA dpo/ipo run's reference is its base: its losses need the adapters beside the base, not merged.
    by_adapters = lora.enabled(cfg) and cfg.training.objective in objectives.NEEDS_REFERENCE
    if by_adapters and cfg.model.quantization != "none":
        raise ConfigError(f"model.quantization={cfg.model.quantization} evaluates merged weights, and a LoRA "
                          f"{cfg.training.objective} run is evaluated with its adapters apart from the base (its "
                          "reference); evaluate it without model.quantization")

    # The same batches (same seed) that training evaluated on, so the numbers compare with metrics.jsonl.
    batches = batch_lib.eval_plans(run)
    eval_step = step_lib.make_eval_step(cfg, run.mesh, run.act_rules)
    losses = (batch_lib.evaluate(eval_step, state["params"], run, batches, frozen) if by_adapters
              else batch_lib.evaluate(eval_step, params, run, batches))
    summary = {"step": step, "quantization": cfg.model.quantization, "train_loss": losses["train"],
               "val_loss": losses["val"], "param_bytes": quant.nbytes(params)}
    line = f"step {step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}"
    if cfg.model.quantization != "none":
        float_cfg = cfg.replace(model=dataclasses.replace(cfg.model, quantization="none"))
        float_losses = batch_lib.evaluate(step_lib.make_eval_step(float_cfg, run.mesh, run.act_rules), float_params,
                                          run, batches)
        summary.update(float_train_loss=float_losses["train"], float_val_loss=float_losses["val"],
                       float_param_bytes=quant.nbytes(float_params))
        line += (f" with model.quantization={cfg.model.quantization} (float: val loss {float_losses['val']:.4f}, "
                 f"difference {losses['val'] - float_losses['val']:+.4f}); weights "
                 f"{summary['param_bytes'] / 2**20:.2f} MiB (float {summary['float_param_bytes'] / 2**20:.2f} MiB)")
    log(line)
    if t_cfg.sample_tokens:
        summary["sample"] = step_lib.sample_text(params, cfg, run.tokenizer, t_cfg.sample_prompt,
                                                 t_cfg.sample_tokens, t_cfg.sample_temperature, t_cfg.sample_top_k)
        log("sample:\n" + t_cfg.sample_prompt + summary["sample"])
    return summary
