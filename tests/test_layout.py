"""The code's layout: no module of retnet_jax (subpackages included) or of the benchmark beside it over 450 lines, no
script over 250."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MAX_LINES = {"retnet_jax": 450, "benchmarks": 450, "scripts": 250}


@pytest.mark.parametrize("folder", MAX_LINES)
def test_files_stay_within_their_line_limit(folder):
  files = sorted((REPO / folder).rglob("*.py"))
  assert files, f"no Python files under {folder}/"
  limit = MAX_LINES[folder]
  lines = {str(path.relative_to(REPO)): len(path.read_text().splitlines()) for path in files}
  too_long = {path: count for path, count in lines.items() if count > limit}
  assert not too_long, f"over {limit} lines: {too_long}; split the file by idea"
