"""The Transformer as a model of its own: presets and size, training, exact resume, KV-cache decoding (after a prefill,
left-padded, on a tensor mesh), evaluation and generation from its workdir (through the scripts too), and the
options and inputs it refuses."""

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from ml_collections.config_flags import config_path

from configs import retnet as retnet_config, transformer as transformer_config
from retnet_jax.core import sharding
from retnet_jax.evaluation import evaluate, sampling, text_generation
from retnet_jax.hardware import flops
from retnet_jax.input_pipeline import tokenizer
from retnet_jax.models import architectures, model_config, presets
from retnet_jax.models.model import Model
from retnet_jax.runs import flag_messages
from retnet_jax.training import checkpointing, run_checkpoints, train, train_state
from tests.helpers import (assert_resumed_from, forward, random_tokens, read_metrics, script_stdout, tiny_config,
                           tiny_transformer)

SAMPLER = sampling.Sampler()  # one sampler: its compiled functions are reused across tests

REPO = Path(__file__).resolve().parent.parent
STEPS = 40


def tiny_transformer_config(tmp_path, **train_overrides):
  """test_train's tiny run (the corpus's first 60 kB, logging every step) with the Transformer of the tiny preset
  (configs/transformer.py:tiny differs from configs/retnet.py:tiny only in its model section) and a 64-token cache."""
  config = tiny_config(tmp_path, **train_overrides)
  with config.unlocked():
    config.model = transformer_config.get_config("tiny").model
  config.model.max_len = 64
  return config


def run_config(tmp_path):
  return tiny_transformer_config(tmp_path, steps=STEPS, eval_every_steps=20)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """(config, workdir) of 40 steps of the tiny Transformer, checkpoints every 20 steps."""
  tmp = tmp_path_factory.mktemp("transformer")
  config = run_config(tmp)
  config.checkpoint.every_steps = 20
  train.train_and_evaluate(config, tmp / "run")
  return config, tmp / "run"


@pytest.fixture(scope="module")
def model(trained):
  """The trained Transformer, restored from its workdir."""
  restored, step = train_state.restore_model(*trained)
  assert isinstance(restored, Model) and step == STEPS
  return restored


def count_params(model_cfg):
  abstract = nnx.eval_shape(lambda: Model(model_cfg, rngs=nnx.Rngs(0)))
  return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


def test_presets_are_retnet_sizes_with_matched_parameter_counts():
  """Every preset name: RetNet's width, depth, heads, vocabulary and run, the FFN widened to match its parameters
  (the FFN width rounds to a multiple of 8: measured 1.4% for tiny, 0.2% for small, below 0.06% for the others)."""
  for name in presets.PRESETS:
    config, reference = transformer_config.get_config(name), retnet_config.get_config(name)
    assert config.model.architecture == "transformer" and reference.model.architecture == "retnet"
    for field in ("d_model", "num_layers", "num_heads", "vocab_size", "tie_embeddings", "dtype"):
      assert config.model[field] == reference.model[field], (name, field)
    expected = reference.to_dict()
    expected["model"], expected["train"]["mode"] = config.model.to_dict(), "parallel"
    assert config.to_dict() == expected, name
    assert config.model.max_len == max(config.train.seq_len, 1024)
    architectures.check_config(model_config.of(config.model))
    ratio = flops.matmul_params(model_config.of(config.model)) / flops.matmul_params(reference.model)
    assert abs(ratio - 1) < {"tiny": 0.015, "small": 0.003}.get(name, 1e-3), (name, ratio)
  # All parameters (embedding and norms too) of `small`: 3.8M either way.
  small = transformer_config.get_config("small").model
  assert small.ffn_dim == 856  # 512 + 512 - 2 * 256 / 3 = 853.3, rounded to a multiple of 8
  assert abs(count_params(small) / count_params(retnet_config.get_config("small").model) - 1) < 0.003


def test_transformer_matches_retnet_size_and_flop_count():
  """Attention's 4 d^2 replaces retention's 2 d^2 + 3 d d_v; the FFN takes the difference (64 + 64 - 21 -> 104)."""
  retnet_cfg = retnet_config.get_config("tiny").model
  cfg = presets.transformer_config(retnet_cfg, 32)
  assert cfg.ffn_dim == 104
  # Per layer: q/k/v/o 4 x 32 x 32 = 4096, GLU 3 x 32 x 104 = 9984; two layers and the head 32 x 256.
  assert flops.matmul_params(cfg) == 2 * (4096 + 9984) + 8192 == 36352
  # Scores and their product with V at 16 tokens: 4 * 16 * 32 per token and layer.
  assert flops.train_flops_per_token(cfg, 16, "parallel") == 3 * (2 * 36352 + 2 * 2048)
  # All parameters (norm scales and the embedding too): the same within the rounding of the FFN width.
  count = lambda m: sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
  assert abs(count(tiny_transformer()) / count(Model(retnet_cfg, rngs=nnx.Rngs(0))) - 1) < 0.02


