"""The whole config, typed: `Config` of its sections, built once from the user's `ml_collections` config (the
config files, `--config.x=y`, a workdir's config.json) by `build`, which checks each section's fields and then the
rules across sections, here and nowhere else.

    config = run_config.build(presets.get_config("small"))   # or scripts' cli-built ConfigDict
    config.train.batch_size, config.model.d_model, config.mesh.rules
    train.train_and_evaluate(config, workdir)

The library's entry points take either a ConfigDict or a Config (`build` returns a Config as it is), so notebooks
and tests keep the ConfigDict they edit. What depends on the devices present (the mesh's sizes, the batch and
sequence splits, a kernel's backend) is checked where they are known (`train_state.check_devices`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import traverse_util

from retnet_jax.core import config_checks, markdown, sections
from retnet_jax.core.sharding import MeshConfig
from retnet_jax.input_pipeline import synthetic
from retnet_jax.input_pipeline.data_config import DataConfig
from retnet_jax.models import architectures, model_config, presets
from retnet_jax.training.train_config import CheckpointConfig, TrainConfig

field = sections.field


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(sections.Section):
  """The whole config: the preset it came from, the seed and one section per part."""
  preset: str = field("the preset the config was built from (models.presets.PRESETS)")
  seed: int = field("the seed of the parameters, the data order and the synthetic tasks")
  model: model_config.ModelConfig = field("the model (`model_config`)")
  data: DataConfig = field("the data (`data_config`)")
  train: TrainConfig = field("the run (`train_config`)")
  checkpoint: CheckpointConfig = field("checkpoints (`train_config`)")
  mesh: MeshConfig = field("devices (`core.sharding`)")

  def __post_init__(self):
    seed = self.seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= config_checks.MAX_SEED:
      raise ValueError(f"seed={seed} is out of range: choose an integer from 0 to 2**63 - 1 (--config.seed).")
    check_across(self)


SECTIONS = {"data": DataConfig, "train": TrainConfig, "checkpoint": CheckpointConfig, "mesh": MeshConfig}


def build(config: Any) -> Config:
  """The typed, checked config of `config` (a full ConfigDict as `presets.get_config` builds it, or a dict of
  config.json's layout; a Config is returned as it is). ValueError naming the bad field, its value and the fix;
  TypeError for something other than a full config."""
  if isinstance(config, Config):
    return config
  if not hasattr(config, "items") or not all(name in config for name in ("model", "data", "train", "mesh")):
    got = (f"the string {config!r}: build the config with get_config (configs/retnet.py:NAME's get_config('NAME'))"
           if isinstance(config, str) else "the model fields alone (config.model): pass the whole config"
           if hasattr(config, "items") and "d_model" in config else f"a {type(config).__name__}")
    raise TypeError(f"config must be the full config (an ml_collections.ConfigDict with model, data, train, mesh, "
                    f"... as get_config builds it); got {got}.")
  unknown = sorted(set(config.keys()) - set(Config.names()))
  if unknown:
    raise ValueError(f"{', '.join(unknown)} {'is not a section' if len(unknown) == 1 else 'are not sections'} of a "
                     f"config ({', '.join(Config.names())}); take the config from a preset, e.g. "
                     "--config=configs/retnet.py:small.")
  model = model_config.of(config["model"])
  parts = {name: cls.of(config[name], name) for name, cls in SECTIONS.items()}
  return Config(preset=config["preset"], seed=config["seed"], model=model, **parts)


def check_across(config: Config) -> None:
  """The rules between sections (ValueError naming the option and the fix): the form and segments the model can
  train with, packed documents its mixers can reset at, a synthetic task's vocabulary and lengths."""
  train, model = config.train, config.model
  architectures.check_training(config)
  check_documents(config, (train.mode,), "train.mode")
  if 0 < train.segment_len < train.seq_len:
    for mixer in architectures.mixers(model):
      mixer.check_segments(model, train.segment_len, train.seq_len, train.mode)
  synthetic.check_config(config)


def check_documents(config: Config, modes, option: str) -> None:
  """Refuses `data.reset_at_documents` with forms of `modes` (set by `option`) in which a layer's mixer cannot reset
  (`Mixer.document_refusal`: the torchscale-style chunkwise normaliser, whose per-chunk scalars span documents)."""
  model = config.model
  if not config.data.reset_at_documents:
    return
  for mode in modes:
    if reason := architectures.document_refusal(model, mode):
      raise ValueError(f"data.reset_at_documents=True ({option}) cannot reset {reason}; or set "
                       "data.reset_at_documents=False.")


def reference() -> str:
  """The config reference (docs/config.md's tables): per section, each field's dotted name, type, default in the
  `small` preset (configs/retnet.py's default; the Transformer's own fields from configs/transformer.py:small) and
  meaning, from the sections' definitions."""
  retnet, transformer = (build(presets.get_config("small", name)) for name in ("retnet", "transformer"))
  defaults = {**traverse_util.flatten_dict(transformer.to_dict(), sep="."),
              **traverse_util.flatten_dict(retnet.to_dict(), sep=".")}
  common = set(model_config.Common.names())
  tables = [("The whole config", [row for row in Config.reference("") if row[0].lstrip(".") in ("preset", "seed")]),
            ("model: both architectures", model_config.Common.reference("model")),
            *((f"model: {name} only (configs/{name}.py)", [row for row in cls.reference("model")
                                                            if row[0].removeprefix("model.") not in common])
              for name, cls in model_config.CLASSES.items()),
            *((name, cls.reference(name)) for name, cls in SECTIONS.items())]
  cell = lambda text: str(text).replace("|", "\\|")  # noqa: E731  (a `|` would end the table's cell)
  lines = []
  for title, rows in tables:
    lines += [f"## {title}", "", *markdown.table(
        ["field", "type", "default", "meaning"],
        [[f"`{name.lstrip('.')}`", f"`{cell(kind)}`", f"`{cell(repr(defaults[name.lstrip('.')]))}`", cell(meaning)]
         for name, kind, meaning in rows]), ""]
  return "\n".join(lines)

