"""One training process per workdir: a lock that the kernel releases whenever its holder ends, SIGKILL included.

    with workdir.writer_lock(path, jax.process_index()):  # the lock file's path comes from retnet_jax.runs.workdir
      ...  # write checkpoints, metrics.jsonl, config.json

Readers (evaluation, generation, notebooks) take no lock: they open checkpoints read-only. Each process of a
multi-process run holds its own lock file, so a second run on the same workdir is refused on every process.
The lock is `flock` on a local file system; on network file systems it may not exclude other hosts.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
from pathlib import Path


class WorkdirBusyError(RuntimeError):
  """Another live process is training in this workdir."""


class WorkdirVanishedError(OSError):
  """The workdir's lock file is no longer the one locked: the workdir was deleted, moved or its disk unmounted."""

  def __init__(self, workdir: str | os.PathLike, gone: str):
    super().__init__(f"the workdir {workdir} vanished while training (deleted, moved or its disk unmounted): {gone}")
    self.gone = gone


class LockFileRemovedError(OSError):
  """The workdir's lock file was removed while training, the workdir itself still in place: this process no longer
  excludes a second training there, so it stops (after a checkpoint)."""

  def __init__(self, path: str | os.PathLike, kept: str = ""):
    super().__init__(f"the lock file {path} was removed while training (the workdir is still there): without it a "
                     f"second training could start in this workdir, so the training stopped{kept}")


class WriterLock:
  """The exclusive lock of `workdir` on the file `path`; the file records its holder for the message."""

  def __init__(self, workdir: str | os.PathLike, path: str | os.PathLike):
    self.workdir = Path(workdir)
    self.path = Path(path)
    self._fd: int | None = None
    self._workdir_stat: os.stat_result | None = None  # the workdir's, as the lock was taken

  def acquire(self) -> None:
    """Takes the lock at once, or raises WorkdirBusyError naming the process that holds it."""
    try:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      unwritable = OSError(f"cannot create the lock file {self.path} ({e.strerror}): training writes its checkpoints "
                           "and metrics into the workdir, so it must be writable; choose a writable --workdir "
                           "(evaluate.py and generate.py read a read-only one)")
      unwritable.errno = e.errno
      raise unwritable from None
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _read_holder(fd)
      os.close(fd)
      raise WorkdirBusyError(
          f"{self.workdir} is being trained by {holder} (lock {self.path}); one training process per workdir. "
          "Wait for it to finish, stop it (SIGTERM checkpoints and exits), or choose another --workdir. "
          "Evaluating and sampling from this workdir while it trains are safe.") from None
    os.ftruncate(fd, 0)
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started}).encode(), 0)
    self._fd, self._workdir_stat = fd, os.stat(self.workdir)

  def check_held(self) -> None:
    """Raises unless `path` is still the file this process locked (cheap: a few stat calls): LockFileRemovedError
    where the workdir is still the directory it locked, WorkdirVanishedError where that is gone too (deleted,
    moved, or replaced by a new one at its path)."""
    try:
      held = self._fd is not None and os.path.samestat(os.fstat(self._fd), os.stat(self.path))
    except FileNotFoundError:
      held = False
    if held:
      return
    try:
      in_place = self._workdir_stat is not None and os.path.samestat(self._workdir_stat, os.stat(self.workdir))
    except OSError:
      in_place = False
    if in_place and not self.path.exists():
      raise LockFileRemovedError(self.path)
    raise WorkdirVanishedError(self.workdir, f"its lock file {self.path} is gone")

  def release(self) -> None:
    """Releases the lock (the file stays: it is free once no process holds it)."""
    if self._fd is not None:
      fcntl.flock(self._fd, fcntl.LOCK_UN)
      os.close(self._fd)
      self._fd = None

  def __enter__(self) -> WriterLock:
    self.acquire()
    return self

  def __exit__(self, *exc_info) -> None:
    self.release()


def held_on_this_host(path: str | os.PathLike) -> bool | None:
  """Whether a live process holds the lock at `path`: True or False for a holder on this host; None where the lock
  file is gone or its holder runs on another host (flock cannot tell there)."""
  try:
    fd = os.open(path, os.O_RDONLY)
  except FileNotFoundError:
    return None
  try:
    try:
      host = json.loads(os.pread(fd, 4096, 0).decode()).get("host")
    except (ValueError, AttributeError):
      return None
    if host != socket.gethostname():
      return None
    try:
      fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
      return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False
  finally:
    os.close(fd)


def _read_holder(fd: int) -> str:
  """`process PID on HOST since TIME` from the lock file, or a plain description if it is not written yet."""
  try:
    holder = json.loads(os.pread(fd, 4096, 0).decode())
    return f"process {holder['pid']} on {holder['host']} since {holder['started']}"
  except (ValueError, KeyError, TypeError):
    return "another process"
