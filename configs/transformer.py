"""Transformer configs: `--config=configs/transformer.py:NAME`, the Transformer of RetNet preset NAME's size.

NAME is one of retnet_jax.models.presets.PRESETS (default `small`): the same width, depth, heads, vocabulary and
training run, with the FFN widened so that the parameter count matches RetNet's (as the paper does;
`presets.transformer_config`). The model section holds the Transformer's fields only, `model.max_len` (the KV
cache length) among them; data, train, checkpoint and mesh are RetNet's (training in the parallel form).
"""

from __future__ import annotations

from ml_collections import config_dict

from retnet_jax.models import presets


def get_config(arg: str | None = None) -> config_dict.ConfigDict:
  """The locked Transformer config of preset `arg` (default `small`)."""
  return presets.get_config(arg or "small", architecture="transformer")
