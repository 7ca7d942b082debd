"""Training checkpoints and parameter exports on Orbax; the only module of the package that imports orbax.

    with Checkpointer(workdir / "checkpoints", keep=3, keep_best=True) as ckpt:
      ckpt.save(step, state, {"data_position": ..., "config": config.to_dict()}, eval_loss=loss)
      state, meta = ckpt.restore(abstract_state)  # shardings and dtypes come from abstract_state

Checkpoints are orbax step folders `<directory>/<step>` holding the array pytree (`state`) and a JSON dict
(`meta`). Arrays restore straight into the shardings of the abstract state, so a checkpoint written on one mesh
loads on any other; they are read in the dtypes they were written in (checked against their checksums), then cast
to the abstract state's.
"""

from __future__ import annotations

import errno
import glob
import json
import math
import os
import shutil
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from retnet_jax.core import host_memory
from retnet_jax.nn import layer_stack
from retnet_jax.training import integrity, orbax_logs, write_errors

_ORBAX_DIR = os.path.dirname(os.path.dirname(os.path.abspath(ocp.__file__))) + os.sep
_METRIC = "eval_loss"
_ITEMS = ("state", "meta")  # the items of a step folder (the handler registry's): the arrays, the JSON meta


class IncompatibleCheckpointError(ValueError):
  """The checkpoint was written with another model config: its model fields or its arrays differ."""


def _check_compatible(abstract_state: Any, stored_metadata: Any, location: str, partial: bool = False) -> None:
  """Raises ValueError at the first array whose key or shape differs from the checkpoint's stored metadata (with
  `partial`, the checkpoint may hold more arrays than `abstract_state`).

  Checked before restoring, because orbax's own error for a mismatch does not say which model config is at fault.
  """
  stored = {key: getattr(meta, "shape", None)
            for key, meta in ocp.tree.to_flat_dict(stored_metadata or {}, sep="/").items()}
  if not stored:
    raise ValueError(f"The checkpoint at {location} holds no array metadata: it is damaged or incomplete.")
  expected = {key: tuple(leaf.shape) for key, leaf in ocp.tree.to_flat_dict(abstract_state, sep="/").items()}
  for key, shape in expected.items():
    if key not in stored:
      problem = f"key {key!r} with shape {shape} is missing from the checkpoint"
    elif stored[key] is not None and tuple(stored[key]) != shape:
      problem = f"key {key!r} has shape {tuple(stored[key])} in the checkpoint but {shape} in the model"
    else:
      continue
    break
  else:
    extra = [key for key in stored if key not in expected]
    if partial or not extra:
      return
    problem = f"the checkpoint has key {extra[0]!r} that the model lacks"
  raise IncompatibleCheckpointError(
      f"The checkpoint at {location} does not fit the state this config builds: {problem}. It was written with "
      "another model config (or code version): restore with the config it was trained with (its meta holds it), "
      "or start a fresh directory.")


def _as_stored(abstract_tree: Any, stored_metadata: Any) -> tuple[Any, bool | None]:
  """`abstract_tree` as the checkpoint holds it: in the layout of blocks it was written in (`model.scan_layers`
  either way) and with its arrays' dtypes (read as written, so that their checksums hold), and the layout to
  convert the arrays read into: True scanned, False unrolled, None when the layouts agree."""
  stored = layer_stack.stored_layout(list(ocp.tree.to_flat_dict(stored_metadata or {}, sep="/")))
  wanted = layer_stack.stored_layout(list(ocp.tree.to_flat_dict(abstract_tree, sep="/")))
  scanned = None if stored is None or wanted is None or stored == wanted else wanted
  read_as = abstract_tree if scanned is None else layer_stack.relayout(abstract_tree, scanned=stored)
  dtypes = {key: meta.dtype for key, meta in ocp.tree.to_flat_dict(stored_metadata or {}, sep="/").items()
            if hasattr(meta, "dtype")}
  leaves = [jax.ShapeDtypeStruct(leaf.shape, dtypes.get(key, leaf.dtype), sharding=leaf.sharding)
            for key, leaf in ocp.tree.to_flat_dict(read_as, sep="/").items()]  # in the order of the tree's leaves
  return jax.tree.unflatten(jax.tree.structure(read_as), leaves), scanned


def _as_wanted(tree: Any, scanned: bool | None, abstract_tree: Any) -> Any:
  """The arrays read as the checkpoint holds them moved into the `scanned` layout (None: as read) and cast to the
  dtypes of `abstract_tree` (e.g. a changed `train.optimizer_state_dtype`, or `model.param_dtype` for evaluation),
  one at a time: each source array is deleted once converted."""
  tree = tree if scanned is None else layer_stack.relayout(tree, scanned, delete_source=True)

  def cast(array: jax.Array, wanted: jax.ShapeDtypeStruct) -> jax.Array:
    if array.dtype == wanted.dtype:
      return array
    converted = array.astype(wanted.dtype)
    array.delete()
    return converted

  return jax.tree.map(cast, tree, abstract_tree)


