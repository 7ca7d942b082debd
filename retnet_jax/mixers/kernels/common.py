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

from retnet_jax.mixers import retention, retention_decay
from retnet_jax.mixers.kernels.support import Tiling

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
  j < n (else 0), the decay of key j to the chunk's last real position, and n log(gamma), the state's log decay over
  it (`advance`)."""
  n = jnp.minimum(length - start, size)
  pos_S = lax.broadcasted_iota(jnp.int32, (size,), 0)
  real = pos_S < n
  zeta_S = jnp.where(real, jnp.exp(log_decay * jnp.where(real, n - 1 - pos_S, 0).astype(jnp.float32)), 0.0)
  return zeta_S, log_decay * n.astype(jnp.float32)


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
            log_decay: jax.Array, precision, *, exact_weights: bool) -> jax.Array:
  """`gamma^n state + (weights * keys)^T values`, gamma^n = exp(log_decay) the chunk's decay, exact for any decay
  (`retention.decay_and_add`): the state after a chunk (keys k, weights zeta), or in reverse the state's gradient
  before it (keys q, weights xi, values do).

  The weighted keys are rounded to their dtype for the product; with `exact_weights`, narrower than float32, they
  are split into three parts in that dtype (bfloat16: 8 bits each) whose products add up to the float32 one, as
  `retention.decayed_state` does for the XLA form's states.
  """
  weighted_SxK = keys_SxK.astype(jnp.float32) * weights_S[:, None]
  part_SxK = weighted_SxK.astype(keys_SxK.dtype)
  update_KxV = dot(part_SxK, values_SxV, TN, precision)
  for _ in range(2 if exact_weights and keys_SxK.dtype != jnp.float32 else 0):
    weighted_SxK = weighted_SxK - part_SxK.astype(jnp.float32)
    part_SxK = weighted_SxK.astype(keys_SxK.dtype)
    update_KxV = update_KxV + dot(part_SxK, values_SxV, TN, precision)
  return retention.decay_and_add(state_KxV, retention_decay.state_decay(log_decay), update_KxV)


def chunk_rows(c: jax.Array, size: int) -> pl.Slice:
  """The rows of chunk `c` in a `[length, ...]` ref."""
  return pl.ds(pl.multiple_of(c * size, size), size)


# The split kernels (`state_pass`, `output_pass`, `split_backward`): per-token decays, documents relative to the
# state entering each chunk, and block specs over a `(tiles, chunks, batch * heads)` grid.


def chunk_grid(num_tiles: int, num_chunks: int, batch: int, heads: int) -> tuple[int, int, int]:
  """The chunk-parallel grid: one program per (value or key tile, chunk, batch x head), the tile fastest."""
  return num_tiles, num_chunks, batch * heads


def chunk_rows_spec(size: int, width: int, heads: int, tiled: bool = False) -> pl.BlockSpec:
  """A `[batch, Lp, heads, width]` array's rows of the program's chunk: a `[size, width]` ref (the program's tile of
  the last axis when `tiled`)."""
  return pl.BlockSpec((None, size, None, width), lambda t, c, g: (g // heads, c, g % heads, t if tiled else 0))


def chunk_vector_spec(size: int, heads: int) -> pl.BlockSpec:
  """A `[batch, Lp, heads]` array (decays, qz) over the program's chunk: a `[size]` ref."""
  return pl.BlockSpec((None, size, None), lambda t, c, g: (g // heads, c, g % heads))


def chunk_documents_spec(size: int, heads: int) -> pl.BlockSpec:
  """The `[batch, Lp]` relative document index over the program's chunk: a `[size]` ref."""
  return pl.BlockSpec((None, size), lambda t, c, g: (g // heads, c))


def chunk_state_spec(rows: int, cols: int, heads: int, key_tiles: int = 0) -> pl.BlockSpec:
  """Per-chunk states `[batch, heads, chunks * d_k, d_v]`: the program's chunk's `[rows, cols]` tile, `rows` = d_k
  by a value tile of `cols`, or, with `key_tiles` (d_k / rows) tiles of keys, a key tile by all `cols` = d_v."""
  if key_tiles:
    return pl.BlockSpec((None, None, rows, cols), lambda t, c, g: (g // heads, g % heads, c * key_tiles + t, 0))
  return pl.BlockSpec((None, None, rows, cols), lambda t, c, g: (g // heads, g % heads, c, t))


def vector_spec(length: int) -> pl.BlockSpec:
  """A `[batch, Lp, heads]` array whole per (batch, head) on the `(tiles, batch, heads)` grid: a `[Lp]` ref."""
  return pl.BlockSpec((None, length, None), lambda t, b, h: (b, 0, h))


class SplitDecays(NamedTuple):
  """One chunk's decays from its within-chunk cumulative log decays b (b_i = sum of log gamma over rows 0..i):
  `mask_SxS` exp(b_i - b_j) for i >= j in one document (else 0); `xi_S` exp(b_i), the entering state's decay to row
  i (0 outside the entering document); `zeta_S` exp(b_last - b_j), key j's decay to the chunk's end (0 outside the
  last document); `last` b_last, the chunk's log decay; `keep` whether the entering state outlives the chunk (None:
  always)."""
  mask_SxS: jax.Array | None
  xi_S: jax.Array
  zeta_S: jax.Array
  last: jax.Array
  keep: jax.Array | None


def split_decays(b_S: jax.Array, b_lo_S: jax.Array, rel_S: jax.Array | None, with_mask: bool = True) -> SplitDecays:
  """`SplitDecays` of a chunk from b = `b_S + b_lo_S` (`split.chunk_decays`: each difference b_i - b_j formed as
  (hi_i - hi_j) + (lo_i - lo_j), exact to its own rounding however large |b|); `rel_S` is each row's document index
  less the entering document's (0: the document the entering state belongs to), or None for unpacked rows;
  `with_mask=False` leaves `mask_SxS` None (the state passes need none). Exponents are masked before `exp`: never
  positive."""
  size = b_S.shape[0]
  at_last_S = lax.broadcasted_iota(jnp.int32, (size,), 0) == size - 1  # padding rows add 0: the chunk's last row
  last, last_lo = (jnp.sum(jnp.where(at_last_S, x, 0.0)) for x in (b_S, b_lo_S))
  mask_SxS = None
  if with_mask:
    row = lax.broadcasted_iota(jnp.int32, (size, size), 0)
    col = lax.broadcasted_iota(jnp.int32, (size, size), 1)
    inside = row >= col
    if rel_S is not None:
      inside = inside & (rel_S[:, None] == rel_S[None, :])
    exponent_SxS = (b_S[:, None] - b_S[None, :]) + (b_lo_S[:, None] - b_lo_S[None, :])
    mask_SxS = jnp.where(inside, jnp.exp(jnp.where(inside, exponent_SxS, 0.0)), 0.0)
  xi_S, zeta_S = jnp.exp(b_S + b_lo_S), jnp.exp(jnp.minimum((last - b_S) + (last_lo - b_lo_S), 0.0))
  keep = None
  if rel_S is not None:
    last_document = jnp.max(rel_S)
    xi_S, zeta_S = jnp.where(rel_S == 0, xi_S, 0.0), jnp.where(rel_S == last_document, zeta_S, 0.0)
    keep = last_document == 0
  return SplitDecays(mask_SxS, xi_S, zeta_S, last + last_lo, keep)
