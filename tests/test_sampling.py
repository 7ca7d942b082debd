"""Generation: recurrent decoding matches the parallel model, sampling filters, padding, stop tokens, one compile,
streaming and input errors."""

import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import retnet as retnet_config
from retnet_jax.core import sharding
from retnet_jax.evaluation import sampling, sampling_checks, text_generation
from retnet_jax.input_pipeline.tokenizer import ByteTokenizer
from retnet_jax.models import architectures
from retnet_jax.models.model import Model
from tests.helpers import forward, tiny_model

SAMPLER = sampling.Sampler()  # one sampler: its compiled functions are reused across tests

PROMPTS = [[5, 17, 200, 3, 9], [42], [7, 1, 99, 250, 13, 8, 64, 31, 2, 77, 11], [120, 6, 6, 30, 255, 0, 81, 4]]


@pytest.fixture(scope="module")
def model():
  return tiny_model()


def run(model, prompts, key=0, **kwargs):
  kwargs.setdefault("max_new_tokens", 10)
  tokens, lengths = sampling.pad_prompts(prompts)
  key = jax.random.key(key) if isinstance(key, int) else key
  return SAMPLER.generate(model, tokens, lengths, key=key, **kwargs)


@pytest.mark.parametrize("prefill_mode", architectures.PREFILL_MODES)
def test_greedy_matches_argmax_of_parallel_logits(model, prefill_mode):
  """Every greedy token is the argmax of the parallel model's logits over prompt + the tokens before it."""
  prompt = PROMPTS[2]
  out = run(model, [prompt], temperature=0.0, prefill_mode=prefill_mode)
  assert out.tokens.shape == (1, 10) and out.tokens.dtype == np.int32 and out.lengths.tolist() == [10]
  sequence = jnp.asarray([prompt + out.tokens[0, :-1].tolist()], jnp.int32)
  expected = np.argmax(np.asarray(forward(model, sequence, None, "parallel")[0])[0, len(prompt) - 1:], axis=-1)
  np.testing.assert_array_equal(out.tokens[0], expected)


def test_top_k_one_and_tiny_top_p_are_greedy(model):
  greedy = run(model, PROMPTS, temperature=0.0).tokens
  np.testing.assert_array_equal(run(model, PROMPTS, key=3, top_k=1, temperature=2.0).tokens, greedy)
  np.testing.assert_array_equal(run(model, PROMPTS, key=3, top_p=1e-6).tokens, greedy)


def test_filters_keep_the_most_likely_tokens():
  """top_k keeps the k largest logits; top_p keeps the most likely tokens until their mass reaches p."""
  keys = jax.random.split(jax.random.key(0), 1000)
  logits = jnp.broadcast_to(jnp.log(jnp.asarray([0.05, 0.3, 0.0, 0.5, 0.15])), (len(keys), 5))
  settings = [(None, None), (3, None), (None, 0.7), (None, 0.79), (None, 0.81), (2, 0.99)]
  draws = jax.jit(lambda: [sampling._sample(keys, logits, k, p if p is None else jnp.float32(p))
                           for k, p in settings])()
  kept = [set(np.asarray(draw).tolist()) for draw in draws]
  # top_p 0.7 and 0.79: 0.5 falls short, 0.5 + 0.3 reaches it; 0.81 needs the third token too
  assert kept == [{0, 1, 3, 4}, {1, 3, 4}, {1, 3}, {1, 3}, {1, 3, 4}, {1, 3}]


