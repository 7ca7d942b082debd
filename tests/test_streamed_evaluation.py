"""Evaluation of long sequences block by block (`evaluate.streamed_nll`): equal to whole sequences at once where those
fit (loss and loss by position, with and without packed documents, chunkwise and recurrent), memory that does not
grow with the length, a million-token sequence of a corpus the test writes, and the refusals."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from retnet_jax.core import dispatch
from retnet_jax.evaluation import evaluate, sampling_checks
from tests.helpers import run_script, script_lines, tiny_config, tiny_model

BLOCK = 16


def write_documents(path, count, seed=0):
  """A JSON-lines corpus of `count` documents of 5 to 120 random letters: documents open inside blocks and on their
  edges."""
  rng = np.random.default_rng(seed)
  rows = ("".join(rng.choice(list("abcdefgh "), size=rng.integers(5, 120))) for _ in range(count))
  path.write_text("".join(json.dumps({"text": text}) + "\n" for text in rows))
  return path


@pytest.mark.parametrize("documents", [False, True])
def test_streamed_equals_whole_sequences(tmp_path, documents):
  """Chunkwise and recurrent, 200 tokens in blocks of 16 (12 blocks and a partial one) against whole sequences:
  losses within 1e-6 relative, each of 4 position buckets too, and the same last-position logits."""
  config = tiny_config(tmp_path, batch_size=8)
  if documents:
    config.data.files = (str(write_documents(tmp_path / "train.jsonl", 200)),)
    config.data.validation_files = (str(write_documents(tmp_path / "valid.jsonl", 60, seed=1)),)
    config.data.reset_at_documents = True
  model = tiny_model()
  results = {block: evaluate.evaluate_model(model, config, ("chunkwise", "recurrent"), max_batches=1, seq_len=200,
                                            position_buckets=4, block=block) for block in (0, BLOCK)}
  for mode in ("chunkwise", "recurrent"):
    whole, streamed = results[0]["modes"][mode], results[BLOCK]["modes"][mode]
    assert "block" not in whole and streamed["block"] == BLOCK
    assert streamed["loss"] == pytest.approx(whole["loss"], rel=1e-6)
    assert [b["tokens"] for b in streamed["loss_by_position"]] == [b["tokens"] for b in whole["loss_by_position"]]
    for got, expected in zip(streamed["loss_by_position"], whole["loss_by_position"]):
      assert got["loss"] == pytest.approx(expected["loss"], rel=1e-6)
  assert results[BLOCK]["max_logit_difference"] < 1e-4 and results[BLOCK]["modes_agree"]


def compiled_temporaries(model, length, block, buckets=8):
  graphdef, params = nnx.split(model)
  tokens = jax.ShapeDtypeStruct((1, length + 1), jnp.int32)
  return evaluate.streamed_nll.trace(graphdef, params, tokens, "chunkwise", buckets, block).lower().compile(
      ).memory_analysis().temp_size_in_bytes


@pytest.mark.optimized
def test_memory_does_not_grow_with_the_length():
  """The compiled streamed evaluation holds at most 1.25x the temporaries at 2^20 tokens that it holds at 2^13;
  whole sequences at once (one block) hold 20x more at 2^16 already."""
  model = tiny_model()
  temps = {length: compiled_temporaries(model, length, 2048) for length in (2**13, 2**20)}
  assert temps[2**20] <= 1.25 * temps[2**13], temps
  assert compiled_temporaries(model, 2**16, 2**16) > 20 * temps[2**13]


def test_streams_only_the_forms_whose_state_stays_small():
  retnet = tiny_model().config
  assert evaluate.streams(retnet, "chunkwise", 4096, 2048) and evaluate.streams(retnet, "recurrent", 4096, 2048)
  assert not evaluate.streams(retnet, "parallel", 4096, 2048)
  assert not evaluate.streams(retnet, "chunkwise", 2048, 2048) and not evaluate.streams(retnet, "chunkwise", 4096, 0)
  assert not evaluate.streams(tiny_model(attention_layers=(1,)).config, "chunkwise", 4096, 2048)  # a growing cache
  assert evaluate.streams(tiny_model(attention_layers=(1,), attention_window=8).config, "chunkwise", 4096, 2048)


def test_bad_blocks_and_lengths_are_refused_before_any_work(tmp_path):
  config = tiny_config(tmp_path, batch_size=1)
  with pytest.raises(ValueError, match=r"--eval_block=12 is not a multiple of model\.chunk_size=8"):
    evaluate.check_request(config, ("chunkwise",), 4096, block=12)
  with pytest.raises(ValueError, match=r"the validation split holds 6000 tokens: 0 sequences of --eval_seq_len \+ 1 "
                                       r"= 1048577 tokens"):
    evaluate.evaluate_model(tiny_model(), config, ("chunkwise",), seq_len=2**20)


def test_a_form_that_does_not_fit_is_refused_before_any_batch_runs(tmp_path, monkeypatch):
  """In 16 MiB, batches of 8 sequences of 512 tokens fit block by block (about 7 MiB over the 8 devices) but not in
  the parallel form (its [L, L] scores: about 38 MiB): `--mode=all` is refused, by XLA's memory analysis, naming the
  form, the sizes and the fixes, before a batch runs; the streamed forms alone run."""
  config, model = tiny_config(tmp_path, batch_size=8), tiny_model()
  monkeypatch.setattr(sampling_checks, "device_memory", lambda devices: 16 * 2**20)
  host_map, ran = dispatch.host_map, []
  monkeypatch.setattr(dispatch, "host_map", lambda fn, batches: ran.append(1) or host_map(fn, batches))
  message = (r"the parallel form at 512 tokens per sequence needs about [0-9.]+ MiB \(XLA's memory analysis of its "
             r"compiled program\), more than the 16.0 MiB of host memory available here, bounded by .*; use "
             r"--mode=chunkwise \(the chunkwise and recurrent forms run block by block\), a shorter --eval_seq_len "
             r"or a smaller --config.train.batch_size\.$")
  with pytest.raises(ValueError, match=message):
    evaluate.evaluate_model(model, config, ("chunkwise", "parallel", "recurrent"), max_batches=1, seq_len=512,
                            block=256)
  assert not ran
  results = evaluate.evaluate_model(model, config, ("chunkwise", "recurrent"), max_batches=1, seq_len=512, block=256)
  assert ran and results["modes_agree"]


@pytest.mark.slow
def test_a_million_tokens_evaluate_through_the_script(trained_copy, tmp_path):
  """`scripts/evaluate.py --eval_seq_len=1048576` on a corpus of that length, chunkwise and recurrent in blocks,
  with 8 position buckets: the forms agree, every bucket holds 131072 inputs."""
  _, workdir, _ = trained_copy
  rng = np.random.default_rng(0)
  corpus = tmp_path / "long.txt"
  corpus.write_bytes(bytes(rng.choice(np.frombuffer(b"abcdefgh \n", np.uint8), size=2**20 + 1)))
  losses = {}
  for mode in ("chunkwise", "recurrent"):
    result = run_script("evaluate.py", f"--workdir={workdir}", "--eval_seq_len=1048576", "--by_position=8",
                        "--eval_block=8192", f"--config.data.validation_files={corpus}",
                        "--config.train.batch_size=1", f"--mode={mode}", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(script_lines(result.stdout)[-1])
    assert results["seq_len"] == results["tokens"] == 2**20
    assert results["modes"][mode]["block"] == 8192
    assert [b["tokens"] for b in results["modes"][mode]["loss_by_position"]] == [2**17] * 8
    losses[mode] = results["modes"][mode]["loss"]
  assert losses["recurrent"] == pytest.approx(losses["chunkwise"], rel=1e-4)
