"""Hugging Face checkpoints in and out: `jaxlm convert from-hf SRC OUT` and `jaxlm convert to-hf PATH OUT`.

Import streams: the output arrays are allocated once in their final stacked layout, and each safetensors
tensor is read on its own (seek + read, no memory map kept), transformed by its family `Rule` and copied into
its slice, so peak host memory stays near one copy of the model. Export writes safetensors shards the same
way, one tensor at a time. No torch is needed for either direction.

A converted checkpoint is a folder: config.json (a jaxlm config whose checkpoint.init_from points back at
the folder, so `jaxlm train OUT/config.json` fine-tunes it), params/ (Orbax), hf_config.json (the source's
config.json) and tokenizer/ (the source's tokenizer files, copied back out on export).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import struct
from pathlib import Path
from typing import Callable, Iterator

import jax
import ml_dtypes
import numpy as np

from jaxlm import config as config_lib, families, params as P, storage
from jaxlm.data import hf_folder, tokenizer as tokenizer_lib
from jaxlm.data.errors import DataError
from jaxlm.store import weights
from jaxlm.config import Config, ModelConfig
from jaxlm.families.rules import ConvertError, Rule
from jaxlm.model import param_specs, stack

SAFETENSORS_DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
                      "BF16": np.dtype(ml_dtypes.bfloat16)}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "generation_config.json", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json", "preprocessor_config.json", "processor_config.json")
ARCH_IGNORED = ("dropout", "init_std", "param_dtype", "compute_dtype", "remat", "scan_layers", "block_size",
                "attention", "attention_block", "splash_layout", "loss_chunk_tokens", "expert_capacity_factor",
                "expert_all_to_all", "moe_matmul", "moe_tiles", "context_parallel", "moe_bias_update_rate",
                "mtp_loss_weight")


# ---- safetensors, read and written a tensor at a time -------------------------------------------------------

def read_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def read_tensor(f, info: dict, data_start: int, name: str) -> np.ndarray:
    if info["dtype"] not in SAFETENSORS_DTYPES:
        raise ConvertError(f"tensor {name} has dtype {info['dtype']}; supported: {', '.join(SAFETENSORS_DTYPES)}")
    dtype = SAFETENSORS_DTYPES[info["dtype"]]
    begin, end = info["data_offsets"]
    f.seek(data_start + begin)
    return np.frombuffer(f.read(end - begin), dtype).reshape(info["shape"])


def write_safetensors(path: Path, entries: list[tuple[str, tuple[int, ...], np.dtype]],
                      produce: Callable[[str], np.ndarray]) -> None:
    """Write the tensors named in `entries` (name, shape, dtype), calling produce(name) for each in turn."""
    names = {v: k for k, v in SAFETENSORS_DTYPES.items()}
    header, offset = {}, 0
    for name, shape, dtype in entries:
        size = int(np.prod(shape)) * dtype.itemsize
        header[name] = {"dtype": names[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, shape, dtype in entries:
            a = np.ascontiguousarray(produce(name), dtype=dtype)
            assert a.shape == tuple(shape), (name, a.shape, shape)
            f.write(a.tobytes())


def safetensors_files(src: Path) -> list[Path]:
    index = src / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [f for f in files if not (src / f).is_file()]
        if missing:
            raise ConvertError(f"{index} names {missing[0]}, which is missing from {src}")
        return [src / f for f in files]
    files = sorted(src.glob("*.safetensors"))
    if not files:
        extra = " (only PyTorch .bin weights: re-save them with safe_serialization)" if list(src.glob("*.bin")) else ""
        raise ConvertError(f"no *.safetensors files in {src}{extra}")
    return files


def resolve_source(src: str) -> Path:
    """A local folder, or a hub id downloaded (config, safetensors, tokenizer) into the local HF cache."""
    path = Path(src)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConvertError(f"{src} has no config.json; expected a Hugging Face model folder")
        return path
    if path.exists() or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", src):  # hub ids: gpt2, org/name
        raise ConvertError(f"{src} is neither a Hugging Face model folder nor a hub id like org/name")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ConvertError(f"{src} is not a local folder, and downloading it needs huggingface_hub "
                           "(pip install 'jaxlm[hf]')") from None
    try:
        return Path(snapshot_download(src, allow_patterns=["*.json", "*.safetensors", *TOKENIZER_FILES]))
    except Exception as e:  # noqa: BLE001 - network, auth and missing-repo errors vary
        raise ConvertError(f"{src} is not a local folder, and downloading it from the hub failed: "
                           f"{str(e).splitlines()[0]}") from None


# ---- our weights, addressed by dotted path and (layer, expert) slot ------------------------------------------

def flat_specs(cfg: ModelConfig) -> dict[str, P.ParamSpec]:
    flat = jax.tree_util.tree_flatten_with_path(param_specs(cfg), is_leaf=P.is_spec)[0]
    return {".".join(k.key for k in path): spec for path, spec in flat}


def slots(rule: Rule, cfg: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(HF tensor name, index into our stacked arrays) for every tensor a rule covers: `{i}` runs over the
    layers that have the rule's weight (model/stack.py: dense and MoE layers' MLPs are stacked apart), `{m}`
    over the multi-token prediction modules (HF layers n_layers + m), `{v}` over the vision tower's layers, `{d}`
    over its deepstack mergers (Qwen3-VL), `{e}` over the experts."""
    if "{i}" in rule.hf:
        lay = stack.layout(cfg)
        key = rule.ours[0].split(".")[1]
        layers = [(i, stack.index(lay, stack.group_of(lay, key), i)) for i in stack.layers_with(lay, key)]
    elif "{m}" in rule.hf:
        layers = [(cfg.n_layers + m, m) for m in range(cfg.mtp_layers)]
    elif "{v}" in rule.hf:
        layers = [(v, v) for v in range(cfg.vision.n_layers)]
    elif "{d}" in rule.hf:
        layers = [(d, d) for d in range(len(cfg.vision.deepstack))]
    else:
        layers = [(None, None)]
    experts = range(cfg.n_experts) if "{e}" in rule.hf else [None]
    for i, at in layers:
        for e in experts:
            yield rule.hf.format(i=i, e=e, m=i, v=i, d=i), tuple(x for x in (at, e) if x is not None)


