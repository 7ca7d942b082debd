"""Per-head decay schedules, returned as log(gamma) in float32 whatever the compute dtype.

In bfloat16, 1 - 2^(-5-h) rounds to exactly 1 for h >= 4, which would turn decay off; schedules are
therefore computed in float64 and stored as float32 logs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SCHEDULES = ("retnet", "logspace", "explicit")


def gammas(schedule: str, num_heads: int, explicit: Sequence[float] | None = None) -> np.ndarray:
  """Decay gamma_h in (0, 1) per head as float64 `[num_heads]`.

  `retnet`: 1 - 2^(-5-h) (the official code); `logspace`: 1 - exp(linspace(log 1/32, log 1/512, H)) (the
  paper's experiments); `explicit`: the given list.
  """
  if explicit is not None and schedule != "explicit":
    raise ValueError(f"decay_gammas={tuple(explicit)} is set but decay_schedule={schedule!r} ignores it; set "
                     "model.decay_schedule=explicit to use these gammas, or leave decay_gammas unset.")
  if schedule == "retnet":
    return 1.0 - 2.0 ** (-5.0 - np.arange(num_heads, dtype=np.float64))
  if schedule == "logspace":
    return 1.0 - np.exp(np.linspace(np.log(1 / 32), np.log(1 / 512), num_heads, dtype=np.float64))
  if schedule == "explicit":
    if explicit is None or len(explicit) != num_heads:
      raise ValueError(f"decay_schedule 'explicit' needs decay_gammas with one value per head ({num_heads}); "
                       f"got {explicit!r}.")
    values = np.asarray(explicit, dtype=np.float64)
    if not np.all((values > 0) & (values < 1)):
      raise ValueError(f"decay_gammas must all lie strictly between 0 and 1; got {list(explicit)}.")
    return values
  raise ValueError(f"unknown decay_schedule {schedule!r}; choose one of {SCHEDULES}.")


def log_decay(schedule: str, num_heads: int, explicit: Sequence[float] | None = None) -> np.ndarray:
  """log(gamma_h) as float32 `[num_heads]`, the form the retention functions take."""
  return np.log(gammas(schedule, num_heads, explicit)).astype(np.float32)
