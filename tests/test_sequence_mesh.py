"""The `sequence` mesh axis: the model, its loss and gradients, training, evaluation and prefill with each sequence
split over devices, against the same computation on one device; and the errors before any work."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from configs import retnet as retnet_config
from retnet_jax.core import sharding
from retnet_jax.evaluation import evaluate, sampling, sampling_checks
from retnet_jax.models import architectures
from retnet_jax.models.model import Model
from retnet_jax.training import losses, run_config, train, train_state
from tests.helpers import forward, tiny_config


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def tiny(style="shared", mesh_shape=(1,)):
  config = retnet_config.get_config("tiny")
  config.model.stability_norm_style = style
  config.mesh.shape = mesh_shape
  return config


def forward_loss_and_grads(model, tokens_BxL1, mode, state):
  """Logits and final state of the last 64 tokens after the carried `state`, and the loss and its gradients."""
  graphdef, params = nnx.split(model)

  def loss_fn(params):
    logits, new_state = nnx.merge(graphdef, params)(tokens_BxL1[:, :-1], mode=mode, state=state)
    return losses.token_nll(logits, tokens_BxL1[:, 1:]).mean(), (logits, new_state)

  (loss, (logits, new_state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  return loss, logits, new_state, grads


# (mesh shape over (data, fsdp, tensor, sequence), normaliser style, mode): the sequence alone over 8 devices, and
# over 4 and 2 with the batch over data and the heads over tensor. (With the shared normaliser both modes run the
# same split computation; the torchscale one's parallel and chunkwise divisors differ.)
CASES = [((1, 1, 1, 8), "torchscale", "parallel"), ((2, 1, 1, 4), "torchscale", "chunkwise"),
         ((2, 1, 2, 2), "shared", "chunkwise")]


@pytest.mark.devices(8)
@pytest.mark.parametrize("mesh_shape,style,mode", CASES)
def test_model_split_over_sequence_matches_one_device(mesh_shape, style, mode):
  """Logits, final states (kv and key sums), loss and gradients after a carried-in state, to 1e-5 relative."""
  config = tiny(style, mesh_shape)
  model = Model(config.model, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 24 + 64 + 1), 0, config.model.vocab_size)
  _, carried = forward(model, tokens[:, :24], None, "chunkwise")  # 24 tokens: not a whole number of slices
  step = jax.jit(forward_loss_and_grads, static_argnums=2)
  expected = step(model, tokens[:, 24:], mode, carried)
  placement = sharding.placement(config.mesh, jax.devices()[:int(np.prod(mesh_shape))])
  assert sharding.sequence_devices(config.mesh, int(np.prod(mesh_shape))) == mesh_shape[3]
  with placement.active():
    got = step(model, tokens[:, 24:], mode, carried)
  for name, a, b in zip(("loss", "logits", "state", "grads"), got, expected):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      assert rel_err(x, y) < 1e-5, (name, rel_err(x, y))


def corpus_config(tmp_path, mesh_shape):
  config = tiny_config(tmp_path, text_bytes=40_000, steps=4, seq_len=64)
  config.mesh.shape = mesh_shape
  return config


@pytest.mark.devices(8)
@pytest.mark.slow
def test_training_split_over_sequence_matches_data_parallel(tmp_path):
  """A run on mesh (1, 1, 1, 8) (each 64-token sequence over 8 devices) has the losses of one on (8, 1, 1, 1);
  its checkpoint evaluates in both modes and prefills as on one device."""
  runs = {}
  for shape in ((8, 1, 1, 1), (1, 1, 1, 8)):
    config = corpus_config(tmp_path, shape)
    train.train_and_evaluate(config, tmp_path / str(shape[0]))
    lines = [json.loads(x) for x in (tmp_path / str(shape[0]) / "metrics.jsonl").read_text().splitlines()]
    runs[shape] = [m["loss"] for m in lines if "loss" in m] + [m["eval_loss"] for m in lines if "eval_loss" in m]
  assert len(runs[(1, 1, 1, 8)]) == 5
  np.testing.assert_allclose(runs[(1, 1, 1, 8)], runs[(8, 1, 1, 1)], rtol=1e-5)

  model, _ = train_state.restore_model(config, tmp_path / "1")
  results = evaluate.evaluate_model(model, config, ("parallel", "chunkwise"), max_batches=1)
  assert results["modes_agree"], results
  with pytest.raises(ValueError, match="recurrent form .* cannot use"):
    evaluate.evaluate_model(model, config, ("parallel", "recurrent"))

  # Prefill of prompts of 20 and 13 tokens: left-padded to 1 + a multiple of 8 x chunk 8, the states as on one device.
  prompts, lengths = sampling.pad_prompts([np.arange(1, 21), np.arange(30, 43)])
  sampler = sampling.Sampler()
  expected = sampler.prefill(model, prompts, lengths, prefill_mode="parallel")
  with sharding.placement(config.mesh).active():
    got = sampler.prefill(model, prompts, lengths, prefill_mode="parallel")
    assert sampling_checks.split_padding(prompts.shape[1], config.model.chunk_size) == 64 - 19
  assert np.array_equal(got.state.position, expected.state.position)
  for x, y in zip(jax.tree.leaves(got.state), jax.tree.leaves(expected.state)):
    assert rel_err(x, y) < 1e-5


@pytest.mark.devices(8)
def test_bad_sequence_splits_are_refused_before_any_work():
  config = tiny(mesh_shape=(1, 1, 1, 8))
  config.train.seq_len = 96  # not a multiple of 8 devices x chunk 8
  with pytest.raises(ValueError, match=r"the 96 tokens of each call must be a multiple of 8 x model.chunk_size 8"):
    train.check_config(config, 8)
  config.train.update(seq_len=256, segment_len=32)
  with pytest.raises(ValueError, match="the 32 tokens of each call"):
    train.check_config(config, 8)
  config.train.segment_len = 128
  train.check_config(config, 8)
  config.model.retention_impl = "pallas"  # (on a CPU, refused earlier for the backend)
  with pytest.raises(ValueError, match="Pallas kernels run whole sequences only"):
    built = run_config.build(config)
    architectures.check_mesh_split(built.model, built.mesh, 8, 256)
  config.model.retention_impl = "xla"
  config.model.attention_layers = (1,)  # a hybrid: its config refused, and its model run under such a mesh
  with pytest.raises(ValueError, match=r"model.attention_layers=\(1,\) are attention layers, and only retention "
                                       r"splits sequences"):
    train.check_config(config, 8)
  model = Model(config.model, rngs=nnx.Rngs(0))
  with sharding.placement(config.mesh).active(), pytest.raises(ValueError, match="sequence-parallel attention is not"):
    model(np.zeros((1, 64), np.int32), mode="chunkwise")
  config.model.attention_layers = ()
  config.mesh.rules = tuple(config.mesh.rules[:-1]) + (("length", ("tensor", "sequence")),)
  with pytest.raises(ValueError, match="splits sequences over one mesh axis"):
    train.check_config(config, 8)


def test_older_mesh_shapes_and_rules_keep_working():
  """A 3-entry (data, fsdp, tensor) shape gives the sequence axis size 1; without a `length` rule (or outside a
  mesh) nothing is split along the tokens."""
  config = tiny(mesh_shape=(-1, 1, 2))
  assert sharding.mesh_shape(config.mesh, 8) == (4, 1, 2, 1)
  assert sharding.sequence_devices(config.mesh, 8) == 1
  with pytest.raises(ValueError, match=r"needs one size per axis"):
    sharding.mesh_shape(tiny(mesh_shape=(1, 1, 1, 1, 8)).mesh, 8)
  config.mesh.shape = (1, 1, 1, 8)
  config.mesh.rules = tuple(r for r in config.mesh.rules if r[0] != "length")
  assert sharding.sequence_devices(config.mesh, 8) == 1
  assert sharding.sequence_split() is None


@pytest.mark.parametrize("shape", [("abc",), ("(abc,1)",), (1.5, 1, 1, 1), (True, 1)])
def test_a_mesh_shape_of_no_integers_is_named_with_its_form(shape):
  """`--config.mesh.shape=abc` reaches the config as ('abc',): int() of it named neither the field nor its form."""
  config = tiny(mesh_shape=(-1, 1, 1, 1))
  config.mesh.shape = shape
  with pytest.raises(ValueError, match=r"^mesh.shape=.* must be a tuple of integer sizes, one per axis of "
                                       r"mesh.axis_names=\('data', 'fsdp', 'tensor', 'sequence'\) \(-1: the devices "
                                       r"left over\), e.g. --config.mesh.shape='\(-1,1,1,1\)'.$"):
    train.check_config(config, 8)


@pytest.mark.parametrize("rule, detail", [
    (("embed", "nothing"), r"mesh.rules maps 'embed' to 'nothing', but 'nothing' is not an axis of the mesh \("
                           r"mesh.axis_names=\('data', 'fsdp', 'tensor', 'sequence'\)\); name mesh axes among those, "
                           r"or None to replicate."),
    (("batch", ("data", "fsbp")), r"mesh.rules maps 'batch' to \('data', 'fsbp'\), but 'fsbp' is not an axis"),
    ("embed", r"mesh.rules holds 'embed', not a \(logical axis, mesh axes\) pair; write each rule as"),
])
def test_a_rule_naming_no_mesh_axis_is_refused_before_any_work(rule, detail):
  """Such a rule failed as the first parameter was placed, in jax's words ("Resource axis: nothing of P('nothing',
  'mlp') is not found in mesh"), naming neither the rule nor the field."""
  config = tiny(mesh_shape=(-1, 1, 1, 1))
  config.mesh.rules = tuple(r for r in config.mesh.rules if r[0] != (rule[0] if isinstance(rule, tuple) else rule)
                            ) + (rule,)
  with pytest.raises(ValueError, match="^" + detail):
    train.check_config(config, 8)
