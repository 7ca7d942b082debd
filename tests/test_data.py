"""Tokenizers (retnet_jax.input_pipeline.tokenizer), loading, packing and batching of retnet_jax.input_pipeline.data."""

import importlib.util
import json
import logging
from pathlib import Path

import datasets
import jax
import numpy as np
import pytest
import tokenizers
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import corpus as bench_corpus
from retnet_jax.input_pipeline import data, global_batches, sources, tokenizer

REPO = Path(__file__).resolve().parent.parent


def data_config(**overrides):
  """The real `config.data` section (so field names stay in step with configs/retnet.py), overridden."""
  spec = importlib.util.spec_from_file_location("retnet_config", REPO / "configs" / "retnet.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = module.get_config("tiny").data
  for name, value in overrides.items():
    cfg[name] = value
  return cfg


def byte_tokens(text):
  return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory):
  """A tiny byte-level BPE tokenizer.json with an end-of-text token, trained on the fly."""
  path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
  return bench_corpus.train_bpe(["the quick brown fox", "jumps over the lazy dog", "the dog sleeps"] * 10, path,
                                vocab_size=300)


def write_jsonl(path, rows):
  path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
  return path


# Tokenizers.

def test_byte_tokenizer_round_trip():
  tok = tokenizer.load("byte")
  text = "Hello, wörld — 日本語 🙂\n"
  ids = tok.encode(text)
  assert tok.vocab_size == 256 and tok.eos_id is None
  assert ids.dtype == np.int32 and ids.min() >= 0 and ids.max() < 256
  np.testing.assert_array_equal(ids, byte_tokens(text))
  assert tok.decode(ids) == text
  assert tok.decode(byte_tokens("日")[:2]) == "\ufffd"  # a character cut in two decodes, replaced
  # Ids beyond the bytes (sampled from a model with a larger vocabulary) decode as U+FFFD too.
  assert tok.decode(np.concatenate([[300], byte_tokens("wö"), [-1, 256]])) == "\ufffdwö\ufffd\ufffd"


def test_hf_tokenizer_round_trip(bpe_path):
  tok = tokenizer.load(str(bpe_path))
  reference = tokenizers.Tokenizer.from_file(str(bpe_path))
  text = "the lazy fox sleeps, ünïcode too"
  ids = tok.encode(text)
  assert isinstance(tok, tokenizer.HFTokenizer)
  assert tok.vocab_size == reference.get_vocab_size()
  assert tok.eos_id == reference.token_to_id("<|endoftext|>")
  assert ids.dtype == np.int32 and len(ids) < len(text.encode())  # merges apply
  assert tok.decode(ids) == text
  np.testing.assert_array_equal(np.concatenate(tok.encode_batch([text, "dog"])),
                                np.concatenate([ids, tok.encode("dog")]))


@pytest.mark.parametrize("spec", ["gpt2", "no/such/tokenizer.json", ""])
def test_unknown_tokenizer_errors(spec):
  with pytest.raises(ValueError, match="use 'byte' or the path of a tokenizer.json"):
    tokenizer.load(spec)


def test_malformed_tokenizer_file_errors(tmp_path):
  path = tmp_path / "tokenizer.json"
  path.write_text("{not json")
  with pytest.raises(ValueError, match="could not be read"):
    tokenizer.load(str(path))


def test_load_checks_the_vocabulary_size(bpe_path):
  size = tokenizers.Tokenizer.from_file(str(bpe_path)).get_vocab_size()
  assert tokenizer.load(str(bpe_path), vocab_size=size).vocab_size == size
  assert isinstance(tokenizer.load("byte", vocab_size=None), tokenizer.ByteTokenizer)  # None: unchecked
  with pytest.raises(ValueError, match=rf"the tokenizer has {size} tokens but model.vocab_size={size - 1}; set "
                                       rf"--config.model.vocab_size={size} or more"):
    tokenizer.load(str(bpe_path), vocab_size=size - 1)
  with pytest.raises(ValueError, match="the tokenizer has 256 tokens but model.vocab_size=64"):
    tokenizer.load("byte", vocab_size=64)


# Packing.

def test_pack_keeps_every_token_once_in_order():
  tokens = np.arange(1000, 1103, dtype=np.int32)
  packed = data.pack(tokens, seq_len=9)
  assert packed.shape == (10, 10) and packed.dtype == np.int32
  np.testing.assert_array_equal(packed.reshape(-1), tokens[:100])


def test_pack_too_short_errors():
  with pytest.raises(ValueError, match=r"5 tokens.*seq_len \+ 1 = 9.*smaller train.seq_len or more data"):
    data.pack(np.arange(5), seq_len=8)


