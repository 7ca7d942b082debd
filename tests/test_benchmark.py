"""Benchmark support: the quick suite's results, the FLOP counter against a hand count."""

import dataclasses
import json
import re
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from benchmarks import harness, report
from configs import retnet as retnet_config
from retnet_jax.hardware import flops
from retnet_jax.models.model import Model
from tests.helpers import run_script


def test_flop_counter_matches_hand_count():
  """The `tiny` preset: d 32, 2 layers, 2 heads, d_v 64, FFN 64, vocab 256 (untied head), chunk 8."""
  cfg = retnet_config.get_config("tiny").model
  # Per layer: q, k 32x32 (2 x 1024); v, g 32x64 (2 x 2048); out 64x32 (2048); GLU fc1, gate 32x64, fc2 64x32
  # (3 x 2048): 2048 + 4096 + 2048 + 6144 = 14336. Two layers and the head 32x256 (8192): 36864.
  assert flops.matmul_params(cfg) == 2 * 14336 + 8192 == 36864
  # With one key/value head for the two query heads, k and v are half as wide (32x16 and 32x32): 1536 fewer per layer;
  # the count equals the model's projection and head kernels.
  cfg.num_kv_heads = 1
  kernels = [x for path, x in nnx.to_flat_state(nnx.state(Model(cfg, rngs=nnx.Rngs(0)), nnx.Param))
             if path[-1] == "kernel"]
  assert flops.matmul_params(cfg) == 36864 - 2 * 1536 == sum(x[...].size for x in kernels)
  cfg.num_kv_heads = None
  # Parallel at 16 tokens, per token and layer: scores 2 * 16 * 32 = 1024, scores @ V 2 * 16 * 64 = 2048.
  assert flops.mixing_flops_per_token(cfg, 16, "parallel") == 2 * (1024 + 2048)
  # Chunkwise: the same in a chunk of 8 (512 + 1024), plus per head (d_k 16, d_v 32) the state read q S and
  # the update k^T v, 2 * 16 * 32 each: 2 heads x 2048 = 4096.
  assert flops.mixing_flops_per_token(cfg, 16, "chunkwise") == 2 * (512 + 1024 + 4096)
  assert flops.mixing_flops_per_token(cfg, 16, "recurrent") == 2 * 4096
  # Training: forward (2 per multiply-add) + backward (twice the forward).
  assert flops.train_flops_per_token(cfg, 16, "parallel") == 3 * (2 * 36864 + 6144) == 239616
  assert flops.train_flops_per_token(cfg, 16, "chunkwise") == 3 * (2 * 36864 + 11264) == 254976
  # A hybrid whose layer 1 attends with 4 query heads and 2 key/value heads (head dim 8): q, o 32x32 (2 x 1024), k, v
  # 32x16 (2 x 512), the same GLU (6144): 9216 in place of 14336; it equals the model's kernels. Its attention
  # products at 16 tokens: 4 * 16 * 32 = 2048 per token; decoding with a window of 4 reads 4 keys: 4 * 4 * 32 = 512.
  cfg.update(attention_layers=(1,), attention_num_heads=4, attention_num_kv_heads=2, attention_window=4)
  kernels = [x for path, x in nnx.to_flat_state(nnx.state(Model(cfg, rngs=nnx.Rngs(0)), nnx.Param))
             if path[-1] == "kernel"]
  assert flops.matmul_params(cfg) == 14336 + 9216 + 8192 == sum(x[...].size for x in kernels)
  assert flops.forward_flops_per_token(cfg, 16, "parallel") == 2 * (14336 + 9216 + 8192) + 3072 + 2048
  assert flops.forward_flops_per_token(cfg, 16, "recurrent") == 2 * (14336 + 9216 + 8192) + 4096 + 512


