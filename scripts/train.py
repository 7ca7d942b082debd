"""Trains a RetNet: `python scripts/train.py --config=configs/retnet.py:small --workdir=runs/shakespeare`.

Starting again with the same --workdir resumes from its latest checkpoint; SIGTERM / Ctrl-C checkpoint and exit
cleanly. Override any config field with `--config.train.steps=500` etc.; the config used is written to
WORKDIR/config.json. Several processes (hosts): pass --coordinator_address, --num_processes and --process_id
(or set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID) on each.
"""

from retnet_jax import cli

if __name__ == "__main__":
  cli.prepare()  # first, before numpy and jax start threads

from absl import logging

from retnet_jax import train

_CONFIG = cli.config_flag("Training config file and preset.")
_WORKDIR = cli.workdir_flag("Directory for checkpoints, metrics and the config.")
_START_PROCESSES = cli.distributed_flags()


def main():
  logging.set_verbosity(logging.INFO)
  _START_PROCESSES()
  train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  cli.run(main)
