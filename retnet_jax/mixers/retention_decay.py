"""Per-token decays for the retention forms (gated retention): `log_decay [batch, seq, heads]`, gamma_n =
exp(log_decay[b, n, h]), in the convention of the constant decay

    S_n = gamma_n S_(n-1) + k_n^T v_n,    o_n = q_n S_n.

With b_n = sum_(t <= n) log gamma_t (from the first token of the call) and the segment sums
s[n, m] = sum_(m < t <= n) log gamma_t = b_n - b_m:

    o_n   = sum_(m <= n) exp(s[n, m]) (q_n . k_m) v_m  +  exp(b_n) q_n S_in
    S_out = sum_m exp(s[L-1, m]) k_m^T v_m  +  exp(b_(L-1)) S_in

A `[heads]` decay is the case log gamma_t = log gamma (s[n, m] = (n - m) log gamma); the forms keep their own
exact-power path for it. The parallel form takes these over the whole call; the chunkwise form within each chunk,
the state carrying the rest.

Precision: each exponent is summed from its own terms, never as a difference b_n - b_m of cumulative sums. After a
strongly decaying token (a gate near 0: |b| large) that difference would keep only |b| eps of absolute precision in
every later exponent (float32 eps = 6e-8: a gate of log gamma = -1e4 leaves the mask of every later pair of tokens
6e-4 wrong), where a sum of terms of one sign (all log gamma <= 0) is exact to a few eps relative to itself (at
worst eps times its number of terms). The segment sums cost a cumulative sum over one axis of an `[..., L, L]`
array (L the chunk size in the chunkwise form, the length in the parallel form, which is quadratic in it already).

Stability: every exponent formed is a sum of log gamma <= 0 (s[n, m] for n >= m, b_n, the suffix sums), so no exp of
a positive number is taken; the masked entries (n < m) have exponent 0 there, replaced by 0 before exp as well and
their value by 0 after (`masked_exp`, the double where), so neither value nor gradient holds an inf or a NaN. A decay
near 0 underflows exp to an exact 0 with a zero gradient. log_decay must be finite (`retention` refuses -inf, gamma =
0, where the values are known: the `[heads]` path's powers would form -inf * 0); -1e4 already decays to an exact 0 in
one step. A decay near 1 (log gamma ~ -1e-6) keeps its
precision as a log, and the recurrent and state updates scale the state as the constant path does, by expm1 near 1
and by exp near 0 (`state_decay`, `retention.decay_and_add`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def is_per_token(log_decay) -> bool:
  """Whether `log_decay` is per token, `[batch, seq, heads]` (else `[heads]`, one decay per head)."""
  return log_decay.ndim == 3


def check_shape(log_decay, batch: int, length: int, heads: int) -> None:
  """ValueError naming the bad shape and the two accepted ones unless `log_decay` is `[heads]` or `[batch, seq,
  heads]`."""
  if tuple(log_decay.shape) not in ((heads,), (batch, length, heads)):
    raise ValueError(f"log_decay must have shape [heads] = ({heads},) (a decay per head) or [batch, seq, heads] = "
                     f"({batch}, {length}, {heads}) (a decay per token); got {tuple(log_decay.shape)}.")


def state_decay(log_decay: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(keep, scale), keep + scale = gamma = exp(log_decay), to scale a state as `keep * S + scale * S` with every term
  exact: (1, gamma - 1) for gamma >= 1/2, where gamma would round towards 1 and gamma - 1 (expm1) keeps its precision;
  (0, gamma) below, where 1 + (gamma - 1) would cancel gamma away. Either way the gradient of log_decay is gamma times
  that of scale, to float rounding; neither branch forms an inf or a NaN for any finite log_decay <= 0. Elementwise,
  any shape; pure jnp, so that the kernels share it."""
  expm1 = jnp.expm1(log_decay)
  near_one = expm1 >= -0.5
  return near_one.astype(expm1.dtype), jnp.where(near_one, expm1, jnp.exp(log_decay))


def masked_exp(exponent: jax.Array, keep: jax.Array) -> jax.Array:
  """exp(exponent) where `keep`, else 0: the exponent is replaced by 0 before exp where not kept, so that the masked
  branch forms no inf (nor a NaN in the gradient: the double where)."""
  return jnp.where(keep, jnp.exp(jnp.where(keep, exponent, 0)), 0)


