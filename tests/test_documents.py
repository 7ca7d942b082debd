"""Packed documents (`data.reset_at_documents`): where documents start, the ids batches carry, and training and
evaluation on them equal to running each document alone."""

import functools

import datasets
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import retnet as retnet_config
from configs import transformer as transformer_config
from retnet_jax.core import segments, sharding
from retnet_jax.evaluation import evaluate
from retnet_jax.input_pipeline import data, global_batches, synthetic, tokenizer
from retnet_jax.training import losses, resume, run_config, train, train_step
from tests.helpers import (CORPUS, assert_resumed_from, random_tokens, read_metrics, tiny_config, tiny_model,
                           tiny_transformer)
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
    data.load_documents(data_config(reset_at_documents=True), tokenizer.ByteTokenizer())


def packed(num=10, width=5):
  """Sequences `[num, width]` and document ids that change inside some rows."""
  sequences = np.arange(num * width, dtype=np.int32).reshape(num, width)
  return sequences, sequences // 7


def test_evaluation_batches_carry_the_ids_of_their_rows():
  sequences, ids = packed()
  evaluated = list(global_batches.eval_batches(global_batches.SequenceRows(sequences, ids), 3, 2))
  rows = global_batches.eval_rows(10, 3, 2)
  for (tokens, weights, batch_ids), row in zip(evaluated, rows):
    assert weights is None and batch_ids.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(tokens), sequences[row])
    np.testing.assert_array_equal(np.asarray(batch_ids), ids[row])


def test_ids_of_another_shape_are_refused():
  sequences, ids = packed()
  with pytest.raises(ValueError, match=r"validation document_ids of shape \(9, 5\) do not match the sequences' "
                                       r"\(10, 5\); pack both with pack_split"):
    global_batches.SequenceRows(sequences, ids[:9])


# Training and evaluation: a packed row computes what each of its documents computes alone.
# Training and evaluation: a packed row computes what each of its documents computes alone.

# Document ids of two rows of 21 tokens (20 inputs): starts at 5 (a one-token document), 6 and 12 (on the edges of
# segments of 6), 3, 12 and 16 (on a chunk edge of the tiny preset's 8).
IDS = np.asarray([[0] * 5 + [1] + [2] * 6 + [3] * 9, [4] * 3 + [5] * 9 + [6] * 4 + [7] * 5], np.int32)


def documents(ids_BxL1):
  """(row, first input, end) of each document of each row's inputs `ids[:, :-1]`: inputs `[first, end)` predict the
  tokens `[first + 1, end + 1)`."""
  pieces = []
  for row, ids in enumerate(np.asarray(ids_BxL1)[:, :-1]):
    edges = [0, *(np.flatnonzero(np.diff(ids)) + 1), len(ids)]
    pieces += [(row, first, end) for first, end in zip(edges[:-1], edges[1:])]
  return pieces


def alone_nll(model, tokens_BxL1, ids_BxL1):
  """Next-token NLL `[B, L]` of every input with its document run alone from an empty state: one parallel call on
  the documents as rows, right-padded (after their tokens, so unseen)."""
  pieces = documents(ids_BxL1)
  width = max(end - first for _, first, end in pieces)
  inputs_DxW, targets_DxW = np.zeros((len(pieces), width), np.int32), np.zeros((len(pieces), width), np.int32)
  for d, (row, first, end) in enumerate(pieces):
    inputs_DxW[d, :end - first] = tokens_BxL1[row, first:end]
    targets_DxW[d, :end - first] = tokens_BxL1[row, first + 1:end + 1]
  logits, _ = model(jnp.asarray(inputs_DxW), mode="parallel")
  nll_DxW = losses.token_nll(logits, jnp.asarray(targets_DxW))
  nll_BxL = jnp.zeros((tokens_BxL1.shape[0], tokens_BxL1.shape[1] - 1), jnp.float32)
  for d, (row, first, end) in enumerate(pieces):
    nll_BxL = nll_BxL.at[row, first:end].set(nll_DxW[d, :end - first])
  return nll_BxL


def compiled_alone_nll(model, tokens_BxL1, ids_BxL1):
  """`alone_nll` compiled as one program (the documents' bounds fixed as it is traced): eagerly, each document's
  slice and update compiles on its own."""
  return nnx.jit(lambda model: alone_nll(model, tokens_BxL1, ids_BxL1))(model)


@functools.cache
def alone_loss_and_grads(architecture):
  """(graphdef, params) of the tiny model of `architecture`, random tokens like `IDS`, and their mean loss with
  each document alone and its gradients (computed once per architecture)."""
  graphdef, params = nnx.split(tiny_model() if architecture == "retnet" else tiny_transformer())
  tokens = random_tokens(*IDS.shape, seed=5)
  alone = jax.value_and_grad(lambda p: alone_nll(nnx.merge(graphdef, p), tokens, IDS).mean())
  return graphdef, params, tokens, jax.jit(alone)(params)


