"""The RetNet decoder language model.

    model = RetNet(config.model, rngs=nnx.Rngs(seed))
    logits_BxLxV, state = model(tokens_BxL, mode="parallel" | "chunkwise" | "recurrent", state=None)

`state` holds the position reached and every layer's retention state; every mode takes and returns it, so a
prompt prefilled in one mode continues in any other. A state whose position starts at -p treats the first p
tokens as left padding (they do not enter the state): prompts of different lengths share one batch.
`segment_ids [batch, seq]` packs documents into a row (`retnet_jax.segments`): each is computed as if alone, the
state passed in continues each row's first document and the state returned is its last document's.
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

from retnet_jax import decay, layer_stack, layers, retention, rotation, segments, sharding, stability

MODES = ("parallel", "chunkwise", "recurrent")  # the retention forms (`architectures.MODES`)
State = dict[str, Any]
def rotation_tables_for(cfg: ml_collections.ConfigDict, positions_BxL: jax.Array):
  """The q/k rotation tables of a model config at `positions [B, L]`, shared by every layer of one call: their
  sines and cosines would cost more than the rotations."""
  return rotation.rotation_tables(positions_BxL, cfg.d_model // cfg.num_heads, cfg.rotation_base, cfg.rotation_freqs)


def check_model_config(cfg: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the bad value and the fix for a model config that cannot be built (TypeError for
  something other than the model fields)."""
  if not isinstance(cfg, ml_collections.ConfigDict) or "d_model" not in cfg:
    full = isinstance(cfg, ml_collections.ConfigDict) and "model" in cfg
    raise TypeError("a model takes the model fields, config.model (e.g. presets.model_config('tiny')); got "
                    + ("the full config: pass config.model." if full else f"a {type(cfg).__name__}."))
  for name in ("d_model", "num_layers", "num_heads", "value_dim", "ffn_dim", "vocab_size"):
    if int(cfg[name]) < 1:
      raise ValueError(f"model.{name} must be a positive integer; got {cfg[name]}.")
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
  if not math.isfinite(cfg.rotation_base) or cfg.rotation_base <= 0:
    raise ValueError(f"model.rotation_base must be a positive finite number; got {cfg.rotation_base}.")
  for name in ("norm_eps", "head_norm_eps"):
    if not math.isfinite(cfg[name]) or cfg[name] < 0:
      raise ValueError(f"model.{name} must be a finite number >= 0; got {cfg[name]}.")
  retention.check_chunk_size(cfg.chunk_size, "model.chunk_size")
  layers.compute_dtype(cfg.dtype)
  decay.gammas(cfg.decay_schedule, cfg.num_heads, cfg.decay_gammas)
  layers.check_activation(cfg.ffn_activation)
  layers.check_matmul_precision(cfg.matmul_precision)
  if cfg.retention_impl not in layers.RETENTION_IMPLS:
    raise ValueError(f"unknown model.retention_impl {cfg.retention_impl!r}; choose one of {layers.RETENTION_IMPLS}.")
  if cfg.stability_norm_style not in stability.NORM_STYLES:
    raise ValueError(f"unknown model.stability_norm_style {cfg.stability_norm_style!r}; "
                     f"choose one of {stability.NORM_STYLES}.")


def check_tokens(tokens: Any, vocab_size: int) -> None:
  """Checks rank, dtype and (for concrete arrays, outside jit) the id range of a token batch."""
  if not hasattr(tokens, "ndim"):
    raise ValueError(f"tokens must be an integer array [batch, seq]; got a {type(tokens).__name__} (convert it: "
                     "jnp.asarray(ids, jnp.int32)).")
  if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"tokens must be an integer array [batch, seq]; got shape {getattr(tokens, 'shape', None)} "
                     f"dtype {getattr(tokens, 'dtype', None)}.")
  if tokens.shape[0] < 1 or tokens.shape[1] < 1:
    raise ValueError(f"tokens must hold at least one row and one position; got shape {tuple(tokens.shape)}.")
  try:
    host = np.asarray(tokens)
  except jax.errors.TracerArrayConversionError:
    return  # traced: ids cannot be checked before the computation runs
  low, high = int(host.min()), int(host.max())
  if low < 0 or high >= vocab_size:
    raise ValueError(f"token ids must lie in [0, {vocab_size}); got ids from {low} to {high}. "
                     "Check the tokenizer against model.vocab_size.")


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
  expected = {k: v.shape for k, v in jax.eval_shape(lambda: layers.init_layer_state(cfg, batch)).items()}
  for i, layer_state in enumerate(state["layers"]):
    found = {k: tuple(np.shape(v)) for k, v in layer_state.items()} if isinstance(layer_state, dict) else layer_state
    if found != expected:
      raise ValueError(f"layer {i} of the state holds {found}, but a batch of {batch} in this model config needs "
                       f"{expected}; the state was made by another model config or batch size.")


