"""Plain `data.files` (or a hub dataset) prepared once into a cached corpus, so every text run reads one way.

    corpus = corpus_cache.open_cached(config.data, tokenizer)  # built on first use, then mapped

The cache key covers what decides the tokens: the files (path, size, modification time), the validation files or
fraction, the hub dataset, the text field and the tokenizer's fingerprint. The first run tokenizes as
`data.load_documents` always has (the whole source in memory, the validation split the last
`validation_fraction` of the stream unless `validation_files`); later runs map the cached shards. Processes on one
host take turns on a lock, so one builds and the others reuse it. The cache lives in `$RETNET_JAX_CACHE`, else
`$XDG_CACHE_HOME/retnet_jax/prepared` (`~/.cache/...`); where it cannot be written (or is a file), one warning
names it and the fallback, `$TMPDIR/retnet_jax_cache_UID`, which later runs reuse (no copy per run). A write that
fails (a full disk) names the file, its bytes and the fix, and removes the half-written entry. The cache folder
carries the project's mark (`owned_folders`), recording each entry and its lock before they are created: one holding
other files is refused by name before any work, and only recorded entries are ever replaced or removed.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from absl import logging

from retnet_jax.core import owned_folders
from retnet_jax.input_pipeline import data, prepared
from retnet_jax.input_pipeline.tokenizer import Tokenizer
from retnet_jax.input_pipeline.data_config import DataConfig


def cache_root() -> Path:
  """$RETNET_JAX_CACHE, else $XDG_CACHE_HOME/retnet_jax/prepared (~/.cache/...)."""
  if os.environ.get("RETNET_JAX_CACHE"):
    return Path(os.environ["RETNET_JAX_CACHE"])
  return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "retnet_jax" / "prepared"


def fallback_root() -> Path:
  """Where the cache goes when `cache_root` cannot be written: one folder per user in the temporary directory,
  reused by later runs (a fresh temporary folder per run would leave a tokenized copy of the corpus each time)."""
  return Path(tempfile.gettempdir()) / f"retnet_jax_cache_{os.getuid()}"


_warned: set[str] = set()  # cache roots already reported unwritable by this process
FOLDER_FORMAT = "prepared-corpus cache"  # the cache folder's format, in its mark
_ENTRY_NAME = re.compile(r"[0-9a-f]{20}(\.lock)?")  # an entry (`cache_key`) or its lock file


def _earlier_cache(root: Path) -> list[str] | None:
  """What an earlier version (before the mark) wrote in cache folder `root`: its entries and their lock files, where
  it holds nothing else; else None."""
  names = [p.name for p in root.iterdir()]
  return names if all(_ENTRY_NAME.fullmatch(name) for name in names) else None


def _claim_entry(root: Path, key: str) -> Any:
  """The lock file of entry `key` in cache folder `root`, created with its parents; the folder claimed and the
  entry and its lock recorded first (`owned_folders`: NotOwnedError for a folder holding other files); OSError
  where it cannot be written."""
  root.mkdir(parents=True, exist_ok=True)
  folder = owned_folders.claim(root, FOLDER_FORMAT, flag="RETNET_JAX_CACHE", earlier=_earlier_cache, take_flag=None)
  folder.record(key, f"{key}.lock")
  return open(root / f"{key}.lock", "a")  # pylint: disable=consider-using-with


def _open_root(key: str) -> tuple[Path, Any]:
  """The cache root and the lock file of entry `key` in it: `cache_root`, else (warned once per process)
  `fallback_root`; ValueError naming both when neither can be written."""
  root = cache_root()
  try:
    return root, _claim_entry(root, key)
  except OSError as e:
    problem = e
  fallback = fallback_root()
  origin = "RETNET_JAX_CACHE" if os.environ.get("RETNET_JAX_CACHE") else "the cache folder"
  reason = "is a file" if root.is_file() or any(p.is_file() for p in root.parents) else (
      problem.strerror or str(problem)).lower()
  try:
    fallback.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock = _claim_entry(fallback, key)
  except OSError as e:
    raise ValueError(f"{origin} {str(root)!r} cannot be written ({reason}), nor can the fallback {str(fallback)!r} "
                     f"({(e.strerror or str(e)).lower()}); set RETNET_JAX_CACHE to a writable folder.") from None
  if str(root) not in _warned:
    _warned.add(str(root))
    logging.warning(f"{origin} {str(root)!r} cannot be written ({reason}); caching tokenized corpora in "
                    f"{str(fallback)!r} instead (reused by later runs; delete it to free the space). Set "
                    "RETNET_JAX_CACHE to a writable folder to keep them there.")
  return fallback, lock


def cache_key(data_cfg: DataConfig, sources: tuple[data.TextSource, data.TextSource | None],
              tokenizer: Tokenizer) -> str:
  """A digest of everything that decides the cached corpus's tokens: `sources` (`data.text_sources(data_cfg)`),
  the validation fraction and the tokenizer."""
  def described(source):
    return [(str(Path(f).resolve()), Path(f).stat().st_size, Path(f).stat().st_mtime_ns)
            for f in (source.files if source else ())]
  train, validation = sources
  described_key = {"format": prepared.VERSION, "files": described(train),
                   "validation_files": described(validation),
                   "validation_fraction": None if validation else data_cfg.validation_fraction,
                   "hub": [train.hub_dataset, train.hub_config] if train.kind == "hub" else None,
                   "text_field": data_cfg.text_field, "tokenizer": prepared.fingerprint(tokenizer),
                   "vocab_size": tokenizer.vocab_size}
  return hashlib.sha256(json.dumps(described_key, sort_keys=True).encode()).hexdigest()[:20]


def open_cached(data_cfg: DataConfig, tokenizer: Tokenizer) -> prepared.Corpus:
  """The cached corpus of `config.data`'s text source (`data.text_sources`; errors and the corpus's label name it),
  built now if missing, rebuilt if damaged; errors of the data itself as `data.load_documents` gives them."""
  sources = data.text_sources(data_cfg)
  source = sources[0].label
  key = cache_key(data_cfg, sources, tokenizer)
  root, lock = _open_root(key)
  directory = root / key
  try:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if (directory / prepared.METADATA).is_file():
      try:
        return prepared.open_corpus(directory, tokenizer, source)
      except prepared.CorpusError:  # damaged since: build it again
        pass
    # the sources keyed (globs expanded once), read; one document is refused on use
    train, valid = data.load_documents(data_cfg, tokenizer, one_document_ok=True, sources=sources)
    shutil.rmtree(directory, ignore_errors=True)  # an interrupted or damaged build
    try:
      prepared.write_splits(directory, {"train": train, "validation": valid}, tokenizer, data_cfg.tokenizer,
                            sources[0].names())
    except prepared.WriteError as e:
      shutil.rmtree(directory, ignore_errors=True)  # a half-written entry frees its space
      raise ValueError(f"{source}: caching its tokenized corpus failed: {e}; free space there or point "
                       "RETNET_JAX_CACHE to another folder (one with room for it).") from None
    return prepared.open_corpus(directory, tokenizer, source)
  finally:
    lock.close()
