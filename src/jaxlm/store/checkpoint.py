"""Checkpoints of a run: train state (params, optimizer state, step, skip counters) plus the data loader's
position, written by Orbax and sealed by a jaxlm manifest (the size and CRC32 of every file, written by process 0
once Orbax has committed the step).

Layout: <run_dir>/checkpoints/<step>/{state/, loader/, jaxlm_manifest.json}. Restore takes the newest checkpoint
whose manifest verifies and moves newer ones that do not to checkpoints/rejected/; old checkpoints go only after a
newer one is committed, and a state holding NaN or infinity is never saved. The folder may be local or a gs:// or
s3:// URL: every file operation here goes through `storage`. docs/reliability.md has the whole protocol.
"""

from __future__ import annotations

import json
import threading
import time
import zlib
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxlm import storage
from jaxlm.config import CheckpointConfig
from jaxlm.errors import UserError

MANIFEST = "jaxlm_manifest.json"
MANIFEST_FORMAT = 1
REJECTED = "rejected"
REJECTED_NOTE = "jaxlm_rejected.json"  # in a rejected folder: when and why
_TMP_MARK = ".orbax-checkpoint-tmp"
_CHUNK = 16 << 20


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be written or restored; the message says which and why."""


# ---- manifests ------------------------------------------------------------------------------------------------

def file_crc32(path: str | Path) -> tuple[int, int]:
    """(size, CRC32) of a file's bytes. CRC32 catches every single-bit flip and every burst of up to 32 bits;
    sealing or checking a checkpoint costs a fraction of writing it (docs/reliability.md)."""
    crc, size = 0, 0
    with storage.open_file(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


def _files(step_dir: str | Path) -> dict[str, int]:
    return {rel: size for rel, size in sorted(storage.files(step_dir).items()) if not rel.startswith(MANIFEST)}


def write_manifest(step_dir: str | Path, step: int) -> dict:
    """Seal a committed Orbax step folder: size and CRC32 of every file, written last and atomically."""
    files = {}
    for rel in _files(step_dir):
        size, crc = file_crc32(storage.join(step_dir, rel))
        files[rel] = {"size": size, "crc32": f"{crc:08x}"}
    manifest = {"format": MANIFEST_FORMAT, "step": step, "files": files}
    storage.write_text(storage.join(step_dir, MANIFEST), json.dumps(manifest, indent=1))
    return manifest


def verify(step_dir: str | Path) -> str | None:
    """None if the folder's manifest verifies, else the reason it does not (one line)."""
    try:
        manifest = json.loads(storage.read_text(storage.join(step_dir, MANIFEST)))
    except FileNotFoundError:
        return f"no {MANIFEST} (the save did not finish)"
    except (OSError, ValueError) as e:
        return f"{MANIFEST} is unreadable ({e.__class__.__name__})"
    try:
        files = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict) or not files:
            raise ValueError("unknown format")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{MANIFEST} is unreadable ({e.__class__.__name__})"
    sizes = _files(step_dir)  # one listing: a size that differs fails before any byte is read
    for rel, want in files.items():
        if rel not in sizes:
            return f"{rel} is missing"
        if sizes[rel] != want["size"]:
            return f"{rel} has {sizes[rel]} bytes, the manifest says {want['size']}"
    for rel, want in files.items():
        try:
            size, crc = file_crc32(storage.join(step_dir, rel))
        except FileNotFoundError:
            return f"{rel} is missing"
        except OSError as e:
            return f"{rel} is unreadable ({e.strerror or e.__class__.__name__})"
        if size != want["size"] or f"{crc:08x}" != want["crc32"]:
            return f"{rel} does not match its checksum in the manifest"
    return None


def step_numbers(ckpt_dir: str | Path) -> list[int]:
    """Steps of the step folders, oldest first."""
    return sorted(int(name) for name in storage.folders(ckpt_dir) if name.isdigit())


def newest_verified(ckpt_dir: str | Path) -> tuple[int | None, list[tuple[int, str]]]:
    """(newest step whose manifest verifies or None, [(step, reason)] for the newer ones that do not)."""
    skipped = []
    for step in reversed(step_numbers(ckpt_dir)):
        reason = verify(storage.join(ckpt_dir, str(step)))
        if reason is None:
            return step, skipped
        skipped.append((step, reason))
    return None, skipped


