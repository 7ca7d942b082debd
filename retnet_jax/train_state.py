"""The train state's layout: its structure and shardings on a mesh, sharded creation, and restore from a workdir.

    layout = train_state.make_layout(config, placement)  # shapes and shardings only: nothing runs
    state = train_state.init(config, layout)              # created sharded, in place
    model, step = train_state.restore_model(config, workdir)

The state is the pytree `{"params", "opt_state", "step", "nonfinite_steps", "first_nonfinite_step"}`. Nothing
here builds a train step: evaluation, generation and conversion use the layout without compiling one.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from retnet_jax import architectures, checkpointing, layers, optimizer, sharding

TrainState = dict[str, Any]
# Model fields that may change between a checkpoint and its resumption: they change how, not what, it computes.
RESUMABLE_MODEL_CHANGES = ("dtype", "chunk_size", "matmul_precision", "retention_impl", "max_len")
# Model fields added since checkpoints were first written -> the value a checkpoint without the field was trained
# with (the model's behaviour before the field existed).
ADDED_MODEL_FIELDS = {"num_kv_heads": None, "rotation_pairs": "interleaved", "rotation_freqs": "linspace",
                      "head_norm_scale": False, "architecture": "retnet"}


def check_config(config: ml_collections.ConfigDict, num_devices: int) -> None:
  """Checks what the state and its batches need (model, optimizer, mesh and batch split) before any work."""
  architectures.check_config(config.model)
  if config.model.architecture == "retnet":
    layers.check_retention_impl(config.model)
  train = config.train
  for name in ("batch_size", "seq_len", "grad_accum_steps"):
    if int(train[name]) < 1:
      raise ValueError(f"train.{name} must be a positive integer; got {train[name]}.")
  optimizer.check_config(train)
  sharding.check_batch_split(config.mesh, train.batch_size, train.grad_accum_steps, num_devices)
  segment = train.segment_len if 0 < train.segment_len < train.seq_len else train.seq_len
  check_sequence_split(config, num_devices, segment, (train.mode,))


def check_sequence_split(config: ml_collections.ConfigDict, num_devices: int, length: int, modes=()) -> None:
  """Where `config.mesh` splits each sequence over several devices: checks that calls of `length` tokens in
  `modes` can be split so (whole chunks per device, not the recurrent form, not the kernels)."""
  devices = sharding.sequence_devices(config.mesh, num_devices)
  if devices == 1:
    return
  where = f"config.mesh splits each sequence over {devices} devices (mesh.shape={tuple(config.mesh.shape)})"
  if config.model.architecture != "retnet":
    raise ValueError(f"{where}, but only retention splits sequences (sequence-parallel attention is not built): "
                     "give the Transformer a mesh whose sequence axis has size 1.")
  if "recurrent" in modes:
    raise ValueError(f"{where}, which the recurrent form (one token after another) cannot use: use the parallel "
                     "or chunkwise mode, or a mesh whose sequence axis has size 1.")
  if config.model.retention_impl == "pallas":
    raise ValueError(f"{where}, but the Pallas kernels run whole sequences only: use model.retention_impl='xla' "
                     "(or 'auto', which runs XLA's form where sequences are split).")
  if length % (devices * config.model.chunk_size):
    raise ValueError(f"{where} in whole chunks, so the {length} tokens of each call must be a multiple of "
                     f"{devices} x model.chunk_size {config.model.chunk_size} = {devices * config.model.chunk_size}: "
                     "change train.seq_len (or train.segment_len), the chunk size or the sequence axis's size.")


@dataclasses.dataclass(frozen=True)
class Layout:
  """The train state of one config on one placement: model structure and abstract state with shardings."""
  placement: sharding.Placement
  graphdef: nnx.GraphDef
  abstract_state: TrainState  # jax.ShapeDtypeStructs carrying the mesh's shardings

  @property
  def shardings(self) -> Any:
    return jax.tree.map(lambda leaf: leaf.sharding, self.abstract_state)


def _fresh_state(tx: optax.GradientTransformation, params: nnx.State) -> TrainState:
  """Step 0 around `params`: a zero optimizer state and counters."""
  return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32),
          "nonfinite_steps": jnp.zeros((), jnp.int32), "first_nonfinite_step": jnp.full((), -1, jnp.int32)}


def _init_fn(config: ml_collections.ConfigDict) -> Callable[[], TrainState]:
  """The pure function that creates a fresh state, parameters drawn from `config.seed`."""
  tx = optimizer.make_optimizer(config.train)
  return lambda: _fresh_state(tx, nnx.state(architectures.build(config.model, rngs=nnx.Rngs(config.seed)), nnx.Param))


def make_layout(config: ml_collections.ConfigDict, placement: sharding.Placement) -> Layout:
  """The state's structure and shardings for `config` on `placement`, traced abstractly (nothing runs)."""
  with placement.active():
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: architectures.build(config.model, rngs=nnx.Rngs(0))))
    abstract = jax.eval_shape(_init_fn(config))
  shardings = sharding.tree_shardings(abstract, placement.mesh, placement.rules)
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
  return Layout(placement, graphdef, abstract)


def init_fn(config: ml_collections.ConfigDict, layout: Layout) -> Callable[[], TrainState]:
  """A jitted `init() -> state` that creates every array directly with its sharding (compiled on first call)."""
  return jax.jit(_init_fn(config), out_shardings=layout.shardings)


