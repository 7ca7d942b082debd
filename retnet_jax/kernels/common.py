"""What the forward and backward kernels share: the grid and block specs, in-kernel gamma powers, the dot, and the
masks of packed documents.

Grid `(value tiles, batch, heads)`, the value tile fastest so that the programs of one head, which read the same q
and k, run side by side. Each program sees its head's whole (padded) sequence and walks it chunk by chunk.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from retnet_jax.kernels.support import Tiling

# lax.dot_general contractions of two matrices: a @ b, a @ b^T, a^T @ b.
NN = ((1,), (0,))
NT = ((1,), (1,))
TN = ((0,), (0,))


def dot(a: jax.Array, b: jax.Array, contract, precision) -> jax.Array:
  """A float32-accumulated product of two same-dtype matrices, contracting `contract` (NN, NT or TN)."""
  return lax.dot_general(a, b, (contract, ((), ())), precision=precision, preferred_element_type=jnp.float32)


def grid(num_tiles: int, batch: int, heads: int) -> tuple[int, int, int]:
  return num_tiles, batch, heads


def head_spec() -> pl.BlockSpec:
  """log_decay `[heads]`: the program's own head, a scalar ref."""
  return pl.BlockSpec((None,), lambda t, b, h: (h,))


def rows_spec(length: int, width: int) -> pl.BlockSpec:
  """A `[batch, length, heads, width]` array whole per (batch, head): a `[length, width]` ref."""
  return pl.BlockSpec((None, length, None, width), lambda t, b, h: (b, 0, h, 0))


def rows_tile_spec(length: int, block_v: int) -> pl.BlockSpec:
  """A `[batch, length, heads, d_v]` array's value tile: a `[length, block_v]` ref."""
  return pl.BlockSpec((None, length, None, block_v), lambda t, b, h: (b, 0, h, t))


def documents_spec(length: int) -> pl.BlockSpec:
  """The per-token document index `[batch, length]` of packed rows: the program's row, a `[length]` ref."""
  return pl.BlockSpec((None, length), lambda t, b, h: (b, 0))


def state_tile_spec(key_dim: int, block_v: int) -> pl.BlockSpec:
  """A `[batch, heads, d_k, d_v]` state's value tile: a `[d_k, block_v]` ref."""
  return pl.BlockSpec((None, None, key_dim, block_v), lambda t, b, h: (b, h, 0, t))


def compiler_params(tiling: Tiling) -> plgpu.CompilerParams:
  return plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages)


def in_chunk_decays(log_decay: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
  """The decay mask `[S, S]` (gamma^(i-j) for i >= j, else 0) and xi `[S]` = gamma^(j+1), the decay from the
  previous chunk's last position to query j, from the head's scalar log(gamma)."""
  row = lax.broadcasted_iota(jnp.int32, (size, size), 0)
  col = lax.broadcasted_iota(jnp.int32, (size, size), 1)
  causal = row >= col
  mask_SxS = jnp.where(causal, jnp.exp(log_decay * jnp.where(causal, row - col, 0).astype(jnp.float32)), 0.0)
  xi_S = jnp.exp(log_decay * (lax.broadcasted_iota(jnp.int32, (size,), 0) + 1).astype(jnp.float32))
  return mask_SxS, xi_S


def state_decays(log_decay: jax.Array, start: jax.Array, size: int, length: int) -> tuple[jax.Array, jax.Array]:
  """For the chunk at `start`, with n = min(length - start, size) its true length: zeta `[S]` = gamma^(n-1-j) for
  j < n (else 0), the decay of key j to the chunk's last real position, and gamma^n - 1, the state's decay over it
  less one (`advance` adds it to the state: gamma^n itself would round towards 1)."""
  n = jnp.minimum(length - start, size)
  pos_S = lax.broadcasted_iota(jnp.int32, (size,), 0)
  real = pos_S < n
  zeta_S = jnp.where(real, jnp.exp(log_decay * jnp.where(real, n - 1 - pos_S, 0).astype(jnp.float32)), 0.0)
  return zeta_S, jnp.expm1(log_decay * n.astype(jnp.float32))


class Documents(NamedTuple):
  """Chunk c of a packed row: `same_SxS`, whether two rows lie in one document; `entering_S`, the rows still in the
  document that entered the chunk (the state carried in reaches them); `last_S`, the rows of the chunk's last document
  (their keys reach the next chunk); `keep`, whether the entering state outlives the chunk (no document starts in it,
  its first row included). All None for unpacked rows: `only` then leaves everything as it is."""
  same_SxS: jax.Array | None = None
  entering_S: jax.Array | None = None
  last_S: jax.Array | None = None
  keep: jax.Array | None = None


def chunk_documents(documents_ref, c: jax.Array, size: int) -> Documents:
  """`Documents` of chunk `c` from the row's non-decreasing document index (0 on the first document, the one the
  carried-in state belongs to), or the empty `Documents()` when `documents_ref` is None."""
  if documents_ref is None:
    return Documents()
  doc_S = documents_ref[chunk_rows(c, size)]
  entering = jnp.where(c > 0, jnp.max(documents_ref[chunk_rows(jnp.maximum(c - 1, 0), size)]), 0)
  last = jnp.max(doc_S)
  return Documents(doc_S[:, None] == doc_S[None, :], doc_S == entering, doc_S == last, last == entering)


def only(flags: jax.Array | None, x: jax.Array) -> jax.Array:
  """`x` where `flags` hold (broadcast), else 0; `x` itself when `flags` is None (no documents)."""
  return x if flags is None else jnp.where(flags, x, 0.0)


def advance(state_KxV: jax.Array, keys_SxK: jax.Array, values_SxV: jax.Array, weights_S: jax.Array,
            expm1_decay: jax.Array, precision, *, exact_weights: bool) -> jax.Array:
  """`state + ((gamma^n - 1) state + (weights * keys)^T values)`: the state after a chunk (keys k, weights zeta), or
  in reverse the state's gradient before it (keys q, weights xi, values do).

  The weighted keys are rounded to their dtype for the product; with `exact_weights`, narrower than float32, they
  are split into three parts in that dtype (bfloat16: 8 bits each) whose products add up to the float32 one, as
  `retention._decayed_state` does for the XLA form's states.
  """
  weighted_SxK = keys_SxK.astype(jnp.float32) * weights_S[:, None]
  part_SxK = weighted_SxK.astype(keys_SxK.dtype)
  update_KxV = dot(part_SxK, values_SxV, TN, precision)
  for _ in range(2 if exact_weights and keys_SxK.dtype != jnp.float32 else 0):
    weighted_SxK = weighted_SxK - part_SxK.astype(jnp.float32)
    part_SxK = weighted_SxK.astype(keys_SxK.dtype)
    update_KxV = update_KxV + dot(part_SxK, values_SxV, TN, precision)
  return state_KxV + (expm1_decay * state_KxV + update_KxV)


def chunk_rows(c: jax.Array, size: int) -> pl.Slice:
  """The rows of chunk `c` in a `[length, ...]` ref."""
  return pl.ds(pl.multiple_of(c * size, size), size)
