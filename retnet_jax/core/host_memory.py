"""Host memory reuse between XLA executions on the CPU backend (glibc malloc).

XLA's CPU runtime allocates each execution's temporaries afresh. glibc serves allocations above 32 MB made on
worker threads with `mmap` and returns them with `munmap`, so every step faults its temporaries in again (the
cost is in docs/benchmarks.md). `keep_freed_memory()` makes malloc serve them from one heap that is never
trimmed, so later steps reuse the same pages: the process keeps its peak footprint. Call it first, before
importing numpy or jax: a thread keeps the malloc arena it first used, and numpy's and XLA's threads would
otherwise already hold others. The scripts do so through `retnet_jax.runs.cli.prepare`. Buffers used once (a
checkpoint's reads) are allocated within `one_off_buffers()`, so that the heap does not keep them. The heap keeps
more than the live memory (freed blocks that later temporaries do not fit), so the peak is higher and varies run to
run (measured in docs/scale.md); `RETNET_JAX_KEEP_FREED_MEMORY=0` leaves malloc as it is, for the lower peak.
`available()` is what a new allocation can still take, and which limit bounds it, for checks that size work
against host memory: the smallest of `MemAvailable`, the address-space limit (RLIMIT_AS) less what the process
holds, and the memory limits of its cgroups less their usage.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import importlib.metadata
import os
import resource
from collections.abc import Iterator

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_DEFAULT_MMAP_MAX = 65536  # glibc's
OPT_OUT = "RETNET_JAX_KEEP_FREED_MEMORY"  # "0": `keep_freed_memory` leaves malloc's defaults
_kept = False  # whether keep_freed_memory applied its settings
PROC, CGROUP_ROOT = "/proc", "/sys/fs/cgroup"  # where `available` reads the kernel's figures


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


def available(proc: str = PROC, cgroup_root: str = CGROUP_ROOT) -> tuple[int, str]:
  """Bytes of host memory a new allocation can take without failing, swapping or meeting the OOM killer, and which
  limit bounds it. The smallest of: Linux's `MemAvailable` (free memory plus the caches it can reclaim; the physical
  memory where the kernel does not say, which overstates it by what other processes hold); the address-space limit
  (RLIMIT_AS, `prlimit --as`) less the address space the process already holds (`VmSize`, reserved whether used or
  not: after a first jax computation on 2 CPU cores, 1.8 GiB, of which 0.3 GiB resident; 0.9 GiB with
  `keep_freed_memory`'s one malloc arena); and the memory limit of each cgroup the process is in, its own and its
  ancestors' (v2 `memory.max`, v1 `memory.limit_in_bytes`), less the cgroup's usage short of the page cache it can
  reclaim (`inactive_file`). A source that cannot be read is left out; "no limit" reads as "max" or a huge number,
  never the smallest.

  Args:
    proc, cgroup_root: where procfs and the cgroup filesystems are mounted (a test points them at a fake layout).

  Returns:
    The bytes (never below 0) and the bound that gives them, for a message: "MemAvailable", "the address-space
    limit (RLIMIT_AS) less the 1.2 GiB this process holds", "the memory.max of cgroup /user.slice less its usage".
  """
  bounds = [_mem_available(proc), *_address_space_left(proc), *_cgroups_left(proc, cgroup_root)]
  left, what = min(bounds, key=lambda bound: bound[0])
  return max(left, 0), what


def available_bytes() -> int:
  """The bytes of `available()`."""
  return available()[0]


def _read(path: str) -> str | None:
  """The text of `path`, or None where it cannot be read."""
  try:
    with open(path, encoding="ascii") as f:
      return f.read()
  except (OSError, ValueError):  # ValueError: UnicodeDecodeError
    return None


def _number(path: str) -> int | None:
  """The integer that file `path` holds (a cgroup's figure), or None: unreadable, or not a number ("max")."""
  try:
    return int(_read(path) or "")
  except ValueError:
    return None


def _field(text: str | None, key: str) -> int | None:
  """The value of `key` in lines of "key value" or "key: value kB" (meminfo, status, memory.stat), in bytes."""
  for line in (text or "").splitlines():
    parts = line.split()
    if parts and parts[0].rstrip(":") == key:
      try:
        return int(parts[1]) * (1024 if parts[2:] == ["kB"] else 1)
      except (ValueError, IndexError):
        return None
  return None


def _mem_available(proc: str) -> tuple[int, str]:
  """`MemAvailable`, else the physical memory."""
  left = _field(_read(os.path.join(proc, "meminfo")), "MemAvailable")
  if left is None:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "the physical memory"
  return left, "MemAvailable"


def _address_space_left(proc: str) -> list[tuple[int, str]]:
  """The soft RLIMIT_AS less this process's `VmSize`; none where there is no limit or no `VmSize`."""
  limit, _ = resource.getrlimit(resource.RLIMIT_AS)
  held = _field(_read(os.path.join(proc, "self", "status")), "VmSize")
  if limit == resource.RLIM_INFINITY or held is None:
    return []
  size = f"{held / 2**30:.1f} GiB" if held >= 2**30 else f"{held / 2**20:.0f} MiB"
  return [(limit - held, f"the address-space limit (RLIMIT_AS) less the {size} this process holds")]


def _cgroups_left(proc: str, cgroup_root: str) -> list[tuple[int, str]]:
  """Each memory limit less usage of this process's cgroups (/proc/self/cgroup: "0::/path" for v2, "N:memory:/path"
  for v1's memory hierarchy)."""
  bounds = []
  for line in (_read(os.path.join(proc, "self", "cgroup")) or "").splitlines():
    hierarchy, _, rest = line.partition(":")
    controllers, _, path = rest.partition(":")
    if not path.startswith("/"):  # not such a line
      continue
    if hierarchy == "0" and not controllers:
      bounds += _cgroup_tree_left(cgroup_root, path, "memory.max", "memory.current", "inactive_file")
    elif "memory" in controllers.split(","):
      bounds += _cgroup_tree_left(os.path.join(cgroup_root, "memory"), path, "memory.limit_in_bytes",
                                  "memory.usage_in_bytes", "total_inactive_file")
  return bounds


def _cgroup_tree_left(mount: str, path: str, limit_file: str, usage_file: str, inactive_key: str
                      ) -> list[tuple[int, str]]:
  """`limit_file` less `usage_file` (short of `inactive_key` in memory.stat) of cgroup `path` under `mount` and of each
  of its ancestors, whose limits hold it too; none where `path` resolves outside `mount` (a path read from a file is
  not trusted to stay in it)."""
  top = os.path.realpath(mount)
  folder = os.path.realpath(os.path.join(top, path.lstrip("/")))
  if os.path.commonpath([top, folder]) != top:
    return []
  bounds = []
  while True:
    limit, usage = _number(os.path.join(folder, limit_file)), _number(os.path.join(folder, usage_file))
    if limit is not None and usage is not None:
      inactive = _field(_read(os.path.join(folder, "memory.stat")), inactive_key) or 0
      name = "/" + os.path.relpath(folder, top) if folder != top else "/"
      bounds.append((limit - (usage - inactive), f"the {limit_file} of cgroup {name} less its usage"))
    if folder == top:
      return bounds
    folder = os.path.dirname(folder)
