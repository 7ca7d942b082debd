"""Retention as pure functions: the parallel, recurrent and chunkwise recurrent forms.

All three compute the raw retention of one layer (no normalisation, q and k already rotated and scaled)

    o_n = sum_{m <= n} gamma^(n - m) (q_n . k_m) v_m  +  gamma^(n + 1) q_n S_in
    S_out = gamma^L S_in + sum_m gamma^(L - 1 - m) k_m^T v_m

per head, and return `(out, final_state)`. Layout: q, k `[batch, seq, heads, d_k]`, v
`[batch, seq, heads, d_v]`, state `[batch, heads, d_k, d_v]`, `log_decay` = log(gamma) of shape `[heads]`.
Products accumulate in float32 (float64 for float64 inputs) and the state is kept in that precision, so a
prompt prefilled in one form can be continued in any other.

Two helpers expose intermediate quantities for normalisers built on top (layers.MultiScaleRetention):
`chunk_states`, the state entering each chunk of the chunkwise form, and `score_abs_sums`, the decayed
sums of score magnitudes `sum_m gamma^(n-m) |q_n . k_m|`.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp


def _acc_dtype(x: jax.Array) -> jnp.dtype:
  """Accumulation dtype: float32 for float32/bfloat16 inputs, float64 for float64 inputs."""
  return jnp.promote_types(x.dtype, jnp.float32)


def _check_inputs(q, k, v, log_decay, state):
  """Validates shapes before tracing so a mistake names the bad array instead of an einsum error."""
  if q.ndim != 4 or k.shape != q.shape:
    raise ValueError(f"q and k must both be [batch, seq, heads, d_k]; got q {q.shape}, k {k.shape}.")
  if v.ndim != 4 or v.shape[:3] != q.shape[:3]:
    raise ValueError(f"v must be [batch, seq, heads, d_v] matching q {q.shape} in the first three dims; "
                     f"got {v.shape}.")
  if log_decay.shape != (q.shape[2],):
    raise ValueError(f"log_decay must have shape [heads] = ({q.shape[2]},); got {log_decay.shape}.")
  if state is not None:
    expected = (q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    if state.shape != expected:
      raise ValueError(f"state must be [batch, heads, d_k, d_v] = {expected}; got {state.shape}.")


def _powers(log_decay_H: jax.Array, exponent: jax.Array) -> jax.Array:
  """gamma^exponent per head: `[heads, *exponent.shape]`, from log(gamma) to stay exact near gamma = 1."""
  return jnp.exp(log_decay_H.reshape((-1,) + (1,) * exponent.ndim) * exponent)


def _decay_mask(log_decay_H: jax.Array, length: int, dtype) -> jax.Array:
  """D[h, n, m] = gamma_h^(n - m) for n >= m, else 0. Shape `[heads, length, length]`."""
  pos = jnp.arange(length, dtype=dtype)
  diff_LxL = pos[:, None] - pos[None, :]
  causal = diff_LxL >= 0
  return jnp.where(causal, _powers(log_decay_H, jnp.where(causal, diff_LxL, 0)), 0)


def _zeros_state(q, v, acc):
  return jnp.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]), acc)


def parallel_retention(q, k, v, log_decay, state=None):
  """Parallel form: `((Q K^T) * D) V` with one `[L, L]` decay mask per head. Returns (out, final_state)."""
  _check_inputs(q, k, v, log_decay, state)
  acc = _acc_dtype(q)
  length = q.shape[1]
  log_decay_H = log_decay.astype(acc)
  pos_L = jnp.arange(length, dtype=acc)

  # Head-major operands: the batched products then need only cheap copies of whole rows; XLA's own layouts
  # for the token-major einsums transposed v and the output across their last axis (a 2-D transpose per head).
  q_h, k_h, v_h = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # [B, H, L, *]
  scores_BxHxLxL = jnp.einsum("bhnk,bhmk->bhnm", q_h, k_h, preferred_element_type=acc)
  scores_BxHxLxL = scores_BxHxLxL * _decay_mask(log_decay_H, length, acc)
  out_BxHxLxV = jnp.einsum("bhnm,bhmv->bhnv", scores_BxHxLxL.astype(v.dtype), v_h, preferred_element_type=acc)

  zeta_HxL = _powers(log_decay_H, length - 1 - pos_L)  # gamma^(L-1-m): decay from m to the end
  k_decayed = (k_h * zeta_HxL[None, :, :, None]).astype(k.dtype)
  state_out = jnp.einsum("bhmk,bhmv->bhkv", k_decayed, v_h, preferred_element_type=acc)
  if state is not None:
    state = state.astype(acc)
    xi_HxL = _powers(log_decay_H, pos_L + 1)  # gamma^(n+1): decay from the carried state to n
    # In the accumulation dtype: XLA's CPU runtime has no bfloat16 x bfloat16 -> float32 kernel for this dot.
    cross = jnp.einsum("bhnk,bhkv->bhnv", q_h.astype(acc), state)
    out_BxHxLxV = out_BxHxLxV + cross * xi_HxL[None, :, :, None]
    state_out = state_out + _powers(log_decay_H, jnp.asarray(length, acc))[None, :, None, None] * state
  out_BxLxHxV = jnp.swapaxes(out_BxHxLxV, 1, 2)
  return out_BxLxHxV.astype(v.dtype), state_out


def recurrent_retention(q, k, v, log_decay, state=None):
  """Recurrent form: `S_n = gamma S_(n-1) + k_n^T v_n`, `o_n = q_n S_n`, one `lax.scan` step per token."""
  _check_inputs(q, k, v, log_decay, state)
  acc = _acc_dtype(q)
  gamma_H = jnp.exp(log_decay.astype(acc))
  state = _zeros_state(q, v, acc) if state is None else state.astype(acc)

  def step(s_BxHxKxV, inputs):
    q_BxHxK, k_BxHxK, v_BxHxV = (x.astype(acc) for x in inputs)
    s_BxHxKxV = gamma_H[None, :, None, None] * s_BxHxKxV + k_BxHxK[..., :, None] * v_BxHxV[..., None, :]
    return s_BxHxKxV, jnp.einsum("bhk,bhkv->bhv", q_BxHxK, s_BxHxKxV)

  time_major = tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v))
  state_out, out_LxBxHxV = jax.lax.scan(step, state, time_major)
  return jnp.swapaxes(out_LxBxHxV, 0, 1).astype(v.dtype), state_out


def _chunk_len(chunk_size, length: int) -> int:
  """The chunk length used for a sequence of `length`: `chunk_size` (any positive integer type), at most the
  length, and 1 for an empty sequence."""
  try:
    size = operator.index(chunk_size)
  except TypeError:
    size = 0
  if size < 1:
    raise ValueError(f"chunk_size must be a positive integer; got {chunk_size!r}.")
  return max(min(size, length), 1)


def _to_chunks(x, size):
  """`[batch, seq, heads, d]` zero-padded to whole chunks: `[batch, chunks, size, heads, d]`."""
  batch, length, heads, dim = x.shape
  num_chunks = -(-length // size)
  x = jnp.pad(x, ((0, 0), (0, num_chunks * size - length), (0, 0), (0, 0)))
  return x.reshape(batch, num_chunks, size, heads, dim)


def chunk_states(k, v, log_decay, chunk_size, state=None):
  """The cross-chunk part of the chunkwise form: the state entering each chunk and the final state.

  Returns `(states [chunks, batch, heads, d_k, d_v], final_state)`: chunk c's entry is the state as at the
  last position of chunk c - 1 (the first is `state`, zero if None). The last chunk decays the state only by
  its true length, so the final state equals the recurrent form's for any sequence length.
  """
  _check_inputs(k, k, v, log_decay, state)
  acc = _acc_dtype(k)
  length = k.shape[1]
  size = _chunk_len(chunk_size, length)
  num_chunks = -(-length // size)
  log_decay_H = log_decay.astype(acc)
  k_c, v_c = (jnp.swapaxes(_to_chunks(x, size), 2, 3) for x in (k, v))  # [B, C, H, S, *]

  # Each chunk's contribution to the state at its own last real position, and its true length.
  pos_CxS = jnp.arange(num_chunks * size, dtype=acc).reshape(num_chunks, size)
  chunk_len_C = jnp.minimum(length - size * jnp.arange(num_chunks), size).astype(acc)
  chunk_end_C = size * jnp.arange(num_chunks, dtype=acc) + chunk_len_C
  valid = pos_CxS < length
  zeta_HxCxS = jnp.where(valid, _powers(log_decay_H, jnp.where(valid, chunk_end_C[:, None] - 1 - pos_CxS, 0)), 0)
  k_decayed = (k_c * jnp.moveaxis(zeta_HxCxS, 0, 1)[None, ..., None]).astype(k.dtype)
  kv_CxBxHxKxV = jnp.einsum("bchmk,bchmv->cbhkv", k_decayed, v_c, preferred_element_type=acc)
  chunk_decay_CxH = _powers(log_decay_H, chunk_len_C).T

  def step(state_BxHxKxV, inputs):
    kv, decay_H = inputs
    return decay_H[None, :, None, None] * state_BxHxKxV + kv, state_BxHxKxV

  state = _zeros_state(k, v, acc) if state is None else state.astype(acc)
  state_out, before_CxBxHxKxV = jax.lax.scan(step, state, (kv_CxBxHxKxV, chunk_decay_CxH))
  return before_CxBxHxKxV, state_out


def chunkwise_retention(q, k, v, log_decay, chunk_size, state=None):
  """Chunkwise recurrent form: parallel inside chunks of `chunk_size`, a `lax.scan` carries the state across.

  The sequence is zero-padded to whole chunks; the last chunk decays the state only by its true length, so
  the final state equals the recurrent form's for any sequence length. Memory is linear in the length.
  """
  _check_inputs(q, k, v, log_decay, state)
  acc = _acc_dtype(q)
  batch, length, heads, _ = q.shape
  size = _chunk_len(chunk_size, length)
  log_decay_H = log_decay.astype(acc)
  # Head-major inside chunks, as in parallel_retention.
  q_c, k_c, v_c = (jnp.swapaxes(_to_chunks(x, size), 2, 3) for x in (q, k, v))  # [B, C, H, S, *]

  # Inside each chunk: the parallel form.
  scores = jnp.einsum("bchnk,bchmk->bchnm", q_c, k_c, preferred_element_type=acc)
  scores = scores * _decay_mask(log_decay_H, size, acc)
  inner = jnp.einsum("bchnm,bchmv->bchnv", scores.astype(v.dtype), v_c, preferred_element_type=acc)

  # Across chunks: query j of a chunk is j + 1 steps after the previous chunk's last position.
  before_CxBxHxKxV, state_out = chunk_states(k, v, log_decay, size, state)
  xi_HxS = _powers(log_decay_H, jnp.arange(1, size + 1, dtype=acc))
  # Chunk-major states: XLA's CPU runtime has no bfloat16 x bfloat16 -> float32 kernel for the batch-major dot.
  cross = jnp.einsum("bchnk,cbhkv->bchnv", q_c, before_CxBxHxKxV.astype(q.dtype), preferred_element_type=acc)
  out = inner + cross * xi_HxS[None, None, :, :, None]
  out = jnp.swapaxes(out, 2, 3).reshape(batch, -1, heads, out.shape[-1])[:, :length]
  return out.astype(v.dtype), state_out


def score_abs_sums(q, k, log_decay, chunk_size):
  """`sum_m gamma^(n-m) |q_n . k_m|` over the m <= n in n's chunk: `[batch, seq, heads]`, accumulation dtype.

  Not part of retention itself: the official chunkwise code normalises rows of its in-chunk decayed score
  matrix by it (see layers.MultiScaleRetention). Chunks of `chunk_size` positions start at the first one.
  """
  if q.ndim != 4 or k.shape != q.shape:
    raise ValueError(f"q and k must both be [batch, seq, heads, d_k]; got q {q.shape}, k {k.shape}.")
  if log_decay.shape != (q.shape[2],):
    raise ValueError(f"log_decay must have shape [heads] = ({q.shape[2]},); got {log_decay.shape}.")
  acc = _acc_dtype(q)
  batch, length, heads, _ = q.shape
  size = _chunk_len(chunk_size, length)
  scores = jnp.einsum("bcnhk,bcmhk->bchnm", _to_chunks(q, size), _to_chunks(k, size), preferred_element_type=acc)
  sums_BxCxHxS = jnp.sum(jnp.abs(scores) * _decay_mask(log_decay.astype(acc), size, acc), axis=-1)
  return jnp.swapaxes(sums_BxCxHxS, 2, 3).reshape(batch, -1, heads)[:, :length]
