"""The training loop: resume, the jitted step over batches, evaluation, metrics, checkpoints, profiling.

    train_and_evaluate(config, workdir)

The train state's layout is `retnet_jax.training.train_state`, the step `retnet_jax.training.train_step`. The data
position is saved beside the state in each checkpoint, so a resumed run sees exactly the batches an uninterrupted run
would. SIGTERM / SIGINT finish the current step, write a checkpoint and return.
"""

from __future__ import annotations

import errno
import json
import math
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from retnet_jax.core import dispatch, sharding, whole_files
from retnet_jax.hardware import flops
from retnet_jax.input_pipeline import data, global_batches, loader, synthetic, tokenizer as tokenizer_lib
from retnet_jax.nn import layers
from retnet_jax.runs import workdir as workdir_lib, workdir_lock
from retnet_jax.training import (checkpointing, losses, metrics, peer_watch, preemption, run_checkpoints, run_config,
                                 train_state, train_step as train_step_lib, write_errors)


# Seconds between progress lines by time before the first logged step: the small run's first line came at step 50,
# 85 s in.
EARLY_PROGRESS_S = 15.0


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


def evaluate(run: train_step_lib.Setup, params, batches: Iterable[losses.Batch]) -> float:
  """Mean validation loss (nats per token) over `batches`."""
  with run.placement.active():
    batch_losses = dispatch.host_map(lambda batch: run.eval_step(params, batch), batches)
  return float(np.mean(batch_losses))


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
  writes = workdir_lib.training_names(config, jax.process_index())
  workdir = workdir_lib.check_training_dir(workdir, writes, take_folder)
  if config.train.warmup_steps > config.train.steps:
    metrics.log(f"NOTE: train.warmup_steps={config.train.warmup_steps} exceeds train.steps={config.train.steps}: "
                "the learning rate stops short of train.learning_rate")
  tokenizer = None
  if not config.data.synthetic:  # a synthetic task makes its own token ids (checked against the vocabulary)
    tokenizer = tokenizer_lib.load(config.data.tokenizer, vocab_size=config.model.vocab_size)
  mesh = sharding.make_mesh(config.mesh)
  run = train_step_lib.setup(config, mesh)
  batches, valid_batches = _data_sources(config, tokenizer, run.placement.batch_sharding)

  workdir_lib.claim(workdir, writes, take_folder)
  with workdir_lib.writer_lock(workdir, jax.process_index()) as lock:  # one training process writes the workdir
    checkpointer = checkpointing.Checkpointer(workdir_lib.checkpoint_dir(workdir), keep=config.checkpoint.keep,
                                              keep_best=config.checkpoint.keep_best,
                                              async_save=config.checkpoint.async_save)
    try:
      with checkpointer:
        state = _restore_or_init(config, run, checkpointer, batches, workdir)  # another model's refused first
        with metrics.MetricsWriter(workdir) as writer:
          if jax.process_index() == 0:
            whole_files.write_text(workdir_lib.config_file(workdir), json.dumps(config.to_dict(), indent=2))
          return _train_loop(config, run, state, batches, valid_batches, checkpointer, writer, lock)
    except (workdir_lock.LockFileRemovedError, write_errors.ExportWriteError):  # they say what the workdir keeps
      raise
    except Exception as e:  # pylint: disable=broad-exception-caught
      fault = _workdir_fault(e, lock, checkpointer)
      if fault is None:
        raise
      raise fault from e


