"""Prepared corpora: prepare_data.py's shards hold exactly the documents (held-out ones in validation), resume after an
interruption to the same bytes, refuse what is not a complete corpus for this run; the Grain loader covers every row
once per epoch, resumes exactly, mixes by weight and gives each process disjoint rows of the global batch."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import jax
import ml_collections
import numpy as np
import pytest

from benchmarks import corpus as bench_corpus
from retnet_jax.input_pipeline import data, global_batches, loader, prepared, tokenizer as tokenizer_lib
from retnet_jax.input_pipeline.data_config import DataConfig
from retnet_jax.models import presets
from retnet_jax.training import train
from tests.helpers import REPO, assert_resumed_from, free_port, read_metrics, run_script, script_stdout, tiny_config

DOCUMENTS = [f"document {i}: " + "the quick brown fox jumps over the lazy dog " * (i % 5 + 1) for i in range(60)]


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory):
  """A tiny byte-level BPE tokenizer.json whose separator is <|endoftext|>."""
  path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
  return str(bench_corpus.train_bpe(DOCUMENTS, path, vocab_size=300))


def prepare(out, documents=DOCUMENTS, spec="byte", **options):
  options = {"shard_tokens": 500, "batch_documents": 4, **options}
  return prepared.write(out, documents, None, spec, ["test"], 0.1, **options)


def data_config(paths, **fields):
  """The tiny preset's data section reading the prepared corpora `paths`, built (checked) as a run builds it."""
  return DataConfig.of({**presets.get_config("tiny").data.to_dict(), "prepared": tuple(map(str, paths)), **fields},
                       "data")


def split_documents(corpus, split):
  """The documents of a split as lists of ids, separators dropped."""
  eos = corpus.metadata["tokenizer"]["eos_id"]
  documents = []
  for shard in corpus.shards[split]:
    bounds = list(shard.starts) + [len(shard.tokens)]
    for begin, end in zip(bounds[:-1], bounds[1:]):
      ids = np.asarray(shard.tokens[begin:end], np.int32)
      documents.append(list(ids[1:] if eos is not None and begin > 0 else ids))
      if eos is not None and begin > 0:
        assert ids[0] == eos  # the separator opens the document
  return documents


def interrupted(at):
  """DOCUMENTS until document `at`, then a KeyboardInterrupt (as Ctrl-C stops a prepare)."""
  for i, text in enumerate(DOCUMENTS):
    if i == at:
      raise KeyboardInterrupt
    yield text


@pytest.mark.parametrize("spec", ["byte", "bpe"])
def test_shards_hold_every_document_once_and_hold_out_every_tenth(tmp_path, bpe_path, spec):
  spec = bpe_path if spec == "bpe" else spec
  tok = tokenizer_lib.load(spec)
  metadata = prepare(tmp_path / "c", spec=spec, workers=2)
  corpus = prepared.open_corpus(tmp_path / "c", tok)
  encoded = [list(ids) for ids in tok.encode_batch(DOCUMENTS)]
  held_out = [i for i in range(len(DOCUMENTS)) if prepared._is_held_out(i, 0.1)]  # pylint: disable=protected-access
  assert len(held_out) == 6 and held_out == [9, 19, 29, 39, 49, 59]
  assert split_documents(corpus, "validation") == [encoded[i] for i in held_out]
  assert split_documents(corpus, "train") == [e for i, e in enumerate(encoded) if i not in held_out]
  assert len(corpus.shards["train"]) > 1 and corpus.shards["train"][0].tokens.dtype == np.uint16
  assert metadata["documents"] == {"train": 54, "validation": 6}
  assert not (tmp_path / "c" / prepared.PROGRESS).exists()


def finished_shards(out):
  """The names of the shard files that `out`'s progress.json records as finished."""
  shards = json.loads((out / prepared.PROGRESS).read_text())["shards"]
  return [path.name for split, finished in shards.items() for index in range(len(finished))
          for path in sorted(out.glob(f"{split}-{index:05d}.*"))]


def file_stats(out, names):
  """The inode and modification time of each file `names` in `out`: a file written again changes them."""
  return {name: ((out / name).stat().st_ino, (out / name).stat().st_mtime_ns) for name in names}


