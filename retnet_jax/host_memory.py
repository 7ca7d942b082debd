"""Host memory reuse between XLA executions on the CPU backend (glibc malloc).

XLA's CPU runtime allocates each execution's temporaries afresh. glibc serves allocations above 32 MB made on
worker threads with `mmap` and returns them with `munmap`, so every step faults its temporaries in again (the
cost is in docs/benchmarks.md). `keep_freed_memory()` makes malloc serve them from one heap that is never
trimmed, so later steps reuse the same pages: the process keeps its peak footprint. Call it first, before
importing numpy or jax: a thread keeps the malloc arena it first used, and numpy's and XLA's threads would
otherwise already hold others. The scripts do so through `retnet_jax.cli.prepare`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.metadata
import os

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


@functools.cache
def _glibc():
  """The C library if it is glibc (it has mallopt and malloc_trim with these meanings), else None.

  Cached: `find_library` starts an `ldconfig -p` subprocess.
  """
  name = ctypes.util.find_library("c")
  if name is None:
    return None
  libc = ctypes.CDLL(name)
  return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "malloc_trim") else None


def _cpu_backend() -> bool:
  """Whether jax will run on the CPU: JAX_PLATFORMS says so, or no accelerator plugin is installed."""
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms:
    return platforms.split(",")[0].strip() == "cpu"
  return not list(importlib.metadata.entry_points(group="jax_plugins"))


def keep_freed_memory() -> bool:
  """One malloc arena, no `mmap` for large blocks, no trimming (glibc, CPU backend only); True if applied."""
  libc = _glibc()
  if libc is None or not _cpu_backend():
    return False
  # Trimming off (-1: never), then large blocks from the heap, then every thread on the main arena, whose
  # heap can grow without bound (another arena falls back to mmap for blocks above its 64 MB heaps).
  return all(libc.mallopt(param, value) == 1
             for param, value in ((_M_TRIM_THRESHOLD, -1), (_M_MMAP_MAX, 0), (_M_ARENA_MAX, 1)))


def release_freed_memory() -> None:
  """Returns the heap's free pages to the system (`malloc_trim`), e.g. before measuring a peak RSS."""
  libc = _glibc()
  if libc is not None:
    libc.malloc_trim(0)
