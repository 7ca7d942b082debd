"""The GPU suite's decode part: greedy `Sampler.decode` at batch 1 (ms/token against parameter bytes, in
`GpuSuite.decode_param_dtype`, / a read bandwidth measured alongside), at a large batch after long contexts, against
the Transformer's KV cache at the largest batch it fits, and the context suite's curve at batch 1 (XLA's memory of
the prefill, decoding tokens/s, RetNet against the Transformer; `benchmarks.context` on a CPU)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks import cases
from benchmarks.gpu_train import suite_config
from benchmarks.harness import Budget, Case, interleave, rate
from benchmarks.report import fmt, fmt_range
from benchmarks.suites import GpuSuite
from retnet_jax.core import markdown
from retnet_jax.evaluation import sampling
from retnet_jax.hardware import accelerators
from retnet_jax.models import presets
from retnet_jax.models.model import Model


def _context_decode_case(model, batch: int, context: int, new_tokens: int) -> Case:
  """`cases.decode_from` a state `context` tokens in that holds zeros (`cases.zero_state`: a prefill of this batch and
  length would not fit the device), with its batch in the info."""
  case = cases.decode_from(model, sampling.Sampler(), cases.zero_state(model, batch, context, new_tokens), new_tokens)
  case.info["batch"] = batch
  return case


def _cache_bytes(model, batch: int, max_len: int) -> int:
  shapes = jax.eval_shape(lambda: model.init_state(batch, max_len))
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def measure_decode(suite: GpuSuite, source: str, limit: int | None, budget: Budget) -> dict[str, Any]:
  """Batch 1 against the weight-read floor, then per context RetNet at `decode_batch` against the Transformer at the
  largest power-of-two batch up to it whose KV cache fits a third of the device's memory (decoding holds it twice:
  the state passed in and the loop's updated copy). A context not started before `budget` is spent is skipped."""
  config = suite_config(suite, suite.decode_model)
  config.model.param_dtype = suite.decode_param_dtype
  retnet = Model(config.model, rngs=nnx.Rngs(config.seed))
  # Its KV caches are made per context (`_context_decode_case`): max_len is unused.
  attention = Model(presets.transformer_config(config.model, 1), rngs=nnx.Rngs(config.seed))
  params = cases.param_count(config.model)
  param_bytes = jnp.dtype(suite.decode_param_dtype).itemsize * params  # as stored and read
  new = suite.decode_new_tokens
  batch_1 = {"memory_read": cases.read_case(param_bytes // 4),
             "retnet": cases.decode_case(retnet, 1, suite.decode_prompt_len, new, "chunkwise")}
  print(f"decode {suite.decode_model} batch 1 after {suite.decode_prompt_len} tokens", flush=True)
  interleave(batch_1, suite.rounds, source, budget)
  read = rate(param_bytes, batch_1["memory_read"].info["seconds"])
  ours = batch_1["retnet"].info
  floor_s = param_bytes / read["median"]
  results: dict[str, Any] = {
      "model": suite.decode_model, "params": params, "param_dtype": suite.decode_param_dtype,
      "param_bytes": param_bytes, "new_tokens": new,
      "prompt_len": suite.decode_prompt_len, "read_bytes_per_s": read, "weight_read_floor_s": floor_s,
      "batch_1": {"s_per_token": ours["seconds"], "state_bytes": ours["state_bytes"], "memory": ours["memory"]},
      "batch_1_over_floor": floor_s / ours["seconds"]["median"], "contexts": [], "skipped": {}}
  del batch_1
  cache_budget = None if limit is None else limit // 3
  for context in suite.decode_contexts:
    if budget.spent():
      results["skipped"][f"context {context}"] = budget.reason
      continue
    batch = suite.decode_batch
    while batch > 1 and cache_budget is not None and _cache_bytes(attention, batch, context + new) > cache_budget:
      batch //= 2
    point: dict[str, Any] = {"context": context, "transformer_cache_bytes_at_decode_batch": _cache_bytes(
        attention, suite.decode_batch, context + new)}
    group = {"retnet": _context_decode_case(retnet, suite.decode_batch, context, new)}
    if cache_budget is not None and _cache_bytes(attention, batch, context + new) > cache_budget:
      point["transformer_skipped"] = "a KV cache of even batch 1 exceeds a third of the device's memory"
    else:
      group["transformer"] = _context_decode_case(attention, batch, context, new)
    batches = ", ".join(f"{n} batch {c.info['batch']}" for n, c in group.items())
    print(f"decode after {context} tokens: {batches}", flush=True)
    interleave(group, suite.rounds, source, budget)
    for name, case in group.items():
      point[name] = {"batch": case.info["batch"], "state_bytes": case.info["state_bytes"],
                     "tokens_per_s": rate(case.info["batch"], case.info["seconds"]), "memory": case.info["memory"]}
    if "transformer" in point:
      point["throughput_ratio"] = point["retnet"]["tokens_per_s"]["median"] / point["transformer"]["tokens_per_s"][
          "median"]
    results["contexts"].append(point)
    del group
  results["curve"] = measure_curve(suite, config, retnet, attention, source, cache_budget, budget, results["skipped"])
  return results


def measure_curve(suite: GpuSuite, config, retnet, attention, source: str, cache_budget: int | None, budget: Budget,
                  skipped: dict[str, str]) -> list[dict[str, Any]]:
  """Per context of `suite.curve_contexts`, batch 1: XLA's memory analysis of RetNet's and the Transformer's prefill
  (`Sampler.compile_prefill`, compiled, not run: the Transformer's abstract, its KV cache holding the context and the
  new tokens), and their decoding tokens/s from a zero-filled state that far in, interleaved; the Transformer's only
  where its KV cache fits `cache_budget`. A context not started before `budget` is spent goes to `skipped`."""
  new, sampler, points = suite.decode_new_tokens, sampling.Sampler(), []
  for context in suite.curve_contexts:
    if budget.spent():
      skipped[f"curve {context}"] = budget.reason
      continue
    print(f"decode curve: prefill compiled and decoding after {context} tokens", flush=True)
    at_context = nnx.eval_shape(lambda: Model(presets.transformer_config(config.model, context + new),
                                              rngs=nnx.Rngs(0)))
    point: dict[str, Any] = {"context": context}
    for name, model in (("retnet", retnet), ("transformer", at_context)):
      sizes = accelerators.memory_sizes(sampler.compile_prefill(model, 1, context))
      point[name] = {"prefill_xla": sizes, "prefill_xla_bytes": accelerators.required_bytes(sizes)}
    group = {"retnet": _context_decode_case(retnet, 1, context, new)}
    if cache_budget is not None and _cache_bytes(attention, 1, context + new) > cache_budget:
      point["transformer"]["decode_skipped"] = "its KV cache at batch 1 exceeds a third of the device's memory"
      point["transformer"]["state_bytes"] = _cache_bytes(attention, 1, context + new)
    else:
      group["transformer"] = _context_decode_case(attention, 1, context, new)
    interleave(group, suite.rounds, source, budget)
    for name, case in group.items():
      point[name].update(state_bytes=case.info["state_bytes"], tokens_per_s=rate(1, case.info["seconds"]))
    points.append(point)
    del group
  return points


def decode_markdown(results: dict[str, Any]) -> list[str]:
  """The decode part's batch-1 line against the weight-read floor and its table per context."""
  lines = [f"## Decoding, {results['model']} ({results['params']:,} parameters, bfloat16 compute)", "",
           f"Batch 1 after a {results['prompt_len']}-token prompt: "
           f"{fmt_range(results['batch_1']['s_per_token'], scale=1e3)} ms/token. Weight-read "
           f"floor {fmt(results['param_bytes'], 'B')} ({results.get('param_dtype', 'float32')} parameters) / "
           f"{fmt(results['read_bytes_per_s']['median'], 'B/s')} = {results['weight_read_floor_s'] * 1e3:.3g} "
           "ms/token: "
           f"RetNet reaches {results['batch_1_over_floor']:.0%} of it.", ""]
  rows = []
  for p in results["contexts"]:
    t = p.get("transformer")
    rows.append([f"{p['context']:,}", p["retnet"]["batch"], fmt_range(p["retnet"]["tokens_per_s"]),
                 fmt(p["retnet"]["state_bytes"], "B"), t["batch"] if t else "-",
                 fmt_range(t["tokens_per_s"]) if t else p["transformer_skipped"],
                 fmt(t["state_bytes"], "B") if t else "-", fmt(p.get("throughput_ratio"))])
  lines += markdown.table(["context", "RetNet batch", "RetNet tokens/s", "RetNet state", "Transformer batch",
                           "Transformer tokens/s", "KV cache", "ratio"], rows)
  if results.get("curve"):  # (absent from the results of earlier runs)
    lines += ["", "Against the context at batch 1: XLA's memory analysis of the prefill (compiled, not run) and "
              "decoding tokens/s from a zero-filled state that far in.", ""]
    lines += markdown.table(
        ["context", "RetNet prefill XLA", "Transformer prefill XLA", "RetNet tokens/s", "Transformer tokens/s",
         "KV cache"],
        [[f"{p['context']:,}", fmt(p["retnet"]["prefill_xla_bytes"], "B"),
          fmt(p["transformer"]["prefill_xla_bytes"], "B"), fmt_range(p["retnet"]["tokens_per_s"]),
          fmt_range(p["transformer"]["tokens_per_s"]) if "tokens_per_s" in p["transformer"]
          else p["transformer"]["decode_skipped"], fmt(p["transformer"]["state_bytes"], "B")]
         for p in results["curve"]])
  return lines + [f"Skipped: {name}: {reason.rstrip('.')}." for name, reason in results["skipped"].items()]
