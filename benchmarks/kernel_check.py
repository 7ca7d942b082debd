"""The Pallas retention kernels (both layouts, `kernels.LAYOUTS`) checked against the XLA chunkwise form in float32
and timed beside its bfloat16 form.

Per head dims d_k x d_v and length T: up to `check_max_len`, each layout's out, final state, normaliser by-products
and gradients (q, k, v, state) against the XLA form in float32 at `precision=highest` from the same bfloat16 values
(`op.op_inputs`), beside the XLA form's own bfloat16 error (`op.relative_error`); then forward and forward+backward
times of both layouts (each tiling given) and of the XLA form in bfloat16, all interleaved (`op.op_case`), with
TFLOP/s from `op.retention_op_flops`; and each layout's launch grids (`kernels.launch_grids`: programs per launch,
chunks walked serially per program). The JSON report is rewritten after every case, so a run cut short keeps its
results.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks.harness import interleave, memory_source, rate
from benchmarks.op import (KINDS, TOLERANCE, error_text, kind_flops, op_case, op_inputs, relative_error,
                           retention_op_flops)
from retnet_jax.core import whole_files
from retnet_jax.mixers import decay, kernels, retention


@dataclasses.dataclass(frozen=True)
class Settings:
  """What one run checks and times, and how often."""
  batch: int
  heads: int
  chunk: int  # 0: `kernels.default_chunk` per head dims
  head_dims: tuple[tuple[int, int], ...]  # (d_k, d_v) per head
  lengths: tuple[int, ...]
  check_max_len: int  # numerics are checked at lengths up to this one
  rounds: int  # interleaved timing rounds
  repeats: int  # timed calls per case and round


def _vjp(form):
  """jit of (q, k, v, state, d_out) -> (out, final state, dq, dk, dv, d_state) for `form(q, k, v, state)`."""
  def run(q, k, v, state, d_out):
    (out, final), pullback = jax.vjp(form, q, k, v, state)
    return (out, final, *pullback((d_out.astype(out.dtype), jnp.zeros_like(final))))
  return jax.jit(run)


def check(log_decay, chunk: int, inputs: dict[str, jax.Array], interpret: bool,
          layouts: tuple[str, ...] = kernels.LAYOUTS, segment_ids: jax.Array | None = None) -> dict[str, Any]:
  """Relative errors of the kernels and of the XLA form in bfloat16 against the XLA form in float32.

  Args:
    log_decay: per-head log decays [H], or per token [B, T, H] (not differentiated).
    chunk: the chunk of both forms.
    inputs: bfloat16 q, k, v, d_out (`op.op_inputs`) and float32 `state` [B, H, d_k, d_v], `key_sum` [B, H, d_k].
    interpret: run the kernels in Pallas interpret mode.
    layouts: the kernel layouts to check.
    segment_ids: packed documents [B, T] (retention restarts at each), or None for one document per row.

  Returns:
    {layout: {output: error} for each of `layouts`, "xla_bfloat16": {output: error}, "ok": every kernel error within
    `op.TOLERANCE`}.
  """
  q, k, v, d_out, state, key_sum = (inputs[n] for n in ("q", "k", "v", "d_out", "state", "key_sum"))
  names = ("out", "state", "dq", "dk", "dv", "d_state")
  xla = _vjp(lambda q, k, v, s: retention.chunkwise_retention(q, k, v, log_decay, chunk, s, segment_ids))
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  with jax.default_matmul_precision("highest"):
    expected = jax.block_until_ready(xla(*f32, state, d_out))
    ones = jnp.ones(q.shape[:3] + (1,), jnp.float32)
    expected_qz, expected_key_sum = retention.chunkwise_retention(*f32[:2], ones, log_decay, chunk, key_sum[..., None],
                                                                  segment_ids)
  errors = {"xla_bfloat16": dict(zip(names, map(relative_error, xla(q, k, v, state, d_out), expected)))}
  for layout in layouts:
    config = kernels.default_config(q.shape[-1], v.shape[-1], layout)
    kernel = _vjp(lambda q, k, v, s, config=config: kernels.chunkwise_retention(
        q, k, v, log_decay, chunk, s, segment_ids=segment_ids, config=config, interpret=interpret))
    errors[layout] = dict(zip(names, map(relative_error, kernel(q, k, v, state, d_out), expected)))
    _, _, qz, key_sum_out = jax.jit(lambda *a, config=config: kernels.chunkwise_retention_with_key_sum(
        *a[:3], log_decay, chunk, a[3], a[4], segment_ids=segment_ids, config=config, interpret=interpret))(
            q, k, v, state, key_sum)
    errors[layout].update(qz=relative_error(qz, expected_qz[..., 0]),
                          key_sum=relative_error(key_sum_out, expected_key_sum[..., 0]))
  errors["ok"] = max(max(errors[layout].values()) for layout in layouts) <= TOLERANCE
  return errors


def tiling_configs(default: kernels.KernelConfig, forward: list[str], backward: list[str]
                   ) -> list[kernels.KernelConfig]:
  """The configs to time in `default`'s layout: each forward tiling (`block_v:num_warps:num_stages`; none: the
  default's) with the first backward one, and each further backward tiling with the first forward one."""
  forwards = [kernels.Tiling.parse(t) for t in forward] or [default.forward]
  backwards = [kernels.Tiling.parse(t) for t in backward] or [default.backward]
  return ([dataclasses.replace(default, forward=f, backward=backwards[0]) for f in forwards]
          + [dataclasses.replace(default, forward=forwards[0], backward=b) for b in backwards[1:]])


