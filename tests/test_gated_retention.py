"""Gated retention (`model.mixer="gated_retention"`, YOCO's self-decoder layer): the layer's forms against a float64
recurrence written from the definition (awkward lengths, carried states, gates near 0 and near 1), their gradients, a
constant gate as RetNet's retention, hand-offs between forms, packed documents, left padding, the whole model (hybrid
too, its FLOP count, the Pallas kernels, the sequence split) and the config errors."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import retnet as retnet_config
from retnet_jax.core import segments, sharding
from retnet_jax.hardware import flops
from retnet_jax.mixers import base, decay, gated_retention, multiscale_retention
from retnet_jax.mixers.multiscale_retention import RetentionState
from retnet_jax.models import model_config, presets
from retnet_jax.models.model import Model
from retnet_jax.training import losses
from tests.helpers import forms_agree, forward, max_abs_diff, random_tokens, tiny_model

MODES = ("parallel", "chunkwise", "recurrent")
GATED = gated_retention.GATED_RETENTION
BATCH, LENGTH = 2, 11


def layer_config(**overrides):
  """The tiny preset's model section with gated retention (2 heads, d_k 16, d_v 32) and `overrides`, typed."""
  cfg = retnet_config.get_config("tiny").model
  cfg.update({"mixer": "gated_retention", **overrides})
  return model_config.of(cfg)


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@nnx.jit(static_argnames=("cfg", "mode"))
def run_layer(layer, x, positions, state, segment_ids, cfg, mode):
  """The layer over `x [B, L, D]` at `positions [B, L]` in `mode`: (y, new state, the call's rotation tables)."""
  context = GATED.context(cfg, base.Call(positions, mode, segment_ids))
  return *layer(x, context, state), context.tables


def gated_layer(cfg, dtype, gate: str, seed: int = 0):
  """A layer whose gate logits x W_gt are, for the inputs of `layer_inputs` (feature 0 is 1 at every token), a
  per-head offset (W_gt's row 0) plus N(0, 3^2)-ish noise: `mixed` gates around sigmoid(0)^(1/16) ~ 0.96, `near0`
  one head forgetting all (log gamma ~ -125) and one strongly (~ -3), `near1` log gamma ~ -1e-10 and -5e-8."""
  layer = GATED.layer(cfg, dtype=dtype, rngs=nnx.Rngs(seed))
  rng = np.random.default_rng(seed + 1)
  kernel = rng.normal(scale=3 / np.sqrt(cfg.d_model), size=(cfg.d_model, cfg.num_heads))
  kernel[0] = {"mixed": [0.0, 0.0], "near0": [-2000.0, -50.0], "near1": [20.0, 14.0]}[gate]
  layer.gt_proj.kernel[...] = jnp.asarray(kernel, jnp.float32)
  return layer


