"""Rotation of query/key feature pairs by position (the complex phase of retention, xPos-style).

Feature pair j at position n is rotated by n * theta_j, so the dot product of a rotated query and key depends on
their positions only through n - m. Pairs: `interleaved` (x_2j, x_2j+1), as torchscale, or `half` (x_j,
x_j+d/2), as flash-linear-attention and GPT-NeoX. Frequencies: `linspace` theta_j = base^(-j / (d/2 - 1)), as
torchscale, or `rope` theta_j = base^(-2j / d), as RoFormer and flash-linear-attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from retnet_jax.core import config_checks

PAIRS = ("interleaved", "half")
FREQS = ("linspace", "rope")


def check_rotary_dim(head_dim: int) -> None:
  """Rotation acts on feature pairs, so the key head dim must be even."""
  if head_dim % 2:
    raise ValueError(f"key head dim {head_dim} is odd, so its features cannot be split into rotation pairs; "
                     "choose d_model / num_heads even.")


def check_rotation(pairs: str, freqs: str) -> None:
  """Raises ValueError for a pairing or frequency schedule not in PAIRS / FREQS."""
  config_checks.choice(pairs, "model.rotation_pairs", PAIRS)
  config_checks.choice(freqs, "model.rotation_freqs", FREQS)


def rotation_tables(positions_BxL: jax.Array, head_dim: int, base: float = 10000.0,
                    freqs: str = "linspace") -> tuple[jax.Array, jax.Array]:
  """cos and sin of the angles n * theta_j of each feature pair j: two float32 `[batch, seq, 1, head_dim // 2]`.

  A model computes them once per call and shares them between its layers: the sines and cosines cost more
  than the rotations themselves.
  """
  check_rotary_dim(head_dim)
  if freqs == "rope":
    theta_P = base ** -(jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  else:
    theta_P = base ** -jnp.linspace(0.0, 1.0, head_dim // 2, dtype=jnp.float32)
  angles_BxLx1xP = positions_BxL.astype(jnp.float32)[..., None, None] * theta_P
  return jnp.cos(angles_BxLx1xP), jnp.sin(angles_BxLx1xP)


def tables_for(cfg, positions_BxL: jax.Array, num_heads: int | None = None, base: float | None = None
               ) -> tuple[jax.Array, jax.Array]:
  """The rotation tables of a model config's heads at `positions [B, L]` (default: `cfg.num_heads` heads of
  `cfg.d_model // num_heads` features at `cfg.rotation_base`), shared by every layer of one call: their sines and
  cosines would cost more than the rotations."""
  head_dim = cfg.d_model // (num_heads or cfg.num_heads)
  return rotation_tables(positions_BxL, head_dim, cfg.rotation_base if base is None else base, cfg.rotation_freqs)


def rotate(x_BxLxHxK: jax.Array, tables: tuple[jax.Array, jax.Array], pairs: str = "interleaved") -> jax.Array:
  """Rotates the feature pairs (`interleaved` or `half`) of `x [batch, seq, heads, head_dim]` by
  `rotation_tables(...)`, in the tables' float32 (float64 for float64 `x`)."""
  cos, sin = tables
  wide = jnp.promote_types(x_BxLxHxK.dtype, cos.dtype)
  if pairs == "half":
    first, second = jnp.split(x_BxLxHxK.astype(wide), 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x_BxLxHxK.dtype)
  x_BxLxHxPx2 = x_BxLxHxK.reshape(x_BxLxHxK.shape[:-1] + (-1, 2)).astype(wide)
  even, odd = x_BxLxHxPx2[..., 0], x_BxLxHxPx2[..., 1]
  rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
  return rotated.reshape(x_BxLxHxK.shape).astype(x_BxLxHxK.dtype)