EXPECTED_KEYS = {
    "meta": ["suite", "command", "date", "machine", "jax", "size", "params", "memory_source", "inference_devices",
             "total_s", "plots"],
    "ceilings": ["matmul_flops", "memory_read_bytes_per_s", "matmul_size", "read_array_bytes"],
    "training": [f"{model}/{form}/{dtype}" for dtype in ("float32", "bfloat16")
                 for model, form in (("retnet", "parallel"), ("retnet", "chunkwise"), ("transformer", "parallel"))]
                + ["gated/chunkwise/float32"],  # quick: gated retention's one train row
    "lengths": ["forward", "train", "forward_analysis", "train_analysis"],
    "decoding": ["throughput", "latency", "latency_ratio", "large_batch", "weight_read_floor_s",
                 "weight_read_floor_tokens_per_s", "batch_1_over_floor", "large_batch_flops_per_s",
                 "large_batch_fraction_of_matmul_ceiling"],
    "torchscale": ["available", "note", "ratios"],
    "long_training": ["seq_len", "segment_len", "whole", "segmented"],
}


class _FakeDevice:
  """A device whose memory statistics are `before` until the measured function sets them to `after`."""

  def __init__(self, before, after):
    self.stats, self.after = before, after

  def memory_stats(self):
    return self.stats


def test_device_peak_memory_sums_the_devices_a_case_runs_on(monkeypatch):
  """With device statistics (GPUs), a case on a 2-device mesh reports both devices' memory, not device 0's."""
  devices = [_FakeDevice({"bytes_in_use": 100}, {"bytes_in_use": 100, "peak_bytes_in_use": 400}),
             _FakeDevice({"bytes_in_use": 50}, {"bytes_in_use": 50, "peak_bytes_in_use": 300}),
             _FakeDevice({"bytes_in_use": 7}, {"bytes_in_use": 7, "peak_bytes_in_use": 9000})]  # not the case's

  def run():
    for device in devices:
      device.stats = device.after

  monkeypatch.setattr(harness.jax, "devices", lambda: devices)
  source = "device memory_stats peak_bytes_in_use"
  assert harness.peak_memory(run, source, devices=2) == {"peak_bytes": 700, "above_start_bytes": 550}
  for device, before in zip(devices, (100, 50, 7)):
    device.stats = {"bytes_in_use": before}
  assert harness.peak_memory(run, source) == {"peak_bytes": 400, "above_start_bytes": 300}


def test_table_ranges_share_the_median_unit():
  assert report.fmt_range({"median": 2.65e10, "min": 2.33e10, "max": 3.08e10}, "FLOP/s") == "26.5 GFLOP/s [23.3-30.8]"
  assert report.fmt_range({"median": 665, "min": 514, "max": 682}) == "665 [514-682]"


@pytest.mark.slow
@pytest.mark.parametrize("flags,message", [
    ("--seq_len=0", "flag --seq_len=0: 0 is not a positive integer"),
    ("--config.model.d_model=128", "--config.model.d_model: the suite sets these .* use --d_model"),
    ("--out=README.md", r"--out='README.md' is a file; choose a directory \(new or empty\)"),
    ("--point_budget_s=5", "--point_budget_s: only for --suite=context"),
    ("--suite=context --context_lengths=1024,1", r"--context_lengths=1024,1: give lengths of at least 2 tokens"),
    ("--suite=context --context_lengths=4k", r"--context_lengths=4k: give lengths of at least 2 tokens"),
    ("--suite=context --d_model=64", "--d_model: --suite=context builds its models from presets; choose its size "
                                     "with --context_size"),
])
def test_bad_flags_are_named(flags, message):
  proc = run_script("benchmark.py", *flags.split())
  assert proc.returncode != 0 and re.search(message, proc.stderr), proc.stderr[-3000:]


