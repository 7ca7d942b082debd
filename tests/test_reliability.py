"""Reliability: preemption (SIGTERM, SIGKILL), damaged checkpoints, non-finite guards, determinism, two processes."""

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from retnet_jax.core import sharding
from retnet_jax.training import checkpointing, train, train_state, train_step
from tests.helpers import (assert_resumed_from, corpus_slice, flip_bytes, free_port, logged_steps, read_metrics,
                           run_script, tiny_config)

REPO = Path(__file__).resolve().parent.parent
TRAIN = dict(batch_size=8, seq_len=32, warmup_steps=2, log_every_steps=1, eval_batches=1)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  return corpus_slice(tmp_path_factory.mktemp("corpus"))


def in_process_config(corpus, **train_overrides):
  return tiny_config(corpus.parent, **{**TRAIN, "steps": 12, "eval_every_steps": 100, **train_overrides})


def script_flags(workdir, corpus, **train_overrides):
  """Flags of the tiny model on `corpus` with TRAIN's settings: for train.py, evaluate.py and generate.py."""
  return ([f"--config={REPO / 'configs' / 'retnet.py'}:tiny", f"--workdir={workdir}",
           f"--config.data.files=('{corpus}',)"]
          + [f"--config.train.{k}={v}" for k, v in {**TRAIN, **train_overrides}.items()])


def launch(workdir, corpus, devices=1, steps=300, extra=(), **checkpoint):
  """Starts scripts/train.py on `devices` CPU devices, logging every step."""
  flags = script_flags(workdir, corpus, steps=steps, eval_every_steps=10_000)
  flags += [f"--config.checkpoint.{k}={v}" for k, v in {"every_steps": 10_000, **checkpoint}.items()]
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  return subprocess.Popen([sys.executable, str(REPO / "scripts" / "train.py"), *flags, *extra], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process, timeout=300):
  output, _ = process.communicate(timeout=timeout)
  assert process.returncode == 0, output[-3000:]
  return output


def wait_for(condition, process, timeout=120):
  deadline = time.time() + timeout
  while not condition():
    assert process.poll() is None, process.communicate()[0][-3000:]
    assert time.time() < deadline, "timed out"
    time.sleep(0.002)


def rows_logged(workdir):
  """How many rows metrics.jsonl holds so far (0 before it is written)."""
  path = Path(workdir) / "metrics.jsonl"
  return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
  """An uninterrupted 300-step run in a subprocess on one device: the losses every other run must reproduce."""
  workdir = tmp_path_factory.mktemp("reference")
  finish(launch(workdir, corpus))
  return read_metrics(workdir)


@pytest.mark.slow
def test_sigterm_checkpoints_exits_zero_and_resumes_exactly(tmp_path, corpus, reference):
  """SIGTERM saves the step it stopped at; the rerun resumes from that checkpoint and logs every step as an
  uninterrupted run does."""
  workdir = tmp_path / "run"
  process = launch(workdir, corpus)
  wait_for(lambda: rows_logged(workdir) >= 30, process)
  process.send_signal(signal.SIGTERM)
  output = finish(process)
  assert "SIGTERM received: checkpoint of step" in output
  with checkpointing.Checkpointer(workdir / "checkpoints") as checkpointer:
    stopped_at = checkpointer.latest_step()
  assert 30 <= stopped_at < 300 and max(read_metrics(workdir)) == stopped_at  # nothing lost: the last step is saved
  assert_resumed_from(workdir, stopped_at, finish(launch(workdir, corpus)))
  assert read_metrics(workdir) == reference  # every step, bitwise


