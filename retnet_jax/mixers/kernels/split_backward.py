"""The split backward's chunk-parallel kernels, from the states entering each chunk (H_c, `state_pass` recomputed)
and the gradients of the states leaving it (dH_(c+1), `state_pass` in reverse). With dS = (do v^T) * mask:

    dv_c = ((q k^T) * mask)^T do + zeta * (k dH_(c+1))      one program per (value tile, chunk, batch x head)
    dq_c = dS k + xi * (do H_c^T)                           one program per (key tile, chunk, batch x head),
    dk_c = dS^T q + zeta * (v dH_(c+1)^T)                   looping over the value columns

dq and dk contract over the value columns, so their programs tile the keys instead and walk all of d_v: each writes
whole rows of dq and dk, with no partial sums over value tiles. The same program writes its key tile's share of the
decays' gradient, `[key tiles, batch, Lp, heads]` float32, no wider than the decays: per token, d log(gamma_n)
summed from the terms gamma_n scales (`_decay_gradient`, two more `[S, S]` products); per head, q_n . dq_n - k_n .
dk_n, the gradient of the cumulative log decay at row n (less the final state's term).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from retnet_jax.mixers.kernels import common
from retnet_jax.mixers.kernels.support import Tiling


def _dv_kernel(b_ref, b_lo_ref, q_ref, k_ref, do_ref, d_state_ref, *refs, precision, packed):
  """`[S]` decays (hi and lo), `[S, d_k]` q and k, `[S, block_v]` do, `[d_k, block_v]` leaving state gradient -> dv
  tile."""
  rel_ref, dv_ref = (refs[0], refs[1]) if packed else (None, refs[0])
  decays = common.split_decays(b_ref[...], b_lo_ref[...], None if rel_ref is None else rel_ref[...])
  q_SxK, k_SxK, do_SxV = q_ref[...], k_ref[...], do_ref[...]
  scores_SxS = common.dot(q_SxK, k_SxK, common.NT, precision) * decays.mask_SxS
  dv_SxV = (common.dot(scores_SxS.astype(do_SxV.dtype), do_SxV, common.TN, precision)
            + decays.zeta_S[:, None] * common.dot(k_SxK, d_state_ref[...].astype(k_SxK.dtype), common.NN, precision))
  dv_ref[...] = dv_SxV.astype(dv_ref.dtype)


def _decay_gradient(decays, q_SxK, k_SxK, d_scores_SxS, dq_state_SxK, dk_state_SxK, carried, precision):
  """The tile's share of d log(gamma_n) `[S]` for each row n of the chunk, each term formed on its own: the products
  that gamma_n scales, the pairs j < n <= i of the chunk (M = dS * (q k^T), mask included), the entering state's
  reach of rows i >= n (xi_i q_i . (do H_c^T)_i), the keys j < n into the leaving state (zeta_j k_j . (v dH^T)_j) and
  the entering state carried through the chunk (exp(b_last) <H_c, dH_(c+1)>, `carried` = <H_c, dH_(c+1)>).

  A sum of these terms is exact to float rounding relative to itself (all of one sign: to its float32 roundings),
  where q_n . dq_n - k_n . dk_n summed over m >= n cancels the terms not crossing n: a gate near 0 leaves gamma_n's
  terms (~gamma_n) far below those (~1), lost to their rounding. The pairs cost two `[S, S]` products."""
  size = q_SxK.shape[0]
  row = lax.broadcasted_iota(jnp.int32, (size, size), 0)
  col = lax.broadcasted_iota(jnp.int32, (size, size), 1)
  pairs_SxS = d_scores_SxS * common.dot(q_SxK, k_SxK, common.NT, precision)
  before_SxS = common.dot(pairs_SxS, jnp.where(row < col, 1.0, 0.0), common.NN, precision)  # [i, n]: sum over j < n
  entering_S = decays.xi_S * jnp.sum(q_SxK.astype(jnp.float32) * dq_state_SxK, axis=1)
  leaving_S = decays.zeta_S * jnp.sum(k_SxK.astype(jnp.float32) * dk_state_SxK, axis=1)
  through_S = jnp.sum(jnp.where(row >= col, before_SxS + entering_S[:, None], leaving_S[:, None]), axis=0)
  return through_S + common.only(decays.keep, jnp.exp(decays.last) * carried)


def _dqk_kernel(b_ref, b_lo_ref, q_ref, k_ref, v_ref, do_ref, state_ref, d_state_ref, *refs, block_v, precision,
                packed, per_token):
  """`[S]` decays (hi and lo), `[S, block_k]` q and k, `[S, d_v]` v and do, `[block_k, d_v]` entering state and
  leaving state gradient -> dq, dk tiles and the tile's `[S]` share of the decay gradient: per token, d log(gamma_n)
  itself (`_decay_gradient`); per head, q_n . dq_n - k_n . dk_n."""
  rel_ref, (dq_ref, dk_ref, db_ref) = (refs[0], refs[1:]) if packed else (None, refs)
  decays = common.split_decays(b_ref[...], b_lo_ref[...], None if rel_ref is None else rel_ref[...])
  q_SxK, k_SxK = q_ref[...], k_ref[...]
  size, block_k = q_SxK.shape

  def step(j, carry):
    d_scores_SxS, dq_SxK, dk_SxK, carried = carry
    cols = pl.ds(pl.multiple_of(j * block_v, block_v), block_v)
    v_SxV, do_SxV, state_KxV, d_state_KxV = v_ref[:, cols], do_ref[:, cols], state_ref[:, cols], d_state_ref[:, cols]
    if per_token:
      carried = carried + jnp.sum(state_KxV.astype(jnp.float32) * d_state_KxV.astype(jnp.float32))
    return (d_scores_SxS + common.dot(do_SxV, v_SxV, common.NT, precision),
            dq_SxK + common.dot(do_SxV, state_KxV.astype(do_SxV.dtype), common.NT, precision),
            dk_SxK + common.dot(v_SxV, d_state_KxV.astype(v_SxV.dtype), common.NT, precision), carried)

  zeros = lambda *shape: jnp.zeros(shape, jnp.float32)
  d_scores_SxS, dq_state_SxK, dk_state_SxK, carried = lax.fori_loop(
      0, v_ref.shape[1] // block_v, step, (zeros(size, size), zeros(size, block_k), zeros(size, block_k), zeros()))
  d_scores_SxS = d_scores_SxS * decays.mask_SxS
  dq_SxK = (common.dot(d_scores_SxS.astype(q_SxK.dtype), k_SxK, common.NN, precision)
            + decays.xi_S[:, None] * dq_state_SxK)
  dk_SxK = (common.dot(d_scores_SxS.astype(q_SxK.dtype), q_SxK, common.TN, precision)
            + decays.zeta_S[:, None] * dk_state_SxK)
  dq_ref[...] = dq_SxK.astype(dq_ref.dtype)
  dk_ref[...] = dk_SxK.astype(dk_ref.dtype)
  if per_token:
    db_ref[...] = _decay_gradient(decays, q_SxK, k_SxK, d_scores_SxS, dq_state_SxK, dk_state_SxK, carried,
                                  precision)
  else:
    db_ref[...] = (jnp.sum(q_SxK.astype(jnp.float32) * dq_SxK, axis=1)
                   - jnp.sum(k_SxK.astype(jnp.float32) * dk_SxK, axis=1))


def gradients(b, q, k, v, d_out, states, d_states, *, rel=None, per_token: bool, size: int, block_k: int,
              precision, tiling: Tiling, interpret: bool):
  """dq, dk, dv and the decay gradient per row over padded inputs.

  Args:
    b, rel: as in `state_pass.state_pass`. q, k: `[batch, Lp, heads, d_k]`. v, d_out: `[batch, Lp, heads, d_v]`.
    states: `[batch, heads, chunks * d_k, d_v]`, the state entering each chunk; d_states: likewise, the gradient of
      the state leaving each chunk. block_k: key columns per dq/dk program (divides d_k). per_token: whether the
      decays are per token (else per head: `db` as below).
  Returns:
    `(dq, dk` in q's dtype, `dv` in v's, `db` float32 `[batch, Lp, heads]`: per token d log(gamma_n) (documents
    included, 0 where one starts after the chunk's first row); per head q_n . dq_n - k_n . dk_n, the gradient of the
    cumulative log decay at row n less the final state's term`)`.
  """
  batch, padded, heads, key_dim = q.shape
  value_dim, num_chunks, block_v = v.shape[-1], padded // size, tiling.block_v
  d_out = d_out.astype(v.dtype)
  params = dict(compiler_params=common.compiler_params(tiling), interpret=interpret)
  documents = ([common.chunk_documents_spec(size, heads)], [rel]) if rel is not None else ([], [])
  rows, decays = common.chunk_rows_spec(size, key_dim, heads), common.chunk_vector_spec(size, heads)
  value_tile = common.chunk_rows_spec(size, block_v, heads, True)
  dv = pl.pallas_call(
      functools.partial(_dv_kernel, precision=precision, packed=rel is not None),
      out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype),
      grid=common.chunk_grid(value_dim // block_v, num_chunks, batch, heads),
      in_specs=[decays, decays, rows, rows, value_tile,
                common.chunk_state_spec(key_dim, block_v, heads), *documents[0]],
      out_specs=value_tile, name="retention_dv", **params)(*b, q, k, d_out, d_states, *documents[1])

  key_tiles = key_dim // block_k
  key_tile = common.chunk_rows_spec(size, block_k, heads, True)
  values = common.chunk_rows_spec(size, value_dim, heads)
  state = common.chunk_state_spec(block_k, value_dim, heads, key_tiles)
  db_spec = pl.BlockSpec((None, None, size, None), lambda t, c, g: (t, g // heads, c, g % heads))
  dq, dk, db = pl.pallas_call(
      functools.partial(_dqk_kernel, block_v=block_v, precision=precision, packed=rel is not None,
                        per_token=per_token),
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct((key_tiles, batch, padded, heads), jnp.float32)],
      grid=common.chunk_grid(key_tiles, num_chunks, batch, heads),
      in_specs=[decays, decays, key_tile, key_tile, values, values, state, state,
                *documents[0]],
      out_specs=[key_tile, key_tile, db_spec], name="retention_dqk", **params)(
          *b, q, k, v, d_out, states, d_states, *documents[1])
  return dq, dk, dv, db.sum(axis=0)