def test_padded_batch_matches_each_prompt_alone_and_sampling_is_deterministic(model):
  """Left padding with negative start positions: each row decodes as if alone (greedy, and sampling with one
  key per row), including a prompt of length 1. Sampling repeats for the same keys and differs for others."""
  greedy = run(model, PROMPTS, temperature=0.0)
  for i, prompt in enumerate(PROMPTS):
    np.testing.assert_array_equal(run(model, [prompt], temperature=0.0).tokens[0], greedy.tokens[i])

  keys = jax.random.split(jax.random.key(4), len(PROMPTS))
  sampled = run(model, PROMPTS, key=keys)
  np.testing.assert_array_equal(run(model, [PROMPTS[1]], key=keys[1:2]).tokens[0], sampled.tokens[1])
  np.testing.assert_array_equal(run(model, PROMPTS, key=keys).tokens, sampled.tokens)
  other = run(model, PROMPTS, key=jax.random.split(jax.random.key(5), len(PROMPTS)))
  assert not np.array_equal(other.tokens, sampled.tokens)
  assert not np.array_equal(greedy.tokens, sampled.tokens)


def test_torchscale_style_pads_only_in_the_parallel_prefill():
  """With the torchscale normaliser, chunkwise results depend on where chunks start, so padding would shift them
  (4.5e-2 on the logits of a row padded by 6 with chunks of 8): refused; the parallel prefill pads exactly."""
  cfg = retnet_config.get_config("tiny").model
  cfg.stability_norm_style = "torchscale"
  ts_model = Model(cfg, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"lengths \[5, 1, 11, 8\] are left-padded .* prefill_mode='parallel'"):
    run(ts_model, PROMPTS, temperature=0.0)
  greedy = run(ts_model, PROMPTS, temperature=0.0, prefill_mode="parallel")
  for i, prompt in enumerate(PROMPTS):
    alone = run(ts_model, [prompt], temperature=0.0, prefill_mode="parallel")
    np.testing.assert_array_equal(alone.tokens[0], greedy.tokens[i])


def test_stop_tokens_end_rows(model):
  """Each row stops at its first stop token; once all rows have stopped the loop exits early."""
  free = run(model, PROMPTS, temperature=0.0).tokens.tolist()
  stop = {row[2] for row in free}
  out = run(model, PROMPTS, temperature=0.0, stop_tokens=sorted(stop))
  for i, row in enumerate(free):
    length = next(n for n, token in enumerate(row) if token in stop) + 1
    assert length <= 3 and out.lengths[i] == length, i
    assert out.tokens[i, :length].tolist() == row[:length], i
    assert (out.tokens[i, length:] == row[length - 1]).all(), i  # the rest repeats the row's stop token


def test_compiles_once_per_shape_and_settings(model):
  """Repeated calls of one Sampler reuse its compilations."""
  prefills, loops = SAMPLER._prefill_jit._cache_size, SAMPLER._loop_jit._cache_size
  run(model, [[1, 2, 3], [4]], key=5, top_p=0.9, temperature=0.7, stream=lambda tokens, step: None)
  before = prefills(), loops()
  out = run(model, [[9, 8, 7], [6, 5]], key=6, top_p=0.5, temperature=1.3, stream=lambda tokens, step: None)
  again = run(model, [[9, 8, 7], [6, 5]], key=6, top_p=0.5, temperature=1.3, stream=lambda tokens, step: None)
  other = run(model, [[9, 8, 7], [6, 5]], key=7, top_p=0.5, temperature=1.3, stream=lambda tokens, step: None)
  assert (prefills(), loops()) == before and out.tokens.shape == (2, 10)  # new prompts, key, temperature...
  np.testing.assert_array_equal(again.tokens, out.tokens)  # one key: deterministic
  assert not np.array_equal(other.tokens, out.tokens)
  run(model, [[9], [6]], key=6, top_p=0.5, temperature=1.3, stream=lambda tokens, step: None)
  assert (prefills(), loops()) == (before[0] + 1, before[1])  # a new prompt length: only the prefill compiles
  run(model, [[9], [6]], key=6, top_p=0.5, temperature=1.3)
  assert (prefills(), loops()) == (before[0] + 1, before[1] + 1)  # no streaming: another loop


