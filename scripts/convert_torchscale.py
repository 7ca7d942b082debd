"""Converts an official torchscale RetNet checkpoint into a workdir that scripts/evaluate.py and generate.py load:

    python scripts/convert_torchscale.py --state_dict=retnet.pt --torchscale_config=retnet.json --workdir=runs/ts

`--state_dict` is a `torch.save`d state_dict of torchscale's RetNetDecoder (late-2023 layout, its own names:
`layers.0.retention.q_proj.weight`, ..., `embed_tokens.weight`) or a fairseq checkpoint of one (its `model` dict,
names under `decoder.`); `--torchscale_config` a JSON object of its RetNetConfig keyword values. Writes
WORKDIR/checkpoints/0 and WORKDIR/config.json into a new or empty WORKDIR (--take_folder: one holding other files,
left untouched), then prints the flags that load the result. Reading the .pt file
needs torch: `pip install -e '.[torch]'`.
"""

from retnet_jax.runs import cli

if __name__ == "__main__":
  cli.prepare()  # first, before numpy and jax start threads

import json
import pickle
import sys
from collections.abc import Mapping
from pathlib import Path

from absl import flags

from retnet_jax.interop import convert
from retnet_jax.runs import workdir

_STATE_DICT = flags.DEFINE_string("state_dict", None, "torch.save'd RetNetDecoder state_dict (.pt).", required=True)
_TORCHSCALE_CONFIG = flags.DEFINE_string("torchscale_config", None, "JSON file of RetNetConfig keyword values.",
                                         required=True)
_WORKDIR = cli.workdir_flag("Directory to write checkpoints/0 and config.json into.")
_TAKE_FOLDER = cli.take_folder_flag()


def main():
  convert.check_empty_workdir(_WORKDIR.value, _TAKE_FOLDER.value)
  try:
    import torch  # only to read the .pt file
  except ImportError:
    sys.exit("reading a torch state_dict needs torch: pip install -e '.[torch]'")
  try:
    state_dict = torch.load(_STATE_DICT.value, map_location="cpu", weights_only=True)
  except (OSError, RuntimeError, pickle.UnpicklingError, KeyError, EOFError) as e:
    first_line = (str(e).strip().splitlines() or [""])[0]  # torch appends pages of advice
    sys.exit(f"{_STATE_DICT.value} could not be read as a torch.save file ({type(e).__name__}: {first_line}).")
  if not isinstance(state_dict, Mapping):
    sys.exit(f"{_STATE_DICT.value} holds a {type(state_dict).__name__}, not a state_dict (names -> tensors).")
  try:
    torchscale_config = json.loads(Path(_TORCHSCALE_CONFIG.value).read_text())
  except json.JSONDecodeError as e:
    sys.exit(f"{_TORCHSCALE_CONFIG.value} is not valid JSON ({e}).")
  if not isinstance(torchscale_config, dict):
    sys.exit(f"{_TORCHSCALE_CONFIG.value} holds a JSON {type(torchscale_config).__name__}; it must be a JSON object "
             "of RetNetConfig keyword values.")
  model, config = convert.load_torchscale(state_dict, torchscale_config)
  checkpoints = convert.write_checkpoint(model, config, _WORKDIR.value, _TAKE_FOLDER.value)
  load_flags = convert.load_flags(config, _WORKDIR.value)
  print(f"wrote {checkpoints / '0'} and {workdir.config_file(_WORKDIR.value)}; load it with (plus "
        f"--config.data.tokenizer=PATH for the checkpoint's tokenizer):\n"
        f"  python scripts/evaluate.py {load_flags}\n  python scripts/generate.py {load_flags}", flush=True)


if __name__ == "__main__":
  cli.run(main)
