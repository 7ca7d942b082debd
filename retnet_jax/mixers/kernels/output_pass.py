"""The split forward's output pass: one program per (value tile, chunk, batch x head), all independent, from the
state entering the chunk (`state_pass`):

    out_c = ((q k^T) * mask) v + xi * (q H_c)          qz_c = rowsum((q k^T) * mask) + xi * (q . z_c)

with mask_ij = exp(b_i - b_j) (i >= j, one document), xi_i = exp(b_i) (rows of the entering document); qz, the shared
normaliser's by-product, when the key sums are given (the first value tile writes it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from retnet_jax.mixers.kernels import common
from retnet_jax.mixers.kernels.support import Tiling


def _kernel(b_ref, b_lo_ref, q_ref, k_ref, v_ref, state_ref, *refs, precision, with_key_sum, packed):
  """One program: the chunk's `[S]` decays, `[S, d_k]` q and k, `[S, block_v]` values, `[d_k, block_v]` state."""
  rel_ref, refs = (refs[0], refs[1:]) if packed else (None, refs)
  key_sum_ref, out_ref, qz_ref = refs if with_key_sum else (None, refs[0], None)
  decays = common.split_decays(b_ref[...], b_lo_ref[...], None if rel_ref is None else rel_ref[...])
  q_SxK, k_SxK, v_SxV = q_ref[...], k_ref[...], v_ref[...]
  scores_SxS = common.dot(q_SxK, k_SxK, common.NT, precision) * decays.mask_SxS
  inner_SxV = common.dot(scores_SxS.astype(v_SxV.dtype), v_SxV, common.NN, precision)
  cross_SxV = common.dot(q_SxK, state_ref[...].astype(q_SxK.dtype), common.NN, precision)
  out_ref[...] = (inner_SxV + decays.xi_S[:, None] * cross_SxV).astype(out_ref.dtype)
  if with_key_sum:
    @pl.when(pl.program_id(0) == 0)  # every value tile computes the same qz: the first one stores it
    def _():
      qz_ref[...] = (jnp.sum(scores_SxS, axis=1)
                     + decays.xi_S * jnp.sum(q_SxK.astype(jnp.float32) * key_sum_ref[...][None, :], axis=1))


def output_pass(b, q, k, v, states, key_sums=None, *, rel=None, size: int, precision, tiling: Tiling,
                interpret: bool):
  """Every chunk's output over padded inputs.

  Args:
    b, rel: as in `state_pass.state_pass`. q, k: `[batch, Lp, heads, d_k]`. v: `[batch, Lp, heads, d_v]`.
    states: `[batch, heads, chunks * d_k, d_v]`, the state entering each chunk. key_sums: float32 `[batch, heads,
      chunks * d_k]`, the key sum entering each chunk, or None for no qz.
  Returns:
    `(out` in v's dtype, `qz` float32 `[batch, Lp, heads]` or None).
  """
  batch, padded, heads, key_dim = q.shape
  block_v = tiling.block_v
  rows, decays = common.chunk_rows_spec(size, key_dim, heads), common.chunk_vector_spec(size, heads)
  in_specs = [decays, decays, rows, rows, common.chunk_rows_spec(size, block_v, heads, True),
              common.chunk_state_spec(key_dim, block_v, heads)]
  inputs = [*b, q, k, v, states]
  out_specs = [common.chunk_rows_spec(size, block_v, heads, True)]
  out_shape = [jax.ShapeDtypeStruct(v.shape, v.dtype)]
  if rel is not None:
    in_specs.append(common.chunk_documents_spec(size, heads))
    inputs.append(rel)
  if key_sums is not None:
    in_specs.append(pl.BlockSpec((None, None, key_dim), lambda t, c, g: (g // heads, g % heads, c)))
    inputs.append(key_sums)
    out_specs.append(common.chunk_vector_spec(size, heads))
    out_shape.append(jax.ShapeDtypeStruct((batch, padded, heads), jnp.float32))
  kernel = functools.partial(_kernel, precision=precision, with_key_sum=key_sums is not None, packed=rel is not None)
  results = pl.pallas_call(
      kernel, out_shape=out_shape, grid=common.chunk_grid(v.shape[-1] // block_v, padded // size, batch, heads),
      in_specs=in_specs, out_specs=out_specs, compiler_params=common.compiler_params(tiling), interpret=interpret,
      name="retention_output")(*inputs)
  return results[0], (results[1] if key_sums is not None else None)
