"""Checks of one config field (or argument) that the `check_*` functions share: a positive integer, a choice among
names, a finite number. Each raises ValueError naming the field, the bad value and what to give instead.

    for name in ("batch_size", "seq_len"):
      config_checks.positive_int(config.train[name], f"train.{name}")
    config_checks.choice(cfg.kernel_layout, "model.kernel_layout", kernels.LAYOUTS)
    config_checks.finite_number(cfg.rotation_base, "model.rotation_base", positive=True)
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable
from typing import Any

# The largest seed (config.seed, --seed): PRNG seeds are 64-bit integers (jax.random.key, numpy's generators).
MAX_SEED = 2**63 - 1


def _why(why: str) -> str:
  return f" ({why})" if why else ""


def _shown(value: Any) -> str:
  """A number as printed (a NumPy scalar as its plain value), anything else as its repr (a string quoted)."""
  return str(value) if isinstance(value, numbers.Number) else repr(value)


def positive_int(value: Any, field: str, why: str = "") -> int:
  """`value` as a Python int if it is an integer (any integer type) of at least 1.

  Args:
    value: the field's value.
    field: its name in the message, e.g. "train.batch_size".
    why: what the number counts, written in parentheses after the requirement.

  Returns:
    The value as an int; ValueError "`field` must be a positive integer (why); got `value`." otherwise (a float or
    a string included, as no integer).
  """
  try:
    number = operator.index(value)
  except TypeError:
    number = 0
  if number < 1:
    raise ValueError(f"{field} must be a positive integer{_why(why)}; got {_shown(value)}.")
  return number


def choice(value: Any, field: str, choices: Iterable[Any], why: str = "", otherwise: str = "") -> Any:
  """`value` if it is one of `choices` (a tuple, or a dict's keys).

  Args:
    value: the field's value.
    field: its name in the message, e.g. "model.kernel_layout".
    choices: the accepted values, listed in the message as a tuple.
    why: what the field selects, written in parentheses after the bad value.
    otherwise: the alternatives to a choice, appended to the list (e.g. ", or leave it unset for text data").

  Returns:
    The value; ValueError "unknown `field` `value` (why); choose one of `choices``otherwise`." otherwise.
  """
  choices = tuple(choices)
  if value not in choices:
    raise ValueError(f"unknown {field} {value!r}{_why(why)}; choose one of {choices}{otherwise}.")
  return value


def finite_number(value: Any, field: str, positive: bool = False, why: str = "") -> float:
  """`value` as a float if it is a finite real number, above 0 with `positive`, at least 0 without.

  Args:
    value: the field's value.
    field: its name in the message, e.g. "model.norm_eps".
    positive: refuse 0 as well.
    why: what the number does, written in parentheses after the requirement.

  Returns:
    The value as a float; ValueError "`field` must be a positive finite number (why); got `value`." (or "a finite
    number >= 0") otherwise.
  """
  good = (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
          and (value > 0 if positive else value >= 0))
  if not good:
    requirement = "a positive finite number" if positive else "a finite number >= 0"
    raise ValueError(f"{field} must be {requirement}{_why(why)}; got {_shown(value)}.")
  return float(value)
