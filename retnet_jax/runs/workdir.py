"""A run's directory: where each of its files lives, who may write there, and the config it was written with.

    WORKDIR/
      checkpoints/STEP           training checkpoints (STEP.corrupt: one set aside as unreadable)
      params/STEP                the parameters alone, exported when training ends
      config.json                the config of the run (or of a conversion)
      metrics.jsonl, tensorboard/, profile/   what training logs (retnet_jax.training.metrics, train.profile_steps)
      metrics.png                training's loss and learning rate against the step, redrawn at each evaluation
      eval_step_STEP.json        scripts/evaluate.py's results (eval_step_STEP_by_position.png: its plot)
      passkey_step_STEP.json     scripts/passkey.py's results (passkey_step_STEP.png: its heatmap)
      lm_eval_step_STEP.json     scripts/harness_eval.py's results (each with _N before .json for other settings)
      train_PROCESS.lock         the lock of the training process (retnet_jax.runs.workdir_lock)
      .retnet_jax.json           the project's mark: written first, it records the names above that were written
                                 (retnet_jax.core.owned_folders); training and conversions write into nothing else

Which checkpoint step a run's writer and readers take, by one policy, and the params export are
`retnet_jax.training.run_checkpoints`: this module opens no checkpoint.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ml_collections

from retnet_jax.core import config_checks, owned_folders
from retnet_jax.models import presets
from retnet_jax.runs import workdir_lock

# The evaluations that write results_file(..., kind, step), and the files each writes beside its JSON (the suffix
# replacing ".json"): evaluate.py's loss-by-position plot, passkey.py's heatmap.
RESULTS = {"eval": ("_by_position.png",), "passkey": (".png",), "lm_eval": ()}


FORMAT = "workdir"  # a workdir's format in its mark (`owned_folders`)
PROFILE_DIR = "profile"  # `train.profile_steps`' trace
# `metrics.MetricsWriter`'s: every value by step, TensorBoard's event files, the loss and learning-rate plot.
METRICS_FILE, TENSORBOARD_DIR, METRICS_PLOT = "metrics.jsonl", "tensorboard", "metrics.png"
# The fields of every config.json that training and the conversions write: a folder of an earlier version of this
# project (written before the mark) is recognised by them.
CONFIG_FIELDS = ("preset", "model", "data", "train", "checkpoint", "mesh", "seed")
# What an earlier version wrote in a workdir (the layout above), recorded as the project's when one is adopted.
_EARLIER_NAMES = re.compile(r"config\.json|metrics\.jsonl|checkpoints|params|tensorboard|profile|train_\d+\.lock|"
                            rf"({'|'.join(RESULTS)})_step_\d+(_\d+)?(_by_position)?\.(json|png)")


def check_training_dir(workdir: str | os.PathLike, writes: Sequence[str] = (), take: bool = False) -> Path:
  """`workdir` as a Path, refused when empty (an unset shell variable would train into the current directory),
  a file, inside another run's `checkpoints/` or `params/`, or a folder this project may not write into
  (`owned_folders.check`: new, empty, a run's, or with `take` (--take_folder) one holding other files).

  Args:
    workdir: the --workdir flag's value.
    writes: the names the caller writes there (`training_names`); one the folder holds unrecorded is refused.
    take: write into a folder holding files this project did not write, beside them.
  """
  if not os.fspath(workdir).strip():
    raise ValueError("--workdir is empty (an unset shell variable?); name the run's directory, e.g. "
                     "--workdir=runs/NAME.")
  workdir = Path(workdir)
  if workdir.exists() and not workdir.is_dir():
    raise ValueError(f"--workdir={workdir} is a file; choose a directory (new or a run's).")
  check_outside_runs(workdir, "--workdir", "a new run's, or that run itself to resume it")
  owned_folders.check(workdir, FORMAT, flag="--workdir", writes=writes, take=take, earlier=earlier_workdir)
  return workdir


def training_names(process_index: int, profiled: bool) -> tuple[str, ...]:
  """The names training writes in its workdir on process `process_index` (the layout above, results aside); the
  profiler's traces too where `profiled` (`train.profile_steps`)."""
  names = (config_file("").name, METRICS_FILE, TENSORBOARD_DIR, METRICS_PLOT,
           checkpoint_dir("").name, export_dir("", 0).parent.name, writer_lock("", process_index).path.name)
  return names + ((PROFILE_DIR,) if profiled else ())


def claim(workdir: str | os.PathLike, writes: Sequence[str], take: bool = False) -> owned_folders.OwnedFolder:
  """Creates `workdir` where new and marks it as a workdir of this project, recording `writes` (written next);
  refuses what `check_training_dir` refuses. Arguments as `check_training_dir`'s."""
  return owned_folders.claim(workdir, FORMAT, flag="--workdir", writes=writes, take=take, earlier=earlier_workdir)


def earlier_workdir(folder: Path) -> list[str] | None:
  """The names an earlier version of this project (before the mark) wrote in `folder`, where its config.json is
  one that training or a conversion wrote (`CONFIG_FIELDS`) beside checkpoints/, params/ or metrics.jsonl; else
  None."""
  try:
    saved = json.loads(config_file(folder).read_text())
  except (OSError, ValueError):
    return None
  found = [p.name for p in folder.iterdir()]
  if not (isinstance(saved, dict) and all(field in saved for field in CONFIG_FIELDS)
          and {checkpoint_dir("").name, export_dir("", 0).parent.name, METRICS_FILE} & set(found)):
    return None
  return sorted(name for name in found if _EARLIER_NAMES.fullmatch(name))


def check_outside_runs(path: Path, flag: str, choices: str) -> None:
  """Refuses (naming `flag` and the `choices` of directory) a `path` inside a run's `checkpoints/` or `params/`,
  whose folders that run writes, replaces and prunes."""
  for parent in (*path.absolute().parents, *path.resolve().parents):  # as named, and with links followed
    if parent.name in ("checkpoints", "params") and config_file(parent.parent).is_file():
      raise ValueError(f"{flag}={path} lies inside the {parent.name}/ folder of the run {parent.parent}; "
                       f"choose a directory outside it ({choices}).")


def checkpoint_dir(workdir: str | os.PathLike) -> Path:
  """`WORKDIR/checkpoints`: the training checkpoints, one folder per step."""
  return Path(workdir) / "checkpoints"


def has_checkpoints(workdir: str | os.PathLike) -> bool:
  """Whether `checkpoint_dir` holds a step folder."""
  return bool(listed_steps(workdir))


def listed_steps(workdir: str | os.PathLike) -> list[int]:
  """The step folders of `checkpoint_dir`, ascending, from a directory listing alone (no orbax, any thread): a
  folder is renamed to its step once committed; whether it reads back whole is the question of
  `run_checkpoints.restore_newest`."""
  ckpt_dir = checkpoint_dir(workdir)
  try:
    return sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit())
  except (FileNotFoundError, NotADirectoryError):
    return []


