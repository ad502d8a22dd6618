"""Process-wide runtime settings: the host allocator for XLA:CPU and the persistent compilation cache.

Allocator. XLA:CPU takes the scratch memory of a whole step (every intermediate of forward, backward and
update) as one allocation from malloc and frees it when the step ends. That block is usually larger than
glibc's mmap threshold, so glibc maps it fresh from the kernel on every step and unmaps it afterwards: each
step page-faults its whole working set in again and the kernel zero-fills it. On small models that costs
as much as the arithmetic (shakespeare_char_cpu on a 2-core machine: 6,300 to 7,200 tokens/s with glibc's
defaults, about 10,000 with the settings below). `tune_for_xla_cpu()` raises the mmap threshold so that
such blocks come from the heap, and raises the trim threshold so that the heap keeps them between steps
instead of returning them to the kernel. The price is that up to TRIM_BYTES of freed memory stays in the
process. It only applies to glibc (Linux); JAXLM_TUNE_MALLOC=0 leaves the allocator as it is.
`release_free_memory()` hands freed memory back at the end of a phase whose memory the next one does not reuse
(GRPO's rollouts).

Compilation cache. `use_compilation_cache(path)` points JAX's persistent cache at `path`
(`compile.cache_dir`), so that rerunning a command (a resumed run, the same config again, the processes
of a multi-host job on one machine) loads compiled executables instead of compiling them again. The cache
is keyed by the program, the devices, the flags and the JAX version, so a stale entry is never used.
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
    interleaved with updates grew the resident memory by about 0.2 GB per batch (docs/rl.md). True if it ran."""
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
