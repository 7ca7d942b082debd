"""The package metadata a user's `pip install` produces: setup.cfg's one-line summary, README.md as the description.

pip asks setuptools' PEP 517 backend (pyproject.toml: `setuptools.build_meta`) for the metadata; the test asks it the
same way, into a temporary folder, so it checks this checkout's setup.cfg and README rather than the metadata of
whatever install the environment holds (an editable install keeps the metadata of when it was made).
"""

from __future__ import annotations

import configparser
import importlib.metadata
from pathlib import Path

from setuptools import build_meta

ROOT = Path(__file__).resolve().parent.parent


def built_metadata(folder: Path):
  """The metadata (an email.message.Message) that setuptools builds from this checkout, as pip has it built."""
  name = build_meta.prepare_metadata_for_build_wheel(str(folder))
  return importlib.metadata.PathDistribution(folder / name).metadata


def test_metadata_has_the_summary_and_readme_as_description(tmp_path, monkeypatch):
  monkeypatch.chdir(ROOT)
  metadata = built_metadata(tmp_path)
  parser = configparser.ConfigParser()
  parser.read(ROOT / "setup.cfg")
  summary = parser["metadata"]["description"]
  assert "\n" not in summary and summary.startswith("Retentive Networks (RetNet) in JAX")
  assert metadata["Name"] == "retnet_jax"
  assert metadata["Summary"] == summary  # whole: not cut at a line or a length
  assert metadata["Description-Content-Type"] == "text/markdown"
  assert metadata.get_payload() == (ROOT / "README.md").read_text()
  assert metadata["License"] == "Apache-2.0" or metadata["License-Expression"] == "Apache-2.0"
  assert metadata["Requires-Python"] == ">=3.11"
  assert "docs" in metadata.get_all("Provides-Extra")
