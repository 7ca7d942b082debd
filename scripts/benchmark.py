"""Benchmarks RetNet on this machine against its ceilings, a same-size Transformer and (when installed) torchscale.

    python scripts/benchmark.py --suite=full --out=runs/benchmark

Measures, in one run: the matmul ceilings (float32, bfloat16) and memory read bandwidth; training throughput and MFU
of the real train step (`train_step.setup`) in the parallel and chunkwise forms, float32 and bfloat16; forward and
training time and peak memory vs sequence length; greedy decoding with `Sampler.decode` (tokens/s at batch 1 and a
large batch, per-token latency vs context); the same for a Transformer of the same size, and decoding for a hybrid
whose last layer attends over a window of the prompt's length; gated retention (`model.mixer="gated_retention"`)
beside RetNet in the training rows and decoding tokens/s of the suite's `gated_forms` and `gated_decode_batches`;
and torchscale's RetNet at the identical configuration when torch and torchscale import. Writes OUT/results.json,
OUT/results.md (also printed) and PNG plots. The benchmark itself is the `benchmarks` package beside scripts/.

Cases that are compared are measured interleaved: each is warmed up once (its peak memory is taken then),
then timed once per round, round after round, because this machine's speed drifts between runs.
Compilation is timed on its own (ahead of time) and never inside a timed run. Decoding times whole
`Sampler.decode` calls (no stream callback) from a prompt prefilled once, per token: the prefill is not part
of a token's latency.

`--suite=sequence` measures sequence-parallel training instead (`benchmarks.sequence`): per-device XLA
buffers and step time of one long sequence split over 1, 2, 4 and 8 devices (simulated on a CPU), written to
OUT/sequence_parallel.json, .md and .png.

`--suite=context` measures prefill and decoding against the context length instead (`benchmarks.context`):
RetNet, gated retention, a hybrid whose last layer attends over a window and the Transformer of the same size (the
`--context_size` preset, default `small`), at batch 1, at each of `--context_lengths` (default: powers of 4 from 1k
tokens to 1M for `small`, to 4M and then 10M for `tiny`), the models taking turns at each length, each point in its
own process: XLA's memory analysis of the compiled prefill, the process's peak RSS, prefill tokens/s and decoding
tokens/s after that context. A prefill or decoding estimated from the model's previous length to take longer than
--point_budget_s is skipped with the estimate (the Transformer's prefill grows with the square of the length);
its XLA memory analysis is still recorded. Writes OUT/context.json, .md and .png:

    python scripts/benchmark.py --suite=context --out=runs/context
    python scripts/benchmark.py --suite=context --context_size=tiny --out=runs/context_tiny

`--suite=data` measures the data path instead (`benchmarks.corpus`): preparing a corpus (byte and BPE
tokenizers, 1 and 2 processes), Grain's loader per process at batch 64 x 2048 and the train step beside them, and
with --memory_mb the peak RSS of training from prepared corpora of those sizes; OUT/data.json and .md.

`--suite=gpu` runs the GPU suite instead (`benchmarks.gpu`), on one device, its parts chosen with --parts
(one device command may not run them all): the retention op against fla's Triton kernel and cuDNN attention, train
steps of a ~350M RetNet and the 1.3b preset (and their Transformers) with MFU, decoding, and the deep presets'
compile times, each written to OUT/gpu_<part>*.json and .md; each train case runs in its own process. Its models
are presets (the --config flag is unused). --time_budget_s ends a run in time: what has not started by then is
recorded as skipped, what was measured is kept (OUT/gpu_run.md lists the groups run and not started):

    python scripts/benchmark.py --suite=gpu --parts=op --op_head_dims=256x256 --out=runs/gpu
    python scripts/benchmark.py --suite=gpu --gpu_sizes=tiny --out=runs/gpu_smoke  # every part in seconds
    python scripts/benchmark.py --suite=gpu --time_budget_s=3000 --out=runs/gpu  # every part, within 50 minutes
"""

from __future__ import annotations

from retnet_jax.runs import cli

if __name__ == "__main__":
  cli.prepare()  # first, before numpy and jax start threads

import dataclasses
import os
import sys
from pathlib import Path

from absl import app, flags
import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's root: benchmarks/ is not installed
from benchmarks import cases, context, corpus, gpu, sections, sequence
from benchmarks.harness import Budget
from benchmarks.suites import CONTEXT_SUITES, GPU_SUITES, SEQUENCE_SUITE, SIZE_FIELDS, SUITES
from retnet_jax.core import owned_folders
from retnet_jax.nn.layer_stack import REMAT_POLICIES

