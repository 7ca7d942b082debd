"""Attention over many keys a block at a time (`softmax_attention.blocked_attention`): equal to softmax attention in
float64 on awkward sizes and masks, taken by a multi-token call over a cache longer than a block (a prefill's blocks,
a windowed layer's chunk) with the logits of the parallel form, by training over a sequence longer than a block with
the whole read's loss and gradients, and its memory bounded by a block's scores in the forward and the backward
pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from retnet_jax.evaluation import sampling
from retnet_jax.hardware import accelerators
from retnet_jax.mixers import softmax_attention
from tests.helpers import random_tokens, tiny_model, tiny_transformer


def reference(q, k, v, visible):
  """Softmax attention in float64: q `[B, L, H, K]`, k, v `[B, S, G, K]`, visible `[B, L, S]`; a row that sees no
  key gives zeros."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  heads, groups = q.shape[2], k.shape[2]
  k, v = (np.repeat(x, heads // groups, axis=2) for x in (k, v))
  scores = np.einsum("blhk,bshk->bhls", q, k)
  seen = np.asarray(visible)[:, None]
  scores = np.where(seen, scores, -np.inf)
  probs = np.exp(scores - np.where(seen.any(-1, keepdims=True), scores.max(-1, keepdims=True), 0.0))
  probs /= np.maximum(probs.sum(-1, keepdims=True), 1e-300)
  return np.einsum("bhls,bshk->blhk", probs, v)


def keys_of(start, n, mask):
  """`blocked_attention`'s `visible_of` for a whole mask `[B, L, S]` (its `mask_args`): keys `start ... start + n -
  1`."""
  return jax.lax.dynamic_slice_in_dim(mask, start, n, -1)


@pytest.mark.parametrize("keys,block", [(13, 4), (12, 4), (5, 5), (7, 1), (9, 8)])
@pytest.mark.parametrize("dtype,tolerance", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)], ids=["float32", "bfloat16"])
def test_blocked_attention_is_softmax_attention(keys, block, dtype, tolerance):
  """Grouped heads (4 queries, 2 keys/values), a last block overlapping its predecessor (13 keys in 4s), one block,
  blocks of one key; masks with a row that sees one key, one that sees none, and large scores (no overflow)."""
  rng = np.random.default_rng(keys * 10 + block)
  q = rng.normal(size=(2, 3, 4, 8)) * 4
  k, v = rng.normal(size=(2, keys, 2, 8)) * 4, rng.normal(size=(2, keys, 2, 8))
  visible = rng.random((2, 3, keys)) < 0.6
  visible[0, 1] = False
  visible[1, 2] = np.arange(keys) == keys - 1
  q_, k_, v_ = (jnp.asarray(x, dtype) for x in (q, k, v))
  expected = reference(q_.astype(jnp.float32), k_.astype(jnp.float32), v_.astype(jnp.float32), visible)
  mask = jnp.asarray(visible)
  blocked = jax.jit(lambda *args: softmax_attention.blocked_attention(*args, keys_of, block, (mask,)))(q_, k_, v_)
  assert blocked.dtype == dtype and blocked.shape == (2, 3, 4, 8)
  scale = np.abs(expected).max()
  np.testing.assert_allclose(np.asarray(blocked, np.float64), expected, atol=tolerance * scale)
  whole = softmax_attention.attention(q_, k_, v_, mask)
  np.testing.assert_allclose(np.asarray(whole, np.float64), expected, atol=tolerance * scale)
  with pytest.raises(ValueError, match="at least one block of keys"):
    softmax_attention.blocked_attention(q_, k_, v_, keys_of, keys + 1, (mask,))


def calls():
  """A model call compiled afresh (`helpers.forward` may hold a trace of another KEY_BLOCK)."""
  return nnx.jit(lambda model, tokens, state, mode, segment_ids=None: model(tokens, mode=mode, state=state,
                                                                            segment_ids=segment_ids),
                 static_argnames="mode")


@pytest.mark.parametrize("dtype,tolerance", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)], ids=["float32", "bfloat16"])
def test_blocked_attention_differentiates_as_attention(dtype, tolerance):
  """Its own backward pass (flash attention's: the scores recomputed from each row's maximum and sum) gives
  `attention`'s gradients (float32's, within bfloat16's rounding for bfloat16 operands), finite where a row sees no
  key and where the last block overlaps its predecessor."""
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((2, 5, 4, 8), (2, 13, 2, 8), (2, 13, 2, 8)))
  visible = rng.random((2, 5, 13)) < 0.6
  visible[0, 1] = False
  mask, weights = jnp.asarray(visible), jnp.asarray(rng.normal(size=(2, 5, 4, 8)), jnp.float32)
  blocked = lambda *qkv: softmax_attention.blocked_attention(*qkv, keys_of, 4, (mask,))
  gradient = lambda form, *qkv: jax.jit(jax.grad(lambda q, k, v: jnp.sum(weights * form(q, k, v).astype(jnp.float32)),
                                                argnums=(0, 1, 2)))(*qkv)
  want = gradient(lambda *qkv: softmax_attention.attention(*qkv, mask), q, k, v)
  got = gradient(blocked, *(x.astype(dtype) for x in (q, k, v)))
  for got, want in zip(got, want):
    assert got.dtype == dtype and np.all(np.isfinite(got))
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=tolerance * float(np.abs(want).max()))


