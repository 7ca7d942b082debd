"""The test tiers (tests/tiers.py) rest on tests/durations.json: every test the suite collects is placed by a recorded
time, by a `slow` mark in its own file, or by tiers.FAST."""

from tests import tiers


def test_every_collected_test_has_a_recorded_duration_or_an_explicit_tier(request):
  """A test missing from the record stays in the tier its marks give, so a slow new test would join the fast tier
  unseen (the record once missed six whole files); rewrite it from a full run (`python tests/tiers.py`)."""
  _, durations = tiers.load()
  unplaced = [item.nodeid for item in request.session.items
              if item.nodeid not in durations and not tiers.kept_fast(item.nodeid)
              and item.get_closest_marker("slow") is None]
  assert not unplaced, (f"{len(unplaced)} tests have no recorded duration and no slow mark, e.g. {unplaced[:5]}; "
                        "run the suite with --junitxml and rewrite tests/durations.json (python tests/tiers.py ...)")
