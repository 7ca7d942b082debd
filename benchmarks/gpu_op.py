"""The GPU suite's op part: chunkwise retention forward and forward+backward, bfloat16, per head dims and length:
ours XLA (`retention.chunkwise_retention`), ours Pallas (`kernels.chunkwise_retention`, per layout of
`GpuSuite.op_layouts`), fla's Triton `chunk_retention` (PyTorch) and `jax.nn.dot_product_attention(
implementation="cudnn", is_causal=True)`; with per-token decays (`GpuSuite.op_decays`), ours again (`_per_token`)
against fla's `chunk_simple_gla`. Each is checked against the XLA form in float32 before timing; tokens/s and TFLOP/s
(`op.retention_op_flops`, `op.attention_op_flops`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import Budget, Case, interleave, rate, timed
from benchmarks.op import (KINDS, TOLERANCE, attention_op_flops, error_text, kind_flops, op_case, op_inputs,
                           relative_error, retention_op_flops)
from benchmarks.report import fmt
from benchmarks.suites import GpuSuite
from retnet_jax.core import markdown
from retnet_jax.mixers import decay, kernels, retention

FLA_CHUNK = 64  # the chunk of fla's chunk_retention (its chunk_simple_gla)
DECAYS = ("constant", "per_token")  # GpuSuite.op_decays: per-head log decays [H], or per token [B, T, H]
FLA_NAMES = {"constant": "fla", "per_token": "fla_simple_gla"}  # fla's implementation of each decay, by case name
PER_TOKEN_LAYOUT = "split"  # the kernel layout that takes per-token decays (`kernels.chunkwise_retention`)
GATE_NORMALIZER = 16.0  # per-token log decays: logsigmoid(gate) / this, as gated retention's (YOCO's) default


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


def log_decays(decay_kind: str, batch: int, length: int, heads: int) -> jax.Array:
  """The op's log decays: per head, `decay.log_decay('retnet', heads)` (fla's `chunk_retention` schedule); per token,
  float32 [batch, length, heads] logsigmoid(gate) / GATE_NORMALIZER of standard normal gates, as gated retention
  makes them (what fla's `chunk_simple_gla` takes as `g`)."""
  if decay_kind == "constant":
    return jnp.asarray(decay.log_decay("retnet", heads), jnp.float32)
  gates = jax.random.normal(jax.random.key(2), (batch, length, heads), jnp.float32)
  return jax.nn.log_sigmoid(gates) / GATE_NORMALIZER


def case_name(impl: str, decay_kind: str) -> str:
  """The name of implementation `impl` (xla, pallas, pallas_<layout>) for `decay_kind`: `_per_token` appended."""
  return impl if decay_kind == "constant" else f"{impl}_per_token"


def fla_functions() -> tuple[dict[str, Callable] | None, str | None]:
  """({decay: fla's function}, None) where JAX runs on a GPU, torch has CUDA and fla imports, else (None, the
  reason): `chunk_retention` for constant decays, `chunk_simple_gla` for per-token ones."""
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
    from fla.ops.simple_gla import chunk_simple_gla
  except ImportError as e:
    return None, f"fla does not import ({e}); install flash-linear-attention==0.6.0 and fla-core==0.6.0"
  return {"constant": lambda q, k, v, g: chunk_retention(q, k, v, scale=1.0)[0],
          "per_token": lambda q, k, v, g: chunk_simple_gla(q, k, v, g=g, scale=1.0)[0]}, None


def _op_forms(suite: GpuSuite, d_k: int, d_v: int) -> dict[str, tuple[Callable, str, str | None]]:
  """The JAX implementations as `name: (form(q, k, v, log_decay) -> out, decay kind, kernel layout or None)`
  (attention's v has head dim d_k and it takes no decay); Pallas per `suite.op_layouts` (`pallas` the split layout,
  `pallas_<layout>` the others; per-token decays on PER_TOKEN_LAYOUT only)."""
  xla_chunk, pallas_chunk = suite.chunk_sizes["xla"], suite.chunk_sizes["pallas"]
  forms: dict[str, tuple[Callable, str, str | None]] = {}
  for decay_kind in suite.op_decays:
    forms[case_name("xla", decay_kind)] = (
        lambda q, k, v, log_decay: retention.chunkwise_retention(q, k, v, log_decay, xla_chunk)[0], decay_kind, None)
    for layout in suite.op_layouts:
      if decay_kind == "per_token" and layout != PER_TOKEN_LAYOUT:
        continue
      config = kernels.default_config(d_k, d_v, layout)
      forms[case_name("pallas" if layout == "split" else f"pallas_{layout}", decay_kind)] = (
          lambda q, k, v, log_decay, config=config: kernels.chunkwise_retention(q, k, v, log_decay, pallas_chunk,
                                                                                config=config)[0], decay_kind, layout)
  if "constant" in suite.op_decays:
    forms["cudnn_attention"] = (lambda q, k, v, log_decay: jax.nn.dot_product_attention(
        q, k, v, implementation="cudnn", is_causal=True), "constant", None)
  return forms


def _op_skip_reason(name: str, layout: str | None, d_k: int, d_v: int, suite: GpuSuite) -> str | None:
  if layout is not None:
    try:
      kernels.check_supported(d_k, d_v, jnp.bfloat16, suite.chunk_sizes["pallas"], layout=layout)
    except ValueError as e:
      return str(e)
  if name == "cudnn_attention" and jax.default_backend() != "gpu":
    return f"cuDNN attention needs a CUDA GPU; the backend is {jax.default_backend()!r}"
  return None


def _to_torch(array, dtype_name: str):
  """A JAX or NumPy array as a torch CUDA tensor of `dtype_name` (bfloat16, float32)."""
  import torch
  return torch.from_numpy(np.asarray(array, np.float32)).to("cuda", getattr(torch, dtype_name))


def _check_op(forms, fla, suite: GpuSuite, d_k: int, d_v: int, runnable: set[str]) -> dict[str, Any]:
  """Each runnable implementation's output against the XLA form of its decay in float32 at `highest` precision from
  the same bfloat16 values, at `op_check_len` tokens: `op.relative_error` and whether it is within `op.TOLERANCE`."""
  q, k, v, _ = op_inputs(suite.op_batch, suite.op_check_len, suite.op_heads, d_k, d_v, seed=1)
  runs = {}
  for decay_kind in suite.op_decays:
    log_decay = log_decays(decay_kind, suite.op_batch, suite.op_check_len, suite.op_heads)
    with jax.default_matmul_precision("highest"):
      reference = np.asarray(jax.jit(lambda q, k, v, log_decay: retention.chunkwise_retention(
          q, k, v, log_decay, suite.chunk_sizes["xla"])[0])(*(x.astype(jnp.float32) for x in (q, k, v)), log_decay))
    for name, (form, kind, _) in forms.items():
      if kind == decay_kind and name in runnable and name != "cudnn_attention":
        runs[name] = (lambda form=form, log_decay=log_decay: jax.jit(form)(q, k, v, log_decay), reference)
    if fla is not None:
      if decay_kind == "constant":
        check_fla_mapping(log_decay)
      call, torch_args = fla[decay_kind], [_to_torch(x, "bfloat16") for x in (q, k, v)]
      runs[FLA_NAMES[decay_kind]] = (lambda call=call, args=torch_args, g=_to_torch(log_decay, "float32"): call(
          *args, g).float().cpu().numpy(), reference)
  errors, failed = {}, {}
  for name, (run, reference) in runs.items():
    try:
      errors[name] = relative_error(run(), reference)
    except Exception as e:  # pylint: disable=broad-except  (an implementation that does not run here is a result)
      failed[name] = error_text(e)
  return {"seq_len": suite.op_check_len, "tolerance": TOLERANCE, "relative_error": errors, "failed": failed,
          "ok": {name: errors.get(name, np.inf) <= TOLERANCE for name in runs}}


def _fla_op_case(call, suite: GpuSuite, length: int, d_k: int, d_v: int, backward: bool, log_decay) -> Case:
  """fla's `call(q, k, v, g)` on torch CUDA tensors of the same shapes and scales as `op.op_inputs` (its own random
  values) and our log decays `log_decay` as `g` (not differentiated); memory from torch."""
  import torch
  generator = torch.Generator("cuda").manual_seed(0)
  shape = (suite.op_batch, length, suite.op_heads)
  make = lambda dim, scale=1.0: (torch.randn(shape + (dim,), generator=generator, device="cuda") * scale).to(
      torch.bfloat16).requires_grad_(backward)
  q, k, v = make(d_k, d_k**-0.25), make(d_k, d_k**-0.25), make(d_v)
  d_out = make(d_v).detach()
  g = _to_torch(log_decay, "float32")

  def once():
    out = call(q, k, v, g)
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


def measure_op(suite: GpuSuite, d_k: int, d_v: int, source: str, write: Callable[[dict], None], budget: Budget
               ) -> dict[str, Any]:
  """The op at head dims (d_k, d_v) at every length, the implementations interleaved per length; a length not
  started before `budget` is spent is skipped."""
  forms = _op_forms(suite, d_k, d_v)
  fla, fla_reason = fla_functions()
  skipped = {name: reason for name, (_, _, layout) in forms.items()
             if (reason := _op_skip_reason(name, layout, d_k, d_v, suite))}
  if fla_reason:
    skipped.update({FLA_NAMES[decay_kind]: fla_reason for decay_kind in suite.op_decays})
  results: dict[str, Any] = {"d_k": d_k, "d_v": d_v, "batch": suite.op_batch, "heads": suite.op_heads,
                             "dtype": "bfloat16", "decays": list(suite.op_decays), "layouts": list(suite.op_layouts),
                             "chunk_sizes": {**suite.chunk_sizes, "fla": FLA_CHUNK}, "attention_head_dim": d_k,
                             "skipped": skipped, "points": []}
  results["agreement"] = _check_op(forms, fla, suite, d_k, d_v, set(forms) - set(skipped))
  agreement = results["agreement"]
  for name, ok in agreement["ok"].items():
    if not ok:
      skipped[name] = (f"it failed the check: {agreement['failed'][name]}" if name in agreement["failed"] else
                       "its output disagrees with the XLA form in float32 beyond the tolerance (see agreement): not "
                       "timed")
  timed_fla = {decay_kind: fla[decay_kind] for decay_kind in suite.op_decays
               if fla is not None and FLA_NAMES[decay_kind] not in skipped}
  chunks = {name: suite.chunk_sizes["xla" if name.startswith("xla") else "pallas"] for name in forms}
  chunks.update({name: FLA_CHUNK for name in FLA_NAMES.values()})
  for length in suite.op_lengths:
    if budget.spent():
      skipped[f"{length} tokens"] = budget.reason
      write(results)
      continue
    retention_args = op_inputs(suite.op_batch, length, suite.op_heads, d_k, d_v)
    decays = {decay_kind: log_decays(decay_kind, suite.op_batch, length, suite.op_heads)
              for decay_kind in suite.op_decays}
    # Attention's: the same q and k, v and its cotangent at head dim d_k.
    attention_args = (None if "cudnn_attention" in skipped or "cudnn_attention" not in forms else
                      op_inputs(suite.op_batch, length, suite.op_heads, d_k, d_k))
    op_cases, errors = {}, {}
    for kind in KINDS:
      for name, (form, decay_kind, _) in forms.items():
        if name not in skipped:
          try:
            args = attention_args if name == "cudnn_attention" else retention_args
            op_cases[f"{name}/{kind}"] = op_case(form, *args, kind, suite.op_repeats, (decays[decay_kind],))
          except Exception as e:  # pylint: disable=broad-except  (a case that does not compile is a result)
            errors[f"{name}/{kind}"] = error_text(e)
      for decay_kind, call in timed_fla.items():
        op_cases[f"{FLA_NAMES[decay_kind]}/{kind}"] = _fla_op_case(call, suite, length, d_k, d_v,
                                                                   kind == "forward_backward", decays[decay_kind])
    print(f"op {d_k}x{d_v} at {length} tokens: {', '.join(op_cases)}", flush=True)
    interleave(op_cases, suite.rounds, source, budget)
    point: dict[str, Any] = {"seq_len": length, "cases": {}, "errors": errors}
    tokens = suite.op_batch * length
    for name, case in op_cases.items():
      impl, kind = name.split("/")
      forward = (attention_op_flops(suite.op_batch, suite.op_heads, length, d_k) if impl == "cudnn_attention" else
                 retention_op_flops(suite.op_batch, suite.op_heads, length, d_k, d_v, chunks[impl]))
      work = kind_flops(forward, kind)
      seconds = case.info["seconds"]
      point["cases"][name] = {**case.info, "flops": work, "tokens_per_s": rate(tokens, seconds),
                              "tflops_per_s": work / seconds["median"] / 1e12}
    for kind in KINDS:
      for decay_kind in suite.op_decays:
        theirs = point["cases"].get(f"{FLA_NAMES[decay_kind]}/{kind}")
        for layout in suite.op_layouts:
          impl = case_name("pallas" if layout == "split" else f"pallas_{layout}", decay_kind)
          if theirs and (ours := point["cases"].get(f"{impl}/{kind}")):
            point[f"{impl}_over_fla_{kind}"] = ours["tokens_per_s"]["median"] / theirs["tokens_per_s"]["median"]
    results["points"].append(point)
    write(results)
    del retention_args, attention_args, op_cases, decays
    if timed_fla:
      import torch
      torch.cuda.empty_cache()  # torch gives back what it cached, for JAX's next allocations
  return results


def op_markdown(results: dict[str, Any]) -> list[str]:
  """The op part's table (tokens/s and TFLOP/s per implementation and length), agreement and skips."""
  names = sorted({name for p in results["points"] for name in p["cases"]})
  lines = [f"## Retention op, d_k {results['d_k']} / d_v {results['d_v']} (batch {results['batch']}, "
           f"{results['heads']} heads, bfloat16)", "",
           "Tokens/s (TFLOP/s) per implementation and length; FLOP counts in `flop_counts`.", ""]
  lines += markdown.table(["tokens"] + names, [
      [f"{p['seq_len']:,}"] + [f"{fmt(c['tokens_per_s']['median'])} ({c['tflops_per_s']:.3g})"
                               if (c := p["cases"].get(n)) else "-" for n in names] for p in results["points"]])
  agreement = results["agreement"]
  lines += ["", f"Agreement with the XLA form in float32 at {agreement['seq_len']} tokens (relative error, tolerance "
            f"{agreement['tolerance']}): " + (", ".join(f"{k} {v:.1e}" for k, v in agreement["relative_error"].items())
                                            or "none run") + "."]
  ratio_keys = sorted({key for p in results["points"] for key in p if "_over_fla_" in key})
  for key in ratio_keys:  # <impl>_over_fla_<kind>: against fla's function of the impl's decay
    impl, kind = key.split("_over_fla_")
    ratios = [f"{p['seq_len']:,} {p[key]:.2f}x" for p in results["points"] if key in p]
    theirs = FLA_NAMES["per_token" if impl.endswith("_per_token") else "constant"]
    lines.append(f"{impl} / {theirs} tokens/s, {kind.replace('_', '+')}: {', '.join(ratios)}.")
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
  for ax, kind in zip(axes, KINDS):
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


