"""Timing harness: cases warmed up once (peak memory) then timed in interleaved rounds; compilation timed apart; a
run's time budget; a case run alone in a fresh process; out-of-memory errors read as results."""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import re
import resource
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from retnet_jax.core import host_memory

SETTLE_S = 0.1  # pause before every measured run (see `interleave`)


@dataclasses.dataclass
class Case:
  """One thing to time: `run()` does it once and returns the seconds of each unit (a step, a token).

  `measure_memory()`, for a case that runs in another process, runs it once and returns that process's peak.
  `devices`: how many of the first JAX devices it runs on (device memory statistics are summed over them).
  """
  run: Callable[[], list[float]]
  info: dict[str, Any] = dataclasses.field(default_factory=dict)
  measure_memory: Callable[[], dict[str, int]] | None = None
  devices: int = 1


def timed(fn: Callable[[], Any], repeats: int = 1) -> Callable[[], list[float]]:
  """A Case.run that calls `fn` (which must block until done) `repeats` times and times each call."""
  def run():
    seconds = []
    for _ in range(repeats):
      start = time.perf_counter()
      fn()
      seconds.append(time.perf_counter() - start)
    return seconds
  return run


def spread(values) -> dict[str, float]:
  """Median, min, max and count of `values`."""
  values = np.asarray(values, dtype=np.float64)
  return {"median": float(np.median(values)), "min": float(values.min()), "max": float(values.max()),
          "runs": int(values.size)}


def _proc_status_bytes(field: str) -> int:
  for line in Path("/proc/self/status").read_text().splitlines():
    if line.startswith(field + ":"):
      return int(line.split()[1]) * 1024
  raise KeyError(field)


def memory_source() -> str:
  """How peak memory is read: the device's own statistics, else the process RSS high-water mark."""
  stats = jax.devices()[0].memory_stats()
  if stats and "peak_bytes_in_use" in stats:
    return "device memory_stats peak_bytes_in_use, summed over the devices a case runs on (cumulative over the process)"
  try:
    Path("/proc/self/clear_refs").write_text("5")
    _proc_status_bytes("VmHWM")
    return "process RSS high-water mark (VmHWM, reset before each measured call via /proc/self/clear_refs)"
  except (OSError, KeyError):
    return "process RSS high-water mark (resource.getrusage ru_maxrss: cumulative, never reset)"


def peak_memory(fn: Callable[[], Any], source: str, devices: int = 1) -> dict[str, int]:
  """Runs `fn`; its peak memory and the peak above the memory in use when it started (bytes).

  Device statistics are summed over the first `devices` devices (those `fn` runs on): each device's own peak,
  which in an SPMD program all reach at the same step. The process RSS covers every device of a CPU backend.
  The heap's free pages are returned first: `host_memory.keep_freed_memory` keeps them, and they would count
  as memory in use before the call.
  """
  host_memory.release_freed_memory()
  if source.startswith("device"):
    in_use = lambda key: sum(device.memory_stats()[key] for device in jax.devices()[:devices])
    before = in_use("bytes_in_use")
    fn()
    peak = in_use("peak_bytes_in_use")
  elif "VmHWM" in source:
    Path("/proc/self/clear_refs").write_text("5")
    before = _proc_status_bytes("VmRSS")
    fn()
    peak = _proc_status_bytes("VmHWM")
  else:
    before = _proc_status_bytes("VmRSS")
    fn()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  return {"peak_bytes": peak, "above_start_bytes": peak - before}


@dataclasses.dataclass
class Budget:
  """A run's time budget from `start` (wall-clock seconds, comparable across processes); `seconds` None: unlimited.
  What has not started once it is spent is skipped with `reason`, which names the budget as `label` does."""
  seconds: float | None = None
  start: float = dataclasses.field(default_factory=time.time)
  label: str = "--time_budget_s"

  def left(self) -> float:
    return math.inf if self.seconds is None else self.seconds - (time.time() - self.start)

  def spent(self) -> bool:
    return self.left() <= 0

  @property
  def reason(self) -> str:
    return f"time budget: not started within {self.label}={self.seconds:g}"