def test_an_interrupted_prepare_resumes_to_the_same_bytes_and_never_trains_half_written(tmp_path):
  """A prepare stopped by Ctrl-C resumes after its last finished shard (kept as written, not written again) and
  ends with the bytes of an uninterrupted one; until then its folder is refused as half-written."""
  prepare(tmp_path / "whole")
  with pytest.raises(KeyboardInterrupt):
    prepare(tmp_path / "part", interrupted(40))
  with pytest.raises(prepared.CorpusError, match=r"is half-written \(a prepare was interrupted\); rerun "
                                                  r"scripts/prepare_data.py --out=.*part to finish"):
    prepared.open_corpus(tmp_path / "part", tokenizer_lib.load("byte"))
  (tmp_path / "part" / f"train-{len(list((tmp_path / 'part').glob('train-*.tokens'))) - 1:05d}.tokens").write_bytes(
      b"x")  # the shard being written when it stopped
  finished = file_stats(tmp_path / "part", finished_shards(tmp_path / "part"))
  prepare(tmp_path / "part")  # resumes after its last finished shard; its partial shard is dropped
  assert len(finished) >= 2 and file_stats(tmp_path / "part", finished) == finished  # kept, not written again
  for whole in sorted((tmp_path / "whole").iterdir()):
    assert (tmp_path / "part" / whole.name).read_bytes() == whole.read_bytes(), whole.name
  assert sorted(p.name for p in (tmp_path / "part").iterdir()) == sorted(p.name for p in (tmp_path / "whole").iterdir())
  with pytest.raises(prepared.CorpusError, match="already holds a prepared corpus"):
    prepare(tmp_path / "part")


def test_preparing_writes_only_into_an_empty_folder_or_its_own_and_deletes_nothing_else(tmp_path):
  """A folder holding anything prepare did not write, a source or a file is refused by name before any work, and
  every file in it is kept; one interrupted before its first shard finished resumes (it is marked as its own)."""
  folder = tmp_path / "d"
  folder.mkdir()
  users = {"train-00000-of-00002.jsonl": "{}", "validation-00000.tokens": "mine", "train-notes.txt": "notes"}
  for name, text in users.items():
    (folder / name).write_text(text)
  source = str(folder / "train-00000-of-00002.jsonl")
  with pytest.raises(prepared.CorpusError, match=r"--out='.*d' holds the source '.*train-00000-of-00002.jsonl'; "
                                                  r"give an --out outside the sources"):
    prepared.write(folder, DOCUMENTS, None, "byte", [source], 0.1)
  with pytest.raises(ValueError, match=r"--out='.*d' holds 'train-00000-of-00002.jsonl', 'train-notes.txt', "
                                       r"'validation-00000.tokens', which this project did not write \(no "
                                       r"\.retnet_jax\.json\); choose a new or empty --out, or pass --take_folder"):
    prepare(folder)
  (folder / "train-00000-of-00002.jsonl").unlink()
  with pytest.raises(ValueError, match=r"holds 'train-notes.txt', 'validation-00000.tokens', which"):
    prepare(folder)
  assert {p.name: p.read_text() for p in folder.iterdir()} == {k: v for k, v in users.items() if "jsonl" not in k}
  with pytest.raises(prepared.CorpusError, match=r"--out='.*inside' lies inside the source '.*d'; give an --out "
                                                  r"outside the sources"):
    prepared.write(folder / "inside", DOCUMENTS, None, "byte", [str(folder)], 0.1)
  # data.hub_dataset naming a local folder: prepare read its own progress.json as data (CastError) and left it.
  with pytest.raises(prepared.CorpusError, match=rf"--out='.*inside' lies inside the source 'hub:{folder}'; give an "
                                                  r"--out outside the sources"):
    prepared.write(folder / "inside", DOCUMENTS, None, "byte", [f"hub:{folder}"], 0.1)
  assert not (folder / "inside").exists()
  with pytest.raises(prepared.CorpusError, match=r"--out='.*notes.txt' is a file; give a directory"):
    prepare(folder / "train-notes.txt")
  assert not (folder / "inside").exists() and (folder / "train-notes.txt").read_text() == "notes"

  prepare(tmp_path / "whole")
  with pytest.raises(KeyboardInterrupt):
    prepare(tmp_path / "early", interrupted(1))  # before any shard finished
  prepare(tmp_path / "early")
  for whole in sorted((tmp_path / "whole").iterdir()):
    assert (tmp_path / "early" / whole.name).read_bytes() == whole.read_bytes(), whole.name


def test_prepare_data_script_never_deletes_its_sources_nor_writes_into_a_run(tmp_path):
  """The issue's reproduction: sources named as hub datasets name their shards, --out their folder."""
  folder = tmp_path / "d"
  folder.mkdir()
  text = "".join(json.dumps({"text": text}) + "\n" for text in DOCUMENTS)
  (folder / "train-00000-of-00002.jsonl").write_text(text)
  result = run_script("prepare_data.py", "--config=configs/retnet.py:tiny",
                      f"--config.data.files={folder}/train-*.jsonl", f"--out={folder}")
  assert result.returncode == 1 and result.stderr.strip().splitlines()[-1].startswith(
      f"error: --out='{folder}' holds the source '{folder}/train-00000-of-00002.jsonl'"), result.stderr[-3000:]
  assert (folder / "train-00000-of-00002.jsonl").read_text() == text
  (tmp_path / "run" / "checkpoints").mkdir(parents=True)
  (tmp_path / "run" / "config.json").write_text("{}")
  result = run_script("prepare_data.py", "--config=configs/retnet.py:tiny",
                      f"--config.data.files={folder}/train-*.jsonl", f"--out={tmp_path}/run/checkpoints/corpus")
  assert result.returncode == 1 and result.stderr.strip().splitlines()[-1].startswith(
      f"error: --out={tmp_path}/run/checkpoints/corpus lies inside the checkpoints/ folder of the run "
      f"{tmp_path}/run; choose a directory outside it"), result.stderr[-3000:]
  assert not (tmp_path / "run" / "checkpoints" / "corpus").exists()