@pytest.mark.slow
def test_quick_suite_writes_every_result(tmp_path):
  """`scripts/benchmark.py --suite=quick` runs end to end and writes results.json with every expected key,
  results.md and the plots (the numbers themselves depend on the machine and are not checked)."""
  proc = run_script("benchmark.py", "--suite=quick", f"--out={tmp_path}", timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads((tmp_path / "results.json").read_text())
  for section, keys in EXPECTED_KEYS.items():
    assert set(keys) <= set(results[section]), (section, set(keys) - set(results[section]))
  for case in results["training"].values():
    assert {"tokens_per_s", "step_s", "compile_s", "memory", "compiled_bytes", "flops_per_token", "mfu"} <= set(case)
    assert {"median", "min", "max"} <= set(case["tokens_per_s"])
  assert {"retnet/parallel", "retnet/chunkwise", "transformer/parallel"} == set(results["lengths"]["forward"])
  assert {"retnet/parallel", "retnet/chunkwise"} == set(results["lengths"]["train"])
  for kind in ("forward", "train"):
    for points in results["lengths"][kind].values():
      assert all({"seq_len", "seconds", "memory", "compiled_bytes", "compile_s"} <= set(p) for p in points)
    assert {"crossover_seq_len", "time_growth_exponent"} <= set(results["lengths"][f"{kind}_analysis"])
  assert "compiled_bytes" in results["long_training"]["whole"]
  assert {"tokens_per_s", "step_s", "memory", "compiled_bytes"} <= set(results["long_training"]["segmented"])
  assert {"retnet/chunkwise/float32"} == set(results["document_resets"]["cases"])  # quick: one row
  assert all(r["ratio"] > 0 for r in results["document_resets"]["cases"].values())
  for model in ("retnet", "transformer", "hybrid"):
    assert {"batch_1", "batch_32"} <= set(results["decoding"]["throughput"][model])
    assert all({"context", "latency_s", "state_bytes"} <= set(p) for p in results["decoding"]["latency"][model])
  assert set(results["decoding"]["throughput"]["gated"]) == {"batch_1"}  # quick: gated retention's one decode row
  assert {name for name in results["training"] if name.startswith("gated/")} == {"gated/chunkwise/float32"}
  assert [t["target"] for t in results["targets"]] and all("met" in t for t in results["targets"])
  text = (tmp_path / "results.md").read_text()
  assert "## Training step" in text and "Gated retention over RetNet, decoding tokens/s: batch 1 " in text
  assert "over RetNet (`retnet/`, the same size), tokens/s: chunkwise/float32 " in text
  for name in results["meta"]["plots"]:
    assert (tmp_path / name).stat().st_size > 0


@pytest.mark.slow
def test_data_suite_measures_prepare_loader_step_and_memory(tmp_path):
  """`--suite=data` on a small corpus: every rate and the peak RSS of training from a prepared corpus."""
  proc = run_script("benchmark.py", "--suite=data", "--config=configs/retnet.py:tiny", "--data_mb=0.5",
                    "--memory_mb=0.5", f"--out={tmp_path}", timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads((tmp_path / "data.json").read_text())
  assert set(results["prepare"]) == {"byte_workers1", "bpe4096_workers1", "bpe4096_workers2"}
  assert all(r["tokens_per_sec"] > 0 for r in results["prepare"].values())
  assert results["prepare"]["byte_workers1"]["tokens"] > 400_000  # a token per byte of about 0.5 MB
  assert results["prepare"]["bpe4096_workers1"]["tokens"] == results["prepare"]["bpe4096_workers2"]["tokens"]
  assert results["loader"]["loader_tokens_per_sec"] > 0 and results["train_step"]["tokens_per_sec"] > 0
  assert results["memory"]["0.5MB"]["peak_rss_bytes"] > results["memory"]["0.5MB"]["corpus_bytes"] > 0
  assert "| loader, batch 64 x 2048" in (tmp_path / "data.md").read_text()


@pytest.mark.devices(8)
def test_sequence_suite_splits_one_sequence_over_devices(tmp_path):
  """The sequence suite at the quick size: per split, buffers per device falling with the split, the same first
  loss as on one device, and the JSON, table and plot written."""
  from benchmarks import sequence, suites
  sweep = suites.SequenceSweep(suite=suites.SUITES["quick"], splits=(1, 8), lengths=(256,),
                               compile_only_lengths=(1024,), rounds=1)
  results = sequence.run(retnet_config.get_config("small"), sweep, tmp_path, "test")
  run, compiled = results["run"], results["compiled_only"]
  assert [p["devices"] for p in run] == [1, 8] and [p["devices"] for p in compiled] == [1, 8]
  assert run[0]["buffer_fraction"] == 1 and run[1]["buffer_fraction"] < 0.5, run
  assert compiled[1]["buffer_fraction"] < 0.25, compiled
  assert run[1]["loss_rel_diff"] < 1e-5, run
  assert json.loads((tmp_path / "sequence_parallel.json").read_text())["meta"]["splits"] == [1, 8]
  assert "| 1,024 | 8 |" in (tmp_path / "sequence_parallel.md").read_text()
  assert (tmp_path / "sequence_parallel.png").stat().st_size > 0


def test_gpu_suite_flop_counts_and_fla_mapping():
  """The op's FLOP counts against hand counts, and our chunkwise form against fla's pure-PyTorch reference
  (`fla.ops.retention.naive`, loaded without fla's package, which needs Triton) in float32 under the mapping the
  suite times fla with: same [B, T, H, D] layout, fla's fixed decays = decay.log_decay('retnet'), no query scale."""
  import importlib.util

  import torch

  from retnet_jax.mixers import decay, retention
  from benchmarks import gpu_op, op
  # B 2, H 3, T 128, d_k 16, d_v 32, chunk 64: per head and token 2 * 64 * 48 + 4 * 16 * 32 = 8192 FLOPs.
  assert op.retention_op_flops(2, 3, 128, 16, 32, 64) == 2 * 3 * 128 * 8192
  # Causal attention: 2 * T^2 * d per head = 2 * 128^2 * 16 = 524288.
  assert op.attention_op_flops(2, 3, 128, 16) == 2 * 3 * 524288
  np.testing.assert_allclose(gpu_op.fla_log_decay(4), np.log([1 - 1 / 32, 1 - 1 / 64, 1 - 1 / 128, 1 - 1 / 256]),
                             rtol=1e-6)
  np.testing.assert_array_equal(gpu_op.fla_log_decay(8), decay.log_decay("retnet", 8))
  with pytest.raises(ValueError, match="fla's chunk_retention fixes log decays"):
    gpu_op.check_fla_mapping(decay.log_decay("logspace", 4))

  spec = importlib.util.find_spec("fla")
  if spec is None:
    pytest.skip("fla is not installed")
  path = Path(spec.submodule_search_locations[0]) / "ops" / "retention" / "naive.py"
  naive = importlib.util.spec_from_file_location("fla_naive_retention", path)
  module = importlib.util.module_from_spec(naive)
  naive.loader.exec_module(module)
  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal((2, 40, 3, d)).astype(np.float32) for d in (16, 16, 32))
  log_decay = gpu_op.fla_log_decay(3)
  gpu_op.check_fla_mapping(log_decay)
  with jax.default_matmul_precision("highest"):
    ours, _ = retention.chunkwise_retention(jnp.asarray(q) * 16**-0.5, k, v, log_decay, 16)  # naive scales q
  head_first = lambda x: torch.from_numpy(x).transpose(1, 2)
  theirs = module.naive_retention(head_first(q), head_first(k), head_first(v)).transpose(1, 2).numpy()
  np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.cpu_only("on a GPU the parts skipped here (Pallas, cuDNN) run, and no reason names the CPU")
def test_gpu_suite_runs_tiny_on_cpu(tmp_path):
  """Every part of `--suite=gpu` at the tiny sizes on the CPU: what runs here is measured, what needs a GPU (Pallas,
  cuDNN, fla) is recorded as skipped with its reason; each part's JSON and table are written."""
  from benchmarks import gpu, suites
  from benchmarks.op import retention_op_flops
  suite = suites.GPU_SUITES["tiny"]
  written = gpu.run(suite, "tiny", gpu.PARTS, tmp_path, "test")
  assert set(written) == {"gpu_op_16x32", "gpu_train_tiny", "gpu_decode", "gpu_compile", "gpu_run"}
  assert set(written["gpu_run"]["seconds"]) == set(written) - {"gpu_run"} and not written["gpu_run"]["skipped"]
  for stem, document in written.items():
    assert json.loads((tmp_path / f"{stem}.json").read_text())["meta"]["part"] == document["meta"]["part"]
    assert (tmp_path / f"{stem}.md").read_text().startswith("# GPU suite")
  op = written["gpu_op_16x32"]
  assert {"device", "versions", "command", "flop_counts"} <= set(op["meta"]) and op["meta"]["versions"]["jax"]
  assert set(op["skipped"]) == {"pallas", "cudnn_attention", "fla"}
  assert "GPUs only" in op["skipped"]["pallas"] and "CUDA GPU" in op["skipped"]["fla"]
  assert op["agreement"]["ok"] == {"xla": True}
  (point,) = op["points"]
  assert set(point["cases"]) == {"xla/forward", "xla/forward_backward"}
  forward, both = point["cases"]["xla/forward"], point["cases"]["xla/forward_backward"]
  assert forward["flops"] == retention_op_flops(1, 2, 32, 16, 32, 16) and both["flops"] == 3 * forward["flops"]
  assert forward["tflops_per_s"] == pytest.approx(forward["flops"] / forward["seconds"]["median"] / 1e12)
  assert (tmp_path / "gpu_op_16x32.png").stat().st_size > 0
  train = written["gpu_train_tiny"]  # each case measured in its own process
  assert set(train["cases"]) == {"retnet/xla", "transformer"} and "GPUs only" in train["skipped"]["retnet/pallas"]
  for case in train["cases"].values():  # MFU against the GEMM timed in the case's process
    assert case["mfu"] == pytest.approx(case["tokens_per_s"]["median"] * case["flops_per_token"]
                                        / case["bfloat16_gemm_flops_per_s"]["median"])
    assert 0 <= case["float32_matmul_share"] <= 1 and sum(case["matmul_flops_by_dtype"].values()) > 0
    assert case["memory"]["peak_bytes"] > 0
  assert "| MFU | f32-operand matmul share |" in (tmp_path / "gpu_train_tiny.md").read_text()
  decode = written["gpu_decode"]
  assert decode["param_bytes"] == 4 * decode["params"] and 0 < decode["batch_1_over_floor"]
  (context,) = decode["contexts"]
  assert context["retnet"]["batch"] == context["transformer"]["batch"] == 1 and context["throughput_ratio"] > 0
  # KV cache of 32 context + 4 new slots: 2 (key, value) x 1 layer x 36 x 32 (d_model) x 2 bytes (bfloat16), and
  # the int32 position and next slot.
  assert context["transformer"]["state_bytes"] == 2 * 36 * 32 * 2 + 4 + 4
  assert set(written["gpu_compile"]["models"]) == {"tiny/xla"}
  assert written["gpu_compile"]["models"]["tiny/xla"]["compile_s"] > 0.05


def _in_process(monkeypatch):
  """Runs the GPU suite's train cases in this process, so that monkeypatches reach them."""
  from benchmarks import gpu_train
  monkeypatch.setattr(gpu_train, "isolated", lambda fn, *args, timeout=None: fn(*args))


class _FakeCompiled:
  """A step function standing for a compiled step: called as it is, with XLA's memory analysis of 1000 bytes."""

  def __init__(self, step):
    self.step = step

  def __call__(self, *args):
    return self.step(*args)

  def memory_analysis(self):
    sizes = dict(argument_size_in_bytes=1000, output_size_in_bytes=0, temp_size_in_bytes=0, alias_size_in_bytes=0,
                 generated_code_size_in_bytes=0)
    return types.SimpleNamespace(**sizes)


def _fake_compile(steps):
  """A `compile_timed` that compiles nothing: each call takes the next of `steps`, an error to raise or a step."""
  def compile_timed(fn, *args):
    del fn, args
    step = steps.pop(0)
    if isinstance(step, Exception):
      raise step
    return _FakeCompiled(step), 0.01, 1000
  return compile_timed


def test_gpu_train_out_of_memory_is_skipped_with_the_failed_allocation(tmp_path, monkeypatch):
  """An out-of-memory of a train case's compile or run (the error a GPU raises) is recorded as skipped with the
  allocation that failed, and the part goes on with the next case and writes its files."""
  from benchmarks import gpu, gpu_train, suites
  oom = lambda n: jax.errors.JaxRuntimeError(f"RESOURCE_EXHAUSTED: Out of memory while trying to allocate {n} bytes.")

  def step_out_of_memory(state, batch):
    raise oom(61203283968)

  _in_process(monkeypatch)
  monkeypatch.setattr(gpu_train, "compile_timed", _fake_compile([oom(49283072000), step_out_of_memory]))
  written = gpu.run(suites.GPU_SUITES["tiny"], "tiny", ("train",), tmp_path, "test")
  train = json.loads((tmp_path / "gpu_train_tiny.json").read_text())
  assert train == json.loads(json.dumps(written["gpu_train_tiny"])) and not train["cases"]
  assert train["skipped"]["retnet/xla"] == "out of memory: 45.9 GiB"  # compiling
  assert train["skipped"]["transformer"] == "out of memory: 57.0 GiB"  # running
  assert "Skipped: retnet/xla: out of memory: 45.9 GiB." in (tmp_path / "gpu_train_tiny.md").read_text()
  assert harness.out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: Failed to allocate request for 45.90GiB "
                                            "(49283072000B) on device ordinal 0")) == "out of memory: 45.9 GiB"
  assert harness.out_of_memory(RuntimeError("Out of memory allocating 12.5GiB")) == "out of memory: 12.5GiB"
  assert harness.out_of_memory(ValueError("INVALID_ARGUMENT: 49283072000 bytes")) is None


