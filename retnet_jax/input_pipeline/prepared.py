"""Prepared corpora: token shards on disk, written once by `scripts/prepare_data.py`, memory-mapped by training.

A prepared directory carries the project's mark (`owned_folders`: written first, recording each name written before
it is created) and holds, per split (`train`, `validation`), shards `SPLIT-NNNNN.tokens` (the token stream,
uint16 when the vocabulary fits, else uint32) and `SPLIT-NNNNN.starts` (int64 offsets of its documents' first
tokens), and `metadata.json` (the tokenizer's name, fingerprint, size and separator; the sources; each shard's
token and document counts), written last: a directory without it is not a complete corpus. A shard is a `Split`
of `retnet_jax.input_pipeline.data`: documents joined by the tokenizer's separator, which opens the document after it.

    write(out, texts, tokenizer, ...)          # documents -> shards (resumable), the metadata last
    corpus = open_corpus(path, tokenizer)      # checked against the tokenizer and the files' sizes
    rows = corpus.rows("train", seq_len)       # PackedRows: random access to [seq_len + 1] rows of every shard
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from retnet_jax.core import owned_folders
from retnet_jax.input_pipeline import encoding, packed_rows, tokenizer as tokenizer_lib

FORMAT = "retnet_jax.prepared"
FOLDER_FORMAT = "prepared corpus"  # its format in the folder's mark
VERSION = 1
METADATA = "metadata.json"
PROGRESS = "progress.json"  # a prepare in progress: its finished shards and the documents they consumed
_PARTIAL = ".partial"  # the suffix of a JSON file being written (`_write_json`)
_JSON_NAMES = tuple(name for json_name in (PROGRESS, METADATA)  # what `write` writes beside the shards
                    for name in (json_name, Path(json_name).with_suffix(_PARTIAL).name))
SPLITS = ("train", "validation")
_SHARD_NAME = re.compile(r"(train|validation)-(\d{5,})\.(tokens|starts)")  # `_shard_paths`' names


class CorpusError(ValueError):
  """A directory that is not a complete prepared corpus for this run."""


class WriteError(OSError):
  """A shard or metadata file the disk did not take whole (full, read-only): names the file and its bytes."""


def _tofile(array: np.ndarray, path: Path) -> None:
  array.tofile(path)  # OSError "N requested and M written" on a short write


def _write_array(array: np.ndarray, path: Path) -> None:
  """Writes `array`'s bytes to `path`; WriteError naming the file and its bytes when the disk takes fewer."""
  try:
    _tofile(array, path)
  except OSError as e:
    raise WriteError(f"writing {path} ({array.nbytes:,} bytes) failed ({e.strerror or e})") from None


def fingerprint(tokenizer: tokenizer_lib.Tokenizer) -> str:
  """A digest of the tokenizer's whole definition: ids from another tokenizer must not train this model."""
  if isinstance(tokenizer, tokenizer_lib.ByteTokenizer):
    return "byte"
  return hashlib.sha256(tokenizer.tokenizer.to_str().encode()).hexdigest()[:16]


def token_dtype(vocab_size: int) -> np.dtype:
  """uint16 when every id fits, else uint32."""
  return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def _shard_paths(directory: Path, split: str, index: int) -> tuple[Path, Path]:
  stem = directory / f"{split}-{index:05d}"
  return stem.with_suffix(".tokens"), stem.with_suffix(".starts")


def _shard_problem(directory: Path, split: str, index: int, entry: dict[str, int], dtype: np.dtype) -> str | None:
  """What is wrong with a finished shard's files against its entry (`NAME is missing`, or another size), or None."""
  for file, count, item_dtype in zip(_shard_paths(directory, split, index), (entry["tokens"], entry["documents"]),
                                     (dtype, np.dtype(np.int64))):
    size, expected = (file.stat().st_size if file.is_file() else None), count * item_dtype.itemsize
    if size != expected:
      return f"{file.name} " + ("is missing" if size is None else f"holds {size} bytes, not {expected}")
  return None


def _source_fingerprints(sources: list[str]) -> dict[str, list[int]]:
  """Each source file's [size, modification time in ns]: a resumed prepare refuses sources changed since it began."""
  return {source: [(stat := Path(source).stat()).st_size, stat.st_mtime_ns]
          for source in sources if Path(source).is_file()}


