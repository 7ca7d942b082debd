"""The cache of plain files' tokenized corpora (retnet_jax/input_pipeline/corpus_cache.py) where it cannot be written:
one warning naming both folders and a fallback that later runs reuse; a disk that takes less than a file named with the
fix; a folder of the user's refused, its files untouched."""

import json
import logging
import os
import tempfile

import ml_collections
import pytest

from retnet_jax.core import owned_folders
from retnet_jax.input_pipeline import corpus_cache, prepared, tokenizer as tokenizer_lib

DOCUMENTS = [f"document {i}: the quick brown fox jumps over the lazy dog" for i in range(30)]


@pytest.fixture
def data_cfg(tmp_path):
  path = tmp_path / "docs.jsonl"
  path.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCUMENTS))
  return ml_collections.ConfigDict(dict(files=(str(path),), validation_files=(), validation_fraction=0.1,
                                        hub_dataset=None, hub_config=None, text_field="text", tokenizer="byte",
                                        reset_at_documents=False, prepared=(), prepared_weights=()))


@pytest.fixture
def temporary(tmp_path, monkeypatch):
  """$TMPDIR as a folder of this test's (the fallback lies in it), and no cache root reported yet."""
  folder = tmp_path / "tmp"
  folder.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(folder))
  monkeypatch.setattr(corpus_cache, "_warned", set())
  return folder


def unwritable_caches(tmp_path):
  (tmp_path / "a-file").write_text("not a folder")
  caches = [("a-file", "is a file"), ("a-file/inside", "is a file")]
  if os.geteuid() != 0:  # root writes into any folder
    (tmp_path / "locked").mkdir(mode=0o500)
    caches.append(("locked/cache", "permission denied"))
  return caches


def test_an_unwritable_cache_warns_once_naming_both_folders_and_reuses_its_fallback(tmp_path, monkeypatch, data_cfg,
                                                                                     temporary, caplog):
  byte = tokenizer_lib.load("byte")
  for name, reason in unwritable_caches(tmp_path):
    monkeypatch.setenv("RETNET_JAX_CACHE", str(tmp_path / name))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="absl"):
      first = corpus_cache.open_cached(data_cfg, byte)
      second = corpus_cache.open_cached(data_cfg, byte)
    fallback = temporary / f"retnet_jax_cache_{os.getuid()}"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"RETNET_JAX_CACHE '{tmp_path / name}' cannot be written ({reason}); caching tokenized "
                        f"corpora in '{fallback}' instead (reused by later runs; delete it to free the space). Set "
                        "RETNET_JAX_CACHE to a writable folder to keep them there."], warnings
    assert first.path == second.path and first.path.parent == fallback
    assert [p.name for p in temporary.iterdir()] == [fallback.name]  # one copy, whatever the number of runs
    assert len([p for p in fallback.iterdir() if p.is_dir()]) == 1
  assert (tmp_path / "a-file").read_text() == "not a folder"


def test_a_cache_whose_fallback_cannot_be_written_either_is_one_line_naming_both(tmp_path, monkeypatch, data_cfg,
                                                                                temporary):
  monkeypatch.setenv("RETNET_JAX_CACHE", str(tmp_path / "a-file"))
  (tmp_path / "a-file").write_text("")
  (temporary / f"retnet_jax_cache_{os.getuid()}").write_text("")
  with pytest.raises(ValueError, match=r"^RETNET_JAX_CACHE '.*a-file' cannot be written \(is a file\), nor can the "
                                       r"fallback '.*retnet_jax_cache_\d+' \(.*\); set RETNET_JAX_CACHE to a writable "
                                       r"folder.$"):
    corpus_cache.open_cached(data_cfg, tokenizer_lib.load("byte"))


