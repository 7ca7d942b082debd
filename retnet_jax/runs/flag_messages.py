"""The one line a script ends with for a flag or config field it does not know, suggesting the names it does know:
the script's own flags and this package's, and the config's fields (absl suggests among every flag, its own logging
flags included: --stpes -> stderrthreshold)."""

from __future__ import annotations

import difflib
import os
import sys

from absl import flags
import ml_collections

from retnet_jax.models import presets


def unknown_flag(name: str) -> str:
  """One line for a flag the script does not define, suggesting the closest of its own flags (the script's and this
  package's: absl's suggestions come from every flag, e.g. --stpes -> stderrthreshold) and of the config's fields
  (--stpes -> --config.train.steps)."""
  own = {flag.name: flag.name for module, defined in flags.FLAGS.flags_by_module_dict().items()
         if module.startswith("retnet_jax") or os.path.abspath(module) == os.path.abspath(sys.argv[0])
         for flag in defined}
  if "config" in own:
    config = presets.get_config("tiny")
    for section, fields in config.items():
      if isinstance(fields, ml_collections.ConfigDict):
        own.update({field: f"config.{section}.{field}" for field in fields if field not in own})
  close = [own[match] for match in difflib.get_close_matches(name, list(own), n=2, cutoff=0.75)]
  return f"unknown flag --{name}" + (f"; did you mean {' or '.join('--' + c for c in close)}?" if close else ".")


def unknown_field(argv: list[str], error: BaseException) -> str:
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
