"""Flax NNX layers of RetNet: projections, RMSNorm, embedding, multi-scale retention, GLU feed-forward, block.

Parameters are float32 and carry logical axis names (`vocab`, `embed`, `heads`, `mlp`); compute runs in the
configured dtype with float32 accumulation. Built under a mesh (`jax.set_mesh`), a parameter is placed where the
active `nnx.logical_axis_rules` put its axes, as far as that mesh has those axes and they split it evenly, and
replicated otherwise (with no rules active: replicated).
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from retnet_jax import (config_checks, decay, kernels, layer_stack, matmul, retention, rotation, sequence_parallel,
                        sharding, stability)

# model.retention_impl: the chunkwise form as XLA einsums, as the Pallas kernels (in model.kernel_layout), or the
# kernels where they compile (GPU) and XLA elsewhere.
RETENTION_IMPLS = ("xla", "pallas", "auto")
# model.matmul_precision -> jax.default_matmul_precision (on GPUs `default` lets float32 matmuls run in TF32).
MATMUL_PRECISIONS = {"default": None, "high": "high", "highest": "highest"}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "swish": jax.nn.swish,
    "relu": jax.nn.relu,
}


def xavier_uniform(gain: float) -> nnx.Initializer:
  return nnx.initializers.variance_scaling(gain**2, "fan_avg", "uniform")


def _param(rngs: nnx.Rngs, init: nnx.Initializer, shape: tuple[int, ...], axes: tuple[str | None, ...]):
  """A float32 parameter annotated with logical `axes`; under a mesh, placed as the module docstring says."""
  value = sharding.place(init(rngs.params(), shape, jnp.float32), axes)
  return nnx.Param(value, out_sharding=axes, eager_sharding=False)  # placed above, not by flax's rules


def check_activation(name: str) -> None:
  """Raises ValueError for an `ffn_activation` not in ACTIVATIONS."""
  config_checks.choice(name, "model.ffn_activation", ACTIVATIONS)


def check_matmul_precision(name: str) -> None:
  """Raises ValueError for a `matmul_precision` not in MATMUL_PRECISIONS."""
  config_checks.choice(name, "model.matmul_precision", MATMUL_PRECISIONS)


def _kernel_unfit(cfg: ml_collections.ConfigDict, backend: str | None) -> str | None:
  """Why the compiled Pallas kernels cannot run this model's chunkwise retention on `backend`, or None."""
  if stability.torchscale_normaliser(cfg):
    return ("the torchscale normaliser's chunkwise scalars need by-products only the XLA form computes; use "
            "retention_impl='xla' (or 'auto'), or stability_norm_style='shared'")
  try:
    kernels.check_supported(cfg.d_model // cfg.num_heads, cfg.value_dim // cfg.num_heads, compute_dtype(cfg.dtype),
                            cfg.chunk_size, backend, cfg.kernel_layout)
  except ValueError as e:
    return str(e)
  return None


def check_retention_impl(cfg: ml_collections.ConfigDict, backend: str | None = None) -> None:
  """Raises ValueError naming the limit and the fix where `retention_impl=pallas` cannot compile on `backend`
  (default: JAX's) for this model: before any work, as training and evaluation call it. (A model built directly
  runs the kernels interpreted where they do not compile: slow, for tests.)"""
  if cfg.retention_impl == "pallas" and (reason := _kernel_unfit(cfg, backend)):
    raise ValueError(f"model.retention_impl='pallas' cannot run here: {reason}")


def uses_kernel(cfg: ml_collections.ConfigDict, backend: str | None = None) -> bool:
  """Whether the chunkwise form runs as the Pallas kernels: `pallas` (interpreted where they do not compile: for
  tests), or `auto` where they compile."""
  return cfg.retention_impl == "pallas" or (cfg.retention_impl == "auto" and _kernel_unfit(cfg, backend) is None)


def matmul_precision(name: str):
  """The context in which a model of `model.matmul_precision` = `name` runs its matmuls (MATMUL_PRECISIONS)."""
  precision = MATMUL_PRECISIONS[name]
  return contextlib.nullcontext() if precision is None else jax.default_matmul_precision(precision)


