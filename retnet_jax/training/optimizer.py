"""AdamW with warm-up and linear or cosine decay, global-norm clipping, no weight decay on norm scales; its first
moment in float32 or bfloat16 (`train.optimizer_state_dtype`)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from retnet_jax.core import config_checks, sharding

# The train section (`train_config.TrainConfig`, which checks itself through `check_config`): its fields by name.
TrainConfig = Any

SCHEDULES = ("cosine", "linear")
# `train.optimizer_state_dtype` -> the dtype of AdamW's first moment (optax's `mu_dtype`). The second moment stays
# float32: in bfloat16 its small squared gradients would round away against the large ones.
STATE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Optimizer fields of `config.train`: (test, what the value must be).
RANGES = {
    "learning_rate": (lambda x: x > 0, "positive"),
    "warmup_steps": (lambda x: x >= 0, "at least 0"),
    "end_lr_fraction": (lambda x: 0 <= x <= 1, "in [0, 1]"),
    "b1": (lambda x: 0 <= x < 1, "in [0, 1)"),
    "b2": (lambda x: 0 <= x < 1, "in [0, 1)"),
    "weight_decay": (lambda x: x >= 0, "at least 0"),
    "grad_clip_norm": (lambda x: x > 0, "positive"),
}


def check_config(train_cfg: TrainConfig) -> None:
  """Raises ValueError naming the first optimizer field out of its range, an unknown schedule or state dtype."""
  for name, (valid, requirement) in RANGES.items():
    value = getattr(train_cfg, name)
    if not math.isfinite(value) or not valid(value):
      raise ValueError(f"train.{name} must be {requirement}; got {value}.")
  learning_rate_schedule(train_cfg)
  config_checks.choice(train_cfg.optimizer_state_dtype, "train.optimizer_state_dtype", STATE_DTYPES)


def learning_rate_schedule(train_cfg: TrainConfig) -> optax.Schedule:
  """Linear warm-up from 0 to `learning_rate`, then linear or cosine decay to `end_lr_fraction` of it."""
  peak, warmup, steps = train_cfg.learning_rate, train_cfg.warmup_steps, train_cfg.steps
  end = peak * train_cfg.end_lr_fraction
  if train_cfg.lr_schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(steps, warmup + 1), end)
  if train_cfg.lr_schedule == "linear":
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup),
                                 optax.linear_schedule(peak, end, max(steps - warmup, 1))], [warmup])
  raise ValueError(f"unknown train.lr_schedule {train_cfg.lr_schedule!r}; choose one of {SCHEDULES}.")


def decay_mask(params):
  """Weight decay on matrices only: norm scales (and any bias or vector) are left alone, in either layout of the
  layers: a scanned stack's parameters carry a leading layer axis (`sharding.LAYER_AXIS` among their logical axes),
  which makes a stack of norm scales 2-D without making it a matrix."""
  def is_matrix(leaf):
    if not isinstance(leaf, nnx.Variable):
      return leaf.ndim >= 2
    stacked = sharding.LAYER_AXIS in (leaf.get_metadata().get("out_sharding") or ())
    return leaf.replace(leaf.get_value().ndim - stacked >= 2)
  return jax.tree.map(is_matrix, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(train_cfg: TrainConfig) -> optax.GradientTransformation:
  """The paper's recipe: AdamW (0.9, 0.98), weight decay 0.05, warm-up then decay; clipped gradients. The first
  moment is held in `train.optimizer_state_dtype` (its update computed in float32), the second in float32."""
  return optax.chain(
      optax.clip_by_global_norm(train_cfg.grad_clip_norm),
      optax.adamw(learning_rate_schedule(train_cfg), b1=train_cfg.b1, b2=train_cfg.b2,
                  weight_decay=train_cfg.weight_decay, mask=decay_mask,
                  mu_dtype=STATE_DTYPES[train_cfg.optimizer_state_dtype]),
  )
