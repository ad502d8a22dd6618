"""LoRA adapters in and out of Hugging Face PEFT's format, and read for serving over a base (`serve.adapters`).
`jaxlm convert to-hf RUN OUT --adapter-only` writes adapter_config.json and adapter_model.safetensors, which
`peft.PeftModel.from_pretrained(base, OUT)` loads; `jaxlm convert from-hf BASE OUT --adapter PEFT_DIR` imports an
adapter (written by peft or by jaxlm) beside the converted base, to serve it or to go on training it.

PEFT names an adapter after the module it adapts: `base_model.model.{module}.lora_A.weight` [r, in] and
`.lora_B.weight` [out, r]. jaxlm stacks A [L, *in, r] and B [L, r, *out] by layer, so layer i's lora_A is A[i]
flattened to [in, r] and transposed, its lora_B B[i] flattened to [r, out] and transposed. This holds for the
families whose projections are plain linear maps (Llama, Mistral, Qwen, Gemma: `modules` checks it); GPT-2's
fused c_attn is refused in one line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from jaxlm import config as config_lib, families
from jaxlm.store import convert, weights
from jaxlm.model import lora
from jaxlm.config import Config
from jaxlm.families.rules import ConvertError
from jaxlm.model import param_specs

PREFIX = "base_model.model."
# PEFT settings that change what an adapter computes and that jaxlm does not implement: importing one of them
# would give other numbers, so it is refused.
UNSUPPORTED = {"use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "bias": "none", "lora_bias": False,
               "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
               "target_parameters": None, "layer_replication": None}


def modules(cfg: Config) -> dict[tuple[str, str], str]:
    """(block, name) of every adapted weight -> its Hugging Face module name with `{i}` for the layer. Checks
    that the family's tensor is our weight reshaped and transposed, which the lora_A / lora_B layout assumes."""
    fam, model_type = families.for_config(cfg.model)
    by_ours = {rule.ours: rule for rule in fam.rules(cfg.model)}
    specs = param_specs(cfg.model)["layers"]
    out = {}
    for blk, name in lora.targets(cfg):
        rule = by_ours.get((f"layers.{blk}.{name}",))
        if rule is None or not rule.hf.endswith(".weight") or "{i}" not in rule.hf:
            raise ConvertError(f"the {model_type} family has no Hugging Face module for layers.{blk}.{name}; its "
                               "adapter cannot be written in PEFT's format")
        shape = specs[blk][name].shape[1:]
        k = lora.n_in(name)
        probe = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
        if not np.array_equal(rule.to_hf(probe), probe.reshape(int(np.prod(shape[:k])), -1).T):
            raise ConvertError(f"the {model_type} tensor {rule.hf} is not layers.{blk}.{name} reshaped and transposed "
                               "(a fused or permuted projection); its LoRA adapter has no PEFT equivalent")
        out[blk, name] = module_name(fam, rule.hf.removesuffix(".weight"))
    return out


def module_name(fam, name: str) -> str:
    """A tensor's module as transformers names it at run time, which PEFT's adapters use: a multimodal family's
    checkpoints may spell the language model's otherwise (Gemma 3's language_model.model.*, Qwen2.5-VL's
    model.*: the family's PREFIXES), and an adapter written by an older transformers may too."""
    for runtime, saved in getattr(fam, "PREFIXES", ()):
        if name.startswith(runtime):
            return name
        if name.startswith(saved):
            return runtime + name[len(saved):]
    return name


def _hf_module_names(mods: dict, cfg: Config) -> list[str] | str:
    """PEFT's target_modules: the module names, or for a model with a vision tower (whose modules may share
    them: SigLIP's q_proj, Qwen-VL's down_proj) a pattern that PEFT matches against the language model's alone."""
    names = sorted({m.rsplit(".", 1)[-1] for m in mods.values()})
    if cfg.model.vision is None:
        return names
    return rf"{re.escape(_language_prefix(mods))}layers\.\d+\..*\.({'|'.join(names)})"


