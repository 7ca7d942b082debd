"""The notebooks (compare_modes.ipynb, retnet_vs_transformer.ipynb): stored with the outputs of one run at their
default sizes, without warnings, by the command docs/evaluation.md gives (`jupyter execute --inplace`), and run by
that command end to end at tiny sizes."""

import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "notebooks" / "compare_modes.ipynb"
# One length each, the same for both: the decode prefill then reuses the compiled chunkwise forward.
TINY = dict(TRAIN_STEPS="4", BATCH="1", SEQ_LENS="24", DECODE_CONTEXTS="24", DECODE_TOKENS="2", REPEATS="1",
            PREFILL_CONTEXTS="24,48")
VERSUS = REPO / "notebooks" / "retnet_vs_transformer.ipynb"
VERSUS_TINY = dict(TRAIN_STEPS="4", EVAL_EVERY="2", EVAL_SEQ_LEN="128", POSITION_BUCKETS="4", EVAL_BATCHES="1",
                   MQAR_STEPS="4", MQAR_BATCH="8", MQAR_WIDTHS="16,32", PASSKEY_SEQ_LEN="176", PASSKEY_STEPS="2",
                   PASSKEY_BATCH="2", PASSKEY_LENGTHS="176,200", PASSKEY_DEPTHS="0,1", PASSKEY_SAMPLES="2",
                   DECODE_CONTEXTS="16,32", DECODE_TOKENS="4", REPEATS="1", SEEDS="0,1")


def problems(nb: nbformat.NotebookNode) -> list[str]:
  """The error and stderr outputs (warnings, tracebacks, log lines above INFO) of `nb`'s code cells."""
  return [output.get("text") or output.get("ename") for cell in nb.cells if cell.cell_type == "code"
          for output in cell.outputs if output.output_type == "error" or output.get("name") == "stderr"]


def execute(path: Path, tmp_path: Path, prefix: str, sizes: dict[str, str]) -> nbformat.NotebookNode:
  """A copy of the notebook `path` executed as the docs say (`jupyter execute --inplace`), with `sizes` as its
  `prefix`_NAME environment variables and RUN_DIR in `tmp_path`; the executed notebook."""
  copy = tmp_path / path.name
  shutil.copy(path, copy)
  env = dict(os.environ, XLA_FLAGS="",  # one CPU device, as a user has (conftest forces 8 in this process)
             PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
             **{f"{prefix}_{k}": v for k, v in dict(sizes, RUN_DIR=str(tmp_path / "run")).items()})
  done = subprocess.run([sys.executable, "-m", "jupyter", "execute", "--inplace", str(copy)], env=env,
                        capture_output=True, text=True, timeout=1800)
  assert done.returncode == 0, done.stderr[-3000:]  # nbclient names the cell that failed
  return nbformat.read(copy, as_version=4)


@pytest.mark.parametrize("path, tiny", [(NOTEBOOK, TINY), (VERSUS, VERSUS_TINY)], ids=["compare_modes", "versus"])
def test_notebook_is_stored_with_the_outputs_of_one_run(path, tiny):
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  code_cells = [cell for cell in nb.cells if cell.cell_type == "code"]
  # Every cell run once, in order, by one kernel (`jupyter execute --inplace`), and each showed something.
  assert [cell.execution_count for cell in code_cells] == list(range(1, len(code_cells) + 1))
  assert not problems(nb)
  text = "".join(output.get("text", "") for cell in code_cells for output in cell.outputs)
  # RUN_DIR and its workdirs printed relative to the notebook's folder: no machine's own paths.
  assert "writing to ../runs/" in text
  assert all(path.startswith("../runs/") for path in re.findall(r"[^\s,;'\"]*/runs/", text))
  assert sum("image/png" in output.get("data", {}) for cell in code_cells for output in cell.outputs) >= 2
  assert "parameters" in code_cells[0].metadata.get("tags", [])
  for name in tiny:  # every size the test overrides is a parameter read from the environment
    assert f'_param("{name}"' in code_cells[0].source


