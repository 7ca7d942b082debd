"""The benchmark's sections (ceilings and training, length sweeps, long training, decoding, targets) and `run`."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from benchmarks import documents
from benchmarks.cases import (Inference, InitialStates, compile_train_step, decode_case, forward_case,
                              gated_config, make_config, matmul_case, param_count, read_case,
                              retnet_train_case, transformer_train_case)
from benchmarks.harness import interleave, memory_source, rate
from benchmarks.plots import plot
from benchmarks.report import fmt, to_markdown
from benchmarks.suites import Suite
from benchmarks.torchscale_worker import Torchscale
from retnet_jax.core import sharding
from retnet_jax.hardware import flops
from retnet_jax.models import architectures, model_config, presets
from retnet_jax.models.model import Model
from retnet_jax.nn.layers import DTYPES


def measure_training(base, suite: Suite, mesh, states: InitialStates, torchscale: Torchscale, source: str
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
  """Train-step throughput and MFU per model / form / dtype (RetNet, gated retention in `suite.gated_forms`, the
  Transformer), interleaved with the matmul ceilings they are divided by: (results per case, matmul FLOP/s per
  dtype)."""
  cases = {f"matmul/{name}": matmul_case(dtype, suite.matmul_size) for name, dtype in DTYPES.items()}
  flops_per_token = {}
  for dtype in DTYPES:
    for mode in architectures.SEQUENCE_MODES:
      config = make_config(base, suite, dtype, mode, suite.seq_len, suite.batch_size)
      cases[f"retnet/{mode}/{dtype}"] = retnet_train_case(config, mesh, states)
      flops_per_token[f"retnet/{mode}/{dtype}"] = flops.train_flops_per_token(model_config.of(config.model),
                                                                              suite.seq_len, mode)
    config = make_config(base, suite, dtype, "parallel", suite.seq_len, suite.batch_size)
    cases[f"transformer/parallel/{dtype}"] = transformer_train_case(config)
    flops_per_token[f"transformer/parallel/{dtype}"] = flops.train_flops_per_token(
        presets.transformer_config(config.model, suite.seq_len), suite.seq_len, "parallel")
  for mode, dtype in suite.gated_forms:
    config = gated_config(make_config(base, suite, dtype, mode, suite.seq_len, suite.batch_size))
    cases[f"gated/{mode}/{dtype}"] = retnet_train_case(config, mesh, states)
    flops_per_token[f"gated/{mode}/{dtype}"] = flops.train_flops_per_token(model_config.of(config.model),
                                                                           suite.seq_len, mode)
  if torchscale.available:
    for mode in architectures.SEQUENCE_MODES:
      config = make_config(base, suite, "float32", mode, suite.seq_len, suite.batch_size)
      cases[f"torchscale/{mode}/float32"] = torchscale.train_case(mode, config.train)
      flops_per_token[f"torchscale/{mode}/float32"] = flops_per_token[f"retnet/{mode}/float32"]
  print(f"training: {len(cases)} cases, batch {suite.batch_size} x {suite.seq_len} tokens", flush=True)
  interleave(cases, suite.rounds, source)
  matmul = {name: rate(2 * suite.matmul_size**3, cases.pop(f"matmul/{name}").info["seconds"]) for name in DTYPES}
  tokens = suite.batch_size * suite.seq_len
  results = {}
  for name, case in cases.items():
    dtype = name.rsplit("/", 1)[1]
    throughput = rate(tokens, case.info["seconds"])
    results[name] = {"tokens_per_s": throughput, "step_s": case.info["seconds"],
                     "compile_s": case.info.get("compile_s"), "first_run_s": case.info["first_run_s"],
                     "memory": case.info["memory"], "compiled_bytes": case.info.get("compiled_bytes"),
                     "flops_per_token": flops_per_token[name],
                     "mfu": throughput["median"] * flops_per_token[name] / matmul[dtype]["median"]}
  return results, matmul


def _growth(points: list[dict], value: Callable[[dict], float | None]) -> float | None:
  """Exponent p of value ~ length^p between the two longest lengths (1: linear, 2: quadratic)."""
  if len(points) < 2 or not all(value(p) for p in points[-2:]):
    return None
  a, b = points[-2], points[-1]
  return math.log(value(b) / value(a)) / math.log(b["seq_len"] / a["seq_len"])


def _crossover(parallel: list[dict], chunkwise: list[dict]) -> int | None:
  """The shortest length from which the chunkwise form is faster at every longer length measured by both."""
  chunk_time = {p["seq_len"]: p["seconds"]["median"] for p in chunkwise}
  both = [(p["seq_len"], p["seconds"]["median"] < chunk_time[p["seq_len"]]) for p in parallel
          if p["seq_len"] in chunk_time]
  crossover = None
  for length, parallel_faster in reversed(both):
    if parallel_faster:
      break
    crossover = length
  return crossover


def measure_lengths(base, suite: Suite, mesh, states: InitialStates, inference: Inference, source: str
                    ) -> dict[str, Any]:
  """Time and peak memory vs sequence length at batch 1, the forms interleaved at each length: the forward pass
  of RetNet (parallel, chunkwise) and the Transformer on the inference mesh, and RetNet's training step."""
  config = make_config(base, suite, "float32", "parallel", suite.seq_len, 1)
  retnet = inference.place(Model(config.model, rngs=nnx.Rngs(config.seed)))
  builders = {
      "forward": {
          "retnet/parallel": lambda length: forward_case(retnet, "parallel", length, inference.mesh),
          "retnet/chunkwise": lambda length: forward_case(retnet, "chunkwise", length, inference.mesh),
          "transformer/parallel": lambda length: forward_case(inference.place(Model(
              presets.transformer_config(config.model, length), rngs=nnx.Rngs(config.seed))), "parallel", length,
              inference.mesh)},
      "train": {f"retnet/{mode}": lambda length, mode=mode: retnet_train_case(
          make_config(base, suite, "float32", mode, length, 1), mesh, states) for mode in architectures.SEQUENCE_MODES}}
  results: dict[str, Any] = {}
  for kind, lengths in (("forward", suite.lengths), ("train", suite.train_lengths)):
    results[kind] = {name: [] for name in builders[kind]}
    for length in lengths:
      cases = {name: build(length) for name, build in builders[kind].items()
               if name.endswith("chunkwise") or length <= suite.quadratic_max_len}
      print(f"{kind} at {length} tokens: {', '.join(cases)}", flush=True)
      for name, case in interleave(cases, suite.sweep_rounds, source).items():
        results[kind][name].append({"seq_len": length, **case.info})
    results[f"{kind}_analysis"] = {
        "crossover_seq_len": _crossover(results[kind]["retnet/parallel"], results[kind]["retnet/chunkwise"]),
        "time_growth_exponent": {name: _growth(points, lambda p: p["seconds"]["median"])
                                 for name, points in results[kind].items()},
        "compiled_bytes_growth_exponent": {name: _growth(points, lambda p: p["compiled_bytes"])
                                           for name, points in results[kind].items()}}
  return results


