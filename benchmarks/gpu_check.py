"""Every GPU target of the project measured in one command of at most 9 minutes on one H100 (`scripts/gpu_check.py`).

Parts, in priority order, each over the GPU suite's modules (`CHECKS["h100"]`: the `check` sizes of `GPU_SUITES`;
on an H200 `CHECKS["h200"]`, `check_of`):
1. `train`: the 1.3b preset's train step (bfloat16, scanned layers) at the batch and remat policy the AOT plan fits
   on the chip, XLA form, Pallas split and Pallas fused, and the Transformer of that size (`gpu_train`).
2. `op`: the retention op at d 256x256, 4k and 16k tokens, forward and forward+backward, constant and per-token
   decays, both kernel layouts, against fla's `chunk_retention` and `chunk_simple_gla` where fla is installed
   (`gpu_op`).
3. `kernels`: the compiled kernels (both layouts) against the XLA form in float32 at `highest`, values and gradients,
   constant and per-token decays, with packed documents (`kernel_check.check`).
4. `decode`: batch 1 with bfloat16 weights against the weight-read floor, batch 64 at 8k tokens of context against
   the Transformer, then the context suite's curve at batch 1 after 4k, 64k and 1M tokens: XLA's memory of RetNet's
   and the Transformer's prefill (compiled, not run) and their decoding tokens/s from a zero-filled state (the
   Transformer's 1M-token KV cache, 206 GB, is not decoded) (`gpu_decode`).
5. `tests`: the GPU test command (docs/tests.md), `-m "not slow"`, ended at its budget; its counts so far.

Budgets (`BUDGETS_S`, seconds, with `STARTUP_S` summing to `TOTAL_S` = 540) are deadlines taken in order: a part may
run until the start-up and its own and the earlier parts' budgets have passed, so what one part leaves over goes to
the next, and the tests take whatever is left (their counts say how far they went). A part still running past its
deadline stops between cases (a train case's process is ended). How each budget was sized from an H100 run's
figures: docs/benchmarks.md, "Checking every GPU target in one command".

Every part writes OUT/check_<part>.json and .md when it ends (`complete: true`), the train, op and decode parts also
the GPU suite's files of their groups (gpu_train_1.3b.json ...), listed under `files`; a rerun skips a part whose
check file is complete and whose files are all present (`redo` runs it again). Python warnings and the lines of the
process's stderr (its children's and XLA's included) that look like warnings are recorded per part under `warnings`:
Pallas' Triton lowering is deprecated from jax 0.11 and says so there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import gpu, kernel_check
from benchmarks.documents import document_ids
from benchmarks.gpu_op import PER_TOKEN_LAYOUT, log_decays
from benchmarks.harness import Budget
from benchmarks.op import TOLERANCE, op_inputs
from benchmarks.suites import GPU_SUITES, GpuSuite
from retnet_jax.core import markdown, whole_files
from retnet_jax.mixers import kernels

PARTS = ("train", "op", "kernels", "decode", "tests")  # in priority order
FOLDER_FORMAT = "gpu check results"  # --out's format in its mark (`owned_folders`)


def earlier_results(folder: Path) -> list[str] | None:
  """Every name in `folder` where an earlier version of the check (before the mark) wrote it: its summary
  gpu_check.json reads back as one (parts and budgets); else None."""
  try:
    summary = json.loads((folder / "gpu_check.json").read_text())
  except (OSError, ValueError):
    return None
  if not (isinstance(summary, dict) and {"parts", "budgets_s"} <= set(summary)):
    return None
  return sorted(p.name for p in folder.iterdir())
TOTAL_S = 540.0
STARTUP_S = 20.0  # interpreter, imports, the package check and the backend's start
BUDGETS_S = {"train": 200.0, "op": 120.0, "kernels": 50.0, "decode": 50.0, "tests": 100.0}
# docs/tests.md: the numerical tests that run on a GPU.
GPU_TEST_FILES = ("tests/test_retention.py", "tests/test_long_context.py", "tests/test_kernels.py",
                  "tests/test_kernel_segments.py", "tests/test_model.py", "tests/test_sampling.py",
                  "tests/test_train.py")
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
_WARNING_LINE = re.compile(r"warn|deprecat|^W\d{4} ", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Check:
  """What one check run measures beyond its GPU suite: the kernel check's shapes and the test command."""
  suite: str  # the GPU_SUITES entry of the train, op and decode parts
  kernel_batch: int
  kernel_heads: int
  kernel_head_dims: tuple[int, int]
  kernel_length: int
  kernel_chunk: int
  document_len: int  # mean length of the packed documents of the kernel check
  interpret: bool  # the kernels in Pallas interpret mode (a CPU smoke run)
  test_files: tuple[str, ...]
  test_select: tuple[str, ...]  # more pytest arguments (a selection)
  test_backend: str | None  # RETNET_TEST_BACKEND of the test command (None: the tests' default, the CPU)
  budgets_s: dict[str, float]  # per part (see the module's docstring)
  total_s: float  # the whole run's, start-up included