def _json_object(path: Path) -> dict[str, Any]:
  """The JSON object in `path` (ValueError when it is not JSON or not an object)."""
  value = json.loads(path.read_text())
  if not isinstance(value, dict):
    raise ValueError(f"{type(value).__name__} {value!r:.40}, not an object")
  return value


def _shard_entries(splits: Any) -> dict[str, list[dict[str, int]]]:
  """`splits` of metadata.json or progress.json checked: per split, entries {"tokens": N, "documents": N}."""
  for split in SPLITS:
    for index, entry in enumerate(splits[split]):
      if not (isinstance(entry, dict) and all(isinstance(entry.get(k), int) and entry[k] >= 0
                                              for k in ("tokens", "documents"))):
        raise ValueError(f"shard {index} of {split!r} is {entry!r:.60}, not "
                         '{"tokens": COUNT, "documents": COUNT}')
  return {split: splits[split] for split in SPLITS}


def _reason(error: Exception) -> str:
  """An error of reading a JSON file, as words: a KeyError names the missing field."""
  return f"no field {error}" if isinstance(error, KeyError) else str(error)


class Corpus:
  """An opened prepared directory: its metadata and memory-mapped shards."""

  def __init__(self, path: Path, metadata: dict[str, Any], shards: dict[str, list[packed_rows.Shard]], label: str):
    self.path, self.metadata, self.shards = path, metadata, shards
    self.label = label  # how errors name it: `data.prepared='DIR'`, or the source of a cached corpus

  def num_tokens(self, split: str) -> int:
    return sum(len(shard.tokens) for shard in self.shards[split])

  def rows(self, split: str, seq_len: int, documents: bool = False) -> packed_rows.PackedRows:
    return packed_rows.PackedRows(self.shards[split], seq_len, documents)


def open_corpus(path: str | os.PathLike, tokenizer: tokenizer_lib.Tokenizer, field: str = "data.prepared"
                ) -> Corpus:
  """Opens a prepared directory, refusing (CorpusError naming the problem and the fix) one that is not a complete
  prepared corpus, was written by another tokenizer, or whose shards are missing or truncated."""
  path = Path(path)
  rebuild = f"prepare it again: delete {str(path)!r} and rerun scripts/prepare_data.py --out={str(path)!r}"
  if not path.is_dir():
    raise CorpusError(f"{field}={str(path)!r} is not a directory; give the --out directory of "
                      "scripts/prepare_data.py.")
  meta_path = path / METADATA
  if not meta_path.is_file():
    state = ("is half-written (a prepare was interrupted)" if (path / PROGRESS).exists()
             else "is not a prepared corpus (no metadata.json)")
    fix = (f"rerun scripts/prepare_data.py --out={path} to finish it" if (path / PROGRESS).exists()
           else "prepare one with scripts/prepare_data.py")
    raise CorpusError(f"{field}={str(path)!r} {state}; {fix}.")
  try:
    metadata = _json_object(meta_path)
    if metadata.get("format") != FORMAT or metadata.get("version") != VERSION:
      raise ValueError(f"format {metadata.get('format')!r} version {metadata.get('version')!r}")
    dtype, recorded = np.dtype(metadata["dtype"]), dict(metadata["tokenizer"])
    listed = _shard_entries(metadata["splits"])
  except (ValueError, KeyError, TypeError) as e:
    raise CorpusError(f"{field}={str(path)!r}: its metadata.json is unreadable or of another format "
                      f"({_reason(e)}); {rebuild}.") from None
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
      problem = _shard_problem(path, split, index, entry, dtype)
      if problem:
        raise CorpusError(f"{field}={str(path)!r}: shard {problem} (damaged or truncated); {rebuild}.")
      tokens_path, starts_path = _shard_paths(path, split, index)
      shards[split].append(packed_rows.Shard(np.memmap(tokens_path, dtype, "r", shape=(entry["tokens"],)),
                                 np.memmap(starts_path, np.int64, "r", shape=(entry["documents"],))))
  return Corpus(path, metadata, shards, f"{field}={str(path)!r}" if field.startswith("data.prepared") else field)