def remove_recreated(workdir: str | os.PathLike) -> bool:
  """After a training's workdir vanished (deleted or moved): removes what its save in flight recreated at the old
  path, a `checkpoints/` of orbax temporary folders alone, so that a workdir put back is not nested in it.
  Returns whether it removed anything; a path holding anything else is left alone."""
  removed = False
  for _ in range(3):  # the save's last writes may land after a removal
    if not _only_unfinished_saves(workdir):
      break
    shutil.rmtree(workdir, ignore_errors=True)
    removed = True
    time.sleep(0.5)
  return removed


def _only_unfinished_saves(workdir: str | os.PathLike) -> bool:
  """Whether `workdir` holds `checkpoints/` alone, and that only orbax temporary folders."""
  ckpt_dir = checkpoint_dir(workdir)
  try:
    return ([p.name for p in Path(workdir).iterdir()] == [ckpt_dir.name] and
            all(_TMP_SUFFIX in p.name for p in ckpt_dir.iterdir()))
  except (FileNotFoundError, NotADirectoryError):
    return False


_TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's name for a step folder being written


def export_dir(workdir: str | os.PathLike, step: int) -> Path:
  """`WORKDIR/params/STEP`: the parameters alone (`run_checkpoints.export_params`) of `step`."""
  return Path(workdir) / "params" / str(step)


