"""Building a Config in three layers: the dataclass defaults, a base (a preset module under `jaxlm/configs/`,
read by name, or a YAML/JSON file), then dotted `key=value` overrides from the command line, typed here and
validated at the end; a mistake ends in a one-line ConfigError naming the key, the bad value and what is allowed."""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
import math
import pkgutil
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from jaxlm.config.model_schema import ModelConfig
from jaxlm.config.rules import ConfigError
from jaxlm.config.schema import ALIASES, PREFERENCE_OBJECTIVES, Config, all_keys, sections, spelled
from jaxlm.config.validation import validate

def type_name(t) -> str:
    origin = typing.get_origin(t)
    if origin is Literal:
        return "|".join(str(a) for a in typing.get_args(t))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        return f"{type_name(args[0])} or None" if len(args) == 1 else " or ".join(map(type_name, args))
    return getattr(t, "__name__", str(t))


def _coerce(key: str, value: Any, t) -> Any:
    """Convert `value` (a string from the command line, or a YAML/JSON scalar) to type `t`."""
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(t)
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() in ("none", "null"))):
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(key, value, inner)
    if dataclasses.is_dataclass(t) and isinstance(value, dict):  # a nested section (model.vision)
        hints = typing.get_type_hints(t)
        for k in value:
            if k not in hints:
                raise _unknown(f"{key}.{k}", [f"{key}.{name}" for name in hints])
        return t(**{k: _coerce(f"{key}.{k}", v, hints[k]) for k, v in value.items()})
    if origin is Literal:
        choices = typing.get_args(t)
        if value in choices:
            return value
        hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        extra = f" (did you mean '{hint[0]}'?)" if hint else ""
        raise ConfigError(f"{key}={value!r} is not allowed{extra}; choose one of: {', '.join(map(str, choices))}")
    try:
        if t is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if t is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float):
                if not value.is_integer():
                    raise ValueError
                return int(value)
            if isinstance(value, str):
                v = float(value.replace("_", ""))
                if not v.is_integer():
                    raise ValueError
                return int(v)
            if isinstance(value, int):
                return value
            raise ValueError
        if t is float:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, (int, float)):
                return float(value)
            if isinstance(value, str):
                return float(value)
            raise ValueError
        if t is str:
            if isinstance(value, (dict, list)):
                raise ValueError
            return str(value)
    except ValueError:
        raise ConfigError(f"{key}={value!r} is not a valid {type_name(t)}") from None
    raise ConfigError(f"{key}: unsupported setting type {t}")


def _unknown(key: str, candidates: list[str]) -> ConfigError:
    hint = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    extra = f" (did you mean '{hint[0]}'?)" if hint else ""
    return ConfigError(f"unknown setting '{key}'{extra}; `jaxlm train --help` lists them all")


