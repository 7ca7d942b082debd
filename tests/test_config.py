"""The typed config (retnet_jax.training.run_config and its sections): every preset builds, config.json's layout
builds the same config, a field missing or unknown is refused by name, sections are frozen, hashable and checked
when changed, and docs/config.md's tables are the sections' own."""

import dataclasses
import json
from pathlib import Path

import pytest

from retnet_jax.core.sharding import MeshConfig
from retnet_jax.input_pipeline.data_config import DataConfig
from retnet_jax.models import model_config, presets
from retnet_jax.runs import workdir
from retnet_jax.training import resume, run_config
from retnet_jax.training.train_config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("architecture", presets.ARCHITECTURES)
def test_every_preset_builds_and_round_trips_through_config_json(architecture):
  """Each preset's ConfigDict builds; its to_dict, through JSON (tuples as lists), builds an equal config."""
  for name in presets.PRESETS:
    config = run_config.build(presets.get_config(name, architecture))
    assert isinstance(config.model, model_config.CLASSES[architecture]) and config.preset == name
    assert config.to_dict() == presets.get_config(name, architecture).to_dict()
    assert run_config.build(json.loads(json.dumps(config.to_dict()))) == config
    assert run_config.build(config) is config


def test_an_old_runs_config_json_builds():
  """The config.json of a run made before the typed config (tests/data/workdir_dfafd3f) builds as it was saved."""
  saved = json.loads((ROOT / "tests/data/workdir_dfafd3f/config.json").read_text())
  config = run_config.build(workdir.saved_config(ROOT / "tests/data/workdir_dfafd3f"))
  as_json = json.loads(json.dumps(config.to_dict()))
  assert (as_json["model"], as_json["data"], as_json["preset"]) == (saved["model"], saved["data"], saved["preset"])



def test_a_path_field_holding_one_string_is_that_one_path():
  """`data.files` (`validation_files`, `prepared`) saved as one string builds as a tuple of that path, and a
  checkpoint whose config saved it so sees no data change against the same path as a tuple."""
  saved = presets.get_config("tiny").to_dict()
  saved["data"].update(files="a.txt", validation_files="b.txt")
  built = run_config.build(saved)
  assert (built.data.files, built.data.validation_files, built.data.prepared) == (("a.txt",), ("b.txt",), ())
  assert built.data.replace(files="c.txt").files == ("c.txt",)
  assert resume.changed_data_fields(saved, built) == []
  assert resume.changed_data_fields(saved, built.replace(data=built.data.replace(files=("c.txt",)))) == ["data"]

def test_fields_missing_or_unknown_are_refused_by_name():
  config = presets.get_config("tiny").to_dict()
  config["train"]["stpes"] = 3
  with pytest.raises(ValueError, match=r"the train section does not fit its fields \(train.stpes is not a field\)"):
    run_config.build(config)
  del config["train"]["stpes"], config["data"]["mqar"]["num_pairs"]
  with pytest.raises(ValueError, match=r"it lacks data.mqar.num_pairs"):
    run_config.build(config)
  config = presets.get_config("tiny").to_dict()
  config["model"]["max_len"] = 8
  with pytest.raises(ValueError, match=r"model.max_len are not retnet fields.*configs/retnet.py:small"):
    run_config.build(config)
  with pytest.raises(ValueError, match=r"optimiser is not a section of a config"):
    run_config.build({**presets.get_config("tiny").to_dict(), "optimiser": {}})
  with pytest.raises(TypeError, match=r"got the model fields alone \(config.model\)"):
    run_config.build(presets.get_config("tiny").model)


def test_sections_are_frozen_hashable_and_checked_when_changed():
  config = run_config.build(presets.get_config("tiny"))
  with pytest.raises(dataclasses.FrozenInstanceError):
    config.train.steps = 5  # type: ignore[misc]
  assert hash(config) == hash(run_config.build(presets.get_config("tiny")))
  assert config.train.replace(steps=5).steps == 5 and config.train.steps == 200
  with pytest.raises(ValueError, match=r"train.steps must be a positive integer; got 0"):
    config.train.replace(steps=0)
  with pytest.raises(ValueError, match=r"unknown model.mixer 'retnention'"):
    config.model.replace(mixer="retnention")
  with pytest.raises(ValueError, match=r"mesh.rules maps 'embed' to 'fdsp'"):
    config.mesh.replace(rules=(("embed", "fdsp"),))
  with pytest.raises(ValueError, match=r"data.mqar.num_pairs must be a positive integer"):
    config.data.replace(mqar=config.data.mqar.replace(num_pairs=0))
  with pytest.raises(ValueError, match=r"train.mode='chunkwise': this model's layers do not compute"):
    run_config.build(presets.get_config("tiny", "transformer")).replace(
        train=config.train.replace(mode="chunkwise"))


def test_each_section_type_is_the_one_its_consumers_read():
  config = run_config.build(presets.get_config("tiny"))
  assert (type(config.train), type(config.data), type(config.mesh)) == (TrainConfig, DataConfig, MeshConfig)
  assert config.train.segment == config.train.seq_len and config.train.replace(segment_len=16).segment == 16


def test_the_docs_reference_is_the_sections_own():
  """docs/config.md's tables equal `run_config.reference()`; regenerate them from it when a field changes."""
  text = (ROOT / "docs/config.md").read_text()
  tables = text[text.index("## The whole config"):]
  assert tables.rstrip() == run_config.reference().rstrip(), (
      "docs/config.md is out of date: write run_config.reference() after its introduction")
  for name in TrainConfig.names() + DataConfig.names() + MeshConfig.names():
    assert f"`{name}`" in tables or f".{name}" in tables


def test_mixers_read_their_own_sections_which_the_config_holds_flat():
  """A RetNet's mixer fields are sections of their own (`retention`, `gated_retention`, `attention`), built from and
  written back to the flat names the config files, command lines and config.json use."""
  flat = presets.get_config("tiny").model
  flat.update(mixer="gated_retention", gate_init="retnet", attention_layers=(1,), attention_window=4)
  cfg = model_config.of(flat)
  assert (cfg.attention.layers, cfg.attention.window, cfg.gated_retention.gate_init) == ((1,), 4, "retnet")
  assert cfg.retention.decay_schedule == "retnet" and cfg.flat_value("attention_window") == 4
  assert cfg.to_dict() == flat.to_dict() and not {"attention", "retention", "gated_retention"} & set(cfg.to_dict())
  assert set(model_config.RetNetConfig.flat_names()) == set(presets.model_config("tiny"))
  with pytest.raises(ValueError, match=r"model.attention_window=4 configures attention layers, but "
                                       r"model.attention_layers is empty"):
    cfg.replace(attention=cfg.attention.replace(layers=()))
