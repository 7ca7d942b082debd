"""Passkey examples checked by hand (byte tokenizer) and by decoding (a tokenizers BPE), the accuracy of oracles whose
right answers are known, and greedy generation against a greedy loop of whole-sequence forward passes."""

import json
import os
import re
import resource
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from flax import nnx

from configs import retnet as retnet_config
from retnet_jax.core import host_memory
from retnet_jax.evaluation import passkey_eval, sampling, sampling_checks
from retnet_jax.hardware import accelerators
from retnet_jax.input_pipeline import passkey
from retnet_jax.input_pipeline.tokenizer import ByteTokenizer, HFTokenizer
from retnet_jax.models.model import Model
from retnet_jax.runs import workdir
from tests.helpers import REPO, script_lines

BYTES = ByteTokenizer()
# Byte tokens of an example besides the filler: the introduction (64), the needle with two 6-token keys
# (16 + 6 + 14 + 6 + 17), the question (38) and the answer (" " and 5 digits).
OVERHEAD = 64 + 59 + 38 + 6


def key_of(seed):
  return str(np.random.default_rng(seed).integers(10_000, 100_000))


def text_of(example, tokenizer=BYTES):
  return tokenizer.decode(example.tokens)


def needle(key):
  return f" The pass key is {key}. Remember it. {key} is the pass key."


def tiny_model():
  config = retnet_config.get_config("tiny")
  config.model.update(d_model=16, num_layers=1, num_heads=2, value_dim=32, ffn_dim=32)
  return Model(config.model, rngs=nnx.Rngs(0))


def test_byte_example_by_hand():
  example = passkey.make_example(BYTES, 300, 0.5, seed=3)
  key = key_of(3)
  filler = (passkey.FILLER * 2)[:300 - OVERHEAD]  # 133 filler bytes, round(66.5) = 67 of them before the needle
  assert example.tokens.dtype == np.int32 and example.tokens.shape == (300,)
  assert text_of(example) == (passkey.INTRO + filler[:67] + needle(key) + filler[67:] +
                              f" What is the pass key? The pass key is {key}")  # the question written out
  assert example.needle_start == 64 + 67 and text_of(example)[131:].startswith(" The pass key is")
  np.testing.assert_array_equal(example.answer_positions, np.arange(294, 300))
  assert BYTES.decode(example.tokens[example.answer_positions]) == " " + key
  first, last = passkey.make_example(BYTES, 300, 0.0, seed=3), passkey.make_example(BYTES, 300, 1.0, seed=3)
  question = f"{passkey.QUESTION} {key}"
  assert first.needle_start == 64 and text_of(first) == passkey.INTRO + needle(key) + filler + question
  assert last.needle_start == 300 - 6 - 38 - 59 and text_of(last) == passkey.INTRO + filler + needle(key) + question
  np.testing.assert_array_equal(passkey.make_example(BYTES, 300, 0.5, seed=3).tokens, example.tokens)  # pure
  assert key_of(4) != key and key in text_of(example)
  assert BYTES.decode(passkey.make_example(BYTES, 300, 0.5, seed=4).tokens[-5:]) == key_of(4)
  assert len(passkey.make_example(BYTES, OVERHEAD, 0.5, seed=0).tokens) == OVERHEAD  # no filler at all


