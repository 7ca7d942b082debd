"""Measures every GPU target of the project in one command of at most 9 minutes on one H100.

    python scripts/gpu_check.py --out=runs/gpu_check            # on the GPU machine
    python scripts/gpu_check.py --smoke --out=runs/gpu_smoke    # every part on a CPU at tiny sizes, in about a minute

First names the packages it needs that are missing (`benchmarks.requirements`: how to install them from
wheels) and stops before any work; fla missing only skips fla's kernels in the op part. Then runs its parts in
priority order, each within its time budget (train, op, kernels, decode, tests: `benchmarks.gpu_check` says
what each measures and why its budget), writing OUT/check_<part>.json and .md as each ends (the train, op and decode
parts also the GPU suite's gpu_<part>_*.json and .md) and OUT/gpu_check.json and .md, the summary. A rerun skips the
parts done (`--redo=op,tests` or `--redo=all` runs them again), so a run cut short is finished by the next.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's root: benchmarks/ is not installed
from benchmarks import requirements  # noqa: E402  (the standard library only: runs where packages are missing)

START = time.time()  # the parts' deadlines count from here
if __name__ == "__main__":
  if message := requirements.check():
    sys.exit(message)

from retnet_jax.runs import cli  # noqa: E402  (after the package check: it imports ml_collections)

if __name__ == "__main__":
  cli.prepare()  # before numpy and jax start threads

import os  # noqa: E402

import jax  # noqa: E402
from absl import app, flags  # noqa: E402

from benchmarks import gpu_check  # noqa: E402
from retnet_jax.core import owned_folders  # noqa: E402

_OUT = flags.DEFINE_string("out", "runs/gpu_check", "Folder of every result file.")
_PARTS = flags.DEFINE_list("parts", list(gpu_check.PARTS), f"Parts to run, of {','.join(gpu_check.PARTS)} (they run "
                           "in that order).")
_BUDGETS = flags.DEFINE_list("budgets", [], "Seconds per part replacing the defaults, e.g. train=240,tests=60 "
                             f"(defaults {','.join(f'{k}={v:g}' for k, v in gpu_check.BUDGETS_S.items())}).")
_TOTAL_S = flags.DEFINE_float("total_s", None, "Seconds the whole run may take, start-up included; the last part "
                              f"runs until then (default {gpu_check.TOTAL_S:g}; with --smoke, more).")
_REDO = flags.DEFINE_list("redo", [], "Parts to run again though their results are complete (all: every part).")
_SMOKE = flags.DEFINE_boolean("smoke", False, "Every part at tiny sizes on any backend: kernels interpreted, fla "
                              "skipped, the tests a small selection.")


def main():
  # Before JAX starts its backend: torch (fla) shares the GPU, so JAX allocates as it goes, up to 90%.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
  redo = tuple(gpu_check.PARTS) if _REDO.value == ["all"] else tuple(_REDO.value)
  check = gpu_check.CHECKS["smoke"] if _SMOKE.value else gpu_check.check_of(jax.devices()[0].device_kind)
  total = check.total_s if _TOTAL_S.value is None else _TOTAL_S.value
  try:
    budgets = gpu_check.parse_budgets(_BUDGETS.value)
    gpu_check.check_request(tuple(_PARTS.value), {**check.budgets_s, **budgets}, total, redo)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  out = Path(_OUT.value)
  # A folder of its own (new, empty, an earlier check's: its parts done are kept), before any work.
  owned_folders.claim(out, gpu_check.FOLDER_FORMAT, flag="--out", take_flag=None, earlier=gpu_check.earlier_results)
  gpu_check.run(check, tuple(_PARTS.value), out, " ".join(["python"] + sys.argv), budgets, total, redo, START)


if __name__ == "__main__":
  cli.run(main)