CHECKS = {
    "h100": Check(suite="check", kernel_batch=2, kernel_heads=4, kernel_head_dims=(256, 256), kernel_length=1024,
                  kernel_chunk=64, document_len=300, interpret=False, test_files=GPU_TEST_FILES, test_select=(),
                  test_backend="gpu", budgets_s=BUDGETS_S, total_s=TOTAL_S),
    # The same parts on one H200: the train step at the H200's plan (`GPU_SUITES["check_h200"]`).
    "h200": Check(suite="check_h200", kernel_batch=2, kernel_heads=4, kernel_head_dims=(256, 256), kernel_length=1024,
                  kernel_chunk=64, document_len=300, interpret=False, test_files=GPU_TEST_FILES, test_select=(),
                  test_backend="gpu", budgets_s=BUDGETS_S, total_s=TOTAL_S),
    # Every part on a CPU in about a minute: the kernels interpreted, the tests a selection of the check's own; budgets
    # no part reaches on 2 cores.
    "smoke": Check(suite="check_tiny", kernel_batch=1, kernel_heads=2, kernel_head_dims=(16, 32), kernel_length=32,
                   kernel_chunk=16, document_len=20, interpret=True, test_files=("tests/test_gpu_check.py",),
                   test_select=("-k", "deadlines"), test_backend=None,
                   budgets_s=dict.fromkeys(PARTS, 180.0), total_s=STARTUP_S + 5 * 180.0),
}


def check_of(device_kind: str) -> Check:
  """The check for a GPU of `device_kind` (jax's, e.g. 'NVIDIA H200'): the H200's where it names one, else the
  H100's (whose train batch fits the smaller memory)."""
  return CHECKS["h200" if "H200" in device_kind.upper() else "h100"]


def check_request(parts: tuple[str, ...], budgets: dict[str, float], total: float, redo: tuple[str, ...]) -> None:
  """ValueError naming a bad part, budget or total and the fix, before any work."""
  unknown = [p for p in (*parts, *budgets, *redo) if p not in PARTS]
  if unknown or not parts:
    raise ValueError(f"parts {unknown or list(parts)}: choose one or more of {','.join(PARTS)}.")
  bad = {p: s for p, s in budgets.items() if not s > 0}
  if bad:
    raise ValueError(f"budgets {bad}: give each part a positive number of seconds, e.g. train=200.")
  spent = STARTUP_S + sum(budgets[p] for p in parts)
  if not total > 0 or spent > total:
    raise ValueError(f"total {total:g} s: the start-up ({STARTUP_S:g} s) and the parts' budgets take {spent:g} s; "
                     "lower the budgets or raise the total.")


def parse_budgets(items: list[str]) -> dict[str, float]:
  """`part=seconds` items as {part: seconds}; ValueError naming an item that is not one."""
  budgets = {}
  for item in items:
    name, _, seconds = item.partition("=")
    try:
      budgets[name] = float(seconds)
    except ValueError:
      raise ValueError(f"budget {item!r}: give part=seconds, e.g. train=200,op=120.") from None
  return budgets


def deadlines(parts: tuple[str, ...], budgets: dict[str, float], start: float, total: float) -> dict[str, Budget]:
  """Each part's Budget from the run's `start`: the start-up and the budgets of it and the parts before it; the last
  part's runs to `total`, so what earlier parts leave over goes to the parts after them."""
  found, until = {}, STARTUP_S
  for part in parts:
    until += budgets[part]
    seconds = total if part == parts[-1] else until
    found[part] = Budget(seconds, start, label=f"the {part} part's deadline (s from the start)")
  return found


