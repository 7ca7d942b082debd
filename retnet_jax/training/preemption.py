"""SIGTERM / SIGINT / SIGHUP (a closed terminal) as a request to stop cleanly: finish the step, checkpoint, exit 0.

A second SIGINT interrupts at once (KeyboardInterrupt). With several processes, a stop requested on any of them
stops all of them at the same step, so the checkpoint they write together is complete.
"""

from __future__ import annotations

import signal
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class StopRequest:
  """Context manager installing the handlers (main thread only); `requested()` polls them."""

  def __init__(self):
    self.signal_name: str | None = None
    self._previous: dict[int, object] = {}

  def _handle(self, signum, frame):
    if self.signal_name is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.signal_name = signal.Signals(signum).name

  def __enter__(self) -> StopRequest:
    if threading.current_thread() is threading.main_thread():
      self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
    return self

  def __exit__(self, *exc_info) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)

  def requested(self) -> bool:
    """Whether any process received a stop signal (a collective when there are several processes)."""
    local = self.signal_name is not None
    if jax.process_count() == 1:
      return local
    return bool(np.any(multihost_utils.process_allgather(np.asarray(local))))
