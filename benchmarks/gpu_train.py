"""The GPU suite's train part: the training loop's own step (`train_step.setup`) of each named size per retention
implementation and the Transformer of equal size, bfloat16 compute, float32 parameters; tokens/s and MFU against a
bfloat16 GEMM, and the share of the step's matmul FLOPs with a float32 operand (`matmul_dtypes.report`).

Each case runs alone in a fresh process (`harness.isolated`): no other case's buffers share the device, so its peak
memory is its own (the device's running peak cannot be reset within a process), and its GEMM is timed there,
alternated with its steps. A step the runtime cannot allocate is recorded as skipped with the allocation that failed.
Also the named sizes' configs and the device-memory check the other parts use."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks import cases
from benchmarks.harness import (Budget, compile_timed, interleave, isolated, memory_source, out_of_memory,
                                random_tokens, rate)
from benchmarks.report import fmt, fmt_range
from benchmarks.suites import GpuSuite
from retnet_jax.core import markdown, sharding
from retnet_jax.hardware import accelerators, flops, matmul_dtypes
from retnet_jax.models import architectures, model_config, presets
from retnet_jax.training import run_config, train_step

GRACE_S = 10.0  # a case's process is ended this long after the time budget is spent (its rounds stop before it)
# The RetNet implementations a train case names (`GpuSuite.train_impls`): (model.retention_impl, model.kernel_layout).
IMPLS = {"xla": ("xla", "split"), "pallas": ("pallas", "split"), "pallas_fused": ("pallas", "fused")}


def suite_config(suite: GpuSuite, name: str, impl: str = "xla"):
  """The locked config of named size `name`: bfloat16 compute, implementation `impl` (of IMPLS) at its retention
  implementation's chunk, and the suite's chunkwise training shape for that size."""
  if impl not in IMPLS:
    raise ValueError(f"train implementation {impl!r}: choose one of {list(IMPLS)}.")
  retention_impl, layout = IMPLS[impl]
  preset, fields = suite.models[name]
  config = presets.get_config(preset)
  config.model.update(dict(fields))
  config.model.update(dict(dtype="bfloat16", retention_impl=retention_impl, kernel_layout=layout,
                           chunk_size=suite.chunk_sizes[retention_impl]))
  config.train.update(dict(mode="chunkwise", seq_len=suite.train_seq_len, batch_size=suite.train_batch[name],
                           grad_accum_steps=1, remat=suite.train_remat[name]))
  return config


def too_big(buffers: int | None, limit: int | None) -> str | None:
  """Why a program of `buffers` XLA buffer bytes is not run on a device of `limit` bytes, or None where it fits."""
  if buffers is not None and limit is not None and buffers > limit:
    return (f"its XLA buffers ({fmt(buffers, 'B')}) exceed the device's memory ({fmt(limit, 'B')}): lower the "
            "batch (--batch_size) or recompute more (--remat)")
  return None


def _train_step(config, case: str, mesh) -> tuple[Any, Any, Any, Callable[[], Any], contextlib.AbstractContextManager]:
  """Train case `case` ("retnet/<impl>" or "transformer"): (the jitted step, the state to trace and compile it for,
  a batch, a function giving the initial state, the context it is built in). RetNet's compiles from its abstract
  state, so nothing is allocated for a step that does not fit."""
  if case == "transformer":
    step_fn, state, batch = cases.transformer_train_step(config)
    return step_fn, state, batch, lambda: state, contextlib.nullcontext()
  run = train_step.setup(run_config.build(config), mesh)
  with run.placement.active():
    tokens = random_tokens(config.train.batch_size, config.train.seq_len + 1, config.model.vocab_size)
    batch = jax.device_put(tokens, run.placement.batch_sharding)
  return run.train_step, run.abstract_state, batch, run.init, run.placement.active()


def _case_config(suite: GpuSuite, name: str, case: str):
  """The config of train case `case` of named size `name` (the Transformer's: RetNet's, trained in parallel)."""
  if case == "transformer":
    config = suite_config(suite, name)
    config.train.mode = "parallel"  # the Transformer's one training form
    return config
  return suite_config(suite, name, case.split("/", 1)[1])


def measure_case(suite: GpuSuite, name: str, case: str, limit: int | None, budget: Budget) -> dict[str, Any]:
  """Train case `case` of named size `name`, alone in this process: its matmul FLOPs by operand dtype (traced),
  compile, a warm-up run (peak memory, before the GEMM allocates), then rounds alternating a step with the bfloat16
  GEMM its MFU divides by. {"skipped": reason} where its XLA buffers exceed `limit` or the runtime runs out of
  memory compiling or running it."""
  config = _case_config(suite, name, case)
  batch_size, seq_len = config.train.batch_size, config.train.seq_len
  model_cfg = presets.transformer_config(config.model, seq_len) if case == "transformer" else config.model
  mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
  try:
    step_fn, state, batch, init, context = _train_step(config, case, mesh)
    with context:
      shares = matmul_dtypes.report(step_fn, state, batch)
      step, compile_s, buffers = compile_timed(step_fn, state, batch)
      if reason := too_big(buffers, limit):
        return {"skipped": reason}
      timed_cases = {case: cases.train_case(step, init(), batch, compile_s, buffers),
                     "matmul/bfloat16": cases.matmul_case(jnp.bfloat16, suite.matmul_size)}
    stats = jax.devices()[0].memory_stats()
    interleave(timed_cases, suite.rounds, memory_source(), budget)
  except Exception as error:  # pylint: disable=broad-except  (an out of memory is a result; anything else is raised)
    if reason := out_of_memory(error):
      return {"skipped": reason}
    raise
  info = timed_cases[case].info
  gemm = rate(2 * suite.matmul_size**3, timed_cases["matmul/bfloat16"].info["seconds"])
  per_token = flops.train_flops_per_token(model_cfg, seq_len, "chunkwise")
  throughput = rate(batch_size * seq_len, info["seconds"])
  chip = accelerators.chip_of(jax.devices()[0].device_kind)
  peak = chip.peak_bf16_flops if chip else None
  return {"tokens_per_s": throughput, "step_s": info["seconds"], "compile_s": compile_s,
          "first_run_s": info["first_run_s"], "memory": info["memory"],
          "peak_bytes_before_step": stats.get("peak_bytes_in_use") if stats else None, "compiled_bytes": buffers,
          "plan_required_bytes": accelerators.required_bytes(accelerators.memory_sizes(step)),
          "chunk_size": model_cfg.get("chunk_size"), "flops_per_token": per_token, "bfloat16_gemm_flops_per_s": gemm,
          "mfu": throughput["median"] * per_token / gemm["median"], "chip_peak_bf16_flops": peak,
          "mfu_of_peak": None if peak is None else throughput["median"] * per_token / peak, **shares}


def _device_bytes_held() -> int | None:
  """Device memory this process holds (its allocator's pool, else what is in use); None where none is reported."""
  stats = jax.devices()[0].memory_stats()
  return stats.get("pool_bytes", stats.get("bytes_in_use")) if stats else None


def _measure_alone(suite: GpuSuite, name: str, case: str, limit: int | None, budget: Budget) -> dict[str, Any]:
  """`measure_case` in a fresh process; {"skipped": reason} where the backend cannot run the case, `budget` is spent
  before it starts, or it is still running when the budget (and `GRACE_S` more) is spent (its process is ended)."""
  try:
    architectures.check_backend(model_config.of(_case_config(suite, name, case).model))
  except ValueError as e:
    return {"skipped": str(e)}
  if budget.spent():
    return {"skipped": budget.reason}
  print(f"train {name} {case}: batch {suite.train_batch[name]} x {suite.train_seq_len} tokens, in its own process",
        flush=True)
  try:
    return isolated(measure_case, suite, name, case, limit, budget,
                    timeout=None if budget.seconds is None else budget.left() + GRACE_S)
  except TimeoutError:
    return {"skipped": f"time budget: ended while compiling or measuring ({budget.label}={budget.seconds:g})"}


def measure_train(suite: GpuSuite, name: str, limit: int | None, budget: Budget,
                  write: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
  """Train steps of named size `name` (RetNet per implementation, the Transformer of equal size), each measured
  alone in a fresh process (`_measure_alone`); `write(results)` after each."""
  config = suite_config(suite, name)
  results: dict[str, Any] = {
      "model": name, "preset": suite.models[name][0], "params": cases.param_count(config.model),
      "batch_size": suite.train_batch[name], "seq_len": suite.train_seq_len, "remat": suite.train_remat[name],
      "matmul_size": suite.matmul_size, "suite_process_device_bytes": _device_bytes_held(), "cases": {},
      "skipped": {}}
  for case in [f"retnet/{impl}" for impl in suite.train_impls] + ["transformer"]:
    measured = _measure_alone(suite, name, case, limit, budget)
    if "skipped" in measured:
      results["skipped"][case] = measured["skipped"]
    else:
      results["cases"][case] = measured
    write(results)
  return results


def train_markdown(results: dict[str, Any]) -> list[str]:
  """The train part's table of one named size (tokens/s, step time, memory, MFU, float32-operand share) and skips."""
  held = results["suite_process_device_bytes"]
  lines = [f"## Training step, {results['model']} ({results['params']:,} RetNet parameters)", "",
           f"Batch {results['batch_size']} x {results['seq_len']} tokens, bfloat16 compute, float32 parameters, "
           f"train.remat={results['remat']}. Each case alone in a fresh process (its peak memory is its own), its MFU "
           f"against a bfloat16 GEMM ({results['matmul_size']}^2) timed alternately with its steps there"
           + (f"; the suite's own process held {fmt(held, 'B')} of device memory meanwhile." if held else ".")
           + " f32-operand matmul share: the step's matmul FLOPs with a float32 operand (traced). AOT plan: the "
           "memory `planning.aot` counts for the step as compiled here (XLA's buffers and generated code); MFU of "
           "peak: against the chip's vendor bf16 peak (`hardware.accelerators`).", ""]
  percent = lambda x: "-" if x is None else f"{x:.1%}"
  lines += markdown.table(
      ["model", "tokens/s", "step s", "compile s", "peak memory", "XLA buffers", "AOT plan", "bf16 GEMM",
       "MFU of peak", "MFU", "f32-operand matmul share"],
      [[name, fmt_range(r["tokens_per_s"]), fmt_range(r["step_s"]), fmt(r["compile_s"]),
        fmt(r["memory"]["peak_bytes"], "B"), fmt(r["compiled_bytes"], "B"), fmt(r.get("plan_required_bytes"), "B"),
        fmt_range(r["bfloat16_gemm_flops_per_s"], "FLOP/s"), percent(r.get("mfu_of_peak")), f"{r['mfu']:.1%}",
        f"{r['float32_matmul_share']:.1%}"]
       for name, r in results["cases"].items()])
  return lines + [f"Skipped: {name}: {reason.rstrip('.')}." for name, reason in results["skipped"].items()]
