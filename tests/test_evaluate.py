"""Evaluation and generation from a checkpoint written by a short training run, through the scripts too."""

import copy
import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from flax import nnx

from configs import retnet as retnet_config
from retnet_jax.core import dispatch, sharding
from retnet_jax.evaluation import evaluate, sampling
from retnet_jax.input_pipeline import data, global_batches, tokenizer
from retnet_jax.runs import workdir as workdir_lib
from retnet_jax.training import checkpointing, metrics, train_state
from tests.helpers import flip_bytes, forward, run_script, script_stdout

SAMPLER = sampling.Sampler()  # one sampler: its compiled functions are reused across tests


def test_all_three_modes_agree_on_a_trained_checkpoint(trained):
  config, workdir, _ = trained
  model, step = train_state.restore_model(config, workdir)
  assert step == 8
  results = evaluate.evaluate_model(model, config, modes=("parallel", "chunkwise", "recurrent"), max_batches=2)
  assert results["modes_agree"] and results["max_loss_difference"] < 1e-4
  parallel = results["modes"]["parallel"]
  assert 0 < parallel["loss"] < np.log(256)  # better than uniform after training
  assert parallel["bits_per_byte"] == pytest.approx(parallel["bits_per_token"])  # byte tokenizer
  assert parallel["perplexity"] == pytest.approx(np.exp(parallel["loss"]))
  assert results["tokens"] == results["bytes"] == 2 * 8 * 32
  # The last training eval used the same 2 batches in the same (parallel) form.
  last_eval = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines() if "eval_loss" in l][-1]
  assert parallel["loss"] == pytest.approx(last_eval["eval_loss"], rel=1e-5)


def test_bfloat16_weights_evaluate_and_generate_close_to_float32(trained):
  """model.param_dtype=bfloat16 restores the float32 masters cast to bfloat16, every parameter (half the bytes);
  evaluation and generation run on them within bfloat16's rounding of the weights' results."""
  config, workdir, _ = trained
  halved = copy.deepcopy(config)
  halved.model.param_dtype = "bfloat16"
  models = {cfg.model.param_dtype: train_state.restore_model(cfg, workdir)[0] for cfg in (config, halved)}
  params = {name: jax.tree.leaves(nnx.state(model, nnx.Param)) for name, model in models.items()}
  assert {p.dtype for p in params["bfloat16"]} == {jnp.dtype(jnp.bfloat16)}
  assert 2 * sum(p.nbytes for p in params["bfloat16"]) == sum(p.nbytes for p in params["float32"])
  for full, half in zip(params["float32"], params["bfloat16"]):
    np.testing.assert_array_equal(np.asarray(half), np.asarray(full.astype(jnp.bfloat16)))

  results = {name: evaluate.evaluate_model(model, cfg, modes=("parallel", "recurrent"), max_batches=2)
             for (name, model), cfg in zip(models.items(), (config, halved))}
  assert results["bfloat16"]["modes_agree"]
  assert results["bfloat16"]["modes"]["parallel"]["loss"] == pytest.approx(
      results["float32"]["modes"]["parallel"]["loss"], rel=1e-2)

  prompts, lengths = sampling.pad_prompts([list(b"ROMEO:"), list(b"A")])
  logits = {}  # the next token's after a prefilled prompt, as decoding computes them
  for name, model in models.items():
    prefilled = SAMPLER.prefill(model, prompts, lengths)
    logits[name] = np.asarray(forward(model, prefilled.last_tokens[:, None], prefilled.state, "recurrent")[0])
  assert logits["bfloat16"].dtype == np.float32
  np.testing.assert_allclose(logits["bfloat16"], logits["float32"], atol=2e-2 * np.max(np.abs(logits["float32"])))
  out = SAMPLER.generate(models["bfloat16"], prompts, lengths, max_new_tokens=8, key=jax.random.key(0),
                          temperature=0)
  assert out.tokens.shape == (2, 8)


