"""The split kernels' state passes: one program per (value tile, batch, head) walks the chunks in order, carrying a
float32 `[d_k, block_v]` state with one product per chunk, and writes the state entering each chunk.

Forward (keys k, weights zeta; H_0 the carried-in state), writing H_c for chunk c:

    H_(c+1) = exp(b_last) H_c + (zeta * k)^T v

Reverse, the state's gradient (keys q, weights xi, values do; dH_C the final state's cotangent), writing for chunk c
the gradient of the state leaving it, dH_(c+1), and returning dH_0, the carried-in state's:

    dH_c = exp(b_last) dH_(c+1) + (xi * q)^T do

Packed rows: the carry is dropped (not decayed) across a chunk in which a document starts, and the weights reach
only the chunk's last document (forward) or the entering one (reverse): `common.split_decays`. The forward pass also
carries the key sum z (retention's state for a ones value column) and writes each chunk's entering z.
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


def _kernel(b_ref, b_lo_ref, keys_ref, values_ref, init_ref, *refs, size, reverse, precision, with_key_sum, packed):
  """One program: the row's `[Lp]` cumulative decays (hi and lo parts), `[Lp, d_k]` keys, a `[Lp, block_v]` value
  tile, the initial `[d_k, block_v]` carry; writes `[chunks * d_k, block_v]` per-chunk states and the last carry."""
  rel_ref, refs = (refs[0], refs[1:]) if packed else (None, refs)
  if with_key_sum:
    key_sum_ref, states_ref, final_ref, key_sums_ref, final_key_sum_ref = refs
  else:
    states_ref, final_ref = refs
  num_chunks, key_dim = keys_ref.shape[0] // size, keys_ref.shape[1]
  first_tile = pl.program_id(0) == 0

  def step(i, carry):
    state_KxV, z_K = carry
    c = num_chunks - 1 - i if reverse else i
    rows, state_rows = common.chunk_rows(c, size), common.chunk_rows(c, key_dim)
    decays = common.split_decays(b_ref[rows], b_lo_ref[rows], None if rel_ref is None else rel_ref[rows],
                                 with_mask=False)
    states_ref[state_rows, :] = state_KxV.astype(states_ref.dtype)
    keys_SxK = keys_ref[rows, :]
    weights_S = decays.xi_S if reverse else decays.zeta_S
    state_KxV = common.advance(common.only(decays.keep, state_KxV), keys_SxK, values_ref[rows, :], weights_S,
                               decays.last, precision, exact_weights=not reverse)
    if not with_key_sum:
      return state_KxV, z_K

    @pl.when(first_tile)  # every value tile carries the same key sum: the first one stores it
    def _():
      key_sums_ref[state_rows] = z_K

    z_K = common.only(decays.keep, z_K)
    key_sum_K = jnp.sum(keys_SxK.astype(jnp.float32) * weights_S[:, None], axis=0)
    return state_KxV, retention.decay_and_add(z_K, retention_decay.state_decay(decays.last), key_sum_K)

  z_K = key_sum_ref[...] if with_key_sum else None
  state_KxV, z_K = lax.fori_loop(0, num_chunks, step, (init_ref[...], z_K))
  final_ref[...] = state_KxV
  if with_key_sum:
    @pl.when(first_tile)
    def _():
      final_key_sum_ref[...] = z_K


def state_pass(b, keys, values, init, key_sum=None, *, rel=None, reverse: bool = False, size: int, states_dtype,
               precision, tiling: Tiling, interpret: bool):
  """Each chunk's entering states (forward) or leaving states' gradients (`reverse`), over padded inputs.

  Args:
    b: the log decays summed within each chunk up to each row, a float32 `[batch, Lp, heads]` pair (hi, lo)
      (`split.chunk_decays`).
    keys: `[batch, Lp, heads, d_k]` (k; q in reverse). values: `[batch, Lp, heads, d_v]` (v; do in reverse).
    init: float32 `[batch, heads, d_k, d_v]`, the carried-in state (the final state's cotangent in reverse).
    key_sum: float32 `[batch, heads, d_k]` to also carry the key sum (forward only), or None.
    rel: int32 `[batch, Lp]`, each token's document index less that of the state entering its chunk, or None.
    states_dtype: the dtype the per-chunk states are written in.
  Returns:
    `(states [batch, heads, chunks * d_k, d_v]` in `states_dtype`, `last` float32 like init, `key_sums [batch, heads,
    chunks * d_k]` float32 or None, `final_key_sum` or None).
  """
  batch, padded, heads, key_dim = keys.shape
  block_v, num_chunks = tiling.block_v, padded // size
  with_key_sum = key_sum is not None
  states_spec = pl.BlockSpec((None, None, num_chunks * key_dim, block_v), lambda t, b, h: (b, h, 0, t))
  decays = common.vector_spec(padded)
  in_specs = [decays, decays, common.rows_spec(padded, key_dim), common.rows_tile_spec(padded, block_v),
              common.state_tile_spec(key_dim, block_v)]
  inputs = [*b, keys, values, init]
  out_specs = [states_spec, common.state_tile_spec(key_dim, block_v)]
  out_shape = [jax.ShapeDtypeStruct((batch, heads, num_chunks * key_dim, values.shape[-1]), states_dtype),
               jax.ShapeDtypeStruct(init.shape, jnp.float32)]
  if rel is not None:
    in_specs.append(common.documents_spec(padded))
    inputs.append(rel)
  if with_key_sum:
    key_sum_spec = pl.BlockSpec((None, None, key_dim), lambda t, b, h: (b, h, 0))
    in_specs.append(key_sum_spec)
    inputs.append(key_sum)
    out_specs += [pl.BlockSpec((None, None, num_chunks * key_dim), lambda t, b, h: (b, h, 0)), key_sum_spec]
    out_shape += [jax.ShapeDtypeStruct((batch, heads, num_chunks * key_dim), jnp.float32),
                  jax.ShapeDtypeStruct(key_sum.shape, jnp.float32)]
  kernel = functools.partial(_kernel, size=size, reverse=reverse, precision=precision, with_key_sum=with_key_sum,
                             packed=rel is not None)
  results = pl.pallas_call(
      kernel, out_shape=out_shape, grid=common.grid(values.shape[-1] // block_v, batch, heads), in_specs=in_specs,
      out_specs=out_specs, compiler_params=common.compiler_params(tiling), interpret=interpret,
      name="retention_state_gradients" if reverse else "retention_states")(*inputs)
  return tuple(results) if with_key_sum else (*results, None, None)
