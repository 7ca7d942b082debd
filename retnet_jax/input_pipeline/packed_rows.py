"""Rows of a prepared corpus: its memory-mapped shards (`Shard`) packed into `[seq_len + 1]` rows of consecutive
tokens (`PackedRows`, a Grain data source with random access), which `prepared.Corpus.rows` hands to training."""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np


class Shard(NamedTuple):
  """One shard of a split, memory-mapped."""
  tokens: np.ndarray  # uint16 | uint32 [num_tokens]
  starts: np.ndarray  # int64 [num_documents]


class PackedRows:
  """Rows `[seq_len + 1]` int32 of consecutive tokens, packed per shard (each shard's remainder dropped), in
  shard order; with `documents`, a row is `(tokens, document ids)`, ids counted per shard. A Grain data source."""

  def __init__(self, shards: list[Shard], seq_len: int, documents: bool = False):
    self.shards, self.width, self.documents = shards, seq_len + 1, documents
    counts = [len(shard.tokens) // self.width for shard in shards]
    self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

  def __len__(self) -> int:
    return int(self.offsets[-1])

  def __getitem__(self, index: int) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    index = int(index)
    if not 0 <= index < len(self):
      raise IndexError(f"row {index} of {len(self)}")
    shard_index = bisect.bisect_right(self.offsets, index) - 1
    shard = self.shards[shard_index]
    begin = (index - int(self.offsets[shard_index])) * self.width
    tokens = np.array(shard.tokens[begin:begin + self.width], np.int32)
    if not self.documents:
      return tokens
    positions = np.arange(begin, begin + self.width)
    return tokens, (np.searchsorted(shard.starts, positions, side="right") - 1).astype(np.int32)

  def take(self, indices: Iterable[int]) -> np.ndarray | tuple[np.ndarray, None, np.ndarray]:
    """The rows at `indices` as a batch (`global_batches.EvalRows`): tokens `[n, seq_len + 1]`, with `documents`
    `(tokens, None, document ids)` (`losses.Batch`'s form: no loss weights)."""
    rows = [self[i] for i in indices]
    if not self.documents:
      return np.stack(rows)
    return np.stack([r[0] for r in rows]), None, np.stack([r[1] for r in rows])
