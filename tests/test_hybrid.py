"""Hybrid RetNets (`model.attention_layers`): softmax attention in chosen layers, optionally over a sliding window
through a ring-buffer KV cache. The three modes and every hand-off agree to float32 rounding, unrolled or scanned; a
windowed prefill then decoding equals the parallel logits past the window; the attention layer equals a float64
reference; packed documents and left padding act as alone; segments and remat keep the gradients; generation, training
with resume, evaluation, passkey and a sharded step work; bad fields are refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import retnet as retnet_config
from retnet_jax.core import sharding
from retnet_jax.evaluation import evaluate, passkey_eval, sampling
from retnet_jax.input_pipeline import passkey
from retnet_jax.input_pipeline.tokenizer import ByteTokenizer
from retnet_jax.mixers import attention as attention_mixer
from retnet_jax.models import architectures, model_config, presets
from retnet_jax.nn import layer_stack, rotation
from retnet_jax.training import losses, run_config, train, train_state, train_step
from tests.helpers import (assert_resumed_from, forms_agree, forward, max_abs_diff, on_gpu, random_tokens,
                           read_metrics, tiny_config, tiny_model)

SAMPLER = sampling.Sampler()  # one sampler: its compiled functions are reused across tests

MODES = architectures.MODES
# Layer 1 of the tiny preset's two is attention: every earlier token with grouped key/value heads, or a window of 5
# tokens (shorter than the calls below, so the ring buffer wraps) with the tiny preset's heads; and four layers,
# every second one attention, scanned (two groups of a retention and an attention block).
HYBRIDS = {"full_gqa": dict(attention_layers=(1,), attention_num_heads=4, attention_num_kv_heads=2),
           "window": dict(attention_layers=(1,), attention_window=5, attention_rotation_base=500.0),
           "scanned": dict(num_layers=4, attention_layers=(1, 3), attention_window=5, scan_layers=True)}


@pytest.fixture(scope="module", params=sorted(HYBRIDS))
def hybrid(request):
  return tiny_model(chunk_size=4, **HYBRIDS[request.param])


def test_modes_agree(hybrid):
  """13 tokens (chunk 4, window 5): logits and states of the three forms agree to float32 rounding."""
  results = forms_agree(hybrid, random_tokens(2, 13), MODES)
  state = results["parallel"][1].layers[-1]
  assert isinstance(state, attention_mixer.KVCache) and int(state.next_slot) == 13


@pytest.mark.parametrize("first,second", [("chunkwise", "recurrent"), ("parallel", "chunkwise"),
                                          ("recurrent", "parallel")])
def test_prefill_in_one_mode_continues_in_another(hybrid, first, second):
  """A state handed from one form to another, twice (7 + 5 + 7 tokens: the window's ring wraps inside a call and
  across calls), continues the whole sequence's parallel logits; the states agree too."""
  tokens = random_tokens(2, 19, seed=1)
  whole, whole_state = forward(hybrid, tokens, None, "parallel")
  logits1, state = forward(hybrid, tokens[:, :7], None, first)
  logits2, state = forward(hybrid, tokens[:, 7:12], state, second)
  logits3, state = forward(hybrid, tokens[:, 12:], state, first)
  assert max_abs_diff(jnp.concatenate([logits1, logits2, logits3], axis=1), whole) < 5e-5
  assert max_abs_diff(state, whole_state) < 1e-5


def test_window_decoding_matches_parallel_past_the_window():
  """Prefill 3 tokens, then decode 14 one at a time through a 4-token ring buffer: the logits equal the parallel
  form's at every position, far past the window; the cache stays 4 slots, and the window does matter (the
  unwindowed model's logits differ past it)."""
  windowed = tiny_model(attention_layers=(0,), attention_window=4)
  tokens = random_tokens(1, 17, seed=2)
  whole, _ = forward(windowed, tokens, None, "parallel")
  logits, state = forward(windowed, tokens[:, :3], windowed.init_state(1), "chunkwise")
  steps = [logits]
  for n in range(3, tokens.shape[1]):
    logits, state = forward(windowed, tokens[:, n:n + 1], state, "recurrent")
    steps.append(logits)
    assert state.layers[0].key.shape[1] == 4
  assert max_abs_diff(jnp.concatenate(steps, axis=1), whole) < 5e-5
  unwindowed = forward(tiny_model(attention_layers=(0,)), tokens, None, "parallel")[0]
  assert max_abs_diff(unwindowed[:, :4], whole[:, :4]) < 5e-5
  assert max_abs_diff(unwindowed[:, 4:], whole[:, 4:]) > 1e-2


