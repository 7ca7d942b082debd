"""Stability normalisers of multi-scale retention: each head's raw output o_n is divided by a positive scalar per
(position, head), which the per-head norm then cancels up to its epsilon.

With sigma_n = sum_{t<=n} gamma^t and z_n the decayed key sum carried in the state (so q_n . z_n is retention of a
ones value column):
- `shared`, every form alike: sqrt(sigma_n) * clamp(|q_n . z_n| / sqrt(sigma_n), 1, SCORE_CLAMP_MAX), so the forms
  agree exactly before and after the per-head norm;
- `torchscale`, the official release 0.3.0's scalars, which differ between forms: parallel
  sqrt(sigma_n) * clamp(|q_n . z_n| / sqrt(sigma_n), 1) (its absolute row sum of the decayed scores); recurrent
  sqrt(sigma_n) (its state is stored divided by that); chunkwise, see `torchscale_chunkwise_divisor`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

SCORE_CLAMP_MAX = 5e4  # upper clamp of the shared score normaliser, as in the official repository's later code
NORM_STYLES = ("shared", "torchscale")


def torchscale_normaliser(cfg) -> bool:
  """Whether `cfg` (a model config, or a layer holding its fields) divides by the `torchscale` style's scalars, whose
  chunkwise form depends on where chunks start and spans documents: `stability_norm` on in that style (a
  Transformer's config has neither field)."""
  return bool(getattr(cfg, "stability_norm", False)) and getattr(cfg, "stability_norm_style", None) == "torchscale"


def sqrt_decay_sum(n: jax.Array, log_decay_H: jax.Array) -> jax.Array:
  """sqrt(sigma_n), sigma_n = sum_{t<=n} gamma^t = (1 - gamma^(n+1)) / (1 - gamma): `n [...]` -> `[..., H]`."""
  n = n.astype(jnp.float32)[..., None]
  return jnp.sqrt(jnp.expm1((n + 1) * log_decay_H) / jnp.expm1(log_decay_H))


def divisor(style: str, mode: str, qz_BxLxH: jax.Array, positions_BxL: jax.Array, log_decay_H: jax.Array
            ) -> jax.Array:
  """Each head's divisor `[B, L, H]` (float32) in the `shared` style, or the `torchscale` style's parallel and
  recurrent forms, from `qz = q_n . z_n [B, L, H]` at `positions [B, L]` (negative: left padding, as 0)."""
  sqrt_sigma = sqrt_decay_sum(jnp.maximum(positions_BxL, 0), log_decay_H)
  if style == "torchscale" and mode == "recurrent":
    return sqrt_sigma
  score = jnp.abs(qz_BxLxH.astype(jnp.float32)) / sqrt_sigma
  if style == "shared":
    return sqrt_sigma * jnp.clip(score, 1.0, SCORE_CLAMP_MAX)
  return sqrt_sigma * jnp.maximum(score, 1.0)


def torchscale_chunkwise_divisor(abs_sums_BxLxH: jax.Array, entry_states_CxBxHxKxV: jax.Array, chunk_size: int,
                                 log_decay_H: jax.Array) -> jax.Array:
  """The torchscale style's chunkwise divisor `[B, L, H]`, from the chunkwise pass's by-products.

  With j the position inside a chunk of size S: sqrt(sigma_j) * max(clamp(A_j / sqrt(sigma_j), 1),
  clamp(max_v sum_k |R| / sigma_(S-1), 1)), where A_j = sum_m gamma^(j-m) |q_j . k_m| over the chunk (`abs_sums`)
  and R the raw kv state entering the chunk (`entry_states`). Each chunk's sums are its own, so a row's clamp
  depends on the chunking.
  """
  length = abs_sums_BxLxH.shape[1]
  size = min(chunk_size, length)
  sqrt_sigma_LxH = sqrt_decay_sum(jnp.arange(length) % size, log_decay_H)
  inner = jnp.maximum(abs_sums_BxLxH / sqrt_sigma_LxH, 1.0)
  sigma_last_H = sqrt_decay_sum(jnp.asarray(size - 1), log_decay_H) ** 2
  state_abs_CxBxH = jnp.abs(entry_states_CxBxHxKxV).sum(axis=-2).max(axis=-1)
  cross_BxCxH = jnp.maximum(jnp.moveaxis(state_abs_CxBxH, 0, 1) / sigma_last_H, 1.0)
  cross = jnp.repeat(cross_BxCxH, size, axis=1)[:, :length]
  return sqrt_sigma_LxH * jnp.maximum(inner, cross)
