"""Checkpoints of a run: train state (params, optimizer state, step, skip counters) plus the data loader's
position, written by Orbax and sealed by a jaxlm manifest.

Layout: <run_dir>/checkpoints/<step>/{state/, loader/, jaxlm_manifest.json}. A checkpoint counts only once
it is committed, in two stages: Orbax writes every process's files into `<step>.orbax-checkpoint-tmp` and
renames it to `<step>` when all of them are done; then process 0 writes `jaxlm_manifest.json`, the size and
CRC32 of every file in the folder (to a temporary name, then renamed). A run killed at any moment leaves
either a committed checkpoint or one that restore recognizes as incomplete.

Restore takes the newest checkpoint whose manifest verifies (every listed file present, same size, same
CRC32: a truncated, emptied or bit-flipped file fails). Newer ones that do not verify are skipped with a
warning naming the folder and moved to checkpoints/rejected/, so the resumed run can save those steps
again; leftover temporary folders are deleted. Old checkpoints are deleted only after a newer one is
committed, and a state holding NaN or infinity is never saved.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import zlib
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxlm.config import CheckpointConfig

MANIFEST = "jaxlm_manifest.json"
MANIFEST_FORMAT = 1
REJECTED = "rejected"
_TMP_MARK = ".orbax-checkpoint-tmp"
_CHUNK = 16 << 20


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or restored; the message says which and why."""


# ---- manifests ------------------------------------------------------------------------------------------------

def file_crc32(path: Path) -> tuple[int, int]:
    """(size, CRC32) of a file's bytes. CRC32 catches every single-bit flip and every burst of up to 32 bits;
    it runs at about 2 GB/s here, so sealing or checking a checkpoint costs a fraction of writing it."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


def _files(step_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*")
                  if p.is_file() and not p.name.startswith(MANIFEST))


def write_manifest(step_dir: Path, step: int) -> dict:
    """Seal a committed Orbax step folder: size and CRC32 of every file, written last and atomically."""
    files = {}
    for rel in _files(step_dir):
        size, crc = file_crc32(step_dir / rel)
        files[rel] = {"size": size, "crc32": f"{crc:08x}"}
    manifest = {"format": MANIFEST_FORMAT, "step": step, "files": files}
    tmp = step_dir / f"{MANIFEST}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, step_dir / MANIFEST)
    return manifest


def verify(step_dir: Path) -> str | None:
    """None if the folder's manifest verifies, else the reason it does not (one line)."""
    path = step_dir / MANIFEST
    if not path.is_file():
        return f"no {MANIFEST} (the save did not finish)"
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict) or not files:
            raise ValueError("unknown format")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({e.__class__.__name__})"
    for rel, want in files.items():
        try:
            if (step_dir / rel).stat().st_size != want["size"]:
                return f"{rel} has {(step_dir / rel).stat().st_size} bytes, the manifest says {want['size']}"
            size, crc = file_crc32(step_dir / rel)
        except FileNotFoundError:
            return f"{rel} is missing"
        except OSError as e:
            return f"{rel} is unreadable ({e.strerror or e.__class__.__name__})"
        if size != want["size"] or f"{crc:08x}" != want["crc32"]:
            return f"{rel} does not match its checksum in the manifest"
    return None


