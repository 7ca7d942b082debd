"""A multi-process run's processes watch each other: workdir locks on one host, pulses through JAX's coordinator.

A process that dies (SIGKILL, OOM, a lost host) leaves the others failing or blocked in a collective, then waiting
on it until JAX's heartbeat timeout aborts them with a stack dump. When an error leaves the steps, or the steps stall
for `stall_seconds`, while a peer is gone, this process prints one line naming the lost process and the last
committed checkpoint, and exits. A peer is gone when its lock on this host is free (the kernel released it), or when
its pulse (a counter it raises every `interval` in the coordination service's key-value store, from a thread that
runs while its steps wait) has not moved for `pulse_seconds`: this covers peers on other hosts.

    with PeerWatch(peer_locks, committed_step, Pulse.of_this_run()) as watch:
      for step in ...:
        ...
        watch.progress()
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import jax

from retnet_jax.runs import workdir_lock

EXIT_STATUS = 1
LEFT = "left"  # the pulse of a process that finished its steps: it stopped beating, but is not lost


class Pulse:
  """This process's sign of life in the coordination service's key-value store, and every process's."""

  PREFIX = "retnet_jax/pulse/"

  def __init__(self, client, process_index: int):
    self.client, self.key = client, f"{self.PREFIX}{process_index}"

  @classmethod
  def of_this_run(cls) -> Pulse | None:
    """The pulse of this process in a multi-process run (None with one process)."""
    if jax.process_count() == 1:
      return None
    from jax._src import distributed  # pylint: disable=import-outside-toplevel  (the store has no public API)
    return cls(distributed.global_state.client, jax.process_index())

  def beat(self, value: str) -> None:
    """Publishes `value` (a new one each beat; LEFT when the steps are over)."""
    self.client.key_value_set(self.key, value, allow_overwrite=True)

  def read(self) -> dict[int, str]:
    """Process index -> its last published value (raises if the coordinator cannot be reached)."""
    return {int(key.rsplit("/", 1)[-1]): value for key, value in self.client.key_value_dir_get(self.PREFIX)}


class PeerWatch:
  """A thread checking `peer_locks` (process index -> lock file) and the peers' pulses every `interval` seconds
  while the owner's steps stall; `committed_step()` gives the newest committed checkpoint step (None: none)."""

  def __init__(self, peer_locks: Mapping[int, Path], committed_step: Callable[[], int | None],
               pulse: Pulse | None = None, stall_seconds: float = 10.0, pulse_seconds: float = 20.0,
               interval: float = 1.0, on_lost: Callable[[str], None] | None = None):
    self.peer_locks, self.committed_step, self.pulse = dict(peer_locks), committed_step, pulse
    self.stall_seconds, self.pulse_seconds, self.interval = stall_seconds, pulse_seconds, interval
    self.on_lost = on_lost or _exit_with
    self._last_progress = time.monotonic()
    self._heard = {index: (None, self._last_progress) for index in self.peer_locks}  # value, when it last changed
    self._beats = itertools.count()
    self._stopped = threading.Event()
    self._thread = threading.Thread(target=self._watch, name="peer-watch", daemon=True)

  def progress(self) -> None:
    """Marks that the owner's steps moved on (a peer waited on is alive)."""
    self._last_progress = time.monotonic()

  def listen(self) -> None:
    """Beats this process's pulse and notes which peers' pulses moved (none when the coordinator is unreachable:
    then every peer's, the coordinator's first, ages)."""
    if self.pulse is None:
      return
    try:
      self.pulse.beat(str(next(self._beats)))
      values = self.pulse.read()
    except Exception:  # pylint: disable=broad-exception-caught  (the coordinator is gone or unreachable)
      return
    now = time.monotonic()
    for index, (value, _) in self._heard.items():
      if values.get(index, value) != value:
        self._heard[index] = (values[index], now)

  def check(self) -> str | None:
    """The line to report if the steps have stalled for `stall_seconds` and a peer is gone, else None."""
    if time.monotonic() - self._last_progress < self.stall_seconds:
      return None
    return self.lost_line() or self.silent_line()

  def lost_line(self) -> str | None:
    """The line naming a peer whose lock is free and the last committed checkpoint, or None."""
    lost = next((index for index, path in self.peer_locks.items()
                 if workdir_lock.held_on_this_host(path) is False), None)
    if lost is None:
      return None
    return self._line(lost, f"its lock {self.peer_locks[lost]} was released")

  def silent_line(self) -> str | None:
    """The line naming a peer whose pulse has not moved for `pulse_seconds`, or None."""
    if self.pulse is None:
      return None
    now = time.monotonic()
    silent = next(((index, now - since) for index, (value, since) in self._heard.items()
                   if value != LEFT and now - since >= self.pulse_seconds), None)
    if silent is None:
      return None
    return self._line(silent[0], f"no sign of life from it for {silent[1]:.0f} s")

  def silent_line_after_error(self) -> str | None:
    """After an error left the steps: listens until every peer's pulse has moved (None: the error is this
    process's own) or one's has been still for `pulse_seconds` (the line naming it)."""
    if self.pulse is None:
      return None
    self.listen()  # values published before the error, a lost peer's last among them
    failed = time.monotonic()
    while True:
      time.sleep(self.interval)
      self.listen()
      if all(value == LEFT or since > failed for value, since in self._heard.values()):
        return None
      if (line := self.silent_line()) is not None:
        return line

  def _line(self, lost: int, evidence: str) -> str:
    step = self.committed_step()
    kept = f"the last committed checkpoint is step {step}" if step is not None else "no checkpoint was committed"
    return (f"error: training process {lost} is gone ({evidence} while this process waited on it); {kept}: "
            "restart every process with the same command to resume.")

  def _watch(self) -> None:
    while not self._stopped.wait(self.interval):
      self.listen()
      line = self.check()
      if line is not None and not self._stopped.is_set():
        self.on_lost(line)
        return

  def __enter__(self) -> PeerWatch:
    if self.peer_locks:
      self.listen()
      self._thread.start()
    return self

  def __exit__(self, exc_type, *_) -> None:
    """Stops the thread. An error leaving the steps while a peer is gone (its lock free, or its pulse still after
    the error) is that peer's loss (a collective or a joint save failing with it), reported before any clean-up,
    which would wait on the lost peer. Steps finished without an error mark the pulse LEFT, so peers still
    finishing theirs do not take this process for lost."""
    self._stopped.set()
    if not self.peer_locks:
      return
    self._thread.join()  # listen() below runs alone
    if exc_type is None and self.pulse is not None:
      try:
        self.pulse.beat(LEFT)
      except Exception:  # pylint: disable=broad-exception-caught  (the coordinator may have finished first)
        pass
    if exc_type is not None and issubclass(exc_type, Exception):
      if (line := self.lost_line() or self.silent_line_after_error()) is not None:
        self.on_lost(line)


def _exit_with(line: str) -> None:
  """Prints `line` and ends the process at once: its main thread is blocked in a collective that will not return."""
  sys.stderr.write(line + "\n")
  sys.stderr.flush()
  os._exit(EXIT_STATUS)
