"""The device mesh and the logical-axis rules that map model and batch axes onto it (the only place they live).

Parameters are annotated with logical axes (`vocab`, `embed`, `heads`, `mlp`) and batches with `batch`;
`config.mesh.rules` maps each to mesh axes (`data`, `fsdp`, `tensor`), so parallelism changes by config alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from flax import nnx
from flax.core import spmd as flax_spmd  # the rules `nnx.logical_axis_rules` sets
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from retnet_jax.core import sections

LAYER_AXIS = "layers"  # the leading axis of stacked blocks' parameters (`layer_stack`)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig(sections.Section):
  """`config.mesh`: the device mesh's axes and the logical-axis rules onto them (checked when built; its sizes
  against the devices present, by `mesh_shape`, when a mesh is made)."""
  shape: tuple[int, ...] = sections.field(
      "sizes of the (data, fsdp, tensor, sequence) axes; -1 takes the remaining devices. A shape with fewer entries "
      "than axis_names gives the axes left out size 1")
  axis_names: tuple[str, ...] = sections.field("the mesh axes' names")
  rules: tuple[tuple[str, Any], ...] = sections.field(
      "logical axis -> mesh axis (or None); swap these to change the parallelism without code changes. `length` "
      "(the token axis of activations) over `sequence` > 1 splits each sequence over those devices")

  def __post_init__(self):
    logical_rules(self)


def mesh_shape(mesh_cfg: MeshConfig, num_devices: int) -> tuple[int, ...]:
  """`config.mesh.shape` with a single -1 replaced by the devices left over; checked against the count.

  A shape with fewer entries than `axis_names` gives the trailing axes size 1, so a (data, fsdp, tensor) shape
  from before the `sequence` axis keeps its meaning.
  """
  names = tuple(mesh_cfg.axis_names)
  try:
    if isinstance(mesh_cfg.shape, (str, bytes)) or any(isinstance(s, (bool, float)) for s in mesh_cfg.shape):
      raise ValueError
    shape = tuple(int(s) for s in mesh_cfg.shape)
  except (TypeError, ValueError):
    raise ValueError(f"mesh.shape={mesh_cfg.shape!r} must be a tuple of integer sizes, one per axis of "
                     f"mesh.axis_names={names} (-1: the devices left over), e.g. --config.mesh.shape='(-1,1,1,1)'."
                     ) from None
  if len(shape) > len(mesh_cfg.axis_names) or not shape:
    raise ValueError(f"mesh.shape={shape} needs one size per axis of mesh.axis_names={names} "
                     "(trailing axes left out have size 1).")
  shape += (1,) * (len(mesh_cfg.axis_names) - len(shape))
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


def make_mesh(mesh_cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
  """A mesh of Auto axes (the compiler propagates shardings between the annotated points)."""
  devices = jax.devices() if devices is None else devices
  names = tuple(mesh_cfg.axis_names)
  return jax.make_mesh(mesh_shape(mesh_cfg, len(devices)), names, axis_types=(AxisType.Auto,) * len(names),
                       devices=devices)


def logical_rules(mesh_cfg: MeshConfig) -> tuple[tuple[str, Any], ...]:
  """`config.mesh.rules` as the (logical axis, mesh axes) pairs `nnx.logical_axis_rules` takes; the layer axis of
  stacked blocks (`model.scan_layers`) is replicated unless the rules name it."""
  names, rules = tuple(mesh_cfg.axis_names), []
  for rule in mesh_cfg.rules:
    if not (isinstance(rule, (list, tuple)) and len(rule) == 2 and isinstance(rule[0], str)):
      raise ValueError(f"mesh.rules holds {rule!r}, not a (logical axis, mesh axes) pair; write each rule as "
                       "('embed', 'fsdp'), ('batch', ('data', 'fsdp')) or ('heads', None).")
    name, axes = rule
    axes = tuple(axes) if isinstance(axes, (list, tuple)) else axes
    unknown = [a for a in (axes if isinstance(axes, tuple) else (axes,)) if a is not None and a not in names]
    if unknown:
      raise ValueError(f"mesh.rules maps {name!r} to {axes!r}, but {unknown[0]!r} is not an axis of the mesh "
                       f"(mesh.axis_names={names}); name mesh axes among those, or None to replicate.")
    rules.append((name, axes))
  rules = tuple(rules)
  return rules if any(name == LAYER_AXIS for name, _ in rules) else (*rules, (LAYER_AXIS, None))


def logical_spec(axes: Sequence[str | None], rules: Sequence[tuple[str, Any]] | None = None) -> P:
  """PartitionSpec of logical `axes` under `rules` (default: the active `nnx.logical_axis_rules`).

  A name without a rule is replicated.
  """
  mapping = dict(flax_spmd.get_logical_axis_rules() if rules is None else rules)
  return P(*(mapping.get(a) if a is not None else None for a in axes))


def mesh_spec(mesh: Any, shape: Sequence[int], axes: Sequence[str | None]) -> P:
  """The active rules' spec for an array of `shape` with logical `axes`, keeping per dimension only the axes
  `mesh` has that split it evenly (others replicate): the project's rules also fit a user's own mesh."""
  spec = []
  for size, names in zip(shape, logical_spec(axes)):
    names = tuple(n for n in ((names,) if isinstance(names, str) else names or ()) if n in mesh.axis_names)
    if size % math.prod(mesh.shape[n] for n in names):
      names = ()
    spec.append(names[0] if len(names) == 1 else names or None)
  return P(*spec)


def place(value: jax.Array, axes: Sequence[str | None]) -> jax.Array:
  """A new parameter's value, under a mesh placed where the active rules put its logical `axes` (`mesh_spec`)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return value
  move = jax.sharding.reshard if mesh.are_all_axes_explicit else jax.lax.with_sharding_constraint
  return move(value, mesh_spec(mesh, value.shape, axes))


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
  """Constrains an activation to the sharding of its logical `axes` (`mesh_spec`); a no-op outside a mesh and
  rules."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not flax_spmd.get_logical_axis_rules():
    return x
  return jax.lax.with_sharding_constraint(x, mesh_spec(mesh, x.shape, axes))


def _length_axis(rules: Sequence[tuple[str, Any]] | None = None) -> str | None:
  """The mesh axis the logical `length` axis maps to under `rules` (default: the active ones), or None."""
  axes = logical_spec(("length",), rules)[0]
  axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
  if len(axes) > 1:
    raise ValueError(f"mesh.rules maps the logical axis 'length' to {axes}; sequence-parallel retention splits "
                     "sequences over one mesh axis: map it to one (e.g. ('length', 'sequence')).")
  return axes[0] if axes else None


def sequence_split() -> tuple[str, int] | None:
  """(axis name, devices) of the active mesh's axis that splits sequences (the `length` rule's, of size > 1), or
  None: where retention runs sequence-parallel."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not flax_spmd.get_logical_axis_rules():
    return None
  axis = _length_axis()
  if axis is None or axis not in mesh.axis_names or mesh.shape[axis] == 1:
    return None
  return axis, mesh.shape[axis]