@pytest.mark.parametrize("architecture,mode,segment_len", [
    ("retnet", "parallel", 0), ("retnet", "chunkwise", 0), ("retnet", "chunkwise", 6), ("retnet", "parallel", 8),
    ("transformer", "parallel", 0)])
def test_the_loss_and_gradients_of_packed_rows_are_each_documents_alone(architecture, mode, segment_len):
  graphdef, params, tokens, (expected, expected_grads) = alone_loss_and_grads(architecture)
  batch = (jnp.asarray(tokens), None, jnp.asarray(IDS))
  loss_fn = lambda p, batch: losses.token_loss(graphdef, p, batch, mode, segment_len=segment_len)
  loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
  assert abs(float(loss) - float(expected)) < 1e-5
  scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(expected_grads))
  assert max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads))
             ) < 1e-4 * scale
  assert abs(float(jax.jit(loss_fn)(params, batch[0])) - float(expected)) > 1e-3  # the documents do matter


def test_a_train_step_with_gradient_accumulation_takes_the_documents_loss():
  config = retnet_config.get_config("tiny")
  config.data.reset_at_documents = True
  config.train.update(batch_size=4, seq_len=20, grad_accum_steps=2)
  config.mesh.shape = (2, 1, 1)
  run = train_step.setup(run_config.build(config), sharding.make_mesh(config.mesh, jax.devices()[:2]))
  tokens, ids = random_tokens(4, 21, seed=6), np.concatenate([IDS, IDS[::-1] + 10])
  with run.placement.active():
    state = run.init()
    params = jax.device_get(state.params)
    batch = jax.device_put((tokens, None, ids), run.placement.batch_sharding)
    _, metrics = run.train_step(state, batch)
    evaluated = float(run.eval_step(params, batch))
  expected = float(compiled_alone_nll(nnx.merge(run.graphdef, params), tokens, ids).mean())
  assert abs(float(metrics["loss"]) - expected) < 1e-5 and abs(evaluated - expected) < 1e-5


@pytest.mark.slow
def test_a_train_step_split_over_sequence_takes_the_documents_loss():
  """Mesh (2, 1, 1, 4): each row of 64 tokens in slices of 16, documents crossing slices and one opening on a slice
  edge; the chunkwise form's slice states combine only within a document."""
  config = retnet_config.get_config("tiny")
  config.data.reset_at_documents = True
  config.train.update(batch_size=2, seq_len=64, mode="chunkwise")
  config.mesh.shape = (2, 1, 1, 4)
  run = train_step.setup(run_config.build(config), sharding.make_mesh(config.mesh, jax.devices()))
  ids = np.cumsum([np.isin(np.arange(65), starts) for starts in ([5, 16, 30, 47], [9, 33, 34, 60])], axis=1,
                  dtype=np.int32)
  tokens = random_tokens(2, 65, seed=7)
  with run.placement.active():
    state = run.init()
    params = jax.device_get(state.params)
    _, metrics = run.train_step(state, jax.device_put((tokens, None, ids), run.placement.batch_sharding))
  expected = float(compiled_alone_nll(nnx.merge(run.graphdef, params), tokens, ids).mean())
  assert abs(float(metrics["loss"]) - expected) < 1e-5


def test_segment_ids_unlike_the_tokens_are_refused():
  graphdef, params = nnx.split(tiny_model())
  tokens = jnp.asarray(random_tokens(*IDS.shape))
  with pytest.raises(ValueError, match=r"the batch's segment_ids \(like its tokens\) must be an integer array "
                                       r"\[batch, seq\] = \[2, 21\].*got shape \(2, 20\)"):
    losses.token_loss(graphdef, params, (tokens, None, jnp.asarray(IDS[:, 1:])), "parallel")
  with pytest.raises(ValueError, match=r"got shape \(2, 21\) dtype float32"):
    losses.token_loss(graphdef, params, (tokens, None, jnp.asarray(IDS, jnp.float32)), "parallel")


def test_forms_that_cannot_reset_are_refused_before_evaluating():
  config = retnet_config.get_config("tiny")
  config.data.reset_at_documents = True
  config.model.stability_norm_style = "torchscale"
  evaluate.check_request(config, ("parallel", "recurrent"), 32)
  with pytest.raises(ValueError, match=r"\(--mode\) cannot reset the chunkwise form of "
                                       r"model.stability_norm_style='torchscale'.*data.reset_at_documents=False"):
    evaluate.check_request(config, ("parallel", "chunkwise"), 32)
  config = transformer_config.get_config("tiny")  # attention resets in every form
  config.data.reset_at_documents = True
  evaluate.check_request(config, ("parallel", "recurrent"), 32)


