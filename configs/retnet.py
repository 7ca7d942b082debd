"""RetNet configs: `--config=configs/retnet.py:NAME` with NAME one of retnet_jax.models.presets.PRESETS (default
`small`).

Overrides from the command line, e.g. `--config.model.num_layers=8 --config.train.steps=500`; the config is
locked, so a misspelt field is an error rather than a silent no-op. The presets and every field's default are
defined in retnet_jax/models/presets.py; this file selects one.
"""

from __future__ import annotations

from ml_collections import config_dict

from retnet_jax.models import presets


def get_config(arg: str | None = None) -> config_dict.ConfigDict:
  """The locked config of preset `arg` (default `small`)."""
  return presets.get_config(arg or "small")