def apply_overrides(cfg: Config, overrides: dict[str, Any]) -> Config:
    """Return `cfg` with dotted-key overrides applied, type-checked; does not validate ranges."""
    by_name = sections()
    keys = [spelled(k) for k, *_ in all_keys()]
    top_hints = typing.get_type_hints(Config)
    changes: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for key, value in overrides.items():
        key = ALIASES.get(key, key)
        parts = key.split(".")
        if len(parts) == 1 and parts[0] in top_hints and parts[0] not in by_name:
            top[parts[0]] = _coerce(key, value, top_hints[parts[0]])
        elif len(parts) == 2 and parts[0] in by_name:
            hints = typing.get_type_hints(by_name[parts[0]])
            if parts[1] not in hints:
                raise _unknown(key, keys)
            changes.setdefault(parts[0], {})[parts[1]] = _coerce(spelled(key), value, hints[parts[1]])
        else:
            raise _unknown(key, keys)
    for section, kv in changes.items():
        top[section] = dataclasses.replace(getattr(cfg, section), **kv)
    return dataclasses.replace(cfg, **top)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """{'model': {'n_layers': 4}} -> {'model.n_layers': 4}."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k in sections() and not prefix:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def parse_overrides(args: list[str]) -> dict[str, str]:
    out = {}
    for a in args:
        if "=" not in a:
            raise ConfigError(f"expected key=value, got {a!r} (e.g. training.steps=100)")
        k, v = a.split("=", 1)
        out[k.strip()] = v
    return out


PRESETS = "jaxlm.configs"


def preset_names() -> list[str]:
    presets = importlib.import_module(PRESETS)  # the stage below config, read by name only
    return sorted(m.name for m in pkgutil.iter_modules(presets.__path__) if not m.name.startswith("_"))


def load_base(name_or_file: str, written: set[str] | None = None) -> Config:
    """A preset by name (`shakespeare_char`) or a YAML/JSON file of nested settings; the dotted keys a file (or
    the files it is based on) sets are added to `written`."""
    path = Path(name_or_file)
    if path.suffix in (".yaml", ".yml", ".json") or path.is_file():
        if not path.is_file():
            raise ConfigError(f"config file {name_or_file} does not exist")
        text = path.read_text()
        try:
            if path.suffix == ".json":
                data = json.loads(text)
            else:
                import yaml

                data = yaml.safe_load(text)
        except Exception as e:  # noqa: BLE001 - parser errors vary; report the first line
            raise ConfigError(f"cannot parse {name_or_file}: {str(e).splitlines()[0]}") from None
        data = data or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{name_or_file} must hold a mapping of settings, not {type(data).__name__}")
        base = load_base(data.pop("base"), written) if "base" in data else Config()
        settings = flatten(data)
        if written is not None and not is_saved_config(data):
            written.update(ALIASES.get(k, k) for k in settings)
        return apply_overrides(base, settings)
    name = name_or_file.replace("-", "_").replace(".", "_")
    names = preset_names()
    if name not in names:
        hint = difflib.get_close_matches(name, names, n=1)
        extra = f" (did you mean '{hint[0]}'?)" if hint else ""
        raise ConfigError(f"unknown preset or file '{name_or_file}'{extra}; presets: {', '.join(names)}")
    return importlib.import_module(f"{PRESETS}.{name}").config()


def is_saved_config(data: dict) -> bool:
    """Whether a file's settings are a whole Config as jaxlm writes it (a run's config.json, a converted model's):
    its values were resolved by jaxlm, not chosen for the next run, so none counts as written by the user (a
    warmup it holds is cut like a preset's: fit_warmup)."""
    return {f.name for f in dataclasses.fields(Config)} <= set(data)


def load(name_or_file: str, overrides: dict[str, Any] | list[str] | None = None) -> Config:
    """Base + overrides, validated."""
    if isinstance(overrides, list):
        overrides = parse_overrides(overrides)
    overrides = overrides or {}
    written = {ALIASES.get(k, k) for k in overrides}
    cfg = apply_overrides(load_base(name_or_file, written), overrides)
    cfg, note = fit_warmup(cfg, explicit="optimizer.warmup_steps" in written,
                           decay_explicit="optimizer.decay_steps" in written)
    if note:
        print(f"note: {note}", file=sys.stderr)
    if (cfg.training.objective in PREFERENCE_OBJECTIVES and cfg.data.loss_mask == "off"
            and "data.loss_mask" not in written):
        # A run's config.json records the mask its data resolved to: `off` after SFT on plain text. Preference
        # tuning from that config scores the replies its own data's mask marks.
        cfg = cfg.replace(data=dataclasses.replace(cfg.data, loss_mask="auto"))
    validate(cfg)
    return cfg


def fit_warmup(cfg: Config, explicit: bool, decay_explicit: bool = False) -> tuple[Config, str | None]:
    """A run shorter than the warmup it inherited (a preset's, the default, or a saved config.json's) trains: the
    warmup is cut to a tenth of the run (of the steps the schedule decays over when fewer), and the note says so.
    A warmup the user wrote is kept (and `validate` refuses it if the schedule is shorter), and so is one before a
    decay the user set past the run's end (a first leg of a longer schedule, resumed later)."""
    o = cfg.optimizer
    decay = o.decay_steps if o.decay_steps is not None else cfg.training.steps
    length = min(decay, cfg.training.steps) if not decay_explicit else decay
    if explicit or o.schedule == "constant" or length >= o.warmup_steps or length < 0:
        return cfg, None
    cut = length // 10
    return cfg.replace(optimizer=dataclasses.replace(o, warmup_steps=cut)), (
        f"optimizer.warmup_steps={o.warmup_steps} is longer than this run's {length} steps: warmup cut to {cut} (a "
        "tenth of them); set optimizer.warmup_steps to choose")


def apply_parameter_scale(m: ModelConfig) -> ModelConfig:
    """Grow a model by `global_parameter_scale` (a power of 2) the way MaxText does: each doubling in turn
    doubles the heads and MLP width, then the width, then the layers, so the non-embedding parameters grow
    about in proportion. The head width stays fixed."""
    if m.global_parameter_scale == 1:
        return m
    base, rem = divmod(int(math.log2(m.global_parameter_scale)), 3)
    heads = base + (rem > 0)
    width = base + (rem > 1)
    return dataclasses.replace(
        m, n_heads=m.n_heads << heads, n_kv_heads=None if m.n_kv_heads is None else m.n_kv_heads << heads,
        d_model=m.d_model << width, head_dim=m.hd, d_ff=m.ff << heads, n_layers=m.n_layers << base,
        global_parameter_scale=1)


def to_json(cfg: Config) -> str:
    return json.dumps(cfg.to_dict(), indent=2)


def from_dict(d: dict) -> Config:
    return apply_overrides(Config(), flatten(d))