@pytest.mark.slow
def test_notebook_runs_end_to_end(tmp_path):
  nb = execute(NOTEBOOK, tmp_path, "COMPARE_MODES", TINY)
  assert not problems(nb)
  run_dir = tmp_path / "run"
  outputs = [output for cell in nb.cells if cell.cell_type == "code" for output in cell.outputs]
  for name in ("time_memory_vs_length.png", "decode_latency.png", "prefill_memory_vs_context.png"):
    assert (run_dir / "plots" / name).stat().st_size > 1000, name
  assert (run_dir / "checkpoints" / "4").is_dir()

  agreement = json.loads((run_dir / "agreement.json").read_text())
  assert agreement["length"] % agreement["chunk_size"]  # not a whole number of chunks
  assert set(agreement["pairs"]) == {"parallel vs chunkwise", "parallel vs recurrent", "chunkwise vs recurrent"}
  for pair in agreement["pairs"].values():
    assert {"logits", "layer 0 `kv`", "layer 1 `kv`"} <= set(pair)
  assert agreement["max_rel"] < 1e-5 and agreement["max_abs"] < 1e-4, agreement
  assert len(agreement["handover"]) == 2
  for handover in agreement["handover"].values():
    assert handover["logits_max_rel"] < 1e-5 and handover["state_max_abs"] < 1e-4, handover

  text = "".join(output.get("text", "") for output in outputs if output.output_type == "stream")
  assert "ROMEO:" in text  # the sampled continuation is printed after its prompt


