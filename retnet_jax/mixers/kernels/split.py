"""Chunkwise retention as split Pallas kernels, per-token decays included, with a custom VJP.

Forward: a serial state pass writes the state entering each chunk (stored in `KernelConfig.states_dtype`), then an
output pass computes every chunk in parallel (`state_pass`, `output_pass`). Backward: the states recomputed, the
state gradient's reverse pass, then dv and dq/dk in parallel over chunks (`split_backward`).

Decays: log(gamma) per head `[heads]` or per token `[batch, seq, heads]` (S_n = gamma_n S_(n-1) + k_n^T v_n, o_n =
q_n S_n). The kernels take b, the log decays summed within each chunk up to each row, in two float32 parts (padding
rows add 0, so the final state decays by the real rows only). The decays' gradient is exact. Per token, the dq/dk
kernel sums, for each row n, the terms gamma_n scales within its chunk, the state leaving the chunk counted through
its gradient (`split_backward._decay_gradient`): exact to float rounding relative to itself for any gate, and 0 where
a document starts after the row's first token (the state is dropped there, gamma_n never applies). Per head, with B_n
the log decays summed over the whole row, dL/dB_n = q_n . dq_n - k_n . dk_n, plus <dS_T, S_T> at the last row (the
final state scales with exp(B_T) as a whole), and d log_gamma = the sum over n of dL/dB_m over m >= n in n's
document: cheaper (no `[S, S]` products), exact for decays away from 0, as a fixed head's are.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from retnet_jax.mixers.kernels import support
from retnet_jax.mixers.kernels.output_pass import output_pass
from retnet_jax.mixers.kernels.split_backward import gradients
from retnet_jax.mixers.kernels.state_pass import state_pass


class Static(NamedTuple):
  size: int
  length: int
  precision: lax.Precision | str | None
  config: support.KernelConfig
  interpret: bool


def _two_sum(a, b):
  """The sum of two (hi, lo) float32 pairs, the rounding error of hi_a + hi_b kept in lo (Knuth's TwoSum)."""
  (hi_a, lo_a), (hi_b, lo_b) = a, b
  hi = hi_a + hi_b
  b_part = hi - hi_a
  return hi, lo_a + lo_b + ((hi_a - (hi - b_part)) + (hi_b - b_part))


def chunk_decays(log_decay: jax.Array, batch: int, padded: int, static: Static) -> tuple[jax.Array, jax.Array]:
  """b, the log decays summed within each chunk up to each row, as float32 `(hi, lo)` `[batch, Lp, heads]` with b = hi
  + lo to about twice float32's precision; the rows past the true length (padding) add 0.

  The kernels form exponents as differences b_i - b_j: from a single float32 b these would keep only eps |b| of
  absolute precision, 6e-4 after a gate of log gamma = -1e4 earlier in the chunk, where (hi_i - hi_j) + (lo_i - lo_j)
  is exact to a few roundings of the difference itself (`common.split_decays`). `[heads]` decays are broadcast."""
  size = static.size
  if log_decay.ndim == 1:
    real = jnp.arange(padded) < static.length
    log_decay = jnp.where(real[None, :, None], log_decay, 0.0) * jnp.ones((batch, 1, 1), jnp.float32)
  heads = log_decay.shape[-1]
  chunks = log_decay.reshape(batch, padded // size, size, heads)
  hi, lo = lax.associative_scan(_two_sum, (chunks, jnp.zeros_like(chunks)), axis=2)
  return hi.reshape(batch, padded, heads), lo.reshape(batch, padded, heads)


def relative_documents(documents: jax.Array | None, size: int) -> jax.Array | None:
  """Each token's document index less that of the state entering its chunk (the last token's of the chunk before;
  0 in the first chunk), from `[batch, Lp]` document indices; None for None."""
  if documents is None:
    return None
  entering = jnp.pad(documents[:, size - 1:-1:size], ((0, 0), (1, 0)))
  return documents - jnp.repeat(entering, size, axis=1)


def _options(static: Static, dtype) -> tuple[dict, jnp.dtype]:
  """The kernels' shared keyword arguments, and the dtype the per-chunk states are stored in."""
  options = dict(size=static.size, precision=static.precision, interpret=static.interpret)
  return options, jnp.dtype(static.config.states_dtype or dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def split(q, k, v, log_decay, state, key_sum, documents, static: Static):
  """`(out, final_state, qz, final_key_sum)` over padded inputs (the last two None without `key_sum`); log_decay
  float32 `[heads]` or `[batch, Lp, heads]`, documents int32 `[batch, Lp]` or None."""
  options, states_dtype = _options(static, q.dtype)
  b = chunk_decays(log_decay, q.shape[0], q.shape[1], static)
  rel = relative_documents(documents, static.size)
  tiling = static.config.forward
  states, final, key_sums, final_key_sum = state_pass(b, k, v, state, key_sum, rel=rel, states_dtype=states_dtype,
                                                      tiling=tiling, **options)
  out, qz = output_pass(b, q, k, v, states, key_sums, rel=rel, tiling=tiling, **options)
  return out, final, qz, final_key_sum


def _split_fwd(q, k, v, log_decay, state, key_sum, documents, static: Static):
  return split(q, k, v, log_decay, state, key_sum, documents, static), (q, k, v, log_decay, state, key_sum,
                                                                        documents)


def _document_sums(db: jax.Array, documents: jax.Array | None) -> jax.Array:
  """Per row n of `[batch, Lp, heads]`, the sum of `db` over m >= n in n's document, 0 where a document starts
  after the first row."""
  if documents is None:
    return jnp.flip(jnp.cumsum(jnp.flip(db, 1), axis=1), 1)
  starts = jnp.concatenate([jnp.zeros_like(documents[:, :1], bool), documents[:, 1:] != documents[:, :-1]], axis=1)
  ends = jnp.concatenate([starts[:, 1:], jnp.ones_like(starts[:, :1])], axis=1)  # the last row of each document

  def combine(a, b):  # segments, scanned from the end: a is the later element
    (x_a, end_a), (x_b, end_b) = a, b
    return x_b + jnp.where(end_b, 0.0, x_a), end_a | end_b

  sums, _ = lax.associative_scan(combine, (jnp.flip(db, 1), jnp.flip(ends, 1)[..., None]), axis=1)
  return jnp.where(starts[..., None], 0.0, jnp.flip(sums, 1))


def _split_bwd(static: Static, residuals, cotangents):
  """Gradients for q, k, v, log_decay and the state; zeros for the key sum (its callers stop it: qz and the key sum
  are the normaliser's, constants to autodiff), none for the document index."""
  q, k, v, log_decay, state, key_sum, documents = residuals
  d_out, d_final, _, _ = cotangents
  options, states_dtype = _options(static, q.dtype)
  batch, padded = q.shape[:2]
  b = chunk_decays(log_decay, batch, padded, static)
  rel = relative_documents(documents, static.size)
  states, final, _, _ = state_pass(b, k, v, state, rel=rel, states_dtype=states_dtype, tiling=static.config.forward,
                                   **options)
  d_states, d_state, _, _ = state_pass(b, q, d_out.astype(v.dtype), d_final, rel=rel, reverse=True,
                                       states_dtype=states_dtype, tiling=static.config.backward, **options)
  per_token = log_decay.ndim == 3
  dq, dk, dv, d_log_decay = gradients(b, q, k, v, d_out, states, d_states, rel=rel, per_token=per_token,
                                      block_k=static.config.key_block(q.shape[-1]), tiling=static.config.backward,
                                      **options)
  if not per_token:  # the rows past the true length are padding: no decay of the head's applies there
    db = d_log_decay.at[:, -1].add(jnp.sum(d_final * final, axis=(2, 3)))
    d_log_decay = jnp.sum(_document_sums(db, documents)[:, :static.length], axis=(0, 1))
  return dq, dk, dv, d_log_decay, d_state, None if key_sum is None else jnp.zeros_like(key_sum), None


split.defvjp(_split_fwd, _split_bwd)