# Loading.

def test_default_corpus_split():
  corpus = (REPO / "data" / "tinyshakespeare.txt").read_bytes()
  train, valid = (split.tokens for split in data.load_documents(data_config(), tokenizer.ByteTokenizer()))
  assert train.dtype == valid.dtype == np.int32
  assert len(train) + len(valid) == len(corpus)
  assert len(valid) == int(len(corpus) * 0.1)
  np.testing.assert_array_equal(valid, np.frombuffer(corpus[-len(valid):], dtype=np.uint8))
  np.testing.assert_array_equal(train[:1000], np.frombuffer(corpus[:1000], dtype=np.uint8))


def test_local_txt_files_in_order(tmp_path):
  first, second, valid = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "v.txt"
  first.write_text("Première ligne.\nSecond line.\n", encoding="utf-8")
  second.write_text("Another document.\n", encoding="utf-8")
  valid.write_text("held out\n", encoding="utf-8")
  cfg = data_config(files=(str(first), str(second)), validation_files=(str(valid),))
  train, held_out = (split.tokens for split in data.load_documents(cfg, tokenizer.ByteTokenizer()))
  np.testing.assert_array_equal(train, byte_tokens("Première ligne.\nSecond line.\nAnother document.\n"))
  np.testing.assert_array_equal(held_out, byte_tokens("held out\n"))


@pytest.mark.skipif(datasets.config.HF_DATASETS_DISABLE_PROGRESS_BARS is not None,
                    reason="HF_DATASETS_DISABLE_PROGRESS_BARS is set: the user's choice decides the bars")
def test_a_small_file_loads_without_progress_bars_and_a_large_one_keeps_them(tmp_path, capfd, monkeypatch):
  """The first run printed the datasets library's bars ("Generating train split", "Tokenizing") for a one-file
  corpus read in a fraction of a second: a file below QUIET_BELOW_BYTES loads without them, a larger one keeps
  them, and the library's setting is as it was after either."""
  path = tmp_path / "corpus.txt"
  path.write_text("a small corpus\n" * 50, encoding="utf-8")
  cfg = data_config(files=(str(path),), validation_files=(str(path),))
  capfd.readouterr()
  data.load_documents(cfg, tokenizer.ByteTokenizer())
  err = capfd.readouterr().err
  assert "Tokenizing" not in err and "Generating" not in err, err
  assert not datasets.are_progress_bars_disabled()
  monkeypatch.setattr(data, "QUIET_BELOW_BYTES", path.stat().st_size)  # the file counts as large
  data.load_documents(cfg, tokenizer.ByteTokenizer())
  assert "Tokenizing" in capfd.readouterr().err
  assert not datasets.are_progress_bars_disabled()


def test_local_jsonl_field_and_validation_fraction(tmp_path):
  path = write_jsonl(tmp_path / "docs.jsonl", [{"id": i, "body": f"doc {i};"} for i in range(10)])
  cfg = data_config(files=(str(path),), text_field="body", validation_fraction=0.25)
  train, valid = (split.tokens for split in data.load_documents(cfg, tokenizer.ByteTokenizer()))
  stream = byte_tokens("".join(f"doc {i};" for i in range(10)))
  num_valid = int(len(stream) * 0.25)
  np.testing.assert_array_equal(train, stream[:-num_valid])
  np.testing.assert_array_equal(valid, stream[-num_valid:])


def test_local_parquet(tmp_path):
  path = tmp_path / "docs.parquet"
  datasets.Dataset.from_dict({"text": ["alpha ", "", "beta ", "gamma"], "n": [1, 2, 3, 4]}).to_parquet(path)
  cfg = data_config(files=(str(path),), validation_files=(str(path),))
  train, valid = (split.tokens for split in data.load_documents(cfg, tokenizer.ByteTokenizer()))
  np.testing.assert_array_equal(train, byte_tokens("alpha beta gamma"))
  np.testing.assert_array_equal(valid, train)


def test_hf_tokenizer_separates_documents_with_eos(tmp_path, bpe_path):
  tok = tokenizer.load(str(bpe_path))
  docs = ["the quick fox", "the lazy dog", "over"]
  rows = [{"text": docs[0]}, {"text": ""}, {"other": "no text"}, {"text": docs[1]}]  # empty ones: no token
  path = write_jsonl(tmp_path / "docs.jsonl", rows)
  other = write_jsonl(tmp_path / "other.jsonl", [{"text": docs[2]}])
  train, _ = data.load_documents(data_config(files=(str(path), str(other)), validation_files=(str(other),)), tok)
  eos = np.asarray([tok.eos_id], dtype=np.int32)
  expected = np.concatenate([tok.encode(docs[0]), eos, tok.encode(docs[1]), eos, tok.encode(docs[2])])
  np.testing.assert_array_equal(train.tokens, expected)


