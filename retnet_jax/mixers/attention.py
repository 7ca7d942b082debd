"""Causal softmax attention, the Transformer's token mixer and a hybrid's attention layers (`base.Mixer`).

Rotary positions (`retnet_jax.nn.rotation`), grouped key/value heads, a sliding window over a ring-buffer cache. Its
decoding state is a KV cache per layer (`key`, `value` `[B, S, G, K]` in the compute dtype and `next_slot`, the tokens
fed so far); as in retention, a state whose position starts at -p treats its first p tokens as left padding. With
`segment_ids` every form attends within each document only (a key before a query's document start has a negative
position). It computes the parallel and recurrent forms; in a hybrid's chunkwise call it attends all tokens at once,
as in the parallel form. A call of several tokens over more than `softmax_attention.KEY_BLOCK` keys (a long training
sequence, a prefill's blocks over a long cache) reads them a block at a time, so that its memory is the keys and one
block's scores, and its backward pass keeps no scores; a query that sees no key (left padding) gets zeros. A
Transformer's layers (`configs/transformer.py`) take their fields plainly (`num_heads`, `max_len`, `rotation_base`); a
hybrid RetNet's (`model.attention_layers`) take the `attention_` fields.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from retnet_jax.core import config_checks, sections, segments, sharding
from retnet_jax.mixers import base, softmax_attention
from retnet_jax.nn import layer_stack, layers, rotation


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
  own = size if beside else step  # the first query's key: the new keys follow the old cache, or its slot (no ring)
  return softmax_attention.read_causal(q, keys, values, visible_of, (step, position_B, document_BxL), own,
                                       window), new_cache


def _cache_keys_visible(start, num_keys: int, query_start, queries: int, step, position_B, document_BxL, *,
                        length: int, size: int, window: int | None, beside: bool) -> jax.Array:
  """`[B, queries, num_keys]`: which of keys `start ... start + num_keys - 1` queries `query_start ... query_start +
  queries - 1` of the `length` fed from `step` on see (`_cached_attention`'s): the slots of a cache of `size`
  written up to the last query, or (`beside`) the old cache's slots, then the new keys (key i < size is slot i, then
  key size + t). Their steps give their positions and documents."""
  i = start + jnp.arange(num_keys)
  key_step_S = (jnp.where(i < size, _slot_steps(step - 1, size, i), step + i - size) if beside
                else _slot_steps(step + length - 1, size, i))
  offset_S = key_step_S - step
  key_document_BxS = None
  if document_BxL is not None:
    key_document_BxS = jnp.where(offset_S >= 0, jnp.take(document_BxL, jnp.clip(offset_S, 0, length - 1), axis=1), 0)
  return _visible(step + query_start + jnp.arange(queries), key_step_S, position_B[:, None] + offset_S[None, :],
                  window, _tokens(document_BxL, query_start, queries), key_document_BxS)


def _tokens(x_BxL, first, n: int):
  """Tokens `first ... first + n - 1` of `x [B, L]` (None stays None)."""
  return None if x_BxL is None else jax.lax.dynamic_slice_in_dim(x_BxL, first, n, axis=1)


def _own_keys_visible(start, num_keys: int, query_start, queries: int, positions_BxL, document_BxL, *,
                      window: int | None) -> jax.Array:
  """`[B, queries, num_keys]`: which of keys `start ... start + num_keys - 1` of the call's own L tokens each of its
  queries `query_start ... query_start + queries - 1` sees (the self form, without a cache)."""
  return _visible(query_start + jnp.arange(queries), start + jnp.arange(num_keys), _tokens(positions_BxL, start,
                  num_keys), window, _tokens(document_BxL, query_start, queries),
                  _tokens(document_BxL, start, num_keys))


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
      out = softmax_attention.read_causal(q, k, v, visible_of, (positions_BxL, document_BxL), 0, self.window)
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