def layer_inputs(cfg, length=LENGTH, seed=0):
  """x `[B, L, D]` (feature 0 constant 1) and a carried state `RetentionState(kv)`, float64 NumPy."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(BATCH, length, cfg.d_model))
  x[..., 0] = 1.0
  heads = cfg.num_heads
  kv = rng.normal(size=(BATCH, heads, cfg.d_model // heads, cfg.value_dim // heads))
  return x, RetentionState(kv)


def reference(layer, cfg, x, tables, positions, state=None, starts=None):
  """The layer from its definition in float64 NumPy, token by token: q, k, v, g projections (k scaled by d_k^-0.5),
  interleaved rotation by the call's tables, left-padding keys zeroed and their gates 1, log gamma_n =
  logsigmoid(x_n W_gt) / gate_logit_normalizer, S_n = gamma_n S_(n-1) + k_n^T v_n (S_(n-1) zeroed at a document
  start), o_n = q_n S_n, per-head RMSNorm, swish(x W_g) * o, output projection: (y, final state)."""
  w = {name: np.asarray(getattr(layer, name).kernel[...], np.float64)
       for name in ("q_proj", "k_proj", "v_proj", "g_proj", "gt_proj", "out_proj")}
  batch, length, _ = x.shape
  heads, d_k = cfg.num_heads, cfg.d_model // cfg.num_heads
  cos, sin = (np.asarray(t, np.float64) for t in tables)  # [B, L, 1, d_k / 2]

  def rotate(y):
    even, odd = y[..., 0::2], y[..., 1::2]
    return np.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1).reshape(y.shape)

  q = rotate((x @ w["q_proj"]).reshape(batch, length, heads, d_k))
  k = rotate((x @ w["k_proj"]).reshape(batch, length, heads, d_k)) * d_k**-0.5
  v = (x @ w["v_proj"]).reshape(batch, length, heads, -1)
  padding = np.asarray(positions) < 0
  k = np.where(padding[..., None, None], 0, k)
  normalizer = cfg.gated_retention.gate_logit_normalizer
  log_decay = np.where(padding[..., None], 0, -np.logaddexp(0, -(x @ w["gt_proj"])) / normalizer)
  s = np.zeros((batch, heads, d_k, v.shape[-1])) if state is None else np.asarray(state.kv, np.float64)
  outs = []
  for n in range(length):
    if starts is not None:
      s = np.where(starts[:, n, None, None, None], 0, s)
    s = np.exp(log_decay[:, n, :, None, None]) * s + k[:, n, :, :, None] * v[:, n, :, None, :]
    outs.append(np.einsum("bhk,bhkv->bhv", q[:, n], s))
  o = np.stack(outs, axis=1)
  o = o / np.sqrt(np.mean(o**2, axis=-1, keepdims=True) + cfg.head_norm_eps)
  g = x @ w["g_proj"]
  return (g / (1 + np.exp(-g)) * o.reshape(batch, length, -1)) @ w["out_proj"], s


def call(layer, cfg, dtype, x, mode, positions=None, state=None, segment_ids=None):
  """`run_layer` on NumPy inputs in `dtype`: (y, state, tables) as NumPy."""
  positions = np.broadcast_to(np.arange(x.shape[1]), x.shape[:2]) if positions is None else positions
  state = None if state is None else RetentionState(jnp.asarray(state.kv, jnp.float32))
  ids = None if segment_ids is None else jnp.asarray(segment_ids)
  y, new_state, tables = run_layer(layer, jnp.asarray(x, dtype), jnp.asarray(positions, jnp.int32), state, ids,
                                   cfg, mode)
  return np.asarray(y), np.asarray(new_state.kv), tables


# Relative tolerances against the float64 recurrence. Measured: float32 5e-7, 7e-6 with gates near 0 (gate logits of
# 2000 carry 1e-4 of float32 rounding); float64 1e-15, 2e-14 near 0.
TOLERANCES = {"float32": 1e-5, "float64": 1e-10}


@pytest.mark.parametrize("gate", ["mixed", "near0", "near1"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_forms_match_a_float64_recurrence(dtype, gate):
  """Every form, chunks of 1, 4 (11 tokens: not a multiple) and 16 (longer than the call), from an empty and a carried
  state, gives the reference's output and final state. The carried state is float32 (the model's)."""
  tol = TOLERANCES[dtype]
  with jax.enable_x64(dtype == "float64"):
    for chunk in (1, 4, 16):
      cfg = layer_config(chunk_size=chunk)
      layer = gated_layer(cfg, jnp.dtype(dtype), gate)
      x, carried = layer_inputs(cfg)
      carried = RetentionState(carried.kv.astype(np.float32).astype(np.float64))  # as float32 hands it in
      for state, mode in itertools.product((None, carried), MODES if chunk == 4 else ("chunkwise",)):
        y, kv, tables = call(layer, cfg, jnp.dtype(dtype), x, mode, state=state)
        expected_y, expected_kv = reference(layer, cfg, x, tables, np.arange(LENGTH)[None], state)
        assert rel_err(y, expected_y) < tol, (chunk, mode, state is None, rel_err(y, expected_y))
        assert rel_err(kv, expected_kv) < tol, (chunk, mode, state is None, rel_err(kv, expected_kv))


def test_gradients_agree_across_forms():
  """The parameters' gradients (gt_proj's included, non-zero) of a loss over the outputs and the final state, after
  a carried state, agree between the forms to float64 rounding; float32's to 1e-4 of the largest."""
  for dtype, tol in (("float64", 1e-9), ("float32", 1e-4)):
    with jax.enable_x64(dtype == "float64"):
      cfg = layer_config(chunk_size=4)
      layer = gated_layer(cfg, jnp.dtype(dtype), "mixed")
      x, carried = layer_inputs(cfg, seed=2)
      x, kv = jnp.asarray(x, dtype), jnp.asarray(carried.kv, dtype)
      weights = jnp.asarray(np.random.default_rng(3).normal(size=(BATCH, LENGTH, cfg.d_model)), dtype)
      positions = jnp.broadcast_to(jnp.arange(LENGTH), (BATCH, LENGTH))

      def grads(mode):
        def loss(layer):
          y, state, _ = run_layer(layer, x, positions, RetentionState(kv), None,
                                  cfg, mode)
          return jnp.sum(y * weights) + jnp.sum(state.kv ** 2)
        return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.jit(nnx.grad(loss))(layer)))

      got = {mode: grads(mode) for mode in MODES}
      assert np.abs(got["parallel"]["gt_proj"]["kernel"]).max() > 1e-3
      for mode in ("chunkwise", "recurrent"):
        for a, b in zip(jax.tree.leaves(got[mode]), jax.tree.leaves(got["parallel"])):
          assert rel_err(a, b) < tol, (dtype, mode, rel_err(a, b))