def _family_of(cfg: ModelConfig):
    fam, model_type = families.for_config(cfg)
    back = fam.config_from_hf(fam.config_to_hf(cfg, model_type))
    for f in dataclasses.fields(ModelConfig):
        if f.name in ARCH_IGNORED or _unused(cfg, f.name):
            continue
        mine, theirs = getattr(cfg, f.name), getattr(back, f.name)
        resolved = {"n_kv_heads": "kv_heads", "head_dim": "hd", "d_ff": "ff", "expert_d_ff": "expert_ff"}.get(f.name)
        if resolved and getattr(cfg, resolved) == getattr(back, resolved):
            continue
        if mine != theirs:
            raise ConvertError(f"model.{f.name}={mine!r} has no equivalent in Hugging Face's {model_type}, the "
                               f"architecture closest to this model (it would load as {theirs!r}): a model trained "
                               f"with model.{f.name}={theirs} exports; docs/families.md lists the families and their "
                               "settings")
    return fam, model_type


def _unused(cfg: ModelConfig, name: str) -> bool:
    """Whether a model option has no effect on this model (its value need not survive an export)."""
    scaling = cfg.rope_scaling
    moe_options = ("experts_per_token", "expert_d_ff", "first_dense_layers", "moe_layer_interval", "n_shared_experts",
                   "router_aux_loss_coef", "expert_bias", "router_weights_input")
    return ((name.startswith("router_") or name in moe_options) and not cfg.n_experts
            or name in ("rope_low_freq_factor", "rope_high_freq_factor") and scaling != "llama3"
            or name == "rope_scaling_factor" and scaling == "none"
            or name == "rope_original_context" and scaling not in ("llama3", "yarn")
            or (name.startswith("rope_yarn_") or name == "rope_attention_factor") and scaling != "yarn"
            or name == "sliding_window" and "local" not in cfg.pattern
            or name == "local_rope_theta" and "local" not in cfg.pattern
            or name == "attention_chunk" and "chunked" not in cfg.pattern
            or name.startswith("attn_temperature_") and name != "attn_temperature_tuning"
            and not cfg.attn_temperature_tuning
            or name == "swiglu_alpha" and cfg.swiglu_limit is None
            or name in ("head_dim", "n_kv_heads") and cfg.latent)


# ---- import ---------------------------------------------------------------------------------------------------

def read_hf_config(src: str, param_dtype: str = "float32") -> tuple[Path, dict, ModelConfig]:
    """(local folder, its config.json, the jaxlm model it describes) of a Hugging Face folder or hub id."""
    src_path = resolve_source(src)
    hf_cfg = json.loads((src_path / "config.json").read_text())
    fam = families.for_model_type(hf_cfg.get("model_type"))
    try:
        model_cfg = dataclasses.replace(fam.config_from_hf(hf_cfg), param_dtype=param_dtype)
    except KeyError as e:
        raise ConvertError(f"{src_path / 'config.json'} lacks {e.args[0]!r}") from None
    if model_cfg.mtp_layers and not _has_mtp(safetensors_files(src_path), model_cfg,
                                             getattr(fam, "normalize_name", lambda n: n)):
        model_cfg = dataclasses.replace(model_cfg, mtp_layers=0)  # save_pretrained of transformers drops them
    return src_path, hf_cfg, model_cfg


