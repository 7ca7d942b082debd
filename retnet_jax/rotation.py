"""Rotation of query/key feature pairs by position (the complex phase of retention, xPos-style).

Feature pair (x_2j, x_2j+1) at position n is rotated by n * theta_j with theta_j = base^(-j / (d/2 - 1)),
so the dot product of a rotated query and key depends on their positions only through n - m.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_rotary_dim(head_dim: int) -> None:
  """Rotation acts on feature pairs, so the key head dim must be even."""
  if head_dim % 2:
    raise ValueError(f"key head dim {head_dim} is odd, so its features cannot be split into rotation pairs; "
                     "choose d_model / num_heads even.")


def rotation_tables(positions_BxL: jax.Array, head_dim: int, base: float = 10000.0) -> tuple[jax.Array, jax.Array]:
  """cos and sin of the angles n * theta_j of each feature pair j: two float32 `[batch, seq, 1, head_dim // 2]`.

  A model computes them once per call and shares them between its layers: the sines and cosines cost more
  than the rotations themselves.
  """
  check_rotary_dim(head_dim)
  theta_P = base ** -jnp.linspace(0.0, 1.0, head_dim // 2, dtype=jnp.float32)
  angles_BxLx1xP = positions_BxL.astype(jnp.float32)[..., None, None] * theta_P
  return jnp.cos(angles_BxLx1xP), jnp.sin(angles_BxLx1xP)


def rotate(x_BxLxHxK: jax.Array, tables: tuple[jax.Array, jax.Array]) -> jax.Array:
  """Rotates interleaved feature pairs of `x [batch, seq, heads, head_dim]` by `rotation_tables(...)`."""
  cos, sin = tables
  pairs = x_BxLxHxK.reshape(x_BxLxHxK.shape[:-1] + (-1, 2)).astype(cos.dtype)
  even, odd = pairs[..., 0], pairs[..., 1]
  rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
  return rotated.reshape(x_BxLxHxK.shape).astype(x_BxLxHxK.dtype)
