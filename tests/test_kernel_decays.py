"""Per-token decays in the split Pallas kernels, and the exact gradient of the decays (per token and per head),
against a float64 recurrence written here: S_n = gamma_n S_(n-1) + k_n^T v_n, o_n = q_n S_n, the state dropped where
a packed document starts. Interpreted on a CPU, compiled on a GPU, as in tests/test_kernels.py.

Decays near 1 (1 - 2^-20) and near 0 (1e-3) within one row, lengths that are not whole chunks, several key and value
tiles, packed documents, bfloat16 inputs, the normaliser's by-products (qz, key sum); the split kernels' gradient of a
per-head decay, which the fused ones stop.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from retnet_jax.core import segments
from retnet_jax.mixers import kernels
from tests.test_kernels import BATCH, BF16_TOL, D_K, HEADS, LOG_DECAY, MANY_CHUNKS, random_inputs, rel_err, two_tiles
from tests.test_kernel_segments import segment_ids

DECAY_TOL = 1e-5  # the decays' gradient: float32 sums over the rest of each document


def recurrence(q, k, v, log_decay, state, starts):
  """The float64 reference: `(out, final_state)` of q, k, v `[B, L, H, d]`, log_decay `[H]` or `[B, L, H]`, the
  carried-in state, and `starts` `[B, L]` (True where a document starts) or None."""
  gamma = jnp.exp(jnp.broadcast_to(log_decay, q.shape[:3]))
  starts = jnp.zeros(q.shape[:2], bool) if starts is None else starts

  def step(s, inputs):
    q_n, k_n, v_n, gamma_n, start_n = inputs
    s = jnp.where(start_n[:, None, None, None], 0.0, gamma_n[..., None, None] * s)
    s = s + k_n[..., :, None] * v_n[..., None, :]
    return s, jnp.einsum("bhk,bhkv->bhv", q_n, s)

  final, out = jax.lax.scan(step, state, [jnp.moveaxis(x, 1, 0) for x in (q, k, v, gamma, starts)])
  return jnp.moveaxis(out, 0, 1), final


def decays_per_token(length, seed):
  """log(gamma) `[BATCH, length, HEADS]`: head 0 between 0.9 and 1 - 2^-20, head 1 mixing 1e-3, 0.5 and 0.999."""
  rng = np.random.default_rng(seed)
  near_one = np.log1p(-rng.uniform(2.0**-20, 0.1, size=(BATCH, length)))
  mixed = np.log(rng.choice([1e-3, 0.5, 0.999], size=(BATCH, length)))
  return np.stack([near_one, mixed], axis=-1)


def vjp_all(form, q, k, v, log_decay, state, d_out, d_state):
  """`(out, final, (dq, dk, dv, d_log_decay, d_state))` of `form(q, k, v, log_decay, state)`."""
  (out, final), pullback = jax.vjp(form, q, k, v, log_decay, state)
  return out, final, pullback((d_out.astype(out.dtype), d_state))


def reference(q, k, v, log_decay, state, d_out, d_state, starts=None):
  with jax.enable_x64(True):
    args = [jnp.asarray(x, jnp.float64) for x in (q, k, v, log_decay, state, d_out, d_state)]
    starts = None if starts is None else jnp.asarray(starts)
    form = lambda q, k, v, a, s: recurrence(q, k, v, a, s, starts)
    out, final, grads = jax.jit(functools.partial(vjp_all, form))(*args)
    return np.asarray(out), np.asarray(final), [np.asarray(g) for g in grads]


@functools.cache
def kernel(chunk, packed):
  def run(ids, *args):
    form = lambda q, k, v, a, s: kernels.chunkwise_retention(q, k, v, a, chunk, s, config=two_tiles("split"),
                                                             segment_ids=ids if packed else None)
    return vjp_all(form, *args)
  return jax.jit(run)


def assert_close(results, expected, tol, decay_tol):
  out, final, grads = results
  ref_out, ref_final, ref_grads = expected
  found = {"out": rel_err(out, ref_out), "state": rel_err(final, ref_final),
           **{name: rel_err(g, r) for name, g, r in zip(("dq", "dk", "dv", "d_log_decay", "d_state"), grads,
                                                         ref_grads)}}
  assert all(e < (decay_tol if name == "d_log_decay" else tol) for name, e in found.items()), found
  assert grads[3].shape == ref_grads[3].shape


def inputs_for(length, per_token, seed):
  q, k, v, state, d_out, d_state, _ = random_inputs(length, seed)
  log_decay = decays_per_token(length, seed) if per_token else LOG_DECAY.astype(np.float64)
  return q, k, v, log_decay, state, d_out, d_state


@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("length,chunk", [(37, 16), MANY_CHUNKS])
def test_float32_values_and_decay_gradients_match_a_float64_recurrence(length, chunk, per_token):
  """Per-token decays `[batch, seq, heads]` near 1 and near 0, and per-head decays `[heads]`: values and gradients,
  the decays' own included (summed over the batch and the positions for `[heads]`)."""
  inputs = inputs_for(length, per_token, seed=length)
  args = [jnp.asarray(x, jnp.float32) for x in inputs]
  results = kernel(chunk, False)(None, *args)
  assert_close(results, reference(*inputs), 2e-6, DECAY_TOL)