def time_forms(log_decay, chunk: int, inputs: dict[str, jax.Array], configs: list[kernels.KernelConfig],
               rounds: int, repeats: int, interpret: bool) -> dict[str, Any]:
  """Forward and forward+backward seconds and rates of the kernels (per config) and of the XLA form, interleaved.

  Args:
    log_decay: per-head log decays [H].
    chunk: the chunk of both forms.
    inputs: bfloat16 q, k, v and d_out (`op.op_inputs`).
    configs: the kernel configs (`tiling_configs` per layout; each layout's first is the reference for its others).
    rounds, repeats: interleaved rounds, and timed calls per case and round.
    interpret: run the kernels in Pallas interpret mode.

  Returns:
    Per case, `{compile_s, compiled_bytes, memory, first_run_s, seconds, tokens_per_s, tflops}`, or `{"error": ...}`
    for one that does not compile. Cases are named `xla/<kind>`, `pallas_<layout>_<tiling>/forward` (that forward
    tiling) and `pallas_<layout>_<tiling>/forward_backward` (that backward tiling, after the layout's first forward
    one).
  """
  q, k, v, d_out = (inputs[n] for n in ("q", "k", "v", "d_out"))
  name = lambda c, t: f"pallas_{c.layout}_{t.block_v}:{t.num_warps}:{t.num_stages}"
  firsts = {c.layout: c for c in reversed(configs)}
  runs = [(f"xla/{kind}", None) for kind in KINDS]
  runs += [(f"{name(c, c.forward)}/forward", c) for c in configs if c.backward == firsts[c.layout].backward]
  runs += [(f"{name(c, c.backward)}/forward_backward", c) for c in configs
           if c.forward == firsts[c.layout].forward]
  cases, results = {}, {}
  for name, config in runs:
    form = (functools.partial(retention.chunkwise_retention, log_decay=log_decay, chunk_size=chunk) if config is None
            else functools.partial(kernels.chunkwise_retention, log_decay=log_decay, chunk_size=chunk, config=config,
                                   interpret=interpret))
    try:
      cases[name] = op_case(lambda q, k, v, form=form: form(q, k, v)[0], q, k, v, d_out, name.split("/")[1], repeats)
    except Exception as e:  # pylint: disable=broad-except  (a tiling that does not compile or fit is a result)
      results[name] = {"error": error_text(e)}
  interleave(cases, rounds, memory_source())
  batch, length, heads, d_k = q.shape
  forward = retention_op_flops(batch, heads, length, d_k, v.shape[-1], chunk)
  for name, case in cases.items():
    seconds = case.info["seconds"]
    results[name] = {**case.info, "tokens_per_s": rate(batch * length, seconds)["median"],
                     "tflops": kind_flops(forward, name.split("/")[1]) / seconds["median"] / 1e12}
  return results