def test_one_prefill_decodes_many_times(model):
  """decode(prefill(...)) is generate; a Prefilled is not consumed, so it can be sampled again."""
  tokens, lengths = sampling.pad_prompts([[1, 2, 3], [4]])
  prefilled = SAMPLER.prefill(model, tokens, lengths)
  kwargs = dict(max_new_tokens=10, key=jax.random.key(3), top_p=0.9)
  first = SAMPLER.decode(model, prefilled, **kwargs)
  np.testing.assert_array_equal(SAMPLER.decode(model, prefilled, **kwargs).tokens, first.tokens)
  np.testing.assert_array_equal(SAMPLER.generate(model, tokens, lengths, **kwargs).tokens, first.tokens)
  other = SAMPLER.decode(model, prefilled, **{**kwargs, "key": jax.random.key(4)})
  assert not np.array_equal(other.tokens, first.tokens)
  with pytest.raises(ValueError, match=r"one per row \[2\]"):
    SAMPLER.decode(model, prefilled, max_new_tokens=2, key=jax.random.split(jax.random.key(0), 3))


def test_each_sampler_streams_to_its_own_calls(model):
  """A Sampler compiles its own loop, whose host callbacks reach its own streams; it samples another's tokens."""
  tokens, lengths = sampling.pad_prompts([[1, 2, 3], [4]])
  kwargs = dict(max_new_tokens=10, key=jax.random.key(3), top_p=0.9, stream_every=4)
  sampler, mine, default = sampling.Sampler(), [], []
  out = sampler.generate(model, tokens, lengths, stream=lambda tokens, step: mine.append(tokens), **kwargs)
  expected = SAMPLER.generate(model, tokens, lengths, stream=lambda tokens, step: default.append(tokens), **kwargs)
  np.testing.assert_array_equal(out.tokens, expected.tokens)
  np.testing.assert_array_equal(np.stack(mine, axis=1), out.tokens)
  np.testing.assert_array_equal(np.stack(default, axis=1), out.tokens)
  assert not sampler._streams and not SAMPLER._streams  # done calls leave no stream behind


