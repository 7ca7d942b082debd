"""The training loop: the jitted step over batches, and on their schedules the logged metrics, evaluation and
checkpoints, until `train.steps` or a stop request.

    schedule, throughput = loop.Schedule.of(config), loop.Throughput.of(config)
    saver = loop.Saver(checkpointer, lock, batches, config.to_dict(), schedule.nonfinite, int(state.step))
    last_metrics = loop.train_loop(schedule, throughput, run, state, batches, valid_batches, saver, writer)

Everything the loop reads from the config is in its `Schedule` and `Throughput`, built once before it starts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from retnet_jax.core import dispatch
from retnet_jax.hardware import flops
from retnet_jax.nn import layers
from retnet_jax.runs import workdir as workdir_lib, workdir_lock
from retnet_jax.training import (checkpointing, losses, metrics, peer_watch, preemption, run_checkpoints, train_state,
                                 train_step as train_step_lib, write_errors)

# Seconds between progress lines by time before the first logged step: the small run's first line came at step 50,
# 85 s in.
EARLY_PROGRESS_S = 15.0


class Schedule(NamedTuple):
  """When the loop logs, evaluates, saves and traces (`config.train`, `config.checkpoint`), and what a non-finite
  step does."""
  steps: int
  log_every: int
  eval_every: int
  save_every: int
  profile: tuple[int, ...]  # (first, last) step traced by the profiler, or ()
  nonfinite: str  # train.nonfinite: stop | skip

  @classmethod
  def of(cls, config: Any) -> Schedule:
    train = config.train
    return cls(train.steps, train.log_every_steps, train.eval_every_steps, config.checkpoint.every_steps,
               tuple(train.profile_steps or ()), train.nonfinite)

  def logs(self, step: int) -> bool:
    return step % self.log_every == 0 or step == self.steps

  def evaluates(self, step: int) -> bool:
    return step % self.eval_every == 0 or step == self.steps

  def saves(self, step: int) -> bool:
    return step % self.save_every == 0 or step == self.steps


class Throughput:
  """Tokens per second and model FLOPs utilisation of timed steps: the model's training FLOPs per token against the
  devices' peak (the datasheet's, or one measured here, which a step that does better raises)."""

  def __init__(self, tokens_per_step: int, flops_per_token: int, peak: float, measured_peak: bool):
    self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
    self.peak, self.measured_peak = peak, measured_peak

  @classmethod
  def of(cls, config: Any) -> Throughput:
    train = config.train
    peak, measured = flops.peak_flops(layers.compute_dtype(config.model.dtype), jax.devices())
    return cls(train.batch_size * train.seq_len, flops.train_flops_per_token(config.model, train.seq_len, train.mode),
               peak, measured)

  def figures(self, seconds_per_step: float) -> dict[str, float]:
    """`step_time`, `tokens_per_sec` and `mfu` of steps that took `seconds_per_step` each."""
    achieved = self.tokens_per_step * self.flops_per_token / seconds_per_step
    if self.measured_peak:  # a ceiling measured while busy read low
      self.peak = max(self.peak, achieved)
    return dict(step_time=seconds_per_step, tokens_per_sec=self.tokens_per_step / seconds_per_step,
                mfu=achieved / self.peak)


class Saver:
  """The loop's checkpoints: the state with the data position and the config, each written after checking that
  this process still holds the workdir's lock; a non-finite step with `nonfinite=stop` is refused first."""

  def __init__(self, checkpointer: checkpointing.Checkpointer, lock: workdir_lock.WriterLock, batches: Any,
               config: dict[str, Any], nonfinite: str, saved_step: int):
    self.checkpointer, self.lock, self.batches, self.config = checkpointer, lock, batches, config
    self.nonfinite, self.saved_step = nonfinite, saved_step

  def check_finite(self, state: train_state.TrainState) -> None:
    """With `nonfinite=stop`, raises at the first non-finite step (its update was not applied)."""
    first = int(state.first_nonfinite_step)
    if self.nonfinite == "stop" and first >= 0:
      raise FloatingPointError(
          f"non-finite loss or gradient at step {first}; its update was not applied and the last good checkpoint "
          f"(step {self.checkpointer.latest_step()}) is intact. Lower train.learning_rate, check the data, or set "
          "train.nonfinite=skip to skip such steps.")

  def save(self, state: train_state.TrainState, eval_loss: float | None = None) -> None:
    """Checks the state (`check_finite`) and the lock (`check_lock`), then writes a checkpoint of `state`."""
    self.check_finite(state)
    self.check_lock(state, eval_loss)  # a failed background save is reported by the save itself
    self._write(state, eval_loss)

  def _write(self, state: train_state.TrainState, eval_loss: float | None) -> None:
    step = int(state.step)
    self.checkpointer.save(step, state.saved(), {"data": self.batches.get_state(), "config": self.config},
                           eval_loss=eval_loss)
    self.saved_step = step

  def check_lock(self, state: train_state.TrainState, eval_loss: float | None = None) -> None:
    """`lock.check_held`; a lock file removed from the workdir still in place stops the run after a checkpoint of
    `state` (one process: the other processes of a run would not join its save)."""
    try:
      self.lock.check_held()
    except workdir_lock.LockFileRemovedError:
      if jax.process_count() == 1:
        if self.saved_step != int(state.step):
          self.check_finite(state)
          self._write(state, eval_loss)
        self.checkpointer.wait()
      committed = self.newest()
      kept = (f"; checkpoint {committed} is committed in {self.checkpointer.directory}: run the same command again "
              "to resume from there (it locks the workdir afresh)" if committed is not None else
              "; no checkpoint was committed yet: run the same command again to start over")
      raise workdir_lock.LockFileRemovedError(self.lock.path, kept) from None

  def check_workdir(self, state: train_state.TrainState) -> None:
    """Stops at a vanished workdir or a failed background save rather than at the next save or at exit."""
    self.check_lock(state)
    self.checkpointer.check_for_errors()

  def newest(self) -> int | None:
    """The newest step committed in the workdir (by any process of the run), or None."""
    return (workdir_lib.listed_steps(self.lock.workdir) or [None])[-1]


