"""Training: learning, sharded steps, gradient accumulation, exact resume, restoring on another mesh, bad input."""

import errno
import json
import logging
import shutil

import jax
import jax.numpy as jnp
import absl.logging
import numpy as np
import pytest
from flax import nnx

from configs import retnet as retnet_config
from retnet_jax.core import sharding
from retnet_jax.hardware import flops
from retnet_jax.mixers import stability
from retnet_jax.models import model_config
from retnet_jax.models.model import Model
from retnet_jax.runs import workdir as workdir_lib
from retnet_jax.training import checkpointing, losses, run_checkpoints, run_config, train, train_state, train_step
from tests.helpers import CORPUS, assert_resumed_from, random_tokens, read_metrics, tiny_config


def random_batch(config, seed=0):
  """Random token rows `[batch_size, seq_len + 1]` for a train step of `config`."""
  return random_tokens(config.train.batch_size, config.train.seq_len + 1, config.model.vocab_size, seed)


def one_step(config, mesh, batch):
  run = train_step.setup(run_config.build(config), mesh)
  with run.placement.active():
    state = run.init()
    state, metrics = run.train_step(state, jax.device_put(batch, run.placement.batch_sharding))
  return state, metrics


def max_tree_diff(a, b):
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.slow
def test_tiny_learns_shakespeare(tmp_path):
  """300 steps of `tiny` on the shipped corpus: the byte unigram entropy is 3.31 nats; measured eval ~2.35."""
  config = tiny_config(tmp_path, steps=300, seq_len=64, learning_rate=3e-3, warmup_steps=20, log_every_steps=50,
                       eval_every_steps=300, eval_batches=8)
  config.data.files = ()
  config.checkpoint.every_steps = 300
  final = train.train_and_evaluate(config, tmp_path / "run")
  assert final["eval_loss"] < 3.31 - 0.7, final


@pytest.mark.devices(8)
def test_sharded_step_matches_single_device():
  """One step on a (2 data, 2 fsdp, 2 tensor) mesh of 8 devices equals the same step on one device."""
  config = retnet_config.get_config("tiny")
  config.train.batch_size = 8
  batch = random_batch(config)
  config.mesh.shape = (1, 1, 1)
  single, single_metrics = one_step(config, sharding.make_mesh(config.mesh, jax.devices()[:1]), batch)
  config.mesh.shape = (2, 2, 2)
  mesh = sharding.make_mesh(config.mesh)
  sharded, sharded_metrics = one_step(config, mesh, batch)
  assert abs(float(single_metrics["loss"]) - float(sharded_metrics["loss"])) < 1e-5
  assert max_tree_diff(single.params, sharded.params) < 1e-5
  assert max_tree_diff(single.opt_state, sharded.opt_state) < 1e-5

  params = sharded.params
  P = jax.sharding.PartitionSpec
  expected = [  # the rules: embed -> fsdp, heads/mlp/vocab -> tensor
      (params["embed"]["embedding"], P("tensor", "fsdp")),
      (params["blocks"][0]["retention"]["q_proj"]["kernel"], P("fsdp", "tensor")),
      (params["blocks"][0]["retention"]["out_proj"]["kernel"], P("tensor", "fsdp")),
      (params["blocks"][1]["ffn"]["fc2"]["kernel"], P("tensor", "fsdp")),
      (params["final_norm"]["scale"], P("fsdp")),
  ]
  for variable, spec in expected:
    array = variable[...]
    assert array.sharding.spec == spec
    split = 2 ** sum(axis is not None for axis in spec)  # each named mesh axis has size 2; data replicates
    assert array.addressable_shards[0].data.size == array.size // split
  mu = sharded.opt_state[1][0].mu["blocks"][0]["retention"]["q_proj"]["kernel"][...]
  assert mu.sharding.spec == P("fsdp", "tensor")  # optimizer moments are sharded like their parameters


@pytest.mark.devices(4)
def test_gradient_accumulation_equals_one_big_batch():
  config = retnet_config.get_config("tiny")
  config.mesh.shape = (4, 1, 1)
  mesh = sharding.make_mesh(config.mesh, jax.devices()[:4])
  config.train.batch_size = 16
  batch = random_batch(config, seed=1)
  whole, whole_metrics = one_step(config, mesh, batch)
  config.train.grad_accum_steps = 4
  accumulated, accumulated_metrics = one_step(config, mesh, batch)
  assert abs(float(whole_metrics["loss"]) - float(accumulated_metrics["loss"])) < 1e-5
  assert abs(float(whole_metrics["grad_norm"]) - float(accumulated_metrics["grad_norm"])) < 1e-5
  assert max_tree_diff(whole.params, accumulated.params) < 1e-5


