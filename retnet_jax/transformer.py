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
`sampling.generate` decodes with this model unchanged (prefilling in the parallel form). With `segment_ids` (packed
documents, `retnet_jax.segments`) the parallel form attends within each document only, the cached prefix reaching the
first; the returned position is the last document's, so its earlier documents' slots read as left padding after.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from retnet_jax import layer_stack, layers, rotation, segments, sharding
from retnet_jax.model import check_tokens, rotation_tables_for

MODES = ("parallel", "recurrent")  # the forms (`architectures.MODES`): chunkwise is a retention form
State = dict[str, Any]
_MASKED = float(jnp.finfo(jnp.float32).min)  # not -inf: a row that sees only padding stays finite


def check_config(cfg: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the bad value and the fix for a model config that cannot be built."""
  for name in ("d_model", "num_layers", "num_heads", "ffn_dim", "vocab_size", "max_len"):
    if int(cfg[name]) < 1:
      raise ValueError(f"model.{name} must be a positive integer; got {cfg[name]}.")
  if cfg.d_model % cfg.num_heads:
    raise ValueError(f"model.d_model={cfg.d_model} is not divisible by model.num_heads={cfg.num_heads}; "
                     "choose num_heads dividing d_model.")
  rotation.check_rotary_dim(cfg.d_model // cfg.num_heads)
  rotation.check_rotation("interleaved", cfg.rotation_freqs)
  if not math.isfinite(cfg.rotation_base) or cfg.rotation_base <= 0:
    raise ValueError(f"model.rotation_base must be a positive finite number; got {cfg.rotation_base}.")
  if not math.isfinite(cfg.norm_eps) or cfg.norm_eps < 0:
    raise ValueError(f"model.norm_eps must be a finite number >= 0; got {cfg.norm_eps}.")
  layers.compute_dtype(cfg.dtype)
  layers.check_activation(cfg.ffn_activation)
  layers.check_matmul_precision(cfg.matmul_precision)


def attention(q_BxLxHxK: jax.Array, k_BxSxHxK: jax.Array, v_BxSxHxK: jax.Array, visible_BxLxS: jax.Array
              ) -> jax.Array:
  """Softmax attention of L queries over S keys where `visible`: `[B, L, H, K]` float32."""
  scores = jnp.einsum("blhk,bshk->bhls", q_BxLxHxK, k_BxSxHxK, preferred_element_type=jnp.float32)
  probs = jax.nn.softmax(jnp.where(visible_BxLxS[:, None], scores, _MASKED), axis=-1)
  return jnp.einsum("bhls,bshk->blhk", probs.astype(v_BxSxHxK.dtype), v_BxSxHxK, preferred_element_type=jnp.float32)


def _cached_attention(q, k, v, cache, slot, position_B, document_BxL=None):
  """Writes k, v at cache `slot` on, then attends over the whole cache: (out `[B, L, H, K]`, cache).

  Slot s holds the token at position `position_B - slot + s` (position_B: the first query's); slots after
  the queries are not visible, and negative positions are left padding. With the queries' document index
  `document [B, L]` (0: the first document), a query sees its own document's slots, the cached ones belonging to 0.
  """
  key = jax.lax.dynamic_update_slice_in_dim(cache["key"], k.astype(cache["key"].dtype), slot, axis=1)
  value = jax.lax.dynamic_update_slice_in_dim(cache["value"], v.astype(cache["value"].dtype), slot, axis=1)
  slots_S = jnp.arange(key.shape[1])
  causal_LxS = slots_S[None, :] <= slot + jnp.arange(q.shape[1])[:, None]
  visible_BxLxS = causal_LxS[None] & ((position_B - slot)[:, None] + slots_S >= 0)[:, None]
  if document_BxL is not None:
    slot_document_BxS = jax.lax.dynamic_update_slice_in_dim(jnp.zeros((q.shape[0], key.shape[1]), jnp.int32),
                                                            document_BxL, slot, axis=1)
    visible_BxLxS = visible_BxLxS & (document_BxL[:, :, None] == slot_document_BxS[:, None, :])
  return attention(q, key, value, visible_BxLxS), {"key": key, "value": value}


class CausalSelfAttention(nnx.Module):
  """Multi-head causal attention: fused q/k/v projection, rotary positions, output projection.

  `form`: `self` attends among the given tokens only (no cache yet), `cache` writes them into the cache
  and attends over it, `recurrent` does the latter one token at a time.
  """

  def __init__(self, cfg: ml_collections.ConfigDict, *, dtype, rngs: nnx.Rngs):
    d = cfg.d_model
    self.num_heads = cfg.num_heads
    self.head_dim = d // cfg.num_heads
    self.dtype = dtype
    init = layers.xavier_uniform(1.0)
    self.qkv_proj = layers.Dense(d, 3 * d, ("embed", "heads"), init=init, dtype=self.dtype, rngs=rngs)
    self.out_proj = layers.Dense(d, d, ("heads", "embed"), init=init, dtype=self.dtype, rngs=rngs)

  def __call__(self, x_BxLxD: jax.Array, positions_BxL: jax.Array, rotation_tables, cache: State, slot: jax.Array,
               form: str, document_BxL: jax.Array | None = None) -> tuple[jax.Array, State]:
    """`document [B, L]`: each token's document index in its row (`segments.document_index`), or None: one."""
    batch, length, d = x_BxLxD.shape
    # Columns grouped per head (q, k, v of head 0, then head 1, ...): a split of the `heads` axis over devices
    # (tensor parallelism) gives each device whole heads.
    qkv = checkpoint_name(self.qkv_proj(x_BxLxD), layer_stack.QKV).reshape(batch, length, self.num_heads, 3,
                                                                            self.head_dim)
    q = rotation.rotate(qkv[:, :, :, 0], rotation_tables) * jnp.asarray(self.head_dim**-0.5, self.dtype)
    k, v = rotation.rotate(qkv[:, :, :, 1], rotation_tables), qkv[:, :, :, 2]
    if form == "self":
      causal_LxL = jnp.tril(jnp.ones((length, length), bool))
      visible_BxLxL = causal_LxL[None] & (positions_BxL >= 0)[:, None, :]
      if document_BxL is not None:  # block-diagonal: within a document only
        visible_BxLxL = visible_BxLxL & (document_BxL[:, :, None] == document_BxL[:, None, :])
      out = attention(q, k, v, visible_BxLxL)
      cache = {name: jax.lax.dynamic_update_slice_in_dim(cache[name], x.astype(cache[name].dtype), 0, axis=1)
               for name, x in (("key", k), ("value", v))}
    elif form == "cache":
      out, cache = _cached_attention(q, k, v, cache, slot, positions_BxL[:, 0], document_BxL)
    else:
      def step(cache, inputs):
        q_t, k_t, v_t, t = inputs
        out_t, cache = _cached_attention(q_t[:, None], k_t[:, None], v_t[:, None], cache, slot + t,
                                         positions_BxL[:, 0] + t)
        return cache, out_t[:, 0]

      # One token (decoding) is inlined rather than looped, so the cache updates in place in an outer loop.
      time_major = tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v)) + (jnp.arange(length),)
      cache, out_LxBxHxK = jax.lax.scan(step, cache, time_major, unroll=length == 1)
      out = jnp.swapaxes(out_LxBxHxK, 0, 1)
    out = checkpoint_name(out.reshape(batch, length, d), layer_stack.MIXER_OUT)
    return self.out_proj(out.astype(self.dtype)), cache