def interleave(cases: dict[str, Case], rounds: int, source: str, budget: Budget | None = None) -> dict[str, Case]:
  """Warms up every case (recording its first run's time and peak memory), then times rounds of one run each.

  Every run starts after a pause of SETTLE_S, so that the previous run's worker threads (XLA's, torch's OpenMP
  threads) have gone idle: torch's OpenMP barriers slow down many-fold while another thread holds a core.
  With a `budget`, rounds stop (after the first) where another would end past it: the rounds timed are kept.
  Fills each case's info with `first_run_s`, `memory` and `seconds` (median/min/max over all timed units).
  """
  for name, case in cases.items():
    time.sleep(SETTLE_S)
    start = time.perf_counter()
    case.info["memory"] = case.measure_memory() if case.measure_memory else peak_memory(case.run, source,
                                                                                         case.devices)
    case.info["first_run_s"] = time.perf_counter() - start
    print(f"  warmed up {name} ({case.info['first_run_s']:.1f} s)", flush=True)
  seconds = {name: [] for name in cases}
  for _ in range(rounds):
    start = time.perf_counter()
    for name, case in cases.items():
      time.sleep(SETTLE_S)
      seconds[name].extend(case.run())
    if budget is not None and budget.left() < time.perf_counter() - start:
      break
  for name, case in cases.items():
    case.info["seconds"] = spread(seconds[name])
  return cases


def compile_timed(fn, *args, devices: int = 1):
  """Compiles jitted `fn` for `args` ahead of time: (executable, seconds, XLA's buffer bytes or None).

  The bytes are summed over the `devices` that run the (SPMD) program: XLA reports one device's.
  """
  start = time.perf_counter()
  compiled = fn.lower(*args).compile()
  seconds = time.perf_counter() - start
  stats = compiled.memory_analysis()
  buffers = None if stats is None else devices * int(stats.temp_size_in_bytes + stats.argument_size_in_bytes
                                                     + stats.output_size_in_bytes - stats.alias_size_in_bytes)
  return compiled, seconds, buffers


def random_tokens(batch: int, length: int, vocab: int, seed: int = 0) -> np.ndarray:
  """Uniform random int32 tokens [batch, length] below `vocab`."""
  return np.random.default_rng(seed).integers(0, vocab, (batch, length)).astype(np.int32)


def rate(units: float, seconds: dict[str, float]) -> dict[str, float]:
  """`units` per second from a time spread (the fastest run gives the max)."""
  return {"median": units / seconds["median"], "min": units / seconds["max"], "max": units / seconds["min"],
          "runs": seconds["runs"]}


def out_of_memory(error: Exception) -> str | None:
  """`out of memory: <the allocation that failed>` for the runtime's RESOURCE_EXHAUSTED / out-of-memory error of a
  compile or a run (the allocation from its message: `... allocate 49283072000 bytes` reads 45.9 GiB), else None."""
  message = str(error)
  if "RESOURCE_EXHAUSTED" not in message and "out of memory" not in message.lower():
    return None
  if found := re.search(r"(\d+)\s*(?:B|bytes)\b", message):
    return f"out of memory: {int(found.group(1)) / 2**30:.1f} GiB"
  if found := re.search(r"\d+(?:\.\d+)?\s*[KMGT]i?B", message):
    return f"out of memory: {found.group(0)}"
  return f"out of memory: {message.strip().splitlines()[0][:300]}"


def _isolated_worker(conn, fn: Callable, args: tuple) -> None:
  """The process of `isolated`: replies (True, fn(*args)) or (False, the traceback)."""
  try:
    conn.send((True, fn(*args)))
  except Exception:  # pylint: disable=broad-except  (re-raised by the caller with this traceback)
    conn.send((False, traceback.format_exc()))


def isolated(fn: Callable, *args, timeout: float | None = None):
  """`fn(*args)` in a fresh (spawned) process, so that nothing else the benchmark built shares its memory and the
  device's peak is its own: its value, or RuntimeError with its traceback where it raised or its process died;
  TimeoutError (the process ended) where it has not replied within `timeout` seconds. `fn` and `args` are pickled."""
  context = multiprocessing.get_context("spawn")
  receive, send = context.Pipe(duplex=False)
  process = context.Process(target=_isolated_worker, args=(send, fn, args), daemon=True)
  process.start()
  send.close()  # the child holds the only writer: its death reads as EOF
  try:
    if not receive.poll(timeout):
      raise TimeoutError(f"{fn.__name__} ran past {timeout:.0f} s")
    ok, value = receive.recv()
  except EOFError:
    process.join()
    raise RuntimeError(f"{fn.__name__}'s process ended (exit code {process.exitcode}) without a reply") from None
  finally:
    if process.is_alive():
      process.terminate()
    process.join()
    receive.close()
  if not ok:
    raise RuntimeError(f"{fn.__name__} failed in its process:\n{value}")
  return value
