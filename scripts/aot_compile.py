r"""Compiles training and generation for a GPU or TPU target on this machine (no accelerator needed): will it fit?

    python scripts/aot_compile.py --config=configs/retnet.py:1.3b --target=h100:8 --out=runs/aot
    python scripts/aot_compile.py --config=configs/retnet.py:1.3b --target=v5e-16 --steps=train,eval,prefill,decode \
        --config.train.batch_size=32 --config.train.remat=full --out=runs/aot
    python scripts/aot_compile.py --config=configs/retnet.py:1.3b --target=v5p-8 --search --out=runs/aot

Targets: h100:N, h200:N, a100:N (N GPUs per host; --hosts), v4-N, v5e-N, v5p-N, v6e-N (Cloud TPU names; --slices).
Needs the aot extra (pip install -e '.[aot]'). Prints a table, then the report as one JSON line (the last line);
writes both under --out (report.md and report.json, or search.md and search.json for --search).
"""

import os

from retnet_jax.runs import cli

if __name__ == "__main__":
  cli.prepare()  # first, before numpy and jax start threads
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only devices: no accelerator is looked for
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # the CUDA plugin's notes that this machine has no GPU

import json
from pathlib import Path

from absl import flags, logging

from retnet_jax.core import markdown, owned_folders, whole_files
from retnet_jax.hardware import accelerators
from retnet_jax.nn import layer_stack
from retnet_jax.planning import aot
from retnet_jax.training import run_config

_CONFIG = cli.config_flag("Config file and preset, with --config.x.y=... overrides.")
_TARGET = flags.DEFINE_string("target", None, f"What to compile for: {', '.join(accelerators.TARGET_NAMES)}.",
                              required=True)
_STEPS = flags.DEFINE_list("steps", ["train"], f"Steps to compile, among {','.join(aot.STEPS)}.")
_SEARCH = flags.DEFINE_boolean("search", False, "Find the largest power-of-two global batch whose train step fits, "
                               "per remat policy, and the lightest policy at that batch.")
_REMATS = flags.DEFINE_list("remat_policies", ["none", *layer_stack.REMAT_POLICIES],
                            "With --search: the train.remat policies to try, in order.")
_HOSTS = flags.DEFINE_integer("hosts", 1, "GPU targets: hosts of N GPUs each.")
_SLICES = flags.DEFINE_integer("slices", 1, "TPU targets: slices of the named size.")
_OUT = flags.DEFINE_string("out", None, "Directory for the table and the JSON report.", required=True)
_TAKE_FOLDER = cli.take_folder_flag()


def search_table(found: dict) -> str:
  """A Markdown table of a search's attempts, and what it found."""
  lines = [f"{found['target']}, seq_len {found['seq_len']}: largest batch {found['largest_batch']} with remat "
           f"{found['lightest_remat_at_largest_batch']}", ""]
  lines += markdown.table(["remat", "batch", "fits", "required GiB", "compile s"], [
      [a["remat"], a["batch_size"], "yes" if a["fits"] else "no",
       "-" if a["required_bytes_per_device"] is None else f"{a['required_bytes_per_device'] / 2**30:.2f}",
       f"{a['compile_seconds']:.1f}"] for a in found["attempts"]])
  return "\n".join(lines)


FOLDER_FORMAT = "aot plans"  # --out's format in its mark (`owned_folders`)


def main():
  logging.set_verbosity(logging.INFO)  # a search's attempts as they end
  target = accelerators.parse_target(_TARGET.value, hosts=_HOSTS.value, slices=_SLICES.value)
  config = run_config.build(_CONFIG.value)
  name = "search" if _SEARCH.value else "report"
  writes = (f"{name}.md", f"{name}.json")
  owned_folders.check(_OUT.value, FOLDER_FORMAT, flag="--out", writes=writes, take=_TAKE_FOLDER.value)  # before work
  if _SEARCH.value:
    report = aot.search(config, target, remats=_REMATS.value)
    table = search_table(report)
  else:
    report = aot.plan(config, target, _STEPS.value)
    table = aot.format_table(report)
  report["config"] = flags.FLAGS["config"].config_filename
  out = Path(_OUT.value)
  owned_folders.claim(out, FOLDER_FORMAT, flag="--out", writes=writes, take=_TAKE_FOLDER.value)
  whole_files.write_text(out / f"{name}.md", table + "\n")
  whole_files.write_text(out / f"{name}.json", json.dumps(report, indent=1) + "\n")
  print(table, flush=True)
  print(json.dumps(report), flush=True)


if __name__ == "__main__":
  cli.run(main)
