"""A run folder written by an earlier version of the project (commit dfafd3f, before the states were typed and the
command line and run folders moved to `retnet_jax.runs`) resumes, evaluates and generates through the scripts, giving
what that version gave: the restructures change no file a run keeps and no number."""

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import assert_resumed_from, metrics_rows, run_script, script_lines, script_stdout

FIXTURE = Path(__file__).resolve().parent / "data" / "workdir_dfafd3f"
EXPECTED = json.loads(FIXTURE.with_suffix(".json").read_text(encoding="utf-8"))


@pytest.mark.slow
def test_a_run_from_dfafd3f_resumes_evaluates_and_generates_as_it_did(tmp_path):
  """Resumed from its checkpoint 4 to step 6: the losses and the eval loss of that version's uninterrupted run (the
  optimizer state, data position and schedule all restored); checkpoint 4's evaluation loss and greedy completion as
  that version computed them."""
  run = tmp_path / "run"
  shutil.copytree(FIXTURE, run)
  trained = run_script("train.py", f"--workdir={run}", *EXPECTED["flags"])
  assert trained.returncode == 0, trained.stderr[-3000:]
  assert_resumed_from(run, 4, trained.stdout + trained.stderr)
  rows = metrics_rows(run)
  for key, expected in (("loss", EXPECTED["losses"]), ("eval_loss", EXPECTED["eval_loss"])):
    got = {str(row["step"]): row[key] for row in rows if key in row and str(row["step"]) in expected}
    assert got == pytest.approx(expected, rel=1e-6, abs=0), key

  evaluation = EXPECTED["evaluate_step_4"]
  evaluated = json.loads(script_lines(script_stdout("evaluate.py", f"--workdir={run}", "--step=4",
                                                    f"--eval_seq_len={evaluation['seq_len']}"))[-1])
  got = {mode: result["loss"] for mode, result in evaluated["modes"].items()}
  assert got == pytest.approx(evaluation["losses"], rel=1e-6, abs=0)
  generation = EXPECTED["generate_step_4"]
  generated = json.loads(script_lines(script_stdout(
      "generate.py", f"--workdir={run}", "--step=4", f"--prompt={generation['prompt']}",
      f"--max_new_tokens={generation['max_new_tokens']}", "--temperature=0"))[-1])
  assert generated["samples"][0]["completion"] == generation["completion"]


@pytest.mark.slow
def test_the_tiny_run_is_bit_for_bit_the_one_before_the_restructure(tmp_path):
  """The same flags trained from step 0: every loss and eval loss exactly as the code before the typed states and
  the moved run folders gave them (the restructure changes no number; a change of numerics on purpose rewrites the
  record)."""
  record = EXPECTED["fresh_run_5765093"]
  # XLA's optimisations on, as a user's run has them (the suite's scripts otherwise run without most of them)
  trained = run_script("train.py", f"--workdir={tmp_path / 'run'}", *EXPECTED["flags"],
                       JAX_DISABLE_MOST_OPTIMIZATIONS="0")
  assert trained.returncode == 0, trained.stderr[-3000:]
  rows = metrics_rows(tmp_path / "run")
  for key in ("loss", "eval_loss"):
    assert {str(row["step"]): row[key] for row in rows if key in row} == record[key if key == "eval_loss" else "losses"]