def _data_sources(config: run_config.Config, tokenizer: tokenizer_lib.Tokenizer | None,
                  batch_sharding: jax.sharding.NamedSharding
                  ) -> tuple[loader.PreparedBatches | synthetic.SyntheticBatches, Callable[[], Iterable[losses.Batch]]]:
  """The training batches, and a function giving the `train.eval_batches` validation batches: packed text read
  through Grain (from `data.prepared`, or the cached corpus of the files), or the synthetic task's `(tokens, loss
  weights)` with `data.synthetic`, each with document ids with `data.reset_at_documents`. Fails here if either
  cannot be made."""
  train_cfg, reset = config.train, config.data.reset_at_documents
  eval_batch, num_eval = train_cfg.batch_size // train_cfg.grad_accum_steps, train_cfg.eval_batches
  if config.data.synthetic:
    valid_rows = synthetic.ValidationRows(config, eval_batch, num_eval)
    return (synthetic.SyntheticBatches(config, train_cfg.batch_size, batch_sharding),
            lambda: global_batches.eval_batches(valid_rows, eval_batch, None, batch_sharding))
  corpora = loader.open_corpora(config.data, tokenizer)
  valid_rows = loader.validation_rows(corpora, train_cfg.seq_len, reset)
  batches = loader.PreparedBatches(corpora, train_cfg.seq_len, train_cfg.batch_size, config.seed, batch_sharding,
                                   config.data.prepared_weights, reset)
  too_few = dict(holds=f"the prepared validation split holds {len(valid_rows)} sequences", batch=str(eval_batch),
                 fix="use a smaller batch size or seq_len, or prepare more validation data")
  global_batches.eval_batches(valid_rows, eval_batch, 1, **too_few)  # enough to evaluate?
  return batches, lambda: global_batches.eval_batches(valid_rows, eval_batch, num_eval, batch_sharding, **too_few)


# Data fields added since checkpoints were first written -> the value a checkpoint without the field was trained with.
ADDED_DATA_FIELDS = {"reset_at_documents": False, "prepared": (), "prepared_weights": ()}

# errno -> (what went wrong with the workdir's disk, the fix)
_DISK_FAULTS = {
    errno.ENOSPC: ("its disk is full", "free space there (or move the workdir to a disk with room)"),
    errno.EDQUOT: ("the disk quota is exceeded", "free space or raise the quota"),
    errno.EROFS: ("its file system is read-only", "remount it read-write (or copy the workdir to a writable disk)"),
    errno.EACCES: ("permission is denied", "make the workdir writable for this user"),
    errno.EPERM: ("permission is denied", "make the workdir writable for this user"),
    errno.EIO: ("its disk reported an I/O error", "check the disk"),
}


def _workdir_fault(error: Exception, lock: workdir_lock.WriterLock, checkpointer: checkpointing.Checkpointer
                   ) -> OSError | None:
  """`error` as one message naming the workdir's fault, what is committed and the fix; None if not a disk fault."""
  vanished = _vanished(lock, checkpointer)
  if vanished is None and isinstance(error, OSError) and error.errno not in _DISK_FAULTS:
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
  what, fix = _DISK_FAULTS.get(error.errno, ("a write failed", "remove the cause"))
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


def _restore_or_init(config: run_config.Config, run: train_step_lib.Setup,
                     checkpointer: checkpointing.Checkpointer,
                     batches: loader.PreparedBatches | synthetic.SyntheticBatches, workdir: Path):
  """The newest checkpoint's state that reads back whole (`run_checkpoints.restore_newest`: an unreadable one is set
  aside with a warning, another model config's refused), else a fresh one; the line saying so names `workdir` as
  given."""
  restored = run_checkpoints.restore_newest(checkpointer, config,
                                            lambda step: checkpointer.restore(run.abstract_state.saved(), step))
  if restored is not None:
    step, (saved, meta) = restored
    state = train_state.TrainState.from_saved(saved)
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
    return state
  with run.placement.active():
    state = run.init()
  metrics.log(f"initialised {_count_params(state.params):,} parameters on mesh "
              f"{dict(run.placement.mesh.shape)}; training from step 0")
  return state


def changed_data_fields(saved: dict, config: run_config.Config) -> list[str]:
  """The fields that choose the batches (`train.seq_len`, `train.batch_size`, `seed`, `data`) on which a checkpoint's
  config `saved` differs from `config`; a data field the checkpoint predates counts as its value then."""
  saved = {**saved, "data": {**ADDED_DATA_FIELDS, **saved.get("data", {})}}
  return [name for name in ("train.seq_len", "train.batch_size", "seed", "data")
          if _field(saved, name) != _field(config.to_dict(), name)]


