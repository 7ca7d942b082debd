"""The decoder language model of every architecture: embedding, blocks of a token mixer and a GLU feed-forward, final
RMSNorm, tied or untied head.

    model = Model(config.model, rngs=nnx.Rngs(seed))  # configs/retnet.py:NAME or configs/transformer.py:NAME
    logits_BxLxV, state = model(tokens_BxL, mode="parallel" | "chunkwise" | "recurrent", state=None)

Each layer runs the mixer the registry gives it (`architectures.layer_mixers`): a RetNet's retention, a
Transformer's attention, a hybrid's attention in `model.attention_layers`. `state` holds the position reached and
every layer's mixer state (retention's fixed-size state, attention's KV cache); every form takes and returns it, so
a prompt prefilled in one form continues in any other. A state whose position starts at -p treats the first p
tokens as left padding (they do not enter the state): prompts of different lengths share one batch.
`segment_ids [batch, seq]` packs documents into a row (`retnet_jax.core.segments`): each is computed as if alone, the
state passed in continues each row's first document and the state returned is its last document's.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from retnet_jax.core import segments, sharding
from retnet_jax.mixers import base
from retnet_jax.models import architectures, model_config
from retnet_jax.nn import layer_stack, layers

MAX_POSITION = 2**31 - 1  # positions are int32


class ModelState(NamedTuple):
  """A model's decoding state: the position `[B]` int32 of each row's next token (negative: left padding to come),
  and each layer's mixer state (`multiscale_retention.RetentionState`, `attention.KVCache`, ...)."""
  position: jax.Array
  layers: tuple[Any, ...]


def check_position(position_B: Any, length: int) -> None:
  """For a concrete carried `position [B]` (outside jit): `length` more tokens must end within the int32 positions,
  or ValueError naming the position and the limit. A traced one is not checked: inside jit, positions past the limit
  would wrap to negative ones (left padding)."""
  try:
    reached = int(np.asarray(position_B, np.int64).max())
  except jax.errors.TracerArrayConversionError:
    return
  if reached + length > MAX_POSITION:
    raise ValueError(f"the state is at position {reached}, and {length} more tokens would pass position "
                     f"{MAX_POSITION}, the largest int32 position; start a new state (position 0) or use fewer "
                     "tokens.")


def shapes(tree: Any) -> Any:
  """`tree` with each leaf replaced by its shape: states compare by tree structure and shapes."""
  return jax.tree.map(lambda x: tuple(np.shape(x)), tree)


def check_state(cfg: model_config.ModelConfig, state: Any, batch: int) -> None:
  """Checks a carried state against the model config and the token batch: its layers, their trees and shapes."""
  if not isinstance(state, ModelState):
    raise ValueError(f"state must be a ModelState(position, layers), as model.init_state and the model return it; "
                     f"got a {type(state).__name__}.")
  if tuple(np.shape(state.position)) != (batch,):
    raise ValueError(f"state.position must have shape [batch] = ({batch},) to match the tokens; got "
                     f"{tuple(np.shape(state.position))}.")
  if len(state.layers) != cfg.num_layers:
    raise ValueError(f"the state holds {len(state.layers)} layer states but model.num_layers={cfg.num_layers}; "
                     "it was made by another model config.")
  expected_by = {}  # (mixer, found) -> its shapes: traced once per kind of layer state, not once per layer
  for i, (mixer, layer_state) in enumerate(zip(architectures.layer_mixers(cfg), state.layers)):
    found = shapes(layer_state)
    key = (mixer.name, repr(found))
    if key not in expected_by:
      expected_by[key] = shapes(jax.eval_shape(lambda: mixer.state_for(cfg, batch, found)))
    expected = expected_by[key]
    if jax.tree.structure(found) != jax.tree.structure(expected) or found != expected:
      raise ValueError(f"layer {i} of the state holds {found}, but a batch of {batch} in this model config needs "
                       f"{expected}; the state was made by another model config or batch size.")


