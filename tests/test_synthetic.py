"""Synthetic recall tasks: MQAR examples against hand-computed cases, deterministic batches and exact resume, the
loss on answers only, mqar_accuracy on stub models, bad input, and a tiny model learning MQAR."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from flax import nnx

from configs import retnet as retnet_config
from configs import transformer as transformer_config
from retnet_jax.core import sharding
from retnet_jax.evaluation import evaluate
from retnet_jax.input_pipeline import data, data_config, global_batches, passkey, synthetic
from retnet_jax.input_pipeline.tokenizer import ByteTokenizer
from retnet_jax.models.model import Model
from retnet_jax.training import checkpointing, losses, optimizer, run_config, train, train_state, train_step

# architecture -> the configs module of its presets
CONFIGS = {"retnet": retnet_config, "transformer": transformer_config}


def mqar_config(vocab_size=16, num_pairs=3, seq_len=15, placement="power", seed=0, **mqar):
  config = retnet_config.get_config("tiny")
  config.seed = seed
  config.model.vocab_size = vocab_size
  config.train.seq_len = seq_len
  config.data.synthetic = "mqar"
  config.data.mqar.update(dict(num_pairs=num_pairs, query_placement=placement, **mqar))
  return config


def test_mqar_examples_match_hand_computed_ones():
  # Pairs (3, 10) (5, 9) (4, 11), queried at slots 0, 1, 2 (positions 6, 8, 10) as 4, 3, 5; then fillers.
  tokens, weights = synthetic.batch(mqar_config(), "train", 0, 2)
  np.testing.assert_array_equal(tokens, [[3, 10, 5, 9, 4, 11, 4, 11, 3, 10, 5, 9, 0, 0, 0, 0],
                                         [6, 12, 3, 8, 5, 14, 5, 14, 0, 0, 0, 0, 3, 8, 6, 12]])
  expected = np.zeros((2, 15))
  expected[0, [6, 8, 10]] = expected[1, [6, 12, 14]] = 1  # the targets at these indices are the answers
  np.testing.assert_array_equal(weights, expected)
  assert tokens.dtype == np.int32 and weights.dtype == np.float32


@pytest.mark.parametrize("placement", data_config.QUERY_PLACEMENTS)
def test_mqar_examples_follow_the_rules(placement):
  num_pairs, seq_len = 5, 31
  tokens, weights = synthetic.batch(mqar_config(vocab_size=24, num_pairs=num_pairs, seq_len=seq_len,
                                                placement=placement, seed=3), "valid", 7, 64)
  assert tokens.shape == (64, seq_len + 1) and weights.shape == (64, seq_len)
  for row, row_weights in zip(tokens, weights):
    keys, values = row[0:2 * num_pairs:2], row[1:2 * num_pairs:2]
    assert len(set(keys)) == len(set(values)) == num_pairs  # distinct
    assert all(1 <= k < 12 for k in keys) and all(12 <= v < 24 for v in values)
    answers = np.flatnonzero(row_weights) + 1  # token positions of the answers
    queries = answers - 1
    assert len(answers) == num_pairs and all((queries - 2 * num_pairs) % 2 == 0)
    assert sorted(row[queries]) == sorted(keys)  # each key asked once ...
    assert all(row[a] == dict(zip(keys, values))[row[a - 1]] for a in answers)  # ... answered by its value
    fillers = np.setdiff1d(np.arange(2 * num_pairs, seq_len + 1), np.concatenate([queries, answers]))
    assert (row[fillers] == synthetic.FILLER).all()
    if placement == "packed":  # right after the pairs
      np.testing.assert_array_equal(np.sort(queries), 2 * num_pairs + 2 * np.arange(num_pairs))


@pytest.mark.parametrize("placement, power_a", [("power", 0.3), ("uniform", 0.3), ("power", 1.0)])
def test_mqar_query_slot_distribution(placement, power_a):
  """One pair and 20 slots: the query's slot s (from 1) has probability s^(power_a - 1) / sum (power), or 1/20."""
  rows, num_slots = 20_000, 20
  tokens, weights = synthetic.batch(mqar_config(num_pairs=1, seq_len=2 * num_slots + 1, placement=placement,
                                                power_a=power_a), "train", 0, rows)
  slots = (np.flatnonzero(weights) % weights.shape[1] - 2) // 2
  frequency = np.bincount(slots, minlength=num_slots) / rows
  slot_weights = np.arange(1, num_slots + 1) ** (power_a - 1.0) if placement == "power" else np.ones(num_slots)
  probability = slot_weights / slot_weights.sum()
  # 5 standard deviations of a binomial frequency.
  np.testing.assert_array_less(np.abs(frequency - probability), 5 * np.sqrt(probability * (1 - probability) / rows))