def test_resume_is_exact(tmp_path, run_crashing_at_batch):
  """8 steps straight vs a run crashed in step 6 and run again, which resumes from checkpoint 4 (no earlier step
  trained again): identical losses and parameters."""
  config = tiny_config(tmp_path)
  straight = train.train_and_evaluate(config, tmp_path / "straight")
  run_crashing_at_batch(6, train.train_and_evaluate, config, tmp_path / "resumed")  # in step 6, after checkpoint 4
  resumed = train.train_and_evaluate(config, tmp_path / "resumed")
  assert_resumed_from(tmp_path / "resumed", 4)

  straight_losses, resumed_losses = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
  assert sorted(straight_losses) == list(range(1, 9))
  for step in range(1, 9):
    assert resumed_losses[step] == straight_losses[step], step  # bitwise on CPU, data order included
  assert resumed["eval_loss"] == straight["eval_loss"]
  abstract = train_state.make_layout(config, sharding.placement(config.mesh)).abstract_state.params
  params = [checkpointing.load_params(tmp_path / run / "params" / "8", abstract) for run in ("straight", "resumed")]
  assert max_tree_diff(*params) == 0


@pytest.mark.devices(8)
def test_checkpoint_restores_on_another_mesh(tmp_path, caplog):
  config = tiny_config(tmp_path, steps=4)
  config.mesh.shape = (8, 1, 1)
  train.train_and_evaluate(config, tmp_path / "run")
  config.mesh.shape = (2, 2, 2)
  run = train_state.make_layout(config, sharding.placement(config.mesh))
  with checkpointing.Checkpointer(tmp_path / "run" / "checkpoints") as checkpointer:
    state, meta = checkpointer.restore(run.abstract_state.saved())
  kernel = state["params"]["blocks"][0]["ffn"]["fc1"]["kernel"][...]
  assert kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
  exported = checkpointing.load_params(tmp_path / "run" / "params" / "4", run.abstract_state.params)
  assert max_tree_diff(state["params"], exported) == 0
  assert int(state["step"]) == 4 and meta["data"] == {"grain": {"next_index": 4}}
  config.train.steps = 6  # and training continues on the new mesh, warning that the batches now differ
  config.seed = 7
  verbosity = absl.logging.get_verbosity()
  absl.logging.set_verbosity(absl.logging.INFO)
  try:
    with caplog.at_level(logging.INFO, logger="absl"):
      assert np.isfinite(train.train_and_evaluate(config, tmp_path / "run")["loss"])
  finally:
    absl.logging.set_verbosity(verbosity)
  assert "WARNING: seed changed since the checkpoint" in caplog.text
  assert_resumed_from(tmp_path / "run", 4, caplog.text)