def _listed(list_steps: Callable[[], Any], directory: str, attempts: int = 10) -> Any:
  """`list_steps()`, again while a step folder it listed vanishes before orbax reads its metadata: a training run
  deletes old steps (its retention policy) as new ones arrive."""
  for _ in range(attempts - 1):
    try:
      return list_steps()
    except FileNotFoundError as e:
      if e.filename is None or os.path.dirname(os.path.abspath(os.fspath(e.filename))) != directory:
        raise
  return list_steps()


def _check_free_space(directory: str, state: Any) -> None:
  """OSError(ENOSPC) unless the disk of `directory` has room for this process's part of `state` uncompressed:
  a save that starts on a full disk fails inside orbax's threads, half-written."""
  needed = sum(shard.data.nbytes for leaf in jax.tree.leaves(state) if isinstance(leaf, jax.Array)
               for shard in leaf.addressable_shards if shard.replica_id == 0)
  free = shutil.disk_usage(directory).free
  if free < needed:
    raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: {free / 2**20:.1f} MiB free, the checkpoint "
                                f"needs up to {needed / 2**20:.1f} MiB")


def _read_arrays(directory: str, abstract_tree: Any, stored_metadata: Any, partial: bool = False) -> Any:
  """The arrays of `abstract_tree` (with `partial`, a part of the tree saved) from the orbax pytree at `directory`,
  placed with its shardings.

  Each array passes through host buffers (the bytes read, the array decoded) before it is placed; read all at
  once, as orbax does by default, they would hold about twice the arrays' bytes at the peak. Here at most the
  largest stored array's bytes are in flight (smaller arrays are read together up to that size), and the
  buffers go back to the system when freed (`host_memory.one_off_buffers`).
  """
  largest = max((math.prod(meta.shape) * jnp.dtype(meta.dtype).itemsize
                 for meta in ocp.tree.to_flat_dict(stored_metadata).values() if hasattr(meta, "dtype")), default=0)
  handler = ocp.PyTreeCheckpointHandler(restore_concurrent_gb=(largest + 1) / 1e9)
  args = ocp.args.PyTreeRestore(item=abstract_tree, partial_restore=partial,
                                restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_tree))
  with host_memory.one_off_buffers(), ocp.Checkpointer(handler) as checkpointer:
    return checkpointer.restore(directory, args=args)


