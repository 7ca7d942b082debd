"""Rotation of query/key feature pairs by position (the complex phase of retention, xPos-style).

Feature pair j at position n is rotated by n * theta_j, so the dot product of a rotated query and key depends on
their positions only through n - m. Pairs: `interleaved` (x_2j, x_2j+1), as torchscale, or `half` (x_j,
x_j+d/2), as flash-linear-attention and GPT-NeoX. Frequencies: `linspace` theta_j = base^(-j / (d/2 - 1)), as
torchscale, or `rope` theta_j = base^(-2j / d), as RoFormer and flash-linear-attention.

The angles are exact at any int32 position (measured within 7e-7 rad), so they depend on positions only through
n - m: the float32 product n * theta_j, as torchscale and fla compute it, is off by up to 3e-2 rad at n = 1e6 and pi
near 2^31. Each frequency, in units of 2^-32 turn per position, is split into a whole number, whose wrapping uint32
product with n is n's exact fraction of a turn, and a float32 remainder below 1/2 unit, whose product with n is below
a quarter turn; the split takes exact float32 products of its 12-bit pieces with those of 2^32 / (2 pi).
"""

from __future__ import annotations

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np

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


def frequencies(head_dim: int, base: float = 10000.0, freqs: str = "linspace") -> jax.Array:
  """The float32 frequencies theta_j `[head_dim // 2]` of a schedule (in radians per position)."""
  if freqs == "rope":
    return base ** -(jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  return base ** -jnp.linspace(0.0, 1.0, head_dim // 2, dtype=jnp.float32)


def _pieces(x: Fraction, count: int) -> np.ndarray:
  """`count` float32 numbers of 12 significant bits each whose sum is `x` to 12 * count bits."""
  pieces = []
  for _ in range(count):
    exponent = x.numerator.bit_length() - x.denominator.bit_length()  # floor(log2 x) or one more
    exponent -= x < Fraction(2) ** exponent
    ulp = Fraction(2) ** (exponent - 11)
    pieces.append(x // ulp * ulp)
    x -= pieces[-1]
  return np.array([float(piece) for piece in pieces], np.float32)


# 2^32 / (2 pi), units of 2^-32 turn per radian, in five pieces: within 2e-10 of a unit (pi to 37 digits).
UNITS_PER_RADIAN = _pieces(2**31 / Fraction("3.141592653589793238462643383279502884"), 5)
RADIANS_PER_UNIT = 2 * math.pi * 2.0**-32


def _turn_units(theta_P: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Frequencies `theta [P]` in units of 2^-32 turn per position: the whole units mod 2^32 (uint32 `[P]`) and the
  remainder (float32 `[P]`, within 1/2). theta's two 12-bit halves times UNITS_PER_RADIAN's pieces are exact
  float32 products; so are their whole parts, and only the remainders, below 1/2 each, are summed in float32."""
  hi_P = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(theta_P, jnp.uint32) & np.uint32(0xFFFFF000),
                                     jnp.float32)
  products_2xNxP = jnp.stack([hi_P, theta_P - hi_P])[:, None, :] * UNITS_PER_RADIAN[:, None]
  whole_2xNxP = jnp.round(products_2xNxP)
  rest_P = jnp.sum(products_2xNxP - whole_2xNxP, axis=(0, 1))
  carry_P = jnp.round(rest_P)
  whole_2xNxP = whole_2xNxP - 2.0**32 * jnp.floor(whole_2xNxP * 2.0**-32)  # mod 2^32, exactly
  whole_P = jnp.sum(whole_2xNxP.astype(jnp.uint32), axis=(0, 1), dtype=jnp.uint32)  # wraps mod 2^32 (x64 too)
  return whole_P + jax.lax.bitcast_convert_type(carry_P.astype(jnp.int32), jnp.uint32), rest_P - carry_P


def rotation_tables(positions_BxL: jax.Array, head_dim: int, base: float = 10000.0,
                    freqs: str = "linspace") -> tuple[jax.Array, jax.Array]:
  """cos and sin of the angles n * theta_j of each feature pair j at int32 `positions [batch, seq]` (any, negative
  ones too), reduced mod 2 pi exactly: two float32 `[batch, seq, 1, head_dim // 2]`.

  A model computes them once per call and shares them between its layers: the sines and cosines cost more
  than the rotations themselves.
  """
  check_rotary_dim(head_dim)
  whole_P, rest_P = _turn_units(frequencies(head_dim, base, freqs))
  positions_BxLx1x1 = positions_BxL.astype(jnp.int32)[..., None, None]
  # n * whole mod 2^32 wraps exactly in uint32; read as int32 it is n's turns in [-1/2, 1/2) in units of 2^-32.
  wrapped_BxLx1xP = jax.lax.bitcast_convert_type(
      jax.lax.bitcast_convert_type(positions_BxLx1x1, jnp.uint32) * whole_P, jnp.int32)
  units_BxLx1xP = wrapped_BxLx1xP.astype(jnp.float32) + positions_BxLx1x1.astype(jnp.float32) * rest_P
  angles_BxLx1xP = units_BxLx1xP * RADIANS_PER_UNIT
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