def _field(config: dict, dotted: str) -> str:
  """A config dict's field `a.b` as canonical JSON, for comparison."""
  for name in dotted.split("."):
    config = config.get(name, {})
  return json.dumps(config, sort_keys=True)


def _check_finite(state: train_state.TrainState, policy: str, checkpointer: checkpointing.Checkpointer) -> None:
  """With policy `stop`, raises at the first non-finite step (its update was not applied)."""
  first = int(state.first_nonfinite_step)
  if policy == "stop" and first >= 0:
    raise FloatingPointError(
        f"non-finite loss or gradient at step {first}; its update was not applied and the last good checkpoint "
        f"(step {checkpointer.latest_step()}) is intact. Lower train.learning_rate, check the data, or set "
        "train.nonfinite=skip to skip such steps.")


def _train_loop(config, run: train_step_lib.Setup, state: train_state.TrainState,
                batches: loader.PreparedBatches | synthetic.SyntheticBatches,
                valid_batches: Callable[[], Iterable[losses.Batch]], checkpointer: checkpointing.Checkpointer,
                writer: metrics.MetricsWriter, lock: workdir_lock.WriterLock) -> dict[str, float]:
  train_cfg = config.train
  workdir = lock.workdir
  tokens_per_step = train_cfg.batch_size * train_cfg.seq_len
  flops_per_token = flops.train_flops_per_token(config.model, train_cfg.seq_len, train_cfg.mode)
  peak, measured_peak = flops.peak_flops(layers.compute_dtype(config.model.dtype), jax.devices())
  profile = tuple(train_cfg.profile_steps or ())
  saved_step = int(state.step)

  def write(eval_loss=None):
    nonlocal saved_step
    checkpointer.save(step, state.saved(), {"data": batches.get_state(), "config": config.to_dict()},
                      eval_loss=eval_loss)
    saved_step = step

  def check_lock(eval_loss=None):
    """`lock.check_held`; a lock file removed from the workdir still in place stops the run after a checkpoint of
    this step (one process: the other processes of a run would not join its save)."""
    try:
      lock.check_held()
    except workdir_lock.LockFileRemovedError:
      if jax.process_count() == 1:
        if saved_step != step:
          _check_finite(state, train_cfg.nonfinite, checkpointer)
          write(eval_loss)
        checkpointer.wait()
      committed = newest()
      kept = (f"; checkpoint {committed} is committed in {checkpointer.directory}: run the same command again to "
              "resume from there (it locks the workdir afresh)" if committed is not None else
              "; no checkpoint was committed yet: run the same command again to start over")
      raise workdir_lock.LockFileRemovedError(lock.path, kept) from None

  def check_workdir():
    """Stops at a vanished workdir or a failed background save rather than at the next save or at exit."""
    check_lock()
    checkpointer.check_for_errors()

  def save(eval_loss=None):
    check_lock(eval_loss)  # a failed background save is reported by the save itself
    write(eval_loss)

  step = int(state.step)
  last: dict[str, float] = {}
  pending: list[dict[str, jax.Array]] = []
  compiled, interval_start, interval_steps = False, time.perf_counter(), 0
  logged, last_line = False, time.perf_counter()  # until the first logged step, a line every EARLY_PROGRESS_S
  peers = {p: workdir_lib.writer_lock(workdir, p).path for p in range(jax.process_count()) if p != jax.process_index()}
  newest = lambda: (workdir_lib.listed_steps(workdir) or [None])[-1]
  with preemption.StopRequest() as stop, peer_watch.PeerWatch(
      peers, newest, peer_watch.Pulse.of_this_run()) as watch:
    while step < train_cfg.steps:
      watch.progress()
      if profile and step == profile[0]:
        jax.profiler.start_trace(str(workdir / workdir_lib.PROFILE_DIR))
      with run.placement.active():
        state, step_metrics = run.train_step(state, next(batches))
      step += 1
      pending.append(step_metrics)
      dispatch.wait_behind(pending)  # queued steps' collectives would starve (dispatch.py)
      if profile and step == profile[1] + 1:
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
      if not compiled:  # the first step compiles: keep it out of the throughput
        jax.block_until_ready(state)
        metrics.log(f"first step (compile + run) took {time.perf_counter() - interval_start:.1f} s")
        compiled, interval_start = True, time.perf_counter()
        last_line = interval_start
      else:
        interval_steps += 1
        if not logged and time.perf_counter() - last_line >= EARLY_PROGRESS_S and step % train_cfg.log_every_steps:
          jax.block_until_ready(state)  # a line by time: the steps so far, timed
          last_line = time.perf_counter()
          metrics.log(metrics.progress_line(step, train_cfg.steps, {}, (last_line - interval_start) / interval_steps))

      if step % train_cfg.log_every_steps == 0 or step == train_cfg.steps:
        logged = True
        check_workdir()
        _check_finite(state, train_cfg.nonfinite, checkpointer)
        values = {k: float(np.mean([m[k] for m in jax.device_get(pending)])) for k in pending[0]}
        values["perplexity"] = math.exp(min(values["loss"], 50.0))
        values["nonfinite_steps"] = int(state.nonfinite_steps)
        seconds = (time.perf_counter() - interval_start) / interval_steps if interval_steps else float("nan")
        if interval_steps:
          achieved = tokens_per_step * flops_per_token / seconds
          peak = max(peak, achieved) if measured_peak else peak  # a ceiling measured while busy read low
          values.update(step_time=seconds, tokens_per_sec=tokens_per_step / seconds, mfu=achieved / peak)
        writer.write(step, values)
        metrics.log(metrics.progress_line(step, train_cfg.steps, values, seconds, show_mfu=not measured_peak))
        last.update(values)
        pending, interval_start, interval_steps = [], time.perf_counter(), 0

      eval_loss = None
      if step % train_cfg.eval_every_steps == 0 or step == train_cfg.steps:
        eval_loss = evaluate(run, state.params, valid_batches())
        values = metrics.eval_metrics(eval_loss)
        writer.write(step, values)
        writer.plot()
        metrics.log(f"step {step}: eval loss {eval_loss:.4f} | perplexity {values['eval_perplexity']:.2f}")
        last.update(values)
        interval_start = time.perf_counter()  # evaluation time is not training time
      if step % config.checkpoint.every_steps == 0 or step == train_cfg.steps:
        _check_finite(state, train_cfg.nonfinite, checkpointer)
        save(eval_loss)
      if stop.requested():
        _check_finite(state, train_cfg.nonfinite, checkpointer)
        if saved_step != step:
          save()
        checkpointer.wait()
        metrics.log(f"{stop.signal_name or 'stop'} received: checkpoint of step {step} committed in "
                    f"{checkpointer.directory}; run the same command again to resume")
        return last

  checkpointer.wait()
  try:
    export_dir = run_checkpoints.export_params(workdir, step, state.params)
  except write_errors.ExportWriteError as e:
    what, fix = _DISK_FAULTS.get(e.errno, ("a write failed", "remove the cause"))
    raise write_errors.ExportWriteError(
        f"{e} ({what}). Checkpoint {step} in {checkpointer.directory} is committed and intact; {fix}, then run the "
        "same command again: the training is done, so it only exports the parameters.", e.errno) from e
  metrics.log(f"done at step {step}; checkpoints in {workdir_lib.checkpoint_dir(workdir)}, params in {export_dir}; "
              f"metrics in {Path(workdir) / workdir_lib.METRICS_FILE} (plot "
              f"{Path(workdir) / workdir_lib.METRICS_PLOT}, TensorBoard {Path(workdir) / workdir_lib.TENSORBOARD_DIR})")
  return last


def _count_params(params) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
