"""Gated retention (`model.mixer="gated_retention"`) through the tools, which reach it through the registry: training
crashed and resumed logs the straight run's metrics; evaluation agrees across forms (loss by position too), passkey
and MQAR evaluate; greedy decoding after either prefill is the same; the decoding state is the kv states alone; the
steps compile ahead of time (scripts/aot_compile.py) for an H100 (the Pallas kernels too) and a TPU with the gated
model's FLOPs; the fla exporter refuses it by name. Under both gate initialisations (`model.gate_init`) where the
gate's bias could change the outcome."""

import json
import re

import jax
import numpy as np
import pytest
from flax import nnx

from configs import retnet as retnet_config
from retnet_jax.evaluation import evaluate, passkey_eval, sampling, sampling_checks
from retnet_jax.hardware import accelerators, flops
from retnet_jax.input_pipeline import passkey
from retnet_jax.input_pipeline.tokenizer import ByteTokenizer
from retnet_jax.interop import export_fla
from retnet_jax.mixers import gated_retention
from retnet_jax.models import architectures, model_config, presets
from retnet_jax.models.model import Model
from retnet_jax.planning import aot
from retnet_jax.training import train, train_state
from tests.helpers import (aot_extra_missing, assert_resumed_from, forward, random_tokens, read_metrics, run_script,
                           tiny_config, tiny_model)

MODES = architectures.MODES
# The gate's starts, the bias's (new beside cases the recorded run placed in the slow tier) marked slow
GATE_INITS_SLOW_BIAS = ["yoco", pytest.param("retnet", marks=pytest.mark.slow)]
SAMPLER = sampling.Sampler()  # one sampler: its compiled functions are reused across tests


@pytest.mark.slow  # 40 to 60 s: three tiny runs
@pytest.mark.parametrize("gate_init", gated_retention.GATE_INITS)
def test_trains_resumes_bit_for_bit_and_evaluates_alike_in_every_form(tmp_path, run_crashing_at_batch, gate_init):
  """Trained chunkwise in segments of 16 tokens (states carried): crashed in step 6 and resumed from checkpoint 4
  (no earlier step trained again), it logs the straight run's losses and evaluation; its checkpoint evaluates alike
  in the three forms, loss by position included (4 buckets of 8 tokens). Under `retnet` the gate bias is restored,
  learned away from its start."""
  config = tiny_config(tmp_path, mode="chunkwise", segment_len=16)
  config.model.update(mixer="gated_retention", gate_init=gate_init)
  straight = train.train_and_evaluate(config, tmp_path / "straight")
  run_crashing_at_batch(6, train.train_and_evaluate, config, tmp_path / "resumed")
  resumed = train.train_and_evaluate(config, tmp_path / "resumed")
  assert_resumed_from(tmp_path / "resumed", 4)
  assert sorted(read_metrics(tmp_path / "straight")) == list(range(1, 9))
  assert read_metrics(tmp_path / "resumed") == read_metrics(tmp_path / "straight")
  assert resumed["eval_loss"] == straight["eval_loss"]
  model, step = train_state.restore_model(config, tmp_path / "resumed")
  assert step == 8 and model.blocks[0].mixer_name == "gated_retention"
  bias = model.blocks[0].gated_retention.gt_bias
  if gate_init == "retnet":
    start = gated_retention.retnet_gate_bias(config.model.num_heads, config.model.gate_logit_normalizer)
    assert np.all(np.isfinite(bias[...])) and not np.allclose(bias[...], start, rtol=0, atol=1e-7)
  else:
    assert bias is None
  results = evaluate.evaluate_model(model, config, modes=MODES, max_batches=1, position_buckets=4)
  assert results["modes_agree"] and results["max_loss_difference"] < 1e-5
  for mode in MODES:
    buckets = results["modes"][mode]["loss_by_position"]
    assert [(b["start"], b["end"]) for b in buckets] == [(0, 8), (8, 16), (16, 24), (24, 32)], mode
    assert all(0 < b["loss"] < np.log(256) for b in buckets), mode
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(buckets, results["modes"]["parallel"]["loss_by_position"])
               ) < 1e-5, mode


