"""The RetNet model: modes agree, state hand-over, parameter counts, dtypes, annotations and input errors."""

import itertools
import json
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from configs import retnet as retnet_config
from retnet_jax.core import sharding
from retnet_jax.mixers import attention
from retnet_jax.mixers.kernels import support
from retnet_jax.mixers.multiscale_retention import RetentionState
from retnet_jax.models import model as model_lib
from retnet_jax.models.model import Model
from retnet_jax.nn import layer_stack
from tests.helpers import forms_agree, forward, kernel_chunk, max_abs_diff, random_tokens, tiny_model

MODES = ("parallel", "chunkwise", "recurrent")


@pytest.mark.parametrize("stability_norm", [True, False])
def test_modes_agree_float32(stability_norm):
  """All three modes give the same logits and states to float32 rounding.

  Equality is exact in real arithmetic at every level, not only for the raw retention: with
  `stability_norm` each form divides a head's raw output by the same scalar sqrt(sigma_n) * c_n (c_n is
  built from q_n . z_n, which every form carries), so even the per-head norm's epsilon cannot make them
  differ. What remains is float32 rounding of differently ordered sums: measured ~3e-6 on logits of size ~4.
  The sequence (21) is not a multiple of the chunk size (8).
  """
  results = forms_agree(tiny_model(stability_norm=stability_norm), random_tokens(2, 21), MODES)
  assert int(results["recurrent"][1].position[0]) == 21


def test_modes_agree_bfloat16():
  """bfloat16 compute: the modes agree within bfloat16 rounding (8 bits of mantissa, ~4e-3 relative per
  operation, compounded over 2 layers); measured max difference ~0.03 on logits of size ~4."""
  model = tiny_model(dtype="bfloat16")
  tokens = random_tokens(2, 21)
  results = {mode: forward(model, tokens, None, mode) for mode in MODES}
  reference = forward(tiny_model(), tokens, None, "parallel")[0]
  scale = float(jnp.max(jnp.abs(reference)))
  for a, b in itertools.combinations(MODES, 2):
    assert max_abs_diff(results[a][0], results[b][0]) < 0.03 * scale, (a, b)
  assert max_abs_diff(results["parallel"][0], reference) < 0.05 * scale  # and bf16 is close to f32


@pytest.mark.parametrize("mixer", ["retention", "gated_retention"])
@pytest.mark.parametrize("first,second", list(itertools.product(MODES, MODES)))
def test_prefill_in_one_mode_continues_in_another(first, second, mixer):
  model = tiny_model(mixer=mixer)
  tokens = random_tokens(2, 19, seed=1)
  whole, whole_state = forward(model, tokens, None, "parallel")
  logits1, state1 = forward(model, tokens[:, :11], None, first)
  logits2, state2 = forward(model, tokens[:, 11:], state1, second)
  assert max_abs_diff(jnp.concatenate([logits1, logits2], axis=1), whole) < 5e-5
  assert max_abs_diff(state2, whole_state) < 1e-5


def test_token_by_token_decoding_matches_parallel():
  model = tiny_model()
  tokens = random_tokens(1, 9, seed=2)
  whole, _ = forward(model, tokens, None, "parallel")
  state, steps = None, []
  for n in range(tokens.shape[1]):
    logits, state = forward(model, tokens[:, n:n + 1], state, "recurrent")
    steps.append(logits)
  assert max_abs_diff(jnp.concatenate(steps, axis=1), whole) < 5e-5


def test_parameters_are_float32_and_annotated():
  model = tiny_model(dtype="bfloat16")
  params = nnx.state(model, nnx.Param)
  for path, leaf in jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable)):
    assert leaf[...].dtype == jnp.float32, path
    axes = leaf.get_metadata().get("out_sharding")
    assert axes is not None and len(axes) == leaf[...].ndim, (path, axes)
    assert set(axes) <= {"vocab", "embed", "heads", "mlp"}, (path, axes)


def test_bfloat16_config_keeps_decays_below_one():
  """In bfloat16, 1 - 2^(-5-h) rounds to 1 for h >= 4; the decays must stay float32 whatever the dtype."""
  model = tiny_model(dtype="bfloat16", d_model=64, num_heads=8, value_dim=64)
  log_decay = np.asarray(model.blocks[0].retention.log_decay, np.float64)
  assert log_decay.shape == (8,) and np.all(log_decay < 0)
  np.testing.assert_allclose(np.exp(log_decay), 1 - 2.0 ** (-5 - np.arange(8)), rtol=1e-7)


