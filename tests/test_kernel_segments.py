"""Packed documents in the fused Pallas kernels (interpreted on a CPU, compiled on a GPU, as in tests/test_kernels.py):
a packed row computes what each document computes alone with the XLA chunkwise form from an empty state (the
carried-in state reaching the row's first document only), in values, final states, the normaliser's qz and key sum,
and gradients (q, k, v, state).

Boundaries on and off chunk edges, several documents in one chunk, one-token documents, lengths that are not whole
chunks or shorter than one, chunk 1 (on a GPU: chunks of 32 and 64), rows with different boundaries, and ids that
repeat (a document is a maximal run of equal ids); also the bad-input errors, and that one document per row changes
nothing.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from retnet_jax.mixers import kernels, retention
from tests.test_kernels import BF16_TOL, F32_TOL, GPU, LOG_DECAY, LAYOUTS, config_for, random_inputs, rel_err, with_vjp

# (chunk, length, each row's document starts, config): see the test's comments. Compiled, the kernels take chunks of
# 16, 32 and 64 only: there the last two cases run at 32 and at 64.
CASES = {
    "edges_and_inside": (16, 37, ((16, 20, 21, 30), (5, 7, 9, 33)), "two_tiles"),
    "shorter_than_a_chunk": (16, 5, ((1, 2, 3, 4), ()), "two_tiles"),
    "last_token_alone": ((32, 97, ((32, 64, 96), (3, 45)), "two_tiles") if GPU
                         else (4, 21, ((4, 8, 20), (3, 13)), "two_tiles")),
    "starts_on_edges": (64, 150, ((64, 128), (128,)), "default") if GPU else (1, 7, ((2, 3), (6,)), "default"),
}


def segment_ids(starts, length):
  """int32 `[rows, length]` ids from each row's document starts; ids repeat (10, 12, 11, 10, ...) but never twice in a
  row, so only the runs tell documents apart."""
  index = np.stack([np.searchsorted(np.asarray(row, int), np.arange(length), side="right") for row in starts])
  return jnp.asarray(10 + (2 * index) % 3, jnp.int32)


def documents_alone(starts, chunk, log_decay):
  """`form(q, k, v, state)`: each document through `retention.chunkwise_retention` on its own, the row's first from
  the carried-in state, the others from zeros; the final state is each row's last document's."""

  def form(q, k, v, state):
    outs, finals = [], []
    for row, row_starts in enumerate(starts):
      edges = (0, *row_starts, q.shape[1])
      pieces = []
      for i, (begin, end) in enumerate(zip(edges[:-1], edges[1:])):
        piece, final = retention.chunkwise_retention(*(x[row:row + 1, begin:end] for x in (q, k, v)), log_decay, chunk,
                                                     state[row:row + 1] if i == 0 else None)
        pieces.append(piece)
      outs.append(jnp.concatenate(pieces, axis=1))
      finals.append(final)
    return jnp.concatenate(outs), jnp.concatenate(finals)

  return form


def reference(starts, chunk, q, k, v, state, d_out, d_state):
  """`documents_alone` in float64: values and gradients (jitted whole: one compile, not one per document's shapes)."""
  with jax.enable_x64(True):
    args = [jnp.asarray(x, jnp.float64) for x in (q, k, v, state, d_out, d_state)]
    form = documents_alone(starts, chunk, jnp.asarray(LOG_DECAY, jnp.float64))
    out, final, grads = jax.jit(functools.partial(with_vjp, form))(*args)
    return np.asarray(out), np.asarray(final), [np.asarray(g) for g in grads]


@functools.cache
def packed_vjp(chunk, kind, layout):
  config = config_for(kind, layout)

  def run(ids, *args):
    form = lambda q, k, v, s: kernels.chunkwise_retention(q, k, v, LOG_DECAY, chunk, s, segment_ids=ids, config=config)
    return with_vjp(form, *args)

  return jax.jit(run)


def errors(results, expected):
  out, final, grads = results
  ref_out, ref_final, ref_grads = expected
  return {"out": rel_err(out, ref_out), "state": rel_err(final, ref_final),
          **{name: rel_err(g, r) for name, g, r in zip(("dq", "dk", "dv", "d_state"), grads, ref_grads)}}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES)
