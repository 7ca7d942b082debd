"""The pure train step, and the compiled init, train and eval steps of one (config, mesh).

    run = train_step.setup(config, mesh)   # compiled once per process for equal (model, train, mesh, seed)
    with run.placement.active():
      state = run.init()
      state, metrics = run.train_step(state, batch)  # tokens [B, L + 1], or (tokens, loss weights [B, L])
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from retnet_jax.core import sharding
from retnet_jax.nn import layer_stack
from retnet_jax.training import losses, optimizer, run_config, train_state

if TYPE_CHECKING:
  from retnet_jax.training.train_config import TrainConfig


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, train_cfg: TrainConfig):
  """A pure `train_step(state, batch) -> (state, metrics)`; micro-batches accumulate in a `lax.scan`.

  The batch is a `losses.Batch`: with loss weights, each micro-batch's loss is its weighted mean and the step's
  loss their mean (the synthetic sources give every row as many answers, so this is the batch's weighted mean).
  A non-finite loss or gradient leaves the parameters and optimizer state as they were; the step is counted.
  """
  schedule = optimizer.learning_rate_schedule(train_cfg)
  accum = train_cfg.grad_accum_steps
  loss_and_grad = jax.value_and_grad(
      lambda params, batch: losses.token_loss(graphdef, params, batch, train_cfg.mode, train_cfg.remat,
                                              train_cfg.segment_len, train_cfg.loss_tile))

  def train_step(state: train_state.TrainState, batch: losses.Batch):
    params = state.params
    if accum == 1:
      loss, grads = loss_and_grad(params, batch)
    else:
      # Micro-batch i takes rows i, i + accum, ...: each device keeps its own rows (no resharding).
      micro_batches = jax.tree.map(
          lambda x_BxN: x_BxN.reshape(x_BxN.shape[0] // accum, accum, *x_BxN.shape[1:]).swapaxes(0, 1), batch)

      def accumulate(carry, micro_batch):
        loss_sum, grad_sum = carry
        loss, grads = loss_and_grad(params, micro_batch)
        return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

      zeros = jax.tree.map(jnp.zeros_like, params)
      (loss, grads), _ = jax.lax.scan(accumulate, (jnp.zeros((), jnp.float32), zeros), micro_batches)
      loss, grads = loss / accum, jax.tree.map(lambda g: g / accum, grads)
    step = state.step + 1
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, opt_state = tx.update(grads, state.opt_state, params)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    new_state = train_state.TrainState(
        params=keep(optax.apply_updates(params, updates), params),
        opt_state=keep(opt_state, state.opt_state),
        step=step,
        nonfinite_steps=state.nonfinite_steps + (~finite).astype(jnp.int32),
        first_nonfinite_step=jnp.where((state.first_nonfinite_step < 0) & ~finite, step, state.first_nonfinite_step),
    )
    return new_state, {"loss": loss, "grad_norm": grad_norm, "learning_rate": schedule(state.step)}

  return train_step


@dataclasses.dataclass(frozen=True)
class Setup(train_state.Layout):
  """A layout with its jitted functions: `init()`, `train_step(state, batch)`, `eval_step(params, batch)`."""
  init: Callable[[], train_state.TrainState]
  train_step: Callable[[train_state.TrainState, losses.Batch], tuple[train_state.TrainState, dict[str, jax.Array]]]
  eval_step: Callable[[Any, losses.Batch], jax.Array]


def setup(config: run_config.Config, mesh: jax.sharding.Mesh) -> Setup:
  """The Setup for (config, mesh); equal model, train, mesh and seed fields reuse one (and its compilations).

  Args:
    config: the typed config (`run_config.build` of the user's config or of config.json's dict).
    mesh: the devices it runs on (`sharding.make_mesh(config.mesh)`).
  """
  if not isinstance(config, run_config.Config):
    raise TypeError(f"train_step.setup takes the typed config; got a {type(config).__name__}: pass "
                    "run_config.build(config).")
  return _build_setup(StepFields(config.model, config.train, config.mesh, config.seed), mesh)


class StepFields(NamedTuple):
  """The fields of a config that a Setup depends on (its cache key): equal ones share the compilations."""
  model: Any
  train: TrainConfig
  mesh: Any
  seed: int


@functools.lru_cache(maxsize=16)
def _build_setup(config: StepFields, mesh: jax.sharding.Mesh) -> Setup:
  layer_stack.check_remat(config.train.remat, mesh.devices.flat[:1], field="train.remat")
  layout = train_state.make_layout(config, sharding.Placement(mesh, sharding.logical_rules(config.mesh)))
  shardings, batch_sharding = layout.shardings, layout.placement.batch_sharding
  graphdef, mode = layout.graphdef, config.train.mode
  return Setup(
      **{f.name: getattr(layout, f.name) for f in dataclasses.fields(train_state.Layout)},
      init=train_state.init_fn(config, layout),
      train_step=jax.jit(make_train_step(graphdef, layout.tx, config.train), in_shardings=(shardings, batch_sharding),
                         out_shardings=(shardings, None), donate_argnums=0),
      eval_step=jax.jit(lambda params, batch: losses.token_loss(graphdef, params, batch, mode,
                                                                loss_tile=config.train.loss_tile),
                        in_shardings=(shardings.params, batch_sharding)))
