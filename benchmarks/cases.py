"""The benchmark's cases: train steps, forward passes, greedy decoding, the matmul and memory-read ceilings."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks.harness import Case, compile_timed, random_tokens, timed
from benchmarks.suites import Suite
from retnet_jax.core import sharding
from retnet_jax.evaluation import sampling
from retnet_jax.hardware import flops
from retnet_jax.mixers import attention
from retnet_jax.models import presets
from retnet_jax.models.model import Model
from retnet_jax.training import optimizer, run_checkpoints, run_config, train_state, train_step

# Model widths the inference mesh's `tensor` axis splits: its device count must divide each.
TENSOR_SPLIT = ("num_heads", "ffn_dim", "vocab_size")


def make_config(base, suite: Suite, dtype: str, mode: str, seq_len: int, batch_size: int):
  """`base` at the suite's model size, with this dtype, form and training shape (one gradient step per batch)."""
  config = base.copy_and_resolve_references()
  config.model.update(suite.size)
  config.model.dtype = dtype
  config.train.update(dict(mode=mode, seq_len=seq_len, batch_size=batch_size, grad_accum_steps=1))
  return config


def gated_config(config):
  """A copy of `config` with YOCO's gated retention (a decay per token) in place of multi-scale retention."""
  config = config.copy_and_resolve_references()
  config.model.mixer = "gated_retention"
  return config


def param_count(model_cfg) -> int:
  """Parameters of the RetNet of model section `model_cfg`, counted abstractly (nothing is allocated)."""
  abstract = nnx.eval_shape(lambda: Model(model_cfg, rngs=nnx.Rngs(0)))
  return int(sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param))))


def train_case(step, state, batch, compile_s: float, buffers: int | None) -> Case:
  """A Case that runs compiled `step(state, batch) -> (state, _)` once per unit, carrying the state."""
  holder = {"state": state}

  def one_step():
    holder["state"], _ = step(holder["state"], batch)
    jax.block_until_ready(holder["state"])

  return Case(timed(one_step), {"compile_s": compile_s, "compiled_bytes": buffers})


class InitialStates:
  """The initial train state per model size, initialised (compiled) once per benchmark run and copied per case.

  It depends on neither the form, the dtype nor the shape (`run_checkpoints.RESUMABLE_MODEL_CHANGES`).
  """

  def __init__(self):
    self._states: dict[str, Any] = {}

  def copy(self, config, run) -> Any:
    """A copy of the initial state of `config.model`; call under `run`'s mesh and logical-axis rules."""
    model = config.model.to_dict()
    key = json.dumps({k: v for k, v in model.items() if k not in run_checkpoints.RESUMABLE_MODEL_CHANGES},
                     sort_keys=True)
    if key not in self._states:
      self._states[key] = run.init()
    return jax.tree.map(jnp.copy, self._states[key])


def retnet_train_case(config, mesh, states: InitialStates) -> Case:
  """The training loop's own jitted train step (`train_step.setup`), compiled ahead of time, from `states`."""
  run = train_step.setup(run_config.build(config), mesh)
  with run.placement.active():
    state = states.copy(config, run)
    batch = jax.device_put(random_tokens(config.train.batch_size, config.train.seq_len + 1,
                                         config.model.vocab_size), run.placement.batch_sharding)
    step, compile_s, buffers = compile_timed(run.train_step, state, batch)
  return train_case(step, state, batch, compile_s, buffers)


def compile_train_step(config, mesh) -> tuple[float, int | None]:
  """Compiles the train step for a `config.train` batch without running it: (seconds, XLA's buffer bytes)."""
  run = train_step.setup(run_config.build(config), mesh)
  with run.placement.active():
    batch = jax.ShapeDtypeStruct((config.train.batch_size, config.train.seq_len + 1), jnp.int32,
                                 sharding=run.placement.batch_sharding)
    _, compile_s, buffers = compile_timed(run.train_step, run.abstract_state, batch)
  return compile_s, buffers


def transformer_train_step(config) -> tuple[Any, dict[str, Any], jax.Array]:
  """The same train step (`train_step.make_train_step`, config.train.mode parallel) around a same-size Transformer:
  (the jitted step, its initial state, a batch)."""
  model = Model(presets.transformer_config(config.model, config.train.seq_len),
                                  rngs=nnx.Rngs(config.seed))
  graphdef, params = nnx.split(model)
  tx = optimizer.make_optimizer(config.train)
  state = train_state.fresh_state(tx, params)
  batch = jnp.asarray(random_tokens(config.train.batch_size, config.train.seq_len + 1, config.model.vocab_size))
  return jax.jit(train_step.make_train_step(graphdef, tx, config.train), donate_argnums=0), state, batch


