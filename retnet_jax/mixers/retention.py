"""Retention as pure functions: the parallel, recurrent and chunkwise recurrent forms.

Each computes one layer's raw retention per head (no normalisation; q and k already rotated and scaled)

    o_n = sum_{m <= n} gamma^(n - m) (q_n . k_m) v_m  +  gamma^(n + 1) q_n S_in
    S_out = gamma^L S_in + sum_m gamma^(L - 1 - m) k_m^T v_m

and returns `(out, final_state)`. `log_decay` is log(gamma) per head `[heads]`, or per token `[batch, seq, heads]`
(gated retention: S_n = gamma_n S_(n-1) + k_n^T v_n, the powers above become products of the gammas between the two
positions; `retnet_jax.mixers.retention_decay`). Products accumulate in float32 (float64 for float64 inputs) and the
state stays in that precision, so a prompt prefilled in one form continues in any other.

With `segment_ids [batch, seq]` (packed documents, `retnet_jax.core.segments`) token n retains token m only within one
document, S_in reaches the row's first document only and S_out holds the last document's keys: a document start is
a decay of zero. Inside, a document start is a bool `starts [batch, seq]`, which may be True at position 0 (a row
whose first token opens a new document: S_in reaches no token).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from retnet_jax.core import config_checks, segments
from retnet_jax.mixers import retention_decay
from retnet_jax.nn import matmul


def accumulation_dtype(x: jax.Array) -> jnp.dtype:
  """Accumulation dtype: float32 for float32/bfloat16 inputs, float64 for float64 inputs."""
  return jnp.promote_types(x.dtype, jnp.float32)


def check_inputs(q, k, v, log_decay, state):
  """Validates shapes (and concrete decays' values) before tracing, so that a mistake names the bad array instead of
  failing in an einsum: the forms', the kernels' and sequence parallelism's shared check."""
  if q.ndim != 4 or k.shape != q.shape:
    raise ValueError(f"q and k must both be [batch, seq, heads, d_k]; got q {q.shape}, k {k.shape}.")
  if v.ndim != 4 or v.shape[:3] != q.shape[:3]:
    raise ValueError(f"v must be [batch, seq, heads, d_v] matching q {q.shape} in the first three dims; "
                     f"got {v.shape}.")
  retention_decay.check_shape(log_decay, *q.shape[:3])
  try:
    values = np.asarray(log_decay)
  except jax.errors.TracerArrayConversionError:  # traced: its values are not known before the computation
    values = None
  if values is not None and (values > 0).any():
    shown = (values.tolist() if values.ndim == 1 else
             f"{values.max()} at [batch, seq, head] {tuple(map(int, np.unravel_index(values.argmax(), values.shape)))}")
    raise ValueError(f"log_decay must be <= 0 (a decay gamma = exp(log_decay) in (0, 1]); got {shown}: pass "
                     "log(gamma), not gamma or -log(gamma).")
  if values is not None and not np.isfinite(values).all():
    raise ValueError("log_decay must be finite (gamma = exp(log_decay) > 0); got a NaN or -inf: a decay to nothing "
                     "is a large negative log_decay such as -1e4, which decays to an exact 0 in one step.")
  if state is not None:
    expected = (q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    if state.shape != expected:
      raise ValueError(f"state must be [batch, heads, d_k, d_v] = {expected}; got {state.shape}.")


def _starts(segment_ids, q):
  """The document starts `[batch, seq]` of `segment_ids` checked against q's batch and length, or None."""
  segments.check_segment_ids(segment_ids, q.shape[0], q.shape[1])
  return None if segment_ids is None else segments.starts(segment_ids)


def powers(log_decay_H: jax.Array, exponent: jax.Array) -> jax.Array:
  """gamma^exponent per head: `[heads, *exponent.shape]`, from log(gamma) to stay exact near gamma = 1."""
  return jnp.exp(log_decay_H.reshape((-1,) + (1,) * exponent.ndim) * exponent)


def decay_and_add(state, decay, kv):
  """`gamma S + kv`, exact in value and gradient for any gamma: `decay` is `retention_decay.state_decay(log gamma)`,
  the pair (keep, scale) broadcast against S, computed once outside the scans that call this per step.

  Near 1 it is written `S + ((gamma - 1) S + kv)`: gamma itself would round to the float nearest 1 (exactly 1 from
  gamma = 1 - 2^-25 on in float32), a bias that compounds at every step, while gamma - 1 keeps its precision: each
  step then rounds once, as any float state must. Below 1/2 it is `gamma S + kv`, where S + (gamma - 1) S would cancel
  gamma S away (gamma - 1 = -1 in float32 for gamma < 3e-8), and the gradients with it: d S = gamma dS and d log_decay
  = gamma <S, dS> come out exact, not 1 + (gamma - 1) rounded. Where kv lies on a coarse grid (products of bfloat16
  keys and values), a decay step below half a unit in the state's last place (gamma within a few 2^-24 of 1) can
  round away at every token; such a head drifts by at most n (1 - gamma) of its state after n tokens, as if gamma
  were 1.
  """
  keep, scale = decay
  return keep * state + (scale * state + kv)


def decayed_state(spec: str, k, zeta, v, acc) -> jax.Array:
  """`einsum(spec, k * zeta, v)` accumulated in `acc`, the decayed keys kept to `acc` precision when k is narrower.

  Rounding k * zeta to bfloat16 would cost the state 16 of float32's 24 bits. It is split instead into three parts in
  k's dtype (8 bits each in bfloat16), each multiplied exactly into `acc` on every backend, where a float32 product
  runs at reduced precision by default on accelerators (TF32, bfloat16 passes). Gradients flow through the first part
  only, as they did through the rounded product, so the backward pass is unchanged. Each part is rounded by
  `reduce_precision`, which XLA keeps, where a float32 -> bfloat16 -> float32 round trip may be folded away (GPUs do,
  under XLA's default excess-precision rule: the remainders would then be zero).
  """
  product = lambda a, b: matmul.einsum(spec, a, b, acc)
  k_decayed = k.astype(acc) * zeta
  if k.dtype == acc:
    return product(k_decayed, v)
  narrow = jnp.finfo(k.dtype)
  rounded = lambda x: jax.lax.reduce_precision(x, exponent_bits=narrow.nexp, mantissa_bits=narrow.nmant)
  hi = rounded(k_decayed)
  rest = jax.lax.stop_gradient(k_decayed - hi)
  mid = rounded(rest)
  lo, mid, hi = (rest - mid).astype(k.dtype), mid.astype(k.dtype), hi.astype(k.dtype)
  v_const = jax.lax.stop_gradient(v)
  return product(hi, v) + product(mid, v_const) + product(lo, v_const)


def _decay_mask(log_decay_H: jax.Array, length: int, dtype) -> jax.Array:
  """D[h, n, m] = gamma_h^(n - m) for n >= m, else 0. Shape `[heads, length, length]`."""
  pos = jnp.arange(length, dtype=dtype)
  diff_LxL = pos[:, None] - pos[None, :]
  causal = diff_LxL >= 0
  return jnp.where(causal, powers(log_decay_H, jnp.where(causal, diff_LxL, 0)), 0)


def zeros_state(q, v, acc):
  """An empty state `[batch, heads, d_k, d_v]` in `acc` for q `[batch, seq, heads, d_k]` and v `[..., d_v]`."""
  return jnp.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]), acc)