def test_evaluation_reads_outputs_back_before_queueing_more_batches(trained, monkeypatch):
  """Every batch queued at once starves a sequence mesh's collectives (XLA aborts with a collective-permute
  timeout): at most `dispatch.IN_FLIGHT` calls run ahead of the outputs read back, with the same loss."""
  config, workdir, _ = trained
  model, _ = train_state.restore_model(config, workdir)
  expected = evaluate.evaluate_model(model, config, max_batches=6)["modes"]["parallel"]["loss"]
  unread, peak = [0], [0]

  class Unread:  # a call's output the host has not read yet
    def __init__(self, array):
      self.array = array
      unread[0] += 1
      peak[0] = max(peak[0], unread[0])

    def __array__(self, dtype=None, copy=None):
      unread[0] -= 1
      return np.asarray(self.array, dtype)

  class Queued:  # the compiled program, its outputs not yet read
    def __init__(self, program):
      self.program, self.memory_analysis = program, program.memory_analysis

    def __call__(self, *args):
      return tuple(map(Unread, self.program(*args)))

  compile_mode = evaluate.compile_mode
  monkeypatch.setattr(evaluate, "compile_mode", lambda *args: Queued(compile_mode(*args)))
  assert evaluate.evaluate_model(model, config, max_batches=6)["modes"]["parallel"]["loss"] == expected
  assert 0 < peak[0] <= 2 * (dispatch.IN_FLIGHT + 1)  # two outputs per call


@pytest.mark.slow
def test_evaluate_script_prints_table_and_json(trained_copy):
  _, workdir, flags = trained_copy
  stdout = script_stdout("evaluate.py", *flags, "--mode=all", "--step=4", "--max_batches=1")
  lines = stdout.strip().splitlines()
  assert lines[0].split() == ["mode", "loss", "ppl", "bits/token", "bits/byte"]
  results = json.loads(lines[-1])
  assert results["step"] == 4 and set(results["modes"]) == {"parallel", "chunkwise", "recurrent"}
  assert results["modes_agree"]
  assert json.loads((workdir / "eval_step_4.json").read_text()) == results


@pytest.mark.slow
def test_generate_script_streams_and_reports(trained):
  _, _, flags = trained
  stdout = script_stdout("generate.py", *flags, "--prompt=ROMEO:", "--prompt=A", "--max_new_tokens=12",
                         "--temperature=0", "--stream_every=5")
  samples = json.loads(stdout.strip().splitlines()[-1])["samples"]
  assert [s["prompt"] for s in samples] == ["ROMEO:", "A"]
  assert stdout.startswith("ROMEO:" + samples[0]["completion"])  # streamed before the JSON line
  assert all(0 < len(s["completion"]) <= 12 for s in samples)  # 12 byte tokens: at most 12 characters
  # Restored onto a tensor-parallel mesh of two CPU devices (docs/evaluation.md), it streams and samples the same text.
  split = script_stdout("generate.py", *flags, "--prompt=ROMEO:", "--prompt=A", "--max_new_tokens=12",
                        "--temperature=0", "--stream_every=5", "--config.mesh.shape=(1,1,2)", JAX_NUM_CPU_DEVICES="2")
  assert split == stdout


@pytest.mark.slow
def test_evaluate_script_errors_are_one_message_and_its_json_survives_an_unwritable_file(trained_copy, tmp_path):
  _, workdir, flags = trained_copy
  result = run_script("evaluate.py", *flags, f"--workdir={tmp_path}")
  assert result.returncode == 1 and "error: no checkpoints in" in result.stderr, result.stderr[-3000:]
  assert "Traceback" not in result.stderr
  blocked = workdir / "eval_step_8.json"
  blocked.mkdir()  # the results file cannot be written (as in a read-only or full workdir)
  try:
    stdout = script_stdout("evaluate.py", *flags, "--max_batches=1")
  finally:
    blocked.rmdir()
  assert json.loads(stdout.strip().splitlines()[-1])["step"] == 8


def test_a_step_deleted_while_it_is_read_gives_the_new_latest(trained, tmp_path, monkeypatch):
  """A training run deletes old steps as it saves new ones; a reader of the latest that loses its step to that
  resolves the latest again (here, step 8 vanishes as its meta is read: step 4 is the latest left)."""
  config, workdir, _ = trained
  shutil.copytree(workdir / "checkpoints", tmp_path / "checkpoints")
  read_meta = checkpointing.Checkpointer.restore_meta

  def deleting_read(self, step=None):
    if step == 8 and (tmp_path / "checkpoints" / "8").exists():
      shutil.rmtree(tmp_path / "checkpoints" / "8")
    return read_meta(self, step)

  monkeypatch.setattr(checkpointing.Checkpointer, "restore_meta", deleting_read)
  assert train_state.restore_model(config, tmp_path)[1] == 4


def test_metrics_json_has_no_nan():
  line = metrics.to_json({"step": 3, "loss": float("nan"), "modes": {"parallel": {"loss": float("inf")}}, "n": 1.5})
  assert json.loads(line) == {"step": 3, "loss": None, "modes": {"parallel": {"loss": None}}, "n": 1.5,
                              "nonfinite": ["loss", "modes.parallel.loss"]}


