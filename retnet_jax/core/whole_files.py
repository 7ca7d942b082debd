"""Files written whole: first to a temporary file of a new name beside the target, then renamed over it, so that a
reader, or a run killed mid-write, sees the old file or the new one and never a part, and no other file in the
folder is written over (the temporary's name is new: `tempfile.mkstemp`).

    whole_files.write_text(workdir / "eval_step_8.json", line + "\n")
    with whole_files.replacing(png) as partial:  # any writer that takes a path
      fig.savefig(partial)
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _partial_prefix(path: Path) -> str:
  return f".{path.stem}.partial."


def is_partial(name: str, path: str | os.PathLike) -> bool:
  """Whether `name` is that of a temporary file `replacing(path)` writes: one in flight, or one a writer killed
  mid-write (SIGKILL) left behind."""
  path = Path(path)
  return name.startswith(_partial_prefix(path)) and name.endswith(path.suffix)


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
  """Yields a new, empty temporary file beside `path` (hidden, with `path`'s suffix, so writers that read the
  format from the name keep it) to write; it becomes `path` when the block ends, and is removed if it raises."""
  path = Path(path)
  fd, partial = tempfile.mkstemp(dir=path.parent, prefix=_partial_prefix(path), suffix=path.suffix)
  os.close(fd)
  try:
    yield Path(partial)
    os.replace(partial, path)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(partial)
    raise


def write_text(path: str | os.PathLike, text: str) -> None:
  """Writes `text` (UTF-8) to `path` whole."""
  with replacing(path) as partial:
    partial.write_text(text, encoding="utf-8")
