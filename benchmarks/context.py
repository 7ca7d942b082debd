"""Prefill and decoding against the context length, four models of one size side by side in one run: RetNet, gated
retention (`model.mixer="gated_retention"`), a hybrid whose last layer attends over a window, and the Transformer of
that size (`presets.transformer_config`, its KV cache holding the context and the new tokens). The paper's
inference-cost picture on this machine: RetNet's memory is flat in the context, the Transformer's is its KV cache.

    python scripts/benchmark.py --suite=context --out=runs/context  # small, 1k to 1M tokens
    python scripts/benchmark.py --suite=context --context_size=tiny --out=runs/context_tiny  # tiny, to 10M

The lengths run from the shortest to the longest, the models taking turns at each. Each (model, length) point runs
in a fresh process (`python -c POINT`, started as the scripts start, `cli.prepare`), so that its peak RSS, a
high-water mark, is its own. A point: the prefill of one prompt of random tokens, compiled ahead of time
(`Sampler.compile_prefill`, the compile timed apart) and sized by XLA's memory analysis (`accelerators.memory_sizes`),
then run (again until the runs have taken MIN_TIMED_S) with the process's peak RSS (`harness.peak_memory`: the heap's
free pages returned first; its start is the RSS after building the model and compiling); then greedy
`Sampler.decode` of `new_tokens` from the prefilled state, compiled by a first call, then timed in pairs of calls
(until they have taken MIN_TIMED_S).

A prefill or decoding that the model's previous length says would take longer than `point_budget_s` (compiling
aside) is skipped, with the reason and the estimate: prefill time grows linearly with the context for a decoding
state of fixed size, quadratically for a KV cache that holds the whole context; decoding time is constant, or linear
in the context. A skipped prefill still records XLA's memory analysis (compiled, not run), and its decoding, unless
skipped too, starts from a zero-filled state at that position (`cases.zero_state`, `"from": "zeros"`). Decoding
holds its state twice (the state passed in and the loop's copy), so it runs where the state takes at most a third of
the host memory available (`host_memory.available`), as `gpu_decode` sizes it on a device; where the decoding state
alone does not fit that memory, the point is recorded as not fitting, with nothing compiled or run. Writes
OUT/context.json (rewritten after each point), OUT/context.md (also printed) and OUT/context.png.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from benchmarks import cases, plots
from benchmarks.harness import memory_source, peak_memory, random_tokens, rate, spread, timed
from benchmarks.report import fmt
from benchmarks.sections import cpu_name
from benchmarks.suites import ContextSweep
from retnet_jax.core import host_memory, markdown
from retnet_jax.evaluation import sampling, sampling_checks
from retnet_jax.hardware import accelerators
from retnet_jax.models import architectures, model_config, presets
from retnet_jax.models.model import Model
from retnet_jax.training.metrics import format_duration

MODELS = ("retnet", "gated", "hybrid", "transformer")  # in the order they take turns at each length
MIN_TIMED_S = 1.0  # a prefill, or decoding, runs again until its runs have taken this long
DECODE_CALLS = 3  # a point's decoding calls: the first compiles, two are timed (`cases.decode_from`)
STARTUP_S = 300.0  # a point's process may take this beyond 3 x the budget (start, build, compiles) before it is ended
POINT = "from retnet_jax.runs import cli; cli.prepare(); from benchmarks import context; context.point_main()"
ROOT = Path(__file__).resolve().parents[1]  # the point process's working directory: `-c` imports benchmarks/ there
REPLY = "context point: "  # the start of the point process's line of results


def sweep_model(sweep: ContextSweep, name: str, length: int):
  """The model section of `name` (one of MODELS) at the sweep's preset size, for a context of `length` tokens."""
  cfg = presets.get_config(sweep.preset).model
  if name == "transformer":
    return presets.transformer_config(cfg, length + sweep.new_tokens)
  if name == "gated":
    cfg.mixer = "gated_retention"
  elif name == "hybrid":
    cfg.attention_layers = (cfg.num_layers - 1,)
    cfg.attention_window = sweep.attention_window
  return cfg