@pytest.fixture(scope="module")
def bpe():
  """A byte-level BPE trained on the template, whose keys take 3 to 6 tokens."""
  tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = tokenizers.decoders.ByteLevel()
  text = [passkey.INTRO, passkey.FILLER * 3, " ".join(passkey.NEEDLE), passkey.QUESTION, " 12 345 67 890 1234 56"]
  tokenizer.train_from_iterator(text, tokenizers.trainers.BpeTrainer(
      vocab_size=400, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  return HFTokenizer(tokenizer)


def test_bpe_examples_hold_the_needle_at_their_depth(bpe):
  intro_tokens = len(bpe.encode(passkey.INTRO))
  for seed in range(4):
    key, answer = key_of(seed), bpe.encode(" " + key_of(seed))
    for depth in (0.0, 0.5, 1.0):
      example = passkey.make_example(bpe, 120, depth, seed)
      text = text_of(example, bpe)
      assert len(example.tokens) == 120 and text.startswith(passkey.INTRO) and text.count(needle(key)) == 1
      assert text.endswith(f"{passkey.QUESTION} {key}")
      np.testing.assert_array_equal(example.answer_positions, np.arange(120 - len(answer), 120))
      np.testing.assert_array_equal(example.tokens[example.answer_positions], answer)
      assert bpe.decode(example.tokens[example.needle_start:]).startswith(needle(key))
      filler_tokens = 120 - len(answer) - len(bpe.encode(passkey.QUESTION)) - intro_tokens - (
          2 * len(answer) + sum(len(bpe.encode(piece)) for piece in passkey.NEEDLE))
      assert example.needle_start - intro_tokens == int(depth * filler_tokens + 0.5)
  assert len({len(bpe.encode(" " + key_of(seed))) for seed in range(4)}) > 1  # answers of several lengths


def test_bad_arguments_are_refused():
  with pytest.raises(ValueError, match=r"depth=1.5 must lie in \[0, 1\]"):
    passkey.make_example(BYTES, 300, 1.5, seed=0)
  with pytest.raises(ValueError, match=f"example of 100 tokens is too short.*a length of at least {OVERHEAD}"):
    passkey.make_grid(BYTES, [300, 100], [0.5], samples=2)
  with pytest.raises(ValueError, match="samples=0 must be a positive number"):
    passkey.make_grid(BYTES, [300], [0.5], samples=0)
  with pytest.raises(ValueError, match="give at least one length and one depth"):
    passkey.make_grid(BYTES, [], [0.5], samples=1)
  with pytest.raises(ValueError, match="seed=-1 must be a non-negative integer"):
    passkey.make_grid(BYTES, [300], [0.5], samples=1, seed=-1)
  # Refused before any example is built (otherwise OOM-killed without a word): the available memory in tokens.
  length = host_memory.available_bytes() // 4
  with pytest.raises(ValueError, match=rf"lengths=\[{length}\] at 1 depths and 1 samples make [\d.]+ GiB of example "
                                       r"tokens, more than a quarter of the [\d.]+ GiB of host memory available here, "
                                       r"bounded by .+; choose shorter lengths"):
    passkey.make_grid(BYTES, [length], [0.5], samples=1)


def window_oracle(tokenizer, window, calls):
  """A GenerateFn that answers right exactly when the whole key sentence lies in the last `window` prompt tokens."""
  def generate(prompts_NxP, lengths_N, num_tokens, progress=None):
    calls.append(len(prompts_NxP))
    out = np.zeros((len(prompts_NxP), num_tokens), np.int32)
    for row, (prompt, length) in enumerate(zip(prompts_NxP, lengths_N)):
      assert not prompt[:len(prompt) - length].any()  # left-padded with id 0
      found = re.search(r"The pass key is (\d+)\.", tokenizer.decode(prompt[len(prompt) - length:][-window:]))
      if found:
        answer = tokenizer.encode(" " + found.group(1))
        out[row, :len(answer)] = answer
    return out
  return generate


def test_accuracy_of_an_oracle_that_sees_a_window():
  """Prompts end 6 tokens before each example; a needle starts at 64 + round(depth (length - 167)): within the last
  150 prompt tokens at every depth of length 200 (needles at 64, 81, 97 of prompts of 194) but only at depth 1 of
  length 400 (64, 181, 297 of 394)."""
  calls, lines = [], []
  grid = passkey.make_grid(BYTES, [200, 400], [0.0, 0.5, 1.0], samples=3, seed=7)
  results = passkey_eval.evaluate(window_oracle(BYTES, 150, calls), grid, batch_size=2, progress=lines.append)
  # A line per call: the prompt tokens done of all (each example up to its answer), time taken and left.
  total = passkey_eval.prompt_tokens(grid)
  assert total == 9 * 194 + 9 * 394 and len(lines) == 12
  assert re.fullmatch(rf"passkey: 388/{total} prompt tokens \(7%\) in 0m00s, ETA \d+m\d\ds", lines[0])
  assert lines[-1].startswith(f"passkey: {total}/{total} prompt tokens (100%)")
  assert results["accuracy"] == [[1.0, 1.0, 1.0], [0.0, 0.0, 1.0]] and results["mean_accuracy"] == pytest.approx(4 / 6)
  assert {k: results[k] for k in ("samples", "lengths", "depths")} == dict(samples=3, lengths=[200, 400],
                                                                          depths=[0.0, 0.5, 1.0])
  assert calls == [2, 1] * 6
  table = passkey_eval.format_table(results).splitlines()
  assert table[1].split() == ["depth", "200", "400"] and table[2].split() == ["0.00", "1.00", "0.00"]


def test_exact_match_and_padded_prompts_of_a_bpe(bpe):
  grid = passkey.make_grid(bpe, [150], [0.25, 0.75], samples=4)
  assert passkey_eval.evaluate(window_oracle(bpe, 150, []), grid)["accuracy"] == [[1.0, 1.0]]
  examples = grid.examples[0][0]
  answers = [ex.tokens[ex.answer_positions] for ex in examples]
  width = max(map(len, answers))
  right = np.stack([np.pad(a, (0, width - len(a)), constant_values=7) for a in answers])
  np.testing.assert_array_equal(passkey_eval.exact_match(right, examples), [True] * 4)
  wrong = right.copy()
  wrong[1, len(answers[1]) - 1] += 1  # the last answer token of example 1
  np.testing.assert_array_equal(passkey_eval.exact_match(wrong, examples), [True, False, True, True])
  assert not passkey_eval.exact_match(right[:, :1], examples).any()  # too few tokens


def test_greedy_generate_continues_the_prompt_as_teacher_forced_argmax_does():
  """Greedy decoding (chunkwise prefill, recurrent steps) makes the tokens that a parallel forward pass over the prompt
  and those tokens predicts by argmax: the scoring is both."""
  model = tiny_model()
  grid = passkey.make_grid(BYTES, [180], [0.5], samples=2)
  prompts_NxP = np.stack([ex.tokens[:ex.answer_positions[0]] for ex in grid.examples[0][0]])  # 174 tokens
  generated_NxT = passkey_eval.greedy_generate(model, "chunkwise")(prompts_NxP, np.full(2, 174), 3)
  graphdef, params = nnx.split(model)
  logits_NxLxV = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t, mode="parallel")[0])(
      params, jnp.asarray(np.concatenate([prompts_NxP, generated_NxT], axis=1)))
  np.testing.assert_array_equal(np.argmax(logits_NxLxV[:, 173:176], axis=-1), generated_NxT)