def test_a_damaged_progress_file_or_finished_shard_is_named_with_its_fix(tmp_path):
  """Resuming reads progress.json (refused by name when it is not one) and checks the shards it lists as finished."""
  out = tmp_path / "c"
  with pytest.raises(KeyboardInterrupt):
    prepare(out, interrupted(40))
  progress = (out / prepared.PROGRESS).read_text()
  for damaged, detail in (("{}", r"no field 'settings'"), ("{not json", r"Expecting property name"),
                          ("[]", r"not an object"), (progress.replace('"documents"', '"docs"'), r"shard 0 of 'train'")):
    (out / prepared.PROGRESS).write_text(damaged)
    with pytest.raises(prepared.CorpusError, match=rf"--out='.*c': its progress.json is not a prepare's progress "
                                                    rf"\(.*{detail}.*\); delete '.*c' and prepare again"):
      prepare(out)
  (out / prepared.PROGRESS).write_text(progress)
  (out / "train-00000.starts").unlink()
  with pytest.raises(prepared.CorpusError, match=r"--out='.*c': its finished shard train-00000.starts is missing "
                                                  r"\(damaged since\); delete '.*c' and prepare again"):
    prepare(out)


def test_a_source_changed_before_resuming_is_refused_by_name(tmp_path):
  """The interrupted prepare's shards hold a source's older text: resuming checks each source file's size and
  modification time."""
  source, out = tmp_path / "corpus.txt", tmp_path / "c"
  source.write_text("the older text")

  def resume(documents=DOCUMENTS):
    return prepared.write(out, documents, None, "byte", [str(source)], 0.1, shard_tokens=500, batch_documents=4)

  with pytest.raises(KeyboardInterrupt):
    resume(interrupted(40))
  source.write_text("the text as edited")
  with pytest.raises(prepared.CorpusError, match=r"--out='.*c' holds an interrupted prepare of '.*corpus.txt', which "
                                                  r"changed since it began \(14 -> 18 bytes\): its shards hold the "
                                                  r"older text; delete '.*c' and prepare again, or restore"):
    resume()
  source.write_text("the older text")
  os.utime(source, ns=(1, 1))  # as old as before in size, not in time
  with pytest.raises(prepared.CorpusError, match=r"changed since it began \(modified\)"):
    resume()


def test_max_tokens_stops_at_the_document_that_reaches_it(tmp_path):
  """Checked per document, not per batch of them: the training split ends with the document that reaches the limit."""
  longest = max(map(len, DOCUMENTS)) + 1  # a separator opens each document but the first
  metadata = prepare(tmp_path / "c", max_tokens=3000, batch_documents=1024)
  assert 3000 <= metadata["tokens"]["train"] < 3000 + longest and metadata["documents"]["validation"] >= 1
  metadata = prepared.write(tmp_path / "one", DOCUMENTS, ["held apart"], "byte", ["test"], 0.1, max_tokens=1)
  assert metadata["documents"]["train"] == 1 and metadata["tokens"]["train"] == len(DOCUMENTS[0])
  with pytest.raises(prepared.CorpusError, match=r"the validation split of \['test'\] came out empty: --max_tokens=1 "
                                                  r"stopped before a held-out document; raise it, or give more"):
    prepare(tmp_path / "none", max_tokens=1)


def test_bad_directories_are_refused_by_name(tmp_path, bpe_path):
  byte = tokenizer_lib.load("byte")
  with pytest.raises(prepared.CorpusError, match=r"data.prepared='.*nowhere' is not a directory"):
    prepared.open_corpus(tmp_path / "nowhere", byte)
  (tmp_path / "empty").mkdir()
  with pytest.raises(prepared.CorpusError, match=r"is not a prepared corpus \(no metadata.json\); prepare one"):
    prepared.open_corpus(tmp_path / "empty", byte)
  prepare(tmp_path / "c")
  with pytest.raises(prepared.CorpusError, match=r"was tokenized by 'byte' \(vocab 256, fingerprint byte\), not by "
                                                  r"this run's data.tokenizer \(vocab 30\d"):
    prepared.open_corpus(tmp_path / "c", tokenizer_lib.load(bpe_path))
  shard = tmp_path / "c" / "train-00001.tokens"
  shard.write_bytes(shard.read_bytes()[:-2])
  with pytest.raises(prepared.CorpusError, match=r"shard train-00001.tokens holds \d+ bytes, not \d+ \(damaged or "
                                                  r"truncated\); prepare it again: delete '.*c' and rerun "
                                                  r"scripts/prepare_data.py --out='.*c'"):
    prepared.open_corpus(tmp_path / "c", byte)
  shard.unlink()
  with pytest.raises(prepared.CorpusError, match=r"shard train-00001.tokens is missing"):
    prepared.open_corpus(tmp_path / "c", byte)
  metadata = json.loads((tmp_path / "c" / "metadata.json").read_text())
  for entry, detail in (({"tokens": 5}, r"shard 0 of 'validation' is \{'tokens': 5\}"),
                        (5, r"shard 0 of 'validation' is 5")):
    (tmp_path / "c" / "metadata.json").write_text(json.dumps({**metadata, "splits": {
        **metadata["splits"], "validation": [entry] + metadata["splits"]["validation"][1:]}}))
    with pytest.raises(prepared.CorpusError, match=rf"data.prepared='.*c': its metadata.json is unreadable or of "
                                                    rf"another format \({detail}, not {{\"tokens\": COUNT, "
                                                    rf"\"documents\": COUNT}}\); prepare it again"):
      prepared.open_corpus(tmp_path / "c", byte)
  (tmp_path / "c" / "metadata.json").write_text("{not json")
  with pytest.raises(prepared.CorpusError, match="its metadata.json is unreadable or of another format"):
    prepared.open_corpus(tmp_path / "c", byte)


