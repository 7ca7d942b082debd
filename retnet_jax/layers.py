"""Flax NNX layers of RetNet: projections, RMSNorm, embedding, multi-scale retention, GLU feed-forward, block.

Parameters are float32 and carry logical axis names (`vocab`, `embed`, `heads`, `mlp`) that
`retnet_jax.sharding` maps to mesh axes; compute runs in the configured dtype with float32 accumulation.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from retnet_jax import decay, retention, rotation, sharding

MODES = ("parallel", "chunkwise", "recurrent")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "swish": jax.nn.swish,
    "relu": jax.nn.relu,
}
SCORE_CLAMP_MAX = 5e4  # upper clamp of the score normaliser, as in the official code
# stability_norm_style: one scalar that every form computes alike, or the official code's scalars per form.
NORM_STYLES = ("shared", "torchscale")


def xavier_uniform(gain: float) -> nnx.Initializer:
  return nnx.initializers.variance_scaling(gain**2, "fan_avg", "uniform")


def _param(rngs: nnx.Rngs, init: nnx.Initializer, shape: tuple[int, ...], axes: tuple[str | None, ...]):
  """A float32 parameter annotated with logical axes; sharded at creation only when a mesh is active."""
  return nnx.Param(init(rngs.params(), shape, jnp.float32), out_sharding=axes,
                   eager_sharding=not jax.sharding.get_abstract_mesh().empty)


def compute_dtype(name: str):
  if name not in DTYPES:
    raise ValueError(f"unknown dtype {name!r}; choose one of {tuple(DTYPES)}.")
  return DTYPES[name]


class Dense(nnx.Module):
  """Bias-free projection; flattens to 2-D first so XLA sees plain matmuls in both directions."""

  def __init__(self, in_features: int, out_features: int, axes, *, init, dtype, rngs: nnx.Rngs, out_dtype=None):
    self.kernel = _param(rngs, init, (in_features, out_features), axes)
    self.dtype = dtype
    self.out_dtype = dtype if out_dtype is None else out_dtype

  def __call__(self, x_NxI: jax.Array) -> jax.Array:
    x_2d = x_NxI.reshape(-1, x_NxI.shape[-1]).astype(self.dtype)
    y = jnp.dot(x_2d, self.kernel[...].astype(self.dtype), preferred_element_type=jnp.float32)
    return y.astype(self.out_dtype).reshape(x_NxI.shape[:-1] + (-1,))


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
    logits = jax.lax.dot_general(x_2d, self.embedding[...].astype(self.dtype), (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)
    return logits.reshape(x_BxLxD.shape[:-1] + (-1,))


def init_layer_state(cfg: ml_collections.ConfigDict, batch_size: int) -> dict[str, jax.Array]:
  """Zero retention state of one layer: `kv [B, H, d_k, d_v]`, plus `key_sum [B, H, d_k]` if normalised."""
  heads = cfg.num_heads
  d_k, d_v = cfg.d_model // heads, cfg.value_dim // heads
  state = {"kv": jnp.zeros((batch_size, heads, d_k, d_v), jnp.float32)}
  if cfg.stability_norm:
    state["key_sum"] = jnp.zeros((batch_size, heads, d_k), jnp.float32)
  return state


def sqrt_decay_sum(n: jax.Array, log_decay_H: jax.Array) -> jax.Array:
  """sqrt(sigma_n), sigma_n = sum_{t<=n} gamma^t = (1 - gamma^(n+1)) / (1 - gamma): `n [...]` -> `[..., H]`."""
  n = n.astype(jnp.float32)[..., None]
  return jnp.sqrt(jnp.expm1((n + 1) * log_decay_H) / jnp.expm1(log_decay_H))


class MultiScaleRetention(nnx.Module):
  """Multi-scale retention: rotated q/k, per-head decay, per-head RMSNorm, swish gate, output projection.

  With `stability_norm`, each head's raw output o_n is divided by a positive scalar per (position, head),
  which the per-head norm cancels up to its epsilon. `stability_norm_style="shared"`: sqrt(sigma_n) * c_n,
  where sigma_n = sum_{t<=n} gamma^t and c_n = clamp(|q_n . z_n| / sqrt(sigma_n), 1, 5e4) with z_n the
  decayed key sum (kept in the state). Every form computes the same scalar, so the forms agree exactly
  before and after the per-head norm, whatever its epsilon. `"torchscale"`: the official code's scalars,
  which differ between forms (see `_divisor`), to reproduce its outputs form by form.

  Positions below 0 are left padding: their keys are zeroed, so they add nothing to the state, and since
  retention depends on relative positions only, a left-padded prompt gives the same outputs as alone.
  """

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    d, heads = cfg.d_model, cfg.num_heads
    self.num_heads = heads
    self.key_dim = d // heads
    self.value_dim = cfg.value_dim // heads
    self.dtype = compute_dtype(cfg.dtype)
    self.head_norm_eps = cfg.head_norm_eps
    self.stability_norm = cfg.stability_norm
    self.stability_norm_style = cfg.stability_norm_style
    self.chunk_size = cfg.chunk_size
    self.log_decay = tuple(float(x) for x in decay.log_decay(cfg.decay_schedule, heads, cfg.decay_gammas))
    qkvg_init = xavier_uniform(2**-2.5)
    dense = lambda i, o, axes, init: Dense(i, o, axes, init=init, dtype=self.dtype, rngs=rngs)
    self.q_proj = dense(d, d, ("embed", "heads"), qkvg_init)
    self.k_proj = dense(d, d, ("embed", "heads"), qkvg_init)
    self.v_proj = dense(d, cfg.value_dim, ("embed", "heads"), qkvg_init)
    self.g_proj = dense(d, cfg.value_dim, ("embed", "heads"), qkvg_init)
    self.out_proj = dense(cfg.value_dim, d, ("heads", "embed"), xavier_uniform(2**-1))

  def _retention(self, mode: str, q, k, v, log_decay_H, state):
    if mode == "parallel":
      return retention.parallel_retention(q, k, v, log_decay_H, state)
    if mode == "chunkwise":
      return retention.chunkwise_retention(q, k, v, log_decay_H, self.chunk_size, state)
    return retention.recurrent_retention(q, k, v, log_decay_H, state)

  def _divisor(self, mode: str, qz_BxLxH, q, k, v, positions_BxL, log_decay_H, kv_in) -> jax.Array:
    """Each head's divisor of its raw output o_n: `[B, L, H]` float32, from q_n . z_n `qz [B, L, H]`.

    shared, every form: sqrt(sigma_n) * clamp(|q_n . z_n| / sqrt(sigma_n), 1, 5e4). torchscale, as its release
    0.3.0 computes it per form: parallel sqrt(sigma_n) * clamp(|q_n . z_n| / sqrt(sigma_n), 1) (the absolute
    row sum of its decayed score matrix); recurrent sqrt(sigma_n) (its state is stored divided by that);
    chunkwise, with j the position inside a chunk of size B, sqrt(sigma_j) * max(clamp(A_j / sqrt(sigma_j), 1),
    clamp(max_v sum_k |R| / sigma_(B-1), 1)), where A_j = sum_m gamma^(j-m) |q_j . k_m| over the chunk and R is
    the raw state entering the chunk (each chunk's sums are its own: a row's clamp depends on the chunking).
    """
    sqrt_sigma = sqrt_decay_sum(jnp.maximum(positions_BxL, 0), log_decay_H)
    score = jnp.abs(qz_BxLxH.astype(jnp.float32)) / sqrt_sigma
    if self.stability_norm_style == "shared":
      return sqrt_sigma * jnp.clip(score, 1.0, SCORE_CLAMP_MAX)
    if mode == "parallel":
      return sqrt_sigma * jnp.maximum(score, 1.0)
    if mode == "recurrent":
      return sqrt_sigma
    length = q.shape[1]
    size = min(self.chunk_size, length)
    sqrt_sigma_LxH = sqrt_decay_sum(jnp.arange(length) % size, log_decay_H)
    inner = jnp.maximum(retention.score_abs_sums(q, k, log_decay_H, size) / sqrt_sigma_LxH, 1.0)
    states_CxBxHxKxV, _ = retention.chunk_states(k, v, log_decay_H, size, kv_in)  # as in chunkwise_retention
    sigma_last_H = sqrt_decay_sum(jnp.asarray(size - 1), log_decay_H) ** 2
    state_abs_CxBxH = jnp.abs(states_CxBxHxKxV).sum(axis=-2).max(axis=-1)
    cross_BxCxH = jnp.maximum(jnp.moveaxis(state_abs_CxBxH, 0, 1) / sigma_last_H, 1.0)
    cross = jnp.repeat(cross_BxCxH, size, axis=1)[:, :length]
    return sqrt_sigma_LxH * jnp.maximum(inner, cross)

  def __call__(self, x_BxLxD: jax.Array, positions_BxL: jax.Array, rotation_tables, state: dict[str, jax.Array] | None,
               mode: str) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`x [B, L, D]` at `positions [B, L]` with the layer's incoming state (None: empty) -> (y, new state).

    `rotation_tables`: `rotation.rotation_tables(positions, d_model // num_heads, rotation_base)`.
    """
    batch, length, _ = x_BxLxD.shape
    heads = self.num_heads
    split = lambda y: y.reshape(batch, length, heads, -1)
    q = split(self.q_proj(x_BxLxD))
    k = split(self.k_proj(x_BxLxD)) * jnp.asarray(self.key_dim**-0.5, self.dtype)
    v = split(self.v_proj(x_BxLxD))
    q, k = rotation.rotate(q, rotation_tables), rotation.rotate(k, rotation_tables)
    k = jnp.where((positions_BxL >= 0)[..., None, None], k, 0)  # negative positions are left padding
    log_decay_H = jnp.asarray(self.log_decay, jnp.float32)

    # No state (training from the start of a sequence): the forms skip the cross term with a zero state.
    kv_in = None if state is None else state["kv"]
    out_BxLxHxV, kv = self._retention(mode, q, k, v, log_decay_H, kv_in)
    new_state = {"kv": kv}
    out_BxLxHxV = out_BxLxHxV.astype(jnp.float32)
    if self.stability_norm:
      # q_n . z_n is the retention of a ones value column, with z the decayed key sum carried in the state.
      # Computed apart from o_n and without gradient (the divisor is a constant to autodiff): XLA shares the
      # score matrix with the call above, and v keeps its width (d_v + 1 columns cost 16-18% of a step).
      q_sg, k_sg = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
      ones = jnp.ones((batch, length, heads, 1), q.dtype)
      z_in = None if state is None else state["key_sum"][..., None]
      qz, key_sum = self._retention(mode, q_sg, k_sg, ones, log_decay_H, z_in)
      new_state["key_sum"] = key_sum[..., 0]
      divisor = self._divisor(mode, qz[..., 0], q_sg, k_sg, v, positions_BxL, log_decay_H, kv_in)
      out_BxLxHxV = out_BxLxHxV / jax.lax.stop_gradient(divisor)[..., None]

    y = rms_norm(out_BxLxHxV, self.head_norm_eps).reshape(batch, length, -1)
    gate = jax.nn.swish(self.g_proj(x_BxLxD).astype(jnp.float32))
    return self.out_proj((gate * y).astype(self.dtype)), new_state