def _is_corrupt(reason: str) -> bool:
    """A committed checkpoint that went bad, as opposed to a save that never finished."""
    return not reason.startswith("no " + MANIFEST)


def select(ckpt_dir: str | Path, log: Callable[[str], None]) -> int | None:
    """Newest usable step, warning about each newer one skipped. Fails when checkpoints were committed
    but none verifies: starting over silently would throw a run away."""
    return _select(ckpt_dir, log)[0]


def _select(ckpt_dir: str | Path, log: Callable[[str], None]) -> tuple[int | None, list[tuple[int, str]]]:
    step, skipped = newest_verified(ckpt_dir)
    for s, reason in skipped:
        log(f"warning: skipping checkpoint {storage.join(ckpt_dir, str(s))}: {reason}")
    if step is None and any(_is_corrupt(r) for _, r in skipped):
        raise CheckpointError(f"no usable checkpoint in {ckpt_dir}: " + "; ".join(f"{s}: {r}" for s, r in skipped)
                              + "; move the folder away to start over")
    return step, skipped


def _manager(ckpt_dir: str, **options) -> ocp.CheckpointManager:
    """Orbax's manager of a checkpoint folder. Object stores cannot rename a folder, so there Orbax marks a
    finished step with a commit file (its own choice for gs://, made explicit for s3://)."""
    if storage.local_path(ckpt_dir) is None:
        options["atomicity_options"] = ocp.options.AtomicityOptions(mode=ocp.options.AtomicityMode.COMMIT_FILE)
    if not options.get("read_only"):
        return ocp.CheckpointManager(storage.orbax_dir(ckpt_dir), options=ocp.CheckpointManagerOptions(**options))
    # Orbax warns "Given directory is read only" for every manager that only reads: every `jaxlm eval`, `generate`
    # and `serve` printed it, as if something were wrong. Its warnings are let through again at once.
    from absl import logging as absl_logging

    level = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)
    try:
        return ocp.CheckpointManager(storage.orbax_dir(ckpt_dir), options=ocp.CheckpointManagerOptions(**options))
    finally:
        absl_logging.set_verbosity(level)


def _all_finite_fn():
    def all_finite(tree):
        leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
        return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)

    return jax.jit(all_finite)


def _restore(mngr: ocp.CheckpointManager, path: str, step: int, abstract_state: dict) -> tuple[dict, dict]:
    try:
        out = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                                         loader=ocp.args.JsonRestore()))
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"cannot restore {path} into this model (different model settings?): "
                              f"{str(e).splitlines()[0]}") from None
    return out["state"], out["loader"]


def _restore_without_optimizer(mngr: ocp.CheckpointManager, path: str, step: int, abstract_state: dict
                               ) -> tuple[dict, dict]:
    """Everything of the train state but its optimizer state (Orbax's partial restore), and the loader's position."""
    part = {k: v for k, v in abstract_state.items() if k != "opt_state"}
    args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape, dtype=a.dtype), part)
    try:
        out = mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(part, restore_args=args, partial_restore=True), loader=ocp.args.JsonRestore()))
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"cannot restore {path} into this model (different model settings?): "
                              f"{str(e).splitlines()[0]}") from None
    return out["state"], out["loader"]


def checkpoints_dir(run_dir: str | Path) -> str:
    """A run's checkpoint folder: an absolute path, or a URL."""
    return str(storage.orbax_dir(storage.join(run_dir, "checkpoints")))


def restore_newest(run_dir: str | Path, abstract_state: dict, log: Callable[[str], None] = print):
    """(step, state, loader state) of a run's newest verified checkpoint, read-only (for eval and export);
    None when it has none."""
    ckpt_dir = checkpoints_dir(run_dir)
    step = select(ckpt_dir, log)
    if step is None:
        return None
    with _manager(ckpt_dir, read_only=True, create=False, enable_async_checkpointing=False) as mngr:
        return (step, *_restore(mngr, storage.join(ckpt_dir, str(step)), step, abstract_state))


