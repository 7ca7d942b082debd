"""The fused Pallas retention kernels against a float64 reference and the XLA chunkwise form: in interpret mode on a
CPU, compiled on a GPU (`RETNET_TEST_BACKEND=gpu`, float32 products at `highest`).

Values and gradients (q, k, v, carried state), lengths that are not whole chunks or shorter than one, chunk 1 (on a
GPU: each of the compiled kernels' chunk tiles), several value tiles (the backward pass's partial sums) and a padded
d_v, bfloat16 inputs, decays near 1 and 0, the stability normaliser's by-products against what `layers.py` computes,
and the input and support errors. Shapes are tiny: interpret mode runs the kernels as XLA loops, and each distinct
shape compiles once; on a GPU they are as small as the compiled kernels take.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from retnet_jax.mixers import kernels, retention, stability
from retnet_jax.mixers.kernels import backward, forward, support
from tests import helpers

# Interpreted, the kernels take any size; compiled (on a GPU), key widths of 16 to 256 and chunks of 16, 32 or 64
# (`support.check_supported`), there tiled as `support.default_config` tiles them: 16 value columns or more.
GPU = helpers.on_gpu()
BATCH, HEADS = 2, 2
D_K = TILE = 16 if GPU else 8  # the key width; the narrowest value tile
D_V = 2 * TILE
LOG_DECAY = np.log(np.array([0.6, 0.995])).astype(np.float32)
LAYOUTS = kernels.LAYOUTS  # every test of the kernels runs on each layout, the split and the fused kernels


def two_tiles(layout):
  """Two value tiles (fused: dq and dk summed over them; split: two steps of the dq/dk walk over the values) and, in
  the split layout interpreted, two key tiles per dq/dk program (compiled, one: Triton's dots take 16 columns or
  more)."""
  return kernels.KernelConfig(kernels.Tiling(TILE), kernels.Tiling(TILE), layout=layout,
                              block_k=D_K if GPU else D_K // 2)


def config_for(kind, layout):
  """`two_tiles` for "two_tiles", else the layout's default config."""
  return two_tiles(layout) if kind == "two_tiles" else kernels.default_config(D_K, D_V, layout)


# (length, chunk) beside chunk 16's cases: several whole chunks and a partial one (chunk 4 interpreted, 32 compiled);
# the default config's one value tile (at chunk 1 interpreted, at the largest chunk tile compiled).
MANY_CHUNKS = (100, 32) if GPU else (21, 4)
DEFAULT_CONFIG = (70, 64) if GPU else (7, 1)
F32_TOL, BF16_TOL = 1e-6, 2e-2  # relative to the largest magnitude; bfloat16 keeps 8 bits of mantissa


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def random_inputs(length, seed, d_v=D_V):
  """q, k, v, state, the cotangents of out and of the final state, and a key sum, as float64 NumPy arrays."""
  rng = np.random.default_rng(seed)
  q, k = rng.normal(size=(2, BATCH, length, HEADS, D_K))
  v, d_out = rng.normal(size=(2, BATCH, length, HEADS, d_v))
  state, d_state = rng.normal(size=(2, BATCH, HEADS, D_K, d_v))
  key_sum = rng.normal(size=(BATCH, HEADS, D_K))
  return q, k, v, state, d_out, d_state, key_sum


def with_vjp(form, q, k, v, state, d_out, d_state):
  """`(out, final_state, (dq, dk, dv, d_state_in))` of `form(q, k, v, state)` for the given cotangents."""
  (out, final), pullback = jax.vjp(form, q, k, v, state)
  return out, final, pullback((d_out.astype(out.dtype), d_state))


def reference(log_decay, q, k, v, state, d_out, d_state):
  """The parallel form in float64: values and gradients."""
  with jax.enable_x64(True):
    args = [jnp.asarray(x, jnp.float64) for x in (q, k, v, state, d_out, d_state)]
    form = lambda q, k, v, s: retention.parallel_retention(q, k, v, jnp.asarray(log_decay, jnp.float64), s)
    out, final, grads = with_vjp(form, *args)
    return np.asarray(out), np.asarray(final), [np.asarray(g) for g in grads]


@functools.cache
def kernel_vjp(chunk, config, log_decay=tuple(LOG_DECAY)):
  form = lambda q, k, v, s: kernels.chunkwise_retention(q, k, v, np.float32(log_decay), chunk, s, config=config)
  return jax.jit(functools.partial(with_vjp, form))


