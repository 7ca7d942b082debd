"""model.scan_layers: stacked blocks under nnx.scan compute the unrolled model's function (forms, states, gradients,
remat), trees move between the layouts, checkpoints restore across them, and the remat policies keep what they
name."""

import contextlib
import copy
import io

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from configs import retnet as retnet_config
from retnet_jax.core import sharding
from retnet_jax.evaluation import sampling
from retnet_jax.models.architectures import MODES
from retnet_jax.nn import layer_stack
from retnet_jax.training import checkpointing, run_config, train, train_state, train_step
from tests.helpers import assert_resumed_from, forward, random_tokens, read_metrics, tiny_model, tiny_transformer

SAMPLER = sampling.Sampler()  # one sampler: its compiled functions are reused across tests


def max_rel_diff(a, b):
  """The largest |a - b| of matching leaves over the largest |a| of that leaf."""
  pairs = ((np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  return max(float(np.max(np.abs(x - y)) / (np.max(np.abs(x)) + 1e-30)) for x, y in pairs)


def pair(**overrides):
  """The same RetNet (seed 0) unrolled and scanned, 3 layers, chunk 4 (13 tokens: a partial last chunk)."""
  fields = dict(num_layers=3, chunk_size=4) | overrides
  return tiny_model(**fields), tiny_model(scan_layers=True, **fields)


def test_scanned_blocks_hold_the_unrolled_blocks_stacked():
  unrolled, scanned = pair()
  params = nnx.state(scanned, nnx.Param)
  kernel = params["blocks"]["ffn"]["fc1"]["kernel"]
  assert kernel.shape == (3, 32, 64) and kernel.get_metadata()["out_sharding"] == ("layers", "embed", "mlp")
  stacked = layer_stack.relayout(nnx.state(unrolled, nnx.Param), scanned=True)
  assert jax.tree.structure(stacked) == jax.tree.structure(params)
  assert max_rel_diff(stacked, params) == 0  # same seed, same values
  back = layer_stack.relayout(params, scanned=False)
  assert jax.tree.structure(back) == jax.tree.structure(nnx.state(unrolled, nnx.Param))
  assert layer_stack.relayout(params, scanned=True) is params  # already so: unchanged


@pytest.mark.parametrize("mode", MODES)
def test_scanned_model_computes_the_unrolled_function(mode):
  unrolled, scanned = pair()
  tokens = random_tokens(2, 13, seed=3)
  ids = np.array([[0] * 5 + [1] * 8, [0] * 9 + [1] * 4])  # packed documents, the second resetting the state
  first = [forward(model, tokens, None, mode) for model in (unrolled, scanned)]
  assert max_rel_diff(first[0][0], first[1][0]) < 1e-5
  assert isinstance(first[1][1].layers, tuple) and len(first[1][1].layers) == 3  # the state's edge layout
  assert max_rel_diff(first[0][1], first[1][1]) < 1e-5
  carried = [forward(model, tokens, out[1], mode, ids) for model, out in zip((unrolled, scanned), first)]
  assert max_rel_diff(carried[0][0], carried[1][0]) < 1e-5
  assert max_rel_diff(carried[0][1], carried[1][1]) < 1e-5


def jitted_grads(model, loss):
  """d loss(model) / d parameters, compiled, as a pure dict."""
  graphdef, params = nnx.split(model)
  return nnx.to_pure_dict(jax.jit(jax.grad(lambda p: loss(nnx.merge(graphdef, p))))(params))


@pytest.mark.parametrize("remat", ["none", "save_qkv_mixer_out"])
def test_scanned_gradients_equal_the_unrolled_ones(remat):
  """Parameter gradients of a loss through a carried state (chunkwise, then recurrent), under remat."""
  tokens = random_tokens(2, 13, seed=4)

  def loss(model):
    logits, state = model(tokens, mode="chunkwise", remat=remat)
    more, _ = model(tokens[:, :5], mode="recurrent", state=state, remat=remat)
    return jnp.mean(logits**2) + jnp.mean(more**2)
  grads = [jitted_grads(model, loss) for model in pair()]
  assert max_rel_diff(layer_stack.relayout(grads[0], scanned=True), grads[1]) < 1e-5


def test_scanned_transformer_computes_the_unrolled_function():
  models = [tiny_transformer(num_layers=3, scan_layers=scan) for scan in (False, True)]
  tokens = random_tokens(2, 11, seed=5)
  outs = [forward(model, tokens[:, :8], None, "parallel") for model in models]
  assert max_rel_diff(outs[0][0], outs[1][0]) < 1e-5
  steps = [forward(model, tokens[:, 8:], out[1], "recurrent") for model, out in zip(models, outs)]
  assert max_rel_diff(steps[0][0], steps[1][0]) < 1e-5
  assert max_rel_diff(steps[0][1].layers, steps[1][1].layers) < 1e-5
  grads = [jitted_grads(m, lambda m: jnp.mean(m(tokens, remat="full")[0] ** 2)) for m in models]
  assert max_rel_diff(layer_stack.relayout(grads[0], scanned=True), grads[1]) < 1e-5


@pytest.mark.parametrize("architecture", ["retnet", "transformer", "hybrid"])
def test_scanned_models_generate_the_unrolled_tokens(architecture):
  """Prefill, then the compiled decoding loop (layer by layer, each group's parameters a slice of the stack; a
  hybrid's groups of a retention and an attention block), on padded prompts."""
  make = {"retnet": lambda **f: tiny_model(num_layers=3, **f),
          "transformer": lambda **f: tiny_transformer(num_layers=3, **f),
          "hybrid": lambda **f: tiny_model(num_layers=4, attention_layers=(1, 3), **f)}[architecture]
  tokens, lengths = sampling.pad_prompts([[5, 17, 200, 3, 9], [42, 7]])
  outs = [SAMPLER.generate(make(scan_layers=scan), tokens, lengths, max_new_tokens=6, key=jax.random.key(0),
                            temperature=0.0) for scan in (False, True)]
  np.testing.assert_array_equal(outs[0].tokens, outs[1].tokens)


def test_scanned_decoding_does_not_copy_the_kv_cache():
  """XLA's memory analysis of the decoding loop of a Transformer with an 8192-token cache (4.2 MB): scanned, its
  temporaries are within a quarter of the cache of the unrolled model's. Stacking every layer's state into the layer
  scan and unstacking it after, at each token, took 5.2 MB more."""
  temporaries = {}
  for scan in (False, True):
    model = tiny_transformer(max_len=8192, scan_layers=scan)
    graphdef, params = nnx.split(model)
    args = (jax.ShapeDtypeStruct((1, 16), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32))
    compiled = SAMPLER.trace_decode(graphdef, params, *args, "parallel", 8).lower().compile()
    temporaries[scan] = compiled.memory_analysis().temp_size_in_bytes
  state = jax.eval_shape(lambda: model.init_state(1))
  cache_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state))
  assert temporaries[True] - temporaries[False] < cache_bytes / 4, (temporaries, cache_bytes)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_remat_policies_keep_what_they_name(scan_layers):
  """The residuals kept for the backward pass: named activations unrolled; under a scan, stacked ones come out of
  it unnamed, so the retention output is told by its shape [layers, batch, seq, value_dim]."""
  graphdef, params = nnx.split(tiny_model(scan_layers=scan_layers))
  tokens = random_tokens(2, 9, seed=6)
  mixer_out = "output of scan" if scan_layers else "named 'mixer_out'"

  def residuals(remat):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      print_saved_residuals(lambda p: nnx.merge(graphdef, p)(tokens, mode="chunkwise", remat=remat)[0].mean(), params)
    lines = out.getvalue().splitlines()
    return {"mixer_out": sum(line.startswith("f32[" + "2," * scan_layers + "2,9,64]") and mixer_out in line
                             for line in lines),
            "qkv_proj": sum("named 'qkv_proj'" in line for line in lines),
            "host": sum("<host>" in line for line in lines)}
  assert residuals("full") == {"mixer_out": 0, "qkv_proj": 0, "host": 0}
  assert residuals("save_mixer_out") == {"mixer_out": 1 if scan_layers else 2, "qkv_proj": 0, "host": 0}
  kept = residuals("save_qkv_mixer_out")
  assert kept["mixer_out"] > 1 and kept["host"] == 0 and (scan_layers or kept["qkv_proj"] == 6)
  assert residuals("offload_qkv_mixer_out")["host"] >= 4


