"""The GPU suite: the retention op against fla's Triton kernel and cuDNN attention, training steps with MFU, decoding
against the weight-read floor and a Transformer's KV cache, and the deep presets' compile times, on one device.

    python scripts/benchmark.py --suite=gpu --parts=op,train,decode,compile --out=runs/gpu

Parts (each writes OUT/gpu_<part>[_<group>].json and .md as it goes, so a run cut short keeps what it measured):
- `op`: the chunkwise retention op, forward and forward+backward, bfloat16, per head dims and length: ours XLA
  (`retention.chunkwise_retention`), ours Pallas (`kernels.chunkwise_retention`), fla's Triton `chunk_retention`
  (PyTorch) and `jax.nn.dot_product_attention(implementation="cudnn", is_causal=True)`; each checked against the
  XLA form in float32 before timing; tokens/s and TFLOP/s (`retention_op_flops`, `attention_op_flops`).
- `train`: the training loop's own step (`train_step.setup`) per retention implementation and the Transformer of
  equal size, bfloat16 compute, float32 parameters; tokens/s and MFU against a bfloat16 GEMM timed alongside.
- `decode`: greedy `sampling.decode` at batch 1 (ms/token against parameter bytes / a measured read bandwidth), and
  at a large batch after long contexts, against the Transformer's KV cache at the largest batch it fits.
- `compile`: compile time (ahead of time, not run) of the deep presets' train steps.
Whatever cannot run on the present backend (Pallas and cuDNN compile for GPUs only; fla needs CUDA) is recorded
under `skipped` with the reason. Every comparison is timed interleaved (`harness.interleave`).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from retnet_jax import decay, flops, kernels, layers, presets, retention, sampling, sharding, train_step, transformer
from retnet_jax.bench import cases
from retnet_jax.bench.harness import Case, compile_timed, interleave, memory_source, random_tokens, rate, timed
from retnet_jax.bench.report import fmt, fmt_range
from retnet_jax.bench.suites import GpuSuite
from retnet_jax.model import RetNet

PARTS = ("op", "train", "decode", "compile")
# The op's outputs from bfloat16 inputs against the XLA form in float32 (largest error / largest value).
OP_TOLERANCE = 2e-2
FLA_CHUNK = 64  # the chunk of fla's chunk_retention (its chunk_simple_gla)
VERSIONED = ("jax", "jaxlib", "flax", "torch", "triton", "flash-linear-attention", "fla-core")
FLOP_COUNTS = {
    "chunkwise": "forward 2 B H T (C (d_k + d_v) + 2 d_k d_v): each chunk's full C x C scores and their product with "
                 "V, the query read of the entry state and the state update, as computed (masked entries included), "
                 "with each implementation's chunk C (XLA: its chunk_sizes entry; Pallas and fla: 64)",
    "attention": "forward 2 B H T^2 d: causal attention's scores and their product with V over the T (T + 1) / 2 "
                 "visible pairs (counted as T^2 / 2), head dim d = d_k",
    "forward_backward": "3 x forward (the backward pass counted as twice the forward)",
    "train": "flops.train_flops_per_token (3 x (2 x matmul parameters + retention or attention products)), no "
             "recomputation counted; MFU divides it by the bfloat16 GEMM rate measured in the same run",
}


def retention_op_flops(batch: int, heads: int, length: int, d_k: int, d_v: int, chunk: int) -> int:
  """Forward FLOPs of chunkwise retention as computed: per head and token, the chunk's scores and their product with
  V, 2 C (d_k + d_v), plus the query read of the entry state and the state update, 4 d_k d_v."""
  return 2 * batch * heads * length * (chunk * (d_k + d_v) + 2 * d_k * d_v)


def attention_op_flops(batch: int, heads: int, length: int, head_dim: int) -> int:
  """Forward FLOPs of causal attention: scores and their product with V over half of the T x T pairs, 2 B H T^2 d."""
  return 2 * batch * heads * length**2 * head_dim


def fla_log_decay(num_heads: int) -> np.ndarray:
  """The per-head log decays fla 0.6.0's `chunk_retention` fixes, log(1 - 2^(-5-h)) (its `g_gamma`, natural log)."""
  return np.log1p(-(2.0 ** (-5.0 - np.arange(num_heads, dtype=np.float64)))).astype(np.float32)