def test_synthetic_rows_are_one_document_each():
  config = retnet_config.get_config("tiny")
  config.data.update(synthetic="mqar", reset_at_documents=True)
  config.train.seq_len = 32
  tokens, weights, ids = synthetic.batch(config, "train", 0, 4)
  assert ids.shape == tokens.shape and ids.dtype == np.int32 and not ids.any()
  assert len(next(synthetic.SyntheticBatches(config, 4))) == 3
  graphdef, params = nnx.split(tiny_model())
  loss = jax.jit(lambda batch: losses.token_loss(graphdef, params, batch, "parallel"))
  assert abs(float(loss((tokens, weights, ids))) - float(loss((tokens, weights)))) < 1e-6


def lines(path, start, count):
  """`path`: a JSON-lines file of `count` lines of the shipped corpus from line `start`, one document each, line i
  cut to its first 4 + i % 24 characters (shorter than a sequence, mostly)."""
  texts = [line[:4 + i % 24] for i, line in enumerate(CORPUS.read_text().splitlines()[start:start + count]) if line]
  return write_jsonl(path, [{"text": text} for text in texts])


def documents_config(directory, **train_overrides):
  """The tiny run on lines of the shipped corpus as JSON-lines rows, with `data.reset_at_documents`."""
  config = tiny_config(directory, **train_overrides)
  config.data.update(files=(str(lines(directory / "train.jsonl", 0, 1500)),),
                     validation_files=(str(lines(directory / "valid.jsonl", 1500, 100)),), reset_at_documents=True)
  return config


def test_evaluation_in_every_form_and_by_position_within_documents(tmp_path):
  config = documents_config(tmp_path)
  model = tiny_model()
  results = evaluate.evaluate_model(model, config, ("parallel", "chunkwise", "recurrent"), max_batches=1,
                                    position_buckets=4)
  _, valid = data.load_documents(config.data, tokenizer.ByteTokenizer())
  sequences, ids = data.pack_split(valid, 32, "validation split", reset_at_documents=True)
  rows = global_batches.eval_rows(len(sequences), 8, 1).reshape(-1)
  tokens, ids = sequences[rows], ids[rows]
  assert len(documents(ids)) > 2 * len(rows)  # rows of several documents
  nll_NxL = np.asarray(compiled_alone_nll(model, tokens, ids), np.float64)
  bucket_NxL = np.asarray(segments.positions_in_document(ids[:, :-1])) // 8
  for mode, metrics in results["modes"].items():
    assert metrics["loss"] == pytest.approx(nll_NxL.mean(), abs=1e-5), mode
    by_position = metrics["loss_by_position"]
    assert [(b["start"], b["end"]) for b in by_position] == [(0, 8), (8, 16), (16, 24), (24, 32)][:len(by_position)]
    assert sum(b["tokens"] for b in by_position) == nll_NxL.size
    for k, bucket in enumerate(by_position):
      assert bucket["tokens"] == (bucket_NxL == k).sum()
      assert bucket["loss"] == pytest.approx(nll_NxL[bucket_NxL == k].mean(), abs=1e-5), (mode, k)
  assert results["modes_agree"]


@pytest.mark.slow
def test_a_run_with_documents_resumes_exactly(tmp_path, run_crashing_at_batch):
  """8 steps straight vs a run crashed in step 6 and run again, which resumes from checkpoint 4 (no earlier step
  trained again): identical losses; the documents change the losses."""
  config = documents_config(tmp_path)
  straight = train.train_and_evaluate(config, tmp_path / "straight")
  run_crashing_at_batch(6, train.train_and_evaluate, config, tmp_path / "resumed")
  resumed = train.train_and_evaluate(config, tmp_path / "resumed")
  assert_resumed_from(tmp_path / "resumed", 4)
  straight_losses = read_metrics(tmp_path / "straight")
  assert read_metrics(tmp_path / "resumed") == straight_losses and resumed["eval_loss"] == straight["eval_loss"]
  config.data.reset_at_documents = False
  config.train.steps = 1
  train.train_and_evaluate(config, tmp_path / "plain")
  assert abs(read_metrics(tmp_path / "plain")[1] - straight_losses[1]) > 1e-4


def test_a_checkpoint_from_before_the_flag_resumes_without_a_data_warning():
  config = retnet_config.get_config("tiny")
  saved = config.to_dict()
  del saved["data"]["reset_at_documents"]
  assert resume.changed_data_fields(saved, config) == []
  config.data.reset_at_documents = True
  assert resume.changed_data_fields(saved, config) == ["data"]
