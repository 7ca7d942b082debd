"""The GPU suite's train part: the training loop's own step (`train_step.setup`) of each named size per retention
implementation and the Transformer of equal size, bfloat16 compute, float32 parameters; tokens/s and MFU against a
bfloat16 GEMM timed alongside. Also the named sizes' configs and the device-memory check the other parts use."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from retnet_jax import flops, layers, presets, sharding, train_step
from retnet_jax.bench import cases
from retnet_jax.bench.harness import Case, compile_timed, interleave, random_tokens, rate, timed
from retnet_jax.bench.report import fmt, fmt_range
from retnet_jax.bench.suites import GpuSuite


def model_config(suite: GpuSuite, name: str, impl: str = "xla"):
  """The locked config of named size `name`: bfloat16 compute, `retention_impl=impl` at its chunk, and the suite's
  chunkwise training shape for that size."""
  preset, fields = suite.models[name]
  config = presets.get_config(preset)
  config.model.update(dict(fields))
  config.model.update(dict(dtype="bfloat16", retention_impl=impl, chunk_size=suite.chunk_sizes[impl]))
  config.train.update(dict(mode="chunkwise", seq_len=suite.train_seq_len, batch_size=suite.train_batch[name],
                           grad_accum_steps=1, remat=suite.train_remat[name]))
  return config


def too_big(buffers: int | None, limit: int | None) -> str | None:
  """Why a program of `buffers` XLA buffer bytes is not run on a device of `limit` bytes, or None where it fits."""
  if buffers is not None and limit is not None and buffers > limit:
    return (f"its XLA buffers ({fmt(buffers, 'B')}) exceed the device's memory ({fmt(limit, 'B')}): lower the "
            "batch (--batch_size) or recompute more (--remat)")
  return None


def _retnet_train_cases(suite: GpuSuite, name: str, mesh, limit: int | None, skipped: dict[str, str]
                        ) -> dict[str, Case]:
  """The RetNet train step per retention implementation, compiled ahead of time from the abstract state (nothing
  allocated for a step that does not fit); the steps share one train state, as they share its structure."""
  holder: dict[str, Any] = {}
  found = {}
  for impl in suite.train_impls:
    config = model_config(suite, name, impl)
    try:
      layers.check_retention_impl(config.model)
    except ValueError as e:
      skipped[f"retnet/{impl}"] = str(e)
      continue
    run = train_step.setup(config, mesh)
    with run.placement.active():
      tokens = random_tokens(config.train.batch_size, config.train.seq_len + 1, config.model.vocab_size)
      batch = jax.device_put(tokens, run.placement.batch_sharding)
      step, compile_s, buffers = compile_timed(run.train_step, run.abstract_state, batch)
      if reason := too_big(buffers, limit):
        skipped[f"retnet/{impl}"] = reason
        continue
      if "state" not in holder:
        holder["state"] = run.init()

    def one_step(step=step, batch=batch):
      holder["state"], _ = step(holder["state"], batch)
      jax.block_until_ready(holder["state"])

    found[f"retnet/{impl}"] = Case(timed(one_step), {"compile_s": compile_s, "compiled_bytes": buffers,
                                                     "model_config": config.model})
  return found


def measure_train(suite: GpuSuite, name: str, source: str, limit: int | None) -> dict[str, Any]:
  """Train steps of named size `name` (RetNet per implementation, the Transformer of equal size) interleaved with
  the bfloat16 GEMM their MFU is divided by."""
  skipped: dict[str, str] = {}
  mesh = sharding.make_mesh(model_config(suite, name).mesh, jax.devices()[:1])
  train_cases = {"matmul/bfloat16": cases.matmul_case(jnp.bfloat16, suite.matmul_size)}
  train_cases.update(_retnet_train_cases(suite, name, mesh, limit, skipped))
  config = model_config(suite, name)
  config.train.mode = "parallel"  # the Transformer's one training form
  attention = cases.transformer_train_case(config, mesh)
  attention.info["model_config"] = presets.transformer_config(config.model, suite.train_seq_len)
  if reason := too_big(attention.info["compiled_bytes"], limit):
    skipped["transformer"] = reason
  else:
    train_cases["transformer"] = attention
  del attention
  batch, seq_len = suite.train_batch[name], suite.train_seq_len
  print(f"train {name}: {', '.join(train_cases)}; batch {batch} x {seq_len} tokens", flush=True)
  interleave(train_cases, suite.rounds, source)
  gemm = rate(2 * suite.matmul_size**3, train_cases.pop("matmul/bfloat16").info["seconds"])
  results: dict[str, Any] = {
      "model": name, "preset": suite.models[name][0], "params": cases.param_count(config.model), "batch_size": batch,
      "seq_len": seq_len, "remat": suite.train_remat[name], "matmul_size": suite.matmul_size,
      "bfloat16_gemm_flops_per_s": gemm, "cases": {}, "skipped": skipped}
  for case_name, case in train_cases.items():
    model_cfg = case.info["model_config"]
    per_token = flops.train_flops_per_token(model_cfg, seq_len, "chunkwise")
    throughput = rate(batch * seq_len, case.info["seconds"])
    results["cases"][case_name] = {
        "tokens_per_s": throughput, "step_s": case.info["seconds"], "compile_s": case.info["compile_s"],
        "first_run_s": case.info["first_run_s"], "memory": case.info["memory"],
        "compiled_bytes": case.info["compiled_bytes"], "chunk_size": model_cfg.get("chunk_size"),
        "flops_per_token": per_token, "mfu": throughput["median"] * per_token / gemm["median"]}
  return results


def train_markdown(results: dict[str, Any]) -> list[str]:
  """The train part's table of one named size (tokens/s, step time, memory, MFU) and skips."""
  lines = [f"## Training step, {results['model']} ({results['params']:,} RetNet parameters)", "",
           f"Batch {results['batch_size']} x {results['seq_len']} tokens, bfloat16 compute, float32 parameters, "
           f"train.remat={results['remat']}; bfloat16 GEMM ({results['matmul_size']}^2) "
           f"{fmt_range(results['bfloat16_gemm_flops_per_s'], 'FLOP/s')}.", "",
           "| model | tokens/s | step s | compile s | peak memory | XLA buffers | MFU |",
           "|---|---|---|---|---|---|---|"]
  for name, r in results["cases"].items():
    lines.append(f"| {name} | {fmt_range(r['tokens_per_s'])} | {fmt_range(r['step_s'])} | {fmt(r['compile_s'])} | "
                 f"{fmt(r['memory']['peak_bytes'], 'B')} | {fmt(r['compiled_bytes'], 'B')} | {r['mfu']:.1%} |")
  return lines + [f"Skipped: {name}: {reason.rstrip('.')}." for name, reason in results["skipped"].items()]
