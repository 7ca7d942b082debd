"""The GPU suite's compile part: compile time (ahead of time, not run) of the deep presets' train steps."""

from __future__ import annotations

from typing import Any

import jax

from benchmarks import cases
from benchmarks.gpu_train import suite_config, too_big
from benchmarks.harness import Budget
from benchmarks.report import fmt
from benchmarks.suites import GpuSuite
from retnet_jax.core import markdown, sharding
from retnet_jax.models import architectures, model_config


def measure_compile(suite: GpuSuite, limit: int | None, budget: Budget) -> dict[str, Any]:
  """Seconds to compile (ahead of time, not run) each deep preset's RetNet train step per implementation; one not
  started before `budget` is spent is skipped."""
  results: dict[str, Any] = {"models": {}, "skipped": {}}
  for name in suite.compile_models:
    for impl in suite.train_impls:
      config = suite_config(suite, name, impl)
      try:
        architectures.check_backend(model_config.of(config.model))
      except ValueError as e:
        results["skipped"][f"{name}/{impl}"] = str(e)
        continue
      if budget.spent():
        results["skipped"][f"{name}/{impl}"] = budget.reason
        continue
      print(f"compiling the {name} train step ({impl})", flush=True)
      jax.clear_caches()  # a step this process compiled before (the train part) would come from the cache
      compile_s, buffers = cases.compile_train_step(config, sharding.make_mesh(config.mesh, jax.devices()[:1]))
      results["models"][f"{name}/{impl}"] = {
          "params": cases.param_count(config.model), "num_layers": config.model.num_layers, "compile_s": compile_s,
          "compiled_bytes": buffers, "fits": too_big(buffers, limit) is None,
          "batch_size": config.train.batch_size, "seq_len": config.train.seq_len, "remat": config.train.remat}
  return results


def compile_markdown(results: dict[str, Any]) -> list[str]:
  """The compile part's table of compile times and XLA buffers, and skips."""
  lines = ["## Train-step compile times (compiled, not run)", ""]
  lines += markdown.table(
      ["model/impl", "parameters", "layers", "batch x tokens", "remat", "compile s", "XLA buffers"],
      [[name, f"{r['params']:,}", r["num_layers"], f"{r['batch_size']} x {r['seq_len']}", r["remat"],
        f"{r['compile_s']:.1f}", fmt(r["compiled_bytes"], "B")] for name, r in results["models"].items()])
  return lines + [f"Skipped: {name}: {reason.rstrip('.')}." for name, reason in results["skipped"].items()]