def test_mixture_settings_and_sizes_are_refused_before_reading(tmp_path):
  prepare(tmp_path / "c")
  byte = tokenizer_lib.load("byte")
  for weights, message in (((1.0, 2.0), r"gives 2 weights for 1 prepared corpora"),
                           ((0.0,), r"every weight must be a positive number"),
                           ((float("nan"),), r"every weight must be a positive number")):
    with pytest.raises(ValueError, match=message):
      data_config([tmp_path / "c"], prepared_weights=weights)
  with pytest.raises(ValueError, match=r"data.prepared and data.files are both set"):
    data_config([tmp_path / "c"], files=("a",))
  with pytest.raises(ValueError, match=r"data.prepared='.*c': its training split holds \d+ sequences of "
                                       r"train.seq_len \+ 1 = 257 tokens, fewer than one batch of train.batch_size=64"):
    loader.PreparedBatches(loader.open_corpora(data_config([tmp_path / "c"]), byte), 256, 64, 0)


def test_rows_pack_each_shard_and_carry_document_ids(tmp_path):
  prepare(tmp_path / "c")
  corpus = prepared.open_corpus(tmp_path / "c", tokenizer_lib.load("byte"))
  rows = corpus.rows("train", 15, documents=True)
  expected = np.concatenate([data.pack(np.asarray(s.tokens, np.int32), 15) for s in corpus.shards["train"]])
  ids = np.concatenate([data.pack(data.document_ids(data.Split(np.asarray(s.tokens), s.starts)), 15)
                        for s in corpus.shards["train"]])
  tokens, weights, got_ids = rows.take(range(len(rows)))  # a batch of losses.Batch's form: no loss weights
  assert weights is None
  np.testing.assert_array_equal(tokens, expected)
  np.testing.assert_array_equal(got_ids, ids)
  assert got_ids.max() > 0


