"""The test tiers by measured duration: tests that took at least `slow_s` seconds in the recorded run
(tests/durations.json) join the slow tier (marked `slow`, beside the tests marked so in their files), except the
checks the fast tier must keep (FAST). The fast tier is the default test command (setup.cfg's addopts).

    python tests/tiers.py REPORT.xml...   # rewrites tests/durations.json from the runs' --junitxml reports

A test missing from the record (a new one) stays in the tier its marks give; rerun the suite with --junitxml and
rewrite the record to place it by its time.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

RECORD = Path(__file__).resolve().parent / "durations.json"

# Checks the fast tier keeps whatever their time (every case of each test named): every retention form, with a
# constant, per-token and gated decay, against the float64 reference; the kernels (one case each of the split and
# fused layouts) against float64 and the XLA form; every script started as a user starts it; a streamed prefill against
# one call, and its memory at 2^20 tokens against 2^14.
FAST = {
    "tests/test_retention.py::test_forms_match_float64_reference": "the three forms against float64",
    "tests/test_per_token_decay.py::test_forms_match_float64_recurrence": "per-token decays against float64",
    "tests/test_gated_retention.py::test_forms_match_a_float64_recurrence": "gated retention against float64",
    "tests/test_kernel_decays.py::test_float32_values_and_decay_gradients_match_a_float64_recurrence[21-4-True]":
        "the split kernels against float64",
    "tests/test_kernels.py::test_float32_values_and_gradients_match_float64_and_xla[7-1-default-fused]":
        "the fused kernels against float64 and the XLA form",
    "tests/test_scripts.py::test_every_script_starts_as_a_user_starts_it": "every script",
    "tests/test_streaming.py::test_streamed_state_equals_one_call[retnet-56]":
        "a prefill streamed in blocks equals one call",
    "tests/test_streaming.py::test_prefill_memory_does_not_grow_with_the_prompt": "constant prefill memory",
}


def load() -> tuple[float, dict[str, float]]:
  """(slow_s, {test id: seconds}) of the record."""
  record = json.loads(RECORD.read_text())
  return float(record["slow_s"]), record["durations"]


def kept_fast(nodeid: str) -> bool:
  """Whether `nodeid` is one of the FAST checks (a test named there, or one case of it)."""
  return nodeid in FAST or nodeid.split("[")[0] in FAST


def durations(reports: list[str]) -> dict[str, float]:
  """{test id: seconds} from pytest's --junitxml reports (setup, call and teardown: junit_duration_report=total)."""
  found = {}
  for report in reports:
    for case in ET.parse(report).getroot().iter("testcase"):
      nodeid = case.get("classname").replace(".", "/") + ".py::" + case.get("name")
      found[nodeid] = round(float(case.get("time")), 1)
  return dict(sorted(found.items()))


if __name__ == "__main__":
  if len(sys.argv) < 2:
    sys.exit(__doc__)
  record = json.loads(RECORD.read_text())
  record["durations"] = durations(sys.argv[1:])
  RECORD.write_text(json.dumps(record, indent=1) + "\n")
  print(f"{len(record['durations'])} tests recorded in {RECORD}")