def check_fla_mapping(log_decay_H) -> None:
  """Our inputs map to fla's `chunk_retention(q, k, v, scale=1.0)` unchanged (both [B, T, H, D]; we scale no
  query) only for log decays equal to its fixed schedule; ValueError otherwise."""
  log_decay_H = np.asarray(log_decay_H, np.float32)
  if not np.allclose(log_decay_H, fla_log_decay(log_decay_H.shape[0]), rtol=1e-6, atol=0):
    raise ValueError(f"fla's chunk_retention fixes log decays {fla_log_decay(log_decay_H.shape[0])}; got "
                     f"{log_decay_H}: use decay.log_decay('retnet', heads).")


def _versions() -> dict[str, str | None]:
  found = {}
  for name in VERSIONED:
    try:
      found[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      found[name] = None
  return found


def device_memory() -> int | None:
  """The first device's memory limit in bytes, or None where the backend reports none (CPU)."""
  stats = jax.devices()[0].memory_stats()
  return stats.get("bytes_limit") if stats else None


def _fla():
  """(fla's chunk_retention, None) where JAX runs on a GPU, torch has CUDA and fla imports, else (None, the reason)."""
  if jax.default_backend() != "gpu":
    return None, f"fla's Triton kernels run on a CUDA GPU beside JAX's; JAX's backend is {jax.default_backend()!r}"
  try:
    import torch
  except ImportError as e:
    return None, f"torch does not import: {e}"
  if not torch.cuda.is_available():
    return None, "fla's Triton kernels need a CUDA device and torch sees none"
  try:
    from fla.ops.retention import chunk_retention
  except ImportError as e:
    return None, f"fla does not import ({e}); install flash-linear-attention==0.6.0 and fla-core==0.6.0"
  return chunk_retention, None


def _error(e: Exception) -> str:
  return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"


# ------------------------------------------------------------------------------------------------------- the op


def _op_forms(log_decay, suite: GpuSuite) -> dict[str, Callable]:
  """The JAX implementations as `form(q, k, v) -> out` (attention's v has head dim d_k)."""
  xla_chunk, pallas_chunk = suite.chunk_sizes["xla"], suite.chunk_sizes["pallas"]
  return {
      "xla": lambda q, k, v: retention.chunkwise_retention(q, k, v, log_decay, xla_chunk)[0],
      "pallas": lambda q, k, v: kernels.chunkwise_retention(q, k, v, log_decay, pallas_chunk)[0],
      "cudnn_attention": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn",
                                                                      is_causal=True),
  }


def _op_skip_reason(name: str, d_k: int, d_v: int, suite: GpuSuite) -> str | None:
  if name == "pallas":
    try:
      kernels.check_supported(d_k, d_v, jnp.bfloat16, suite.chunk_sizes["pallas"])
    except ValueError as e:
      return str(e)
  if name == "cudnn_attention" and jax.default_backend() != "gpu":
    return f"cuDNN attention needs a CUDA GPU; the backend is {jax.default_backend()!r}"
  return None


def _rel_error(x, reference) -> float:
  x, reference = np.asarray(x, np.float32), np.asarray(reference, np.float32)
  return float(np.abs(x - reference).max() / max(np.abs(reference).max(), 1e-30))


def _op_inputs(suite: GpuSuite, length: int, d_k: int, d_v: int, seed: int = 0) -> dict[str, jax.Array]:
  """bfloat16 q, k [B, T, H, d_k] (scaled so q . k is O(1)), v [B, T, H, d_v], the attention value [.., d_k] and the
  output cotangents, made on the device."""
  shape = (suite.op_batch, length, suite.op_heads)
  keys = jax.random.split(jax.random.key(seed), 6)
  normal = lambda key, dim, scale=1.0: (jax.random.normal(key, shape + (dim,), jnp.float32) * scale).astype(
      jnp.bfloat16)
  return {"q": normal(keys[0], d_k, d_k**-0.25), "k": normal(keys[1], d_k, d_k**-0.25), "v": normal(keys[2], d_v),
          "v_attention": normal(keys[3], d_k), "d_out": normal(keys[4], d_v), "d_out_attention": normal(keys[5], d_k)}