def from_hf(src: str, out: str | Path, param_dtype: str = "float32", log: Callable[[str], None] = print) -> Path:
    """Convert a Hugging Face model folder (or hub id) into a jaxlm checkpoint folder; returns its path."""
    out = Path(out)
    if (out / "params").exists():
        raise ConvertError(f"{out} already holds a converted checkpoint; choose another OUT or delete it")
    src_path, hf_cfg, model_cfg = read_hf_config(src, param_dtype)
    fam = families.for_model_type(hf_cfg.get("model_type"))
    files = safetensors_files(src_path)
    if hf_cfg.get("num_nextn_predict_layers") and not model_cfg.mtp_layers:
        log(f"{src}: config.json has {hf_cfg['num_nextn_predict_layers']} multi-token prediction module(s) but the "
            "checkpoint holds none of their tensors (transformers' save_pretrained leaves them out); importing "
            "without them")
    cfg = Config(model=model_cfg, run_dir=None).replace(
        checkpoint=dataclasses.replace(Config().checkpoint, init_from=str(out.resolve())))
    config_lib.validate(cfg)

    specs = flat_specs(model_cfg)
    dtype = np.dtype(jax.numpy.dtype(param_dtype))
    arrays = {path: np.empty(s.shape, dtype) for path, s in specs.items()}
    expected: dict[str, tuple[Rule, tuple[int, ...]]] = {}
    rules = fam.rules(model_cfg)
    for rule in rules:
        for name, idx in slots(rule, model_cfg):
            expected[name] = (rule, idx)
    unfilled = sorted(set(specs) - {path for rule in rules for path in rule.ours})
    if unfilled:  # a family's rules must fill every weight: np.empty below would save whatever memory held
        raise ConvertError(f"no {hf_cfg['model_type']} tensor maps to the weight(s) {', '.join(unfilled)} of this "
                           "config; the conversion rules of this family do not cover it")
    ignored = [re.compile(p) for p in fam.ignored(model_cfg)]
    normalize = getattr(fam, "normalize_name", lambda n: n)
    done: set[str] = set()
    for file in files:
        header, start = read_header(file)
        with open(file, "rb") as f:
            for raw_name, info in header.items():
                name = normalize(raw_name)
                if name not in expected:
                    if any(p.fullmatch(name) for p in ignored):
                        continue
                    raise ConvertError(f"{file.name}: tensor {raw_name} {tuple(info['shape'])} is not part of a "
                                       f"{hf_cfg['model_type']} model with this config.json")
                rule, idx = expected[name]
                want, shape = hf_shape(rule, idx, specs), tuple(info["shape"])
                swap = shape != want and rule.swapped is not None and shape == swapped(want, rule.swapped)
                if shape != want and not swap:
                    raise ConvertError(f"{file.name}: tensor {raw_name} has shape {shape}, expected {want} from "
                                       "config.json")
                a = read_tensor(f, info, start, raw_name)
                for path, part in zip(rule.ours, rule.to_ours(np.swapaxes(a, *rule.swapped) if swap else a)):
                    arrays[path][idx] = part
                done.add(name)
    missing = [n for n in expected if n not in done]
    if missing:
        rule, idx = expected[missing[0]]
        raise ConvertError(f"{src_path} lacks tensor {missing[0]} (expected shape {hf_shape(rule, idx, specs)})"
                           + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))

    out.mkdir(parents=True, exist_ok=True)
    for path in list(arrays):  # hand each array to JAX and drop the numpy copy before the next one
        arrays[path] = jax.device_put(arrays.pop(path))
    weights.save_params(out / "params", unflatten(arrays))
    del arrays
    (out / "config.json").write_text(config_lib.to_json(cfg))
    (out / "hf_config.json").write_text(json.dumps(hf_cfg, indent=2))
    copied = copy_tokenizer(src_path, out / "tokenizer")
    n = sum(int(np.prod(s.shape)) for s in specs.values())
    log(f"converted {src} ({hf_cfg['model_type']}, {n:,} parameters, {len(files)} safetensors file(s)) -> {out}"
        + (f"; tokenizer files: {', '.join(copied)}" if copied else "") + _image_settings_note(model_cfg, out))
    return out


