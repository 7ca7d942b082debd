"""metrics.MetricsWriter: metrics.jsonl survives being deleted or replaced mid-run; the progress line; the plot."""

import json
import logging
import re
import struct
import threading
from pathlib import Path

from tensorboardX.proto.event_pb2 import Event

from retnet_jax.core import owned_folders
from retnet_jax.runs import workdir as workdir_lib
from retnet_jax.training import loop, metrics, train
from tests.helpers import tiny_config


def test_a_deleted_or_replaced_metrics_file_is_written_again_with_a_warning(tmp_path, caplog):
  path = tmp_path / "metrics.jsonl"
  with caplog.at_level(logging.WARNING, logger="absl"), metrics.MetricsWriter(tmp_path) as writer:
    writer.write(1, {"loss": 3.0})
    path.unlink()
    writer.write(2, {"loss": 2.0})
    path.rename(tmp_path / "moved.jsonl")
    path.write_text("")
    writer.write(3, {"loss": 1.0})
  assert [json.loads(line) for line in path.read_text().splitlines()] == [{"step": 3, "loss": 1.0}]
  assert [json.loads(line)["step"] for line in (tmp_path / "moved.jsonl").read_text().splitlines()] == [2]
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert warnings == [f"{path} was deleted during training; it is written again from step 2 on (earlier steps: "
                      "tensorboard/ keeps them).",
                      f"{path} was replaced during training; it is written again from step 3 on (earlier steps: "
                      "tensorboard/ keeps them)."]


def _events(path):
  """The events of a TensorBoard event file, read record by record (length, its check, the event, its check)."""
  data, at, events = path.read_bytes(), 0, []
  while at < len(data):
    (length,) = struct.unpack("<Q", data[at:at + 8])
    events.append(Event.FromString(data[at + 12:at + 12 + length]))
    at += 12 + length + 4
  return events


def test_tensorboard_events_are_written_in_this_thread_into_a_new_file_each(tmp_path, monkeypatch):
  """Every value reads back from the event files; no thread is left running (tensorboardX's SummaryWriter left its
  writer thread running after a full disk, which printed a traceback at exit); a second writer within the same
  second adds a file instead of replacing the first's."""
  monkeypatch.setattr(metrics.time, "time", lambda: 1_800_000_000.5)
  threads = threading.active_count()
  for step in (1, 3):
    with metrics.MetricsWriter(tmp_path) as writer:
      assert threading.active_count() == threads
      writer.write(step, {"loss": 2.5, "learning_rate": 0.25})
      writer.write(step + 1, {"loss": 1.5})
  files = sorted((tmp_path / "tensorboard").iterdir())
  assert len(files) == 2 and all(".tfevents.1800000000." in f.name for f in files)
  for step, file in zip((1, 3), files):
    events = _events(file)
    assert events[0].file_version == "brain.Event:2"
    assert [(e.step, e.wall_time, v.tag, v.simple_value) for e in events[1:] for v in e.summary.value] == [
        (step, 1_800_000_000.5, "loss", 2.5), (step, 1_800_000_000.5, "learning_rate", 0.25),
        (step + 1, 1_800_000_000.5, "loss", 1.5)]


def test_progress_line_names_the_step_loss_and_time_left():
  line = metrics.progress_line(100, 400, {"loss": 2.5, "tokens_per_sec": 1234.0}, 0.5)
  assert line == "step 100/400 (25%) | loss 2.5000 | 1,234 tok/s | 0.500 s/step | ETA 2m30s"


