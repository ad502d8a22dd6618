"""Process-wide runtime settings: the platform programs run on, the host allocator for XLA:CPU and the
persistent compilation cache.

Allocator (docs/diagnostics.md, "CPU runs"): XLA:CPU takes a step's scratch memory as one malloc'd block, which
glibc maps fresh and page-faults in again on every step. `tune_for_xla_cpu()` raises the mmap and trim thresholds
so that the block comes from the heap and stays there between steps (up to TRIM_BYTES of freed memory stays in
the process; glibc only; JAXLM_TUNE_MALLOC=0 leaves the allocator as it is). Compilation cache:
`use_compilation_cache(path)` points JAX's persistent cache at compile.cache_dir, so that a rerun loads compiled
executables; the cache is keyed by the program, the devices, the flags and the JAX version.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

MMAP_THRESHOLD_BYTES = 1 << 30  # blocks below this come from the heap, not from a fresh mapping
TRIM_BYTES = 1 << 30  # free memory at the top of the heap kept for reuse rather than returned to the kernel
TOP_PAD_BYTES = 64 << 20  # extra heap grown at once, so that growing the heap is rare

# mallopt parameter numbers from glibc's malloc.h
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3

_applied: bool | None = None


def platform(mesh=None) -> str:
    """The platform ('cpu', 'gpu', 'tpu') of `mesh`'s devices, else of the default backend's: the one programs are
    compiled for (an ahead-of-time compile for a TPU runs on a CPU host with a mesh of TPU devices)."""
    import jax

    return (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform


def tune_for_xla_cpu() -> bool:
    """Apply the settings once per process; True if they are in effect (glibc, not switched off)."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> bool:
    if os.environ.get("JAXLM_TUNE_MALLOC", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (_M_TRIM_THRESHOLD, TRIM_BYTES), (_M_TOP_PAD, TOP_PAD_BYTES)))


def release_free_memory() -> bool:
    """Give the free pages of every malloc arena back to the kernel (glibc's malloc_trim): the memory the
    settings above keep for the next step and the free holes between live blocks, which no threshold returns.
    For the end of a phase whose memory the next one does not reuse: GRPO's rollouts (rl.generate), which
    interleaved with updates grew the resident memory batch after batch (docs/rl.md). True if it ran."""
    trim = _glibc("malloc_trim")
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


@functools.cache
def _glibc(function: str):
    """A function of the C library by name, or None where the library lacks it (musl, macOS: not glibc)."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), function) if name else None
    except (OSError, AttributeError):
        return None


def use_compilation_cache(path: str) -> str | None:
    """Use `path` ('' = none) as JAX's persistent compilation cache unless one is already configured (the
    JAX_COMPILATION_CACHE_DIR variable or jax.config); returns the folder in use, or None."""
    import jax

    current = jax.config.jax_compilation_cache_dir
    if current or not path:
        return current or None
    folder = os.path.expanduser(path)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:  # a read-only home: run without the cache rather than fail
        return None
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_compilation_cache_dir", folder)
    compilation_cache.reset_cache()  # JAX decides on its first compile; an earlier one must not turn the cache off
    return folder
