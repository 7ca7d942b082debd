"""A multi-process run's processes on one host watch each other through their workdir locks.

A process that dies (SIGKILL, OOM) leaves the others failing or blocked in a collective, then waiting on it at exit
until JAX's heartbeat timeout aborts them with a stack dump. Its lock, released by the kernel, says so sooner:
when an error leaves the steps, or the steps stall for `stall_seconds`, while a peer's lock is free, this process
prints one line naming the lost process and the last committed checkpoint, and exits. Peers on other hosts are
left to the heartbeat (`--heartbeat_timeout`).

    with PeerWatch(peer_locks, committed_step) as watch:
      for step in ...:
        ...
        watch.progress()
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from retnet_jax import workdir_lock

EXIT_STATUS = 1


class PeerWatch:
  """A thread checking `peer_locks` (process index -> lock file) every `interval` seconds while the owner's steps
  stall; `committed_step()` gives the newest committed checkpoint step (None: none) for the message."""

  def __init__(self, peer_locks: Mapping[int, Path], committed_step: Callable[[], int | None],
               stall_seconds: float = 10.0, interval: float = 1.0, on_lost: Callable[[str], None] | None = None):
    self.peer_locks, self.committed_step = dict(peer_locks), committed_step
    self.stall_seconds, self.interval = stall_seconds, interval
    self.on_lost = on_lost or _exit_with
    self._last_progress = time.monotonic()
    self._stopped = threading.Event()
    self._thread = threading.Thread(target=self._watch, name="peer-watch", daemon=True)

  def progress(self) -> None:
    """Marks that the owner's steps moved on (a peer waited on is alive)."""
    self._last_progress = time.monotonic()

  def check(self) -> str | None:
    """The line to report if the steps have stalled for `stall_seconds` and a peer's lock is free, else None."""
    if time.monotonic() - self._last_progress < self.stall_seconds:
      return None
    return self.lost_line()

  def lost_line(self) -> str | None:
    """The line naming a peer whose lock is free and the last committed checkpoint, or None."""
    lost = next((index for index, path in self.peer_locks.items()
                 if workdir_lock.held_on_this_host(path) is False), None)
    if lost is None:
      return None
    step = self.committed_step()
    kept = f"the last committed checkpoint is step {step}" if step is not None else "no checkpoint was committed"
    return (f"error: training process {lost} is gone (its lock {self.peer_locks[lost]} was released while this "
            f"process waited on it); {kept}: restart every process with the same command to resume.")

  def _watch(self) -> None:
    while not self._stopped.wait(self.interval):
      line = self.check()
      if line is not None and not self._stopped.is_set():
        self.on_lost(line)
        return

  def __enter__(self) -> PeerWatch:
    if self.peer_locks:
      self._thread.start()
    return self

  def __exit__(self, exc_type, *_) -> None:
    """Stops the thread; an error leaving the steps while a peer's lock is free is that peer's loss (a collective
    or a joint save failing with it), reported at once: cleaning up would wait on the lost peer."""
    self._stopped.set()
    if exc_type is not None and issubclass(exc_type, Exception) and (line := self.lost_line()) is not None:
      self.on_lost(line)


def _exit_with(line: str) -> None:
  """Prints `line` and ends the process at once: its main thread is blocked in a collective that will not return."""
  sys.stderr.write(line + "\n")
  sys.stderr.flush()
  os._exit(EXIT_STATUS)
