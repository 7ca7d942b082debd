"""The context suite (`scripts/benchmark.py --suite=context`, `benchmarks.context`): what each point runs or
skips and why, a skipped prefill still sized and decoded from zeros, and the suite end to end at the tiny size, where
RetNet's compiled prefill stays flat and the Transformer's grows with its KV cache."""

import dataclasses
import json

import pytest

from benchmarks import context
from benchmarks.suites import CONTEXT_SUITES
from tests.helpers import run_script

SWEEP = dataclasses.replace(CONTEXT_SUITES["tiny"], lengths=(4096, 16384), point_budget_s=10.0)
PLENTY = (1 << 40, "MemAvailable")


def measured(length, prefill_s, decode_s_per_token):
  """An earlier point that ran its prefill and decoding in these times."""
  return {"length": length, "prefill": {"seconds": {"median": prefill_s}},
          "decode": {"seconds_per_token": {"median": decode_s_per_token}}}


def test_points_are_skipped_by_their_estimates_and_the_memory_they_need():
  # The first length runs whole: nothing to estimate from.
  first = context.plan(SWEEP, "transformer", 4096, [], PLENTY)
  assert first["run_prefill"] and first["run_decode"] and "prefill_skipped" not in first
  # KV cache of 4096 + 32 slots: 2 layers x (key, value) x 32 wide x 4 bytes, and the position and next slot.
  assert first["state_bytes"] == 2 * 2 * 4128 * 32 * 4 + 2 * 4 + 4
  # 1 s at 4k: attention's prefill grows with the square of the length (16 s at 16k, over the 10 s budget), a fixed
  # state's linearly (4 s); decoding 0.1 s a token (3 calls of 32 tokens: 9.6 s) grows with a KV cache, 4x.
  earlier = [measured(4096, 1.0, 0.1)]
  attention = context.plan(SWEEP, "transformer", 16384, earlier, PLENTY)
  assert not attention["run_prefill"] and attention["prefill_estimate_s"] == pytest.approx(16.0)
  assert attention["prefill_skipped"] == ("time budget: estimated 16 s from 4,096 tokens' 1 s (quadratic), over "
                                          "--point_budget_s=10")
  assert not attention["run_decode"] and attention["decode_estimate_s"] == pytest.approx(4 * 9.6)
  for name in ("retnet", "gated", "hybrid"):  # the hybrid's window keeps its state fixed
    fixed = context.plan(SWEEP, name, 16384, earlier, PLENTY)
    assert fixed["run_prefill"] and fixed["run_decode"], (name, fixed)
  # A skipped length's successor is estimated from the last measured one.
  later = context.plan(SWEEP, "retnet", 65536, earlier + [{"length": 16384}], PLENTY)
  assert not later["run_prefill"] and later["prefill_estimate_s"] == pytest.approx(16.0)
  # Decoding needs its state three times; a state larger than the memory runs nothing.
  cache = first["state_bytes"]
  tight = context.plan(SWEEP, "transformer", 4096, [], (2 * cache, "MemAvailable"))
  assert tight["run_prefill"] and not tight["run_decode"]
  assert tight["decode_skipped"].startswith("does not fit: decoding holds its state of 2.11 MB twice")
  none = context.plan(SWEEP, "transformer", 4096, [], (cache - 1, "the memory.max of cgroup / less its usage"))
  assert none["skipped"] == ("does not fit: its decoding state (KV cache) of 2.11 MB exceeds the 2.11 MB of host "
                             "memory available (the memory.max of cgroup / less its usage)")


def test_a_skipped_prefill_is_still_sized_and_decodes_from_zeros():
  point = context.measure_point(SWEEP, "transformer", 256, prefill=False, decode=True)
  assert "prefill" not in point and point["xla_bytes"] >= point["xla"]["output_bytes"] > 0
  assert point["decode"]["from"] == "zeros" and point["decode"]["tokens_per_s"]["median"] > 0


@pytest.mark.slow
@pytest.mark.optimized
def test_the_suite_runs_every_model_at_every_length_and_retnet_stays_flat(tmp_path):
  """The tiny suite at 4k and 16k tokens writes its JSON, Markdown and plot; RetNet's, gated retention's and the
  hybrid's compiled prefill holds at most 1.25x the bytes at 16k that it holds at 4k; the Transformer's grows with
  its KV cache (its outputs), which holds the context, and by nothing else (its temporaries at most 1.25x)."""
  proc = run_script("benchmark.py", "--suite=context", "--context_size=tiny", "--context_lengths=16384,4096",
                    f"--out={tmp_path}", timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads((tmp_path / "context.json").read_text())
  assert results["meta"]["settings"]["lengths"] == [4096, 16384] and results["meta"]["plot"] == "context.png"
  # Side by side: at each length every model in turn.
  assert [(p["length"], p["model"]) for p in results["points"]] == [
      (n, m) for n in (4096, 16384) for m in context.MODELS]
  by = {(p["model"], p["length"]): p for p in results["points"]}
  for point in results["points"]:
    assert point["prefill"]["tokens_per_s"]["median"] > 0 and point["decode"]["from"] == "prefill", point
    assert point["prefill"]["memory"]["peak_bytes"] > point["prefill"]["memory"]["above_start_bytes"] > 0
  for name in ("retnet", "gated", "hybrid"):
    assert by[name, 16384]["xla_bytes"] <= 1.25 * by[name, 4096]["xla_bytes"], name
    assert by[name, 16384]["state_bytes"] == by[name, 4096]["state_bytes"]
  transformer = {n: by["transformer", n] for n in (4096, 16384)}
  assert transformer[16384]["xla"]["output_bytes"] > 3.5 * transformer[4096]["xla"]["output_bytes"]
  temporaries = {n: transformer[n]["xla"]["temporary_bytes"] for n in (4096, 16384)}
  assert temporaries[16384] <= 1.25 * temporaries[4096], temporaries  # its cache read a block of keys at a time
  assert transformer[16384]["state_bytes"] == 2 * 2 * (16384 + 32) * 32 * 4 + 2 * 4 + 4
  text = (tmp_path / "context.md").read_text()
  assert text.count("| context | XLA prefill (temporaries) |") == 4 and "| 16,384 |" in text
  assert (tmp_path / "context.png").stat().st_size > 0