def test_float32_packed_rows_match_each_document_alone(case, layout):
  """edges_and_inside: starts on a chunk edge (16), a one-token document (20), four documents in the first chunk,
  starts in the partial last chunk (33) and documents crossing chunk edges; shorter_than_a_chunk: one-token documents,
  and a row of one document that carries the state through; last_token_alone: starts on chunk edges and a last
  document of one token, alone in the last chunk; starts_on_edges: every start on a chunk edge (chunk 1 where the
  kernels run interpreted), with the default config."""
  chunk, length, starts, config = CASES[case]
  inputs = random_inputs(length, seed=length + chunk)[:6]
  args = [jnp.asarray(x, jnp.float32) for x in inputs]
  results = packed_vjp(chunk, config, layout)(segment_ids(starts, length), *args)
  found = errors(results, reference(starts, chunk, *inputs))
  assert max(found.values()) < F32_TOL, found


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bfloat16_packed_rows_within_bfloat16_rounding(layout):
  chunk, length, starts, config = CASES["edges_and_inside"]
  inputs = random_inputs(length, seed=4)[:6]
  args = [jnp.asarray(x, jnp.bfloat16) for x in inputs[:3]] + [jnp.asarray(x, jnp.float32) for x in inputs[3:]]
  results = packed_vjp(chunk, config, layout)(segment_ids(starts, length), *args)
  assert results[0].dtype == jnp.bfloat16 and results[1].dtype == jnp.float32
  found = errors(results, reference(starts, chunk, *inputs))
  assert max(found.values()) < BF16_TOL, found


@functools.cache
def packed_with_key_sum(chunk, layout):
  return jax.jit(lambda ids, q, k, v, s, z: kernels.chunkwise_retention_with_key_sum(
      q, k, v, LOG_DECAY, chunk, s, z, segment_ids=ids, config=config_for("two_tiles", layout)))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case,dtype,tol", [("edges_and_inside", jnp.float32, F32_TOL),
                                            ("last_token_alone", jnp.float32, F32_TOL),
                                            ("edges_and_inside", jnp.bfloat16, BF16_TOL)])
def test_normaliser_by_products_restart_with_each_document(case, dtype, tol, layout):
  """qz and the final key sum against each document's float64 retention of a ones column (the carried key sum
  reaching the first document only); out and the state are those of the plain packed form."""
  chunk, length, starts, _ = CASES[case]
  q, k, v, state, _, _, key_sum = random_inputs(length, seed=7)
  with jax.enable_x64(True):
    ones = jnp.ones(q.shape[:3] + (1,), jnp.float64)
    ref_qz, ref_key_sum = jax.jit(documents_alone(starts, chunk, jnp.asarray(LOG_DECAY, jnp.float64)))(
        *(jnp.asarray(x, jnp.float64) for x in (q, k)), ones, jnp.asarray(key_sum[..., None], jnp.float64))
  ids = segment_ids(starts, length)
  args = [jnp.asarray(x, dtype) for x in (q, k, v)] + [jnp.asarray(x, jnp.float32) for x in (state, key_sum)]
  out, final, qz, key_sum_out = packed_with_key_sum(chunk, layout)(ids, *args)
  assert qz.dtype == key_sum_out.dtype == jnp.float32 and qz.shape == q.shape[:3]
  assert rel_err(qz, ref_qz[..., 0]) < tol and rel_err(key_sum_out, ref_key_sum[..., 0]) < tol
  plain_out, plain_final = packed_vjp(chunk, "two_tiles", layout)(ids, *args[:4], args[2], args[3])[:2]
  np.testing.assert_array_equal(out, plain_out)
  np.testing.assert_array_equal(final, plain_final)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_document_per_row_changes_nothing(layout):
  """Ids that never change (whatever their value, different per row) give segment_ids=None's results, gradients
  included: the document masks then keep every term."""
  chunk, length, _, config = CASES["edges_and_inside"]
  args = [jnp.asarray(x, jnp.float32) for x in random_inputs(length, seed=9)[:6]]
  ids = jnp.asarray([[3] * length, [-8] * length], jnp.int32)
  unpacked = jax.jit(functools.partial(with_vjp, lambda q, k, v, s: kernels.chunkwise_retention(
      q, k, v, LOG_DECAY, chunk, s, config=config_for(config, layout))))(*args)
  packed = packed_vjp(chunk, config, layout)(ids, *args)
  for got, expected in zip(jax.tree.leaves(packed), jax.tree.leaves(unpacked)):
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6 * np.abs(expected).max())


def test_bad_segment_ids_name_the_problem():
  q, k, v, state = (jnp.asarray(x, jnp.float32) for x in random_inputs(5, seed=0)[:4])
  good = jnp.zeros((2, 5), jnp.int32)
  for bad in (good[:, :4], good[:1], good[..., None], good.astype(jnp.float32)):
    with pytest.raises(ValueError, match=r"segment_ids must be an integer array \[batch, seq\] = \[2, 5\].*got shape"):
      kernels.chunkwise_retention(q, k, v, LOG_DECAY, 4, state, segment_ids=bad)
  with pytest.raises(ValueError, match="segment_ids must be .* got a list .*jnp.asarray"):
    kernels.chunkwise_retention_with_key_sum(q, k, v, LOG_DECAY, 4, segment_ids=[[0] * 5] * 2)