@pytest.mark.devices(2)
@pytest.mark.parametrize("mesh_shape", [(1, 1, 2), (2, 1, 1)])
def test_sharded_model_decodes_the_same_tokens(model, mesh_shape):
  """A model on a tensor-parallel (heads, FFN and vocabulary split) or data-parallel mesh prefills, samples
  and streams the tokens the single-device model does, and its prefilled state agrees."""
  config = retnet_config.get_config("tiny")
  config.mesh.shape = mesh_shape
  mesh = sharding.make_mesh(config.mesh, jax.devices()[:2])
  sharded = sharding.shard_model(Model(config.model, rngs=nnx.Rngs(0)), mesh, sharding.logical_rules(config.mesh))
  kernel = sharded.blocks[0].retention.q_proj.kernel[...]
  assert len(kernel.sharding.device_set) == 2 and kernel.addressable_shards[0].data.shape[1] == (
      kernel.shape[1] // 2 if mesh_shape[2] == 2 else kernel.shape[1])
  tokens, lengths = sampling.pad_prompts(PROMPTS)
  expected_state = SAMPLER.prefill(model, tokens, lengths).state
  state = SAMPLER.prefill(sharded, tokens, lengths).state
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(expected_state)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  kwargs = dict(key=4, top_p=0.9, temperature=0.8)
  received = []
  out = run(sharded, PROMPTS, stream_every=3, stream=lambda tokens, step: received.append(tokens), **kwargs)
  np.testing.assert_array_equal(out.tokens, run(model, PROMPTS, **kwargs).tokens)
  np.testing.assert_array_equal(np.stack(received, axis=1), out.tokens)


@pytest.mark.parametrize("stream_every", [1, 3, 8, 16])
def test_stream_receives_every_step_in_order(model, stream_every):
  """Blocks of `stream_every` steps (the last one shorter; one block when it exceeds the 10 steps)."""
  received = []
  out = run(model, [[1, 2, 3], [4]], key=7, top_p=0.9, stream_every=stream_every,
            stream=lambda tokens, step: received.append((step, tokens)))
  assert [step for step, _ in received] == list(range(10))
  np.testing.assert_array_equal(np.stack([tokens for _, tokens in received], axis=1), out.tokens)


def test_stream_delivers_blocks_in_step_order():
  """Blocks that reach the host out of order (the loop's callbacks are unordered) or twice are handed on in
  step order, each step once."""
  received = []
  in_order = sampling._InOrder(lambda tokens, step: received.append((step, tokens.tolist())))
  for step in (2, 3, 0, 3, 1, 4):
    in_order(np.asarray([step, -step]), step)
  assert received == [(step, [step, -step]) for step in range(5)]


def test_stream_stops_with_the_loop(model):
  """An early exit (every row stopped) streams the steps run, up to the stop tokens, and no more."""
  free = run(model, [[1, 2, 3]], temperature=0.0).tokens[0].tolist()
  received = []
  out = run(model, [[1, 2, 3]], temperature=0.0, stop_tokens=(free[4],), stream_every=3,
            stream=lambda tokens, step: received.append((step, int(tokens[0]))))
  stop_at = free.index(free[4])
  assert out.lengths[0] == stop_at + 1
  assert received == [(step, token) for step, token in enumerate(free[:stop_at + 1])]


def test_generate_text_prints_row_as_produced(model, capsys):
  tokenizer = ByteTokenizer()
  texts = text_generation.generate_text(SAMPLER, model, tokenizer, ["abc", "d"], key=jax.random.key(8), top_p=0.9,
                                        max_new_tokens=10, print_row=1)
  ids = run(model, [list(b"abc"), list(b"d")], key=8, top_p=0.9, stream=lambda tokens, step: None).tokens
  assert texts == [tokenizer.decode(row) for row in ids]
  assert capsys.readouterr().out == texts[1] + "\n"


def test_text_printer_waits_for_whole_characters():
  file = io.StringIO()
  printer = text_generation.TextPrinter(ByteTokenizer(), row=0, stop_tokens=(10,), file=file)
  for step, byte in enumerate("é!".encode() + b"\nzz"):
    printer(np.asarray([byte]), step)
    assert "\ufffd" not in file.getvalue()
  printer.finish()
  assert file.getvalue() == "é!\n"


@pytest.mark.parametrize("kwargs,message", [
    (dict(prefill_mode="recurrent"), "unknown prefill_mode 'recurrent'"),
    (dict(max_new_tokens=0), "max_new_tokens must be a positive integer; got 0"),
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(temperature=float("inf")), "temperature must be >= 0 and finite .*; got inf"),
    (dict(top_k=0), r"top_k must lie in \[1, vocab_size=256\].*got 0"),
    (dict(top_k=257), "got 257"),
    (dict(top_p=0.0), r"top_p must lie in \(0, 1\].*got 0.0"),
    (dict(top_p=1.5), "got 1.5"),
    (dict(stop_tokens=(300,)), r"stop tokens \[300\]"),
    (dict(stream_every=0), "stream_every must be a positive integer"),
    (dict(key=jax.random.split(jax.random.key(0), 3)), r"one per row \[2\]"),
    (dict(key=None), r"key must be a PRNG key, e.g. jax.random.key\(seed\)"),
    (dict(top_k=2.5), r"top_k must be an integer in \[1, vocab_size=256\] or None; got 2.5"),
    (dict(stop_tokens=5), "stop_tokens must be a sequence of token ids"),
    (dict(stop_tokens=[2.7]), "every stop token must be an integer token id; got 2.7"),
    (dict(stream="print"), "stream must be a callable"),
])
def test_generate_errors(model, kwargs, message):
  with pytest.raises(ValueError, match=message):
    run(model, [[1, 2], [3]], **kwargs)


