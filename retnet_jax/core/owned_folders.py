"""The folders the project writes into: new, empty, or carrying its mark, a small file written first that names the
tool, the folder's format and the mark's version, and records the names the project wrote there.

    folder = owned_folders.claim(path, "workdir", flag="--workdir", writes=("config.json", "checkpoints"))
    folder.record("train-00003.tokens")   # before the name is created
    folder.written()                       # the names it may replace or remove

Anything else is refused (NotOwnedError) before any work, naming the folder, a few of the files found there and
the fix, unless an earlier version of the project wrote it (`earlier` recognises such a folder and names what it
wrote, recorded as the project's) or the user takes it (`take`: the scripts' --take_folder), in which case the
project writes beside the files found and touches none of them. A name the project is about to write that the
folder already holds, unrecorded, is refused even then: the project replaces or removes only names it recorded. A
name it writes or recorded that is a symbolic link is refused too: it would write through the link. The temporary
file of a mark that a process killed mid-write left counts as no file, and the next claim removes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from retnet_jax.core import whole_files

MARK = ".retnet_jax.json"
TOOL = "retnet_jax"
VERSION = 1
TAKE_FLAG = "--take_folder"  # the scripts' flag that writes into a folder holding files the project did not write


class NotOwnedError(ValueError):
  """A folder the project may not write into: it holds files the project did not write, or another format's."""


class MarkWriteError(OSError):
  """The folder or its mark could not be written (a full or read-only disk): the message names it and the fix;
  `errno` is the cause's."""

  def __init__(self, message: str, code: int | None):
    super().__init__(message)
    self.errno = code


def listing(names: Iterable[str], limit: int = 3) -> str:
  """`'a', 'b', 'c' (and 4 more)`: a few of `names`, sorted, for a message."""
  names = sorted(names)
  more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
  return ", ".join(repr(name) for name in names[:limit]) + more


class OwnedFolder:
  """A folder carrying the project's mark: what the project recorded as written there."""

  def __init__(self, path: str | os.PathLike, kind: str):
    self.path, self.kind = Path(path), kind

  def written(self) -> set[str]:
    """The names the project recorded as written in the folder."""
    mark = read_mark(self.path)
    return set(mark["written"]) if mark else set()

  def owns(self, name: str) -> bool:
    """Whether the project recorded `name` as written (its to replace or remove)."""
    return name in self.written()

  def record(self, *names: str) -> None:
    """Records `names` as written, before they are created; refuses (NotOwnedError) one that exists unrecorded."""
    if bad := [name for name in names if not plain_name(name)]:
      raise ValueError(f"cannot record {listing(map(str, bad))} in {self.path}: not plain names inside it.")
    with _locked(self.path):
      mark = self._mark()
      foreign = [name for name in names if name not in mark["written"] and os.path.lexists(self.path / name)]
      if foreign:
        raise NotOwnedError(f"{self.path} holds {listing(foreign)}, which this project did not write and would "
                            "write over; move it elsewhere and run the same command again.")
      _write_mark(self.path, {**mark, "written": sorted(set(mark["written"]) | set(names))})

  def forget(self, *names: str) -> None:
    """Drops `names` (removed by the project) from the record: a file put there later under the name is not its."""
    with _locked(self.path):
      mark = self._mark()
      _write_mark(self.path, {**mark, "written": sorted(set(mark["written"]) - set(names))})

  def _mark(self) -> dict[str, Any]:
    """The folder's mark; NotOwnedError where it is gone (deleted since the folder was claimed)."""
    mark = read_mark(self.path)
    if mark is None:
      raise NotOwnedError(f"{self.path / MARK} is gone (deleted while this project wrote into {self.path}); "
                          "restore it, or choose a new or empty folder.")
    return mark


def read_mark(folder: str | os.PathLike) -> dict[str, Any] | None:
  """The mark of `folder` ({"tool", "format", "version", "written"}), or None where it has none; NotOwnedError
  naming the fix for one that is not the project's mark."""
  path = Path(folder) / MARK
  try:
    mark = json.loads(path.read_text())
  except FileNotFoundError:
    return None
  except (OSError, ValueError) as e:
    raise NotOwnedError(f"{path} is unreadable ({e}); restore it, or choose a new or empty folder.") from None
  version = mark.get("version") if isinstance(mark, dict) else None
  if not (isinstance(mark, dict) and mark.get("tool") == TOOL and isinstance(mark.get("format"), str)
          and type(version) is int and version >= 1 and isinstance(mark.get("written"), list)):
    raise NotOwnedError(f"{path} is not {TOOL}'s mark (tool, format, version, written); choose a new or empty folder.")
  bad = [name for name in mark["written"] if not plain_name(name)]
  if bad:
    raise NotOwnedError(f"{path} records {listing(map(str, bad))} as written, which are not plain names inside its "
                        "folder; it was not written by this project: choose a new or empty folder.")
  if mark["version"] > VERSION:
    raise NotOwnedError(f"{path} is version {mark['version']} of {TOOL}'s mark, newer than this code's {VERSION}; "
                        "update this code, or choose a new or empty folder.")
  return mark


def plain_name(name: Any) -> bool:
  """Whether `name` is a plain file name inside a folder: a non-empty string, not `.` or `..`, without a path
  separator or NUL (a mark's names are removed and replaced: none may reach outside its folder)."""
  return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and os.sep not in name
          and "\0" not in name)


