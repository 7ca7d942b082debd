"""Prepared corpora: token shards on disk, written once by `scripts/prepare_data.py`, memory-mapped by training.

A prepared directory holds, per split (`train`, `validation`), shards `SPLIT-NNNNN.tokens` (the token stream,
uint16 when the vocabulary fits, else uint32) and `SPLIT-NNNNN.starts` (int64 offsets of its documents' first
tokens), and `metadata.json` (the tokenizer's name, fingerprint, size and separator; the sources; each shard's
token and document counts), written last: a directory without it is not a complete corpus. A shard is a `Split`
of `retnet_jax.data`: documents joined by the tokenizer's separator, which opens the document after it.

    write(out, texts, tokenizer, ...)          # documents -> shards (resumable), the metadata last
    corpus = open_corpus(path, tokenizer)      # checked against the tokenizer and the files' sizes
    rows = corpus.rows("train", seq_len)       # PackedRows: random access to [seq_len + 1] rows of every shard
"""

from __future__ import annotations

import bisect
import hashlib
import json
import multiprocessing
import os
from collections.abc import Iterable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from retnet_jax import tokenizer as tokenizer_lib

FORMAT = "retnet_jax.prepared"
VERSION = 1
METADATA = "metadata.json"
PROGRESS = "progress.json"  # a prepare in progress: its finished shards and the documents they consumed
SPLITS = ("train", "validation")


class CorpusError(ValueError):
  """A directory that is not a complete prepared corpus for this run."""


def fingerprint(tokenizer: tokenizer_lib.Tokenizer) -> str:
  """A digest of the tokenizer's whole definition: ids from another tokenizer must not train this model."""
  if isinstance(tokenizer, tokenizer_lib.ByteTokenizer):
    return "byte"
  return hashlib.sha256(tokenizer.tokenizer.to_str().encode()).hexdigest()[:16]


def token_dtype(vocab_size: int) -> np.dtype:
  """uint16 when every id fits, else uint32."""
  return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


class Shard(NamedTuple):
  """One shard of a split, memory-mapped."""
  tokens: np.ndarray  # uint16 | uint32 [num_tokens]
  starts: np.ndarray  # int64 [num_documents]


def _shard_paths(directory: Path, split: str, index: int) -> tuple[Path, Path]:
  stem = directory / f"{split}-{index:05d}"
  return stem.with_suffix(".tokens"), stem.with_suffix(".starts")


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

  def take(self, indices: Iterable[int]) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """The rows at `indices`, stacked: `[n, seq_len + 1]` (and the ids alike)."""
    rows = [self[i] for i in indices]
    if not self.documents:
      return np.stack(rows)
    return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])


class Corpus:
  """An opened prepared directory: its metadata and memory-mapped shards."""

  def __init__(self, path: Path, metadata: dict[str, Any], shards: dict[str, list[Shard]], label: str):
    self.path, self.metadata, self.shards = path, metadata, shards
    self.label = label  # how errors name it: `data.prepared='DIR'`, or the source of a cached corpus

  def num_tokens(self, split: str) -> int:
    return sum(len(shard.tokens) for shard in self.shards[split])

  def rows(self, split: str, seq_len: int, documents: bool = False) -> PackedRows:
    return PackedRows(self.shards[split], seq_len, documents)


def open_corpus(path: str | os.PathLike, tokenizer: tokenizer_lib.Tokenizer, field: str = "data.prepared"
                ) -> Corpus:
  """Opens a prepared directory, refusing (CorpusError naming the problem and the fix) one that is not a complete
  prepared corpus, was written by another tokenizer, or whose shards are missing or truncated."""
  path = Path(path)
  remedy = f"rerun scripts/prepare_data.py --out={path} to finish or rebuild it"
  if not path.is_dir():
    raise CorpusError(f"{field}={str(path)!r} is not a directory; give the --out directory of "
                      "scripts/prepare_data.py.")
  meta_path = path / METADATA
  if not meta_path.is_file():
    state = ("is half-written (a prepare was interrupted)" if (path / PROGRESS).exists()
             else "is not a prepared corpus (no metadata.json)")
    raise CorpusError(f"{field}={str(path)!r} {state}; "
                      f"{remedy if (path / PROGRESS).exists() else 'prepare one with scripts/prepare_data.py'}.")
  try:
    metadata = json.loads(meta_path.read_text())
    if metadata.get("format") != FORMAT or metadata.get("version") != VERSION:
      raise ValueError(f"format {metadata.get('format')!r} version {metadata.get('version')!r}")
    dtype, recorded = np.dtype(metadata["dtype"]), metadata["tokenizer"]
    listed = {split: metadata["splits"][split] for split in SPLITS}
  except (ValueError, KeyError, TypeError) as e:
    raise CorpusError(f"{field}={str(path)!r}: its metadata.json is unreadable or of another format ({e}); "
                      f"{remedy}.") from None
  mine = fingerprint(tokenizer)
  if recorded.get("fingerprint") != mine or recorded.get("vocab_size") != tokenizer.vocab_size:
    raise CorpusError(
        f"{field}={str(path)!r} was tokenized by {recorded.get('name')!r} (vocab {recorded.get('vocab_size')}, "
        f"fingerprint {recorded.get('fingerprint')}), not by this run's data.tokenizer (vocab "
        f"{tokenizer.vocab_size}, fingerprint {mine}); set data.tokenizer to the one it was prepared with, or "
        "prepare the corpus again with this tokenizer.")
  shards = {}
  for split, entries in listed.items():
    shards[split] = []
    for index, entry in enumerate(entries):
      tokens_path, starts_path = _shard_paths(path, split, index)
      for file, count, item_dtype in ((tokens_path, entry["tokens"], dtype),
                                      (starts_path, entry["documents"], np.dtype(np.int64))):
        size = file.stat().st_size if file.is_file() else None
        if size != count * item_dtype.itemsize:
          what = "is missing" if size is None else f"holds {size} bytes, not {count * item_dtype.itemsize}"
          raise CorpusError(f"{field}={str(path)!r}: shard {file.name} {what} (damaged or truncated); {remedy}.")
      shards[split].append(Shard(np.memmap(tokens_path, dtype, "r", shape=(entry["tokens"],)),
                                 np.memmap(starts_path, np.int64, "r", shape=(entry["documents"],))))
  return Corpus(path, metadata, shards, f"{field}={str(path)!r}" if field.startswith("data.prepared") else field)