class _ShardWriter:
  """Appends documents of one split to numbered shards of about `shard_tokens` tokens, streaming to disk."""

  def __init__(self, folder: owned_folders.OwnedFolder, split: str, dtype: np.dtype, eos_id: int | None,
               shard_tokens: int, done: list[dict[str, int]]):
    self.folder, self.directory, self.split, self.dtype = folder, folder.path, split, dtype
    self.eos_id, self.shard_tokens = eos_id, shard_tokens
    self.done = done  # finished shards' entries
    self._file, self._starts, self._tokens = None, [], 0

  def add(self, ids: np.ndarray) -> int:
    """Appends one document; returns the tokens it took, its separator included."""
    if self._file is None:
      path = _shard_paths(self.directory, self.split, len(self.done))[0]
      self.folder.record(*(p.name for p in _shard_paths(self.directory, self.split, len(self.done))))
      self._file = open(path, "wb")  # pylint: disable=consider-using-with
    if self._starts and self.eos_id is not None:
      ids = np.concatenate([[self.eos_id], ids])  # the separator opens this document
    self._starts.append(self._tokens)
    try:
      self._file.write(np.asarray(ids, self.dtype).tobytes())
    except OSError as e:  # a full disk: the prepare resumes at this shard once there is room
      raise WriteError(f"writing {self._file.name} failed ({e.strerror or e}); free space on its disk and rerun "
                       "the same command: the prepare resumes at this shard") from None
    self._tokens += len(ids)
    return len(ids)

  @property
  def full(self) -> bool:
    return self._tokens >= self.shard_tokens

  def close(self) -> None:
    """Finishes the open shard (if it holds any document): its files are complete once listed in `done`."""
    if self._file is None:
      return
    starts_path = _shard_paths(self.directory, self.split, len(self.done))[1]
    try:
      self._file.close()
      _write_array(np.asarray(self._starts, np.int64), starts_path)
    except OSError as e:  # a full disk: the prepare resumes at this shard once there is room
      detail = str(e) if isinstance(e, WriteError) else f"writing {self._file.name} failed ({e.strerror or e})"
      raise WriteError(f"{detail}; free space on its disk and rerun the same command: the prepare resumes at this "
                       "shard") from None
    self.done.append({"tokens": self._tokens, "documents": len(self._starts)})
    self._file, self._starts, self._tokens = None, [], 0


def _write_json(path: Path, value: dict[str, Any]) -> None:
  """Writes atomically: a reader sees the old file or the new one, never a part."""
  partial, text = path.with_suffix(_PARTIAL), json.dumps(value, indent=1)
  try:
    partial.write_text(text)
  except OSError as e:
    raise WriteError(f"writing {partial} ({len(text):,} bytes) failed ({e.strerror or e})") from None
  os.replace(partial, path)


def _is_held_out(index: int, fraction: float) -> bool:
  """Whether document `index` is validation: `fraction` of the documents, spread evenly through the corpus."""
  return int((index + 1) * fraction) > int(index * fraction)