def _language_prefix(mods: dict) -> str:
    """What the language model's module names start with ("model.language_model." for transformers' VLMs)."""
    return next(iter(mods.values())).split("layers.{i}", 1)[0]


def pattern_targets(pattern: str, cfg: Config, cfg_file: Path) -> list[str]:
    """The projections a target_modules pattern names (PEFT matches it whole against each module's name), all
    layers alike; one line when it names a layer's module but not all layers' (layers_to_transform)."""
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise ConvertError(f"{cfg_file}: target_modules={pattern!r} is not a regular expression ({e})") from None
    every = config_lib.apply_overrides(cfg, {"lora.rank": max(cfg.lora.rank, 1),
                                             "lora.targets": ",".join(config_lib.LORA_TARGETS)})
    out = []
    for (_, name), module in modules(every).items():
        hits = [bool(compiled.fullmatch(module.format(i=i))) for i in range(cfg.model.n_layers)]
        if any(hits) and not all(hits):
            raise ConvertError(f"{cfg_file}: target_modules={pattern!r} names {module.format(i=hits.index(True))} "
                               "but not every layer's; jaxlm adapts a projection in all layers")
        if all(hits):
            out.append(lora.HF_NAMES[name])
    if not out:
        raise ConvertError(f"{cfg_file}: target_modules={pattern!r} names none of the language model's projections "
                           f"(e.g. {next(iter(modules(every).values())).format(i=0)})")
    return sorted(set(out))


def write_peft(path: str | Path, out: str | Path, dtype: str | None = None, log: Callable[[str], None] = print
               ) -> Path:
    """The adapters of a LoRA run (or of a folder with an imported adapter) as a PEFT adapter folder."""
    cfg = weights.load_config(path)
    if not lora.enabled(cfg):
        raise ConvertError(f"{path} is not a LoRA run (lora.rank=0): it has no adapter; export the whole model "
                           "without --adapter-only")
    mods = modules(cfg)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    adapters = jax.device_get(weights.restore_adapters(path, cfg, lambda tree: jax.tree.map(lambda _: one, tree)))
    out_dtype = np.dtype(jax.numpy.dtype(dtype or cfg.model.param_dtype))
    arrays = {}
    for (blk, name), module in mods.items():
        a, b = adapters["layers"][blk][name]["a"], adapters["layers"][blk][name]["b"]
        r = a.shape[-1]
        for i in range(cfg.model.n_layers):
            m = PREFIX + module.format(i=i)
            arrays[f"{m}.lora_A.weight"] = np.asarray(a[i], np.float32).reshape(-1, r).T
            arrays[f"{m}.lora_B.weight"] = np.asarray(b[i], np.float32).reshape(r, -1).T
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    entries = [(k, v.shape, out_dtype) for k, v in sorted(arrays.items())]
    convert.write_safetensors(out / "adapter_model.safetensors", entries, lambda k: arrays[k])
    fam, model_type = families.for_config(cfg.model)
    hf_cfg = fam.config_to_hf(cfg.model, model_type)
    lo = cfg.lora
    adapter_cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lo.rank, "lora_alpha": lo.alpha,
                   "lora_dropout": lo.dropout, "target_modules": _hf_module_names(mods, cfg),
                   "base_model_name_or_path": _base_name(path, cfg), "inference_mode": True,
                   "init_lora_weights": True, "auto_mapping": {"base_model_class": hf_cfg["architectures"][0]},
                   **UNSUPPORTED}
    (out / "adapter_config.json").write_text(json.dumps(adapter_cfg, indent=2))
    log(f"exported the LoRA adapter of {path} (rank {lo.rank}, {len(mods)} projections x {cfg.model.n_layers} "
        f"layers, {sum(v.size for v in arrays.values()):,} parameters, {out_dtype}) as a PEFT adapter -> {out}")
    return out


def _base_name(path, cfg: Config) -> str | None:
    """The base model's folder, as the adapter's base_model_name_or_path."""
    return str(path) if weights.has_adapter_dir(path) else cfg.checkpoint.init_from


