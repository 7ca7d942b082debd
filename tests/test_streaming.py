"""Streamed runs (`retnet_jax.models.streaming`): a prompt prefilled block by block equals the one-call prefill at
awkward lengths (1, a block less one, a block, a block and one, 3.5 blocks), from an empty or a carried state, with
packed documents and left-padded batches, for RetNet, gated retention, a windowed hybrid and the Transformer; the
block's carry is exact in float64; its memory does not grow with the prompt; bad blocks are refused."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import retnet as retnet_config
from retnet_jax.evaluation import sampling
from retnet_jax.mixers import attention, retention
from retnet_jax.models import streaming
from retnet_jax.models.model import Model
from tests.helpers import random_tokens, tiny_model, tiny_transformer

BLOCK = 16  # two chunks of the tiny preset's 8
LENGTHS = (1, BLOCK - 1, BLOCK, BLOCK + 1, 7 * BLOCK // 2)
SAMPLER = sampling.Sampler()

MODELS = {
    "retnet": lambda: tiny_model(),
    "gated": lambda: tiny_model(mixer="gated_retention"),
    "windowed_hybrid": lambda: tiny_model(attention_layers=(1,), attention_window=5),
    "transformer": lambda: tiny_transformer(max_len=80),
}


@functools.cache
def model_of(name):
  return MODELS[name]()


@nnx.jit(static_argnames=("mode", "block"))
def streamed(model, tokens, state, ids, mode, block):
  """The state after `tokens` run block by block, and the next-token logits of token 7 from it."""
  state = streaming.final_state(model, tokens, mode, block, state, ids)
  logits, _ = model(jnp.full((tokens.shape[0], 1), 7, jnp.int32), mode="recurrent", state=state)
  return state, logits[:, 0]


def rel_err(a, b):
  """The largest difference over trees, relative to the largest reference value of each leaf."""
  return max(float(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)).max()
                   / max(np.abs(np.asarray(y, np.float64)).max(), 1e-30))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def documents(length, seed):
  """Document ids `[2, length]`: row 0's documents run across block edges, row 1's open inside blocks and on block
  edges, its last on the last block edge (so the final state tells whether that block started empty)."""
  ids = np.zeros((2, length), np.int32)
  for row, opens in enumerate(((5, 2 * BLOCK + 7), (3, BLOCK, BLOCK + 1, 2 * BLOCK, 3 * BLOCK))):
    for start in opens:
      ids[row, start:] += 1 + seed
  return jnp.asarray(ids)


def retention_states(state):
  """The state's retention layers' leaves and its positions: a KV cache's slots of an earlier document (which
  streaming empties where a document opens on a block's first column, and one call keeps unseen) left out."""
  return state.position, [layer for layer in state.layers if not isinstance(layer, attention.KVCache)]