def describe(sweep: ContextSweep, name: str) -> str:
  """What model `name` is, for the report."""
  return {"retnet": "RetNet (multi-scale retention in every layer)",
          "gated": "Gated retention (`model.mixer=\"gated_retention\"`) in every layer",
          "hybrid": f"Hybrid: retention, its last layer attending over the last {sweep.attention_window} tokens",
          "transformer": "Transformer of the same size, KV cache of context + new tokens"}[name]


def _estimate(earlier: list[dict[str, Any]], seconds_of, length: int, power: int) -> tuple[float, str] | None:
  """(seconds, how) at `length` from the last of `earlier` points whose `seconds_of(point)` is measured, scaled by
  (length / its length)^power; None where none is."""
  measured = [p for p in earlier if seconds_of(p) is not None]
  if not measured:
    return None
  last = measured[-1]
  growth = {0: "constant", 1: "linear", 2: "quadratic"}[power]
  seconds = seconds_of(last) * (length / last["length"])**power
  return seconds, f"{seconds:.0f} s from {last['length']:,} tokens' {seconds_of(last):.3g} s ({growth})"


def plan(sweep: ContextSweep, name: str, length: int, earlier: list[dict[str, Any]], available: tuple[int, str]
         ) -> dict[str, Any]:
  """What point (`name`, `length`) runs, from the model's `earlier` points and the host memory `available` (bytes,
  what bounds it): `run_prefill` and `run_decode` (bools), with `prefill_skipped` / `decode_skipped` (the reason) and
  the estimate in seconds where one is skipped; or `skipped` where even the decoding state does not fit (nothing runs).
  Every plan holds the decoding state's bytes (`state_bytes`)."""
  cfg = sweep_model(sweep, name, length)
  state_bytes = sampling_checks.state_bytes(nnx.eval_shape(lambda: Model(cfg, rngs=nnx.Rngs(0))), 1)
  memory, bound = available
  if state_bytes > memory:
    return {"state_bytes": state_bytes, "skipped": f"does not fit: its decoding state (KV cache) of "
            f"{fmt(state_bytes, 'B')} exceeds the {fmt(memory, 'B')} of host memory available ({bound})"}
  found: dict[str, Any] = {"state_bytes": state_bytes, "run_prefill": True, "run_decode": True}
  growing = architectures.cache_field(model_config.of(cfg)) is not None
  prefill = _estimate(earlier, lambda p: p["prefill"]["seconds"]["median"] if "prefill" in p else None, length,
                      1 + growing)
  decode = _estimate(earlier, lambda p: DECODE_CALLS * sweep.new_tokens * p["decode"]["seconds_per_token"]["median"]
                     if "decode" in p else None, length, int(growing))
  for part, estimate in (("prefill", prefill), ("decode", decode)):
    if estimate is not None and estimate[0] > sweep.point_budget_s:
      found.update({f"run_{part}": False, f"{part}_estimate_s": estimate[0],
                    f"{part}_skipped": f"time budget: estimated {estimate[1]}, over --point_budget_s="
                                       f"{sweep.point_budget_s:g}"})
  if found["run_decode"] and 3 * state_bytes > memory:
    found.update(run_decode=False, decode_skipped=f"does not fit: decoding holds its state of {fmt(state_bytes, 'B')} "
                 f"twice, and three times it exceeds the {fmt(memory, 'B')} of host memory available ({bound})")
  return found


def _runs(run: Callable[[], list[float]], unit: int, source: str) -> tuple[list[float], dict[str, int]]:
  """`run` (a Case's run: seconds, each of one of `unit` units of a call: 1 for a prefill's, the new tokens for
  decoding's per token) run until its calls have taken MIN_TIMED_S: (every such time, the first run's peak memory,
  `harness.peak_memory`)."""
  seconds: list[float] = []
  usage = peak_memory(lambda: seconds.extend(run()), source)
  while unit * sum(seconds) < MIN_TIMED_S:
    seconds += run()
  return seconds, usage