def test_gpu_time_budget_ends_a_run_keeping_what_it_measured(tmp_path, monkeypatch):
  """A budget spent during the first train case's warm-up: that case is kept with the one round timed, the next
  case and the next part are recorded as skipped for the time budget, and the files are written."""
  from benchmarks import gpu, gpu_train, suites
  budget = harness.Budget(3600)

  def step_spending_the_budget(state, batch):
    budget.seconds = 0.0
    return state, None

  _in_process(monkeypatch)
  monkeypatch.setattr(gpu_train, "compile_timed", _fake_compile([step_spending_the_budget]))
  suite = dataclasses.replace(suites.GPU_SUITES["tiny"], rounds=3)
  written = gpu.run(suite, "tiny", ("train", "compile"), tmp_path, "test", budget)
  train, summary = written["gpu_train_tiny"], written["gpu_run"]
  assert set(train["cases"]) == {"retnet/xla"} and train["skipped"]["transformer"].startswith("time budget")
  assert train["cases"]["retnet/xla"]["step_s"]["runs"] == 1  # of 3 rounds: the budget was spent
  assert set(summary["seconds"]) == {"gpu_train_tiny"} and summary["skipped"]["gpu_compile"].startswith("time budget")
  assert json.loads((tmp_path / "gpu_run.json").read_text())["skipped"] == summary["skipped"]
  assert "- gpu_compile: skipped: time budget" in (tmp_path / "gpu_run.md").read_text()
  assert not (tmp_path / "gpu_compile.json").exists()