def check_peft_folder(peft_dir: str | Path) -> dict:
    """A PEFT adapter folder's adapter_config.json, once its two files are known to be there."""
    folder = Path(peft_dir)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        if not (folder / name).is_file():
            raise ConvertError(f"--adapter {peft_dir} has no {name}; expected a PEFT adapter folder "
                               "(save_pretrained of a peft model)")
    try:
        return json.loads((folder / "adapter_config.json").read_text())
    except ValueError as e:
        raise ConvertError(f"{folder / 'adapter_config.json'} is not valid JSON ({e})") from None


def read_peft(peft_dir: str | Path, cfg: Config) -> tuple[Config, dict]:
    """A PEFT LoRA adapter for the model of `cfg`: the config with its lora settings, and the adapters as numpy
    arrays in jaxlm's layout. Anything that does not fit the model stops with one line naming it."""
    ac = check_peft_folder(peft_dir)
    cfg_file, tensors = Path(peft_dir) / "adapter_config.json", Path(peft_dir) / "adapter_model.safetensors"
    if ac.get("peft_type") != "LORA":
        raise ConvertError(f"{cfg_file}: peft_type={ac.get('peft_type')!r}; only LORA adapters are supported")
    for key, plain in UNSUPPORTED.items():
        value = ac.get(key)
        if value not in (None, plain, [], {}):
            raise ConvertError(f"{cfg_file}: {key}={ac[key]!r} is not supported (jaxlm's LoRA computes "
                               f"x W + (alpha / r) x A B on the base's own projections)")
    fam, model_type = families.for_config(cfg.model)
    base_class = (ac.get("auto_mapping") or {}).get("base_model_class")
    ours = fam.config_to_hf(cfg.model, model_type)["architectures"][0]
    if base_class and base_class != ours:
        raise ConvertError(f"{cfg_file} adapts a {base_class}, and the base is a {ours}: the adapter belongs to "
                           "another architecture")
    target_modules = ac.get("target_modules") or []
    if isinstance(target_modules, str):
        target_modules = pattern_targets(target_modules, cfg, cfg_file)
    reverse = {hf: ours_ for ours_, hf in lora.HF_NAMES.items()}
    unknown = [t for t in target_modules if t not in reverse]
    if unknown:
        raise ConvertError(f"{cfg_file}: target module {unknown[0]!r} is not a projection jaxlm adapts "
                           f"({', '.join(reverse)})")
    r, alpha = int(ac["r"]), float(ac["lora_alpha"])
    cfg = config_lib.apply_overrides(cfg, {"lora.rank": r, "lora.alpha": alpha,
                                           "lora.dropout": float(ac.get("lora_dropout") or 0.0),
                                           "lora.targets": ",".join(t for t in config_lib.LORA_TARGETS
                                                                    if lora.HF_NAMES[t] in target_modules)})
    config_lib.validate(cfg)
    mods = modules(cfg)
    specs = lora.specs(cfg)["layers"]
    expected = {}
    for (blk, name), module in mods.items():
        for i in range(cfg.model.n_layers):
            for part in ("A", "B"):
                expected[f"{PREFIX}{module.format(i=i)}.lora_{part}.weight"] = (blk, name, i, part)
    out = {"layers": {blk: {name: {"a": np.zeros(specs[blk][name]["a"].shape, np.float32),
                                   "b": np.zeros(specs[blk][name]["b"].shape, np.float32)} for name in names}
                      for blk, names in specs.items()}}
    header, start = convert.read_header(tensors)
    seen = set()
    with open(tensors, "rb") as f:
        for raw, info in header.items():
            key = raw.replace(".default.weight", ".weight")
            key = PREFIX + module_name(fam, key.removeprefix(PREFIX))
            if key not in expected and cfg.model.vision is not None and not key.startswith(
                    PREFIX + _language_prefix(mods)):
                raise ConvertError(f"{tensors.name}: tensor {raw} adapts a module outside the language model (the "
                                   "vision tower or projector); jaxlm's LoRA adapts the language model's projections "
                                   "only (give target_modules as a pattern that names those alone)")
            if key not in expected:
                raise ConvertError(f"{tensors.name}: tensor {raw} is not an adapter of a {model_type} model with "
                                   f"lora.targets={cfg.lora.targets} (adapter for another model?)")
            blk, name, i, part = expected[key]
            target = out["layers"][blk][name][part.lower()]
            want = ((r, int(np.prod(target.shape[1:-1]))) if part == "A" else (int(np.prod(target.shape[2:])), r))
            if tuple(info["shape"]) != want:
                raise ConvertError(f"{tensors.name}: tensor {raw} has shape {tuple(info['shape'])}, and this base "
                                   f"needs {want}: the adapter was made for a model of another size")
            tensor = convert.read_tensor(f, info, start, raw).astype(np.float32)
            target[i] = tensor.T.reshape(target.shape[1:])  # [in, r] -> [*in, r]; [r, out] -> [r, *out]
            seen.add(key)
    missing = sorted(set(expected) - seen)
    if missing:
        raise ConvertError(f"{tensors.name} lacks {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1
                                                                   else ""))
    return cfg, out