@pytest.mark.parametrize("gate_init, decays", [  # compiling the three forms, as slow as the yoco case recorded
    ("yoco", dict(decay_schedule="explicit", decay_gammas=(2 ** (-1 / 16),) * 2)),
    pytest.param("retnet", dict(), marks=pytest.mark.slow)])
def test_a_constant_gate_is_retnets_retention(gate_init, decays):
  """With gt_proj zero, log gamma = logsigmoid(b) / 16 at every token: the layer is RetNet's multi-scale retention
  with, under `yoco` (b = 0), gamma = 2^(-1/16) in every head, under `retnet` (b = gt_bias) RetNet's default decays
  1 - 2^(-5-h); no normaliser, and the same q, k, v, g, out weights (both layers draw them first from one seed), in
  every form, to float32 rounding."""
  cfg = layer_config(chunk_size=4, stability_norm=False, gate_init=gate_init)
  gated = GATED.layer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
  cfg = layer_config(chunk_size=4, stability_norm=False, mixer="retention", **decays)  # RetNet's: gated's at defaults
  gated.gt_proj.kernel[...] = jnp.zeros_like(gated.gt_proj.kernel[...])
  retnet = multiscale_retention.RETENTION.layer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
  x, carried = layer_inputs(cfg, seed=5)
  x = jnp.asarray(x, jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(LENGTH), (BATCH, LENGTH))
  state = RetentionState(jnp.asarray(carried.kv, jnp.float32))
  for mode in MODES:  # each layer's call compiled: eagerly, each operation dispatches on its own
    call = base.Call(positions, mode, None)
    expected = nnx.jit(lambda layer: layer(x, multiscale_retention.RETENTION.context(cfg, call), state))(retnet)
    got = nnx.jit(lambda layer: layer(x, GATED.context(cfg, call), state))(gated)
    assert max_abs_diff(got, expected) < 1e-5 * float(jnp.abs(expected[0]).max()), mode


def zero_input_log_decay(heads: int, dtype) -> np.ndarray:
  """log gamma `[heads]` of a `gate_init="retnet"` layer with `heads` heads (d_k 2) at a zero input, in `dtype`."""
  cfg = layer_config(gate_init="retnet", num_heads=heads, d_model=2 * heads, value_dim=2 * heads)
  layer = GATED.layer(cfg, dtype=dtype, rngs=nnx.Rngs(0))
  log_decay = layer.gate_log_decay(jnp.zeros((1, 1, cfg.d_model), dtype), jnp.zeros((1, 1), jnp.int32))
  assert log_decay.dtype == dtype
  return np.asarray(log_decay[0, 0], np.float64)


def test_retnet_gate_init_starts_each_head_at_retnets_decay():
  """`gate_init="retnet"`: a zero input gives head h RetNet's log gamma_h, the retention mixer's default schedule's
  for the same head count: the float64 bias exactly (float64 rounding) for every preset's head count (the 6.7B
  preset's 16, torchscale 65B's 32, the most), the layer's float32 parameter to its rounding, computed in float64
  and in float32 (no head's decay rounds to 1), for the most heads."""
  schedule = retnet_config.get_config("tiny").model.decay_schedule
  head_counts = sorted({preset.model.num_heads for preset in presets.PRESETS.values()})
  assert presets.preset("6.7b").model.num_heads in head_counts and head_counts[-1] == 32
  for heads in head_counts:
    bias = gated_retention.retnet_gate_bias(heads, 16.0)
    assert rel_err(-np.logaddexp(0, -bias) / 16, np.log(decay.gammas(schedule, heads))) < 1e-14, heads
  expected = np.log(decay.gammas(schedule, head_counts[-1]))
  with jax.enable_x64(True):
    assert rel_err(zero_input_log_decay(head_counts[-1], jnp.float64), expected) < 2e-6
  got32 = zero_input_log_decay(head_counts[-1], jnp.float32)
  assert np.all(got32 < 0) and rel_err(got32, expected) < 2e-6