def done(out: Path, part: str) -> bool:
  """Whether `part` ran to its end before: OUT/check_<part>.json says complete and every file it lists is there."""
  try:
    record = json.loads((out / f"check_{part}.json").read_text())
  except (OSError, ValueError):
    return False
  return record.get("complete") is True and all((out / name).is_file() for name in record.get("files", []))


@contextlib.contextmanager
def captured_warnings() -> Iterator[list[str]]:
  """Collects, while passing them through, the Python warnings raised and the lines written to file descriptor 2
  (this process's stderr, its child processes' and XLA's logging) that look like warnings; the list fills on exit,
  each distinct line once with its count."""
  found: list[str] = []
  sys.stderr.flush()
  read_end, write_end = os.pipe()
  saved = os.dup(2)
  os.dup2(write_end, 2)
  os.close(write_end)
  chunks: list[bytes] = []

  def pump():
    while data := os.read(read_end, 1 << 16):
      os.write(saved, data)
      chunks.append(data)

  thread = threading.Thread(target=pump, daemon=True)
  thread.start()
  try:
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      yield found
  finally:
    sys.stderr.flush()
    os.dup2(saved, 2)  # the pipe's last writer closes: the pump reads to its end
    thread.join(timeout=10)
    os.close(saved)
    os.close(read_end)
    lines = [f"{w.category.__name__}: {w.message} ({Path(w.filename).name}:{w.lineno})" for w in caught]
    lines += [line.strip() for line in b"".join(chunks).decode(errors="replace").splitlines()
              if _WARNING_LINE.search(line.strip())]
    counts: dict[str, int] = {}
    for line in lines:
      counts[line] = counts.get(line, 0) + 1
    found += [line if n == 1 else f"{line} (x{n})" for line, n in counts.items()]
    for w in caught:
      print(f"{w.category.__name__}: {w.message}", file=sys.stderr)


def count_outcomes(lines: list[str]) -> dict[str, int]:
  """Test outcomes in pytest's verbose progress lines (`-v -rN`: one word per test, with or without workers)."""
  counts = dict.fromkeys(OUTCOMES, 0)
  for line in lines:
    if found := re.search(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", line):
      word = found.group(1).lower()
      counts[{"xfail": "xfailed", "xpass": "xpassed"}.get(word, word)] += 1
  return counts


def tests_command(check: Check) -> list[str]:
  """The pytest command of the tests part: verbose progress (counted as it comes), no summary repeats, 4 workers
  where pytest-xdist is installed."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  workers = ["-n", "4"] if check.test_backend and importlib.util.find_spec("xdist") else []
  return [sys.executable, "-m", "pytest", *check.test_files, "-m", "not slow", "-v", "-rN", "-p", "no:cacheprovider",
          *workers, *check.test_select]


def run_tests(command: list[str], env: dict[str, str], budget: Budget, cwd: Path) -> dict[str, Any]:
  """Runs `command` until it ends or `budget` is spent (its process group is then ended): the outcomes counted,
  whether it finished, its exit status and its output's last lines."""
  process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd,
                             start_new_session=True)
  lines: list[str] = []
  reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")), daemon=True)
  reader.start()
  try:
    process.wait(timeout=max(budget.left(), 1.0))
    finished = True
  except subprocess.TimeoutExpired:
    os.killpg(process.pid, signal.SIGTERM)
    try:
      process.wait(timeout=10)
    except subprocess.TimeoutExpired:
      os.killpg(process.pid, signal.SIGKILL)
      process.wait()
    finished = False
  reader.join(timeout=10)
  process.stdout.close()
  return {"command": " ".join(command[1:]), "finished": finished, "returncode": process.returncode,
          "counts": count_outcomes(lines), "output_tail": [line.rstrip() for line in lines[-30:]]}


