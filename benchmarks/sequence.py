"""Sequence-parallel training: per-device XLA buffers and step time of the chunkwise train step of one sequence
split over 1, 2, 4, 8 devices of the `sequence` mesh axis, against the sequence length.

    python scripts/benchmark.py --suite=sequence --out=runs/sequence

On the CPU backend the devices are simulated on this machine's cores (XLA_FLAGS, set by scripts/benchmark.py), so
the step times show the cost of the split, not a speed-up; the buffers are what each device would hold. At each
length every split trains the same sequence from the same initial state: their first losses are compared. Lengths
in `compile_only_lengths` are compiled, not run. Every timed step starts with the heap's free pages returned to the
system, so its buffers' page faults are part of every split's time alike.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path
from typing import Any

import jax

from benchmarks.cases import compile_train_step, make_config, param_count
from benchmarks.harness import Case, compile_timed, interleave, memory_source, random_tokens, rate, timed
from benchmarks.report import fmt
from benchmarks.sections import cpu_name
from benchmarks.suites import SequenceSweep
from retnet_jax.core import host_memory, markdown, sharding
from retnet_jax.training import run_config, train_step


def _split_config(base, sweep: SequenceSweep, length: int, split: int):
  """The float32 chunkwise step of one `length`-token sequence, on mesh (1, 1, 1, split) over the first devices."""
  config = make_config(base, sweep.suite, "float32", "chunkwise", length, 1)
  config.mesh.shape = (1, 1, 1, split)
  return config, sharding.make_mesh(config.mesh, jax.devices()[:split])


def _train_case(base, sweep: SequenceSweep, length: int, split: int) -> Case:
  """A timed train step whose first run records its loss; compiled ahead of time (per-device XLA buffers)."""
  config, mesh = _split_config(base, sweep, length, split)
  run = train_step.setup(run_config.build(config), mesh)
  with run.placement.active():
    state = run.init()  # the same values on every mesh (the parameters' PRNG does not depend on the sharding)
    batch = jax.device_put(random_tokens(1, length + 1, config.model.vocab_size), run.placement.batch_sharding)
    step, compile_s, buffers = compile_timed(run.train_step, state, batch)
  holder: dict[str, Any] = {"state": state}
  info = {"compile_s": compile_s, "compiled_bytes": buffers, "loss": None}

  def one_step():
    holder["state"], metrics = step(holder["state"], batch)
    jax.block_until_ready(holder["state"])
    if info["loss"] is None:
      info["loss"] = float(metrics["loss"])

  timed_step = timed(one_step)

  def run_alone():
    # The splits' buffers fit the never-trimmed heap differently: returning its free pages first keeps the
    # process at about the largest step's footprint, not the sum of every split's.
    host_memory.release_freed_memory()
    return timed_step()

  return Case(run_alone, info, devices=split)


def measure(base, sweep: SequenceSweep, source: str) -> dict[str, Any]:
  """Per length and split: per-device XLA buffers, compile time, step time (interleaved over the splits), peak
  memory and the first step's loss; and the compiled buffers only at `compile_only_lengths`."""
  results: dict[str, Any] = {"run": [], "compiled_only": []}
  for length in sweep.lengths:
    print(f"sequence-parallel training: {length} tokens over {', '.join(map(str, sweep.splits))} devices", flush=True)
    cases = interleave({split: _train_case(base, sweep, length, split) for split in sweep.splits}, sweep.rounds,
                       source)
    single = cases[sweep.splits[0]].info
    for split, case in cases.items():
      info = case.info
      results["run"].append({
          "seq_len": length, "devices": split, "compiled_bytes_per_device": info["compiled_bytes"],
          "buffer_fraction": info["compiled_bytes"] / single["compiled_bytes"], "compile_s": info["compile_s"],
          "step_s": info["seconds"], "tokens_per_s": rate(length, info["seconds"]), "memory": info["memory"],
          "loss": info["loss"], "loss_rel_diff": abs(info["loss"] - single["loss"]) / abs(single["loss"])})
  for length in sweep.compile_only_lengths:
    print(f"sequence-parallel training: {length} tokens, compiled only", flush=True)
    for split in sweep.splits:
      compile_s, buffers = compile_train_step(*_split_config(base, sweep, length, split))
      results["compiled_only"].append({"seq_len": length, "devices": split, "compiled_bytes_per_device": buffers,
                                       "compile_s": compile_s})
    first = results["compiled_only"][-len(sweep.splits)]["compiled_bytes_per_device"]
    for point in results["compiled_only"][-len(sweep.splits):]:
      point["buffer_fraction"] = point["compiled_bytes_per_device"] / first
  return results