def _check_op(forms, chunk_retention, log_decay, suite: GpuSuite, d_k: int, d_v: int, runnable: set[str]
              ) -> dict[str, Any]:
  """Each runnable implementation's output against the XLA form in float32 at `highest` precision from the same
  bfloat16 values, at `op_check_len` tokens: relative error and whether it is within OP_TOLERANCE."""
  x = _op_inputs(suite, suite.op_check_len, d_k, d_v, seed=1)
  q, k, v = (x[n].astype(jnp.float32) for n in ("q", "k", "v"))
  with jax.default_matmul_precision("highest"):
    reference = np.asarray(jax.jit(lambda q, k, v: retention.chunkwise_retention(
        q, k, v, log_decay, suite.chunk_sizes["xla"])[0])(q, k, v))
  runs = {name: lambda name=name: jax.jit(forms[name])(x["q"], x["k"], x["v"]) for name in ("xla", "pallas")
          if name in runnable}
  if chunk_retention is not None:
    import torch
    check_fla_mapping(log_decay)
    to_torch = lambda a: torch.from_numpy(np.asarray(a, np.float32)).to("cuda", torch.bfloat16)
    runs["fla"] = lambda: chunk_retention(to_torch(x["q"]), to_torch(x["k"]), to_torch(x["v"]), scale=1.0)[0].float(
        ).cpu().numpy()
  errors, failed = {}, {}
  for name, run in runs.items():
    try:
      errors[name] = _rel_error(run(), reference)
    except Exception as e:  # pylint: disable=broad-except  (an implementation that does not run here is a result)
      failed[name] = _error(e)
  return {"seq_len": suite.op_check_len, "tolerance": OP_TOLERANCE, "relative_error": errors, "failed": failed,
          "ok": {name: errors.get(name, np.inf) <= OP_TOLERANCE for name in runs}}


def _jax_op_case(form, x: dict[str, jax.Array], attention: bool, backward: bool, repeats: int) -> Case:
  v, d_out = (x["v_attention"], x["d_out_attention"]) if attention else (x["v"], x["d_out"])
  args = (x["q"], x["k"], v) + ((d_out,) if backward else ())
  fn = jax.jit((lambda q, k, v, d_out: jax.vjp(form, q, k, v)[1](d_out)) if backward else form)
  compiled, compile_s, buffers = compile_timed(fn, *args)
  return Case(timed(lambda: jax.block_until_ready(compiled(*args)), repeats),
              {"compile_s": compile_s, "compiled_bytes": buffers})


def _fla_op_case(chunk_retention, suite: GpuSuite, length: int, d_k: int, d_v: int, backward: bool) -> Case:
  """fla's chunk_retention on torch CUDA tensors of the same shapes (its own random values); memory from torch."""
  import torch
  generator = torch.Generator("cuda").manual_seed(0)
  shape = (suite.op_batch, length, suite.op_heads)
  make = lambda dim, scale=1.0: (torch.randn(shape + (dim,), generator=generator, device="cuda") * scale).to(
      torch.bfloat16).requires_grad_(backward)
  q, k, v = make(d_k, d_k**-0.25), make(d_k, d_k**-0.25), make(d_v)
  d_out = make(d_v).detach()

  def once():
    out, _ = chunk_retention(q, k, v, scale=1.0)
    if backward:
      torch.autograd.grad(out, (q, k, v), d_out)
    torch.cuda.synchronize()

  def measure_memory():
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    once()
    peak = torch.cuda.max_memory_allocated()
    return {"peak_bytes": peak, "above_start_bytes": peak - before}

  return Case(timed(once, suite.op_repeats), {}, measure_memory=measure_memory)