def test_learns_on_the_corpus(trained):
  """From 6.1 nats at step 1 (uniform over bytes: ln 256 = 5.5) to well below in 40 steps (measured: eval 3.5)."""
  _, workdir = trained
  losses, evals = read_metrics(workdir), read_metrics(workdir, "eval_loss")
  assert sorted(losses) == list(range(1, STEPS + 1))
  assert losses[1] > math.log(256)
  assert evals[STEPS] < losses[1] - 2.0, (losses[1], evals)
  mfu = read_metrics(workdir, "mfu")  # the Transformer's FLOP count feeds the MFU
  assert mfu and all(0 < value < 10 for value in mfu.values())


def test_resume_is_exact(tmp_path, trained, run_crashing_at_batch):
  """The trained run vs one crashed in step 30 and run again, which resumes from checkpoint 20 (no earlier step
  trained again): identical losses and params."""
  straight_config, straight = trained
  config = run_config(tmp_path)
  config.checkpoint.every_steps = 20
  assert config.model == straight_config.model and config.train == straight_config.train
  run_crashing_at_batch(30, train.train_and_evaluate, config, tmp_path / "resumed")
  with checkpointing.Checkpointer(tmp_path / "resumed" / "checkpoints", read_only=True) as checkpointer:
    assert checkpointer.all_steps() == [20]
  train.train_and_evaluate(config, tmp_path / "resumed")
  assert_resumed_from(tmp_path / "resumed", 20)
  assert read_metrics(tmp_path / "resumed") == read_metrics(straight)  # bitwise on CPU, data order included
  assert read_metrics(tmp_path / "resumed", "eval_loss") == read_metrics(straight, "eval_loss")
  abstract = train_state.make_layout(config, sharding.placement(config.mesh)).abstract_state.params
  straight_params, resumed_params = [checkpointing.load_params(run / "params" / str(STEPS), abstract)
                                     for run in (straight, tmp_path / "resumed")]
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(straight_params), jax.tree.leaves(resumed_params)))


def test_kv_cache_decoding_equals_parallel_logits(model):
  """On the trained model and real text: the recurrent form over the whole text and token by token through the
  cache give the parallel logits (float32 rounding, ~1e-6; a parallel prefill continued recurrently: below)."""
  text = (REPO / "data" / "tinyshakespeare.txt").read_bytes()[:2 * 40]
  tokens = jnp.asarray(np.frombuffer(text, np.uint8).reshape(2, 40), jnp.int32)
  parallel, _ = forward(model, tokens, None, "parallel")
  atol = 1e-5 * float(jnp.max(jnp.abs(parallel)))
  recurrent, _ = forward(model, tokens, model.init_state(2), "recurrent")
  np.testing.assert_allclose(recurrent, parallel, atol=atol)
  state, steps = model.init_state(2), []
  for t in range(tokens.shape[1]):
    logits, state = forward(model, tokens[:, t:t + 1], state, "recurrent")
    steps.append(logits)
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), parallel, atol=atol)
  assert int(state.layers[0].next_slot) == 40 and state.layers[0].key.shape[1] == model.config.max_len


