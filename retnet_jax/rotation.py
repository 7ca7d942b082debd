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


def rotation_angles(positions: jax.Array, head_dim: int, base: float = 10000.0) -> jax.Array:
  """Angles n * theta_j: `positions [...]` -> `[..., head_dim // 2]` float32."""
  check_rotary_dim(head_dim)
  theta = base ** -jnp.linspace(0.0, 1.0, head_dim // 2, dtype=jnp.float32)
  return positions.astype(jnp.float32)[..., None] * theta


def rotate(x_BxLxHxK: jax.Array, angles_BxLxP: jax.Array) -> jax.Array:
  """Rotates interleaved pairs of `x [batch, seq, heads, 2P]` by `angles [batch, seq, P]`."""
  cos = jnp.cos(angles_BxLxP)[:, :, None, :]
  sin = jnp.sin(angles_BxLxP)[:, :, None, :]
  pairs = x_BxLxHxK.reshape(x_BxLxHxK.shape[:-1] + (-1, 2)).astype(cos.dtype)
  even, odd = pairs[..., 0], pairs[..., 1]
  rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
  return rotated.reshape(x_BxLxHxK.shape).astype(x_BxLxHxK.dtype)
