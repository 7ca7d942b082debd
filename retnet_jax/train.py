"""The training loop: sharded state created in place, a pure jitted `train_step`, evaluation, checkpoints, resume.

    train_and_evaluate(config, workdir)

The train state is the pytree `{"params", "opt_state", "step", "nonfinite_steps", "first_nonfinite_step"}`;
the data position is saved beside it in the checkpoint, so a resumed run sees exactly the batches an
uninterrupted run would. SIGTERM / SIGINT finish the current step, write a checkpoint and return.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from retnet_jax import (checkpointing, data, flops, layers, metrics, model as model_lib, optimizer,
                        preemption, sharding)

TrainState = dict[str, Any]
# Model fields that may change between a checkpoint and its resumption: they do not change the parameters.
RESUMABLE_MODEL_CHANGES = ("dtype", "chunk_size")
# What a non-finite loss or gradient does: skip the update (counted and logged), or stop the run.
NONFINITE_POLICIES = ("stop", "skip")


# Optimizer fields: (test, what the value must be).
_OPTIMIZER_RANGES = {
    "learning_rate": (lambda x: x > 0, "positive"),
    "warmup_steps": (lambda x: x >= 0, "at least 0"),
    "end_lr_fraction": (lambda x: 0 <= x <= 1, "in [0, 1]"),
    "b1": (lambda x: 0 <= x < 1, "in [0, 1)"),
    "b2": (lambda x: 0 <= x < 1, "in [0, 1)"),
    "weight_decay": (lambda x: x >= 0, "at least 0"),
    "grad_clip_norm": (lambda x: x > 0, "positive"),
}


def check_config(config: ml_collections.ConfigDict, num_devices: int) -> None:
  """Checks the config against itself and the devices before any data is read or file written."""
  model_lib.check_model_config(config.model)
  train = config.train
  for name in ("steps", "batch_size", "seq_len", "grad_accum_steps", "log_every_steps", "eval_every_steps",
               "eval_batches"):
    if int(train[name]) < 1:
      raise ValueError(f"train.{name} must be a positive integer; got {train[name]}.")
  for name in ("every_steps", "keep"):
    if int(config.checkpoint[name]) < 1:
      raise ValueError(f"checkpoint.{name} must be a positive integer; got {config.checkpoint[name]}.")
  for name, (valid, requirement) in _OPTIMIZER_RANGES.items():
    if not math.isfinite(train[name]) or not valid(train[name]):
      raise ValueError(f"train.{name} must be {requirement}; got {train[name]}.")
  profile = train.profile_steps
  if profile is not None and (len(profile) != 2 or not 0 <= profile[0] <= profile[1] < train.steps):
    raise ValueError(f"train.profile_steps must be (first, last) with 0 <= first <= last < train.steps="
                     f"{train.steps}; got {profile}.")
  if train.mode not in ("parallel", "chunkwise"):
    raise ValueError(f"train.mode={train.mode!r}; train with 'parallel' or 'chunkwise' (the recurrent form is "
                     "for decoding).")
  if train.nonfinite not in NONFINITE_POLICIES:
    raise ValueError(f"unknown train.nonfinite {train.nonfinite!r}; choose one of {NONFINITE_POLICIES}.")
  if train.remat != "none" and train.remat not in model_lib.REMAT_POLICIES:
    raise ValueError(f"unknown train.remat {train.remat!r}; choose none or one of "
                     f"{tuple(model_lib.REMAT_POLICIES)}.")
  if not isinstance(train.segment_len, int) or train.segment_len < 0:
    raise ValueError(f"train.segment_len must be 0 (whole sequences) or a positive number of tokens; "
                     f"got {train.segment_len!r}.")
  if (train.segment_len and train.mode == "chunkwise" and config.model.stability_norm_style == "torchscale"
      and train.segment_len % config.model.chunk_size):
    raise ValueError(f"train.segment_len={train.segment_len} is not a multiple of model.chunk_size="
                     f"{config.model.chunk_size}: the torchscale-style chunkwise normaliser depends on where chunks "
                     "start; choose a multiple of the chunk size.")
  optimizer.learning_rate_schedule(train)
  if train.batch_size % train.grad_accum_steps:
    raise ValueError(f"train.batch_size={train.batch_size} is not divisible by "
                     f"train.grad_accum_steps={train.grad_accum_steps}; choose a divisor of the batch size.")
  shape = dict(zip(config.mesh.axis_names, sharding.mesh_shape(config.mesh, num_devices)))
  batch_axes = sharding.logical_spec(("batch",), sharding.logical_rules(config.mesh))[0] or ()
  batch_axes = (batch_axes,) if isinstance(batch_axes, str) else batch_axes
  shards = math.prod(shape[a] for a in batch_axes)
  micro_batch = train.batch_size // train.grad_accum_steps
  if micro_batch % shards:
    raise ValueError(f"the micro-batch of {micro_batch} sequences (train.batch_size / train.grad_accum_steps) "
                     f"is not divisible by the {shards} data shards of mesh axes {batch_axes}; choose a batch "
                     "size that is a multiple of the shard count (times grad_accum_steps).")
  if shards % jax.process_count():
    raise ValueError(f"the batch is split into {shards} data shards (mesh axes {batch_axes}) but runs on "
                     f"{jax.process_count()} processes, and each process loads only its own rows: make the sizes of "
                     f"{batch_axes} a multiple of the process count in mesh.shape={tuple(config.mesh.shape)}.")


@dataclasses.dataclass(frozen=True)
class Setup:
  """Everything compiled for one (config, mesh): the state's structure and shardings, and the jitted steps."""
  mesh: jax.sharding.Mesh
  rules: tuple
  graphdef: nnx.GraphDef
  abstract_state: TrainState  # ShapeDtypeStructs carrying the mesh's shardings
  batch_sharding: jax.sharding.NamedSharding
  init: Callable[[], TrainState]
  train_step: Callable[[TrainState, jax.Array], tuple[TrainState, dict[str, jax.Array]]]
  eval_step: Callable[[Any, jax.Array], jax.Array]


