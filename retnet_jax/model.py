"""The RetNet decoder language model.

    model = RetNet(config.model, rngs=nnx.Rngs(seed))
    logits_BxLxV, state = model(tokens_BxL, mode="parallel" | "chunkwise" | "recurrent", state=None)

`state` holds the position reached and every layer's retention state; every mode takes and returns it, so a
prompt prefilled in one mode continues in any other. A state whose position starts at -p treats the first p
tokens as left padding (they do not enter the state): prompts of different lengths share one batch.
`segment_ids [batch, seq]` packs documents into a row (`retnet_jax.segments`): each is computed as if alone, the
state passed in continues each row's first document and the state returned is its last document's.
A hybrid (`model.attention_layers`) runs the Transformer's attention in those layers, whose state is a KV cache
(`key`, `value` and `next_slot`; with `attention_window`, a ring buffer of that many tokens) handed on the same way.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from retnet_jax import (config_checks, decay, kernels, layer_stack, layers, retention, rotation, segments, sharding,
                        stability, transformer)

MODES = ("parallel", "chunkwise", "recurrent")  # the retention forms (`architectures.MODES`)
State = dict[str, Any]
def attention_heads(cfg: ml_collections.ConfigDict) -> tuple[int, int]:
  """(query heads, key/value heads) of a hybrid's attention layers: `attention_num_heads` (None: `num_heads`) and
  `attention_num_kv_heads` (None: one per query head)."""
  heads = cfg.attention_num_heads or cfg.num_heads
  return heads, cfg.attention_num_kv_heads or heads


def attention_cache_len(cfg: ml_collections.ConfigDict, max_len: int | None = None) -> int:
  """Slots of an attention layer's KV cache: `attention_window` (a ring buffer of the last tokens, constant in the
  context), else `max_len` (default `attention_max_len`)."""
  return cfg.attention_window or max_len or cfg.attention_max_len


def init_attention_state(cfg: ml_collections.ConfigDict, batch_size: int, size: int) -> dict[str, jax.Array]:
  """An attention layer's empty state: its KV cache of `size` slots (`transformer.empty_cache`) and `next_slot`,
  the tokens fed so far."""
  return {**transformer.empty_cache(cfg, batch_size, size, *attention_heads(cfg)),
          "next_slot": jnp.zeros((), jnp.int32)}


def _check_attention(cfg: ml_collections.ConfigDict) -> None:
  """The hybrid fields: layer indices in range and distinct, heads dividing the width, a window of at least one
  token, and no attention option without attention layers."""
  chosen = cfg.attention_layers
  if not isinstance(chosen, (tuple, list)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in chosen):
    raise ValueError(f"model.attention_layers must be a tuple of layer indices, e.g. (1,) or (3, 7); got {chosen!r}.")
  if not chosen:
    for name in ("attention_num_heads", "attention_num_kv_heads", "attention_window"):
      if cfg[name] is not None:
        raise ValueError(f"model.{name}={cfg[name]} configures attention layers, but model.attention_layers is "
                         "empty: name them (e.g. --config.model.attention_layers='(1,)') or unset "
                         f"model.{name}.")
    return
  bad = [i for i in chosen if not 0 <= i < cfg.num_layers]
  if bad:
    raise ValueError(f"model.attention_layers={tuple(chosen)} names layers {bad} outside [0, model.num_layers="
                     f"{cfg.num_layers}); choose indices from 0 to {cfg.num_layers - 1}.")
  repeated = sorted({i for i in chosen if list(chosen).count(i) > 1})
  if repeated:
    raise ValueError(f"model.attention_layers={tuple(chosen)} repeats layers {repeated}; name each layer once.")
  heads, kv_heads = attention_heads(cfg)
  if heads < 1 or cfg.d_model % heads:
    raise ValueError(f"model.attention_num_heads={heads} must be a positive divisor of model.d_model={cfg.d_model} "
                     "(or None: model.num_heads).")
  if kv_heads < 1 or heads % kv_heads:
    raise ValueError(f"model.attention_num_kv_heads={kv_heads} must be a positive divisor of the attention layers' "
                     f"{heads} query heads (or None: one key/value head per query head).")
  rotation.check_rotary_dim(cfg.d_model // heads)
  if cfg.attention_window is not None and cfg.attention_window < 1:
    raise ValueError(f"model.attention_window={cfg.attention_window} must be a positive number of tokens (or None: "
                     "attend to every earlier token).")
  config_checks.finite_number(cfg.attention_rotation_base, "model.attention_rotation_base", positive=True)
  if cfg.attention_max_len < 1:
    raise ValueError(f"model.attention_max_len must be a positive number of tokens; got {cfg.attention_max_len}.")


def check_model_config(cfg: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the bad value and the fix for a model config that cannot be built (TypeError for
  something other than the model fields)."""
  if not isinstance(cfg, ml_collections.ConfigDict) or "d_model" not in cfg:
    full = isinstance(cfg, ml_collections.ConfigDict) and "model" in cfg
    raise TypeError("a model takes the model fields, config.model (e.g. presets.model_config('tiny')); got "
                    + ("the full config: pass config.model." if full else f"a {type(cfg).__name__}."))
  for name in ("d_model", "num_layers", "num_heads", "value_dim", "ffn_dim", "vocab_size"):
    config_checks.positive_int(cfg[name], f"model.{name}")
  if cfg.d_model % cfg.num_heads:
    raise ValueError(f"model.d_model={cfg.d_model} is not divisible by model.num_heads={cfg.num_heads}; "
                     "choose num_heads dividing d_model.")
  if cfg.value_dim % cfg.num_heads:
    raise ValueError(f"model.value_dim={cfg.value_dim} is not divisible by model.num_heads={cfg.num_heads}; "
                     "choose value_dim as a multiple of num_heads.")
  if cfg.num_kv_heads is not None and (cfg.num_kv_heads < 1 or cfg.num_heads % cfg.num_kv_heads):
    raise ValueError(f"model.num_kv_heads={cfg.num_kv_heads} must be a positive divisor of model.num_heads="
                     f"{cfg.num_heads} (or None: one key/value head per query head).")
  rotation.check_rotary_dim(cfg.d_model // cfg.num_heads)
  rotation.check_rotation(cfg.rotation_pairs, cfg.rotation_freqs)
  config_checks.finite_number(cfg.rotation_base, "model.rotation_base", positive=True)
  for name in ("norm_eps", "head_norm_eps"):
    config_checks.finite_number(cfg[name], f"model.{name}")
  retention.check_chunk_size(cfg.chunk_size, "model.chunk_size")
  _check_attention(cfg)
  layers.compute_dtype(cfg.dtype)
  decay.gammas(cfg.decay_schedule, cfg.num_heads, cfg.decay_gammas)
  layers.check_activation(cfg.ffn_activation)
  layers.check_matmul_precision(cfg.matmul_precision)
  config_checks.choice(cfg.retention_impl, "model.retention_impl", layers.RETENTION_IMPLS)
  config_checks.choice(cfg.kernel_layout, "model.kernel_layout", kernels.LAYOUTS)
  config_checks.choice(cfg.stability_norm_style, "model.stability_norm_style", stability.NORM_STYLES)


def check_state(cfg: ml_collections.ConfigDict, state: Any, batch: int) -> None:
  """Checks a carried state against the model config and the token batch: its layers, their keys and shapes."""
  if not isinstance(state, dict) or set(state) != {"position", "layers"}:
    keys = sorted(state) if isinstance(state, dict) else type(state).__name__
    raise ValueError(f"state must be a dict with 'position' and 'layers', as the model returns it; got {keys}.")
  if tuple(np.shape(state["position"])) != (batch,):
    raise ValueError(f"state['position'] must have shape [batch] = ({batch},) to match the tokens; got "
                     f"{tuple(np.shape(state['position']))}.")
  if len(state["layers"]) != cfg.num_layers:
    raise ValueError(f"the state holds {len(state['layers'])} layer states but model.num_layers={cfg.num_layers}; "
                     "it was made by another model config.")
  shapes = lambda init: {k: v.shape for k, v in jax.eval_shape(init).items()}
  retention_state = shapes(lambda: layers.init_layer_state(cfg, batch))
  for i, layer_state in enumerate(state["layers"]):
    found = {k: tuple(np.shape(v)) for k, v in layer_state.items()} if isinstance(layer_state, dict) else layer_state
    expected = retention_state
    if i in cfg.attention_layers:  # a KV cache: `attention_window` slots, or as many as the state was made with
      size = found["key"][1] if not cfg.attention_window and isinstance(found, dict) and "key" in found else None
      expected = shapes(lambda: init_attention_state(cfg, batch, attention_cache_len(cfg, size)))
    if found != expected:
      raise ValueError(f"layer {i} of the state holds {found}, but a batch of {batch} in this model config needs "
                       f"{expected}; the state was made by another model config or batch size.")


def check_attention_room(cfg: ml_collections.ConfigDict, state: State, length: int) -> None:
  """For a concrete state (`transformer.check_room`): the KV caches of unwindowed attention layers must hold
  `length` more tokens, or ValueError naming model.attention_max_len."""
  if cfg.attention_window:
    return
  for layer in cfg.attention_layers:
    cache = state["layers"][layer]
    transformer.check_room(cache["next_slot"], cache["key"].shape[1], length, "model.attention_max_len")


def check_segments(cfg: ml_collections.ConfigDict, segment_ids: Any, shape: tuple[int, int], mode: str) -> None:
  """Checks `segment_ids` against the tokens' shape, and refuses them where the torchscale chunkwise normaliser
  (whose per-chunk scalars cannot restart inside a chunk) would run."""
  segments.check_segment_ids(segment_ids, *shape)
  torchscale = stability.torchscale_normaliser(cfg)
  if segment_ids is not None and torchscale and mode == "chunkwise":
    raise ValueError("segment_ids cannot reset the chunkwise form of model.stability_norm_style='torchscale' (its "
                     "per-chunk scalars span documents): use mode='parallel' or 'recurrent', or "
                     "stability_norm_style='shared'.")


class RetNet(nnx.Module):
  """Decoder-only RetNet LM: embedding, `num_layers` pre-norm blocks, final RMSNorm, tied or untied head.

  `scale_embedding` multiplies the embeddings by sqrt(d_model) and `embed_norm` applies an RMSNorm to them
  before the first block (the official code's `no_scale_embedding=False` and `layernorm_embedding`).
  `scan_layers` stacks the blocks' parameters and runs them in a scan (`layer_stack`; a hybrid's by the period of
  its retention and attention blocks): the same function.
  """

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    check_model_config(cfg)
    self.config = ml_collections.FrozenConfigDict(cfg)
    dtype = layers.compute_dtype(cfg.dtype)
    self.embed = layers.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, rngs=rngs)
    self.embed_scale = cfg.d_model**0.5 if cfg.scale_embedding else None
    self.embed_norm = layers.RMSNorm(cfg.d_model, cfg.norm_eps, dtype=dtype, rngs=rngs) if cfg.embed_norm else None
    self.blocks = layer_stack.build(lambda r, layer: _block(cfg, layer, dtype, r), cfg.num_layers, cfg.scan_layers,
                                    rngs)
    self.final_norm = layers.RMSNorm(cfg.d_model, cfg.norm_eps, dtype=dtype, rngs=rngs)
    self.head = None if cfg.tie_embeddings else layers.Dense(
        cfg.d_model, cfg.vocab_size, ("embed", "vocab"), init=nnx.initializers.normal(cfg.d_model**-0.5),
        dtype=dtype, out_dtype=jnp.float32, rngs=rngs)

  def init_state(self, batch_size: int, max_len: int | None = None) -> State:
    """The empty state: position 0, zero retention state in every retention layer and an empty KV cache in every
    attention layer (`attention_cache_len(config, max_len)` slots)."""
    cfg = self.config
    return {"position": jnp.zeros((batch_size,), jnp.int32),
            "layers": [init_attention_state(cfg, batch_size, attention_cache_len(cfg, max_len))
                       if layer in cfg.attention_layers else layers.init_layer_state(cfg, batch_size)
                       for layer in range(cfg.num_layers)]}

  def __call__(self, tokens_BxL: jax.Array, mode: str = "parallel", state: State | None = None,
               remat: str = "none", segment_ids: jax.Array | None = None) -> tuple[jax.Array, State]:
    """Runs the model over a token batch in one retention form.

    Args:
      tokens_BxL: integer token ids `[batch, seq]`.
      mode: the retention form: parallel, chunkwise or recurrent (MODES).
      state: the state a previous call returned (position `[batch]`, each layer's retention state), or None to start
        at position 0.
      remat: `none`, or a key of `layer_stack.REMAT_POLICIES` to recompute each block in the backward pass and save
        memory.
      segment_ids: integer document ids `[batch, seq]` (a document: a run of equal ids in a row), or None: one
        document per row. A row whose first token opens a new document takes a zero (`init_state`) state row.
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
      raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}.")
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
    check_segments(self.config, segment_ids, tokens_BxL.shape, mode)
    if state is None:  # no carried state: the blocks skip the cross terms with an all-zero state
      state = {"position": jnp.zeros((batch,), jnp.int32), "layers": [None] * self.config.num_layers}
    else:
      check_state(self.config, state, batch)
      check_attention_room(self.config, state, length)
    positions_BxL = segments.model_positions(segment_ids, state["position"], length)
    tables = rotation.tables_for(self.config, positions_BxL)
    attention = _Attention(self.config, positions_BxL, mode, segment_ids) if self.config.attention_layers else None
    x = self.embed(tokens_BxL)
    if self.embed_scale is not None:
      x = x * jnp.asarray(self.embed_scale, x.dtype)
    if self.embed_norm is not None:
      x = self.embed_norm(x)
    x = sharding.constrain(x, ("batch", "length", None))

    def call(block, x, layer_state):
      if isinstance(block, transformer.TransformerBlock):
        x, layer_state = attention(block, x, layer_state)
      else:
        x, layer_state = block(x, positions_BxL, tables, layer_state, mode, segment_ids)
      return sharding.constrain(x, ("batch", "length", None)), layer_state
    x, layer_states = layer_stack.run(self.blocks, x, state["layers"], call, remat)
    return self.final_norm(x), {"position": positions_BxL[:, -1] + 1, "layers": layer_states}


def _block(cfg: ml_collections.ConfigDict, layer: int, dtype, rngs: nnx.Rngs) -> nnx.Module:
  """Block `layer` of a RetNet: retention's, or in a hybrid's `attention_layers` the Transformer's."""
  if layer not in cfg.attention_layers:
    return layers.RetNetBlock(cfg, dtype=dtype, rngs=rngs)
  heads, kv_heads = attention_heads(cfg)
  return transformer.TransformerBlock(cfg, dtype=dtype, rngs=rngs, num_heads=heads, num_kv_heads=kv_heads,
                                      window=cfg.attention_window, rotation_pairs=cfg.rotation_pairs)


