"""The run's resolved settings (`setup` -> Run): data and vocabulary, the run's tokenizer, the loss mask, the
mesh and shardings, the batch over the mesh, the run directory, and the trained weights' abstract state;
everything checked before anything is compiled, so a bad setting fails in one line. `jaxlm train` (loop.py),
`jaxlm compile` (aot.py), `jaxlm eval` and the benchmarks start here.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path

import jax
import optax

from jaxlm import config as config_lib
from jaxlm import runtime, sharding, storage
from jaxlm.errors import UserError
from jaxlm.model import lora
from jaxlm.train import metrics, objectives, optim
from jaxlm.train.state import make_abstract_state, placed
from jaxlm.config import Config, ConfigError
from jaxlm.data import (loader as loader_lib, mixture, preference, prepare, tokenizer as tokenizer_lib,
                        train_images, vision_data)
from jaxlm.model import param_specs, ring


class TrainingError(UserError, RuntimeError, exit_status=1):
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
    # The images of a dataset prepared with them, per split (data/vision_data.py); None otherwise.
    images: dict | None = None
    # Image slots per row of the step's batches (image_slots); 0: its batches carry no images.
    image_slots: int = 0
    # One image of the step's batches as the tower takes it ([S, S, 3]; a padded layout's dict of shapes: Llama 4's
    # tiles and canvas, Qwen-VL's patches and grid; data/train_images.py).
    image_shape: tuple | dict = ()


def resolve_data_dir(cfg: Config) -> Path | str:
    """data.dir as a local Path (a path or file:// URL), or the URL of a folder on object storage; data/<dataset>
    when unset."""
    if not cfg.data.dir:
        return Path("data") / cfg.data.dataset
    local = storage.local_path(cfg.data.dir)
    return cfg.data.dir if local is None else local


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
            data_dir = resolve_data_dir(cfg)
            if isinstance(data_dir, Path):  # a folder at a URL is read as it is, never prepared into
                data_dir = prepare.ensure_prepared(cfg.data.dataset, data_dir, cfg.data.input)
            dataset = loader_lib.Dataset(data_dir, cfg.data)
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
                              f"({dataset.vocab_size}, from {storage.join(data_dir, 'meta.json')})")
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
    if runtime.platform(mesh) == "cpu":
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
    images = check_images(cfg, dataset) if dataset is not None else None
    slots = image_slots(cfg, dataset, images)
    if slots and n > 1:
        raise ConfigError(f"image data needs the `length` axis on one device (an image's tokens attend to one "
                          f"another), and the mesh splits it over {n} devices (mesh.ici_sequence / dcn_sequence or "
                          "mesh.rules); use FSDP or tensor parallelism")
    specs = lora.specs(cfg) if lora.enabled(cfg) else param_specs(cfg.model)
    optimizer = optim.make(cfg.optimizer, cfg.training.steps, None if lora.enabled(cfg) else specs, mesh, param_rules)
    if vision_frozen(cfg) and not lora.enabled(cfg):  # a LoRA run's tower is in its frozen base already
        optimizer = optim.frozen(optimizer, ("vision",))
    abstract_state = make_abstract_state(specs, mesh, optimizer, param_rules)
    abstract_frozen = placed(lora.frozen_specs(cfg), mesh, param_rules) if lora.enabled(cfg) else None
    run_dir = resolve_run_dir(cfg)
    return Run(cfg, run_dir, dataset, mesh, param_rules, act_rules, specs, optimizer, abstract_state, tokenizer,
               abstract_frozen, images=images, image_slots=slots, image_shape=image_shape(cfg, images) if slots else ())


def vision_frozen(cfg: Config) -> bool:
    """Whether the run leaves the model's vision tower as it is (training.freeze_vision, a model with one)."""
    return cfg.model.vision is not None and cfg.training.freeze_vision


def image_shape(cfg: Config, images: dict | None) -> tuple | dict:
    """One image of the run's batches: the data's (data/train_images.py), or without data the kind's default."""
    fixed = images["train"].fixed if images is not None else train_images.of_model(None, cfg.model.vision, check=False)
    return fixed.shape


def image_slots(cfg: Config, dataset, images: dict | None) -> int:
    """Image slots per row of the run's batches (data.images_per_row): with image data, the setting or the most
    images a row's unit holds (a conversation, or a preference pair: its prompt's images twice); without data (an
    ahead-of-time compile of a model with a tower), the setting or 1; otherwise 0, no images."""
    want = cfg.data.images_per_row
    if images is None:
        compiling = dataset is None and cfg.model.vision is not None and cfg.training.objective != "grpo"
        return (want or 1) if compiling else 0
    per_unit = 2 if preference.is_preference(dataset.meta) else 1
    need = per_unit * max(images["train"].max_per_document, 1)
    if want and want < need:
        unit = "preference pair (its prompt's images, once per reply)" if per_unit == 2 else "conversation"
        raise ConfigError(f"data.images_per_row={want}: a {unit} of {dataset.dir} has {need} images and is never "
                          f"cut; set data.images_per_row >= {need} (or 0)")
    return want or need


def check_images(cfg: Config, dataset) -> dict | None:
    """The dataset's images per split (vision_data.SplitImages), checked against the run's settings; None for a
    dataset without images. What image data does not support yet stops here in one line."""
    folders = dataset.datasets if isinstance(dataset, mixture.MixtureDataset) else [dataset]
    with_images = [ds.dir for ds in folders if "images" in ds.meta]
    if not with_images:
        if cfg.model.vision is not None and lora.enabled(cfg) and not cfg.training.freeze_vision:
            raise ConfigError("lora.rank>0 adapts the language model only: the vision tower stays frozen; set "
                              "training.freeze_vision=true, or lora.rank=0 to train the tower")
        return None
    where = with_images[0]
    refusals = [
        (len(folders) > 1, "data.mixture: train on the folder with images alone"),
        (cfg.model.vision is None, "a model without a vision tower (model.vision): train a vision-language model's "
                                   "config, e.g. `jaxlm convert from-hf` of Gemma 3"),
        (cfg.training.objective not in ("next_token", *objectives.PREFERENCE),
         f"training.objective={cfg.training.objective}: image data trains with next_token (SFT) or, prepared as "
         "preference pairs, with dpo, ipo or orpo"),
        (cfg.data.loss_mask == "off", "data.loss_mask=off: padding would be trained; set data.loss_mask=auto"),
        (lora.enabled(cfg) and not cfg.training.freeze_vision,
         "lora.rank>0 with training.freeze_vision=false: LoRA adapts the language model and keeps the tower frozen"),
    ]
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"{where} holds images, which do not combine with {why}")
    check_image_kind(cfg.model.vision, dataset.meta["images"], where)
    return vision_data.open_images(dataset)


