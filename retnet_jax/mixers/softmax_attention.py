"""Softmax attention of queries over keys, read whole (`attention`) or a block of keys at a time (`blocked_attention`:
a running softmax, with flash attention's backward pass); `read_causal` reads causal attention, over a sequence's own
keys or a KV cache, in blocks of queries, each up to its last query.

    out_BxLxHxK = read_causal(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, visible_of, mask_args)  # training's self form
    out_BxLxHxK = read_causal(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, visible_of, mask_args, offset)  # over a KV cache

`visible_of(start, size, query_start, queries, *mask_args)` says which of keys `start ... start + size - 1` each of
the queries sees (`[B, queries, size]`), so a blocked read never builds the whole `[B, L, S]` mask. The attention
mixer (`attention.py`) builds the masks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from retnet_jax.nn import matmul

_MASKED = float(jnp.finfo(jnp.float32).min)  # not -inf: a row that sees only padding stays finite
# The most keys per step of `blocked_attention`, and queries per block, which `read_causal` uses for several queries
# over more keys (in blocks of equal size): its scores are [B, H, L, at most KEY_BLOCK] however many keys there are.
KEY_BLOCK = 1024


def attention(q_BxLxHxK: jax.Array, k_BxSxGxK: jax.Array, v_BxSxGxK: jax.Array, visible_BxLxS: jax.Array
              ) -> jax.Array:
  """Softmax attention of L queries over S keys where `visible`: `[B, L, H, K]` in v's dtype (scores and softmax in
  float32); a row that sees no key (left padding) gives zeros, whatever else the keys hold. With G < H key/value heads,
  each group of H / G consecutive query heads shares one (query head j reads key/value head j // (H / G))."""
  batch, length, heads, key_dim = q_BxLxHxK.shape
  groups = k_BxSxGxK.shape[2]
  q = q_BxLxHxK.reshape(batch, length, groups, heads // groups, key_dim)
  scores = matmul.einsum("blgjk,bsgk->bgjls", q, k_BxSxGxK, jnp.float32)
  seen = visible_BxLxS[:, None, None]
  probs = jnp.where(seen, jax.nn.softmax(jnp.where(seen, scores, _MASKED), axis=-1), 0.0)
  out = matmul.einsum("bgjls,bsgk->blgjk", probs.astype(v_BxSxGxK.dtype), v_BxSxGxK)
  return out.reshape(batch, length, heads, -1)


def blocked_attention(q_BxLxHxK: jax.Array, k_BxSxGxK: jax.Array, v_BxSxGxK: jax.Array,
                      visible_of: Callable[..., jax.Array], block: int, mask_args: tuple[Any, ...] = (),
                      keys_needed: jax.Array | None = None, keys_from: jax.Array | None = None) -> jax.Array:
  """`attention` over the keys `block` at a time with a running maximum and sum (online softmax), so that its scores
  are `[B, H, L, block]` in float32 however many keys S there are; the result is `attention`'s up to rounding
  (a row that sees no key gives zeros, as there). Its backward pass (flash attention's) keeps the output and each
  row's maximum and sum, and recomputes each block's scores: no scores are kept.

  Args:
    q_BxLxHxK, k_BxSxGxK, v_BxSxGxK: as `attention`, S >= `block`.
    visible_of: `visible_of(start, size, *mask_args)` -> `[B, L, size]`, which of keys `start ... start + size - 1`
      each query sees (`start` traced). It must not close over traced arrays: its backward pass runs in another
      trace, so what it reads (steps, positions, documents) comes in `mask_args`.
    block: keys per step.
    mask_args: `visible_of`'s arrays (None entries allowed); they take no gradient.
    keys_needed: None, or a count `[]` int32 (traced) past which no query sees a key (a cache's unwritten slots, the
      keys after a causal block's last query): the blocks after it are not read, in either pass.
    keys_from: None, or the first key `[]` int32 (traced) any query may see (a window's start): the blocks that end
      before it are not read.
  Returns:
    `[B, L, H, K]` in v's dtype.
  """
  size = k_BxSxGxK.shape[1]
  if size < block:
    raise ValueError(f"blocked_attention takes at least one block of keys: {size} keys, blocks of {block}.")
  return _blocked(visible_of, block, q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, tuple(mask_args), (keys_from, keys_needed))


def _blocks(step, carry, size: int, block: int, key_range):
  """`jax.lax.scan(step, carry, block indices)`'s carry, skipping the blocks outside `key_range` (`keys_from`,
  `keys_needed`: None bounds nothing): those that end at or before the first or start at or past the second."""
  keys_from, keys_needed = key_range
  if keys_from is not None or keys_needed is not None:
    read = step
    wanted = lambda index: ((keys_needed is None or index * block < keys_needed) &
                            (keys_from is None or (index + 1) * block > keys_from))
    step = lambda carry, index: (jax.lax.cond(wanted(index), lambda c: read(c, index)[0], lambda c: c, carry), None)
  return jax.lax.scan(step, carry, jnp.arange(-(-size // block)))[0]


def _key_block(q_BxLxGxJxK, k_BxSxGxK, v_BxSxGxK, visible_of, mask_args, block: int, index):
  """Block `index`'s keys and values `[B, block, G, K]`, its start, which keys each query sees `[B, 1, 1, L, block]` and
  its float32 scores `[B, G, J, L, block]` (not visible: `_MASKED`; keys of the block before, where the last block
  overlaps it: -inf)."""
  start = jnp.minimum(index * block, k_BxSxGxK.shape[1] - block)  # the last block may overlap the one before
  k, v = (jax.lax.dynamic_slice_in_dim(x, start, block, axis=1) for x in (k_BxSxGxK, v_BxSxGxK))
  seen = visible_of(start, block, *mask_args)[:, None, None]
  scores = jnp.where(seen, matmul.einsum("blgjk,bsgk->bgjls", q_BxLxGxJxK, k, jnp.float32), _MASKED)
  return k, v, start, seen, jnp.where(start + jnp.arange(block) >= index * block, scores, -jnp.inf)


def _blocked_forward(visible_of, block: int, q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask_args, key_range):
  """(the output `[B, L, H, K]` in v's dtype, each row's score maximum and sum of exponentials `[B, G, J, L]` float32:
  kept apart, as a log-sum-exp would lose the sum of a row that sees no key beside its maximum `_MASKED`)."""
  batch, length, heads, key_dim = q_BxLxHxK.shape
  size, groups = k_BxSxGxK.shape[1], k_BxSxGxK.shape[2]
  q = q_BxLxHxK.reshape(batch, length, groups, heads // groups, key_dim)

  def step(carry, index):
    max_BxGxJxL, sum_BxGxJxL, out_BxGxJxLxK = carry
    _, v, _, seen, scores = _key_block(q, k_BxSxGxK, v_BxSxGxK, visible_of, mask_args, block, index)
    new_max = jnp.maximum(max_BxGxJxL, scores.max(axis=-1))
    probs = jnp.where(seen, jnp.exp(scores - new_max[..., None]), 0.0)
    rescale = jnp.exp(max_BxGxJxL - new_max)
    out = out_BxGxJxLxK * rescale[..., None] + matmul.einsum("bgjls,bsgk->bgjlk", probs.astype(v.dtype), v,
                                                             jnp.float32)
    return (new_max, sum_BxGxJxL * rescale + probs.sum(axis=-1), out), None

  shape = (batch, groups, heads // groups, length)
  empty = (jnp.full(shape, _MASKED), jnp.zeros(shape), jnp.zeros((*shape, v_BxSxGxK.shape[-1])))
  maxes, sums, out = _blocks(step, empty, size, block, key_range)
  out = (out / _nonzero(sums)[..., None]).transpose(0, 3, 1, 2, 4)  # a row that sees no key: 0 / 1
  return out.reshape(batch, length, heads, -1).astype(v_BxSxGxK.dtype), maxes, sums


def _nonzero(sums):
  return jnp.where(sums > 0, sums, 1.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _blocked(visible_of, block: int, q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask_args, key_range):
  return _blocked_forward(visible_of, block, q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask_args, key_range)[0]


def _blocked_fwd(visible_of, block: int, q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask_args, key_range):
  out, maxes, sums = _blocked_forward(visible_of, block, q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask_args, key_range)
  return out, (q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask_args, key_range, out, maxes, sums)


def _blocked_bwd(visible_of, block: int, residuals, dout_BxLxHxK):
  """Per key block: probabilities from the kept maximum and sum, then the gradients of v, the scores (zero where a key
  is masked: there the score is a constant), q and k; matmul operands in the inputs' dtype, sums in float32."""
  q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask_args, key_range, out_BxLxHxK, max_BxGxJxL, sum_BxGxJxL = residuals
  batch, length, heads, key_dim = q_BxLxHxK.shape
  size, groups = k_BxSxGxK.shape[1], k_BxSxGxK.shape[2]
  grouped = lambda x: x.reshape(batch, length, groups, heads // groups, x.shape[-1])
  q, dout = grouped(q_BxLxHxK), grouped(dout_BxLxHxK.astype(v_BxSxGxK.dtype))
  # The softmax's row term: sum over the head dim of dout * out, [B, G, J, L] (a float32 reduction, not a matmul).
  row_BxGxJxL = (dout.astype(jnp.float32) * grouped(out_BxLxHxK).astype(jnp.float32)).sum(-1).transpose(0, 2, 3, 1)

  def step(carry, index):
    dq_BxLxGxJxK, dk_BxSxGxK, dv_BxSxGxK = carry
    k, v, start, seen, scores = _key_block(q, k_BxSxGxK, v_BxSxGxK, visible_of, mask_args, block, index)
    probs = jnp.where(seen, jnp.exp(scores - max_BxGxJxL[..., None]) / _nonzero(sum_BxGxJxL)[..., None], 0.0)
    dv = matmul.einsum("bgjls,blgjk->bsgk", probs.astype(v.dtype), dout, jnp.float32)
    dprobs = matmul.einsum("blgjk,bsgk->bgjls", dout, v, jnp.float32)
    dscores = jnp.where(seen, probs * (dprobs - row_BxGxJxL[..., None]), 0.0).astype(q.dtype)
    dq_BxLxGxJxK = dq_BxLxGxJxK + matmul.einsum("bgjls,bsgk->blgjk", dscores, k, jnp.float32)
    dk = matmul.einsum("bgjls,blgjk->bsgk", dscores, q, jnp.float32)
    add = lambda total, part: jax.lax.dynamic_update_slice_in_dim(
        total, jax.lax.dynamic_slice_in_dim(total, start, block, axis=1) + part, start, axis=1)
    return (dq_BxLxGxJxK, add(dk_BxSxGxK, dk), add(dv_BxSxGxK, dv)), None

  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
  dq, dk, dv = _blocks(step, (zeros(q), zeros(k_BxSxGxK), zeros(v_BxSxGxK)), size, block, key_range)
  return (dq.reshape(q_BxLxHxK.shape).astype(q_BxLxHxK.dtype), dk.astype(k_BxSxGxK.dtype),
          dv.astype(v_BxSxGxK.dtype), jax.tree.map(lambda _: None, mask_args), (None, None))


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def _equal_blocks(size: int) -> int:
  """The size of the fewest equal blocks of at most `KEY_BLOCK` that cover `size` (1056: two of 528)."""
  return -(-size // -(-size // KEY_BLOCK))


def read_causal(q_BxLxHxK: jax.Array, k_BxSxGxK: jax.Array, v_BxSxGxK: jax.Array,
                visible_of: Callable[..., jax.Array], mask_args: tuple[Any, ...], offset: Any = 0,
                window: int | None = None) -> jax.Array:
  """Causal attention of L queries whose own keys are keys `offset ... offset + L - 1` of the S keys (those before are
  a cache's; those after, unwritten slots, are never read): read whole, or over more than `KEY_BLOCK` keys a block
  at a time (`blocked_attention`). More than `KEY_BLOCK` queries that own at least half the keys (a sequence's own,
  a prompt into a cache about its length, a windowed call longer than its window) run in blocks of queries, each
  reading the key blocks up to its last query's own (about half the work of every query against every key) and,
  with a `window`, from the block holding its first query's first key on (the cache's keys for the queries whose
  window reaches before their own).

  Args:
    q_BxLxHxK, k_BxSxGxK, v_BxSxGxK: as `attention`.
    visible_of: `visible_of(start, size, query_start, queries, *mask_args)` -> `[B, queries, size]`, which of keys
      `start ... start + size - 1` queries `query_start ... query_start + queries - 1` see; as `blocked_attention`'s,
      it must not close over traced arrays.
    mask_args: its arrays.
    offset: the key of the first query, an int or a traced `[]` int32: 0 for a sequence's own keys (training's self
      form), the slots written before the queries in a cache.
    window: None, or how many of the latest keys, its own included, a query sees at most.
  Returns:
    `[B, L, H, K]` in v's dtype.
  """
  length, size = q_BxLxHxK.shape[1], k_BxSxGxK.shape[1]
  if length == 1 or size <= KEY_BLOCK:
    return attention(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, visible_of(0, size, 0, length, *mask_args))
  # Queries owning less than half the keys skip too small a share for what smaller blocks cost (docs/benchmarks.md).
  block = length if length <= KEY_BLOCK or 2 * length < size else _equal_blocks(length)
  blocks, key_block = -(-length // block), _equal_blocks(size)
  of_block = functools.partial(_for_queries, visible_of, block)

  def query_block(index):  # the last block may overlap the one before: its own rows are its last ones
    start = jnp.minimum(index * block, length - block)
    q = jax.lax.dynamic_slice_in_dim(q_BxLxHxK, start, block, axis=1)
    first = None if window is None else jnp.where(start < window - 1, 0, offset + start - window + 1)
    return blocked_attention(q, k_BxSxGxK, v_BxSxGxK, of_block, key_block, (start, *mask_args), offset + start + block,
                             first)

  if blocks == 1:
    return query_block(0)
  out_NxBxQxHxK = jax.lax.map(query_block, jnp.arange(blocks))
  whole = jnp.moveaxis(out_NxBxQxHxK[:-1], 0, 1).reshape(q_BxLxHxK.shape[0], (blocks - 1) * block,
                                                         *out_NxBxQxHxK.shape[3:])
  return jnp.concatenate([whole, out_NxBxQxHxK[-1][:, blocks * block - length:]], axis=1)


def _for_queries(visible_of, queries: int, start, size: int, query_start, *mask_args) -> jax.Array:
  """`read_causal`'s mask of one block of `queries` queries, as `blocked_attention` asks for it."""
  return visible_of(start, size, query_start, queries, *mask_args)