def write(out: str | os.PathLike, documents: Iterable[str], validation_documents: Iterable[str] | None,
          tokenizer_spec: str, sources: list[str], validation_fraction: float, shard_tokens: int = 1 << 27,
          max_tokens: int | None = None, workers: int = 1, batch_documents: int = 1024,
          progress: Any = None, take: bool = False) -> dict[str, Any]:
  """Tokenizes `documents` (texts in order) into a prepared corpus in `out`, resuming where an interrupted call
  with the same arguments stopped (after its last finished shard).

  `out` must be empty, new, or this call's interrupted prepare (its mark and progress.json, written before any
  shard); anything else (`owned_folders.NotOwnedError`, unless `take`), or an `out` holding or inside a source
  (CorpusError), is refused before any work. Only the shards it recorded as written are ever removed or replaced.

  Validation: `validation_documents` when given, else every document `_is_held_out` at `validation_fraction`.
  Host memory stays that of one batch of documents and the shards' document offsets.

  Args:
    out: the directory (created).
    documents: the training source's texts (its documents in order); an empty text is skipped.
    validation_documents: the validation texts, or None to hold out documents of `documents`.
    tokenizer_spec: `config.data.tokenizer`.
    sources: what was read, for the metadata (those that are paths on disk `out` must neither hold nor lie in).
    validation_fraction: the share of held-out documents.
    shard_tokens: tokens per shard (a shard ends after the batch of documents that reaches it).
    max_tokens: stop after the document that brings the training split to this many tokens (None: read everything).
    workers: tokenizing processes (the byte tokenizer always runs in this one).
    batch_documents: documents per tokenizing task.
    progress: called as progress(documents, tokens) after each batch.
    take: write into an `out` holding files this project did not write, beside them (--take_folder).
  Returns:
    The metadata written to `out/metadata.json`.
  """
  out = Path(out)
  if validation_documents is None and not 0 < validation_fraction < 1:
    raise CorpusError(f"data.validation_fraction={validation_fraction} must lie strictly between 0 and 1 (the share "
                      "of documents held out for validation); set it to e.g. 0.1, or give data.validation_files.")
  _check_out(out, sources)
  # first: a metadata.json of the user's is theirs, refused as such, not taken for a prepared corpus
  owned_folders.check(out, FOLDER_FORMAT, flag="--out", writes=_JSON_NAMES, take=take, earlier=_earlier_prepare)
  if (out / METADATA).exists():
    raise CorpusError(f"--out={str(out)!r} already holds a prepared corpus; choose another --out or delete it.")
  resuming = (out / PROGRESS).exists()
  tokenizer = tokenizer_lib.load(tokenizer_spec)
  dtype = token_dtype(tokenizer.vocab_size)
  settings = {"tokenizer": _recorded(tokenizer, tokenizer_spec), "sources": sources,
              "validation_fraction": validation_fraction, "held_out": validation_documents is None,
              "shard_tokens": shard_tokens, "max_tokens": max_tokens}
  fingerprints = _source_fingerprints(sources)
  if resuming:
    state = _read_progress(out, settings, fingerprints, dtype)
  folder = owned_folders.claim(out, FOLDER_FORMAT, flag="--out", writes=_JSON_NAMES, take=take,
                               earlier=_earlier_prepare)
  if resuming:
    leftovers = [name for name in folder.written()  # shards being written when the prepare stopped
                 if (shard := _SHARD_NAME.fullmatch(name)) and int(shard[2]) >= len(state["shards"][shard[1]])]
    for name in leftovers:
      (out / name).unlink(missing_ok=True)
    folder.forget(*leftovers)
  else:
    state = {"settings": settings, "fingerprints": fingerprints, "consumed": 0,
             "shards": {split: [] for split in SPLITS}}
    _write_json(out / PROGRESS, state)  # a prepare in progress, before any shard is written
  writers = {split: _ShardWriter(folder, split, dtype, tokenizer.eos_id, shard_tokens, state["shards"][split])
             for split in SPLITS}
  consumed, train_tokens = state["consumed"], sum(e["tokens"] for e in state["shards"]["train"])

  def checkpoint() -> None:
    for writer in writers.values():
      writer.close()
    state["consumed"] = consumed
    _write_json(out / PROGRESS, state)

  # The byte tokenizer is a copy: shipping texts to workers and ids back costs more than it (3x slower measured)
  encoder = encoding.Encoder(tokenizer_spec, 1 if tokenizer_spec == "byte" else workers)
  remaining = (text for i, text in enumerate(documents) if i >= state["consumed"])

  def reached() -> bool:
    return max_tokens is not None and train_tokens >= max_tokens

  for encoded in encoder.map(encoding.batched(remaining, batch_documents)):
    for ids in encoded:
      if reached():  # checked per document: a batch holds many
        break
      index, consumed = consumed, consumed + 1
      held_out = validation_documents is None and _is_held_out(index, validation_fraction)
      if len(ids):
        written = writers["validation" if held_out else "train"].add(ids)
        train_tokens += 0 if held_out else written
    if progress is not None:
      progress(consumed, train_tokens)
    if reached():
      break
    if writers["train"].full:
      checkpoint()
  checkpoint()
  if validation_documents is not None and not state["shards"]["validation"]:
    for encoded in encoder.map(encoding.batched(validation_documents, batch_documents)):
      for ids in encoded:
        if len(ids):
          writers["validation"].add(ids)
          if writers["validation"].full:
            writers["validation"].close()
    checkpoint()
  for split in SPLITS:
    if not state["shards"][split]:
      stopped = (f"--max_tokens={max_tokens} stopped before a held-out document; raise it, or "
                 if reached() and validation_documents is None else "")
      raise CorpusError(f"the {split} split of {sources} came out empty: "
                        + (f"{stopped}give more documents or data.validation_files (a .txt file is one document)"
                           if split == "validation" else "the sources hold no text") + ".")
  metadata = _write_metadata(out, dtype, state["shards"], **settings)
  (out / PROGRESS).unlink()
  return metadata


