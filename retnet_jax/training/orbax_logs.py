"""Orbax's log records and leftover tracebacks kept out of training's output (`quiet`), for `checkpointing`.

Orbax logs every save at info level through absl, and a failed read or write leaves coroutines and TensorStore
callbacks that print tracebacks or warnings after the error itself reached the caller. What passes: orbax's warnings and
errors (less those about what is intended) and everything that is not orbax's. Records are told apart by the
file they come from, inside orbax's installed package folder (`package_dir`, which `checkpointing` passes: this
module does not import orbax).
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import sys
import traceback
import types
import warnings

# Orbax warnings that say what is intended: a reader's directory is read-only; a save between evaluations has
# no eval_loss for keep_best to rank it by.
_EXPECTED_WARNINGS = ("Given directory is read only", "Requested `tracked_metric`")


class OrbaxWarningsOnly(logging.Filter):
  """Drops orbax's info and debug records, which otherwise flood training logs at every save, its warnings about
  what is intended, and its error records that carry a traceback: the error itself reaches the caller, who
  reports it once (`write_errors.CheckpointWriteError`)."""

  def __init__(self, package_dir: str):
    super().__init__()
    self.package_dir = package_dir

  def filter(self, record: logging.LogRecord) -> bool:
    if record.exc_info and any(frame.filename.startswith(self.package_dir)
                               for frame in traceback.extract_tb(record.exc_info[2])):
      return False  # also asyncio's report of a failed orbax write whose future nobody awaited
    if record.name == "asyncio" and record.exc_info and record.exc_info[2] is None:
      return False  # the same for a TensorStore write's future, whose error carries no traceback
    if record.name == "asyncio" and self.package_dir in record.getMessage():
      return False  # an orbax task left pending in the loop a failed save closed ('Task was destroyed ...')
    if not record.pathname.startswith(self.package_dir):
      return True
    return record.levelno >= logging.WARNING and not record.getMessage().startswith(_EXPECTED_WARNINGS)


class LeftoversDropped:
  """`sys.unraisablehook` without what a failed orbax read or write leaves behind, each of which would print a
  traceback after the error itself was raised to the caller: its other coroutines, never awaited once the first
  failed, and TensorStore's callbacks into the event loop orbax closed. Everything else goes on to `hook`."""

  def __init__(self, hook, package_dir: str):
    self.hook = hook
    self.package_dir = package_dir

  def __call__(self, unraisable) -> None:
    frames = traceback.extract_tb(unraisable.exc_traceback)
    late_callback = (unraisable.exc_type is RuntimeError and frames and frames[0].name == "call_soon_threadsafe"
                     and str(unraisable.exc_value) == "Event loop is closed")
    code = getattr(unraisable.object, "cr_code", None)
    orbax_coroutine = code is not None and code.co_filename.startswith(self.package_dir)
    if not (late_callback or orbax_coroutine):
      self.hook(unraisable)


@functools.cache
def coroutine_names(package_dir: str) -> frozenset[str]:
  """Qualified names of the coroutine functions (nested ones too) of the loaded modules under `package_dir`."""
  names, seen = set(), set()

  def visit(code: types.CodeType) -> None:
    if code in seen:
      return
    seen.add(code)
    if code.co_flags & inspect.CO_COROUTINE:
      names.add(code.co_qualname)
    for constant in code.co_consts:
      if isinstance(constant, types.CodeType):
        visit(constant)

  def members(namespace: dict, depth: int = 0):
    for value in list(namespace.values()):
      value = getattr(value, "__func__", value)  # staticmethod, classmethod
      if isinstance(value, types.FunctionType):
        yield value.__code__
      elif isinstance(value, type) and depth == 0:
        yield from members(vars(value), 1)

  for module in list(sys.modules.values()):
    if (getattr(module, "__file__", None) or "").startswith(package_dir):
      for code in members(vars(module)):
        if (code.co_filename or "").startswith(package_dir):
          visit(code)
  return frozenset(names)


def _unawaited(names: frozenset[str]) -> str:
  """The message of Python's warning about any of the coroutines `names` collected unawaited, as a regex."""
  return f"coroutine '({'|'.join(sorted(map(re.escape, names)))})' was never awaited$"


def quiet(package_dir: str) -> None:
  """Filters the records of code under `package_dir` (orbax's folder, ending in a separator) out of absl's log
  (orbax logs through absl.logging) and asyncio's, and its leftovers from `sys.unraisablehook` and from the
  warnings about its coroutines left unawaited (they print at exit, after the run's error); doing it again is a
  no-op."""
  for name in ("absl", "asyncio"):
    logger = logging.getLogger(name)
    if not any(isinstance(f, OrbaxWarningsOnly) for f in logger.filters):
      logger.addFilter(OrbaxWarningsOnly(package_dir))
  if not isinstance(sys.unraisablehook, LeftoversDropped):
    sys.unraisablehook = LeftoversDropped(sys.unraisablehook, package_dir)
  names = coroutine_names(package_dir)
  if names:
    warnings.filterwarnings("ignore", message=_unawaited(names), category=RuntimeWarning)
