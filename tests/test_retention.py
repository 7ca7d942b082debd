"""The three retention forms against a float64 double-sum reference and against each other."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from retnet_jax.mixers import decay, retention
from retnet_jax.nn import rotation

BATCH, HEADS, D_K, D_V = 2, 3, 4, 6
LOG_DECAY = np.log(np.array([0.5, 0.9, 0.995])).astype(np.float32)  # fast, medium and slow decay


def reference(q, k, v, log_decay, state):
  """The math note's double sum in float64 NumPy: o_n = sum_{m<=n} g^(n-m) (q_n.k_m) v_m + g^(n+1) q_n S."""
  gamma = np.exp(log_decay.astype(np.float64))
  length = q.shape[1]
  n = np.arange(length)
  diff = n[:, None] - n[None, :]
  mask = np.where(diff >= 0, gamma[:, None, None] ** np.maximum(diff, 0), 0.0)  # [H, L, L]
  scores = np.einsum("bnhk,bmhk->bhnm", q, k) * mask
  out = np.einsum("bhnm,bmhv->bnhv", scores, v)
  final = np.einsum("hm,bmhk,bmhv->bhkv", gamma[:, None] ** (length - 1 - n), k, v)
  if state is not None:
    out = out + np.einsum("hn,bnhk,bhkv->bnhv", gamma[:, None] ** (n + 1), q, state)
    final = final + gamma[None, :, None, None] ** length * state
  return out, final


def random_inputs(length, seed=0, with_state=True):
  rng = np.random.default_rng(seed)
  q, k = rng.normal(size=(2, BATCH, length, HEADS, D_K))
  v = rng.normal(size=(BATCH, length, HEADS, D_V))
  state = rng.normal(size=(BATCH, HEADS, D_K, D_V)) if with_state else None
  return q, k, v, state


# Jitted once per shape: a whole-function compile is far cheaper than eager op-by-op dispatch.
_parallel = jax.jit(retention.parallel_retention)
_recurrent = jax.jit(retention.recurrent_retention)
_chunkwise = jax.jit(retention.chunkwise_retention, static_argnames="chunk_size")
FORMS = {
    "parallel": lambda q, k, v, lg, s, c: _parallel(q, k, v, lg, s),
    "recurrent": lambda q, k, v, lg, s, c: _recurrent(q, k, v, lg, s),
    "chunkwise": lambda q, k, v, lg, s, c: _chunkwise(q, k, v, lg, chunk_size=c, state=s),
}


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-10), (np.float32, 1e-5)])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("length", [1, 7, 64, 100])
def test_forms_match_float64_reference(length, with_state, dtype, tol):
  q, k, v, state = random_inputs(length, seed=length, with_state=with_state)
  out_ref, final_ref = reference(q, k, v, LOG_DECAY, state)
  with jax.enable_x64(dtype == np.float64):
    args = [jnp.asarray(x, dtype) for x in (q, k, v)]
    s = None if state is None else jnp.asarray(state, dtype)
    results = {"parallel": FORMS["parallel"](*args, LOG_DECAY, s, None),
               "recurrent": FORMS["recurrent"](*args, LOG_DECAY, s, None)}
    for chunk in (1, 3, 16, 64, 128):
      results[f"chunkwise/{chunk}"] = FORMS["chunkwise"](*args, LOG_DECAY, s, chunk)
  # The reference uses the decay the forms see: log_decay rounded to float32.
  for name, (out, final) in results.items():
    assert out.dtype == dtype and out.shape == out_ref.shape, name
    assert rel_err(out, out_ref) < tol, (name, rel_err(out, out_ref))
    assert rel_err(final, final_ref) < tol, (name, rel_err(final, final_ref))
  for (a, ra), (b, rb) in itertools.combinations(results.items(), 2):
    assert rel_err(ra[0], rb[0]) < tol, (a, b)
    assert rel_err(ra[1], rb[1]) < tol, (a, b)


@pytest.mark.parametrize("first,second", list(itertools.product(FORMS, FORMS)))
def test_split_sequence_continues_from_state(first, second):
  """Prefill in one form, continue in another: equals one call over the whole sequence."""
  length = 45
  q, k, v, state = (None if x is None else jnp.asarray(x, jnp.float32) for x in random_inputs(length, seed=3))
  split = int(np.random.default_rng(hash((first, second)) % 2**32).integers(1, length))
  whole_out, whole_state = FORMS["parallel"](q, k, v, LOG_DECAY, state, None)
  out1, s1 = FORMS[first](q[:, :split], k[:, :split], v[:, :split], LOG_DECAY, state, 4)
  out2, s2 = FORMS[second](q[:, split:], k[:, split:], v[:, split:], LOG_DECAY, s1, 4)
  assert rel_err(jnp.concatenate([out1, out2], axis=1), whole_out) < 1e-5
  assert rel_err(s2, whole_state) < 1e-5


