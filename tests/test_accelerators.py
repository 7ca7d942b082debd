"""The XLA flags training adds on NVIDIA GPUs: which, where, what the user keeps, and the training script's use."""

import importlib.util

import jax
import pytest

from retnet_jax.hardware import accelerators
from tests.helpers import script_flags, run_python, tiny_config

RECOMMENDED = " ".join(accelerators.GPU_TRAINING_XLA_FLAGS)


def test_the_recommended_flags_are_added_on_a_gpu_only():
  assert accelerators.gpu_xla_flags(None, "", gpu=True) == (RECOMMENDED, accelerators.GPU_TRAINING_XLA_FLAGS)
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" in accelerators.GPU_TRAINING_XLA_FLAGS
  assert accelerators.gpu_xla_flags(None, "", gpu=False) == ("", ())
  assert accelerators.gpu_xla_flags("none", "", gpu=True) == ("", ())
  assert accelerators.gpu_xla_flags(None, "--xla_dump_to=/tmp/x", gpu=False) == ("--xla_dump_to=/tmp/x", ())


def test_flags_the_user_set_keep_their_values():
  user = "--xla_gpu_enable_triton_gemm=true --xla_dump_to=/tmp/x"
  flags, added = accelerators.gpu_xla_flags(None, user, gpu=True)
  assert added == tuple(f for f in accelerators.GPU_TRAINING_XLA_FLAGS if "triton_gemm" not in f)
  assert flags == " ".join((user, *added))
  assert accelerators.gpu_xla_flags("none", user, gpu=True) == (user, ())


def test_a_flag_string_replaces_the_recommended_ones():
  choice = "--xla_gpu_enable_command_buffer= --xla_gpu_enable_latency_hiding_scheduler=false"
  assert accelerators.gpu_xla_flags(choice, "", gpu=True) == (choice, tuple(choice.split()))
  with pytest.raises(ValueError, match=r"--xla_gpu_flags: 'latency' is not an XLA flag; give flags as "
                                       r"--xla_NAME=VALUE separated by spaces, or 'none'"):
    accelerators.gpu_xla_flags("latency", "", gpu=False)


def test_flags_xla_does_not_know_are_refused_on_any_machine(monkeypatch):
  """A misspelt --xla_gpu_flags was accepted on a CPU, then aborted XLA as a GPU run started; XLA's own parser now
  reads them first (the tests' machine has no GPU), and a real GPU flag passes."""
  monkeypatch.setattr(accelerators, "local_gpu", lambda: False)
  monkeypatch.setenv("XLA_FLAGS", "")
  with pytest.raises(ValueError, match=r"^--xla_gpu_flags: --xla_nonexistent_flag=1: not a flag of this XLA \(jax "
                                       r"[\d.]+\), which would abort as the GPU backend starts; check the spelling"):
    accelerators.set_gpu_xla_flags("--xla_gpu_enable_latency_hiding_scheduler=true --xla_nonexistent_flag=1")
  assert accelerators.set_gpu_xla_flags("--xla_gpu_enable_latency_hiding_scheduler=true") == ()


def test_a_value_xla_cannot_read_is_refused():
  with pytest.raises(ValueError, match=r"XLA cannot read --xla_gpu_enable_latency_hiding_scheduler=maybe"):
    accelerators.check_xla_flags(["--xla_gpu_enable_latency_hiding_scheduler=maybe"])


def test_a_check_that_cannot_read_the_flags_warns_and_goes_on(monkeypatch):
  """A later jax whose process fails in other words leaves the flags unchecked: a warning, not an error."""
  monkeypatch.setattr(accelerators, "XLA_FLAGS_READER", "import sys; sys.exit('no such API')")
  warned = []
  monkeypatch.setattr(accelerators.logging, "warning", warned.append)
  accelerators.check_xla_flags(["--xla_nonexistent_flag=1"])
  assert warned == ["the XLA flags --xla_nonexistent_flag=1 were not checked (no such API); XLA reads them as JAX "
                    "starts."]


def test_a_gpu_needs_the_cuda_plugin_the_driver_and_platforms_that_allow_it(monkeypatch):
  """Decided without starting JAX's backend (the tests run on the CPU platform: no GPU)."""
  assert not accelerators.local_gpu()
  monkeypatch.setattr(accelerators.os.path, "exists", lambda path: path == "/proc/driver/nvidia/version")
  assert not accelerators.local_gpu()  # JAX_PLATFORMS=cpu
  platforms = jax.config.jax_platforms
  try:
    jax.config.update("jax_platforms", "cuda,cpu")
    plugin = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None  # the aot extra's
    assert accelerators.local_gpu() == plugin
    monkeypatch.setattr(accelerators, "_find_spec", lambda module: None)  # no CUDA plugin
    assert not accelerators.local_gpu()
  finally:
    jax.config.update("jax_platforms", platforms)


@pytest.mark.slow
def test_the_training_script_sets_and_logs_them_where_it_sees_a_gpu(tmp_path):
  """The script on a machine taken for one with a GPU (here the CPU backend, whose XLA knows the GPU flags too: an
  unknown one would abort the process) adds them to XLA_FLAGS before JAX starts, logs them, and keeps the user's."""
  config = tiny_config(tmp_path, steps=1, eval_every_steps=1)
  flags = [*script_flags(config, tmp_path / "run"), "--config.train.steps=1", "--config.train.eval_every_steps=1"]
  program = ("import runpy, sys; from retnet_jax.hardware import accelerators; accelerators.local_gpu = lambda: True; "
             f"sys.argv = ['scripts/train.py', *{flags!r}]; "
             "runpy.run_path('scripts/train.py', run_name='__main__')")
  result = run_python("-c", program, XLA_FLAGS="--xla_gpu_enable_triton_gemm=true")
  assert result.returncode == 0, result.stderr[-3000:]
  logged = [line for line in result.stderr.splitlines() if "XLA flags for the GPU" in line]
  expected = " ".join(f for f in accelerators.GPU_TRAINING_XLA_FLAGS if "triton_gemm" not in f)
  assert len(logged) == 1 and logged[0].endswith(f"(--xla_gpu_flags=none: without): {expected}"), logged