def test_globs_expand_and_rows_without_text_are_counted(tmp_path, caplog):
  for name, text in (("b.txt", "second "), ("a.txt", "first "), ("c.md", "not matched")):
    (tmp_path / name).write_text(text)
  only_a = (str(tmp_path / "a.txt"),)
  train, _ = data.load_documents(data_config(files=(str(tmp_path / "*.txt"),), validation_files=only_a),
                                 tokenizer.ByteTokenizer())
  np.testing.assert_array_equal(train.tokens, byte_tokens("first second "))  # sorted matches
  with pytest.raises(FileNotFoundError, match=r"data\.files: the pattern .*\*\.json' matches no file"):
    data.load_documents(data_config(files=(str(tmp_path / "*.json"),)), tokenizer.ByteTokenizer())
  rows = write_jsonl(tmp_path / "half.jsonl", [{"text": "a"}, {"other": 1}, {"text": "b"}, {"text": ""}])
  with caplog.at_level(logging.WARNING, logger="absl"):
    data.load_documents(data_config(files=(str(rows),), validation_files=only_a), tokenizer.ByteTokenizer())
  assert "half.jsonl': 2 of 4 rows have no text in field 'text'; they are skipped" in caplog.text
  with pytest.raises(ValueError, match=r"the validation split holds 5 tokens, too few"):
    data.pack(np.arange(5), 8, "validation split")


def test_missing_file_errors(tmp_path):
  missing = str(tmp_path / "nope.txt")
  with pytest.raises(FileNotFoundError, match=r"data\.files.*nope\.txt.*does not exist"):
    data.load_documents(data_config(files=(missing,)), tokenizer.ByteTokenizer())
  real = tmp_path / "real.txt"
  real.write_text("some text")
  with pytest.raises(FileNotFoundError, match=r"data\.validation_files.*nope\.txt"):
    data.load_documents(data_config(files=(str(real),), validation_files=(missing,)), tokenizer.ByteTokenizer())


def test_empty_file_errors(tmp_path):
  path = tmp_path / "empty.txt"
  path.write_text("")
  with pytest.raises(ValueError, match=r"empty\.txt.*is empty"):
    data.load_documents(data_config(files=(str(path),)), tokenizer.ByteTokenizer())


def test_no_text_errors(tmp_path):
  path = write_jsonl(tmp_path / "blank.jsonl", [{"text": ""}, {"text": ""}])
  with pytest.raises(ValueError, match=r"blank\.jsonl.*holds no text in field 'text'"):
    data.load_documents(data_config(files=(str(path),)), tokenizer.ByteTokenizer())


def test_bad_extension_errors(tmp_path):
  path = tmp_path / "table.csv"
  path.write_text("text\nhello\n")
  with pytest.raises(ValueError, match=r"table\.csv.*unsupported type '\.csv'.*\.txt.*\.jsonl.*\.parquet"):
    data.load_documents(data_config(files=(str(path),)), tokenizer.ByteTokenizer())


ROWS = "".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(5))


@pytest.mark.parametrize("name, text, message", [
    ("broken.parquet", "not a parquet file", r"'.*broken\.parquet' is not a readable Parquet file \(Parquet magic "
                                             r"bytes not found.*\); give a Parquet file, or a file named by its "
                                             r"format \(\.jsonl, \.txt\)\.$"),
    ("rows.jsonl", ROWS + "{not json\n" + ROWS, r"'.*rows\.jsonl' line 6 is not a JSON object \(Expecting property "
                                                r"name enclosed in double quotes at column 2\); a JSON-lines file "
                                                r"holds one object per line: fix or remove that line\.$"),
    ("rows.jsonl", ROWS + "\n[1, 2]\n", r"'.*rows\.jsonl' line 7 is not a JSON object \(a list\)"),
    ("rows.json", ROWS[:-1] + "}\n", r"'.*rows\.json' line 5 is not a JSON object \(Extra data at column"),
])
def test_an_unreadable_file_is_named_with_its_line_and_the_fix(tmp_path, name, text, message):
  """Arrow's message ("JSON parse error: ... in row 5", counted within a block) named neither the file nor the line,
  whether the files are read whole (training's cache) or streamed (prepare_data.py)."""
  path = tmp_path / name
  path.write_text(text)
  with pytest.raises(ValueError, match=r"^data\.files: " + message):
    data.load_documents(data_config(files=(str(path),)), tokenizer.ByteTokenizer())
  train, _ = sources.of_config(data_config(files=(str(path),)))
  with pytest.raises(ValueError, match=r"^data\.files: " + message):
    list(train)


