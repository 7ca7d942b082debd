"""Training a config in a workdir: the config checked and its step set up (traced, not compiled), the workdir
checked, the data opened, the workdir claimed and locked, the state resumed or created, then the loop; a workdir's
disk fault is reported as one message.

    train_and_evaluate(config, workdir)

The train state's layout is `retnet_jax.training.train_state`, the step `retnet_jax.training.train_step`, the loop
`retnet_jax.training.loop`, where it starts `retnet_jax.training.resume`. The data position is saved beside the
state in each checkpoint, so a resumed run sees exactly the batches an uninterrupted run would. SIGTERM / SIGINT
finish the current step, write a checkpoint and return.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import jax

from retnet_jax.core import sharding, whole_files
from retnet_jax.input_pipeline import tokenizer as tokenizer_lib, training_data
from retnet_jax.runs import workdir as workdir_lib, workdir_lock
from retnet_jax.training import (checkpointing, loop, metrics, resume, run_config, train_state,
                                 train_step as train_step_lib, write_errors)


def check_config(config: run_config.Config | Any, num_devices: int) -> run_config.Config:
  """The config built (`run_config.build`: each section's fields, the rules across them) and checked for training
  on `num_devices` devices (`train_state.check_devices`) with float32 master weights, before any data is read or
  file written."""
  config = run_config.build(config)
  train_state.check_devices(config, num_devices)
  if config.model.param_dtype != "float32":
    raise ValueError(f"model.param_dtype={config.model.param_dtype!r}: training keeps float32 master weights (the "
                     "option casts them for evaluation, generation and export); set --config.model.param_dtype="
                     "float32 to train, model.dtype=bfloat16 to compute in bfloat16.")
  return config


def train_and_evaluate(config: run_config.Config | Any, workdir: str | os.PathLike,
                       take_folder: bool = False) -> dict[str, float]:
  """Trains `config` in `workdir`, resuming from its latest checkpoint.

  Args:
    config: the full config (`configs/retnet.py:NAME` or `configs/transformer.py:NAME`), checked before anything
      is read or written.
    workdir: the run's directory: checkpoints, metrics, TensorBoard events, config.json, the final params. New,
      empty or a run's (`workdir.check_training_dir`).
    take_folder: train in a `workdir` holding files this project did not write, beside them (--take_folder).
  Returns:
    The last logged train and eval metrics (`loss`, `eval_loss`, ...).
  """
  config = check_config(config, jax.device_count())
  mesh = sharding.make_mesh(config.mesh)
  run = train_step_lib.setup(config, mesh)  # traced abstractly: nothing runs yet
  writes = workdir_lib.training_names(jax.process_index(), bool(config.train.profile_steps))
  workdir = workdir_lib.check_training_dir(workdir, writes, take_folder)
  if config.train.warmup_steps > config.train.steps:
    metrics.log(f"NOTE: train.warmup_steps={config.train.warmup_steps} exceeds train.steps={config.train.steps}: "
                "the learning rate stops short of train.learning_rate")
  tokenizer = None
  if not config.data.synthetic:  # a synthetic task makes its own token ids (checked against the vocabulary)
    tokenizer = tokenizer_lib.load(config.data.tokenizer, vocab_size=config.model.vocab_size)
  batches, valid_batches = training_data.open_batches(config, tokenizer, run.placement.batch_sharding)

  workdir_lib.claim(workdir, writes, take_folder)
  with workdir_lib.writer_lock(workdir, jax.process_index()) as lock:  # one training process writes the workdir
    checkpointer = checkpointing.Checkpointer(workdir_lib.checkpoint_dir(workdir), keep=config.checkpoint.keep,
                                              keep_best=config.checkpoint.keep_best,
                                              async_save=config.checkpoint.async_save)
    try:
      with checkpointer:
        state = resume.restore_or_init(config, run, checkpointer, batches, workdir)  # another model's refused first
        with metrics.MetricsWriter(workdir) as writer:
          saved_config = config.to_dict()  # config.json and each checkpoint's config
          if jax.process_index() == 0:
            whole_files.write_text(workdir_lib.config_file(workdir), json.dumps(saved_config, indent=2))
          schedule, throughput = loop.Schedule.of(config), loop.Throughput.of(config)
          saver = loop.Saver(checkpointer, lock, batches, saved_config, schedule.nonfinite, int(state.step))
          return loop.train_loop(schedule, throughput, run, state, batches, valid_batches, saver, writer)
    except (workdir_lock.LockFileRemovedError, write_errors.ExportWriteError):  # they say what the workdir keeps
      raise
    except Exception as e:  # pylint: disable=broad-exception-caught
      fault = _workdir_fault(e, lock, checkpointer)
      if fault is None:
        raise
      raise fault from e


def _workdir_fault(error: Exception, lock: workdir_lock.WriterLock, checkpointer: checkpointing.Checkpointer
                   ) -> OSError | None:
  """`error` as one message naming the workdir's fault, what is committed and the fix; None if not a disk fault."""
  vanished = _vanished(lock, checkpointer)
  if vanished is None and isinstance(error, OSError) and error.errno not in write_errors.DISK_FAULTS:
    time.sleep(1)  # a workdir being deleted can fail a save before the deletion reaches the lock file
    vanished = _vanished(lock, checkpointer)
  if vanished is not None:
    removed = (f" (the save in flight had recreated {workdir_lib.checkpoint_dir(lock.workdir)}: removed)"
               if workdir_lib.remove_recreated(lock.workdir) else "")
    return workdir_lock.WorkdirVanishedError(
        lock.workdir, f"{vanished}{removed}. Restore it (or remount its disk) and run the same command again to "
        "resume from its latest checkpoint, or choose a new --workdir to start afresh.")
  if not isinstance(error, OSError):
    return None
  what, fix = write_errors.disk_fault(error.errno)
  try:
    checkpointer.reload()
    committed = checkpointer.latest_step()
  except Exception:  # pylint: disable=broad-exception-caught  (the listing may fail for the same cause)
    committed = None
  detail = error if isinstance(error, write_errors.CheckpointWriteError) else error.strerror or error
  kept = (f"checkpoint {committed} is committed and intact; {fix}, then run the same command again to resume "
          f"from step {committed}" if committed is not None else
          f"no checkpoint was committed yet; {fix}, then run the same command again to start over")
  fault = OSError(f"cannot write to the workdir {lock.workdir}: {what} ({detail}). The training stopped; {kept}.")
  fault.errno = error.errno
  return fault


def _vanished(lock: workdir_lock.WriterLock, checkpointer: checkpointing.Checkpointer) -> str | None:
  """What of the workdir is gone or replaced (its lock file or checkpoint directory), or None."""
  try:
    lock.check_held()
  except workdir_lock.WorkdirVanishedError as e:
    return e.gone
  except workdir_lock.LockFileRemovedError:  # the workdir itself is in place
    pass
  return f"{checkpointer.directory} is gone" if checkpointer.vanished() else None
