"""Benchmarks RetNet on this machine against its ceilings, a same-size Transformer and (when installed) torchscale.

    python scripts/benchmark.py --suite=full --out=runs/benchmark

Measures, in one run: the matmul ceilings (float32, bfloat16) and memory read bandwidth; training throughput
and MFU of the real train step (`train.setup`) in the parallel and chunkwise forms, float32 and bfloat16;
forward and training time and peak memory vs sequence length; greedy decoding with `sampling.decode`
(tokens/s at batch 1 and a large batch, per-token latency vs context); the same for a Transformer of the same
size; and torchscale's RetNet at the identical configuration when torch and torchscale import. Writes
OUT/results.json, OUT/results.md (also printed) and PNG plots.

Cases that are compared are measured interleaved: each is warmed up once (its peak memory is taken then),
then timed once per round, round after round, because this machine's speed drifts by 10-20% between runs.
Compilation is timed on its own (ahead of time) and never inside a timed run. Decoding times whole
`sampling.decode` calls (no stream callback) from a prompt prefilled once, per token: the prefill is not part
of a token's latency.
"""

from __future__ import annotations

from retnet_jax import host_memory

if __name__ == "__main__":  # first, before numpy and jax start threads (see retnet_jax/host_memory.py)
  host_memory.keep_freed_memory()

import dataclasses
import datetime
import importlib.util
import json
import math
import multiprocessing
import os
import platform
import resource
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from absl import app, flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from retnet_jax import convert, flops, optimizer, sampling, sharding, train
from retnet_jax.baselines import transformer
from retnet_jax.model import RetNet

SIZE_FIELDS = ("d_model", "num_layers", "num_heads", "value_dim", "ffn_dim", "vocab_size", "chunk_size")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
SETTLE_S = 0.1  # pause before every measured run (see `interleave`)
# tok/s of torchscale's batch-1 decoding measured where the decoding target was set (an Intel machine); the
# decoding target uses it when torchscale is not installed.
TORCHSCALE_DECODE_REFERENCE = 28.0


@dataclasses.dataclass(frozen=True)
class Suite:
  """What a suite measures: the model size, the training shape, the sweeps and the repetitions."""
  size: dict[str, int]  # model fields set on configs/retnet.py:small
  seq_len: int
  batch_size: int
  rounds: int  # timed rounds after the warm-up: ceilings and training
  sweep_rounds: int  # for the sequence-length sweeps
  decode_rounds: int  # for decoding (each run times two decode calls)
  lengths: tuple[int, ...]  # sequence lengths of the forward sweep (batch 1)
  train_lengths: tuple[int, ...]  # sequence lengths of the training-step sweep (batch 1)
  quadratic_max_len: int  # the sweeps of the quadratic forms (parallel retention, attention) stop here
  prompt_len: int  # prompt before decoding at batch 1 and at `decode_batch`
  decode_batch: int
  new_tokens: int
  contexts: tuple[int, ...]  # prompt lengths of the latency-vs-context sweep (batch 1)
  long_train_len: int  # chunkwise training of one sequence this long, whole and in segments (batch 1)
  segment_len: int  # train.segment_len of the segmented long training step
  matmul_size: int


SUITES = {
    "quick": Suite(size=dict(d_model=64, num_layers=1, num_heads=2, value_dim=128, ffn_dim=128, vocab_size=256,
                             chunk_size=16),
                   seq_len=64, batch_size=4, rounds=2, sweep_rounds=2, decode_rounds=2, lengths=(32, 64),
                   train_lengths=(32,), quadratic_max_len=64, prompt_len=16, decode_batch=32, new_tokens=8,
                   contexts=(16, 32), long_train_len=256, segment_len=64, matmul_size=256),
    "full": Suite(size=dict(d_model=512, num_layers=6, num_heads=4, value_dim=1024, ffn_dim=1024, vocab_size=256,
                            chunk_size=128),
                  seq_len=512, batch_size=8, rounds=3, sweep_rounds=2, decode_rounds=4,
                  lengths=(512, 1024, 2048, 4096, 8192, 16384), train_lengths=(512, 1024, 2048, 4096),
                  quadratic_max_len=4096, prompt_len=2048, decode_batch=32, new_tokens=64,
                  contexts=(128, 512, 2048, 8192), long_train_len=16384, segment_len=2048, matmul_size=2048),
}

_CONFIG = config_flags.DEFINE_config_file("config", "configs/retnet.py:small", "Base config; the suite sets its "
                                          "model size and training shape.", lock_config=True)
# Config fields each case sets itself: overriding them with --config.X would be silently undone.
SUITE_CONFIG_FLAGS = tuple(f"--config.model.{name}" for name in SIZE_FIELDS) + (
    "--config.model.dtype", "--config.train.mode", "--config.train.seq_len", "--config.train.batch_size",
    "--config.train.grad_accum_steps")
_SUITE = flags.DEFINE_enum("suite", "quick", list(SUITES),
                           "quick: tiny sizes (about 100 s on 2 cores); full: the preset below.")
_OUT = flags.DEFINE_string("out", "runs/benchmark", "Output folder for results.json, results.md and plots.")
_SIZE = {name: flags.DEFINE_integer(name, None, f"model.{name} (default: the suite's)") for name in SIZE_FIELDS}
_SEQ_LEN = flags.DEFINE_integer("seq_len", None, "Training sequence length (default: the suite's).", lower_bound=1)
_BATCH_SIZE = flags.DEFINE_integer("batch_size", None, "Training batch size (default: the suite's).", lower_bound=1)
_INFERENCE_DEVICES = flags.DEFINE_integer(
    "inference_devices", None, "Devices of the tensor-parallel mesh (heads, FFN and vocabulary split) that the "
    "forward sweep and decoding run on. Default: all, at most as many as split those evenly. On the CPU backend "
    "the benchmark makes one JAX device per core unless JAX_NUM_CPU_DEVICES or XLA_FLAGS set a count.")


# ----------------------------------------------------------------------------------------------- measuring

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


