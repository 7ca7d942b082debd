"""Results, plots, configs, marks and exported tensors are written whole (`whole_files`): a write that fails or is
killed midway leaves the old file (or none) under the name, never a part, and writes over no other file."""

import json
import signal
import subprocess
import sys

import pytest

from retnet_jax.core import whole_files
from retnet_jax.training import metrics


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
  target = tmp_path / "eval_step_8.json"
  target.write_text('{"old": 1}\n')
  with pytest.raises(KeyboardInterrupt):
    with whole_files.replacing(target) as partial:
      partial.write_text('{"new": ')
      raise KeyboardInterrupt
  assert target.read_text() == '{"old": 1}\n'
  assert sorted(p.name for p in tmp_path.iterdir()) == ["eval_step_8.json"]
  whole_files.write_text(target, '{"new": 2}\n')
  assert target.read_text() == '{"new": 2}\n' and len(list(tmp_path.iterdir())) == 1


def test_a_killed_write_leaves_no_partial_result(tmp_path):
  """A process killed (SIGKILL) halfway through writing a result leaves no file of that name: results killed
  mid-write were truncated JSON of 175 bytes that nothing mentioned."""
  target = tmp_path / "passkey_step_8.json"
  code = ("import os, signal, sys\nfrom retnet_jax.core import whole_files\n"
          "with whole_files.replacing(sys.argv[1]) as partial:\n"
          "  partial.write_text('{\"accuracy\": [[0.5, ')\n  os.kill(os.getpid(), signal.SIGKILL)\n")
  done = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, timeout=120)
  assert done.returncode == -signal.SIGKILL
  assert not target.exists()
  left = [p.name for p in tmp_path.iterdir()]  # the hidden temporary, never read as a result
  assert len(left) == 1 and left[0].startswith(".passkey_step_8.partial.") and left[0].endswith(".json")


def test_results_and_their_plot_are_written_whole(tmp_path):
  """`metrics.write_results`: the JSON line whole; a plot interrupted midway leaves no PNG and no temporary."""
  def plot(results, png):
    with whole_files.replacing(png) as partial:
      partial.write_bytes(b"\x89PNG half")
      raise KeyboardInterrupt
  with pytest.raises(KeyboardInterrupt):
    metrics.write_results({"step": 8, "loss": 1.5}, tmp_path / "eval_step_8.json", plot)
  assert json.loads((tmp_path / "eval_step_8.json").read_text()) == {"step": 8, "loss": 1.5}
  assert sorted(p.name for p in tmp_path.iterdir()) == ["eval_step_8.json"]


def test_the_temporary_never_takes_a_name_the_folder_holds(tmp_path):
  for name in (".eval_step_8.partial.json", "eval_step_8.json.partial", ".eval_step_8.json.partial"):
    (tmp_path / name).write_bytes(b"the user's")
  whole_files.write_text(tmp_path / "eval_step_8.json", "{}\n")
  assert all((tmp_path / name).read_bytes() == b"the user's" for name in (
      ".eval_step_8.partial.json", "eval_step_8.json.partial", ".eval_step_8.json.partial"))