def measure_op(suite: GpuSuite, d_k: int, d_v: int, source: str, write: Callable[[dict], None]) -> dict[str, Any]:
  """The op at head dims (d_k, d_v) at every length, the implementations interleaved per length."""
  log_decay = decay.log_decay("retnet", suite.op_heads)
  forms = _op_forms(log_decay, suite)
  chunk_retention, fla_reason = _fla()
  skipped = {name: reason for name in forms if (reason := _op_skip_reason(name, d_k, d_v, suite))}
  if fla_reason:
    skipped["fla"] = fla_reason
  results: dict[str, Any] = {"d_k": d_k, "d_v": d_v, "batch": suite.op_batch, "heads": suite.op_heads,
                             "dtype": "bfloat16", "chunk_sizes": {**suite.chunk_sizes, "fla": FLA_CHUNK},
                             "attention_head_dim": d_k, "skipped": skipped, "points": []}
  results["agreement"] = _check_op(forms, chunk_retention, log_decay, suite, d_k, d_v, set(forms) - set(skipped))
  agreement = results["agreement"]
  for name, ok in agreement["ok"].items():
    if not ok:
      skipped[name] = (f"it failed the check: {agreement['failed'][name]}" if name in agreement["failed"] else
                       "its output disagrees with the XLA form in float32 beyond the tolerance (see agreement): not "
                       "timed")
  chunk_retention = None if "fla" in skipped else chunk_retention
  chunks = {"xla": suite.chunk_sizes["xla"], "pallas": suite.chunk_sizes["pallas"], "fla": FLA_CHUNK}
  for length in suite.op_lengths:
    x = _op_inputs(suite, length, d_k, d_v)
    op_cases, errors = {}, {}
    for backward in (False, True):
      kind = "forward_backward" if backward else "forward"
      for name, form in forms.items():
        if name not in skipped:
          try:
            op_cases[f"{name}/{kind}"] = _jax_op_case(form, x, name == "cudnn_attention", backward, suite.op_repeats)
          except Exception as e:  # pylint: disable=broad-except  (a case that does not compile is a result)
            errors[f"{name}/{kind}"] = _error(e)
      if chunk_retention is not None:
        op_cases[f"fla/{kind}"] = _fla_op_case(chunk_retention, suite, length, d_k, d_v, backward)
    print(f"op {d_k}x{d_v} at {length} tokens: {', '.join(op_cases)}", flush=True)
    interleave(op_cases, suite.rounds, source)
    point: dict[str, Any] = {"seq_len": length, "cases": {}, "errors": errors}
    tokens = suite.op_batch * length
    for name, case in op_cases.items():
      impl, kind = name.split("/")
      forward = (attention_op_flops(suite.op_batch, suite.op_heads, length, d_k) if impl == "cudnn_attention" else
                 retention_op_flops(suite.op_batch, suite.op_heads, length, d_k, d_v, chunks[impl]))
      work = forward * (3 if kind == "forward_backward" else 1)
      seconds = case.info["seconds"]
      point["cases"][name] = {**case.info, "flops": work, "tokens_per_s": rate(tokens, seconds),
                              "tflops_per_s": work / seconds["median"] / 1e12}
    for kind in ("forward", "forward_backward"):
      if f"pallas/{kind}" in point["cases"] and f"fla/{kind}" in point["cases"]:
        point[f"pallas_over_fla_{kind}"] = (point["cases"][f"pallas/{kind}"]["tokens_per_s"]["median"]
                                            / point["cases"][f"fla/{kind}"]["tokens_per_s"]["median"])
    results["points"].append(point)
    write(results)
    del x, op_cases
    if chunk_retention is not None:
      import torch
      torch.cuda.empty_cache()  # torch gives back what it cached, for JAX's next allocations
  return results