@pytest.fixture
def small_blocks(monkeypatch):
  """Blocks of at most 7 keys: the test models' caches (21-40 slots) are read in blocks, 40 slots in 6 blocks of 7,
  the last overlapping its predecessor. Returns the (keys, block) of each blocked call."""
  monkeypatch.setattr(softmax_attention, "KEY_BLOCK", 7)
  calls = []
  blocked = softmax_attention.blocked_attention
  monkeypatch.setattr(softmax_attention, "blocked_attention",
                      lambda *args: calls.append((args[1].shape[1], args[4])) or blocked(*args))
  return calls


def test_a_call_over_a_long_cache_reads_it_in_blocks_with_the_parallel_logits(small_blocks, monkeypatch):
  """One call of 27 tokens into a 40-slot cache, left-padded and with a document starting inside it, gives the
  logits of the cache read whole (padding rows included) and of the parallel form; three calls of 9 tokens carrying
  the cache give the parallel form's, and so does a windowed hybrid layer (a window of 12 beside 9 tokens: 21 keys)."""
  tokens = jnp.asarray(random_tokens(2, 27, seed=3))
  model = tiny_transformer(max_len=40)
  hybrid = tiny_model(attention_layers=(1,), attention_window=12)
  segment_ids = jnp.asarray(np.repeat([[1, 2], [1, 1]], [15, 12], axis=1), jnp.int32)
  padded = model.init_state(2)._replace(position=jnp.asarray([0, -3], jnp.int32))
  with monkeypatch.context() as whole_reads:
    whole_reads.setattr(softmax_attention, "KEY_BLOCK", 10**9)
    unblocked, _ = calls()(model, tokens, padded, "parallel", segment_ids)
    parallel, _ = calls()(model, tokens, None, "parallel", segment_ids)
    expected = {m: calls()(m, tokens, None, "parallel")[0] for m in (model, hybrid)}
  assert not small_blocks
  blocked, _ = calls()(model, tokens, padded, "parallel", segment_ids)
  assert small_blocks == [(40, 7)] * model.config.num_layers
  scale = float(jnp.max(jnp.abs(unblocked)))
  np.testing.assert_allclose(blocked, unblocked, atol=1e-5 * scale)
  np.testing.assert_allclose(blocked[0], parallel[0], atol=1e-5 * scale)
  for model, mode in ((model, "parallel"), (hybrid, "chunkwise")):
    small_blocks.clear()
    call = calls()
    expected_ = expected[model]
    state, pieces = model.init_state(2), []
    for start in range(0, 27, 9):
      logits, state = call(model, tokens[:, start:start + 9], state, mode)
      pieces.append(logits)
    assert small_blocks, "no call read its keys in blocks"
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), expected_,
                               atol=1e-5 * float(jnp.max(jnp.abs(expected_))))


@pytest.mark.parametrize("kind", ["transformer", "windowed_hybrid", "scanned_remat"])
def test_training_reads_a_long_sequence_in_blocks_with_the_whole_reads_loss_and_gradients(small_blocks, monkeypatch,
                                                                                         kind):
  """The parallel form without a state (training's) over 27 tokens in blocks of 7 (the last overlapping), with two
  documents in one row; in a hybrid, a window of 9 (the queries from 14 on read from key 6, the last of the first
  block, and those from 20 on skip that block); and in a Transformer whose layers run in a scan, each block
  recomputed (the backward pass then runs in other traces than the forward): its logits and parameter gradients are
  the whole read's."""
  tokens = jnp.asarray(random_tokens(2, 27, seed=4))
  segment_ids = jnp.asarray(np.repeat([[1, 2], [1, 1]], [15, 12], axis=1), jnp.int32)
  model = {"transformer": lambda: tiny_transformer(max_len=40),
           "windowed_hybrid": lambda: tiny_model(attention_layers=(1,), attention_window=9),
           "scanned_remat": lambda: tiny_transformer(max_len=40, scan_layers=True)}[kind]()

  remat = "full" if kind == "scanned_remat" else "none"

  def loss(model):
    logits, _ = model(tokens, mode="parallel", segment_ids=segment_ids, remat=remat)
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - logits[..., 0]), logits

  grad = lambda: nnx.jit(nnx.grad(loss, has_aux=True))(model)
  with monkeypatch.context() as whole_reads:
    whole_reads.setattr(softmax_attention, "KEY_BLOCK", 10**9)
    expected_grads, expected = grad()
  grads, logits = grad()
  assert set(small_blocks) == {(27, 7)}
  np.testing.assert_allclose(logits, expected, atol=1e-5 * float(jnp.max(jnp.abs(expected))))
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads)):
    np.testing.assert_allclose(got, want, atol=1e-5 * float(jnp.max(jnp.abs(want))))


