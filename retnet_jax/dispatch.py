"""A compiled function over many batches with a bound on the calls in flight.

JAX returns from a call before the device has run it; a loop over a hundred batches queues a hundred programs.
Their collectives (a sequence-parallel mesh's permutes) can then starve and time out, and every queued output
holds device memory. `host_map` reads each output back to the host once `in_flight` later calls are queued.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

IN_FLIGHT = 2  # the next call queued while the host reads the previous one's output


def host_map(fn: Callable[[Any], Any], items: Iterable[Any], in_flight: int = IN_FLIGHT) -> list[Any]:
  """`[fn(item) for item in items]` with every output leaf as a numpy array, at most `in_flight` calls ahead of
  the outputs read back."""
  if in_flight < 1:
    raise ValueError(f"in_flight={in_flight} must be at least 1 call.")
  pending, outputs = collections.deque(), []
  for item in items:
    pending.append(fn(item))
    if len(pending) > in_flight:
      outputs.append(jax.tree.map(np.asarray, pending.popleft()))
  outputs.extend(jax.tree.map(np.asarray, output) for output in pending)
  return outputs