def parallel_retention(q, k, v, log_decay, state=None, segment_ids=None):
  """Parallel form: `O = ((Q K^T) * D) V` with the `[L, L]` decay mask D of each head (block-diagonal over the
  documents of `segment_ids`).

  Args:
    q, k: `[batch, seq, heads, d_k]`. v: `[batch, seq, heads, d_v]`. log_decay: log(gamma) <= 0, finite: `[heads]`,
      or per token `[batch, seq, heads]` (gamma_n = exp(log_decay[b, n, h]); module docstring).
    state: the carried-in state `[batch, heads, d_k, d_v]`, or None for an empty one.
    segment_ids: integer `[batch, seq]` document ids (module docstring), or None: one document per row.
  Returns:
    `(out [batch, seq, heads, d_v]` in v's dtype, `final_state [batch, heads, d_k, d_v]` in the accumulation dtype).
  """
  check_inputs(q, k, v, log_decay, state)
  starts_BxL = _starts(segment_ids, q)
  acc = accumulation_dtype(q)
  length = q.shape[1]
  if retention_decay.is_per_token(log_decay):  # products of the gammas, from sums of their logs
    mask, zeta_BxHxLx1, xi_BxHxLx1, carried_BxHx1x1 = retention_decay.parallel_factors(log_decay, acc)
  else:  # powers of each head's gamma
    log_decay_H = log_decay.astype(acc)
    pos_L = jnp.arange(length, dtype=acc)
    mask = _decay_mask(log_decay_H, length, acc)
    zeta_BxHxLx1 = powers(log_decay_H, length - 1 - pos_L)[None, :, :, None]  # gamma^(L-1-m): from m to the end
    xi_BxHxLx1 = powers(log_decay_H, pos_L + 1)[None, :, :, None]  # gamma^(n+1): from the carried state to n
    carried_BxHx1x1 = powers(log_decay_H, jnp.asarray(length, acc))[None, :, None, None]

  # Head-major operands: the batched products then copy whole rows, where token-major ones transposed per head.
  q_h, k_h, v_h = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # [B, H, L, *]
  scores_BxHxLxL = matmul.einsum("bhnk,bhmk->bhnm", q_h, k_h, acc)
  scores_BxHxLxL = scores_BxHxLxL * mask
  if starts_BxL is not None:  # within a document only, and the final state from the last one's keys
    doc_BxL = jnp.cumsum(starts_BxL, axis=1)
    scores_BxHxLxL = jnp.where((doc_BxL[:, :, None] == doc_BxL[:, None, :])[:, None], scores_BxHxLxL, 0)
    zeta_BxHxLx1 = jnp.where((doc_BxL == doc_BxL[:, -1:])[:, None, :, None], zeta_BxHxLx1, 0)
  out_BxHxLxV = matmul.einsum("bhnm,bhmv->bhnv", scores_BxHxLxL.astype(v.dtype), v_h, acc)

  state_out = decayed_state("bhmk,bhmv->bhkv", k_h, zeta_BxHxLx1, v_h, acc)
  if state is not None:
    state = state.astype(acc)
    carried = carried_BxHx1x1 * state
    if starts_BxL is not None:  # the first document only, and the final state only where it is the last
      xi_BxHxLx1 = jnp.where((doc_BxL == 0)[:, None, :, None], xi_BxHxLx1, 0)
      carried = jnp.where((doc_BxL[:, -1] == 0)[:, None, None, None], carried, 0)
    cross = matmul.einsum("bhnk,bhkv->bhnv", q_h, state.astype(q.dtype), acc)  # as the chunkwise form's
    out_BxHxLxV = out_BxHxLxV + cross * xi_BxHxLx1
    state_out = state_out + carried
  out_BxLxHxV = jnp.swapaxes(out_BxHxLxV, 1, 2)
  return out_BxLxHxV.astype(v.dtype), state_out


