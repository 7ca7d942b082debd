"""What a failed write of checkpoints or exported parameters says: the errors training reports, and the cause's errno
and reason read from an OSError or from TensorStore's message, where the errno sits inside pages of its spec."""

from __future__ import annotations

import errno
import os
import re

# errno -> (what went wrong with the workdir's disk, the fix), for the messages of a failed write
DISK_FAULTS = {
    errno.ENOSPC: ("its disk is full", "free space there (or move the workdir to a disk with room)"),
    errno.EDQUOT: ("the disk quota is exceeded", "free space or raise the quota"),
    errno.EROFS: ("its file system is read-only", "remount it read-write (or copy the workdir to a writable disk)"),
    errno.EACCES: ("permission is denied", "make the workdir writable for this user"),
    errno.EPERM: ("permission is denied", "make the workdir writable for this user"),
    errno.EIO: ("its disk reported an I/O error", "check the disk"),
}


def disk_fault(code: int | None) -> tuple[str, str]:
  """(what went wrong, the fix) of a failed write with errno `code` (`DISK_FAULTS`, else a generic pair)."""
  return DISK_FAULTS.get(code, ("a write failed", "remove the cause"))


class CheckpointWriteError(OSError):
  """A checkpoint could not be written (disk full, read-only, vanished directory...); earlier steps are intact.

  `errno` is the cause's, also where TensorStore reports it inside its message (`os_error_code='28'`).
  """

  def __init__(self, step: int | None, directory: str, cause: BaseException):
    code, reason = write_failure(cause)
    super().__init__(f"could not write checkpoint {step} in {directory}: {reason}")
    self.errno, self.step = code, step


class ExportWriteError(OSError):
  """The parameters could not be exported (`export_params`); `errno` as CheckpointWriteError's."""

  def __init__(self, message: str, code: int | None):
    super().__init__(message)
    self.errno = code


def write_failure(cause: BaseException) -> tuple[int | None, str]:
  """(errno, reason) of a failed write: an OSError's, or TensorStore's, whose errno sits inside its message
  (`RESOURCE_EXHAUSTED: ... [os_error_code='28']`) beside pages of its spec."""
  code = getattr(cause, "errno", None)
  if code is None and (match := re.search(r"os_error_code='(\d+)'", str(cause))):
    code = int(match.group(1))
  reason = (cause.strerror if isinstance(cause, OSError) and cause.strerror else
            os.strerror(code) if code else (str(cause).splitlines() or [type(cause).__name__])[0])
  return code, reason
