"""Tokenizing documents in batches, in worker processes for a tokenizer.json (`scripts/prepare_data.py --workers`).

    encoder = Encoder(tokenizer_spec, workers)
    for ids in encoder.map(batched(texts, 1024)): ...   # per batch, one int array per document, in order
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterable, Iterator
from concurrent import futures
from typing import Any

import numpy as np

from retnet_jax.input_pipeline import tokenizer as tokenizer_lib


class Encoder:
  """Tokenizes batches of texts, in worker processes when `workers` > 1 (results in order, a bounded window)."""

  def __init__(self, spec: str, workers: int):
    self.spec, self.workers = spec, workers

  def map(self, batches: Iterable[list[str]]) -> Iterator[list[np.ndarray]]:
    if self.workers <= 1:
      tokenizer = tokenizer_lib.load(self.spec)
      yield from (tokenizer.encode_batch(texts) for texts in batches)
      return
    spawn = multiprocessing.get_context("spawn")  # forking a process that runs JAX's threads can deadlock
    with futures.ProcessPoolExecutor(self.workers, mp_context=spawn, initializer=_init_worker,
                                     initargs=(self.spec,)) as pool:
      window: list[futures.Future] = []
      for texts in batches:
        window.append(pool.submit(_encode, texts))
        if len(window) >= 2 * self.workers:
          yield _unpack(*window.pop(0).result())
      yield from (_unpack(*f.result()) for f in window)


_WORKER_TOKENIZER = None


def _init_worker(spec: str) -> None:
  global _WORKER_TOKENIZER  # pylint: disable=global-statement
  _WORKER_TOKENIZER = tokenizer_lib.load(spec)


def _encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
  """A batch's ids as one array and the documents' lengths: one buffer to send back, not one per document."""
  ids = _WORKER_TOKENIZER.encode_batch(texts)
  return np.concatenate(ids) if ids else np.zeros(0, np.int32), np.asarray([len(d) for d in ids], np.int64)


def _unpack(ids: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
  return np.split(ids, np.cumsum(lengths)[:-1])


def batched(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
  """`items` in lists of `size` (the last may be shorter)."""
  batch = []
  for item in items:
    batch.append(item)
    if len(batch) == size:
      yield batch
      batch = []
  if batch:
    yield batch