class Block(nnx.Module):
  """Pre-norm block: Y = Mixer(LN(X)) + X, then X' = FFN(LN(Y)) + Y; `dtype` is the compute dtype. The mixer's
  layer and norm are the attributes `NAME` and `NAME_norm` of its name (`retention`, `attention`): the parameter
  paths checkpoints hold."""

  def __init__(self, cfg: model_config.ModelConfig, mixer: base.Mixer, *, dtype, rngs: nnx.Rngs):
    self.mixer_name = mixer.name
    setattr(self, f"{mixer.name}_norm", layers.RMSNorm(cfg.d_model, cfg.norm_eps, dtype=dtype, rngs=rngs))
    setattr(self, mixer.name, mixer.layer(cfg, dtype=dtype, rngs=rngs))
    self.ffn_norm = layers.RMSNorm(cfg.d_model, cfg.norm_eps, dtype=dtype, rngs=rngs)
    self.ffn = layers.GLUFeedForward(cfg, dtype=dtype, rngs=rngs)

  def __call__(self, x_BxLxD: jax.Array, context: Any, state: base.State | None) -> tuple[jax.Array, base.State]:
    """`x [B, L, D]` in its mixer's call `context` with the layer's state (None: empty) -> (x', new state)."""
    norm, mixer = getattr(self, f"{self.mixer_name}_norm"), getattr(self, self.mixer_name)
    y, state = mixer(norm(x_BxLxD), context, state)
    x_BxLxD = x_BxLxD + y
    return x_BxLxD + self.ffn(self.ffn_norm(x_BxLxD)), state