@pytest.mark.parametrize("change,message", [
    (lambda c: c.train.update(batch_size=12), "not divisible by the 8 data shards"),
    (lambda c: c.mesh.update(shape=(3, 1, 1)), "needs 3 devices but 8 are present"),
    (lambda c: c.data.update(files=("/nonexistent/corpus.txt",)), "does not exist"),
    (lambda c: c.data.update(files=(str(CORPUS.parent),)), "is a directory; list the files in it"),
    (lambda c: c.train.update(seq_len=100_000), "too few for one sequence"),
    (lambda c: c.data.update(tokenizer="/nonexistent/tokenizer.json"), "neither 'byte' nor an existing file"),
    (lambda c: c.train.update(mode="recurrent"), "train with 'parallel' or 'chunkwise'"),
    (lambda c: c.train.update(grad_accum_steps=3), "not divisible by train.grad_accum_steps=3"),
    (lambda c: c.model.update(dtype="float16"), "unknown dtype 'float16'"),
    (lambda c: c.model.update(param_dtype="float16"), r"unknown model.param_dtype 'float16' .* choose one of"),
    (lambda c: c.model.update(param_dtype="bfloat16"), r"model.param_dtype='bfloat16': training keeps float32 master "
                                                       r"weights .* set --config.model.param_dtype=float32"),
    (lambda c: c.train.update(optimizer_state_dtype="float16"), r"unknown train.optimizer_state_dtype 'float16'"),
    (lambda c: c.model.update(decay_schedule="cosine"), "unknown decay_schedule 'cosine'"),
    (lambda c: c.model.update(chunk_size=0), "model.chunk_size must be a positive integer"),
    (lambda c: c.model.update(num_heads=3), "not divisible by model.num_heads=3"),
    (lambda c: c.train.update(lr_schedule="step"), "unknown train.lr_schedule 'step'"),
    (lambda c: c.train.update(nonfinite="ignore"), "unknown train.nonfinite 'ignore'"),
    (lambda c: c.train.update(remat="everything"), "unknown train.remat 'everything'"),
    (lambda c: c.train.update(segment_len=-4), "train.segment_len must be 0"),
    (lambda c: c.train.update(mode="chunkwise", segment_len=12) or c.model.update(stability_norm_style="torchscale"),
     "train.segment_len=12 is not a multiple of model.chunk_size=8"),
    (lambda c: c.train.update(segment_len=8) or c.model.update(attention_layers=(1,), attention_max_len=16),
     r"train.segment_len=8 carries the attention layers' KV caches from segment to segment, .* exceeds "
     r"model.attention_max_len=16. Raise it \(--config.model.attention_max_len=\d+\) or set model.attention_window"),
    (lambda c: c.model.update(vocab_size=100), "the tokenizer has 256 tokens but model.vocab_size=100"),
    (lambda c: c.data.update(validation_fraction=1.5), "validation_fraction must lie strictly between 0 and 1"),
    (lambda c: c.data.update(validation_fraction=0.003),
     r"^the prepared validation split holds 5 sequences, fewer than one batch of 8; use a smaller batch size or "
     r"seq_len, or prepare more validation data\.$"),
    (lambda c: c.data.update(reset_at_documents=True), r"data.reset_at_documents=True but data.files holds a single "
                                                       r"document .* or set data.reset_at_documents=False"),
    (lambda c: c.data.update(reset_at_documents=True) or c.train.update(mode="chunkwise")
     or c.model.update(stability_norm_style="torchscale"),
     r"data.reset_at_documents=True \(train.mode\) cannot reset the chunkwise form of "
     r"model.stability_norm_style='torchscale'"),
    (lambda c: c.train.update(learning_rate=-1.0), r"train.learning_rate must be positive; got -1.0"),
    (lambda c: c.train.update(warmup_steps=-5), r"train.warmup_steps must be at least 0; got -5"),
    (lambda c: c.train.update(b2=1.0), r"train.b2 must be in \[0, 1\); got 1.0"),
    (lambda c: c.checkpoint.update(keep=0), r"checkpoint.keep must be a positive integer; got 0"),
    (lambda c: c.train.update(profile_steps=(5,)), r"profile_steps must be \(first, last\)"),
    (lambda c: c.mesh.update(shape=(1, 1, 8)) or c.model.update(ffn_dim=36),
     r"\['ffn'\]\['fc1'\]\['kernel'\].* cannot be split over mesh axes \('tensor',\) \(8 devices\): 36 is not"),
])
@pytest.mark.devices(8)
def test_bad_input_fails_before_touching_the_workdir(tmp_path, change, message):
  config = tiny_config(tmp_path)
  change(config)
  with pytest.raises((ValueError, FileNotFoundError), match=message):
    train.train_and_evaluate(config, tmp_path / "run")
  assert not (tmp_path / "run").exists()


@pytest.mark.devices(8)
def test_batch_must_be_split_over_the_processes(tmp_path, monkeypatch):
  """Each process loads only its own rows, so a batch replicated over processes (all devices on `tensor`) would
  hand each one half of what it needs."""
  config = tiny_config(tmp_path)
  config.mesh.shape = (1, 1, 8)
  monkeypatch.setattr(train.jax, "process_count", lambda: 2)
  with pytest.raises(ValueError, match=r"split into 1 data shards .* on 2 processes.*multiple of the process count"):
    train.check_config(config, 8)
  config.mesh.shape = (2, 1, 4)
  train.check_config(config, 8)