def take(batches, count):
  return [tuple(np.asarray(a) for a in next(batches)) for _ in range(count)]


def test_batches_are_deterministic_and_resume_exactly():
  config = mqar_config(seq_len=31, num_pairs=4)
  uninterrupted = take(synthetic.SyntheticBatches(config, 8), 6)
  np.testing.assert_array_equal(np.stack([t for t, _ in uninterrupted]),
                                np.stack([t for t, _ in take(synthetic.SyntheticBatches(config, 8), 6)]))
  for index, (tokens, weights) in enumerate(uninterrupted):  # batch i is a function of (seed, i)
    expected_tokens, expected_weights = synthetic.batch(config, "train", index, 8)
    np.testing.assert_array_equal(tokens, expected_tokens)
    np.testing.assert_array_equal(weights, expected_weights)
  assert len({t.tobytes() for t, _ in uninterrupted}) == 6
  first = synthetic.SyntheticBatches(config, 8)
  take(first, 4)
  assert first.get_state() == {"index": 4}
  resumed = synthetic.SyntheticBatches(config, 8)
  resumed.set_state({"index": np.int64(4)})  # as restored from a checkpoint
  for (tokens, weights), (expected_tokens, expected_weights) in zip(take(resumed, 2), uninterrupted[4:]):
    np.testing.assert_array_equal(tokens, expected_tokens)
    np.testing.assert_array_equal(weights, expected_weights)
  other_seed = mqar_config(seq_len=31, num_pairs=4, seed=1)
  assert not np.array_equal(take(synthetic.SyntheticBatches(other_seed, 8), 1)[0][0], uninterrupted[0][0])
  valid = list(global_batches.eval_batches(synthetic.ValidationRows(config, 8, 2), 8, None))
  assert not np.array_equal(np.asarray(valid[0][0]), uninterrupted[0][0])  # a stream apart from training
  again = list(global_batches.eval_batches(synthetic.ValidationRows(config, 8, 2), 8, None))
  np.testing.assert_array_equal(np.asarray(again[1][0]), np.asarray(valid[1][0]))


@pytest.mark.devices(8)
@pytest.mark.parametrize("reset", [False, True])
def test_validation_batches_are_the_valid_streams_batches(reset):
  """global_batches.eval_batches of ValidationRows gives batch i of the "valid" stream byte for byte, whole or
  sharded, with the (zero) document ids under data.reset_at_documents."""
  config = mqar_config(seq_len=31, num_pairs=4)
  config.data.reset_at_documents = reset
  batch_sharding = sharding.placement(config.mesh).batch_sharding
  for placed in (None, batch_sharding):
    batches = list(global_batches.eval_batches(synthetic.ValidationRows(config, 16, 3), 16, None, placed))
    assert len(batches) == 3
    for index, got in enumerate(batches):
      expected = synthetic.batch(config, "valid", index, 16)
      assert len(got) == len(expected) == (3 if reset else 2)
      for array, want in zip(got, expected):
        assert array.dtype == want.dtype and np.asarray(array).tobytes() == want.tobytes()
        assert placed is None or array.sharding == placed
  rows = synthetic.ValidationRows(config, 16, 3)
  assert len(rows) == 48
  tokens, weights = rows.take(np.array([40, 3, 17]))[:2]  # rows of batches 2, 0 and 1, in that order
  drawn = [synthetic.batch(config, "valid", i, 16) for i in range(3)]
  np.testing.assert_array_equal(tokens, np.stack([drawn[2][0][8], drawn[0][0][3], drawn[1][0][1]]))
  np.testing.assert_array_equal(weights, np.stack([drawn[2][1][8], drawn[0][1][3], drawn[1][1][1]]))


@pytest.mark.devices(8)
def test_sharded_batches_equal_the_whole_batch():
  config = mqar_config(seq_len=31, num_pairs=4)
  batch_sharding = sharding.placement(config.mesh).batch_sharding  # rows split over the 8 devices
  tokens, weights = next(synthetic.SyntheticBatches(config, 16, batch_sharding))
  assert tokens.sharding == weights.sharding == batch_sharding
  expected_tokens, expected_weights = synthetic.batch(config, "train", 0, 16)
  np.testing.assert_array_equal(np.asarray(tokens), expected_tokens)
  np.testing.assert_array_equal(np.asarray(weights), expected_weights)