def test_gate_init_adds_only_a_bias_drawn_from_no_random_stream():
  """`yoco` (the default) has no gate bias; `retnet` adds `gt_bias` [heads] per layer (stacked under scan_layers)
  and draws every other parameter as `yoco` does, bit for bit."""
  default = dict(nnx.to_flat_state(nnx.state(tiny_gated(), nnx.Param)))
  for scan in (False, True):
    params = {init: nnx.to_flat_state(nnx.state(tiny_gated(gate_init=init, scan_layers=scan), nnx.Param))
              for init in ("yoco", "retnet")}
    yoco = dict(params["yoco"])
    retnet = {path: x for path, x in params["retnet"] if path[-1] != "gt_bias"}
    biases = [x[...] for path, x in params["retnet"] if path[-1] == "gt_bias"]
    assert not any(path[-1] == "gt_bias" for path in yoco), scan
    assert jax.tree.map(np.shape, biases) == ([(2, 2)] if scan else [(2,), (2,)]), scan
    assert retnet.keys() == yoco.keys() and all(np.array_equal(retnet[p][...], yoco[p][...]) for p in yoco), scan
    if not scan:
      assert default.keys() == yoco.keys() and all(np.array_equal(default[p][...], yoco[p][...]) for p in yoco)


@pytest.mark.devices(8)
def test_retnet_gate_bias_is_placed_by_the_rules():
  """Built under a (data 2, fsdp 2, tensor 2) mesh with the project's rules, the gate bias (logical axis `heads`)
  splits its 2 heads over `tensor`, with the values of a model built without a mesh."""
  config = retnet_config.get_config("tiny")
  config.model.update(mixer="gated_retention", gate_init="retnet")
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.logical_rules(config.mesh)):
    model = Model(config.model, rngs=nnx.Rngs(0))
  bias = model.blocks[0].gated_retention.gt_bias[...]
  assert bias.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("tensor")), 1)
  assert bias.addressable_shards[0].data.size == 1
  assert max_abs_diff(nnx.state(model, nnx.Param), nnx.state(tiny_gated(gate_init="retnet"), nnx.Param)) == 0


def test_left_padding_adds_nothing_and_keeps_the_state():
  """Left-padding tokens (negative positions) neither add keys nor decay a carried state: the prompt after 5 of them
  gives the outputs and final state it gives alone, in every form (a padding gate other than 1 would decay it)."""
  cfg = layer_config(chunk_size=4)
  layer = gated_layer(cfg, jnp.float32, "near0")  # the padding's own gates would forget the state
  x, carried = layer_inputs(cfg, length=LENGTH + 5, seed=6)
  positions = np.broadcast_to(np.arange(-5, LENGTH), (BATCH, LENGTH + 5))
  for mode in MODES:
    alone_y, alone_kv, _ = call(layer, cfg, jnp.float32, x[:, 5:], mode, state=carried)
    y, kv, _ = call(layer, cfg, jnp.float32, x, mode, positions=positions, state=carried)
    assert max_abs_diff(y[:, 5:], alone_y) < 1e-5 and max_abs_diff(kv, alone_kv) < 1e-5, mode


def test_packed_documents_match_the_reference():
  """segment_ids reset the state and the gate products at each document start (on and off chunk edges, a one-token
  document), in every form: the float64 reference with the state zeroed at each start."""
  ids = np.array([[0, 0, 0, 0, 1, 2, 2, 2, 2, 2, 3], [7] * LENGTH], np.int32)
  starts = np.asarray(segments.starts(jnp.asarray(ids)))
  with jax.enable_x64(True):
    cfg = layer_config(chunk_size=4)
    layer = gated_layer(cfg, jnp.float64, "mixed")
    x, carried = layer_inputs(cfg, seed=7)
    for mode in MODES:
      y, kv, tables = call(layer, cfg, jnp.float64, x, mode, state=carried, segment_ids=ids)
      carried32 = RetentionState(carried.kv.astype(np.float32))
      expected_y, expected_kv = reference(layer, cfg, x, tables, np.arange(LENGTH)[None], carried32, starts)
      assert rel_err(y, expected_y) < 1e-10 and rel_err(kv, expected_kv) < 1e-10, mode


def tiny_gated(**overrides) -> Model:
  return tiny_model(mixer="gated_retention", **overrides)


