"""Flax NNX layers every model shares: projections, RMSNorm, embedding, GLU feed-forward (the token mixers are
`retnet_jax.mixers`').

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
import numpy as np
from flax import nnx

from retnet_jax.core import config_checks, sharding
from retnet_jax.nn import matmul

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


def param(rngs: nnx.Rngs, init: nnx.Initializer, shape: tuple[int, ...], axes: tuple[str | None, ...]):
  """A float32 parameter drawn by `init` from `rngs`, annotated with logical `axes` (`fixed_param`)."""
  return fixed_param(init(rngs.params(), shape, jnp.float32), axes)


def fixed_param(value: Any, axes: tuple[str | None, ...]):
  """A float32 parameter of the given `value` (no random draw: the other parameters' draws are unchanged),
  annotated with logical `axes`; under a mesh, placed as the module docstring says."""
  value = sharding.place(jnp.asarray(value, jnp.float32), axes)
  return nnx.Param(value, out_sharding=axes, eager_sharding=False)  # placed above, not by flax's rules


def check_config(cfg: Any) -> None:
  """Raises ValueError naming the field, the bad value and the fix for the fields of the layers every model has:
  sizes, the norms' epsilon, dtypes, activation and matmul precision."""
  for name in ("d_model", "num_layers", "ffn_dim", "vocab_size"):
    config_checks.positive_int(getattr(cfg, name), f"model.{name}")
  config_checks.finite_number(cfg.norm_eps, "model.norm_eps")
  compute_dtype(cfg.dtype)
  check_activation(cfg.ffn_activation)
  check_matmul_precision(cfg.matmul_precision)
  config_checks.choice(cfg.param_dtype, "model.param_dtype", DTYPES,
                       why="the weights' dtype for evaluation, generation and export")


def check_activation(name: str) -> None:
  """Raises ValueError for an `ffn_activation` not in ACTIVATIONS."""
  config_checks.choice(name, "model.ffn_activation", ACTIVATIONS)


def check_matmul_precision(name: str) -> None:
  """Raises ValueError for a `matmul_precision` not in MATMUL_PRECISIONS."""
  config_checks.choice(name, "model.matmul_precision", MATMUL_PRECISIONS)


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
    self.kernel = param(rngs, init, (in_features, out_features), axes)
    self.dtype = dtype
    self.out_dtype = dtype if out_dtype is None else out_dtype

  def __call__(self, x_NxI: jax.Array) -> jax.Array:
    x_2d = x_NxI.reshape(-1, x_NxI.shape[-1]).astype(self.dtype)
    y = matmul.einsum("ni,io->no", x_2d, self.kernel[...].astype(self.dtype), self.out_dtype)
    return y.reshape(x_NxI.shape[:-1] + (-1,))


def rms_norm(x: jax.Array, eps: float) -> jax.Array:
  """x / sqrt(mean(x^2) + eps) over the last axis, in float32 (float64 for float64 `x`)."""
  x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
  """RMSNorm with a learned per-feature scale."""

  def __init__(self, dim: int, eps: float, *, dtype, rngs: nnx.Rngs):
    self.scale = param(rngs, nnx.initializers.ones, (dim,), ("embed",))
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
    self.embedding = param(rngs, nnx.initializers.normal(dim**-0.5), (vocab_size, dim), ("vocab", "embed"))
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


class GLUFeedForward(nnx.Module):
  """GLU feed-forward: (act(x W_1) * (x W_gate)) W_2."""

  def __init__(self, cfg: Any, *, dtype, rngs: nnx.Rngs):
    self.activation = cfg.ffn_activation
    init = nnx.initializers.variance_scaling(1 / 3, "fan_in", "uniform")
    self.fc1 = Dense(cfg.d_model, cfg.ffn_dim, ("embed", "mlp"), init=init, dtype=dtype, rngs=rngs)
    self.gate = Dense(cfg.d_model, cfg.ffn_dim, ("embed", "mlp"), init=init, dtype=dtype, rngs=rngs)
    self.fc2 = Dense(cfg.ffn_dim, cfg.d_model, ("mlp", "embed"), init=init, dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.fc2(ACTIVATIONS[self.activation](self.fc1(x)) * self.gate(x))