@pytest.mark.parametrize("preset,billions", [("1.3b", 1.3), ("2.7b", 2.7), ("6.7b", 6.7)])
def test_preset_parameter_counts(preset, billions):
  cfg = retnet_config.get_config(preset)
  abstract = nnx.eval_shape(lambda: Model(cfg.model, rngs=nnx.Rngs(0)))
  count = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
  assert abs(count / (billions * 1e9) - 1) < 0.05, count


@pytest.mark.parametrize("overrides,message", [
    (dict(d_model=30, num_heads=4, value_dim=64), "not divisible by model.num_heads"),
    (dict(d_model=6, num_heads=2, value_dim=8), "odd"),
    (dict(value_dim=63), "value_dim=63"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(dtype="float16"), "unknown dtype"),
    (dict(decay_schedule="cosine"), "unknown decay_schedule"),
    (dict(decay_gammas=(0.9, 0.8)), r"decay_schedule='retnet' ignores it; set model.decay_schedule=explicit"),
    (dict(ffn_activation="tanh"), "ffn_activation"),
    (dict(rotation_base=0.0), "rotation_base must be a positive finite number; got 0.0"),
    (dict(head_norm_eps=float("nan")), "head_norm_eps must be a finite number >= 0; got nan"),
    (dict(norm_eps=-1.0), "norm_eps must be a finite number >= 0; got -1.0"),
])
def test_bad_model_configs(overrides, message):
  with pytest.raises(ValueError, match=message):
    tiny_model(**overrides)


def test_bad_inputs():
  model = tiny_model()
  with pytest.raises(ValueError, match="unknown mode 'sequential'"):
    model(random_tokens(1, 4), mode="sequential")
  with pytest.raises(ValueError, match=r"ids from 0 to 300"):
    model(jnp.array([[0, 300]]))
  with pytest.raises(ValueError, match=r"ids from -1"):
    model(jnp.array([[-1, 3]]))
  with pytest.raises(ValueError, match=r"integer array \[batch, seq\]"):
    model(jnp.zeros((1, 4)))
  for empty in ((0, 4), (2, 0)):
    with pytest.raises(ValueError, match=re.escape(f"at least one row and one position; got shape {empty}")):
      model(jnp.zeros(empty, jnp.int32))
  with pytest.raises(ValueError, match="unknown preset 'huge'"):
    retnet_config.get_config("huge")
  with pytest.raises(ValueError, match=r"integer array \[batch, seq\]; got a list \(convert it"):
    model([[1, 2, 3]])
  config = retnet_config.get_config("tiny")
  for wrong, got in ((config, "the full config: pass config.model."), (config.model.to_dict()["d_model"], "a int.")):
    with pytest.raises(TypeError, match=re.escape(f"a model takes the model fields, config.model (e.g. "
                                                  f"presets.model_config('tiny')); got {got}")):
      Model(wrong, rngs=nnx.Rngs(0))
  # The model fields as config.json holds them (a dict, tuples as lists) build the same typed section.
  as_json = json.loads(json.dumps(config.model.to_dict()))
  assert Model(as_json, rngs=nnx.Rngs(0)).config == Model(config.model, rngs=nnx.Rngs(0)).config


def test_states_from_another_config_or_batch_are_refused():
  model, tokens = tiny_model(), random_tokens(2, 5)
  _, state = model(tokens)
  with pytest.raises(ValueError, match=r"holds 1 layer states but model.num_layers=2"):
    model(tokens, state=tiny_model(num_layers=1)(tokens)[1])
  with pytest.raises(ValueError, match=r"layer 0 of the state holds RetentionState\(kv=.*key_sum=\(2, 2, 16\)\)"):
    tiny_model(stability_norm=False)(tokens, state=state)
  with pytest.raises(ValueError, match=r"state.position must have shape \[batch\] = \(1,\)"):
    model(tokens[:1], state=state)
  with pytest.raises(ValueError, match=r"state must be a ModelState\(position, layers\).*got a dict"):
    model(tokens, state={"position": state.position, "layers": state.layers})  # the layout before typed states
  hybrid = tiny_model(attention_layers=(1,))
  swapped = hybrid.init_state(2)._replace(layers=hybrid.init_state(2).layers[::-1])
  with pytest.raises(ValueError, match=r"layer 0 of the state holds KVCache\(key="):
    hybrid(tokens, state=swapped)  # same leaves' count, another mixer's state


