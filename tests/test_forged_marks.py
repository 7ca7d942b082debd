"""A folder's mark and its names cannot be turned against the user: a mark whose names reach outside its folder, or
whose fields have the wrong types, is refused in one line naming it before anything is removed; a user's file named
like the mark's temporary is neither ignored nor written over; an output that is a symbolic link is never written
through; paths are checked as resolved and an unexpanded ~ is refused."""

import errno
import json
import os
import re
import shutil

import pytest

from benchmarks import gpu_check
from retnet_jax.core import owned_folders
from retnet_jax.interop import export_fla
from retnet_jax.runs import workdir as workdir_lib
from retnet_jax.training import train
from tests.helpers import run_script
from tests.test_convert_fla import our_fla_model
from tests.test_prepared import prepare


def forged(folder, **fields):
  """`folder` with a mark of the project's shape, `fields` replacing its own."""
  folder.mkdir(parents=True, exist_ok=True)
  mark = {"tool": owned_folders.TOOL, "format": export_fla.FOLDER_FORMAT, "version": 1, "written": [], **fields}
  (folder / owned_folders.MARK).write_text(json.dumps(mark))
  return folder / owned_folders.MARK


@pytest.mark.parametrize("written", [["../outside/victim.txt"], ["ABSOLUTE"], [""], ["."], [".."], ["a/b"],
                                     [5, None], ["ok", "..\x00"]])
def test_a_forged_list_of_names_deletes_nothing_outside_the_folder(tmp_path, written):
  """convert_fla.py --to_fla's stale-file cleanup removed `../outside/victim.txt` and an absolute path that a forged
  mark listed: such a mark is refused in one line naming it, before the export writes or removes anything."""
  victim = tmp_path / "outside" / "victim.txt"
  victim.parent.mkdir()
  victim.write_bytes(b"the user's\n")
  written = [str(victim) if name == "ABSOLUTE" else name for name in written]
  mark = forged(tmp_path / "out", written=written)
  model, config = our_fla_model()
  with pytest.raises(owned_folders.NotOwnedError, match=rf"^{mark}( records .* as written, which are not plain names "
                                                        r"inside its folder| is not retnet_jax's mark)"):
    export_fla.write_fla(model, config, tmp_path / "out")
  assert victim.read_bytes() == b"the user's\n"
  assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [owned_folders.MARK]


@pytest.mark.parametrize("version", [True, -7, 0, "1", 1.0, None])
def test_a_mark_of_the_wrong_types_is_refused_by_name(tmp_path, version):
  mark = forged(tmp_path / "out", version=version)
  with pytest.raises(owned_folders.NotOwnedError, match=rf"^{mark} is not retnet_jax's mark \(tool, format, version, "
                                                        r"written\); choose a new or empty folder\.$"):
    owned_folders.read_mark(tmp_path / "out")


def test_a_users_file_named_like_the_marks_temporary_is_kept(tmp_path):
  """A folder holding only the user's `.retnet_jax.json.partial` counted as empty, and the mark's write went through
  that very name: it is the user's file now, refused as such, and --take_folder writes beside it."""
  folder = tmp_path / "out"
  folder.mkdir()
  (folder / ".retnet_jax.json.partial").write_bytes(b"the user's\n")
  with pytest.raises(owned_folders.NotOwnedError, match=r"holds '\.retnet_jax\.json\.partial', which this project "
                                                        r"did not write"):
    owned_folders.claim(folder, "workdir", flag="--workdir")
  owned = owned_folders.claim(folder, "workdir", flag="--workdir", writes=("config.json",), take=True)
  owned.record("metrics.jsonl")
  assert (folder / ".retnet_jax.json.partial").read_bytes() == b"the user's\n"
  assert sorted(p.name for p in folder.iterdir()) == [owned_folders.MARK, ".retnet_jax.json.partial"]
  assert owned.written() == {"config.json", "metrics.jsonl"}


def test_only_plain_names_are_recorded(tmp_path):
  owned = owned_folders.claim(tmp_path / "out", "workdir", flag="--workdir")
  with pytest.raises(ValueError, match=r"cannot record '\.\./x' in .*out: not plain names inside it\."):
    owned.record("../x")
  assert owned.written() == set()


@pytest.mark.parametrize("name,is_dir", [("metrics.jsonl", False), ("params", True)])
def test_a_symlinked_output_is_never_written_through(trained_copy, tmp_path, name, is_dir):
  """A `metrics.jsonl` that was a symlink to a user's file was appended to, and a `params/` that was a symlink to a
  user's folder was replaced: training refuses such a workdir before any work, the link's target untouched."""
  config, workdir, _ = trained_copy
  target = tmp_path / "users"
  if is_dir:
    target.mkdir()
    (target / "notes.txt").write_bytes(b"the user's\n")
  else:
    target.write_bytes(b"the user's\n")
  snapshot = lambda: sorted((str(p), p.read_bytes()) for p in [target, *target.rglob("*")] if p.is_file())
  before = snapshot()
  link = workdir / name
  shutil.rmtree(link) if is_dir else link.unlink()
  link.symlink_to(target, target_is_directory=is_dir)
  config.train.steps += 4
  with pytest.raises(owned_folders.NotOwnedError, match=rf"holds '{name}' as symbolic links, which this project "
                                                        r"would write through"):
    train.train_and_evaluate(config, workdir)
  assert snapshot() == before and link.is_symlink()


