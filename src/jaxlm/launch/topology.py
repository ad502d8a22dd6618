"""TPU slices as Cloud TPU builds them: chips, chip grid, workers (host VMs) and chips per worker, and the names
`gcloud` wants. `jaxlm describe v5e-256` prints a slice; `jaxlm compile` builds compile-only devices from the same
generations and grids (aot.py), and `jaxlm launch --scheduler tpu-vm` writes its command lines from it."""

from __future__ import annotations

import dataclasses
import math
import re

from jaxlm.config import ConfigError

# name prefix -> (generation in libtpu's topology names, chip config, grid rank, TensorCores per chip).
# v4 and v5p slice names count TensorCores and run one JAX device per chip (megacore); v5e and v6e chips
# have one core each.
TPU_GENERATIONS = {"v4": ("v4", "megacore", 3, 2), "v5p": ("v5", "megacore", 3, 2),
                   "v5e": ("v5e", "default", 2, 1), "v6e": ("v6e", "default", 2, 1)}
# name prefix -> (gcloud's --accelerator-type prefix, the TPU VM software version to create it with).
GCLOUD = {"v4": ("v4", "tpu-ubuntu2204-base"), "v5p": ("v5p", "v2-alpha-tpuv5"),
          "v5e": ("v5litepod", "v2-alpha-tpuv5-lite"), "v6e": ("v6e", "v2-alpha-tpuv6e")}
# Chips of the largest slice one worker serves alone (v5e and v6e have 8-chip single-host machines); every
# larger slice is made of workers with 4 chips each.
SINGLE_HOST_CHIPS = {"v4": 4, "v5p": 4, "v5e": 8, "v6e": 8}
CHIPS_PER_HOST = 4


def tpu_grid(rank: int, chips: int) -> tuple[int, ...]:
    """Chip grid of a slice as Cloud TPU builds them: 1x1, 1x2, 2x2, 2x4, 4x4, ... 16x16 (v5e, v6e) and
    2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, ... (v4, v5p): each doubling doubles the smallest dimension, the
    last of equals first."""
    grid = [1, 1] if rank == 2 else [2, 2, 1]
    if chips < math.prod(grid) or chips & (chips - 1) or (rank == 2 and chips > 256):
        raise ValueError
    while math.prod(grid) < chips:
        i = max(i for i, d in enumerate(grid) if d == min(grid))
        grid[i] *= 2
    return tuple(grid)


def slice_grid(gen: str, count: int) -> tuple[int, ...]:
    """The chip grid of the slice {gen}-{count} (count in chips for v5e and v6e, TensorCores for v4 and v5p);
    ValueError when no slice has that many."""
    _, _, rank, cores = TPU_GENERATIONS[gen]
    if count % cores:
        raise ValueError
    return tpu_grid(rank, count // cores)


@dataclasses.dataclass(frozen=True)
class Slice:
    name: str  # as jaxlm names it: v5e-256
    generation: str
    chips: int
    grid: tuple[int, ...]
    workers: int
    chips_per_worker: int
    accelerator_type: str  # as gcloud names it: v5litepod-256
    runtime_version: str

    @property
    def devices(self) -> int:
        """JAX devices: one per chip (v4 and v5p run their two cores as one megacore device)."""
        return self.chips

    def lines(self) -> list[str]:
        return [f"slice {self.name}: {self.chips} chips ({'x'.join(map(str, self.grid))}), {self.devices} JAX devices",
                f"workers {self.workers}",
                f"chips_per_worker {self.chips_per_worker}",
                f"processes {self.workers} (one per worker, each with {self.chips_per_worker} local devices)",
                f"accelerator_type {self.accelerator_type}",
                f"runtime_version {self.runtime_version}"]


def tpu_slice(name: str) -> Slice:
    """A slice named like v5e-256 (chips for v5e and v6e, TensorCores for v4 and v5p, as Cloud TPU names them)."""
    m = re.fullmatch(r"(v\d+[a-z]?)-(\d+)", name.strip().lower())
    if not m or m[1] not in TPU_GENERATIONS:
        raise ConfigError(f"{name!r} is not a TPU slice jaxlm knows; name one like v4-8, v5e-256, v5p-128 or v6e-256 "
                          f"(generations: {', '.join(TPU_GENERATIONS)})")
    gen, count = m[1], int(m[2])
    _, _, rank, cores = TPU_GENERATIONS[gen]
    try:
        grid = slice_grid(gen, count)
    except ValueError:
        raise ConfigError(f"{name!r}: {gen} slices are named by their {'TensorCores' if cores > 1 else 'chips'}, a "
                          f"power of two from {cores * (4 if rank == 3 else 1)}") from None
    chips = math.prod(grid)
    per_worker = chips if chips <= SINGLE_HOST_CHIPS[gen] else CHIPS_PER_HOST
    prefix, runtime = GCLOUD[gen]
    return Slice(f"{gen}-{count}", gen, chips, grid, chips // per_worker, per_worker, f"{prefix}-{count}", runtime)
