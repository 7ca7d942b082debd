"""Every script starts as a user starts it: `python scripts/NAME.py --help` in a fresh process imports the script and
everything it reads, defines its flags and prints them (the fast tier's smoke check of each script; their real runs are
in the tests of what they do)."""

import re
from pathlib import Path

import pytest

from tests.helpers import REPO, run_script

SCRIPTS = sorted(path.name for path in (REPO / "scripts").glob("*.py"))


def test_the_scripts_are_the_ones_checked():
  assert len(SCRIPTS) >= 12 and "train.py" in SCRIPTS and "gpu_check.py" in SCRIPTS, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_starts_as_a_user_starts_it(script):
  result = run_script(script, "--help")
  assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
  defined = set(re.findall(r"flags\.DEFINE_\w+\(\s*\"(\w+)\"", (REPO / "scripts" / script).read_text()))
  shown = set(re.findall(r"^  --(?:\[no\])?(\w+)", result.stdout, flags=re.MULTILINE))
  assert defined <= shown, (sorted(defined - shown), result.stdout[-2000:])
  assert Path(REPO / "scripts" / script).stem in result.stdout  # absl names the script's own flags by its module


# What a script may import before `cli.prepare()`: the standard library's os, sys, time and pathlib (the repository's
# root on sys.path, for benchmarks/), cli itself, and the GPU check's package check (standard library only).
BEFORE_PREPARE = re.compile(r"(import (os|sys|time)|from pathlib import Path|from retnet_jax\.runs import cli|"
                            r"from benchmarks import requirements)\b.*")


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_takes_the_common_start_before_its_imports(script):
  """`cli.prepare()` before numpy, jax or the package's modules load (the CPU without the CUDA plugin's tracebacks,
  the kept heap, one line on a signal), then `cli.run(main)`: convert_fla.py skipped it, printed two "Unable to
  load CUDA" tracebacks and said nothing on SIGTERM."""
  source = (REPO / "scripts" / script).read_text()
  body = source.split('"""', 2)[2].replace("from __future__ import annotations", "")  # after the docstring
  before, found, _ = body.partition('if __name__ == "__main__":\n  cli.prepare()')
  assert found, script
  imports = re.findall(r"^(?:import|from) .*", before, flags=re.MULTILINE)
  assert imports and all(BEFORE_PREPARE.fullmatch(line) for line in imports), (script, imports)
  assert source.rstrip().endswith('if __name__ == "__main__":\n  cli.run(main)'), script
