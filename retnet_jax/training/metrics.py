"""Training metrics: JSON lines, TensorBoard event files (tensorboardX, no TensorFlow) and a progress line."""

from __future__ import annotations

import itertools
import json
import math
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from absl import logging

from retnet_jax.core import whole_files
from retnet_jax.runs import workdir as workdir_lib

# tensorboardX imports torch where it is installed, only to accept torch tensors, which training never logs; that
# import takes seconds at every start of a script. Hidden while tensorboardX imports, unless already imported.
_HIDE_TORCH = "torch" not in sys.modules
if _HIDE_TORCH:
  sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX takes as "not installed"
try:
  from tensorboardX.proto.event_pb2 import Event  # pylint: disable=g-import-not-at-top
  from tensorboardX.record_writer import RecordWriter  # pylint: disable=g-import-not-at-top
  from tensorboardX.summary import scalar  # pylint: disable=g-import-not-at-top
finally:
  if _HIDE_TORCH:
    del sys.modules["torch"]


def to_json(values: dict[str, Any]) -> str:
  """`values` as one line of valid JSON: a non-finite number becomes null, and `nonfinite` lists where."""
  nonfinite = []

  def clean(value, path):
    if isinstance(value, dict):
      return {k: clean(v, f"{path}.{k}" if path else k) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
      return [clean(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, float) and not math.isfinite(value):
      nonfinite.append(path)
      return None
    return value

  cleaned = clean(values, "")
  return json.dumps({**cleaned, "nonfinite": nonfinite} if nonfinite else cleaned, allow_nan=False)


def write_results(results: dict[str, Any], path: str | os.PathLike,
                  plot: Callable[[dict[str, Any], Path], Any] | None = None) -> str:
  """`results` as one JSON line (`to_json`), written whole (`whole_files`) to `path` by the first process, with
  `plot(results, png)` beside it (`png`: `path` with the suffix `.png`; the plot writes whole too); returns the
  line for stdout. A read-only or full workdir is logged, not raised: the results still reach stdout."""
  line = to_json(results)
  if jax.process_index() == 0:
    path = Path(path)
    try:
      whole_files.write_text(path, line + "\n")
      if plot is not None:
        plot(results, path.with_suffix(".png"))
    except OSError as e:
      logging.error(f"could not write {e.filename or path} ({e.strerror}); the results are the JSON line below only")
  return line


def _drop_partial_line(path: str) -> None:
  """Cuts a last line that a failed write (a full disk) left unfinished, so the file stays valid JSON lines."""
  try:
    file = open(path, "rb+")
  except FileNotFoundError:
    return
  with file:
    content = file.read()
    if content and not content.endswith(b"\n"):
      file.truncate(content.rfind(b"\n") + 1)


def _new_events_file(folder: str) -> str:
  """A path for a new TensorBoard event file in `folder` (made if missing), named as TensorBoard expects and never
  one that exists: an earlier writer's file within the same second is not replaced."""
  os.makedirs(folder, exist_ok=True)
  stem = os.path.join(folder, f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}")
  return next(path for n in itertools.count() if not os.path.exists(path := f"{stem}.{n}"))


class MetricsWriter:
  """Appends `{"step": ..., **metrics}` to WORKDIR/metrics.jsonl and TensorBoard, and plots the loss and learning
  rate into WORKDIR/metrics.png (`plot`); only process 0 writes.

  Event files are written in the caller's thread, each write flushed: tensorboardX's `SummaryWriter` writes from a
  thread of its own, which a full disk left running until exit, where it printed a traceback after the run's error.
  """

  def __init__(self, workdir: str | os.PathLike):
    self.enabled = jax.process_index() == 0
    if self.enabled:
      self._path = os.path.join(workdir, workdir_lib.METRICS_FILE)
      _drop_partial_line(self._path)
      self._jsonl = open(self._path, "a", encoding="utf-8")
      self._events = RecordWriter(_new_events_file(os.path.join(workdir, workdir_lib.TENSORBOARD_DIR)))
      self._events.write(Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString())

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    if not self.enabled:
      return
    values = {k: float(v) for k, v in metrics.items()}
    self._reopen_if_replaced(step)
    self._jsonl.write(to_json({"step": int(step), **values}) + "\n")
    self._jsonl.flush()
    wall_time = time.time()
    for name, value in values.items():
      self._events.write(Event(summary=scalar(name, value), step=int(step), wall_time=wall_time).SerializeToString())
    self._events.flush()

  def plot(self) -> None:
    """Writes WORKDIR/metrics.png from every line of metrics.jsonl (a resumed run's earlier steps included):
    training and validation loss, and the learning rate, against the step. A curve to look at without a
    TensorBoard viewer; training calls it at each evaluation."""
    if not self.enabled:
      return
    from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel  (Agg canvas, no pyplot state)

    by_step: dict[str, dict[int, float]] = {"loss": {}, "eval_loss": {}, "learning_rate": {}}
    with open(self._path, encoding="utf-8") as file:
      for line in file:
        values = json.loads(line)
        for name, series in by_step.items():
          if isinstance(values.get(name), (int, float)):  # null: non-finite (`to_json`)
            series[values["step"]] = values[name]  # a step logged again after a rewind: its latest value
    fig = Figure(figsize=(11, 4))
    loss_ax, rate_ax = fig.subplots(1, 2)
    for name, label, style in (("loss", "training", "-"), ("eval_loss", "validation", "o-")):
      steps = sorted(by_step[name])
      loss_ax.plot(steps, [by_step[name][s] for s in steps], style, label=label, markersize=4)
    loss_ax.set(xlabel="step", ylabel="loss (nats per token)", title="Loss")
    loss_ax.legend()
    steps = sorted(by_step["learning_rate"])
    rate_ax.plot(steps, [by_step["learning_rate"][s] for s in steps])
    rate_ax.set(xlabel="step", ylabel="learning rate", title="Learning rate")
    for ax in (loss_ax, rate_ax):
      ax.grid(True, alpha=0.3)
    fig.tight_layout()
    with whole_files.replacing(os.path.join(os.path.dirname(self._path), workdir_lib.METRICS_PLOT)) as png:
      fig.savefig(png, dpi=100)

  def _reopen_if_replaced(self, step: int) -> None:
    """Reopens metrics.jsonl if it was deleted or replaced since it was opened (its lines would go nowhere)."""
    opened = os.fstat(self._jsonl.fileno())
    try:
      current = os.stat(self._path)
    except FileNotFoundError:
      current = None
    if current is not None and (current.st_dev, current.st_ino) == (opened.st_dev, opened.st_ino):
      return
    logging.warning(f"{self._path} was {'deleted' if current is None else 'replaced'} during training; it is "
                    f"written again from step {step} on (earlier steps: tensorboard/ keeps them).")
    self._jsonl.close()
    self._jsonl = open(self._path, "a", encoding="utf-8")

  def close(self, *, after_error: bool = False) -> None:
    """Flushes and closes both files; `after_error` (another error is being reported) drops what cannot be written
    (a full disk) instead of raising."""
    if not self.enabled:
      return
    errors = []
    for file in (self._jsonl, self._events):
      try:
        file.close()  # closed even when its last flush fails
      except OSError as e:
        errors.append(e)
    if errors and not after_error:
      raise errors[0]

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, exc_type, *_) -> None:
    self.close(after_error=exc_type is not None)


def format_duration(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  hours, rest = divmod(seconds, 3600)
  return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def progress_line(step: int, total: int, metrics: dict[str, float], seconds_per_step: float,
                  show_mfu: bool = True) -> str:
  """`step 100/3000 (3%) | loss 2.3456 | ... | ETA 12m05s` for the console.

  Args:
    step, total: the step logged and the run's last. metrics: the step's values (optionally `loss`, `learning_rate`,
      `grad_norm`, `tokens_per_sec`, `mfu`: a line by time before the first logged step has none). seconds_per_step:
      training time per step (nan: not timed yet).
    show_mfu: whether the line shows `mfu`; False where its ceiling is measured (`flops.peak_flops`: CPUs, chips
      outside the device table). There the ceiling is a matmul timed at start, so the line read "MFU 99%" on an idle
      CPU and 21-41% on a busy one: a figure that compares with no chip's. metrics.jsonl keeps it as `mfu`.
  """
  parts = [f"step {step}/{total} ({100 * step / total:.0f}%)"]
  if "loss" in metrics:
    parts.append(f"loss {metrics['loss']:.4f}")
  if "learning_rate" in metrics:
    parts.append(f"lr {metrics['learning_rate']:.2e}")
  if "grad_norm" in metrics:
    parts.append(f"grad {metrics['grad_norm']:.3f}")
  if "tokens_per_sec" in metrics:
    parts.append(f"{metrics['tokens_per_sec']:,.0f} tok/s")
  if show_mfu and "mfu" in metrics:
    parts.append(f"MFU {100 * metrics['mfu']:.0f}%")
  if math.isfinite(seconds_per_step):
    parts.append(f"{seconds_per_step:.3f} s/step")
    parts.append(f"ETA {format_duration((total - step) * seconds_per_step)}")
  return " | ".join(parts)


def log(message: str) -> None:
  """Console output of process 0 (other processes stay quiet)."""
  if jax.process_index() == 0:
    logging.info(message)


def eval_metrics(loss: float) -> dict[str, float]:
  """Validation loss in nats per token, its perplexity and bits per token."""
  return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0)), "eval_bits_per_token": loss / math.log(2)}