class TransformerBlock(nnx.Module):
  """Pre-norm block: Y = Attention(LN(X)) + X, then X' = FFN(LN(Y)) + Y; `dtype` is the compute dtype."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, dtype, rngs: nnx.Rngs):
    self.attention_norm = layers.RMSNorm(cfg.d_model, cfg.norm_eps, dtype=dtype, rngs=rngs)
    self.attention = CausalSelfAttention(cfg, dtype=dtype, rngs=rngs)
    self.ffn_norm = layers.RMSNorm(cfg.d_model, cfg.norm_eps, dtype=dtype, rngs=rngs)
    self.ffn = layers.GLUFeedForward(cfg, dtype=dtype, rngs=rngs)

  def __call__(self, x_BxLxD, positions_BxL, rotation_tables, cache: State, slot: jax.Array, form: str,
               document_BxL=None):
    y, cache = self.attention(self.attention_norm(x_BxLxD), positions_BxL, rotation_tables, cache, slot, form,
                              document_BxL)
    x_BxLxD = x_BxLxD + y
    return x_BxLxD + self.ffn(self.ffn_norm(x_BxLxD)), cache


def check_state_room(state: State, length: int) -> None:
  """For a concrete state (outside jit): its cache must hold `length` more tokens (a traced one is not checked:
  inside jit, tokens past the cache's end would overwrite its last slots)."""
  try:
    used = int(np.asarray(state["next_slot"]))
  except jax.errors.TracerArrayConversionError:
    return
  size = state["layers"][0]["key"].shape[1]
  if used + length > size:
    raise ValueError(f"the KV cache holds {size} tokens; {used} are used and {length} more do not fit. Raise "
                     f"model.max_len to at least {used + length} (--config.model.max_len={used + length}), or use "
                     "fewer tokens.")


class Transformer(nnx.Module):
  """Decoder-only Transformer LM: embedding, `num_layers` pre-norm blocks, final RMSNorm, tied or untied head."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    check_config(cfg)
    self.config = ml_collections.FrozenConfigDict(cfg)
    dtype = layers.compute_dtype(cfg.dtype)
    self.embed = layers.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, rngs=rngs)
    self.blocks = layer_stack.build(lambda r: TransformerBlock(cfg, dtype=dtype, rngs=r), cfg.num_layers,
                                    cfg.scan_layers, rngs)
    self.final_norm = layers.RMSNorm(cfg.d_model, cfg.norm_eps, dtype=dtype, rngs=rngs)
    self.head = None if cfg.tie_embeddings else layers.Dense(
        cfg.d_model, cfg.vocab_size, ("embed", "vocab"), init=nnx.initializers.normal(cfg.d_model**-0.5),
        dtype=dtype, out_dtype=jnp.float32, rngs=rngs)

  def init_state(self, batch_size: int, max_len: int | None = None) -> State:
    """An empty KV cache of `max_len` (default `config.max_len`) slots per layer, at position 0."""
    cfg = self.config
    shape = (batch_size, max_len or cfg.max_len, cfg.num_heads, cfg.d_model // cfg.num_heads)
    dtype = layers.compute_dtype(cfg.dtype)
    return {"position": jnp.zeros((batch_size,), jnp.int32), "next_slot": jnp.zeros((), jnp.int32),
            "layers": [{"key": jnp.zeros(shape, dtype), "value": jnp.zeros(shape, dtype)}
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
    if mode not in MODES:
      raise ValueError(f"unknown mode {mode!r}; a Transformer has {MODES} (chunkwise is a retention form).")
    precision = layers.MATMUL_PRECISIONS[self.config.matmul_precision]
    with contextlib.nullcontext() if precision is None else jax.default_matmul_precision(precision):
      return self._forward(tokens_BxL, mode, state, remat, segment_ids)

  def _forward(self, tokens_BxL, mode: str, state: State | None, remat: str, segment_ids
               ) -> tuple[jax.Array, State]:
    check_tokens(tokens_BxL, self.config.vocab_size)
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
    tables = rotation_tables_for(self.config, positions_BxL)
    x = sharding.constrain(self.embed(tokens_BxL), ("batch", None, None))

    def call(block, x, cache):
      x, cache = block(x, positions_BxL, tables, cache, state["next_slot"], form, document_BxL)
      return sharding.constrain(x, ("batch", None, None)), cache
    x, caches = layer_stack.run(self.blocks, x, state["layers"], call, remat)
    x = self.final_norm(x)
    logits = self.embed.attend(x) if self.head is None else self.head(x)
    return logits, {"position": positions_BxL[:, -1] + 1, "next_slot": state["next_slot"] + length, "layers": caches}
