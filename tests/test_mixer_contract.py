"""The mixer contract: every token mixer the registry offers (`architectures`: each `model.mixer`, attention as a
hybrid's last layer and as each other architecture's layers) and a test-only one (tests/contract_mixer.py: causal
linear attention without decay) keeps the promises of `mixers.base.Mixer`, in the tiny preset at awkward sizes (a
state carried over 5 tokens, then 13, in chunks of 4):

(a) its forms agree with each other, and layer by layer with a float64 run;
(b) a prefix then the rest from the returned state equals one call, in every sequence form and hand-off;
(c) decoding token by token from the empty state equals the parallel form;
(d) packed documents act as alone where it resets at them; elsewhere a ValueError names the fix;
(e) its FLOP counts (`matmul_params`, `mixing_flops`, what `hardware.flops` sums) match a traced count;
(f) a model of it round-trips through a checkpoint;
(g) its train and decode steps compile for a compile-only H100 (slow tier).

The mixer under test is the last layer's (`architectures.layer_mixers`); states are opaque pytrees. A mixer added to
`architectures.MIXERS` joins every test (docs/models.md, "Adding a mixer")."""

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from retnet_jax.hardware import accelerators, flops, matmul_dtypes
from retnet_jax.mixers import base
from retnet_jax.models import architectures, model_config, presets
from retnet_jax.models.model import Model
from retnet_jax.planning import aot
from retnet_jax.training import checkpointing
from tests import contract_mixer
from tests.helpers import aot_extra_missing, forward, max_abs_diff, random_tokens

BATCH, PREFIX, LENGTH, CHUNK = 2, 5, 13, 4  # 13 tokens after a carried state of 5; chunks of 4 do not divide 13
RTOL_FORMS, STATE_ATOL = 1e-5, 1e-5  # tests/helpers.forms_agree's: of the largest logit; on the states
# Against float64, relative to the largest value (tests/test_gated_retention.py's TOLERANCES for float32).
RTOL_FLOAT64 = 1e-5
FLOP_LENGTH = 256  # tokens of a traced sequence call: per-token terms the counts leave out are small beside 2 L d


def _config(architecture: str, num_layers: int = 1, **model_fields) -> ml_collections.ConfigDict:
  """The tiny preset's full config of `architecture` with `num_layers` layers, `model_fields`, and chunks of CHUNK
  where it has them."""
  config = presets.get_config("tiny", architecture)
  config.model.update(num_layers=num_layers, **model_fields)
  if "chunk_size" in config.model:
    config.model.chunk_size = CHUNK
  return config


def _case_configs() -> dict[str, ml_collections.ConfigDict]:
  """Full configs by case: a RetNet of each registered mixer and of the test mixer (read as the module is collected,
  before the test mixer is registered), a hybrid RetNet whose second layer is attention, and each other
  architecture."""
  configs = {name: _config("retnet", mixer=name) for name in dict.fromkeys([*architectures.MIXERS,
                                                                            contract_mixer.NAME])}
  configs["hybrid_attention"] = _config("retnet", num_layers=2, attention_layers=(1,))
  configs.update({name: _config(name) for name in architectures.ARCHITECTURES if name != "retnet"})
  return configs


CONFIGS = _case_configs()
CASES = list(CONFIGS)
TOKENS = random_tokens(BATCH, PREFIX + LENGTH, seed=1)
cases = pytest.mark.parametrize("case", CASES)


@pytest.fixture(scope="module", autouse=True)
def _test_mixer_registered():
  """The test-only mixer registered as `model.mixer=contract_mixer.NAME` while this module's tests run."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setitem(architectures.MIXERS, contract_mixer.NAME, contract_mixer.LINEAR_ATTENTION)
    yield


@functools.cache
def model_of(case: str) -> Model:
  """The case's model from seed 0, built once."""
  return Model(model_config.of(CONFIGS[case].model), rngs=nnx.Rngs(0))


def mixer_of(case: str) -> base.Mixer:
  """The mixer under test: the last layer's."""
  return architectures.layer_mixers(model_config.of(CONFIGS[case].model))[-1]


def rel_err(a, b) -> float:
  """The largest difference between two trees of arrays, each leaf's over the largest magnitude of b's, in float64."""
  return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
             / max(float(np.max(np.abs(np.asarray(y, np.float64)))), 1e-30)
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def assert_logits_close(got, expected, what) -> None:
  """Logits within RTOL_FORMS of the expected ones' largest."""
  assert max_abs_diff(got, expected) < RTOL_FORMS * float(jnp.abs(expected).max()), what


@functools.cache
def carried(case: str) -> tuple:
  """(logits, state) of the case's model over the 5 first tokens in the parallel form, made once."""
  return forward(model_of(case), TOKENS[:, :PREFIX], None, "parallel")