def test_missing_text_field_errors(tmp_path):
  jsonl = write_jsonl(tmp_path / "docs.jsonl", [{"content": "hello"}])
  with pytest.raises(ValueError, match=r"no field 'text'.*content.*set data\.text_field"):
    data.load_documents(data_config(files=(str(jsonl),)), tokenizer.ByteTokenizer())
  parquet = tmp_path / "docs.parquet"
  datasets.Dataset.from_dict({"body": ["hello"]}).to_parquet(parquet)
  with pytest.raises(ValueError, match=r"docs\.parquet' has no field 'text'.*set data\.text_field"):
    data.load_documents(data_config(files=(str(parquet),)), tokenizer.ByteTokenizer())


def test_one_chooser_names_the_source_for_training_and_preparing(tmp_path, monkeypatch):
  """data.text_sources picks files, else the hub dataset, else the shipped corpus; load_documents and sources.of_config
  read what it picks, and both refuse a missing shipped corpus with its message."""
  for name in ("b.txt", "a.txt"):
    (tmp_path / name).write_text(f"text of {name}")
  pattern, valid = str(tmp_path / "*.txt"), str(tmp_path / "a.txt")
  train, validation = data.text_sources(data_config(files=(pattern,), hub_dataset="ignored/dataset",
                                                    validation_files=(valid,)))
  assert train == data.TextSource("files", (str(tmp_path / "a.txt"), str(tmp_path / "b.txt")), None, None, "text",
                                  "data.files")
  assert validation == data.TextSource("files", (valid,), None, None, "text", "data.validation_files")
  hub, none = data.text_sources(data_config(hub_dataset="some/dataset", hub_config="en", text_field="body"))
  assert hub == data.TextSource("hub", (), "some/dataset", "en", "body", "data.hub_dataset='some/dataset'")
  assert none is None and hub.names() == ["hub:some/dataset/en"] and train.names() == list(train.files)
  shipped, _ = data.text_sources(data_config())
  assert shipped == data.TextSource("shipped", (str(data.DEFAULT_CORPUS),), None, None, "text",
                                    "the shipped corpus (data.files empty)")
  streamed, held_out = sources.of_config(data_config(files=(pattern,), validation_files=(valid,)))
  assert streamed.source == train and held_out.source == validation and sources.of_config(data_config())[1] is None
  assert list(streamed) == ["text of a.txt", "text of b.txt"] and streamed.characters == 26
  monkeypatch.setattr(data, "DEFAULT_CORPUS", tmp_path / "missing.txt")
  for read in (lambda: data.load_documents(data_config(), tokenizer.ByteTokenizer()),
               lambda: sources.of_config(data_config())):
    with pytest.raises(FileNotFoundError, match=r"^the shipped corpus .*missing\.txt is missing \(data/ is not "
                                                r"installed with the package\); set data\.files"):
      read()


def test_document_texts_checks_the_text_field():
  rows = {"text": ["a", None, ""], "id": [1, 2, 3]}
  assert data.document_texts(rows, "text", "here") == ["a", "", ""]  # null: no text
  with pytest.raises(ValueError, match=r"^here has no field 'body' \(fields: \['id', 'text'\]\); set "
                                       r"data\.text_field to the field holding the text\.$"):
    data.document_texts(rows, "body", "here")
  with pytest.raises(ValueError, match=r"^here: field 'id' holds int, not text; set data\.text_field"):
    data.document_texts(rows, "id", "here")


def test_both_readers_refuse_a_field_that_is_not_text_alike(tmp_path):
  path = write_jsonl(tmp_path / "ids.jsonl", [{"text": 1}, {"text": 2}])
  message = r"^data\.files: '.*ids\.jsonl': field 'text' holds int, not text; set data\.text_field"
  with pytest.raises(ValueError, match=message):
    data.load_documents(data_config(files=(str(path),)), tokenizer.ByteTokenizer())
  with pytest.raises(ValueError, match=message):
    list(sources.of_config(data_config(files=(str(path),)))[0])


def test_unreachable_hub_errors(monkeypatch):
  def offline(*args, **kwargs):
    raise ConnectionError("Couldn't reach 'some/dataset' on the Hub")
  monkeypatch.setattr(datasets, "load_dataset", offline)
  with pytest.raises(ConnectionError, match=r"'some/dataset'.*hub could not be reached.*data\.files"):
    data.load_documents(data_config(hub_dataset="some/dataset"), tokenizer.ByteTokenizer())


