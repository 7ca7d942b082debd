"""Compiles the real train, eval, prefill and decode steps for a GPU or TPU target on any machine (no accelerator
needed): memory per device and whether it fits, FLOPs, collectives, compile time and a step-time lower bound.

    target = accelerators.parse_target("h100:8")
    report = plan(config, target, steps=("train", "eval"))  # {"steps": {"train": {"fits": ..., ...}}, ...}
    found = search(config, target)  # the largest power-of-two batch that fits, per remat policy

The steps are the ones training and generation run: `train_step.setup(config, mesh)`'s jitted train and eval steps,
and the `sampling.Sampler`'s prefill and decoding loop, on a mesh of the target's compile-only devices with the
config's mesh shape. A compiler out-of-memory is a result (`fits: false`), not an error.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging
from jax.experimental import mesh_utils
from jax.sharding import AxisType
from jax._src.lib import _jax  # XLA's HLO cost analysis, for a target whose compiler reports none (GPUs)

from retnet_jax.core import markdown, sharding
from retnet_jax.core.sharding import MeshConfig
from retnet_jax.evaluation import sampling, sampling_checks
from retnet_jax.hardware import accelerators, flops, matmul_dtypes
from retnet_jax.mixers.kernels import support
from retnet_jax.models import architectures, streaming
from retnet_jax.nn import layer_stack
from retnet_jax.training import run_config, train, train_step as train_step_lib

STEPS = ("train", "eval", "prefill", "decode")
DECODE_TOKENS = 256  # new tokens per decoding loop compiled
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
                "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}


def check_request(config: run_config.Config | Any, target: accelerators.Target, steps: Sequence[str]
                  ) -> run_config.Config:
  """Refuses, before any compile, unknown steps, a missing extra, a config or mesh the target cannot run, and a KV
  cache too short for the prefill or decode step's context; returns the config built (`run_config.build`)."""
  config = run_config.build(config)
  unknown = [s for s in steps if s not in STEPS]
  if unknown or not steps:
    raise ValueError(f"--steps={','.join(steps)}: choose steps among {','.join(STEPS)}.")
  accelerators.check_installed(target.chip.platform)
  try:
    _slice_axis(sharding.mesh_shape(config.mesh, target.num_devices), target.slices)
  except ValueError as e:
    raise ValueError(f"--target={target.name} has {target.num_devices} devices: {e}") from None
  with support.target_backend(target.chip.platform):
    train.check_config(config, target.num_devices)  # training's own checks: the plan is of that training
  for step, new_tokens in (("prefill", 0), ("decode", DECODE_TOKENS)):
    if step in steps:  # prompts of train.seq_len + 1 tokens (`_traces`)
      sampling_checks.check_cache_length(config.model, config.train.seq_len + 1, new_tokens)
  return config


def plan(config: run_config.Config | Any, target: accelerators.Target, steps: Sequence[str] = ("train",)
         ) -> dict[str, Any]:
  """Compiles `steps` of `config` for `target`; the report of each step under "steps", and what they share."""
  config = check_request(config, target, steps)
  devices = accelerators.devices(target)
  mesh = _mesh(config.mesh, target, devices)
  chip = target.chip
  report = {"target": target.name, "platform": chip.platform, "device_kind": chip.device_kind,
            "devices": target.num_devices, "hosts": len({d.process_index for d in devices}), "slices": target.slices,
            "mesh": dict(zip(mesh.axis_names, mesh.devices.shape)), "batch_size": config.train.batch_size,
            "seq_len": config.train.seq_len, "mode": config.train.mode, "remat": config.train.remat,
            "scan_layers": config.model.scan_layers, "retention_impl": getattr(config.model, "retention_impl", None),
            "kernel_layout": getattr(config.model, "kernel_layout", None),
            "dtype": config.model.dtype,
            "peak_bf16_flops_per_device": chip.peak_bf16_flops, "hbm_bytes_per_second": chip.hbm_bytes_per_second,
            "device_memory_bytes": chip.memory_bytes, "steps": {}}
  with support.target_backend(chip.platform):
    run = train_step_lib.setup(config, mesh)
    with run.placement.active():
      traces = _traces(config, run)
      for step in steps:
        report["steps"][step] = _compile(traces[step], config, target, step)
  report["fits"] = all(r["fits"] for r in report["steps"].values())
  return report