def measure_point(sweep: ContextSweep, name: str, length: int, prefill: bool, decode: bool) -> dict[str, Any]:
  """Point (`name`, `length`) in this process: the prefill compiled and sized, run where `prefill` (and it fits the
  host memory available), then decoding where `decode` (from the prefilled state, else from zeros)."""
  source = memory_source()
  model = Model(sweep_model(sweep, name, length), rngs=nnx.Rngs(0))
  sampler = sampling.Sampler()
  start = time.perf_counter()
  sizes = accelerators.memory_sizes(sampler.compile_prefill(model, 1, length))  # the sampler keeps it for its run
  result: dict[str, Any] = {"compile_s": time.perf_counter() - start, "xla": sizes,
                            "xla_bytes": accelerators.required_bytes(sizes), "platform": jax.default_backend(),
                            "memory_source": source}
  prefilled = None
  memory, bound = host_memory.available()
  if prefill and result["xla_bytes"] > memory:
    result["prefill_skipped"] = (f"does not fit: XLA's analysis needs {fmt(result['xla_bytes'], 'B')}, more than the "
                                 f"{fmt(memory, 'B')} of host memory available ({bound})")
  elif prefill:
    tokens = random_tokens(1, length, model.config.vocab_size, seed=1)
    holder = {}

    def run():
      holder["prefilled"] = jax.block_until_ready(sampler.prefill(model, tokens, np.full((1,), length, np.int32)))

    seconds, usage = _runs(timed(run), 1, source)
    result["prefill"] = {"seconds": spread(seconds), "tokens_per_s": rate(length - 1, spread(seconds)),
                         "memory": usage, "rss_start_bytes": usage["peak_bytes"] - usage["above_start_bytes"]}
    prefilled = holder["prefilled"]
  if decode:
    start = time.perf_counter()
    origin = "prefill" if prefilled is not None else "zeros"
    if prefilled is None:
      prefilled = cases.zero_state(model, 1, length, sweep.new_tokens)
    case = cases.decode_from(model, sampler, prefilled, sweep.new_tokens)
    seconds, usage = _runs(case.run, sweep.new_tokens, source)
    result["decode"] = {"from": origin, "seconds_per_token": spread(seconds), "tokens_per_s": rate(1, spread(seconds)),
                        "first_call_s": case.info["first_call_s"], "memory": usage,
                        "wall_s": time.perf_counter() - start}
  return result


def point_main() -> None:
  """The point process (POINT): measures the point of the JSON request in its first argument and prints REPLY and
  the results as one JSON line."""
  request = json.loads(sys.argv[1])
  sweep = request.pop("sweep")
  sweep = ContextSweep(**{**sweep, "lengths": tuple(sweep["lengths"])})
  print(REPLY + json.dumps(measure_point(sweep, **request)), flush=True)


def measure_apart(sweep: ContextSweep, name: str, length: int, prefill: bool, decode: bool) -> dict[str, Any]:
  """`measure_point` in a fresh process: its results, or `error` where the process failed or ran past 3 x the
  budget + STARTUP_S (then ended), with the end of its output."""
  request = json.dumps({"sweep": dataclasses.asdict(sweep), "name": name, "length": length, "prefill": prefill,
                        "decode": decode})
  timeout = 3 * sweep.point_budget_s + STARTUP_S
  try:
    done = subprocess.run([sys.executable, "-c", POINT, request], capture_output=True, text=True, timeout=timeout,
                          check=False, cwd=ROOT)
  except subprocess.TimeoutExpired:
    return {"error": f"ran past {timeout:.0f} s and was ended"}
  replies = [line[len(REPLY):] for line in done.stdout.splitlines() if line.startswith(REPLY)]
  if done.returncode or not replies:
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
    return {"error": f"its process ended with exit status {done.returncode}:\n{tail}"}
  return json.loads(replies[-1])


def _rate(tokens_per_s: float) -> str:
  """Tokens/s as a whole number with thousands separators (3 significant digits below 100)."""
  return f"{tokens_per_s:,.0f}" if tokens_per_s >= 100 else f"{tokens_per_s:.3g}"