def exported_steps(workdir: str | os.PathLike) -> list[int]:
  """The steps of the params exports, ascending."""
  folder = export_dir(workdir, 0).parent
  return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


def config_file(workdir: str | os.PathLike) -> Path:
  """`WORKDIR/config.json`: the config the run was written with."""
  return Path(workdir) / "config.json"


def saved_config(workdir: str | os.PathLike) -> ml_collections.ConfigDict:
  """The full config a workdir was written with (by training or a conversion): its preset, with the model and
  data sections of its config.json (the data it trained on: what evaluation reads) and its training length
  (`train.seq_len`: evaluation's default length)."""
  path = config_file(workdir)
  if path.is_dir():
    raise ValueError(f"{path} is a folder, not the config file of a run; put the run's config.json back, or give "
                     "the config with --config.")
  if not path.is_file():
    raise FileNotFoundError(f"{path} is missing; give a workdir written by scripts/train.py or a conversion.")
  try:
    saved = json.loads(path.read_bytes().decode("utf-8"))
  except ValueError as e:  # not UTF-8 (UnicodeDecodeError) or not JSON (JSONDecodeError)
    raise ValueError(f"{path} is not valid JSON text ({e}); fix it, or give the config with --config.") from None
  missing = [key for key in ("preset", "model", "data") if not isinstance(saved, dict) or key not in saved]
  if missing:
    raise ValueError(f"{path} lacks {missing}: not the config.json of a retnet_jax run (training and the "
                     "converters write preset, model and data); give the workdir of one.")
  for key, kind in (("preset", str), ("model", dict), ("data", dict)):
    if not isinstance(saved[key], kind):
      raise ValueError(f"{path}: {key}={saved[key]!r} must be a {'string' if kind is str else 'JSON object'}; fix "
                       "it in config.json, or give the config with --config.")
  config = presets.get_config(saved["preset"], saved["model"].get("architecture", "retnet"))
  fields = [(("model", name), value) for name, value in saved["model"].items()]
  fields += _nested_fields(("data",), saved["data"])
  train = saved.get("train")
  if isinstance(train, dict) and "seq_len" in train:
    fields.append((("train", "seq_len"), config_checks.positive_int(train["seq_len"], f"{path}: train.seq_len",
                                                                    "the run's training length")))
  for names, value in fields:
    *parents, name = names
    section = config
    for parent in parents:
      section = section[parent]
    field = ".".join(names)
    if name not in section:
      raise ValueError(f"{path}: {field} is not a field of a {config.model.architecture} config; remove it from "
                       "config.json, or give the config with --config.")
    try:
      section[name] = tuple(value) if isinstance(section[name], tuple) and isinstance(value, list) else value
    except (TypeError, ValueError) as e:
      raise ValueError(f"{path}: {field}={value!r} does not fit the field ({e}); fix it in config.json, or "
                       "give the config with --config.") from None
  return config


def _nested_fields(names: tuple[str, ...], values: dict[str, Any]) -> list[tuple[tuple[str, ...], Any]]:
  """(the dotted path's names, value) of every leaf field of a config.json section (its subsections opened)."""
  fields = []
  for name, value in values.items():
    if isinstance(value, dict):
      fields += _nested_fields(names + (name,), value)
    else:
      fields.append((names + (name,), value))
  return fields


