"""Packed documents: `segment_ids [batch, seq]` says which document each token belongs to.

A document is a maximal run of equal ids in a row ([7, 7, 3, 3, 7] holds three), so only changes between neighbours
matter and any integer ids do. Token n retains (or attends to) token m only if m <= n and both lie in one document.
A carried-in state belongs to each row's first document; the state returned is each row's last document's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_segment_ids(segment_ids, batch: int, length: int, name: str = "segment_ids") -> None:
  """ValueError naming the array and the fix unless `segment_ids` is an integer array `[batch, length]` (or None)."""
  if segment_ids is None:
    return
  if not hasattr(segment_ids, "ndim"):
    raise ValueError(f"{name} must be an integer array [batch, seq] = [{batch}, {length}] or None; got a "
                     f"{type(segment_ids).__name__} (convert it: jnp.asarray(ids, jnp.int32)).")
  if tuple(segment_ids.shape) != (batch, length) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array [batch, seq] = [{batch}, {length}], one document id per "
                     f"token; got shape {tuple(segment_ids.shape)} dtype {segment_ids.dtype}.")


def starts(segment_ids_BxL: jax.Array) -> jax.Array:
  """`[B, L]` bool: True where a document other than the row's first begins (the id differs from the one before)."""
  changed = segment_ids_BxL[:, 1:] != segment_ids_BxL[:, :-1]
  return jnp.concatenate([jnp.zeros((segment_ids_BxL.shape[0], 1), bool), changed], axis=1)


def document_index(segment_ids_BxL: jax.Array) -> jax.Array:
  """`[B, L]` int32: 0 on the row's first document, counting up by one at each document start."""
  return jnp.cumsum(starts(segment_ids_BxL), axis=1, dtype=jnp.int32)


def positions_in_document(segment_ids_BxL: jax.Array) -> jax.Array:
  """`[B, L]` int32: each token's offset from the first token of its document within the row."""
  length = segment_ids_BxL.shape[1]
  pos_BxL = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), segment_ids_BxL.shape)
  start_BxL = jax.lax.cummax(jnp.where(starts(segment_ids_BxL), pos_BxL, 0), axis=1)
  return pos_BxL - start_BxL


def in_first_document(segment_ids_BxL: jax.Array) -> jax.Array:
  """`[B, L]` bool: True on the tokens of the row's first document, the ones a carried-in state reaches."""
  return document_index(segment_ids_BxL) == 0


def model_positions(segment_ids_BxL: jax.Array | None, position_B: jax.Array, length: int) -> jax.Array:
  """`[B, L]` int32 positions of a model call of `length` tokens: the row's first document (the whole row where
  `segment_ids` is None) continues from the carried `position [B]`, every later one counts from 0 at its start (so
  rotation and normalisers restart with it). The state's next position is the last column's + 1."""
  continued_BxL = position_B[:, None] + jnp.arange(length, dtype=jnp.int32)
  if segment_ids_BxL is None:
    return continued_BxL
  return jnp.where(in_first_document(segment_ids_BxL), continued_BxL, positions_in_document(segment_ids_BxL))


def empty_rows(state, empty_B: jax.Array):
  """A model's `state` zeroed in the rows where `empty_B` (arrays `[batch, ...]`; scalars, such as a KV cache's next
  slot, kept): position 0 and no retention state there (a Transformer's cached slots then read as left padding),
  for a row whose next call opens a new document at its first token."""
  def empty(x):
    return x if x.ndim == 0 else jnp.where(empty_B.reshape((-1,) + (1,) * (x.ndim - 1)), jnp.zeros_like(x), x)
  return jax.tree.map(empty, state)
