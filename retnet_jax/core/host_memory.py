"""Host memory reuse between XLA executions on the CPU backend (glibc malloc).

XLA's CPU runtime allocates each execution's temporaries afresh. glibc serves allocations above 32 MB made on
worker threads with `mmap` and returns them with `munmap`, so every step faults its temporaries in again (the
cost is in docs/benchmarks.md). `keep_freed_memory()` makes malloc serve them from one heap that is never
trimmed, so later steps reuse the same pages: the process keeps its peak footprint. Call it first, before
importing numpy or jax: a thread keeps the malloc arena it first used, and numpy's and XLA's threads would
otherwise already hold others. The scripts do so through `retnet_jax.training.cli.prepare`. Buffers used once (a
checkpoint's reads) are allocated within `one_off_buffers()`, so that the heap does not keep them. The heap keeps
more than the live memory (freed blocks that later temporaries do not fit), so the peak is higher and varies run to
run (measured in docs/scale.md); `RETNET_JAX_KEEP_FREED_MEMORY=0` leaves malloc as it is, for the lower peak.
`available_bytes()` is what a new allocation can still take, for checks that size work against the CPU backend.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import importlib.metadata
import os
from collections.abc import Iterator

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_DEFAULT_MMAP_MAX = 65536  # glibc's
OPT_OUT = "RETNET_JAX_KEEP_FREED_MEMORY"  # "0": `keep_freed_memory` leaves malloc's defaults
_kept = False  # whether keep_freed_memory applied its settings


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
  """One malloc arena, no `mmap` for large blocks, no trimming (glibc, CPU backend only, unless OPT_OUT is "0");
  True if applied."""
  libc = _glibc()
  if libc is None or not _cpu_backend() or os.environ.get(OPT_OUT) == "0":
    return False
  # Trimming off (-1: never), then large blocks from the heap, then every thread on the main arena, whose
  # heap can grow without bound (another arena falls back to mmap for blocks above its 64 MB heaps).
  global _kept
  _kept = all(libc.mallopt(param, value) == 1
              for param, value in ((_M_TRIM_THRESHOLD, -1), (_M_MMAP_MAX, 0), (_M_ARENA_MAX, 1)))
  return _kept


@contextlib.contextmanager
def one_off_buffers() -> Iterator[None]:
  """Within: large blocks come from `mmap` again, each returned to the system when freed, where
  `keep_freed_memory` holds them in the heap. For buffers used once, such as a checkpoint's reads, which the
  heap would otherwise keep for the rest of the process; blocks allocated within stay valid after it."""
  libc = _glibc()
  if not _kept or libc is None:
    yield
    return
  libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
  try:
    yield
  finally:
    libc.mallopt(_M_MMAP_MAX, 0)


def release_freed_memory() -> None:
  """Returns the heap's free pages to the system (`malloc_trim`), e.g. before measuring a peak RSS."""
  libc = _glibc()
  if libc is not None:
    libc.malloc_trim(0)


def available_bytes() -> int:
  """Bytes of host memory a new allocation can take without swapping or the kernel's OOM killer: Linux's
  `MemAvailable` (free memory plus the caches it can reclaim), else the physical memory where the kernel does not
  say. Physical memory overstates it by what other processes hold (on a 23.5 GiB machine, 19-21 GiB available)."""
  try:
    with open("/proc/meminfo", encoding="ascii") as meminfo:
      for line in meminfo:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024  # in kB
  except (OSError, ValueError, IndexError):
    pass
  return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