def recurrent_retention(q, k, v, log_decay, state=None, segment_ids=None):
  """Recurrent form: `S_n = gamma S_(n-1) + k_n^T v_n`, `o_n = q_n S_n`, one `lax.scan` step per token (S_(n-1)
  zeroed where a document of `segment_ids` starts).

  Args and returns as in `parallel_retention`.
  """
  check_inputs(q, k, v, log_decay, state)
  starts_BxL = _starts(segment_ids, q)
  acc = accumulation_dtype(q)
  per_token = retention_decay.is_per_token(log_decay)
  decay = retention_decay.state_decay(log_decay.astype(acc))  # [heads], or [batch, seq, heads] read step by step
  state = zeros_state(q, v, acc) if state is None else state.astype(acc)

  def step(s_BxHxKxV, inputs):
    if starts_BxL is not None:
      *inputs, start_B = inputs
      s_BxHxKxV = jnp.where(start_B[:, None, None, None], 0, s_BxHxKxV)
    if per_token:
      *inputs, keep_BxH, scale_BxH = inputs
    q_BxHxK, k_BxHxK, v_BxHxV = (x.astype(acc) for x in inputs)
    decay_xHx1x1 = tuple(x[:, :, None, None] for x in ((keep_BxH, scale_BxH) if per_token else
                                                       (decay[0][None, :], decay[1][None, :])))
    s_BxHxKxV = decay_and_add(s_BxHxKxV, decay_xHx1x1, k_BxHxK[..., :, None] * v_BxHxV[..., None, :])
    return s_BxHxKxV, jnp.einsum("bhk,bhkv->bhv", q_BxHxK, s_BxHxKxV)

  per_step = (decay if per_token else ()) + (() if starts_BxL is None else (starts_BxL,))
  time_major = tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v) + per_step)
  state_out, out_LxBxHxV = jax.lax.scan(step, state, time_major)
  return jnp.swapaxes(out_LxBxHxV, 0, 1).astype(v.dtype), state_out


