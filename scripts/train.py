"""Trains a RetNet: `python scripts/train.py --config=configs/retnet.py:small --workdir=runs/shakespeare`.

Starting again with the same --workdir resumes from its latest checkpoint; SIGTERM / Ctrl-C checkpoint and exit
cleanly. Override any config field with `--config.train.steps=500` etc.; the config used is written to
WORKDIR/config.json. Several processes (hosts): pass --coordinator_address, --num_processes and --process_id
(or set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID) on each.
"""

from retnet_jax import cli

if __name__ == "__main__":
  cli.prepare()  # first, before numpy and jax start threads

import os

from absl import flags, logging
import jax

from retnet_jax import train

_CONFIG = cli.config_flag("Training config file and preset.")
_WORKDIR = cli.workdir_flag("Directory for checkpoints, metrics and the config.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", os.environ.get("JAX_COORDINATOR_ADDRESS"),
                                   "host:port of process 0, for multi-process training.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", int(os.environ.get("JAX_NUM_PROCESSES", 0)) or None,
                                      "Number of processes, for multi-process training.")
_PROCESS_ID = flags.DEFINE_integer("process_id", int(os.environ.get("JAX_PROCESS_ID", -1)),
                                   "This process's index, for multi-process training.")


def main():
  logging.set_verbosity(logging.INFO)
  if _COORDINATOR.value:
    if jax.config.jax_platforms in (None, "", "cpu"):
      jax.config.update("jax_cpu_collectives_implementation", "gloo")  # cross-process collectives on CPU
    jax.distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value,
                               _PROCESS_ID.value if _PROCESS_ID.value >= 0 else None)
  train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  cli.run(main)