@pytest.mark.parametrize("form", FORMS)
def test_causality(form):
  """The output at position n has zero gradient with respect to every input after n."""
  length, n = 11, 4
  q, k, v, state = (jnp.asarray(x, jnp.float32) for x in random_inputs(length, seed=5))
  grads = jax.grad(lambda q, k, v: FORMS[form](q, k, v, LOG_DECAY, state, 3)[0][:, n].sum(), argnums=(0, 1, 2))(
      q, k, v)
  for g in grads:
    assert np.all(np.asarray(g[:, n + 1:]) == 0)
    assert np.any(np.asarray(g[:, :n + 1]) != 0)  # and it does depend on the past


def test_zero_length_chunk_size_rejected():
  q, k, v = (jnp.asarray(x, jnp.float32) for x in random_inputs(5)[:3])
  for bad in (0, -2, 2.5):
    with pytest.raises(ValueError, match="chunk_size"):
      retention.chunkwise_retention(q, k, v, LOG_DECAY, bad)
  np.testing.assert_array_equal(retention.chunkwise_retention(q, k, v, LOG_DECAY, np.int64(3))[0],
                                retention.chunkwise_retention(q, k, v, LOG_DECAY, 3)[0])  # numpy integers too


@pytest.mark.parametrize("form", FORMS)
def test_empty_sequence_passes_the_state_through(form):
  q, k, v, state = (jnp.asarray(x[:, :0] if x.ndim == 4 and i < 3 else x, jnp.float32)
                    for i, x in enumerate(random_inputs(5)))
  out, state_out = FORMS[form](q, k, v, LOG_DECAY, state, 3)
  assert out.shape == v.shape and out.shape[1] == 0
  np.testing.assert_array_equal(state_out, state)


def test_shape_errors_name_the_array():
  q, k, v = (jnp.asarray(x, jnp.float32) for x in random_inputs(5, with_state=False)[:3])
  with pytest.raises(ValueError, match="v must be"):
    retention.parallel_retention(q, k, v[:, :3], LOG_DECAY)
  with pytest.raises(ValueError, match="log_decay"):
    retention.recurrent_retention(q, k, v, LOG_DECAY[:2])
  with pytest.raises(ValueError, match="state must be"):
    retention.chunkwise_retention(q, k, v, LOG_DECAY, 2, jnp.zeros((BATCH, HEADS, D_K, D_V + 1)))
  with pytest.raises(ValueError, match=r"log_decay must have shape \[heads\]"):
    retention.chunkwise_with_states(q, k, v, LOG_DECAY[:1], 2, score_abs_sums=True)
  for form in (retention.parallel_retention, retention.recurrent_retention):  # gamma > 1: a growing state
    with pytest.raises(ValueError, match=r"log_decay must be <= 0"):
      form(q, k, v, -LOG_DECAY)