def interleave(cases: dict[str, Case], rounds: int, source: str) -> dict[str, Case]:
  """Warms up every case (recording its first run's time and peak memory), then times rounds of one run each.

  Every run starts after a pause of SETTLE_S, so that the previous run's worker threads (XLA's, torch's OpenMP
  threads) have gone idle: torch's OpenMP barriers slow down many-fold while another thread holds a core.
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
    for name, case in cases.items():
      time.sleep(SETTLE_S)
      seconds[name].extend(case.run())
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
  return np.random.default_rng(seed).integers(0, vocab, (batch, length)).astype(np.int32)


def rate(units: float, seconds: dict[str, float]) -> dict[str, float]:
  """`units` per second from a time spread (the fastest run gives the max)."""
  return {"median": units / seconds["median"], "min": units / seconds["max"], "max": units / seconds["min"],
          "runs": seconds["runs"]}


# ----------------------------------------------------------------------------------------------- the cases

def make_config(base, suite: Suite, dtype: str, mode: str, seq_len: int, batch_size: int):
  config = base.copy_and_resolve_references()
  config.model.update(suite.size)
  config.model.dtype = dtype
  config.train.update(dict(mode=mode, seq_len=seq_len, batch_size=batch_size, grad_accum_steps=1))
  return config


def _train_case(step, state, batch, compile_s: float, buffers: int | None) -> Case:
  holder = {"state": state}

  def one_step():
    holder["state"], _ = step(holder["state"], batch)
    jax.block_until_ready(holder["state"])

  return Case(timed(one_step), {"compile_s": compile_s, "compiled_bytes": buffers})


_INITIAL_STATES: dict[str, Any] = {}


def retnet_train_case(config, mesh) -> Case:
  """The training loop's own jitted train step (`train.setup`), compiled ahead of time.

  The initial state depends on neither the form, the dtype nor the shape, so it is initialised (compiled) once
  per model size and copied.
  """
  run = train.setup(config, mesh)
  key = json.dumps({k: v for k, v in config.model.to_dict().items() if k not in train.RESUMABLE_MODEL_CHANGES},
                   sort_keys=True)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(run.rules):
    if key not in _INITIAL_STATES:
      _INITIAL_STATES[key] = run.init()
    state = jax.tree.map(jnp.copy, _INITIAL_STATES[key])
    batch = jax.device_put(random_tokens(config.train.batch_size, config.train.seq_len + 1,
                                         config.model.vocab_size), run.batch_sharding)
    step, compile_s, buffers = compile_timed(run.train_step, state, batch)
  return _train_case(step, state, batch, compile_s, buffers)


def transformer_train_case(config, mesh) -> Case:
  """The same train step (`train.make_train_step`, config.train.mode parallel) around a same-size Transformer."""
  model = transformer.Transformer(transformer.transformer_config(config.model, config.train.seq_len),
                                  rngs=nnx.Rngs(config.seed))
  graphdef, params = nnx.split(model)
  tx = optimizer.make_optimizer(config.train)
  # Besides params and opt_state the train state holds step counters; their values do not change the timing.
  counters = {k: jnp.zeros(a.shape, a.dtype) for k, a in train.setup(config, mesh).abstract_state.items()
              if k not in ("params", "opt_state")}
  state = {"params": params, "opt_state": tx.init(params), **counters}
  batch = jnp.asarray(random_tokens(config.train.batch_size, config.train.seq_len + 1, config.model.vocab_size))
  step_fn = jax.jit(train.make_train_step(graphdef, tx, config.train), donate_argnums=0)
  step, compile_s, buffers = compile_timed(step_fn, state, batch)
  return _train_case(step, state, batch, compile_s, buffers)


@dataclasses.dataclass(frozen=True)
class Inference:
  """Where the forward sweep and decoding run: a mesh whose `tensor` axis splits heads, FFN and vocabulary.

  On a CPU, XLA runs some of a step's ops on one core (the decoding state reads, docs/benchmarks.md log entry
  23); with one JAX device per core, each device runs its share of the heads on its own core (entry 24).
  Training stays on one device: it gained nothing there.
  """
  mesh: jax.sharding.Mesh
  rules: tuple[tuple[str, Any], ...]

  @classmethod
  def create(cls, config, requested: int | None) -> Inference:
    devices, names = jax.devices(), tuple(config.mesh.axis_names)
    widths = {name: config.model[name] for name in ("num_heads", "ffn_dim", "vocab_size")}
    if "tensor" not in names:
      raise app.UsageError(f"mesh.axis_names={names} has no 'tensor' axis for the inference mesh.")
    if requested is None:
      count = max(n for n in range(1, len(devices) + 1) if all(w % n == 0 for w in widths.values()))
    elif not 1 <= requested <= len(devices) or any(w % requested for w in widths.values()):
      raise app.UsageError(f"--inference_devices={requested}: choose 1 to {len(devices)} (the devices present) "
                           f"that divides each of {widths}.")
    else:
      count = requested
    mesh_cfg = config.mesh.copy_and_resolve_references()
    mesh_cfg.shape = tuple(count if name == "tensor" else 1 for name in names)
    return cls(sharding.make_mesh(mesh_cfg, devices[:count]), sharding.logical_rules(config.mesh))

  def place(self, model: nnx.Module) -> nnx.Module:
    return sharding.shard_model(model, self.mesh, self.rules)


def forward_case(model, mode: str, length: int, mesh: jax.sharding.Mesh) -> Case:
  """Logits of one sequence of `length` tokens, by a model placed on `mesh` (`sharding.shard_model`)."""
  graphdef, params = nnx.split(model)
  forward = jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens, mode=mode)[0])
  tokens = jax.device_put(random_tokens(1, length, model.config.vocab_size), NamedSharding(mesh, P()))
  compiled, compile_s, buffers = compile_timed(forward, params, tokens, devices=mesh.size)
  return Case(timed(lambda: compiled(params, tokens).block_until_ready()),
              {"compile_s": compile_s, "compiled_bytes": buffers}, devices=mesh.size)


def state_bytes(model, batch: int) -> int:
  """Bytes of the decoding state (RetNet: retention states; Transformer: the KV cache)."""
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(lambda: model.init_state(batch))))


def decode_case(model, batch: int, context: int, new_tokens: int, prefill_mode: str) -> Case:
  """Greedy `sampling.decode` of `new_tokens` after a `context`-token prompt, prefilled once here (not timed):
  each run decodes twice, each unit is one call's time per token."""
  prompts = random_tokens(batch, context, model.config.vocab_size, seed=1)
  prefilled = sampling.prefill(model, prompts, np.full((batch,), context, np.int32), prefill_mode=prefill_mode)
  decode = lambda: sampling.decode(model, prefilled, max_new_tokens=new_tokens, key=jax.random.key(0),
                                   temperature=0.0)
  decode()  # compiles here, so that the warm-up run's memory is that of decoding alone

  def run():
    return [s / new_tokens for s in timed(decode, repeats=2)()]

  devices = max(len(x.sharding.device_set) for x in jax.tree.leaves(nnx.state(model)))
  return Case(run, {"state_bytes": state_bytes(model, batch)}, devices=devices)