def trained_task(workdir: str | os.PathLike) -> str | None:
  """What the run in `workdir` trained on, by its config.json's data section: "text", or the synthetic task of
  `data.synthetic` ("passkey", "mqar"); None where config.json is missing or does not say (a config given with
  --config may name other data than the run's)."""
  try:
    data = json.loads(config_file(workdir).read_bytes().decode("utf-8"))["data"]
    return data.get("synthetic") or "text"
  except (OSError, ValueError, KeyError, TypeError, AttributeError):
    return None


def script_config(given: ml_collections.ConfigDict, workdir: str | os.PathLike, named: bool,
                  overrides: Sequence[str]) -> ml_collections.ConfigDict:
  """The config of a script that reads a run (evaluate, generate, passkey): `given` (--config) where it was named
  on the command line or the workdir has no config.json; otherwise the workdir's saved config (its preset, model,
  data and training length: `saved_config`) with each of `overrides` (the dotted fields set by --config.x.y) taken
  from `given`, so that a hybrid, an overridden model or the run's own corpus is read without repeating its fields.

  Args:
    given: --config's value. workdir: the run's directory. named: whether --config was on the command line.
    overrides: the fields that --config.x.y flags set, e.g. ("model.param_dtype", "train.seq_len").
  """
  if named or not config_file(workdir).exists():
    return given
  config = saved_config(workdir)
  for name in overrides:
    *parents, field = name.split(".")
    source, target = given, config
    for parent in parents:
      source, target = source[parent], target[parent]
    target[field] = source[field]
  return config


def results_file(folder: str | os.PathLike, kind: str, step: int, settings: Sequence[str] = ()) -> Path:
  """Where evaluation `kind` (one of RESULTS) of checkpoint `step` run with `settings` (its command line:
  `cli.given_flags`) writes its results: `FOLDER/KIND_step_STEP.json`, or `KIND_step_STEP_N.json` with the smallest N
  from 2 where the names before it hold results of other settings (a result is replaced only by a rerun of its own
  settings, which the JSON's "settings" records). A name is free only with the files written beside it (`RESULTS`):
  a file of that name without its results is the user's, and the next N is taken."""
  if kind not in RESULTS:
    raise ValueError(f"unknown kind of results {kind!r}; choose one of {tuple(RESULTS)}.")
  for index in itertools.count(1):
    path = Path(folder) / f"{kind}_step_{step}{'' if index == 1 else f'_{index}'}.json"
    ours = os.path.lexists(path) and _recorded_settings(path) == list(settings)
    companions = [path.with_name(path.stem + suffix) for suffix in RESULTS[kind]]
    if (ours or not os.path.lexists(path)) and (ours or not any(map(os.path.lexists, companions))):
      return path


def check_results_path(path: str | os.PathLike, flag: str) -> None:
  """Refuses (ValueError naming `flag` and the fix) a results file `path` named on the command line that would land
  on a file not of results (recording no "settings": a run's config.json, a user's file) or inside a run's
  `checkpoints/` or `params/`: results never replace what a run reads."""
  path = Path(path)
  check_outside_runs(path, flag, "a new .json file, or a folder for the results")
  if os.path.lexists(path) and (not path.is_file() or _recorded_settings(path) is None):
    raise ValueError(f"{flag}={path} exists and is not a results file (it records no \"settings\"): the results "
                     "would replace it; name a new .json file, or a folder to write the results into.")


def _recorded_settings(path: Path) -> list[str] | None:
  """The "settings" a results file records (None where it records none or cannot be read)."""
  try:
    recorded = json.loads(path.read_text())
  except (OSError, ValueError):
    return None
  return recorded.get("settings") if isinstance(recorded, dict) else None


def writer_lock(workdir: str | os.PathLike, process_index: int = 0) -> workdir_lock.WriterLock:
  """The lock `WORKDIR/train_<process_index>.lock` that one training process per workdir holds."""
  return workdir_lock.WriterLock(workdir, Path(workdir) / f"train_{process_index}.lock")
