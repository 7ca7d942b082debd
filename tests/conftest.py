"""Gives the tests 8 CPU devices (this must run before jax is imported) and shared fixtures."""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import pytest  # noqa: E402


class Crash(Exception):
  """Stands for a run killed mid-step."""


@pytest.fixture
def run_crashing_at_batch(monkeypatch):
  """`run_crashing_at_batch(n, fn, *args)`: calls fn with the n-th training batch fetch raising Crash."""
  from retnet_jax import data

  def run(n, fn, *args):
    original, calls = data.BatchIterator.__next__, []

    def next_or_crash(self):
      calls.append(1)
      if len(calls) == n:
        raise Crash
      return original(self)

    monkeypatch.setattr(data.BatchIterator, "__next__", next_or_crash)
    try:
      with pytest.raises(Crash):
        fn(*args)
    finally:
      monkeypatch.setattr(data.BatchIterator, "__next__", original)

  return run