def test_the_step_takes_the_typed_config_only(tmp_path):
  """Below the entry points the config is typed: `train_step.setup` refuses a ConfigDict by naming the builder."""
  config = tiny_config(tmp_path)
  with pytest.raises(TypeError, match=r"takes the typed config; got a ConfigDict: pass run_config.build\(config\)"):
    train_step.setup(config, sharding.make_mesh(run_config.build(config).mesh, jax.devices()[:1]))


def test_workdir_that_is_a_file_is_refused(tmp_path):
  (tmp_path / "run").write_text("notes")
  with pytest.raises(ValueError, match="is a file; choose a directory"):
    train.train_and_evaluate(tiny_config(tmp_path), tmp_path / "run")


@pytest.mark.parametrize("seed", [-1, 2**63, 10**20])
def test_a_seed_out_of_range_is_refused_before_any_file_is_written(tmp_path, seed):
  config = tiny_config(tmp_path)
  config.seed = seed
  with pytest.raises(ValueError, match=rf"seed={seed} is out of range: choose an integer from 0 to 2\*\*63 - 1"):
    train.train_and_evaluate(config, tmp_path / "run")
  assert not (tmp_path / "run").exists()


def test_fewer_steps_than_the_workdir_holds_and_a_long_warmup_are_noted(trained_copy, caplog):
  config, workdir, _ = trained_copy
  config.train.update(steps=4, warmup_steps=6)
  with caplog.at_level(logging.INFO, logger="absl"):
    train.train_and_evaluate(config, workdir)
  notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("NOTE:")]
  assert notes == ["NOTE: train.warmup_steps=6 exceeds train.steps=4: the learning rate stops short of "
                   "train.learning_rate",
                   "NOTE: the checkpoint's step 8 is past train.steps=4: nothing to train (raise "
                   "--config.train.steps above 8 to go on)"]
  assert_resumed_from(workdir, 8, caplog.text)


@pytest.mark.slow
def test_a_full_disk_while_exporting_says_so_and_a_rerun_exports(trained_copy, monkeypatch):
  """TensorStore's raw RESOURCE_EXHAUSTED (its spec's `_sharding` after it) named no fix."""
  config, workdir, _ = trained_copy
  shutil.rmtree(workdir / "params")
  save = checkpointing.ocp.StandardCheckpointer.save

  def full(self, directory, *args, **kwargs):
    (workdir / "params" / "8").mkdir(parents=True)  # what it wrote before the disk filled
    raise ValueError("RESOURCE_EXHAUSTED: Error writing local file \"x\": No space left on device "
                     "[os_error_code='28'] [source locations='...'] tensorstore_spec='{\"_sharding\": ...}'")

  monkeypatch.setattr(checkpointing.ocp.StandardCheckpointer, "save", full)
  with pytest.raises(OSError, match=rf"could not export the parameters to {workdir / 'params' / '8'}: No space left "
                                    rf"on device \(its disk is full\). Checkpoint 8 in {workdir / 'checkpoints'} is "
                                    r"committed and intact; free space there .*, then run the same command again: "
                                    r"the training is done, so it only exports the parameters\.$") as error:
    train.train_and_evaluate(config, workdir)
  assert error.value.errno == errno.ENOSPC and not (workdir / "params" / "8").exists()
  monkeypatch.setattr(checkpointing.ocp.StandardCheckpointer, "save", save)
  train.train_and_evaluate(config, workdir)
  assert workdir_lib.exported_steps(workdir) == [8]
  assert_resumed_from(workdir, 8)  # both reruns restored checkpoint 8 and trained no step again


def test_bfloat16_first_adam_moment_tracks_float32():
  """train.optimizer_state_dtype=bfloat16: the train state holds Adam's first moment in bfloat16, sharded as its
  parameter, the second in float32; 10 steps of `tiny` stay within 2e-3 of float32's losses (measured 6.7e-4) and
  2e-3 of its parameters (measured 1.9e-4)."""
  runs = {}
  for dtype in ("float32", "bfloat16"):
    config = retnet_config.get_config("tiny")
    config.train.update(batch_size=4, seq_len=32, warmup_steps=2, steps=20, optimizer_state_dtype=dtype)
    run = train_step.setup(run_config.build(config), sharding.make_mesh(config.mesh, jax.devices()[:1]))
    with run.placement.active():
      state, losses = run.init(), []
      for step in range(10):
        state, metrics = run.train_step(state, jax.device_put(random_batch(config, seed=step % 2),
                                                              run.placement.batch_sharding))
        losses.append(float(metrics["loss"]))
    runs[dtype] = state, losses
  (state, losses), (reference, reference_losses) = runs["bfloat16"], runs["float32"]
  moments = state.opt_state[1][0]
  assert {leaf.dtype for leaf in jax.tree.leaves(moments.mu)} == {jnp.dtype(jnp.bfloat16)}
  assert {leaf.dtype for leaf in jax.tree.leaves(moments.nu)} == {jnp.dtype(jnp.float32)}
  assert jax.tree.map(lambda leaf: leaf.sharding, moments.mu) == jax.tree.map(lambda leaf: leaf.sharding,
                                                                              state.params)
  np.testing.assert_allclose(losses, reference_losses, rtol=2e-3)
  assert max_tree_diff(state.params, reference.params) < 2e-3