def _kernel_check(check: Check) -> dict[str, Any]:
  """The kernels against the XLA form (`kernel_check.check`): both layouts with constant decays, alone and with
  documents; the split layout (the one that takes them) with per-token decays and documents."""
  d_k, d_v = check.kernel_head_dims
  batch, length, heads = check.kernel_batch, check.kernel_length, check.kernel_heads
  layouts = tuple(layout for layout in kernels.LAYOUTS if check.interpret or kernels.is_supported(
      d_k, d_v, jnp.bfloat16, check.kernel_chunk, layout=layout))
  q, k, v, d_out = op_inputs(batch, length, heads, d_k, d_v)
  state_key, key_sum_key = jax.random.split(jax.random.key(1))
  inputs = {"q": q, "k": k, "v": v, "d_out": d_out,
            "state": jax.random.normal(state_key, (batch, heads, d_k, d_v)),
            "key_sum": jax.random.normal(key_sum_key, (batch, heads, d_k))}
  ids = jnp.asarray(document_ids(batch, length, check.document_len))
  results: dict[str, Any] = {"batch": batch, "heads": heads, "d_k": d_k, "d_v": d_v, "length": length,
                             "chunk": check.kernel_chunk, "interpret": check.interpret, "tolerance": TOLERANCE,
                             "documents_per_row": [int(row.max()) + 1 for row in np.asarray(ids)], "cases": {}}
  for decay_kind, documents in (("constant", False), ("constant", True), ("per_token", True)):
    name = f"{decay_kind}{'/documents' if documents else ''}"
    print(f"kernel check {name}", flush=True)
    checked = layouts if decay_kind == "constant" else tuple(l for l in layouts if l == PER_TOKEN_LAYOUT)
    results["cases"][name] = kernel_check.check(log_decays(decay_kind, batch, length, heads), check.kernel_chunk,
                                                inputs, check.interpret, checked, ids if documents else None)
  results["ok"] = all(case["ok"] for case in results["cases"].values())
  return results


def kernels_markdown(results: dict[str, Any]) -> list[str]:
  """The kernel check's largest error per case and layout, and whether all are within the tolerance."""
  lines = [f"## Kernels against the XLA form in float32 (`highest`), d_k {results['d_k']} / d_v {results['d_v']}", "",
           f"Batch {results['batch']}, {results['heads']} heads, {results['length']} tokens, chunk {results['chunk']}"
           f"{', interpreted' if results['interpret'] else ''}; documents per row {results['documents_per_row']}. "
           f"Largest relative error over out, state, dq, dk, dv, d_state, qz, key_sum (tolerance "
           f"{results['tolerance']}); `xla_bfloat16` the XLA form's own from the same bfloat16 values.", ""]
  names = list(dict.fromkeys(n for errors in results["cases"].values() for n in errors if n != "ok"))
  lines += markdown.table(["case"] + names + ["ok"], [
      [case] + [f"{max(errors[n].values()):.1e}" if n in errors else "-" for n in names]
      + ["yes" if errors["ok"] else "NO"] for case, errors in results["cases"].items()])
  return lines


def tests_markdown(results: dict[str, Any]) -> list[str]:
  """The tests part's counts and whether the run finished within its budget."""
  counts = ", ".join(f"{n} {name}" for name, n in results["counts"].items() if n)
  state = "finished" if results["finished"] else "ended at its budget"
  return ["## GPU tests", "", f"`{results['command']}`: {counts or 'no test ran'} ({state}, exit status "
          f"{results['returncode']}).", ""] + ["    " + line for line in results["output_tail"][-10:]]


def _suite_part(suite: GpuSuite, sizes: str, part: str, out: Path, command: str, budget: Budget
                ) -> tuple[dict[str, Any], list[str], list[str]]:
  """A part of the GPU suite (`gpu.run`): (its results by file stem, its files, its Markdown)."""
  written = gpu.run(suite, sizes, (part,), out, command, budget)
  stems = [stem for stem in written if stem != "gpu_run"]
  text = [(out / f"{stem}.md").read_text() for stem in stems]
  return {stem: written[stem] for stem in stems}, [f"{s}.{e}" for s in stems for e in ("json", "md")], text