class Model(nnx.Module):
  """Decoder-only LM: embedding, `num_layers` pre-norm blocks, final RMSNorm, tied or untied head.

  `scale_embedding` multiplies the embeddings by sqrt(d_model) and `embed_norm` applies an RMSNorm to them
  before the first block (the official RetNet code's `no_scale_embedding=False` and `layernorm_embedding`; a
  Transformer's section has neither). `scan_layers` stacks the blocks' parameters and runs them in a scan
  (`layer_stack`; a hybrid's by the period of its retention and attention blocks): the same function.
  """

  def __init__(self, cfg: model_config.ModelConfig | Any, *, rngs: nnx.Rngs):
    """`cfg`: the model section, typed (`model_config.of`) or as the config holds it (built and checked here)."""
    cfg = self.config = model_config.of(cfg)
    dtype = layers.compute_dtype(cfg.dtype)
    self.embed = layers.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, rngs=rngs)
    self.embed_scale = cfg.d_model**0.5 if getattr(cfg, "scale_embedding", False) else None
    self.embed_norm = (layers.RMSNorm(cfg.d_model, cfg.norm_eps, dtype=dtype, rngs=rngs)
                       if getattr(cfg, "embed_norm", False) else None)
    mixers = architectures.layer_mixers(cfg)
    self.blocks = layer_stack.build(lambda r, layer: Block(cfg, mixers[layer], dtype=dtype, rngs=r), cfg.num_layers,
                                    cfg.scan_layers, rngs)
    self.final_norm = layers.RMSNorm(cfg.d_model, cfg.norm_eps, dtype=dtype, rngs=rngs)
    self.head = None if cfg.tie_embeddings else layers.Dense(
        cfg.d_model, cfg.vocab_size, ("embed", "vocab"), init=nnx.initializers.normal(cfg.d_model**-0.5),
        dtype=dtype, out_dtype=jnp.float32, rngs=rngs)

  def init_state(self, batch_size: int, max_len: int | None = None) -> ModelState:
    """The empty state: position 0 and every layer's empty mixer state (a KV cache of `max_len` slots, default the
    model's cache length, unless windowed)."""
    cfg = self.config
    return ModelState(jnp.zeros((batch_size,), jnp.int32),
                      tuple(mixer.init_state(cfg, batch_size, max_len) for mixer in architectures.layer_mixers(cfg)))

  def __call__(self, tokens_BxL: jax.Array, mode: str = "parallel", state: ModelState | None = None,
               remat: str = "none", segment_ids: jax.Array | None = None) -> tuple[jax.Array, ModelState]:
    """Runs the model over a token batch in one form.

    Args:
      tokens_BxL: integer token ids `[batch, seq]`.
      mode: the form, one of `architectures.modes(config)`: parallel, chunkwise (retention) or recurrent.
      state: the `ModelState` a previous call or `init_state` returned, or None to start at position 0.
      remat: `none`, or a key of `layer_stack.REMAT_POLICIES` to recompute each block in the backward pass and save
        memory.
      segment_ids: integer document ids `[batch, seq]` (a document: a run of equal ids in a row), or None: one
        document per row. A row whose first token opens a new document takes an empty (`init_state`) state row.
    Returns:
      `(logits [batch, seq, vocab]` float32, the state after the last token).
    """
    x_BxLxD, state = self.hidden(tokens_BxL, mode, state, remat, segment_ids)
    return self.logits(x_BxLxD), state

  def hidden(self, tokens_BxL: jax.Array, mode: str = "parallel", state: ModelState | None = None,
             remat: str = "none", segment_ids: jax.Array | None = None) -> tuple[jax.Array, ModelState]:
    """As the call, with the final-normed hidden states `[batch, seq, d_model]` (compute dtype) in place of the
    logits: for a loss that projects them tile by tile (`losses.tiled_nll`)."""
    own = architectures.modes(self.config)
    if mode not in own:
      raise ValueError(f"unknown mode {mode!r} for a {self.config.architecture}; choose one of {own}.")
    with layers.matmul_precision(self.config.matmul_precision):
      return self._forward(tokens_BxL, mode, state, remat, segment_ids)

  def logits(self, x_BxLxD: jax.Array) -> jax.Array:
    """Float32 logits `[..., vocab]` of hidden states `[..., d_model]` (`hidden`'s)."""
    with layers.matmul_precision(self.config.matmul_precision):
      return layers.output_logits(self.embed, self.head, x_BxLxD)

  def _forward(self, tokens_BxL, mode: str, state: ModelState | None, remat: str, segment_ids
               ) -> tuple[jax.Array, ModelState]:
    cfg = self.config
    layers.check_tokens(tokens_BxL, cfg.vocab_size)
    batch, length = tokens_BxL.shape
    segments.check_segment_ids(segment_ids, batch, length)
    mixers = architectures.layer_mixers(cfg)
    if state is None:  # no carried state: each layer starts empty (retention skips the cross terms)
      state = ModelState(jnp.zeros((batch,), jnp.int32), (None,) * cfg.num_layers)
    else:
      check_state(cfg, state, batch)
      check_position(state.position, length)
      for mixer, layer_state in zip(mixers, state.layers):
        mixer.check_room(cfg, layer_state, length)
    positions_BxL = segments.model_positions(segment_ids, state.position, length)
    call = base.Call(positions_BxL, mode, segment_ids)
    contexts = {mixer.name: mixer.context(cfg, call) for mixer in architectures.mixers(cfg)}
    x = self.embed(tokens_BxL)
    if self.embed_scale is not None:
      x = x * jnp.asarray(self.embed_scale, x.dtype)
    if self.embed_norm is not None:
      x = self.embed_norm(x)
    x = sharding.constrain(x, ("batch", "length", None))

    def call_block(block, x, layer_state):
      x, layer_state = block(x, contexts[block.mixer_name], layer_state)
      return sharding.constrain(x, ("batch", "length", None)), layer_state
    x, layer_states = layer_stack.run(self.blocks, x, state.layers, call_block, remat)
    return self.final_norm(x), ModelState(positions_BxL[:, -1] + 1, tuple(layer_states))
