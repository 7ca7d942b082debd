"""JAX on the CPU, without the accelerator plugins' start-up noise, on a machine that has no accelerator.

With the CUDA or TPU plugins installed (the `aot` extra) and no GPU or TPU present, JAX's plugin discovery prints two
tracebacks, libtpu's host warnings and the CUDA stubs' "Could not find cuda drivers" notes before a script's own
output. `use_cpu_without_accelerators` (called by `cli.prepare`, before jax is imported) sets JAX_PLATFORMS=cpu when
no accelerator's device node exists and JAX_PLATFORMS is unset; `import_jax_quietly` then imports jax with the C++
notes it prints dropped; anything else written to stderr meanwhile is passed on. A machine with a GPU or TPU, or a
JAX_PLATFORMS the user set, is left as it is. (The CUDA plugin's library prints one more note when the backend
starts, which entry points cannot move earlier: `jax.distributed` must be initialised first.)
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import os
import sys
import tempfile
from collections.abc import Iterator

# Device nodes of the accelerators JAX has plugins for: NVIDIA's driver, TPU chips (accel: v2-v4, v5p; vfio: v5e,
# v6e), AMD's ROCm driver.
ACCELERATOR_NODES = ("/proc/driver/nvidia/version", "/dev/nvidia[0-9]*", "/dev/accel[0-9]*", "/dev/vfio/[0-9]*",
                     "/dev/kfd")
# Lines the CUDA stubs print (through C++ logging that precedes absl's set-up) when loaded without a driver.
NOISE = (b"cudart_stub.cc", b"All log messages before absl::InitializeLog() is called")


def accelerator_present(patterns: tuple[str, ...] = ACCELERATOR_NODES) -> bool:
  """Whether any accelerator's device node (`patterns`, globs) exists on this machine."""
  return any(glob.glob(pattern) for pattern in patterns)


@contextlib.contextmanager
def dropped_notes(noise: tuple[bytes, ...] = NOISE) -> Iterator[None]:
  """Within: what is written to file descriptor 2 (C++ code included) is held, then passed on without the lines
  that hold one of `noise`."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as held:
    os.dup2(held.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      held.seek(0)
      kept = [line for line in held if not any(note in line for note in noise)]
      if kept:
        os.write(2, b"".join(kept))


def use_cpu_without_accelerators() -> bool:
  """Sets JAX_PLATFORMS=cpu where no accelerator is present and JAX_PLATFORMS is unset; True if it did."""
  if os.environ.get("JAX_PLATFORMS") or accelerator_present():
    return False
  os.environ["JAX_PLATFORMS"] = "cpu"
  return True


def import_jax_quietly() -> None:
  """Imports jax without the CUDA stubs' notes it prints."""
  with dropped_notes():
    importlib.import_module("jax")