@functools.cache
def after(case: str, mode: str) -> tuple:
  """(logits, state) over the 13 other tokens from `carried`'s state in `mode`, made once."""
  return forward(model_of(case), TOKENS[:, PREFIX:], carried(case)[1], mode)


@functools.cache
def whole(case: str, mode: str) -> tuple:
  """(logits, state) over all 18 tokens from no state in `mode`, made once."""
  return forward(model_of(case), TOKENS, None, mode)


@cases
def test_forms_agree_after_a_carried_state(case):
  """(a) From a state carried over 5 tokens, every form the model computes gives the same logits and state over 13
  tokens (chunks of 4 leave a partial one), and the forms include the mixer's own."""
  modes = architectures.modes(model_config.of(CONFIGS[case].model))
  assert modes[0] == "parallel" and set(mixer_of(case).modes) <= set(modes)
  for a, b in itertools.combinations(modes, 2):
    (logits_a, state_a), (logits_b, state_b) = after(case, a), after(case, b)
    assert_logits_close(logits_b, logits_a, (a, b))
    assert max_abs_diff(state_b, state_a) < STATE_ATOL, (a, b)


@nnx.jit(static_argnames=("mixer", "cfg", "modes"))
def layer_runs(layer, x_BxTxD, positions_BxT, mixer, cfg, modes) -> dict:
  """One layer of `mixer` as one compiled program: without `modes`, {"whole": (y, state)} over all 18 inputs from no
  state in the parallel form; else per form of `modes`, (y, state) over the last 13 from the state of the 5 first
  (parallel)."""
  run = lambda x, positions, state, mode: layer(x, mixer.context(cfg, base.Call(positions, mode, None)), state)
  if not modes:
    return {"whole": run(x_BxTxD, positions_BxT, None, "parallel")}
  _, carried_state = run(x_BxTxD[:, :PREFIX], positions_BxT[:, :PREFIX], None, "parallel")
  return {mode: run(x_BxTxD[:, PREFIX:], positions_BxT[:, PREFIX:], carried_state, mode) for mode in modes}


def layer_results(case: str, dtype, modes: tuple[str, ...]) -> dict:
  """`layer_runs` (as NumPy) of the mixer's layer built in `dtype` (its parameters float32 whatever the dtype, drawn
  from seed 0) over random inputs."""
  cfg, mixer = model_config.of(CONFIGS[case].model), mixer_of(case)
  x_BxTxD = jnp.asarray(np.random.default_rng(2).normal(size=(BATCH, PREFIX + LENGTH, cfg.d_model)), dtype)
  positions_BxT = jnp.broadcast_to(jnp.arange(PREFIX + LENGTH, dtype=jnp.int32), x_BxTxD.shape[:2])
  layer = mixer.layer(cfg, dtype=dtype, rngs=nnx.Rngs(0))
  return jax.tree.map(np.asarray, layer_runs(layer, x_BxTxD, positions_BxT, mixer, cfg, modes))


@cases
def test_layer_forms_match_a_float64_run(case):
  """(a) The model computes in float32 or bfloat16 only, so the mixer's layer is run alone: in float32, each of its
  forms over 13 inputs after a state carried over 5 gives, within RTOL_FLOAT64, the outputs and final state of the
  float64 layer (the same parameters) over all 18 in the parallel form (measured: 3e-7 to 4e-7)."""
  with jax.enable_x64(True):
    y64, state64 = layer_results(case, jnp.float64, ())["whole"]
  assert y64.dtype == np.float64
  for mode, got in layer_results(case, jnp.float32, mixer_of(case).modes).items():
    error = rel_err(got, (y64[:, PREFIX:], state64))
    assert got[0].dtype == np.float32 and error < RTOL_FLOAT64, (mode, error)


@cases
def test_a_prefix_then_the_rest_equals_one_call(case):
  """(b) In every sequence form, 5 tokens then 13 from the returned state give one call's logits and state over the
  18; so do 5 in the parallel form then 13 in each sequence form."""
  model = model_of(case)
  modes = architectures.modes(model_config.of(CONFIGS[case].model))
  for mode in (m for m in modes if m in architectures.SEQUENCE_MODES):
    head = carried(case) if mode == "parallel" else forward(model, TOKENS[:, :PREFIX], None, mode)
    rest = after(case, mode) if mode == "parallel" else forward(model, TOKENS[:, PREFIX:], head[1], mode)
    logits, state = whole(case, mode)
    for first, head_logits, (rest_logits, rest_state) in ((mode, head[0], rest),
                                                          ("parallel", carried(case)[0], after(case, mode))):
      assert_logits_close(jnp.concatenate([head_logits, rest_logits], axis=1), logits, (first, mode))
      assert max_abs_diff(rest_state, state) < STATE_ATOL, (first, mode)