def measure_long_training(base, suite: Suite, mesh, states: InitialStates, source: str) -> dict[str, Any]:
  """Chunkwise training of one `long_train_len`-token sequence: the whole-sequence step compiled only (its XLA
  buffers; running it would need them as memory), the `train.segment_len` step compiled, run and timed."""
  whole = make_config(base, suite, "float32", "chunkwise", suite.long_train_len, 1)
  segmented = whole.copy_and_resolve_references()
  segmented.train.segment_len = suite.segment_len
  whole_compile_s, whole_bytes = compile_train_step(whole, mesh)
  print(f"long training: {suite.long_train_len} tokens, whole sequence compiled ({fmt(whole_bytes, 'B')} XLA), "
        f"segments of {suite.segment_len} timed", flush=True)
  case = interleave({"segmented": retnet_train_case(segmented, mesh, states)}, suite.sweep_rounds,
                    source)["segmented"]
  return {"seq_len": suite.long_train_len, "segment_len": suite.segment_len,
          "whole": {"compile_s": whole_compile_s, "compiled_bytes": whole_bytes},
          "segmented": {"tokens_per_s": rate(suite.long_train_len, case.info["seconds"]),
                        "step_s": case.info["seconds"], "compile_s": case.info["compile_s"],
                        "first_run_s": case.info["first_run_s"], "memory": case.info["memory"],
                        "compiled_bytes": case.info["compiled_bytes"]}}


