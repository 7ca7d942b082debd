"""scripts/gpu_check.py: the parts' deadlines, skipping what is done, the missing-package message, warnings captured,
test outcomes counted, and (slow) its smoke run of every part on the CPU, then a rerun that skips them all."""

import dataclasses
import json
import os
import warnings

import pytest

from benchmarks import gpu_check, gpu_train, requirements
from benchmarks.suites import GPU_SUITES
from retnet_jax.hardware import accelerators
from retnet_jax.planning import aot
from tests.helpers import aot_extra_missing, run_script


def test_deadlines_carry_over_and_bad_budgets_are_refused():
  """Each part's deadline adds its budget to the start-up and the earlier parts' (time one leaves goes to the next);
  the last part runs to the total; unknown parts and budgets that do not fit are refused naming them."""
  budgets = {"train": 100.0, "op": 50.0, "tests": 30.0}
  found = gpu_check.deadlines(("train", "op", "tests"), budgets, start=1000.0, total=400.0)
  startup = gpu_check.STARTUP_S
  assert [found[p].seconds for p in ("train", "op", "tests")] == [startup + 100, startup + 150, 400.0]
  assert all(b.start == 1000.0 for b in found.values()) and "the op part's deadline" in found["op"].reason
  assert gpu_check.STARTUP_S + sum(gpu_check.BUDGETS_S.values()) <= gpu_check.TOTAL_S == 540
  with pytest.raises(ValueError, match=r"\['decoding'\]: choose one or more of train,op,kernels,decode,tests"):
    gpu_check.check_request(("train", "decoding"), gpu_check.BUDGETS_S, 540, ())
  with pytest.raises(ValueError, match=r"\['trian'\]"):
    gpu_check.check_request(("train",), gpu_check.BUDGETS_S, 540, ("trian",))
  with pytest.raises(ValueError, match=r"'op': -5.0.*positive"):
    gpu_check.check_request(("op",), {**gpu_check.BUDGETS_S, "op": -5.0}, 540, ())
  with pytest.raises(ValueError, match="take 570 s; lower the budgets"):
    gpu_check.check_request(gpu_check.PARTS, {**gpu_check.BUDGETS_S, "tests": 130.0}, 540, ())
  gpu_check.check_request(("op", "tests"), gpu_check.BUDGETS_S, 540, ("op",))
  assert gpu_check.parse_budgets(["train=240", "tests=60"]) == {"train": 240.0, "tests": 60.0}
  with pytest.raises(ValueError, match="'train:240': give part=seconds"):
    gpu_check.parse_budgets(["train:240"])


def test_deadlines_done_only_when_complete_with_every_file(tmp_path):
  """A part counts as done (and a rerun skips it) only where its check file says complete and lists no file that
  is missing; an unreadable or incomplete one is run again."""
  assert not gpu_check.done(tmp_path, "op")
  (tmp_path / "gpu_op_16x32.json").write_text("{}")
  record = {"part": "op", "complete": True, "files": ["gpu_op_16x32.json"]}
  (tmp_path / "check_op.json").write_text(json.dumps(record))
  assert gpu_check.done(tmp_path, "op") and not gpu_check.done(tmp_path, "train")
  (tmp_path / "check_op.json").write_text(json.dumps({**record, "files": ["gpu_op_16x32.json", "gpu_op.md"]}))
  assert not gpu_check.done(tmp_path, "op")
  (tmp_path / "check_op.json").write_text(json.dumps({**record, "complete": False}))
  assert not gpu_check.done(tmp_path, "op")
  (tmp_path / "check_op.json").write_text('{"part": "op", "compl')  # cut off while written
  assert not gpu_check.done(tmp_path, "op")


def test_missing_packages_are_named_with_how_to_install(monkeypatch, capsys):
  """A required distribution that is not installed is named with the wheel install, before any work; an optional
  one (fla) only as a note."""
  assert requirements.missing(("numpy", "no-such-distribution-x")) == ["no-such-distribution-x"]
  assert requirements.check() is None  # this environment has them all
  monkeypatch.setattr(requirements, "REQUIRED", ("numpy", "no-such-distribution-x", "no-such-distribution-y"))
  monkeypatch.setattr(requirements, "OPTIONAL", ("no-such-fla",))
  message = requirements.check()
  assert message.startswith("Missing packages (scripts/gpu_check.py needs them; nothing was run): "
                            "no-such-distribution-x, no-such-distribution-y.")
  assert "--dest wheels no-such-distribution-x no-such-distribution-y`" in message
  assert "pip install --no-deps --target DIR wheels/*.whl" in message and "PYTHONPATH=DIR" in message
  assert "numpy" not in message and "no-such-fla" not in message
  assert "Optional packages missing (the op part skips fla's kernels without them): no-such-fla." in (
      capsys.readouterr().out)


def test_captured_warnings_keep_python_warnings_and_stderr_warning_lines():
  """Python warnings and stderr lines that read as warnings (a child's or XLA's, written to file descriptor 2) are
  recorded once each with their count; other stderr lines are not."""
  with gpu_check.captured_warnings() as found:
    for _ in range(2):
      warnings.warn("the Triton lowering is deprecated", DeprecationWarning)
    os.write(2, b"W0101 00:00:00.0 1 pallas.cc:1] lowering\nplain progress line\nUserWarning: from a child\n")
  assert found[0].startswith("DeprecationWarning: the Triton lowering is deprecated (test_gpu_check.py:")
  assert found[0].endswith(" (x2)") and len(found) == 3
  assert found[1:] == ["W0101 00:00:00.0 1 pallas.cc:1] lowering", "UserWarning: from a child"]


