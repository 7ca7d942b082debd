"""The device mesh and the logical-axis rules that map model and batch axes onto it (the only place they live).

Parameters are annotated with logical axes (`vocab`, `embed`, `heads`, `mlp`) and batches with `batch`;
`config.mesh.rules` maps each to mesh axes (`data`, `fsdp`, `tensor`), so parallelism changes by config alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
from flax import nnx
from flax.core import spmd as flax_spmd  # the rules `nnx.logical_axis_rules` sets
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


def mesh_shape(mesh_cfg: ml_collections.ConfigDict, num_devices: int) -> tuple[int, ...]:
  """`config.mesh.shape` with a single -1 replaced by the devices left over; checked against the count."""
  shape = tuple(int(s) for s in mesh_cfg.shape)
  if len(shape) != len(mesh_cfg.axis_names):
    raise ValueError(f"mesh.shape={shape} needs one size per axis of mesh.axis_names={tuple(mesh_cfg.axis_names)}.")
  if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
    raise ValueError(f"mesh.shape={shape} must hold positive sizes and at most one -1; e.g. (-1, 1, 1).")
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if num_devices % known:
      raise ValueError(f"mesh.shape={shape}: {num_devices} devices cannot be split into axes of sizes {known} x "
                       "the rest; choose sizes whose product divides the device count.")
    shape = tuple(num_devices // known if s == -1 else s for s in shape)
  if math.prod(shape) != num_devices:
    raise ValueError(f"mesh.shape={shape} needs {math.prod(shape)} devices but {num_devices} are present; "
                     "make the sizes multiply to the device count, or use -1 for one axis.")
  return shape


def make_mesh(mesh_cfg: ml_collections.ConfigDict, devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
  """A mesh of Auto axes (the compiler propagates shardings between the annotated points)."""
  devices = jax.devices() if devices is None else devices
  names = tuple(mesh_cfg.axis_names)
  return jax.make_mesh(mesh_shape(mesh_cfg, len(devices)), names, axis_types=(AxisType.Auto,) * len(names),
                       devices=devices)


def logical_rules(mesh_cfg: ml_collections.ConfigDict) -> tuple[tuple[str, Any], ...]:
  """`config.mesh.rules` as the (logical axis, mesh axes) pairs `nnx.logical_axis_rules` takes."""
  return tuple((name, tuple(axes) if isinstance(axes, (list, tuple)) else axes) for name, axes in mesh_cfg.rules)


def logical_spec(axes: Sequence[str | None], rules: Sequence[tuple[str, Any]] | None = None) -> P:
  """PartitionSpec of logical `axes` under `rules` (default: the active `nnx.logical_axis_rules`).

  A name without a rule is replicated.
  """
  mapping = dict(flax_spmd.get_logical_axis_rules() if rules is None else rules)
  return P(*(mapping.get(a) if a is not None else None for a in axes))


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
  """Constrains an activation to the sharding of its logical `axes`; a no-op outside a mesh and rules."""
  if jax.sharding.get_abstract_mesh().empty or not flax_spmd.get_logical_axis_rules():
    return x
  return jax.lax.with_sharding_constraint(x, logical_spec(axes))


def batch_sharding(mesh: jax.sharding.Mesh, rules: Sequence[tuple[str, Any]], ndim: int = 2) -> NamedSharding:
  """Batches `[batch, ...]` split over the mesh axes the `batch` rule names."""
  return NamedSharding(mesh, logical_spec(("batch",) + (None,) * (ndim - 1), rules))


def tree_shardings(abstract_tree: Any, mesh: jax.sharding.Mesh, rules: Sequence[tuple[str, Any]]) -> Any:
  """NamedShardings for a pytree of annotated variables (params, optimizer moments); others replicated."""
  with nnx.logical_axis_rules(rules):
    shardings = nnx.get_named_sharding(abstract_tree, mesh)
  for (path, leaf), leaf_sharding in zip(jax.tree_util.tree_leaves_with_path(abstract_tree),
                                         jax.tree.leaves(shardings)):
    for size, axes in zip(leaf.shape, leaf_sharding.spec):
      axes = (axes,) if isinstance(axes, str) else axes or ()
      parts = math.prod(mesh.shape[a] for a in axes)
      if size % parts:
        raise ValueError(f"{jax.tree_util.keystr(path)} of shape {tuple(leaf.shape)} cannot be split over mesh "
                         f"axes {axes} ({parts} devices): {size} is not divisible by {parts}. Choose mesh sizes that "
                         "divide the model's widths (heads, value_dim, ffn_dim, vocab_size, d_model), or change "
                         "mesh.rules.")
  return shardings


def shard_model(model: nnx.Module, mesh: jax.sharding.Mesh, rules: Sequence[tuple[str, Any]]) -> nnx.Module:
  """Moves `model`'s variables (in place) to the shardings their logical axes get on `mesh`; returns it.

  Under `("heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor")` this is tensor parallelism: each device
  holds and runs a slice of the heads, the FFN and the vocabulary, and jitted calls follow those shardings.
  """
  state = nnx.state(model)
  nnx.update(model, jax.device_put(state, tree_shardings(state, mesh, rules)))
  return model