def import_peft(out: Path, peft_dir: str | Path, log: Callable[[str], None] = print) -> None:
    """Put a PEFT adapter beside the base converted into `out`: out/adapter (Orbax) and the lora settings in
    out/config.json, so that `jaxlm.load(out)` and `jaxlm serve out` run base + adapter and `jaxlm train
    out/config.json` goes on training it."""
    cfg = weights.load_config(out)
    cfg, adapters = read_peft(peft_dir, cfg)
    weights.save_params(out / weights.ADAPTER_DIR, jax.tree.map(
        lambda a: jax.numpy.asarray(a, jax.numpy.dtype(cfg.model.param_dtype)), adapters))
    (out / "config.json").write_text(config_lib.to_json(cfg))
    log(f"imported the PEFT adapter {peft_dir} (rank {cfg.lora.rank}, alpha {cfg.lora.alpha:g}, "
        f"{cfg.lora.targets}) -> {out / weights.ADAPTER_DIR}")


def for_serving(path: str | Path, base_cfg: Config, sharding) -> tuple[dict, float]:
    """The adapters of one serve.adapters entry, to serve over a base of settings `base_cfg`: a PEFT adapter
    folder (adapter_config.json), a LoRA run directory or a converted folder with an imported adapter. Returns
    the adapters in lora.specs' layout in the base's dtype, placed by `sharding`, and their scale alpha / r. An
    adapter made for a model of other shapes, or adapting a weight the base lacks, stops in one line; that it
    was trained on this base's weights is the user's word (only shapes can be checked)."""
    dtype = jax.numpy.dtype(base_cfg.model.param_dtype)
    if (Path(path) / "adapter_config.json").is_file():
        cfg, tree = read_peft(path, base_cfg)
        return jax.device_put(jax.tree.map(lambda a: a.astype(dtype), tree), sharding), lora.scale(cfg)
    cfg = weights.load_config(path)
    if not lora.enabled(cfg):
        raise ConvertError(f"serve.adapters: {path} holds no LoRA adapter (lora.rank=0); give a PEFT adapter "
                           "folder, a LoRA run directory or a converted folder with an imported adapter")
    ours, base = param_specs(cfg.model)["layers"], param_specs(base_cfg.model)["layers"]
    for blk, name in lora.targets(cfg):
        theirs = base.get(blk, {}).get(name)
        if theirs is None or theirs.shape != ours[blk][name].shape:
            have = "none" if theirs is None else list(theirs.shape)
            raise ConvertError(f"serve.adapters: {path} adapts layers.{blk}.{name} of shape "
                               f"{list(ours[blk][name].shape)}, and the served base's is {have}: the adapter "
                               "belongs to another model")
    tree = weights.restore_adapters(path, cfg, lambda t: jax.tree.map(lambda _: sharding, t))
    return jax.tree.map(lambda a: a.astype(dtype), tree), lora.scale(cfg)