def output_logits(embed: "Embed", head: "Dense | None", x: jax.Array) -> jax.Array:
  """Float32 logits `[..., vocab]` of final hidden states `[..., d_model]`: the untied `head`, or tied to `embed`."""
  return embed.attend(x) if head is None else head(x)


def compute_dtype(name: str):
  """The jnp dtype of a config's `dtype` name."""
  if name not in DTYPES:
    raise ValueError(f"unknown dtype {name!r}; choose one of {tuple(DTYPES)}.")
  return DTYPES[name]


class Dense(nnx.Module):
  """Bias-free projection; flattens to 2-D first so XLA sees plain matmuls in both directions. The product is
  emitted in `out_dtype` (default: the compute dtype), its backward in the compute dtype (`matmul.einsum`)."""

  def __init__(self, in_features: int, out_features: int, axes, *, init, dtype, rngs: nnx.Rngs, out_dtype=None):
    self.kernel = _param(rngs, init, (in_features, out_features), axes)
    self.dtype = dtype
    self.out_dtype = dtype if out_dtype is None else out_dtype

  def __call__(self, x_NxI: jax.Array) -> jax.Array:
    x_2d = x_NxI.reshape(-1, x_NxI.shape[-1]).astype(self.dtype)
    y = matmul.einsum("ni,io->no", x_2d, self.kernel[...].astype(self.dtype), self.out_dtype)
    return y.reshape(x_NxI.shape[:-1] + (-1,))