@functools.cache
def xla_vjp(chunk):
  form = lambda q, k, v, s: retention.chunkwise_retention(q, k, v, LOG_DECAY, chunk, s)
  return jax.jit(functools.partial(with_vjp, form))


def assert_close(results, expected, tol, context):
  out, final, grads = results
  ref_out, ref_final, ref_grads = expected
  errors = {"out": rel_err(out, ref_out), "state": rel_err(final, ref_final),
            **{name: rel_err(g, r) for name, g, r in zip(("dq", "dk", "dv", "d_state"), grads, ref_grads)}}
  assert max(errors.values()) < tol, (context, errors)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("length,chunk,config", [
    (37, 16, "two_tiles"),  # a partial last chunk
    (5, 16, "two_tiles"),  # shorter than one chunk
    (*DEFAULT_CONFIG, "default"),  # one value tile
    (64, 16, "two_tiles"),  # whole chunks
    (*MANY_CHUNKS, "two_tiles"),  # several chunks and a partial one
])
def test_float32_values_and_gradients_match_float64_and_xla(length, chunk, config, layout):
  inputs = random_inputs(length, seed=length + chunk)
  args = [jnp.asarray(x, jnp.float32) for x in inputs[:6]]
  results = kernel_vjp(chunk, config_for(config, layout))(*args)
  assert results[0].dtype == jnp.float32 and results[0].shape == args[2].shape
  assert results[1].dtype == jnp.float32 and results[1].shape == args[3].shape
  assert_close(results, reference(LOG_DECAY, *inputs[:6]), F32_TOL, "float64")
  assert_close(results, xla_vjp(chunk)(*args), F32_TOL, "xla")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bfloat16_inputs_within_bfloat16_rounding(layout):
  """bfloat16 q, k, v (float32 state): out in bfloat16, state float32, both and the gradients within 2e-2 of the
  float64 reference, and as close to the XLA form's bfloat16 result; the final state within float32 rounding of the
  float64 state of the rounded inputs (the decayed keys are not rounded to bfloat16 for it)."""
  inputs = random_inputs(37, seed=11)
  args = [jnp.asarray(x, jnp.bfloat16) for x in inputs[:3]] + [jnp.asarray(x, jnp.float32) for x in inputs[3:6]]
  results = kernel_vjp(16, two_tiles(layout))(*args)
  assert results[0].dtype == jnp.bfloat16 and results[1].dtype == jnp.float32
  assert [g.dtype for g in results[2]] == [jnp.bfloat16] * 3 + [jnp.float32]
  assert_close(results, reference(LOG_DECAY, *inputs[:6]), BF16_TOL, "float64")
  assert_close(results, xla_vjp(16)(*args), BF16_TOL, "xla")
  rounded_state = reference(LOG_DECAY, *(np.asarray(x, np.float64) for x in args))[1]
  assert rel_err(results[1], rounded_state) < F32_TOL


@pytest.mark.parametrize("layout", LAYOUTS)
def test_padded_value_dim_other_backward_tiling_and_extreme_decays(layout):
  """d_v = 12 padded to 16 (24 to 32 on a GPU): one forward tile, two backward tiles; decays of 1 - 2^-20 (the state
  barely decays: float32's log(gamma) is where the precision lies) and 0.02 (gamma^16 underflows to 0 without NaNs)."""
  log_decay = np.log(np.array([1 - 2.0**-20, 0.02])).astype(np.float32)
  inputs = random_inputs(70, seed=3, d_v=TILE + TILE // 2)
  args = [jnp.asarray(x, jnp.float32) for x in inputs[:6]]
  config = kernels.KernelConfig(forward=kernels.Tiling(2 * TILE), backward=kernels.Tiling(TILE), layout=layout)
  results = kernel_vjp(16, config, tuple(log_decay))(*args)
  assert_close(results, reference(log_decay, *inputs[:6]), F32_TOL, "float64")


def test_empty_sequence_passes_the_states_through():
  q, k, v, state, _, _, key_sum = (jnp.asarray(x, jnp.float32) for x in random_inputs(0, seed=0))
  out, final, qz, key_sum_out = kernels.chunkwise_retention_with_key_sum(q, k, v, LOG_DECAY, 16, state, key_sum)
  assert out.shape == v.shape and qz.shape == (BATCH, 0, HEADS)
  np.testing.assert_array_equal(final, state)
  np.testing.assert_array_equal(key_sum_out, key_sum)


@functools.cache
def kernel_with_key_sum(chunk, layout):
  return jax.jit(lambda q, k, v, s, z: kernels.chunkwise_retention_with_key_sum(q, k, v, LOG_DECAY, chunk, s, z,
                                                                                config=two_tiles(layout)))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, F32_TOL), (jnp.bfloat16, BF16_TOL)])
