"""Synthetic tasks as data sources: batches of (tokens, loss weights) drawn from the seed and the batch index.

    synthetic.check_config(config)                          # the task's knobs against seq_len and the vocabulary
    tokens_BxL1, weights_BxL = synthetic.batch(config, "train", index, batch_size)
    batches = synthetic.SyntheticBatches(config, batch_size, sharding)  # endless global batches, resumable
    valid = global_batches.eval_batches(synthetic.ValidationRows(config, batch_size, num_batches), batch_size, None,
                                        sharding)

`config.data.synthetic` names a task of SOURCES (None: text data). Each source makes a global batch of token rows
`[B, seq_len + 1]` (inputs `[:, :-1]`, targets `[:, 1:]`) and float32 weights `[B, seq_len]` over the targets: 1 at
the answers, 0 elsewhere, so the loss is taken on the answers only. Batch `index` of a split is a function of
`(config.seed, split, index)` alone, so a resumed run sees the batches an uninterrupted run would. Each row is one
document: with `data.reset_at_documents` a batch also carries document ids, zero throughout (`losses.Batch`).

`mqar` is multi-query associative recall as in Zoology (Arora et al. 2023): `num_pairs` key-value pairs
`k1 v1 ... kn vn`, then a query region of two-token slots where every key is asked once, in random order, each
query a key followed by its value (the answer); the other slots hold the filler token 0. Keys are drawn without
replacement from `[1, V // 2)` and values from `[V // 2, V)` (V: `data.mqar.vocab_size`, default the model's).
`query_placement` picks the query slots: `power` (Zoology's: slot s, counted from 1 after the pairs, with
probability proportional to `s^(power_a - 1)`, without replacement; small `power_a` favours early slots),
`uniform`, or `packed` (the first `num_pairs` slots, right after the pairs).

`passkey` is `passkey.make_example` at length `seq_len + 1` in the tokenizer of `data.tokenizer`: a
`data.passkey.digits`-digit key hidden at `data.passkey.depth` of the filler (None: a uniform depth per example),
asked for at the end; the answers are the key's tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from retnet_jax.input_pipeline import data, global_batches, passkey, tokenizer as tokenizer_lib

SPLITS = ("train", "valid")  # each split its own stream of examples
FILLER = 0  # the token of the query region's unused slots: never a key or a value


@dataclasses.dataclass(frozen=True)
class Source:
  """A synthetic task: `check(config)` raises ValueError for knobs that cannot work (before any work);
  `generate(config, rng, batch_size)` returns int32 tokens `[B, seq_len + 1]` and float32 weights `[B, seq_len]`."""
  check: Callable[[Any], None]
  generate: Callable[[Any, np.random.Generator, int], tuple[np.ndarray, np.ndarray]]


def answer_weights(answer_positions_BxA: np.ndarray, seq_len: int) -> np.ndarray:
  """Loss weights `[B, seq_len]` float32 over the targets: 1 where the target is an answer token.

  Args:
    answer_positions_BxA: int indices of the answer tokens in each row of `[B, seq_len + 1]` tokens (>= 1: the
      first token is never a target).
    seq_len: L.
  Returns:
    Weights whose target index `j` (predicting token `j + 1`) is 1 for each answer position `j + 1`.
  """
  answer_positions_BxA = np.asarray(answer_positions_BxA)
  weights_BxL = np.zeros((len(answer_positions_BxA), seq_len), np.float32)
  np.put_along_axis(weights_BxL, answer_positions_BxA - 1, 1.0, axis=1)
  return weights_BxL


def mqar_vocab_size(config: Any) -> int:
  """The MQAR vocabulary: `data.mqar.vocab_size`, or `model.vocab_size` when unset."""
  vocab_size = config.data.mqar.vocab_size
  return config.model.vocab_size if vocab_size is None else vocab_size


def check_mqar(config: Any) -> None:
  """Refuses MQAR knobs that cannot fit the sequence or the vocabularies, naming the value and the fix."""
  seq_len, vocab_size, num_pairs = config.train.seq_len, mqar_vocab_size(config), config.data.mqar.num_pairs
  if vocab_size > config.model.vocab_size:
    raise ValueError(f"data.mqar.vocab_size={vocab_size} exceeds model.vocab_size={config.model.vocab_size}; set "
                     f"--config.model.vocab_size={vocab_size} or more, or a smaller data.mqar.vocab_size.")
  if vocab_size // 2 - 1 < num_pairs:
    raise ValueError(f"the MQAR vocabulary of {vocab_size} tokens holds {max(vocab_size // 2 - 1, 0)} keys "
                     f"([1, vocab_size // 2)), too few for data.mqar.num_pairs={num_pairs} distinct keys; set "
                     f"data.mqar.vocab_size to {2 * num_pairs + 2} or more, or use fewer pairs.")
  if 4 * num_pairs > seq_len + 1:
    raise ValueError(f"data.mqar.num_pairs={num_pairs} needs {4 * num_pairs} tokens (every pair and its query, two "
                     f"tokens each) but a row holds train.seq_len + 1 = {seq_len + 1}; set train.seq_len to "
                     f"{4 * num_pairs - 1} or more, or use at most {(seq_len + 1) // 4} pairs.")


def mqar_batch(config: Any, rng: np.random.Generator, batch_size: int
               ) -> tuple[np.ndarray, np.ndarray]:
  """A batch of MQAR examples: tokens `[B, seq_len + 1]` int32 and answer weights `[B, seq_len]` float32."""
  mqar, length = config.data.mqar, config.train.seq_len + 1
  num_pairs, vocab_size = mqar.num_pairs, mqar_vocab_size(config)
  num_keys, num_slots = vocab_size // 2, (length - 2 * num_pairs) // 2
  keys_BxN = rng.permuted(np.tile(np.arange(1, num_keys), (batch_size, 1)), axis=1)[:, :num_pairs]
  values_BxN = rng.permuted(np.tile(np.arange(num_keys, vocab_size), (batch_size, 1)), axis=1)[:, :num_pairs]
  # Query j asks pair order[j] in slot slots[j].
  order_BxN = rng.permuted(np.tile(np.arange(num_pairs), (batch_size, 1)), axis=1)
  if mqar.query_placement == "packed":
    slots_BxN = np.tile(np.arange(num_pairs), (batch_size, 1))
  else:
    # Gumbel top-k: the first num_pairs slots by log-weight + Gumbel noise are a draw without replacement.
    exponent = mqar.power_a - 1 if mqar.query_placement == "power" else 0.0
    scores_BxS = exponent * np.log(np.arange(1, num_slots + 1)) + rng.gumbel(size=(batch_size, num_slots))
    slots_BxN = np.argsort(-scores_BxS, axis=1)[:, :num_pairs]
  tokens_BxL1 = np.full((batch_size, length), FILLER, np.int32)
  tokens_BxL1[:, 0:2 * num_pairs:2], tokens_BxL1[:, 1:2 * num_pairs:2] = keys_BxN, values_BxN
  query_BxN = 2 * num_pairs + 2 * slots_BxN
  np.put_along_axis(tokens_BxL1, query_BxN, np.take_along_axis(keys_BxN, order_BxN, axis=1), axis=1)
  np.put_along_axis(tokens_BxL1, query_BxN + 1, np.take_along_axis(values_BxN, order_BxN, axis=1), axis=1)
  return tokens_BxL1, answer_weights(query_BxN + 1, config.train.seq_len)


@functools.cache
def _tokenizer(spec: str, vocab_size: int) -> tokenizer_lib.Tokenizer:
  return tokenizer_lib.load(spec, vocab_size=vocab_size)


def check_passkey(config: Any) -> None:
  """Refuses passkey knobs, tokenizers and lengths that cannot make an example, naming the value and the fix."""
  tokenizer, digits = _tokenizer(config.data.tokenizer, config.model.vocab_size), config.data.passkey.digits
  spelt = "".join(tokenizer.decode(np.asarray(tokenizer.encode(" 0123456789"), np.int32)).split())
  if spelt != "0123456789":
    raise ValueError(f"data.tokenizer={config.data.tokenizer!r} cannot spell the key's digits (' 0123456789' "
                     f"decodes as {spelt!r}): the answers would be unknown tokens; use a tokenizer with digits.")
  try:
    passkey.make_example(tokenizer, config.train.seq_len + 1, 0.0, 0, digits)
  except ValueError as e:
    raise ValueError(f"train.seq_len={config.train.seq_len} cannot hold a passkey example (a row holds train.seq_len "
                     f"+ 1 tokens): {e} Set train.seq_len to that length - 1 or more.") from None


def passkey_batch(config: Any, rng: np.random.Generator, batch_size: int
                  ) -> tuple[np.ndarray, np.ndarray]:
  """A batch of passkey examples: tokens `[B, seq_len + 1]` int32 and answer weights `[B, seq_len]` float32."""
  tokenizer, length = _tokenizer(config.data.tokenizer, config.model.vocab_size), config.train.seq_len + 1
  depth, digits = config.data.passkey.depth, config.data.passkey.digits
  examples = [passkey.make_example(tokenizer, length, rng.uniform() if depth is None else depth,
                                   int(rng.integers(2**32)), digits) for _ in range(batch_size)]
  # A key's token count can differ between examples (BPE), so the weights are set row by row.
  weights_BxL = np.concatenate([answer_weights(ex.answer_positions[None], config.train.seq_len) for ex in examples])
  return np.stack([ex.tokens for ex in examples]).astype(np.int32), weights_BxL


SOURCES: dict[str, Source] = {"mqar": Source(check=check_mqar, generate=mqar_batch),
                              "passkey": Source(check=check_passkey, generate=passkey_batch)}


def check_config(config: Any) -> None:
  """Checks what `config.data.synthetic`'s task needs from the other sections (the model's vocabulary, the rows of
  `train.seq_len + 1` tokens); the data section checked its own fields (`data_config.DataConfig`)."""
  if config.data.synthetic is not None:
    SOURCES[config.data.synthetic].check(config)


def batch(config: Any, split: str, index: int, batch_size: int
          ) -> tuple[np.ndarray, ...]:
  """Global batch `index` of `split` of the task `config.data.synthetic`: (tokens `[B, seq_len + 1]` int32,
  weights `[B, seq_len]` float32), a function of `(config.seed, split, index)` and the task's config alone. With
  `data.reset_at_documents`, also document ids like the tokens, zero: each row is one document."""
  rng = np.random.default_rng([config.seed, SPLITS.index(split), index])
  tokens, weights = SOURCES[config.data.synthetic].generate(config, rng, batch_size)
  return (tokens, weights, np.zeros_like(tokens)) if config.data.reset_at_documents else (tokens, weights)


class SyntheticBatches:
  """Endless global batches `(tokens [B, seq_len + 1] int32, loss weights [B, seq_len] float32[, ids])` of the task
  `config.data.synthetic`: batch i is `batch(config, "train", i, B)`, so the position is i alone, saved by
  `get_state` and restored by `set_state`. With `sharding`, each process places only its own rows."""

  def __init__(self, config: Any, global_batch_size: int,
               sharding: jax.sharding.NamedSharding | None = None):
    self.local = global_batches.process_rows(global_batch_size, jax.process_index(), jax.process_count())  # fails early
    self.config, self.global_batch_size, self.sharding = config, global_batch_size, sharding
    self.index = 0

  def __iter__(self) -> Iterator[tuple[jax.Array, ...]]:
    return self

  def __next__(self) -> tuple[jax.Array, ...]:
    arrays = batch(self.config, "train", self.index, self.global_batch_size)
    self.index += 1
    return global_batches.global_batch(tuple(array[self.local] for array in arrays), self.global_batch_size,
                                       self.sharding)

  def get_state(self) -> dict[str, int]:
    """Index of the next batch, for checkpoints."""
    return dict(index=self.index)

  def set_state(self, state: dict[str, Any]) -> None:
    """Continues from a `get_state()` position."""
    data.check_state_keys(state, ("index",))
    if int(state["index"]) < 0:
      raise ValueError(f"data iterator state {dict(state)} is out of range (index >= 0).")
    self.index = int(state["index"])


class ValidationRows:
  """The first `num_batches` validation batches of the task `config.data.synthetic` as rows
  (`global_batches.EvalRows`): row r is row `r % B` of `batch(config, "valid", r // B, B)`, so
  `global_batches.eval_batches` of all of them gives those batches, the same every time and drawn apart from the
  training batches."""

  def __init__(self, config: Any, global_batch_size: int, num_batches: int):
    self.config, self.global_batch_size, self.num_batches = config, global_batch_size, num_batches

  def __len__(self) -> int:
    return self.num_batches * self.global_batch_size

  def take(self, indices: np.ndarray) -> tuple[np.ndarray, ...]:
    """`(tokens [n, seq_len + 1], weights [n, seq_len][, ids])` of the rows at `indices`, each batch they fall in
    drawn once."""
    batch_n, row_n = np.divmod(np.asarray(indices), self.global_batch_size)
    drawn = {i: batch(self.config, "valid", i, self.global_batch_size) for i in np.unique(batch_n).tolist()}
    rows = [tuple(array[r] for array in drawn[i]) for i, r in zip(batch_n.tolist(), row_n.tolist())]
    return tuple(np.stack(column) for column in zip(*rows))