def test_a_workdir_reached_through_a_link_into_another_runs_checkpoints_is_refused(trained, tmp_path):
  """--workdir=LINK/new, LINK pointing into another run's checkpoints/, wrote a second run inside that run."""
  link = tmp_path / "link"
  link.symlink_to(trained.workdir / "checkpoints", target_is_directory=True)
  with pytest.raises(ValueError, match=r"--workdir=.*link/new lies inside the checkpoints/ folder of the run"):
    workdir_lib.check_training_dir(link / "new")
  assert not (trained.workdir / "checkpoints" / "new").exists()


def test_an_unexpanded_tilde_is_refused(tmp_path, monkeypatch):
  """'--workdir=~' made a folder named ~ while the last line said ~/checkpoints."""
  monkeypatch.chdir(tmp_path)
  with pytest.raises(owned_folders.NotOwnedError, match=r"^--workdir='~' begins with '~', which no shell expanded"):
    workdir_lib.check_training_dir("~")
  assert not (tmp_path / "~").exists()


@pytest.mark.parametrize("kind,user_file", [("passkey", "passkey_step_30.png"),
                                            ("eval", "eval_step_30_by_position.png")])
def test_a_users_file_named_like_a_results_companion_is_kept(tmp_path, kind, user_file):
  """A user's `passkey_step_30.png` beside no JSON, and a user's `eval_step_30_by_position.png`, were replaced by new
  plots (a free name was chosen for the JSON only): the name is free only with its companions."""
  (tmp_path / user_file).write_bytes(b"the user's")
  path = workdir_lib.results_file(tmp_path, kind, 30, ["--a=1"])
  assert path.name == f"{kind}_step_30_2.json"
  ours = tmp_path / f"{kind}_step_31.json"
  ours.write_text(json.dumps({"settings": ["--a=1"]}))
  (tmp_path / user_file.replace("30", "31")).write_bytes(b"an earlier plot of those results")
  assert workdir_lib.results_file(tmp_path, kind, 31, ["--a=1"]) == ours  # a rerun replaces its own results


def test_a_users_metadata_json_is_refused_as_theirs_not_as_a_corpus(tmp_path):
  """prepare_data.py --take_folder beside a user's metadata.json called it a prepared corpus and suggested deleting
  it: it is the user's file, refused as such (with or without --take_folder), its bytes kept."""
  (tmp_path / "d").mkdir()
  (tmp_path / "d" / "metadata.json").write_bytes(b'{"mine": 1}')
  for take in (False, True):
    with pytest.raises(owned_folders.NotOwnedError, match=r"holds 'metadata.json', which this project did not "
                                                          r"write"):
      prepare(tmp_path / "d", take=take)
  assert (tmp_path / "d" / "metadata.json").read_bytes() == b'{"mine": 1}'


def test_a_full_disk_when_the_mark_is_written_is_one_line_naming_it(tmp_path, monkeypatch):
  """A disk already full when the mark is written gave a bare Errno 28."""
  def full(path, text):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
  monkeypatch.setattr(owned_folders.whole_files, "write_text", full)
  with pytest.raises(owned_folders.MarkWriteError) as raised:
    owned_folders.claim(tmp_path / "new", "workdir", flag="--workdir")
  assert str(raised.value) == (f"could not write {tmp_path / 'new' / owned_folders.MARK}, the project's record of "
                               "what it wrote there (No space left on device); free space on that disk or make it "
                               "writable, then run the same command again.")
  assert raised.value.errno == errno.ENOSPC


def test_kernel_check_replaces_no_file_but_its_own_results(tmp_path):
  """kernel_check.py wrote its --out unchecked: a user's file there is refused before any kernel runs."""
  users = tmp_path / "notes.json"
  users.write_bytes(b'{"mine": 1}')
  result = run_script("kernel_check.py", "--interpret", f"--out={users}")
  assert result.returncode == 1 and "Traceback" not in result.stderr
  assert f"error: --out={users} exists and is not a results file" in result.stderr, result.stderr[-2000:]
  assert users.read_bytes() == b'{"mine": 1}'


@pytest.mark.parametrize("script,flags", [("benchmark.py", ("--suite=quick",)),
                                          ("gpu_check.py", ("--smoke", "--parts=kernels"))])
def test_benchmark_and_gpu_check_write_only_into_folders_of_their_own(tmp_path, script, flags):
  """benchmark.py --out overwrote a user's data.json and data.md; gpu_check.py wrote its --out unchecked: a folder
  holding a user's files is refused before any work, their bytes kept."""
  out = tmp_path / "out"
  out.mkdir()
  for name in ("data.json", "data.md"):
    (out / name).write_bytes(b"the user's")
  result = run_script(script, *flags, f"--out={out}")
  assert result.returncode == 1 and "Traceback" not in result.stderr
  assert re.search(rf"^error: --out='{out}' holds 'data.json', 'data.md', which this project did not write",
                   result.stderr, flags=re.MULTILINE), result.stderr[-2000:]
  assert sorted(p.name for p in out.iterdir()) == ["data.json", "data.md"]
  assert all((out / name).read_bytes() == b"the user's" for name in ("data.json", "data.md"))


def test_an_earlier_gpu_checks_folder_is_adopted_and_a_users_is_not(tmp_path):
  (tmp_path / "gpu_check.json").write_text(json.dumps({"parts": {}, "budgets_s": {}}))
  (tmp_path / "check_op.json").write_text("{}")
  assert gpu_check.earlier_results(tmp_path) == ["check_op.json", "gpu_check.json"]
  (tmp_path / "gpu_check.json").write_text(json.dumps({"mine": 1}))
  assert gpu_check.earlier_results(tmp_path) is None