class _ShardWriter:
  """Appends documents of one split to numbered shards of about `shard_tokens` tokens, streaming to disk."""

  def __init__(self, directory: Path, split: str, dtype: np.dtype, eos_id: int | None, shard_tokens: int,
               done: list[dict[str, int]]):
    self.directory, self.split, self.dtype, self.eos_id, self.shard_tokens = directory, split, dtype, eos_id, shard_tokens
    self.done = done  # finished shards' entries
    self._file, self._starts, self._tokens = None, [], 0

  def add(self, ids: np.ndarray) -> None:
    if self._file is None:
      self._file = open(_shard_paths(self.directory, self.split, len(self.done))[0], "wb")  # pylint: disable=consider-using-with
    if self._starts and self.eos_id is not None:
      ids = np.concatenate([[self.eos_id], ids])  # the separator opens this document
    self._starts.append(self._tokens)
    self._file.write(np.asarray(ids, self.dtype).tobytes())
    self._tokens += len(ids)

  @property
  def full(self) -> bool:
    return self._tokens >= self.shard_tokens

  def close(self) -> None:
    """Finishes the open shard (if it holds any document): its files are complete once listed in `done`."""
    if self._file is None:
      return
    self._file.close()
    starts_path = _shard_paths(self.directory, self.split, len(self.done))[1]
    np.asarray(self._starts, np.int64).tofile(starts_path)
    self.done.append({"tokens": self._tokens, "documents": len(self._starts)})
    self._file, self._starts, self._tokens = None, [], 0


def _write_json(path: Path, value: dict[str, Any]) -> None:
  """Writes atomically: a reader sees the old file or the new one, never a part."""
  partial = path.with_suffix(".partial")
  partial.write_text(json.dumps(value, indent=1))
  os.replace(partial, path)


def _is_held_out(index: int, fraction: float) -> bool:
  """Whether document `index` is validation: `fraction` of the documents, spread evenly through the corpus."""
  return int((index + 1) * fraction) > int(index * fraction)


class _Encoder:
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


