"""Where a training run starts: the newest checkpoint of its workdir that reads back whole, with its data position,
or a fresh state; what changed since that checkpoint is said before the first step.

    state = resume.restore_or_init(config, run, checkpointer, batches, workdir)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np

from retnet_jax.input_pipeline import data_config
from retnet_jax.runs import workdir as workdir_lib
from retnet_jax.training import checkpointing, metrics, run_checkpoints, train_state, train_step as train_step_lib
from retnet_jax.training.run_config import Config

# Data fields added since checkpoints were first written -> the value a checkpoint without the field was trained with.
ADDED_DATA_FIELDS = {"reset_at_documents": False, "prepared": (), "prepared_weights": ()}


def restore_or_init(config: Config, run: train_step_lib.Setup, checkpointer: checkpointing.Checkpointer,
                    batches: Any, workdir: Path) -> train_state.TrainState:
  """The newest checkpoint's state that reads back whole (`run_checkpoints.restore_newest`: an unreadable one is set
  aside with a warning, another model config's refused), with `batches` set to its data position; else a fresh
  state. The line saying so names `workdir` as given."""
  restored = run_checkpoints.restore_newest(checkpointer, config,
                                            lambda step: checkpointer.restore(run.abstract_state.saved(), step))
  if restored is None:
    with run.placement.active():
      state = run.init()
    metrics.log(f"initialised {_count_params(state.params):,} parameters on mesh "
                f"{dict(run.placement.mesh.shape)}; training from step 0")
    return state
  step, (saved, meta) = restored
  batches.set_state(meta["data"])
  metrics.log(f"resumed from {workdir_lib.checkpoint_dir(workdir) / str(step)} (data position {meta['data']})")
  saved_dtype = meta["config"]["train"].get("optimizer_state_dtype", "float32")  # float32 before the field
  if saved_dtype != config.train.optimizer_state_dtype:
    metrics.log(f"NOTE: the checkpoint's first Adam moment is {saved_dtype}: converted to "
                f"train.optimizer_state_dtype={config.train.optimizer_state_dtype}")
  changed = changed_data_fields(meta["config"], config)
  if changed:
    metrics.log(f"WARNING: {', '.join(changed)} changed since the checkpoint: the data position continues, but "
                "the batches are no longer those an uninterrupted run would have seen.")
  if step > config.train.steps:
    metrics.log(f"NOTE: the checkpoint's step {step} is past train.steps={config.train.steps}: nothing to train "
                f"(raise --config.train.steps above {step} to go on)")
  return train_state.TrainState.from_saved(saved)


def changed_data_fields(saved: dict, config: Config) -> list[str]:
  """The fields that choose the batches (`train.seq_len`, `train.batch_size`, `seed`, `data`) on which a checkpoint's
  config `saved` differs from `config`; a data field the checkpoint predates counts as its value then, and a path
  field that holds one path as a string (as older runs saved it) as that one path."""
  data = {**ADDED_DATA_FIELDS, **saved.get("data", {})}
  data.update({name: data_config.as_tuple(data[name]) for name in data_config.PATH_FIELDS if name in data})
  saved, current = {**saved, "data": data}, config.to_dict()
  return [name for name in ("train.seq_len", "train.batch_size", "seed", "data")
          if _field(saved, name) != _field(current, name)]


def _field(config: dict, dotted: str) -> str:
  """A config dict's field `a.b` as canonical JSON, for comparison."""
  for name in dotted.split("."):
    config = config.get(name, {})
  return json.dumps(config, sort_keys=True)


def _count_params(params) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