class GLUFeedForward(nnx.Module):
  """GLU feed-forward: (act(x W_1) * (x W_gate)) W_2."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    if cfg.ffn_activation not in ACTIVATIONS:
      raise ValueError(f"unknown ffn_activation {cfg.ffn_activation!r}; choose one of {tuple(ACTIVATIONS)}.")
    self.activation = cfg.ffn_activation
    dtype = compute_dtype(cfg.dtype)
    init = nnx.initializers.variance_scaling(1 / 3, "fan_in", "uniform")
    self.fc1 = Dense(cfg.d_model, cfg.ffn_dim, ("embed", "mlp"), init=init, dtype=dtype, rngs=rngs)
    self.gate = Dense(cfg.d_model, cfg.ffn_dim, ("embed", "mlp"), init=init, dtype=dtype, rngs=rngs)
    self.fc2 = Dense(cfg.ffn_dim, cfg.d_model, ("mlp", "embed"), init=init, dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.fc2(ACTIVATIONS[self.activation](self.fc1(x)) * self.gate(x))


class RetNetBlock(nnx.Module):
  """Pre-norm block: Y = MSR(LN(X)) + X, then X' = FFN(LN(Y)) + Y."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    dtype = compute_dtype(cfg.dtype)
    self.retention_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype=dtype, rngs=rngs)
    self.retention = MultiScaleRetention(cfg, rngs=rngs)
    self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype=dtype, rngs=rngs)
    self.ffn = GLUFeedForward(cfg, rngs=rngs)

  def __call__(self, x_BxLxD, positions_BxL, rotation_tables, state: dict[str, Any] | None, mode: str):
    y, state = self.retention(self.retention_norm(x_BxLxD), positions_BxL, rotation_tables, state, mode)
    x_BxLxD = x_BxLxD + y
    return x_BxLxD + self.ffn(self.ffn_norm(x_BxLxD)), state