def test_transformer_incremental_decoding_matches_parallel():
  """Parallel logits equal recurrent ones: one call, token by token through the cache, and after a prefill.

  The sequence (21 tokens) does not fill the cache (32 slots); differences are float32 rounding (~1e-6).
  """
  model = tiny_transformer()
  tokens = random_tokens(2, 21)
  parallel, state = forward(model, tokens, None, "parallel")
  scale = float(jnp.max(jnp.abs(parallel)))
  recurrent, recurrent_state = forward(model, tokens, model.init_state(2), "recurrent")
  np.testing.assert_allclose(recurrent, parallel, atol=1e-5 * scale)
  step_state, steps = model.init_state(2), []
  for t in range(21):
    logits, step_state = forward(model, tokens[:, t:t + 1], step_state, "recurrent")
    steps.append(logits)
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), parallel, atol=1e-5 * scale)
  prefill, prefill_state = forward(model, tokens[:, :13], model.init_state(2), "parallel")
  rest, _ = forward(model, tokens[:, 13:], prefill_state, "recurrent")
  np.testing.assert_allclose(jnp.concatenate([prefill, rest], axis=1), parallel, atol=1e-5 * scale)
  for final in (state, recurrent_state, step_state):
    assert all(int(layer.next_slot) == 21 for layer in final.layers) and final.position.tolist() == [21, 21]
  # The cache the parallel call returns continues like the one filled token by token.
  np.testing.assert_allclose(state.layers[1].key[:, :21], step_state.layers[1].key[:, :21],
                             atol=1e-5)


def test_transformer_splits_whole_heads_over_a_tensor_mesh():
  """On a tensor-parallel mesh (as the benchmark's forward sweep and decoding run) each device computes whole
  heads: the compiled forward gathers nothing (its only collectives are the all-reduces after the output and
  FFN projections), and the logits and the cache are the single-device ones."""
  config = retnet_config.get_config("tiny")
  config.mesh.shape = (1, 1, 2)
  mesh = sharding.make_mesh(config.mesh, jax.devices()[:2])
  sharded = sharding.shard_model(tiny_transformer(), mesh, sharding.logical_rules(config.mesh))
  single = tiny_transformer()
  tokens = random_tokens(2, 21)
  hlo = forward.lower(sharded, tokens, sharded.init_state(2), "parallel").compile().as_text()
  assert "all-reduce(" in hlo and not any(op + "(" in hlo for op in ("all-gather", "all-to-all", "collective-permute"))
  logits, state = forward(sharded, tokens, sharded.init_state(2), "parallel")
  expected, expected_state = forward(single, tokens, single.init_state(2), "parallel")
  np.testing.assert_allclose(logits, expected, atol=1e-5 * float(jnp.max(jnp.abs(expected))))
  np.testing.assert_allclose(state.layers[1].key, expected_state.layers[1].key, atol=1e-5)


def test_transformer_left_padding_and_generate():
  """A left-padded prompt gives the logits of the prompt alone, and greedy `sampling.generate` (parallel
  prefill, recurrent decoding through the cache) picks the argmax of the parallel logits."""
  model = tiny_transformer()
  prompt = random_tokens(1, 7, seed=1)
  padded = jnp.concatenate([jnp.zeros((1, 4), jnp.int32), prompt], axis=1)
  state = model.init_state(1)
  state = state._replace(position=jnp.asarray([-4], jnp.int32))
  padded_logits, _ = forward(model, padded, state, "parallel")
  alone, _ = forward(model, prompt, None, "parallel")
  np.testing.assert_allclose(padded_logits[:, 4:], alone, atol=1e-5 * float(jnp.max(jnp.abs(alone))))

  out = SAMPLER.generate(model, np.asarray(prompt), np.asarray([7], np.int32), max_new_tokens=8,
                          key=jax.random.key(0), temperature=0.0, prefill_mode="parallel")
  sequence = jnp.concatenate([prompt, jnp.asarray(out.tokens[:, :-1])], axis=1)
  logits, _ = forward(model, sequence, None, "parallel")
  np.testing.assert_array_equal(out.tokens[0], np.argmax(np.asarray(logits)[0, 6:], axis=-1))


def test_transformer_input_errors():
  model = tiny_transformer(max_len=8)
  with pytest.raises(ValueError, match="unknown mode 'chunkwise'"):
    model(random_tokens(1, 4), mode="chunkwise")
  with pytest.raises(ValueError, match="KV cache holds 8 tokens; 6 are used"):
    _, state = model(random_tokens(1, 6), mode="recurrent", state=model.init_state(1))
    model(random_tokens(1, 3), mode="recurrent", state=state)
  with pytest.raises(ValueError, match="must be a positive divisor of model.d_model"):
    tiny_transformer(num_heads=3)


