"""The workdir: its layout (`runs.workdir`), the one policy for the newest checkpoint that reads back whole
(`training.run_checkpoints`), and restoring the model from the parameters alone."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import retnet as retnet_config
from retnet_jax.core import sharding
from retnet_jax.runs import workdir as workdir_lib
from retnet_jax.training import checkpointing, optimizer, run_checkpoints, train_state


def save_steps(workdir, config, steps, state=None):
  """Checkpoints `steps` of `state` (default: a small stand-in) with the meta training writes; returns the state."""
  state = {"params": {"w": jnp.arange(4.0)}} if state is None else state
  with checkpointing.Checkpointer(workdir_lib.checkpoint_dir(workdir), async_save=False) as ckpt:
    for step in steps:
      ckpt.save(step, state, {"data": {"epoch": 0, "index": step}, "config": config.to_dict()})
  return state


def damage_meta(workdir, step):
  (workdir_lib.checkpoint_dir(workdir) / str(step) / "meta" / "metadata").write_text("{not json")


def newest(workdir, config, read_only):
  """`restore_newest` as a reader (read-only) or as the writer, reading the stand-in state."""
  with checkpointing.Checkpointer(workdir_lib.checkpoint_dir(workdir), read_only=read_only) as ckpt:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = {"params": {"w": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=device)}}
    return run_checkpoints.restore_newest(ckpt, config, lambda step: ckpt.restore(abstract, step))


def test_a_damaged_newest_step_is_set_aside_by_the_writer_and_named_to_a_reader(tmp_path):
  config = retnet_config.get_config("tiny")
  save_steps(tmp_path, config, (1, 2))
  damage_meta(tmp_path, 2)
  with pytest.raises(ValueError, match=r"checkpoint 2 in .* is unreadable .*--step \(available steps: \[1, 2\]\)"):
    newest(tmp_path, config, read_only=True)
  assert (workdir_lib.checkpoint_dir(tmp_path) / "2").is_dir()  # a reader changes nothing
  step, (state, meta) = newest(tmp_path, config, read_only=False)
  assert step == 1 and meta["data"]["index"] == 1
  np.testing.assert_array_equal(state["params"]["w"], np.arange(4.0))
  # The same step written again and damaged again: set aside beside the first copy.
  save_steps(tmp_path, config, (2,))
  damage_meta(tmp_path, 2)
  assert newest(tmp_path, config, read_only=False)[0] == 1
  assert sorted(p.name for p in workdir_lib.checkpoint_dir(tmp_path).iterdir()) == ["1", "2.corrupt", "2.corrupt.1"]
  damage_meta(tmp_path, 1)
  assert newest(tmp_path, config, read_only=False) is None  # nothing left: a fresh start


def test_a_checkpoint_of_another_model_config_is_refused_by_name_and_kept(tmp_path):
  config = retnet_config.get_config("tiny")
  save_steps(tmp_path, config, (1,))
  other = retnet_config.get_config("tiny")
  other.model.num_layers = 3
  for read_only in (True, False):
    with pytest.raises(checkpointing.IncompatibleCheckpointError,
                       match=r"incompatible model config \(model.num_layers: checkpoint 2 vs config 3\)"):
      newest(tmp_path, other, read_only)
  assert [p.name for p in workdir_lib.checkpoint_dir(tmp_path).iterdir()] == ["1"]


def test_restore_model_reads_the_parameters_alone(tmp_path, monkeypatch):
  """No optimizer is built and no optimizer state read: a checkpoint whose Adam moments' checksums disagree (which
  resuming training refuses) or that holds no optimizer state at all restores the model."""
  config = retnet_config.get_config("tiny")
  layout = train_state.make_layout(config, sharding.placement(config.mesh))
  with layout.placement.active():
    state = train_state.init_fn(config, layout)()
  save_steps(tmp_path / "full", config, (3,), state.saved())
  meta_file = workdir_lib.checkpoint_dir(tmp_path / "full") / "3" / "meta" / "metadata"
  meta = json.loads(meta_file.read_text())
  meta["checksums"] = {k: v + (k.startswith("['opt_state']")) for k, v in meta["checksums"].items()}
  meta_file.write_text(json.dumps(meta))
  save_steps(tmp_path / "params_only", config, (5,), {"params": state.params, "step": state.step})

  def no_optimizer(_):
    raise AssertionError("restore_model built an optimizer")

  monkeypatch.setattr(optimizer, "make_optimizer", no_optimizer)
  for workdir, step in ((tmp_path / "full", 3), (tmp_path / "params_only", 5)):
    model, restored_step = train_state.restore_model(config, workdir)
    assert restored_step == step
    jax.tree.map(np.testing.assert_array_equal, nnx.state(model, nnx.Param), state.params)
  monkeypatch.undo()
  with checkpointing.Checkpointer(workdir_lib.checkpoint_dir(tmp_path / "full")) as ckpt:  # the writer's restore
    restore = lambda step: ckpt.restore(layout.abstract_state.saved(), step)
    assert run_checkpoints.restore_newest(ckpt, config, restore) is None
  assert (workdir_lib.checkpoint_dir(tmp_path / "full") / "3.corrupt").is_dir()


def test_training_writes_the_layout(trained):
  workdir = trained.workdir
  assert sorted(int(p.name) for p in workdir_lib.checkpoint_dir(workdir).iterdir()) == [4, 8]
  assert workdir_lib.export_dir(workdir, 8).is_dir() and workdir_lib.exported_steps(workdir) == [8]
  assert json.loads(workdir_lib.config_file(workdir).read_text())["train"]["steps"] == 8
  assert workdir_lib.writer_lock(workdir).path.is_file()
  assert workdir_lib.results_file(workdir, "passkey", 8) == workdir / "passkey_step_8.json"
  with pytest.raises(ValueError, match="unknown kind of results 'loss'"):
    workdir_lib.results_file(workdir, "loss", 8)


def test_a_training_dir_is_refused_when_empty_a_file_or_inside_another_run(tmp_path, trained):
  with pytest.raises(ValueError, match=r"--workdir is empty \(an unset shell variable\?\)"):
    workdir_lib.check_training_dir("")
  (tmp_path / "file").write_text("")
  with pytest.raises(ValueError, match="is a file; choose a directory"):
    workdir_lib.check_training_dir(tmp_path / "file")
  for inside in (workdir_lib.checkpoint_dir(trained.workdir) / "new", workdir_lib.export_dir(trained.workdir, 8)):
    with pytest.raises(ValueError, match=f"lies inside the {inside.relative_to(trained.workdir).parts[0]}/ folder "
                                         f"of the run {trained.workdir}; choose a directory outside it"):
      workdir_lib.check_training_dir(inside)
  assert workdir_lib.check_training_dir(str(trained.workdir)) == trained.workdir  # resuming a run is fine
  assert workdir_lib.check_training_dir(tmp_path / "checkpoints" / "run") == tmp_path / "checkpoints" / "run"


def test_restore_model_refuses_a_step_that_is_not_an_int(trained):
  for step in ("8", 8.0, -1, True):
    with pytest.raises(ValueError, match=rf"step={step!r} must be a checkpoint step, a non-negative int"):
      train_state.restore_model(trained.config, trained.workdir, step)


def test_saved_config_is_the_runs_and_refuses_what_no_run_writes(trained, tmp_path):
  saved = workdir_lib.saved_config(trained.workdir)
  assert saved.model.to_dict() == trained.config.model.to_dict() and saved.preset == "tiny"
  (tmp_path / "config.json").write_text(json.dumps({"model": {}, "data": {}}))
  with pytest.raises(ValueError, match=r"lacks \['preset'\]: not the config.json of a retnet_jax run"):
    workdir_lib.saved_config(tmp_path)
  (tmp_path / "config.json").write_text("{")
  with pytest.raises(ValueError, match="is not valid JSON"):
    workdir_lib.saved_config(tmp_path)
  with pytest.raises(FileNotFoundError, match="config.json is missing"):
    workdir_lib.saved_config(tmp_path / "none")



def test_a_gated_run_from_before_gate_init_reads_back_as_yoco(tmp_path):
  """A gated run's config.json and checkpoint config written before `model.gate_init` existed (no such field) read
  back as `yoco`, the gate they were trained with: the config loads so, the checkpoint resumes under it and is
  refused under `retnet`, naming the field."""
  config = retnet_config.get_config("tiny")
  config.model.mixer = "gated_retention"
  old_model = {k: v for k, v in json.loads(json.dumps(config.model.to_dict())).items() if k != "gate_init"}
  (tmp_path / "config.json").write_text(json.dumps({"preset": "tiny", "model": old_model, "data": {}}))
  saved = workdir_lib.saved_config(tmp_path)
  assert saved.model.mixer == "gated_retention" and saved.model.gate_init == "yoco"
  run_checkpoints.check_compatible(old_model, config, tmp_path)
  config.model.gate_init = "retnet"
  with pytest.raises(ValueError, match="model.gate_init: checkpoint 'yoco' vs config 'retnet'"):
    run_checkpoints.check_compatible(old_model, config, tmp_path)


@pytest.mark.parametrize("edit,message", [
    (dict(model=None), r"config.json: model=None must be a JSON object; fix it in config.json"),
    (dict(model={"vocab_size": "256"}), r"config.json: model.vocab_size='256' does not fit the field \(.*\); fix it "
                                        "in config.json, or give the config with --config"),
    (dict(model={"vocab_sise": 256}), r"config.json: model.vocab_sise is not a field of a retnet config; remove it "
                                      "from config.json"),
    (dict(data={"tokenizer": 3}), r"config.json: data.tokenizer=3 does not fit the field"),
])
def test_an_edited_config_json_is_named_with_the_field_and_the_fix(tmp_path, edit, message):
  """Readers without --config failed on such a config.json with an AttributeError, a TypeError or a KeyError."""
  (tmp_path / "config.json").write_text(json.dumps({"preset": "tiny", "model": {}, "data": {}, **edit}))
  with pytest.raises(ValueError, match=message):
    workdir_lib.saved_config(tmp_path)


def test_a_config_json_that_is_binary_or_a_folder_is_named(tmp_path):
  """A binary config.json failed naming no file; one that is a folder fell back to the `small` preset."""
  (tmp_path / "config.json").write_bytes(b"\xc8\x00\x01")
  with pytest.raises(ValueError, match=r"config.json is not valid JSON text \('utf-8' codec can't decode byte 0xc8"):
    workdir_lib.saved_config(tmp_path)
  (tmp_path / "config.json").unlink()
  (tmp_path / "config.json").mkdir()
  with pytest.raises(ValueError, match="config.json is a folder, not the config file of a run"):
    workdir_lib.script_config(retnet_config.get_config("small"), tmp_path, named=False, overrides=())


def test_only_what_a_save_in_flight_recreated_is_removed(tmp_path):
  """After the workdir was moved mid-save: checkpoints/ of temporary folders alone goes; anything else stays."""
  recreated = tmp_path / "run"
  (workdir_lib.checkpoint_dir(recreated) / "25.orbax-checkpoint-tmp" / "state.orbax-checkpoint-tmp").mkdir(parents=True)
  assert workdir_lib.remove_recreated(recreated) and not recreated.exists()
  for extra in ("config.json", "checkpoints/20"):
    kept = tmp_path / extra.replace("/", "_")
    (workdir_lib.checkpoint_dir(kept) / "25.orbax-checkpoint-tmp").mkdir(parents=True)
    (kept / extra).mkdir()
    assert not workdir_lib.remove_recreated(kept) and (kept / extra).is_dir()
  assert not workdir_lib.remove_recreated(tmp_path / "none")


def test_results_of_other_settings_are_kept_beside_each_other(tmp_path):
  """Evaluating a step again with other settings overwrote its results file."""
  first = workdir_lib.results_file(tmp_path, "eval", 8, ["--mode=all"])
  assert first == tmp_path / "eval_step_8.json"
  first.write_text(json.dumps({"loss": 1.0, "settings": ["--mode=all"]}))
  assert workdir_lib.results_file(tmp_path, "eval", 8, ["--mode=all"]) == first  # a rerun of the same settings
  second = workdir_lib.results_file(tmp_path, "eval", 8, ["--eval_seq_len=64"])
  assert second == tmp_path / "eval_step_8_2.json"
  second.write_text(json.dumps({"loss": 2.0, "settings": ["--eval_seq_len=64"]}))
  assert workdir_lib.results_file(tmp_path, "eval", 8, ["--eval_seq_len=64"]) == second
  (tmp_path / "eval_step_8_3.json").write_text("not JSON")  # a damaged or foreign file is kept too
  assert workdir_lib.results_file(tmp_path, "eval", 8, []) == tmp_path / "eval_step_8_4.json"
