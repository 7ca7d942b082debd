"""The project writes only into folders it owns (new, empty, or carrying its mark), and inside them touches only the
names it recorded: each case of the issue where a user's file was overwritten, deleted or moved keeps its bytes."""

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import pytest

from configs import retnet as retnet_config
from retnet_jax.core import owned_folders, sharding
from retnet_jax.interop import convert
from retnet_jax.runs import workdir as workdir_lib
from retnet_jax.training import checkpointing, integrity, run_checkpoints, train, train_state
from tests.helpers import assert_resumed_from, run_script, script_flags
from tests.test_prepared import interrupted, prepare
from tests.test_workdir import newest, save_steps

NOT_OURS = r"which this project did not write"


def contents(folder):
  """Every file under `folder` by relative path -> its bytes."""
  return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def users_folder(folder, files):
  """`folder` created with the user's `files` (relative path -> bytes); returns their contents."""
  for name, data in files.items():
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)
  return contents(folder)


def test_a_folder_is_claimed_when_new_empty_or_marked_and_records_what_is_written(tmp_path):
  folder = owned_folders.claim(tmp_path / "new", "workdir", flag="--workdir", writes=("a",))
  mark = json.loads((tmp_path / "new" / owned_folders.MARK).read_text())
  assert mark == {"tool": "retnet_jax", "format": "workdir", "version": owned_folders.VERSION, "written": ["a"]}
  folder.record("b")
  (tmp_path / "new" / "users").write_text("mine")
  with pytest.raises(owned_folders.NotOwnedError, match=r"holds 'users', which this project did not write and would"):
    folder.record("users")
  folder.forget("b")
  assert folder.written() == {"a"}
  owned_folders.claim(tmp_path / "new", "workdir", flag="--workdir")  # marked: its own
  with pytest.raises(owned_folders.NotOwnedError, match=r"--out='.*new' is a workdir folder of this project, not a "
                                                        r"prepared corpus"):
    owned_folders.check(tmp_path / "new", "prepared corpus", flag="--out")
  (tmp_path / "empty").mkdir()
  owned_folders.claim(tmp_path / "empty", "workdir", flag="--workdir")
  before = users_folder(tmp_path / "taken", {"notes.txt": b"notes", "a": b"mine"})
  with pytest.raises(owned_folders.NotOwnedError, match=r"holds 'a', which this project did not write and would "
                                                        r"write over"):
    owned_folders.claim(tmp_path / "taken", "workdir", flag="--workdir", writes=("a",), take=True)
  taken = owned_folders.claim(tmp_path / "taken", "workdir", flag="--workdir", writes=("b",), take=True)
  assert taken.written() == {"b"} and contents(tmp_path / "taken") == {
      **before, owned_folders.MARK: (tmp_path / "taken" / owned_folders.MARK).read_bytes()}


def test_training_refuses_a_users_folder_before_any_work_and_keeps_its_bytes(tmp_path, monkeypatch):
  """Case 1: config.json was replaced and an unfinished line of metrics.jsonl cut; also --workdir=. in sources."""
  config = retnet_config.get_config("tiny")
  before = users_folder(tmp_path / "d", {"config.json": b'{"my":"config"}', "metrics.jsonl": b'{"a": 1}\n{"b": '})
  with pytest.raises(owned_folders.NotOwnedError, match=rf"--workdir='.*d' holds 'config.json', 'metrics.jsonl', "
                                                        rf"{NOT_OURS} \(no .retnet_jax.json\); choose a new or empty "
                                                        r"--workdir, or pass --take_folder"):
    train.train_and_evaluate(config, tmp_path / "d")
  with pytest.raises(owned_folders.NotOwnedError, match=r"holds 'config.json', 'metrics.jsonl', which this project "
                                                        r"did not write and would write over"):
    train.train_and_evaluate(config, tmp_path / "d", take_folder=True)
  assert contents(tmp_path / "d") == before
  sources = users_folder(tmp_path / "src", {"model.py": b"code", "notes.md": b"notes"})
  monkeypatch.chdir(tmp_path / "src")
  with pytest.raises(owned_folders.NotOwnedError, match=rf"--workdir='.' holds 'model.py', 'notes.md', {NOT_OURS}"):
    train.train_and_evaluate(config, ".")
  assert contents(tmp_path / "src") == sources


def test_a_workdir_of_another_frameworks_checkpoints_is_refused_and_none_set_aside(tmp_path):
  """Case 5: another framework's checkpoints/1000 and 2000 were renamed to *.corrupt."""
  config = retnet_config.get_config("tiny")
  before = users_folder(tmp_path / "d", {"checkpoints/1000/model.bin": b"a", "checkpoints/2000/model.bin": b"b"})
  with pytest.raises(owned_folders.NotOwnedError, match=rf"--workdir='.*d' holds 'checkpoints', {NOT_OURS}"):
    train.train_and_evaluate(config, tmp_path / "d")
  assert contents(tmp_path / "d") == before
  save_steps(tmp_path / "run", config, (1,))  # a run's own folder, where a foreign step was put since
  users_folder(tmp_path / "run", {"checkpoints/2000/model.bin": b"b"})
  with pytest.raises(ValueError, match=r"checkpoints/2000 is not a checkpoint this project wrote \(it holds "
                                       r"\['model.bin'\], not state and meta\); move it out of"):
    newest(tmp_path / "run", config, read_only=False)
  assert (tmp_path / "run" / "checkpoints" / "2000" / "model.bin").read_bytes() == b"b"


