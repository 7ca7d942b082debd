"""Converts flash-linear-attention's (fla) RetNet checkpoints into workdirs that scripts/evaluate.py, generate.py and
training load, and workdirs back into fla checkpoints:

    python scripts/convert_fla.py --checkpoint=retnet-checkpoint --workdir=runs/fla
    python scripts/convert_fla.py --to_fla --workdir=runs/fla --checkpoint=exported

Import: `--checkpoint` is an fla RetNet folder (config.json with model_type retnet, model.safetensors or the shards
of model.safetensors.index.json, optionally tokenizer.json); writes WORKDIR/checkpoints/0 and WORKDIR/config.json
(data.tokenizer: the checkpoint's tokenizer.json) into a new or empty WORKDIR (--take_folder: one holding other
files, left untouched) and prints the flags that load the result. Export (`--to_fla`):
the workdir's latest checkpoint (or `--step`) with its config.json, written as a folder that fla's
`RetNetForCausalLM.from_pretrained` loads, into a new or empty CHECKPOINT or an earlier export (--take_folder: one
holding other files, left untouched). Neither direction needs torch.
"""

from retnet_jax.runs import cli

if __name__ == "__main__":
  cli.prepare()  # first, before numpy and jax start threads

from pathlib import Path

from absl import flags

from retnet_jax.core import sharding
from retnet_jax.interop import convert, convert_fla, export_fla
from retnet_jax.models import presets
from retnet_jax.runs import workdir as workdir_lib
from retnet_jax.training import train_state

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "fla RetNet checkpoint folder: read, or written with --to_fla.",
                                  required=True)
_WORKDIR = cli.workdir_flag("Workdir: written (checkpoints/0, config.json), or read with --to_fla.")
_TO_FLA = flags.DEFINE_boolean("to_fla", False, "Export the workdir's model as an fla checkpoint instead.")
_TAKE_FOLDER = cli.take_folder_flag()
_STEP = cli.step_flag("With --to_fla: the checkpoint step to export (default: the latest).")


def main():
  workdir, checkpoint = Path(_WORKDIR.value), Path(_CHECKPOINT.value)
  if _TO_FLA.value:
    config = workdir_lib.saved_config(workdir)
    export_fla.check_export(config, checkpoint, _TAKE_FOLDER.value)
    model, step = train_state.restore_model(config, workdir, _STEP.value)
    export_fla.write_fla(model, config, checkpoint, take=_TAKE_FOLDER.value)
    print(f"wrote step {step} of {workdir} to {checkpoint}; load it with "
          f"fla.models.RetNetForCausalLM.from_pretrained({str(checkpoint)!r})", flush=True)
    return
  convert.check_empty_workdir(workdir, _TAKE_FOLDER.value)
  model, config = convert_fla.load_fla(checkpoint, sharding.placement(presets.get_config("fla").mesh))
  checkpoints = convert.write_checkpoint(model, config, workdir, _TAKE_FOLDER.value)
  load_flags = convert.load_flags(config, workdir)
  print(f"wrote {checkpoints / '0'} and {workdir_lib.config_file(workdir)}; load it with:\n"
        f"  python scripts/evaluate.py {load_flags}\n  python scripts/generate.py {load_flags}", flush=True)


if __name__ == "__main__":
  cli.run(main)