class _TorchscaleCases:
  """Builds and runs torchscale cases; lives in the worker process (see `Torchscale`)."""

  def __init__(self, model_cfg: dict[str, Any]):
    self.cfg = types.SimpleNamespace(**model_cfg)
    import torch
    self.torch = torch
    self._config, self._decoder = convert.torchscale_classes()
    self.torch.set_num_threads(os.cpu_count())
    self.note = (f"torch {self.torch.__version__} with {self.torch.get_num_threads()} threads, in a worker process "
                 "with the default malloc settings")

  def model(self, mode: str):
    c = self.cfg
    args = self._config(vocab_size=c.vocab_size, decoder_embed_dim=c.d_model, decoder_value_embed_dim=c.value_dim,
                        decoder_retention_heads=c.num_heads, decoder_ffn_embed_dim=c.ffn_dim,
                        decoder_layers=c.num_layers, activation_fn="gelu", dropout=0.0, drop_path_rate=0.0,
                        chunkwise_recurrent=mode == "chunkwise", recurrent_chunk_size=c.chunk_size,
                        layernorm_eps=c.norm_eps, share_decoder_input_output_embed=c.tie_embeddings)
    return self._decoder(args, self.torch.nn.Embedding(c.vocab_size, c.d_model))

  def train_case(self, mode: str, train_cfg: dict[str, Any]) -> Case:
    """A training step: loss, backward, clipping, AdamW with our hyper-parameters."""
    torch, t = self.torch, types.SimpleNamespace(**train_cfg)
    model = self.model(mode).train()
    opt = torch.optim.AdamW(model.parameters(), lr=t.learning_rate, betas=(t.b1, t.b2), weight_decay=t.weight_decay)
    tokens = torch.from_numpy(random_tokens(t.batch_size, t.seq_len + 1, self.cfg.vocab_size)).long()

    def one_step():
      logits = model(tokens[:, :-1])[0]
      loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
      opt.zero_grad(set_to_none=True)
      loss.backward()
      torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip_norm)
      opt.step()

    return Case(timed(one_step))

  def decode_case(self, new_tokens: int) -> Case:
    """Incremental (recurrent) greedy decoding at batch 1; each unit is one token's time."""
    torch = self.torch
    model = self.model("parallel").eval()

    def run():
      tokens, state, stamps = torch.zeros((1, 1), dtype=torch.long), {}, []
      with torch.no_grad():
        for _ in range(new_tokens):
          logits = model(tokens, incremental_state=state)[0]
          tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
          stamps.append(time.perf_counter())
      return np.diff(stamps).tolist()

    return Case(run)


def _torchscale_worker(conn, model_cfg: dict[str, Any], source: str) -> None:
  """The worker process's loop: ("train", name, mode, train_cfg) / ("decode", name, new_tokens) build a case,
  ("run", name) times it once, ("memory", name) runs it once for its peak memory; replies ("ok", value) or
  ("error", text)."""
  try:
    cases, harness = {}, _TorchscaleCases(model_cfg)
    conn.send(("ok", harness.note))
  except ImportError as error:
    conn.send(("error", f"torchscale not measured: {error}"))
    return
  while True:
    command, name, *args = conn.recv()
    try:
      if command == "train":
        cases[name], value = harness.train_case(*args), None
      elif command == "decode":
        cases[name], value = harness.decode_case(*args), None
      elif command == "run":
        value = cases[name].run()
      elif command == "memory":
        value = peak_memory(cases[name].run, source)
      else:  # "stop"
        conn.send(("ok", None))
        return
      conn.send(("ok", value))
    except Exception as error:  # reported to the caller, which raises it with the worker's message
      conn.send(("error", f"{type(error).__name__}: {error}"))


class Torchscale:
  """torchscale's RetNet (the official implementation) at our configuration, when torch and torchscale import.

  Its cases run in a worker process, started with `spawn`, that the benchmark drives step by step, so they still
  alternate with ours in one run while each library keeps its own threads and malloc settings:
  `host_memory.keep_freed_memory` changes malloc for a whole process, and torchscale is measured as shipped.
  """

  def __init__(self, model_cfg, source: str):
    self.available, self.note = False, "torchscale not measured: "
    missing = [name for name in ("torch", "torchscale") if importlib.util.find_spec(name) is None]
    if missing:
      self.note += (f"{' and '.join(missing)} not installed (pip install -e '.[torch]' && "
                    "pip install --no-deps torchscale==0.3.0)")
      return
    context = multiprocessing.get_context("spawn")
    self._conn, child = context.Pipe()
    # Peak memory in the worker is its own RSS; a device-memory source would describe this process's device.
    worker_source = source if "RSS" in source else "process RSS high-water mark (resource.getrusage ru_maxrss)"
    self._process = context.Process(target=_torchscale_worker, args=(child, model_cfg.to_dict(), worker_source),
                                    daemon=True)
    self._process.start()
    reply, value = self._conn.recv()
    self.available, self.note = reply == "ok", value
    self._names = 0

  def _call(self, *message):
    self._conn.send(message)
    reply, value = self._conn.recv()
    if reply != "ok":
      raise RuntimeError(f"torchscale worker: {value}")
    return value

  def _case(self, *build) -> Case:
    self._names += 1
    name = str(self._names)
    self._call(build[0], name, *build[1:])
    return Case(lambda: self._call("run", name), measure_memory=lambda: self._call("memory", name))

  def train_case(self, mode: str, train_cfg) -> Case:
    fields = ("learning_rate", "b1", "b2", "weight_decay", "batch_size", "seq_len", "grad_clip_norm")
    return self._case("train", mode, {k: train_cfg[k] for k in fields})

  def decode_case(self, new_tokens: int) -> Case:
    return self._case("decode", new_tokens)

  def close(self) -> None:
    if self.available:
      self._call("stop", "")
      self._process.join()