def measure_decoding(base, suite: Suite, matmul, torchscale: Torchscale, inference: Inference, source: str
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
  """Greedy decoding on the inference mesh: tokens/s at batch 1 and `decode_batch`, per-token latency vs
  context, gated retention's tokens/s at `gated_decode_batches`, interleaved with the read bandwidth of the
  weight-read floor: (results, read bytes/s)."""
  config = make_config(base, suite, "float32", "chunkwise", suite.seq_len, 1)
  retnet = inference.place(Model(config.model, rngs=nnx.Rngs(config.seed)))
  param_bytes = 4 * sum(x.size for x in jax.tree.leaves(nnx.state(retnet, nnx.Param)))
  contexts = sorted(set(suite.contexts) | {suite.prompt_len})
  cases, models = {"memory_read": read_case(param_bytes // 4)}, {"retnet": lambda context: retnet}
  # A preallocated KV cache as long as the prompt and the new tokens: attention reads what the context needs.
  models["transformer"] = lambda context: inference.place(Model(
      presets.transformer_config(config.model, context + suite.new_tokens), rngs=nnx.Rngs(config.seed)))
  # The hybrid: the last layer attends over a window of `prompt_len` tokens (a ring-buffer cache of that many).
  hybrid_cfg = config.model.copy_and_resolve_references()
  hybrid_cfg.update(attention_layers=(hybrid_cfg.num_layers - 1,), attention_window=suite.prompt_len)
  hybrid = inference.place(Model(hybrid_cfg, rngs=nnx.Rngs(config.seed)))
  models["hybrid"] = lambda context: hybrid
  for name, model_at in models.items():
    prefill = architectures.prefill_modes(model_at(suite.prompt_len).config)[0]
    for context in contexts:
      cases[f"{name}/batch_1/{context}"] = decode_case(model_at(context), 1, context, suite.new_tokens, prefill)
    cases[f"{name}/batch_{suite.decode_batch}/{suite.prompt_len}"] = decode_case(
        model_at(suite.prompt_len), suite.decode_batch, suite.prompt_len, suite.new_tokens, prefill)
  gated = inference.place(Model(gated_config(config).model, rngs=nnx.Rngs(config.seed)))
  for batch in suite.gated_decode_batches:
    cases[f"gated/batch_{batch}/{suite.prompt_len}"] = decode_case(
        gated, batch, suite.prompt_len, suite.new_tokens, architectures.prefill_modes(gated.config)[0])
  if torchscale.available:
    cases["torchscale/batch_1"] = torchscale.decode_case(suite.new_tokens)
  print(f"decoding: {len(cases)} cases, {suite.new_tokens} new tokens each", flush=True)
  interleave(cases, suite.decode_rounds, source)
  read = rate(param_bytes, cases.pop("memory_read").info["seconds"])
  cfg = model_config.of(config.model)
  forward_flops = 2 * flops.matmul_params(cfg) + flops.mixing_flops_per_token(cfg, 1, "recurrent")
  results: dict[str, Any] = {"throughput": {}, "latency": {}, "latency_ratio": {}, "large_batch": {}}
  for name in models:
    results["latency"][name] = [
        {"context": c, "latency_s": cases[f"{name}/batch_1/{c}"].info["seconds"],
         "state_bytes": cases[f"{name}/batch_1/{c}"].info["state_bytes"],
         "memory": cases[f"{name}/batch_1/{c}"].info["memory"],
         "first_call_s": cases[f"{name}/batch_1/{c}"].info["first_run_s"]} for c in contexts]
    latency = {p["context"]: p["latency_s"]["median"] for p in results["latency"][name]}
    results["latency_ratio"][name] = latency[contexts[-1]] / latency[contexts[0]]
    large = cases[f"{name}/batch_{suite.decode_batch}/{suite.prompt_len}"].info
    results["throughput"][name] = {
        "batch_1": rate(1, cases[f"{name}/batch_1/{suite.prompt_len}"].info["seconds"]),
        f"batch_{suite.decode_batch}": rate(suite.decode_batch, large["seconds"])}
    results["large_batch"][name] = {"batch": suite.decode_batch, "state_bytes": large["state_bytes"],
                                    "memory": large["memory"], "first_call_s": large["first_run_s"]}
  results["throughput"]["gated"] = {
      f"batch_{batch}": rate(batch, cases[f"gated/batch_{batch}/{suite.prompt_len}"].info["seconds"])
      for batch in suite.gated_decode_batches}
  if torchscale.available:
    results["throughput"]["torchscale"] = {"batch_1": rate(1, cases["torchscale/batch_1"].info["seconds"])}
  bandwidth = read["median"]
  ours = results["throughput"]["retnet"]
  results.update(
      prompt_len=suite.prompt_len, new_tokens=suite.new_tokens, latency_contexts=contexts,
      param_bytes=param_bytes, weight_read_floor_s=param_bytes / bandwidth,
      weight_read_floor_tokens_per_s=bandwidth / param_bytes,
      batch_1_over_floor=ours["batch_1"]["median"] * param_bytes / bandwidth,
      forward_flops_per_token=forward_flops,
      large_batch_flops_per_s=ours[f"batch_{suite.decode_batch}"]["median"] * forward_flops)
  results["large_batch_fraction_of_matmul_ceiling"] = (
      results["large_batch_flops_per_s"] / matmul["float32"]["median"])
  return results, read


def torchscale_ratios(training, decoding, torchscale: Torchscale) -> dict[str, Any]:
  """Our tokens/s over torchscale's (training per form, batch-1 decoding), when torchscale was measured."""
  if not torchscale.available:
    return {"available": False, "note": torchscale.note, "ratios": {}}
  ratios = {f"train_{mode}": training[f"retnet/{mode}/float32"]["tokens_per_s"]["median"]
            / training[f"torchscale/{mode}/float32"]["tokens_per_s"]["median"] for mode in architectures.SEQUENCE_MODES}
  ratios["decode_batch_1"] = (decoding["throughput"]["retnet"]["batch_1"]["median"]
                              / decoding["throughput"]["torchscale"]["batch_1"]["median"])
  return {"available": True, "note": torchscale.note, "ratios": ratios}


def check_targets(results) -> list[dict[str, Any]]:
  """The performance targets, each with its value in this run and whether it is met (value and met None where the
  run did not measure what it compares with)."""
  training, decoding, long = results["training"], results["decoding"], results["long_training"]
  forward_longest = results["lengths"]["forward"]["retnet/chunkwise"][-1]
  theirs = decoding["throughput"].get("torchscale", {}).get("batch_1", {}).get("median")
  batch_1 = decoding["throughput"]["retnet"]["batch_1"]["median"]
  reference = "torchscale not measured" if theirs is None else f"{theirs:.1f} tok/s"
  targets = [
      ("float32 training (parallel) >= 75% of the float32 matmul ceiling",
       training["retnet/parallel/float32"]["mfu"], lambda v: v >= 0.75),
      ("float32 training (chunkwise) >= 75% of the float32 matmul ceiling",
       training["retnet/chunkwise/float32"]["mfu"], lambda v: v >= 0.75),
      (f"decoding batch 1 >= 6 x torchscale ({reference})", None if theirs is None else batch_1 / theirs,
       lambda v: v >= 6),
      ("decoding batch 1 within 2 x of the weight-read floor", decoding["batch_1_over_floor"], lambda v: v >= 0.5),
      ("per-token latency flat: longest / shortest context < 1.1", decoding["latency_ratio"]["retnet"],
       lambda v: v < 1.1),
      ("chunkwise forward memory linear: XLA buffers grow as L^p, p < 1.2",
       results["lengths"]["forward_analysis"]["compiled_bytes_growth_exponent"]["retnet/chunkwise"],
       lambda v: v < 1.2),
      (f"chunkwise forward at {forward_longest['seq_len']} tokens >= 1,800 tokens/s",
       forward_longest["seq_len"] / forward_longest["seconds"]["median"], lambda v: v >= 1800),
      (f"chunkwise training at {long['seq_len']} tokens (train.segment_len={long['segment_len']}) under 4 GB: "
       "peak memory, GB", long["segmented"]["memory"]["peak_bytes"] / 1e9, lambda v: v < 4),
  ]
  if "document_resets" in results:  # (`documents.measure`: absent from the results of earlier runs)
    targets.append(("document resets cost <= 5% of training throughput: lowest with / without",
                    min(c["ratio"] for c in results["document_resets"]["cases"].values()), lambda v: v >= 0.95))
  return [{"target": name, "value": value, "met": None if value is None else bool(test(value))}
          for name, value, test in targets]


def cpu_name() -> str:
  """The CPU's model name, else the machine type."""
  for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else ():
    if line.startswith("model name"):
      return line.split(":", 1)[1].strip()
  return platform.machine()


def run(base, suite: Suite, suite_name: str, out: Path, command: str, inference_devices: int | None = None
        ) -> dict[str, Any]:
  """Measures every section of `suite` on `base` (a configs/retnet.py config) and writes OUT/results.json,
  OUT/results.md (also printed) and the plots; returns the results. `inference_devices`: see `Inference.create`."""
  out.mkdir(parents=True, exist_ok=True)
  config = make_config(base, suite, "float32", "parallel", suite.seq_len, suite.batch_size)
  mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
  inference = Inference.create(config, inference_devices)
  source = memory_source()
  torchscale = Torchscale(config.model, source)
  states = InitialStates()
  start = time.perf_counter()
  params = param_count(config.model)
  results: dict[str, Any] = {"meta": {
      "suite": suite_name, "command": command,
      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
      "machine": f"{cpu_name()}, {os.cpu_count()} cores", "jax": jax.__version__,
      "device": str(jax.devices()[0]), "size": suite.size, "params": int(params), "seq_len": suite.seq_len,
      "batch_size": suite.batch_size, "rounds": suite.rounds, "memory_source": source,
      "inference_devices": inference.mesh.size,
      "suite_settings": dataclasses.asdict(suite), "load_average_start": os.getloadavg()}}
  training, matmul = measure_training(base, suite, mesh, states, torchscale, source)
  lengths = measure_lengths(base, suite, mesh, states, inference, source)
  long_training = measure_long_training(base, suite, mesh, states, source)
  document_resets = documents.measure(base, suite, source)
  decoding, read = measure_decoding(base, suite, matmul, torchscale, inference, source)
  results.update(ceilings={"matmul_flops": matmul, "memory_read_bytes_per_s": read, "matmul_size": suite.matmul_size,
                           "read_array_bytes": 4 * int(params)},
                 training=training, lengths=lengths, long_training=long_training, document_resets=document_resets,
                 decoding=decoding)
  results["torchscale"] = torchscale_ratios(results["training"], results["decoding"], torchscale)
  results["targets"] = check_targets(results)
  torchscale.close()
  results["meta"]["total_s"] = time.perf_counter() - start
  results["meta"]["load_average_end"] = os.getloadavg()
  results["meta"]["plots"] = plot(results, out)
  (out / "results.json").write_text(json.dumps(results, indent=2))
  markdown = to_markdown(results)
  (out / "results.md").write_text(markdown)
  print(markdown)
  print(f"wrote {out}/results.json, results.md and {', '.join(results['meta']['plots'])} "
        f"in {results['meta']['total_s']:.0f} s")
  return results