def _slice_axis(shape: tuple[int, ...], slices: int) -> int | None:
  """The first mesh axis that `slices` slices split evenly (None for one slice), or ValueError naming the fix."""
  if slices == 1:
    return None
  axis = next((i for i, size in enumerate(shape) if size % slices == 0), None)
  if axis is None:
    raise ValueError(f"no axis of mesh.shape={shape} splits over the {slices} slices; make one of them (the data "
                     f"axis, usually) a multiple of {slices}.")
  return axis


def _mesh(mesh_cfg: MeshConfig, target: accelerators.Target, devices) -> jax.sharding.Mesh:
  """`config.mesh` on the target's devices; over several slices the first axis they split spans them (over the
  data-center network), the others stay within a slice."""
  shape = sharding.mesh_shape(mesh_cfg, len(devices))
  axis = _slice_axis(shape, target.slices)
  if axis is None:
    return sharding.make_mesh(mesh_cfg, devices)
  across = tuple(target.slices if i == axis else 1 for i in range(len(shape)))
  grid = mesh_utils.create_hybrid_device_mesh(tuple(s // a for s, a in zip(shape, across)), across, devices,
                                              allow_split_physical_axes=True)
  return jax.sharding.Mesh(grid, tuple(mesh_cfg.axis_names), axis_types=(AxisType.Auto,) * len(shape))


def _traces(config: run_config.Config, run: train_step_lib.Setup):
  """Per step, a function that traces it: the same jitted functions training and generation call. Batches are
  `train.batch_size` rows of `train.seq_len` tokens (and the next token), prompts as long: the prefill runs
  `train.seq_len` tokens, in blocks of `streaming.check_block`'s default."""
  batch, seq_len = config.train.batch_size, config.train.seq_len
  tokens = jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32, sharding=run.placement.batch_sharding)
  params = run.abstract_state.params
  sampler = sampling.Sampler()
  prefill_mode = architectures.prefill_modes(config.model)[0]
  lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
  prefill_args = (run.graphdef, params, tokens, lengths, prefill_mode)

  return {"train": lambda: run.train_step.trace(run.abstract_state, tokens),
          "eval": lambda: run.eval_step.trace(params, tokens),
          "prefill": lambda: sampler.trace_prefill(*prefill_args, streaming.check_block(config.model, None)),
          "decode": lambda: sampler.trace_decode(*prefill_args, DECODE_TOKENS)}


def _model_flops(config: run_config.Config, step: str) -> float:
  """`flops.py`'s count of the step's model FLOPs (all devices); a decoding step's attention reads its whole KV
  cache."""
  cfg, train = config.model, config.train
  tokens = train.batch_size * train.seq_len
  if step == "train":
    return flops.train_flops_per_token(cfg, train.seq_len, train.mode) * tokens
  if step == "eval":
    return flops.forward_flops_per_token(cfg, train.seq_len, train.mode) * tokens
  if step == "prefill":
    return flops.forward_flops_per_token(cfg, train.seq_len, architectures.prefill_modes(cfg)[0]) * tokens
  context = architectures.decode_context(cfg)  # attention reads its whole KV cache
  return flops.forward_flops_per_token(cfg, context, "recurrent") * train.batch_size * DECODE_TOKENS


