"""Runs the tests on 8 CPU devices (set before jax is imported), or on the accelerator with RETNET_TEST_BACKEND=gpu;
shared fixtures (the shared functions are in tests/helpers.py).

On an accelerator, float32 matmuls run at full precision (`highest`: the forms' agreement tolerances assume exact
float32 products, which TF32 would not give), XLA's GPU ops run deterministically (the resume tests compare runs bit
for bit), tests marked `devices(n)` are skipped where fewer devices are present and tests marked `cpu_only(reason)`
are skipped off the CPU: run them on the CPU as usual. Corpora of plain files are cached
(retnet_jax/input_pipeline/corpus_cache.py) in a temporary directory per test process, not in the user's cache.
"""
import os
import tempfile

BACKEND = os.environ.get("RETNET_TEST_BACKEND", "cpu")
if BACKEND == "cpu":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
if BACKEND == "cpu":
  # The 8 simulated devices meet in each collective; XLA aborts the process when one arrives a minute after the
  # others (20 s to a warning, 40 s more to the abort), a watchdog for deadlocks. Two test workers on 2 cores, beside
  # the subprocesses some tests start, can delay a device's thread that long without any deadlock: allow 10 minutes.
  os.environ["XLA_FLAGS"] += " --xla_cpu_collective_call_terminate_timeout_seconds=600"
if BACKEND != "cpu":
  # test_resume_is_exact (RetNet's and the Transformer's) compares a straight run's losses with a resumed run's bit
  # for bit; on a GPU, XLA's scatter-adds (the embedding gradient) run as atomics, summing in a varying order, unless
  # its ops are made deterministic. XLA reads its flags once, as the backend starts: they hold for the whole run.
  os.environ["XLA_FLAGS"] += " --xla_gpu_deterministic_ops=true"
os.environ["RETNET_JAX_CACHE"] = tempfile.mkdtemp(prefix="retnet_jax_test_cache_")
if BACKEND == "cpu":
  # Most of the suite's time is XLA compiling small programs; unoptimised CPU code computes the same values (the
  # tolerances hold) and compiles faster. Tests of compiled memory or FLOPs are marked `optimized` and compile as
  # shipped. The environment variable reaches the scripts the tests start too.
  os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# Compiled programs are kept on disk (`compilation_cache_dir`, set in pytest_configure) and shared by the test
# workers and the scripts they start: every entry, however quick its compile; a lock file serialises the writers.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))

import copy  # noqa: E402
import shutil  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

if BACKEND != "cpu":
  jax.config.update("jax_default_matmul_precision", "highest")

from retnet_jax.training import train  # noqa: E402
from tests import helpers, tiers  # noqa: E402


def pytest_configure(config):
  config.addinivalue_line("markers", "cpu_only(reason): checks what holds on XLA's CPU backend only (its messages, a "
                                     "measured CPU ceiling); skipped on other backends with the reason")
  config.addinivalue_line("markers", "optimized: checks compiled memory, FLOPs or speed, so XLA optimises as it does "
                                     "outside the tests (the suite otherwise compiles with most optimisations off)")
  if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    # pytest's own cache folder (.pytest_cache), kept between runs; a fresh folder per run without the cacheprovider.
    cache = (config.cache.mkdir("jax_compilation_cache") if getattr(config, "cache", None) is not None
             else tempfile.mkdtemp(prefix="retnet_jax_test_xla_"))
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(cache)
  jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the marks
def pytest_collection_modifyitems(items):
  """Tests that took at least `slow_s` seconds in the recorded run join the slow tier (tests/tiers.py)."""
  slow_s, durations = tiers.load()
  for item in items:
    if durations.get(item.nodeid, 0.0) >= slow_s and not tiers.kept_fast(item.nodeid):
      item.add_marker(pytest.mark.slow)


def pytest_runtest_setup(item):
  marker = item.get_closest_marker("devices")
  if marker is not None and jax.device_count() < marker.args[0]:
    pytest.skip(f"needs {marker.args[0]} devices; {jax.device_count()} on {jax.default_backend()}")
  marker = item.get_closest_marker("cpu_only")
  if marker is not None and jax.default_backend() != "cpu":
    pytest.skip(f"on the CPU only ({jax.default_backend()} here): {marker.args[0]}")


@pytest.fixture(autouse=True)
def _optimized(request, monkeypatch):
  """Compiles a test marked `optimized` with XLA's optimisations on, in process and in the scripts it starts."""
  if request.node.get_closest_marker("optimized") is None or not jax.config.read("jax_disable_most_optimizations"):
    yield
    return
  monkeypatch.delenv("JAX_DISABLE_MOST_OPTIMIZATIONS", raising=False)
  jax.config.update("jax_disable_most_optimizations", False)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", True)


class Crash(Exception):
  """Stands for a run killed mid-step."""


@pytest.fixture
def run_crashing_at_batch(monkeypatch):
  """`run_crashing_at_batch(n, fn, *args)`: calls fn with the n-th training batch fetch raising Crash."""
  from retnet_jax.input_pipeline import loader

  def run(n, fn, *args):
    original, calls = loader.PreparedBatches.__next__, []

    def next_or_crash(self):
      calls.append(1)
      if len(calls) == n:
        raise Crash
      return original(self)

    monkeypatch.setattr(loader.PreparedBatches, "__next__", next_or_crash)
    try:
      with pytest.raises(Crash):
        fn(*args)
    finally:
      monkeypatch.setattr(loader.PreparedBatches, "__next__", original)

  return run


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
  """The tiny run of `helpers.tiny_config` (8 steps; checkpoints 4 and 8), trained once per test process: a
  `helpers.TrainedRun`. Tests only read its workdir; one that writes there takes `trained_copy`."""
  directory = tmp_path_factory.mktemp("trained")
  config = helpers.tiny_config(directory)
  workdir = directory / "run"
  train.train_and_evaluate(config, workdir)
  return helpers.TrainedRun(config, workdir, helpers.script_flags(config, workdir))


@pytest.fixture
def trained_copy(trained, tmp_path):
  """`trained` with its workdir copied to `tmp_path/run` and its config copied, for a test that changes them."""
  workdir = tmp_path / "run"
  shutil.copytree(trained.workdir, workdir)
  return helpers.TrainedRun(copy.deepcopy(trained.config), workdir, helpers.script_flags(trained.config, workdir))
