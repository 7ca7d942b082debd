"""The backward kernel: per (value tile, batch, head), a forward walk over the chunks for dq, then a reverse walk
for dk, dv and the incoming state's gradient, each carrying a float32 `[d_k, block_v]` state.

With dS = (do v^T) * mask and R_c the state after chunk c (R_-1 the state carried in):

    dq_c = dS k + xi * (do R_(c-1)^T)                    (forward: R recomputed exactly as in the forward pass)
    dk_c = dS^T q + zeta * (v dR_c^T)
    dv_c = ((q k^T) * mask)^T do + zeta * (k dR_c)       (reverse: dR_(c-1) = gamma^n dR_c + (xi * q)^T do)

Packed rows: the masks of the forward pass (`common.Documents`), so that dS also needs one document, and in reverse
the state's gradient stops at a document start (dR_(c-1) keeps gamma^n dR_c only when no document starts in c).

dq and dk contract over the value columns, so each value tile writes a partial sum `[tiles, batch, Lp, heads, d_k]`
(float32 when there are several tiles) that the caller adds up; dv and the state's gradient are whole per tile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from retnet_jax.mixers.kernels import common
from retnet_jax.mixers.kernels.support import Tiling


def _kernel(log_decay_ref, q_ref, k_ref, v_ref, do_ref, state_ref, d_final_ref, *refs, size, length, precision,
            packed):
  """One program: `[Lp, d_k]` q and k, `[Lp, block_v]` tiles of v and do, `[d_k, block_v]` state tiles (and the
  row's `[Lp]` document index when `packed`)."""
  documents_ref, (dq_ref, dk_ref, dv_ref, d_state_ref) = (refs[0], refs[1:]) if packed else (None, refs)
  log_decay = log_decay_ref[...]
  mask_SxS, xi_S = common.in_chunk_decays(log_decay, size)
  num_chunks = q_ref.shape[0] // size

  def load(c):
    rows = common.chunk_rows(c, size)
    return rows, q_ref[rows, :], k_ref[rows, :], v_ref[rows, :], do_ref[rows, :]

  def forward_step(c, state_KxV):
    rows, q_SxK, k_SxK, v_SxV, do_SxV = load(c)
    docs = common.chunk_documents(documents_ref, c, size)
    d_scores_SxS = common.dot(do_SxV, v_SxV, common.NT, precision) * common.only(docs.same_SxS, mask_SxS)
    dq_SxK = (common.dot(d_scores_SxS.astype(k_SxK.dtype), k_SxK, common.NN, precision)
              + common.only(docs.entering_S, xi_S)[:, None]
              * common.dot(do_SxV, state_KxV.astype(do_SxV.dtype), common.NT, precision))
    dq_ref[rows, :] = dq_SxK.astype(dq_ref.dtype)
    zeta_S, chunk_log_decay = common.state_decays(log_decay, c * size, size, length)
    return common.advance(common.only(docs.keep, state_KxV), k_SxK, v_SxV, common.only(docs.last_S, zeta_S),
                          chunk_log_decay, precision, exact_weights=True)

  def reverse_step(i, d_state_KxV):
    c = num_chunks - 1 - i
    rows, q_SxK, k_SxK, v_SxV, do_SxV = load(c)
    docs = common.chunk_documents(documents_ref, c, size)
    zeta_S, chunk_log_decay = common.state_decays(log_decay, c * size, size, length)
    zeta_S, chunk_mask_SxS = common.only(docs.last_S, zeta_S), common.only(docs.same_SxS, mask_SxS)
    d_scores_SxS = common.dot(do_SxV, v_SxV, common.NT, precision) * chunk_mask_SxS
    scores_SxS = common.dot(q_SxK, k_SxK, common.NT, precision) * chunk_mask_SxS
    dk_SxK = (common.dot(d_scores_SxS.astype(q_SxK.dtype), q_SxK, common.TN, precision)
              + zeta_S[:, None] * common.dot(v_SxV, d_state_KxV.astype(v_SxV.dtype), common.NT, precision))
    dv_SxV = (common.dot(scores_SxS.astype(do_SxV.dtype), do_SxV, common.TN, precision)
              + zeta_S[:, None] * common.dot(k_SxK, d_state_KxV.astype(k_SxK.dtype), common.NN, precision))
    dk_ref[rows, :] = dk_SxK.astype(dk_ref.dtype)
    dv_ref[rows, :] = dv_SxV.astype(dv_ref.dtype)
    return common.advance(common.only(docs.keep, d_state_KxV), q_SxK, do_SxV, common.only(docs.entering_S, xi_S),
                          chunk_log_decay, precision, exact_weights=False)

  lax.fori_loop(0, num_chunks, forward_step, state_ref[...])
  d_state_ref[...] = lax.fori_loop(0, num_chunks, reverse_step, d_final_ref[...])


def backward(q, k, v, log_decay, state, d_out, d_final_state, *, documents=None, size: int, length: int, precision,
             tiling: Tiling, interpret: bool):
  """Gradients over padded inputs (as in `forward.forward`, documents too) from the cotangents of out and the final
  state.

  Returns:
    `(dq, dk, dv, d_state)`: dq and dk in q's dtype, dv in v's, d_state float32.
  """
  batch, padded, heads, key_dim = q.shape
  block_v = tiling.block_v
  num_tiles = v.shape[-1] // block_v
  partial_dtype = q.dtype if num_tiles == 1 else jnp.float32
  partial_spec = pl.BlockSpec((None, None, padded, None, key_dim), lambda t, b, h: (t, b, 0, h, 0))
  partial_shape = jax.ShapeDtypeStruct((num_tiles,) + q.shape, partial_dtype)
  tile, state_tile = common.rows_tile_spec(padded, block_v), common.state_tile_spec(key_dim, block_v)
  kernel = functools.partial(_kernel, size=size, length=length, precision=precision, packed=documents is not None)
  in_specs = [common.head_spec(), common.rows_spec(padded, key_dim), common.rows_spec(padded, key_dim), tile, tile,
              state_tile, state_tile]
  inputs = [log_decay, q, k, v, d_out.astype(v.dtype), state, d_final_state]
  if documents is not None:
    in_specs.append(common.documents_spec(padded))
    inputs.append(documents)
  dq, dk, dv, d_state = pl.pallas_call(
      kernel,
      out_shape=[partial_shape, partial_shape, jax.ShapeDtypeStruct(v.shape, v.dtype),
                 jax.ShapeDtypeStruct(state.shape, jnp.float32)],
      grid=common.grid(num_tiles, batch, heads),
      in_specs=in_specs, out_specs=[partial_spec, partial_spec, tile, state_tile],
      compiler_params=common.compiler_params(tiling), interpret=interpret, name="retention_backward")(*inputs)
  dq, dk = (x.sum(axis=0).astype(q.dtype) for x in (dq, dk))
  return dq, dk, dv, d_state