def op_markdown(results: dict[str, Any]) -> list[str]:
  names = sorted({name for p in results["points"] for name in p["cases"]})
  lines = [f"## Retention op, d_k {results['d_k']} / d_v {results['d_v']} (batch {results['batch']}, "
           f"{results['heads']} heads, bfloat16)", "",
           "Tokens/s (TFLOP/s) per implementation and length; FLOP counts in `flop_counts`.", "",
           "| tokens | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
  for p in results["points"]:
    cells = [f"{fmt(c['tokens_per_s']['median'])} ({c['tflops_per_s']:.3g})" if (c := p["cases"].get(n)) else "-"
             for n in names]
    lines.append(f"| {p['seq_len']:,} | " + " | ".join(cells) + " |")
  agreement = results["agreement"]
  lines += ["", f"Agreement with the XLA form in float32 at {agreement['seq_len']} tokens (relative error, tolerance "
            f"{agreement['tolerance']}): " + (", ".join(f"{k} {v:.1e}" for k, v in agreement["relative_error"].items())
                                            or "none run") + "."]
  for kind in ("forward", "forward_backward"):
    ratios = [f"{p['seq_len']:,} {p[key]:.2f}x" for p in results["points"] if (key := f"pallas_over_fla_{kind}") in p]
    if ratios:
      lines.append(f"Pallas / fla tokens/s, {kind.replace('_', '+')}: {', '.join(ratios)}.")
  lines += [f"Skipped: {name}: {reason.rstrip('.')}." for name, reason in results["skipped"].items()]
  lines += [f"Failed at {p['seq_len']}: {name}: {error}." for p in results["points"]
            for name, error in p["errors"].items()]
  return lines


def op_plot(results: dict[str, Any], path: Path) -> None:
  """Tokens/s against length, forward and forward+backward, one line per implementation."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
  for ax, kind in zip(axes, ("forward", "forward_backward")):
    for impl in sorted({n.split("/")[0] for p in results["points"] for n in p["cases"]}):
      points = [p for p in results["points"] if f"{impl}/{kind}" in p["cases"]]
      ax.plot([p["seq_len"] for p in points], [p["cases"][f"{impl}/{kind}"]["tokens_per_s"]["median"] for p in points],
              marker="o", label=impl)
    ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="tokens / s",
           title=f"{kind.replace('_', '+')}, d_k {results['d_k']} / d_v {results['d_v']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


# --------------------------------------------------------------------------------------------- models and training


def model_config(suite: GpuSuite, name: str, impl: str = "xla"):
  """The locked config of named size `name`: bfloat16 compute, `retention_impl=impl` at its chunk, and the suite's
  chunkwise training shape for that size."""
  preset, fields = suite.models[name]
  config = presets.get_config(preset)
  config.model.update(dict(fields))
  config.model.update(dict(dtype="bfloat16", retention_impl=impl, chunk_size=suite.chunk_sizes[impl]))
  config.train.update(dict(mode="chunkwise", seq_len=suite.train_seq_len, batch_size=suite.train_batch[name],
                           grad_accum_steps=1, remat=suite.train_remat[name]))
  return config


def _too_big(buffers: int | None, limit: int | None) -> str | None:
  if buffers is not None and limit is not None and buffers > limit:
    return (f"its XLA buffers ({fmt(buffers, 'B')}) exceed the device's memory ({fmt(limit, 'B')}): lower the "
            "batch (--batch_size) or recompute more (--remat)")
  return None


def _retnet_train_cases(suite: GpuSuite, name: str, mesh, limit: int | None, skipped: dict[str, str]
                        ) -> dict[str, Case]:
  """The RetNet train step per retention implementation, compiled ahead of time from the abstract state (nothing
  allocated for a step that does not fit); the steps share one train state, as they share its structure."""
  holder: dict[str, Any] = {}
  found = {}
  for impl in suite.train_impls:
    config = model_config(suite, name, impl)
    try:
      layers.check_retention_impl(config.model)
    except ValueError as e:
      skipped[f"retnet/{impl}"] = str(e)
      continue
    run = train_step.setup(config, mesh)
    with run.placement.active():
      tokens = random_tokens(config.train.batch_size, config.train.seq_len + 1, config.model.vocab_size)
      batch = jax.device_put(tokens, run.placement.batch_sharding)
      step, compile_s, buffers = compile_timed(run.train_step, run.abstract_state, batch)
      if reason := _too_big(buffers, limit):
        skipped[f"retnet/{impl}"] = reason
        continue
      if "state" not in holder:
        holder["state"] = run.init()

    def one_step(step=step, batch=batch):
      holder["state"], _ = step(holder["state"], batch)
      jax.block_until_ready(holder["state"])

    found[f"retnet/{impl}"] = Case(timed(one_step), {"compile_s": compile_s, "compiled_bytes": buffers,
                                                     "model_config": config.model})
  return found


def measure_train(suite: GpuSuite, name: str, source: str, limit: int | None) -> dict[str, Any]:
  """Train steps of named size `name` (RetNet per implementation, the Transformer of equal size) interleaved with
  the bfloat16 GEMM their MFU is divided by."""
  skipped: dict[str, str] = {}
  mesh = sharding.make_mesh(model_config(suite, name).mesh, jax.devices()[:1])
  train_cases = {"matmul/bfloat16": cases.matmul_case(jnp.bfloat16, suite.matmul_size)}
  train_cases.update(_retnet_train_cases(suite, name, mesh, limit, skipped))
  config = model_config(suite, name)
  config.train.mode = "parallel"  # the Transformer's one training form
  attention = cases.transformer_train_case(config, mesh)
  attention.info["model_config"] = presets.transformer_config(config.model, suite.train_seq_len)
  if reason := _too_big(attention.info["compiled_bytes"], limit):
    skipped["transformer"] = reason
  else:
    train_cases["transformer"] = attention
  del attention
  batch, seq_len = suite.train_batch[name], suite.train_seq_len
  print(f"train {name}: {', '.join(train_cases)}; batch {batch} x {seq_len} tokens", flush=True)
  interleave(train_cases, suite.rounds, source)
  gemm = rate(2 * suite.matmul_size**3, train_cases.pop("matmul/bfloat16").info["seconds"])
  results: dict[str, Any] = {
      "model": name, "preset": suite.models[name][0], "params": cases.param_count(config.model), "batch_size": batch,
      "seq_len": seq_len, "remat": suite.train_remat[name], "matmul_size": suite.matmul_size,
      "bfloat16_gemm_flops_per_s": gemm, "cases": {}, "skipped": skipped}
  for case_name, case in train_cases.items():
    model_cfg = case.info["model_config"]
    per_token = flops.train_flops_per_token(model_cfg, seq_len, "chunkwise")
    throughput = rate(batch * seq_len, case.info["seconds"])
    results["cases"][case_name] = {
        "tokens_per_s": throughput, "step_s": case.info["seconds"], "compile_s": case.info["compile_s"],
        "first_run_s": case.info["first_run_s"], "memory": case.info["memory"],
        "compiled_bytes": case.info["compiled_bytes"], "chunk_size": model_cfg.get("chunk_size"),
        "flops_per_token": per_token, "mfu": throughput["median"] * per_token / gemm["median"]}
  return results


def train_markdown(results: dict[str, Any]) -> list[str]:
  lines = [f"## Training step, {results['model']} ({results['params']:,} RetNet parameters)", "",
           f"Batch {results['batch_size']} x {results['seq_len']} tokens, bfloat16 compute, float32 parameters, "
           f"train.remat={results['remat']}; bfloat16 GEMM ({results['matmul_size']}^2) "
           f"{fmt_range(results['bfloat16_gemm_flops_per_s'], 'FLOP/s')}.", "",
           "| model | tokens/s | step s | compile s | peak memory | XLA buffers | MFU |",
           "|---|---|---|---|---|---|---|"]
  for name, r in results["cases"].items():
    lines.append(f"| {name} | {fmt_range(r['tokens_per_s'])} | {fmt_range(r['step_s'])} | {fmt(r['compile_s'])} | "
                 f"{fmt(r['memory']['peak_bytes'], 'B')} | {fmt(r['compiled_bytes'], 'B')} | {r['mfu']:.1%} |")
  return lines + [f"Skipped: {name}: {reason.rstrip('.')}." for name, reason in results["skipped"].items()]


# ------------------------------------------------------------------------------------------------------ decoding


def _context_decode_case(model, batch: int, context: int, new_tokens: int) -> Case:
  """Greedy `sampling.decode` of `new_tokens` from a state `context` tokens in: RetNet's retention state, or a KV
  cache of `context + new_tokens` slots with `context` filled. The state holds zeros (a prefill of this batch and
  length would not fit the device): a step's work does not depend on its values. Units as `cases.decode_case`."""
  if model.config.architecture == "transformer":
    state = model.init_state(batch, context + new_tokens)
    state["next_slot"] = jnp.int32(context)
  else:
    state = model.init_state(batch)
  state["position"] = jnp.full((batch,), context, jnp.int32)
  prefilled = sampling.Prefilled(state, jnp.zeros((batch,), jnp.int32))
  decode = lambda: sampling.decode(model, prefilled, max_new_tokens=new_tokens, key=jax.random.key(0),
                                   temperature=0.0)
  decode()  # compiles
  bytes_ = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  return Case(lambda: [s / new_tokens for s in timed(decode, repeats=2)()], {"state_bytes": bytes_, "batch": batch})


def _cache_bytes(model, batch: int, max_len: int) -> int:
  shapes = jax.eval_shape(lambda: model.init_state(batch, max_len))
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def measure_decode(suite: GpuSuite, source: str, limit: int | None) -> dict[str, Any]:
  """Batch 1 against the weight-read floor, then per context RetNet at `decode_batch` against the Transformer at the
  largest power-of-two batch up to it whose KV cache fits a third of the device's memory (decoding holds it twice:
  the state passed in and the loop's updated copy)."""
  config = model_config(suite, suite.decode_model)
  retnet = RetNet(config.model, rngs=nnx.Rngs(config.seed))
  # Its KV caches are made per context (`_context_decode_case`): max_len is unused.
  attention = transformer.Transformer(presets.transformer_config(config.model, 1), rngs=nnx.Rngs(config.seed))
  params = cases.param_count(config.model)
  param_bytes = 4 * params  # float32 parameters, as stored and read
  new = suite.decode_new_tokens
  batch_1 = {"memory_read": cases.read_case(params),
             "retnet": cases.decode_case(retnet, 1, suite.decode_prompt_len, new, "chunkwise")}
  print(f"decode {suite.decode_model} batch 1 after {suite.decode_prompt_len} tokens", flush=True)
  interleave(batch_1, suite.rounds, source)
  read = rate(param_bytes, batch_1["memory_read"].info["seconds"])
  ours = batch_1["retnet"].info
  floor_s = param_bytes / read["median"]
  results: dict[str, Any] = {
      "model": suite.decode_model, "params": params, "param_bytes": param_bytes, "new_tokens": new,
      "prompt_len": suite.decode_prompt_len, "read_bytes_per_s": read, "weight_read_floor_s": floor_s,
      "batch_1": {"s_per_token": ours["seconds"], "state_bytes": ours["state_bytes"], "memory": ours["memory"]},
      "batch_1_over_floor": floor_s / ours["seconds"]["median"], "contexts": []}
  del batch_1
  budget = None if limit is None else limit // 3
  for context in suite.decode_contexts:
    batch = suite.decode_batch
    while batch > 1 and budget is not None and _cache_bytes(attention, batch, context + new) > budget:
      batch //= 2
    point: dict[str, Any] = {"context": context, "transformer_cache_bytes_at_decode_batch": _cache_bytes(
        attention, suite.decode_batch, context + new)}
    group = {"retnet": _context_decode_case(retnet, suite.decode_batch, context, new)}
    if budget is not None and _cache_bytes(attention, batch, context + new) > budget:
      point["transformer_skipped"] = "a KV cache of even batch 1 exceeds a third of the device's memory"
    else:
      group["transformer"] = _context_decode_case(attention, batch, context, new)
    batches = ", ".join(f"{n} batch {c.info['batch']}" for n, c in group.items())
    print(f"decode after {context} tokens: {batches}", flush=True)
    interleave(group, suite.rounds, source)
    for name, case in group.items():
      point[name] = {"batch": case.info["batch"], "state_bytes": case.info["state_bytes"],
                     "tokens_per_s": rate(case.info["batch"], case.info["seconds"]), "memory": case.info["memory"]}
    if "transformer" in point:
      point["throughput_ratio"] = point["retnet"]["tokens_per_s"]["median"] / point["transformer"]["tokens_per_s"][
          "median"]
    results["contexts"].append(point)
    del group
  return results


def decode_markdown(results: dict[str, Any]) -> list[str]:
  lines = [f"## Decoding, {results['model']} ({results['params']:,} parameters, bfloat16 compute)", "",
           f"Batch 1 after a {results['prompt_len']}-token prompt: "
           f"{fmt_range(results['batch_1']['s_per_token'], scale=1e3)} ms/token. Weight-read "
           f"floor {fmt(results['param_bytes'], 'B')} (float32 parameters) / "
           f"{fmt(results['read_bytes_per_s']['median'], 'B/s')} = {results['weight_read_floor_s'] * 1e3:.3g} "
           "ms/token: "
           f"RetNet reaches {results['batch_1_over_floor']:.0%} of it.", "",
           "| context | RetNet batch | RetNet tokens/s | RetNet state | Transformer batch | Transformer tokens/s | "
           "KV cache | ratio |", "|---|---|---|---|---|---|---|---|"]
  for p in results["contexts"]:
    t = p.get("transformer")
    lines.append(f"| {p['context']:,} | {p['retnet']['batch']} | {fmt_range(p['retnet']['tokens_per_s'])} | "
                 f"{fmt(p['retnet']['state_bytes'], 'B')} | {t['batch'] if t else '-'} | "
                 f"{fmt_range(t['tokens_per_s']) if t else p['transformer_skipped']} | "
                 f"{fmt(t['state_bytes'], 'B') if t else '-'} | {fmt(p.get('throughput_ratio'))} |")
  return lines


# ------------------------------------------------------------------------------------------------------- compile


def measure_compile(suite: GpuSuite, limit: int | None) -> dict[str, Any]:
  """Seconds to compile (ahead of time, not run) each deep preset's RetNet train step per implementation."""
  results: dict[str, Any] = {"models": {}, "skipped": {}}
  for name in suite.compile_models:
    for impl in suite.train_impls:
      config = model_config(suite, name, impl)
      try:
        layers.check_retention_impl(config.model)
      except ValueError as e:
        results["skipped"][f"{name}/{impl}"] = str(e)
        continue
      print(f"compiling the {name} train step ({impl})", flush=True)
      jax.clear_caches()  # a step this process compiled before (the train part) would come from the cache
      compile_s, buffers = cases.compile_train_step(config, sharding.make_mesh(config.mesh, jax.devices()[:1]))
      results["models"][f"{name}/{impl}"] = {
          "params": cases.param_count(config.model), "num_layers": config.model.num_layers, "compile_s": compile_s,
          "compiled_bytes": buffers, "fits": _too_big(buffers, limit) is None,
          "batch_size": config.train.batch_size, "seq_len": config.train.seq_len, "remat": config.train.remat}
  return results


def compile_markdown(results: dict[str, Any]) -> list[str]:
  lines = ["## Train-step compile times (compiled, not run)", "",
           "| model/impl | parameters | layers | batch x tokens | remat | compile s | XLA buffers |",
           "|---|---|---|---|---|---|---|"]
  for name, r in results["models"].items():
    lines.append(f"| {name} | {r['params']:,} | {r['num_layers']} | {r['batch_size']} x {r['seq_len']} | {r['remat']} "
                 f"| {r['compile_s']:.1f} | {fmt(r['compiled_bytes'], 'B')} |")
  return lines + [f"Skipped: {name}: {reason.rstrip('.')}." for name, reason in results["skipped"].items()]


# ----------------------------------------------------------------------------------------------------------- run


def run(suite: GpuSuite, sizes: str, parts: tuple[str, ...], out: Path, command: str) -> dict[str, Any]:
  """Measures `parts` of `suite` and writes, per part and group, OUT/gpu_<part>[_<group>].json and .md (and the op's
  PNG), each rewritten as its results come; returns {file stem: results}."""
  unknown = [p for p in parts if p not in PARTS]
  if unknown or not parts:
    raise ValueError(f"parts {list(parts)}: choose one or more of {PARTS}.")
  out.mkdir(parents=True, exist_ok=True)
  source, limit = memory_source(), device_memory()
  meta = {"suite": "gpu", "sizes": sizes, "command": command, "device": jax.devices()[0].device_kind,
          "backend": jax.default_backend(), "device_memory_bytes": limit, "python": sys.version.split()[0],
          "versions": _versions(), "memory_source": source, "flop_counts": FLOP_COUNTS,
          "suite_settings": dataclasses.asdict(suite)}
  written: dict[str, Any] = {}

  def write(stem: str, part: str, results: dict[str, Any], markdown: Callable[[dict], list[str]]) -> None:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    document = {"meta": {**meta, "part": part, "date": stamp}, **results}
    (out / f"{stem}.json").write_text(json.dumps(document, indent=2))
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v)
    text = [f"# GPU suite: {part} ({stamp})", "", f"`{command}`", "", f"{meta['device']} ({meta['backend']}); "
            f"{versions}. Medians [min-max] over timed runs after a warm-up, interleaved.", ""] + markdown(results)
    (out / f"{stem}.md").write_text("\n".join(text) + "\n")
    written[stem] = document

  for part in parts:
    start = time.perf_counter()
    if part == "op":
      for d_k, d_v in suite.op_head_dims:
        stem = f"gpu_op_{d_k}x{d_v}"
        results = measure_op(suite, d_k, d_v, source, lambda r, stem=stem: write(stem, "op", r, op_markdown))
        op_plot(results, out / f"{stem}.png")
    elif part == "train":
      for name in suite.train_models:
        write(f"gpu_train_{name}", "train", measure_train(suite, name, source, limit), train_markdown)
    elif part == "decode":
      write("gpu_decode", "decode", measure_decode(suite, source, limit), decode_markdown)
    else:
      write("gpu_compile", "compile", measure_compile(suite, limit), compile_markdown)
    print(f"part {part}: {time.perf_counter() - start:.0f} s", flush=True)
  for stem in written:
    print((out / f"{stem}.md").read_text())
  return written