@cases
def test_decoding_token_by_token_equals_the_parallel_form(case):
  """(c) From the model's empty state (`init_state`), the recurrent form fed one token at a time gives the parallel
  form's logits at every position, and its state."""
  model = model_of(case)
  state, steps = model.init_state(BATCH), []
  for n in range(TOKENS.shape[1]):
    logits, state = forward(model, TOKENS[:, n:n + 1], state, "recurrent")
    steps.append(logits)
  assert_logits_close(jnp.concatenate(steps, axis=1), whole(case, "parallel")[0], "decoded")
  assert max_abs_diff(state, whole(case, "parallel")[1]) < STATE_ATOL


@cases
def test_packed_documents_act_as_alone_or_are_refused(case):
  """(d) Two documents packed in each row, the 13 first tokens then the 5 first again: in a form where the model
  resets at documents (`architectures.document_refusal` is None) they give the logits each gives alone (the 13
  first of one call over the 18, by causality; the 5 first), and the state returned continues as the last one's
  alone; in another form, the call is refused by a ValueError with the refusal, which names the fix ("...: use ...")."""
  model, cfg = model_of(case), model_config.of(CONFIGS[case].model)
  packed_BxT = np.concatenate([TOKENS[:, :LENGTH], TOKENS[:, :PREFIX]], axis=1)
  segment_ids_BxT = jnp.asarray(np.repeat([[3] * LENGTH + [8] * PREFIX], BATCH, axis=0), jnp.int32)
  alone = jnp.concatenate([whole(case, "parallel")[0][:, :LENGTH], carried(case)[0]], axis=1)
  for mode in architectures.modes(cfg):
    if reason := architectures.document_refusal(cfg, mode):
      assert re.search(r": use .+", reason), reason
      with pytest.raises(ValueError, match=re.escape(reason)):
        forward(model, packed_BxT, None, mode, segment_ids_BxT)
      continue
    logits, state = forward(model, packed_BxT, None, mode, segment_ids_BxT)
    assert_logits_close(logits, alone, mode)
    assert_logits_close(forward(model, TOKENS[:, PREFIX:], state, "parallel")[0], after(case, "parallel")[0], mode)


def traced_flops(fn, *args) -> float:
  """The matmul FLOPs of `fn(*args)` traced from its jaxpr (`matmul_dtypes`, the AOT planner's count: every
  dot_general, a scan's body once per step): no compile."""
  return sum(matmul_dtypes.matmul_flops_by_dtype(jax.make_jaxpr(fn)(*args)).values())


def flop_call(cfg, mode: str, state_of) -> tuple[int, int, object]:
  """(tokens, context, state) of a traced call in `mode`: FLOP_LENGTH tokens from no state in a sequence form, one
  decoding step from `state_of(BATCH)` reading `architectures.decode_context` tokens in the recurrent form."""
  if mode == "recurrent":
    return 1, architectures.decode_context(cfg), state_of(BATCH)
  return FLOP_LENGTH, FLOP_LENGTH, None


def layer_flops(cfg, mixer: base.Mixer, mode: str) -> tuple[float, float]:
  """(traced, analytic) forward FLOPs of one layer of `mixer` per token in `mode` (`flop_call`'s call)."""
  layer = mixer.layer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
  tokens, context, state = flop_call(cfg, mode, lambda batch: mixer.init_state(cfg, batch))
  call = base.Call(jnp.broadcast_to(jnp.arange(tokens), (BATCH, tokens)), mode, None)
  x_BxLxD = jax.ShapeDtypeStruct((BATCH, tokens, cfg.d_model), jnp.float32)
  traced = traced_flops(lambda x, s: layer(x, mixer.context(cfg, call), s), x_BxLxD, state) / (BATCH * tokens)
  return traced, 2 * mixer.matmul_params(cfg) + mixer.mixing_flops(cfg, context, mode)


# traced mixing / mixing_flops, measured: sequence forms 1.0 to 1.4 (retention's parallel form: its normaliser's
# second pass, which XLA shares with the first, 1.35), recurrent 0.5 to 1.0 (0.5: only the state read q S is a matmul
# in retention's forms, the update k^T v elementwise).
MIXING_RATIOS = {"parallel": (0.9, 1.5), "chunkwise": (0.9, 1.5), "recurrent": (0.45, 1.1)}


@cases
def test_a_mixer_that_cannot_split_sequences_refuses_a_mesh_that_does(case):
  """A mixer whose `splits_sequences` is False refuses sequences split over 2 devices, naming where (the base class's
  default: a new mixer cannot forget it); one that splits takes whole chunks per device in its sequence forms."""
  cfg, mixer = model_config.of(CONFIGS[case].model), mixer_of(case)
  modes = tuple(mode for mode in mixer.modes if mode != "recurrent")
  check = lambda: mixer.check_sequence_split(cfg, "the mesh splits sequences over 2 devices", 2, 4 * CHUNK, modes)
  if mixer.splits_sequences:
    check()
  else:
    with pytest.raises(ValueError, match=r"^the mesh splits sequences over 2 devices, but .*: use a mesh whose "):
      check()