def to_markdown(results: dict[str, Any]) -> str:
  """The sweep as markdown tables."""
  meta = results["meta"]
  lines = [f"# Sequence-parallel training ({meta['date']})", "", f"`{meta['command']}`", "",
           f"{meta['machine']}; jax {meta['jax']}; {meta['device_count']} {meta['platform']} devices; model "
           f"{meta['size']} ({meta['params']:,} parameters), float32, chunkwise, batch 1.", ""]
  lines += markdown.table(
      ["tokens", "devices", "XLA buffers / device", "vs 1 device", "step", "tokens/s", "compile", "loss vs 1 device"],
      [[f"{p['seq_len']:,}", p["devices"], fmt(p["compiled_bytes_per_device"], "B"), f"{p['buffer_fraction']:.3f}",
        fmt(p["step_s"]["median"], "s"), fmt(p["tokens_per_s"]["median"]), fmt(p["compile_s"], "s"),
        f"{p['loss_rel_diff']:.1e}"] for p in results["run"]]
      + [[f"{p['seq_len']:,}", p["devices"], fmt(p["compiled_bytes_per_device"], "B"), f"{p['buffer_fraction']:.3f}",
          "(compiled only)", "", fmt(p["compile_s"], "s"), ""] for p in results["compiled_only"]])
  return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], out: Path) -> str:
  """Per-device buffers and step time against length, one line per split: the PNG's file name."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker

  fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
  points = results["run"] + results["compiled_only"]
  for split in sorted({p["devices"] for p in points}):
    mine = sorted((p for p in points if p["devices"] == split), key=lambda p: p["seq_len"])
    axes[0].plot([p["seq_len"] for p in mine], [p["compiled_bytes_per_device"] / 2**30 for p in mine], marker="o",
                 label=f"{split} device{'s' if split > 1 else ''}")
    timed_points = [p for p in mine if "step_s" in p]
    axes[1].plot([p["seq_len"] for p in timed_points], [p["step_s"]["median"] for p in timed_points], marker="o",
                 label=f"{split} device{'s' if split > 1 else ''}")
  axes[0].set(title="XLA buffers per device", ylabel="GiB")
  axes[1].set(title=f"train step time ({results['meta']['platform']})", ylabel="seconds")
  lengths = sorted({p["seq_len"] for p in points})
  for ax in axes:
    ax.set(xscale="log", yscale="log", xlabel="tokens in the sequence")
    ax.set_xticks(lengths, [f"{n // 1024}k" if n >= 1024 else str(n) for n in lengths])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(out / "sequence_parallel.png", dpi=100)
  plt.close(fig)
  return "sequence_parallel.png"


def run(base, sweep: SequenceSweep, out: Path, command: str) -> dict[str, Any]:
  """Measures the sweep and writes OUT/sequence_parallel.json, .md (also printed) and .png; returns the results."""
  if max(sweep.splits) > jax.device_count():
    raise ValueError(f"the sequence suite splits over up to {max(sweep.splits)} devices but {jax.device_count()} "
                     "are present; on a CPU set XLA_FLAGS=--xla_force_host_platform_device_count=8.")
  out.mkdir(parents=True, exist_ok=True)
  start = time.perf_counter()
  config, _ = _split_config(base, sweep, sweep.lengths[0], 1)
  params = param_count(config.model)
  results: dict[str, Any] = {"meta": {
      "suite": "sequence", "command": command,
      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
      "machine": f"{cpu_name()}, {os.cpu_count()} cores", "jax": jax.__version__, "platform": jax.default_backend(),
      "device_count": jax.device_count(), "size": sweep.suite.size, "params": int(params),
      "splits": sweep.splits, "rounds": sweep.rounds, "memory_source": memory_source(),
      "load_average_start": os.getloadavg()}}
  results.update(measure(base, sweep, results["meta"]["memory_source"]))
  results["meta"].update(total_s=time.perf_counter() - start, load_average_end=os.getloadavg(),
                         plots=[plot(results, out)])
  (out / "sequence_parallel.json").write_text(json.dumps(results, indent=2))
  markdown = to_markdown(results)
  (out / "sequence_parallel.md").write_text(markdown)
  print(markdown)
  return results
