"""What the scripts share: the host-memory setting made first, their common flags, and the absl entry point.

    from retnet_jax import cli
    if __name__ == "__main__":
      cli.prepare()  # before numpy and jax are imported
    ...
    _CONFIG = cli.config_flag("Config file and preset.")
    if __name__ == "__main__":
      cli.run(main)

Importing this module imports neither numpy nor jax, so `prepare` can still act on every thread they start.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from absl import app, flags
from ml_collections import config_flags

from retnet_jax import host_memory, presets, workdir_lock

DEFAULT_CONFIG = "configs/retnet.py:small"


def prepare() -> None:
  """Process-wide settings that must precede numpy and jax: `host_memory.keep_freed_memory` (CPU backend)."""
  host_memory.keep_freed_memory()


def config_flag(help_text: str) -> flags.FlagHolder:
  """`--config=FILE:PRESET` (locked: a misspelt `--config.x.y` is an error) with `--config.x.y=...` overrides.

  ml_collections reads the overrides of sys.argv as the flag is defined: one that names no field ends the
  script with one line naming it and the nearest field names.
  """
  try:
    return config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, help_text, lock_config=True)
  except (AttributeError, KeyError) as e:
    sys.exit(_unknown_field(sys.argv, e))


def workdir_flag(help_text: str) -> flags.FlagHolder:
  """The required `--workdir`."""
  return flags.DEFINE_string("workdir", None, help_text, required=True)


def step_flag(help_text: str) -> flags.FlagHolder:
  """`--step`: a checkpoint step; None for the latest."""
  return flags.DEFINE_integer("step", None, help_text)


_VERBOSE = flags.DEFINE_boolean("verbose", False, "Show the traceback of an error, not only its message.")
# What bad input, a busy workdir or a failing disk raise: their messages name the value or path and the fix.
USER_ERRORS = (ValueError, OSError, FloatingPointError, workdir_lock.WorkdirBusyError)


def run(main: Callable[[], None]) -> None:
  """Parses the flags (jax's own among them) and calls `main()`; positional arguments are a usage error.

  A USER_ERRORS exception ends the script with its message alone on stderr and exit status 1 (its traceback
  with --verbose).
  """
  import jax  # pylint: disable=import-outside-toplevel  (after `prepare`, which the scripts call first)

  def absl_main(argv: list[str]) -> None:
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
      main()
    except USER_ERRORS as e:
      if _VERBOSE.value:
        raise
      sys.exit(f"error: {e} ({type(e).__name__}; --verbose shows the traceback)")

  jax.config.config_with_absl()
  app.run(absl_main, flags_parser=_parse_flags)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with each failure as one line: a bad value, an unknown preset, a misspelt field."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    lines = [line for line in str(e).splitlines() if line.strip()]
    if any(line.startswith("Traceback") for line in lines):  # ml_collections quotes its own traceback: the cause
      lines = [lines[0].split(": Error whilst", 1)[0] + ":", lines[-1]]
    sys.exit("error: " + " ".join(lines) + "\nPass --helpshort or --helpfull to see help on flags.")
  except (AttributeError, KeyError) as e:
    sys.exit(_unknown_field(argv, e))


def _unknown_field(argv: list[str], error: BaseException) -> str:
  """One line for ml_collections' error about a `--config.x.y=...` that names no field (its innermost message)."""
  while error.args and isinstance(error.args[0], BaseException):
    error = error.args[0]
  detail = " ".join(str(error.args[0] if error.args else error).split())
  overrides = [arg.split("=", 1)[0] for arg in argv[1:] if arg.startswith("--config.")]
  culprit = next((name for name in overrides if f"'{name.rsplit('.', 1)[-1]}'" in detail), "a --config override")
  field = culprit.removeprefix("--config.model.")
  owners = [name for name, fields in presets.MODEL_FIELDS.items() if field in fields]
  if field != culprit and owners:  # another architecture's option
    detail += (f" (model.{field} is a {owners[0]} option, which this config's architecture does not have: drop it, "
               f"or use --config=configs/{owners[0]}.py:NAME)")
  return f"error: {culprit} names no config field: {detail}"