def test_evaluate_and_generate_from_the_workdir(trained, model):
  """evaluate_model in both of its forms (the training's eval loss, the same rows) and greedy generation (a
  parallel prefill, then recurrent decoding), which picks the argmax of the parallel logits, also for a
  left-padded row."""
  config, workdir = trained
  modes = architectures.modes(model_config.of(config.model))
  results = evaluate.evaluate_model(model, config, modes, config.train.eval_batches)
  assert set(results["modes"]) == {"parallel", "recurrent"} and results["modes_agree"]
  assert results["modes"]["parallel"]["loss"] == pytest.approx(read_metrics(workdir, "eval_loss")[STEPS], rel=1e-5)

  prompts = [list(b"ROMEO:"), list(b"KING HENRY:")]
  tokens_BxP, lengths_B = sampling.pad_prompts(prompts)
  out = SAMPLER.generate(model, tokens_BxP, lengths_B, max_new_tokens=12, key=jax.random.key(0), temperature=0.0)
  for prompt, generated in zip(prompts, out.tokens):
    sequence = jnp.asarray([prompt + generated[:-1].tolist()], jnp.int32)
    logits, _ = forward(model, sequence, None, "parallel")
    np.testing.assert_array_equal(generated, np.argmax(np.asarray(logits)[0, len(prompt) - 1:], axis=-1))


def test_decoding_and_evaluation_errors(trained, model):
  """Forms it lacks and a KV cache (64 tokens) too short for the prompt and the new tokens are refused before
  any work."""
  config, _ = trained
  tokens_BxP, lengths_B = sampling.pad_prompts([list(b"ROMEO:"), list(b"KING HENRY:")])
  key = jax.random.key(0)
  with pytest.raises(ValueError, match=r"unknown prefill_mode 'chunkwise' for a transformer; choose one of "
                                       r"\('parallel',\)"):
    SAMPLER.generate(model, tokens_BxP, lengths_B, max_new_tokens=2, key=key, prefill_mode="chunkwise")
  with pytest.raises(ValueError, match=r"prompts padded to 11 tokens and 55 new tokens need a KV cache of 65 tokens, "
                                       r"but model.max_len=64; raise model.max_len \(--config.model.max_len=65\)"):
    SAMPLER.generate(model, tokens_BxP, lengths_B, max_new_tokens=55, key=key)
  prefilled = SAMPLER.prefill(model, tokens_BxP, lengths_B)  # compiled by the test above
  with pytest.raises(ValueError, match=r"the KV cache holds 64 tokens; 10 are used and 55 more do not fit"):
    SAMPLER.decode(model, prefilled, max_new_tokens=55, key=key)
  with pytest.raises(ValueError, match=r"unknown mode 'chunkwise' for a transformer; choose one of \('parallel', "
                                       r"'recurrent'\) or all"):
    evaluate.evaluate_model(model, config, modes=("parallel", "chunkwise"))