def test_passkey_decodes_an_untrained_model():
  """Passkey retrieval (200-token prompts) decodes an untrained tiny gated model: accuracy in [0, 1]."""
  grid = passkey.make_grid(ByteTokenizer(), [200], [0.5], samples=2)
  scores = passkey_eval.evaluate(passkey_eval.greedy_generate(tiny_model(mixer="gated_retention")), grid)
  assert scores["samples"] == 2 and 0 <= scores["mean_accuracy"] <= 1


def test_mqar_evaluates_an_untrained_model_alike_in_every_form():
  config = retnet_config.get_config("tiny")
  config.model.update(mixer="gated_retention", vocab_size=16)
  config.train.seq_len = 15
  config.data.synthetic = "mqar"
  config.data.mqar.num_pairs = 3
  results = evaluate.evaluate_model(Model(config.model, rngs=nnx.Rngs(0)), config, modes=MODES, max_batches=1)
  assert results["task"] == "mqar" and results["modes_agree"] and results["max_loss_difference"] < 1e-5
  assert all(0 <= results["modes"][mode]["mqar_accuracy"] <= 1 for mode in MODES)


@pytest.mark.parametrize("gate_init", GATE_INITS_SLOW_BIAS)
def test_greedy_generation_is_the_same_after_either_prefill(gate_init):
  """Two prompts of 11 and 4 tokens (left-padded; chunks of 4 do not divide them): greedy tokens after a chunkwise
  prefill equal those after a parallel prefill, and are the argmax of the parallel logits over each prompt and its
  generated tokens."""
  model = tiny_model(mixer="gated_retention", chunk_size=4, gate_init=gate_init)
  prompts = [random_tokens(1, 11, seed=6)[0], random_tokens(1, 4, seed=7)[0]]
  tokens, lengths = sampling.pad_prompts(prompts)
  out = {mode: SAMPLER.generate(model, tokens, lengths, max_new_tokens=6, key=jax.random.key(0), temperature=0,
                                prefill_mode=mode).tokens for mode in ("chunkwise", "parallel")}
  np.testing.assert_array_equal(out["chunkwise"], out["parallel"])
  for prompt, new in zip(prompts, np.asarray(out["chunkwise"])):
    logits, _ = forward(model, np.concatenate([prompt, new])[None], None, "parallel")
    np.testing.assert_array_equal(np.argmax(np.asarray(logits[0, len(prompt) - 1:-1]), -1), new)