def token_loss(graphdef: nnx.GraphDef, params, tokens_BxL1: jax.Array, mode: str, remat: str = "none",
               segment_len: int = 0):
  """Mean next-token cross-entropy (nats) of `tokens [batch, seq + 1]`: inputs [:, :-1], targets [:, 1:].

  `segment_len` in (0, seq): the sequence runs as segments of that many tokens in a `lax.scan` that carries
  the recurrent state, each segment under `jax.checkpoint`, so the backward pass recomputes one segment at a
  time and activation memory grows with the segment, not the sequence. Same loss and gradients to float
  rounding (every form continues a carried state exactly). Unlike a checkpoint per block this also saves memory
  on XLA's CPU backend, which removes the optimisation barriers that keep a block's recomputation apart from
  the forward pass; a loop body's recomputation stays in the backward loop.
  """
  inputs_BxL, targets_BxL = tokens_BxL1[:, :-1], tokens_BxL1[:, 1:]
  batch, length = inputs_BxL.shape
  if not 0 < segment_len < length:
    logits, _ = nnx.merge(graphdef, params)(inputs_BxL, mode=mode, remat=remat)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets_BxL).mean()
  num_segments = -(-length // segment_len)
  # Padding goes after the last token, so (causal) it changes no real position's output; its loss is masked.
  pad = num_segments * segment_len - length
  segments = lambda x_BxL: jnp.pad(x_BxL, ((0, 0), (0, pad))).reshape(
      batch, num_segments, segment_len).swapaxes(0, 1)

  # params enter as an argument, not a closure: a block's own `remat` must see them at this trace level.
  @functools.partial(jax.checkpoint, prevent_cse=False)  # inside a scan, CSE cannot undo the recomputation
  def segment(params, state, xs):
    inputs, targets, weights = xs
    logits, state = nnx.merge(graphdef, params)(inputs, mode=mode, state=state, remat=remat)
    return state, jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, targets) * weights)

  xs = (segments(inputs_BxL), segments(targets_BxL), segments(jnp.ones((batch, length), jnp.float32)))
  _, sums = jax.lax.scan(functools.partial(segment, params), nnx.merge(graphdef, params).init_state(batch), xs)
  return sums.sum() / (batch * length)


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, train_cfg: ml_collections.ConfigDict):
  """A pure `train_step(state, batch) -> (state, metrics)`; micro-batches are accumulated with `lax.scan`."""
  schedule = optimizer.learning_rate_schedule(train_cfg)
  accum = train_cfg.grad_accum_steps
  loss_and_grad = jax.value_and_grad(
      lambda params, tokens: token_loss(graphdef, params, tokens, train_cfg.mode, train_cfg.remat,
                                        train_cfg.segment_len))

  def train_step(state: TrainState, batch_BxL1: jax.Array):
    params = state["params"]
    if accum == 1:
      loss, grads = loss_and_grad(params, batch_BxL1)
    else:
      # Micro-batch i takes rows i, i + accum, ...: each device keeps its own rows (no resharding).
      batch, length = batch_BxL1.shape
      micro_MxBxL1 = batch_BxL1.reshape(batch // accum, accum, length).swapaxes(0, 1)

      def accumulate(carry, tokens):
        loss_sum, grad_sum = carry
        loss, grads = loss_and_grad(params, tokens)
        return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

      zeros = jax.tree.map(jnp.zeros_like, params)
      (loss, grads), _ = jax.lax.scan(accumulate, (jnp.zeros((), jnp.float32), zeros), micro_MxBxL1)
      loss, grads = loss / accum, jax.tree.map(lambda g: g / accum, grads)
    step = state["step"] + 1
    if train_cfg.inject_nonfinite_steps:  # a test hook for the guard below
      loss = jnp.where(jnp.isin(step, jnp.asarray(train_cfg.inject_nonfinite_steps)), jnp.nan, loss)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, opt_state = tx.update(grads, state["opt_state"], params)
    # A non-finite loss or gradient leaves parameters and optimizer state as they were; the step is counted.
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    new_state = {
        "params": keep(optax.apply_updates(params, updates), params),
        "opt_state": keep(opt_state, state["opt_state"]),
        "step": step,
        "nonfinite_steps": state["nonfinite_steps"] + (~finite).astype(jnp.int32),
        "first_nonfinite_step": jnp.where((state["first_nonfinite_step"] < 0) & ~finite, step,
                                          state["first_nonfinite_step"]),
    }
    return new_state, {"loss": loss, "grad_norm": grad_norm, "learning_rate": schedule(state["step"])}

  return train_step


_SETUPS: dict[tuple[str, jax.sharding.Mesh], Setup] = {}


def setup(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> Setup:
  """The Setup for (config, mesh), built once per process, so a resumed or repeated run reuses its compilations."""
  key = (json.dumps({k: config[k].to_dict() for k in ("model", "train", "mesh")} | {"seed": config.seed},
                    sort_keys=True), mesh)
  if key not in _SETUPS:
    _SETUPS[key] = _build_setup(copy.deepcopy(config), mesh)
  return _SETUPS[key]


def _build_setup(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> Setup:
  """Builds the abstract state with shardings and the jitted init, train and eval steps for `mesh`."""
  rules = sharding.logical_rules(config.mesh)
  tx = optimizer.make_optimizer(config.train)

  def init() -> TrainState:
    params = nnx.state(model_lib.RetNet(config.model, rngs=nnx.Rngs(config.seed)), nnx.Param)
    return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32),
            "nonfinite_steps": jnp.zeros((), jnp.int32), "first_nonfinite_step": jnp.full((), -1, jnp.int32)}

  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: model_lib.RetNet(config.model, rngs=nnx.Rngs(0))))
    abstract = jax.eval_shape(init)
  shardings = sharding.tree_shardings(abstract, mesh, rules)
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
  batch_sharding = sharding.batch_sharding(mesh, rules)
  mode = config.train.mode
  return Setup(
      mesh=mesh, rules=rules, graphdef=graphdef, abstract_state=abstract, batch_sharding=batch_sharding,
      init=jax.jit(init, out_shardings=shardings),
      train_step=jax.jit(make_train_step(graphdef, tx, config.train), in_shardings=(shardings, batch_sharding),
                         out_shardings=(shardings, None), donate_argnums=0),
      eval_step=jax.jit(lambda params, batch: token_loss(graphdef, params, batch, mode),
                        in_shardings=(shardings["params"], batch_sharding)))