def rms_norm(x: jax.Array, eps: float) -> jax.Array:
  """x / sqrt(mean(x^2) + eps) over the last axis, in float32."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
  """RMSNorm with a learned per-feature scale."""

  def __init__(self, dim: int, eps: float, *, dtype, rngs: nnx.Rngs):
    self.scale = _param(rngs, nnx.initializers.ones, (dim,), ("embed",))
    self.eps = eps
    self.dtype = dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    return (rms_norm(x, self.eps) * self.scale[...]).astype(self.dtype)


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


class Embed(nnx.Module):
  """Token embedding; `attend` gives tied output logits."""

  def __init__(self, vocab_size: int, dim: int, *, dtype, rngs: nnx.Rngs):
    self.embedding = _param(rngs, nnx.initializers.normal(dim**-0.5), (vocab_size, dim), ("vocab", "embed"))
    self.dtype = dtype

  def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
    # A gather from a sharded table into batch-sharded rows makes XLA rematerialise it through a slow
    # path; gathering the (small) table first keeps the lookup local to each batch shard.
    table = sharding.constrain(self.embedding[...], (None, None))
    return jnp.take(table, tokens_BxL, axis=0).astype(self.dtype)

  def attend(self, x_BxLxD: jax.Array) -> jax.Array:
    x_2d = x_BxLxD.reshape(-1, x_BxLxD.shape[-1]).astype(self.dtype)
    logits = matmul.einsum("nd,vd->nv", x_2d, self.embedding[...].astype(self.dtype), jnp.float32)
    return logits.reshape(x_BxLxD.shape[:-1] + (-1,))


def kv_heads(cfg: ml_collections.ConfigDict) -> int:
  """The key/value heads of a model config: `num_kv_heads`, or `num_heads` where it is None."""
  return cfg.num_heads if cfg.num_kv_heads is None else cfg.num_kv_heads


def init_layer_state(cfg: ml_collections.ConfigDict, batch_size: int) -> dict[str, jax.Array]:
  """Zero retention state of one layer: `kv [B, H, d_k, d_v]`, plus `key_sum [B, H, d_k]` if normalised."""
  heads = cfg.num_heads
  d_k, d_v = cfg.d_model // heads, cfg.value_dim // heads
  state = {"kv": jnp.zeros((batch_size, heads, d_k, d_v), jnp.float32)}
  if cfg.stability_norm:
    state["key_sum"] = jnp.zeros((batch_size, heads, d_k), jnp.float32)
  return state


class MultiScaleRetention(nnx.Module):
  """Multi-scale retention: rotated q/k, per-head decay, per-head RMSNorm, swish gate, output projection.

  With `num_kv_heads` < `num_heads`, each group of num_heads / num_kv_heads query heads shares one key/value head
  (query head j reads key/value head j // group size); `head_norm_scale` gives the per-head RMSNorm a learned
  scale that all heads share. With `stability_norm`, each head's raw output is divided by the
  `stability_norm_style` scalars of `retnet_jax.stability`. Positions below 0 are left padding: their keys are
  zeroed, so they add nothing to the state, and as retention depends on relative positions only, a left-padded
  prompt gives the outputs it gives alone. With `segment_ids` (packed documents, `retnet_jax.segments`) every form
  retains within a document only, and positions count from each document's start, so the normaliser restarts too.
  """

  def __init__(self, cfg: ml_collections.ConfigDict, *, dtype, rngs: nnx.Rngs):
    d, heads = cfg.d_model, cfg.num_heads
    self.num_heads = heads
    self.num_kv_heads = kv_heads(cfg)
    self.key_dim = d // heads
    self.value_dim = cfg.value_dim // heads
    self.dtype = dtype
    self.rotation_pairs = cfg.rotation_pairs
    self.head_norm_eps = cfg.head_norm_eps
    self.stability_norm = cfg.stability_norm
    self.stability_norm_style = cfg.stability_norm_style
    self.chunk_size = cfg.chunk_size
    self.kernel = uses_kernel(cfg)
    self.kernel_config = kernels.default_config(self.key_dim, self.value_dim, cfg.kernel_layout)
    self.precision = MATMUL_PRECISIONS[cfg.matmul_precision]
    self.log_decay = tuple(float(x) for x in decay.log_decay(cfg.decay_schedule, heads, cfg.decay_gammas))
    qkvg_init = xavier_uniform(2**-2.5)
    dense = lambda i, o, axes, init: Dense(i, o, axes, init=init, dtype=dtype, rngs=rngs)
    self.q_proj = dense(d, d, ("embed", "heads"), qkvg_init)
    self.k_proj = dense(d, self.key_dim * self.num_kv_heads, ("embed", "heads"), qkvg_init)
    self.v_proj = dense(d, self.value_dim * self.num_kv_heads, ("embed", "heads"), qkvg_init)
    self.g_proj = dense(d, cfg.value_dim, ("embed", "heads"), qkvg_init)
    self.out_proj = dense(cfg.value_dim, d, ("heads", "embed"), xavier_uniform(2**-1))
    self.head_norm_scale = (_param(rngs, nnx.initializers.ones, (self.value_dim,), (None,))
                            if cfg.head_norm_scale else None)

  def _retention(self, mode: str, q, k, v, log_decay_H, state, score_abs_sums=False, split_over=None,
                 segment_ids=None, wide_entry_states=False):
    """(out, final state, chunk entry states, in-chunk |score| row sums); the last two from the chunkwise form only,
    the entry states in q's dtype unless `wide_entry_states` (`retention.chunkwise_with_states`).

    `split_over`: the (mesh axis, size) that splits the sequence (`sharding.sequence_split`), where the parallel and
    chunkwise modes both run the chunkwise form per slice (`sequence_parallel`), or None."""
    if split_over is not None:
      return sequence_parallel.sharded_chunkwise(q, k, v, log_decay_H, self.chunk_size, state, score_abs_sums,
                                                 segment_ids, axis_name=split_over[0])
    if mode == "parallel":
      return *retention.parallel_retention(q, k, v, log_decay_H, state, segment_ids), None, None
    if mode == "chunkwise":
      return retention.chunkwise_with_states(q, k, v, log_decay_H, self.chunk_size, state, score_abs_sums,
                                             segment_ids, wide_entry_states)
    return *retention.recurrent_retention(q, k, v, log_decay_H, state, segment_ids), None, None

  def __call__(self, x_BxLxD: jax.Array, positions_BxL: jax.Array, rotation_tables, state: dict[str, jax.Array] | None,
               mode: str, segment_ids_BxL: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`x [B, L, D]` at `positions [B, L]` with the layer's incoming state (None: empty) -> (y, new state).

    `rotation_tables`: `rotation.rotation_tables(positions, d_model // num_heads, rotation_base, rotation_freqs)`.
    `segment_ids`: the documents `[B, L]` (positions then count within each), or None: one document per row.
    """
    batch, length, _ = x_BxLxD.shape
    heads = self.num_heads
    split = lambda proj, num_heads: checkpoint_name(proj(x_BxLxD), layer_stack.QKV).reshape(
        batch, length, num_heads, -1)
    q = split(self.q_proj, heads)
    k = split(self.k_proj, self.num_kv_heads) * jnp.asarray(self.key_dim**-0.5, self.dtype)
    v = split(self.v_proj, self.num_kv_heads)
    q, k = (rotation.rotate(y, rotation_tables, self.rotation_pairs) for y in (q, k))
    if self.num_kv_heads < heads:  # each key/value head serves a group of consecutive query heads
      k, v = (jnp.repeat(y, heads // self.num_kv_heads, axis=2) for y in (k, v))
    k = jnp.where((positions_BxL >= 0)[..., None, None], k, 0)  # negative positions are left padding
    log_decay_H = jnp.asarray(self.log_decay, jnp.float32)

    # No state (training from the start of a sequence): the forms skip the cross term with a zero state.
    split_over = None if mode == "recurrent" else sharding.sequence_split()
    if mode == "chunkwise" and self.kernel and split_over is None:
      out_BxLxHxV, new_state = self._fused(q, k, v, log_decay_H, state, positions_BxL, segment_ids_BxL)
    else:
      out_BxLxHxV, new_state = self._unfused(mode, q, k, v, log_decay_H, state, positions_BxL, split_over,
                                             segment_ids_BxL)
    y = rms_norm(out_BxLxHxV, self.head_norm_eps)
    if self.head_norm_scale is not None:
      y = y * self.head_norm_scale[...]
    y = checkpoint_name(y.reshape(batch, length, -1), layer_stack.MIXER_OUT)
    gate = jax.nn.swish(self.g_proj(x_BxLxD).astype(jnp.float32))
    return self.out_proj((gate * y).astype(self.dtype)), new_state

  def _fused(self, q, k, v, log_decay_H, state, positions_BxL, segment_ids_BxL=None):
    """The chunkwise form and the shared normaliser's q . z from one pass of the Pallas kernels, on each device's
    batch and head shards: (normalised float32 output, new state)."""
    qkv_axes, state_axes = ("batch", None, "heads", None), ("batch", "heads", None, None)
    kv_in = None if state is None else state["kv"]
    doc_axes = ("batch", None)  # the documents split over the batch like q
    if not self.stability_norm:
      kernel = lambda q, k, v, log_decay, kv, ids: kernels.chunkwise_retention(
          q, k, v, log_decay, self.chunk_size, kv, segment_ids=ids, precision=self.precision,
          config=self.kernel_config)
      out, kv = sharding.per_shard(kernel, [qkv_axes] * 3 + [("heads",), state_axes, doc_axes],
                                   [qkv_axes, state_axes])(q, k, v, log_decay_H, kv_in, segment_ids_BxL)
      return out.astype(jnp.float32), {"kv": kv}
    kernel = lambda q, k, v, log_decay, kv, z, ids: kernels.chunkwise_retention_with_key_sum(
        q, k, v, log_decay, self.chunk_size, kv, z, segment_ids=ids, precision=self.precision,
        config=self.kernel_config)
    z_in = None if state is None else state["key_sum"]
    out, kv, qz, key_sum = sharding.per_shard(
        kernel, [qkv_axes] * 3 + [("heads",), state_axes, ("batch", "heads", None), doc_axes],
        [qkv_axes, state_axes, ("batch", None, "heads"), ("batch", "heads", None)],
    )(q, k, v, log_decay_H, kv_in, z_in, segment_ids_BxL)
    divisor = stability.divisor(self.stability_norm_style, "chunkwise", qz, positions_BxL, log_decay_H)
    return out.astype(jnp.float32) / divisor[..., None], {"kv": kv, "key_sum": key_sum}

  def _unfused(self, mode: str, q, k, v, log_decay_H, state, positions_BxL, split_over=None, segment_ids_BxL=None):
    """The XLA form of `mode` (split over `split_over`, as in `_retention`), then the normaliser from a second call
    on a ones value column: (normalised float32 output, new state)."""
    batch, length, heads = q.shape[:3]
    kv_in = None if state is None else state["kv"]
    # torchscale's chunkwise scalars read the entry states in float32.
    torchscale_chunks = stability.torchscale_normaliser(self) and mode == "chunkwise"
    out_BxLxHxV, kv, entry_states, _ = self._retention(mode, q, k, v, log_decay_H, kv_in, split_over=split_over,
                                                       segment_ids=segment_ids_BxL,
                                                       wide_entry_states=torchscale_chunks)
    new_state = {"kv": kv}
    out_BxLxHxV = out_BxLxHxV.astype(jnp.float32)
    if self.stability_norm:
      # q_n . z_n is the retention of a ones value column, z the decayed key sum in the state. A call of its own
      # without gradient (the divisor is a constant to autodiff): XLA shares its scores with the call above, and
      # v keeps its width. Its in-chunk scores are q . k, so it also gives torchscale's chunkwise score sums.
      q_sg, k_sg = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
      ones = jnp.ones((batch, length, heads, 1), q.dtype)
      z_in = None if state is None else state["key_sum"][..., None]
      qz, key_sum, _, abs_sums = self._retention(mode, q_sg, k_sg, ones, log_decay_H, z_in, torchscale_chunks,
                                                 split_over, segment_ids_BxL)
      new_state["key_sum"] = key_sum[..., 0]
      if torchscale_chunks:
        divisor = stability.torchscale_chunkwise_divisor(abs_sums, entry_states, self.chunk_size, log_decay_H)
      else:
        divisor = stability.divisor(self.stability_norm_style, mode, qz[..., 0], positions_BxL, log_decay_H)
      out_BxLxHxV = out_BxLxHxV / jax.lax.stop_gradient(divisor)[..., None]
    return out_BxLxHxV, new_state


class GLUFeedForward(nnx.Module):
  """GLU feed-forward: (act(x W_1) * (x W_gate)) W_2."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, dtype, rngs: nnx.Rngs):
    self.activation = cfg.ffn_activation
    init = nnx.initializers.variance_scaling(1 / 3, "fan_in", "uniform")
    self.fc1 = Dense(cfg.d_model, cfg.ffn_dim, ("embed", "mlp"), init=init, dtype=dtype, rngs=rngs)
    self.gate = Dense(cfg.d_model, cfg.ffn_dim, ("embed", "mlp"), init=init, dtype=dtype, rngs=rngs)
    self.fc2 = Dense(cfg.ffn_dim, cfg.d_model, ("mlp", "embed"), init=init, dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.fc2(ACTIVATIONS[self.activation](self.fc1(x)) * self.gate(x))


class RetNetBlock(nnx.Module):
  """Pre-norm block: Y = MSR(LN(X)) + X, then X' = FFN(LN(Y)) + Y; `dtype` is the compute dtype."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, dtype, rngs: nnx.Rngs):
    self.retention_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype=dtype, rngs=rngs)
    self.retention = MultiScaleRetention(cfg, dtype=dtype, rngs=rngs)
    self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype=dtype, rngs=rngs)
    self.ffn = GLUFeedForward(cfg, dtype=dtype, rngs=rngs)

  def __call__(self, x_BxLxD, positions_BxL, rotation_tables, state: dict[str, Any] | None, mode: str,
               segment_ids_BxL=None):
    y, state = self.retention(self.retention_norm(x_BxLxD), positions_BxL, rotation_tables, state, mode,
                              segment_ids_BxL)
    x_BxLxD = x_BxLxD + y
    return x_BxLxD + self.ffn(self.ffn_norm(x_BxLxD)), state