@pytest.mark.slow
def test_a_closed_terminal_checkpoints_and_exits_zero(tmp_path, corpus):
  """SIGHUP (the terminal of a run started without nohup closed) stops as SIGTERM does: the last step is saved."""
  workdir = tmp_path / "run"
  process = launch(workdir, corpus, steps=100_000)
  wait_for(lambda: rows_logged(workdir) >= 30, process)
  process.send_signal(signal.SIGHUP)
  output = finish(process)
  assert "SIGHUP received: checkpoint of step" in output
  with checkpointing.Checkpointer(workdir / "checkpoints") as checkpointer:
    assert checkpointer.latest_step() == max(read_metrics(workdir)) >= 30


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_with_one_line(tmp_path, corpus):
  workdir = tmp_path / "run"
  process = launch(workdir, corpus, steps=100_000, every_steps=20)
  wait_for(lambda: rows_logged(workdir) >= 30, process)
  process.send_signal(signal.SIGINT)
  time.sleep(0.2)
  process.send_signal(signal.SIGINT)
  output, _ = process.communicate(timeout=60)
  errors = [line for line in output.splitlines() if line.startswith("error:")]
  if process.returncode == -signal.SIGINT and "SIGINT received: checkpoint of step" in output:
    # The first Ctrl-C's checkpoint and stop finished within the 0.2 s: the second arrived as Python was exiting,
    # with nothing left to interrupt (the run is saved).
    assert "Traceback" not in output and not errors, output[-3000:]
    return
  assert process.returncode == 128 + signal.SIGINT and "Traceback" not in output, output[-3000:]
  assert len(errors) == 1 and re.fullmatch(rf"error: (interrupted by a second Ctrl-C|stopped by SIGINT); the last "
                                           rf"checkpoint in {workdir} is step \d+: rerun the same command to go on "
                                           r"from there.", errors[0]), errors


@pytest.mark.slow
def test_sigkill_right_after_a_checkpoint_started_loses_only_that_interval(tmp_path, corpus, reference):
  """SIGKILL while checkpoint 50 is written: the rerun resumes from the last whole checkpoint (50, or 25 when 50 was
  not yet committed), training again only the steps after it, and logs every step as an uninterrupted run does."""
  workdir = tmp_path / "run"
  process = launch(workdir, corpus, every_steps=25, async_save=True)
  checkpoints = workdir / "checkpoints"
  started = lambda: checkpoints.is_dir() and any(p.name.startswith("50") for p in checkpoints.iterdir())
  wait_for(started, process)
  process.kill()  # SIGKILL while step 50 is being written (or just after)
  process.wait()
  with checkpointing.Checkpointer(checkpoints) as checkpointer:
    latest = checkpointer.latest_step()
  assert latest in (25, 50)  # a half-written 50 is never taken as the latest
  assert (workdir / "train_0.lock").exists()  # the killed run's lock file stays, but its lock died with it
  assert_resumed_from(workdir, latest, finish(launch(workdir, corpus, every_steps=25, async_save=True)))
  assert read_metrics(workdir) == reference  # steps after `latest` were redone identically


