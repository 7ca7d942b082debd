"""The scripts' shared command line: bad flags and config fields end in one line of error, no traceback."""

import re

import pytest

from tests.helpers import run_script


@pytest.mark.slow
@pytest.mark.parametrize("flags,message", [
    (["--config.train.stpes=3"], r'error: --config.train.stpes names no config field: .*Did you mean "steps"'),
    (["--config=configs/retnet.py:huge"], r"error: flag --config=configs/retnet.py:huge: ValueError: unknown preset "
                                          r"'huge'; choose one of"),
    (["--config.train.steps=abc"], r"error: flag --config.train.steps=abc: invalid literal"),
    (["--config.train.learning_rate=-1"], r"error: train.learning_rate must be positive; got -1.0. \(ValueError; "
                                          r"--verbose shows the traceback\)"),
])
def test_errors_are_one_message(tmp_path, flags, message):
  result = run_script("train.py", f"--workdir={tmp_path / 'run'}", *flags)
  assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert re.search(message, result.stderr), result.stderr[-3000:]
  assert not (tmp_path / "run").exists()  # refused before the workdir is touched


@pytest.mark.slow
def test_verbose_keeps_the_traceback(tmp_path):
  result = run_script("train.py", f"--workdir={tmp_path / 'run'}", "--config.train.learning_rate=-1", "--verbose")
  assert result.returncode != 0 and "Traceback" in result.stderr and "learning_rate must be positive" in result.stderr