class Stub(nnx.Module):
  """A model whose logits come from a table of the current token: `table[inputs]`; no state."""

  def __init__(self, table):
    self.table = nnx.Param(jnp.asarray(table, jnp.float32))

  def __call__(self, inputs_BxL, mode="parallel", state=None, remat="none", segment_ids=None):
    return self.table[...][inputs_BxL], state

  def init_state(self, batch_size):
    return jnp.zeros(())


# Next-token probabilities given the current token (rows), vocabulary 4.
PROBABILITIES = np.array([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25], [0.5, 0.1, 0.2, 0.2], [0.7, 0.1, 0.1, 0.1]])
TOKENS = np.array([[1, 2, 3, 1], [2, 2, 1, 3]], np.int32)
WEIGHTS = np.array([[0, 1, 0], [1, 0, 1]], np.float32)  # targets 2 -> 3, 2 -> 2, 1 -> 3


def test_loss_is_taken_on_the_answers_only():
  graphdef, params = nnx.split(Stub(np.log(PROBABILITIES)))
  expected = -(np.log(0.2) + np.log(0.2) + np.log(0.25)) / 3
  batch = (jnp.asarray(TOKENS), jnp.asarray(WEIGHTS))
  for segment_len in (0, 2):  # whole sequences, and segments carrying the state
    loss = losses.token_loss(graphdef, params, batch, "parallel", segment_len=segment_len)
    assert float(loss) == pytest.approx(expected, rel=1e-6)
  all_targets = -np.mean(np.log([[0.25, 0.2, 0.1], [0.2, 0.1, 0.25]]))
  assert float(losses.token_loss(graphdef, params, jnp.asarray(TOKENS), "parallel")) == pytest.approx(all_targets,
                                                                                                       rel=1e-6)


def test_train_step_carries_the_weights_through_micro_batches():
  """With as many answers per row, two micro-batches give the loss and update of the whole batch."""
  config = retnet_config.get_config("tiny")
  config.train.warmup_steps = 0  # a first step that moves the parameters
  graphdef, params = nnx.split(Stub(np.log(PROBABILITIES)))
  weights = np.array([[1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 0, 1]], np.float32)
  batch = (jnp.asarray(np.concatenate([TOKENS, TOKENS[::-1]])), jnp.asarray(weights))
  results = []
  for accum in (1, 2):
    config.train.grad_accum_steps = accum
    tx = optimizer.make_optimizer(config.train)
    state = train_state.fresh_state(tx, params)
    results.append(jax.jit(train_step.make_train_step(graphdef, tx, config.train))(state, batch))
  (whole, whole_metrics), (micro, micro_metrics) = results
  assert float(whole_metrics["loss"]) == pytest.approx(float(losses.token_loss(graphdef, params, batch, "parallel")))
  assert float(micro_metrics["loss"]) == pytest.approx(float(whole_metrics["loss"]), rel=1e-6)
  np.testing.assert_allclose(micro.params["table"][...], whole.params["table"][...], atol=1e-6)
  assert not np.allclose(whole.params["table"][...], params["table"][...])


class Recall(nnx.Module):
  """Predicts the token that followed the current token's last earlier occurrence (logit `scale`, others 0),
  where the current token is even; predicts 0 (never an MQAR value) otherwise."""

  def __init__(self, vocab_size, scale=5.0):
    self.vocab_size, self.scale = vocab_size, scale

  def __call__(self, inputs_BxL, mode="parallel", state=None, remat="none", segment_ids=None):
    length = inputs_BxL.shape[1]
    positions = jnp.arange(length)
    earlier_BxLxL = (inputs_BxL[:, :, None] == inputs_BxL[:, None, :]) & (positions[None, :] < positions[:, None])
    last_BxL = jnp.max(jnp.where(earlier_BxLxL, positions, -1), axis=-1)
    recalled_BxL = jnp.take_along_axis(inputs_BxL, jnp.clip(last_BxL + 1, 0, length - 1), axis=1)
    predicted_BxL = jnp.where((last_BxL >= 0) & (inputs_BxL % 2 == 0), recalled_BxL, 0)
    return self.scale * jax.nn.one_hot(predicted_BxL, self.vocab_size), state