# ----------------------------------------------------------------------------------------------- sections

def matmul_case(dtype, size: int) -> Case:
  """The float32 / bfloat16 matmul ceiling: `flops.measure_matmul_flops` (the training loop's MFU denominator);
  a unit is the median time of one `size`^2 matmul."""
  return Case(lambda: [2 * size**3 / flops.measure_matmul_flops(dtype, size)], {"size": size})


def read_case(num_floats: int) -> Case:
  """The memory read bandwidth: a reduction over `num_floats` float32 (the model's parameter bytes)."""
  data = jnp.ones((num_floats,), jnp.float32)
  total, _, _ = compile_timed(jax.jit(jnp.sum), data)
  return Case(timed(lambda: total(data).block_until_ready(), repeats=10), {"bytes": data.nbytes})


def measure_training(base, suite: Suite, mesh, torchscale: Torchscale, source: str
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
  """Train-step throughput and MFU per model / form / dtype, interleaved with the matmul ceilings they are
  divided by: (results per case, matmul FLOP/s per dtype)."""
  cases, flops_per_token = {f"matmul/{name}": matmul_case(dtype, suite.matmul_size) for name, dtype in DTYPES.items()}, {}
  for dtype in DTYPES:
    for mode in ("parallel", "chunkwise"):
      config = make_config(base, suite, dtype, mode, suite.seq_len, suite.batch_size)
      cases[f"retnet/{mode}/{dtype}"] = retnet_train_case(config, mesh)
      flops_per_token[f"retnet/{mode}/{dtype}"] = flops.train_flops_per_token(config.model, suite.seq_len, mode)
    config = make_config(base, suite, dtype, "parallel", suite.seq_len, suite.batch_size)
    cases[f"transformer/parallel/{dtype}"] = transformer_train_case(config, mesh)
    flops_per_token[f"transformer/parallel/{dtype}"] = transformer.train_flops_per_token(
        transformer.transformer_config(config.model, suite.seq_len), suite.seq_len)
  if torchscale.available:
    for mode in ("parallel", "chunkwise"):
      config = make_config(base, suite, "float32", mode, suite.seq_len, suite.batch_size)
      cases[f"torchscale/{mode}/float32"] = torchscale.train_case(mode, config.train)
      flops_per_token[f"torchscale/{mode}/float32"] = flops_per_token[f"retnet/{mode}/float32"]
  print(f"training: {len(cases)} cases, batch {suite.batch_size} x {suite.seq_len} tokens", flush=True)
  interleave(cases, suite.rounds, source)
  matmul = {name: rate(2 * suite.matmul_size**3, cases.pop(f"matmul/{name}").info["seconds"]) for name in DTYPES}
  tokens = suite.batch_size * suite.seq_len
  results = {}
  for name, case in cases.items():
    dtype = name.rsplit("/", 1)[1]
    throughput = rate(tokens, case.info["seconds"])
    results[name] = {"tokens_per_s": throughput, "step_s": case.info["seconds"],
                     "compile_s": case.info.get("compile_s"), "first_run_s": case.info["first_run_s"],
                     "memory": case.info["memory"], "compiled_bytes": case.info.get("compiled_bytes"),
                     "flops_per_token": flops_per_token[name],
                     "mfu": throughput["median"] * flops_per_token[name] / matmul[dtype]["median"]}
  return results, matmul


def _growth(points: list[dict], value: Callable[[dict], float | None]) -> float | None:
  """Exponent p of value ~ length^p between the two longest lengths (1: linear, 2: quadratic)."""
  if len(points) < 2 or not all(value(p) for p in points[-2:]):
    return None
  a, b = points[-2], points[-1]
  return math.log(value(b) / value(a)) / math.log(b["seq_len"] / a["seq_len"])


def _crossover(parallel: list[dict], chunkwise: list[dict]) -> int | None:
  """The shortest length from which the chunkwise form is faster at every longer length measured by both."""
  chunk_time = {p["seq_len"]: p["seconds"]["median"] for p in chunkwise}
  both = [(p["seq_len"], p["seconds"]["median"] < chunk_time[p["seq_len"]]) for p in parallel
          if p["seq_len"] in chunk_time]
  crossover = None
  for length, parallel_faster in reversed(both):
    if parallel_faster:
      break
    crossover = length
  return crossover


def measure_lengths(base, suite: Suite, mesh, inference: Inference, source: str) -> dict[str, Any]:
  """Time and peak memory vs sequence length at batch 1, the forms interleaved at each length: the forward pass
  of RetNet (parallel, chunkwise) and the Transformer on the inference mesh, and RetNet's training step."""
  config = make_config(base, suite, "float32", "parallel", suite.seq_len, 1)
  retnet = inference.place(RetNet(config.model, rngs=nnx.Rngs(config.seed)))
  builders = {
      "forward": {
          "retnet/parallel": lambda length: forward_case(retnet, "parallel", length, inference.mesh),
          "retnet/chunkwise": lambda length: forward_case(retnet, "chunkwise", length, inference.mesh),
          "transformer/parallel": lambda length: forward_case(inference.place(transformer.Transformer(
              transformer.transformer_config(config.model, length), rngs=nnx.Rngs(config.seed))), "parallel", length,
              inference.mesh)},
      "train": {f"retnet/{mode}": lambda length, mode=mode: retnet_train_case(
          make_config(base, suite, "float32", mode, length, 1), mesh) for mode in ("parallel", "chunkwise")}}
  results: dict[str, Any] = {}
  for kind, lengths in (("forward", suite.lengths), ("train", suite.train_lengths)):
    results[kind] = {name: [] for name in builders[kind]}
    for length in lengths:
      cases = {name: build(length) for name, build in builders[kind].items()
               if name.endswith("chunkwise") or length <= suite.quadratic_max_len}
      print(f"{kind} at {length} tokens: {', '.join(cases)}", flush=True)
      for name, case in interleave(cases, suite.sweep_rounds, source).items():
        results[kind][name].append({"seq_len": length, **case.info})
    results[f"{kind}_analysis"] = {
        "crossover_seq_len": _crossover(results[kind]["retnet/parallel"], results[kind]["retnet/chunkwise"]),
        "time_growth_exponent": {name: _growth(points, lambda p: p["seconds"]["median"])
                                 for name, points in results[kind].items()},
        "compiled_bytes_growth_exponent": {name: _growth(points, lambda p: p["compiled_bytes"])
                                           for name, points in results[kind].items()}}
  return results


def measure_long_training(base, suite: Suite, mesh, source: str) -> dict[str, Any]:
  """Chunkwise training of one `long_train_len`-token sequence: the whole-sequence step compiled only (its XLA
  buffers; running it would need them as memory), the `train.segment_len` step compiled, run and timed."""
  whole = make_config(base, suite, "float32", "chunkwise", suite.long_train_len, 1)
  segmented = whole.copy_and_resolve_references()
  segmented.train.segment_len = suite.segment_len
  run = train.setup(whole, mesh)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(run.rules):
    batch = jax.ShapeDtypeStruct((1, suite.long_train_len + 1), jnp.int32, sharding=run.batch_sharding)
    _, whole_compile_s, whole_bytes = compile_timed(run.train_step, run.abstract_state, batch)
  print(f"long training: {suite.long_train_len} tokens, whole sequence compiled ({_fmt(whole_bytes, 'B')} XLA), "
        f"segments of {suite.segment_len} timed", flush=True)
  case = interleave({"segmented": retnet_train_case(segmented, mesh)}, suite.sweep_rounds, source)["segmented"]
  return {"seq_len": suite.long_train_len, "segment_len": suite.segment_len,
          "whole": {"compile_s": whole_compile_s, "compiled_bytes": whole_bytes},
          "segmented": {"tokens_per_s": rate(suite.long_train_len, case.info["seconds"]),
                        "step_s": case.info["seconds"], "compile_s": case.info["compile_s"],
                        "first_run_s": case.info["first_run_s"], "memory": case.info["memory"],
                        "compiled_bytes": case.info["compiled_bytes"]}}


def measure_decoding(base, suite: Suite, matmul, torchscale: Torchscale, inference: Inference, source: str
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
  """Greedy decoding on the inference mesh: tokens/s at batch 1 and `decode_batch`, per-token latency vs
  context, interleaved with the read bandwidth of the weight-read floor: (results, read bytes/s)."""
  config = make_config(base, suite, "float32", "chunkwise", suite.seq_len, 1)
  retnet = inference.place(RetNet(config.model, rngs=nnx.Rngs(config.seed)))
  param_bytes = 4 * sum(x.size for x in jax.tree.leaves(nnx.state(retnet, nnx.Param)))
  contexts = sorted(set(suite.contexts) | {suite.prompt_len})
  cases, models = {"memory_read": read_case(param_bytes // 4)}, {"retnet": lambda context: retnet}
  # A preallocated KV cache as long as the prompt and the new tokens: attention reads what the context needs.
  models["transformer"] = lambda context: inference.place(transformer.Transformer(
      transformer.transformer_config(config.model, context + suite.new_tokens), rngs=nnx.Rngs(config.seed)))
  for name, model_at in models.items():
    prefill = "chunkwise" if name == "retnet" else "parallel"
    for context in contexts:
      cases[f"{name}/batch_1/{context}"] = decode_case(model_at(context), 1, context, suite.new_tokens, prefill)
    cases[f"{name}/batch_{suite.decode_batch}/{suite.prompt_len}"] = decode_case(
        model_at(suite.prompt_len), suite.decode_batch, suite.prompt_len, suite.new_tokens, prefill)
  if torchscale.available:
    cases["torchscale/batch_1"] = torchscale.decode_case(suite.new_tokens)
  print(f"decoding: {len(cases)} cases, {suite.new_tokens} new tokens each", flush=True)
  interleave(cases, suite.decode_rounds, source)
  read = rate(param_bytes, cases.pop("memory_read").info["seconds"])
  forward_flops = 2 * flops.matmul_params(config.model) + flops.retention_flops_per_token(config.model, 1,
                                                                                          "recurrent")
  results: dict[str, Any] = {"throughput": {}, "latency": {}, "latency_ratio": {}, "large_batch": {}}
  for name in models:
    results["latency"][name] = [
        {"context": c, "latency_s": cases[f"{name}/batch_1/{c}"].info["seconds"],
         "state_bytes": cases[f"{name}/batch_1/{c}"].info["state_bytes"],
         "memory": cases[f"{name}/batch_1/{c}"].info["memory"],
         "first_call_s": cases[f"{name}/batch_1/{c}"].info["first_run_s"]} for c in contexts]
    latency = {p["context"]: p["latency_s"]["median"] for p in results["latency"][name]}
    results["latency_ratio"][name] = latency[contexts[-1]] / latency[contexts[0]]
    large = cases[f"{name}/batch_{suite.decode_batch}/{suite.prompt_len}"].info
    results["throughput"][name] = {
        "batch_1": rate(1, cases[f"{name}/batch_1/{suite.prompt_len}"].info["seconds"]),
        f"batch_{suite.decode_batch}": rate(suite.decode_batch, large["seconds"])}
    results["large_batch"][name] = {"batch": suite.decode_batch, "state_bytes": large["state_bytes"],
                                    "memory": large["memory"], "first_call_s": large["first_run_s"]}
  if torchscale.available:
    results["throughput"]["torchscale"] = {"batch_1": rate(1, cases["torchscale/batch_1"].info["seconds"])}
  bandwidth = read["median"]
  ours = results["throughput"]["retnet"]
  results.update(
      prompt_len=suite.prompt_len, new_tokens=suite.new_tokens, latency_contexts=contexts,
      param_bytes=param_bytes, weight_read_floor_s=param_bytes / bandwidth,
      weight_read_floor_tokens_per_s=bandwidth / param_bytes,
      batch_1_over_floor=ours["batch_1"]["median"] * param_bytes / bandwidth,
      forward_flops_per_token=forward_flops,
      large_batch_flops_per_s=ours[f"batch_{suite.decode_batch}"]["median"] * forward_flops)
  results["large_batch_fraction_of_matmul_ceiling"] = (
      results["large_batch_flops_per_s"] / matmul["float32"]["median"])
  return results, read


def torchscale_ratios(training, decoding, torchscale: Torchscale) -> dict[str, Any]:
  if not torchscale.available:
    return {"available": False, "note": torchscale.note, "ratios": {}}
  ratios = {f"train_{mode}": training[f"retnet/{mode}/float32"]["tokens_per_s"]["median"]
            / training[f"torchscale/{mode}/float32"]["tokens_per_s"]["median"] for mode in ("parallel", "chunkwise")}
  ratios["decode_batch_1"] = (decoding["throughput"]["retnet"]["batch_1"]["median"]
                              / decoding["throughput"]["torchscale"]["batch_1"]["median"])
  return {"available": True, "note": torchscale.note, "ratios": ratios}


def check_targets(results) -> list[dict[str, Any]]:
  """The issue's performance targets, each with the measured value and whether it is met."""
  training, decoding, long = results["training"], results["decoding"], results["long_training"]
  forward_longest = results["lengths"]["forward"]["retnet/chunkwise"][-1]
  theirs = decoding["throughput"].get("torchscale", {}).get("batch_1", {}).get("median", TORCHSCALE_DECODE_REFERENCE)
  batch_1 = decoding["throughput"]["retnet"]["batch_1"]["median"]
  targets = [
      ("float32 training (parallel) >= 75% of the float32 matmul ceiling",
       training["retnet/parallel/float32"]["mfu"], lambda v: v >= 0.75),
      ("float32 training (chunkwise) >= 75% of the float32 matmul ceiling",
       training["retnet/chunkwise/float32"]["mfu"], lambda v: v >= 0.75),
      (f"decoding batch 1 >= 6 x torchscale ({theirs:.1f} tok/s)", batch_1 / theirs, lambda v: v >= 6),
      ("decoding batch 1 within 2 x of the weight-read floor", decoding["batch_1_over_floor"], lambda v: v >= 0.5),
      ("per-token latency flat: longest / shortest context < 1.1", decoding["latency_ratio"]["retnet"],
       lambda v: v < 1.1),
      ("chunkwise forward memory linear: XLA buffers grow as L^p, p < 1.2",
       results["lengths"]["forward_analysis"]["compiled_bytes_growth_exponent"]["retnet/chunkwise"],
       lambda v: v is not None and v < 1.2),
      (f"chunkwise forward at {forward_longest['seq_len']} tokens >= 1,800 tokens/s",
       forward_longest["seq_len"] / forward_longest["seconds"]["median"], lambda v: v >= 1800),
      (f"chunkwise training at {long['seq_len']} tokens (train.segment_len={long['segment_len']}) under 4 GB: "
       "peak memory, GB", long["segmented"]["memory"]["peak_bytes"] / 1e9, lambda v: v < 4),
  ]
  return [{"target": name, "value": value, "met": bool(test(value))} for name, value, test in targets]


# ----------------------------------------------------------------------------------------------- reporting

def _prefix(x: float, unit: str) -> tuple[float, str]:
  """(factor, SI prefix) to print `x` in `unit`; none for a unitless number."""
  return next(((f, p) for f, p in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")) if unit and abs(x) >= f),
              (1.0, ""))


def _fmt(x: float | None, unit: str = "") -> str:
  if x is None:
    return "-"
  factor, prefix = _prefix(x, unit)
  return f"{x / factor:.3g} {prefix}{unit}".strip()


def _range(s: dict[str, float], unit: str = "", scale: float = 1.0) -> str:
  """`median [min-max]`, the range in the median's unit prefix."""
  median, low, high = (s[k] * scale for k in ("median", "min", "max"))
  factor, _ = _prefix(median, unit)
  return f"{_fmt(median, unit)} [{low / factor:.3g}-{high / factor:.3g}]"


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def to_markdown(results) -> str:
  meta, ceilings = results["meta"], results["ceilings"]
  lines = [f"# Benchmark ({meta['suite']} suite)", "",
           f"`{meta['command']}` on {meta['machine']}, {meta['date']}; jax {meta['jax']}. Model: "
           + ", ".join(f"{k} {v}" for k, v in meta["size"].items())
           + f" ({meta['params']:,} parameters); training batch {meta['batch_size']} x {meta['seq_len']} on one "
           f"device; the forward sweep and decoding on {meta['inference_devices']} (tensor-parallel). "
           f"Medians [min-max] over timed runs after a warm-up. Peak memory: {meta['memory_source']}, "
           "(+ the part above the memory in use before the call); XLA buffers: the compiled program's arguments "
           "+ temporaries + outputs, summed over its devices. Load average (1, 5, 15 min) at start "
           f"{', '.join(f'{x:.1f}' for x in meta['load_average_start'])}, at end "
           f"{', '.join(f'{x:.1f}' for x in meta['load_average_end'])}: other processes share the cores when "
           "it exceeds ~1.", "", "## Ceilings", "",
           "Measured interleaved with what they are compared to: the matmuls with the training steps, the read "
           "bandwidth with the decoding runs.", ""]
  lines += _table(["ceiling", "median [min-max]"], [
      [f"matmul {name} ({ceilings['matmul_size']}^2)", _range(s, "FLOP/s")]
      for name, s in ceilings["matmul_flops"].items()] + [
      [f"memory read ({_fmt(ceilings['read_array_bytes'], 'B')} reduction)",
       _range(ceilings["memory_read_bytes_per_s"], "B/s")]])
  lines += ["", "## Training step", ""]
  lines += _table(["model/form/dtype", "tokens/s", "step s", "compile s", "peak memory", "XLA buffers", "MFU"], [
      [name, _range(r["tokens_per_s"]), _range(r["step_s"]), _fmt(r["compile_s"]),
       f"{_fmt(r['memory']['peak_bytes'], 'B')} (+{_fmt(r['memory']['above_start_bytes'], 'B')})",
       _fmt(r["compiled_bytes"], "B"), f"{r['mfu']:.1%}"]
      for name, r in results["training"].items()])
  ts = results["torchscale"]
  lines += ["", "## torchscale (official implementation), same configuration", "", ts["note"], ""]
  if ts["ratios"]:
    lines += _table(["ours / theirs", "ratio"], [[k, f"{v:.2f}x"] for k, v in ts["ratios"].items()])
  for kind in ("forward", "train"):
    sweep, analysis = results["lengths"][kind], results["lengths"][f"{kind}_analysis"]
    lengths = sorted({p["seq_len"] for points in sweep.values() for p in points})
    by = {name: {p["seq_len"]: p for p in points} for name, points in sweep.items()}
    cell = lambda p: "-" if p is None else (f"{_range(p['seconds'], 's')}, {_fmt(p['memory']['peak_bytes'], 'B')} peak "
                                            f"(+{_fmt(p['memory']['above_start_bytes'], 'B')}), "
                                            f"{_fmt(p['compiled_bytes'], 'B')} XLA")
    lines += ["", f"## {kind.capitalize()} vs sequence length (batch 1)", ""]
    lines += _table(["tokens"] + list(sweep), [[n] + [cell(by[name].get(n)) for name in sweep] for n in lengths])
    lines += ["", (f"Chunkwise faster than parallel from {analysis['crossover_seq_len']} tokens. "
                  if analysis["crossover_seq_len"] else "Chunkwise faster than parallel at none of these lengths. ")
              + "Growth exponent between the two longest lengths (1 linear, 2 quadratic), time: "
              + ", ".join(f"{k} {_fmt(v)}" for k, v in analysis["time_growth_exponent"].items())
              + "; XLA buffers: "
              + ", ".join(f"{k} {_fmt(v)}" for k, v in analysis["compiled_bytes_growth_exponent"].items()) + "."]
  dec = results["decoding"]
  lines += ["", f"## Decoding (greedy `sampling.decode` of {dec['new_tokens']} tokens after a prefilled prompt, "
            "no stream callback)", ""]
  lines += _table(["model", "tokens/s"], [
      [f"{name} {key.replace('_', ' ')}" + (f" after {dec['prompt_len']} tokens" if name != "torchscale" else ""),
       _range(value)]
      for name, entry in dec["throughput"].items() for key, value in entry.items()])
  lines += ["", "Per-token latency vs context (batch 1):", ""]
  names = list(dec["latency"])
  lines += _table(["context"] + [f"{n} ms/token" for n in names] + [f"{n} state" for n in names], [
      [c] + [_range(dec["latency"][n][i]["latency_s"], scale=1e3) for n in names]
      + [_fmt(dec["latency"][n][i]["state_bytes"], "B") for n in names]
      for i, c in enumerate(dec["latency_contexts"])])
  lines += ["", "Latency longest / shortest context: " + ", ".join(
      f"{k} {v:.2f}" for k, v in dec["latency_ratio"].items())
      + f". Weight-read floor: {_fmt(dec['param_bytes'], 'B')} / read bandwidth = {dec['weight_read_floor_s'] * 1e3:.2f}"
      f" ms/token ({dec['weight_read_floor_tokens_per_s']:.0f} tok/s); batch 1 reaches "
      f"{dec['batch_1_over_floor']:.0%} of it. Large batch: {_fmt(dec['large_batch_flops_per_s'], 'FLOP/s')} "
      f"({dec['large_batch_fraction_of_matmul_ceiling']:.0%} of the float32 matmul ceiling). Large-batch "
      "decoding state / peak memory: " + ", ".join(
          f"{k} {_fmt(v['state_bytes'], 'B')} / {_fmt(v['memory']['peak_bytes'], 'B')}"
          for k, v in dec["large_batch"].items()) + "."]
  long, seg = results["long_training"], results["long_training"]["segmented"]
  lines += ["", f"## Chunkwise training of one {long['seq_len']}-token sequence", "",
            f"Whole sequence: {_fmt(long['whole']['compiled_bytes'], 'B')} XLA buffers (compiled only). "
            f"`train.segment_len={long['segment_len']}`: {_fmt(seg['compiled_bytes'], 'B')} XLA buffers, peak memory "
            f"{_fmt(seg['memory']['peak_bytes'], 'B')} (+{_fmt(seg['memory']['above_start_bytes'], 'B')}), "
            f"step {_range(seg['step_s'], 's')}, {_range(seg['tokens_per_s'])} tokens/s."]
  lines += ["", "## Targets", ""]
  lines += _table(["target", "value", "met"], [[t["target"], _fmt(t["value"]), "yes" if t["met"] else "no"]
                                               for t in results["targets"]])
  return "\n".join(lines) + "\n"


def plot(results, out: Path) -> list[str]:
  """PNG plots: time and memory vs length, latency and state vs context, training throughput."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  def lines(ax, series, x, y, title, ylabel, xlabel="tokens"):
    for name, points in series.items():
      ax.plot([p[x] for p in points], [y(p) for p in points], marker="o", label=name)
    ax.set(xscale="log", yscale="log", title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)

  files = []
  for kind in ("forward", "train"):
    sweep = results["lengths"][kind]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    lines(axes[0], sweep, "seq_len", lambda p: p["seconds"]["median"], f"{kind}: time (batch 1)", "seconds")
    lines(axes[1], sweep, "seq_len", lambda p: max(p["memory"]["above_start_bytes"], 2**20) / 2**30,
          f"{kind}: peak memory above the start", "GiB")
    lines(axes[2], {k: v for k, v in sweep.items() if all(p["compiled_bytes"] for p in v)}, "seq_len",
          lambda p: p["compiled_bytes"] / 2**30, f"{kind}: XLA buffers", "GiB")
    files.append(f"{kind}_vs_length.png")
    fig.tight_layout()
    fig.savefig(out / files[-1], dpi=100)
    plt.close(fig)

  latency = results["decoding"]["latency"]
  fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
  lines(axes[0], latency, "context", lambda p: p["latency_s"]["median"] * 1e3, "decoding latency (batch 1)",
        "ms / token", "context tokens")
  lines(axes[1], latency, "context", lambda p: p["state_bytes"] / 2**20, "decoding state (KV cache)", "MiB",
        "context tokens")
  files.append("decoding_vs_context.png")
  fig.tight_layout()
  fig.savefig(out / files[-1], dpi=100)
  plt.close(fig)

  training = results["training"]
  fig, ax = plt.subplots(figsize=(10, 4.5))
  ax.barh(list(training), [r["tokens_per_s"]["median"] for r in training.values()],
          xerr=[[r["tokens_per_s"]["median"] - r["tokens_per_s"]["min"] for r in training.values()],
                [r["tokens_per_s"]["max"] - r["tokens_per_s"]["median"] for r in training.values()]])
  ax.set(xlabel="tokens / s", title="training step throughput")
  files.append("training_throughput.png")
  fig.tight_layout()
  fig.savefig(out / files[-1], dpi=100)
  plt.close(fig)
  return files


# ----------------------------------------------------------------------------------------------- main

def _cpu_name() -> str:
  for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else ():
    if line.startswith("model name"):
      return line.split(":", 1)[1].strip()
  return platform.machine()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if jax.config.jax_num_cpu_devices < 0 and "xla_force_host_platform_device_count" not in os.environ.get(
      "XLA_FLAGS", ""):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    jax.config.update("jax_num_cpu_devices", cores)  # before any device is created
  suite = SUITES[_SUITE.value]
  size = {name: flag.value if flag.value is not None else suite.size[name] for name, flag in _SIZE.items()}
  suite = dataclasses.replace(
      suite, size=size, seq_len=suite.seq_len if _SEQ_LEN.value is None else _SEQ_LEN.value,
      batch_size=suite.batch_size if _BATCH_SIZE.value is None else _BATCH_SIZE.value)
  set_by_suite = [arg.split("=")[0] for arg in sys.argv[1:] if arg.split("=")[0] in SUITE_CONFIG_FLAGS]
  if set_by_suite:
    raise app.UsageError(f"{', '.join(set_by_suite)}: the suite sets these (and runs both dtypes and forms); use "
                         f"--{', --'.join(SIZE_FIELDS)}, --seq_len and --batch_size instead.")
  out = Path(_OUT.value)
  if out.exists() and not out.is_dir():
    raise app.UsageError(f"--out={out} is a file; give a folder for results.json, results.md and the plots.")
  out.mkdir(parents=True, exist_ok=True)
  base = _CONFIG.value
  config = make_config(base, suite, "float32", "parallel", suite.seq_len, suite.batch_size)
  mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
  inference = Inference.create(config, _INFERENCE_DEVICES.value)
  source = memory_source()
  torchscale = Torchscale(config.model, source)
  start = time.perf_counter()
  params = sum(x.size for x in jax.tree.leaves(
      nnx.state(nnx.eval_shape(lambda: RetNet(config.model, rngs=nnx.Rngs(0))), nnx.Param)))
  results: dict[str, Any] = {"meta": {
      "suite": _SUITE.value, "command": " ".join(["python"] + sys.argv),
      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
      "machine": f"{_cpu_name()}, {os.cpu_count()} cores", "jax": jax.__version__,
      "device": str(jax.devices()[0]), "size": size, "params": int(params), "seq_len": suite.seq_len,
      "batch_size": suite.batch_size, "rounds": suite.rounds, "memory_source": source,
      "inference_devices": inference.mesh.size,
      "suite_settings": dataclasses.asdict(suite), "load_average_start": os.getloadavg()}}
  training, matmul = measure_training(base, suite, mesh, torchscale, source)
  lengths = measure_lengths(base, suite, mesh, inference, source)
  long_training = measure_long_training(base, suite, mesh, source)
  decoding, read = measure_decoding(base, suite, matmul, torchscale, inference, source)
  results.update(ceilings={"matmul_flops": matmul, "memory_read_bytes_per_s": read, "matmul_size": suite.matmul_size,
                           "read_array_bytes": 4 * int(params)},
                 training=training, lengths=lengths, long_training=long_training, decoding=decoding)
  results["torchscale"] = torchscale_ratios(results["training"], results["decoding"], torchscale)
  results["targets"] = check_targets(results)
  torchscale.close()
  results["meta"]["total_s"] = time.perf_counter() - start
  results["meta"]["load_average_end"] = os.getloadavg()
  results["meta"]["plots"] = plot(results, out)
  (out / "results.json").write_text(json.dumps(results, indent=2))
  markdown = to_markdown(results)
  (out / "results.md").write_text(markdown)
  print(markdown)
  print(f"wrote {out}/results.json, results.md and {', '.join(results['meta']['plots'])} "
        f"in {results['meta']['total_s']:.0f} s")


if __name__ == "__main__":
  jax.config.config_with_absl()
  app.run(main)