_CONFIG = cli.config_flag("Base config; the suite sets its model size and training shape.")
# Config fields each case sets itself: overriding them with --config.X would be silently undone.
SUITE_CONFIG_FLAGS = tuple(f"--config.model.{name}" for name in SIZE_FIELDS) + (
    "--config.model.dtype", "--config.train.mode", "--config.train.seq_len", "--config.train.batch_size",
    "--config.train.grad_accum_steps")
_SUITE = flags.DEFINE_enum("suite", "quick", list(SUITES) + ["sequence", "context", "gpu", "data"], "quick: tiny "
                           "sizes; full: the full-size preset; sequence: sequence-parallel training, the full suite's "
                           "model; context: prefill and decoding against the context length "
                           "(benchmarks/context.py); gpu: the GPU suite (benchmarks/suites.py); data: "
                           "preparing, loading and training throughput of prepared corpora "
                           "(benchmarks/corpus.py).")
_OUT = flags.DEFINE_string("out", "runs/benchmark", "Output folder for results.json, results.md and plots.")
_SIZE = {name: flags.DEFINE_integer(name, None, f"model.{name} (default: the suite's)") for name in SIZE_FIELDS}
_SEQ_LEN = flags.DEFINE_integer("seq_len", None, "Training sequence length (default: the suite's).", lower_bound=1)
_BATCH_SIZE = flags.DEFINE_integer("batch_size", None, "Training batch size (default: the suite's).", lower_bound=1)
_INFERENCE_DEVICES = flags.DEFINE_integer(
    "inference_devices", None, "Devices of the tensor-parallel mesh (heads, FFN and vocabulary split) that the "
    "forward sweep and decoding run on. Default: all, at most as many as split those evenly. On the CPU backend "
    "the benchmark makes one JAX device per core unless JAX_NUM_CPU_DEVICES or XLA_FLAGS set a count.")

_PARTS = flags.DEFINE_list("parts", list(gpu.PARTS), f"--suite=gpu: the parts to run, of {', '.join(gpu.PARTS)}.")
_GPU_SIZES = flags.DEFINE_enum("gpu_sizes", "h100", list(GPU_SUITES), "--suite=gpu: h100: one 80 GB GPU; tiny: "
                               "seconds, a smoke run of every part.")
_OP_HEAD_DIMS = flags.DEFINE_list("op_head_dims", None, "--suite=gpu: the op's per-head d_kxd_v, e.g. 256x512 "
                                  "(default: the sizes').")
_OP_LENGTHS = flags.DEFINE_list("op_lengths", None, "--suite=gpu: the op's lengths (default: the sizes').")
_TRAIN_MODELS = flags.DEFINE_list("train_models", None, "--suite=gpu: the named sizes of the train part (default: "
                                  "the sizes').")
_REMAT = flags.DEFINE_enum("remat", None, ["none", *REMAT_POLICIES], "--suite=gpu: train.remat of every train step "
                           "(default: the sizes').")
_TIME_BUDGET_S = flags.DEFINE_float(
    "time_budget_s", None, "--suite=gpu: seconds the run may take (default: no limit). Parts, groups and cases not "
    "started when they are spent are recorded as skipped ('time budget'), a train case still running then is ended, "
    "timing rounds stop early (after the first); what was measured is kept.", lower_bound=0)
_DATA_MB = flags.DEFINE_float("data_mb", 16, "--suite=data: size of the corpus prepared and loaded, in MB.",
                               lower_bound=0.5)
_MEMORY_MB = flags.DEFINE_list("memory_mb", [], "--suite=data: corpus sizes in MB to train `tiny` from, measuring "
                               "peak RSS (e.g. 4,400).")
_CONTEXT_SIZE = flags.DEFINE_enum("context_size", "small", list(CONTEXT_SUITES), "--suite=context: the preset "
                                  "whose size the four models take (CONTEXT_SUITES in benchmarks/suites.py).")
_CONTEXT_LENGTHS = flags.DEFINE_list("context_lengths", None, "--suite=context: the context lengths in tokens, e.g. "
                                     "1024,4096 (default: the size's).")
