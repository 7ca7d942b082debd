"""The forward kernel: one pass over the chunks per (value tile, batch, head), the state carried in float32.

Per chunk c (rows of q, k `[S, d_k]`, of v `[S, block_v]`), with R the state entering it:

    out_c = ((q k^T) * mask) v + xi * (q R)          R <- gamma^n R + (zeta * k)^T v

(the decayed keys zeta * k in three parts of their dtype for the product, as in the XLA form, so that the state of
bfloat16 inputs keeps float32's precision), and, with the key sum, the normaliser's by-products in the same pass
(the key sum is retention's state for a ones value column: q . z is the row sum of the masked scores plus xi * (q . z)):

    qz_c = rowsum((q k^T) * mask) + xi * (q . z)     z <- gamma^n z + sum_j zeta_j k_j

Packed rows (a document index per token): the mask also needs one document, xi only reaches the rows still in the
document that entered the chunk, zeta only the keys of the chunk's last document, and the entering states (R, z)
are dropped before the update when a document starts in the chunk (`common.Documents`).

Each chunk's states are never written out: the backward pass recomputes them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from retnet_jax.mixers import retention, retention_decay
from retnet_jax.mixers.kernels import common
from retnet_jax.mixers.kernels.support import Tiling


def _kernel(log_decay_ref, q_ref, k_ref, v_ref, state_ref, *refs, size, length, precision, with_key_sum, packed):
  """One program: `[Lp, d_k]` q and k, a `[Lp, block_v]` value tile and its `[d_k, block_v]` state tile (and the row's
  `[Lp]` document index when `packed`)."""
  documents_ref, refs = (refs[0], refs[1:]) if packed else (None, refs)
  if with_key_sum:
    key_sum_ref, out_ref, state_out_ref, qz_ref, key_sum_out_ref = refs
  else:
    out_ref, state_out_ref = refs
  log_decay = log_decay_ref[...]
  mask_SxS, xi_S = common.in_chunk_decays(log_decay, size)
  first_tile = pl.program_id(0) == 0

  def step(c, carry):
    state_KxV, z_K = carry
    rows = common.chunk_rows(c, size)
    docs = common.chunk_documents(documents_ref, c, size)
    chunk_xi_S = common.only(docs.entering_S, xi_S)
    q_SxK, k_SxK, v_SxV = q_ref[rows, :], k_ref[rows, :], v_ref[rows, :]
    scores_SxS = common.dot(q_SxK, k_SxK, common.NT, precision) * common.only(docs.same_SxS, mask_SxS)
    inner_SxV = common.dot(scores_SxS.astype(v_SxV.dtype), v_SxV, common.NN, precision)
    cross_SxV = common.dot(q_SxK, state_KxV.astype(q_SxK.dtype), common.NN, precision)
    out_ref[rows, :] = (inner_SxV + chunk_xi_S[:, None] * cross_SxV).astype(out_ref.dtype)
    zeta_S, chunk_log_decay = common.state_decays(log_decay, c * size, size, length)
    zeta_S = common.only(docs.last_S, zeta_S)
    state_KxV = common.advance(common.only(docs.keep, state_KxV), k_SxK, v_SxV, zeta_S, chunk_log_decay, precision,
                               exact_weights=True)
    if not with_key_sum:
      return state_KxV, z_K
    qz_S = jnp.sum(scores_SxS, axis=1) + chunk_xi_S * jnp.sum(q_SxK.astype(jnp.float32) * z_K[None, :], axis=1)

    @pl.when(first_tile)  # every value tile computes the same qz: the first one stores it
    def _():
      qz_ref[rows] = qz_S

    z_K = common.only(docs.keep, z_K)
    key_sum_K = jnp.sum(k_SxK.astype(jnp.float32) * zeta_S[:, None], axis=0)
    return state_KxV, retention.decay_and_add(z_K, retention_decay.state_decay(chunk_log_decay), key_sum_K)

  z_K = key_sum_ref[...] if with_key_sum else None
  state_KxV, z_K = lax.fori_loop(0, q_ref.shape[0] // size, step, (state_ref[...], z_K))
  state_out_ref[...] = state_KxV
  if with_key_sum:
    @pl.when(first_tile)
    def _():
      key_sum_out_ref[...] = z_K


def forward(q, k, v, log_decay, state, key_sum, *, documents=None, size: int, length: int, precision, tiling: Tiling,
            interpret: bool):
  """The kernel over padded inputs (length a multiple of `size`, d_v of `tiling.block_v`).

  Args:
    q, k: `[batch, Lp, heads, d_k]`. v: `[batch, Lp, heads, d_v]`, same dtype. log_decay: float32 `[heads]`.
    state: float32 `[batch, heads, d_k, d_v]`. key_sum: float32 `[batch, heads, d_k]`, or None for no by-products.
    length: the true length (the last chunk decays the state by its real rows only).
    documents: int32 `[batch, Lp]`, each token's document index in its row (`segments.document_index`, the padding
      in the last document), or None for unpacked rows.
  Returns:
    `(out` in v's dtype, `final_state, qz [batch, Lp, heads], final_key_sum)`, the last two float32 or None.
  """
  batch, padded, heads, key_dim = q.shape
  block_v = tiling.block_v
  with_key_sum = key_sum is not None
  in_specs = [common.head_spec(), common.rows_spec(padded, key_dim), common.rows_spec(padded, key_dim),
              common.rows_tile_spec(padded, block_v), common.state_tile_spec(key_dim, block_v)]
  out_specs = [common.rows_tile_spec(padded, block_v), common.state_tile_spec(key_dim, block_v)]
  out_shape = [jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(state.shape, jnp.float32)]
  inputs = [log_decay, q, k, v, state]
  if documents is not None:
    in_specs.append(common.documents_spec(padded))
    inputs.append(documents)
  if with_key_sum:
    key_sum_spec = pl.BlockSpec((None, None, key_dim), lambda t, b, h: (b, h, 0))
    in_specs.append(key_sum_spec)
    out_specs += [pl.BlockSpec((None, padded, None), lambda t, b, h: (b, 0, h)), key_sum_spec]
    out_shape += [jax.ShapeDtypeStruct((batch, padded, heads), jnp.float32),
                  jax.ShapeDtypeStruct(key_sum.shape, jnp.float32)]
    inputs.append(key_sum)
  kernel = functools.partial(_kernel, size=size, length=length, precision=precision, with_key_sum=with_key_sum,
                             packed=documents is not None)
  results = pl.pallas_call(
      kernel, out_shape=out_shape, grid=common.grid(v.shape[-1] // block_v, batch, heads), in_specs=in_specs,
      out_specs=out_specs, compiler_params=common.compiler_params(tiling), interpret=interpret,
      name="retention_forward")(*inputs)
  return tuple(results) if with_key_sum else (*results, None, None)
