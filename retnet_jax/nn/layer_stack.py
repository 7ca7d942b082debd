"""A model's stack of blocks: one module per layer, or (`model.scan_layers`) one module whose parameters carry a
leading layer axis, run under `jax.lax.scan` so that compile time stops growing with depth; remat in either.
Blocks of several structures (a hybrid's retention and attention blocks) are stacked by their period: the shortest
run of blocks whose structures repeat through the stack (a `Group`) is the scanned unit, one group per step.

    blocks = build(lambda rngs, layer: model.Block(cfg, mixer, ...), cfg.num_layers, cfg.scan_layers, rngs)
    x, layer_states = run(blocks, x, layer_states, call, remat)  # call(block, x, layer_state) -> (x, layer_state)
    tree = relayout(tree, scanned=True)  # parameters, optimizer moments: one layout to the other

Both layouts initialise the same values from the same seed (a scanned stack is the unrolled blocks stacked), and
carried states stay a list of per-layer states at the model's edge.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from retnet_jax.core import sharding

LAYER_AXIS = sharding.LAYER_AXIS  # the logical name of the stacked axis (replicated unless `mesh.rules` names it)
BLOCKS = "blocks"  # the attribute that holds the stack in every model
GROUP = "layers"  # the attribute of a `Group` holding its blocks (a stacked state keyed so is grouped)
# Activations named with `jax.ad_checkpoint.checkpoint_name` in the blocks, for the policies that keep them.
QKV, MIXER_OUT = "qkv_proj", "mixer_out"  # query/key/value projections; the token mixer's output (retention's
# normalised heads, or attention's), before the gate and output projection
_cp = jax.checkpoint_policies
# `train.remat`: what each block keeps for the backward pass instead of recomputing it (MaxText's set).
REMAT_POLICIES = {
    "full": None,  # keep only the block input
    "dots_saveable": _cp.dots_saveable,  # keep every matmul output
    "dots_with_no_batch_dims_saveable": _cp.dots_with_no_batch_dims_saveable,  # keep matmuls without batch dims
    "save_mixer_out": _cp.save_only_these_names(MIXER_OUT),
    "save_qkv_mixer_out": _cp.save_only_these_names(QKV, MIXER_OUT),
    "offload_qkv_mixer_out": _cp.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=(QKV, MIXER_OUT), offload_src="device",
        offload_dst="pinned_host"),  # kept in host memory between the passes
}
OFFLOADING = ("offload_qkv_mixer_out",)


def check_remat(remat: str, devices: Sequence[Any] = (), field: str = "remat") -> None:
  """Raises ValueError naming `field` for an unknown policy, or one that offloads where `devices` have no host
  memory."""
  if remat != "none" and remat not in REMAT_POLICIES:
    raise ValueError(f"unknown {field} {remat!r}; choose none or one of {tuple(REMAT_POLICIES)}.")
  for device in devices if remat in OFFLOADING else ():
    kinds = {memory.kind for memory in device.addressable_memories()}  # none listed: a compile-only device
    if kinds and "pinned_host" not in kinds:
      raise ValueError(f"{field}={remat!r} offloads to host memory, which {device.platform} devices here do not "
                       f"expose (memory kinds {sorted(kinds)}); choose save_qkv_mixer_out or another policy.")


class Group(nnx.Module):
  """A period of consecutive blocks of different structures: what a scan over a hybrid's blocks stacks."""

  def __init__(self, blocks: Sequence[nnx.Module]):
    setattr(self, GROUP, nnx.List(blocks))


def build(make_block: Callable[[nnx.Rngs, int], nnx.Module], num_layers: int, scanned: bool, rngs: nnx.Rngs
          ) -> nnx.Module:
  """`num_layers` blocks from `make_block(rngs, layer)`, in order: an `nnx.List`, or with `scanned` one block (or
  `Group` of blocks, for blocks of several structures) whose parameters are theirs stacked on a leading axis (logical
  name `LAYER_AXIS`)."""
  blocks = [make_block(rngs, layer) for layer in range(num_layers)]
  if not scanned:
    return nnx.List(blocks)
  stacked = relayout(nnx.State({BLOCKS: {i: nnx.state(b).raw_mapping for i, b in enumerate(blocks)}}), True)
  period = len(stacked[BLOCKS][GROUP]) if GROUP in stacked[BLOCKS] else 1  # as relayout grouped them
  graphdef, *_ = nnx.split(blocks[0] if period == 1 else Group(blocks[:period]))
  stacked = jax.tree.map(lambda v: v.replace(sharding.place(v.get_value(), v.get_metadata()["out_sharding"])),
                         stacked, is_leaf=_is_variable)
  return nnx.merge(graphdef, stacked[BLOCKS])


