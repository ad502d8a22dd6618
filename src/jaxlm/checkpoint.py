"""Orbax checkpoints of a run: train state (params, optimizer state, step) plus the data loader's position.

A checkpoint lives in <run_dir>/checkpoints/<step>/ and counts only once Orbax has committed it
(written to a temporary folder, then renamed), so a run killed mid-save resumes from the previous one.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp

from jaxlm.config import CheckpointConfig


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be restored into this run; the message says why."""


class Checkpointer:
    def __init__(self, run_dir: Path, cfg: CheckpointConfig):
        self.dir = (Path(run_dir) / "checkpoints").absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep,
            enable_async_checkpointing=cfg.async_save,
            cleanup_tmp_directories=True,
            create=True,
        )
        self._mngr = ocp.CheckpointManager(self.dir, options=options)

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def save(self, step: int, state: dict, loader_state: dict) -> None:
        self._mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                      loader=ocp.args.JsonSave(loader_state)), force=True)

    def restore(self, step: int, abstract_state: dict) -> tuple[dict, dict]:
        """Restore into the shapes and shardings of `abstract_state` (a tree of ShapeDtypeStruct)."""
        try:
            out = self._mngr.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), loader=ocp.args.JsonRestore()))
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"cannot restore {self.dir / str(step)} into this model "
                                  f"(different model settings?): {str(e).splitlines()[0]}") from None
        return out["state"], out["loader"]

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()


def abstract_like(tree) -> dict:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)