def _compile(trace, config: run_config.Config, target: accelerators.Target, step: str) -> dict[str, Any]:
  """Traces, lowers and compiles one step; its matmul FLOPs by operand dtypes (`matmul_dtypes`, from the jaxpr),
  memory, FLOPs, collectives, compile time and bound, or the compiler's out-of-memory as `fits: false` with the bytes
  its message says were needed (a TPU's: the temporaries alone)."""
  chip, devices = target.chip, target.num_devices
  start = time.perf_counter()
  traced = trace()
  by_dtype = matmul_dtypes.matmul_flops_by_dtype(traced.jaxpr)
  lowered = traced.lower()
  model_flops = _model_flops(config, step)
  result: dict[str, Any] = {
      "model_flops_per_device": model_flops / devices,
      "device_memory_bytes": chip.memory_bytes, "matmul_flops_by_dtype": by_dtype,
      "float32_matmul_share": matmul_dtypes.float32_share(by_dtype)}
  try:
    compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    if not str(e).startswith("RESOURCE_EXHAUSTED"):
      raise
    message = " ".join(str(e).split())
    return result | {"fits": False, "compile_seconds": time.perf_counter() - start,
                     "required_bytes_per_device": _bytes_needed(message), "error": message[:400]}
  result["compile_seconds"] = time.perf_counter() - start
  sizes = accelerators.memory_sizes(compiled)
  required = accelerators.required_bytes(sizes)
  cost, source = _cost(compiled, lowered, devices)
  hlo = compiled.as_text()
  # What the step cannot avoid: reading its arguments and writing its outputs once, and the FLOPs of the model or
  # of the compiled program (XLA counts a loop's body once), whichever is more. XLA's bytes accessed are an
  # estimate of its own, not a bound.
  moved = sizes["argument_bytes"] + sizes["output_bytes"]
  compute = max(cost.get("flops", 0.0), result["model_flops_per_device"] or 0.0)
  return result | sizes | {
      "required_bytes_per_device": required, "fits": required <= chip.memory_bytes,
      "xla_flops_per_device": cost.get("flops"), "xla_bytes_accessed_per_device": cost.get("bytes accessed"),
      "xla_flops_source": source,
      "pallas_kernel_calls": hlo.count("__gpu$xla.gpu.triton") + hlo.count("triton_kernel_call"),
      "collectives": collectives(hlo),
      "step_seconds_lower_bound": max(compute / chip.peak_bf16_flops, moved / chip.hbm_bytes_per_second),
      "bound_terms": {"compute_seconds": compute / chip.peak_bf16_flops,
                      "memory_seconds": moved / chip.hbm_bytes_per_second}}


def _cost(compiled, lowered, devices: int) -> tuple[dict[str, float], str]:
  """XLA's cost analysis per device: the compiled program's where the target's compiler gives one (TPUs), else
  the lowered program's (before optimization, the whole mesh's work split evenly; custom calls such as the Pallas
  kernels count nothing) from the host's XLA."""
  cost = compiled.cost_analysis()
  if isinstance(cost, list):
    cost = cost[0] if cost else None
  if cost:
    return {k: float(v) for k, v in cost.items() if k in ("flops", "bytes accessed")}, "compiled"
  module = lowered.compiler_ir("hlo").as_hlo_module()
  cost = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
  return {k: float(cost[k]) / devices for k in ("flops", "bytes accessed") if k in cost}, "lowered"


def _bytes_needed(message: str) -> int | None:
  """The bytes an out-of-memory message says the program needs ("... required for HLO temporaries (69.54G)
  exceeds ..." or "Used 20.5G of 15.75G hbm"), or None."""
  found = (re.search(r"required[^(]*\(([\d.]+)([KMGT]?)\)", message)
           or re.search(r"Used ([\d.]+)([KMGT]?) of", message))
  if not found:
    return None
  return int(float(found.group(1)) * 1024 ** " KMGT".index(found.group(2) or " "))


