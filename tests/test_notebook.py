"""The notebooks (compare_modes.ipynb, retnet_vs_transformer.ipynb): stored without outputs, and run end to end with
tiny sizes in a fresh kernel."""

import json
import math
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "notebooks" / "compare_modes.ipynb"
# One length each, the same for both: the decode prefill then reuses the compiled chunkwise forward.
TINY = dict(TRAIN_STEPS="4", BATCH="1", SEQ_LENS="24", DECODE_CONTEXTS="24", REPEATS="1")
VERSUS = REPO / "notebooks" / "retnet_vs_transformer.ipynb"
VERSUS_TINY = dict(TRAIN_STEPS="4", EVAL_EVERY="2", EVAL_SEQ_LEN="128", POSITION_BUCKETS="4", EVAL_BATCHES="1",
                   MQAR_STEPS="4", MQAR_BATCH="8", MQAR_WIDTHS="16,32", PASSKEY_SEQ_LEN="176", PASSKEY_STEPS="2",
                   PASSKEY_BATCH="2", PASSKEY_LENGTHS="176,200", PASSKEY_DEPTHS="0,1", PASSKEY_SAMPLES="2",
                   DECODE_CONTEXTS="16,32", DECODE_TOKENS="4", REPEATS="1")


@pytest.mark.parametrize("path, tiny", [(NOTEBOOK, TINY), (VERSUS, VERSUS_TINY)], ids=["compare_modes", "versus"])
def test_notebook_is_stored_without_outputs(path, tiny):
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  code_cells = [cell for cell in nb.cells if cell.cell_type == "code"]
  assert all(not cell.outputs and cell.execution_count is None for cell in code_cells)
  assert "parameters" in code_cells[0].metadata.get("tags", [])
  for name in tiny:  # every size the test overrides is a parameter read from the environment
    assert f'_param("{name}"' in code_cells[0].source