def sequence_devices(mesh_cfg: MeshConfig, num_devices: int) -> int:
  """How many devices `config.mesh` splits each sequence over (1: none)."""
  axis = _length_axis(logical_rules(mesh_cfg))
  shape = dict(zip(mesh_cfg.axis_names, mesh_shape(mesh_cfg, num_devices)))
  return shape.get(axis, 1)


def per_shard(fn: Callable[..., Any], in_axes: Sequence[Sequence[str | None] | None],
              out_axes: Sequence[Sequence[str | None]]) -> Callable[..., Any]:
  """`fn` run on each device's shards of its arguments (`jax.shard_map` under the active mesh and rules; `fn`
  itself outside them): for kernels, which have no partitioning rule.

  Args:
    fn: takes arrays (or None) and returns a tuple of arrays; it must act on each shard independently along the
      axes that are split.
    in_axes: the logical axes of each argument (None for an argument passed as None). out_axes: of each output.
  """
  def call(*args):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not flax_spmd.get_logical_axis_rules():
      return fn(*args)
    given = [i for i, arg in enumerate(args) if arg is not None]

    def on_shards(*arrays):
      full = list(args)
      for i, array in zip(given, arrays):
        full[i] = array
      return fn(*full)

    outs = jax.eval_shape(fn, *args)
    return jax.shard_map(
        on_shards, check_vma=False,
        in_specs=tuple(mesh_spec(mesh, args[i].shape, in_axes[i]) for i in given),
        out_specs=tuple(mesh_spec(mesh, out.shape, axes) for out, axes in zip(outs, out_axes)),
    )(*(args[i] for i in given))
  return call


def batch_sharding(mesh: jax.sharding.Mesh, rules: Sequence[tuple[str, Any]], ndim: int = 2) -> NamedSharding:
  """Batches `[batch, ...]` split over the mesh axes the `batch` rule names."""
  return NamedSharding(mesh, logical_spec(("batch",) + (None,) * (ndim - 1), rules))


@dataclasses.dataclass(frozen=True)
class Placement:
  """A mesh and the logical-axis rules that place arrays on it: where batches go, and the context in which
  the model's annotations resolve."""
  mesh: jax.sharding.Mesh
  rules: tuple[tuple[str, Any], ...]

  @property
  def batch_sharding(self) -> NamedSharding:
    return batch_sharding(self.mesh, self.rules)

  @contextlib.contextmanager
  def active(self) -> Iterator[None]:
    """`jax.set_mesh(mesh)` and `nnx.logical_axis_rules(rules)` together."""
    with jax.set_mesh(self.mesh), nnx.logical_axis_rules(self.rules):
      yield


def placement(mesh_cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Placement:
  """The Placement of `config.mesh` on `devices` (default: all)."""
  return Placement(make_mesh(mesh_cfg, devices), logical_rules(mesh_cfg))


def check_batch_split(mesh_cfg: MeshConfig, batch_size: int, grad_accum_steps: int,
                      num_devices: int) -> None:
  """Checks that each micro-batch splits evenly over the data shards, and the shards over the processes."""
  if batch_size % grad_accum_steps:
    raise ValueError(f"train.batch_size={batch_size} is not divisible by "
                     f"train.grad_accum_steps={grad_accum_steps}; choose a divisor of the batch size.")
  shape = dict(zip(mesh_cfg.axis_names, mesh_shape(mesh_cfg, num_devices)))
  batch_axes = logical_spec(("batch",), logical_rules(mesh_cfg))[0] or ()
  batch_axes = (batch_axes,) if isinstance(batch_axes, str) else batch_axes
  shards = math.prod(shape[a] for a in batch_axes)
  micro_batch = batch_size // grad_accum_steps
  if micro_batch % shards:
    raise ValueError(f"the micro-batch of {micro_batch} sequences (train.batch_size / train.grad_accum_steps) "
                     f"is not divisible by the {shards} data shards of mesh axes {batch_axes}; choose a batch "
                     "size that is a multiple of the shard count (times grad_accum_steps).")
  if shards % jax.process_count():
    raise ValueError(f"the batch is split into {shards} data shards (mesh axes {batch_axes}) but runs on "
                     f"{jax.process_count()} processes, and each process loads only its own rows: make the sizes of "
                     f"{batch_axes} a multiple of the process count in mesh.shape={tuple(mesh_cfg.shape)}.")


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
