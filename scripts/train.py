"""Trains a RetNet: `python scripts/train.py --config=configs/retnet.py:small --workdir=runs/shakespeare`.

Starting again with the same --workdir resumes from its latest checkpoint. Override any config field with
`--config.train.steps=500` etc.; the config used is written to WORKDIR/config.json.
"""

from absl import app, flags, logging
import jax
from ml_collections import config_flags

from retnet_jax import train

_CONFIG = config_flags.DEFINE_config_file("config", "configs/retnet.py:small", "Training config file and preset.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and the config.", required=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.INFO)
  train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  jax.config.config_with_absl()
  app.run(main)
