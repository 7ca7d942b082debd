"""The Transformer decoder language model: causal softmax attention with rotary positions and a KV cache.

    model = Transformer(config.model, rngs=nnx.Rngs(seed))  # configs/transformer.py, or presets.transformer_config
    logits_BxLxV, state = model(tokens_BxL, mode="parallel" | "recurrent", state=None)

Embedding, RMSNorm, GLU feed-forward and projections are RetNet's layers (`retnet_jax.layers`), queries and
keys are rotated by `retnet_jax.rotation` (interleaved pairs), and the call signature is RetNet's, so training,
evaluation, checkpoints and sampling take either (`retnet_jax.architectures`). `state` is a preallocated KV
cache: per layer `key` and `value` `[B, max_len, H, d]` in the compute dtype, the next free slot `next_slot`
(shared by the batch) and each row's `position`. `parallel` processes all tokens at once (attending over the
cached prefix too when a state is given); `recurrent` decodes incrementally, one token at a time through the
cache. As in RetNet, a state starting at position -p treats its first p tokens as left padding, so
`Sampler.generate` (`sampling`) decodes with this model unchanged (prefilling in the parallel form). With
`segment_ids` (packed documents, `retnet_jax.segments`) the parallel form attends within each document only, the
cached prefix reaching the first; the returned position is the last document's, so its earlier documents' slots read
as left padding after.
Its attention (`CausalSelfAttention`: grouped key/value heads, a sliding window over a ring-buffer cache) and block
also serve a hybrid RetNet's attention layers (`model.attention_layers`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from retnet_jax import config_checks, layer_stack, layers, matmul, rotation, segments, sharding

MODES = ("parallel", "recurrent")  # the forms (`architectures.MODES`): chunkwise is a retention form
State = dict[str, Any]
_MASKED = float(jnp.finfo(jnp.float32).min)  # not -inf: a row that sees only padding stays finite


def check_config(cfg: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the bad value and the fix for a model config that cannot be built."""
  for name in ("d_model", "num_layers", "num_heads", "ffn_dim", "vocab_size", "max_len"):
    config_checks.positive_int(cfg[name], f"model.{name}")
  if cfg.d_model % cfg.num_heads:
    raise ValueError(f"model.d_model={cfg.d_model} is not divisible by model.num_heads={cfg.num_heads}; "
                     "choose num_heads dividing d_model.")
  rotation.check_rotary_dim(cfg.d_model // cfg.num_heads)
  rotation.check_rotation("interleaved", cfg.rotation_freqs)
  config_checks.finite_number(cfg.rotation_base, "model.rotation_base", positive=True)
  config_checks.finite_number(cfg.norm_eps, "model.norm_eps")
  layers.compute_dtype(cfg.dtype)
  layers.check_activation(cfg.ffn_activation)
  layers.check_matmul_precision(cfg.matmul_precision)


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


def _slot_steps(last_step, size: int) -> jax.Array:
  """`[S]`: the step each cache slot holds once steps up to `last_step` were written (step t goes to slot t mod S,
  so a cache of S slots is a ring buffer of the last S tokens); negative: not written yet."""
  slots_S = jnp.arange(size)
  return last_step - (last_step - slots_S) % size


def write_cache(cache: State, k, v, step, ring: bool) -> State:
  """The cache with `k, v [B, L, G, K]` written for steps `step ... step + L - 1`, each at its step mod S (a `ring`
  buffer: of more than S tokens, the last S), or from slot `step` on."""
  length, size = k.shape[1], cache["key"].shape[1]
  if not ring or length == 1 or (isinstance(step, int) and step + length <= size):
    return {name: jax.lax.dynamic_update_slice_in_dim(cache[name], x.astype(cache[name].dtype), step % size, axis=1)
            for name, x in (("key", k), ("value", v))}
  kept = min(length, size)
  slots = (step + length - kept + jnp.arange(kept)) % size
  return {name: cache[name].at[:, slots].set(x[:, length - kept:].astype(cache[name].dtype))
          for name, x in (("key", k), ("value", v))}


def _cached_attention(q, k, v, cache, step, position_B, window: int | None, document_BxL=None):
  """Writes k, v at `step` on into the cache and attends over it and them: (out `[B, L, H, K]`, cache).

  The token fed at step t sits at position `position_B - step + t` (position_B: the first query's). A cache of
  `window` slots (a ring buffer) cannot hold the keys of a multi-token call's first queries once it has written
  their successors, so those attend over the old cache and the new keys side by side; otherwise the keys are
  written first and the queries attend over the whole cache. With the queries' document index `document [B, L]`
  (0: the first document), a query sees its own document's keys, the cached ones belonging to 0.
  """
  length, size = q.shape[1], cache["key"].shape[1]
  query_step_L = step + jnp.arange(length)
  new_cache = write_cache(cache, k, v, step, window is not None)
  if window is not None and length > 1:  # attend over [old cache, new keys]
    key_step_S = jnp.concatenate([_slot_steps(step - 1, size), query_step_L])
    keys, values = (jnp.concatenate([cache[name], x.astype(cache[name].dtype)], axis=1)
                    for name, x in (("key", k), ("value", v)))
  else:
    key_step_S = _slot_steps(step + length - 1, size)
    keys, values = new_cache["key"], new_cache["value"]
  key_document_BxS = None
  if document_BxL is not None:
    offset_S = key_step_S - step
    key_document_BxS = jnp.where(offset_S >= 0, jnp.take(document_BxL, jnp.clip(offset_S, 0, length - 1), axis=1), 0)
  key_position_BxS = position_B[:, None] + (key_step_S - step)[None, :]
  visible = _visible(query_step_L, key_step_S, key_position_BxS, window, document_BxL, key_document_BxS)
  return attention(q, keys, values, visible), new_cache


class CausalSelfAttention(nnx.Module):
  """Multi-head causal attention: fused q/k/v projection, rotary positions, output projection; optionally grouped
  key/value heads and a sliding window of the last `window` tokens.

  `form`: `self` attends among the given tokens only (no cache yet), `cache` writes them into the cache
  and attends over it, `recurrent` does the latter one token at a time. A windowed layer's cache needs only
  `window` slots (a ring buffer), so its decoding memory stays constant in the context.
  """

  def __init__(self, d_model: int, num_heads: int, num_kv_heads: int | None = None, *, window: int | None = None,
               rotation_pairs: str = "interleaved", dtype, rngs: nnx.Rngs):
    self.num_heads = num_heads
    self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    self.head_dim = d_model // num_heads
    self.window = window
    self.rotation_pairs = rotation_pairs
    self.dtype = dtype
    init = layers.xavier_uniform(1.0)
    width = (num_heads + 2 * self.num_kv_heads) * self.head_dim
    self.qkv_proj = layers.Dense(d_model, width, ("embed", "heads"), init=init, dtype=self.dtype, rngs=rngs)
    self.out_proj = layers.Dense(d_model, d_model, ("heads", "embed"), init=init, dtype=self.dtype, rngs=rngs)

  def __call__(self, x_BxLxD: jax.Array, positions_BxL: jax.Array, rotation_tables, cache: State, slot: jax.Array,
               form: str, document_BxL: jax.Array | None = None) -> tuple[jax.Array, State]:
    """`cache`: `key`, `value` `[B, S, G, K]`, `slot` the step it has reached (tokens fed so far). `document
    [B, L]`: each token's document index in its row (`segments.document_index`), or None: one."""
    batch, length, d = x_BxLxD.shape
    groups, group_size = self.num_kv_heads, self.num_heads // self.num_kv_heads
    # Columns grouped per key/value head (its query heads, then its key and its value): a split of the `heads`
    # axis over devices (tensor parallelism) gives each device whole groups. One group per head: q, k, v per head.
    qkv = checkpoint_name(self.qkv_proj(x_BxLxD), layer_stack.QKV).reshape(batch, length, groups, group_size + 2,
                                                                            self.head_dim)
    rotate = lambda x: rotation.rotate(x, rotation_tables, self.rotation_pairs)
    q = rotate(qkv[:, :, :, :group_size].reshape(batch, length, self.num_heads, self.head_dim))
    q = q * jnp.asarray(self.head_dim**-0.5, self.dtype)
    k, v = rotate(qkv[:, :, :, group_size]), qkv[:, :, :, group_size + 1]
    if form == "self":
      steps_L = jnp.arange(length)
      visible = _visible(steps_L, steps_L, positions_BxL, self.window, document_BxL, document_BxL)
      out = attention(q, k, v, visible)
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
    return self.out_proj(out.astype(self.dtype)), cache


class TransformerBlock(nnx.Module):
  """Pre-norm block: Y = Attention(LN(X)) + X, then X' = FFN(LN(Y)) + Y; `dtype` is the compute dtype.

  The attention's heads, key/value heads, window and rotation pairs default to a Transformer's (`cfg.num_heads`,
  one key/value head each, no window, interleaved); a hybrid RetNet's attention layers pass their own.
  """

  def __init__(self, cfg: ml_collections.ConfigDict, *, dtype, rngs: nnx.Rngs, num_heads: int | None = None,
               num_kv_heads: int | None = None, window: int | None = None, rotation_pairs: str = "interleaved"):
    self.attention_norm = layers.RMSNorm(cfg.d_model, cfg.norm_eps, dtype=dtype, rngs=rngs)
    self.attention = CausalSelfAttention(cfg.d_model, num_heads or cfg.num_heads, num_kv_heads, window=window,
                                         rotation_pairs=rotation_pairs, dtype=dtype, rngs=rngs)
    self.ffn_norm = layers.RMSNorm(cfg.d_model, cfg.norm_eps, dtype=dtype, rngs=rngs)
    self.ffn = layers.GLUFeedForward(cfg, dtype=dtype, rngs=rngs)

  def __call__(self, x_BxLxD, positions_BxL, rotation_tables, cache: State, slot: jax.Array, form: str,
               document_BxL=None):
    y, cache = self.attention(self.attention_norm(x_BxLxD), positions_BxL, rotation_tables, cache, slot, form,
                              document_BxL)
    x_BxLxD = x_BxLxD + y
    return x_BxLxD + self.ffn(self.ffn_norm(x_BxLxD)), cache


def empty_cache(cfg: ml_collections.ConfigDict, batch_size: int, size: int, num_heads: int, num_kv_heads: int
                ) -> State:
  """One layer's empty KV cache of `size` slots: `key`, `value` `[B, size, num_kv_heads, d_model // num_heads]` in
  the compute dtype."""
  shape = (batch_size, size, num_kv_heads, cfg.d_model // num_heads)
  dtype = layers.compute_dtype(cfg.dtype)
  return {"key": jnp.zeros(shape, dtype), "value": jnp.zeros(shape, dtype)}


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


def check_state_room(state: State, length: int) -> None:
  """`check_room` for a Transformer's state."""
  check_room(state["next_slot"], state["layers"][0]["key"].shape[1], length, "model.max_len")


class Transformer(nnx.Module):
  """Decoder-only Transformer LM: embedding, `num_layers` pre-norm blocks, final RMSNorm, tied or untied head."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    check_config(cfg)
    self.config = ml_collections.FrozenConfigDict(cfg)
    dtype = layers.compute_dtype(cfg.dtype)
    self.embed = layers.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, rngs=rngs)
    self.blocks = layer_stack.build(lambda r, _: TransformerBlock(cfg, dtype=dtype, rngs=r), cfg.num_layers,
                                    cfg.scan_layers, rngs)
    self.final_norm = layers.RMSNorm(cfg.d_model, cfg.norm_eps, dtype=dtype, rngs=rngs)
    self.head = None if cfg.tie_embeddings else layers.Dense(
        cfg.d_model, cfg.vocab_size, ("embed", "vocab"), init=nnx.initializers.normal(cfg.d_model**-0.5),
        dtype=dtype, out_dtype=jnp.float32, rngs=rngs)

  def init_state(self, batch_size: int, max_len: int | None = None) -> State:
    """An empty KV cache of `max_len` (default `config.max_len`) slots per layer, at position 0."""
    cfg = self.config
    return {"position": jnp.zeros((batch_size,), jnp.int32), "next_slot": jnp.zeros((), jnp.int32),
            "layers": [empty_cache(cfg, batch_size, max_len or cfg.max_len, cfg.num_heads, cfg.num_heads)
                       for _ in range(cfg.num_layers)]}

  def __call__(self, tokens_BxL: jax.Array, mode: str = "parallel", state: State | None = None,
               remat: str = "none", segment_ids: jax.Array | None = None) -> tuple[jax.Array, State]:
    """Logits `[batch, seq, vocab]` (float32) for `tokens [batch, seq]`, and the state after the last token.

    Args:
      tokens_BxL: integer token ids `[batch, seq]`.
      mode: parallel (all tokens at once) or recurrent (one token at a time through the cache) (MODES).
      state: the state a previous call or `init_state` returned, or None to start at position 0 (the returned
        cache then has max(max_len, seq) slots).
      remat: `none`, or a key of `layer_stack.REMAT_POLICIES` to recompute each block in the backward pass.
      segment_ids: integer document ids `[batch, seq]` for the parallel form (as in `RetNet`), or None.
    Returns:
      `(logits [batch, seq, vocab]` float32, the state after the last token).
    """
    x_BxLxD, state = self.hidden(tokens_BxL, mode, state, remat, segment_ids)
    return self.logits(x_BxLxD), state

  def hidden(self, tokens_BxL: jax.Array, mode: str = "parallel", state: State | None = None, remat: str = "none",
             segment_ids: jax.Array | None = None) -> tuple[jax.Array, State]:
    """As the call, with the final-normed hidden states `[batch, seq, d_model]` (compute dtype) in place of the
    logits: for a loss that projects them tile by tile (`losses.tiled_nll`)."""
    if mode not in MODES:
      raise ValueError(f"unknown mode {mode!r}; a Transformer has {MODES} (chunkwise is a retention form).")
    with layers.matmul_precision(self.config.matmul_precision):
      return self._forward(tokens_BxL, mode, state, remat, segment_ids)

  def logits(self, x_BxLxD: jax.Array) -> jax.Array:
    """Float32 logits `[..., vocab]` of hidden states `[..., d_model]` (`hidden`'s)."""
    with layers.matmul_precision(self.config.matmul_precision):
      return layers.output_logits(self.embed, self.head, x_BxLxD)

  def _forward(self, tokens_BxL, mode: str, state: State | None, remat: str, segment_ids
               ) -> tuple[jax.Array, State]:
    layers.check_tokens(tokens_BxL, self.config.vocab_size)
    batch, length = tokens_BxL.shape
    segments.check_segment_ids(segment_ids, batch, length)
    if segment_ids is not None and mode == "recurrent":
      raise ValueError("segment_ids cannot apply to a Transformer's recurrent (decoding) step, which attends over "
                       "its whole cache: pass packed documents in mode='parallel', and decode without segment_ids.")
    form = "cache" if mode == "parallel" else "recurrent"
    if state is None:
      state = self.init_state(batch, max(self.config.max_len, length))
      form = "self" if mode == "parallel" else form
    check_state_room(state, length)
    positions_BxL = segments.model_positions(segment_ids, state["position"], length)
    document_BxL = None if segment_ids is None else segments.document_index(segment_ids)
    tables = rotation.tables_for(self.config, positions_BxL)
    x = sharding.constrain(self.embed(tokens_BxL), ("batch", None, None))

    def call(block, x, cache):
      x, cache = block(x, positions_BxL, tables, cache, state["next_slot"], form, document_BxL)
      return sharding.constrain(x, ("batch", None, None)), cache
    x, caches = layer_stack.run(self.blocks, x, state["layers"], call, remat)
    return self.final_norm(x), {"position": positions_BxL[:, -1] + 1, "next_slot": state["next_slot"] + length,
                                "layers": caches}
