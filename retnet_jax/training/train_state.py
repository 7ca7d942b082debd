"""The train state's layout: its structure and shardings on a mesh, sharded creation, and restore from a workdir.

    layout = train_state.make_layout(config, placement)  # shapes and shardings only: nothing runs
    state = train_state.init(config, layout)              # created sharded, in place
    model, step = train_state.restore_model(config, workdir)  # the parameters alone (in model.param_dtype)

The state is a `TrainState(params, opt_state, step, nonfinite_steps, first_nonfinite_step)`; checkpoints hold it as
the dict of those fields (`TrainState.saved`), as they always have. Nothing here builds a train step: evaluation,
generation and conversion use the layout without compiling one.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from retnet_jax.core import sharding
from retnet_jax.models import architectures, model as model_lib
from retnet_jax.nn import layers
from retnet_jax.training import optimizer, run_checkpoints, run_config
from retnet_jax.training.run_config import Config


class TrainState(NamedTuple):
  """What training carries from step to step: the model's parameters (an `nnx.State`, float32 masters), the
  optimizer's state, the steps done, and the non-finite steps skipped and the first of them (-1: none)."""
  params: Any
  opt_state: Any
  step: jax.Array
  nonfinite_steps: jax.Array
  first_nonfinite_step: jax.Array

  def saved(self) -> dict[str, Any]:
    """The tree a checkpoint holds: a dict of the fields by name (checkpoints' layout, and their checksums' keys)."""
    return self._asdict()

  @classmethod
  def from_saved(cls, tree: dict[str, Any]) -> "TrainState":
    """The state of a checkpoint's tree (`saved`'s layout)."""
    return cls(**tree)


def check_devices(config: Config, num_devices: int) -> None:
  """Checks what the state and its batches need from the devices present (the kernels' backend, the sequence and
  batch splits over the mesh) before any work; `run_config.build` checked the config itself."""
  train = config.train
  architectures.check_backend(config.model)
  architectures.check_mesh_split(config.model, config.mesh, num_devices, train.segment, (train.mode,))
  sharding.check_batch_split(config.mesh, train.batch_size, train.grad_accum_steps, num_devices)


@dataclasses.dataclass(frozen=True)
class Layout:
  """The train state of one config on one placement: model structure and abstract state with shardings."""
  placement: sharding.Placement
  graphdef: nnx.GraphDef
  tx: optax.GradientTransformation  # the optimizer whose state the train state holds
  abstract_state: TrainState  # jax.ShapeDtypeStructs carrying the mesh's shardings

  @property
  def shardings(self) -> Any:
    return jax.tree.map(lambda leaf: leaf.sharding, self.abstract_state)


def fresh_state(tx: optax.GradientTransformation, params: nnx.State) -> TrainState:
  """Step 0 around `params`: a zero optimizer state and counters."""
  return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32),
                    jnp.full((), -1, jnp.int32))


def _init_fn(config: Config, tx: optax.GradientTransformation) -> Callable[[], TrainState]:
  """The pure function that creates a fresh state for `tx`, parameters drawn from `config.seed`."""
  return lambda: fresh_state(tx, nnx.state(model_lib.Model(config.model, rngs=nnx.Rngs(config.seed)), nnx.Param))


def model_layout(config: Config, placement: sharding.Placement) -> tuple[nnx.GraphDef, nnx.State]:
  """The model's structure and its parameters as `jax.ShapeDtypeStruct`s with their shardings on `placement`, in
  `model.param_dtype` (training's float32 masters as evaluation, generation and export hold them), traced
  abstractly (nothing runs; no optimizer: what evaluation restores)."""
  dtype = layers.compute_dtype(config.model.param_dtype)
  with placement.active():
    graphdef, params = nnx.split(nnx.eval_shape(lambda: model_lib.Model(config.model, rngs=nnx.Rngs(0))))
  shardings = sharding.tree_shardings(params, placement.mesh, placement.rules)
  return graphdef, jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, dtype, sharding=s), params, shardings)


def make_layout(config: Config, placement: sharding.Placement) -> Layout:
  """The state's structure and shardings for `config` on `placement` (its optimizer built once, here), traced
  abstractly (nothing runs)."""
  tx = optimizer.make_optimizer(config.train)
  init = _init_fn(config, tx)
  graphdef, _ = model_layout(config, placement)
  with placement.active():
    abstract = jax.eval_shape(init)
  shardings = sharding.tree_shardings(abstract, placement.mesh, placement.rules)
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
  return Layout(placement, graphdef, tx, abstract)


def init_fn(config: Config, layout: Layout) -> Callable[[], TrainState]:
  """A jitted `init() -> state` that creates every array directly with its sharding (compiled on first call)."""
  return jax.jit(_init_fn(config, layout.tx), out_shardings=layout.shardings)


def from_params(layout: Layout, params: nnx.State) -> TrainState:
  """A fresh state (step 0, zero optimizer state) around `params`, placed with the layout's shardings."""
  placed = jax.tree.map(lambda leaf: leaf, layout.abstract_state.params)
  nnx.replace_by_pure_dict(placed, nnx.to_pure_dict(params))
  placed = jax.device_put(placed, layout.shardings.params)
  with layout.placement.active():
    return jax.jit(lambda p: fresh_state(layout.tx, p), out_shardings=layout.shardings)(placed)


def restore_model(config: Config | Any, workdir: str | os.PathLike, step: int | None = None
                  ) -> tuple[model_lib.Model, int]:
  """The model of `workdir` at `step` (None: the newest that reads back whole), placed on `config.mesh` over the
  devices present, its parameters cast to `model.param_dtype` (every one: matrices, embeddings and norm scales).
  Only its parameters are read (`run_checkpoints.read_params`): no optimizer is built or restored.

  Returns:
    (model, step).
  """
  config = run_config.build(config)
  check_devices(config, jax.device_count())
  graphdef, abstract_params = model_layout(config, sharding.placement(config.mesh))
  params, step = run_checkpoints.read_params(workdir, config, abstract_params, step)
  return nnx.merge(graphdef, params), step