def evaluate(run: train_step_lib.Setup, params: Any, batches: Iterable[losses.Batch]) -> float:
  """Mean validation loss (nats per token) over `batches`."""
  with run.placement.active():
    batch_losses = dispatch.host_map(lambda batch: run.eval_step(params, batch), batches)
  return float(np.mean(batch_losses))


def train_loop(schedule: Schedule, throughput: Throughput, run: train_step_lib.Setup, state: train_state.TrainState,
               batches: Iterator[losses.Batch], valid_batches: Callable[[], Iterable[losses.Batch]], saver: Saver,
               writer: metrics.MetricsWriter) -> dict[str, float]:
  """Trains `state` from its step to `schedule.steps` (or a stop request: SIGTERM, SIGINT), checkpointing on the
  schedule, at a stop and at the end, then exports the parameters.

  Returns:
    The last logged train and eval metrics (`loss`, `eval_loss`, ...).
  """
  workdir, checkpointer, profile = saver.lock.workdir, saver.checkpointer, schedule.profile
  step = int(state.step)
  last: dict[str, float] = {}
  pending: list[dict[str, jax.Array]] = []
  compiled, interval_start, interval_steps = False, time.perf_counter(), 0
  logged, last_line = False, time.perf_counter()  # until the first logged step, a line every EARLY_PROGRESS_S
  peers = {p: workdir_lib.writer_lock(workdir, p).path for p in range(jax.process_count()) if p != jax.process_index()}
  with preemption.StopRequest() as stop, peer_watch.PeerWatch(
      peers, saver.newest, peer_watch.Pulse.of_this_run()) as watch:
    while step < schedule.steps:
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
        if not logged and time.perf_counter() - last_line >= EARLY_PROGRESS_S and step % schedule.log_every:
          jax.block_until_ready(state)  # a line by time: the steps so far, timed
          last_line = time.perf_counter()
          metrics.log(metrics.progress_line(step, schedule.steps, {}, (last_line - interval_start) / interval_steps))

      if schedule.logs(step):
        logged = True
        saver.check_workdir(state)
        saver.check_finite(state)
        values = {k: float(np.mean([m[k] for m in jax.device_get(pending)])) for k in pending[0]}
        values["perplexity"] = math.exp(min(values["loss"], 50.0))
        values["nonfinite_steps"] = int(state.nonfinite_steps)
        seconds = (time.perf_counter() - interval_start) / interval_steps if interval_steps else float("nan")
        if interval_steps:
          values.update(throughput.figures(seconds))
        writer.write(step, values)
        metrics.log(metrics.progress_line(step, schedule.steps, values, seconds,
                                          show_mfu=not throughput.measured_peak))
        last.update(values)
        pending, interval_start, interval_steps = [], time.perf_counter(), 0

      eval_loss = None
      if schedule.evaluates(step):
        eval_loss = evaluate(run, state.params, valid_batches())
        values = metrics.eval_metrics(eval_loss)
        writer.write(step, values)
        writer.plot()
        metrics.log(f"step {step}: eval loss {eval_loss:.4f} | perplexity {values['eval_perplexity']:.2f}")
        last.update(values)
        interval_start = time.perf_counter()  # evaluation time is not training time
      if schedule.saves(step):
        saver.save(state, eval_loss)
      if stop.requested():
        if saver.saved_step != step:
          saver.save(state)  # checks the state first
        else:
          saver.check_finite(state)
        checkpointer.wait()
        metrics.log(f"{stop.signal_name or 'stop'} received: checkpoint of step {step} committed in "
                    f"{checkpointer.directory}; run the same command again to resume")
        return last

  checkpointer.wait()
  _export(workdir, step, state.params, checkpointer)
  return last


def _export(workdir: Path, step: int, params: Any, checkpointer: checkpointing.Checkpointer) -> None:
  """Exports the trained parameters (`run_checkpoints.export_params`): a failed write says that the checkpoint is
  intact and that running again only exports."""
  try:
    export_dir = run_checkpoints.export_params(workdir, step, params)
  except write_errors.ExportWriteError as e:
    what, fix = write_errors.disk_fault(e.errno)
    raise write_errors.ExportWriteError(
        f"{e} ({what}). Checkpoint {step} in {checkpointer.directory} is committed and intact; {fix}, then run the "
        "same command again: the training is done, so it only exports the parameters.", e.errno) from e
  metrics.log(f"done at step {step}; checkpoints in {workdir_lib.checkpoint_dir(workdir)}, params in {export_dir}; "
              f"metrics in {Path(workdir) / workdir_lib.METRICS_FILE} (plot "
              f"{Path(workdir) / workdir_lib.METRICS_PLOT}, TensorBoard {Path(workdir) / workdir_lib.TENSORBOARD_DIR})")