def assert_refuses_another_model(workdir, **model_changes):
  """restore_model with the tiny config changed by `model_changes` names the first changed field."""
  other = retnet_config.get_config("tiny")
  other.model.update(model_changes)
  with pytest.raises(ValueError, match=f"incompatible model config.*{next(iter(model_changes))}"):
    train_state.restore_model(other, workdir)


def test_params_export_loads_without_checkpoints(trained, tmp_path):
  """A workdir holding only config.json and the final params export (checkpoints deleted) still loads."""
  config, workdir, _ = trained
  shutil.copytree(workdir / "params", tmp_path / "params")
  shutil.copy(workdir / "config.json", tmp_path / "config.json")
  exported, step = train_state.restore_model(config, tmp_path)
  checkpointed, _ = train_state.restore_model(config, workdir, step=8)
  assert step == 8
  jax.tree.map(np.testing.assert_array_equal, nnx.state(exported, nnx.Param), nnx.state(checkpointed, nnx.Param))
  with pytest.raises(ValueError, match=r"No exported params for step 4 .* available steps: \[8\]"):
    train_state.restore_model(config, tmp_path, step=4)
  for file in (tmp_path / "params" / "8").rglob("*"):  # truncated data files: one clear error, not TensorStore's
    if file.is_file() and file.parent.name == "d":
      file.write_bytes(file.read_bytes()[:10])
  with pytest.raises(ValueError, match=r"the params export .*8 is unreadable .*available steps: \[8\]"):
    train_state.restore_model(config, tmp_path)
  assert_refuses_another_model(tmp_path, num_layers=3)


def test_python_api_arguments_of_the_wrong_kind_are_named(trained):
  config, workdir, _ = trained
  model, _ = train_state.restore_model(config, workdir)
  with pytest.raises(ValueError, match=r"modes='parallel' is one string; give a sequence of forms, e.g. "
                                       r"\('parallel',\)"):
    evaluate.evaluate_model(model, config, modes="parallel")
  with pytest.raises(TypeError, match=r"config must be the full config .*; got the model fields alone "
                                      r"\(config.model\)"):
    evaluate.evaluate_model(model, config.model)
  with pytest.raises(TypeError, match=r"workdir must be a run's directory \(a str or path\); got None"):
    train_state.restore_model(config, None)
  with pytest.raises(TypeError, match=r"got the string 'configs/retnet.py:tiny': build the config with get_config"):
    train_state.restore_model("configs/retnet.py:tiny", workdir)


def test_errors_name_what_was_found(trained, tmp_path):
  config, workdir, _ = trained
  with pytest.raises(FileNotFoundError, match="no checkpoints in"):
    train_state.restore_model(config, tmp_path)
  with pytest.raises(ValueError, match=r"No checkpoint for step 5 .* available steps: \[4, 8\]"):
    train_state.restore_model(config, workdir, step=5)
  assert_refuses_another_model(workdir, d_model=64)
  with pytest.raises(ValueError, match="unknown mode 'serial'"):
    evaluate.evaluate_model(None, config, modes=("serial",))
  damaged = tmp_path / "damaged"
  shutil.copytree(workdir / "checkpoints", damaged / "checkpoints")
  (damaged / "checkpoints" / "8" / "meta" / "metadata").write_text("{not json")
  with pytest.raises(ValueError, match=r"checkpoint 8 in .* is unreadable .*--step \(available steps: \[4, 8\]\)"):
    train_state.restore_model(config, damaged)
  assert train_state.restore_model(config, damaged, step=4)[1] == 4
  flipped = tmp_path / "flipped"  # bytes changed in place: readable, but not what was saved
  shutil.copytree(workdir / "checkpoints", flipped / "checkpoints")
  flip_bytes(flipped / "checkpoints" / "8", every_data_file=True)
  with pytest.raises(ValueError, match=r"checkpoint 8 in .* is unreadable .*--step \(available steps: \[4, 8\]\)"):
    train_state.restore_model(config, flipped)
  with pytest.raises(ValueError, match="max_batches must be a positive number of batches"):
    evaluate.evaluate_model(None, config, max_batches=0)
  bigger = tmp_path / "tokenizer.json"
  tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(300)}, unk_token="w0")).save(str(bigger))
  config = copy.deepcopy(config)
  config.data.tokenizer = str(bigger)
  with pytest.raises(ValueError, match="the tokenizer has 300 tokens but model.vocab_size=256"):
    evaluate.evaluate_model(None, config)