def _batched(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
  batch = []
  for item in items:
    batch.append(item)
    if len(batch) == size:
      yield batch
      batch = []
  if batch:
    yield batch


def write(out: str | os.PathLike, documents: Iterable[str], validation_documents: Iterable[str] | None,
          tokenizer_spec: str, sources: list[str], validation_fraction: float, shard_tokens: int = 1 << 27,
          max_tokens: int | None = None, workers: int = 1, batch_documents: int = 1024,
          progress: Any = None) -> dict[str, Any]:
  """Tokenizes `documents` (texts in order) into a prepared corpus in `out`, resuming where an interrupted call
  with the same arguments stopped (after its last finished shard).

  Validation: `validation_documents` when given, else every document `_is_held_out` at `validation_fraction`.
  Host memory stays that of one batch of documents and the shards' document offsets.

  Args:
    out: the directory (created).
    documents: the training source's texts (its documents in order); an empty text is skipped.
    validation_documents: the validation texts, or None to hold out documents of `documents`.
    tokenizer_spec: `config.data.tokenizer`.
    sources: what was read, for the metadata.
    validation_fraction: the share of held-out documents.
    shard_tokens: tokens per shard (a shard ends after the batch of documents that reaches it).
    max_tokens: stop once the training split holds this many tokens (None: read everything).
    workers: tokenizing processes (the byte tokenizer always runs in this one).
    batch_documents: documents per tokenizing task.
    progress: called as progress(documents, tokens) after each batch.
  Returns:
    The metadata written to `out/metadata.json`.
  """
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  tokenizer = tokenizer_lib.load(tokenizer_spec)
  dtype = token_dtype(tokenizer.vocab_size)
  settings = {"tokenizer": _recorded(tokenizer, tokenizer_spec), "sources": sources, "validation_fraction": validation_fraction,
              "held_out": validation_documents is None, "shard_tokens": shard_tokens, "max_tokens": max_tokens}
  if (out / METADATA).exists():
    raise CorpusError(f"--out={str(out)!r} already holds a prepared corpus; choose another --out or delete it.")
  state = {"settings": settings, "consumed": 0, "shards": {split: [] for split in SPLITS}}
  if (out / PROGRESS).exists():
    saved = json.loads((out / PROGRESS).read_text())
    if saved["settings"] != settings:
      raise CorpusError(f"--out={str(out)!r} holds an interrupted prepare of other sources or settings; rerun "
                        "that command to finish it, or choose another --out.")
    state = saved
  for split in SPLITS:  # shards being written when the prepare stopped
    for leftover in out.glob(f"{split}-*.*"):
      if int(leftover.stem.rsplit("-", 1)[1]) >= len(state["shards"][split]):
        leftover.unlink()
  writers = {split: _ShardWriter(out, split, dtype, tokenizer.eos_id, shard_tokens, state["shards"][split])
             for split in SPLITS}
  consumed, train_tokens = state["consumed"], sum(e["tokens"] for e in state["shards"]["train"])

  def checkpoint() -> None:
    for writer in writers.values():
      writer.close()
    state["consumed"] = consumed
    _write_json(out / PROGRESS, state)

  # The byte tokenizer is a copy: shipping texts to workers and ids back costs more than it (3x slower measured)
  encoder = _Encoder(tokenizer_spec, 1 if tokenizer_spec == "byte" else workers)
  remaining = (text for i, text in enumerate(documents) if i >= state["consumed"])
  for encoded in encoder.map(_batched(remaining, batch_documents)):
    if max_tokens is not None and train_tokens >= max_tokens:
      break
    for ids in encoded:
      index, consumed = consumed, consumed + 1
      held_out = validation_documents is None and _is_held_out(index, validation_fraction)
      if len(ids):
        writers["validation" if held_out else "train"].add(ids)
        train_tokens += 0 if held_out else len(ids)
    if progress is not None:
      progress(consumed, train_tokens)
    if writers["train"].full:
      checkpoint()
  checkpoint()
  if validation_documents is not None and not state["shards"]["validation"]:
    for encoded in encoder.map(_batched(validation_documents, batch_documents)):
      for ids in encoded:
        if len(ids):
          writers["validation"].add(ids)
          if writers["validation"].full:
            writers["validation"].close()
    checkpoint()
  for split in SPLITS:
    if not state["shards"][split]:
      raise CorpusError(f"the {split} split of {sources} came out empty: "
                        + ("give more documents or data.validation_files (a .txt file is one document)"
                           if split == "validation" else "the sources hold no text") + ".")
  metadata = _write_metadata(out, dtype, state["shards"], **settings)
  (out / PROGRESS).unlink()
  return metadata


def write_splits(out: str | os.PathLike, splits: dict[str, tuple[np.ndarray, np.ndarray]],
                 tokenizer: tokenizer_lib.Tokenizer, tokenizer_spec: str, sources: list[str]) -> dict[str, Any]:
  """A prepared corpus in `out` of splits already in memory: name -> (tokens, document starts), one shard each
  (`data.load_documents`' splits, for the cache of plain files). The metadata is written last."""
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  dtype = token_dtype(tokenizer.vocab_size)
  entries = {}
  for split, (tokens, starts) in splits.items():
    tokens_path, starts_path = _shard_paths(out, split, 0)
    np.asarray(tokens).astype(dtype).tofile(tokens_path)
    np.asarray(starts, np.int64).tofile(starts_path)
    entries[split] = [{"tokens": len(tokens), "documents": len(starts)}]
  return _write_metadata(out, dtype, entries, tokenizer=_recorded(tokenizer, tokenizer_spec), sources=sources)


def _recorded(tokenizer: tokenizer_lib.Tokenizer, spec: str) -> dict[str, Any]:
  """What the metadata keeps of the tokenizer, for `open_corpus` to check a run's against."""
  return {"name": spec, "fingerprint": fingerprint(tokenizer), "vocab_size": tokenizer.vocab_size,
          "eos_id": tokenizer.eos_id}


def _write_metadata(out: Path, dtype: np.dtype, shards: dict[str, list[dict[str, int]]], **fields: Any
                    ) -> dict[str, Any]:
  """Writes metadata.json, last: `fields`, the shards' entries per split and their totals; returns it."""
  metadata = {"format": FORMAT, "version": VERSION, "dtype": dtype.name, **fields, "splits": shards,
              "documents": {s: sum(e["documents"] for e in entries) for s, entries in shards.items()},
              "tokens": {s: sum(e["tokens"] for e in entries) for s, entries in shards.items()}}
  _write_json(out / METADATA, metadata)
  return metadata