def script_json(name, config, workdir, *flags):
  """A script on the trained workdir, one CPU device, with the run's config as flags; its last stdout line as JSON."""
  overrides = {"data.files": f"('{config.data.files[0]}',)", "model.max_len": config.model.max_len,
               **{f"train.{k}": config.train[k] for k in ("batch_size", "seq_len", "eval_batches")}}
  stdout = script_stdout(name, f"--config={REPO / 'configs' / 'transformer.py'}:tiny", f"--workdir={workdir}",
                         *[f"--config.{k}={v}" for k, v in overrides.items()], *flags)
  return json.loads(stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_scripts_evaluate_and_generate_it(trained, model):
  """scripts/evaluate.py --mode=all evaluates its two forms; scripts/generate.py prefills it in the parallel form
  (the default for a Transformer) and decodes greedily what the library does."""
  config, workdir = trained
  results = script_json("evaluate.py", config, workdir, "--mode=all", "--max_batches=2")
  assert set(results["modes"]) == {"parallel", "recurrent"} and results["modes_agree"]
  assert results["modes"]["parallel"]["loss"] == pytest.approx(read_metrics(workdir, "eval_loss")[STEPS], rel=1e-5)
  generated = script_json("generate.py", config, workdir, "--prompt=ROMEO:", "--max_new_tokens=12", "--temperature=0",
                          "--nostream")
  expected = text_generation.generate_text(SAMPLER, model, tokenizer.ByteTokenizer(), ["ROMEO:"], max_new_tokens=12,
                                           key=jax.random.key(0), temperature=0.0)
  assert generated["samples"] == [{"prompt": "ROMEO:", "completion": expected[0]}]


@pytest.mark.parametrize("change,message", [
    (lambda c: c.model.update(architecture="mamba"), r"unknown model.architecture 'mamba'; choose one of \('retnet', "
                                                     r"'transformer'\)"),
    (lambda c: c.train.update(mode="chunkwise"),
     r"train.mode='chunkwise': this model's layers do not compute the chunkwise form.*--config.train.mode=parallel"),
    (lambda c: c.train.update(segment_len=16), r"train.segment_len=16: segments carry retention's fixed-size state.*"
                                               r"--config.train.segment_len=0"),
    (lambda c: c.model.update(max_len=0), "model.max_len must be a positive integer; got 0"),
    (lambda c: c.model.update(num_heads=3), "model.num_heads=3 must be a positive divisor of model.d_model=32"),
    (lambda c: c.model.update(rotation_freqs="xpos"), "unknown model.rotation_freqs 'xpos'"),
])
def test_bad_input_fails_before_touching_the_workdir(tmp_path, change, message):
  config = tiny_transformer_config(tmp_path)
  change(config)
  with pytest.raises(ValueError, match=message):
    train.train_and_evaluate(config, tmp_path / "run")
  assert not (tmp_path / "run").exists()


def test_retention_options_and_mixed_sections_are_refused(tmp_path):
  """A Transformer config has no retention fields: the locked config refuses them, and the command line's error
  (`retnet_jax.runs.flag_messages`) names the option and the fix; a RetNet model section set to `transformer` is
  refused."""
  config = transformer_config.get_config("tiny")
  for field in ("chunk_size", "retention_impl", "decay_schedule", "stability_norm", "value_dim"):
    with pytest.raises(KeyError, match=f'"{field}" does not exist and cannot be added since the config is locked'):
      config.model[field] = None
  with pytest.raises(KeyError) as error:  # as ml_collections reads `--config.model.retention_impl=pallas`
    config_path.get_value("model.retention_impl", config)
  assert flag_messages.unknown_field(["train.py", "--config.model.retention_impl=pallas"], error.value) == (
      "error: --config.model.retention_impl names no config field: 'retention_impl' (model.retention_impl is a "
      "retnet option, which this config's architecture does not have: drop it, or use "
      "--config=configs/retnet.py:NAME)")
  with pytest.raises(ValueError, match="unknown architecture 'mamba'"):
    presets.get_config("tiny", architecture="mamba")
  mixed = tiny_config(tmp_path)
  mixed.model.architecture = "transformer"
  with pytest.raises(ValueError, match=r"model.architecture='transformer' does not fit this model section \(it lacks "
                                       r"model.max_len; model.attention_layers, .* are not transformer fields\); "
                                       r"take the "
                                       r"whole section from configs/transformer.py"):
    train.train_and_evaluate(mixed, tmp_path / "run")


def test_checkpoints_of_the_other_architecture_are_refused(tmp_path):
  """A RetNet checkpoint written before `architecture` existed loads as a RetNet and is refused, by that field
  alone, under a Transformer config; the cache length may change between runs."""
  old = {k: v for k, v in retnet_config.get_config("tiny").model.to_dict().items() if k != "architecture"}
  run_checkpoints.check_compatible(old, retnet_config.get_config("tiny"), tmp_path)
  config = transformer_config.get_config("tiny")
  with pytest.raises(ValueError, match=r"incompatible model config \(model.architecture: checkpoint 'retnet' vs "
                                       r"config 'transformer'\); use the model config it was trained with"):
    run_checkpoints.check_compatible(old, config, tmp_path)
  saved = config.model.to_dict()
  config.model.max_len = 4096
  run_checkpoints.check_compatible(saved, config, tmp_path)


@pytest.mark.devices(8)
def test_sharding_rules_split_its_parameters():
  """The mesh's logical-axis rules place its parameters as RetNet's: embed -> fsdp, heads / mlp / vocab -> tensor."""
  config = transformer_config.get_config("tiny")
  config.mesh.shape = (2, 2, 2)
  params = train_state.make_layout(config, sharding.placement(config.mesh)).abstract_state.params
  P = jax.sharding.PartitionSpec
  block = params["blocks"][0]
  for variable, spec in ((params["embed"]["embedding"], P("tensor", "fsdp")),
                         (block["attention"]["qkv_proj"]["kernel"], P("fsdp", "tensor")),
                         (block["attention"]["out_proj"]["kernel"], P("tensor", "fsdp")),
                         (block["ffn"]["fc2"]["kernel"], P("tensor", "fsdp")),
                         (params["head"]["kernel"], P("fsdp", "tensor"))):
    assert variable.get_value().sharding.spec == spec  # abstract: a ShapeDtypeStruct with its sharding