@pytest.mark.slow
def test_evaluating_and_sampling_while_training_leave_it_intact(tmp_path, corpus, reference):
  """Readers open checkpoints read-only: evaluate.py and generate.py against a workdir that is training (saving
  asynchronously every 5 steps) succeed, and the training finishes with every step equal to an uninterrupted run.
  (A reader used to remove the writer's save in flight, and the training died.)"""
  workdir = tmp_path / "run"
  process = launch(workdir, corpus, every_steps=5, async_save=True)
  checkpoints = workdir / "checkpoints"
  wait_for(lambda: checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir()), process)
  readers = [("evaluate.py", ["--max_batches=1"]), ("generate.py", ["--max_new_tokens=4", "--stream=false"])]
  reads = 0
  while process.poll() is None and reads < 6:
    script, extra = readers[reads % 2]
    result = run_script(script, *script_flags(workdir, corpus), *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    reads += 1
  finish(process)
  assert reads >= 2  # at least one evaluation and one sampling overlapped the training
  assert read_metrics(workdir) == reference
  assert not [p.name for p in checkpoints.iterdir() if not p.name.isdigit()]  # no save left half-written
  with checkpointing.Checkpointer(checkpoints, read_only=True) as checkpointer:
    assert checkpointer.latest_step() == 300


@pytest.mark.slow
def test_a_second_training_in_a_live_workdir_is_refused(tmp_path, corpus, reference):
  """Two trainings in one workdir: the second is refused at once, naming the first, which runs on undisturbed."""
  workdir = tmp_path / "run"
  first = launch(workdir, corpus)
  wait_for(lambda: rows_logged(workdir) >= 1, first)
  first.send_signal(signal.SIGSTOP)  # alive but paused, holding its lock, until the second has tried
  try:
    second = launch(workdir, corpus)
    output, _ = second.communicate(timeout=300)
  finally:
    first.send_signal(signal.SIGCONT)
  assert second.returncode != 0 and f"is being trained by process {first.pid} on" in output, output[-3000:]
  finish(first)
  assert read_metrics(workdir) == reference and logged_steps(workdir) == list(range(1, 301))  # the first run alone


@pytest.fixture
def small_disk(tmp_path):
  """A 1,200 KiB tmpfs (room for two checkpoints of the tiny model), remountable; skipped unless root can mount."""
  disk = tmp_path / "disk"
  disk.mkdir()
  if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", str(disk)],
                                         capture_output=True).returncode != 0:
    pytest.skip("mounting a small tmpfs needs root")
  yield disk
  subprocess.run(["umount", "-l", str(disk)], check=True)


def one_error(output):
  """The error line a failed script ends with, after checking that nothing printed a traceback."""
  assert "Traceback" not in output, output[-3000:]
  return output.strip().splitlines()[-1]


@pytest.mark.slow
def test_full_then_read_only_disk_give_one_message_each_and_the_run_resumes_exactly(tmp_path, corpus, reference,
                                                                                    small_disk):
  """A disk that fills up stops the training with one message naming it, the committed checkpoint and the fix;
  read-only, training is refused and evaluation still prints its results; with room again the run resumes and
  every step equals an uninterrupted run's, resumed from the committed checkpoint."""
  workdir = small_disk / "run"
  process = launch(workdir, corpus, every_steps=5, async_save=True)
  output, _ = process.communicate(timeout=300)
  error = one_error(output)
  assert process.returncode == 1 and error.startswith(f"error: cannot write to the workdir {workdir}: its disk is "
                                                      "full"), output[-3000:]
  committed = int(error.split("resume from step ")[1].split(".")[0])
  assert f"checkpoint {committed} is committed and intact" in error and committed >= 5
  read_metrics(workdir)  # metrics.jsonl is still valid JSON lines

  subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
  process = launch(workdir, corpus, every_steps=5, async_save=True)
  output, _ = process.communicate(timeout=300)
  assert process.returncode == 1 and "Read-only file system" in one_error(output), output[-3000:]
  assert "writable --workdir" in output
  result = run_script("evaluate.py", *script_flags(workdir, corpus), "--max_batches=1")
  assert result.returncode == 0 and json.loads(result.stdout.splitlines()[-1])["step"] == committed
  assert "could not write" in result.stderr and "Traceback" not in result.stderr

  subprocess.run(["mount", "-o", "remount,rw,size=20m", str(small_disk)], check=True)
  assert_resumed_from(workdir, committed, finish(launch(workdir, corpus, every_steps=5, async_save=True)))
  assert read_metrics(workdir) == reference


@pytest.mark.slow
def test_a_workdir_deleted_while_training_stops_it_promptly_with_one_message(tmp_path, corpus):
  workdir = tmp_path / "run"
  process = launch(workdir, corpus, every_steps=5, async_save=True)
  wait_for(lambda: rows_logged(workdir) >= 20, process)
  while workdir.exists():  # the training keeps writing into it meanwhile
    shutil.rmtree(workdir, ignore_errors=True)
  output, _ = process.communicate(timeout=60)
  error = f"error: the workdir {workdir} vanished while training"
  assert process.returncode == 1 and error in one_error(output), output[-3000:]