def from_params(config: ml_collections.ConfigDict, layout: Layout, params: nnx.State) -> TrainState:
  """A fresh state (step 0, zero optimizer state) around `params`, placed with the layout's shardings."""
  placed = jax.tree.map(lambda leaf: leaf, layout.abstract_state["params"])
  nnx.replace_by_pure_dict(placed, nnx.to_pure_dict(params))
  placed = jax.device_put(placed, layout.shardings["params"])
  tx = optimizer.make_optimizer(config.train)
  with layout.placement.active():
    return jax.jit(lambda p: _fresh_state(tx, p), out_shardings=layout.shardings)(placed)


def check_compatible(saved_model: dict, config: ml_collections.ConfigDict, workdir: str | os.PathLike) -> None:
  """Refuses a checkpoint written with another model config, naming the fields (before anything is overwritten)."""
  workdir = Path(workdir)
  current = config.model.to_dict()
  saved_model = {**{k: v for k, v in ADDED_MODEL_FIELDS.items() if k in current}, **saved_model}
  differs = sorted(k for k in set(saved_model) | set(current)
                   if k not in RESUMABLE_MODEL_CHANGES
                   and json.dumps(saved_model.get(k)) != json.dumps(current.get(k)))
  if "architecture" in differs:  # the other fields differ as a consequence
    differs = ["architecture"]
  if differs:
    details = ", ".join(f"model.{k}: checkpoint {saved_model.get(k)!r} vs config {current.get(k)!r}"
                        for k in differs)
    raise ValueError(f"{workdir} holds a checkpoint of an incompatible model config ({details}); use the model "
                     f"config it was trained with ({workdir / 'config.json'}), or another --workdir for a new run.")


def restore_model(config: ml_collections.ConfigDict, workdir: str | os.PathLike, step: int | None = None
                  ) -> tuple[architectures.Model, int]:
  """The model of `workdir` at `step` (None: the latest), placed on `config.mesh` over the devices present.

  Reads the training checkpoints (`checkpoints/STEP`), or, in a workdir that has none, the parameters-only
  export that training writes at its end (`params/STEP`), checked against the workdir's `config.json`.

  Returns:
    (model, step).
  """
  workdir = Path(workdir)
  ckpt_dir, export_dir = workdir / "checkpoints", workdir / "params"
  has_checkpoints = ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir())
  exported = sorted(int(p.name) for p in export_dir.iterdir() if p.name.isdigit()) if export_dir.is_dir() else []
  if not has_checkpoints and not exported:
    raise FileNotFoundError(f"no checkpoints in {workdir} (expected {ckpt_dir} or {export_dir}); train first "
                            f"with scripts/train.py --workdir={workdir}, or point --workdir at a training run.")
  check_config(config, jax.device_count())
  layout = make_layout(config, sharding.placement(config.mesh))
  if has_checkpoints:
    with checkpointing.Checkpointer(ckpt_dir, read_only=True) as checkpointer:  # the workdir may be training
      state = _restore_state(config, layout, checkpointer, step)
    return nnx.merge(layout.graphdef, state["params"]), int(state["step"])
  if step is None:
    step = exported[-1]
  elif step not in exported:
    raise ValueError(f"No exported params for step {step} in {export_dir} (and no {ckpt_dir}); "
                     f"available steps: {exported}.")
  config_file = workdir / "config.json"
  if config_file.is_file():
    check_compatible(json.loads(config_file.read_text())["model"], config, workdir)
  try:
    params = checkpointing.load_params(export_dir / str(step), layout.abstract_state["params"])
  except checkpointing.IncompatibleCheckpointError:
    raise
  except Exception as e:  # a truncated or damaged export: orbax and TensorStore raise many kinds
    raise ValueError(f"the params export {export_dir / str(step)} is unreadable ({type(e).__name__}: "
                     f"{_first_line(e)}); choose another with --step (available steps: {exported}), or restore "
                     "from checkpoints/.") from e
  return nnx.merge(layout.graphdef, params), step


def _first_line(error: Exception) -> str:
  """The first line of an error's message (TensorStore appends pages of its spec)."""
  return (str(error).strip().splitlines() or [""])[0]


def _restore_state(config: ml_collections.ConfigDict, layout: Layout, checkpointer: checkpointing.Checkpointer,
                   requested: int | None, attempts: int = 10) -> TrainState:
  """The state of checkpoint `requested` (None: the latest). A training run in the same workdir may delete a
  step while it is read (its retention policy, as newer steps arrive): the latest is then resolved again."""
  ckpt_dir = Path(checkpointer.directory)
  for attempt in range(1, attempts + 1):
    step, steps = checkpointer.resolve(requested), checkpointer.all_steps()
    try:
      saved_model = checkpointer.restore_meta(step)["config"]["model"]
    except Exception as e:  # orbax raises many kinds for a damaged step folder
      error = e
    else:
      check_compatible(saved_model, config, ckpt_dir.parent)
      try:
        return checkpointer.restore(layout.abstract_state, step)[0]
      except checkpointing.IncompatibleCheckpointError:
        raise
      except Exception as e:
        error = e
    checkpointer.reload()
    if requested is not None or attempt == attempts or checkpointer.latest_step() == step:
      raise _unreadable(ckpt_dir, step, steps, error) from error


def _unreadable(ckpt_dir: Path, step: int, steps: list[int], error: Exception) -> ValueError:
  return ValueError(f"checkpoint {step} in {ckpt_dir} is unreadable ({type(error).__name__}: {_first_line(error)}); "
                    f"choose another with --step (available steps: {steps}).")