# RetNet at 3.5 blocks and the windowed hybrid at a block and one in the fast tier, the rest in the slow one.
FAST = (("retnet", 7 * BLOCK // 2), ("windowed_hybrid", BLOCK + 1))
CASES = [pytest.param(name, length, marks=() if (name, length) in FAST else pytest.mark.slow)
         for name in MODELS for length in LENGTHS]


@pytest.mark.parametrize("name,length", CASES)
def test_streamed_state_equals_one_call(name, length):
  """From an empty state, from a carried one, and with documents: states and next-token logits within 1e-5."""
  model = model_of(name)
  mode = "parallel" if name == "transformer" else "chunkwise"
  tokens = jnp.asarray(random_tokens(2, length, seed=length))
  carried, _ = streamed(model, jnp.asarray(random_tokens(2, 9, seed=99)), model.init_state(2), None, mode, 0)
  cases = {"empty": (model.init_state(2), None), "carried": (carried, None),
           "documents": (carried, documents(length, seed=length))}
  for case, (state, ids) in cases.items():
    (expected, expected_logits), (got, got_logits) = (streamed(model, tokens, state, ids, mode, block)
                                                      for block in (0, BLOCK))
    if ids is not None:
      expected, got = retention_states(expected), retention_states(got)
    assert rel_err(got, expected) < 1e-5, (case, rel_err(got, expected))
    assert rel_err(got_logits, expected_logits) < 1e-5, (case, rel_err(got_logits, expected_logits))


def test_left_padded_batches_prefill_and_decode_as_one_call():
  """The sampler's streamed prefill (prompts of 1 to 3.5 blocks, left-padded) equals its one-call prefill, and greedy
  decoding from it gives the same tokens."""
  model = model_of("retnet")
  prompts = [random_tokens(1, n, seed=n)[0] for n in LENGTHS]
  tokens, lengths = sampling.pad_prompts(prompts)
  one = SAMPLER.prefill(model, tokens, lengths, prefill_block=0)
  blocks = SAMPLER.prefill(model, tokens, lengths, prefill_block=BLOCK)
  assert rel_err(blocks.state, one.state) < 1e-5
  decode = lambda prefilled: SAMPLER.decode(model, prefilled, max_new_tokens=6, key=jax.random.key(0),
                                            temperature=0.0).tokens
  np.testing.assert_array_equal(decode(blocks), decode(one))


@pytest.mark.parametrize("with_documents", [False, True])
def test_the_blocks_carry_is_exact_in_float64(with_documents):
  """`streaming.fold` over the chunkwise form, each block entering the state (zeroed where a document opens at its
  first column), equals one call in float64 within 1e-12."""
  length, heads, dim = 7 * BLOCK // 2, 2, 4
  rng = np.random.default_rng(0)
  q, k, v = rng.normal(size=(3, 2, length, heads, dim))
  state = rng.normal(size=(2, heads, dim, dim))
  log_decay = np.log(np.asarray([0.5, 1 - 1e-6]))
  ids = documents(length, seed=1) if with_documents else None

  def folded(q, k, v, state, ids):
    def run(carry, start, width):
      state, outs = carry
      opens = streaming.opens_at(ids, start)
      state = state if opens is None else jnp.where(opens[:, None, None, None], 0.0, state)
      q_, k_, v_, ids_ = (streaming.columns(x, start, width) for x in (q, k, v, ids))
      out, state = retention.chunkwise_retention(q_, k_, v_, log_decay, 8, state, ids_)
      return state, jax.lax.dynamic_update_slice_in_dim(outs, out, start, axis=1)
    return streaming.fold(run, (state, jnp.zeros_like(v)), length, BLOCK)

  with jax.enable_x64(True):  # each side one compiled program, not hundreds of eager float64 ops
    one_call = lambda q, k, v, state, ids: retention.chunkwise_retention(q, k, v, log_decay, 8, state, ids)
    expected_out, expected_state = jax.jit(one_call)(q, k, v, state, ids)
    got_state, got_out = jax.jit(folded)(q, k, v, state, ids)
  assert got_out.dtype == jnp.float64
  assert rel_err(got_out, expected_out) < 1e-12 and rel_err(got_state, expected_state) < 1e-12


@pytest.mark.optimized
def test_prefill_memory_does_not_grow_with_the_prompt():
  """The small preset's compiled prefill holds at most 1.25x the temporaries at 2^20 tokens that it holds at 2^14
  (one call: 22.7 KB per token, 23.8 GB at 2^20)."""
  model = Model(retnet_config.get_config("small").model, rngs=nnx.Rngs(0))
  temps = {n: SAMPLER.compile_prefill(model, 1, n).memory_analysis().temp_size_in_bytes for n in (2**14, 2**20)}
  assert temps[2**20] <= 1.25 * temps[2**14], temps
  one_call = SAMPLER.compile_prefill(model, 1, 2**14, prefill_block=0).memory_analysis().temp_size_in_bytes
  assert one_call > 4 * temps[2**14]  # the test can tell: one call's temporaries grow with the prompt


def test_a_prefill_runs_the_compilation_of_compile_prefill(monkeypatch):
  """`compile_prefill`'s executable is what a prefill of its shapes then runs: nothing is traced again (the tracing
  would call `streaming.final_state`), and the state equals a fresh sampler's; with `progress` it compiles anew."""
  model = model_of("retnet")
  tokens, lengths = sampling.pad_prompts([list(range(1, 40)), [5, 6, 7]])
  expected = sampling.Sampler().prefill(model, tokens, lengths)
  sampler = sampling.Sampler()
  sampler.compile_prefill(model, *tokens.shape)
  traced = []
  original = streaming.final_state
  monkeypatch.setattr(streaming, "final_state", lambda *args, **kw: traced.append(1) or original(*args, **kw))
  got = sampler.prefill(model, tokens, lengths)
  assert not traced
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(a, b)
  sampler.prefill(model, tokens, lengths, progress=lambda done, columns: None)
  assert traced


@pytest.mark.parametrize("block,message", [
    (12, "prefill_block=12 is not a multiple of model.chunk_size=8 = 8, so its blocks would not hold whole chunks; "
         "use 8 or 16."),
    (-4, "prefill_block must be a positive integer"),
    (2.5, "prefill_block must be a positive integer"),
])
def test_bad_blocks_are_refused_before_any_work(block, message):
  tokens, lengths = sampling.pad_prompts([[1, 2, 3]])
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
    SAMPLER.prefill(model_of("retnet"), tokens, lengths, prefill_block=block)


def test_default_block_is_whole_chunks():
  assert streaming.check_block(model_of("retnet").config, None) == streaming.DEFAULT_BLOCK
  assert streaming.check_block(tiny_model(chunk_size=24).config, None) == 2064
  assert streaming.check_block(model_of("transformer").config, 5) == 5


def test_progress_reports_every_block_in_order_after_it_ran():
  """`progress(columns_done, columns)` once per block, increasing, the last the whole prompt; the states equal a
  prefill without it."""
  model = model_of("retnet")
  tokens, lengths = sampling.pad_prompts([random_tokens(1, 7 * BLOCK // 2 + 1, seed=3)[0]])
  reports = []
  with_progress = SAMPLER.prefill(model, tokens, lengths, prefill_block=BLOCK,
                                  progress=lambda done, columns: reports.append((done, columns)))
  assert reports == [(16, 56), (32, 56), (48, 56), (56, 56)]
  assert rel_err(with_progress.state, SAMPLER.prefill(model, tokens, lengths, prefill_block=BLOCK).state) == 0
  with pytest.raises(ValueError, match=r"progress must be a callable progress\(columns_done, columns\) or None"):
    SAMPLER.prefill(model, tokens, lengths, progress=5)