_POINT_BUDGET_S = flags.DEFINE_float("point_budget_s", None, "--suite=context: seconds a point's prefill or decoding "
                                     "may take, estimated from the model's previous length; longer ones are skipped "
                                     "(default: the size's).", lower_bound=0)
CONTEXT_FLAGS = ("--context_size", "--context_lengths", "--point_budget_s")
GPU_FLAGS = ("--parts", "--gpu_sizes", "--op_head_dims", "--op_lengths", "--train_models", "--remat", "--time_budget_s")


def _refuse_model_flags(suite: str, extra: tuple[str, ...], fix: str) -> None:
  """UsageError where the model-size flags, --config or `extra` flags are given to a suite that builds its models
  from presets."""
  fixed = [f"--{n}" for n, f in _SIZE.items() if f.value is not None] + [
      arg.split("=")[0] for arg in sys.argv[1:] if arg.startswith("--config") or arg.split("=")[0] in extra]
  if fixed:
    raise app.UsageError(f"{', '.join(fixed)}: --suite={suite} builds its models from presets; {fix}")


def _gpu_suite(name: str):
  """GPU_SUITES[name] with the flags' overrides; UsageError naming a bad one."""
  suite = GPU_SUITES[name]
  _refuse_model_flags("gpu", (), "use --train_models, --seq_len, --batch_size, --remat, --op_head_dims and "
                      "--op_lengths (GPU_SUITES in benchmarks/suites.py).")
  try:
    head_dims = tuple(tuple(int(x) for x in dims.split("x", 1)) for dims in _OP_HEAD_DIMS.value or ())
    lengths = tuple(int(x) for x in _OP_LENGTHS.value or ())
  except ValueError:
    raise app.UsageError(f"--op_head_dims={','.join(_OP_HEAD_DIMS.value or ())} --op_lengths="
                         f"{','.join(_OP_LENGTHS.value or ())}: give e.g. "
                         "--op_head_dims=256x256,128x128 --op_lengths=2048,4096.") from None
  if any(len(d) != 2 or min(d) < 1 for d in head_dims) or any(n < 1 for n in lengths):
    raise app.UsageError(f"--op_head_dims={','.join(_OP_HEAD_DIMS.value or ())} --op_lengths="
                         f"{','.join(_OP_LENGTHS.value or ())}: give positive "
                         "sizes, e.g. --op_head_dims=256x256,128x128 --op_lengths=2048,4096.")
  unknown = [m for m in _TRAIN_MODELS.value or () if m not in suite.models]
  if unknown:
    raise app.UsageError(f"--train_models={','.join(unknown)}: choose of {list(suite.models)}.")
  train_models = tuple(_TRAIN_MODELS.value or suite.train_models)
  return dataclasses.replace(
      suite, op_head_dims=head_dims or suite.op_head_dims, op_lengths=lengths or suite.op_lengths,
      train_models=train_models,
      train_seq_len=suite.train_seq_len if _SEQ_LEN.value is None else _SEQ_LEN.value,
      train_batch=suite.train_batch if _BATCH_SIZE.value is None else {m: _BATCH_SIZE.value for m in suite.models},
      train_remat=suite.train_remat if _REMAT.value is None else {m: _REMAT.value for m in suite.models})


def _context_sweep():
  """CONTEXT_SUITES[--context_size] with the flags' overrides; UsageError naming a bad one."""
  _refuse_model_flags("context", ("--seq_len", "--batch_size", "--inference_devices"),
                      "choose its size with --context_size (CONTEXT_SUITES in benchmarks/suites.py).")
  sweep = CONTEXT_SUITES[_CONTEXT_SIZE.value]
  try:
    lengths = tuple(sorted({int(x) for x in _CONTEXT_LENGTHS.value or ()}))
  except ValueError:
    lengths = None
  if lengths is None or lengths and lengths[0] < 2:
    raise app.UsageError(f"--context_lengths={','.join(_CONTEXT_LENGTHS.value)}: give lengths of at least 2 tokens, "
                         "e.g. --context_lengths=1024,4096.")
  budget = sweep.point_budget_s if _POINT_BUDGET_S.value is None else _POINT_BUDGET_S.value
  return dataclasses.replace(sweep, lengths=lengths or sweep.lengths, point_budget_s=budget)


