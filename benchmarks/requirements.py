"""The packages `scripts/gpu_check.py` needs beyond jax, flax and torch, named before any work where one is missing.

Standard library only: it runs before anything imports the packages it looks for. A GPU image may come with jax,
flax and torch but without the project's other dependencies; a machine without the network installs them from
wheels downloaded elsewhere (`install_message`).
"""

from __future__ import annotations

import importlib.metadata

# Distributions the check imports beyond jax, flax and torch (the model, training and data code and the GPU tests
# import them; array-record is grain's). dm-tree, which some GPU images also lack, is needed by none of them.
REQUIRED = ("ml-collections", "grain", "array-record", "tensorboardX", "datasets")
# Without these the op part skips fla's kernels (a note, not an error).
OPTIONAL = ("flash-linear-attention", "fla-core")


def missing(distributions: tuple[str, ...]) -> list[str]:
  """The names in `distributions` that no installed distribution (on sys.path, `--target` folders included) has."""
  absent = []
  for name in distributions:
    try:
      importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      absent.append(name)
  return absent


def install_message(names: list[str], optional: bool = False) -> str:
  """What is missing and how to install it on a machine without the network: download the wheels where there is
  one, copy them over, install them without dependencies into a folder and put it on PYTHONPATH."""
  listed = " ".join(names)
  what = ("Optional packages missing (the op part skips fla's kernels without them)" if optional else
          "Missing packages (scripts/gpu_check.py needs them; nothing was run)")
  return (f"{what}: {', '.join(names)}. Install them from wheels: where there is a network, `pip download --no-deps "
          f"--python-version 3.12 --only-binary=:all: --dest wheels {listed}`; copy `wheels/` to this machine, then "
          "`pip install --no-deps --target DIR wheels/*.whl` and rerun with `PYTHONPATH=DIR` (the versions setup.cfg "
          "pins).")


def check() -> str | None:
  """The message naming the required packages that are missing (None: all present); the optional ones missing are
  printed as a note."""
  if absent := missing(OPTIONAL):
    print(install_message(absent, optional=True), flush=True)
  absent = missing(REQUIRED)
  return install_message(absent) if absent else None