@pytest.mark.slow
def test_retnet_vs_transformer_runs_end_to_end(tmp_path):
  nb = execute(VERSUS, tmp_path, "RETNET_VS_TRANSFORMER", VERSUS_TINY)
  assert not problems(nb)
  run_dir = tmp_path / "run"
  for name in ("validation_loss.png", "loss_by_position.png", "mqar.png", "mqar_by_state.png", "passkey.png",
               "decoding.png"):
    assert (run_dir / "plots" / name).stat().st_size > 1000, name
  results = json.loads((run_dir / "results.json").read_text())
  assert "nonfinite" not in results, results["nonfinite"]  # metrics.to_json lists any non-finite value there
  models = {"retnet", "gated", "gated_retnet", "hybrid", "transformer"}
  seeds = [0, 1]
  assert results["seeds"] == seeds
  for section in ("parameters", "steps", "validation", "loss_by_position"):
    assert set(results[section]) == models, section
  assert set(results["mqar"]) == models | {"seeds", "d_model", "pairs", "seq_len"}
  assert set(results["mqar_by_state"]) == models | {"widths", "context", "seeds"}
  assert set(results["passkey"]) == models | {"seeds", "train_example_len", "lengths", "depths"}
  assert results["passkey"]["train_example_len"] == 177

  def assert_spread(summary, values):
    assert summary["values"] == pytest.approx(values)
    assert (summary["mean"], summary["min"], summary["max"]) == pytest.approx(
        (np.mean(values), min(values), max(values)))

  for arch in models:
    assert (run_dir / "text" / arch / "checkpoints" / "4").is_dir(), arch
    for width, seed in itertools.product((16, 32), seeds):
      assert (run_dir / "mqar" / f"d{width}" / arch / f"seed{seed}" / "checkpoints" / "4").is_dir(), (arch, width)
    assert results["steps"][arch] == 4
    mqar = results["mqar"][arch]
    assert [(r["seed"], r["d_model"], r["step"]) for r in mqar["runs"]] == [(seed, 32, 4) for seed in seeds]
    for curve in (results["validation"][arch], *(r["validation"] for r in mqar["runs"])):
      assert curve["step"] == [2, 4]
      assert all(math.isfinite(loss) and loss > 0 for loss in curve["eval_loss"])
      assert 0 < curve["train_seconds"][0] < curve["train_seconds"][1]
    assert_spread(mqar["accuracy"], [r["accuracy"] for r in mqar["runs"]])
    assert_spread(mqar["loss"], [r["loss"] for r in mqar["runs"]])
    assert all(0 <= r["accuracy"] <= 1 and math.isfinite(r["loss"]) for r in mqar["runs"])
    # The seeds draw other parameters and other examples: their runs differ.
    assert mqar["runs"][0]["validation"]["eval_loss"] != mqar["runs"][1]["validation"]["eval_loss"]
    by_position = results["loss_by_position"][arch]
    assert by_position["seq_len"] == 128 > by_position["train_seq_len"] == 64
    assert [(b["start"], b["end"]) for b in by_position["buckets"]] == [(0, 32), (32, 64), (64, 96), (96, 128)]
    assert all(math.isfinite(b["loss"]) for b in by_position["buckets"])
    assert sum(b["loss"] for b in by_position["buckets"]) / 4 == pytest.approx(by_position["loss"], rel=1e-5)
    # MQAR against the state at widths 16 and 32 (the preset's own: the runs above).
    narrow, preset_width = results["mqar_by_state"][arch]
    assert (narrow["d_model"], preset_width["d_model"]) == (16, 32) and narrow["step"] == 4
    assert preset_width["accuracy"] == mqar["accuracy"]
    assert narrow["parameters"] < preset_width["parameters"] and narrow["state_bytes"] < preset_width["state_bytes"]
    passkey = results["passkey"][arch]
    for seed, run in zip(seeds, passkey["runs"], strict=True):
      assert (run["seed"], run["step"], run["lengths"], run["depths"], run["samples"]) == (
          seed, 2, [176, 200], [0.0, 1.0], 2)
      assert all(a in (0.0, 0.5, 1.0) for row in run["accuracy"] for a in row) and math.isfinite(run["key_loss"])
      assert (run_dir / "passkey" / arch / f"seed{seed}" / "checkpoints" / "2").is_dir()
    for n, summary in enumerate(passkey["by_length"]):  # each length's accuracy over the depths, per seed
      assert_spread(summary, [np.mean(run["accuracy"][n]) for run in passkey["runs"]])
    assert_spread(passkey["key_loss"], [run["key_loss"] for run in passkey["runs"]])
  # The sizes are matched as the paper does: parameter counts within 2%.
  assert results["parameters"]["transformer"] == pytest.approx(results["parameters"]["retnet"], rel=0.02)
  # Gated RetNet adds the gate projections, [d_model 32, 2 heads] in each of the 2 layers; RetNet's init of the gates
  # a bias per head in each layer.
  assert results["parameters"]["gated"] == results["parameters"]["retnet"] + 2 * 32 * 2
  assert results["parameters"]["gated_retnet"] == results["parameters"]["gated"] + 2 * 2
  modes = {arch: by_position["mode"] for arch, by_position in results["loss_by_position"].items()}
  assert modes == {"retnet": "chunkwise", "gated": "chunkwise", "gated_retnet": "chunkwise", "hybrid": "chunkwise",
                   "transformer": "parallel"}

  decoding = results["decoding"]
  assert decoding["contexts"] == [16, 32]
  for arch in models:
    assert len(decoding[arch]["ms_per_token"]) == len(decoding[arch]["state_bytes"]) == 2
    assert all(ms > 0 for ms in decoding[arch]["ms_per_token"])
  # tiny: 2 layers, d_model 32 in float32. RetNet: per layer kv [1, 2 heads, 16, 32] and key_sum [1, 2, 16], and
  # the position; gated RetNet: kv alone per layer, and the position; the Transformer: keys and values
  # [1, n, 2 heads, 16] and the next slot per layer, and the position.
  assert decoding["retnet"]["state_bytes"] == [2 * (2 * 16 * 32 + 2 * 16) * 4 + 4] * 2
  assert decoding["gated"]["state_bytes"] == decoding["gated_retnet"]["state_bytes"] == [2 * 2 * 16 * 32 * 4 + 4] * 2
  assert decoding["transformer"]["state_bytes"] == [2 * (2 * n * 32 * 4 + 4) + 4 for n in (16, 32)]
  # The hybrid: layer 0's retention state, layer 1's ring buffer of the training length's 64 tokens (keys and values
  # [1, 64, 2 heads, 16]) and its next slot, and the position: constant in the context.
  # MQAR's state after its 32 tokens, at widths 16 and 32 (value width 2 d_model, 2 heads of d_model / 2).
  assert [p["state_bytes"] for p in results["mqar_by_state"]["retnet"]] == [
      2 * (2 * (d // 2) * d + 2 * (d // 2)) * 4 + 4 for d in (16, 32)]
  assert [p["state_bytes"] for p in results["mqar_by_state"]["transformer"]] == [
      2 * (2 * 32 * d * 4 + 4) + 4 for d in (16, 32)]
  assert decoding["hybrid"]["state_bytes"] == [(2 * 16 * 32 + 2 * 16) * 4 + 2 * 64 * 32 * 4 + 4 + 4] * 2