def test_a_conversion_into_a_folder_holding_another_config_is_refused(tmp_path):
  """Case 2: convert_fla.py --checkpoint=X --workdir=X replaced fla's own config.json in X."""
  before = users_folder(tmp_path / "x", {"config.json": b'{"model_type": "retnet"}', "model.safetensors": b"w"})
  for take in (False, True):
    with pytest.raises(owned_folders.NotOwnedError, match=r"--workdir='.*x' holds 'config.json'"):
      convert.check_empty_workdir(tmp_path / "x", take)
  assert contents(tmp_path / "x") == before


def test_a_users_progress_partial_in_out_is_refused(tmp_path):
  """Case 3: the user's progress.partial was overwritten, renamed to progress.json and deleted."""
  before = users_folder(tmp_path / "d", {"progress.partial": b"the user's"})
  for take in (False, True):
    with pytest.raises(owned_folders.NotOwnedError, match=r"--out='.*d' holds 'progress.partial', which this "):
      prepare(tmp_path / "d", take=take)
  assert contents(tmp_path / "d") == before


def test_a_resumed_prepare_removes_only_the_shards_it_recorded(tmp_path):
  """Case 4: a user's train-00099.tokens put in an interrupted prepare's --out was deleted by the rerun; a user's
  file under a name the prepare comes to write is refused by name, kept, and the prepare resumes once it is moved."""
  with pytest.raises(KeyboardInterrupt):
    prepare(tmp_path / "c", interrupted(40))
  users = {"train-00099.tokens": b"the user's", "train-00006.tokens": b"also the user's"}
  users_folder(tmp_path / "c", users)
  with pytest.raises(owned_folders.NotOwnedError, match=r"holds 'train-00006.tokens', which this project did not "
                                                        r"write and would write over; move it elsewhere"):
    prepare(tmp_path / "c")
  assert {name: (tmp_path / "c" / name).read_bytes() for name in users} == users
  (tmp_path / "c" / "train-00006.tokens").rename(tmp_path / "kept")
  prepare(tmp_path / "c")
  assert (tmp_path / "c" / "train-00099.tokens").read_bytes() == b"the user's"
  assert (tmp_path / "kept").read_bytes() == b"also the user's"


def test_results_never_land_on_a_file_the_run_reads(trained, tmp_path):
  """Case 6: harness_eval.py --output_path=WORKDIR/config.json replaced the run's config.json."""
  config_json = workdir_lib.config_file(trained.workdir)
  with pytest.raises(ValueError, match=r"--output_path=.*config.json exists and is not a results file \(it records "
                                       r"no \"settings\"\): the results would replace it; name a new .json file"):
    workdir_lib.check_results_path(config_json, "--output_path")
  with pytest.raises(ValueError, match=r"lies inside the checkpoints/ folder of the run"):
    workdir_lib.check_results_path(workdir_lib.checkpoint_dir(trained.workdir) / "r.json", "--output_path")
  (tmp_path / "old.json").write_text(json.dumps({"results": {}, "settings": []}))
  for path in (tmp_path / "new.json", tmp_path / "old.json"):
    workdir_lib.check_results_path(path, "--output_path")


def test_an_earlier_versions_workdir_is_adopted_and_resumes(trained_copy):
  """A workdir written before the mark (config.json, checkpoints/, metrics.jsonl) is recognised and marked, and
  the run resumes from its checkpoint 8."""
  workdir = trained_copy.workdir
  (workdir / owned_folders.MARK).unlink()
  (workdir / workdir_lib.METRICS_PLOT).unlink()  # written since the mark
  (workdir / "notes.md").write_text("mine")
  train.train_and_evaluate(trained_copy.config, workdir)  # at its last step: nothing to train
  assert_resumed_from(workdir, 8)
  written = owned_folders.OwnedFolder(workdir, workdir_lib.FORMAT).written()
  assert {"config.json", "checkpoints", "metrics.jsonl", "params", "tensorboard", "train_0.lock"} <= written
  assert "notes.md" not in written and (workdir / "notes.md").read_text() == "mine"


def abstract_params(config):
  return train_state.model_layout(config, sharding.placement(config.mesh))[1]


def stale_export(workdir, config):
  """Replaces the run's params/8 by an export of other params; returns the checkpoint's params."""
  params, _ = run_checkpoints.read_params(workdir, config, abstract_params(config))
  checkpointing.export_params(workdir_lib.export_dir(workdir, 8), jax.tree.map(lambda x: x + 1, params), replace=True)
  return params