@pytest.mark.slow
def test_a_workdir_moved_while_training_is_not_recreated_at_its_old_path(tmp_path, corpus, reference):
  """The save in flight recreated checkpoints/STEP.orbax-checkpoint-tmp at the old path, so moving the workdir back
  nested it and training restarted from step 0. Moved once a checkpoint is committed (saving every 5 steps, the next
  one likely in flight): moved back, the run resumes from its newest committed checkpoint."""
  workdir = tmp_path / "run"
  process = launch(workdir, corpus, every_steps=5, async_save=True)
  checkpoints = workdir / "checkpoints"
  committed = lambda: checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir())
  wait_for(lambda: rows_logged(workdir) >= 30 and committed(), process)
  workdir.rename(tmp_path / "moved")
  output, _ = process.communicate(timeout=60)
  error = f"error: the workdir {workdir} vanished while training"
  assert process.returncode == 1 and error in one_error(output), output[-3000:]
  time.sleep(1)
  assert not workdir.exists()
  (tmp_path / "moved").rename(workdir)  # put back, as the message says: it resumes
  with checkpointing.Checkpointer(checkpoints, read_only=True) as checkpointer:
    latest = checkpointer.latest_step()
  assert latest is not None and latest >= 5
  assert_resumed_from(workdir, latest, finish(launch(workdir, corpus)))
  assert read_metrics(workdir) == reference


def test_writer_lock_is_exclusive_and_released(tmp_path):
  from retnet_jax.runs import workdir as workdir_lib, workdir_lock  # pylint: disable=import-outside-toplevel
  with workdir_lib.writer_lock(tmp_path):
    with pytest.raises(workdir_lock.WorkdirBusyError, match=rf"being trained by process {os.getpid()} on .* since"):
      workdir_lib.writer_lock(tmp_path).acquire()  # another open file description: flock excludes it too
    with workdir_lib.writer_lock(tmp_path, process_index=1):  # another process of the same run: its own lock
      pass
  with workdir_lib.writer_lock(tmp_path):  # released on exit
    pass
  with checkpointing.Checkpointer(tmp_path, read_only=True) as reader:
    with pytest.raises(ValueError, match="read-only"):
      reader.save(1, {"x": np.zeros(2)}, {})


@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus):
  """An uninterrupted in-process run of `in_process_config`: (workdir, its last metrics)."""
  workdir = tmp_path_factory.mktemp("straight")
  return workdir, train.train_and_evaluate(in_process_config(corpus), workdir)


def _garble_arrays(step_dir):
  for file in (step_dir / "state").rglob("*"):
    if file.is_file():
      file.write_bytes(b"\0garbage" * 3)