def _reference_attention(block, x, positions, window, cfg):
  """Block `block`'s attention output for `x [B, L, D]` in float64 numpy: q, k, v read from the fused kernel (per
  key/value head: its query heads, its key, its value), rotation by the model's pairs and frequencies, softmax over
  the visible keys."""
  attention = block.attention
  heads, groups, head_dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
  size = heads // groups
  x = np.asarray(x, np.float64)
  h = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + cfg.norm_eps) * np.asarray(block.attention_norm.scale[...])
  qkv = (h @ np.asarray(attention.qkv_proj.kernel[...], np.float64)).reshape(*x.shape[:2], groups, size + 2, head_dim)
  q = qkv[:, :, :, :size].reshape(*x.shape[:2], heads, head_dim)
  k, v = qkv[:, :, :, size], qkv[:, :, :, size + 1]
  theta = cfg.attention.rotation_base ** -np.linspace(0, 1, head_dim // 2)  # the tiny preset's linspace frequencies
  angle = positions[:, :, None, None] * theta

  def rotate(y):  # interleaved pairs, as the tiny preset
    even, odd = y[..., 0::2], y[..., 1::2]
    out = np.empty_like(y)
    out[..., 0::2] = even * np.cos(angle) - odd * np.sin(angle)
    out[..., 1::2] = odd * np.cos(angle) + even * np.sin(angle)
    return out
  q, k = rotate(q) / np.sqrt(head_dim), rotate(k)
  k, v = np.repeat(k, size, axis=2), np.repeat(v, size, axis=2)
  scores = np.einsum("blhk,bshk->bhls", q, k)
  n = np.arange(x.shape[1])
  visible = (n[None, :] <= n[:, None]) & ((n[:, None] - n[None, :] < window) if window else True)
  scores = np.where(visible, scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  out = np.einsum("bhls,bshk->blhk", probs / probs.sum(-1, keepdims=True), v).reshape(*x.shape[:2], -1)
  return out @ np.asarray(attention.out_proj.kernel[...], np.float64)


@pytest.mark.parametrize("window", [None, 3])
def test_attention_layer_matches_a_float64_reference(window):
  """The attention block's mixer (grouped heads, window, its own rotary base) equals softmax attention computed
  in float64 from the same parameters, to float32 rounding."""
  model = tiny_model(attention_layers=(0,), attention_num_heads=4, attention_num_kv_heads=1, attention_window=window,
                     attention_rotation_base=300.0)
  block = model.blocks[0]
  x = jax.random.normal(jax.random.key(1), (2, 11, model.config.d_model))
  positions = np.tile(np.arange(11), (2, 1))
  tables = rotation.tables_for(model.config, jnp.asarray(positions), 4, 300.0)
  context = attention_mixer.Context(jnp.asarray(positions), tables, "parallel", None)
  ours, _ = block.attention(block.attention_norm(x), context, None)
  reference = _reference_attention(block, x, positions, window, model.config)
  assert np.max(np.abs(np.asarray(ours) - reference)) < 1e-5 * np.max(np.abs(reference))


def test_packed_documents_act_as_alone(hybrid):
  """Two documents packed in a row (5 + 8 tokens) give, in every form, the logits each gives alone."""
  tokens = random_tokens(1, 13, seed=3)
  segment_ids = jnp.asarray([[0] * 5 + [1] * 8])
  alone = jnp.concatenate([forward(hybrid, tokens[:, :5], None, "parallel")[0],
                           forward(hybrid, tokens[:, 5:], None, "parallel")[0]], axis=1)
  for mode in MODES:
    packed, _ = forward(hybrid, tokens, None, mode, segment_ids)
    assert max_abs_diff(packed, alone) < 5e-5, mode


def test_left_padding_matches_the_prompt_alone(hybrid):
  """A prompt left-padded by 4 (its state starting at position -4) gives the logits it gives alone."""
  tokens = random_tokens(1, 9, seed=4)
  alone, _ = forward(hybrid, tokens, None, "parallel")
  padded = np.concatenate([np.zeros((1, 4), np.int32), tokens], axis=1)
  for mode in MODES:
    state = hybrid.init_state(1)
    state = state._replace(position=jnp.asarray([-4]))
    logits, _ = forward(hybrid, padded, state, mode)
    assert max_abs_diff(logits[:, 4:], alone) < 5e-5, mode


def test_segmented_and_rematerialised_gradients_equal_whole_sequences(hybrid):
  """Backpropagating through segments of 5 tokens that carry retention states and KV caches, or under a remat
  policy that keeps the attention's q/k/v and output, gives the whole-sequence loss and gradients."""
  graphdef, params = nnx.split(hybrid)
  batch = jnp.asarray(random_tokens(2, 14, seed=5))
  value_and_grad = jax.jit(jax.value_and_grad(
      lambda p, segment_len, remat: losses.token_loss(graphdef, p, batch, "chunkwise", remat, segment_len)),
      static_argnums=(1, 2))
  whole, whole_grads = value_and_grad(params, 0, "none")
  for segment_len, remat in ((5, "none"), (0, "save_qkv_mixer_out")):
    loss, grads = value_and_grad(params, segment_len, remat)
    assert abs(float(whole) - float(loss)) < 1e-5, (segment_len, remat)
    assert max_abs_diff(whole_grads, grads) < 1e-5, (segment_len, remat)


def test_greedy_generation_follows_the_parallel_logits():
  """Greedy tokens from a windowed hybrid (two prompts of different lengths, prefilled chunkwise, decoded through
  the ring buffer) are the argmax of the parallel form's logits over each row's prompt and its generated tokens."""
  model = tiny_model(attention_layers=(1,), attention_window=3, attention_num_kv_heads=1)
  prompts = [random_tokens(1, 6, seed=6)[0], random_tokens(1, 2, seed=7)[0]]
  tokens, lengths = sampling.pad_prompts(prompts)
  out = SAMPLER.generate(model, tokens, lengths, max_new_tokens=7, key=jax.random.key(0), temperature=0)
  for prompt, new in zip(prompts, out.tokens):
    sequence = np.concatenate([prompt, new])[None]
    logits, _ = forward(model, sequence, None, "parallel")
    np.testing.assert_array_equal(np.argmax(np.asarray(logits[0, len(prompt) - 1:-1]), -1), new)


def test_decoding_state_is_constant_in_the_context_with_a_window():
  """A windowed hybrid's decoding state has the same size after 6 and 40 tokens; an unwindowed one's cache is
  model.attention_max_len slots."""
  windowed = tiny_model(attention_layers=(1,), attention_window=4)
  sizes = [sum(x.nbytes for x in jax.tree.leaves(forward(windowed, random_tokens(1, n), None, "chunkwise")[1]))
           for n in (6, 40)]
  assert sizes[0] == sizes[1]
  unwindowed = tiny_model(attention_layers=(1,), attention_max_len=64)
  assert unwindowed.init_state(1).layers[1].key.shape[1] == 64


@pytest.mark.parametrize("layers", [(1, 3), (1, 2)])
def test_scanned_hybrids_equal_unrolled_ones(layers):
  """Scanned, a hybrid stacks its blocks by the period of their structures (attention in layers 1 and 3 of 4: two
  groups of two blocks; in 1 and 2: one group of four): the unrolled model's parameters from the same seed, moved
  by relayout both ways, and its logits and states in every form."""
  unrolled = tiny_model(num_layers=4, attention_layers=layers, attention_window=5, chunk_size=4)
  scanned = tiny_model(num_layers=4, attention_layers=layers, attention_window=5, chunk_size=4, scan_layers=True)
  assert len(getattr(scanned.blocks, layer_stack.GROUP)) == {(1, 3): 2, (1, 2): 4}[layers]
  params = nnx.state(unrolled, nnx.Param), nnx.state(scanned, nnx.Param)
  assert max_abs_diff(layer_stack.relayout(params[0], True), params[1]) == 0
  assert max_abs_diff(layer_stack.relayout(params[1], False), params[0]) == 0
  tokens = random_tokens(2, 13)
  # Equal on a CPU; on a GPU, XLA compiles the scanned loop's body and the unrolled blocks into different kernels
  # (fusions, GEMM tilings) that sum in other orders: a few float32 ulps of logits up to 4 and states up to 13 (2.7e-6
  # measured on an H100).
  tol = 1e-5 if on_gpu() else 1e-6
  for mode in MODES:
    assert max_abs_diff(forward(scanned, tokens, None, mode), forward(unrolled, tokens, None, mode)) < tol, mode


@pytest.mark.parametrize("overrides,message", [
    (dict(attention_layers=(2,)), r"model.attention_layers=\(2,\) names layers \[2\] outside \[0, model.num_layers=2"),
    (dict(attention_layers=(1, 1)), r"repeats layers \[1\]; name each layer once"),
    (dict(attention_layers=[0, "1"]), "must be a tuple of layer indices"),
    (dict(attention_layers=(1,), attention_num_heads=5), "attention_num_heads=5 must be a positive divisor of "
                                                         "model.d_model=32"),
    (dict(attention_layers=(1,), attention_num_heads=4, attention_num_kv_heads=3),
     "attention_num_kv_heads=3 must be a positive divisor of the attention layers' 4 query heads"),
    (dict(attention_layers=(1,), attention_window=0), "attention_window=0 must be a positive number of tokens"),
    (dict(attention_layers=(1,), attention_rotation_base=-1.0), "attention_rotation_base must be a positive"),
    (dict(attention_layers=(1,), attention_max_len=0), "attention_max_len must be a positive integer"),
    (dict(attention_window=8), r"model.attention_window=8 configures attention layers, but model.attention_layers "
                               r"is empty"),
])
def test_bad_hybrid_fields_are_refused(overrides, message):
  """Each refused by name as the model is built."""
  with pytest.raises(ValueError, match=message):
    tiny_model(**overrides)


def test_segments_longer_than_an_unwindowed_cache_are_refused(tmp_path):
  """Segmented training carries unwindowed caches through the whole sequence: it must fit model.attention_max_len."""
  config = tiny_config(tmp_path, seq_len=64, segment_len=16)
  config.model.update(attention_layers=(1,), attention_max_len=32)
  with pytest.raises(ValueError, match=r"train.seq_len=64 exceeds model.attention_max_len=32. Raise it "
                                       r"\(--config.model.attention_max_len=64\) or set model.attention_window"):
    train.check_config(config, 1)
  config.model.attention_window = 8
  train.check_config(config, 1)


def test_a_full_cache_is_refused_by_name():
  """An unwindowed cache of 8 slots holding 6 tokens refuses 3 more, naming model.attention_max_len."""
  model = tiny_model(attention_layers=(1,), attention_max_len=8)
  _, state = forward(model, random_tokens(1, 6), model.init_state(1), "chunkwise")
  with pytest.raises(ValueError, match=r"holds 8 tokens; 6 are used and 3 more do not fit. Raise "
                                       r"model.attention_max_len to at least 9"):
    model(jnp.asarray(random_tokens(1, 3)), mode="recurrent", state=state)


def test_a_hybrid_trains_resumes_and_evaluates(tmp_path, run_crashing_at_batch):
  """A windowed hybrid trained chunkwise in segments of 16 tokens (retention states and ring buffers carried):
  crashed in step 6 and resumed from checkpoint 4 (no earlier step trained again), it logs the straight run's
  losses; its checkpoint evaluates alike in the three modes, and the passkey evaluation decodes it."""
  config = tiny_config(tmp_path, mode="chunkwise", segment_len=16)
  config.model.update(attention_layers=(1,), attention_window=8)
  straight = train.train_and_evaluate(config, tmp_path / "straight")
  run_crashing_at_batch(6, train.train_and_evaluate, config, tmp_path / "resumed")  # after checkpoint 4
  resumed = train.train_and_evaluate(config, tmp_path / "resumed")
  assert_resumed_from(tmp_path / "resumed", 4)
  assert read_metrics(tmp_path / "resumed") == read_metrics(tmp_path / "straight")
  assert sorted(read_metrics(tmp_path / "straight")) == list(range(1, 9))
  assert resumed["eval_loss"] == straight["eval_loss"]
  model, step = train_state.restore_model(config, tmp_path / "resumed")
  assert step == 8 and model.blocks[1].mixer_name == "attention"
  config.model.scan_layers = True  # the checkpoint read into the scanned layout: the same model
  scanned, _ = train_state.restore_model(config, tmp_path / "resumed")
  tokens = random_tokens(2, 20, seed=9)
  assert max_abs_diff(forward(scanned, tokens, None, "chunkwise"), forward(model, tokens, None, "chunkwise")) == 0
  config.model.scan_layers = False
  results = evaluate.evaluate_model(model, config, modes=MODES, max_batches=1)
  losses_by_mode = [results["modes"][mode]["loss"] for mode in MODES]
  assert max(losses_by_mode) - min(losses_by_mode) < 1e-5 and losses_by_mode[0] < 5.0
  grid = passkey.make_grid(ByteTokenizer(), [200], [0.5], samples=2)
  scores = passkey_eval.evaluate(passkey_eval.greedy_generate(model), grid)
  assert scores["samples"] == 2 and 0 <= scores["mean_accuracy"] <= 1


@pytest.mark.devices(8)
def test_sharded_step_matches_the_single_device_step():
  """A hybrid with grouped heads trained one step on a (data 2, fsdp 2, tensor 2) mesh: the single device's loss and
  parameters; the fused q/k/v kernel splits over fsdp and tensor (whole key/value groups per device)."""
  config = retnet_config.get_config("tiny")
  config.model.update(attention_layers=(1,), attention_num_heads=4, attention_num_kv_heads=2, attention_window=16)
  config.train.batch_size = 8
  batch = random_tokens(8, config.train.seq_len + 1, config.model.vocab_size, seed=2)
  results = []
  for shape, devices in (((1, 1, 1), jax.devices()[:1]), ((2, 2, 2), jax.devices())):
    config.mesh.shape = shape
    run = train_step.setup(run_config.build(config), sharding.make_mesh(config.mesh, devices))
    with run.placement.active():
      results.append(run.train_step(run.init(), jax.device_put(batch, run.placement.batch_sharding)))
  (single, single_metrics), (sharded, sharded_metrics) = results
  assert abs(float(single_metrics["loss"]) - float(sharded_metrics["loss"])) < 1e-5
  kernel = sharded.params["blocks"][1]["attention"]["qkv_proj"]["kernel"][...]
  assert kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor") and len(kernel.devices()) == 8
  assert max_abs_diff(single.params, sharded.params) < 1e-5


def test_a_kv_cache_larger_than_memory_is_refused_before_any_work():
  """A window of 10^9 tokens trained, then generation failed allocating 128 GB: the decoding state is sized first."""
  model = tiny_model(attention_layers=(1,), attention_window=10**9)
  tokens, lengths = sampling.pad_prompts([[1, 2, 3]])
  for call in (lambda: SAMPLER.generate(model, tokens, lengths, max_new_tokens=2, key=jax.random.key(0)),
               lambda: SAMPLER.prefill(model, tokens, lengths)):
    with pytest.raises(ValueError, match=r"the decoding state of 1 rows takes \d+\.\d GiB, more than the .* GiB of "
                                         r"host memory available here, bounded by .+; lower "
                                         r"model.attention_window=1000000000"):
      call()


def test_the_fields_that_size_decoding_states_come_from_the_mixers():
  """`architectures.state_fields` (what the memory check names to lower) asks each mixer: none for retention, the
  window of a windowed attention layer, the cache length of an unwindowed one or of a Transformer."""
  expected = {(): {}, ("attention_window",): dict(attention_layers=(1,), attention_window=5),
              ("attention_max_len",): dict(attention_layers=(1,))}
  for fields, overrides in expected.items():
    cfg = retnet_config.get_config("tiny").model
    cfg.update(overrides)
    assert architectures.state_fields(model_config.of(cfg)) == fields
  assert architectures.state_fields(model_config.of(presets.transformer_config(retnet_config.get_config("tiny").model,
                                                                               64))) == (
      "max_len",)