def _tokens(n: int) -> str:
  """A length on a plot's axis: 1k, 64k, 1M, 10M."""
  return f"{n / 2**20:g}M" if n >= 2**20 else f"{n / 2**10:g}k" if n >= 2**10 else str(n)


def _summary(point: dict[str, Any]) -> str:
  """A point's progress line."""
  parts = [f"{point['model']} at {point['length']:,} tokens"]
  if "skipped" in point:
    return f"{parts[0]}: skipped: {point['skipped']}"
  if "error" in point:
    return f"{parts[0]}: failed: {point['error']}"
  parts.append(f"XLA {fmt(point['xla_bytes'], 'B')} (compiled in {point['compile_s']:.1f} s)")
  if "prefill" in point:
    p = point["prefill"]
    parts.append(f"prefill {fmt(p['seconds']['median'], 's')}, {_rate(p['tokens_per_s']['median'])} tokens/s, peak RSS "
                 f"{fmt(p['memory']['peak_bytes'], 'B')} (+{fmt(p['memory']['above_start_bytes'], 'B')})")
  else:
    parts.append(f"prefill skipped: {point['prefill_skipped']}")
  if "decode" in point:
    parts.append(f"decode {_rate(point['decode']['tokens_per_s']['median'])} tokens/s from {point['decode']['from']}")
  else:
    parts.append(f"decode skipped: {point['decode_skipped']}")
  return f"{parts[0]}: " + "; ".join(parts[1:]) + f" [{point['seconds']:.0f} s]"


def measure(sweep: ContextSweep, results: dict[str, Any], save) -> None:
  """Every point of the sweep into `results["points"]`, the lengths in order and the models taking turns at each;
  `save()` after each."""
  for length in sweep.lengths:
    for name in MODELS:
      earlier = [p for p in results["points"] if p["model"] == name]
      point = {"model": name, "length": length, **plan(sweep, name, length, earlier, host_memory.available())}
      start = time.perf_counter()
      if "skipped" not in point:
        print(f"context: {name} at {length:,} tokens ...", flush=True)
        point.update(measure_apart(sweep, name, length, point["run_prefill"], point["run_decode"]))
      point["seconds"] = time.perf_counter() - start
      print(f"  {_summary(point)}", flush=True)
      results["points"].append(point)
      save()


def to_markdown(results: dict[str, Any]) -> str:
  """A table per model: XLA bytes, peak RSS, prefill and decoding tokens/s and the decoding state per length."""
  meta = results["meta"]
  text = [f"# Prefill and decoding against the context ({meta['preset']} size, {meta['date']})", "",
            f"`{meta['command']}` on {meta['machine']}; jax {meta['jax']}; {format_duration(meta['total_s'])}. "
            f"Batch 1, a prompt of random tokens; greedy decoding of {meta['new_tokens']} tokens per call after it. "
            "XLA: the compiled prefill's arguments (the parameters and the prompt, 4 bytes a token), outputs (the "
            "decoding state) and temporaries, temporaries in brackets. Peak RSS: the process's high-water mark "
            "during the prefill (each point in its own process), + the part above its RSS after building the model "
            "and compiling. Medians over the runs. Load average (1, 5, 15 min) at the start "
            f"{', '.join(f'{x:.1f}' for x in meta['load_average_start'])}, at the end "
            f"{', '.join(f'{x:.1f}' for x in meta['load_average_end'])}.", ""]
  for name, model in results["models"].items():
    rows = []
    for p in (p for p in results["points"] if p["model"] == name):
      prefill, decode = p.get("prefill"), p.get("decode")
      notes = [p[key] for key in ("skipped", "error", "prefill_skipped") if key in p]
      notes += [f"decoding: {p['decode_skipped']}"] if "decode_skipped" in p else []
      notes += ["decoding from a zero-filled state"] if decode and decode["from"] == "zeros" else []
      rows.append([f"{p['length']:,}",
                   f"{fmt(p['xla_bytes'], 'B')} ({fmt(p['xla']['temporary_bytes'], 'B')})" if "xla" in p else "-",
                   f"{fmt(prefill['memory']['peak_bytes'], 'B')} (+{fmt(prefill['memory']['above_start_bytes'], 'B')})"
                   if prefill else "-", _rate(prefill["tokens_per_s"]["median"]) if prefill else "-",
                   fmt(prefill["seconds"]["median"], "s") if prefill else "-",
                   _rate(decode["tokens_per_s"]["median"]) if decode else "-", fmt(p["state_bytes"], "B"),
                   "; ".join(n.rstrip(".") for n in notes)])
    text += [f"## {model['description']}", "", f"{model['params']:,} parameters.", ""]
    text += markdown.table(["context", "XLA prefill (temporaries)", "prefill peak RSS", "prefill tokens/s",
                              "prefill", "decode tokens/s", "decoding state", "note"], rows)
    text.append("")
  return "\n".join(text)


