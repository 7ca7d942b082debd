"""bfloat16 both ways and the tiled loss: every matmul of a bfloat16 train step takes bfloat16 operands (read from the
step's jaxpr, no compile), float32 models compute what they computed before, and `train.loss_tile` gives the untiled
loss and gradients without the whole `[tokens, vocab]` logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from retnet_jax.core import sharding
from retnet_jax.hardware import matmul_dtypes
from retnet_jax.models import model as model_lib, presets
from retnet_jax.nn import matmul
from retnet_jax.training import losses, run_config, train_step


def _step_report(name: str, architecture: str = "retnet", documents: bool = False, devices=None, **fields):
  """`matmul_dtypes.report` of the train step of preset `name` (batch 2) with `fields` ("model.x" / "train.x")."""
  config = presets.get_config(name, architecture)
  config.train.batch_size = 2
  for key, value in fields.items():
    section, field = key.split("__")
    config[section][field] = value
  config.data.reset_at_documents = documents
  run = train_step.setup(run_config.build(config), sharding.make_mesh(config.mesh, devices or jax.devices()[:1]))
  shape = (config.train.batch_size, config.train.seq_len + 1)
  tokens = jax.ShapeDtypeStruct(shape, jnp.int32)
  batch = (tokens, None, jax.ShapeDtypeStruct(shape, jnp.int32)) if documents else tokens
  with run.placement.active():
    return matmul_dtypes.report(run.train_step, run.abstract_state, batch)


@pytest.mark.parametrize("architecture", ["retnet", "transformer"])
def test_the_13b_train_step_multiplies_bfloat16_both_ways(architecture):
  """The issue's figure: before, 66% (RetNet) and 67% (Transformer) of the step's matmul FLOPs took a float32 operand
  (float32 cotangents in the backward pass); at most 2% may."""
  report = _step_report("1.3b", architecture)
  assert report["float32_matmul_share"] <= 0.02, report
  assert sum(report["matmul_flops_by_dtype"].values()) > 1e13  # the whole step was counted (6 x 1.3e9 x 4096)


@pytest.mark.parametrize("case", [
    dict(train__mode="parallel"), dict(documents=True), dict(train__segment_len=8),
    dict(model__retention_impl="pallas", model__chunk_size=16, model__d_model=64, model__value_dim=128),
    dict(model__attention_layers=(1,), model__attention_window=8), dict(model__scan_layers=True, train__remat="full"),
    dict(train__grad_accum_steps=2, train__loss_tile=16)], ids=str)
def test_every_form_and_path_of_a_bfloat16_step_takes_bfloat16_operands(case):
  """Forms, documents, carried state (segments), the Pallas kernels' bodies, hybrids, scanned layers, micro-batches
  and the tiled loss, at a tiny size in bfloat16: no matmul with a float32 operand at all."""
  report = _step_report("tiny", model__dtype="bfloat16", train__seq_len=32, **case)
  assert report["float32_matmul_share"] == 0.0, report


@pytest.mark.devices(2)
def test_the_sequence_parallel_step_takes_bfloat16_operands():
  report = _step_report("tiny", devices=jax.devices()[:2], model__dtype="bfloat16", train__seq_len=32,
                        mesh__shape=(1, 1, 1, 2))
  assert report["float32_matmul_share"] == 0.0, report


def test_a_float32_step_keeps_float32_matmuls():
  report = _step_report("tiny", train__seq_len=32)
  assert set(report["matmul_flops_by_dtype"]) == {"float32 x float32"}


def test_the_counter_weighs_scans_and_branches():
  """A dot in a scan of 5 counts 5 times, a cond its costliest branch; keys name both operand dtypes."""
  a, b = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 3), jnp.float32)

  def program(a, b):
    _, ys = jax.lax.scan(lambda c, _: (c, a @ a.T), None, None, length=5)
    branch = jax.lax.cond(True, lambda: a.astype(jnp.float32) @ b, lambda: jnp.zeros((4, 3)))
    return ys, branch

  by_dtype = matmul_dtypes.matmul_flops_by_dtype(jax.make_jaxpr(program)(a, b))
  assert by_dtype == {"bfloat16 x bfloat16": 5 * 2 * 4 * 8 * 4, "float32 x float32": 2 * 4 * 8 * 3}
  assert matmul_dtypes.float32_share(by_dtype) == pytest.approx(192 / (192 + 1280))


def test_matmul_einsum_keeps_a_float32_result_and_a_bfloat16_backward():
  """The forward equals the plain einsum accumulated in float32; the backward multiplies the cotangent rounded to
  bfloat16 (so equals plain autodiff of bfloat16 operands up to that rounding), and only in bfloat16."""
  rng = np.random.default_rng(0)
  a, b = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for shape in ((3, 5, 8), (3, 8, 4)))
  spec = "bnk,bkv->bnv"
  plain = lambda a, b: jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
  ours = lambda a, b: matmul.einsum(spec, a, b, jnp.float32)
  np.testing.assert_array_equal(ours(a, b), plain(a, b))
  weights = jnp.asarray(rng.standard_normal((3, 5, 4)), jnp.float32)
  loss = lambda f: lambda a, b: jnp.sum(f(a, b) * weights)
  grads = jax.grad(loss(ours), argnums=(0, 1))(a, b)
  exact = jax.grad(loss(lambda a, b: plain(a.astype(jnp.float32), b.astype(jnp.float32))), argnums=(0, 1))(a, b)
  for got, want in zip(grads, exact):
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0.02, atol=0.02)
  backward = matmul_dtypes.matmul_flops_by_dtype(jax.make_jaxpr(jax.grad(loss(ours), argnums=(0, 1)))(a, b))
  assert set(backward) == {"bfloat16 x bfloat16"}
  # float32 operands: the plain einsum itself, the same program
  a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
  assert str(jax.make_jaxpr(ours)(a32, b32)) == str(jax.make_jaxpr(plain)(a32, b32))
  with pytest.raises(TypeError, match="one dtype"):
    matmul.einsum(spec, a, b32)


def _tiny(architecture="retnet", **model_fields):
  config = presets.get_config("tiny", architecture)
  config.model.update(model_fields)
  return nnx.split(model_lib.Model(config.model, rngs=nnx.Rngs(0)), nnx.Param)


def _loss_and_grads(graphdef, params, batch, tile, **kwargs):
  return jax.jit(jax.value_and_grad(lambda p: losses.token_loss(graphdef, p, batch, loss_tile=tile, **kwargs)))(params)


def _max_relative(a_tree, b_tree):
  return max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a))) for a, b in
             zip(jax.tree.leaves(a_tree), jax.tree.leaves(b_tree)))


@pytest.mark.parametrize("case", [
    dict(), dict(tie_embeddings=True), dict(architecture="transformer"), dict(weights=True), dict(documents=True),
    dict(segment_len=12), dict(mode="chunkwise", documents=True, weights=True)], ids=str)
def test_the_tiled_loss_equals_the_untiled_one(case):
  """float32: loss within 1e-6 and gradients within 1e-5 (relative to each leaf's largest), for tiles that do and do
  not divide the tokens, one position per tile, and one tile holding everything."""
  case = dict(case)
  architecture, mode = case.pop("architecture", "retnet"), case.pop("mode", "parallel")
  weights, documents, segment_len = case.pop("weights", False), case.pop("documents", False), case.pop(
      "segment_len", 0)
  graphdef, params = _tiny(architecture, **case)
  rng = np.random.default_rng(1)
  tokens = jnp.asarray(rng.integers(0, 256, (4, 31)), jnp.int32)
  batch = tokens
  if weights or documents:
    batch = (tokens, jnp.asarray(rng.random((4, 30)), jnp.float32) if weights else None,
             jnp.asarray(np.cumsum(rng.random((4, 31)) < 0.15, axis=1), jnp.int32) if documents else None)
  kwargs = dict(mode=mode, segment_len=segment_len)
  loss, grads = _loss_and_grads(graphdef, params, batch, 0, **kwargs)
  for tile in (4, 28, 52, 10_000):  # one position per tile, 7, 13 (not dividing 30), all at once
    tiled_loss, tiled_grads = _loss_and_grads(graphdef, params, batch, tile, **kwargs)
    assert abs(float(tiled_loss - loss)) <= 1e-6 * abs(float(loss)), tile
    assert _max_relative(grads, tiled_grads) < 1e-5, tile


def test_the_tiled_loss_in_bfloat16_differs_by_rounding_only():
  graphdef, params = _tiny(dtype="bfloat16")
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 256, (4, 33)), jnp.int32)
  loss, grads = _loss_and_grads(graphdef, params, tokens, 0, mode="chunkwise")
  tiled_loss, tiled_grads = _loss_and_grads(graphdef, params, tokens, 24, mode="chunkwise")
  assert abs(float(tiled_loss - loss)) <= 1e-6 * abs(float(loss))  # the same float32 logits, in other rows
  assert _max_relative(grads, tiled_grads) < 2**-6  # weight gradients rounded to bfloat16 once per tile


def test_gradient_accumulation_with_tiles_equals_without():
  config = presets.get_config("tiny")
  config.train.update(dict(batch_size=4, seq_len=24, grad_accum_steps=2))
  tokens = jnp.asarray(np.random.default_rng(3).integers(0, 256, (4, 25)), jnp.int32)
  states = []
  for tile in (0, 20):
    config.train.loss_tile = tile
    run = train_step.setup(run_config.build(config), sharding.make_mesh(config.mesh, jax.devices()[:1]))
    with run.placement.active():
      states.append(run.train_step(run.init(), tokens))
  (state, metrics), (tiled_state, tiled_metrics) = states
  assert abs(float(metrics["loss"] - tiled_metrics["loss"])) <= 1e-6 * float(metrics["loss"])
  assert _max_relative(state.params, tiled_state.params) < 1e-5


@pytest.mark.optimized
def test_the_tiled_step_never_holds_the_whole_logits():
  """Compiled for the CPU: with a 4096-token vocabulary and 1024 tokens a step, the untiled step's temporaries hold
  the float32 logits (16 MiB) and their cotangent; tiles of 128 tokens take at least 16 MiB less."""
  config = presets.get_config("tiny")
  config.model.vocab_size = 4096
  config.train.update(dict(batch_size=8, seq_len=128))
  temporaries = {}
  for tile in (0, 128):
    config.train.loss_tile = tile
    run = train_step.setup(run_config.build(config), sharding.make_mesh(config.mesh, jax.devices()[:1]))
    tokens = jax.ShapeDtypeStruct((8, 129), jnp.int32)
    with run.placement.active():
      compiled = run.train_step.lower(run.abstract_state, tokens).compile()
    temporaries[tile] = compiled.memory_analysis().temp_size_in_bytes
  logits_bytes = 8 * 128 * 4096 * 4
  assert temporaries[0] - temporaries[128] >= logits_bytes, temporaries


def test_a_negative_loss_tile_is_refused_by_name():
  config = presets.get_config("tiny")
  config.train.loss_tile = -1
  with pytest.raises(ValueError, match="train.loss_tile"):
    run_config.build(config)