def test_loss_by_position_is_each_buckets_mean_per_token_nll(trained):
  """At twice the training length, each bucket's loss is the mean of the per-token NLL computed here with numpy."""
  config, workdir, _ = trained
  model, _ = train_state.restore_model(config, workdir)
  results = evaluate.evaluate_model(model, config, modes=("chunkwise", "recurrent"), max_batches=1, seq_len=64,
                                    position_buckets=4)
  _, valid = data.load_documents(config.data, tokenizer.ByteTokenizer())
  sequences = data.pack(valid.tokens, 64)
  rows_NxL1 = sequences[global_batches.eval_rows(len(sequences), 8, 1).reshape(-1)]
  with sharding.placement(config.mesh).active():
    parallel = nnx.jit(lambda model: model(jnp.asarray(rows_NxL1[:, :-1]), mode="parallel")[0])
    logits_NxLxV = np.asarray(parallel(model), np.float64)
  shifted = logits_NxLxV - logits_NxLxV.max(axis=-1, keepdims=True)
  log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
  nll_NxL = -np.take_along_axis(log_probs, rows_NxL1[:, 1:, None], axis=-1)[..., 0]
  assert results["seq_len"] == 64 and results["tokens"] == 8 * 64 and results["modes_agree"]
  for mode in ("chunkwise", "recurrent"):
    buckets = results["modes"][mode]["loss_by_position"]
    assert [(b["start"], b["end"]) for b in buckets] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    np.testing.assert_allclose([b["loss"] for b in buckets], [nll_NxL[:, 16 * k:16 * (k + 1)].mean() for k in range(4)],
                               rtol=1e-5)
    assert results["modes"][mode]["loss"] == pytest.approx(nll_NxL.mean(), rel=1e-5)
  table = evaluate.format_table(results).splitlines()
  assert table[-6:-4] == ["loss by position (64 tokens per sequence):", f"{'positions':>15} {'chunkwise':>10} "
                                                                         f"{'recurrent':>10}"]
  assert table[-4].split()[0] == "0-16" and len(table[-1].split()) == 3


def test_by_position_errors_name_the_fix(trained):
  config, _, _ = trained
  with pytest.raises(ValueError, match=r"--by_position=5 buckets do not split the 64 positions .* divides 64 "
                                       r"\(e.g. 4\)"):
    evaluate.check_position_buckets(64, 5)
  with pytest.raises(ValueError, match=r"--by_position=100 .* \(e.g. 64\)"):
    evaluate.check_position_buckets(64, 100)
  with pytest.raises(ValueError, match="--by_position=-1 must be a number of position buckets"):
    evaluate.check_position_buckets(64, -1)
  with pytest.raises(ValueError, match="--eval_seq_len=0 must be a positive number of tokens"):
    evaluate.evaluate_model(None, config, seq_len=0, position_buckets=4)
  # 6,000 validation tokens (10% of 60 KB) hold 5 sequences of 1,001 tokens: fewer than a batch of 8.
  with pytest.raises(ValueError, match=r"the validation split holds 6000 tokens: 5 sequences of --eval_seq_len \+ 1 = "
                                       r"1001 tokens, fewer than one batch of 8 .*a shorter --eval_seq_len"):
    evaluate.evaluate_model(None, config, seq_len=1000)


