"""Sequence-parallel chunkwise retention on simulated CPU devices against the single-device chunkwise form: outputs,
final and chunk-entry states, the normaliser's by-products and gradients, on meshes splitting the sequence alone or
with batch and heads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from retnet_jax.mixers import retention, sequence_parallel

BATCH, HEADS, D_K, D_V, CHUNK = 2, 4, 4, 6, 4
LOG_DECAY = np.log(np.array([0.5, 0.9, 0.995, 1 - 1e-6])).astype(np.float32)
# (mesh shape, axis names): the sequence alone, and with batch split over data and heads over tensor.
MESHES = [((2,), ("sequence",)), ((8,), ("sequence",)), ((2, 4), ("data", "sequence")),
          ((2, 2, 2), ("data", "sequence", "tensor"))]


def make_mesh(shape, names):
  devices = jax.devices()[:int(np.prod(shape))]
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names), devices=devices)


def random_inputs(length, seed=0, dtype=np.float32):
  rng = np.random.default_rng(seed)
  q, k = rng.normal(size=(2, BATCH, length, HEADS, D_K))
  v = rng.normal(size=(BATCH, length, HEADS, D_V))
  state = rng.normal(size=(BATCH, HEADS, D_K, D_V)).astype(np.float32)
  return (*(jnp.asarray(x, dtype) for x in (q, k, v)), jnp.asarray(state))


def place(mesh, q, k, v, state):
  """Inputs split as a model's activations would be: batch over data, sequence over sequence, heads over tensor."""
  axis = lambda name: name if name in mesh.axis_names else None
  qkv = NamedSharding(mesh, P(axis("data"), "sequence", axis("tensor")))
  return (*(jax.device_put(x, qkv) for x in (q, k, v)),
          jax.device_put(state, NamedSharding(mesh, P(axis("data"), axis("tensor")))))


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


_sharded = jax.jit(sequence_parallel.sharded_chunkwise, static_argnames=("chunk_size", "score_abs_sums"))
_single = jax.jit(retention.chunkwise_with_states, static_argnames=("chunk_size", "score_abs_sums"))


@pytest.mark.parametrize("shape,names", MESHES)
def test_matches_single_device_chunkwise(shape, names):
  """Outputs, final state, chunk-entry states and in-chunk score sums, with and without a carried-in state; the
  output stays split over the sequence (and the batch over data), the final state is whole on every device."""
  mesh = make_mesh(shape, names)
  length = 2 * CHUNK * mesh.shape["sequence"]
  q, k, v, state = random_inputs(length, seed=len(names) + length)
  for carried in (None, state):
    expected = _single(q, k, v, LOG_DECAY, chunk_size=CHUNK, state=carried, score_abs_sums=True)
    args = place(mesh, q, k, v, state)
    with jax.set_mesh(mesh):
      result = _sharded(*args[:3], LOG_DECAY, chunk_size=CHUNK, state=None if carried is None else args[3],
                        score_abs_sums=True)
    for name, got, want in zip(("out", "final state", "entry states", "score sums"), result, expected):
      assert got.shape == want.shape and rel_err(got, want) < 1e-5, (name, carried is None, rel_err(got, want))
    out, final = result[:2]
    assert out.sharding.spec[:2] == args[0].sharding.spec[:2]
    assert "sequence" not in jax.tree.leaves(tuple(final.sharding.spec))


@pytest.mark.parametrize("shape,names", MESHES[:3])
def test_gradients_match_single_device_chunkwise(shape, names):
  mesh = make_mesh(shape, names)
  length = CHUNK * mesh.shape["sequence"]
  q, k, v, state = random_inputs(length, seed=7)
  rng = np.random.default_rng(8)
  w_out, w_state = rng.normal(size=v.shape), rng.normal(size=state.shape)

  def loss(form):
    def fn(q, k, v, state):
      out, final = form(q, k, v, LOG_DECAY, CHUNK, state)
      return jnp.sum(out * w_out) + jnp.sum(final * w_state)
    return jax.jit(jax.grad(fn, argnums=(0, 1, 2, 3)))

  expected = loss(retention.chunkwise_retention)(q, k, v, state)
  with jax.set_mesh(mesh):
    grads = loss(sequence_parallel.chunkwise_retention)(*place(mesh, q, k, v, state))
  for name, got, want in zip("qkvs", grads, expected):
    assert rel_err(got, want) < 1e-5, (name, rel_err(got, want))


def test_normaliser_key_sums_and_bfloat16():
  """The normaliser's q_n . z_n and key sums are the same function with a ones value column; in bfloat16 the final
  state is as float32-accurate as the single-device form's, the outputs within bfloat16 rounding."""
  mesh = make_mesh((4,), ("sequence",))
  length = 4 * CHUNK * 3
  q, k, v, state = random_inputs(length, seed=9, dtype=jnp.bfloat16)
  ones = jnp.ones(v.shape[:3] + (1,), jnp.bfloat16)
  z_in = state[..., :1]
  single = jax.jit(retention.chunkwise_retention, static_argnames="chunk_size")
  sharded = jax.jit(lambda *args: sequence_parallel.chunkwise_retention(*args, mesh=mesh), static_argnums=4)
  for value, carried in ((ones, z_in), (v, state)):
    expected_out, expected_state = single(q, k, value, LOG_DECAY, CHUNK, carried)
    out, final = sharded(q, k, value, LOG_DECAY, CHUNK, carried)
    assert out.dtype == jnp.bfloat16 and final.dtype == jnp.float32
    assert rel_err(out, expected_out) < 1e-2 and rel_err(final, expected_state) < 1e-6


def test_lengths_that_do_not_split_into_whole_chunks_are_refused():
  mesh = make_mesh((4,), ("sequence",))
  for length in (60, 24):  # not a multiple of the 4 devices x chunk size 4; a multiple of 4 but not of 16
    q, k, v, _ = random_inputs(length)
    with pytest.raises(ValueError, match=r"length %d must be a multiple of 4 x chunk_size 4 = 16" % length):
      sequence_parallel.chunkwise_retention(q, k, v, LOG_DECAY, CHUNK, mesh=mesh)
  q, k, v, _ = random_inputs(16)
  with pytest.raises(ValueError, match="needs a mesh with an axis 'sequence'"):
    sequence_parallel.chunkwise_retention(q, k, v, LOG_DECAY, CHUNK, mesh=make_mesh((4,), ("data",)))
