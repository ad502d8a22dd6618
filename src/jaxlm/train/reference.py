"""Reference log-probabilities for dpo and ipo: the starting weights' log-probability of every token of the
preference data, computed in one pass over both splits before training and stored with the run, so that training
holds one model in memory (the policy) and reads the reference's figures with each batch ("ref_logps").

<run_dir>/reference/ holds {split}.logps.f32 (float32 [N], one per token of the split as the prepared folder
stores it; 0 for a document's first token) and reference.json (what they were computed from), removed first and
written last so that an interrupted pass leaves nothing that looks finished (docs/preference.md). A run reuses
files that match it, else computes them from its starting weights; a LoRA run needs none (objectives.py).

Legend: B rows per batch, T block_size, R = T + 1, N tokens of a split.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import time
from typing import Callable

import jax
import numpy as np

from jaxlm import params as P, sharding, storage
from jaxlm.train import batches as batch_lib, run as run_lib, step as step_lib
from jaxlm.data import preference, vision_data
from jaxlm.model.loss import token_logprobs

FORMAT = 1
# Model settings that change how a run computes, not what it computes: a reference made under other values of
# these still serves.
RUNTIME_SETTINGS = ("remat", "scan_layers", "attention", "attention_block", "splash_layout", "loss_chunk_tokens",
                    "dropout")


def folder(run: run_lib.Run) -> str:
    return storage.join(run.run_dir, "reference")


def describe(run: run_lib.Run) -> dict:
    """What the reference files of this run must have been computed from (reference.json)."""
    cfg = run.cfg
    weights = {"init_from": str(cfg.checkpoint.init_from)} if cfg.checkpoint.init_from else {"seed": cfg.seed}
    with storage.open_file(storage.join(run.dataset.dir, "meta.json")) as f:  # a path or a URL (data.dir)
        meta = f.read()
    return {"format": FORMAT, "weights": weights,
            "model": {k: v for k, v in dataclasses.asdict(cfg.model).items() if k not in RUNTIME_SETTINGS},
            "dataset": str(run.dataset.dir), "dataset_meta": "sha256:" + hashlib.sha256(meta).hexdigest(),
            "splits": {name: {"tokens": split.n_tokens, "file": f"{name}.logps.f32"}
                       for name, split in run.dataset.splits.items()}}


def ensure(run: run_lib.Run, state: dict, log: Callable[[str], None] = print) -> None:
    """Set run.reference to the reference log-probabilities of each split: the run's files when they match it,
    else computed now from the starting weights (`state`'s at step 0, else read again) and written first."""
    want = describe(run)
    why = _mismatch(run, want)
    if why is None:
        log(f"reference log-probabilities: {folder(run)} (computed before, from {_weights(want)})")
    else:
        log(f"reference log-probabilities: computing them from {_weights(want)} ({why})")
        params = state["params"] if int(jax.device_get(state["step"])) == 0 else starting_params(run)
        write(run, compute(run, params, log), want)
    run.reference = read(run, want)


def _weights(want: dict) -> str:
    w = want["weights"]
    return f"checkpoint.init_from={w['init_from']}" if "init_from" in w else f"the initialization of seed={w['seed']}"


def _mismatch(run: run_lib.Run, want: dict) -> str | None:
    """Why the run's reference files cannot serve (None when they can)."""
    path = storage.join(folder(run), "reference.json")
    if not storage.exists(path):
        return "none stored yet"
    try:
        have = json.loads(storage.read_text(path))
    except ValueError:
        return f"{path} is damaged"
    differ = [k for k in want if have.get(k) != want[k]]
    if differ:
        return f"{path} was computed for another {differ[0]}"
    sizes = storage.files(folder(run))
    for entry in want["splits"].values():
        if sizes.get(entry["file"]) != 4 * entry["tokens"]:
            return f"{entry['file']} is missing or not {entry['tokens']} float32 values"
    return None


def starting_params(run: run_lib.Run) -> dict:
    """The weights the run started from (a resumed run's state holds trained ones): checkpoint.init_from's, or
    the fresh initialization of its seed, as state.init_state_from / init_state make them."""
    from jaxlm.store import weights

    if run.cfg.checkpoint.init_from:
        return weights.restore_params(run.cfg.checkpoint.init_from, run.abstract_state["params"])
    return P.init(run.specs, jax.random.key(run.cfg.seed), run.mesh, run.param_rules)


def compute(run: run_lib.Run, params: dict, log: Callable[[str], None] = print) -> dict[str, np.ndarray]:
    """Each split's reference log-probabilities [N] (module docstring) under `params`: every pair once, packed
    whole into rows of training.batch_size (with their prompts' images, for pairs prepared with them), placed and
    sharded like training batches. A few batches are in
    flight while the host fills in the last one's results."""
    cfg, mesh, T, B = run.cfg, run.mesh, run.cfg.model.block_size, run.cfg.training.batch_size
    pipeline = (cfg.training.pipeline_microbatches, cfg.training.pipeline_repeats)

    @jax.jit
    def logps(params, batch):
        with sharding.activation_sharding(mesh, run.act_rules, pipeline, run.param_rules):
            return token_logprobs(params, batch["inputs"], batch["targets"], cfg.model, None,
                                   batch["positions"], batch["segment_ids"], images=batch.get("images"))[0]

    def fetch(x):
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    out = {}
    for name, split in run.dataset.splits.items():
        started = time.perf_counter()
        values = np.zeros(split.n_tokens, np.float32)
        pending: collections.deque = collections.deque()
        n_batches = 0
        store = None if run.images is None else run.images[name]
        pair_images = None if store is None else vision_data.pair_images(store)
        for plan in preference.every_pair(split, T, B, pair_images, run.image_slots):
            rows = plan.rows(split, np.arange(B), T)
            seg = rows["segment_ids"]
            within = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)  # targets in their input's document
            batch = {"inputs": rows["tokens"][:, :-1], "targets": rows["tokens"][:, 1:],
                     "positions": rows["positions"][:, :-1], "segment_ids": seg[:, :-1]}
            placed = {k: batch_lib.put_batch(mesh, v, 0, run.act_rules) for k, v in batch.items()}
            if store is not None:  # the prompts' images, once for each reply's document
                pixels = store.read(vision_data.slots_of(plan, split, store, run.image_slots))
                placed["images"] = jax.device_put(pixels, step_lib.image_sharding(run, 0, 0))
            pending.append((rows["sources"][:, 1:][within], within, logps(params, placed)))
            n_batches += 1
            while len(pending) > 2:
                sources, mask, result = pending.popleft()
                values[sources] = fetch(result)[mask]
        while pending:
            sources, mask, result = pending.popleft()
            values[sources] = fetch(result)[mask]
        log(f"  {name}: {split.n_documents // 2:,} pairs in {n_batches} batches of {B} rows, "
            f"{time.perf_counter() - started:.1f} s")
        out[name] = values
    return out