def collectives(hlo: str) -> dict[str, dict[str, int]]:
  """The collectives in a compiled HLO module's text, by kind: how many, and the bytes of their results (per
  device; an asynchronous pair counted once, by its start)."""
  found: dict[str, dict[str, int]] = {}
  pattern = r"^\s*(?:ROOT )?%?\S+ = (.*?) (" + "|".join(_COLLECTIVES) + r")(-start)?\("
  for result, kind, started in re.findall(pattern, hlo, flags=re.MULTILINE):
    arrays = [_array_bytes(dtype, dims) for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", result)]
    size = max(arrays, default=0) if started else sum(arrays)  # a start's tuple holds its operands too
    entry = found.setdefault(kind, {"count": 0, "bytes": 0})
    entry["count"] += 1
    entry["bytes"] += size
  return found


def _array_bytes(dtype: str, dims: str) -> int:
  """Bytes of an HLO array `dtype[dims]` (e.g. `bf16`, `4,8`)."""
  return math.prod(int(d) for d in filter(None, dims.split(","))) * _DTYPE_BYTES.get(dtype, 4)


def search(config: run_config.Config | Any, target: accelerators.Target, max_batch: int = 1 << 16,
           remats: Sequence[str] = ("none", *layer_stack.REMAT_POLICIES)) -> dict[str, Any]:
  """Per remat policy in `remats` (default: none and every `layer_stack.REMAT_POLICIES` key), the largest
  power-of-two global batch (a multiple of the data shards and micro-batches, at most `max_batch`) at the config's
  seq_len whose train step fits, found by doubling or halving from the config's batch (memory grows with the batch);
  the largest of those batches, and the lightest policy reaching it (fewest XLA FLOPs: least recomputation). Every
  attempt is recorded."""
  config = check_request(config, target, ("train",))
  for remat in remats:
    layer_stack.check_remat(remat, field="--remat_policies")
  shape = dict(zip(config.mesh.axis_names, sharding.mesh_shape(config.mesh, target.num_devices)))
  batch_axes = sharding.logical_spec(("batch",), sharding.logical_rules(config.mesh))[0] or ()
  batch_axes = (batch_axes,) if isinstance(batch_axes, str) else batch_axes
  unit = config.train.grad_accum_steps
  for axis in batch_axes:
    unit *= shape[axis]
  attempts, largest, start = [], {}, min(config.train.batch_size, max_batch)
  for remat in remats:  # each starts where the one before ended
    batch = unit << (max(start // unit, 1).bit_length() - 1)  # the largest unit x 2^k up to `start`
    fitted = failed = None
    while unit <= batch <= max_batch and (fitted is None or failed is None):
      step = plan(_with(config, batch_size=batch, remat=remat), target, ("train",))["steps"]["train"]
      attempts.append({"remat": remat, "batch_size": batch} | {k: step.get(k) for k in (
          "fits", "required_bytes_per_device", "xla_flops_per_device", "compile_seconds", "error")})
      logging.info("remat %s, batch %d: %s", remat, batch, "fits" if step["fits"] else "does not fit")
      jax.clear_caches()  # the attempt's executable is not needed again
      fitted, failed = (batch, failed) if step["fits"] else (fitted, batch)
      batch = batch * 2 if step["fits"] else batch // 2
    largest[remat] = fitted
    start = fitted or start
  best = max((b for b in largest.values() if b), default=None)
  reaching = [a for a in attempts if a["fits"] and a["batch_size"] == best]
  lightest = min(reaching, key=lambda a: a["xla_flops_per_device"] or 0.0)["remat"] if reaching else None
  return {"target": target.name, "seq_len": config.train.seq_len, "largest_batch_per_remat": largest,
          "largest_batch": best, "lightest_remat_at_largest_batch": lightest, "attempts": attempts}


def _with(config: run_config.Config, **train_fields) -> run_config.Config:
  """A copy of `config` with `train_fields` changed, checked as the config is."""
  return config.replace(train=config.train.replace(**train_fields))


def format_table(report: dict[str, Any]) -> str:
  """A Markdown table of a plan's steps: memory per device, fit, FLOPs, collectives, compile time and bound."""
  gib = lambda b: "-" if b is None else f"{b / 2**30:.2f}"
  tflop = lambda f: "-" if f is None else f"{f / 1e12:.2f}"
  lines = [f"{report['target']} ({report['devices']} x {report['device_kind']}), mesh {report['mesh']}, batch "
           f"{report['batch_size']} x {report['seq_len']}, remat {report['remat']}, {report['mode']}"
           f"{', scanned layers' if report.get('scan_layers') else ''}", ""]
  rows = []
  for name, r in report["steps"].items():
    comm = ", ".join(f"{k} x{v['count']} ({gib(v['bytes'])} GiB)" for k, v in r.get("collectives", {}).items())
    bound = r.get("step_seconds_lower_bound")
    rows.append([name, "yes" if r["fits"] else "no", gib(r["required_bytes_per_device"]), gib(r["device_memory_bytes"]),
                 gib(r.get("argument_bytes")), gib(r.get("temporary_bytes")), tflop(r.get("xla_flops_per_device")),
                 tflop(r["model_flops_per_device"]), comm or "-", f"{r['compile_seconds']:.1f}",
                 "-" if bound is None else f"{bound:.4f}", f"{r['float32_matmul_share']:.1%}"])
  lines += markdown.table(["step", "fits", "required GiB", "of GiB", "args GiB", "temp GiB", "XLA TFLOP", "model TFLOP",
                           "collectives", "compile s", "step >= s", "f32-operand matmuls"], rows)
  lines.append("")
  lines.append("Per device. `step >= s` is a lower bound: max(FLOPs / peak bf16 FLOP/s, (arguments + outputs) / HBM "
               "bandwidth), FLOPs the larger of XLA's and the model's. `f32-operand matmuls`: the share of the step's "
               "matmul FLOPs (from its jaxpr) with a float32 operand, which run at float32 (TF32) rate.")
  return "\n".join(lines)