def _part(name: str, check: Check, out: Path, command: str, budget: Budget
          ) -> tuple[dict[str, Any], list[str], list[str]]:
  """Runs part `name`: (its results, the files it wrote beside its check file, its Markdown lines)."""
  if name in ("train", "op", "decode"):
    return _suite_part(GPU_SUITES[check.suite], check.suite, name, out, command, budget)
  if name == "kernels":
    results = _kernel_check(check)
    return results, [], kernels_markdown(results)
  env = {k: v for k, v in os.environ.items() if k != "RETNET_TEST_BACKEND"}
  if check.test_backend:
    env["RETNET_TEST_BACKEND"] = check.test_backend
  results = run_tests(tests_command(check), env, budget, Path(__file__).resolve().parents[1])
  return results, [], tests_markdown(results)


def run(check: Check, parts: tuple[str, ...], out: Path, command: str, budgets: dict[str, float] | None = None,
        total: float | None = None, redo: tuple[str, ...] = (), start: float | None = None) -> dict[str, Any]:
  """Runs `parts` (of PARTS, in PARTS' order) of `check` into `out`, each within its deadline (`deadlines`), skipping
  those done before (`done`) unless in `redo`; OUT/gpu_check.json and .md (the summary) rewritten after each.

  Args:
    check: the sizes (CHECKS).
    parts: the parts to run.
    out: the folder of every result file.
    command: the command line, recorded.
    budgets: seconds per part replacing the check's; total: the run's seconds (None: the check's).
    start: when the run started (time.time(), default now): the deadlines count from it.
    redo: parts to run again though done.

  Returns:
    The summary: per part its status (done, skipped: done earlier, skipped: time budget) and seconds.
  """
  budgets = {**check.budgets_s, **(budgets or {})}
  total = check.total_s if total is None else total
  parts = tuple(p for p in PARTS if p in parts)
  check_request(parts, budgets, total, redo)
  start = time.time() if start is None else start
  out.mkdir(parents=True, exist_ok=True)
  summary: dict[str, Any] = {"total_s": total, "budgets_s": {p: budgets[p] for p in parts}, "parts": {}}
  for part, budget in deadlines(parts, budgets, start, total).items():
    if done(out, part) and part not in redo:
      summary["parts"][part] = {"status": "skipped: done earlier (--redo to run it again)"}
    elif budget.spent():
      summary["parts"][part] = {"status": budget.reason}
    else:
      began = time.perf_counter()
      print(f"== {part} (until {budget.seconds:.0f} s from the start, {budget.left():.0f} s left)", flush=True)
      with captured_warnings() as found:
        results, files, text = _part(part, check, out, command, budget)
      seconds = time.perf_counter() - began
      stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
      record = {"part": part, "complete": True, "date": stamp, "command": command, "check": dataclasses.asdict(check),
                "device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "jax": jax.__version__,
                "seconds": seconds, "deadline_s": budget.seconds, "budget_s": budgets[part], "files": files,
                "warnings": found, "results": results}
      header = [f"# GPU check: {part} ({stamp})", "", f"`{command}` on {record['device']} ({record['backend']}, jax "
                f"{jax.__version__}): {seconds:.0f} s (budget {budgets[part]:g} s).", ""]
      notes = ["", f"Warnings ({len(found)}):", ""] + [f"- {line}" for line in found] if found else []
      whole_files.write_text(out / f"check_{part}.md", "\n".join(header + text + notes) + "\n")
      whole_files.write_text(out / f"check_{part}.json", json.dumps(record, indent=1, default=str))
      summary["parts"][part] = {"status": "done", "seconds": seconds, "warnings": len(found)}
    summary["elapsed_s"] = time.time() - start
    whole_files.write_text(out / "gpu_check.json", json.dumps(summary, indent=1))
    whole_files.write_text(out / "gpu_check.md", summary_markdown(summary))
  print(summary_markdown(summary), flush=True)
  return summary


def summary_markdown(summary: dict[str, Any]) -> str:
  """The run's parts: status, seconds against budget, warnings recorded."""
  rows = [[part, entry["status"], f"{entry['seconds']:.0f}" if "seconds" in entry else "-",
           f"{summary['budgets_s'][part]:g}", entry.get("warnings", "-")] for part, entry in summary["parts"].items()]
  return "\n".join([f"# GPU check ({summary['elapsed_s']:.0f} s of {summary['total_s']:g})", ""] + markdown.table(
      ["part", "status", "seconds", "budget s", "warnings"], rows)) + "\n"

