"""The notebooks' start: what `runs.cli.prepare` does for a script, for a Jupyter kernel.

`start` is a notebook's first call, before numpy and jax are imported: JAX on the CPU without the accelerator plugins'
start-up noise where this machine has no accelerator (`quiet_start`), freed host memory kept (`host_memory`), and
the log's INFO lines (this package's progress lines and notes) as their text alone on stdout, which Jupyter shows as
the cell's output; warnings and errors go to stderr with their level. tqdm's note that ipywidgets is missing is
dropped: the notebooks show no library progress bars (their inputs are small).
"""

from __future__ import annotations

import logging
import sys
import warnings

from absl import logging as absl_logging

from retnet_jax.core import host_memory, quiet_start


def start() -> None:
  """Process-wide settings for a notebook's kernel; call it before anything imports numpy or jax."""
  cpu_only = quiet_start.use_cpu_without_accelerators()
  host_memory.keep_freed_memory()
  if cpu_only:
    quiet_start.import_jax_quietly()
    # The CUDA plugin's note as the backend starts: a notebook has no jax.distributed to initialise first.
    with quiet_start.dropped_notes():
      sys.modules["jax"].devices()
  warnings.filterwarnings("ignore", message="IProgress not found", module="tqdm")
  info = logging.StreamHandler(sys.stdout)  # the kernel's stdout, set before a cell runs
  info.setFormatter(logging.Formatter("%(message)s"))
  info.addFilter(lambda record: record.levelno < logging.WARNING)
  problems = logging.StreamHandler(sys.stderr)
  problems.setLevel(logging.WARNING)
  problems.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
  absl_logger = absl_logging.get_absl_logger()  # absl.logging's messages, this package's among them
  absl_logger.handlers[:] = [info, problems]
  absl_logger.propagate = False
  absl_logger.setLevel(logging.INFO)
