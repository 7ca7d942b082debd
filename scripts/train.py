"""Trains a RetNet: `python scripts/train.py --config=configs/retnet.py:small --workdir=runs/shakespeare`.

WORKDIR must be new, empty or a run's (--take_folder: one holding other files, left untouched). Starting again with
the same --workdir resumes from its latest checkpoint; SIGTERM / Ctrl-C / SIGHUP checkpoint and exit
cleanly. Override any config field with `--config.train.steps=500` etc.; the config used is written to
WORKDIR/config.json. Several processes (hosts): pass --coordinator_address, --num_processes and --process_id
(or set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID) on each. On NVIDIA GPUs it adds the XLA flags
of `accelerators.GPU_TRAINING_XLA_FLAGS` to XLA_FLAGS (a flag already there keeps its value) and logs them;
--xla_gpu_flags replaces them (checked against this jax's XLA first, on any machine), --xla_gpu_flags=none adds
none.
"""

from retnet_jax.runs import cli

if __name__ == "__main__":
  cli.prepare()  # first, before numpy and jax start threads

from absl import flags, logging

from retnet_jax.hardware import accelerators
from retnet_jax.training import metrics, run_config, train

_CONFIG = cli.config_flag("Training config file and preset.")
_WORKDIR = cli.workdir_flag("Directory for checkpoints, metrics and the config.")
_TAKE_FOLDER = cli.take_folder_flag()
_START_PROCESSES = cli.distributed_flags()
_XLA_GPU_FLAGS = flags.DEFINE_string(
    "xla_gpu_flags", None, "XLA flags for training on NVIDIA GPUs, added to XLA_FLAGS where a GPU is present (a flag "
    "already in XLA_FLAGS keeps its value). Unset: those JAX's GPU performance guide recommends for Hopper "
    "(latency-hiding scheduler, highest-priority collective stream, cuBLAS matmuls, combined collectives); 'none': "
    "none; else flags as '--xla_NAME=VALUE ...' in their place.")


def main():
  logging.set_verbosity(logging.INFO)
  added = accelerators.set_gpu_xla_flags(_XLA_GPU_FLAGS.value)  # before anything starts JAX's backend
  _START_PROCESSES()
  if added:
    metrics.log(f"XLA flags for the GPU (--xla_gpu_flags=none: without): {' '.join(added)}")
  train.train_and_evaluate(run_config.build(_CONFIG.value), _WORKDIR.value, _TAKE_FOLDER.value)


if __name__ == "__main__":
  cli.run(main)