@pytest.mark.parametrize("damage", [
    _garble_arrays,
    lambda step_dir: (step_dir / "meta" / "metadata").write_text("{not json"),
    lambda step_dir: (step_dir / "state" / "_METADATA").unlink(),
    lambda step_dir: flip_bytes(step_dir, every_data_file=True),
], ids=["arrays", "meta", "array_metadata", "flipped_bytes"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, corpus, straight, run_crashing_at_batch,
                                                              damage):
  config = in_process_config(corpus)
  straight_workdir, straight = straight
  run_crashing_at_batch(10, train.train_and_evaluate, config, tmp_path / "run")  # checkpoints 4 and 8 written
  damage(tmp_path / "run" / "checkpoints" / "8")
  resumed = train.train_and_evaluate(config, tmp_path / "run")
  assert (tmp_path / "run" / "checkpoints" / "8.corrupt").is_dir()
  assert_resumed_from(tmp_path / "run", 4)  # not from step 0: steps 5-12 redone
  assert read_metrics(tmp_path / "run") == read_metrics(straight_workdir)
  assert resumed["eval_loss"] == straight["eval_loss"]


def corrupt_targets_at(monkeypatch, steps):
  """Training steps `steps` (counted from 1) get their batch with the last targets outside the vocabulary: a NaN
  loss with finite gradients (an out-of-range label's logit reads as NaN and takes no gradient)."""
  setup = train_step.setup

  def corrupting_setup(config, mesh):
    run = setup(config, mesh)

    def corrupting_step(state, tokens_BxL1):
      if int(state.step) + 1 in steps:
        corrupt = np.array(tokens_BxL1)
        corrupt[:, -1] = config.model.vocab_size
        tokens_BxL1 = jax.device_put(corrupt, tokens_BxL1.sharding)
      return run.train_step(state, tokens_BxL1)

    return dataclasses.replace(run, train_step=corrupting_step)

  monkeypatch.setattr(train_step, "setup", corrupting_setup)


def test_nonfinite_step_is_skipped_and_counted(tmp_path, corpus, monkeypatch):
  config = in_process_config(corpus, steps=6, nonfinite="skip")
  corrupt_targets_at(monkeypatch, steps=(3,))
  final = train.train_and_evaluate(config, tmp_path / "run")
  logged = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  by_step = {m["step"]: m for m in logged if "loss" in m}
  assert by_step[3]["loss"] is None and by_step[3]["nonfinite"] == ["loss", "perplexity"]  # valid JSON: null, flagged
  assert by_step[2]["nonfinite_steps"] == 0 and by_step[3]["nonfinite_steps"] == 1
  assert final["nonfinite_steps"] == 1 and np.isfinite(final["eval_loss"])


def test_nonfinite_step_stops_the_run_naming_it(tmp_path, corpus, monkeypatch):
  config = in_process_config(corpus, steps=8, nonfinite="stop")
  corrupt_targets_at(monkeypatch, steps=(6,))
  config.checkpoint.every_steps = 4
  with pytest.raises(FloatingPointError, match=r"at step 6;.*checkpoint \(step 4\) is intact"):
    train.train_and_evaluate(config, tmp_path / "run")
  with checkpointing.Checkpointer(tmp_path / "run" / "checkpoints") as checkpointer:
    assert checkpointer.all_steps() == [4]


def test_a_removed_lock_file_is_told_from_a_vanished_workdir(tmp_path):
  from retnet_jax.runs import workdir as workdir_lib, workdir_lock  # pylint: disable=import-outside-toplevel
  (tmp_path / "run").mkdir()
  with workdir_lib.writer_lock(tmp_path / "run") as lock:
    lock.check_held()
    lock.path.unlink()
    with pytest.raises(workdir_lock.LockFileRemovedError, match=r"the lock file .*train_0.lock was removed"):
      lock.check_held()
    (tmp_path / "run").rename(tmp_path / "moved")
    (tmp_path / "run").mkdir()  # another directory at its path
    with pytest.raises(workdir_lock.WorkdirVanishedError, match=r"vanished while training"):
      lock.check_held()


@pytest.mark.slow
def test_a_lock_file_removed_while_training_stops_it_after_a_checkpoint(tmp_path, corpus, monkeypatch):
  """It stopped saying the workdir "vanished" (it had not) and lost the steps since the last checkpoint."""
  config = in_process_config(corpus, steps=8)
  config.checkpoint.every_steps = 4
  workdir = tmp_path / "run"
  setup = train_step.setup

  def removing_setup(config, mesh):
    run = setup(config, mesh)

    def removing_step(state, tokens_BxL1):
      if int(state.step) + 1 == 6:
        (workdir / "train_0.lock").unlink()
      return run.train_step(state, tokens_BxL1)

    return dataclasses.replace(run, train_step=removing_step)

  monkeypatch.setattr(train_step, "setup", removing_setup)
  with pytest.raises(OSError, match=rf"the lock file {workdir / 'train_0.lock'} was removed while training \(the "
                                    r"workdir is still there\).*so the training stopped; checkpoint 6 is committed in "
                                    rf"{workdir / 'checkpoints'}: run the same command again to resume from there"):
    train.train_and_evaluate(config, workdir)
  with checkpointing.Checkpointer(workdir / "checkpoints") as checkpointer:
    assert checkpointer.all_steps() == [4, 6]


def test_same_seed_same_losses(tmp_path, corpus):
  config = in_process_config(corpus, steps=6)
  train.train_and_evaluate(config, tmp_path / "a")
  train.train_and_evaluate(config, tmp_path / "b")
  assert read_metrics(tmp_path / "a") == read_metrics(tmp_path / "b")
  config.seed = 1
  train.train_and_evaluate(config, tmp_path / "c")
  assert read_metrics(tmp_path / "c") != read_metrics(tmp_path / "a")


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path, corpus):
  """2 processes x 4 CPU devices (gloo collectives over loopback) vs 1 process x 8 devices."""
  steps = 12
  single = tmp_path / "single"
  finish(launch(single, corpus, devices=8, steps=steps, every_steps=6))
  multi = tmp_path / "multi"
  port = free_port()
  processes = [launch(multi, corpus, devices=4, steps=steps, every_steps=6,
                      extra=[f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}"])
               for i in range(2)]
  for process in processes:
    finish(process)
  single_losses, multi_losses = read_metrics(single), read_metrics(multi)
  assert logged_steps(multi) == list(range(1, steps + 1))  # each step once: process 0 alone writes the metrics
  assert max(abs(single_losses[s] - multi_losses[s]) for s in single_losses) < 1e-5

  config = in_process_config(corpus, steps=steps)  # the jointly written checkpoint restores in one process
  run = train_state.make_layout(config, sharding.placement(config.mesh))
  with checkpointing.Checkpointer(multi / "checkpoints") as checkpointer:
    state, meta = checkpointer.restore(run.abstract_state.saved())
  exported = checkpointing.load_params(single / "params" / str(steps), run.abstract_state.params)
  assert int(state["step"]) == steps
  difference = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                   for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(exported)))
  assert difference < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("peer_host", ["this", "another"])