def _broadcast_from_main(value: int) -> int:
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int64(value)))


# ---- the writer ----------------------------------------------------------------------------------------------

class Checkpointer:
    """Saves and restores one run's checkpoints. Every process calls every method (Orbax writes each
    process's shards); process 0 alone chooses the checkpoint to restore, seals, moves and deletes folders.

    Saves are asynchronous: `save` returns once the state is copied off the devices; a background thread
    waits for Orbax's commit, then writes the manifest and deletes checkpoints beyond `keep`. A failure
    there is kept and reported by `check` (the loop calls it at every metrics flush), `save` and `close`.
    """

    def __init__(self, run_dir: str | Path, cfg: CheckpointConfig, log: Callable[[str], None] = print):
        self.dir = checkpoints_dir(run_dir)
        self.keep, self.on_error, self._log = cfg.keep, cfg.on_error, log
        self._main = jax.process_index() == 0
        latest, error = -1, None
        if self._main:
            storage.makedirs(self.dir)
            for name in storage.folders(self.dir):
                if _TMP_MARK in name:
                    storage.remove(self._path(name))
                    log(f"removed the unfinished save {self._path(name)}")
            try:
                step, skipped = _select(self.dir, log)  # skipped: every step newer than the one chosen
                latest = -1 if step is None else step
                for s, reason in skipped:
                    self._reject(s, reason)
            except CheckpointError as e:
                latest, error = -2, e
        # Every process restores what process 0 chose (or fails with it); this also waits for its clean-up.
        latest = _broadcast_from_main(latest)
        if latest == -2:
            raise error or CheckpointError(f"process 0 found no usable checkpoint in {self.dir}")
        self.latest = None if latest < 0 else latest
        # Unfinished saves were removed or set aside above. Orbax's own clean-up would, on an object store, also
        # delete every folder without its commit file: rejected/ too.
        self._mngr = _manager(self.dir, max_to_keep=None, enable_async_checkpointing=cfg.async_save,
                              cleanup_tmp_directories=False, create=True)
        self._all_finite = _all_finite_fn()
        self._async = cfg.async_save
        self._thread: threading.Thread | None = None
        self._errors: list[tuple[int, str]] = []
        self._last_step: int | None = None

    def _path(self, *parts: str) -> str:
        return storage.join(self.dir, *parts)

    def _reject(self, step: int, reason: str) -> None:
        """Move a step folder that does not verify out of the way (not deleted: it may be the only copy of
        a run someone wants to inspect), keeping at most `keep` rejected folders, the newest by their notes."""
        taken = set(storage.folders(self._path(REJECTED)))
        n = 0
        while (name := f"{step}" if n == 0 else f"{step}.{n}") in taken:
            n += 1
        target = self._path(REJECTED, name)
        storage.makedirs(self._path(REJECTED))
        storage.move(self._path(str(step)), target)
        storage.write_text(storage.join(target, REJECTED_NOTE), json.dumps({"time": time.time(), "reason": reason}))
        self._log(f"moved {self._path(str(step))} to {target}")
        for old in sorted(taken | {name}, key=self._rejected_at)[:-self.keep]:
            storage.remove(self._path(REJECTED, old))

    def _rejected_at(self, name: str) -> float:
        """When a rejected folder was set aside (0 for one without a readable note)."""
        try:
            return float(json.loads(storage.read_text(self._path(REJECTED, name, REJECTED_NOTE)))["time"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0.0

    def restore(self, step: int, abstract_state: dict) -> tuple[dict, dict]:
        """Restore into the shapes and shardings of `abstract_state` (a tree of ShapeDtypeStruct)."""
        return _restore(self._mngr, self._path(str(step)), step, abstract_state)

    def restore_without_optimizer(self, step: int, abstract_state: dict) -> tuple[dict, dict]:
        """`restore` of all but the optimizer state (returned without an "opt_state"): for a run that goes on
        with another optimizer, whose state a checkpoint of the first does not hold."""
        # A manager of its own: this one has registered the handler its saves use, which takes whole trees only.
        with _manager(self.dir, read_only=True, create=False, enable_async_checkpointing=False) as mngr:
            return _restore_without_optimizer(mngr, self._path(str(step)), step, abstract_state)

    def save(self, step: int, state: dict, loader_state: dict) -> None:
        """Start saving `state` at `step`. Raises CheckpointError when the previous save failed and
        checkpoint.on_error=stop, when this one cannot start, or when the state is not finite."""
        self._join()
        self.check()
        self._last_step = step
        if not bool(self._all_finite(state)):
            raise CheckpointError(f"refusing to save step {step}: the train state holds NaN or infinite values "
                                  f"(the newest good checkpoint stays in {self.dir})")
        try:
            # A failure of the previous save was recorded by its commit thread; Orbax would raise it again here.
            self._mngr.wait_until_finished()
        except Exception:  # noqa: BLE001
            pass
        try:
            self._mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                          loader=ocp.args.JsonSave(loader_state)), force=True)
        except Exception as e:  # noqa: BLE001 - the file system's errors come in many types
            self._fail(step, e)
            self.check()
            return
        self._thread = threading.Thread(target=self._commit, args=(step,), name="jaxlm-checkpoint-commit",
                                        daemon=True)
        self._thread.start()
        if not self._async:
            self._join()
            self.check()

    def _commit(self, step: int) -> None:
        try:
            self._mngr.wait_until_finished()
            step_dir = self._path(str(step))
            if self._main:
                if not storage.isdir(step_dir):
                    raise FileNotFoundError(f"Orbax did not commit {step_dir}")
                write_manifest(step_dir, step)
                self._collect_garbage()
        except Exception as e:  # noqa: BLE001 - reported on the main thread by check()
            self._fail(step, e)

    def _fail(self, step: int, e: BaseException) -> None:
        if self._main:  # free what the failed save wrote (a full disk needs the space back)
            for name in storage.folders(self.dir):
                # Orbax writes into <step>.orbax-checkpoint-tmp locally, into <step> itself on an object store.
                unsealed = name == str(step) and not storage.exists(self._path(name, MANIFEST))
                if name.startswith(f"{step}{_TMP_MARK}") or unsealed:
                    storage.remove(self._path(name))
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        self._errors.append((step, f"saving the checkpoint of step {step} to {self._path(str(step))} failed "
                            f"({e.__class__.__name__}: {first})"))

    def _collect_garbage(self) -> None:
        """Delete checkpoints older than the newest `keep` committed ones; runs only after a commit, so the
        previous checkpoint outlives every save that fails."""
        steps = step_numbers(self.dir)
        committed = [s for s in steps if storage.exists(self._path(str(s), MANIFEST))]
        if len(committed) <= self.keep:
            return
        oldest_kept = committed[-self.keep]
        for s in steps:
            if s < oldest_kept:
                storage.remove(self._path(str(s), MANIFEST))  # uncommitted first, then gone
                storage.remove(self._path(str(s)))

    def check(self) -> None:
        """Report failed saves: raise with checkpoint.on_error=stop, log and go on with continue."""
        errors, self._errors = self._errors, []
        if not errors:
            return
        if self.on_error == "stop":
            raise CheckpointError(errors[0][1] + "; checkpoint.on_error=stop ends the run (the newest committed "
                                  f"checkpoint in {self.dir} is intact)")
        for _, err in errors:
            self._log(f"warning: {err}; training goes on (checkpoint.on_error=continue)")

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def wait(self) -> None:
        """Block until the last save is committed (manifest written) or has failed."""
        self._join()

    def close(self) -> None:
        """Commit the save in flight, then report failures; the failure of the last save is always an error."""
        self._join()
        try:
            self._mngr.wait_until_finished()  # a failure already recorded would be raised again by close()
        except Exception:  # noqa: BLE001
            pass
        self._mngr.close()
        final = [err for step, err in self._errors if step == self._last_step]
        self._errors = [(step, err) for step, err in self._errors if step != self._last_step]
        self.check()
        if final:
            raise CheckpointError(final[0] + "; the run's last state is not saved")


def abstract_like(tree) -> dict:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)