def test_isolated_runs_in_its_own_process():
  """`harness.isolated`: the value from a fresh process, its error with the traceback, a process that dies or runs
  past its timeout."""
  import os
  import time
  assert harness.isolated(os.getpid) != os.getpid()
  with pytest.raises(RuntimeError, match="ValueError: invalid literal"):
    harness.isolated(int, "x")
  with pytest.raises(RuntimeError, match="exit code 3"):
    harness.isolated(os._exit, 3)
  with pytest.raises(TimeoutError):
    harness.isolated(time.sleep, 60, timeout=0.5)


def test_kernel_check_and_gpu_op_part_share_the_op_measure(tmp_path):
  """The kernel check and the GPU suite's op part draw the same bfloat16 inputs, measure errors alike (in float64: a
  difference that float32 rounds away still counts) and count FLOPs alike; the kernel check runs in interpret mode
  on the CPU and writes its JSON report."""
  from benchmarks import kernel_check, op
  q, k, v, d_out = op.op_inputs(1, 8, 2, 16, 32)
  q_attention, k_attention, v_attention, _ = op.op_inputs(1, 8, 2, 16, 16)
  assert {x.dtype for x in (q, k, v, d_out)} == {jnp.dtype(jnp.bfloat16)}
  assert q.shape == k.shape == (1, 8, 2, 16) and v.shape == d_out.shape == (1, 8, 2, 32)
  assert v_attention.shape == (1, 8, 2, 16)
  np.testing.assert_array_equal(q, q_attention)
  np.testing.assert_array_equal(k, k_attention)
  reference = np.array([1.0, -2.0])
  assert op.relative_error(reference + [1e-9, 0.0], reference) == pytest.approx(5e-10)
  assert op.kind_flops(10, "forward") == 10 and op.kind_flops(10, "forward_backward") == 30

  settings = kernel_check.Settings(batch=1, heads=2, chunk=16, head_dims=((16, 32),), lengths=(32,), check_max_len=32,
                                   rounds=1, repeats=1)
  report = kernel_check.run(settings, [], [], interpret=True, out=tmp_path / "kernel_check.json")
  assert json.loads((tmp_path / "kernel_check.json").read_text()) == json.loads(json.dumps(report))
  assert {"device", "backend", "jax", "python", "batch", "heads", "chunk", "dtype", "interpret", "tolerance",
          "settings", "cases"} == set(report) and report["tolerance"] == op.TOLERANCE
  (case,) = report["cases"]
  assert case["errors"]["ok"]
  for layout in ("split", "fused"):
    assert set(case["errors"][layout]) == {"out", "state", "dq", "dk", "dv", "d_state", "qz", "key_sum"}
  assert set(case["times"]) == {"xla/forward", "xla/forward_backward", "pallas_split_32:8:2/forward",
                                "pallas_split_32:8:2/forward_backward", "pallas_fused_32:8:2/forward",
                                "pallas_fused_32:8:2/forward_backward"}
  assert case["launch_grids"]["split"]["split/output"] == {"programs": 2 * 2, "serial_steps": 1}  # 2 chunks, 2 heads
  assert case["launch_grids"]["fused"]["fused/forward"] == {"programs": 2, "serial_steps": 2}
  forward = op.retention_op_flops(1, 2, 32, 16, 32, 16)
  for name, times in case["times"].items():
    assert times["tflops"] == pytest.approx(op.kind_flops(forward, name.split("/")[1]) / times["seconds"]["median"]
                                            / 1e12)


