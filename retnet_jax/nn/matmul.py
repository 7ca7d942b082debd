"""Matmuls that take the operands' dtype in both directions, with a float32 result where numerics need one.

A bfloat16 GEMM accumulates in float32 inside. Emitting its float32 result (for a softmax, a decay mask, a state)
makes autodiff multiply a float32 cotangent in the backward pass: float32 (on GPUs TF32) GEMMs at half the bfloat16
rate, and float32 cotangents in memory. `einsum` keeps the wide result but casts the cotangent to the operands'
dtype before its two backward products, so both directions run on bfloat16 operands (accumulating in float32).
Float32 and float64 operands take the plain einsum: their models compute exactly what they computed before.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _narrow(dtype) -> bool:
  return jnp.finfo(dtype).bits < 32


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _wide_result(spec: str, a: jax.Array, b: jax.Array, out_dtype) -> jax.Array:
  return jnp.einsum(spec, a, b, preferred_element_type=out_dtype)


def _wide_result_fwd(spec, a, b, out_dtype):
  return _wide_result(spec, a, b, out_dtype), (a, b)


def _wide_result_bwd(spec, out_dtype, residuals, cotangent):
  a, b = residuals
  product = lambda a, b: jnp.einsum(spec, a, b, preferred_element_type=a.dtype)
  cotangent = cotangent.astype(a.dtype)
  # Transposed as linear maps, so that the forward product is not traced (and counted) again.
  (grad_a,) = jax.linear_transpose(lambda x: product(x, b), a)(cotangent)
  (grad_b,) = jax.linear_transpose(lambda y: product(a, y), b)(cotangent)
  return grad_a, grad_b


_wide_result.defvjp(_wide_result_fwd, _wide_result_bwd)


def einsum(spec: str, a: jax.Array, b: jax.Array, out_dtype=None) -> jax.Array:
  """`jnp.einsum(spec, a, b)` accumulated in float32 (or wider) and returned in `out_dtype` (default: a's dtype).

  Args:
    spec: a two-operand einsum spec. a, b: operands of one dtype (cast before: the cast is where precision is
      chosen).
    out_dtype: the result's dtype; wider than bfloat16 operands, the backward pass still multiplies in bfloat16.
  Returns:
    The product in `out_dtype`.
  """
  if a.dtype != b.dtype:
    raise TypeError(f"matmul.einsum({spec!r}) takes operands of one dtype; got {a.dtype} and {b.dtype}.")
  out_dtype = jnp.dtype(a.dtype if out_dtype is None else out_dtype)
  if _narrow(a.dtype) and not _narrow(out_dtype):
    return _wide_result(spec, a, b, out_dtype)
  return jnp.einsum(spec, a, b, preferred_element_type=out_dtype)
