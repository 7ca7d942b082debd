"""notebooks/compare_modes.ipynb: stored without outputs, and runs end to end with tiny sizes in a fresh kernel."""

import json
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "notebooks" / "compare_modes.ipynb"
# One length each, the same for both: the decode prefill then reuses the compiled chunkwise forward.
TINY = dict(TRAIN_STEPS="4", BATCH="1", SEQ_LENS="24", DECODE_CONTEXTS="24", REPEATS="1")


def test_notebook_is_stored_without_outputs():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(nb)
  code_cells = [cell for cell in nb.cells if cell.cell_type == "code"]
  assert all(not cell.outputs and cell.execution_count is None for cell in code_cells)
  assert "parameters" in code_cells[0].metadata.get("tags", [])
  for name in TINY:  # every size the test overrides is a parameter read from the environment
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