@pytest.mark.parametrize("gate_init", gated_retention.GATE_INITS)
def test_decoding_state_is_the_kv_states_alone(gate_init):
  """batch x layers x heads x d_k x d_v float32 (no key_sum: no normaliser) plus each row's int32 position, whatever
  the gate's start; RetNet's state of the same size holds a key_sum more."""
  batch, model = 3, tiny_model(mixer="gated_retention", gate_init=gate_init)
  cfg = model.config
  kv_bytes = batch * cfg.num_layers * cfg.num_heads * (cfg.d_model // cfg.num_heads) * (cfg.value_dim // cfg.num_heads)
  assert sampling_checks.state_bytes(model, batch) == 4 * kv_bytes + 4 * batch
  assert sampling_checks.state_bytes(tiny_model(), batch) > sampling_checks.state_bytes(model, batch)


def gated_aot_config(**model_fields):
  """The tiny preset with gated retention in one layer (fast compiles) and `model_fields`."""
  config = presets.get_config("tiny")
  config.model.update(mixer="gated_retention", num_layers=1, **model_fields)
  return config


@pytest.mark.skipif(aot_extra_missing("gpu") is not None, reason=str(aot_extra_missing("gpu")))
@pytest.mark.optimized
@pytest.mark.parametrize("gate_init", GATE_INITS_SLOW_BIAS)
def test_train_step_compiles_for_an_h100_with_the_kernels(gate_init):
  """Chunkwise with the split Pallas kernels (per-token decays): the step fits, calls the kernels, and its model
  FLOPs are flops' count for the gated model (its gate projection's more than RetNet's; the gate bias of `retnet`
  adds no matmul)."""
  config = gated_aot_config(retention_impl="pallas", chunk_size=16, gate_init=gate_init)
  config.train.mode = "chunkwise"
  report = aot.plan(config, accelerators.parse_target("h100:1"), ("train",))
  step = report["steps"]["train"]
  # as RetNet's split kernels: the state and output passes forward; backward the state pass again, the state
  # gradient's reverse pass, dv, and dq/dk (the decay's gradient is XLA's, from their outputs)
  assert report["fits"] and step["fits"] and step["pallas_kernel_calls"] == 6
  tokens = config.train.batch_size * config.train.seq_len
  expected = flops.train_flops_per_token(model_config.of(config.model), config.train.seq_len, "chunkwise") * tokens
  assert step["model_flops_per_device"] == expected
  config.model.update(mixer="retention", gate_init="yoco")
  retention = flops.train_flops_per_token(model_config.of(config.model), config.train.seq_len, "chunkwise")
  assert expected > retention * tokens


@pytest.mark.parametrize("target, devices, steps, gate_init", [("h100:1", 1, "train", "yoco"),
                                                               ("v5e-4", 4, "train,decode", "retnet")])
@pytest.mark.optimized
def test_aot_script_compiles_a_gated_model(tmp_path, target, devices, steps, gate_init):
  """scripts/aot_compile.py with --config.model.mixer=gated_retention, for an H100 and for a TPU v5e-4 (data
  parallel; with the gate bias of `model.gate_init=retnet`): each step fits, with flops' counts for the gated model
  per device."""
  if missing := aot_extra_missing("gpu" if target.startswith("h100") else "tpu"):
    pytest.skip(missing)
  result = run_script("aot_compile.py", "--config=configs/retnet.py:tiny", f"--target={target}", f"--steps={steps}",
                      f"--out={tmp_path}", "--config.model.num_layers=1", "--config.model.mixer=gated_retention",
                      f"--config.model.gate_init={gate_init}")
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(result.stdout.strip().splitlines()[-1])
  assert report["fits"] and sorted(report["steps"]) == sorted(steps.split(","))
  config = gated_aot_config(gate_init=gate_init)
  tokens = config.train.batch_size * config.train.seq_len
  train_step = report["steps"]["train"]
  assert train_step["fits"] and train_step["model_flops_per_device"] == flops.train_flops_per_token(
      config.model, config.train.seq_len, config.train.mode) * tokens / devices
  if "decode" in steps:
    context = architectures.decode_context(model_config.of(config.model))
    decode = report["steps"]["decode"]
    assert decode["fits"] and decode["model_flops_per_device"] == (
        flops.forward_flops_per_token(model_config.of(config.model), context, "recurrent") * config.train.batch_size
        * aot.DECODE_TOKENS / devices)


@pytest.mark.parametrize("gate_init", gated_retention.GATE_INITS)
def test_the_fla_exporter_refuses_gated_retention_by_its_mixer(tmp_path, gate_init):
  """fla's RetNet has a fixed decay per head: the refusal names model.mixer, not the architecture, before writing,
  whatever the gate's start."""
  config = presets.get_config("fla")
  config.model.update(mixer="gated_retention", gate_init=gate_init)
  assert any("model.mixer='gated_retention'" in problem for problem in export_fla.export_problems(config.model))
  with pytest.raises(ValueError, match=re.escape("model.mixer='gated_retention' (fla's RetNet")):
    export_fla.check_export(config, tmp_path / "out")
  assert not (tmp_path / "out").exists()