def test_decoding_target_without_torchscale_is_not_measured():
  """The decoding target against torchscale divides by torchscale's decoding in the same run; without it the target
  is reported as not measured (value and met None), not compared with a figure from another machine."""
  from benchmarks import sections
  results = {
      "training": {"retnet/parallel/float32": {"mfu": 0.8}, "retnet/chunkwise/float32": {"mfu": 0.7}},
      "decoding": {"throughput": {"retnet": {"batch_1": {"median": 100.0}}}, "batch_1_over_floor": 0.6,
                   "latency_ratio": {"retnet": 1.0}},
      "long_training": {"seq_len": 256, "segment_len": 64, "segmented": {"memory": {"peak_bytes": 1e9}}},
      "lengths": {"forward": {"retnet/chunkwise": [{"seq_len": 64, "seconds": {"median": 0.01}}]},
                  "forward_analysis": {"compiled_bytes_growth_exponent": {"retnet/chunkwise": 1.0}}}}
  (target,) = [t for t in sections.check_targets(results) if "torchscale" in t["target"]]
  assert target == {"target": "decoding batch 1 >= 6 x torchscale (torchscale not measured)", "value": None,
                    "met": None}
  results["decoding"]["throughput"]["torchscale"] = {"batch_1": {"median": 20.0}}
  (target,) = [t for t in sections.check_targets(results) if "torchscale" in t["target"]]
  assert target == {"target": "decoding batch 1 >= 6 x torchscale (20.0 tok/s)", "value": 5.0, "met": False}
  assert all(t["met"] is not None for t in sections.check_targets(results))