def write(run: run_lib.Run, values: dict[str, np.ndarray], want: dict) -> None:
    """Store the reference files (only the main process writes; the others wait until they are whole)."""
    where = folder(run)
    if jax.process_index() == 0:
        storage.makedirs(where)
        storage.remove(storage.join(where, "reference.json"))
        for name, entry in want["splits"].items():
            path = storage.join(where, entry["file"])
            local = storage.local_path(path)
            if local is not None:
                tmp = local.with_name(f".{local.name}.tmp")
                values[name].astype(np.float32).tofile(tmp)
                tmp.replace(local)
            else:
                with storage.open_file(path, "wb") as f:
                    f.write(values[name].astype(np.float32).tobytes())
        storage.write_text(storage.join(where, "reference.json"), json.dumps(want, indent=2))
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("jaxlm reference written")


def read(run: run_lib.Run, want: dict) -> dict[str, np.ndarray]:
    """Each split's reference file: memory-mapped from a local run_dir, read whole from an object store."""
    out = {}
    for name, entry in want["splits"].items():
        path = storage.join(folder(run), entry["file"])
        local = storage.local_path(path)
        if local is not None:
            out[name] = np.memmap(local, np.float32, mode="r", shape=(entry["tokens"],))
        else:
            with storage.open_file(path, "rb") as f:
                out[name] = np.frombuffer(f.read(), np.float32)
    return out