def _image_settings_note(cfg: ModelConfig, out: Path) -> str:
    """Where a vision model's image processor settings come from, or that images need them (data/hf_folder.py)."""
    if cfg.vision is None:
        return ""
    try:
        return f"; image processor settings: {hf_folder.image_settings(out / 'tokenizer')[1]}"
    except DataError as e:
        return f"; images cannot be given to it yet: {e}"


def _has_mtp(files: list[Path], cfg: ModelConfig, normalize) -> bool:
    """Whether a checkpoint holds multi-token prediction modules: tensors of the layers after the last."""
    first = f"model.layers.{cfg.n_layers}."
    return any(normalize(name).startswith(first) for file in files for name in read_header(file)[0])


def hf_shape(rule: Rule, idx: tuple[int, ...], specs: dict[str, P.ParamSpec]) -> tuple[int, ...]:
    """The HF tensor shape a rule expects, from our shapes (np.zeros of one slice: pages are never touched)."""
    parts = [np.zeros(specs[p].shape[len(idx):], np.float32) for p in rule.ours]
    return tuple(rule.to_hf(*parts).shape)


def swapped(shape: tuple[int, ...], axes: tuple[int, int]) -> tuple[int, ...]:
    out = list(shape)
    out[axes[0]], out[axes[1]] = shape[axes[1]], shape[axes[0]]
    return tuple(out)


def unflatten(flat: dict[str, object]) -> dict:
    tree: dict = {}
    for path, v in flat.items():
        node = tree
        *parents, last = path.split(".")
        for k in parents:
            node = node.setdefault(k, {})
        node[last] = v
    return tree


def copy_tokenizer(src: Path, dst: Path) -> list[str]:
    names = [n for n in TOKENIZER_FILES if (src / n).is_file()]
    if names:
        dst.mkdir(parents=True, exist_ok=True)
        for n in names:
            shutil.copyfile(src / n, dst / n)
    return names


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, as Hugging Face's ByteLevel pre-tokenizer writes bytes."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}


def hf_tokenizer_files(tok: tokenizer_lib.Tokenizer) -> dict[str, str] | None:
    """tokenizer.json and tokenizer_config.json that make transformers' AutoTokenizer encode and decode as jaxlm's
    char or byte tokenizer does (a BPE without merges over the characters, or over the bytes through the ByteLevel
    pre-tokenizer), for `jaxlm convert to-hf` of a model trained on them; None for other kinds."""
    kind = tok.spec["kind"]
    if kind == "byte":
        vocab = {c: b for b, c in _bytes_to_unicode().items()}
        pre = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
        decoder = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    elif kind == "char":
        vocab, pre, decoder = {c: i for i, c in enumerate(tok.chars)}, None, {"type": "Fuse"}
    else:
        return None
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
             "vocab": vocab, "merges": []}
    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
            "pre_tokenizer": pre, "post_processor": None, "decoder": decoder, "model": model}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1_000_000_000,
              "clean_up_tokenization_spaces": False}
    return {"tokenizer.json": json.dumps(spec, ensure_ascii=False, indent=1),
            "tokenizer_config.json": json.dumps(config, indent=2)}


def write_data_tokenizer(cfg: Config, out: Path) -> list[str]:
    """A run trained on jaxlm's own char or byte vocabulary (the quickstart, shakespeare_char) has no tokenizer
    files: write Hugging Face ones equal to it, from the prepared data's meta.json where it is found."""
    meta_file = storage.join(cfg.data.dir or f"data/{cfg.data.dataset}", "meta.json")
    if not storage.exists(meta_file):
        return []
    spec = json.loads(storage.read_text(meta_file)).get("tokenizer") or {}
    if spec.get("kind") not in ("char", "byte"):
        return []
    files = hf_tokenizer_files(tokenizer_lib.from_spec(spec))
    for name, text in files.items():
        (out / name).write_text(text)
    return list(files)


# ---- export ---------------------------------------------------------------------------------------------------