def test_a_lost_process_is_named_in_one_line_by_the_survivor(tmp_path, corpus, peer_host):
  """Process 1 SIGKILLed mid-run: process 0 says so in one line naming it, instead of JAX's abort with a stack dump
  after the heartbeat timeout: by its lock on this host, else (its lock names another host, which flock cannot
  read) by its pulse in the coordinator's store standing still (peer_watch)."""
  workdir, port = tmp_path / "run", free_port()
  processes = [launch(workdir, corpus, devices=4, steps=100_000, every_steps=5,
                      extra=[f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}"])
               for i in range(2)]
  wait_for(lambda: rows_logged(workdir) >= 12, processes[0])
  if peer_host == "another":  # its lock file names another host: flock cannot tell whether it lives
    (workdir / "train_1.lock").write_text(json.dumps({"pid": 1, "host": "another-host", "started": "then"}))
  processes[1].kill()
  processes[1].wait()
  started = time.monotonic()
  output, _ = processes[0].communicate(timeout=120)
  errors = [line for line in output.splitlines() if line.startswith("error:")]
  assert processes[0].returncode == 1 and len(errors) == 1, output[-3000:]
  evidence = (r"its lock .*train_1.lock was released" if peer_host == "this" else
              r"no sign of life from it for \d+ s")
  expected = (rf"error: training process 1 is gone \({evidence} while this process waited on it\); the last "
              r"committed checkpoint is step \d+: restart every process with the same command to resume.")
  assert re.fullmatch(expected, errors[0]), errors
  assert time.monotonic() - started < 60 and "Traceback" not in output and "Fatal" not in output