def test_mqar_accuracy_on_a_stub():
  config = mqar_config(vocab_size=32, num_pairs=6, seq_len=31)
  config.train.batch_size = 16
  results = evaluate.evaluate_model(Recall(32), config, modes=("parallel", "recurrent"), max_batches=3)
  valid = list(global_batches.eval_batches(synthetic.ValidationRows(config, 16, 3), 16, None))
  tokens, weights = (np.concatenate([np.asarray(b[i]) for b in valid]) for i in (0, 1))
  keys = tokens[:, :-1][weights > 0]  # the query keys; the stub recalls the even ones
  hits, answers = int(np.sum(keys % 2 == 0)), len(keys)
  assert results["task"] == "mqar" and results["answers"] == answers == 3 * 16 * 6
  assert results["sequences"] == 48 and 0 < hits < answers
  # A hit costs log(1 + 31 e^-5) nats, a miss (all mass on 0) log(e^5 + 31).
  loss = (hits * np.log1p(31 * np.exp(-5.0)) + (answers - hits) * np.log(np.exp(5.0) + 31)) / answers
  for mode in ("parallel", "recurrent"):
    assert results["modes"][mode]["mqar_accuracy"] == pytest.approx(hits / answers)
    assert results["modes"][mode]["loss"] == pytest.approx(loss, rel=1e-5)
    assert "bits_per_byte" not in results["modes"][mode]
  assert results["modes_agree"]
  assert evaluate.format_table(results).splitlines()[0].split()[-1] == "accuracy"


@pytest.mark.parametrize("fields, message", [
    (dict(synthetic="recall"), r"unknown data.synthetic 'recall'; choose one of \('mqar', 'passkey'\)"),
    (dict(num_pairs=5), r"num_pairs=5 needs 20 tokens .* train.seq_len \+ 1 = 16; set train.seq_len to 19"),
    (dict(vocab_size=7), r"vocabulary of 7 tokens holds 2 keys .*num_pairs=3 .*vocab_size to 8 or more"),
    (dict(vocab_size=32), r"data.mqar.vocab_size=32 exceeds model.vocab_size=16; set --config.model.vocab_size=32"),
    (dict(num_pairs=0), r"data.mqar.num_pairs must be a positive integer; got 0"),
    (dict(query_placement="late"), r"unknown data.mqar.query_placement 'late'; choose one of"),
    (dict(power_a=0.0), r"data.mqar.power_a must be positive"),
    (dict(power_a=float("inf")), r"data.mqar.power_a must be positive and finite"),
    ({"data.files": ("corpus.txt",)}, r"data.files=\('corpus.txt',\) is text data, unused by data.synthetic='mqar'"),
    ({"data.tokenizer": "tokenizer.json"}, r"data.tokenizer='tokenizer.json' is unused by data.synthetic='mqar'"),
])
def test_bad_synthetic_config_is_refused_before_any_work(tmp_path, fields, message):
  config = mqar_config()
  if "synthetic" in fields:
    config.data.synthetic = fields["synthetic"]
  elif any(name.startswith("data.") for name in fields):
    config.data.update({name.removeprefix("data."): value for name, value in fields.items()})
  else:
    config.data.mqar.update(fields)
  with pytest.raises(ValueError, match=message):
    train.train_and_evaluate(config, tmp_path / "run")
  assert not (tmp_path / "run").exists()
  with pytest.raises(ValueError, match=message):
    evaluate.evaluate_model(Recall(16), config)


def passkey_config(seq_len=220, depth=None):
  config = retnet_config.get_config("tiny")
  config.train.seq_len = seq_len
  config.data.synthetic = "passkey"
  config.data.passkey.depth = depth
  return config