def test_normaliser_by_products_match_float64_and_layers(dtype, tol, layout):
  """qz = q_n . z_n and the final key sum, from the same pass, against the float64 retention of a ones column and
  against `layers.py`'s second XLA call (retention of ones, rounded to the compute dtype); the divisors they give
  agree, and out and the state are those of `chunkwise_retention`."""
  length, chunk = 37, 16
  q, k, v, state, _, _, key_sum = random_inputs(length, seed=5)
  with jax.enable_x64(True):
    ones = jnp.ones((BATCH, length, HEADS, 1), jnp.float64)
    ref_qz, ref_key_sum = retention.parallel_retention(q, k, ones, LOG_DECAY.astype(np.float64), key_sum[..., None])
  args = [jnp.asarray(x, dtype) for x in (q, k, v)] + [jnp.asarray(x, jnp.float32) for x in (state, key_sum)]
  out, final, qz, key_sum_out = kernel_with_key_sum(chunk, layout)(*args)
  assert qz.dtype == key_sum_out.dtype == jnp.float32 and qz.shape == (BATCH, length, HEADS)
  assert rel_err(qz, ref_qz[..., 0]) < tol and rel_err(key_sum_out, ref_key_sum[..., 0]) < tol

  layers_qz, layers_key_sum, _, _ = retention.chunkwise_with_states(
      args[0], args[1], jnp.ones((BATCH, length, HEADS, 1), dtype), LOG_DECAY, chunk, args[4][..., None])
  assert rel_err(qz, layers_qz[..., 0]) < tol and rel_err(key_sum_out, layers_key_sum[..., 0]) < tol
  positions = jnp.broadcast_to(jnp.arange(length), (BATCH, length))
  divisors = [stability.divisor("shared", "chunkwise", x, positions, LOG_DECAY) for x in (qz, layers_qz[..., 0])]
  assert rel_err(*divisors) < tol

  plain_out, plain_final = kernel_vjp(chunk, two_tiles(layout))(*args[:4], args[2], args[3])[:2]
  np.testing.assert_array_equal(out, plain_out)
  np.testing.assert_array_equal(final, plain_final)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_key_sum_form_differentiates_like_the_plain_form(layout):
  """Gradients flow through out and the state only: qz and the key sum are constants, as the divisor is."""
  length, chunk = MANY_CHUNKS
  q, k, v, state, d_out, d_state, key_sum = (jnp.asarray(x, jnp.float32) for x in random_inputs(length, seed=8))

  def loss(form, q, k, v, s):
    out, final = form(q, k, v, s)[:2]
    return jnp.sum(out * d_out) + jnp.sum(final * d_state)

  with_key_sum = lambda *a: kernels.chunkwise_retention_with_key_sum(*a[:3], LOG_DECAY, chunk, a[3], key_sum,
                                                                     config=two_tiles(layout))
  expected = kernel_vjp(chunk, two_tiles(layout))(q, k, v, state, d_out, d_state)[2]
  grads = jax.jit(jax.grad(functools.partial(loss, with_key_sum), argnums=(0, 1, 2, 3)))(q, k, v, state)
  for g, e in zip(grads, expected):
    np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6)
  qz_grad = jax.jit(jax.grad(lambda q: jnp.sum(with_key_sum(q, k, v, state)[2])))(q)
  assert not np.any(np.asarray(qz_grad))