def test_a_full_disk_names_the_cache_file_its_bytes_and_the_fix(tmp_path, monkeypatch, data_cfg):
  """numpy's own message of a short write ("60000 requested and 32768 written") named neither the file nor a fix;
  the half-written entry is removed, and a disk with room again builds the cache."""
  monkeypatch.setenv("RETNET_JAX_CACHE", str(tmp_path / "cache"))
  real = prepared._tofile

  def short_write(array, path):
    path.write_bytes(array.tobytes()[:array.nbytes // 2])
    raise OSError(f"{array.nbytes} requested and {array.nbytes // 2} written")

  monkeypatch.setattr(prepared, "_tofile", short_write)
  byte = tokenizer_lib.load("byte")
  with pytest.raises(ValueError) as error:
    corpus_cache.open_cached(data_cfg, byte)
  (entry,) = [p for p in (tmp_path / "cache").iterdir() if p.suffix == ".lock"]
  message = str(error.value)
  assert message.startswith(f"data.files: caching its tokenized corpus failed: writing {tmp_path}/cache/"
                            f"{entry.stem}/train-00000.tokens ("), message
  assert " bytes) failed (" in message and " requested and " in message
  assert message.endswith("; free space there or point RETNET_JAX_CACHE to another folder (one with room for it)."
                          ), message
  assert int(message.split(".tokens (")[1].split(" bytes")[0].replace(",", "")) > 0
  assert not (tmp_path / "cache" / entry.stem).exists()  # the half-written entry is gone
  monkeypatch.setattr(prepared, "_tofile", real)
  assert corpus_cache.open_cached(data_cfg, byte).path == tmp_path / "cache" / entry.stem


def test_a_full_disk_during_prepare_names_the_shard_and_resumes_once_there_is_room(tmp_path, monkeypatch):
  real = prepared._tofile

  def full(array, path):
    raise OSError(f"{array.nbytes} requested and 0 written")

  monkeypatch.setattr(prepared, "_tofile", full)
  documents = [f"document {i}: " + "the quick brown fox " * 5 for i in range(40)]
  with pytest.raises(prepared.WriteError, match=r"^writing .*/c/train-00000.starts \([\d,]+ bytes\) failed \(\d+ "
                                                r"requested and 0 written\); free space on its disk and rerun the "
                                                r"same command: the prepare resumes at this shard$"):
    prepared.write(tmp_path / "c", documents, None, "byte", ["test"], 0.1, shard_tokens=500, batch_documents=4)
  monkeypatch.setattr(prepared, "_tofile", real)
  prepared.write(tmp_path / "c", documents, None, "byte", ["test"], 0.1, shard_tokens=500, batch_documents=4)
  whole = prepared.write(tmp_path / "whole", documents, None, "byte", ["test"], 0.1, shard_tokens=500,
                         batch_documents=4)
  for path in sorted((tmp_path / "whole").iterdir()):
    assert (tmp_path / "c" / path.name).read_bytes() == path.read_bytes(), path.name
  assert whole["tokens"]["train"] > 0


def test_a_cache_folder_holding_a_users_files_is_refused_and_keeps_their_bytes(tmp_path, monkeypatch, data_cfg):
  """RETNET_JAX_CACHE pointing at a folder of the user's was written into (an entry and a lock file beside their
  files). Such a folder is refused by name, with a few of its files and the fix, before any tokenizing."""
  cache = tmp_path / "mine"
  cache.mkdir()
  (cache / "notes.txt").write_bytes(b"keep\x00me")
  monkeypatch.setenv("RETNET_JAX_CACHE", str(cache))
  monkeypatch.setattr(corpus_cache.data, "load_documents", lambda *args: pytest.fail("tokenized"))
  with pytest.raises(owned_folders.NotOwnedError, match=r"^RETNET_JAX_CACHE='.*mine' holds 'notes.txt', which this "
                                                        r"project did not write \(no \.retnet_jax\.json\); choose a "
                                                        r"new or empty RETNET_JAX_CACHE, or move those files "
                                                        r"elsewhere\.$"):
    corpus_cache.open_cached(data_cfg, tokenizer_lib.load("byte"))
  assert [p.name for p in cache.iterdir()] == ["notes.txt"] and (cache / "notes.txt").read_bytes() == b"keep\x00me"


def test_the_cache_folder_records_its_entries_and_adopts_an_earlier_versions(tmp_path, monkeypatch, data_cfg):
  """A new cache folder carries the mark, recording each entry and its lock; a folder an earlier version filled
  (entries and locks only, no mark) is the project's: its entries are kept and recorded."""
  byte = tokenizer_lib.load("byte")
  monkeypatch.setenv("RETNET_JAX_CACHE", str(tmp_path / "new"))
  corpus = corpus_cache.open_cached(data_cfg, byte)
  key = corpus.path.name
  assert owned_folders.read_mark(tmp_path / "new")["written"] == [key, f"{key}.lock"]
  (tmp_path / "new" / owned_folders.MARK).unlink()  # as an earlier version left it
  (tmp_path / "new").rename(tmp_path / "earlier")
  monkeypatch.setenv("RETNET_JAX_CACHE", str(tmp_path / "earlier"))
  monkeypatch.setattr(corpus_cache.data, "load_documents", lambda *args: pytest.fail("tokenized again"))
  assert corpus_cache.open_cached(data_cfg, byte).path == tmp_path / "earlier" / key
  assert owned_folders.read_mark(tmp_path / "earlier")["written"] == [key, f"{key}.lock"]