def test_model_forms_and_hybrid_forms_agree():
  """The tiny model with gated retention in every layer, and a hybrid with attention in layer 1: the three forms give
  the same logits and states (21 tokens, chunks of 8)."""
  tokens = random_tokens(2, 21)
  for model in (tiny_gated(), tiny_gated(attention_layers=(1,))):
    results = forms_agree(model, tokens, MODES)
    assert isinstance(results["parallel"][1].layers[0], RetentionState)
    assert results["parallel"][1].layers[0].key_sum is None  # no normaliser


def test_packed_documents_equal_each_document_alone_and_left_padding_the_prompt_alone():
  """Model level: a row of three packed documents gives each document's logits alone (and the last one's state), and
  a prompt left-padded by 6 tokens (a state starting at position -6) the prompt's logits and state, in every form."""
  model = tiny_gated()
  docs = [random_tokens(1, n, seed=10 + n) for n in (5, 1, 9)]
  packed = np.concatenate(docs, axis=1)
  ids = np.repeat(np.arange(3), [d.shape[1] for d in docs])[None].astype(np.int32)
  prompt = random_tokens(1, 13, seed=4)
  padded = np.concatenate([random_tokens(1, 6, seed=5), prompt], axis=1)
  state = model.init_state(1)
  state = state._replace(position=jnp.full((1,), -6, jnp.int32))
  alone = [forward(model, d, None, "parallel") for d in docs]
  prompt_alone = forward(model, prompt, None, "chunkwise")
  for mode in MODES:
    logits, last_state = forward(model, packed, None, mode, jnp.asarray(ids))
    assert max_abs_diff(logits, jnp.concatenate([a[0] for a in alone], axis=1)) < 5e-5, mode
    assert max_abs_diff(last_state.layers, alone[-1][1].layers) < 1e-5, mode
    logits, padded_state = forward(model, padded, state, mode)
    assert max_abs_diff(logits[:, 6:], prompt_alone[0]) < 5e-5, mode
    assert max_abs_diff(padded_state, prompt_alone[1]) < 1e-5, mode


def test_matmul_params_count_the_models_kernels():
  """flops.matmul_params equals the model's projection and head kernels: retention's per layer plus the gate
  32 x 2 (64), plain, with `gate_init="retnet"` (its bias is no matmul) and in a hybrid (the attention layer's count
  as in tests/test_benchmark.py)."""
  for overrides, expected in ((dict(), 2 * (14336 + 64) + 8192), (dict(gate_init="retnet"), 2 * (14336 + 64) + 8192),
                              (dict(attention_layers=(1,)), 14336 + 64 + 10240 + 8192)):
    model = tiny_gated(**overrides)
    kernels = [x for path, x in nnx.to_flat_state(nnx.state(model, nnx.Param)) if path[-1] == "kernel"]
    assert flops.matmul_params(model.config) == expected == sum(x[...].size for x in kernels), overrides


def test_pallas_chunkwise_matches_xla():
  """retention_impl='pallas' (the split kernels, interpreted here) runs the chunkwise form with the per-token decays:
  logits, states, a continuation and the parameters' gradients (gt_proj's through the kernels' decay gradient) equal
  the XLA form's. Each model's forward, continuation and gradient compile as one program: run eagerly, the
  interpreted kernels dispatch op by op, several times slower."""
  models = {impl: tiny_gated(retention_impl=impl, chunk_size=16) for impl in ("xla", "pallas")}
  assert models["pallas"].blocks[0].gated_retention.kernel and not models["xla"].blocks[0].gated_retention.kernel
  tokens, more = random_tokens(2, 21, seed=3), random_tokens(2, 5, seed=4)
  loss = lambda model: model(tokens, mode="chunkwise")[0].mean()

  @nnx.jit
  def run(model):
    logits, state = model(tokens, mode="chunkwise")
    return logits, state, model(more, mode="chunkwise", state=state)[0], nnx.grad(loss)(model)

  expected, got = run(models["xla"]), run(models["pallas"])
  assert max_abs_diff(got, expected) < 1e-5 * float(jnp.abs(expected[0]).max())
  assert np.abs(np.asarray(got[3]["blocks"][0]["gated_retention"]["gt_proj"]["kernel"][...])).max() > 0