@pytest.mark.slow
def test_notebook_runs_end_to_end(tmp_path):
  run_dir = tmp_path / "run"
  env = dict(os.environ, XLA_FLAGS="",  # one CPU device, as a user has (conftest forces 8 in this process)
             PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
             COMPARE_MODES_RUN_DIR=str(run_dir), **{f"COMPARE_MODES_{k}": v for k, v in TINY.items()})
  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = NotebookClient(nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(tmp_path)}})
  client.execute(env=env)  # raises CellExecutionError, naming the cell, if any cell fails

  outputs = [output for cell in nb.cells if cell.cell_type == "code" for output in cell.outputs]
  assert not [output for output in outputs if output.output_type == "error"]
  for name in ("time_memory_vs_length.png", "decode_latency.png"):
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
  run_dir = tmp_path / "run"
  env = dict(os.environ, XLA_FLAGS="",  # one CPU device, as a user has (conftest forces 8 in this process)
             PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
             RETNET_VS_TRANSFORMER_RUN_DIR=str(run_dir),
             **{f"RETNET_VS_TRANSFORMER_{k}": v for k, v in VERSUS_TINY.items()})
  nb = nbformat.read(VERSUS, as_version=4)
  client = NotebookClient(nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(tmp_path)}})
  client.execute(env=env)  # raises CellExecutionError, naming the cell, if any cell fails

  for name in ("validation_loss.png", "loss_by_position.png", "mqar.png", "mqar_by_state.png", "passkey.png",
               "decoding.png"):
    assert (run_dir / "plots" / name).stat().st_size > 1000, name
  results = json.loads((run_dir / "results.json").read_text())
  assert "nonfinite" not in results, results["nonfinite"]  # metrics.to_json lists any non-finite value there
  models = {"retnet", "gated", "hybrid", "transformer"}
  for section in ("parameters", "steps", "validation", "loss_by_position", "mqar", "passkey"):
    assert set(results[section]) == models, section
  assert set(results["mqar_by_state"]) == models | {"widths", "context"}
  for arch in models:
    for task in ("text", "mqar"):
      assert (run_dir / task / arch / "checkpoints" / "4").is_dir(), (task, arch)
    assert results["steps"][arch] == 4 and results["mqar"][arch]["step"] == 4
    for curve in (results["validation"][arch], results["mqar"][arch]["validation"]):
      assert curve["step"] == [2, 4]
      assert all(math.isfinite(loss) and loss > 0 for loss in curve["eval_loss"])
      assert 0 < curve["train_seconds"][0] < curve["train_seconds"][1]
    by_position = results["loss_by_position"][arch]
    assert by_position["seq_len"] == 128 > by_position["train_seq_len"] == 64
    assert [(b["start"], b["end"]) for b in by_position["buckets"]] == [(0, 32), (32, 64), (64, 96), (96, 128)]
    assert all(math.isfinite(b["loss"]) for b in by_position["buckets"])
    assert sum(b["loss"] for b in by_position["buckets"]) / 4 == pytest.approx(by_position["loss"], rel=1e-5)
    assert 0 <= results["mqar"][arch]["accuracy"] <= 1 and math.isfinite(results["mqar"][arch]["loss"])
    # MQAR at widths 16 and 32: the preset's own width (32) is the MQAR run above, the other a run of its own.
    narrow, preset_width = results["mqar_by_state"][arch]
    assert (narrow["d_model"], preset_width["d_model"]) == (16, 32) and narrow["step"] == 4
    assert (run_dir / "mqar_width" / "d16" / arch / "checkpoints" / "4").is_dir()
    assert not (run_dir / "mqar_width" / "d32").exists()
    assert preset_width["accuracy"] == results["mqar"][arch]["accuracy"]
    assert narrow["parameters"] < preset_width["parameters"] and narrow["state_bytes"] < preset_width["state_bytes"]
    passkey = results["passkey"][arch]
    assert (passkey["step"], passkey["train_example_len"], passkey["lengths"], passkey["depths"]) == (
        2, 177, [176, 200], [0.0, 1.0])
    assert passkey["samples"] == 2 and all(a in (0.0, 0.5, 1.0) for row in passkey["accuracy"] for a in row)
  # The sizes are matched as the paper does: parameter counts within 2%.
  assert results["parameters"]["transformer"] == pytest.approx(results["parameters"]["retnet"], rel=0.02)
  # Gated RetNet adds the gate projections, [d_model 32, 2 heads] in each of the 2 layers.
  assert results["parameters"]["gated"] == results["parameters"]["retnet"] + 2 * 32 * 2
  modes = {arch: by_position["mode"] for arch, by_position in results["loss_by_position"].items()}
  assert modes == {"retnet": "chunkwise", "gated": "chunkwise", "hybrid": "chunkwise", "transformer": "parallel"}

  decoding = results["decoding"]
  assert decoding["contexts"] == [16, 32]
  for arch in models:
    assert len(decoding[arch]["ms_per_token"]) == len(decoding[arch]["state_bytes"]) == 2
    assert all(ms > 0 for ms in decoding[arch]["ms_per_token"])
  # tiny: 2 layers, d_model 32 in float32. RetNet: per layer kv [1, 2 heads, 16, 32] and key_sum [1, 2, 16], and
  # the position; gated RetNet: kv alone per layer, and the position; the Transformer: keys and values
  # [1, n, 2 heads, 16] and the next slot per layer, and the position.
  assert decoding["retnet"]["state_bytes"] == [2 * (2 * 16 * 32 + 2 * 16) * 4 + 4] * 2
  assert decoding["gated"]["state_bytes"] == [2 * 2 * 16 * 32 * 4 + 4] * 2
  assert decoding["transformer"]["state_bytes"] == [2 * (2 * n * 32 * 4 + 4) + 4 for n in (16, 32)]
  # The hybrid: layer 0's retention state, layer 1's ring buffer of the training length's 64 tokens (keys and values
  # [1, 64, 2 heads, 16]) and its next slot, and the position: constant in the context.
  # MQAR's state after its 32 tokens, at widths 16 and 32 (value width 2 d_model, 2 heads of d_model / 2).
  assert [p["state_bytes"] for p in results["mqar_by_state"]["retnet"]] == [
      2 * (2 * (d // 2) * d + 2 * (d // 2)) * 4 + 4 for d in (16, 32)]
  assert [p["state_bytes"] for p in results["mqar_by_state"]["transformer"]] == [
      2 * (2 * 32 * d * 4 + 4) + 4 for d in (16, 32)]
  assert decoding["hybrid"]["state_bytes"] == [(2 * 16 * 32 + 2 * 16) * 4 + 2 * 64 * 32 * 4 + 4 + 4] * 2