def is_scanned(blocks: nnx.Module) -> bool:
  return not isinstance(blocks, nnx.List)


def as_layout(model: nnx.Module, scanned: bool) -> nnx.Module:
  """`model` (built from `model.config`) with its blocks in the scanned or the unrolled layout: the same
  parameters, moved (itself when already so). Conversions read and write the unrolled layout through it."""
  if is_scanned(model.blocks) == scanned:
    return model
  cfg = model.config.replace(scan_layers=scanned)
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: type(model)(cfg, rngs=nnx.Rngs(0))))
  return nnx.merge(graphdef, relayout(nnx.state(model), scanned))


def run(blocks: nnx.Module, x: jax.Array, layer_states: Sequence[Any], call: Callable[..., tuple[jax.Array, Any]],
        remat: str) -> tuple[jax.Array, list[Any]]:
  """Runs `x` through the blocks in order: `x, layer_state = call(block, x, layer_state)` per layer, each block
  under the remat policy named `remat` (`none`: plain). Scanned blocks run in a scan, but for decoding (one token a
  row, with states): layer by layer, so that the states are not stacked into the scan and out of it at every token.

  Args:
    blocks: what `build` returned.
    x: the carried activation.
    layer_states: one state per layer (None entries: no state).
    call: one block's step; what else it needs (positions, the mode) it closes over.
    remat: `none` or a REMAT_POLICIES key.
  Returns:
    (x after the last block, the list of new layer states).
  """
  check_remat(remat)
  scanned = is_scanned(blocks)
  if remat != "none":  # in a scan CSE cannot merge the recomputation with the forward pass, so it need not be blocked
    call = nnx.remat(call, policy=REMAT_POLICIES[remat], prevent_cse=not scanned)
  if not scanned:
    out = []
    for block, layer_state in zip(blocks, layer_states):
      x, layer_state = call(block, x, layer_state)
      out.append(layer_state)
    return x, out
  num_layers = len(layer_states)
  period = len(getattr(blocks, GROUP)) if isinstance(blocks, Group) else 1
  graphdef, params = nnx.split(blocks)

  def body(x, group):  # one group's blocks, merged from its slice of the parameters, with its layers' states
    group_params, group_states = group
    merged = nnx.merge(graphdef, group_params)
    states = []
    for j, block in enumerate(getattr(merged, GROUP) if period > 1 else [merged]):
      x, layer_state = call(block, x, None if group_states is None else group_states[j])
      states.append(layer_state)
    return x, tuple(states)

  if x.shape[1] == 1 and any(s is not None for s in layer_states):
    # Decoding: the scan would stack every layer's state before it and unstack it after, copying a KV cache per
    # token; group by group instead, each one's parameters a slice of the stack, the states update in place.
    out = []
    for g in range(num_layers // period):
      x, states = body(x, (jax.tree.map(lambda p, g=g: p[g], params), layer_states[g * period:(g + 1) * period]))
      out.extend(states)
    return x, out
  # Per position in a group, the states of that position's layers stacked over the groups.
  given = None if all(s is None for s in layer_states) else tuple(
      jax.tree.map(lambda *s: jnp.stack(s), *layer_states[j::period]) for j in range(period))
  x, stacked = jax.lax.scan(body, x, (params, given))
  return x, [jax.tree.map(lambda s, g=i // period: s[g], stacked[i % period]) for i in range(num_layers)]


# Parameters and optimizer moments between the layouts.

def _holds_blocks(node: Any) -> bool:
  return isinstance(node, Mapping) and BLOCKS in node


def _unrolled(blocks: Mapping) -> bool:
  return all(isinstance(k, int) or str(k).isdigit() for k in blocks)


def relayout(tree: Any, scanned: bool, delete_source: bool = False) -> Any:
  """`tree` (parameters, a train state, or their `jax.ShapeDtypeStruct`s) with every model's blocks in the scanned
  (stacked) or the unrolled layout; already so, unchanged.

  Arrays keep their shardings' other axes (the layer axis replicated); with `delete_source` each source array is
  deleted once moved, so the conversion holds at most one parameter's copies twice.
  """
  def convert(node):
    # nnx.State holds nested plain dicts (it wraps them on access): the new tree is built from those.
    raw = dict(node.raw_mapping if isinstance(node, nnx.State) else node) if _holds_blocks(node) else None
    if raw is None or _unrolled(raw[BLOCKS]) != scanned:
      return node
    raw[BLOCKS] = _stack(raw[BLOCKS], delete_source) if scanned else _unstack(raw[BLOCKS], delete_source)
    return type(node)(raw)
  return jax.tree.map(convert, tree, is_leaf=_holds_blocks)


def _is_variable(node: Any) -> bool:
  return isinstance(node, nnx.Variable)


def _period(layers: Sequence[Any]) -> int:
  """The shortest p dividing the layer count such that layer i has layer i mod p's structure (1: one structure)."""
  structures = [jax.tree.structure(layer, is_leaf=_is_variable) for layer in layers]
  return next(p for p in range(1, len(layers) + 1)
              if len(layers) % p == 0 and all(s == structures[i % p] for i, s in enumerate(structures)))


def _stack(blocks: Mapping, delete_source: bool) -> Any:
  layers = [blocks[k] for k in sorted(blocks, key=int)]
  period = _period(layers)
  if period > 1:  # a Group's state: each position's layers stacked over the groups
    return {GROUP: {j: _stack(dict(enumerate(layers[j::period])), delete_source) for j in range(period)}}

  def stack(*leaves):
    if _is_variable(leaves[0]):  # the value stacked, the layer axis added to its logical axes
      variable = leaves[0].replace(stack(*(leaf.get_value() for leaf in leaves)))
      if (axes := variable.get_metadata().get("out_sharding")) is not None:
        variable.set_metadata(out_sharding=(LAYER_AXIS, *axes))
      return variable
    if isinstance(leaves[0], jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct((len(leaves), *leaves[0].shape), leaves[0].dtype,
                                  sharding=_with_layer_axis(leaves[0].sharding))
    out = jnp.stack(leaves)
    if (target := _with_layer_axis(getattr(leaves[0], "sharding", None))) is not None:
      out = jax.device_put(out, target)
    if delete_source:
      for leaf in leaves:
        leaf.delete()
    return out
  return jax.tree.map(stack, *layers, is_leaf=_is_variable)


def _unstack(blocks: Mapping, delete_source: bool) -> Any:
  if GROUP in blocks:  # a Group's state: position j of group g is layer g * period + j
    positions = [blocks[GROUP][k] for k in sorted(blocks[GROUP], key=int)]
    period = len(positions)
    layers_by_position = [_unstack(position, delete_source) for position in positions]
    return type(blocks)({g * period + j: layer for j, layers in enumerate(layers_by_position)
                         for g, layer in layers.items()})
  num_layers = jax.tree.leaves(blocks)[0].shape[0]

  def split(leaf):
    if _is_variable(leaf):  # the layer axis dropped from its logical axes
      axes = leaf.get_metadata().get("out_sharding")
      parts = [leaf.replace(value) for value in split(leaf.get_value())]
      for part in parts if axes and axes[0] == LAYER_AXIS else ():
        part.set_metadata(out_sharding=tuple(axes[1:]))
      return parts
    if isinstance(leaf, jax.ShapeDtypeStruct):
      part = jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype, sharding=_without_layer_axis(leaf.sharding))
      return [part] * num_layers
    target = _without_layer_axis(getattr(leaf, "sharding", None))
    parts = [leaf[i] if target is None else jax.device_put(leaf[i], target) for i in range(num_layers)]
    if delete_source:
      leaf.delete()
    return parts
  treedef = jax.tree.structure(blocks, is_leaf=_is_variable)
  parts = treedef.flatten_up_to(jax.tree.map(split, blocks, is_leaf=_is_variable))
  return type(blocks)({i: jax.tree.unflatten(treedef, [p[i] for p in parts]) for i in range(num_layers)})


def _with_layer_axis(placement: Any) -> Any:
  if not isinstance(placement, NamedSharding):
    return placement
  return NamedSharding(placement.mesh, P(None, *placement.spec), memory_kind=placement.memory_kind)


def _without_layer_axis(placement: Any) -> Any:
  if not isinstance(placement, NamedSharding):
    return placement
  return NamedSharding(placement.mesh, P(*placement.spec[1:]), memory_kind=placement.memory_kind)


def stored_layout(flat_keys: Sequence[str], sep: str = "/") -> bool | None:
  """Whether flat keys (`"params/blocks/ffn/..."`) hold scanned blocks (True), unrolled ones (False), or no
  blocks (None)."""
  for key in flat_keys:
    parts = key.split(sep)
    if BLOCKS in parts[:-1]:
      return not parts[parts.index(BLOCKS) + 1].isdigit()
  return None