class Checkpointer:
  """Keeps the last `keep` training checkpoints (plus the lowest `eval_loss` one with `keep_best`).

  Saves run in the background when `async_save`; a step still being written is never reported by `latest_step`
  or `all_steps`, and `restore` waits for it. Leftover temporary folders of a crashed save are ignored, and
  removed by a writer. With `read_only` (evaluation, generation, notebooks: a workdir that may be training) it
  only reads: it writes, deletes and cleans up nothing, so the training process's saves in flight are untouched.
  """

  def __init__(self, directory: str | os.PathLike, *, keep: int = 3, keep_best: bool = False,
               async_save: bool = True, read_only: bool = False):
    if keep < 1:
      raise ValueError(f"keep must be at least 1 (the latest checkpoint is needed to resume); got {keep}.")
    orbax_logs.quiet(_ORBAX_DIR)
    self.directory = os.path.abspath(directory)
    self.read_only = read_only
    registry = ocp.handlers.create_default_handler_registry(
        state=ocp.handlers.StandardCheckpointHandler(), meta=ocp.handlers.JsonCheckpointHandler())
    self._pending_step = None
    self._error: write_errors.CheckpointWriteError | None = None
    if read_only:
      options = ocp.CheckpointManagerOptions(read_only=True, create=False, cleanup_tmp_directories=False,
                                             enable_async_checkpointing=False, save_interval_steps=0)
      self._manager = _listed(lambda: ocp.CheckpointManager(self.directory, options=options,
                                                            handler_registry=registry), self.directory)
      return
    best_fn = (lambda metrics: metrics[_METRIC]) if keep_best else None
    policies = [ocp.checkpoint_managers.LatestN(n=keep)]
    if keep_best:  # reverse: rank by descending loss, so the one kept (the last) has the lowest
      policies.append(ocp.checkpoint_managers.BestN(
          get_metric_fn=best_fn, reverse=True, n=1, keep_checkpoints_without_metrics=False))
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
        # best_fn makes orbax write the metrics into each step folder, so the best step survives a restart.
        best_fn=best_fn, best_mode="min",
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options, handler_registry=registry)
    # Held open while this object lives, the directory keeps its inode when deleted: one recreated in its place
    # (by a save in flight) cannot reuse the number and pass for it.
    self._directory_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
    weakref.finalize(self, os.close, self._directory_fd)

  def vanished(self) -> bool:
    """Whether the directory was deleted, or replaced by another, since this writer opened it."""
    try:
      return not os.path.samestat(os.fstat(self._directory_fd), os.stat(self.directory))
    except FileNotFoundError:
      return True

  def save(self, step: int, state: Any, meta: dict, *, eval_loss: float | None = None,
           force: bool = False) -> bool:
    """Starts saving `state` (a pytree of arrays) and the JSON-able `meta` at `step`; returns whether it started.

    Without `force`, a step not above the latest saved one is skipped (orbax's rule); with `force`, an existing
    step raises ValueError rather than being overwritten.
    """
    self._check_writable("save")
    self.wait()  # a failed background save of the previous step is reported as that step's
    meta = {**meta, "checksums": integrity.checksums(state)}  # verified by `restore`
    metrics = None if eval_loss is None else {_METRIC: float(eval_loss)}
    try:
      _check_free_space(self.directory, state)
      started = self._manager.save(
          step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
          metrics=metrics, force=force)
    except OSError as e:
      raise self._failed(step, e) from e
    if started:
      self._pending_step = step
    return started

  def check_for_errors(self) -> None:
    """Raises write_errors.CheckpointWriteError if a background save has failed; does not wait for one in progress."""
    if not self._manager.is_saving_in_progress():
      self.wait()

  def all_steps(self) -> list[int]:
    """Committed steps, ascending."""
    pending = self._pending_step if self._manager.is_saving_in_progress() else None
    return sorted(step for step in self._manager.all_steps() if step != pending)

  def latest_step(self) -> int | None:
    """The newest committed step, or None when there is none."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def resolve(self, step: int | None) -> int:
    """Waits for pending saves, then checks `step` (None: the latest) against the committed steps."""
    self.wait()
    steps = self.all_steps()
    if not steps:
      raise FileNotFoundError(f"No checkpoint in {self.directory}.")
    if step is None:
      return steps[-1]
    if step not in steps:
      raise ValueError(f"No checkpoint for step {step} in {self.directory}; available steps: {steps}.")
    return step

  def restore(self, abstract_state: Any, step: int | None = None, *, partial: bool = False) -> tuple[Any, dict]:
    """(state, meta) of `step` (None: the latest), every array placed with the sharding and cast to the dtype in
    `abstract_state`.

    `abstract_state` is a pytree of `jax.ShapeDtypeStruct` with `.sharding` set, shaped like the saved state, or
    with `partial` like a part of it (e.g. `{"params": ...}`): only that part's arrays are read and verified.
    Raises `integrity.DamagedCheckpointError` when the arrays read differ from the checksums saved with them.
    """
    step = self.resolve(step)
    location = os.path.join(self.directory, str(step))
    stored = self._manager.metadata(step).item_metadata["state"]
    read_as, scanned = _as_stored(abstract_state, stored)
    _check_compatible(read_as, stored, location, partial)
    meta = dict(self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
    state = _read_arrays(os.path.join(location, "state"), read_as, stored, partial)
    integrity.verify(meta.pop("checksums", None), state, f"the checkpoint at {location}")
    return _as_wanted(state, scanned, abstract_state), meta

  def set_aside(self, step: int) -> str:
    """Renames an unreadable step folder to `<step>.corrupt` (`<step>.corrupt.1`, ... if that step was set aside
    before): kept for inspection, no longer a checkpoint. Returns the new path. A step folder holding neither of
    this class's items (`state`, `meta`) is not its to rename: ValueError naming it and the fix."""
    self._check_writable("set a step aside")
    self.wait()
    source = os.path.join(self.directory, str(step))
    found = os.listdir(source)
    if not set(found) & set(_ITEMS):
      raise ValueError(f"{source} is not a checkpoint this project wrote (it holds {sorted(found)[:3]}, not "
                       f"{' and '.join(_ITEMS)}); move it out of {self.directory}, or choose another --workdir.")
    target, copies = f"{source}.corrupt", 0
    while os.path.lexists(target):
      copies += 1
      target = f"{source}.corrupt.{copies}"
    os.replace(source, target)
    self.reload()
    return target

  def restore_meta(self, step: int | None = None) -> dict:
    """Only the JSON meta of `step` (None: the latest); reads no arrays."""
    step = self.resolve(step)
    meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    return {k: v for k, v in meta.items() if k != "checksums"}

  def reload(self) -> None:
    """Lists the steps on disk again (another process may have written or deleted some)."""
    _listed(self._manager.reload, self.directory)

  def wait(self) -> None:
    """Blocks until background saves are committed (and old steps deleted); write_errors.CheckpointWriteError if one
    failed."""
    if self._error is not None:
      raise self._error
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # orbax's background save re-raises whatever failed in it
      raise self._failed(self._pending_step, e) from e

  def _failed(self, step: int | None, cause: BaseException) -> write_errors.CheckpointWriteError:
    """Records the first failed write; every later call that would write reports it again."""
    self._error = write_errors.CheckpointWriteError(step, self.directory, cause)
    return self._error

  def _check_writable(self, action: str) -> None:
    if self.read_only:
      raise ValueError(f"cannot {action} in {self.directory}: this Checkpointer is read-only.")

  def close(self) -> None:
    """Waits for pending saves and releases orbax's threads; a failed save is raised here unless it already was."""
    reported = self._error is not None
    try:
      self.wait()
    except write_errors.CheckpointWriteError:
      try:
        self._manager.close()  # re-raises the failed save before releasing what it can
      except Exception:  # pylint: disable=broad-exception-caught
        pass
      if not reported:
        raise
      return
    self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