def segment_sums(log_decay_XxL: jax.Array) -> jax.Array:
  """s[..., n, m] = sum_(m < t <= n) log gamma_t for n >= m, 0 for n < m: `[..., L, L]` from `[..., L]`, each entry
  the sum of its own terms (a cumulative sum down the columns of the strictly lower triangle)."""
  length = log_decay_XxL.shape[-1]
  below_LxL = jnp.arange(length)[:, None] > jnp.arange(length)[None, :]
  return jnp.cumsum(jnp.where(below_LxL, log_decay_XxL[..., :, None], 0), axis=-2)


def suffix_sums(log_decay_XxL: jax.Array) -> jax.Array:
  """sum_(t > m) log gamma_t, `[..., L]`: the log decay from token m to the last one."""
  if not log_decay_XxL.shape[-1]:
    return log_decay_XxL
  later = jnp.concatenate([log_decay_XxL[..., 1:], jnp.zeros_like(log_decay_XxL[..., :1])], axis=-1)
  return jax.lax.cumsum(later, axis=later.ndim - 1, reverse=True)


def decay_mask(log_decay_XxL: jax.Array) -> jax.Array:
  """D[..., n, m] = exp(s[n, m]) for n >= m, else 0: `[..., L, L]` from the log decays `[..., L]`."""
  length = log_decay_XxL.shape[-1]
  causal_LxL = jnp.arange(length)[:, None] >= jnp.arange(length)[None, :]
  return masked_exp(segment_sums(log_decay_XxL), causal_LxL)


def parallel_factors(log_decay_BxLxH: jax.Array, acc):
  """The parallel form's decays, head-major: (mask D `[B, H, L, L]`, zeta_m = exp(s[L-1, m]) `[B, H, L, 1]` from
  token m to the end, xi_n = exp(b_n) `[B, H, L, 1]` from the carried state to n, exp(b_(L-1)) `[B, H, 1, 1]` on the
  carried state)."""
  a_BxHxL = jnp.swapaxes(log_decay_BxLxH.astype(acc), 1, 2)
  xi = jnp.exp(jnp.cumsum(a_BxHxL, axis=-1))[..., None]
  carried = jnp.exp(jnp.sum(a_BxHxL, axis=-1))[..., None, None]
  return decay_mask(a_BxHxL), jnp.exp(suffix_sums(a_BxHxL))[..., None], xi, carried


def _in_chunks(log_decay_BxLxH: jax.Array, size: int, acc) -> jax.Array:
  """The log decays `[batch, chunks, heads, size]`, the last chunk padded with log decay 0 (gamma = 1), so that sums
  over a whole chunk are its decay over its true length."""
  batch, length, heads = log_decay_BxLxH.shape
  num_chunks = -(-length // size)
  padded = jnp.pad(log_decay_BxLxH.astype(acc), ((0, 0), (0, num_chunks * size - length), (0, 0)))
  return jnp.transpose(padded.reshape(batch, num_chunks, size, heads), (0, 1, 3, 2))


def chunk_state_factors(log_decay_BxLxH: jax.Array, size: int, acc):
  """The chunk-state scan's decays, chunk-major: (zeta_j `[C, B, H, S, 1]`, from token j to its chunk's last real
  token, zero on padding; the chunk's log decay of its entering state, the sum of its log decays `[C, B, H]`)."""
  a_BxCxHxS = _in_chunks(log_decay_BxLxH, size, acc)
  valid_CxS = jnp.arange(a_BxCxHxS.shape[1] * size).reshape(-1, size) < log_decay_BxLxH.shape[1]
  zeta = jnp.where(valid_CxS[:, None, :], jnp.exp(suffix_sums(a_BxCxHxS)), 0)
  return jnp.moveaxis(zeta, 1, 0)[..., None], jnp.moveaxis(jnp.sum(a_BxCxHxS, axis=-1), 1, 0)


def chunk_output_factors(log_decay_BxLxH: jax.Array, size: int, acc):
  """The chunk outputs' decays: (in-chunk mask `[B, C, H, S, S]`, xi_j `[B, C, H, S, 1]`, exp of the log decays
  summed from the chunk's first token to j: from the state entering the chunk to its token j)."""
  a_BxCxHxS = _in_chunks(log_decay_BxLxH, size, acc)
  return decay_mask(a_BxCxHxS), jnp.exp(jnp.cumsum(a_BxCxHxS, axis=-1))[..., None]