def test_left_padding_with_negative_positions_matches_prompt_alone():
  """A prompt left-padded by p tokens, starting at position -p, gives the logits and state of the prompt alone."""
  model = tiny_model()
  prompt = random_tokens(1, 13, seed=4)
  alone, alone_state = forward(model, prompt, None, "chunkwise")
  pad = 6
  padded = jnp.concatenate([random_tokens(1, pad, seed=5), prompt], axis=1)
  state = model.init_state(1)
  state = state._replace(position=jnp.full((1,), -pad, jnp.int32))
  for mode in MODES:
    logits, padded_state = forward(model, padded, state, mode)
    assert max_abs_diff(logits[:, pad:], alone) < 5e-5, mode
    assert max_abs_diff(padded_state, alone_state) < 1e-5, mode


def test_bfloat16_state_hand_over_in_every_mode():
  """bfloat16 compute with a carried-in state runs in every mode (the state stays float32) and matches."""
  model = tiny_model(dtype="bfloat16")
  tokens = random_tokens(2, 19, seed=6)
  whole, _ = forward(model, tokens, None, "parallel")
  scale = float(jnp.max(jnp.abs(whole)))
  _, state = forward(model, tokens[:, :11], None, "chunkwise")
  assert state.layers[0].kv.dtype == jnp.float32
  for mode in MODES:
    logits, _ = forward(model, tokens[:, 11:], state, mode)
    assert max_abs_diff(logits, whole[:, 11:]) < 0.03 * scale, mode


def test_remat_policies_give_the_same_gradients():
  model = tiny_model()
  tokens = random_tokens(2, 9, seed=8)
  graphdef, params = nnx.split(model)
  grad = jax.jit(lambda params, remat: jax.grad(lambda p: nnx.merge(graphdef, p)(
      tokens, mode="chunkwise", remat=remat)[0].mean())(params), static_argnums=1)
  reference = grad(params, "none")
  for remat in layer_stack.REMAT_POLICIES:
    assert max_abs_diff(grad(params, remat), reference) < 1e-6, remat
  with pytest.raises(ValueError, match="unknown remat 'some'"):
    model(tokens, remat="some")


@pytest.mark.devices(8)
@pytest.mark.parametrize("shape,names", [((1,), ("data",)), ((2, 2, 2), ("data", "fsdp", "tensor"))])
@pytest.mark.parametrize("with_rules", [False, True])
def test_model_builds_under_a_user_mesh(shape, names, with_rules):
  """Built and run under a researcher's own mesh, with or without the project's rules active, the model gives the
  logits of one built without a mesh; its parameters lie where the rules put them on the mesh's axes, replicated
  elsewhere."""
  cfg = retnet_config.get_config("tiny")
  rules = sharding.logical_rules(cfg.mesh)
  mesh = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules if with_rules else ()):
    model = Model(cfg.model, rngs=nnx.Rngs(0))
  reference, tokens = tiny_model(), random_tokens(2, 21)
  params = nnx.state(model, nnx.Param)
  assert max_abs_diff(params, nnx.state(reference, nnx.Param)) == 0
  for mode in ("parallel", "chunkwise"):  # sharded parameters split the products: float32 rounding apart
    expected = forward(reference, tokens, None, mode)[0]
    assert max_abs_diff(forward(model, tokens, None, mode)[0], expected) < 1e-5 * float(jnp.max(jnp.abs(expected)))
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules if with_rules else ()):  # and run under that mesh
      inside = nnx.jit(lambda model: model(tokens, mode=mode)[0])(model)  # traced afresh: constraints apply
    assert max_abs_diff(inside, expected) < 1e-5 * float(jnp.max(jnp.abs(expected)))
  for path, leaf in jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable)):
    spec = sharding.logical_spec(leaf.get_metadata()["out_sharding"], rules)
    expected = spec if with_rules and len(names) == 3 else jax.sharding.PartitionSpec()
    assert leaf[...].sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, expected), leaf[...].ndim), path
    if expected != jax.sharding.PartitionSpec():
      assert leaf[...].addressable_shards[0].data.size < leaf[...].size, path  # split indeed