_EXPORT_CHECKSUMS = "checksums.json"  # beside orbax's files in an export folder


def export_params(directory: str | os.PathLike, params: Any, replace: bool = False) -> bool:
  """Writes a params-only pytree to `directory` for evaluation and generation, with the checksums `load_params`
  verifies (written last: an export without them is an interrupted one).

  An export already at `directory` whose checksums are those of `params` is kept; any other is replaced with
  `replace` (the caller owns it: a stale or interrupted export), else refused (FileExistsError). A write that fails
  (a full disk) leaves nothing there and raises write_errors.ExportWriteError naming `directory` and the cause.
  Returns whether it wrote.
  """
  orbax_logs.quiet(_ORBAX_DIR)
  directory = os.path.abspath(directory)
  sums = integrity.checksums(params)
  if os.path.lexists(directory):
    if exported_checksums(directory) == sums:
      return False
    if not replace:
      raise FileExistsError(f"{directory} exists and holds other params; export into a new folder.")
    if jax.process_index() == 0:
      shutil.rmtree(directory)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"removed {directory}")  # before any process writes there
  try:
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(directory, params)  # closing waits for the write to commit
    if jax.process_index() == 0:
      with open(os.path.join(directory, _EXPORT_CHECKSUMS), "w", encoding="utf-8") as file:
        json.dump(sums, file)
  except Exception as e:  # orbax and TensorStore raise many kinds (a full disk: RESOURCE_EXHAUSTED)
    for partial in [directory, *glob.glob(f"{glob.escape(directory)}.orbax-checkpoint-tmp*")]:
      shutil.rmtree(partial, ignore_errors=True)  # so that a rerun exports again
    code, reason = write_errors.write_failure(e)
    raise write_errors.ExportWriteError(f"could not export the parameters to {directory}: {reason}", code) from e
  return True


def exported_checksums(directory: str | os.PathLike) -> dict[str, int] | None:
  """The checksums an export at `directory` was written with, or None where it has none (an interrupted export, or
  not one) or they cannot be read."""
  try:
    with open(os.path.join(directory, _EXPORT_CHECKSUMS), encoding="utf-8") as file:
      sums = json.load(file)
  except (OSError, ValueError):
    return None
  return sums if isinstance(sums, dict) else None


def load_params(directory: str | os.PathLike, abstract_params: Any) -> Any:
  """Reads params written by `export_params`, placed with the shardings and cast to the dtypes in `abstract_params`;
  verifies them against the export's checksums (`integrity.DamagedCheckpointError`, also where it has none)."""
  directory = os.path.abspath(directory)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"No exported params at {directory}.")
  orbax_logs.quiet(_ORBAX_DIR)
  with ocp.StandardCheckpointer() as checkpointer:
    stored = checkpointer.metadata(directory).item_metadata
  read_as, scanned = _as_stored(abstract_params, stored)
  _check_compatible(read_as, stored, directory)
  sums = exported_checksums(directory)
  if sums is None:
    raise integrity.DamagedCheckpointError(
        f"the params export at {directory} has no readable {_EXPORT_CHECKSUMS} (its export was interrupted): it "
        "cannot be verified; run the training command again to export it anew from checkpoints/.")
  params = _read_arrays(directory, read_as, stored)
  integrity.verify(sums, params, f"the params export at {directory}")
  return _as_wanted(params, scanned, abstract_params)