def evaluate(run: Setup, params, batches: Iterable[jax.Array]) -> float:
  """Mean validation loss (nats per token) over `batches`."""
  with jax.set_mesh(run.mesh), nnx.logical_axis_rules(run.rules):
    losses = [run.eval_step(params, batch) for batch in batches]
  return float(np.mean(jax.device_get(losses)))


def check_compatible(saved: dict, config: ml_collections.ConfigDict, workdir: Path) -> None:
  """Refuses a checkpoint written with another model config, naming the fields (before anything is overwritten)."""
  current = config.model.to_dict()
  differs = sorted(k for k in set(saved) | set(current)
                   if k not in RESUMABLE_MODEL_CHANGES and json.dumps(saved.get(k)) != json.dumps(current.get(k)))
  if differs:
    details = ", ".join(f"model.{k}: checkpoint {saved.get(k)!r} vs config {current.get(k)!r}" for k in differs)
    raise ValueError(f"{workdir} holds a checkpoint of an incompatible model config ({details}); use the model "
                     f"config it was trained with ({workdir / 'config.json'}), or another --workdir for a new run.")


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | os.PathLike) -> dict[str, float]:
  """Trains `config` in `workdir`, resuming from its latest checkpoint; returns the last train/eval metrics."""
  workdir = Path(workdir)
  check_config(config, jax.device_count())
  if workdir.exists() and not workdir.is_dir():
    raise ValueError(f"--workdir={workdir} is a file; choose a directory (new or a run's).")
  tokenizer = data.load_tokenizer(config.data.tokenizer)
  data.check_vocab_size(tokenizer, config.model.vocab_size)
  ckpt_dir = workdir / "checkpoints"
  if ckpt_dir.is_dir():
    with checkpointing.Checkpointer(ckpt_dir) as existing:
      for step in reversed(existing.all_steps()):  # the newest whose meta reads; damaged ones are set aside later
        try:
          saved_model = existing.restore_meta(step)["config"]["model"]
        except Exception:  # orbax raises many kinds for a damaged step folder
          continue
        check_compatible(saved_model, config, workdir)
        break
  train_cfg = config.train
  train_tokens, valid_tokens = data.load_splits(config.data, tokenizer)
  train_sequences = data.pack(train_tokens, train_cfg.seq_len)
  valid_sequences = data.pack(valid_tokens, train_cfg.seq_len)

  mesh = sharding.make_mesh(config.mesh)
  run = setup(config, mesh)
  batches = data.BatchIterator(train_sequences, train_cfg.batch_size, config.seed, run.batch_sharding)
  data.eval_batches(valid_sequences, train_cfg.batch_size // train_cfg.grad_accum_steps, 1)  # enough to evaluate?

  workdir.mkdir(parents=True, exist_ok=True)
  if jax.process_index() == 0:
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
  checkpointer = checkpointing.Checkpointer(ckpt_dir, keep=config.checkpoint.keep,
                                            keep_best=config.checkpoint.keep_best,
                                            async_save=config.checkpoint.async_save)
  writer = metrics.MetricsWriter(workdir)
  try:
    return _train_loop(config, run, batches, valid_sequences, checkpointer, writer, workdir)
  finally:
    checkpointer.close()
    writer.close()


def _restore_or_init(config: ml_collections.ConfigDict, run: Setup, checkpointer: checkpointing.Checkpointer,
                     batches: data.BatchIterator):
  """The latest readable checkpoint's state (an unreadable one is set aside with a warning), else a fresh one."""
  for step in reversed(checkpointer.all_steps()):
    try:
      state, meta = checkpointer.restore(run.abstract_state, step)
    except checkpointing.IncompatibleCheckpointError:
      raise  # another model config: nothing older will fit either
    except Exception as e:  # a damaged checkpoint: orbax raises many kinds
      target = checkpointer.set_aside(step)
      metrics.log(f"WARNING: checkpoint {step} is unreadable ({type(e).__name__}: {e}); moved to {target}, "
                  "trying the previous one")
      continue
    batches.set_state(meta["data"])
    metrics.log(f"resumed from {checkpointer.directory}/{step} (data position {meta['data']})")
    changed = [name for name in ("train.seq_len", "train.batch_size", "seed", "data")
               if _field(meta["config"], name) != _field(config.to_dict(), name)]
    if changed:
      metrics.log(f"WARNING: {', '.join(changed)} changed since the checkpoint: the data position continues, but "
                  "the batches are no longer those an uninterrupted run would have seen.")
    return state
  with jax.set_mesh(run.mesh), nnx.logical_axis_rules(run.rules):
    state = run.init()
  metrics.log(f"initialised {_count_params(state['params']):,} parameters on mesh {dict(run.mesh.shape)}; "
              "training from step 0")
  return state


def _field(config: dict, dotted: str) -> str:
  """A config dict's field `a.b` as canonical JSON, for comparison."""
  for name in dotted.split("."):
    config = config.get(name, {})
  return json.dumps(config, sort_keys=True)


def _check_finite(state: TrainState, policy: str, checkpointer: checkpointing.Checkpointer) -> None:
  """With policy `stop`, raises at the first non-finite step (its update was not applied)."""
  first = int(state["first_nonfinite_step"])
  if policy == "stop" and first >= 0:
    raise FloatingPointError(
        f"non-finite loss or gradient at step {first}; its update was not applied and the last good checkpoint "
        f"(step {checkpointer.latest_step()}) is intact. Lower train.learning_rate, check the data, or set "
        "train.nonfinite=skip to skip such steps.")


def _train_loop(config, run: Setup, batches: data.BatchIterator, valid_sequences: np.ndarray,
                checkpointer: checkpointing.Checkpointer, writer: metrics.MetricsWriter,
                workdir: Path) -> dict[str, float]:
  train_cfg = config.train
  eval_batch = train_cfg.batch_size // train_cfg.grad_accum_steps
  state = _restore_or_init(config, run, checkpointer, batches)
  tokens_per_step = train_cfg.batch_size * train_cfg.seq_len
  flops_per_token = flops.train_flops_per_token(config.model, train_cfg.seq_len, train_cfg.mode)
  peak = flops.measure_matmul_flops(layers.compute_dtype(config.model.dtype))
  peak *= jax.process_count() if jax.devices()[0].platform == "cpu" else jax.device_count()
  profile = tuple(train_cfg.profile_steps or ())
  saved_step = int(state["step"])

  def save(eval_loss=None):
    nonlocal saved_step
    checkpointer.save(step, state, {"data": batches.get_state(), "config": config.to_dict()}, eval_loss=eval_loss)
    saved_step = step

  step = int(state["step"])
  last: dict[str, float] = {}
  pending: list[dict[str, jax.Array]] = []
  compiled, interval_start, interval_steps = False, time.perf_counter(), 0
  with preemption.StopRequest() as stop:
    while step < train_cfg.steps:
      if profile and step == profile[0]:
        jax.profiler.start_trace(str(workdir / "profile"))
      with jax.set_mesh(run.mesh), nnx.logical_axis_rules(run.rules):
        state, step_metrics = run.train_step(state, next(batches))
      step += 1
      pending.append(step_metrics)
      if profile and step == profile[1] + 1:
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
      if compiled:
        interval_steps += 1
      else:  # the first step compiles: keep it out of the throughput
        jax.block_until_ready(state)
        metrics.log(f"first step (compile + run) took {time.perf_counter() - interval_start:.1f} s")
        compiled, interval_start = True, time.perf_counter()

      if step % train_cfg.log_every_steps == 0 or step == train_cfg.steps:
        _check_finite(state, train_cfg.nonfinite, checkpointer)
        values = {k: float(np.mean([m[k] for m in jax.device_get(pending)])) for k in pending[0]}
        values["perplexity"] = math.exp(min(values["loss"], 50.0))
        values["nonfinite_steps"] = int(state["nonfinite_steps"])
        seconds = (time.perf_counter() - interval_start) / interval_steps if interval_steps else float("nan")
        if interval_steps:
          values.update(step_time=seconds, tokens_per_sec=tokens_per_step / seconds,
                        mfu=tokens_per_step * flops_per_token / seconds / peak)
        writer.write(step, values)
        metrics.log(metrics.progress_line(step, train_cfg.steps, values, seconds))
        last.update(values)
        pending, interval_start, interval_steps = [], time.perf_counter(), 0

      eval_loss = None
      if step % train_cfg.eval_every_steps == 0 or step == train_cfg.steps:
        eval_loss = evaluate(run, state["params"], data.eval_batches(valid_sequences, eval_batch,
                                                                     train_cfg.eval_batches, run.batch_sharding))
        values = metrics.eval_metrics(eval_loss)
        writer.write(step, values)
        metrics.log(f"step {step}: eval loss {eval_loss:.4f} | perplexity {values['eval_perplexity']:.2f}")
        last.update(values)
        interval_start = time.perf_counter()  # evaluation time is not training time
      if step % config.checkpoint.every_steps == 0 or step == train_cfg.steps:
        _check_finite(state, train_cfg.nonfinite, checkpointer)
        save(eval_loss)
      if stop.requested():
        _check_finite(state, train_cfg.nonfinite, checkpointer)
        if saved_step != step:
          save()
        checkpointer.wait()
        metrics.log(f"{stop.signal_name or 'stop'} received: checkpoint of step {step} committed in "
                    f"{checkpointer.directory}; run the same command again to resume")
        return last

  checkpointer.wait()
  export_dir = workdir / "params" / str(step)
  if not export_dir.exists():
    checkpointing.export_params(export_dir, state["params"])
  metrics.log(f"done at step {step}; checkpoints in {checkpointer.directory}, params in {export_dir}")
  return last


def _count_params(params) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