def _check_inference_mesh(base, size: dict[str, int]) -> None:
  """Usage errors for a config mesh without a `tensor` axis and an --inference_devices that cannot split it."""
  devices, names = jax.devices(), tuple(base.mesh.axis_names)
  widths = {name: size[name] for name in cases.TENSOR_SPLIT}
  if "tensor" not in names:
    raise app.UsageError(f"mesh.axis_names={names} has no 'tensor' axis for the inference mesh.")
  requested = _INFERENCE_DEVICES.value
  if requested is not None and (not 1 <= requested <= len(devices) or any(w % requested for w in widths.values())):
    raise app.UsageError(f"--inference_devices={requested}: choose 1 to {len(devices)} (the devices present) "
                         f"that divides each of {widths}.")


def main():
  for suite, suite_flags in (("gpu", GPU_FLAGS), ("context", CONTEXT_FLAGS)):
    given = [arg.split("=")[0] for arg in sys.argv[1:] if arg.split("=")[0] in suite_flags]
    if _SUITE.value != suite and given:
      raise app.UsageError(f"{', '.join(given)}: only for --suite={suite}.")
  out = Path(_OUT.value)
  # A folder of its own (new, empty, or an earlier benchmark's), before any work: no user's file is written over.
  owned_folders.claim(out, "benchmark results", flag="--out", take_flag=None)
  if _SUITE.value == "context":
    context.run(_context_sweep(), out, " ".join(["python"] + sys.argv))
    return
  if _SUITE.value == "gpu":
    budget = Budget(_TIME_BUDGET_S.value)
    suite = _gpu_suite(_GPU_SIZES.value)
    bad_parts = [p for p in _PARTS.value if p not in gpu.PARTS]
    if bad_parts or not _PARTS.value:
      raise app.UsageError(f"--parts={','.join(_PARTS.value)}: choose one or more of {','.join(gpu.PARTS)}.")
    # Before JAX starts its backend: torch (fla) shares the GPU, so JAX allocates as it goes instead of taking 75%
    # up front, up to 90% (the train steps' limit: a step whose XLA buffers exceed it is skipped).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    gpu.run(suite, _GPU_SIZES.value, tuple(_PARTS.value), out, " ".join(["python"] + sys.argv), budget)
    return
  if _SUITE.value == "data":
    try:
      memory_mb = tuple(float(x) for x in _MEMORY_MB.value)
    except ValueError:
      raise app.UsageError(f"--memory_mb={','.join(_MEMORY_MB.value)}: give sizes in MB, e.g. 4,400.") from None
    corpus.run(_CONFIG.value, out, " ".join(["python"] + sys.argv), _DATA_MB.value, memory_mb)
    return
  if jax.config.jax_num_cpu_devices < 0 and "xla_force_host_platform_device_count" not in os.environ.get(
      "XLA_FLAGS", ""):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    devices = max(SEQUENCE_SUITE.splits) if _SUITE.value == "sequence" else cores
    jax.config.update("jax_num_cpu_devices", devices)  # before any device is created
  suite = SEQUENCE_SUITE.suite if _SUITE.value == "sequence" else SUITES[_SUITE.value]
  size = {name: flag.value if flag.value is not None else suite.size[name] for name, flag in _SIZE.items()}
  suite = dataclasses.replace(
      suite, size=size, seq_len=suite.seq_len if _SEQ_LEN.value is None else _SEQ_LEN.value,
      batch_size=suite.batch_size if _BATCH_SIZE.value is None else _BATCH_SIZE.value)
  set_by_suite = [arg.split("=")[0] for arg in sys.argv[1:] if arg.split("=")[0] in SUITE_CONFIG_FLAGS]
  if set_by_suite:
    raise app.UsageError(f"{', '.join(set_by_suite)}: the suite sets these (and runs both dtypes and forms); use "
                         f"--{', --'.join(SIZE_FIELDS)}, --seq_len and --batch_size instead.")
  if _SUITE.value == "sequence":
    lengths = SEQUENCE_SUITE.lengths if _SEQ_LEN.value is None else (_SEQ_LEN.value,)
    sweep = dataclasses.replace(SEQUENCE_SUITE, suite=suite, lengths=lengths)
    sequence.run(_CONFIG.value, sweep, out, " ".join(["python"] + sys.argv))
    return
  _check_inference_mesh(_CONFIG.value, size)
  sections.run(_CONFIG.value, suite, _SUITE.value, out, " ".join(["python"] + sys.argv), _INFERENCE_DEVICES.value)


if __name__ == "__main__":
  cli.run(main)