def check_chunk_size(chunk_size, name: str = "chunk_size") -> int:
  """`chunk_size` as an int (any integer type), or ValueError naming `name` unless it is a positive integer."""
  return config_checks.positive_int(chunk_size, name)


def _chunk_len(chunk_size, length: int) -> int:
  """The chunk length for a sequence of `length`: `chunk_size`, at most the length, at least 1."""
  return max(min(check_chunk_size(chunk_size), length), 1)


def _to_chunks(x, size):
  """`[batch, seq, heads, d]` zero-padded to whole chunks: `[batch, chunks, size, heads, d]`."""
  batch, length, heads, dim = x.shape
  num_chunks = -(-length // size)
  x = jnp.pad(x, ((0, 0), (0, num_chunks * size - length), (0, 0), (0, 0)))
  return x.reshape(batch, num_chunks, size, heads, dim)


def _from_chunks(x_BxCxHxS, length: int):
  """Head-major chunks `[batch, chunks, heads, size, *rest]` back to `[batch, length, heads, *rest]`."""
  batch, _, heads = x_BxCxHxS.shape[:3]
  return jnp.swapaxes(x_BxCxHxS, 2, 3).reshape((batch, -1, heads) + x_BxCxHxS.shape[4:])[:, :length]


def _chunk_documents(starts_BxL, size):
  """Each position's document index `[batch, chunks, size]` (padding continues the last document), and whether the
  state entering its chunk reaches it (no document starts in its chunk up to it), `[batch, chunks, size]` bool."""
  batch, length = starts_BxL.shape
  pad = -(-length // size) * size - length
  doc_BxCxS = jnp.pad(jnp.cumsum(starts_BxL, axis=1), ((0, 0), (0, pad)), mode="edge").reshape(batch, -1, size)
  starts_BxCxS = jnp.pad(starts_BxL, ((0, 0), (0, pad))).reshape(batch, -1, size)
  return doc_BxCxS, jnp.cumsum(starts_BxCxS, axis=2) == 0


def chunk_states(k, v, log_decay, size, state, starts_BxL=None, entry_dtype=None):
  """The state entering each chunk, `[chunks, batch, heads, d_k, d_v]` (chunk c's: as at the last position of chunk
  c - 1) in `entry_dtype` (default: the accumulation dtype; the carry stays in it), and the final state; the last
  chunk decays the state by its true length only. `log_decay` in the accumulation dtype, `[heads]` or `[batch, seq,
  heads]`. With document `starts` (module docstring), a chunk adds its last document's keys only and drops the state
  entering it if one starts inside it."""
  acc = log_decay.dtype
  length = k.shape[1]
  num_chunks = -(-length // size)
  # Chunk-major, head-major inside: the scan's steps take one chunk each.
  k_c, v_c = (jnp.transpose(_to_chunks(x, size), (1, 0, 3, 2, 4)) for x in (k, v))  # [C, B, H, S, *]

  # Each chunk's contribution to the state at its own last real position, and its decay over its true length.
  if retention_decay.is_per_token(log_decay):
    zeta_CxBxHxSx1, chunk_decay_CxBxH = retention_decay.chunk_state_factors(log_decay, size, acc)
  else:  # integer positions, so that the exponents stay exact at any length
    pos_CxS = jnp.arange(num_chunks * size).reshape(num_chunks, size)
    chunk_len_C = jnp.minimum(length - size * jnp.arange(num_chunks), size)
    valid = pos_CxS < length
    to_end_CxS = jnp.where(valid, (size * jnp.arange(num_chunks) + chunk_len_C)[:, None] - 1 - pos_CxS, 0)
    zeta_HxCxS = jnp.where(valid, powers(log_decay, to_end_CxS.astype(acc)), 0)
    zeta_CxBxHxSx1 = jnp.moveaxis(zeta_HxCxS, 0, 1)[:, None, ..., None]
    chunk_decay_CxBxH = (log_decay[None, :] * chunk_len_C[:, None].astype(acc))[:, None, :]
  xs = retention_decay.state_decay(chunk_decay_CxBxH)  # (keep, scale)
  if starts_BxL is not None:
    doc_BxCxS, reached_BxCxS = _chunk_documents(starts_BxL, size)
    last_doc_CxBxS = jnp.swapaxes(doc_BxCxS == doc_BxCxS[..., -1:], 0, 1)
    zeta_CxBxHxSx1 = jnp.where(last_doc_CxBxS[:, :, None, :, None], zeta_CxBxHxSx1, 0)
    xs += (jnp.swapaxes(reached_BxCxS[..., -1], 0, 1),)  # [C, B]: no document starts in the chunk

  # A chunk's contribution is computed in its step: no [chunks, ...] stack of float32 contributions (nor of their
  # cotangents in the backward pass) exists beside the entry states.
  def step(state_BxHxKxV, inputs):
    k_BxHxSxK, v_BxHxSxV, zeta_BxHxSx1, keep_BxH, scale_BxH, *kept = inputs
    kv = decayed_state("bhmk,bhmv->bhkv", k_BxHxSxK, zeta_BxHxSx1, v_BxHxSxV, acc)
    entering = state_BxHxKxV if not kept else jnp.where(kept[0][:, None, None, None], state_BxHxKxV, 0)
    decay_BxHx1x1 = (keep_BxH[..., None, None], scale_BxH[..., None, None])
    return decay_and_add(entering, decay_BxHx1x1, kv), state_BxHxKxV.astype(entry_dtype or acc)

  state = zeros_state(k, v, acc) if state is None else state.astype(acc)
  state_out, before_CxBxHxKxV = jax.lax.scan(step, state, (k_c, v_c, zeta_CxBxHxSx1) + xs)
  return before_CxBxHxKxV, state_out


def chunk_outputs(q, k, v, log_decay, size, entry_states_CxBxHxKxV, score_abs_sums, starts_BxL=None):
  """The chunkwise form's outputs given the state entering each chunk (`chunk_states`, `log_decay` as there), and
  the in-chunk |score| row sums (None unless `score_abs_sums`); as in `chunkwise_with_states`. With document
  `starts`, scores within a document only and the entering state up to the chunk's first start."""
  acc = log_decay.dtype
  length = q.shape[1]
  # Head-major inside chunks, as in parallel_retention.
  q_c, k_c, v_c = (jnp.swapaxes(_to_chunks(x, size), 2, 3) for x in (q, k, v))  # [B, C, H, S, *]

  # Inside each chunk: the parallel form.
  if retention_decay.is_per_token(log_decay):
    mask, xi_BxCxHxSx1 = retention_decay.chunk_output_factors(log_decay, size, acc)
  else:
    mask = _decay_mask(log_decay, size, acc)
    xi_BxCxHxSx1 = powers(log_decay, jnp.arange(1, size + 1, dtype=acc))[None, None, :, :, None]
  scores = matmul.einsum("bchnk,bchmk->bchnm", q_c, k_c, acc)
  scores = scores * mask
  if starts_BxL is not None:
    doc_BxCxS, reached_BxCxS = _chunk_documents(starts_BxL, size)
    scores = jnp.where((doc_BxCxS[..., :, None] == doc_BxCxS[..., None, :])[:, :, None], scores, 0)
    xi_BxCxHxSx1 = jnp.where(reached_BxCxS[:, :, None, :, None], xi_BxCxHxSx1, 0)
  inner = matmul.einsum("bchnm,bchmv->bchnv", scores.astype(v.dtype), v_c, acc)
  abs_sums = _from_chunks(jnp.sum(jnp.abs(scores), axis=-1), length) if score_abs_sums else None

  # Across chunks: query j of a chunk is j + 1 steps after the previous chunk's last position (xi above).
  cross = matmul.einsum("bchnk,cbhkv->bchnv", q_c, entry_states_CxBxHxKxV.astype(q.dtype), acc)
  out = _from_chunks(inner + cross * xi_BxCxHxSx1, length)
  return out.astype(v.dtype), abs_sums


def chunkwise_with_states(q, k, v, log_decay, chunk_size, state=None, score_abs_sums=False, segment_ids=None,
                          wide_entry_states=False):
  """`chunkwise_retention` with two by-products of its pass, for normalisers built on it.

  `log_decay`: `[heads]` or `[batch, seq, heads]`, as in `chunkwise_retention`. Returns `(out, final_state,
  entry_states, abs_sums)`: `entry_states [chunks, batch, heads, d_k, d_v]`, the state
  entering each chunk, in q's dtype (as the outputs read them: half the memory in bfloat16), or with
  `wide_entry_states` in the accumulation dtype; `abs_sums [batch, seq, heads]` (accumulation dtype, None unless
  `score_abs_sums`), the in-chunk `sum_m gamma^(j-m) |q_j . k_m|` over the m <= j of j's chunk (with a per-token
  decay, D[j, m] in place of gamma^(j-m)), the absolute row sums of the masked scores.
  """
  check_inputs(q, k, v, log_decay, state)
  starts_BxL = _starts(segment_ids, q)
  size = _chunk_len(chunk_size, q.shape[1])
  log_decay = log_decay.astype(accumulation_dtype(q))
  entry_dtype = log_decay.dtype if wide_entry_states else q.dtype
  entry_states_CxBxHxKxV, state_out = chunk_states(k, v, log_decay, size, state, starts_BxL, entry_dtype)
  out, abs_sums = chunk_outputs(q, k, v, log_decay, size, entry_states_CxBxHxKxV, score_abs_sums, starts_BxL)
  return out, state_out, entry_states_CxBxHxKxV, abs_sums


def chunkwise_retention(q, k, v, log_decay, chunk_size, state=None, segment_ids=None):
  """Chunkwise recurrent form: the parallel form inside chunks of `chunk_size`, a `lax.scan` across them.

  The sequence is zero-padded to whole chunks; the last chunk decays the state by its true length only, so the
  final state equals the recurrent form's for any length (a per-token decay is cumulated within each chunk, its
  padding a decay of 1). Memory is linear in the length. Documents may start anywhere, on or off chunk edges.

  Args:
    q, k, v, log_decay, state, segment_ids: as in `parallel_retention`. chunk_size: a positive integer (at most seq
      is used).
  Returns:
    `(out [batch, seq, heads, d_v]` in v's dtype, `final_state [batch, heads, d_k, d_v]` in the accumulation dtype).
  """
  out, state_out, _, _ = chunkwise_with_states(q, k, v, log_decay, chunk_size, state, segment_ids=segment_ids)
  return out, state_out