def check_image_kind(v, info: dict, where) -> None:
    """One line when a folder's images are not for this tower (its kind, side, or Qwen-VL's patches)."""
    fixed, again = train_images.of_meta(info), "; prepare the data with this model's folder"
    if fixed.kind != v.kind and not {fixed.kind, v.kind} <= set(train_images.QWEN):
        raise ConfigError(f"{where} holds images for a {fixed.kind} tower and model.vision.kind is {v.kind}{again}")
    if fixed.kind in train_images.QWEN:
        p = fixed.processor
        if (p.patch_size, p.merge_size, p.temporal_patch_size) != (v.patch_size, v.spatial_merge, v.temporal_patch):
            raise ConfigError(f"{where} holds patch grids of patch {p.patch_size}, merge {p.merge_size}, temporal "
                              f"patch {p.temporal_patch_size}, which model.vision does not take{again}")
    elif fixed.side != v.image_size:
        raise ConfigError(f"{where} holds {fixed.side}x{fixed.side} images and model.vision.image_size is "
                          f"{v.image_size}{again}")


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
    from jaxlm.store import weights

    init = cfg.checkpoint.init_from
    model_tok = weights.tokenizer_source(Path(init), cfg) if init and Path(init).is_dir() else None
    if model_tok is not None and not any((model_tok / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        model_tok = None  # weights imported without tokenizer files: the dataset's tokenizer is the run's
    try:
        return tokenizer_lib.resolve(cfg.data.tokenizer, model_tok, dataset.meta, dataset=f"the dataset {dataset.dir}")
    except tokenizer_lib.TokenizerError as e:
        raise ConfigError(str(e)) from None


def rollout_tokenizer(cfg: Config) -> tokenizer_lib.Tokenizer:
    """A GRPO run's tokenizer: data.tokenizer, else the converted model's (checkpoint.init_from), else the one
    recorded by the prepared data in data.dir / data.dataset (the data the model was trained on)."""
    from jaxlm.store import weights

    init = cfg.checkpoint.init_from
    model_tok = weights.tokenizer_source(Path(init), cfg) if init and Path(init).is_dir() else None
    data_dir = resolve_data_dir(cfg)
    meta = (loader_lib.read_meta(data_dir) if not model_tok and storage.exists(storage.join(data_dir, "meta.json"))
            else None)
    try:
        return tokenizer_lib.resolve(cfg.data.tokenizer, model_tok, meta, dataset=f"the dataset {data_dir}")
    except tokenizer_lib.TokenizerError as e:
        raise ConfigError(str(e)) from None


def resolve_loss_mask(cfg: Config, dataset: loader_lib.Dataset | None) -> str:
    """data.loss_mask as the step will use it, "on" or "off": auto follows the dataset (its meta.json alone
    when the corpus is not opened, as for `jaxlm compile`; no dataset at all reads as none, except for a model with
    a vision tower, compiled for image data, which always has a mask)."""
    setting = cfg.data.loss_mask
    if cfg.training.objective in objectives.PREFERENCE:  # pairs are scored on their replies, which the mask marks
        return "on"
    if setting == "off" or cfg.training.objective == "grpo":  # rollouts weigh their completion tokens themselves
        return "off"
    if dataset is not None:
        has, where = dataset.has_loss_mask, dataset.dir
    elif cfg.model.vision is not None:  # a compile of the image-data step (image_slots), whose data has a mask
        return "on"
    else:
        folders = ([p for p, _ in config_lib.parse_mixture(cfg.data.mixture)] if cfg.data.mixture
                   else [resolve_data_dir(cfg)])
        where = folders[0]
        has = all(storage.exists(storage.join(d, "meta.json")) and bool(loader_lib.read_meta(d).get("has_loss_mask"))
                  for d in folders)
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
                                                      "splash_layout", "loss_chunk_tokens", "scan_layers",
                                                      "compute_dtype", "quantization", "quant_logits",
                                                      "quant_stochastic_rounding", "moe_matmul", "moe_tiles"):
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
