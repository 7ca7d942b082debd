"""The GPU suite on one device: runs its parts and writes each part's results as they come.

    python scripts/benchmark.py --suite=gpu --parts=op,train,decode,compile --out=runs/gpu

Parts, a module each (each writes OUT/gpu_<part>[_<group>].json and .md as it goes, so a run cut short keeps what it
measured):
- `op` (`gpu_op`): the chunkwise retention op, ours (XLA, Pallas) against fla's Triton kernel and cuDNN attention.
- `train` (`gpu_train`): the training loop's own step per retention implementation and the Transformer of equal
  size, with MFU.
- `decode` (`gpu_decode`): greedy decoding against the weight-read floor and a Transformer's KV cache.
- `compile` (`gpu_compile`): compile time of the deep presets' train steps.
Whatever cannot run on the present backend (Pallas and cuDNN compile for GPUs only; fla needs CUDA) is recorded
under `skipped` with the reason. Every comparison is timed interleaved (`harness.interleave`). With a time budget
(`harness.Budget`, --time_budget_s), what has not started when it is spent is skipped ("time budget"): a part's
groups in OUT/gpu_run.json and .md (the run: seconds per group, what was not started), cases within a group in its
own `skipped`.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from benchmarks.gpu_compile import compile_markdown, measure_compile
from benchmarks.gpu_decode import decode_markdown, measure_decode
from benchmarks.gpu_op import measure_op, op_markdown, op_plot
from benchmarks.gpu_train import measure_train, train_markdown
from benchmarks.harness import Budget, memory_source
from benchmarks.suites import GpuSuite

PARTS = ("op", "train", "decode", "compile")
VERSIONED = ("jax", "jaxlib", "flax", "torch", "triton", "flash-linear-attention", "fla-core")
FLOP_COUNTS = {
    "chunkwise": "forward 2 B H T (C (d_k + d_v) + 2 d_k d_v): each chunk's full C x C scores and their product with "
                 "V, the query read of the entry state and the state update, as computed (masked entries included), "
                 "with each implementation's chunk C (XLA: its chunk_sizes entry; Pallas and fla: 64)",
    "attention": "forward 2 B H T^2 d: causal attention's scores and their product with V over the T (T + 1) / 2 "
                 "visible pairs (counted as T^2 / 2), head dim d = d_k",
    "forward_backward": "3 x forward (the backward pass counted as twice the forward)",
    "train": "flops.train_flops_per_token (3 x (2 x matmul parameters + retention or attention products)), no "
             "recomputation counted; MFU divides it by the bfloat16 GEMM rate measured in the case's own process, "
             "alternated with its steps",
}


def _versions() -> dict[str, str | None]:
  """The installed version of each of VERSIONED, None where one is not installed."""
  found = {}
  for name in VERSIONED:
    try:
      found[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      found[name] = None
  return found


def device_memory() -> int | None:
  """The first device's memory limit in bytes, or None where the backend reports none (CPU)."""
  stats = jax.devices()[0].memory_stats()
  return stats.get("bytes_limit") if stats else None


def _groups(suite: GpuSuite, parts: tuple[str, ...]) -> list[tuple[str, str, Any]]:
  """(file stem, part, the argument of its measure) of every group the parts measure, in order."""
  groups = {"op": [(f"gpu_op_{d_k}x{d_v}", (d_k, d_v)) for d_k, d_v in suite.op_head_dims],
            "train": [(f"gpu_train_{name}", name) for name in suite.train_models],
            "decode": [("gpu_decode", None)], "compile": [("gpu_compile", None)]}
  return [(stem, part, arg) for part in parts for stem, arg in groups[part]]


def run(suite: GpuSuite, sizes: str, parts: tuple[str, ...], out: Path, command: str, budget: Budget | None = None
        ) -> dict[str, Any]:
  """Measures `parts` of `suite` and writes, per part and group, OUT/gpu_<part>[_<group>].json and .md (and the op's
  PNG), each rewritten as its results come, and OUT/gpu_run.json and .md (seconds per group, the groups not started
  within `budget`); returns {file stem: results}."""
  unknown = [p for p in parts if p not in PARTS]
  if unknown or not parts:
    raise ValueError(f"parts {list(parts)}: choose one or more of {PARTS}.")
  budget = budget or Budget()
  out.mkdir(parents=True, exist_ok=True)
  source, limit = memory_source(), device_memory()
  meta = {"suite": "gpu", "sizes": sizes, "command": command, "device": jax.devices()[0].device_kind,
          "backend": jax.default_backend(), "device_memory_bytes": limit, "python": sys.version.split()[0],
          "versions": _versions(), "memory_source": source, "flop_counts": FLOP_COUNTS,
          "time_budget_s": budget.seconds, "suite_settings": dataclasses.asdict(suite)}
  written: dict[str, Any] = {}

  def write(stem: str, part: str, results: dict[str, Any], markdown: Callable[[dict], list[str]]) -> None:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    document = {"meta": {**meta, "part": part, "date": stamp}, **results}
    (out / f"{stem}.json").write_text(json.dumps(document, indent=2))
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v)
    text = [f"# GPU suite: {part} ({stamp})", "", f"`{command}`", "", f"{meta['device']} ({meta['backend']}); "
            f"{versions}. Medians [min-max] over timed runs after a warm-up, interleaved.", ""] + markdown(results)
    (out / f"{stem}.md").write_text("\n".join(text) + "\n")
    written[stem] = document

  summary: dict[str, Any] = {"time_budget_s": budget.seconds, "seconds": {}, "skipped": {}}
  for stem, part, arg in _groups(suite, parts):
    if budget.spent():
      summary["skipped"][stem] = budget.reason
      write("gpu_run", "run", summary, run_markdown)
      continue
    start = time.perf_counter()
    if part == "op":
      results = measure_op(suite, *arg, source, lambda r, stem=stem: write(stem, "op", r, op_markdown), budget)
      op_plot(results, out / f"{stem}.png")
    elif part == "train":
      measure_train(suite, arg, limit, budget, lambda r, stem=stem: write(stem, "train", r, train_markdown))
    elif part == "decode":
      write(stem, "decode", measure_decode(suite, source, limit, budget), decode_markdown)
    else:
      write(stem, "compile", measure_compile(suite, limit, budget), compile_markdown)
    summary["seconds"][stem] = time.perf_counter() - start
    print(f"{stem}: {summary['seconds'][stem]:.0f} s", flush=True)
    write("gpu_run", "run", summary, run_markdown)
  for stem in sorted(written, key=lambda stem: stem == "gpu_run"):  # the run's summary last
    print((out / f"{stem}.md").read_text())
  return written


def run_markdown(summary: dict[str, Any]) -> list[str]:
  """The run's seconds per group and the groups not started."""
  budget = summary["time_budget_s"]
  lines = [f"## Run ({'no time budget' if budget is None else f'time budget {budget:g} s'})", ""]
  lines += [f"- {stem}: {seconds:.0f} s" for stem, seconds in summary["seconds"].items()]
  return lines + [f"- {stem}: skipped: {reason}." for stem, reason in summary["skipped"].items()]