def check(path: str | os.PathLike, kind: str, *, flag: str, writes: Sequence[str] = (), take: bool = False,
          earlier: Callable[[Path], list[str] | None] | None = None, take_flag: str | None = TAKE_FLAG
          ) -> list[str] | None:
  """Refuses (NotOwnedError naming `flag`, the folder, a few of its files and the fix) a `path` that the project may
  not write into as a `kind` folder; writes nothing.

  Args:
    path: the folder (it may not exist yet).
    kind: the folder's format, e.g. "workdir", "prepared corpus".
    flag: the flag that named the folder, for the message.
    writes: the names the caller will write at once; one the folder holds unrecorded is refused, `take` or not.
    take: write into a folder holding files the project did not write, beside them.
    earlier: recognises a folder of this kind written by an earlier version (no mark): the names it wrote, else
      None.
    take_flag: the flag that sets `take`, named in the fix; None where there is none (an environment variable
      names the folder), and the fix is a new or empty folder.
  Returns:
    The names to record as the project's where `earlier` recognised the folder, else None.
  """
  path = Path(path)
  named = f"{flag}={str(path)!r}"
  if str(path).startswith("~"):
    raise NotOwnedError(f"{named} begins with '~', which no shell expanded (the flag was quoted?), so a folder named "
                        "'~' would be made here; write the path out, e.g. with $HOME.")
  if path.exists() and not path.is_dir():
    raise NotOwnedError(f"{named} is a file; choose a directory (new or empty).")
  if not path.is_dir():
    return None
  mark, adopted = read_mark(path), None
  if mark is not None and mark["format"] != kind:
    raise NotOwnedError(f"{named} is a {mark['format']} folder of this project, not a {kind}; choose a new or "
                        f"empty {flag}.")
  found = sorted(p.name for p in path.iterdir() if p.name != MARK and not whole_files.is_partial(p.name, MARK))
  if mark is not None:
    recorded = set(mark["written"])
  elif not found:
    recorded = set()
  elif earlier is not None and (adopted := earlier(path)) is not None:
    recorded = set(adopted)
  elif take:
    recorded = set()
  else:
    beside = (f", or pass {take_flag} to write into it beside those files (none of which it touches)" if take_flag
              else ", or move those files elsewhere")
    raise NotOwnedError(f"{named} holds {listing(found)}, which this project did not write (no {MARK}); choose a new "
                        f"or empty {flag}{beside}.")
  foreign = [name for name in writes if name not in recorded and name in found]
  if foreign:
    raise NotOwnedError(f"{named} holds {listing(foreign)}, which this project did not write and would write over; "
                        f"choose a new or empty {flag}, or move those files elsewhere.")
  links = [name for name in set(writes) | recorded if plain_name(name) and (path / name).is_symlink()]
  if links:
    raise NotOwnedError(f"{named} holds {listing(links)} as symbolic links, which this project would write through "
                        "to what they point at; it writes only files of its own: remove the links (what they point at "
                        f"stays as it is), or choose a new {flag}.")
  return adopted


def claim(path: str | os.PathLike, kind: str, *, flag: str, writes: Sequence[str] = (), take: bool = False,
          earlier: Callable[[Path], list[str] | None] | None = None, take_flag: str | None = TAKE_FLAG
          ) -> OwnedFolder:
  """`check`, then creates the folder where new and writes its mark (first), recording `writes` and what an earlier
  version wrote; safe against processes claiming the same folder at once. Arguments as `check`'s."""
  path = Path(path)
  checked = dict(flag=flag, writes=writes, take=take, earlier=earlier, take_flag=take_flag)
  if not path.is_dir():  # refused before anything is made (a file by name); a folder is checked under its lock only,
    check(path, kind, **checked)  # where no other process of the run is halfway through writing the mark
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise MarkWriteError(f"could not create {flag}={str(path)!r} ({e.strerror or e}); free space on that disk or "
                         f"make it writable, or choose another {flag}, then run the same command again.",
                         e.errno) from None
  with _locked(path):  # again, with the mark's lock held
    adopted = check(path, kind, **checked)
    _remove_partial_marks(path)
    mark = read_mark(path) or {"tool": TOOL, "format": kind, "version": VERSION, "written": []}
    written = set(mark["written"]) | set(adopted or ()) | set(writes)
    if mark.get("written") != sorted(written) or not (path / MARK).exists():
      _write_mark(path, {**mark, "written": sorted(written)})
  return OwnedFolder(path, kind)


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
  """Holds an exclusive lock on `folder` itself: one process at a time reads and writes its mark."""
  fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    os.close(fd)  # releases the lock


def _remove_partial_marks(folder: Path) -> None:
  """Removes the mark's temporary files that a process killed while writing the mark left (with the mark's lock
  held, where every mark is written, none is in flight): the folder is then as that process found it, or marked."""
  for name in os.listdir(folder):
    if whole_files.is_partial(name, MARK):
      with contextlib.suppress(FileNotFoundError):
        os.unlink(folder / name)


def _write_mark(folder: Path, mark: dict[str, Any]) -> None:
  """Writes the mark whole (`whole_files`: a reader sees the old one or the new one), through a temporary file of a
  new name, so that no file already in the folder is written over."""
  try:
    whole_files.write_text(folder / MARK, json.dumps(mark, indent=1) + "\n")
  except OSError as e:
    raise MarkWriteError(f"could not write {folder / MARK}, the project's record of what it wrote there "
                         f"({e.strerror or e}); free space on that disk or make it writable, then run the same "
                         "command again.", e.errno) from None