def to_hf(path: str | Path, out: str | Path, dtype: str | None = None, shard_bytes: int = 5 * 2**30,
          log: Callable[[str], None] = print) -> Path:
    """Write config.json + safetensors (+ tokenizer files when known) that transformers loads."""
    cfg, params = weights.load_params(path)
    fam, model_type = _family_of(cfg.model)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    out_dtype = np.dtype(jax.numpy.dtype(dtype or cfg.model.param_dtype))
    flat = {".".join(k.key for k in p): v for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    specs = flat_specs(cfg.model)
    producers: dict[str, Callable[[], np.ndarray]] = {}
    entries = []
    for rule in fam.rules(cfg.model):
        for name, idx in slots(rule, cfg.model):
            producers[name] = (lambda rule=rule, idx=idx: rule.to_hf(*[np.asarray(flat[p][idx], np.float32)
                                                                         for p in rule.ours]))
            entries.append((name, hf_shape(rule, idx, specs), out_dtype))
    shards: list[list] = [[]]
    size = 0
    for e in entries:
        nbytes = int(np.prod(e[1])) * out_dtype.itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += nbytes
    if len(shards) == 1:
        write_safetensors(out / "model.safetensors", shards[0], lambda n: producers[n]())
    else:
        weight_map = {}
        for k, shard in enumerate(shards):
            fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(out / fname, shard, lambda n: producers[n]())
            weight_map.update({name: fname for name, *_ in shard})
        total = sum(int(np.prod(s)) * out_dtype.itemsize for _, s, _ in entries)
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    tok = weights.tokenizer_source(Path(path), cfg)
    copied = copy_tokenizer(tok, out) if tok else write_data_tokenizer(cfg, out)
    source = hf_folder.read_json(tok.parent / "hf_config.json") if tok else None
    hf_cfg = export_config(fam.config_to_hf(cfg.model, model_type), source, fam.config_from_hf)
    hf_cfg["dtype"] = hf_cfg["torch_dtype"] = out_dtype.name
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    log(f"exported {path} as a Hugging Face {model_type} model ({len(entries)} tensors, {len(shards)} file(s), "
        f"{out_dtype}) -> {out}" + (f"; tokenizer files: {', '.join(copied)}" if copied else ""))
    return out


# Keys of the source's config.json that an export of the same model type may write with another value, and why
# (docs/families.md, "Export"). Every other key of the source comes back as it was.
REWRITTEN = {
    "dtype": "the dtype of the exported weights (to-hf --dtype, else model.param_dtype)",
    "torch_dtype": "the same, under the name transformers 4 reads",
    "num_nextn_predict_layers": "the multi-token prediction modules the export holds: transformers' save_pretrained "
                                "leaves them out, so a folder it wrote names some and holds none, and imports without",
    "vision_config.vision_use_head": "false: SigLIP's pooling head is not part of Gemma 3 (the import leaves its "
                                     "tensors out, and the export has none to load)",
}


def export_config(computed: dict, source: dict | None, read: Callable[[dict], ModelConfig]) -> dict:
    """config.json of an export: `computed` (the family's config_to_hf of the model) with the keys of the source's
    config.json (hf_config.json of the converted folder it descends from, when of the same model type) that `read`
    (the family's config_from_hf) reads as the same model, those of REWRITTEN excepted. So the keys jaxlm does not
    model (special and video token ids, initializer_range, dropout, ...) come back as they were, inside text_config
    as at the top, as do defaults spelled otherwise; a setting the model no longer has is written as it now is. The
    special ids (data/hf_folder.py model_ids) are also written where transformers 5 reads them: inside text_config
    for a model with one, else at the top."""
    if source is None:
        return computed
    out = computed
    if source.get("model_type") == computed.get("model_type"):
        model = read(computed)
        for path in _differences(source, computed):
            if ".".join(path) in REWRITTEN:
                continue
            candidate = _with(out, path, _at(source, path))
            try:
                if read(candidate) == model:
                    out = candidate
            except (ConvertError, AttributeError, KeyError, TypeError, ValueError):
                pass  # the source's value is not one this family reads: the computed one stays
    out = dict(out)
    home = out
    if isinstance(out.get("text_config"), dict):
        home = out["text_config"] = dict(out["text_config"])
    for key, value in hf_folder.model_ids(source).items():
        home.setdefault(key, value)
    return out


def _differences(source: dict, out: dict, path: tuple = ()) -> list[tuple[str, ...]]:
    """The key paths of `source` whose value `out` holds otherwise (objects compared key by key)."""
    found = []
    for k, v in source.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            found += _differences(v, out[k], (*path, k))
        elif k not in out or out[k] != v:
            found.append((*path, k))
    return found


def _at(tree: dict, path: tuple[str, ...]):
    for k in path:
        tree = tree[k]
    return tree


def _with(tree: dict, path: tuple[str, ...], value) -> dict:
    """A copy of `tree` with the value at `path` replaced (the objects on the way copied)."""
    return {**tree, path[0]: _with(tree[path[0]], path[1:], value) if len(path) > 1 else value}
