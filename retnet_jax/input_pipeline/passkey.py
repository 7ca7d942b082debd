"""Synthetic passkey retrieval examples: a number hidden at a controlled depth in filler text, then asked for.

    example = make_example(tokenizer, length=1024, depth=0.5, seed=0)  # token ids [1024], answer at the end
    grid = make_grid(tokenizer, lengths=(512, 1024), depths=(0.0, 0.5, 1.0), samples=8)

An example is an introduction, filler sentences with the needle ("The pass key is 12345. Remember it. 12345 is the
pass key.") inserted after a fraction `depth` of them, and the question "What is the pass key? The pass key is"
followed by the key: its answer tokens, the last of the example. Each piece is tokenized on its own and the ids are
joined, so the key has the same ids in the needle and in the answer whatever the tokenizer. A model is scored on
them by `retnet_jax.evaluation.passkey_eval`; `retnet_jax.input_pipeline.synthetic` trains on them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from retnet_jax.core import host_memory
from retnet_jax.input_pipeline.tokenizer import Tokenizer

INTRO = "A pass key is hidden in the text below. Find it and remember it."
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = (" The pass key is", ". Remember it.", " is the pass key.")  # the key goes between the pieces
QUESTION = " What is the pass key? The pass key is"
MAX_DIGITS = 18  # the longest key below 2**63


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


def make_example(tokenizer: Tokenizer, length: int, depth: float, seed: int, digits: int = 5) -> Example:
  """Builds one passkey example of exactly `length` tokens; pure, the same for the same arguments.

  Args:
    tokenizer: anything with `encode(text) -> int ids` (`retnet_jax.input_pipeline.tokenizer`: the byte or a tokenizers
    tokenizer). length: tokens in the example, the answer included.
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
  if not 1 <= digits <= MAX_DIGITS:
    raise ValueError(f"digits={digits} must lie in [1, {MAX_DIGITS}] (keys are drawn as 64-bit integers).")
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


def make_grid(tokenizer: Tokenizer, lengths: Sequence[int], depths: Sequence[float], samples: int,
              seed: int = 0) -> Grid:
  """`samples` examples per (length, depth), every one checked before any model runs; sample s has seed
  `seed + s` in every cell, so cells differ only in their length and depth."""
  if not lengths or not depths:
    raise ValueError(f"give at least one length and one depth; got lengths={list(lengths)}, depths={list(depths)}.")
  if samples < 1:
    raise ValueError(f"samples={samples} must be a positive number of examples per (length, depth).")
  if seed < 0:
    raise ValueError(f"seed={seed} must be a non-negative integer (sample s draws its key from seed + s).")
  num_bytes = 4 * sum(max(int(n), 0) for n in lengths) * len(depths) * samples  # int32 token ids
  memory, bound = host_memory.available()
  if num_bytes > memory // 4:
    raise ValueError(f"lengths={list(lengths)} at {len(depths)} depths and {samples} samples make "
                     f"{num_bytes / 2**30:.1f} GiB of example tokens, more than a quarter of the {memory / 2**30:.1f} "
                     f"GiB of host memory available here, bounded by {bound}; choose shorter lengths, or fewer depths "
                     "or samples.")
  examples = [[[make_example(tokenizer, length, depth, seed + s) for s in range(samples)] for depth in depths]
              for length in lengths]
  return Grid(tuple(int(n) for n in lengths), tuple(float(d) for d in depths), examples)