def test_input_errors_name_the_problem():
  """Each bad input refused by name; compiling for a backend without the kernels (the CPU, whatever runs the tests)
  refused naming the backend and the fix."""
  q, k, v, state, _, _, key_sum = (jnp.asarray(x, jnp.float32) for x in random_inputs(5, seed=0))
  for bad in (0, -2, 2.5):
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
      kernels.chunkwise_retention(q, k, v, LOG_DECAY, bad)
  with pytest.raises(ValueError, match="one dtype, float32 or bfloat16"):
    kernels.chunkwise_retention(q.astype(jnp.bfloat16), k, v, LOG_DECAY, 4)
  with pytest.raises(ValueError, match="one dtype, float32 or bfloat16"):
    kernels.chunkwise_retention(*(x.astype(jnp.float16) for x in (q, k, v)), LOG_DECAY, 4)
  with pytest.raises(ValueError, match="state must be"):
    kernels.chunkwise_retention(q, k, v, LOG_DECAY, 4, state[..., :3])
  with pytest.raises(ValueError, match="key_sum must be"):
    kernels.chunkwise_retention_with_key_sum(q, k, v, LOG_DECAY, 4, state, key_sum[..., :3])
  with pytest.raises(ValueError, match="log_decay must be <= 0"):
    kernels.chunkwise_retention(q, k, v, -LOG_DECAY, 4)
  with support.target_backend("cpu"), pytest.raises(
      ValueError, match="retention_impl='pallas': .* backend is 'cpu'.*retention_impl='xla'"):
    kernels.chunkwise_retention(q, k, v, LOG_DECAY, 4, interpret=False)


def test_support_limits_name_the_limit_and_the_fix():
  assert support.resolve_interpret(None) is (jax.default_backend() != "gpu")
  for d_k, d_v in ((256, 256), (128, 128), (256, 512), (256, 432), (16, 32)):
    assert kernels.is_supported(d_k, d_v, jnp.bfloat16, 64, "gpu", "fused")
    assert kernels.is_supported(d_k, d_v, jnp.bfloat16, kernels.default_chunk(d_k, d_v), "gpu")
    kernels.check_supported(d_k, d_v, "float32", 64, "gpu")
  assert [kernels.default_chunk(*dims) for dims in ((256, 512), (256, 256), (128, 128))] == [128, 64, 64]
  for args, match in [((256, 512, jnp.bfloat16, 64, "cpu"), "GPUs only .* backend is 'cpu'"),
                      ((256, 512, jnp.bfloat16, 64, "tpu"), "backend is 'tpu'"),
                      ((256, 512, jnp.float16, 64, "gpu"), "dtype float16"),
                      ((256, 512, jnp.bfloat16, 100, "gpu"),
                       r"chunk_size 100 is not one of the split .*\(16, 32, 64, 128\)"),
                      ((256, 512, jnp.bfloat16, 128, "gpu", "fused"),
                       r"chunk_size 128 is not one of the fused .*\(16, 32, 64\)"),
                      ((256, 512, jnp.bfloat16, 256, "gpu"), "chunk_size 256"),
                      ((256, 512, jnp.bfloat16, 8, "gpu"), "chunk_size 8"),
                      ((512, 512, jnp.bfloat16, 64, "gpu"), "key head dim 512"),
                      ((96, 512, jnp.bfloat16, 64, "gpu"), "key head dim 96")]:
    assert not kernels.is_supported(*args)
    with pytest.raises(ValueError, match=match) as error:
      kernels.check_supported(*args)
    assert "retention_impl='xla'" in str(error.value) and "'auto'" in str(error.value)


def test_launch_grids_put_the_split_layout_s_serial_steps_in_the_state_passes_only():
  """At the benchmark's 4k tokens (batch 4, 8 heads, d_k = d_v = 256, chunk 64): the split output pass launches at
  least 20 times the fused forward's programs, one chunk each; only the state passes walk the chunks."""
  split, fused = (kernels.launch_grids(4, 4096, 8, 256, 256, 64, kernels.default_config(256, 256, layout))
                  for layout in ("split", "fused"))
  assert split["split/output"]["programs"] >= 20 * fused["fused/forward"]["programs"]
  assert fused["fused/forward"] == {"programs": 8 * 4 * 8, "serial_steps": 64}  # 32 value columns per program
  assert split["split/output"] == {"programs": 4 * 64 * 4 * 8, "serial_steps": 1}
  assert split["split/dqk"] == {"programs": 4 * 64 * 4 * 8, "serial_steps": 1, "value_steps": 4}
  assert {name for name, grid in split.items() if grid["serial_steps"] > 1} == {"split/states",
                                                                                 "split/state_gradients"}


# JAX 0.11 and later lower Pallas' Triton kernels only where they see a GPU (or an abstract one), and say so in this
# message; earlier versions lowered for compute capability 9.0 without one.
NO_GPU_TO_LOWER_FOR = "No supported GPU devices found, please specify an abstract GPU device using AbstractDevice."