class _Attention:
  """Runs a hybrid's attention blocks in one call of the model: the form that a retention `mode` and the layer's
  state give (parallel and chunkwise: all tokens at once; recurrent: one at a time), on a cache it starts where the
  call brings no state."""

  def __init__(self, cfg: ml_collections.ConfigDict, positions_BxL: jax.Array, mode: str, segment_ids):
    if (split := sharding.sequence_split()) is not None:
      raise ValueError(f"the active mesh splits sequences over its {split[0]!r} axis ({split[1]} devices), but "
                       f"model.attention_layers={tuple(cfg.attention_layers)} are attention layers, and only "
                       "retention splits sequences (sequence-parallel attention is not built): use a mesh whose "
                       "sequence axis has size 1.")
    self.cfg, self.positions_BxL, self.mode = cfg, positions_BxL, mode
    self.tables = rotation.tables_for(cfg, positions_BxL, attention_heads(cfg)[0], cfg.attention_rotation_base)
    self.document_BxL = None if segment_ids is None else segments.document_index(segment_ids)

  def __call__(self, block: nnx.Module, x_BxLxD: jax.Array, layer_state: State | None) -> tuple[jax.Array, State]:
    batch, length = self.positions_BxL.shape
    if layer_state is None:  # a cache holding this call's tokens (unwindowed: at least attention_max_len)
      size = attention_cache_len(self.cfg, max(length, self.cfg.attention_max_len))
      cache = transformer.empty_cache(self.cfg, batch, size, *attention_heads(self.cfg))
      step, form = jnp.zeros((), jnp.int32), "recurrent" if self.mode == "recurrent" else "self"
    else:
      cache, step = {k: layer_state[k] for k in ("key", "value")}, layer_state["next_slot"]
      form = "recurrent" if self.mode == "recurrent" else "cache"
    x_BxLxD, cache = block(x_BxLxD, self.positions_BxL, self.tables, cache, step, form, self.document_BxL)
    return x_BxLxD, {**cache, "next_slot": step + length}
