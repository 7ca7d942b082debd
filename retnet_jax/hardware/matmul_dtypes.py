"""The matmul FLOPs of a traced program by operand dtypes: which share of a step's matmuls runs on float32 operands.

A float32 operand makes an accelerator run the whole matmul at float32 (or TF32) rate, about half the bfloat16 rate,
so a bfloat16 model should have (almost) none. Read from the jaxpr, so it needs no compile and no accelerator:

    by_dtype = matmul_flops_by_dtype(jax.make_jaxpr(train_step)(state, batch))
    float32_share(by_dtype)  # 0.004

Every `dot_general` counts 2 x its multiply-adds, keyed `"lhs dtype x rhs dtype"`; a scan's body counts `length`
times, a Pallas kernel's body once per program of its grid, a `cond` its costliest branch, a while loop's body once
(its trip count is not in the jaxpr).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core as jex_core

WIDE_DTYPES = ("float32", "float64")


def _dot_flops(eqn) -> float:
  """2 x the multiply-adds of one `dot_general`: every lhs element meets each of the rhs's free positions."""
  lhs, rhs = (v.aval for v in eqn.invars)
  (_, rhs_contract), (_, rhs_batch) = eqn.params["dimension_numbers"]
  rhs_free = math.prod(d for i, d in enumerate(rhs.shape) if i not in rhs_contract and i not in rhs_batch)
  return 2.0 * math.prod(lhs.shape) * rhs_free


def _sub_jaxprs(value) -> list:
  """The jaxprs held by one equation parameter (a jaxpr, a closed jaxpr, or a sequence of them)."""
  if isinstance(value, jex_core.ClosedJaxpr):
    return [value.jaxpr]
  if isinstance(value, jex_core.Jaxpr):
    return [value]
  if isinstance(value, (tuple, list)):
    return [j for item in value for j in _sub_jaxprs(item)]
  return []


def _repeats(eqn) -> int:
  """How many times an equation's body runs per call: a scan's length, a Pallas kernel's grid size, else 1."""
  if eqn.primitive.name == "scan":
    return int(eqn.params["length"])
  grid_mapping = eqn.params.get("grid_mapping")
  if grid_mapping is not None:
    return math.prod(int(g) for g in grid_mapping.grid)
  return 1


def _count(jaxpr, scale: float, found: dict[str, float]) -> None:
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      lhs, rhs = (v.aval for v in eqn.invars)
      key = f"{lhs.dtype} x {rhs.dtype}"
      found[key] = found.get(key, 0.0) + scale * _dot_flops(eqn)
      continue
    inner = [j for value in eqn.params.values() for j in _sub_jaxprs(value)]
    if not inner:
      continue
    repeats = scale * _repeats(eqn)
    if eqn.primitive.name == "cond":  # one branch runs: count the costliest
      branches = []
      for branch in inner:
        counted: dict[str, float] = {}
        _count(branch, repeats, counted)
        branches.append(counted)
      for key, value in max(branches, key=lambda b: sum(b.values())).items():
        found[key] = found.get(key, 0.0) + value
      continue
    for sub in inner:
      _count(sub, repeats, found)


def matmul_flops_by_dtype(closed_jaxpr: Any) -> dict[str, float]:
  """The FLOPs of every matmul in a (closed) jaxpr, summed by `"lhs dtype x rhs dtype"` (module docstring)."""
  found: dict[str, float] = {}
  _count(getattr(closed_jaxpr, "jaxpr", closed_jaxpr), 1.0, found)
  return dict(sorted(found.items(), key=lambda item: -item[1]))


def float32_share(by_dtype: dict[str, float]) -> float:
  """The share of matmul FLOPs with a float32 (or float64) operand; 0 for a program without matmuls."""
  total = sum(by_dtype.values())
  wide = sum(f for key, f in by_dtype.items() if any(d in WIDE_DTYPES for d in key.split(" x ")))
  return wide / total if total else 0.0


def report(fn: Callable, *args, **kwargs) -> dict[str, Any]:
  """`{"matmul_flops_by_dtype": ..., "float32_matmul_share": ...}` of `fn(*args, **kwargs)`, traced (args may be
  `jax.ShapeDtypeStruct`s)."""
  by_dtype = matmul_flops_by_dtype(jax.make_jaxpr(fn)(*args, **kwargs))
  return {"matmul_flops_by_dtype": by_dtype, "float32_matmul_share": float32_share(by_dtype)}
