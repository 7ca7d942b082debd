"""Causal softmax attention, the Transformer's token mixer and a hybrid's attention layers (`base.Mixer`).

Rotary positions (`retnet_jax.nn.rotation`), grouped key/value heads, a sliding window over a ring-buffer cache. Its
decoding state is a KV cache per layer (`key`, `value` `[B, S, G, K]` in the compute dtype and `next_slot`, the tokens
fed so far); as in retention, a state whose position starts at -p treats its first p tokens as left padding. With
`segment_ids` every form attends within each document only (a key before a query's document start has a negative
position). It computes the parallel and recurrent forms; in a hybrid's chunkwise call it attends all tokens at once,
as in the parallel form. A call of several tokens over more than `KEY_BLOCK` keys (a long training sequence, a
prefill's blocks over a long cache) reads them a block at a time (`blocked_attention`), so that its memory is the keys
and one block's scores, and its backward pass keeps no scores. A Transformer's layers (`configs/transformer.py`) take
their fields plainly (`num_heads`, `max_len`, `rotation_base`); a hybrid RetNet's (`model.attention_layers`) take the
`attention_` fields.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from retnet_jax.core import config_checks, sections, segments, sharding
from retnet_jax.mixers import base
from retnet_jax.nn import layer_stack, layers, matmul, rotation

_MASKED = float(jnp.finfo(jnp.float32).min)  # not -inf: a row that sees only padding stays finite
# The most keys per step of `blocked_attention`, which a multi-token call over a cache of more slots uses (in blocks
# of equal size): its scores are [B, H, L, at most KEY_BLOCK] whatever the cache's length.
KEY_BLOCK = 1024


def attention(q_BxLxHxK: jax.Array, k_BxSxGxK: jax.Array, v_BxSxGxK: jax.Array, visible_BxLxS: jax.Array
              ) -> jax.Array:
  """Softmax attention of L queries over S keys where `visible`: `[B, L, H, K]` in v's dtype (scores and softmax in
  float32). With G < H key/value heads, each group of H / G consecutive query heads shares one (query head j reads
  key/value head j // (H / G))."""
  batch, length, heads, key_dim = q_BxLxHxK.shape
  groups = k_BxSxGxK.shape[2]
  q = q_BxLxHxK.reshape(batch, length, groups, heads // groups, key_dim)
  scores = matmul.einsum("blgjk,bsgk->bgjls", q, k_BxSxGxK, jnp.float32)
  probs = jax.nn.softmax(jnp.where(visible_BxLxS[:, None, None], scores, _MASKED), axis=-1)
  out = matmul.einsum("bgjls,bsgk->blgjk", probs.astype(v_BxSxGxK.dtype), v_BxSxGxK)
  return out.reshape(batch, length, heads, -1)


def blocked_attention(q_BxLxHxK: jax.Array, k_BxSxGxK: jax.Array, v_BxSxGxK: jax.Array,
                      visible_of: Callable[..., jax.Array], block: int, mask_args: tuple[Any, ...] = ()
                      ) -> jax.Array:
  """`attention` over the keys `block` at a time with a running maximum and sum (online softmax), so that its scores
  are `[B, H, L, block]` in float32 however many keys S there are; the result is `attention`'s up to rounding
  (a row that sees no key is, as there, the mean of every value). Its backward pass (flash attention's) keeps the
  output and each row's maximum and sum, and recomputes each block's scores: no scores are kept.

  Args:
    q_BxLxHxK, k_BxSxGxK, v_BxSxGxK: as `attention`, S >= `block`.
    visible_of: `visible_of(start, size, *mask_args)` -> `[B, L, size]`, which of keys `start ... start + size - 1`
      each query sees (`start` traced). It must not close over traced arrays: its backward pass runs in another
      trace, so what it reads (steps, positions, documents) comes in `mask_args`.
    block: keys per step.
    mask_args: `visible_of`'s arrays (None entries allowed); they take no gradient.
  Returns:
    `[B, L, H, K]` in v's dtype.
  """
  size = k_BxSxGxK.shape[1]
  if size < block:
    raise ValueError(f"blocked_attention takes at least one block of keys: {size} keys, blocks of {block}.")
  return _blocked(visible_of, block, q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, tuple(mask_args))


def _key_block(q_BxLxGxJxK, k_BxSxGxK, v_BxSxGxK, visible_of, mask_args, block: int, index):
  """Block `index`'s keys and values `[B, block, G, K]`, its start and its masked float32 scores `[B, G, J, L, block]`
  (not visible: `_MASKED`; keys of the block before, where the last block overlaps it: -inf)."""
  start = jnp.minimum(index * block, k_BxSxGxK.shape[1] - block)  # the last block may overlap the one before
  k, v = (jax.lax.dynamic_slice_in_dim(x, start, block, axis=1) for x in (k_BxSxGxK, v_BxSxGxK))
  visible_BxLxS = visible_of(start, block, *mask_args)
  scores = jnp.where(visible_BxLxS[:, None, None], matmul.einsum("blgjk,bsgk->bgjls", q_BxLxGxJxK, k, jnp.float32),
                     _MASKED)
  return k, v, start, visible_BxLxS, jnp.where(start + jnp.arange(block) >= index * block, scores, -jnp.inf)


def _blocked_forward(visible_of, block: int, q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask_args):
  """(the output `[B, L, H, K]` in v's dtype, each row's score maximum and sum of exponentials `[B, G, J, L]` float32:
  kept apart, as a log-sum-exp would lose the sum of a row that sees no key beside its maximum `_MASKED`)."""
  batch, length, heads, key_dim = q_BxLxHxK.shape
  size, groups = k_BxSxGxK.shape[1], k_BxSxGxK.shape[2]
  q = q_BxLxHxK.reshape(batch, length, groups, heads // groups, key_dim)

  def step(carry, index):
    max_BxGxJxL, sum_BxGxJxL, out_BxGxJxLxK = carry
    _, v, _, _, scores = _key_block(q, k_BxSxGxK, v_BxSxGxK, visible_of, mask_args, block, index)
    new_max = jnp.maximum(max_BxGxJxL, scores.max(axis=-1))
    probs = jnp.exp(scores - new_max[..., None])
    rescale = jnp.exp(max_BxGxJxL - new_max)
    out = out_BxGxJxLxK * rescale[..., None] + matmul.einsum("bgjls,bsgk->bgjlk", probs.astype(v.dtype), v,
                                                             jnp.float32)
    return (new_max, sum_BxGxJxL * rescale + probs.sum(axis=-1), out), None

  shape = (batch, groups, heads // groups, length)
  empty = (jnp.full(shape, _MASKED), jnp.zeros(shape), jnp.zeros((*shape, v_BxSxGxK.shape[-1])))
  (maxes, sums, out), _ = jax.lax.scan(step, empty, jnp.arange(-(-size // block)))
  out = (out / sums[..., None]).transpose(0, 3, 1, 2, 4)
  return out.reshape(batch, length, heads, -1).astype(v_BxSxGxK.dtype), maxes, sums


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _blocked(visible_of, block: int, q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask_args):
  return _blocked_forward(visible_of, block, q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask_args)[0]


def _blocked_fwd(visible_of, block: int, q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask_args):
  out, maxes, sums = _blocked_forward(visible_of, block, q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask_args)
  return out, (q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask_args, out, maxes, sums)


def _blocked_bwd(visible_of, block: int, residuals, dout_BxLxHxK):
  """Per key block: probabilities from the kept maximum and sum, then the gradients of v, the scores (zero where a key
  is masked: there the score is a constant), q and k; matmul operands in the inputs' dtype, sums in float32."""
  q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask_args, out_BxLxHxK, max_BxGxJxL, sum_BxGxJxL = residuals
  batch, length, heads, key_dim = q_BxLxHxK.shape
  size, groups = k_BxSxGxK.shape[1], k_BxSxGxK.shape[2]
  grouped = lambda x: x.reshape(batch, length, groups, heads // groups, x.shape[-1])
  q, dout = grouped(q_BxLxHxK), grouped(dout_BxLxHxK.astype(v_BxSxGxK.dtype))
  # The softmax's row term: sum over the head dim of dout * out, [B, G, J, L] (a float32 reduction, not a matmul).
  row_BxGxJxL = (dout.astype(jnp.float32) * grouped(out_BxLxHxK).astype(jnp.float32)).sum(-1).transpose(0, 2, 3, 1)

  def step(carry, index):
    dq_BxLxGxJxK, dk_BxSxGxK, dv_BxSxGxK = carry
    k, v, start, visible_BxLxS, scores = _key_block(q, k_BxSxGxK, v_BxSxGxK, visible_of, mask_args, block, index)
    probs = jnp.exp(scores - max_BxGxJxL[..., None]) / sum_BxGxJxL[..., None]
    dv = matmul.einsum("bgjls,blgjk->bsgk", probs.astype(v.dtype), dout, jnp.float32)
    dprobs = matmul.einsum("blgjk,bsgk->bgjls", dout, v, jnp.float32)
    dscores = jnp.where(visible_BxLxS[:, None, None], probs * (dprobs - row_BxGxJxL[..., None]), 0.0).astype(q.dtype)
    dq_BxLxGxJxK = dq_BxLxGxJxK + matmul.einsum("bgjls,bsgk->blgjk", dscores, k, jnp.float32)
    dk = matmul.einsum("bgjls,blgjk->bsgk", dscores, q, jnp.float32)
    add = lambda total, part: jax.lax.dynamic_update_slice_in_dim(
        total, jax.lax.dynamic_slice_in_dim(total, start, block, axis=1) + part, start, axis=1)
    return (dq_BxLxGxJxK, add(dk_BxSxGxK, dk), add(dv_BxSxGxK, dv)), None

  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
  (dq, dk, dv), _ = jax.lax.scan(step, (zeros(q), zeros(k_BxSxGxK), zeros(v_BxSxGxK)), jnp.arange(-(-size // block)))
  return (dq.reshape(q_BxLxHxK.shape).astype(q_BxLxHxK.dtype), dk.astype(k_BxSxGxK.dtype),
          dv.astype(v_BxSxGxK.dtype), jax.tree.map(lambda _: None, mask_args))


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def _visible(query_step_L, key_step_S, key_position_BxS, window: int | None, query_document_BxL=None,
             key_document_BxS=None) -> jax.Array:
  """`[B, L, S]`: which keys each query sees. Steps count the tokens fed to a cache (negative: a slot never
  written); a query sees written keys at or before its step (within the last `window` steps if set), not left
  padding (negative positions), and with documents only its own document's."""
  step_LxS = query_step_L[:, None] - key_step_S[None, :]
  visible_LxS = (step_LxS >= 0) & (key_step_S >= 0)[None, :]
  if window is not None:
    visible_LxS = visible_LxS & (step_LxS < window)
  visible_BxLxS = visible_LxS[None] & (key_position_BxS >= 0)[:, None, :]
  if query_document_BxL is not None:
    visible_BxLxS = visible_BxLxS & (query_document_BxL[:, :, None] == key_document_BxS[:, None, :])
  return visible_BxLxS


def _slot_steps(last_step, size: int, slots) -> jax.Array:
  """The step each of cache `slots` (indices in [0, size)) holds once steps up to `last_step` were written (step t
  goes to slot t mod S, so a cache of S slots is a ring buffer of the last S tokens); negative: not written yet."""
  return last_step - (last_step - slots) % size


class KVCache(NamedTuple):
  """One attention layer's decoding state: `key`, `value` `[B, S, G, K]` in the compute dtype, of S slots (a
  window's ring buffer, or `max_len`), and `next_slot []` int32, the tokens fed so far."""
  key: jax.Array
  value: jax.Array
  next_slot: jax.Array


def write_cache(cache: KVCache, k, v, step, ring: bool) -> KVCache:
  """The cache with `k, v [B, L, G, K]` written for steps `step ... step + L - 1`, each at its step mod S (a `ring`
  buffer: of more than S tokens, the last S), or from slot `step` on (`next_slot` kept)."""
  length, size = k.shape[1], cache.key.shape[1]
  if not ring or length == 1 or (isinstance(step, int) and step + length <= size):
    write = lambda old, x: jax.lax.dynamic_update_slice_in_dim(old, x.astype(old.dtype), step % size, axis=1)
  else:
    kept = min(length, size)
    slots = (step + length - kept + jnp.arange(kept)) % size
    write = lambda old, x: old.at[:, slots].set(x[:, length - kept:].astype(old.dtype))
  return cache._replace(key=write(cache.key, k), value=write(cache.value, v))


def _cached_attention(q, k, v, cache, step, position_B, window: int | None, document_BxL=None):
  """Writes k, v at `step` on into the cache and attends over it and them: (out `[B, L, H, K]`, cache).

  The token fed at step t sits at position `position_B - step + t` (position_B: the first query's). A cache of
  `window` slots (a ring buffer) cannot hold the keys of a multi-token call's first queries once it has written
  their successors, so those attend over the old cache and the new keys side by side; otherwise the keys are
  written first and the queries attend over the whole cache. With the queries' document index `document [B, L]`
  (0: the first document), a query sees its own document's keys, the cached ones belonging to 0.
  """
  length, size = q.shape[1], cache.key.shape[1]
  new_cache = write_cache(cache, k, v, step, window is not None)
  beside = window is not None and length > 1
  if beside:  # attend over [old cache, new keys]
    keys, values = (jnp.concatenate([old, x.astype(old.dtype)], axis=1)
                    for old, x in ((cache.key, k), (cache.value, v)))
  else:
    keys, values = new_cache.key, new_cache.value
  visible_of = functools.partial(_cache_keys_visible, length=length, size=size, window=window, beside=beside)
  return read_keys(q, keys, values, visible_of, (step, position_B, document_BxL)), new_cache


def _cache_keys_visible(start, num_keys: int, step, position_B, document_BxL, *, length: int, size: int,
                        window: int | None, beside: bool) -> jax.Array:
  """`[B, L, num_keys]`: which of keys `start ... start + num_keys - 1` the `length` queries fed from `step` on see
  (`_cached_attention`'s): the slots of a cache of `size` written up to the last query, or (`beside`) the old
  cache's slots, then the new keys (key i < size is slot i, then key size + t). Their steps give their positions
  and documents."""
  i = start + jnp.arange(num_keys)
  key_step_S = (jnp.where(i < size, _slot_steps(step - 1, size, i), step + i - size) if beside
                else _slot_steps(step + length - 1, size, i))
  offset_S = key_step_S - step
  key_document_BxS = None
  if document_BxL is not None:
    key_document_BxS = jnp.where(offset_S >= 0, jnp.take(document_BxL, jnp.clip(offset_S, 0, length - 1), axis=1), 0)
  return _visible(step + jnp.arange(length), key_step_S, position_B[:, None] + offset_S[None, :], window,
                  document_BxL, key_document_BxS)


def _own_keys_visible(start, num_keys: int, positions_BxL, document_BxL, *, window: int | None) -> jax.Array:
  """`[B, L, num_keys]`: which of keys `start ... start + num_keys - 1` of the call's own L tokens each sees (the
  self form, without a cache)."""
  keys_of = lambda x: None if x is None else jax.lax.dynamic_slice_in_dim(x, start, num_keys, axis=1)
  return _visible(jnp.arange(positions_BxL.shape[1]), start + jnp.arange(num_keys), keys_of(positions_BxL), window,
                  document_BxL, keys_of(document_BxL))


def read_keys(q_BxLxHxK: jax.Array, k_BxSxGxK: jax.Array, v_BxSxGxK: jax.Array, visible_of: Callable[..., jax.Array],
              mask_args: tuple[Any, ...]) -> jax.Array:
  """`attention` of the queries over all S keys, which `visible_of(start, size, *mask_args)` masks as in
  `blocked_attention`: read whole, or for several queries over more than `KEY_BLOCK` keys (a long training sequence,
  a prefill's block over a long cache) a block at a time, in blocks of equal size (1056 keys: two of 528, not 1024
  and an overlapping 1024)."""
  size = k_BxSxGxK.shape[1]
  if q_BxLxHxK.shape[1] > 1 and size > KEY_BLOCK:
    blocks = -(-size // KEY_BLOCK)
    return blocked_attention(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, visible_of, -(-size // blocks), mask_args)
  return attention(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, visible_of(0, size, *mask_args))


class CausalSelfAttention(nnx.Module):
  """Multi-head causal attention: fused q/k/v projection, rotary positions, output projection; optionally grouped
  key/value heads and a sliding window of the last `window` tokens.

  Its state is a `KVCache` (`key`, `value` `[B, S, G, K]`, and `next_slot`, the tokens fed so far). Without a state it
  attends among the given tokens (or, recurrent, one at a time) over a cache it starts; with one it writes them into
  the cache and attends over it. A windowed layer's cache needs only `window` slots (a ring buffer), so its decoding
  memory stays constant in the context.
  """

  def __init__(self, cfg: base.ModelConfig, settings: "Settings", *, dtype, rngs: nnx.Rngs):
    self.num_heads, self.num_kv_heads = settings.num_heads, settings.num_kv_heads
    self.head_dim = cfg.d_model // settings.num_heads
    self.window = settings.window
    self.rotation_pairs = settings.rotation_pairs
    self.cache_len = settings.max_len
    self.dtype = dtype
    init = layers.xavier_uniform(1.0)
    width = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
    self.qkv_proj = layers.Dense(cfg.d_model, width, ("embed", "heads"), init=init, dtype=dtype, rngs=rngs)
    self.out_proj = layers.Dense(cfg.d_model, cfg.d_model, ("heads", "embed"), init=init, dtype=dtype, rngs=rngs)

  def __call__(self, x_BxLxD: jax.Array, context: "Context", state: KVCache | None) -> tuple[jax.Array, KVCache]:
    """`x [B, L, D]` in the call `context` with the layer's state (None: a cache started for this call, of
    max(L, max_len) slots unless windowed) -> (y, new state)."""
    positions_BxL, tables, mode, document_BxL = context
    batch, length, d = x_BxLxD.shape
    if state is None:
      size = self.window or max(length, self.cache_len)
      cache = empty_cache(batch, size, self.num_kv_heads, self.head_dim, self.dtype)
      form = "recurrent" if mode == "recurrent" else "self"
    else:
      cache = state
      form = "recurrent" if mode == "recurrent" else "cache"
    slot = cache.next_slot
    groups, group_size = self.num_kv_heads, self.num_heads // self.num_kv_heads
    # Columns grouped per key/value head (its query heads, then its key and its value): a split of the `heads`
    # axis over devices (tensor parallelism) gives each device whole groups. One group per head: q, k, v per head.
    qkv = checkpoint_name(self.qkv_proj(x_BxLxD), layer_stack.QKV).reshape(batch, length, groups, group_size + 2,
                                                                            self.head_dim)
    rotate = lambda x: rotation.rotate(x, tables, self.rotation_pairs)
    q = rotate(qkv[:, :, :, :group_size].reshape(batch, length, self.num_heads, self.head_dim))
    q = q * jnp.asarray(self.head_dim**-0.5, self.dtype)
    k, v = rotate(qkv[:, :, :, group_size]), qkv[:, :, :, group_size + 1]
    if form == "self":
      visible_of = functools.partial(_own_keys_visible, window=self.window)
      out = read_keys(q, k, v, visible_of, (positions_BxL, document_BxL))
      cache = write_cache(cache, k, v, 0, self.window is not None)
    elif form == "cache":
      out, cache = _cached_attention(q, k, v, cache, slot, positions_BxL[:, 0], self.window, document_BxL)
    else:
      def step(cache, inputs):  # a key before the query's document start has a negative position: unseen
        q_t, k_t, v_t, position_B, t = inputs
        out_t, cache = _cached_attention(q_t[:, None], k_t[:, None], v_t[:, None], cache, slot + t, position_B,
                                         self.window)
        return cache, out_t[:, 0]

      # One token (decoding) is inlined rather than looped, so the cache updates in place in an outer loop.
      time_major = tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v, positions_BxL)) + (jnp.arange(length),)
      cache, out_LxBxHxK = jax.lax.scan(step, cache, time_major, unroll=length == 1)
      out = jnp.swapaxes(out_LxBxHxK, 0, 1)
    out = checkpoint_name(out.reshape(batch, length, d), layer_stack.MIXER_OUT)
    return self.out_proj(out.astype(self.dtype)), cache._replace(next_slot=slot + length)


def empty_cache(batch_size: int, size: int, num_kv_heads: int, head_dim: int, dtype) -> KVCache:
  """One layer's empty KV cache of `size` slots: `key`, `value` `[B, size, num_kv_heads, head_dim]` in `dtype`,
  `next_slot` 0."""
  shape = (batch_size, size, num_kv_heads, head_dim)
  return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((), jnp.int32))


def check_room(next_slot: Any, size: int, length: int, field: str) -> None:
  """For a concrete `next_slot` (outside jit): a cache of `size` slots must hold `length` more tokens, or
  ValueError naming `field` (its size) and the fix. A traced one is not checked: inside jit, tokens past the cache's
  end would overwrite its first slots."""
  try:
    used = int(np.asarray(next_slot))
  except jax.errors.TracerArrayConversionError:
    return
  if used + length > size:
    raise ValueError(f"the KV cache holds {size} tokens; {used} are used and {length} more do not fit. Raise "
                     f"{field} to at least {used + length} (--config.{field}={used + length}), or use fewer tokens.")




class Settings(NamedTuple):
  """An attention layer's settings as a model section gives them."""
  num_heads: int
  num_kv_heads: int
  window: int | None  # attend to the last `window` tokens; None: every earlier token
  rotation_pairs: str
  rotation_base: float
  max_len: int  # the KV cache's slots (unwindowed): the longest context a decoding state holds


class Context(NamedTuple):
  """What every attention layer of one call shares: positions `[B, L]`, rotation tables, form, documents `[B, L]`
  (`segments.document_index`, or None)."""
  positions_BxL: jax.Array
  tables: tuple[jax.Array, jax.Array]
  mode: str
  document_BxL: jax.Array | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class HybridAttentionConfig(sections.Section):
  """`model.attention_*`: a hybrid RetNet's attention layers (the model section holds them flat, prefixed), checked
  against the model's sizes by `HYBRID.check_config` and the registry."""
  FLAT_PREFIX = "attention_"
  layers: tuple[int, ...] = sections.field("hybrids: these layers (indices) use softmax attention in place of "
                                           "retention")
  num_heads: int | None = sections.field("the attention layers' query heads; None: num_heads")
  num_kv_heads: int | None = sections.field("the attention layers' key/value heads; None: one per query head")
  window: int | None = sections.field("attend to the last W tokens only, through a ring-buffer KV cache of W tokens "
                                      "(decoding memory constant in the context); None: every earlier token")
  rotation_base: float = sections.field("the attention layers' rotary base (fla: rope_theta)")
  max_len: int = sections.field("KV-cache length of unwindowed attention layers: the longest prompt + generation a "
                                "decoding state holds")

  def __post_init__(self):
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in self.layers):
      raise ValueError(f"model.attention_layers must be a tuple of layer indices, e.g. (1,) or (3, 7); got "
                       f"{self.layers!r}.")


class Attention(base.Mixer):
  """Causal attention as the registry holds it, reading its settings from the model section's own fields (the
  Transformer's) or from its `attention` section (a hybrid's, `HybridAttentionConfig`: the fields the user's config
  names `prefix + field`, as messages do). Fields a model section lacks take their defaults: one key/value head per
  query head, no window, interleaved rotation pairs."""

  name = "attention"
  modes = ("parallel", "recurrent")
  splits_sequences = False
  fixed_state = False

  def __init__(self, prefix: str, what: str):
    self.prefix, self.what = prefix, what  # `what`: the layers, as messages name them

  def field(self, name: str) -> str:
    return self.prefix + name

  def settings(self, cfg: base.ModelConfig) -> Settings:
    """Its settings in model section `cfg`: heads (None: `num_heads`), key/value heads (None: one per query head),
    window, rotation pairs and base, cache length."""
    fields = cfg.attention if self.prefix else cfg
    own = lambda name: getattr(fields, name, None)  # noqa: E731
    heads = own("num_heads") or cfg.num_heads
    return Settings(heads, own("num_kv_heads") or heads, own("window"), getattr(cfg, "rotation_pairs", "interleaved"),
                    own("rotation_base"), own("max_len"))

  def check_config(self, cfg: base.ModelConfig) -> None:
    heads, kv_heads, window, pairs, base_, max_len = self.settings(cfg)
    heads_field = self.field("num_heads")
    fallback = " (or None: model.num_heads)" if self.prefix else ""
    if not isinstance(heads, int) or heads < 1 or cfg.d_model % heads:
      raise ValueError(f"model.{heads_field}={heads} must be a positive divisor of model.d_model={cfg.d_model}"
                       f"{fallback}.")
    if kv_heads < 1 or heads % kv_heads:
      raise ValueError(f"model.{self.field('num_kv_heads')}={kv_heads} must be a positive divisor of the attention "
                       f"layers' {heads} query heads (or None: one key/value head per query head).")
    rotation.check_rotary_dim(cfg.d_model // heads)
    rotation.check_rotation(pairs, cfg.rotation_freqs)
    if window is not None and window < 1:
      raise ValueError(f"model.{self.field('window')}={window} must be a positive number of tokens (or None: "
                       "attend to every earlier token).")
    config_checks.finite_number(base_, f"model.{self.field('rotation_base')}", positive=True)
    config_checks.positive_int(max_len, f"model.{self.field('max_len')}")

  def layer(self, cfg: base.ModelConfig, *, dtype, rngs: nnx.Rngs) -> CausalSelfAttention:
    return CausalSelfAttention(cfg, self.settings(cfg), dtype=dtype, rngs=rngs)

  def context(self, cfg: base.ModelConfig, call: base.Call) -> Context:
    if (split := sharding.sequence_split()) is not None:
      self.check_sequence_split(cfg, f"the active mesh splits sequences over its {split[0]!r} axis ({split[1]} "
                                     "devices)", split[1], 0, (call.mode,))
    settings = self.settings(cfg)
    tables = rotation.tables_for(cfg, call.positions_BxL, settings.num_heads, settings.rotation_base)
    document_BxL = None if call.segment_ids_BxL is None else segments.document_index(call.segment_ids_BxL)
    return Context(call.positions_BxL, tables, call.mode, document_BxL)

  def init_state(self, cfg: base.ModelConfig, batch_size: int, max_len: int | None = None) -> KVCache:
    """An empty KV cache of `window` slots, else `max_len` (default the model's), and `next_slot` 0."""
    settings = self.settings(cfg)
    size = settings.window or max_len or settings.max_len
    return empty_cache(batch_size, size, settings.num_kv_heads, cfg.d_model // settings.num_heads,
                       layers.compute_dtype(cfg.dtype))

  def state_for(self, cfg: base.ModelConfig, batch_size: int, found: Any) -> KVCache:
    size = None
    if not self.settings(cfg).window and isinstance(found, KVCache) and len(found.key) > 1:
      size = found.key[1]  # an unwindowed cache may be made of any size
    return self.init_state(cfg, batch_size, size)

  def check_room(self, cfg: base.ModelConfig, state: KVCache, length: int) -> None:
    if not self.settings(cfg).window:
      check_room(state.next_slot, state.key.shape[1], length, f"model.{self.field('max_len')}")

  def cache_field(self, cfg: base.ModelConfig) -> str | None:
    return None if self.settings(cfg).window else self.field("max_len")

  def state_field(self, cfg: base.ModelConfig) -> str | None:
    return self.field("window") if self.settings(cfg).window else self.field("max_len")

  def decode_context(self, cfg: base.ModelConfig) -> int:
    settings = self.settings(cfg)
    return settings.window or settings.max_len

  def matmul_params(self, cfg: base.ModelConfig) -> int:
    """q, k, v, o: d^2 each, k and v scaled by the key/value heads' share."""
    heads, kv_heads = self.settings(cfg)[:2]
    d = cfg.d_model
    return 2 * d * d + 2 * d * (d * kv_heads // heads)

  def mixing_flops(self, cfg: base.ModelConfig, seq_len: int, mode: str) -> int:
    """The full [L, L] score matrix and its product with V, 4 L d per token (a window masks scores, it does not
    skip them); a windowed layer decoding (recurrent) reads its W cached tokens, 4 W d."""
    window = self.settings(cfg).window
    keys = min(seq_len, window) if window and mode == "recurrent" else seq_len
    return 4 * keys * cfg.d_model

  def check_segments(self, cfg: base.ModelConfig, segment_len: int, seq_len: int, mode: str) -> None:
    settings, field = self.settings(cfg), f"model.{self.field('max_len')}"
    if not settings.window and seq_len > settings.max_len:
      raise ValueError(f"train.segment_len={segment_len} carries the attention layers' KV caches from segment to "
                       f"segment, and without a window they hold the whole sequence: train.seq_len={seq_len} "
                       f"exceeds {field}={settings.max_len}. Raise it (--config.{field}={seq_len}) or set "
                       f"model.{self.field('window')}.")

  def check_sequence_split(self, cfg: base.ModelConfig, where: str, devices: int, length: int,
                           modes: tuple[str, ...]) -> None:
    raise ValueError(f"{where}, but {self.what(cfg)} are attention layers, and only retention splits sequences "
                     "(sequence-parallel attention is not built): use a mesh whose sequence axis has size 1.")


# A Transformer's layers, and a hybrid RetNet's `model.attention_layers`.
TRANSFORMER = Attention("", lambda cfg: "the Transformer's layers")
HYBRID = Attention("attention_", lambda cfg: f"model.attention_layers={tuple(cfg.attention.layers)}")
