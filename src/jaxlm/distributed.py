"""Multi-process runs through JAX's own distributed runtime (`jax.distributed`).

A run is multi-process when `distributed.coordinator_address` is set, when `jaxlm launch` exported
JAXLM_COORDINATOR / JAXLM_NUM_PROCESSES / JAXLM_PROCESS_ID, or when `distributed.auto=true` lets JAX
detect the cluster (TPU pods, Slurm, Open MPI, Kubernetes). CPU processes exchange data through gloo.
"""

from __future__ import annotations

import os

import jax

from jaxlm.config import DistributedConfig

_initialized = False


def settings(cfg: DistributedConfig) -> dict | None:
    """Arguments for jax.distributed.initialize, or None for a single-process run."""
    if cfg.coordinator_address is not None:
        return {"coordinator_address": cfg.coordinator_address, "num_processes": cfg.num_processes,
                "process_id": cfg.process_id}
    if "JAXLM_COORDINATOR" in os.environ:
        return {"coordinator_address": os.environ["JAXLM_COORDINATOR"],
                "num_processes": int(os.environ["JAXLM_NUM_PROCESSES"]),
                "process_id": int(os.environ["JAXLM_PROCESS_ID"])}
    if cfg.auto:
        return {}
    return None


def initialize(cfg: DistributedConfig) -> None:
    """Join the job once per process, before any device is touched."""
    global _initialized
    args = settings(cfg)
    if args is None or _initialized:
        return
    if os.environ.get("JAX_PLATFORMS", "") in ("", "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**args)
    _initialized = True


def is_main() -> bool:
    """Only process 0 writes logs, metrics and progress; every process writes its checkpoint shards."""
    return jax.process_index() == 0