def _check_out(out: Path, sources: list[str]) -> None:
  """Refuses an `out` that is a file, or holds or lies inside a source on disk (it would read what it writes): a
  file, or a hub dataset (`hub:NAME`) that names a local folder, which the datasets library reads."""
  if out.exists() and not out.is_dir():
    raise CorpusError(f"--out={str(out)!r} is a file; give a directory (new or empty) for the prepared corpus.")
  blocking = next((parent for parent in out.parents if parent.exists() and not parent.is_dir()), None)
  if blocking is not None:
    raise CorpusError(f"--out={str(out)!r} lies under {str(blocking)!r}, which is a file; give a directory (new or "
                      "empty) for the prepared corpus.")
  where = out.resolve()
  for source in sources:
    path = Path(source.removeprefix("hub:")).resolve()
    if path.exists() and (path == where or where in path.parents or path in where.parents):
      relation = "lies inside" if path in where.parents else "holds"
      raise CorpusError(f"--out={str(out)!r} {relation} the source {source!r}; give an --out outside the sources.")


def _earlier_prepare(out: Path) -> list[str] | None:
  """What an interrupted prepare of an earlier version (before the mark) wrote in `out`: its progress.json, the
  JSON files' partial writes and the shards, where progress.json is a prepare's (its fields); else None."""
  try:
    state = _json_object(out / PROGRESS)
  except (OSError, ValueError):
    return None
  if not all(field in state for field in ("settings", "fingerprints", "consumed", "shards")):
    return None
  return sorted(p.name for p in out.iterdir() if p.name in _JSON_NAMES or _SHARD_NAME.fullmatch(p.name))


def _read_progress(out: Path, settings: dict[str, Any], fingerprints: dict[str, list[int]], dtype: np.dtype
                   ) -> dict[str, Any]:
  """The state of `out`'s interrupted prepare, refused (CorpusError naming the fix) when its progress.json is not
  one, it has other settings, a source file changed since it began (size or modification time: its shards hold the
  old text), or a shard it lists as finished is damaged."""
  fix = f"delete {str(out)!r} and prepare again"
  try:
    state = _json_object(out / PROGRESS)
    saved, saved_fingerprints = state["settings"], state["fingerprints"]
    consumed, shards = state["consumed"], _shard_entries(state["shards"])
    if not isinstance(consumed, int) or consumed < 0:
      raise ValueError(f"consumed {consumed!r} is not a count of documents")
    if not (isinstance(saved_fingerprints, dict)
            and all(isinstance(v, list) and len(v) == 2 for v in saved_fingerprints.values())):
      raise ValueError(f"fingerprints {saved_fingerprints!r:.40} are not [size, mtime] pairs by source")
  except (ValueError, KeyError, TypeError) as e:
    raise CorpusError(f"--out={str(out)!r}: its {PROGRESS} is not a prepare's progress ({_reason(e)}); {fix}."
                      ) from None
  if saved != settings:
    raise CorpusError(f"--out={str(out)!r} holds an interrupted prepare of other sources or settings; rerun "
                      "that command to finish it, or choose another --out.")
  for source, now in fingerprints.items():
    if (was := saved_fingerprints.get(source)) != now:
      change = f"{was[0]:,} -> {now[0]:,} bytes" if was and was[0] != now[0] else "modified"
      raise CorpusError(f"--out={str(out)!r} holds an interrupted prepare of {source!r}, which changed since it began "
                        f"({change}): its shards hold the older text; {fix}, or restore {source!r} as it was.")
  for split in SPLITS:
    for index, entry in enumerate(shards[split]):
      problem = _shard_problem(out, split, index, entry, dtype)
      if problem:
        raise CorpusError(f"--out={str(out)!r}: its finished shard {problem} (damaged since); {fix}.")
  return {"settings": settings, "fingerprints": fingerprints, "consumed": consumed, "shards": shards}


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
    _write_array(np.asarray(tokens).astype(dtype), tokens_path)
    _write_array(np.asarray(starts, np.int64), starts_path)
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
