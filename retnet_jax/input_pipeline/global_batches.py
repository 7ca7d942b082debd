"""Global batches from each process's rows: which block of a batch a process loads, the global arrays built from
those blocks, and the validation split's batches (every full batch, or a few spread evenly over the split).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np


def process_rows(global_batch: int, process_index: int, process_count: int) -> slice:
  """The contiguous block of a global batch's rows that process `process_index` of `process_count` loads: the check
  that a batch splits over the processes, which every reader of batches (training, validation, synthetic) passes."""
  if global_batch % process_count:
    raise ValueError(f"train.batch_size={global_batch} is not divisible by the {process_count} processes; "
                     "choose a batch size that is a multiple of the process count.")
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} is outside [0, {process_count}).")
  rows = global_batch // process_count
  return slice(process_index * rows, (process_index + 1) * rows)


def global_batch(local: np.ndarray | tuple[np.ndarray | None, ...], global_rows: int,
                 sharding: jax.sharding.NamedSharding | None) -> jax.Array | tuple[jax.Array | None, ...]:
  """One global batch of `global_rows` rows from this process's block of them (`process_rows`).

  Args:
    local: this process's rows `[global_rows / process_count, ...]`: an array, or a tuple of them (None kept, as in
      `(tokens, None, document ids)`).
    global_rows: the rows of the whole batch.
    sharding: how the batch is laid out over the devices; None: one host's array of `local`, the whole batch.
  Returns:
    `local`'s structure, each array a global `jax.Array` `[global_rows, ...]` of its dtype.
  """
  if isinstance(local, tuple):
    return tuple(None if array is None else global_batch(array, global_rows, sharding) for array in local)
  if sharding is None:
    return jnp.asarray(local)
  return jax.make_array_from_process_local_data(sharding, local, (global_rows, *local.shape[1:]))


def check_one_batch(num_sequences: int, global_batch_size: int, holds: str, batch: str, fix: str) -> None:
  """Refuses a split of fewer sequences than one batch: training and evaluation read whole batches only.

  Args:
    num_sequences: the split's sequences of seq_len + 1 tokens.
    global_batch_size: the sequences of one batch.
    holds: what the split holds, for the message, e.g. "the validation data holds 8 sequences".
    batch: the batch as the message names it, e.g. "train.batch_size=16".
    fix: what to change, e.g. "use a smaller train.batch_size or train.seq_len, or more data".

  Raises:
    ValueError "`holds`, fewer than one batch of `batch`; `fix`." when `num_sequences < global_batch_size`, and
    one naming `batch` when it holds no sequence.
  """
  if global_batch_size < 1:
    raise ValueError(f"a batch must hold at least one sequence; got {batch}.")
  if num_sequences < global_batch_size:
    raise ValueError(f"{holds}, fewer than one batch of {batch}; {fix}.")


class EvalRows(Protocol):
  """A validation split as rows, for `eval_batches` (`packed_rows.PackedRows`, `SequenceRows`,
  `synthetic.ValidationRows`): `len()` rows, and `take(indices)` those rows as one batch `[len(indices), ...]` in its
  structure (`losses.Batch`'s, None kept)."""

  def __len__(self) -> int: ...

  def take(self, indices: np.ndarray) -> np.ndarray | tuple[np.ndarray | None, ...]: ...


class SequenceRows:
  """Packed validation sequences in memory as `EvalRows`: `pack`'s `[num_sequences, seq_len + 1]`, and with
  `pack_split`'s document ids alike a batch is `(tokens, None, document ids)`."""

  def __init__(self, sequences: np.ndarray, document_ids: np.ndarray | None = None):
    self.sequences = np.asarray(sequences, dtype=np.int32)
    self.document_ids = None if document_ids is None else np.asarray(document_ids, dtype=np.int32)
    if self.sequences.ndim != 2:
      raise ValueError(f"validation sequences must be packed as [num_sequences, seq_len + 1]; "
                       f"got shape {self.sequences.shape}. Use pack().")
    if self.document_ids is not None and self.document_ids.shape != self.sequences.shape:
      raise ValueError(f"validation document_ids of shape {self.document_ids.shape} do not match the sequences' "
                       f"{self.sequences.shape}; pack both with pack_split().")

  def __len__(self) -> int:
    return len(self.sequences)

  def take(self, indices: np.ndarray) -> np.ndarray | tuple[np.ndarray, None, np.ndarray]:
    """Tokens `[len(indices), seq_len + 1]`, or with document ids `(tokens, None, ids)`."""
    tokens = self.sequences[indices]
    return tokens if self.document_ids is None else (tokens, None, self.document_ids[indices])


def eval_rows(num_sequences: int, global_batch_size: int, max_batches: int | None) -> np.ndarray:
  """Rows of the validation batches, `[num_batches, global_batch_size]`: every full batch in order, or with
  `max_batches` fewer than those, that many batches of rows spread evenly over the whole split (the same every
  time), so that a sample of the split stands for all of it."""
  num_batches = num_sequences // global_batch_size
  if max_batches is None or max_batches >= num_batches:
    return np.arange(num_batches * global_batch_size).reshape(num_batches, global_batch_size)
  num_rows = max_batches * global_batch_size
  return (np.arange(num_rows) * num_sequences // num_rows).reshape(max_batches, global_batch_size)


def eval_batches(rows: EvalRows, global_batch_size: int, max_batches: int | None,
                 sharding: jax.sharding.NamedSharding | None = None, *, holds: str | None = None,
                 batch: str | None = None, fix: str = "use a smaller train.batch_size or train.seq_len, or more data"
                 ) -> Iterator[jax.Array | tuple[jax.Array | None, ...]]:
  """The validation batches of `rows`: those of `eval_rows` (every full batch in order, or `max_batches` spread
  evenly over the split), each `[global_batch_size, ...]` in the structure of `rows.take`, each process taking and
  placing only its own rows (`process_rows`, `global_batch`).

  Args:
    rows: the validation split (`EvalRows`).
    global_batch_size: rows per batch.
    max_batches: at most this many batches; None: every full batch.
    sharding: the batches' layout over the devices; None: one host's arrays.
    holds, batch, fix: how `check_one_batch` words a split of fewer rows than one batch; by default "the
      validation data holds N sequences", "train.batch_size=B" and the fix given.
  Returns:
    An iterator of the batches; the checks run on the call, not on the first `next()`.
  """
  check_one_batch(len(rows), global_batch_size, holds or f"the validation data holds {len(rows)} sequences",
                  batch or f"train.batch_size={global_batch_size}", fix)
  local = process_rows(global_batch_size, jax.process_index(), jax.process_count())
  rows_NxB = eval_rows(len(rows), global_batch_size, max_batches)
  return (global_batch(rows.take(batch_rows[local]), global_batch_size, sharding) for batch_rows in rows_NxB)