def plot(results: dict[str, Any], out: Path) -> str:
  """Memory (XLA, peak RSS), prefill and decoding tokens/s against the context, one colour per model: the PNG's
  name."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker

  fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
  for i, name in enumerate(results["models"]):
    mine = [p for p in results["points"] if p["model"] == name]
    style = {"color": f"C{i}", "xlabel": "context tokens"}
    memory = "prefill memory: XLA (solid), peak RSS (dashed)"
    ran = [p for p in mine if "prefill" in p]
    plots.lines(axes[0], {f"{name} XLA": [p for p in mine if "xla" in p]}, "length",
                lambda p: p["xla_bytes"] / 2**20, memory, "MiB", **style)
    plots.lines(axes[0], {f"{name} RSS": ran}, "length", lambda p: p["prefill"]["memory"]["peak_bytes"] / 2**20,
                memory, "MiB", linestyle="--", **style)
    plots.lines(axes[1], {name: ran}, "length", lambda p: p["prefill"]["tokens_per_s"]["median"],
                "prefill (batch 1)", "tokens / s", **style)
    plots.lines(axes[2], {name: [p for p in mine if "decode" in p]}, "length",
                lambda p: p["decode"]["tokens_per_s"]["median"], "greedy decoding (batch 1)", "tokens / s", **style)
  lengths = sorted({p["length"] for p in results["points"]})
  for ax in axes:
    ax.set_xticks(lengths, [_tokens(n) for n in lengths])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
  fig.suptitle(f"{results['meta']['preset']} size on {results['meta']['machine']}", fontsize=10)
  fig.tight_layout()
  fig.savefig(out / "context.png", dpi=100)
  plt.close(fig)
  return "context.png"


def run(sweep: ContextSweep, out: Path, command: str) -> dict[str, Any]:
  """Measures the sweep and writes OUT/context.json (after each point), OUT/context.md (also printed) and
  OUT/context.png; returns the results. This process runs nothing on a device (its points' processes do, each
  recording the platform and how it reads memory)."""
  out.mkdir(parents=True, exist_ok=True)
  start = time.perf_counter()
  results: dict[str, Any] = {
      "meta": {"suite": "context", "command": command,
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "machine": f"{cpu_name()}, {os.cpu_count()} cores", "jax": jax.__version__,
               "settings": dataclasses.asdict(sweep), "preset": sweep.preset, "new_tokens": sweep.new_tokens,
               "load_average_start": os.getloadavg()},
      "models": {name: {"description": describe(sweep, name), "params": cases.param_count(
          sweep_model(sweep, name, sweep.lengths[0]))} for name in MODELS},
      "points": []}
  save = lambda: (out / "context.json").write_text(json.dumps(results, indent=1))
  measure(sweep, results, save)
  results["meta"].update(total_s=time.perf_counter() - start, load_average_end=os.getloadavg(),
                         plot=plot(results, out))
  save()
  text = to_markdown(results)
  (out / "context.md").write_text(text)
  print(text)
  return results