def test_offloading_is_refused_where_devices_have_no_host_memory():
  class NoHost:
    platform = "tpu"
    addressable_memories = staticmethod(lambda: [type("M", (), {"kind": "device"})()])
  with pytest.raises(ValueError, match="train.remat='offload_qkv_mixer_out' offloads to host memory"):
    layer_stack.check_remat("offload_qkv_mixer_out", [NoHost()], field="train.remat")
  layer_stack.check_remat("save_mixer_out", [NoHost()], field="train.remat")


def test_optimizer_state_moves_between_layouts():
  unrolled, scanned = pair()
  tx = optax.adam(1e-3)
  moments = tx.init(nnx.state(unrolled, nnx.Param))
  moved = layer_stack.relayout(moments, scanned=True)
  assert jax.tree.structure(moved) == jax.tree.structure(tx.init(nnx.state(scanned, nnx.Param)))
  assert jax.tree.structure(layer_stack.relayout(moved, scanned=False)) == jax.tree.structure(moments)


def test_checkpoints_restore_across_layouts(trained, tmp_path, run_crashing_at_batch):
  """Train unrolled, resume scanned from checkpoint 4 after a crash in step 6: the straight unrolled run's losses;
  read either way, and back."""
  config = copy.deepcopy(trained.config)
  run_crashing_at_batch(6, train.train_and_evaluate, config, tmp_path / "switched")  # in step 6, after checkpoint 4
  config.model.scan_layers = True
  resumed = train.train_and_evaluate(config, tmp_path / "switched")
  assert_resumed_from(tmp_path / "switched", 4)
  losses, switched = read_metrics(trained.workdir), read_metrics(tmp_path / "switched")
  assert sorted(switched) == sorted(losses) == list(range(1, 9))
  for step in range(1, 5):
    assert switched[step] == losses[step], step
  for step in range(5, 9):  # the same function; float32 rounding of another order, grown by Adam's steps
    assert switched[step] == pytest.approx(losses[step], rel=1e-4), step
  assert resumed["eval_loss"] == pytest.approx(read_metrics(trained.workdir, "eval_loss")[8], rel=1e-4)

  params = {}  # both checkpoints read in both layouts, the one not written in converted as it is read
  for scan in (False, True):
    config.model.scan_layers = scan
    for run in ("straight", "switched"):
      model, step = train_state.restore_model(config, trained.workdir if run == "straight" else tmp_path / run)
      assert step == 8 and layer_stack.is_scanned(model.blocks) == scan
      params[run, scan] = nnx.state(model, nnx.Param)
  for run in ("straight", "switched"):
    assert max_rel_diff(layer_stack.relayout(params[run, False], True), params[run, True]) == 0
  abstract = train_state.model_layout(config, sharding.placement(config.mesh))[1]  # scanned
  exported = checkpointing.load_params(trained.workdir / "params" / "8", abstract)  # an unrolled export
  assert max_rel_diff(exported, params["straight", True]) == 0


@pytest.mark.devices(8)
def test_scanned_sharded_step_matches_the_unrolled_single_device_step():
  config = retnet_config.get_config("tiny")
  config.train.batch_size = 8
  batch = random_tokens(8, config.train.seq_len + 1, config.model.vocab_size, seed=2)
  results = []
  for scan, shape, devices in ((False, (1, 1, 1), jax.devices()[:1]), (True, (2, 2, 2), jax.devices())):
    config.model.scan_layers, config.mesh.shape = scan, shape
    run = train_step.setup(run_config.build(config), sharding.make_mesh(config.mesh, devices))
    with run.placement.active():
      state, metrics = run.train_step(run.init(), jax.device_put(batch, run.placement.batch_sharding))
    results.append((state, metrics))
  (single, single_metrics), (sharded, sharded_metrics) = results
  assert abs(float(single_metrics["loss"]) - float(sharded_metrics["loss"])) < 1e-5
  kernel = sharded.params["blocks"]["retention"]["q_proj"]["kernel"][...]
  assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")  # the layer axis replicated
  assert max_rel_diff(layer_stack.relayout(single.params, True), sharded.params) < 1e-4