@pytest.mark.devices(4)
@pytest.mark.parametrize("stability_norm", [True, False])
def test_pallas_retention_impl_matches_xla_in_values_states_and_gradients(stability_norm):
  """retention_impl='pallas' (the kernels interpreted on the CPU, compiled on GPUs) against the XLA form: logits and
  states with a carried state, and parameter gradients, on one device and on a (data 2, tensor 2) mesh under the
  rules, where the kernels run per batch and head shard. Each check compiles its forward passes and gradient as one
  program: run eagerly, the interpreted kernels dispatch op by op, several times slower."""
  models = {impl: tiny_model(retention_impl=impl, stability_norm=stability_norm, chunk_size=kernel_chunk(8))
            for impl in ("xla", "pallas")}
  tokens, more = random_tokens(2, 21, seed=3), random_tokens(2, 11, seed=4)
  loss = lambda model: model(tokens, mode="chunkwise")[0].mean()

  def run(model):
    logits, state = model(tokens, mode="chunkwise")
    return logits, state, model(more, mode="chunkwise", state=state)[0], nnx.grad(loss)(model)

  one_device = nnx.jit(run)
  expected = one_device(models["xla"])
  scale = float(jnp.max(jnp.abs(expected[0])))
  assert max_abs_diff(one_device(models["pallas"]), expected) < 1e-5 * scale
  cfg = retnet_config.get_config("tiny")
  mesh = jax.make_mesh((2, 1, 2), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.logical_rules(cfg.mesh)):
    sharded = nnx.jit(run)(models["pallas"])
  assert max_abs_diff(sharded, expected) < 1e-5 * scale


def test_retention_impl_and_matmul_precision_configs():
  """`pallas` is refused before any work where the kernels do not compile (the CPU, whatever runs the tests; naming
  the fix); `auto` picks XLA there; `highest` reaches every dot of the forward and backward pass."""
  from retnet_jax.training import run_config, train_state  # pylint: disable=import-outside-toplevel
  from retnet_jax.mixers import multiscale_retention as msr  # pylint: disable=import-outside-toplevel
  config = retnet_config.get_config("tiny")
  config.model.retention_impl = "pallas"
  with support.target_backend("cpu"), pytest.raises(
      ValueError, match=r"retention_impl='pallas' cannot run here: .*GPUs only.*retention_impl='xla'"):
    train_state.check_devices(run_config.build(config), 1)
  model_cfg = lambda **fields: ml_collections.ConfigDict({**config.model.to_dict(), **fields})
  assert msr.uses_kernel(config.model, "cpu") and not msr.uses_kernel(model_cfg(retention_impl="auto"), "cpu")
  gpu_ready = dict(retention_impl="auto", chunk_size=16, d_model=64, num_heads=2)
  assert msr.uses_kernel(model_cfg(**gpu_ready), "gpu")
  torchscale = model_cfg(**{**gpu_ready, "retention_impl": "pallas", "stability_norm_style": "torchscale"})
  with pytest.raises(ValueError, match="torchscale normaliser's chunkwise scalars"):
    msr.check_retention_impl(torchscale, "gpu")
  with pytest.raises(ValueError, match="unknown model.retention_impl 'triton'"):
    tiny_model(retention_impl="triton")
  with pytest.raises(ValueError, match=r"unknown model.kernel_layout 'tiled'; choose one of \('split', 'fused'\)"):
    tiny_model(kernel_layout="tiled")
  with pytest.raises(ValueError, match="unknown model.matmul_precision 'tf32'"):
    tiny_model(matmul_precision="tf32")

  def dot_precisions(precision):
    model = tiny_model(matmul_precision=precision)
    graphdef, params = nnx.split(model)
    grad = jax.grad(lambda p: nnx.merge(graphdef, p)(random_tokens(1, 5), mode="chunkwise")[0].mean())
    text = jax.jit(grad).lower(params).as_text()
    return re.findall(r"dot_general[^\n]*?(?:precision = \[(\w+), \w+\]|\n)", text)

  assert set(dot_precisions("highest")) == {"HIGHEST"}
  assert "HIGHEST" not in set(dot_precisions("default"))


def test_states_are_typed_pytrees():
  """`init_state` and every call give a `ModelState` whose layers hold their mixers' typed states, the same tree
  either way (a hand-off can be a loop's carry): retention's `RetentionState`, attention's `KVCache`."""
  model = tiny_model(attention_layers=(1,), attention_window=4)
  empty = model.init_state(2)
  _, state = forward(model, random_tokens(2, 5), empty, "chunkwise")
  for got in (empty, state):
    assert isinstance(got, model_lib.ModelState) and isinstance(got.layers, tuple)
    assert [type(layer) for layer in got.layers] == [RetentionState, attention.KVCache]
  assert jax.tree.structure(empty) == jax.tree.structure(state)
  assert state.layers[0].key_sum.shape == (2, 2, 16) and int(state.layers[1].next_slot) == 5
