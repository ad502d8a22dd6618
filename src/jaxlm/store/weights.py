"""Model folders read and written: a `jaxlm convert from-hf` folder (config.json, params/, an imported adapter/,
tokenizer/) or a run directory (config.json and its newest checkpoint); `load_params` reads one's config and
weights into a tree on one device or sharded over a mesh. A LoRA folder gives its base with the adapters merged,
or base and adapters apart. Training (checkpoint.init_from), `jaxlm.load`, the server and export read them here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import jax

from jaxlm import config as config_lib, params as P, sharding, storage
from jaxlm.model import lora
from jaxlm.config import Config
from jaxlm.families.rules import ConvertError
from jaxlm.model import param_specs


def save_params(path: Path, params: dict) -> None:
    """Write the weights as one Orbax checkpoint. Orbax stages every array it writes in host memory, all at once
    by default (a second copy of the model); capping the bytes in flight at the largest array (or 256 MB) keeps
    the import near one copy at little cost in speed."""
    import orbax.checkpoint as ocp

    largest = max((a.nbytes for a in jax.tree.leaves(params)), default=0)
    limit_gb = math.ceil(max(largest, 2**28) / 1e6 + 1) / 1e3  # a MB of slack: Orbax compares as floats
    handler = ocp.StandardCheckpointHandler(save_concurrent_gb=limit_gb)
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(path.absolute(), args=ocp.args.StandardSave(params))


def load_config(path: str | Path) -> Config:
    file = storage.local_folder(path, "loading weights") / "config.json"
    if not file.is_file():
        raise ConvertError(f"{path} has no config.json; expected a jaxlm run directory or converted checkpoint")
    return config_lib.from_dict(json.loads(file.read_text()))


def params_location(path: str | Path) -> tuple[Path, bool]:
    """Where a folder keeps its weights: (folder, is_train_state). A converted checkpoint has params/, a run
    directory has checkpoints/<step>/state holding params next to the optimizer state."""
    from jaxlm.store import checkpoint

    path = storage.local_folder(path, "loading weights").absolute()
    if (path / "params").is_dir():
        return path / "params", False
    try:
        step = checkpoint.select(path / "checkpoints", print)
    except checkpoint.CheckpointError as e:
        raise ConvertError(str(e)) from None
    if step is None:
        raise ConvertError(f"{path} holds no weights (no params/ and no committed checkpoints/<step>)")
    return path / "checkpoints" / str(step) / "state", True


ADAPTER_DIR = "adapter"  # a converted folder's LoRA adapter (Orbax), imported from PEFT: `from-hf --adapter`


def has_adapter_dir(path: str | Path) -> bool:
    return (storage.local_folder(path, "loading weights") / ADAPTER_DIR).is_dir()


def restore_params(path: str | Path, abstract_params: dict) -> dict:
    """The model weights of a folder in the shapes and shardings of `abstract_params` (a tree of
    ShapeDtypeStruct with shardings): a converted checkpoint, or a run's latest checkpoint (its optimizer state
    is not read). A LoRA run, or a converted folder with an imported adapter, gives its base with the
    adapters merged in."""
    cfg = load_config(path) if (storage.local_folder(path, "loading weights") / "config.json").is_file() else None
    if cfg is not None and cfg.lora.rank > 0:
        base = restore_base_params(path, cfg, abstract_params)
        adapters = restore_adapters(path, cfg, _replicated_like(abstract_params))
        merged = lora.merge(base, adapters, cfg)
        return jax.tree.map(lambda a, m: jax.device_put(m, a.sharding), abstract_params, merged)
    return _restore_plain(path, abstract_params)


def restore_base_params(path: str | Path, cfg: Config, abstract_params: dict) -> dict:
    """The base weights of a LoRA folder (its adapters not merged): a converted folder's own params/, or for a
    run directory the model it was started from (checkpoint.init_from, itself merged if it had adapters)."""
    if has_adapter_dir(path):
        return _restore_plain(path, abstract_params)
    if not cfg.checkpoint.init_from:
        raise ConvertError(f"{path} is a LoRA run without checkpoint.init_from, so its base weights are unknown")
    return restore_params(cfg.checkpoint.init_from, abstract_params)


def restore_adapters(path: str | Path, cfg: Config, shardings_of) -> dict:
    """A LoRA folder's adapters (an imported adapter/, or a run's latest checkpoint), placed by shardings_of(a
    ShapeDtypeStruct tree) -> a tree of shardings."""
    abstract = P.abstract(lora.specs(cfg))
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
                            shardings_of(abstract))
    folder = storage.local_folder(path, "loading weights")
    if (folder / ADAPTER_DIR).is_dir():
        import orbax.checkpoint as ocp

        with ocp.StandardCheckpointer() as ckptr:
            return ckptr.restore((folder / ADAPTER_DIR).absolute(), abstract)
    return _restore_plain(path, abstract)


def _replicated_like(abstract_params: dict):
    """A function giving every leaf of a tree the replicated sharding on the device(s) of `abstract_params`."""
    sh = jax.tree.leaves(abstract_params)[0].sharding
    one = (jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec())
           if isinstance(sh, jax.sharding.NamedSharding) else sh)
    return lambda tree: jax.tree.map(lambda _: one, tree)


def _restore_plain(path: str | Path, abstract_params: dict) -> dict:
    import orbax.checkpoint as ocp

    location, is_state = params_location(path)
    try:
        if not is_state:
            with ocp.StandardCheckpointer() as ckptr:
                return ckptr.restore(location, abstract_params)
        item = {"params": abstract_params}
        with ocp.PyTreeCheckpointer() as ckptr:
            out = ckptr.restore(location, args=ocp.args.PyTreeRestore(
                item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True))
        return out["params"]
    except (ValueError, KeyError, TypeError) as e:
        raise ConvertError(f"cannot load weights from {location} into this model (different model settings?): "
                           f"{str(e).splitlines()[0]}") from None


# ---- one piece at a time ---------------------------------------------------------------------------------------
# A load that must never hold the whole model (a QLoRA base quantized as it is read, train/state.py load_frozen)
# reads each array, or a slice of a stacked array's layers, on the host and places only that piece.

Read = Callable[[tuple, "slice | None", jax.ShapeDtypeStruct, str], jax.Array]


def piece_reader(path: str | Path, replicated: jax.sharding.Sharding, merged: bool = True) -> Read:
    """read(keys, layers, target, dtype): the weight at `keys` (its `layers` slice of the leading axis, or all
    of it for None) as restore_params (merged) or restore_base_params (not) reads it in target.dtype, then cast
    to `dtype` and placed as target.shape and target.sharding say. A LoRA folder's adapters are merged into a
    piece at a time on the device; they are loaded once, placed by `replicated`."""
    cfg = load_config(path) if (storage.local_folder(path, "loading weights") / "config.json").is_file() else None
    if not merged or cfg is None or cfg.lora.rank == 0:
        return _orbax_reader(path)
    if has_adapter_dir(path):
        base = _orbax_reader(path)
    elif not cfg.checkpoint.init_from:
        raise ConvertError(f"{path} is a LoRA run without checkpoint.init_from, so its base weights are unknown")
    else:
        base = piece_reader(cfg.checkpoint.init_from, replicated)
    adapters = restore_adapters(path, cfg, lambda tree: jax.tree.map(lambda _: replicated, tree))

    def read(keys, layers, target, dtype):
        ad = adapters["layers"].get(keys[1], {}).get(keys[2]) if len(keys) == 3 and keys[0] == "layers" else None
        if ad is None:
            return base(keys, layers, target, dtype)
        w = base(keys, layers, target, target.dtype)
        ad = {k: v if layers is None else v[layers] for k, v in ad.items()}
        tree = lora.merge({"layers": {keys[1]: {keys[2]: w}}}, {"layers": {keys[1]: {keys[2]: ad}}}, cfg)
        return jax.device_put(tree["layers"][keys[1]][keys[2]].astype(dtype), target.sharding)

    return read


def _orbax_reader(path: str | Path) -> Read:
    """Pieces of the arrays of a folder's Orbax checkpoint, read through TensorStore as Orbax's own restore reads
    them (the same cast to the restored dtype), so a piece holds the bits a whole restore would. Orbax stores an
    array one process writes as one compressed chunk, which a read of any slice decompresses whole: the last
    chunk read along the layers (the whole array, for such a checkpoint) stays on the host for the next slices."""
    import numpy as np
    import orbax.checkpoint as ocp
    import tensorstore as ts
    from etils import epath

    location, is_state = params_location(path)
    try:
        meta = json.loads((location / "_METADATA").read_text())
    except (OSError, ValueError) as e:
        raise ConvertError(f"cannot read the checkpoint metadata in {location}: {e}") from None
    use_ocdbt, use_zarr3 = meta.get("use_ocdbt", True), meta.get("use_zarr3", False)
    context = ocp.type_handlers.get_ts_context(use_ocdbt=use_ocdbt)
    prefix = ("params",) if is_state else ()
    last: dict = {}  # {"key": (name, dtype, first layer), "host": those layers}

    def open_(name, dtype):
        info = ocp.type_handlers.ParamInfo(name=name, parent_dir=epath.Path(location), use_zarr3=use_zarr3,
                                           ts_context=context)
        spec = ocp.type_handlers.get_cast_tspec_deserialize(
            ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=use_ocdbt), ocp.RestoreArgs(dtype=dtype))
        try:
            return ts.open(spec, context=context).result()
        except ValueError as e:
            raise ConvertError(f"cannot load weight {name} from {location} (different model settings?): "
                               f"{str(e).splitlines()[0]}") from None

    def host_layers(store, name, dtype, layers: slice):
        step = store.chunk_layout.read_chunk.shape[0] or store.shape[0]
        first = layers.start // step * step
        if layers.stop > first + step:
            return store[layers].read().result()
        if last.get("key") != (name, dtype, first):
            last.clear()
            last.update(key=(name, dtype, first), host=store[first:first + step].read().result())
        return last["host"][layers.start - first:layers.stop - first]

    def read(keys, layers, target, dtype):
        name = ".".join((*prefix, *keys))
        store = open_(name, target.dtype)
        shape = store.shape if layers is None else store[layers].shape
        if tuple(shape) != tuple(target.shape):
            raise ConvertError(f"cannot load weights from {location} into this model (different model settings?): "
                               f"{name} has shape {tuple(store.shape)}, this model's is {tuple(target.shape)}")
        host = store.read().result() if layers is None else host_layers(store, name, target.dtype, layers)
        host = np.asarray(host).astype(jax.numpy.dtype(dtype))
        return jax.make_array_from_callback(host.shape, target.sharding, lambda index: host[index])

    return read


def load_params(path: str | Path, device: jax.Device | None = None, mesh: jax.sharding.Mesh | None = None,
                rules=None) -> tuple[Config, dict]:
    """The config and weights of a run directory (newest checkpoint) or converted folder, on one device or
    sharded over `mesh` by the parameter rules (default sharding.PARAM_RULES)."""
    cfg = load_config(path)
    specs = param_specs(cfg.model)
    one = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
    shardings = (P.shardings(specs, mesh, rules or sharding.PARAM_RULES) if mesh is not None
                 else jax.tree.map(lambda _: one, P.abstract(specs)))
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), P.abstract(specs),
                            shardings)
    return cfg, restore_params(path, abstract)


def tokenizer_source(path: Path, cfg: Config) -> Path | None:
    """The tokenizer/ folder of this checkpoint, or of the converted checkpoint it descends from: a run fine-tuned
    from a converted model (checkpoint.init_from), or from a run that was, and so on back."""
    seen: set[Path] = set()
    base = Path(path)
    while base not in seen:
        seen.add(base)
        if (base / "tokenizer").is_dir():
            return base / "tokenizer"
        if cfg is None or not cfg.checkpoint.init_from:
            return None
        base = Path(cfg.checkpoint.init_from)
        cfg_file = base / "config.json"
        cfg = config_lib.load(str(cfg_file)) if cfg_file.is_file() else None
    return None