def test_an_export_of_other_params_is_exported_again_by_a_rerun(trained_copy):
  """A params/STEP left from an earlier training of the workdir (its checkpoints/ deleted, retrained with another
  seed) was kept, logged as the run's params and scored."""
  workdir, config = trained_copy.workdir, trained_copy.config
  params = stale_export(workdir, config)
  train.train_and_evaluate(config, workdir)  # at its last step: exports again
  assert_resumed_from(workdir, 8)  # checkpoint 8 restored, no step trained again
  assert checkpointing.exported_checksums(workdir_lib.export_dir(workdir, 8)) == integrity.checksums(params)


def test_an_export_without_checksums_is_refused_and_exported_again(trained_copy):
  """An export lacking checksums.json (interrupted) was read unverified and never repaired by a rerun."""
  workdir, config = trained_copy.workdir, trained_copy.config
  params, _ = run_checkpoints.read_params(workdir, config, abstract_params(config))
  export = workdir_lib.export_dir(workdir, 8)
  (export / "checksums.json").unlink()
  shutil.move(workdir_lib.checkpoint_dir(workdir), workdir / "moved")
  with pytest.raises(ValueError, match=r"the params export .*params/8 is unreadable \(DamagedCheckpointError: the "
                                       r"params export at .* has no readable checksums.json \(its export was "
                                       r"interrupted\): it cannot be verified; run the training command again"):
    run_checkpoints.read_params(workdir, config, abstract_params(config))
  assert run_checkpoints.export_params(workdir, 8, params) == export
  assert checkpointing.exported_checksums(export) == integrity.checksums(params)
  assert not checkpointing.export_params(export, params)  # the same params: kept


@pytest.mark.slow
def test_train_script_refuses_a_users_folder_in_one_line(trained, tmp_path):
  before = users_folder(tmp_path / "d", {"config.json": b'{"my":"config"}', "metrics.jsonl": b'{"a": 1}\n{"b": '})
  result = run_script("train.py", *script_flags(trained.config, tmp_path / "d"))
  assert result.returncode == 1 and contents(tmp_path / "d") == before
  assert result.stderr.strip().splitlines()[-1].startswith(f"error: --workdir='{tmp_path / 'd'}' holds 'config.json'")


def test_a_claim_waits_for_another_process_writing_the_mark(tmp_path, monkeypatch):
  """Two processes of one run claim their workdir at once: the second read the folder, unlocked, while the first
  held the lock and its mark was a temporary file beside the mark, and refused the folder as holding a file the
  project did not write. It now checks the folder under the lock, once that mark is whole."""
  folder = tmp_path / "run"
  folder.mkdir()
  partial = folder / "..retnet_jax.partial.x1y2z3.json"
  waiting, flock = threading.Event(), fcntl.flock
  monkeypatch.setattr(owned_folders.fcntl, "flock", lambda fd, op: waiting.set() or flock(fd, op))
  fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
  flock(fd, fcntl.LOCK_EX)
  partial.write_text(json.dumps({"tool": owned_folders.TOOL, "format": "workdir", "version": owned_folders.VERSION,
                                 "written": ["config.json"]}))
  outcome = []
  claimer = threading.Thread(target=lambda: outcome.append(_claimed(folder)))
  claimer.start()
  while not waiting.is_set() and claimer.is_alive():
    time.sleep(0.01)
  os.replace(partial, folder / owned_folders.MARK)
  os.close(fd)  # releases the lock
  claimer.join()
  assert outcome == [{"config.json", "metrics.jsonl"}]


def test_a_mark_left_half_written_by_a_killed_claim_is_removed_by_the_next(tmp_path):
  """A process killed (SIGKILL) while writing a new folder's mark leaves the mark's temporary file and no mark: the
  same command run again refused the folder as holding a file the project did not write. The next claim removes
  it, with the mark's lock held, and marks the folder."""
  folder = tmp_path / "run"
  code = ("import os, signal, sys\nfrom retnet_jax.core import owned_folders\n"
          "os.replace = lambda *args: os.kill(os.getpid(), signal.SIGKILL)  # killed before the mark is whole\n"
          "owned_folders.claim(sys.argv[1], 'workdir', flag='--workdir', writes=['config.json'])\n")
  done = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, timeout=120)
  assert done.returncode == -signal.SIGKILL, done.stderr.decode()
  left = [p.name for p in folder.iterdir()]
  assert len(left) == 1 and left[0].startswith("..retnet_jax.partial.") and left[0].endswith(".json")
  assert owned_folders.check(folder, "workdir", flag="--workdir") is None  # as a new folder
  assert _claimed(folder) == {"metrics.jsonl"}  # the killed claim recorded nothing
  assert [p.name for p in folder.iterdir()] == [owned_folders.MARK]


def _claimed(folder):
  try:
    return owned_folders.claim(folder, "workdir", flag="--workdir", writes=["metrics.jsonl"]).written()
  except owned_folders.NotOwnedError as e:
    return e