def check_segments(cfg: ml_collections.ConfigDict, segment_ids: Any, shape: tuple[int, int], mode: str) -> None:
  """Checks `segment_ids` against the tokens' shape, and refuses them where the torchscale chunkwise normaliser
  (whose per-chunk scalars cannot restart inside a chunk) would run."""
  segments.check_segment_ids(segment_ids, *shape)
  torchscale = cfg.stability_norm and cfg.stability_norm_style == "torchscale"
  if segment_ids is not None and torchscale and mode == "chunkwise":
    raise ValueError("segment_ids cannot reset the chunkwise form of model.stability_norm_style='torchscale' (its "
                     "per-chunk scalars span documents): use mode='parallel' or 'recurrent', or "
                     "stability_norm_style='shared'.")


class RetNet(nnx.Module):
  """Decoder-only RetNet LM: embedding, `num_layers` pre-norm blocks, final RMSNorm, tied or untied head.

  `scale_embedding` multiplies the embeddings by sqrt(d_model) and `embed_norm` applies an RMSNorm to them
  before the first block (the official code's `no_scale_embedding=False` and `layernorm_embedding`).
  `scan_layers` stacks the blocks' parameters and runs them in a scan (`layer_stack`): the same function.
  """

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    check_model_config(cfg)
    self.config = ml_collections.FrozenConfigDict(cfg)
    dtype = layers.compute_dtype(cfg.dtype)
    self.embed = layers.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, rngs=rngs)
    self.embed_scale = cfg.d_model**0.5 if cfg.scale_embedding else None
    self.embed_norm = layers.RMSNorm(cfg.d_model, cfg.norm_eps, dtype=dtype, rngs=rngs) if cfg.embed_norm else None
    self.blocks = layer_stack.build(lambda r: layers.RetNetBlock(cfg, dtype=dtype, rngs=r), cfg.num_layers,
                                    cfg.scan_layers, rngs)
    self.final_norm = layers.RMSNorm(cfg.d_model, cfg.norm_eps, dtype=dtype, rngs=rngs)
    self.head = None if cfg.tie_embeddings else layers.Dense(
        cfg.d_model, cfg.vocab_size, ("embed", "vocab"), init=nnx.initializers.normal(cfg.d_model**-0.5),
        dtype=dtype, out_dtype=jnp.float32, rngs=rngs)

  def init_state(self, batch_size: int) -> State:
    """The empty state: position 0 and zero retention state in every layer."""
    return {"position": jnp.zeros((batch_size,), jnp.int32),
            "layers": [layers.init_layer_state(self.config, batch_size) for _ in range(self.config.num_layers)]}

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
    if mode not in MODES:
      raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}.")
    precision = layers.MATMUL_PRECISIONS[self.config.matmul_precision]
    with contextlib.nullcontext() if precision is None else jax.default_matmul_precision(precision):
      return self._forward(tokens_BxL, mode, state, remat, segment_ids)

  def _forward(self, tokens_BxL, mode: str, state: State | None, remat: str, segment_ids
               ) -> tuple[jax.Array, State]:
    check_tokens(tokens_BxL, self.config.vocab_size)
    batch, length = tokens_BxL.shape
    check_segments(self.config, segment_ids, tokens_BxL.shape, mode)
    if state is None:  # no carried state: the blocks skip the cross terms with an all-zero state
      state = {"position": jnp.zeros((batch,), jnp.int32), "layers": [None] * self.config.num_layers}
    else:
      check_state(self.config, state, batch)
    positions_BxL = segments.model_positions(segment_ids, state["position"], length)
    tables = rotation_tables_for(self.config, positions_BxL)
    x = self.embed(tokens_BxL)
    if self.embed_scale is not None:
      x = x * jnp.asarray(self.embed_scale, x.dtype)
    if self.embed_norm is not None:
      x = self.embed_norm(x)
    x = sharding.constrain(x, ("batch", "length", None))

    def call(block, x, layer_state):
      x, layer_state = block(x, positions_BxL, tables, layer_state, mode, segment_ids)
      return sharding.constrain(x, ("batch", "length", None)), layer_state
    x, layer_states = layer_stack.run(self.blocks, x, state["layers"], call, remat)
    x = self.final_norm(x)
    logits = self.embed.attend(x) if self.head is None else self.head(x)
    return logits, {"position": positions_BxL[:, -1] + 1, "layers": layer_states}
