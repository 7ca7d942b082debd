"""Retention at long lengths against a float64 recurrence: decays close to 1 in every form and every hand-off between
forms, and the float32 states that bfloat16 prefills hand over.

A float32 state rounds once per token, so the recurrent form's error grows as the square root of the length (a few
1e-6 at 8k tokens, 1e-5 at 32k); the chunkwise form rounds once per chunk.
"""

import jax
import jax.numpy as jnp
import numpy as np

from retnet_jax.mixers import decay, retention

D_K, D_V = 4, 4
# Explicit decays up to 1 - 2^-22, float32-representable or not, and the retnet schedule's head 20, whose gamma
# rounds to exactly 1 in float32 (1 - 2^-25).
GAMMAS_8K = (1 - 2**-5, 1 - 2**-12, 1 - 1e-6, 1 - 3e-7, 1 - 2**-22, 1 - 2**-25)
GAMMAS_32K = (1 - 2**-5, 1 - 1e-6, 1 - 2**-22, 1 - 1e-7)

_parallel = jax.jit(retention.parallel_retention)
_recurrent = jax.jit(retention.recurrent_retention)
_chunkwise = jax.jit(retention.chunkwise_retention, static_argnames="chunk_size")
_chunkwise_by_products = jax.jit(retention.chunkwise_with_states, static_argnames=("chunk_size", "wide_entry_states"))
FORMS = {
    "parallel": lambda q, k, v, lg, s: _parallel(q, k, v, lg, s),
    "recurrent": lambda q, k, v, lg, s: _recurrent(q, k, v, lg, s),
    "chunkwise": lambda q, k, v, lg, s: _chunkwise(q, k, v, lg, chunk_size=64, state=s),
}


def float64_recurrence(q, k, v, log_decay, state):
  """S_n = gamma S_(n-1) + k_n^T v_n, o_n = q_n S_n in float64 NumPy, gamma = exp(log_decay) of the float32 logs."""
  gamma_H = np.exp(np.asarray(log_decay, np.float64))[None, :, None, None]
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  s = np.asarray(state, np.float64)
  out = np.empty(v.shape)
  for n in range(q.shape[1]):
    s = gamma_H * s + k[:, n, :, :, None] * v[:, n, :, None, :]
    out[:, n] = np.einsum("bhk,bhkv->bhv", q[:, n], s)
  return out, s


def random_inputs(length, heads, seed):
  rng = np.random.default_rng(seed)
  q, k = rng.normal(size=(2, 1, length, heads, D_K)).astype(np.float32)
  v = rng.normal(size=(1, length, heads, D_V)).astype(np.float32)
  state = (4 * rng.normal(size=(1, heads, D_K, D_V))).astype(np.float32)
  return q, k, v, state


def head_rel_err(a, b, head_axis):
  """The largest error relative to the largest reference value, per head (heads differ in scale), over heads."""
  a, b = np.moveaxis(np.asarray(a, np.float64), head_axis, 0), np.moveaxis(np.asarray(b, np.float64), head_axis, 0)
  return max(np.abs(x - y).max() / np.abs(y).max() for x, y in zip(a, b))


def assert_close(out, state, ref_out, ref_state, tol, name):
  out_err, state_err = head_rel_err(out, ref_out, 2), head_rel_err(state, ref_state, 1)
  assert out_err < tol and state_err < tol, (name, out_err, state_err)


def test_every_form_matches_float64_at_8k_tokens():
  length = 8195  # not a multiple of the chunk sizes
  log_decay = decay.log_decay("explicit", len(GAMMAS_8K), GAMMAS_8K)
  q, k, v, state = random_inputs(length, len(GAMMAS_8K), seed=0)
  ref_out, ref_state = float64_recurrence(q, k, v, log_decay, state)
  assert_close(*_recurrent(q, k, v, log_decay, state), ref_out, ref_state, 5e-6, "recurrent")
  for chunk in (1, 16, 256):
    assert_close(*_chunkwise(q, k, v, log_decay, chunk, state), ref_out, ref_state, 5e-6, f"chunkwise/{chunk}")
  # The parallel form on the heads of 1 - 3e-7 and 1 - 2^-22 (its [L, L] scores and mask take 256 MB per head).
  heads = slice(3, 5)
  args = (q[:, :, heads], k[:, :, heads], v[:, :, heads], log_decay[heads], state[:, heads])
  assert_close(*_parallel(*args), ref_out[:, :, heads], ref_state[:, heads], 5e-6, "parallel")


