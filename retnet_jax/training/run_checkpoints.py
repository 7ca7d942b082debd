"""A run's checkpoints read by one policy: the newest step that reads back whole, a checkpoint of another model
config refused by name, the parameters alone for readers, and the params export that training ends with.

    step, (state, meta) = restore_newest(checkpointer, config, lambda step: checkpointer.restore(abstract, step))
    params, step = read_params(workdir, config, abstract_params)  # evaluation: the parameters alone

Training (the writer) and evaluation, generation, lm-eval and conversion (readers) choose their step by the one
policy of `restore_newest`. Where each file of a run lives is `retnet_jax.runs.workdir`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from retnet_jax.runs import workdir as workdir_lib
from retnet_jax.training import checkpointing, metrics

if TYPE_CHECKING:
  from retnet_jax.training.run_config import Config

T = TypeVar("T")

# Model fields that may change between a checkpoint and its resumption: they change how, not what, it computes
# (`param_dtype`: the dtype evaluation, generation and export cast the float32 weights to).
RESUMABLE_MODEL_CHANGES = ("dtype", "chunk_size", "matmul_precision", "retention_impl", "kernel_layout", "max_len",
                           "scan_layers", "attention_max_len", "param_dtype")
# Model fields added since checkpoints were first written -> the value a checkpoint without the field was trained
# with (the model's behaviour before the field existed).
ADDED_MODEL_FIELDS = {"num_kv_heads": None, "rotation_pairs": "interleaved", "rotation_freqs": "linspace",
                      "head_norm_scale": False, "architecture": "retnet", "mixer": "retention", "attention_layers": (),
                      "attention_num_heads": None, "attention_num_kv_heads": None, "attention_window": None,
                      "attention_rotation_base": 10000.0, "kernel_layout": "fused",
                      "gate_logit_normalizer": 16.0, "gate_init": "yoco"}


def check_compatible(saved_model: dict, config: Config, workdir: str | os.PathLike) -> None:
  """Refuses (IncompatibleCheckpointError) a checkpoint written with another model config, naming the fields."""
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
    raise checkpointing.IncompatibleCheckpointError(
        f"{workdir} holds a checkpoint of an incompatible model config ({details}); use the model config it was "
        f"trained with ({workdir_lib.config_file(workdir)}), or another --workdir for a new run.")


def restore_newest(checkpointer: checkpointing.Checkpointer, config: Config,
                   read: Callable[[int], T], step: int | None = None, attempts: int = 10) -> tuple[int, T] | None:
  """`(step, read(step))` of checkpoint `step`, or (None) of the newest step that reads back whole.

  A step's meta is checked first: a checkpoint of another model config is refused by name (`check_compatible`),
  as is one whose arrays do not fit the config's (nothing older fits either). A step that does not read back
  whole (meta or arrays unreadable, or unlike their checksums) is, for the writer (`checkpointer` not read-only:
  the training process), set aside as `STEP.corrupt` with a warning and the previous step read; for a reader,
  named in a ValueError with the steps to choose from, unless a training run deleted it while it was read (its
  retention policy, as newer steps arrive): the newest is then resolved again, up to `attempts` times.

  Returns:
    `(step, read(step))`; None for the writer when no step is left (a fresh start).
  """
  workdir = Path(checkpointer.directory).parent
  attempt = 0
  while True:
    attempt += 1
    if not checkpointer.read_only and not checkpointer.all_steps():
      return None
    current, steps = checkpointer.resolve(step), checkpointer.all_steps()
    try:
      check_compatible(checkpointer.restore_meta(current)["config"]["model"], config, workdir)
      return current, read(current)
    except checkpointing.IncompatibleCheckpointError:
      raise
    except Exception as e:  # orbax and TensorStore raise many kinds for a damaged step folder
      error = e
    if not checkpointer.read_only:
      target = checkpointer.set_aside(current)
      metrics.log(f"WARNING: checkpoint {current} is unreadable ({type(error).__name__}: {_first_line(error)}); "
                  f"moved to {target}, trying the previous one")
      continue
    checkpointer.reload()
    if step is not None or attempt == attempts or checkpointer.latest_step() == current:
      raise ValueError(f"checkpoint {current} in {checkpointer.directory} is unreadable ({type(error).__name__}: "
                       f"{_first_line(error)}); choose another with --step (available steps: {steps}).") from error


def read_params(workdir: str | os.PathLike, config: Config, abstract_params: Any,
                step: int | None = None) -> tuple[Any, int]:
  """The parameters of `workdir` at `step` (None: the newest that reads back whole), placed as `abstract_params`.

  Reads the parameters alone (no optimizer state) of the training checkpoints, or, in a workdir that has none,
  the params export that training writes at its end, checked against the workdir's config.json.

  Args:
    workdir: a training run's (or a conversion's) directory; it may be training meanwhile.
    config: the full config; a checkpoint of another model config is refused by name.
    abstract_params: the parameters' `jax.ShapeDtypeStruct`s with shardings (`train_state.model_layout`).
    step: the checkpoint step (None: the newest).
  Returns:
    (params, step).
  """
  if not isinstance(workdir, (str, os.PathLike)) or not os.fspath(workdir):
    raise TypeError(f"workdir must be a run's directory (a str or path); got {workdir!r}.")
  if step is not None and (isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0):
    raise ValueError(f"step={step!r} must be a checkpoint step, a non-negative int (or None: the newest).")
  ckpt_dir, exported = workdir_lib.checkpoint_dir(workdir), workdir_lib.exported_steps(workdir)
  if workdir_lib.has_checkpoints(workdir):
    with checkpointing.Checkpointer(ckpt_dir, read_only=True) as checkpointer:
      step, params = restore_newest(checkpointer, config, lambda s: checkpointer.restore(
          {"params": abstract_params}, s, partial=True)[0]["params"], step)
    return params, step
  export = workdir_lib.export_dir(workdir, 0).parent
  if not exported:
    raise FileNotFoundError(f"no checkpoints in {workdir} (expected {ckpt_dir} or {export}); train first "
                            f"with scripts/train.py --workdir={workdir}, or point --workdir at a training run.")
  if step is None:
    step = exported[-1]
  elif step not in exported:
    raise ValueError(f"No exported params for step {step} in {export} (and no {ckpt_dir}); "
                     f"available steps: {exported}.")
  if workdir_lib.config_file(workdir).is_file():
    check_compatible(json.loads(workdir_lib.config_file(workdir).read_text())["model"], config, workdir)
  try:
    return checkpointing.load_params(workdir_lib.export_dir(workdir, step), abstract_params), step
  except checkpointing.IncompatibleCheckpointError:
    raise
  except Exception as e:  # a truncated or damaged export: orbax and TensorStore raise many kinds
    raise ValueError(f"the params export {workdir_lib.export_dir(workdir, step)} is unreadable ({type(e).__name__}: "
                     f"{_first_line(e)}); choose another with --step (available steps: {exported}), or restore "
                     "from checkpoints/.") from e


def export_params(workdir: str | os.PathLike, step: int, params: Any) -> Path:
  """Exports `params` of `step` to `workdir.export_dir` for readers, unless it holds these params already (their
  checksums agree). One there of other params (the run retrained after its checkpoints/ was deleted) or without
  checksums (an interrupted export) is replaced, with a note: params/ is the run's (`workdir.training_names`,
  recorded in its mark). Returns the export's folder."""
  folder = workdir_lib.export_dir(workdir, step)
  existed = folder.exists()
  if checkpointing.export_params(folder, params, replace=True) and existed:
    metrics.log(f"NOTE: {folder} held other params than step {step}'s checkpoint (or an interrupted export): "
                "exported again")
  return folder


def _first_line(error: Exception) -> str:
  """The first line of an error's message (TensorStore appends pages of its spec)."""
  return (str(error).strip().splitlines() or [""])[0]