def test_a_training_step_over_4k_tokens_keeps_no_scores_for_its_backward_pass():
  """XLA's memory analysis of the tiny Transformer's loss gradient over 4096 tokens: temporaries below 256 MB, where
  reading the keys whole kept every layer's [4096, 4096] scores per head (963 MB)."""
  model = tiny_transformer(max_len=4096)
  graphdef, params = nnx.split(model)

  def loss(params, tokens):
    logits, _ = nnx.merge(graphdef, params)(tokens, mode="parallel")
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1))

  compiled = jax.jit(jax.grad(loss)).lower(params, jax.ShapeDtypeStruct((1, 4096), jnp.int32)).compile()
  sizes = accelerators.memory_sizes(compiled)
  assert sizes["temporary_bytes"] < 256 * 2**20, sizes


def test_a_prefill_reads_only_the_blocks_of_the_cache_written_so_far(small_blocks, monkeypatch):
  """9 tokens into an empty 40-slot cache read blocks of 7 up to slot 13: slots 14-39 were poisoned with NaN and the
  logits are the recurrent form's (the whole read, which reads them, gives NaN); a left-padded row's padding tokens,
  which see no key, get zeros from attention in every form, so their logits agree too."""
  model = tiny_transformer(max_len=40)
  tokens = jnp.asarray(random_tokens(2, 9, seed=5))
  state = model.init_state(2)._replace(position=jnp.asarray([0, -3], jnp.int32))
  poison = lambda x: x.at[:, 14:].set(jnp.nan)
  state = state._replace(layers=tuple(c._replace(key=poison(c.key), value=poison(c.value)) for c in state.layers))
  logits, _ = calls()(model, tokens, state, "parallel")
  assert small_blocks == [(40, 7)] * model.config.num_layers
  with monkeypatch.context() as whole_reads:
    whole_reads.setattr(softmax_attention, "KEY_BLOCK", 10**9)
    assert np.isnan(calls()(model, tokens, state, "parallel")[0]).all()
    expected, _ = calls()(model, tokens, model.init_state(2)._replace(position=state.position), "recurrent")
  np.testing.assert_allclose(logits, expected, atol=1e-5 * float(jnp.max(jnp.abs(expected))))


@pytest.mark.parametrize("window", [None, 4], ids=["cache", "window"])
def test_a_long_call_reads_in_blocks_of_queries_only_the_key_blocks_they_may_see(small_blocks, window):
  """18 queries whose own keys follow 4 others (`read_causal`'s offset: a cache's slots written before them, or a
  window's ring buffer beside its new keys), in 3 blocks of 6 over 22 keys in blocks of 6: with a cache, the first
  query block reads the key blocks up to its last query's key (9), not keys 12-21, poisoned with NaN; with a window
  of 4 whose ring holds no key yet, the query blocks from 6 on read from the key block holding their first query's
  first key, not the poisoned ring (block 0). Those rows equal float64 attention over the keys unpoisoned."""
  rng = np.random.default_rng(1)
  q, k, v = (rng.normal(size=(2, n, heads, 8)).astype(np.float32) for n, heads in ((18, 4), (22, 2), (22, 2)))
  query, key = np.arange(18)[:, None] + 4, np.arange(22)[None, :]
  visible = (key <= query) if window is None else (key >= 4) & (key <= query) & (query - key < window)
  visible = np.broadcast_to(visible, (2, 18, 22))
  poisoned, rows = (slice(12, None), slice(0, 6)) if window is None else (slice(0, 4), slice(6, None))
  k_nan, v_nan = (x.copy() for x in (k, v))
  k_nan[:, poisoned], v_nan[:, poisoned] = np.nan, np.nan

  def visible_of(start, size, query_start, queries, mask):
    return jax.lax.dynamic_slice(mask, (0, query_start, start), (2, queries, size))

  read = jax.jit(lambda q, k, v, mask, offset: softmax_attention.read_causal(q, k, v, visible_of, (mask,), offset,
                                                                             window))
  out = read(q, k_nan, v_nan, jnp.asarray(visible), jnp.int32(4))
  assert set(small_blocks) == {(22, 6)}
  want = reference(q, k, v, visible)
  np.testing.assert_allclose(out[:, rows], want[:, rows], atol=1e-5 * float(np.abs(want).max()))


def test_a_transformer_prefill_holds_a_block_of_scores_not_the_cache_times_a_block():
  """XLA's memory analysis of the tiny Transformer's prefill of 16k tokens (blocks of 2048 into a cache of 16k + 32
  slots): the temporaries stay below 64 MB, where a block's scores against the whole cache took 810 MB."""
  model = tiny_transformer(max_len=16384 + 32)
  sizes = accelerators.memory_sizes(sampling.Sampler().compile_prefill(model, 1, 16384))
  assert sizes["temporary_bytes"] < 64 * 2**20, sizes