def run(settings: Settings, forward_tilings: list[str], backward_tilings: list[str], interpret: bool, out: Path,
        command_line: Sequence[str] = ()) -> dict[str, Any]:
  """Checks and times every (head dims, length) of `settings`, rewriting the JSON report at `out` (whole) after each.

  Args:
    settings: batch, heads, chunk, head dims, lengths, the longest length checked, rounds and repeats.
    forward_tilings, backward_tilings: tilings to time (`tiling_configs`).
    interpret: run the kernels in Pallas interpret mode (any backend); else they must support every head dims.
    command_line: the flags given (`cli.given_flags`), recorded as the report's "settings": a later run may
      replace a results file that records them (`workdir.check_results_path`).

  Returns:
    The report: device, versions, sizes and one entry per case ({d_k, d_v, length, chunk, errors?, times,
    launch_grids}), for each kernel layout that supports the chunk (both when interpreted).
  """
  log_decay = decay.log_decay("retnet", settings.heads)
  report = {"settings": list(command_line), "device": str(jax.devices()[0].device_kind),
            "backend": jax.default_backend(), "jax": jax.__version__,
            "python": sys.version.split()[0], "batch": settings.batch, "heads": settings.heads, "chunk": settings.chunk,
            "dtype": "bfloat16", "interpret": interpret, "tolerance": TOLERANCE, "cases": []}
  out.parent.mkdir(parents=True, exist_ok=True)
  state_key, key_sum_key = jax.random.split(jax.random.key(1))  # op_inputs draws from key 0
  for d_k, d_v in settings.head_dims:
    chunk = settings.chunk or kernels.default_chunk(d_k, d_v)
    if not interpret:
      kernels.check_supported(d_k, d_v, jnp.bfloat16, chunk)
    layouts = tuple(layout for layout in kernels.LAYOUTS
                    if interpret or kernels.is_supported(d_k, d_v, jnp.bfloat16, chunk, layout=layout))
    configs = [config for layout in layouts
               for config in tiling_configs(kernels.default_config(d_k, d_v, layout), forward_tilings,
                                            backward_tilings)]
    for length in settings.lengths:
      q, k, v, d_out = op_inputs(settings.batch, length, settings.heads, d_k, d_v)
      inputs = {"q": q, "k": k, "v": v, "d_out": d_out,
                "state": jax.random.normal(state_key, (settings.batch, settings.heads, d_k, d_v)),
                "key_sum": jax.random.normal(key_sum_key, (settings.batch, settings.heads, d_k))}
      case: dict[str, Any] = {"d_k": d_k, "d_v": d_v, "length": length, "chunk": chunk, "launch_grids": {
          layout: kernels.launch_grids(settings.batch, length, settings.heads, d_k, d_v, chunk,
                                       kernels.default_config(d_k, d_v, layout)) for layout in layouts}}
      if length <= settings.check_max_len:
        case["errors"] = check(log_decay, chunk, inputs, interpret, layouts)
      case["times"] = time_forms(log_decay, chunk, inputs, configs, settings.rounds, settings.repeats, interpret)
      report["cases"].append(case)
      whole_files.write_text(out, json.dumps(report, indent=1))
      print(json.dumps(case), flush=True)
  return report