def test_a_prefill_beyond_the_memory_is_refused_before_any_prompt_runs(monkeypatch):
  """passkey.py --lengths=10000000 estimated its time, then grew past the host's memory until the kernel killed it:
  each prefill is now sized by XLA's memory analysis of its compiled program, nothing allocated or run."""
  def ran(*args, **kwargs):
    raise AssertionError("a prompt ran")
  monkeypatch.setattr(sampling.Sampler, "prefill", ran)
  monkeypatch.setattr(sampling.Sampler, "generate", ran)
  monkeypatch.setattr(sampling_checks, "device_memory", lambda devices: 2**17)
  grid = passkey.make_grid(BYTES, [180], [0.5], samples=2)
  with pytest.raises(ValueError, match=r"^length 180: the prefill of 2 prompts of 174 tokens takes about 0\.\d MiB "
                                       r"\(XLA's memory analysis of its compiled program\), more than the 0\.1 MiB of "
                                       r"host memory available here, bounded by .+; choose shorter lengths "
                                       r"\(--lengths\), or "
                                       r"fewer examples per call \(--batch_size\)\.$"):
    passkey_eval.check_memory(tiny_model(), "chunkwise", grid)


def test_a_prefill_beyond_the_available_host_memory_is_refused(monkeypatch):
  """passkey.py --lengths=10000000 (tiny preset) was sized at 22.1 GiB and accepted on a 23.5 GiB machine with 19-21
  GiB available: the CPU backend compared against the physical memory. It compares against what is available."""
  needed = accelerators.required_bytes(accelerators.memory_sizes(
      sampling.Sampler().compile_prefill(tiny_model(), 2, 174, "chunkwise")))
  monkeypatch.setattr(host_memory, "available_bytes", lambda: needed // 2)
  grid = passkey.make_grid(BYTES, [180], [0.5], samples=2)
  with pytest.raises(ValueError, match=r"^length 180: .* more than the .* of host memory available here, bounded by "
                                       r".+; choose shorter lengths \(--lengths\)"):
    passkey_eval.check_memory(tiny_model(), "chunkwise", grid)


def test_available_host_memory_is_at_most_the_physical_memory():
  assert 0 < host_memory.available_bytes() <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_a_prefill_that_fits_is_accepted():
  model = tiny_model()
  passkey_eval.check_memory(model, None, passkey.make_grid(BYTES, [180], [0.5], samples=2))
  compiled = sampling.Sampler().compile_prefill(model, 2, 174)
  assert 0 < accelerators.required_bytes(accelerators.memory_sizes(compiled)) < 2**30


def test_a_long_call_reports_its_progress_with_an_eta(monkeypatch):
  """Within one call, the prefill's progress becomes lines of the grid's prompt tokens done and the time left (every
  PROGRESS_EVERY_S seconds: here every report), then the call's own line."""
  monkeypatch.setattr(passkey_eval, "PROGRESS_EVERY_S", 0.0)
  grid = passkey.make_grid(BYTES, [400], [0.5], samples=2)  # prompts of 394 tokens: 788 in the grid

  def generate(prompts_NxP, lengths_N, num_tokens, progress=None):
    for done in (98, 197, 393):  # columns of the 393 the prefill runs
      progress(done, prompts_NxP.shape[1] - 1)
    return np.zeros((len(prompts_NxP), num_tokens), np.int32)
  lines = []
  passkey_eval.evaluate(generate, grid, progress=lines.append)
  assert [line.split(" prompt tokens")[0] for line in lines] == ["passkey: 196/788", "passkey: 395/788",
                                                                 "passkey: 788/788"]
  assert all(re.search(r"in \dm\d\ds, ETA \d+m\d\ds$", line) for line in lines)


@pytest.mark.slow
def test_ten_million_tokens_under_an_8_gib_address_space_limit(trained_copy):
  """The tiny preset's passkey at 10,000,000 tokens, as `prlimit --as=8589934592 scripts/passkey.py` runs it: the
  prefill streams in blocks, so it exits 0 with progress lines and its accuracy grid (before: sized at 22.1 GiB, then
  refused, or under the limit accepted and failed allocating 23.7 GB)."""
  _, workdir, _ = trained_copy
  limit = 8 * 2**30
  result = subprocess.run(
      [sys.executable, str(REPO / "scripts" / "passkey.py"), f"--workdir={workdir}", "--lengths=10000000",
       "--samples=1", "--depths=0.5"], capture_output=True, text=True, cwd=REPO, timeout=900,
      env={**os.environ, "XLA_FLAGS": ""}, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
  assert result.returncode == 0, result.stderr[-3000:]
  lines = script_lines(result.stdout)
  assert any(re.match(r"passkey: 9999994/9999994 prompt tokens \(100%\) in \dm\d\ds, ETA 0m00s$", line)
             for line in lines + result.stderr.splitlines())
  results = json.loads(lines[-1])
  assert results["lengths"] == [10_000_000] and np.shape(results["accuracy"]) == (1, 1)


@pytest.mark.parametrize("synthetic,expected", [
    (None, "expected: near 0 for a model not trained on passkey examples (this run trained on text); train one with "
           "--config.data.synthetic=passkey, as notebooks/retnet_vs_transformer.ipynb's passkey section does."),
    ("mqar", "expected: near 0 for a model not trained on passkey examples (this run trained on mqar); train one"),
    ("passkey", "expected: up to 1 at the lengths this run trained on (data.synthetic=passkey) once its training "
                "converges"),
])
def test_the_results_say_what_accuracy_to_expect(tmp_path, synthetic, expected):
  """The README's passkey example on the Shakespeare run scored 0 everywhere without saying that this is expected:
  one line of the results says what the run's training (its config.json) leads to expect."""
  config = retnet_config.get_config("tiny")
  config.data.synthetic = synthetic
  workdir.config_file(tmp_path).write_text(config.to_json_best_effort(indent=2))  # as training writes it
  line = passkey_eval.expectation(workdir.trained_task(tmp_path))
  assert line.startswith(expected) and "\n" not in line, line
  assert passkey_eval.expectation(workdir.trained_task(tmp_path / "none")).startswith(
      "expected: near 0 for a model not trained on passkey examples; train one")