def test_generate_input_errors(model):
  key = jax.random.key(0)
  # numpy and jax scalars work where Python numbers do
  np.testing.assert_array_equal(run(model, [[1, 2]], max_new_tokens=np.int64(3), temperature=jnp.float32(0)).tokens,
                                run(model, [[1, 2]], max_new_tokens=3, temperature=0.0).tokens)
  with pytest.raises(ValueError, match="prompts must be a list of strings; got one string 'hello'"):
    text_generation.generate_text(SAMPLER, model, ByteTokenizer(), "hello", max_new_tokens=2, key=key)
  with pytest.raises(ValueError, match=r"lengths must lie in \[1, 2\]"):
    SAMPLER.generate(model, np.ones((2, 2), np.int32), np.asarray([3, 1]), max_new_tokens=2, key=key)
  with pytest.raises(ValueError, match=r"shape \[batch\] = \(2,\)"):
    SAMPLER.generate(model, np.ones((2, 2), np.int32), np.asarray([2]), max_new_tokens=2, key=key)
  with pytest.raises(ValueError, match="ids from 1 to 300"):
    SAMPLER.generate(model, np.asarray([[1, 300]]), np.asarray([2]), max_new_tokens=2, key=key)



def test_a_prompt_that_is_not_utf8_is_named(model):
  """A --prompt of Latin-1 bytes failed in the tokenizer with "surrogates not allowed", naming neither."""
  prompt = b"caf\xe9 au lait".decode("utf-8", "surrogateescape")  # as Python reads such a command line
  with pytest.raises(ValueError, match=r"--prompt 1 holds the byte e9, which is not UTF-8 \(at character 3: 'caf'"
                                       r"\.\.\.\); give the prompt as UTF-8 text"):
    text_generation.check_prompts(["ROMEO:", prompt], "--prompt")
  with pytest.raises(ValueError, match="prompt 0 holds the byte e9"):
    text_generation.generate_text(SAMPLER, model, ByteTokenizer(), [prompt], max_new_tokens=2,
                                  key=jax.random.key(0))
  text_generation.check_prompts(["caf\u00e9"])


def test_pad_prompts():
  tokens, lengths = sampling.pad_prompts([[1, 2, 3], [4], np.asarray([5, 6])])
  np.testing.assert_array_equal(tokens, [[1, 2, 3], [0, 0, 4], [0, 5, 6]])
  assert tokens.dtype == np.int32 and lengths.dtype == np.int32 and lengths.tolist() == [3, 1, 2]
  with pytest.raises(ValueError, match="prompts is empty"):
    sampling.pad_prompts([])
  with pytest.raises(ValueError, match="prompt 1 is empty"):
    sampling.pad_prompts([[1], []])
  with pytest.raises(ValueError, match="prompt 2 holds 4 tokens, more than max_prompt_len=3"):
    sampling.pad_prompts([[1], [2, 3], [4, 5, 6, 7]], max_prompt_len=3)


def test_decoding_compiles_with_the_cpu_options(model):
  """On CPU the loop is compiled with CPU_DECODE_OPTIONS: its dots leave YNNPACK, which a default jit uses
  (from batch 2 at this size)."""
  if jax.default_backend() != "cpu":
    pytest.skip("the options concern XLA's CPU backend")
  graphdef, params = nnx.split(model)
  tokens, lengths = sampling.pad_prompts([[1, 2, 3], [4]])
  settings = sampling_checks.check_settings(model.config.vocab_size, 4, 0.0, None, None, (), None, 8)
  prefilled = SAMPLER.prefill(model, tokens, lengths)
  args = (params, prefilled.state, prefilled.last_tokens, jax.random.key(0), jnp.float32(1), jnp.float32(1),
          jnp.int32(0))
  compiled = SAMPLER._loop_jit.lower(*args, graphdef=graphdef, settings=settings).compile()
  default = jax.jit(SAMPLER._loop, static_argnames=("graphdef", "settings")).lower(
      *args, graphdef=graphdef, settings=settings).compile()
  assert "__ynn_fusion" in default.as_text() and "__ynn_fusion" not in compiled.as_text()
