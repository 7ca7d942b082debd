"""Checksums of arrays: what a checkpoint's arrays were when saved, checked as they are read back."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


class DamagedCheckpointError(ValueError):
  """The checkpoint's arrays read back differ from what was saved (their checksums disagree)."""


_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}
CHECKSUM_BLOCK = 1 << 20  # elements weighed at a time: XLA materialises the products of one block, not the array's


@jax.jit
def checksum(x: jax.Array) -> jax.Array:
  """A uint32 sum of the array's bit patterns times odd position weights: any one changed element changes it.

  Summed block by block (uint32 sums wrap, so the order does not change the result).
  """
  flat, block = x.reshape(-1), CHECKSUM_BLOCK

  def weighed(start: jax.Array, values: jax.Array) -> jax.Array:
    bits = jax.lax.bitcast_convert_type(values, _UNSIGNED[x.dtype.itemsize]).astype(jnp.uint32)
    positions = start + jnp.arange(values.size, dtype=jnp.uint32)
    return jnp.sum(bits * ((2 * positions + 1) * jnp.uint32(2654435761)), dtype=jnp.uint32)  # odd: no cancelling

  def add_block(i: jax.Array, total: jax.Array) -> jax.Array:
    return total + weighed(i.astype(jnp.uint32) * block, jax.lax.dynamic_slice(flat, (i * block,), (block,)))

  whole = flat.size // block
  total = jax.lax.fori_loop(0, whole, add_block, jnp.uint32(0)) if whole else jnp.uint32(0)
  return total + weighed(jnp.uint32(whole * block), flat[whole * block:])


def checksums(tree: Any) -> dict[str, int]:
  """`checksum` of each array of a pytree by key path, as JSON-able ints (a collective on multi-process runs).

  One array at a time, so the memory it needs beyond the tree is one array's temporaries, not the whole tree's.
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {jax.tree_util.keystr(path): int(checksum(value)) for path, value in flat}


def verify(saved: dict[str, int] | None, restored: Any, what: str) -> None:
  """Raises DamagedCheckpointError if an array of `restored` differs from its checksum in `saved` (None: none were
  saved); `restored` may be part of what was saved (checksums are keyed by key path)."""
  if saved is None:
    return
  found = checksums(restored)
  damaged = [key for key, value in found.items() if saved.get(key) != value]
  if damaged:
    raise DamagedCheckpointError(f"{what} is damaged: {len(damaged)} array(s) read back differ from what was "
                                 f"saved, first {damaged[0]}.")