def test_resume_converts_the_first_adam_moment_to_a_new_state_dtype(trained_copy, caplog):
  """A run resumed with another train.optimizer_state_dtype reads its checkpoint's moments as written (checked
  against their checksums), casts them, notes it and trains on; its checkpoints then hold the new dtype."""
  config, workdir, _ = trained_copy
  config.train.update(steps=10, optimizer_state_dtype="bfloat16")
  with caplog.at_level(logging.INFO, logger="absl"):
    assert np.isfinite(train.train_and_evaluate(config, workdir)["loss"])
  assert ("NOTE: the checkpoint's first Adam moment is float32: converted to train.optimizer_state_dtype=bfloat16"
          in caplog.text)
  assert_resumed_from(workdir, 8, caplog.text)
  layout = train_state.make_layout(config, sharding.placement(config.mesh))
  with checkpointing.Checkpointer(workdir / "checkpoints", read_only=True) as checkpointer:
    state, _ = checkpointer.restore(layout.abstract_state.saved(), 10)
  mu = state["opt_state"][1][0].mu["blocks"][0]["retention"]["q_proj"]["kernel"][...]
  assert mu.dtype == jnp.bfloat16 and float(jnp.max(jnp.abs(mu))) > 0


def test_incompatible_checkpoint_is_refused_and_kept(trained_copy):
  config, workdir, _ = trained_copy
  before = sorted(p.name for p in (workdir / "checkpoints").iterdir())
  config.model.num_layers = 3
  with pytest.raises(ValueError, match="incompatible model config.*num_layers"):
    train.train_and_evaluate(config, workdir)
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == before


def test_checkpoints_written_before_a_model_field_existed_stay_compatible(tmp_path):
  """A checkpoint's config without the fields added since (its model had their old behaviour) resumes under
  today's defaults and is refused under another value; how the model computes may change on resume."""
  config = tiny_config(tmp_path)
  old = {k: v for k, v in config.model.to_dict().items() if k not in run_checkpoints.ADDED_MODEL_FIELDS}
  config.model.update(matmul_precision="highest", retention_impl="auto", chunk_size=4)
  run_checkpoints.check_compatible(old, config, tmp_path)
  config.model.rotation_pairs = "half"
  with pytest.raises(ValueError, match="model.rotation_pairs: checkpoint 'interleaved' vs config 'half'"):
    run_checkpoints.check_compatible(old, config, tmp_path)


def test_profile_trace_and_tensorboard_events_are_written(tmp_path):
  config = tiny_config(tmp_path, steps=4, profile_steps=(2, 3))
  train.train_and_evaluate(config, tmp_path / "run")
  assert list((tmp_path / "run" / "profile").rglob("*.xplane.pb"))
  assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
  assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["steps"] == 4


def _loss_and_grads(model_cfg, tokens, mode, segment_len, remat="none"):
  graphdef, params = nnx.split(Model(model_cfg, rngs=nnx.Rngs(0)))
  fn = lambda p: losses.token_loss(graphdef, p, tokens, mode, remat, segment_len)
  return jax.jit(jax.value_and_grad(fn))(params)


