"""Compiled calls in a loop with a bound on the calls in flight.

JAX returns from a call before the device has run it; a loop over a hundred batches queues a hundred programs.
Their collectives (a sequence-parallel mesh's permutes, a data-parallel mesh's gradient sums on simulated CPU
devices) can then starve until XLA aborts the process, and every queued output holds device memory. `host_map`
reads each output back to the host once `in_flight` later calls are queued; `wait_behind` lets a loop that keeps
its outputs on the device (training's metrics) stay at most `in_flight` calls ahead of them.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Sequence
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


def wait_behind(outputs: Sequence[Any], in_flight: int = IN_FLIGHT) -> None:
  """Blocks until the output `in_flight` calls before the newest of `outputs` is computed (nothing while fewer are
  queued): called after each call of a loop whose calls depend on each other, at most `in_flight` run ahead."""
  if in_flight < 1:
    raise ValueError(f"in_flight={in_flight} must be at least 1 call.")
  if len(outputs) > in_flight:
    jax.block_until_ready(outputs[-1 - in_flight])