def test_deadlines_count_test_outcomes_from_progress_lines():
  """pytest's verbose progress lines, with workers (`[gw0] [ 50%] PASSED ...`) and without, counted by outcome."""
  lines = ["[gw0] [ 25%] PASSED tests/test_kernels.py::test_a", "tests/test_model.py::test_b FAILED   [ 50%]",
           "[gw1] [ 75%] SKIPPED tests/test_model.py::test_c", "tests/test_train.py::test_d XFAIL   [100%]",
           "ERROR tests/test_train.py::test_e", "collected 5 items"]
  assert gpu_check.count_outcomes(lines) == {"passed": 1, "failed": 1, "error": 1, "skipped": 1, "xfailed": 1,
                                             "xpassed": 0}


def test_the_check_follows_the_chip_and_differs_only_in_its_train_shape():
  """An H200 gets the H200's plan (its train batch and remat), any other GPU the H100's; nothing else differs."""
  assert gpu_check.check_of("NVIDIA H200").suite == "check_h200"
  assert gpu_check.check_of("NVIDIA H100 80GB HBM3").suite == gpu_check.check_of("NVIDIA A100-SXM4-80GB").suite
  h100, h200 = GPU_SUITES[gpu_check.CHECKS["h100"].suite], GPU_SUITES["check_h200"]
  assert (h200.train_batch, h200.train_remat) != (h100.train_batch, h100.train_remat)
  assert h200 == dataclasses.replace(h100, train_batch=h200.train_batch, train_remat=h200.train_remat)


@pytest.mark.slow
@pytest.mark.skipif(aot_extra_missing("gpu") is not None, reason=str(aot_extra_missing("gpu")))
@pytest.mark.parametrize("check, target", [("h100", "h100:1"), ("h200", "h200:1")])
def test_each_chips_train_step_fits_its_chip_by_the_aot_plan(check, target):
  """The train part's step (XLA form) at the check's batch and remat fits the chip it is for, compiled for it."""
  suite = GPU_SUITES[gpu_check.CHECKS[check].suite]
  step = aot.plan(gpu_train.suite_config(suite, "1.3b"), accelerators.parse_target(target), ("train",))
  assert step["steps"]["train"]["fits"], step["steps"]["train"]


@pytest.mark.slow
@pytest.mark.cpu_only("the smoke sizes skip what needs a GPU, which a GPU would run")
def test_smoke_run_writes_every_part_and_a_rerun_skips_them(tmp_path):
  """`--smoke`: every part's check file (complete, its Markdown beside it) and the GPU suite's files of the parts
  that write them; a rerun runs no part; --redo runs one again."""
  out = tmp_path / "check"
  result = run_script("gpu_check.py", "--smoke", f"--out={out}", timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  for part in gpu_check.PARTS:
    record = json.loads((out / f"check_{part}.json").read_text())
    assert record["complete"] and all((out / name).is_file() for name in record["files"]), part
    assert (out / f"check_{part}.md").read_text().startswith(f"# GPU check: {part}")
  files = {part: json.loads((out / f"check_{part}.json").read_text())["files"] for part in gpu_check.PARTS}
  assert "gpu_train_tiny.json" in files["train"] and "gpu_op_16x32.md" in files["op"]
  assert "gpu_decode.json" in files["decode"] and not files["kernels"]
  # The decode part's curve against the context: the prefill compiled at each context, both models decoding.
  curve = json.loads((out / "gpu_decode.json").read_text())["curve"]
  assert [p["context"] for p in curve] == list(GPU_SUITES["check_tiny"].curve_contexts)
  for point in curve:
    assert point["retnet"]["prefill_xla_bytes"] > 0 and point["transformer"]["tokens_per_s"]["median"] > 0
  assert curve[-1]["transformer"]["state_bytes"] > 8 * curve[0]["transformer"]["state_bytes"]
  assert curve[-1]["retnet"]["state_bytes"] == curve[0]["retnet"]["state_bytes"]
  kernels = json.loads((out / "check_kernels.json").read_text())["results"]
  assert kernels["ok"] and set(kernels["cases"]) == {"constant", "constant/documents", "per_token/documents"}
  tests = json.loads((out / "check_tests.json").read_text())["results"]
  assert tests["finished"] and tests["returncode"] == 0 and tests["counts"]["passed"] >= 1
  summary = json.loads((out / "gpu_check.json").read_text())
  assert [entry["status"] for entry in summary["parts"].values()] == ["done"] * len(gpu_check.PARTS)
  rerun = run_script("gpu_check.py", "--smoke", f"--out={out}", "--redo=tests")
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  parts = json.loads((out / "gpu_check.json").read_text())["parts"]
  statuses = {part: entry["status"] for part, entry in parts.items()}
  assert statuses.pop("tests") == "done" and all(s.startswith("skipped: done earlier") for s in statuses.values())