@pytest.mark.slow
def test_evaluate_script_by_position_writes_json_and_plot(trained_copy, tmp_path):
  _, workdir, flags = trained_copy
  stdout = script_stdout("evaluate.py", *flags, "--mode=chunkwise", "--max_batches=1", "--eval_seq_len=64",
                         "--by_position=4")
  results = json.loads(stdout.strip().splitlines()[-1])
  assert results["seq_len"] == 64 and results["sequences"] == 8
  assert [(b["start"], b["end"]) for b in results["modes"]["chunkwise"]["loss_by_position"]] == [
      (0, 16), (16, 32), (32, 48), (48, 64)]
  assert json.loads((workdir / "eval_step_8.json").read_text()) == results
  assert (workdir / "eval_step_8_by_position.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  # Buckets that do not fit are refused before the checkpoint is looked for (this workdir has none).
  result = run_script("evaluate.py", *flags, f"--workdir={tmp_path}", "--eval_seq_len=64", "--by_position=5")
  assert result.returncode == 1 and "error: --by_position=5 buckets do not split the 64 positions" in result.stderr


@pytest.mark.slow
def test_passkey_script_writes_json_and_heatmap(trained_copy):
  _, workdir, flags = trained_copy
  stdout = script_stdout("passkey.py", *flags, "--lengths=192", "--depths=0,1", "--samples=2")
  assert stdout.startswith("passkey accuracy (2 samples per cell; greedy decoding")
  results = json.loads(stdout.strip().splitlines()[-1])
  assert {k: results[k] for k in ("step", "mode", "samples", "lengths", "depths")} == dict(
      step=8, mode="chunkwise", samples=2, lengths=[192], depths=[0.0, 1.0])
  assert np.shape(results["accuracy"]) == (1, 2) and all(a in (0.0, 0.5, 1.0) for a in results["accuracy"][0])
  assert json.loads((workdir / "passkey_step_8.json").read_text()) == results
  assert (workdir / "passkey_step_8.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  # Other settings keep the first result (it was overwritten), with their own heatmap.
  other = json.loads(script_stdout("passkey.py", *flags, "--lengths=224", "--depths=0", "--samples=1")
                     .strip().splitlines()[-1])
  assert json.loads((workdir / "passkey_step_8.json").read_text()) == results
  assert json.loads((workdir / "passkey_step_8_2.json").read_text()) == other
  assert "--lengths=224" in other["settings"] and (workdir / "passkey_step_8_2.png").is_file()


@pytest.mark.slow
def test_passkey_script_refuses_a_grid_that_would_take_hours(trained):
  """--lengths=10000000 --samples=1 passed the memory guard and ran for minutes without a word."""
  result = run_script("passkey.py", *trained.flags, "--lengths=1000000", "--depths=0", "--samples=1",
                      "--max_hours=0.0001")
  assert result.returncode == 1, result.stderr
  assert re.search(r"error: --lengths=1000000: 999\d{3} prompt tokens take about \S+ here \(\d+\.\d+ ms per "
                   r"token, timed on a short prompt\), more than --max_hours=0.0001; choose shorter lengths",
                   result.stderr), result.stderr


def test_scripts_read_the_model_of_the_workdir_unless_config_is_named(trained, tmp_path):
  """Without --config, a script reading a run takes its preset and model from config.json (a hybrid or any model
  override needed repeating), with the --config.x.y given on the command line on top."""
  config, workdir, _ = trained
  given = retnet_config.get_config("small")
  given.model.param_dtype = "bfloat16"
  read = workdir_lib.script_config(given, workdir, named=False, overrides=("model.param_dtype",))
  assert read.model.to_dict() == {**config.model.to_dict(), "param_dtype": "bfloat16"}
  assert workdir_lib.script_config(given, workdir, named=True, overrides=()) is given
  assert workdir_lib.script_config(given, tmp_path, named=False, overrides=()) is given  # no config.json


@pytest.mark.slow
def test_generate_script_without_config_reads_the_workdirs_model(trained):
  stdout = script_stdout("generate.py", f"--workdir={trained.workdir}", "--prompt=A", "--max_new_tokens=4",
                         "--nostream")
  assert [s["prompt"] for s in json.loads(stdout.strip().splitlines()[-1])["samples"]] == ["A"]


def test_a_run_is_evaluated_on_its_own_data_without_config(trained_copy):
  """A run trained on the user's corpus (`--config.data.files=...`), then `evaluate.py --workdir=RUN` without
  `--config`, was scored on the shipped Shakespeare split with no word: it reads the run's data section and
  training length from its config.json, and the results name what they evaluated."""
  config, workdir, flags = trained_copy
  given = script_stdout("evaluate.py", *flags, "--max_batches=1", "--mode=chunkwise")
  alone = script_stdout("evaluate.py", f"--workdir={workdir}", "--max_batches=1", "--mode=chunkwise")
  given, alone = json.loads(given.splitlines()[-1]), json.loads(alone.splitlines()[-1])
  assert alone["data"] == given["data"] == {"files": [config.data.files[0]], "split": "validation",
                                            "split_tokens": alone["data"]["split_tokens"]}
  assert alone["seq_len"] == config.train.seq_len == 32  # the run's, not the preset's 64
  assert alone["modes"]["chunkwise"]["loss"] == given["modes"]["chunkwise"]["loss"]


def test_a_bad_training_length_in_config_json_is_named(trained_copy):
  _, workdir, _ = trained_copy
  saved = json.loads((workdir / "config.json").read_text())
  saved["train"]["seq_len"] = -5
  (workdir / "config.json").write_text(json.dumps(saved))
  with pytest.raises(ValueError, match=r"config\.json: train\.seq_len must be a positive integer \(the run's "
                                       r"training length\); got -5\."):
    workdir_lib.saved_config(workdir)
