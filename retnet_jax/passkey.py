"""Synthetic passkey retrieval: a number hidden at a controlled depth in filler text, then asked for.

    example = make_example(tokenizer, length=1024, depth=0.5, seed=0)  # token ids [1024], answer at the end
    grid = make_grid(tokenizer, lengths=(512, 1024), depths=(0.0, 0.5, 1.0), samples=8)
    results = evaluate(greedy_generate(model, "chunkwise"), grid)  # accuracy [length][depth]
    plot_heatmap(results, "passkey.png")

An example is an introduction, filler sentences with the needle ("The pass key is 12345. Remember it. 12345 is the
pass key.") inserted after a fraction `depth` of them, and the question "What is the pass key? The pass key is"
followed by the key: its answer tokens, the last of the example. Each piece is tokenized on its own and the ids are
joined, so the key has the same ids in the needle and in the answer whatever the tokenizer. Scoring: greedy
decoding after the question, exact match of every answer token (the same as every teacher-forced argmax being
right).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np

from retnet_jax import sampling

if TYPE_CHECKING:  # data imports synthetic, which builds passkey training examples from this module
  from retnet_jax import data

INTRO = "A pass key is hidden in the text below. Find it and remember it."
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = (" The pass key is", ". Remember it.", " is the pass key.")  # the key goes between the pieces
QUESTION = " What is the pass key? The pass key is"
SCORING = "greedy decoding after the question, exact match of every answer token"

# generate_fn(prompts_NxP, lengths_N, num_tokens) -> int token ids [N, num_tokens]: greedy continuations of
# left-padded prompts (`sampling.pad_prompts`).
GenerateFn = Callable[[np.ndarray, np.ndarray, int], np.ndarray]


class Example(NamedTuple):
  """One passkey example: `tokens` int32 `[length]`, `answer_positions` int32 `[A]` (the indices in `tokens` of the
  key's tokens after the question: the last A), and `needle_start`, the index of the needle's first token."""
  tokens: np.ndarray
  answer_positions: np.ndarray
  needle_start: int


class Grid(NamedTuple):
  """The examples of an evaluation: `examples[i][j]` holds the samples of `lengths[i]` and `depths[j]`."""
  lengths: tuple[int, ...]
  depths: tuple[float, ...]
  examples: list[list[list[Example]]]


def make_example(tokenizer: data.Tokenizer, length: int, depth: float, seed: int, digits: int = 5) -> Example:
  """Builds one passkey example of exactly `length` tokens; pure, the same for the same arguments.

  Args:
    tokenizer: anything with `encode(text) -> int ids` (`data.load_tokenizer`: the byte or a tokenizers tokenizer).
    length: tokens in the example, the answer included.
    depth: where the needle sits in the filler, in [0, 1]: the fraction of the filler tokens before it (0: right
      after the introduction, 1: right before the question).
    seed: chooses the key, a `digits`-digit number drawn by `np.random.default_rng(seed)`.
    digits: the key's number of digits.
  Returns:
    `Example(tokens, answer_positions, needle_start)`; the loss or the accuracy of a model on the example is that of
    predicting `tokens[answer_positions]` from the tokens before each.
  """
  if not 0 <= depth <= 1:
    raise ValueError(f"depth={depth} must lie in [0, 1] (the fraction of the filler before the needle).")
  if digits < 1:
    raise ValueError(f"digits={digits} must be a positive number of digits.")
  key = str(np.random.default_rng(seed).integers(10 ** (digits - 1), 10 ** digits))
  encode = lambda text: np.asarray(tokenizer.encode(text), np.int32).reshape(-1)
  key_ids = encode(" " + key)
  needle = np.concatenate([encode(NEEDLE[0]), key_ids, encode(NEEDLE[1]), key_ids, encode(NEEDLE[2])])
  intro, question = encode(INTRO), encode(QUESTION)
  num_filler = length - len(intro) - len(needle) - len(question) - len(key_ids)
  if num_filler < 0:
    raise ValueError(f"a passkey example of {length} tokens is too short: this tokenizer needs "
                     f"{length - num_filler} tokens without filler; use a length of at least {length - num_filler}.")
  sentence = encode(FILLER)
  filler = np.tile(sentence, -(-num_filler // len(sentence)))[:num_filler]
  before = int(depth * num_filler + 0.5)  # rounded half up
  tokens = np.concatenate([intro, filler[:before], needle, filler[before:], question, key_ids])
  return Example(tokens, np.arange(length - len(key_ids), length, dtype=np.int32), len(intro) + before)


def make_grid(tokenizer: data.Tokenizer, lengths: Sequence[int], depths: Sequence[float], samples: int,
              seed: int = 0) -> Grid:
  """`samples` examples per (length, depth), every one checked before any model runs; sample s has seed
  `seed + s` in every cell, so cells differ only in their length and depth."""
  if not lengths or not depths:
    raise ValueError(f"give at least one length and one depth; got lengths={list(lengths)}, depths={list(depths)}.")
  if samples < 1:
    raise ValueError(f"samples={samples} must be a positive number of examples per (length, depth).")
  examples = [[[make_example(tokenizer, length, depth, seed + s) for s in range(samples)] for depth in depths]
              for length in lengths]
  return Grid(tuple(int(n) for n in lengths), tuple(float(d) for d in depths), examples)


def exact_match(generated_NxT: np.ndarray, examples: Sequence[Example]) -> np.ndarray:
  """bool `[N]`: whether row n's first tokens are exactly example n's answer tokens."""
  return np.asarray([len(ex.answer_positions) <= len(row) and
                     np.array_equal(row[:len(ex.answer_positions)], ex.tokens[ex.answer_positions])
                     for row, ex in zip(np.asarray(generated_NxT), examples)])


def evaluate(generate_fn: GenerateFn, grid: Grid, batch_size: int | None = None) -> dict[str, Any]:
  """Passkey accuracy per (length, depth).

  Args:
    generate_fn: greedy continuations of left-padded prompts (`greedy_generate`); it gets each example up to its
      answer and generates as many tokens as the longest answer of the batch.
    grid: from `make_grid`.
    batch_size: examples per `generate_fn` call (None: a cell's samples at once).
  Returns:
    `{"scoring", "samples", "lengths", "depths", "accuracy": [[per depth] per length], "mean_accuracy"}`.
  """
  if batch_size is not None and batch_size < 1:
    raise ValueError(f"batch_size={batch_size} must be a positive number of examples (or None: a whole cell).")
  accuracy = []
  for row in grid.examples:
    accuracy.append([])
    for cell in row:
      correct = []
      step = batch_size or len(cell)
      for start in range(0, len(cell), step):
        batch = cell[start:start + step]
        prompts_NxP, lengths_N = sampling.pad_prompts([ex.tokens[:ex.answer_positions[0]] for ex in batch])
        generated_NxT = generate_fn(prompts_NxP, lengths_N, max(len(ex.answer_positions) for ex in batch))
        correct.append(exact_match(generated_NxT, batch))
      accuracy[-1].append(float(np.concatenate(correct).mean()))
  return {"scoring": SCORING, "samples": len(grid.examples[0][0]), "lengths": list(grid.lengths),
          "depths": list(grid.depths), "accuracy": accuracy, "mean_accuracy": float(np.mean(accuracy))}


def greedy_generate(model: Any, prefill_mode: str | None = None) -> GenerateFn:
  """A `GenerateFn` of `model`: prompts prefilled in `prefill_mode` (`architectures.prefill_modes`; None: the
  model's default), then decoded greedily in the recurrent form (`sampling.generate`)."""
  def generate(prompts_NxP: np.ndarray, lengths_N: np.ndarray, num_tokens: int) -> np.ndarray:
    return sampling.generate(model, prompts_NxP, lengths_N, max_new_tokens=num_tokens, key=jax.random.key(0),
                             temperature=0.0, prefill_mode=prefill_mode).tokens
  return generate


def format_table(results: dict[str, Any]) -> str:
  """A plain-text table of the accuracy: a row per depth, a column per length."""
  lines = [f"passkey accuracy ({results['samples']} samples per cell; {results['scoring']})",
           f"{'depth':>6} " + " ".join(f"{n:>8}" for n in results["lengths"])]
  for j, depth in enumerate(results["depths"]):
    lines.append(f"{depth:>6.2f} " + " ".join(f"{row[j]:>8.2f}" for row in results["accuracy"]))
  lines.append(f"mean accuracy {results['mean_accuracy']:.3f}")
  return "\n".join(lines)


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
  fig.savefig(path, dpi=100)
