"""dispatch.host_map: outputs read back in order, at most `in_flight` calls ahead."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from retnet_jax.core import dispatch


def test_host_map_reads_each_output_back_before_queueing_more_than_in_flight_calls():
  log = []

  class Output:  # a call's output, logging when it is made and when the host reads it
    def __init__(self, i):
      self.i = i
      log.append(("call", i))

    def __array__(self, dtype=None, copy=None):
      log.append(("read", self.i))
      return np.asarray(self.i, dtype)

  outputs = dispatch.host_map(Output, range(6), in_flight=2)
  assert log == [("call", 0), ("call", 1), ("call", 2), ("read", 0), ("call", 3), ("read", 1), ("call", 4),
                 ("read", 2), ("call", 5), ("read", 3), ("read", 4), ("read", 5)]
  assert [o.item() for o in outputs] == list(range(6)) and all(isinstance(o, np.ndarray) for o in outputs)
  assert dispatch.host_map(Output, [], in_flight=1) == []
  with pytest.raises(ValueError, match="in_flight=0 must be at least 1"):
    dispatch.host_map(Output, range(3), in_flight=0)


def test_wait_behind_keeps_a_chain_of_calls_at_most_in_flight_ahead():
  """Four chained slow calls (each ~0.1 s): after each, the one `in_flight` back is done; without the wait the
  host would have queued all four before the first one finished."""
  step = jax.jit(lambda x: jnp.linalg.matrix_power(x, 64) / jnp.linalg.norm(x))
  x = jnp.eye(256) + 1e-3
  step(x).block_until_ready()  # compiled
  outputs = []
  for _ in range(4):
    outputs.append(step(outputs[-1] if outputs else x))
    dispatch.wait_behind(outputs, in_flight=1)
    assert all(o.is_ready() for o in outputs[:-1])
  dispatch.wait_behind(outputs[:1])  # fewer than in_flight queued: nothing to wait for
  with pytest.raises(ValueError, match="in_flight=0 must be at least 1"):
    dispatch.wait_behind(outputs, in_flight=0)
