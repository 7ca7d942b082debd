"""Runs the tests on 8 CPU devices (set before jax is imported), or on the accelerator with RETNET_TEST_BACKEND=gpu;
shared fixtures.

On an accelerator, float32 matmuls run at full precision (`highest`: the forms' agreement tolerances assume exact
float32 products, which TF32 would not give) and tests marked `devices(n)` are skipped where fewer devices are
present: run them on the CPU as usual.
"""
import os

BACKEND = os.environ.get("RETNET_TEST_BACKEND", "cpu")
if BACKEND == "cpu":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

if BACKEND != "cpu":
  jax.config.update("jax_default_matmul_precision", "highest")


def pytest_runtest_setup(item):
  marker = item.get_closest_marker("devices")
  if marker is not None and jax.device_count() < marker.args[0]:
    pytest.skip(f"needs {marker.args[0]} devices; {jax.device_count()} on {jax.default_backend()}")


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


def flip_bytes(step_dir, every_data_file=False):
  """XORs 4,000 bytes in the middle of the largest array file (or of every array data file) of a checkpoint
  step, sizes unchanged. Which bytes a restore reads depends on the storage layout, so tests that must damage
  what is read whatever the mesh flip every data file."""
  files = [f for f in (step_dir / "state").rglob("*") if f.is_file()]
  if every_data_file:
    files = [f for f in files if f.parent.name == "d"]
  else:
    files = [max(files, key=lambda f: f.stat().st_size)]
  for file in files:
    data = bytearray(file.read_bytes())
    middle = max(len(data) // 2 - 2000, 0)
    data[middle:middle + 4000] = bytes(b ^ 0x5A for b in data[middle:middle + 4000])
    file.write_bytes(bytes(data))