@pytest.mark.parametrize("per_token", [True, False])
def test_packed_documents_with_per_token_decays(per_token):
  """Documents starting on and off chunk edges, one-token documents, in the partial last chunk: the state and the
  decays' gradient restart with each document (a decay where a document starts has no effect: its gradient is 0)."""
  length, chunk, starts = 37, 16, ((16, 20, 21, 30), (5, 7, 9, 33))
  inputs = inputs_for(length, per_token, seed=3)
  ids = segment_ids(starts, length)
  args = [jnp.asarray(x, jnp.float32) for x in inputs]
  results = kernel(chunk, True)(ids, *args)
  assert_close(results, reference(*inputs, starts=np.asarray(segments.starts(ids))), 2e-6, DECAY_TOL)
  if per_token:
    assert not np.any(np.asarray(results[2][3])[np.asarray(segments.starts(ids)) & (np.arange(length) > 0)])


def test_bfloat16_per_token_decays_within_bfloat16_rounding():
  inputs = inputs_for(37, True, seed=5)
  args = ([jnp.asarray(x, jnp.bfloat16) for x in inputs[:3]] + [jnp.asarray(x, jnp.float32) for x in inputs[3:]])
  results = kernel(16, False)(None, *args)
  assert results[0].dtype == jnp.bfloat16 and results[2][3].dtype == jnp.float32
  assert_close(results, reference(*(np.asarray(x, np.float64) for x in args)), BF16_TOL, BF16_TOL)


def test_per_token_decay_errors_name_the_problem():
  q, k, v, state = (jnp.asarray(x, jnp.float32) for x in random_inputs(5, seed=0)[:4])
  log_decay = jnp.asarray(decays_per_token(5, seed=0), jnp.float32)
  with pytest.raises(ValueError, match=r"log_decay must be \[heads\] .* or \[batch, seq, heads\]"):
    kernels.chunkwise_retention(q, k, v, log_decay[:, :4], 4)
  with pytest.raises(ValueError, match="log_decay must be <= 0"):
    kernels.chunkwise_retention(q, k, v, -log_decay, 4)
  fused = kernels.KernelConfig(kernels.Tiling(D_K), kernels.Tiling(D_K), layout="fused")
  with pytest.raises(ValueError, match="split kernels only"):
    kernels.chunkwise_retention(q, k, v, log_decay, 4, config=fused)
  with pytest.raises(ValueError, match="unknown kernel layout 'tiled'.*'split', 'fused'"):
    kernels.KernelConfig(kernels.Tiling(D_K), kernels.Tiling(D_K), layout="tiled")


def test_normaliser_by_products_with_per_token_decays():
  """qz = q_n . z_n and the final key sum under per-token decays and documents: the float64 recurrence of a ones
  value column from the carried key sum; out and the state those of the plain form."""
  length, chunk, starts = 37, 16, ((16, 20, 21, 30), ())
  q, k, v, log_decay, state, _, _ = inputs_for(length, True, seed=9)
  key_sum = np.random.default_rng(9).normal(size=(BATCH, HEADS, D_K))
  ids = segment_ids(starts, length)
  with jax.enable_x64(True):
    ref_qz, ref_key_sum = recurrence(*(jnp.asarray(x, jnp.float64) for x in (q, k)), jnp.ones(q.shape[:3] + (1,)),
                                     jnp.asarray(log_decay), jnp.asarray(key_sum[..., None]), segments.starts(ids))
  args = [jnp.asarray(x, jnp.float32) for x in (q, k, v, log_decay, state, key_sum)]
  out, final, qz, key_sum_out = jax.jit(lambda *a: kernels.chunkwise_retention_with_key_sum(
      *a[:4], chunk, *a[4:], segment_ids=ids, config=two_tiles("split")))(*args)
  assert rel_err(qz, ref_qz[..., 0]) < 2e-6 and rel_err(key_sum_out, ref_key_sum[..., 0]) < 2e-6
  plain_out, plain_final = jax.jit(lambda *a: kernels.chunkwise_retention(
      *a[:4], chunk, a[4], segment_ids=ids, config=two_tiles("split")))(*args[:5])
  np.testing.assert_array_equal(out, plain_out)
  np.testing.assert_array_equal(final, plain_final)
