"""The optimizer: AdamW's state dtypes (`train.optimizer_state_dtype`), the float32 default as plain optax AdamW."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs import retnet as retnet_config
from retnet_jax.nn import layer_stack
from retnet_jax.training import optimizer
from tests.helpers import tiny_model


def adam_state(opt_state) -> optax.ScaleByAdamState:
  """The AdamW moments in `make_optimizer`'s chain (clipping, then AdamW)."""
  return opt_state[1][0]


def updated(tx, params, steps=3):
  """The state of optimizer `tx` and the parameters after `steps` updates by fixed gradients, compiled as one program
  (eagerly, each operation on each parameter dispatches on its own)."""
  @jax.jit
  def run(params):
    opt_state = tx.init(params)
    for step in range(steps):
      grads = jax.tree.map(lambda p: jnp.sin(p * (step + 1)) * 0.1, params)
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
    return opt_state, params
  return run(params)


def test_bfloat16_state_holds_the_first_moment_in_bfloat16_and_the_second_in_float32():
  config = retnet_config.get_config("tiny")
  config.train.optimizer_state_dtype = "bfloat16"
  opt_state, params = updated(optimizer.make_optimizer(config.train), nnx.state(tiny_model(), nnx.Param))
  moments = adam_state(opt_state)
  assert {leaf.dtype for leaf in jax.tree.leaves(moments.mu)} == {jnp.dtype(jnp.bfloat16)}
  assert {leaf.dtype for leaf in jax.tree.leaves(moments.nu)} == {jnp.dtype(jnp.float32)}
  assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}  # the masters stay float32
  assert any(float(jnp.max(jnp.abs(leaf))) > 0 for leaf in jax.tree.leaves(moments.mu))


def test_float32_state_is_plain_adamw_bit_for_bit():
  """The default adds nothing to optax's AdamW: the same states and parameters to the bit."""
  train_cfg = retnet_config.get_config("tiny").train
  assert train_cfg.optimizer_state_dtype == "float32"
  params = nnx.state(tiny_model(), nnx.Param)
  plain = optax.chain(optax.clip_by_global_norm(train_cfg.grad_clip_norm),
                      optax.adamw(optimizer.learning_rate_schedule(train_cfg), b1=train_cfg.b1, b2=train_cfg.b2,
                                  weight_decay=train_cfg.weight_decay, mask=optimizer.decay_mask))
  got_tree, want_tree = (updated(tx, params) for tx in (optimizer.make_optimizer(train_cfg), plain))
  for got, want in zip(jax.tree.leaves(got_tree), jax.tree.leaves(want_tree)):
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_an_unknown_state_dtype_is_refused_with_the_choices():
  train_cfg = retnet_config.get_config("tiny").train
  train_cfg.optimizer_state_dtype = "float16"
  with pytest.raises(ValueError, match=r"unknown train.optimizer_state_dtype 'float16'; choose one of "
                                       r"\('float32', 'bfloat16'\)"):
    optimizer.check_config(train_cfg)


@pytest.mark.parametrize("overrides", [{}, {"attention_layers": (1,)}], ids=["retnet", "hybrid"])
def test_weight_decay_takes_the_same_parameters_in_either_layout_of_the_layers(overrides):
  """Scanned layers stack each norm scale into [layers, d]: still a vector per layer, so still not decayed. An
  update with zero gradients is weight decay alone: it leaves the norm scales and moves every matrix, in both
  layouts, by the same amounts."""
  train_cfg = retnet_config.get_config("tiny").train
  tx = optimizer.make_optimizer(train_cfg)
  update = jax.jit(tx.update)
  moved = {}
  for scanned in (False, True):
    params = nnx.state(tiny_model(scan_layers=scanned, **overrides), nnx.Param)
    after, opt_state = params, tx.init(params)
    for _ in range(2):  # the warm-up's first step has a learning rate of 0
      updates, opt_state = update(jax.tree.map(jnp.zeros_like, after), opt_state, after)
      after = optax.apply_updates(after, updates)
    change = layer_stack.relayout(jax.tree.map(jnp.subtract, after, params), scanned=False)  # layer by layer
    moved[scanned] = {jax.tree_util.keystr(path): bool(jnp.any(leaf != 0))
                      for path, leaf in jax.tree_util.tree_leaves_with_path(change)}
  assert moved[True] == moved[False]
  assert not any(flag for path, flag in moved[True].items() if "scale" in path)
  assert all(flag for path, flag in moved[True].items() if "kernel" in path or "embedding" in path)