@cases
def test_flop_counts_match_a_traced_count(case):
  """(e) `matmul_params` counts the layer's weight matrices (each multiplies every token once). In each of the
  mixer's forms over 256 tokens (one decoding step: recurrent), the layer's traced matmul FLOPs per token less
  2 x matmul_params, over `mixing_flops`, lie in MIXING_RATIOS: the analytic count leaves out per-token state terms
  (the parallel form's final state k^T v) and second passes, the traced one products that are not matmuls. The
  model's traced FLOPs fall short of `flops.forward_flops_per_token` by exactly its layers' shortfalls: flops.py
  counts its FFNs and head as computed, and sums every layer's mixer."""
  cfg, mixer, model = model_config.of(CONFIGS[case].model), mixer_of(case), model_of(case)
  matrices = sum(x.size for x in jax.tree.leaves(nnx.state(mixer.layer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)),
                                                           nnx.Param)) if x.ndim == 2)
  assert mixer.matmul_params(cfg) == matrices
  for mode in mixer.modes:
    traced, analytic = layer_flops(cfg, mixer, mode)
    low, high = MIXING_RATIOS[mode]
    ratio = (traced - 2 * matrices) / (analytic - 2 * matrices)
    assert low <= ratio <= high, (mode, ratio)
  for mode in architectures.modes(cfg):
    tokens, context, state = flop_call(cfg, mode, model.init_state)
    tokens_BxL = jax.ShapeDtypeStruct((BATCH, tokens), jnp.int32)
    traced = traced_flops(lambda t, s: model(t, mode=mode, state=s), tokens_BxL, state) / (BATCH * tokens)
    gaps = {m: -np.subtract(*layer_flops(cfg, m, mode)) for m in architectures.mixers(cfg)}  # analytic - traced
    layers_gap = sum(gaps[m] for m in architectures.layer_mixers(cfg))
    assert flops.forward_flops_per_token(cfg, context, mode) - traced == layers_gap, mode


@cases
def test_a_checkpoint_round_trip_keeps_parameters_and_outputs(case, tmp_path):
  """(f) The model's parameters saved and restored through `checkpointing.Checkpointer` into a model drawn from
  another seed are the saved ones bit for bit, and give the same logits."""
  model, cfg = model_of(case), model_config.of(CONFIGS[case].model)
  params = nnx.state(model, nnx.Param)
  with checkpointing.Checkpointer(tmp_path, async_save=False) as ckpt:
    assert ckpt.save(1, {"params": params}, {"case": case})
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), {"params": params})
  with checkpointing.Checkpointer(tmp_path, read_only=True) as ckpt:
    restored, meta = ckpt.restore(abstract, 1)
  other = Model(cfg, rngs=nnx.Rngs(1))
  assert max_abs_diff(nnx.state(other, nnx.Param), params) > 0 and meta["case"] == case
  nnx.update(other, restored["params"])
  assert jax.tree.structure(nnx.state(other, nnx.Param)) == jax.tree.structure(params)
  for got, saved in zip(jax.tree.leaves(nnx.state(other, nnx.Param)), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(saved))
  # The restored arrays are placed on a device (committed): a compile of their own, on the 5 first tokens.
  np.testing.assert_array_equal(forward(other, TOKENS[:, :PREFIX], None, "parallel")[0], carried(case)[0])


needs_gpu = pytest.mark.skipif(aot_extra_missing("gpu") is not None, reason=str(aot_extra_missing("gpu")))


@pytest.mark.slow
@pytest.mark.optimized
@needs_gpu
@cases
def test_train_and_decode_steps_compile_for_an_h100(case):
  """(g) The tiny preset's train and decode steps with the mixer compile for a compile-only H100 (`aot.plan`) and
  fit, and each step's matmul FLOPs traced from its jaxpr are within 10% of the model's count (`flops`; measured
  0.96 to 1.04)."""
  report = aot.plan(CONFIGS[case], accelerators.parse_target("h100:1"), ("train", "decode"))
  assert report["fits"] and report["device_kind"] == accelerators.CHIPS["h100"].device_kind
  for name, step in report["steps"].items():
    repeats = aot.DECODE_TOKENS if name == "decode" else 1  # the decoding loop's body is traced once
    ratio = sum(step["matmul_flops_by_dtype"].values()) * repeats / step["model_flops_per_device"]
    assert step["fits"] and step["compile_seconds"] > 0 and 0.9 <= ratio <= 1.1, (name, ratio)