def test_every_hand_off_matches_float64_at_8k_tokens():
  """One 8k-token sequence in seven segments whose forms meet in every ordered pair, each continuing from the state
  the previous one handed over (parallel segments short enough for its [L, L] scores)."""
  forms = ("parallel", "recurrent", "chunkwise", "parallel", "chunkwise", "recurrent", "parallel")
  lengths = (1536, 897, 897, 1536, 897, 896, 1536)
  log_decay = decay.log_decay("explicit", len(GAMMAS_8K), GAMMAS_8K)
  q, k, v, state = random_inputs(sum(lengths), len(GAMMAS_8K), seed=2)
  ref_out, ref_state = float64_recurrence(q, k, v, log_decay, state)
  start = 0
  for i, (form, length) in enumerate(zip(forms, lengths)):
    part = slice(start, start + length)
    out, state = FORMS[form](q[:, part], k[:, part], v[:, part], log_decay, state)
    assert head_rel_err(out, ref_out[:, part], 2) < 5e-6, (i, form, head_rel_err(out, ref_out[:, part], 2))
    start += length
  assert head_rel_err(state, ref_state, 1) < 5e-6, head_rel_err(state, ref_state, 1)


def test_32k_tokens_and_a_chunkwise_prefill_continued_recurrently():
  """32,768 tokens with decays up to 1 - 1e-7: the chunkwise form, the recurrent form, and a chunkwise prefill of
  all but the last 256 tokens continued in the recurrent form (how generation decodes after a long prompt)."""
  length, tail = 32768, 256
  log_decay = decay.log_decay("explicit", len(GAMMAS_32K), GAMMAS_32K)
  q, k, v, state = random_inputs(length, len(GAMMAS_32K), seed=3)
  ref_out, ref_state = float64_recurrence(q, k, v, log_decay, state)
  assert_close(*_chunkwise(q, k, v, log_decay, 64, state), ref_out, ref_state, 5e-6, "chunkwise")
  assert_close(*_recurrent(q, k, v, log_decay, state), ref_out, ref_state, 2e-5, "recurrent")
  head = slice(0, length - tail)
  prefill_out, prefill_state = _chunkwise(q[:, head], k[:, head], v[:, head], log_decay, 64, state)
  out, final = _recurrent(q[:, -tail:], k[:, -tail:], v[:, -tail:], log_decay, prefill_state)
  assert_close(jnp.concatenate([prefill_out, out], axis=1), final, ref_out, ref_state, 5e-6, "hand-off")


def test_bfloat16_prefill_hands_over_a_float32_accurate_state():
  """bfloat16 q, k, v: the chunkwise form's final and chunk-entry states (asked for wide) and the parallel form's final
  state are float32-accurate (their outputs are bfloat16), and so is the state after recurrent decoding continues from
  them; the entry states the outputs read are those rounded to bfloat16."""
  # On GPUs too: the decayed keys are split into bfloat16 parts by `reduce_precision` (`retention.decayed_state`),
  # which XLA keeps. A float32 -> bfloat16 -> float32 round trip, as before, was folded away there under XLA's
  # default excess precision (lower parts zero: the states 2.0e-3 off on an H100).
  tol = 1e-6
  length, tail = 2051, 64
  gammas = (1 - 2**-5, 1 - 2**-8, 1 - 2**-12, 1 - 1e-6)
  log_decay = decay.log_decay("explicit", len(gammas), gammas)
  q, k, v, state = random_inputs(length + tail, len(gammas), seed=4)
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
  _, ref_state = float64_recurrence(q[:, :length], k[:, :length], v[:, :length], log_decay, state)
  _, ref_final = float64_recurrence(q[:, length:], k[:, length:], v[:, length:], log_decay, ref_state)
  prefill = (q[:, :length], k[:, :length], v[:, :length], log_decay)
  chunk = 64
  _, chunk_state, entry_states, _ = _chunkwise_by_products(*prefill, chunk, state, wide_entry_states=True)
  narrow_entries = _chunkwise_by_products(*prefill, chunk, state)[2]
  assert narrow_entries.dtype == jnp.bfloat16
  np.testing.assert_array_equal(narrow_entries, entry_states.astype(jnp.bfloat16))
  for name, prefill_state in {"chunkwise": chunk_state, "parallel": _parallel(*prefill, state)[1]}.items():
    assert prefill_state.dtype == jnp.float32
    assert head_rel_err(prefill_state, ref_state, 1) < tol, (name, head_rel_err(prefill_state, ref_state, 1))
    _, final = _recurrent(q[:, length:], k[:, length:], v[:, length:], log_decay, prefill_state)
    assert head_rel_err(final, ref_final, 1) < tol, (name, head_rel_err(final, ref_final, 1))
  c = entry_states.shape[0] - 1  # the state entering the last chunk
  _, ref_entry = float64_recurrence(q[:, :c * chunk], k[:, :c * chunk], v[:, :c * chunk], log_decay, state)
  assert head_rel_err(entry_states[c], ref_entry, 1) < tol
