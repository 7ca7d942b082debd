"""Packed documents (`data.reset_at_documents`): where documents start, the ids batches carry, and training and
evaluation on them equal to running each document alone."""

import datasets
import numpy as np
import pytest

from retnet_jax import data, tokenizer
from tests.test_data import bpe_path, byte_tokens, data_config, write_jsonl  # noqa: F401  (bpe_path: a fixture)


def ids_of(split):
  """Document ids of a split, as lists of each document's tokens (the split cut at its starts)."""
  ids = data.document_ids(split)
  assert ids.dtype == np.int32 and ids.shape == split.tokens.shape
  return [split.tokens[ids == d].tolist() for d in range(int(ids[-1]) + 1)]


def test_txt_files_jsonl_and_parquet_rows_start_documents(tmp_path):
  first, second = tmp_path / "a.txt", tmp_path / "b.txt"
  first.write_text("one\ntwo\n")
  second.write_text("three")
  rows = write_jsonl(tmp_path / "rows.jsonl", [{"text": "ab"}, {"text": ""}, {"text": "cde"}])
  parquet = tmp_path / "rows.parquet"
  datasets.Dataset.from_dict({"text": ["xy", "z"]}).to_parquet(parquet)
  files = tuple(map(str, (first, second, rows, parquet)))
  train, _ = data.load_documents(data_config(files=files, validation_files=(str(second),), reset_at_documents=True),
                                 tokenizer.ByteTokenizer())
  assert ids_of(train) == [byte_tokens(text).tolist() for text in ("one\ntwo\n", "three", "ab", "cde", "xy", "z")]
  np.testing.assert_array_equal(train.tokens, byte_tokens("one\ntwo\nthreeabcdexyz"))  # the tokens as before


def test_a_separator_opens_the_document_after_it(tmp_path, bpe_path):  # noqa: F811
  tok = tokenizer.load(str(bpe_path))
  docs = ["the quick fox", "the lazy dog", "over"]
  path = write_jsonl(tmp_path / "docs.jsonl", [{"text": docs[0]}, {"text": ""}, {"text": docs[1]}])
  other = write_jsonl(tmp_path / "other.jsonl", [{"text": docs[2]}])
  train, valid = data.load_documents(data_config(files=(str(path), str(other)), validation_files=(str(other),)), tok)
  eos = [tok.eos_id]
  assert ids_of(train) == [tok.encode(docs[0]).tolist()] + [eos + tok.encode(d).tolist() for d in docs[1:]]
  assert ids_of(valid) == [tok.encode(docs[2]).tolist()]


def test_the_validation_fraction_cuts_a_document_in_two(tmp_path):
  path = write_jsonl(tmp_path / "docs.jsonl", [{"text": text} for text in ("aaaa", "bbbb", "cccc", "dddd", "eeee")])
  train, valid = data.load_documents(data_config(files=(str(path),), validation_fraction=0.3),
                                     tokenizer.ByteTokenizer())  # 6 of 20 tokens held out: "dd" + "eeee"
  assert [bytes(d).decode() for d in ids_of(train)] == ["aaaa", "bbbb", "cccc", "dd"]
  assert [bytes(d).decode() for d in ids_of(valid)] == ["dd", "eeee"]
  train, valid = data.load_documents(data_config(files=(str(path),), validation_fraction=0.2),
                                     tokenizer.ByteTokenizer())  # the cut on a document start
  assert [bytes(d).decode() for d in ids_of(valid)] == ["eeee"] and len(ids_of(train)) == 4


def test_packed_rows_hold_several_documents_and_documents_span_rows(tmp_path):
  texts = ["a" * 3, "b" * 11, "c" * 2, "d" * 5]
  path = write_jsonl(tmp_path / "docs.jsonl", [{"text": text} for text in texts])
  train, _ = data.load_documents(data_config(files=(str(path),), validation_files=(str(path),)),
                                 tokenizer.ByteTokenizer())
  sequences, ids = data.pack_split(train, 4, "training split", reset_at_documents=True)
  np.testing.assert_array_equal(sequences, data.pack(train.tokens, 4))
  assert ids.shape == sequences.shape and ids.dtype == np.int32
  # Rows of 5 tokens: "aaabb" (two documents), "bbbbb" and "bbbbc" (the long one across three rows), "cdddd".
  np.testing.assert_array_equal(ids, [[0, 0, 0, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 1, 2], [2, 3, 3, 3, 3]])
  assert data.pack_split(train, 4, "training split", reset_at_documents=False)[1] is None


def test_one_document_is_refused_with_the_flag(tmp_path):
  path = tmp_path / "one.txt"
  path.write_text("a single document")
  with pytest.raises(ValueError, match=r"data.reset_at_documents=True but data.files holds a single document .*"
                                       r"give several files or rows, or set data.reset_at_documents=False"):
    data.load_documents(data_config(files=(str(path),), reset_at_documents=True), tokenizer.ByteTokenizer())
  with pytest.raises(ValueError, match=r"the shipped corpus \(data.files empty\) holds a single document"):
    data.load_splits(data_config(reset_at_documents=True), tokenizer.ByteTokenizer())


def packed(num=10, width=5):
  """Sequences `[num, width]` and document ids that change inside some rows."""
  sequences = np.arange(num * width, dtype=np.int32).reshape(num, width)
  return sequences, sequences // 7


def test_batches_carry_the_ids_of_their_rows_and_resume_exactly():
  sequences, ids = packed()
  iterator = data.BatchIterator(sequences, 3, seed=7, document_ids=ids)
  uninterrupted = [next(iterator) for _ in range(8)]
  for tokens, weights, batch_ids in uninterrupted:
    assert weights is None and batch_ids.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(batch_ids), np.asarray(tokens) // 7)
  plain = data.BatchIterator(sequences, 3, seed=7)
  np.testing.assert_array_equal(np.asarray(next(plain)), np.asarray(uninterrupted[0][0]))  # the same rows
  first = data.BatchIterator(sequences, 3, seed=7, document_ids=ids)
  for _ in range(4):  # mid-epoch of the second epoch
    next(first)
  resumed = data.BatchIterator(sequences, 3, seed=7, document_ids=ids)
  resumed.set_state({k: np.int64(v) for k, v in first.get_state().items()})
  for expected in uninterrupted[4:]:
    for got, want in zip(next(resumed), expected):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  evaluated = list(data.eval_batches(sequences, 3, 2, document_ids=ids))
  rows = data.eval_rows(10, 3, 2)
  for (tokens, _, batch_ids), row in zip(evaluated, rows):
    np.testing.assert_array_equal(np.asarray(tokens), sequences[row])
    np.testing.assert_array_equal(np.asarray(batch_ids), ids[row])


def test_ids_of_another_shape_are_refused():
  sequences, ids = packed()
  with pytest.raises(ValueError, match=r"training document_ids of shape \(10, 4\) do not match the sequences' "
                                       r"\(10, 5\); pack both with pack_split"):
    data.BatchIterator(sequences, 3, seed=0, document_ids=ids[:, :4])
  with pytest.raises(ValueError, match="validation document_ids of shape"):
    data.eval_batches(sequences, 3, 2, document_ids=ids[:9])