def test_validation_batches_are_the_rows_eval_rows_picks(tmp_path):
  """global_batches.eval_batches of a prepared corpus's validation rows: the packed shards' rows that
  global_batches.eval_rows picks, byte for byte, whole or sharded over the devices, with document ids
  `(tokens, None, ids)`."""
  prepare(tmp_path / "c", DOCUMENTS * 4, shard_tokens=1000)
  corpora = loader.open_corpora(data_config([tmp_path / "c"]), tokenizer_lib.load("byte"))
  shards = corpora[0].shards["validation"]
  assert len(shards) > 1
  tokens = np.concatenate([data.pack(np.asarray(s.tokens, np.int32), 15) for s in shards])
  ids = np.concatenate([data.pack(data.document_ids(data.Split(np.asarray(s.tokens), s.starts)), 15) for s in shards])
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  for max_batches, placed in ((None, None), (3, batch_sharding)):
    rows_NxB = global_batches.eval_rows(len(tokens), 8, max_batches)
    plain = list(global_batches.eval_batches(loader.validation_rows(corpora, 15, False), 8, max_batches, placed))
    documents = list(global_batches.eval_batches(loader.validation_rows(corpora, 15, True), 8, max_batches, placed))
    assert len(plain) == len(documents) == len(rows_NxB) == (3 if max_batches else len(tokens) // 8)
    for batch, (batch_tokens, weights, batch_ids), rows in zip(plain, documents, rows_NxB):
      assert weights is None and batch.dtype == batch_tokens.dtype == batch_ids.dtype == np.int32
      assert np.asarray(batch).tobytes() == np.asarray(batch_tokens).tobytes() == tokens[rows].tobytes()
      assert np.asarray(batch_ids).tobytes() == ids[rows].tobytes()
      assert placed is None or batch.sharding == batch_ids.sharding == placed


def test_batches_cover_each_row_once_per_epoch_resume_exactly_and_mix_by_weight(tmp_path):
  prepare(tmp_path / "a")
  prepare(tmp_path / "b", [text.upper() for text in DOCUMENTS])
  byte = tokenizer_lib.load("byte")
  batches = loader.PreparedBatches(loader.open_corpora(data_config([tmp_path / "a"]), byte), 15, 4, seed=3)
  rows = prepared.open_corpus(tmp_path / "a", byte).rows("train", 15)
  epoch = np.concatenate([np.asarray(next(batches)) for _ in range(len(rows) // 4 + 1)])[:len(rows)]
  all_rows = rows.take(range(len(rows)))
  assert sorted(map(bytes, epoch)) == sorted(map(bytes, all_rows))  # every row once
  assert not np.array_equal(epoch, all_rows)  # shuffled

  both = loader.open_corpora(data_config([tmp_path / "a", tmp_path / "b"]), byte)
  mixed = loader.PreparedBatches(both, 15, 4, seed=0, weights=(3.0, 1.0))
  first = [np.asarray(next(mixed)) for _ in range(5)]
  state = json.loads(json.dumps(mixed.get_state()))  # as a checkpoint keeps it
  after = [np.asarray(next(mixed)) for _ in range(30)]
  resumed = loader.PreparedBatches(both, 15, 4, seed=0, weights=(3.0, 1.0))
  resumed.set_state(state)
  for expected in after:
    np.testing.assert_array_equal(np.asarray(next(resumed)), expected)
  upper = np.mean([not any(chr(c).islower() for c in row) for batch in first + after for row in batch])
  assert 0.15 < upper < 0.35  # weight 1 of 4


def test_two_processes_read_disjoint_rows_whose_union_is_the_global_batch(tmp_path):
  prepare(tmp_path / "c")
  program = textwrap.dedent(f"""
      import sys
      import jax
      import numpy as np
      process = int(sys.argv[1])
      jax.distributed.initialize("127.0.0.1:{{}}".format(sys.argv[2]), 2, process)
      sys.path.insert(0, {str(REPO)!r})
      from retnet_jax.input_pipeline import loader, tokenizer
      from tests.test_prepared import data_config
      mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
      sharding = jax.NamedSharding(mesh, jax.P("data"))
      corpora = loader.open_corpora(data_config([{str(tmp_path / "c")!r}]), tokenizer.load("byte"))
      batches = loader.PreparedBatches(corpora, 15, 8, 5, sharding)
      local = [np.asarray(next(batches).addressable_shards[0].data) for _ in range(3)]
      np.save({str(tmp_path)!r} + f"/rows_{{process}}.npy", np.stack(local))
      """)
  port = free_port()
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
  processes = [subprocess.Popen([sys.executable, "-c", program, str(i), str(port)], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
  for process in processes:
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output[-3000:]
  local = [np.load(tmp_path / f"rows_{i}.npy") for i in range(2)]  # [batches, 4, 16] each
  single = loader.PreparedBatches(loader.open_corpora(data_config([tmp_path / "c"]), tokenizer_lib.load("byte")), 15,
                                  8, 5)
  for b in range(3):
    expected = {bytes(row) for row in np.asarray(next(single))}
    halves = [{bytes(row) for row in local[i][b]} for i in range(2)]
    assert len(halves[0]) == len(halves[1]) == 4 and not halves[0] & halves[1]
    assert halves[0] | halves[1] == expected


@pytest.mark.slow
def test_training_from_a_prepared_corpus_resumes_mid_epoch_exactly(tmp_path):
  prepare(tmp_path / "c", DOCUMENTS * 4, shard_tokens=4000)
  config = tiny_config(tmp_path, steps=12, eval_every_steps=6)
  config.data.files = ()
  config.data.prepared = (str(tmp_path / "c"),)
  config.checkpoint.every_steps = 6
  workdir = tmp_path / "run"
  train.train_and_evaluate(config, workdir)
  straight = read_metrics(workdir)
  shutil.rmtree(workdir / "checkpoints" / "12")  # as if stopped after step 6's checkpoint
  shutil.rmtree(workdir / "params")
  train.train_and_evaluate(config, workdir)  # resumes from step 6, mid-epoch
  assert_resumed_from(workdir, 6)
  assert read_metrics(workdir) == straight and len(straight) == 12
  output = script_stdout("evaluate.py", f"--workdir={workdir}", "--config=configs/retnet.py:tiny",
                      f"--config.data.prepared={tmp_path / 'c'}", "--config.train.seq_len=32",
                      "--config.train.batch_size=8", "--mode=chunkwise")
  assert json.loads(output.splitlines()[-1])["modes"]["chunkwise"]["loss"] > 0


def test_prepare_data_script_reports_progress_and_json_and_refuses_a_second_run(tmp_path):
  corpus = tmp_path / "docs.jsonl"
  corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in DOCUMENTS))
  flags = ["--config=configs/retnet.py:tiny", f"--config.data.files={corpus}", f"--out={tmp_path / 'out'}",
           "--workers=2", "--shard_tokens=1000"]
  result = run_script("prepare_data.py", *flags)
  assert result.returncode == 0, result.stderr[-3000:]
  summary = json.loads(result.stdout.strip().splitlines()[-1])
  assert summary["documents"] == {"train": 54, "validation": 6} and summary["out"] == str(tmp_path / "out")
  assert "prepared 54 training and 6 validation documents" in result.stderr
  prepared.open_corpus(tmp_path / "out", tokenizer_lib.load("byte"))
  again = run_script("prepare_data.py", *flags)
  assert again.returncode == 1 and again.stderr.strip().splitlines()[-1].startswith(
      "error: --out=") and "already holds a prepared corpus" in again.stderr
  one_document = run_script("prepare_data.py", "--config=configs/retnet.py:tiny", f"--out={tmp_path / 'shakespeare'}")
  assert one_document.returncode == 1 and "the validation split of" in one_document.stderr and \
      "came out empty: give more documents or data.validation_files" in one_document.stderr


def test_sources_stream_parquet_rows_a_local_dataset_and_validation_files(tmp_path):
  """Parquet rows and a dataset directory (read as data.hub_dataset reads a hub name) are documents; with
  data.validation_files, those are the validation split and nothing is held out."""
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  from retnet_jax.input_pipeline import sources  # pylint: disable=import-outside-toplevel
  pq.write_table(pa.table({"body": DOCUMENTS[:30]}), tmp_path / "rows.parquet")
  (tmp_path / "hub").mkdir()
  (tmp_path / "hub" / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCUMENTS[30:]))
  (tmp_path / "valid.txt").write_text("a validation document")
  config = ml_collections.ConfigDict(dict(files=(str(tmp_path / "rows.parquet"),), hub_dataset=None, hub_config=None,
                                          text_field="body", validation_files=(str(tmp_path / "valid.txt"),)))
  train_stream, validation = sources.of_config(config)
  assert list(train_stream) == DOCUMENTS[:30] and list(validation) == ["a validation document"]
  metadata = prepared.write(tmp_path / "c", train_stream, validation, "byte", train_stream.names(), 0.1)
  assert metadata["documents"] == {"train": 30, "validation": 1} and not metadata["held_out"]
  config.update(files=(), hub_dataset=str(tmp_path / "hub"), text_field="text")
  hub, _ = sources.of_config(config)
  assert list(hub) == DOCUMENTS[30:] and hub.characters == sum(map(len, DOCUMENTS[30:]))
  assert hub.total_characters is None
  assert hub.names() == [f"hub:{tmp_path / 'hub'}"]
  config.text_field = "body"
  with pytest.raises(ValueError, match=rf"^data.hub_dataset='{tmp_path / 'hub'}' has no field 'body' \(fields: "
                                       r"\['text'\]\); set data.text_field"):
    list(sources.of_config(config)[0])


@pytest.mark.slow
def test_training_resets_at_prepared_documents(tmp_path):
  """data.reset_at_documents on a prepared corpus: batches carry the stored documents' ids (the tokens as without
  them) into the model: the losses, training and evaluation, differ from the same run with the documents ignored."""
  prepare(tmp_path / "c", DOCUMENTS * 4, shard_tokens=4000)
  config = tiny_config(tmp_path, steps=2, eval_every_steps=2)
  config.data.update(files=(), prepared=(str(tmp_path / "c"),), reset_at_documents=True)
  corpora = loader.open_corpora(config.data, tokenizer_lib.load("byte"))
  tokens, _, ids = next(loader.PreparedBatches(corpora, 32, 8, 0, documents=True))
  assert tokens.shape == ids.shape == (8, 33) and int((np.diff(np.asarray(ids), axis=1) > 0).sum()) > 0
  np.testing.assert_array_equal(tokens, next(loader.PreparedBatches(corpora, 32, 8, 0)))
  final = train.train_and_evaluate(config, tmp_path / "run")
  config.data.reset_at_documents = False
  ignored = train.train_and_evaluate(config, tmp_path / "ignored")
  assert np.isfinite(final["eval_loss"]) and abs(final["eval_loss"] - ignored["eval_loss"]) > 1e-4
  losses, ignored_losses = read_metrics(tmp_path / "run"), read_metrics(tmp_path / "ignored")
  assert sorted(losses) == [1, 2] and all(abs(losses[s] - ignored_losses[s]) > 1e-4 for s in losses), losses


def test_a_position_saved_before_grain_continues_after_as_many_batches(tmp_path):
  """Checkpoints of earlier runs hold (epoch, index): resuming continues after epoch * batches per epoch + index."""
  prepare(tmp_path / "c")
  corpora = loader.open_corpora(data_config([tmp_path / "c"]), tokenizer_lib.load("byte"))
  batches = loader.PreparedBatches(corpora, 15, 4, seed=0)
  per_epoch = len(corpora[0].rows("train", 15)) // 4
  old = loader.PreparedBatches(corpora, 15, 4, seed=0)
  old.set_state({"epoch": np.int64(1), "index": np.int64(2)})
  assert old.get_state() == {"grain": {"next_index": per_epoch + 2}}
  for _ in range(per_epoch + 2):
    next(batches)
  np.testing.assert_array_equal(np.asarray(next(old)), np.asarray(next(batches)))


def test_a_cached_corpus_reads_the_files_its_key_describes(tmp_path, monkeypatch):
  """The cache key and the documents read come from one expansion of data.files: a file matching the glob after
  the key was made is not read into the entry keyed without it (the sources are listed once)."""
  monkeypatch.setenv("RETNET_JAX_CACHE", str(tmp_path / "cache"))
  (tmp_path / "a.txt").write_text("first document\n" * 40)
  listed, text_sources = [], data.text_sources

  def late_file(data_cfg):  # another file arrives once the sources are listed
    listed.append(text_sources(data_cfg))
    (tmp_path / "b.txt").write_text("a later document\n" * 40)
    return listed[-1]

  monkeypatch.setattr(data, "text_sources", late_file)
  config = DataConfig.of({**presets.get_config("tiny").data.to_dict(), "files": (str(tmp_path / "*.txt"),)}, "data")
  (corpus,) = loader.open_corpora(config, tokenizer_lib.load("byte"))
  assert len(listed) == 1 and corpus.metadata["sources"] == [str(tmp_path / "a.txt")], corpus.metadata


def test_plain_files_train_through_their_cached_corpus(tmp_path, monkeypatch):
  """data.files are prepared once into the cache (keyed by the files and tokenizer), then mapped: the same rows
  as packing the split in memory, a changed file makes another entry."""
  monkeypatch.setenv("RETNET_JAX_CACHE", str(tmp_path / "cache"))
  path = tmp_path / "docs.jsonl"
  path.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCUMENTS))
  config = ml_collections.ConfigDict(dict(files=(str(path),), validation_files=(), validation_fraction=0.1,
                                          hub_dataset=None, hub_config=None, text_field="text", tokenizer="byte",
                                          reset_at_documents=False, prepared=(), prepared_weights=()))
  byte = tokenizer_lib.load("byte")
  (corpus,) = loader.open_corpora(config, byte)
  train_split, valid_split = data.load_documents(config, byte)
  np.testing.assert_array_equal(corpus.rows("train", 15).take(range(3)), data.pack(train_split.tokens, 15)[:3])
  np.testing.assert_array_equal(loader.validation_rows([corpus], 15, False).take(range(len(data.pack(
      valid_split.tokens, 15)))), data.pack(valid_split.tokens, 15))
  assert loader.open_corpora(config, byte)[0].path == corpus.path  # reused
  shard = corpus.path / "train-00000.tokens"
  shard.write_bytes(shard.read_bytes()[:-3])
  rebuilt = loader.open_corpora(config, byte)[0]  # a damaged entry is built again
  assert rebuilt.path == corpus.path and rebuilt.num_tokens("train") == len(train_split.tokens)
  path.write_text(path.read_text() + json.dumps({"text": "one more"}) + "\n")
  assert loader.open_corpora(config, byte)[0].path != corpus.path
  config.reset_at_documents = True
  one = tmp_path / "one.txt"
  one.write_text("a single document")
  config.files = (str(one),)
  with pytest.raises(ValueError, match=r"data.reset_at_documents=True but data.files holds a single document"):
    loader.open_corpora(config, byte)


def _interrupted_prepare(out):
  with pytest.raises(KeyboardInterrupt):
    prepare(out, interrupted(40))


def _finished_prepare(out):
  prepare(out)


def _edit_json(path, edit):
  path.write_text(edit(path.read_text()))


# The campaign's shapes of bad input (issue 41): (setup of the folder, what is run, the one line expected, which
# names the file or field). `run` is "prepare" (prepared.write into the folder), "open" (training's open_corpus)
# or "train" (loader.open_corpora of a data config).
BAD_INPUTS = {
    "an empty file in --out": (lambda out: (out.mkdir(), (out / "notes").write_text("")), "prepare",
                               r"--out='{out}' holds 'notes', which this project did not write \(no "
                               r"\.retnet_jax\.json\); choose a new or empty --out"),
    "a file named like a shard in --out": (
        lambda out: (out.mkdir(), (out / "train-notes.txt").write_text("mine")), "prepare",
        r"--out='{out}' holds 'train-notes.txt', which this project did not write"),
    "--out a file": (lambda out: out.write_text("mine"), "prepare", r"--out='{out}' is a file; give a directory"),
    "--out under a file": (lambda out: out.write_text("mine"), "prepare inside",
                           r"--out='{out}/inside' lies under '{out}', which is a file; give a directory"),
    "progress.json of {}": (lambda out: (_interrupted_prepare(out), (out / "progress.json").write_text("{}")),
                            "prepare", r"--out='{out}': its progress.json is not a prepare's progress \(no field "
                                       r"'settings'\); delete '{out}' and prepare again."),
    "progress.json not JSON": (lambda out: (_interrupted_prepare(out), (out / "progress.json").write_text("{x")),
                               "prepare", r"--out='{out}': its progress.json is not a prepare's progress \(Expecting"),
    "progress.json of a list": (lambda out: (_interrupted_prepare(out), (out / "progress.json").write_text("[1]")),
                                "prepare", r"its progress.json is not a prepare's progress \(list \[1\], not an "),
    "progress.json with a bad count": (
        lambda out: (_interrupted_prepare(out), _edit_json(out / "progress.json", lambda t: json.dumps(
            {**json.loads(t), "consumed": -3}))), "prepare", r"its progress.json is not a prepare's progress "
                                                             r"\(consumed -3 is not a count of documents\)"),
    "an interrupted prepare, half-written": (_interrupted_prepare, "open",
                                             r"data.prepared='{out}' is half-written \(a prepare was interrupted\); "
                                             r"rerun scripts/prepare_data.py --out={out} to finish it."),
    "metadata.json not JSON": (lambda out: (_finished_prepare(out), (out / "metadata.json").write_text("{x")),
                               "open", r"data.prepared='{out}': its metadata.json is unreadable or of another "
                                       r"format \(Expecting .*\); prepare it again: delete '{out}'"),
    "metadata.json without splits": (
        lambda out: (_finished_prepare(out), _edit_json(out / "metadata.json", lambda t: json.dumps(
            {k: v for k, v in json.loads(t).items() if k != "splits"}))), "open",
        r"its metadata.json is unreadable or of another format \(no field 'splits'\)"),
    "metadata.json of another version": (
        lambda out: (_finished_prepare(out), _edit_json(out / "metadata.json", lambda t: json.dumps(
            {**json.loads(t), "version": 99}))), "open", r"of another format \(format 'retnet_jax.prepared' version "
                                                         r"99\)"),
    "a shard's name taken by the user's file": (
        lambda out: (_finished_prepare(out), (out / "validation-00000.starts").write_text("mine")), "open",
        r"data.prepared='{out}': shard validation-00000.starts holds 4 bytes, not \d+ \(damaged or truncated\)"),
    "data.validation_fraction=-0.5": (lambda out: None, "prepare -0.5",
                                      r"data.validation_fraction=-0.5 must lie strictly between 0 and 1 \(the share "
                                      r"of documents held out for validation\); set it to e.g. 0.1, or give "
                                      r"data.validation_files."),
    "data.validation_fraction=1": (lambda out: None, "prepare 1", r"data.validation_fraction=1.0 must lie strictly"),
    "data.prepared=''": (lambda out: None, "train ''", r"data.prepared is empty \(data.prepared=\(''?,?\)\); give "
                                                      r"the --out directory of scripts/prepare_data.py, or unset "
                                                      r"data.prepared to train on data.files."),
    "one of data.prepared ''": (lambda out: _finished_prepare(out), "train both",
                                r"data.prepared\[1\] is empty \(data.prepared=\('{out}', ''\)\); give the --out"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_the_campaigns_bad_inputs_are_one_line_naming_the_file_or_field(tmp_path, case):
  """Each bad shape of a prepared corpus or of --out is refused in one line naming the file (or field) and the fix,
  and no file of the user's is changed."""
  setup, run, expected = BAD_INPUTS[case]
  out = tmp_path / "c"
  setup(out)
  before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} if out.exists() else {}
  byte = tokenizer_lib.load("byte")
  with pytest.raises(ValueError) as error:
    if run == "prepare":
      prepare(out)
    elif run == "prepare inside":
      prepare(out / "inside")
    elif run.startswith("prepare "):
      prepared.write(out, DOCUMENTS, None, "byte", ["test"], float(run.split()[1]))
    elif run == "open":
      prepared.open_corpus(out, byte)
    else:
      loader.open_corpora(data_config([out, ""] if run == "train both" else [""]), byte)
  message = str(error.value)
  assert "\n" not in message and re.search(expected.format(out=re.escape(str(out))), message), message
  assert str(out) in message or message.startswith("data."), message  # the file, or the field
  if not case.startswith("progress.json"):  # a resumed prepare refused: its own files are kept as they were too
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
  assert not (tmp_path / "c" / "inside").exists()


def test_a_users_file_named_like_a_shard_survives_a_resumed_prepare_and_training(tmp_path):
  """`train-notes.txt` is no shard name (int() of 'notes' failed once): a resume keeps it, training ignores it."""
  out = tmp_path / "c"
  with pytest.raises(KeyboardInterrupt):
    prepare(out, interrupted(40))
  (out / "train-notes.txt").write_text("mine")
  prepare(out)
  assert (out / "train-notes.txt").read_text() == "mine"
  assert prepared.open_corpus(out, tokenizer_lib.load("byte")).num_tokens("train") > 0