def test_mfu_is_left_off_the_line_where_its_ceiling_is_a_measured_matmul():
  """On a CPU the ceiling is a matmul timed at start: the line read "MFU 99%" idle and 21-41% busy, comparable with
  no chip's figure; there the line leaves it to metrics.jsonl's `mfu`."""
  values = {"loss": 2.5, "tokens_per_sec": 1234.0, "mfu": 0.994}
  assert metrics.progress_line(1, 4, values, 0.5) == ("step 1/4 (25%) | loss 2.5000 | 1,234 tok/s | MFU 99% | "
                                                      "0.500 s/step | ETA 0m01s")
  assert metrics.progress_line(1, 4, values, 0.5, show_mfu=False) == ("step 1/4 (25%) | loss 2.5000 | 1,234 tok/s "
                                                                      "| 0.500 s/step | ETA 0m01s")


def test_throughput_divides_by_the_datasheet_peak_or_the_best_rate_seen():
  """MFU = tokens x FLOPs per token / time / peak. A datasheet peak stays; a peak measured at start (a CPU's matmul,
  which reads low while the machine is busy) is raised by a step that does better, so MFU never exceeds 1."""
  datasheet = loop.Throughput(tokens_per_step=1000, flops_per_token=6, peak=12_000.0, measured_peak=False)
  assert datasheet.figures(0.5) == dict(step_time=0.5, tokens_per_sec=2000.0, mfu=1.0)
  assert datasheet.figures(0.25)["mfu"] == 2.0 and datasheet.peak == 12_000.0
  measured = loop.Throughput(tokens_per_step=1000, flops_per_token=6, peak=12_000.0, measured_peak=True)
  assert measured.figures(0.25)["mfu"] == 1.0 and measured.peak == 24_000.0
  assert measured.figures(0.5)["mfu"] == 0.5  # the higher ceiling stays


def test_training_plots_its_loss_and_learning_rate_into_the_workdir(trained):
  """Training wrote no curve to look at without a TensorBoard viewer: at each evaluation it redraws
  WORKDIR/metrics.png from metrics.jsonl, a name recorded in the workdir's mark like the others it writes."""
  png = trained.workdir / workdir_lib.METRICS_PLOT
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1024
  assert workdir_lib.METRICS_PLOT in owned_folders.read_mark(trained.workdir)["written"]


def test_the_last_line_names_every_output_as_the_workdir_was_given(trained_copy, caplog, monkeypatch):
  """It named the checkpoints and params, not metrics.jsonl, metrics.png and tensorboard/; "resumed from" printed an
  absolute path where the last line printed it as given."""
  config, workdir, _ = trained_copy
  monkeypatch.chdir(workdir.parent)
  config.train.steps += 1
  with caplog.at_level(logging.INFO, logger="absl"):
    train.train_and_evaluate(config, Path(workdir.name))
  run = workdir.name
  assert f"resumed from {run}/checkpoints/8 (data position" in caplog.text  # as given too, not absolute
  assert caplog.records[-1].getMessage() == (
      f"done at step 9; checkpoints in {run}/checkpoints, params in {run}/params/9; metrics in {run}/metrics.jsonl "
      f"(plot {run}/metrics.png, TensorBoard {run}/tensorboard)")


def test_progress_lines_come_by_time_until_the_first_logged_step(tmp_path, caplog, monkeypatch):
  """The small run's first line came at step 50, 85 s in: before the first logged step, a line every
  EARLY_PROGRESS_S seconds (here every step) gives the step, its time and the ETA; none after it."""
  monkeypatch.setattr(loop, "EARLY_PROGRESS_S", 0.0)
  config = tiny_config(tmp_path, steps=8, log_every_steps=4, eval_every_steps=8)
  with caplog.at_level(logging.INFO, logger="absl"):
    train.train_and_evaluate(config, tmp_path / "run")
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
  assert [line.split(" (")[0] for line in lines[:4]] == ["step 2/8", "step 3/8", "step 4/8", "step 8/8"]
  assert len(lines) == 5 and lines[4].startswith("step 8: eval loss")
  assert all(re.fullmatch(r"step [23]/8 \(\d+%\) \| [\d.]+ s/step \| ETA \dm\d\ds", line) for line in lines[:2]), lines
  assert "loss" in lines[2]
