"""Compiles the Pallas retention kernels on a GPU, checks them against the XLA chunkwise form, and times both.

    python scripts/kernel_check.py --out=runs/kernel_check.json
    python scripts/kernel_check.py --head_dims=256x512 --lengths=16384 --forward_tilings=64:8:2,32:8:3  # tuning
    python scripts/kernel_check.py --interpret  # a tiny CPU smoke run in Pallas interpret mode

For each per-head size d_k x d_v and length T (batch 4, 8 heads, bfloat16, chunk 64 by default): up to
`--check_max_len`, the kernels' out, final state, normaliser by-products and gradients (q, k, v, state) against the
XLA form in float32 at `precision=highest` from the same bfloat16 values, beside the XLA form's own bfloat16 error;
then forward and forward+backward times of the kernels (each tiling given) and of the XLA form in bfloat16,
interleaved. FLOPs per head: forward 2 T (C (d_k + d_v) + 2 d_k d_v) for chunk C, forward+backward 3 times that.
Times are named `pallas_<tiling>/forward` (that forward tiling) and `pallas_<tiling>/forward_backward` (that backward
tiling, after the first forward one). The JSON (device, versions, one entry per case) is rewritten after every case,
so a run cut short keeps its results.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from retnet_jax import cli, decay, kernels, retention
from retnet_jax.bench import harness

_OUT = flags.DEFINE_string("out", "runs/kernel_check.json", "JSON results file.")
_BATCH = flags.DEFINE_integer("batch", 4, "Batch size.", lower_bound=1)
_HEADS = flags.DEFINE_integer("heads", 8, "Heads.", lower_bound=1)
_CHUNK = flags.DEFINE_integer("chunk", 64, "Chunk size.", lower_bound=1)
_HEAD_DIMS = flags.DEFINE_list("head_dims", ["256x256", "128x128", "256x512"], "Per-head sizes d_k x d_v.")
_LENGTHS = flags.DEFINE_list("lengths", ["2048", "4096", "8192", "16384", "32768"], "Sequence lengths T.")
_CHECK_MAX_LEN = flags.DEFINE_integer("check_max_len", 8192, "Check numerics at lengths up to this one.")
_FORWARD_TILINGS = flags.DEFINE_list("forward_tilings", [], "Forward kernel tilings block_v:num_warps:num_stages "
                                      "to time, e.g. 64:8:2,32:8:3 (default: kernels.default_config's).")
_BACKWARD_TILINGS = flags.DEFINE_list("backward_tilings", [], "Backward kernel tilings to time forward+backward "
                                       "with, beside the first forward tiling (default: kernels.default_config's).")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Interleaved timing rounds.", lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per case and round.", lower_bound=1)
_INTERPRET = flags.DEFINE_boolean("interpret", False, "Pallas interpret mode at a tiny size (no GPU needed): "
                                  "batch 1, 2 heads, 16x32, T 64 and 100, chunk 16 (its times are the interpreter's).")
TOLERANCE = 2e-2  # relative to the largest magnitude, as the bfloat16 tests


def _rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _inputs(batch, length, heads, d_k, d_v, seed=0):
  """bfloat16 q, k (keys scaled by d_k^-1/2 as in the model), v, the out cotangent; float32 state and key sum."""
  keys = jax.random.split(jax.random.key(seed), 6)
  q, k = (jax.random.normal(key, (batch, length, heads, d_k)) for key in keys[:2])
  v, d_out = (jax.random.normal(key, (batch, length, heads, d_v)) for key in keys[2:4])
  state = jax.random.normal(keys[4], (batch, heads, d_k, d_v))
  key_sum = jax.random.normal(keys[5], (batch, heads, d_k))
  bf16 = lambda x: x.astype(jnp.bfloat16)
  return bf16(q), bf16(k * d_k**-0.5), bf16(v), bf16(d_out), state, key_sum


def _vjp(form):
  """jit of (q, k, v, state, d_out) -> (out, final state, dq, dk, dv, d_state) for `form(q, k, v, state)`."""
  def run(q, k, v, state, d_out):
    (out, final), pullback = jax.vjp(form, q, k, v, state)
    return (out, final, *pullback((d_out.astype(out.dtype), jnp.zeros_like(final))))
  return jax.jit(run)


def _check(log_decay, chunk, args, interpret) -> dict:
  """Relative errors of the kernels and of the XLA form in bfloat16 against the XLA form in float32."""
  q, k, v, d_out, state, key_sum = args
  names = ("out", "state", "dq", "dk", "dv", "d_state")
  kernel = _vjp(lambda q, k, v, s: kernels.chunkwise_retention(q, k, v, log_decay, chunk, s, interpret=interpret))
  xla = _vjp(lambda q, k, v, s: retention.chunkwise_retention(q, k, v, log_decay, chunk, s))
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  with jax.default_matmul_precision("highest"):
    expected = jax.block_until_ready(xla(*f32, state, d_out))
    ones = jnp.ones(q.shape[:3] + (1,), jnp.float32)
    expected_qz, expected_key_sum = retention.chunkwise_retention(*f32[:2], ones, log_decay, chunk, key_sum[..., None])
  errors = {"kernel": dict(zip(names, map(_rel_err, kernel(q, k, v, state, d_out), expected))),
            "xla_bfloat16": dict(zip(names, map(_rel_err, xla(q, k, v, state, d_out), expected)))}
  _, _, qz, key_sum_out = jax.jit(lambda *a: kernels.chunkwise_retention_with_key_sum(
      *a[:3], log_decay, chunk, a[3], a[4], interpret=interpret))(q, k, v, state, key_sum)
  errors["kernel"].update(qz=_rel_err(qz, expected_qz[..., 0]), key_sum=_rel_err(key_sum_out, expected_key_sum[..., 0]))
  errors["ok"] = max(errors["kernel"].values()) <= TOLERANCE
  return errors


def _configs(default: kernels.KernelConfig) -> list[kernels.KernelConfig]:
  """The configs to time: each forward tiling with the first backward one, and the reverse."""
  forwards = [kernels.Tiling.parse(t) for t in _FORWARD_TILINGS.value] or [default.forward]
  backwards = [kernels.Tiling.parse(t) for t in _BACKWARD_TILINGS.value] or [default.backward]
  return ([kernels.KernelConfig(f, backwards[0]) for f in forwards]
          + [kernels.KernelConfig(forwards[0], b) for b in backwards[1:]])


def _time(log_decay, chunk, args, configs) -> dict:
  """Forward and forward+backward seconds and rates of the kernels (per config) and of the XLA form."""
  q, k, v, d_out, _, _ = args
  tiling_name = lambda t: f"{t.block_v}:{t.num_warps}:{t.num_stages}"
  runs = [("xla/forward", None), ("xla/forward_backward", None)]
  first = configs[0]
  runs += [(f"pallas_{tiling_name(c.forward)}/forward", c) for c in configs if c.backward == first.backward]
  runs += [(f"pallas_{tiling_name(c.backward)}/forward_backward", c) for c in configs if c.forward == first.forward]
  cases, results = {}, {}
  for name, config in runs:
    form = (functools.partial(retention.chunkwise_retention, log_decay=log_decay, chunk_size=chunk) if config is None
            else functools.partial(kernels.chunkwise_retention, log_decay=log_decay, chunk_size=chunk, config=config))
    if name.endswith("/forward"):
      fn, fn_args = jax.jit(lambda q, k, v, form=form: form(q, k, v)[0]), (q, k, v)
    else:
      fn = jax.jit(lambda q, k, v, d_out, form=form: jax.vjp(lambda *x: form(*x)[0], q, k, v)[1](d_out))
      fn_args = (q, k, v, d_out)
    try:
      compiled, compile_s, _ = harness.compile_timed(fn, *fn_args)
    except Exception as e:  # pylint: disable=broad-except  (a tiling that does not compile or fit is a result)
      results[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
      continue
    run = lambda compiled=compiled, fn_args=fn_args: jax.block_until_ready(compiled(*fn_args))
    cases[name] = harness.Case(harness.timed(run, _REPEATS.value), {"compile_s": compile_s})
  harness.interleave(cases, _ROUNDS.value, harness.memory_source())
  batch, length, heads, d_k = q.shape
  flops = batch * heads * 2 * length * (chunk * (d_k + v.shape[-1]) + 2 * d_k * v.shape[-1])
  for name, case in cases.items():
    seconds = case.info["seconds"]
    work = flops * (3 if name.endswith("forward_backward") else 1)
    results[name] = {**case.info, "tokens_per_s": harness.rate(batch * length, seconds)["median"],
                     "tflops": work / seconds["median"] / 1e12}
  return results


def main():
  interpret = _INTERPRET.value
  if not interpret and jax.default_backend() != "gpu":
    raise ValueError(f"no GPU: JAX's default backend is {jax.default_backend()!r}. Run this on a GPU machine, or "
                     "with --interpret for a tiny smoke run of the kernels in Pallas interpret mode.")
  batch, heads, chunk = (1, 2, 16) if interpret else (_BATCH.value, _HEADS.value, _CHUNK.value)
  head_dims = [(16, 32)] if interpret else [tuple(int(x) for x in dims.split("x")) for dims in _HEAD_DIMS.value]
  lengths = [64, 100] if interpret else [int(x) for x in _LENGTHS.value]
  log_decay = decay.log_decay("retnet", heads)
  report = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(), "jax": jax.__version__,
            "python": sys.version.split()[0], "batch": batch, "heads": heads, "chunk": chunk, "dtype": "bfloat16",
            "interpret": interpret, "tolerance": TOLERANCE, "cases": []}
  out = Path(_OUT.value)
  out.parent.mkdir(parents=True, exist_ok=True)
  for d_k, d_v in head_dims:
    configs = _configs(kernels.default_config(d_k, d_v))
    for length in lengths:
      if not interpret:
        kernels.check_supported(d_k, d_v, jnp.bfloat16, chunk)
      args = _inputs(batch, length, heads, d_k, d_v)
      case = {"d_k": d_k, "d_v": d_v, "length": length}
      if interpret or length <= _CHECK_MAX_LEN.value:
        case["errors"] = _check(log_decay, chunk, args, interpret)
      case["times"] = _time(log_decay, chunk, args, configs)
      report["cases"].append(case)
      out.write_text(json.dumps(report, indent=1))
      print(json.dumps(case), flush=True)
  failed = [c for c in report["cases"] if not c.get("errors", {"ok": True})["ok"]]
  print(f"{len(report['cases'])} cases, {len(failed)} beyond tolerance {TOLERANCE}; results in {out}")
  if failed:
    sys.exit(1)


if __name__ == "__main__":
  cli.run(main)