@pytest.mark.parametrize("length,chunk", [(7, 3), (16, 4), (5, 8)])
def test_chunkwise_by_products_match_float64(length, chunk):
  """The chunkwise pass's by-products for the normalisers: the state entering each chunk, and the in-chunk decayed
  sums of score magnitudes sum_m gamma^(j-m) |q_j . k_m| over the m <= j of j's chunk."""
  q, k, v, state = random_inputs(length, seed=length)
  size = min(chunk, length)
  expected_states = np.stack([reference(q[:, :s], k[:, :s], v[:, :s], LOG_DECAY, state)[1]
                              for s in range(0, length, size)])
  n = np.arange(length)
  diff = n[:, None] - n[None, :]
  in_chunk = (diff >= 0) & (n[:, None] // size == n[None, :] // size)
  mask = np.where(in_chunk, np.exp(LOG_DECAY.astype(np.float64))[:, None, None] ** np.maximum(diff, 0), 0.0)
  expected_sums = np.einsum("bhnm,hnm->bnh", np.abs(np.einsum("bnhk,bmhk->bhnm", q, k)), mask)
  with jax.enable_x64(True):
    args = [jnp.asarray(x, jnp.float64) for x in (q, k, v, state)]
    out, final, states, sums = retention.chunkwise_with_states(*args[:3], LOG_DECAY, chunk, args[3],
                                                               score_abs_sums=True)
    expected_out, expected_final = retention.chunkwise_retention(*args[:3], LOG_DECAY, chunk, args[3])
    assert retention.chunkwise_with_states(*args[:3], LOG_DECAY, chunk, args[3])[3] is None
  assert states.shape == expected_states.shape and rel_err(states, expected_states) < 1e-10
  assert sums.shape == expected_sums.shape and rel_err(sums, expected_sums) < 1e-10
  np.testing.assert_array_equal(out, expected_out)
  np.testing.assert_array_equal(final, expected_final)


def test_rotation_depends_only_on_position_difference():
  rng = np.random.default_rng(0)
  head_dim = 16
  x, y = (jnp.asarray(rng.normal(size=(1, 1, 1, head_dim)), jnp.float32) for _ in range(2))

  def dot_at(n, m):
    qn = rotation.rotate(x, rotation.rotation_tables(jnp.array([[n]]), head_dim))
    km = rotation.rotate(y, rotation.rotation_tables(jnp.array([[m]]), head_dim))
    return float(jnp.sum(qn * km))

  for n, m, shift in [(5, 2, 7), (3, 3, 100), (0, 9, 31)]:
    np.testing.assert_allclose(dot_at(n, m), dot_at(n + shift, m + shift), rtol=1e-4, atol=1e-5)
  assert abs(dot_at(5, 2) - dot_at(5, 3)) > 1e-3  # and it does depend on the difference


def test_rotation_pairs_are_interleaved():
  """Pair j = (x_2j, x_2j+1) at position n turns by n * theta_j, theta_j = base^(-j / (P - 1)): a float64 check."""
  rng = np.random.default_rng(3)
  head_dim, base = 8, 10000.0
  x = rng.normal(size=(2, 3, 2, head_dim))
  positions = np.array([[0, 1, 7], [-2, 40, 1000]])
  out = rotation.rotate(jnp.asarray(x, jnp.float32), rotation.rotation_tables(jnp.asarray(positions), head_dim, base))
  theta = base ** -np.linspace(0.0, 1.0, head_dim // 2)
  angle = positions[:, :, None, None] * theta  # [B, L, 1, P]
  even, odd = x[..., 0::2], x[..., 1::2]
  expected = np.stack([even * np.cos(angle) - odd * np.sin(angle), odd * np.cos(angle) + even * np.sin(angle)],
                      axis=-1).reshape(x.shape)
  np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-4, atol=1e-4)
  with pytest.raises(ValueError, match="odd"):
    rotation.rotation_tables(jnp.array([[1]]), 5)


def test_decay_schedules():
  np.testing.assert_allclose(decay.gammas("retnet", 3), [1 - 1 / 32, 1 - 1 / 64, 1 - 1 / 128])
  logspace = decay.gammas("logspace", 4)
  np.testing.assert_allclose([logspace[0], logspace[-1]], [1 - 1 / 32, 1 - 1 / 512])
  np.testing.assert_allclose(decay.gammas("explicit", 2, (0.9, 0.5)), [0.9, 0.5])
  for schedule in ("retnet", "logspace"):
    log_decay = decay.log_decay(schedule, 16)
    assert log_decay.dtype == np.float32 and np.all(np.exp(log_decay.astype(np.float64)) < 1)
  with pytest.raises(ValueError, match="unknown decay_schedule"):
    decay.gammas("linear", 2)
  with pytest.raises(ValueError, match="one value per head"):
    decay.gammas("explicit", 3, (0.9, 0.5))
  with pytest.raises(ValueError, match="strictly between 0 and 1"):
    decay.gammas("explicit", 2, (0.9, 1.0))


def test_bfloat16_inputs_with_state_run_eagerly_and_match_float32():
  """bfloat16 q/k/v (float32 state) in every form, outside jit too: within bfloat16 rounding of float32."""
  q, k, v, state = random_inputs(37, seed=7)
  expected, expected_state = reference(q, k, v, LOG_DECAY, state)
  args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
  for name, (out, final) in {
      "parallel": retention.parallel_retention(*args, LOG_DECAY, jnp.asarray(state, jnp.float32)),
      "recurrent": retention.recurrent_retention(*args, LOG_DECAY, jnp.asarray(state, jnp.float32)),
      "chunkwise": retention.chunkwise_retention(*args, LOG_DECAY, 8, jnp.asarray(state, jnp.float32)),
  }.items():
    assert out.dtype == jnp.bfloat16 and final.dtype == jnp.float32, name
    assert rel_err(out, expected) < 2e-2 and rel_err(final, expected_state) < 2e-2, name
