"""Passkey retrieval scored: a model's greedy answers to `retnet_jax.input_pipeline.passkey`'s examples, accuracy per
context length and needle depth, as a table and a heatmap.

    grid = passkey.make_grid(tokenizer, lengths=(512, 1024), depths=(0.0, 0.5, 1.0), samples=8)
    results = evaluate(greedy_generate(model, "chunkwise"), grid)  # accuracy [length][depth]
    print(format_table(results))
    plot_heatmap(results, "passkey.png")

Scoring: greedy decoding after the question, exact match of every answer token (the same as every teacher-forced
argmax being right).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from retnet_jax.core import whole_files
from retnet_jax.evaluation import sampling, sampling_checks
from retnet_jax.input_pipeline.passkey import Example, Grid
from retnet_jax.hardware import accelerators
from retnet_jax.training import metrics

SCORING = "greedy decoding after the question, exact match of every answer token"

# generate_fn(prompts_NxP, lengths_N, num_tokens, progress=None) -> int token ids [N, num_tokens]: greedy
# continuations of left-padded prompts (`sampling.pad_prompts`), reporting the prefill's columns done to `progress`
# (`sampling.Progress`) where given.
GenerateFn = Callable[..., np.ndarray]
PROGRESS_EVERY_S = 10.0  # seconds between progress lines within one long call


def exact_match(generated_NxT: np.ndarray, examples: Sequence[Example]) -> np.ndarray:
  """bool `[N]`: whether row n's first tokens are exactly example n's answer tokens."""
  return np.asarray([len(ex.answer_positions) <= len(row) and
                     np.array_equal(row[:len(ex.answer_positions)], ex.tokens[ex.answer_positions])
                     for row, ex in zip(np.asarray(generated_NxT), examples)])


def prompt_tokens(grid: Grid) -> int:
  """The prompt tokens (each example up to its answer) of every example of `grid`."""
  return sum(ex.answer_positions[0] for row in grid.examples for cell in row for ex in cell)


def seconds_per_token(generate_fn: GenerateFn, grid: Grid, probe_len: int = 4096) -> float:
  """Seconds per prompt token of `generate_fn` on this device, timed on a second call (the first compiles) with the
  first `probe_len` tokens of the grid's first example: with `prompt_tokens`, how long the grid will take (at least:
  a parallel prefill grows with the square of the length)."""
  example = grid.examples[0][0][0]
  prompts_1xP, lengths_1 = sampling.pad_prompts([example.tokens[:min(probe_len, example.answer_positions[0])]])
  answer = len(example.answer_positions)
  np.asarray(generate_fn(prompts_1xP, lengths_1, answer))
  start = time.perf_counter()
  np.asarray(generate_fn(prompts_1xP, lengths_1, answer))
  return (time.perf_counter() - start) / prompts_1xP.shape[1]


def batches(grid: Grid, batch_size: int | None = None) -> Iterator[tuple[int, int, list[Example]]]:
  """The calls of `evaluate`, in its order: (length index, depth index, the examples of one call: at most
  `batch_size`, or a cell's samples where None)."""
  if batch_size is not None and batch_size < 1:
    raise ValueError(f"batch_size={batch_size} must be a positive number of examples (or None: a whole cell).")
  for i, row in enumerate(grid.examples):
    for j, cell in enumerate(row):
      step = batch_size or len(cell)
      for start in range(0, len(cell), step):
        yield i, j, cell[start:start + step]


def check_memory(model: Any, prefill_mode: str | None, grid: Grid, batch_size: int | None = None,
                 prefill_block: int | None = None) -> None:
  """Refuses, before any prompt runs, a grid whose prefill would not fit the memory of the device it runs on (an
  accelerator's, or on the CPU the host memory still available): each distinct shape of `evaluate`'s calls is
  compiled ahead of time (`sampling.Sampler.compile_prefill`) and sized by XLA's memory analysis
  (`accelerators.required_bytes`: arguments, the parameters included, outputs, temporaries), and the evaluation then
  reuses those compilations.

  Args:
    model, prefill_mode, prefill_block: as `greedy_generate`.
    grid, batch_size: as `evaluate`.
  """
  device = jax.local_devices()[0]  # where an uncommitted prefill runs
  memory = sampling_checks.device_memory([device])
  sampler, shapes = sampling.Sampler(), {}
  for i, _, batch in batches(grid, batch_size):
    shapes.setdefault((len(batch), max(ex.answer_positions[0] for ex in batch)), i)
  for (rows, width), i in shapes.items():
    compiled = sampler.compile_prefill(model, rows, width, prefill_mode, prefill_block)
    needed = accelerators.required_bytes(accelerators.memory_sizes(compiled))
    if needed > memory:
      fewer_rows = ", or fewer examples per call (--batch_size)" if rows > 1 else ""
      size = sampling_checks.size_text
      raise ValueError(f"length {grid.lengths[i]}: the prefill of {rows} prompt{'s' * (rows > 1)} of {width} tokens "
                       f"takes about {size(needed)} (XLA's memory analysis of its compiled program), more than the "
                       f"{size(memory)} of {sampling_checks.memory_name([device])}; choose shorter lengths "
                       f"(--lengths){fewer_rows}.")


def evaluate(generate_fn: GenerateFn, grid: Grid, batch_size: int | None = None,
             progress: Callable[[str], Any] | None = None) -> dict[str, Any]:
  """Passkey accuracy per (length, depth).

  Args:
    generate_fn: greedy continuations of left-padded prompts (`greedy_generate`); it gets each example up to its
      answer and generates as many tokens as the longest answer of the batch.
    grid: from `passkey.make_grid`.
    batch_size: examples per `generate_fn` call (None: a cell's samples at once).
    progress: called with a line of the prompt tokens done, the time taken and the time left after each call, and
      every `PROGRESS_EVERY_S` seconds within a long prefill.
  Returns:
    `{"scoring", "samples", "lengths", "depths", "accuracy": [[per depth] per length], "mean_accuracy"}`.
  """
  correct = [[[] for _ in row] for row in grid.examples]
  total, done, began = prompt_tokens(grid), 0, time.perf_counter()
  last_line = began

  def report(tokens_done: int) -> None:
    nonlocal last_line
    last_line = time.perf_counter()
    elapsed = last_line - began
    left = metrics.format_duration(elapsed * (total - tokens_done) / max(tokens_done, 1))
    progress(f"passkey: {tokens_done}/{total} prompt tokens ({100 * tokens_done / total:.0f}%) in "
             f"{metrics.format_duration(elapsed)}, ETA {left}")

  for i, j, batch in batches(grid, batch_size):
    prompts_NxP, lengths_N = sampling.pad_prompts([ex.tokens[:ex.answer_positions[0]] for ex in batch])
    tokens = int(sum(ex.answer_positions[0] for ex in batch))

    def within_call(columns_done: int, columns: int) -> None:  # the prefill's progress, every PROGRESS_EVERY_S
      if time.perf_counter() - last_line >= PROGRESS_EVERY_S and columns_done < columns:
        report(done + tokens * columns_done // columns)

    generated_NxT = generate_fn(prompts_NxP, lengths_N, max(len(ex.answer_positions) for ex in batch),
                                progress=None if progress is None else within_call)
    correct[i][j].append(exact_match(generated_NxT, batch))
    done += tokens
    if progress is not None:
      report(done)
  accuracy = [[float(np.concatenate(cell).mean()) for cell in row] for row in correct]
  return {"scoring": SCORING, "samples": len(grid.examples[0][0]), "lengths": list(grid.lengths),
          "depths": list(grid.depths), "accuracy": accuracy, "mean_accuracy": float(np.mean(accuracy))}


def greedy_generate(model: Any, prefill_mode: str | None = None, prefill_block: int | None = None) -> GenerateFn:
  """A `GenerateFn` of `model`: prompts prefilled in `prefill_mode` (`architectures.prefill_modes`; None: the
  model's default) in blocks of `prefill_block` tokens (`sampling.Sampler.prefill`), then decoded greedily in the
  recurrent form (`sampling.Sampler.generate`, one sampler per function)."""
  sampler = sampling.Sampler()

  def generate(prompts_NxP: np.ndarray, lengths_N: np.ndarray, num_tokens: int,
               progress: sampling.Progress | None = None) -> np.ndarray:
    return sampler.generate(model, prompts_NxP, lengths_N, max_new_tokens=num_tokens, key=jax.random.key(0),
                            temperature=0.0, prefill_mode=prefill_mode, prefill_block=prefill_block,
                            progress=progress).tokens
  return generate


def format_table(results: dict[str, Any]) -> str:
  """A plain-text table of the accuracy: a row per depth, a column per length."""
  lines = [f"passkey accuracy ({results['samples']} samples per cell; {results['scoring']})",
           f"{'depth':>6} " + " ".join(f"{n:>8}" for n in results["lengths"])]
  for j, depth in enumerate(results["depths"]):
    lines.append(f"{depth:>6.2f} " + " ".join(f"{row[j]:>8.2f}" for row in results["accuracy"]))
  lines.append(f"mean accuracy {results['mean_accuracy']:.3f}")
  return "\n".join(lines)


def expectation(trained_task: str | None) -> str:
  """One line for the printed results: the accuracy to expect from a model trained on `trained_task`
  (`workdir.trained_task`: "text", "passkey", another synthetic task, None: unknown). A table of zeros for the
  Shakespeare run read as a failure: a small model answers with the key only after training on passkey examples."""
  if trained_task == "passkey":
    return ("expected: up to 1 at the lengths this run trained on (data.synthetic=passkey) once its training "
            "converges; longer contexts measure length extrapolation.")
  trained = "" if trained_task is None else f" (this run trained on {trained_task})"
  return (f"expected: near 0 for a model not trained on passkey examples{trained}; train one with "
          "--config.data.synthetic=passkey, as notebooks/retnet_vs_transformer.ipynb's passkey section does.")


def plot_heatmap(results: dict[str, Any], path: str | os.PathLike) -> None:
  """Writes a PNG heatmap of `evaluate`'s accuracy: context length across, depth down, each cell annotated."""
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel  (Agg canvas, no pyplot state)

  accuracy_DxN = np.asarray(results["accuracy"], np.float64).T
  lengths, depths = results["lengths"], results["depths"]
  fig = Figure(figsize=(max(5.0, 2.5 + 0.9 * len(lengths)), 2.0 + 0.45 * len(depths)))
  ax = fig.subplots()
  image = ax.imshow(accuracy_DxN, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
  for (j, i), value in np.ndenumerate(accuracy_DxN):
    ax.text(i, j, f"{value:.2f}", ha="center", va="center", fontsize=8)
  ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
  ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths])
  step = f" at step {results['step']}" if "step" in results else ""
  ax.set(xlabel="context length (tokens)", ylabel="needle depth (fraction of the filler)",
         title=f"Passkey accuracy{step}\n{results['samples']} samples per cell")
  fig.colorbar(image, ax=ax, label="exact-match accuracy")
  fig.tight_layout()
  with whole_files.replacing(path) as png:  # a run killed while plotting leaves no half-written PNG
    fig.savefig(png, dpi=100)
