"""Plain `data.files` (or a hub dataset) prepared once into a cached corpus, so every text run reads one way.

    corpus = corpus_cache.open_cached(config.data, tokenizer, "data.files")  # built on first use, then mapped

The cache key covers what decides the tokens: the files (path, size, modification time), the validation files or
fraction, the hub dataset, the text field and the tokenizer's fingerprint. The first run tokenizes as
`data.load_documents` always has (the whole source in memory, the validation split the last
`validation_fraction` of the stream unless `validation_files`); later runs map the cached shards. Processes on one
host take turns on a lock, so one builds and the others reuse it. The cache lives in `$RETNET_JAX_CACHE`, else
`$XDG_CACHE_HOME/retnet_jax/prepared` (`~/.cache/...`); where it cannot be written, a temporary directory serves
the run.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import ml_collections

from retnet_jax import data, prepared
from retnet_jax.tokenizer import Tokenizer


def cache_root() -> Path:
  """$RETNET_JAX_CACHE, else $XDG_CACHE_HOME/retnet_jax/prepared (~/.cache/...)."""
  if os.environ.get("RETNET_JAX_CACHE"):
    return Path(os.environ["RETNET_JAX_CACHE"])
  return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "retnet_jax" / "prepared"


def cache_key(data_cfg: ml_collections.ConfigDict, tokenizer: Tokenizer) -> str:
  """A digest of everything that decides the cached corpus's tokens."""
  def described(files, source):
    return [(str(Path(f).resolve()), Path(f).stat().st_size, Path(f).stat().st_mtime_ns)
            for f in data.expand_files(files, source)]
  files = data.as_tuple(data_cfg.files) or (() if data_cfg.hub_dataset else (str(data.DEFAULT_CORPUS),))
  validation = data.as_tuple(data_cfg.validation_files)
  described_key = {"format": prepared.VERSION, "files": described(files, "data.files"),
                   "validation_files": described(validation, "data.validation_files"),
                   "validation_fraction": None if validation else data_cfg.validation_fraction,
                   "hub": [data_cfg.hub_dataset, data_cfg.hub_config] if not files else None,
                   "text_field": data_cfg.text_field, "tokenizer": prepared.fingerprint(tokenizer),
                   "vocab_size": tokenizer.vocab_size}
  return hashlib.sha256(json.dumps(described_key, sort_keys=True).encode()).hexdigest()[:20]


def open_cached(data_cfg: ml_collections.ConfigDict, tokenizer: Tokenizer, source: str) -> prepared.Corpus:
  """The cached corpus of `config.data`'s files (errors name `source`), built now if missing, rebuilt if damaged;
  errors of the data itself as `data.load_documents` gives them."""
  if not (data.as_tuple(data_cfg.files) or data_cfg.hub_dataset) and not data.DEFAULT_CORPUS.is_file():
    data.load_documents(data_cfg, tokenizer)  # its error names the missing shipped corpus
  key = cache_key(data_cfg, tokenizer)
  try:
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    lock = open(root / f"{key}.lock", "a")  # pylint: disable=consider-using-with
  except OSError:
    root, lock = Path(tempfile.mkdtemp(prefix="retnet_jax_corpus_")), None
  directory = root / key
  try:
    if lock is not None:
      fcntl.flock(lock, fcntl.LOCK_EX)
    if (directory / prepared.METADATA).is_file():
      try:
        return prepared.open_corpus(directory, tokenizer, source)
      except prepared.CorpusError:  # damaged since: build it again
        pass
    whole = ml_collections.ConfigDict({**data_cfg.to_dict(), "reset_at_documents": False})  # checked on use
    train, valid = data.load_documents(whole, tokenizer)
    shutil.rmtree(directory, ignore_errors=True)  # an interrupted or damaged build
    sources = [str(f) for f in data.as_tuple(data_cfg.files)] or [data_cfg.hub_dataset or str(data.DEFAULT_CORPUS)]
    prepared.write_splits(directory, {"train": train, "validation": valid}, tokenizer, data_cfg.tokenizer, sources)
    return prepared.open_corpus(directory, tokenizer, source)
  finally:
    if lock is not None:
      lock.close()