@pytest.mark.parametrize("mode,style,segment_len,remat", [
    ("chunkwise", "shared", 5, "none"),  # 29 tokens: a padded last segment; chunks of 8 straddle segments
    ("parallel", "shared", 8, "full"),  # with a checkpoint per block inside each segment too
    ("chunkwise", "torchscale", 16, "none"),  # this style's chunkwise normaliser needs segments of whole chunks
    ("parallel", "torchscale", 7, "dots_saveable"),
])
def test_segmented_backprop_gives_the_same_loss_and_gradients(mode, style, segment_len, remat):
  """train.segment_len carries the state across segments: the loss and gradients equal the whole sequence's
  to float32 rounding (measured 5e-7 on the loss, 1e-7 on gradients of size 0.25; segments of 12 with the
  torchscale style, refused by check_config, differ by 3e-3)."""
  model_cfg = retnet_config.get_config("tiny").model
  model_cfg.stability_norm_style = style
  tokens = jnp.asarray(random_tokens(2, 30, seed=3))
  loss, grads = _loss_and_grads(model_cfg, tokens, mode, 0)
  segmented_loss, segmented_grads = _loss_and_grads(model_cfg, tokens, mode, segment_len, remat)
  assert abs(float(loss) - float(segmented_loss)) < 1e-5
  scale = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(grads))
  assert max_tree_diff(grads, segmented_grads) < 1e-4 * scale


@pytest.mark.optimized
def test_segmented_backprop_bounds_the_compiled_buffers():
  """At 2048 tokens, segments of 256 cut the train step's XLA buffers several-fold (the whole sequence keeps
  every layer's activations for the backward pass; measured 11.05 -> 1.26 GB at 16k for the benchmark model)."""
  config = retnet_config.get_config("tiny")
  config.train.update(dict(batch_size=1, seq_len=2048, mode="chunkwise"))
  config.mesh.shape = (1, 1, 1)
  mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])

  def temp_bytes(segment_len):
    config.train.segment_len = segment_len
    run = train_step.setup(run_config.build(config), mesh)
    with run.placement.active():
      batch = jax.ShapeDtypeStruct((1, 2049), jnp.int32, sharding=run.placement.batch_sharding)
      return run.train_step.lower(run.abstract_state, batch).compile().memory_analysis().temp_size_in_bytes

  whole, segmented = temp_bytes(0), temp_bytes(256)
  assert segmented < whole / 3, (whole, segmented)


@pytest.mark.cpu_only("its premise is a CPU's measured ceiling (faked low here); a GPU's peak is the device table's")
def test_mfu_uses_the_device_table_and_never_reads_above_one_on_a_busy_cpu(tmp_path, monkeypatch, caplog):
  """GPUs and TPUs: their nominal peak. A CPU ceiling measured while the machine was busy reads low (here: 1
  FLOP/s): the loop raises it to the rate it achieves, so MFU stays at most 1 (it printed 140% before). The
  progress line leaves a measured ceiling's MFU to metrics.jsonl."""
  h100 = type("Device", (), {"device_kind": "NVIDIA H100 80GB HBM3", "process_index": 0})()
  assert flops.peak_flops(jnp.bfloat16, [h100] * 8) == (8 * 989e12, False)
  peak, measured = flops.peak_flops(jnp.float32, jax.devices())
  assert measured and peak > 1e8
  monkeypatch.setattr(flops, "measured_peak_flops", lambda dtype: 1.0)
  verbosity = absl.logging.get_verbosity()
  absl.logging.set_verbosity(absl.logging.INFO)
  try:
    with caplog.at_level(logging.INFO, logger="absl"):
      train.train_and_evaluate(tiny_config(tmp_path, steps=4, eval_every_steps=4), tmp_path / "run")
  finally:
    absl.logging.set_verbosity(verbosity)
  mfu = read_metrics(tmp_path / "run", "mfu")
  assert mfu and all(0 < value <= 1.0 for value in mfu.values()), mfu
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step 4/4 (100%) | loss")]
  assert lines and "tok/s" in lines[0] and "MFU" not in lines[0], lines


def test_the_torchscale_normaliser_is_one_predicate(tmp_path):
  """Without a stability normaliser the torchscale style has no chunkwise scalars: segments need not align with the
  chunks (train_step's check tested the style alone)."""
  config = tiny_config(tmp_path)
  config.train.update(mode="chunkwise", segment_len=12)
  config.model.update(stability_norm=False, stability_norm_style="torchscale")
  assert not stability.torchscale_normaliser(model_config.of(config.model))
  run_config.build(config)
  config.model.stability_norm = True
  assert stability.torchscale_normaliser(model_config.of(config.model))
  with pytest.raises(ValueError, match="train.segment_len=12 is not a multiple of model.chunk_size=8"):
    run_config.build(config)