# Batches.

def sequences(num=10, width=5):
  return np.arange(num * width, dtype=np.int32).reshape(num, width)


@pytest.mark.parametrize("process_count", [1, 2, 4])
def test_process_rows_split_global_batch(process_count):
  blocks = [global_batches.process_rows(8, index, process_count) for index in range(process_count)]
  rows = np.concatenate([np.arange(8)[block] for block in blocks])
  np.testing.assert_array_equal(rows, np.arange(8))  # disjoint, contiguous, in order, covering all rows
  assert all(block.stop - block.start == 8 // process_count for block in blocks)


def test_process_rows_indivisible_errors():
  with pytest.raises(ValueError, match="batch_size=6 is not divisible by the 4 processes"):
    global_batches.process_rows(6, 0, 4)
  with pytest.raises(ValueError, match=r"a batch must hold at least one sequence; got train.batch_size=0\."):
    global_batches.eval_batches(global_batches.SequenceRows(sequences(8, 3)), 0, None)


@pytest.fixture(scope="module")
def data_sharding():
  assert jax.device_count() == 8, "tests/conftest.py should give 8 CPU devices"
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  return NamedSharding(mesh, P("data"))


def test_eval_batches(data_sharding):
  seqs = sequences(40, 9)
  batches = list(global_batches.eval_batches(global_batches.SequenceRows(seqs), 16, max_batches=8,
                                             sharding=data_sharding))
  assert len(batches) == 2  # 40 sequences hold two full batches
  assert all(b.sharding == data_sharding and {s.data.shape for s in b.addressable_shards} == {(2, 9)}
             for b in batches)
  np.testing.assert_array_equal(np.concatenate([np.asarray(b) for b in batches]), seqs[:32])
  # One batch of two: its rows are spread evenly over the whole split, not its first 16 sequences.
  sample = list(global_batches.eval_batches(global_batches.SequenceRows(seqs), 16, max_batches=1, sharding=None))
  assert len(sample) == 1
  rows = np.arange(16) * 40 // 16
  assert rows[0] == 0 and rows[-1] == 37 and len(set(rows)) == 16
  assert sample[0].dtype == np.int32 and np.asarray(sample[0]).tobytes() == seqs[rows].tobytes()
  np.testing.assert_array_equal(global_batches.eval_rows(40, 16, 1), rows[None])
  with pytest.raises(ValueError, match=r"^the validation data holds 8 sequences, fewer than one batch of "
                                       r"train\.batch_size=16; use a smaller train\.batch_size or train\.seq_len, "
                                       r"or more data\.$"):
    global_batches.eval_batches(global_batches.SequenceRows(seqs[:8]), 16, max_batches=8, sharding=data_sharding)
  with pytest.raises(ValueError, match=r"^holds so much, fewer than one batch of B; fix it\.$"):
    global_batches.eval_batches(global_batches.SequenceRows(seqs[:8]), 16, None, holds="holds so much", batch="B",
                                fix="fix it")
  with pytest.raises(ValueError, match=r"validation sequences must be packed as \[num_sequences, seq_len \+ 1\]"):
    global_batches.SequenceRows(seqs.reshape(-1))


class Taken:
  """Rows whose batch is `(row numbers, None)`, recording what each `take` asked for."""

  def __init__(self, num_rows):
    self.num_rows, self.asked = num_rows, []

  def __len__(self):
    return self.num_rows

  def take(self, indices):
    self.asked.append(np.asarray(indices))
    return np.asarray(indices, np.int32)[:, None], None


def test_eval_batches_take_each_batch_of_eval_rows_and_keep_its_structure(monkeypatch):
  rows = Taken(50)
  batches = list(global_batches.eval_batches(rows, 8, 3))
  for asked, expected in zip(rows.asked, global_batches.eval_rows(50, 8, 3), strict=True):
    np.testing.assert_array_equal(asked, expected)
  assert all(isinstance(b, tuple) and b[1] is None for b in batches)
  np.testing.assert_array_equal(np.asarray(batches[1][0])[:, 0], global_batches.eval_rows(50, 8, 3)[1])
  monkeypatch.setattr(jax, "process_index", lambda: 1)  # process 1 of 2 takes the second half of each batch's rows
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  rows = Taken(50)
  list(global_batches.eval_batches(rows, 8, None))
  np.testing.assert_array_equal(np.stack(rows.asked), global_batches.eval_rows(50, 8, None)[:, 4:])