def test_passkey_source_weights_the_key_after_the_question():
  """Rows are `passkey.make_example`s of seq_len + 1 tokens; the weights select the key's tokens after the question;
  a fixed depth puts every needle at the same place; batches depend on (seed, split, index) alone."""
  tokenizer = ByteTokenizer()
  tokens, weights = synthetic.batch(passkey_config(), "train", 3, 4)
  assert tokens.shape == (4, 221) and weights.shape == (4, 220) and tokens.dtype == np.int32
  for row, row_weights in zip(tokens, weights):
    text = tokenizer.decode(row)
    key = text.split("The pass key is ")[1][:5]
    assert text.endswith(f"What is the pass key? The pass key is {key}") and key.isdigit()
    assert tokenizer.decode(row[1:][row_weights > 0]) == f" {key}"  # the answers: the last 6 tokens
    assert row_weights.sum() == 6 and np.all(row_weights[:-6] == 0)
  assert len({tokenizer.decode(row).index(" The pass key is") for row in tokens}) > 1  # random depths
  fixed, _ = synthetic.batch(passkey_config(depth=0.0), "train", 3, 4)
  assert {tokenizer.decode(row).index(" The pass key is") for row in fixed} == {len(passkey.INTRO)}
  again, _ = synthetic.batch(passkey_config(), "train", 3, 4)
  assert np.array_equal(again, tokens)
  assert not np.array_equal(synthetic.batch(passkey_config(), "valid", 3, 4)[0], tokens)


@pytest.mark.parametrize("fields, message", [
    (dict(seq_len=100), r"train.seq_len=100 cannot hold a passkey example .* at least 167"),
    (dict(depth=1.5), r"data.passkey.depth=1.5 must lie in \[0, 1\]"),
    (dict(digits=0), r"data.passkey.digits must be a positive integer; got 0"),
    (dict(digits=19), r"data.passkey.digits=19 exceeds 18: keys are drawn as 64-bit integers"),
])
def test_bad_passkey_config_is_refused(fields, message):
  config = passkey_config(seq_len=fields.pop("seq_len", 220))
  config.data.passkey.update(fields)
  with pytest.raises(ValueError, match=message):
    run_config.build(config)


def test_a_tokenizer_without_digits_is_refused_for_passkey(tmp_path):
  path = tmp_path / "words.json"
  tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(10)}, unk_token="w0")).save(str(path))
  config = passkey_config()
  config.data.tokenizer = str(path)
  with pytest.raises(ValueError, match=r"cannot spell the key's digits \(' 0123456789' decodes as 'w0'\): the "
                                       r"answers would be unknown tokens"):
    run_config.build(config)


def test_evaluate_reports_passkey_accuracy():
  """The fraction of key tokens predicted by argmax: here of an untrained tiny RetNet, in [0, 1]."""
  config = passkey_config()
  results = evaluate.evaluate_model(Model(config.model, rngs=nnx.Rngs(0)), config, max_batches=1)
  assert results["task"] == "passkey" and results["answers"] == 6 * config.train.batch_size
  assert 0 <= results["modes"]["parallel"]["passkey_accuracy"] <= 1


def test_checkpointed_data_state_of_another_source_is_refused():
  with pytest.raises(ValueError, match=r"another kind of data source .* set data.synthetic as in the run"):
    data.check_state_keys({"index": 3}, ("grain",))
  with pytest.raises(ValueError, match="another kind of data source"):
    synthetic.SyntheticBatches(mqar_config(), 2).set_state({"epoch": 0, "index": 1})


@pytest.mark.slow
@pytest.mark.parametrize("architecture", CONFIGS)
def test_tiny_model_learns_mqar(tmp_path, architecture):
  """400 steps of the tiny preset on 4 pairs: recall far above chance (1/8 for a guessed value, 1/4 for a guessed
  value of the context); measured 1.0 for RetNet and 0.49 for the Transformer, which learns it more slowly here."""
  config = CONFIGS[architecture].get_config("tiny")
  config.model.vocab_size = 16
  config.data.synthetic = "mqar"
  config.data.mqar.num_pairs = 4
  config.train.update(dict(steps=400, batch_size=64, seq_len=16, learning_rate=3e-3, warmup_steps=20,
                           log_every_steps=100, eval_every_steps=400, eval_batches=2))
  config.checkpoint.update(dict(every_steps=400, async_save=False))
  final = train.train_and_evaluate(config, tmp_path / "run")
  model, step = train_state.restore_model(config, tmp_path / "run")
  results = evaluate.evaluate_model(model, config)
  least = {"retnet": 0.8, "transformer": 0.4}[architecture]
  assert step == 400 and results["modes"]["parallel"]["mqar_accuracy"] > least, (final, results)
  assert results["modes"]["parallel"]["loss"] == pytest.approx(final["eval_loss"], rel=1e-5)
  with checkpointing.Checkpointer(tmp_path / "run" / "checkpoints", read_only=True) as checkpointer:
    assert checkpointer.restore_meta(400)["data"] == {"index": 400}