def needs_a_gpu_to_lower(error: RuntimeError) -> bool:
  """Whether `error` is JAX's own refusal to lower Triton kernels without a GPU (NO_GPU_TO_LOWER_FOR, from a JAX that
  gives it): a skip. Any other error, one that names a GPU included, is a failure of the kernels' lowering."""
  return jax.__version_info__ >= (0, 11) and str(error).startswith(NO_GPU_TO_LOWER_FOR)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype,d_k,d_v,chunk,precision", [(jnp.bfloat16, 256, 512, 64, None),
                                                           (jnp.float32, 16, 32, 16, jax.lax.Precision.HIGHEST)])
def test_kernels_lower_to_triton_for_gpus(dtype, d_k, d_v, chunk, precision, packed):
  """The forward (with the key sum) and backward kernels, with and without packed documents (an int32 document index
  per token), lower to Triton IR for CUDA at the paper's head sizes and in float32: they use only what Pallas' Triton
  lowering supports. Triton compiles the IR to GPU code on a GPU only, where its register and shared-memory limits
  show (`scripts/kernel_check.py`). The fused kernels here; the split ones in the next test."""
  batch, length, heads = 1, 2 * chunk, 2
  config = kernels.default_config(d_k, d_v, "fused")
  arrays = lambda *shapes_dtypes: [jax.ShapeDtypeStruct(s, d) for s, d in shapes_dtypes]
  q, v, state, key_sum, log_decay, documents = arrays(
      ((batch, length, heads, d_k), dtype), ((batch, length, heads, d_v), dtype),
      ((batch, heads, d_k, d_v), jnp.float32), ((batch, heads, d_k), jnp.float32), ((heads,), jnp.float32),
      ((batch, length), jnp.int32))
  documents = documents if packed else None
  static = dict(size=chunk, length=length - 3, precision=precision, interpret=False)
  try:
    for fn, args in [(functools.partial(forward.forward, tiling=config.forward, **static),
                      (q, q, v, log_decay, state, key_sum)),
                     (functools.partial(backward.backward, tiling=config.backward, **static),
                      (q, q, v, log_decay, state, v, state))]:
      with_documents = lambda *a, fn=fn: fn(*a[:-1], documents=a[-1])
      text = jax.jit(with_documents).trace(*args, documents).lower(lowering_platforms=("cuda",)).as_text()
      assert text.count("xla.gpu.triton") == 1
      assert (f"tensor<{batch}x{length}xi32>" in text) == packed
  except RuntimeError as e:
    if not needs_a_gpu_to_lower(e):
      raise
    pytest.skip(f"this JAX cannot lower Pallas Triton kernels without a GPU: {e}")


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("dtype,d_k,d_v,chunk,precision", [(jnp.bfloat16, 256, 512, 64, None),
                                                           (jnp.float32, 16, 32, 16, jax.lax.Precision.HIGHEST)])
def test_split_kernels_lower_to_triton_for_gpus(dtype, d_k, d_v, chunk, precision, per_token):
  """The split kernels' forward and backward (key sum, packed documents, per-head or per-token decays, their
  gradient) lower to Triton IR for CUDA: two kernels forward (states, outputs), four backward (states again, the
  state gradient's reverse pass, dv, dq/dk)."""
  batch, length, heads = 1, 2 * chunk - 3, 2
  q, v = (jax.ShapeDtypeStruct((batch, length, heads, d), dtype) for d in (d_k, d_v))
  log_decay = jax.ShapeDtypeStruct((batch, length, heads) if per_token else (heads,), jnp.float32)
  ids = jax.ShapeDtypeStruct((batch, length), jnp.int32)

  def loss(q, k, v, log_decay, ids):
    out, state, qz, _ = kernels.chunkwise_retention_with_key_sum(q, k, v, log_decay, chunk, segment_ids=ids,
                                                                 precision=precision)
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(state) + jnp.sum(qz)

  try:
    with support.target_backend("gpu"):
      texts = [jax.jit(fn).trace(q, q, v, log_decay, ids).lower(lowering_platforms=("cuda",)).as_text()
               for fn in (loss, jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))]
  except RuntimeError as e:
    if not needs_a_gpu_to_lower(e):
      raise
    pytest.skip(f"this JAX cannot lower Pallas Triton kernels without a GPU: {e}")
  assert [text.count("xla.gpu.triton") for text in texts] == [2, 6]