def transformer_train_case(config) -> Case:
  """`transformer_train_step` compiled ahead of time, as a Case."""
  step_fn, state, batch = transformer_train_step(config)
  step, compile_s, buffers = compile_timed(step_fn, state, batch)
  return train_case(step, state, batch, compile_s, buffers)


@dataclasses.dataclass(frozen=True)
class Inference:
  """Where the forward sweep and decoding run: a mesh whose `tensor` axis splits heads, FFN and vocabulary.

  On a CPU, XLA runs some of a step's ops (the decoding state reads) on one core; with one JAX device per core,
  each device runs its share of the heads on its own core. Training stays on one device: it gained nothing there.
  """
  mesh: jax.sharding.Mesh
  rules: tuple[tuple[str, Any], ...]

  @classmethod
  def create(cls, config, count: int | None = None) -> Inference:
    """On the first `count` devices (checked by the caller); default: all, at most as many as split TENSOR_SPLIT."""
    devices, names = jax.devices(), tuple(config.mesh.axis_names)
    if count is None:
      count = max(n for n in range(1, len(devices) + 1) if all(config.model[w] % n == 0 for w in TENSOR_SPLIT))
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


def decode_from(model, sampler: sampling.Sampler, prefilled: sampling.Prefilled, new_tokens: int) -> Case:
  """Greedy `sampler.decode` of `new_tokens` from `prefilled`, compiled here (its first call, not timed: the warm-up
  run's memory is then that of decoding alone); each run decodes twice, each unit is one call's time per token.
  Info: the decoding state's bytes (`state_bytes`) and the first call's seconds (`first_call_s`, compiling)."""
  decode = lambda: sampler.decode(model, prefilled, max_new_tokens=new_tokens, key=jax.random.key(0),
                                  temperature=0.0)
  (first_call_s,) = timed(decode)()

  def run():
    return [s / new_tokens for s in timed(decode, repeats=2)()]

  devices = max(len(x.sharding.device_set) for x in jax.tree.leaves(nnx.state(model)))
  state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(prefilled.state))
  return Case(run, {"state_bytes": state_bytes, "first_call_s": first_call_s}, devices=devices)


def decode_case(model, batch: int, context: int, new_tokens: int, prefill_mode: str) -> Case:
  """`decode_from` after a `context`-token prompt of random tokens, prefilled once here (not timed)."""
  prompts = random_tokens(batch, context, model.config.vocab_size, seed=1)
  sampler = sampling.Sampler()
  prefilled = sampler.prefill(model, prompts, np.full((batch,), context, np.int32), prefill_mode=prefill_mode)
  return decode_from(model, sampler, prefilled, new_tokens)


def zero_state(model, batch: int, context: int, new_tokens: int) -> sampling.Prefilled:
  """A decoding state `context` tokens in, without a prefill: RetNet's retention state, or a KV cache of `context +
  new_tokens` slots with `context` filled, holding zeros (for a context whose prefill would not fit or take too long:
  a decoding step's work does not depend on the state's values)."""
  state = model.init_state(batch, context + new_tokens)
  layers = tuple(layer._replace(next_slot=jnp.int32(context)) if isinstance(layer, attention.KVCache) else layer
                 for layer in state.layers)
  state = state._replace(position=jnp.full((batch,), context, jnp.int32), layers=layers)
  return sampling.Prefilled(state, jnp.zeros((batch,), jnp.int32))


def matmul_case(dtype, size: int) -> Case:
  """The float32 / bfloat16 matmul ceiling: `flops.measure_matmul_flops` (the training loop's MFU denominator);
  a unit is the median time of one `size`^2 matmul."""
  return Case(lambda: [2 * size**3 / flops.measure_matmul_flops(dtype, size)], {"size": size})


def read_case(num_floats: int) -> Case:
  """The memory read bandwidth: a reduction over `num_floats` float32 (the model's parameter bytes)."""
  data = jnp.ones((num_floats,), jnp.float32)
  total, _, _ = compile_timed(jax.jit(jnp.sum), data)
  return Case(timed(lambda: total(data).block_until_ready(), repeats=10), {"bytes": data.nbytes})