def step_numbers(ckpt_dir: Path) -> list[int]:
    """Steps of the (Orbax-committed) step folders, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit() and p.is_dir())


def newest_verified(ckpt_dir: Path) -> tuple[int | None, list[tuple[int, str]]]:
    """(newest step whose manifest verifies or None, [(step, reason)] for the newer ones that do not)."""
    skipped = []
    for step in reversed(step_numbers(ckpt_dir)):
        reason = verify(ckpt_dir / str(step))
        if reason is None:
            return step, skipped
        skipped.append((step, reason))
    return None, skipped


def _is_corrupt(reason: str) -> bool:
    """A committed checkpoint that went bad, as opposed to a save that never finished."""
    return not reason.startswith("no " + MANIFEST)


def select(ckpt_dir: Path, log: Callable[[str], None]) -> int | None:
    """Newest usable step, warning about each newer one skipped. Fails when checkpoints were committed
    but none verifies: starting over silently would throw a run away."""
    step, skipped = newest_verified(ckpt_dir)
    for s, reason in skipped:
        log(f"warning: skipping checkpoint {ckpt_dir / str(s)}: {reason}")
    if step is None and any(_is_corrupt(r) for _, r in skipped):
        raise CheckpointError(f"no usable checkpoint in {ckpt_dir}: " + "; ".join(f"{s}: {r}" for s, r in skipped)
                              + "; move the folder away to start over")
    return step


def _all_finite_fn():
    def all_finite(tree):
        leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
        return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)

    return jax.jit(all_finite)


def _restore(mngr: ocp.CheckpointManager, path: Path, step: int, abstract_state: dict) -> tuple[dict, dict]:
    try:
        out = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                                         loader=ocp.args.JsonRestore()))
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"cannot restore {path} into this model (different model settings?): "
                              f"{str(e).splitlines()[0]}") from None
    return out["state"], out["loader"]


def restore_newest(run_dir: Path, abstract_state: dict, log: Callable[[str], None] = print):
    """(step, state, loader state) of a run's newest verified checkpoint, read-only (for eval and export);
    None when it has none."""
    ckpt_dir = (Path(run_dir) / "checkpoints").absolute()
    step = select(ckpt_dir, log)
    if step is None:
        return None
    options = ocp.CheckpointManagerOptions(read_only=True, create=False, enable_async_checkpointing=False)
    with ocp.CheckpointManager(ckpt_dir, options=options) as mngr:
        return (step, *_restore(mngr, ckpt_dir / str(step), step, abstract_state))


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

    def __init__(self, run_dir: Path, cfg: CheckpointConfig, log: Callable[[str], None] = print):
        self.dir = (Path(run_dir) / "checkpoints").absolute()
        self.keep, self.on_error, self._log = cfg.keep, cfg.on_error, log
        self._main = jax.process_index() == 0
        latest, error = -1, None
        if self._main:
            self.dir.mkdir(parents=True, exist_ok=True)
            for tmp in self.dir.glob(f"*{_TMP_MARK}*"):
                shutil.rmtree(tmp, ignore_errors=True)
                log(f"removed the unfinished save {tmp}")
            try:
                step = select(self.dir, log)
                latest = -1 if step is None else step
                for s in step_numbers(self.dir):
                    if s > latest:
                        self._reject(s)
            except CheckpointError as e:
                latest, error = -2, e
        # Every process restores what process 0 chose (or fails with it); this also waits for its clean-up.
        latest = _broadcast_from_main(latest)
        if latest == -2:
            raise error or CheckpointError(f"process 0 found no usable checkpoint in {self.dir}")
        self.latest = None if latest < 0 else latest
        options = ocp.CheckpointManagerOptions(max_to_keep=None, enable_async_checkpointing=cfg.async_save,
                                               cleanup_tmp_directories=True, create=True)
        self._mngr = ocp.CheckpointManager(self.dir, options=options)
        self._all_finite = _all_finite_fn()
        self._async = cfg.async_save
        self._thread: threading.Thread | None = None
        self._errors: list[tuple[int, str]] = []
        self._last_step: int | None = None

    def _reject(self, step: int) -> None:
        """Move a step folder that does not verify out of the way (not deleted: it may be the only copy of
        a run someone wants to inspect), keeping at most `keep` rejected folders."""
        rejected = self.dir / REJECTED
        rejected.mkdir(exist_ok=True)
        n = 0
        while (target := rejected / (f"{step}" if n == 0 else f"{step}.{n}")).exists():
            n += 1
        os.replace(self.dir / str(step), target)
        os.utime(target)
        self._log(f"moved {self.dir / str(step)} to {target}")
        old = sorted(rejected.iterdir(), key=lambda p: p.stat().st_mtime)
        for p in old[:-self.keep]:
            shutil.rmtree(p, ignore_errors=True)

    def restore(self, step: int, abstract_state: dict) -> tuple[dict, dict]:
        """Restore into the shapes and shardings of `abstract_state` (a tree of ShapeDtypeStruct)."""
        return _restore(self._mngr, self.dir / str(step), step, abstract_state)

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
            step_dir = self.dir / str(step)
            if self._main:
                if not step_dir.is_dir():
                    raise FileNotFoundError(f"Orbax did not commit {step_dir}")
                write_manifest(step_dir, step)
                self._collect_garbage()
        except Exception as e:  # noqa: BLE001 - reported on the main thread by check()
            self._fail(step, e)

    def _fail(self, step: int, e: BaseException) -> None:
        if self._main:  # free what the failed save wrote (a full disk needs the space back)
            for tmp in self.dir.glob(f"{step}{_TMP_MARK}*"):
                shutil.rmtree(tmp, ignore_errors=True)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        self._errors.append((step, f"saving the checkpoint of step {step} to {self.dir / str(step)} failed "
                            f"({e.__class__.__name__}: {first})"))

    def _collect_garbage(self) -> None:
        """Delete checkpoints older than the newest `keep` committed ones; runs only after a commit, so the
        previous checkpoint outlives every save that fails."""
        steps = step_numbers(self.dir)
        committed = [s for s in steps if (self.dir / str(s) / MANIFEST).is_file()]
        if len(committed) <= self.keep:
            return
        oldest_kept = committed[-self.keep]
        for s in steps:
            if s < oldest_kept:
                (self.dir / str(s) / MANIFEST).unlink(missing_ok=True)  # uncommitted first, then gone
                shutil.rmtree(self.dir / str(s), ignore_errors=True)

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