@pytest.mark.devices(4)
def test_sequence_split_matches_one_device():
  """Each sequence split over a mesh's sequence axis (2 devices, the batch over 2 more): logits, states, loss and
  gradients after a carried state equal one device's (the chunkwise form; the parallel form runs the same split
  computation)."""
  config = retnet_config.get_config("tiny")
  config.model.mixer = "gated_retention"
  config.mesh.shape = (2, 1, 1, 2)
  model = Model(config.model, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 12 + 32 + 1), 0, config.model.vocab_size)
  _, carried = forward(model, tokens[:, :12], None, "chunkwise")
  graphdef, params = nnx.split(model)

  @jax.jit
  def step(params):
    def loss_fn(params):
      logits, state = nnx.merge(graphdef, params)(tokens[:, 12:-1], mode="chunkwise", state=carried)
      return losses.token_nll(logits, tokens[:, 13:]).mean(), (logits, state)
    return jax.value_and_grad(loss_fn, has_aux=True)(params)

  expected = jax.tree.leaves(step(params))
  with sharding.placement(config.mesh, jax.devices()[:4]).active():
    assert sharding.sequence_split() == ("sequence", 2)
    got = jax.tree.leaves(step(params))
  for a, b in zip(got, expected):
    assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("overrides,message", [
    (dict(mixer="gated"), r"unknown model.mixer 'gated'.*'retention'.*'gated_retention'"),
    (dict(mixer="gated_retention", gate_logit_normalizer=0.0),
     r"model.gate_logit_normalizer must be a positive finite number.*got 0.0"),
    (dict(mixer="gated_retention", gate_logit_normalizer=float("inf")), r"model.gate_logit_normalizer"),
    (dict(mixer="gated_retention", retention_impl="pallas", kernel_layout="fused"),
     r"retention_impl='pallas' cannot run: per-token decays run on the split kernels only, not "
     r"model.kernel_layout='fused': set model.kernel_layout='split'"),
    (dict(mixer="gated_retention", num_heads=3), r"model.d_model=32 is not divisible by model.num_heads=3"),
    (dict(mixer="gated_retention", gate_init="mamba"),
     r"unknown model.gate_init 'mamba' \(how the gate starts.*\); choose one of \('yoco', 'retnet'\)"),
    (dict(mixer="gated_retention", gate_init="retnet", num_heads=64, d_model=128),
     r"model.gate_init='retnet' cannot start heads \[49, .*63\] of model.num_heads=64 at RetNet's decay"),
    (dict(gate_init="retnet"), r"model.gate_init='retnet' is read by model.mixer='gated_retention' only"),
    # Another mixer's field set away from its default was ignored without a word.
    (dict(mixer="gated_retention", decay_gammas=(2.0, -1.0)),
     r"model.decay_gammas=\(2.0, -1.0\) is read by model.mixer='retention' only, but this model's layers run "
     r"'gated_retention', which ignore it: leave model.decay_gammas at its default \(None\), or set "
     r"model.mixer='retention'"),
    (dict(mixer="gated_retention", decay_schedule="logspace"), r"model.decay_schedule='logspace' is read by "),
    (dict(gate_logit_normalizer=8.0), r"model.gate_logit_normalizer=8.0 is read by model.mixer='gated_retention' "
                                      r"only, but this model's layers run 'retention', which ignore it"),
])
def test_bad_configs_are_refused(overrides, message):
  with pytest.raises(ValueError, match=message):
    tiny_model(**overrides)


def test_backend_checks_and_fields_it_does_not_read():
  """`auto` with the fused layout runs XLA's form (the fused kernels take no per-token decay); `pallas` is refused
  where the kernels do not compile; the normaliser's fields are not read (a torchscale style does not keep it from
  the kernels, and gives the same model: presets set it; the fixed decay's fields are refused)."""
  cfg = layer_config(retention_impl="auto", chunk_size=16, d_model=64, kernel_layout="fused")
  assert not multiscale_retention.uses_kernel(cfg, "gpu", per_token_decay=True)
  cfg = cfg.replace(kernel_layout="split", stability_norm_style="torchscale")
  assert multiscale_retention.uses_kernel(cfg, "gpu", per_token_decay=True)
  cfg = cfg.replace(retention_impl="pallas")
  with pytest.raises(ValueError, match=r"retention_impl='pallas' cannot run here"):
    GATED.check_backend(cfg, "cpu")
  tokens = random_tokens(1, 6)
  other = tiny_gated(stability_norm=False, stability_norm_style="torchscale")
  logits = [forward(model, tokens, None, "parallel")[0] for model in (tiny_gated(), other)]
  assert max_abs_diff(*logits) == 0
