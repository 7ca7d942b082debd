"""The training loop: sharded state created in place, a pure jitted `train_step`, evaluation, checkpoints, resume.

    train_and_evaluate(config, workdir)

The train state is the pytree `{"params", "opt_state", "step"}`; the data position is saved beside it in
the checkpoint, so a resumed run sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import copy
import dataclasses
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

from retnet_jax import checkpointing, data, flops, layers, metrics, model as model_lib, optimizer, sharding

TrainState = dict[str, Any]
# Model fields that may change between a checkpoint and its resumption: they do not change the parameters.
RESUMABLE_MODEL_CHANGES = ("dtype", "chunk_size")


def check_config(config: ml_collections.ConfigDict, num_devices: int) -> None:
  """Checks the config against itself and the devices before any data is read or file written."""
  model_lib.check_model_config(config.model)
  train = config.train
  for name in ("steps", "batch_size", "seq_len", "grad_accum_steps", "log_every_steps", "eval_every_steps",
               "eval_batches"):
    if int(train[name]) < 1:
      raise ValueError(f"train.{name} must be a positive integer; got {train[name]}.")
  if config.checkpoint.every_steps < 1:
    raise ValueError(f"checkpoint.every_steps must be a positive integer; got {config.checkpoint.every_steps}.")
  if train.mode not in ("parallel", "chunkwise"):
    raise ValueError(f"train.mode={train.mode!r}; train with 'parallel' or 'chunkwise' (the recurrent form is "
                     "for decoding).")
  if train.remat != "none" and train.remat not in model_lib.REMAT_POLICIES:
    raise ValueError(f"unknown train.remat {train.remat!r}; choose none or one of "
                     f"{tuple(model_lib.REMAT_POLICIES)}.")
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


def token_loss(graphdef: nnx.GraphDef, params, tokens_BxL1: jax.Array, mode: str, remat: str = "none"):
  """Mean next-token cross-entropy (nats) of `tokens [batch, seq + 1]`: inputs [:, :-1], targets [:, 1:]."""
  model = nnx.merge(graphdef, params)
  logits, _ = model(tokens_BxL1[:, :-1], mode=mode, remat=remat)
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens_BxL1[:, 1:]).mean()


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, train_cfg: ml_collections.ConfigDict):
  """A pure `train_step(state, batch) -> (state, metrics)`; micro-batches are accumulated with `lax.scan`."""
  schedule = optimizer.learning_rate_schedule(train_cfg)
  accum = train_cfg.grad_accum_steps
  loss_and_grad = jax.value_and_grad(
      lambda params, tokens: token_loss(graphdef, params, tokens, train_cfg.mode, train_cfg.remat))

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
    updates, opt_state = tx.update(grads, state["opt_state"], params)
    new_state = {"params": optax.apply_updates(params, updates), "opt_state": opt_state, "step": state["step"] + 1}
    return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), "learning_rate": schedule(state["step"])}

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
    return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}

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


def check_resumable(saved: dict, config: ml_collections.ConfigDict, workdir: Path) -> None:
  """Refuses a workdir whose checkpoint came from another model config (before anything is overwritten)."""
  current = config.model.to_dict()
  differs = sorted(k for k in set(saved) | set(current)
                   if k not in RESUMABLE_MODEL_CHANGES and json.dumps(saved.get(k)) != json.dumps(current.get(k)))
  if differs:
    details = ", ".join(f"model.{k}: checkpoint {saved.get(k)!r} vs config {current.get(k)!r}" for k in differs)
    raise ValueError(f"{workdir} holds a checkpoint of an incompatible model config ({details}); use the same "
                     "model config to resume, or another --workdir for a new run.")


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | os.PathLike) -> dict[str, float]:
  """Trains `config` in `workdir`, resuming from its latest checkpoint; returns the last train/eval metrics."""
  workdir = Path(workdir)
  check_config(config, jax.device_count())
  tokenizer = data.load_tokenizer(config.data.tokenizer)
  if tokenizer.vocab_size > config.model.vocab_size:
    raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size="
                     f"{config.model.vocab_size}; set --config.model.vocab_size={tokenizer.vocab_size} or more.")
  ckpt_dir = workdir / "checkpoints"
  if ckpt_dir.is_dir():
    with checkpointing.Checkpointer(ckpt_dir) as existing:
      if existing.latest_step() is not None:
        check_resumable(existing.restore_meta()["config"]["model"], config, workdir)
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


def _train_loop(config, run: Setup, batches: data.BatchIterator, valid_sequences: np.ndarray,
                checkpointer: checkpointing.Checkpointer, writer: metrics.MetricsWriter,
                workdir: Path) -> dict[str, float]:
  train_cfg = config.train
  eval_batch = train_cfg.batch_size // train_cfg.grad_accum_steps
  if checkpointer.latest_step() is None:
    with jax.set_mesh(run.mesh), nnx.logical_axis_rules(run.rules):
      state = run.init()
    metrics.log(f"initialised {_count_params(state['params']):,} parameters on mesh "
                f"{dict(run.mesh.shape)}; training from step 0")
  else:
    state, meta = checkpointer.restore(run.abstract_state)
    batches.set_state(meta["data"])
    metrics.log(f"resumed from {checkpointer.directory}/{int(state['step'])} (data position {meta['data']})")

  tokens_per_step = train_cfg.batch_size * train_cfg.seq_len
  flops_per_token = flops.train_flops_per_token(config.model, train_cfg.seq_len, train_cfg.mode)
  peak = flops.measure_matmul_flops(layers.compute_dtype(config.model.dtype))
  peak *= jax.process_count() if jax.devices()[0].platform == "cpu" else jax.device_count()
  profile = tuple(train_cfg.profile_steps or ())

  step = int(state["step"])
  last: dict[str, float] = {}
  pending: list[dict[str, jax.Array]] = []
  compiled, interval_start, interval_steps = False, time.perf_counter(), 0
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
      values = {k: float(np.mean([m[k] for m in jax.device_get(pending)])) for k in pending[0]}
      values["perplexity"] = math.exp(min(values["loss"], 50.0))
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
      checkpointer.save(step, state, {"data": batches.get_state(), "config": config.to_dict()}, eval_loss=eval_loss)

  checkpointer.wait()
  export_dir = workdir / "params" / str(step)
  if not export_dir.exists():
    checkpointing.export_params(export_dir, state["params"])
  metrics.log(f"done at step {step}; checkpoints in {checkpointer.directory}, params in {export_dir}")
  return last


def _count_params(params) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
