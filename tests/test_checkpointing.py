"""Checkpointer and params export: round trips, retention, resharding on restore, and the error messages."""

import asyncio
import errno
import gc
import json
import logging
import os
import shutil
import time
import warnings
from pathlib import Path

import absl.logging
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from configs.retnet import get_config
from retnet_jax.models.model import Model
from retnet_jax.training import checkpointing, integrity, write_errors
from retnet_jax.training.checkpointing import Checkpointer, export_params, load_params
from retnet_jax.training.write_errors import CheckpointWriteError
from retnet_jax.training.integrity import DamagedCheckpointError

META = {"data_position": [3, 1024], "config": {"preset": "tiny", "lr": 3e-3, "files": []}, "note": None}


def make_mesh(shape):
  return jax.make_mesh(shape, ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


@pytest.fixture(scope="module")
def state():
  """Params, an AdamW state after one update (so its moments are non-zero), a step counter and rng key data."""
  params = nnx.state(Model(get_config("tiny").model, rngs=nnx.Rngs(0)), nnx.Param)
  tx = optax.adamw(1e-3)
  grads = jax.tree.map(lambda p: 0.1 * p + 0.01, params)
  updates, opt_state = tx.update(grads, tx.init(params), params)
  params = optax.apply_updates(params, updates)
  return {"params": params, "opt": opt_state, "step": jnp.int32(1),
          "rng": jax.random.key_data(jax.random.key(7))}


def abstract(tree, sharding_of=lambda leaf: leaf.sharding):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_of(x)), tree)


def assert_bitwise_equal(restored, expected):
  assert jax.tree.structure(restored) == jax.tree.structure(expected)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(expected)):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def step_dirs(directory):
  return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def test_arrays_that_read_back_other_values_are_refused(tmp_path, state):
  """Damage the storage layer cannot see (arrays that decode, but to other values: here another save's arrays
  under this checkpoint's meta) is refused by the checksums saved with the checkpoint."""
  other = jax.tree.map(lambda x: x + 1, state)
  for directory, tree in ((tmp_path / "a", state), (tmp_path / "b", other)):
    with Checkpointer(directory, async_save=False) as ckpt:
      ckpt.save(1, tree, META)
  shutil.rmtree(tmp_path / "a" / "1" / "state")
  shutil.copytree(tmp_path / "b" / "1" / "state", tmp_path / "a" / "1" / "state")
  with Checkpointer(tmp_path / "a", read_only=True) as ckpt:
    with pytest.raises(DamagedCheckpointError, match=r"checkpoint at .*1 is damaged: \d+ array\(s\) read back"):
      ckpt.restore(abstract(state), 1)
  with Checkpointer(tmp_path / "b", read_only=True) as ckpt:
    assert_bitwise_equal(ckpt.restore(abstract(state), 1)[0], other)


def test_round_trip_is_bitwise_equal(tmp_path, state):
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    assert ckpt.save(5, state, META, eval_loss=2.5)
    assert not ckpt.save(5, state, META)  # orbax's rule: a step not above the latest is skipped
    with pytest.raises(ValueError, match="already exists"):
      ckpt.save(5, state, META, force=True)
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.latest_step() == 5 and ckpt.all_steps() == [5]
    restored, meta = ckpt.restore(abstract(state))
    assert ckpt.restore_meta() == META
  assert meta == META
  assert_bitwise_equal(restored, state)


def test_arrays_are_read_as_written_then_cast_to_the_abstract_dtypes(tmp_path, state):
  """A changed train.optimizer_state_dtype (resume) or model.param_dtype (evaluation): the arrays are read in their
  stored dtypes, so their checksums hold, then cast to the abstract state's; bfloat16 arrays round-trip bitwise."""
  cast = lambda dtype: lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
  halved = {**state, "opt": jax.tree.map(cast(jnp.bfloat16), state["opt"])}
  widened = {**halved, "opt": jax.tree.map(cast(jnp.float32), halved["opt"])}
  with Checkpointer(tmp_path / "float32", async_save=False) as ckpt:
    ckpt.save(1, state, META)
    assert_bitwise_equal(ckpt.restore(abstract(halved), 1)[0], halved)
  with Checkpointer(tmp_path / "bfloat16", async_save=False) as ckpt:
    ckpt.save(1, halved, META)
    assert_bitwise_equal(ckpt.restore(abstract(halved), 1)[0], halved)
    assert_bitwise_equal(ckpt.restore(abstract(widened), 1)[0], widened)
  export_params(tmp_path / "export", state["params"])
  params = jax.tree.map(cast(jnp.bfloat16), state["params"])
  assert_bitwise_equal(load_params(tmp_path / "export", abstract(params)), params)


def test_keep_only_last_steps(tmp_path, state):
  with Checkpointer(tmp_path, keep=2, async_save=False) as ckpt:
    for step in range(1, 5):
      assert ckpt.save(step, state, {"step": step})
    assert ckpt.all_steps() == [3, 4]
  assert step_dirs(tmp_path) == [3, 4]


def test_keep_best_also_keeps_lowest_eval_loss_across_restarts(tmp_path, state):
  losses = {1: 5.0, 2: 1.0, 3: 4.0, 4: 3.0, 5: 2.0}
  with Checkpointer(tmp_path, keep=2, keep_best=True, async_save=False) as ckpt:
    for step, loss in losses.items():
      ckpt.save(step, state, {"step": step}, eval_loss=loss)
    assert ckpt.all_steps() == [2, 4, 5]
  with Checkpointer(tmp_path, keep=2, keep_best=True, async_save=False) as ckpt:
    ckpt.save(6, state, {"step": 6}, eval_loss=9.0)
    assert ckpt.all_steps() == [2, 5, 6]
    assert ckpt.restore_meta(2) == {"step": 2}
  assert step_dirs(tmp_path) == [2, 5, 6]


def test_async_save_then_wait_then_restore(tmp_path, state):
  with Checkpointer(tmp_path, keep=3, async_save=True) as ckpt:
    assert ckpt.save(1, state, {"step": 1})
    assert ckpt.latest_step() in (None, 1)  # a step still being written is not reported
    assert ckpt.save(2, state, {"step": 2})
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2]
    restored, meta = ckpt.restore(abstract(state))
  assert meta == {"step": 2}
  assert_bitwise_equal(restored, state)


@pytest.mark.parametrize("target", ["mesh_2x4", "single_device"])
def test_restore_onto_another_mesh(tmp_path, state, target):
  source = make_mesh((4, 2))
  sharded = jax.tree.map(
      lambda x: jax.device_put(x, NamedSharding(source, P("data", None) if x.ndim == 2 else P())), state)
  assert sharded["params"]["embed"]["embedding"][...].sharding.spec == P("data", None)
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, sharded, META)

  if target == "mesh_2x4":
    dest = make_mesh((2, 4))
    sharding_of = lambda x: NamedSharding(dest, P(None, "tensor") if x.ndim == 2 else P())
  else:
    sharding_of = lambda x: SingleDeviceSharding(jax.devices()[3])
  wanted = abstract(state, sharding_of)
  with Checkpointer(tmp_path) as ckpt:
    restored, _ = ckpt.restore(wanted)
  assert_bitwise_equal(restored, state)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(wanted)):
    assert got.sharding == want.sharding


def test_incompatible_model_config_is_a_clear_error(tmp_path, state):
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(3, state, META)
  cfg = get_config("tiny").model
  cfg.d_model = 64
  wider = nnx.state(nnx.eval_shape(lambda: Model(cfg, rngs=nnx.Rngs(0))), nnx.Param)
  target = abstract(state)
  target["params"] = abstract(wider, lambda x: SingleDeviceSharding(jax.devices()[0]))
  expected = (rf"checkpoint at {tmp_path}/3 does not fit the state this config builds: "
              r"key 'params/blocks/0/ffn/fc1/kernel/value' has shape \(32, 64\) in the checkpoint but \(64, 64\)")
  with Checkpointer(tmp_path) as ckpt, pytest.raises(ValueError, match=expected):
    ckpt.restore(target)


def damage_checksum(step_dir, prefix):
  """Changes the saved checksum of the first array whose key path starts with `prefix` (its arrays stay intact)."""
  meta_file = step_dir / "meta" / "metadata"
  meta = json.loads(meta_file.read_text())
  key = next(k for k in meta["checksums"] if k.startswith(prefix))
  meta["checksums"][key] += 1
  meta_file.write_text(json.dumps(meta))


def test_partial_restore_reads_and_verifies_that_part_only(tmp_path, state):
  """Restoring `{"params": ...}` of a full state reads and checks the params alone: the optimizer state's arrays and
  checksums are neither read nor verified (here its checksum disagrees, which a full restore refuses)."""
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, state, META)
  damage_checksum(tmp_path / "1", "['opt']")
  with Checkpointer(tmp_path, read_only=True) as ckpt:
    with pytest.raises(DamagedCheckpointError, match=r"1 array\(s\) read back differ .*first \['opt'\]"):
      ckpt.restore(abstract(state), 1)
    params, meta = ckpt.restore({"params": abstract(state["params"])}, 1, partial=True)
    assert meta == META
    assert_bitwise_equal(params["params"], state["params"])
  damage_checksum(tmp_path / "1", "['params']")
  with Checkpointer(tmp_path, read_only=True) as ckpt:
    with pytest.raises(DamagedCheckpointError, match=r"first \['params'\]"):
      ckpt.restore({"params": abstract(state["params"])}, 1, partial=True)


def test_a_step_set_aside_twice_keeps_both_copies(tmp_path, state):
  """The same step can turn out unreadable again after it was rewritten: each copy is kept under its own name."""
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(2, state, META)
    assert ckpt.set_aside(2) == f"{tmp_path}/2.corrupt"
    ckpt.save(2, state, META)
    assert ckpt.set_aside(2) == f"{tmp_path}/2.corrupt.1"
    assert ckpt.all_steps() == []
  assert sorted(os.listdir(tmp_path)) == ["2.corrupt", "2.corrupt.1"]


@pytest.mark.optimized
def test_checksums_keep_their_formula_and_sum_in_blocks():
  """The checksum of checkpoints saved before blockwise summing (a uint32 sum of bit patterns times odd position
  weights) is unchanged, and its temporaries are one block's, not the array's."""
  x = jax.random.normal(jax.random.key(0), (integrity.CHECKSUM_BLOCK * 2 + 5,))
  bits = np.asarray(x).view(np.uint32).astype(np.uint64)
  weights = ((2 * np.arange(bits.size, dtype=np.uint64) + 1) * 2654435761) % 2**32
  assert int(integrity.checksum(x)) == int(np.sum(bits * weights) % 2**32)
  big = jax.ShapeDtypeStruct((8192, 2048), jnp.float32)  # 64 MiB
  assert integrity.checksum.lower(big).compile().memory_analysis().temp_size_in_bytes < 8 * 2**20


def test_missing_step_and_empty_directory(tmp_path, state):
  empty = tmp_path / "empty"
  with Checkpointer(empty) as ckpt:
    assert ckpt.latest_step() is None and ckpt.all_steps() == []
    with pytest.raises(FileNotFoundError, match=str(empty)):
      ckpt.restore(abstract(state))
    with pytest.raises(FileNotFoundError, match=str(empty)):
      ckpt.restore_meta(4)
  with Checkpointer(tmp_path / "full", async_save=False) as ckpt:
    ckpt.save(2, state, META)
    ckpt.save(4, state, META)
    with pytest.raises(ValueError, match=r"step 3 .*available steps: \[2, 4\]"):
      ckpt.restore(abstract(state), step=3)


def test_a_reader_lists_again_when_a_step_vanishes_while_listed(tmp_path, state, monkeypatch):
  """A training run deletes its oldest step (retention) while a reader's orbax reads each listed step's metadata:
  the reader lists again and sees the steps left, when opened and on reload (it used to fail with
  FileNotFoundError naming the step folder)."""
  from orbax.checkpoint._src.metadata import checkpoint as orbax_metadata
  with Checkpointer(tmp_path, keep=3, async_save=False) as ckpt:
    for step in (1, 2):
      ckpt.save(step, state, {"step": step})
  read, victims, deleted = orbax_metadata._MetadataStoreImpl.read, ["1"], []

  def read_as_the_writer_deletes(self, file_path):
    step_dir = Path(file_path).parent
    if step_dir.name in victims and step_dir.exists():
      shutil.rmtree(step_dir)  # as the writer's retention policy does, between orbax's listing and its read
      deleted.append(step_dir.name)
    return read(self, file_path)

  monkeypatch.setattr(orbax_metadata._MetadataStoreImpl, "read", read_as_the_writer_deletes)
  with Checkpointer(tmp_path, read_only=True) as reader:
    assert deleted == ["1"] and reader.all_steps() == [2]
    with Checkpointer(tmp_path, keep=3, async_save=False) as writer:
      writer.save(3, state, {"step": 3})
    victims.append("2")
    reader.reload()
    assert deleted == ["1", "2"] and reader.all_steps() == [3]
    assert reader.restore_meta() == {"step": 3}


def test_uncommitted_temporary_directory_is_not_latest(tmp_path, state):
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(2, state, {"step": 2})
  crashed = tmp_path / "9.orbax-checkpoint-tmp-1700000000000000"  # how orbax names a step folder mid-write
  (crashed / "state").mkdir(parents=True)
  (crashed / "state" / "partial").write_bytes(b"\0" * 16)
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    assert ckpt.latest_step() == 2 and ckpt.all_steps() == [2]
    assert ckpt.restore_meta() == {"step": 2}
    ckpt.save(3, state, {"step": 3})
    assert ckpt.latest_step() == 3
  assert not crashed.exists()  # cleaned up before the next save


def test_export_and_load_params(tmp_path, state):
  mesh = make_mesh((2, 4))
  wanted = abstract(state["params"], lambda x: NamedSharding(mesh, P("data", "tensor") if x.ndim == 2 else P()))
  export_params(tmp_path / "export", state["params"])
  params = load_params(tmp_path / "export", wanted)
  assert_bitwise_equal(params, state["params"])
  assert all(got.sharding == want.sharding for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(wanted)))
  with pytest.raises(FileNotFoundError, match="No exported params"):
    load_params(tmp_path / "nothing", wanted)
  export_params(tmp_path / "other", jax.tree.map(lambda x: x + 1, state["params"]))
  shutil.copy(tmp_path / "export" / "checksums.json", tmp_path / "other" / "checksums.json")  # other values
  with pytest.raises(DamagedCheckpointError, match=r"params export at .*other is damaged"):
    load_params(tmp_path / "other", wanted)


def test_orbax_logs_only_warnings(tmp_path, state, caplog):
  verbosity = absl.logging.get_verbosity()
  absl.logging.set_verbosity(absl.logging.DEBUG)
  try:
    with caplog.at_level(logging.DEBUG, logger="absl"), Checkpointer(tmp_path, async_save=False) as ckpt:
      ckpt.save(1, state, META)
      ckpt.restore(abstract(state))
  finally:
    absl.logging.set_verbosity(verbosity)
  assert not [r for r in caplog.records if f"{os.sep}orbax{os.sep}" in r.pathname and r.levelno < logging.WARNING]


def test_a_save_on_a_full_disk_is_one_error_naming_the_step(tmp_path, state, monkeypatch):
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, state, META)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 10, 10))
    with pytest.raises(CheckpointWriteError, match=r"could not write checkpoint 2 in .*: No space left on device: "
                                                   r"0.0 MiB free, the checkpoint needs up to [0-9.]+ MiB") as error:
      ckpt.save(2, state, META)
    assert error.value.errno == errno.ENOSPC and error.value.step == 2
    with pytest.raises(CheckpointWriteError):  # reported again to any later write, not at close
      ckpt.save(3, state, META)
    assert ckpt.all_steps() == [1]
  # TensorStore reports the errno inside its message.
  tensorstore_error = ValueError("RESOURCE_EXHAUSTED: Error writing local file \"x\": Failed to write 25135 bytes to "
                                 "file 16: No space left on device [os_error_code='28']")
  assert CheckpointWriteError(4, "d", tensorstore_error).errno == errno.ENOSPC


def test_an_export_to_a_full_disk_names_the_folder_and_leaves_nothing(tmp_path, monkeypatch):
  def full(self, directory, *args, **kwargs):
    os.makedirs(directory)  # what it wrote before the disk filled
    raise ValueError("RESOURCE_EXHAUSTED: Error writing local file \"x\": No space left on device "
                     "[os_error_code='28'] tensorstore_spec='{\"_sharding\": ...}'")

  monkeypatch.setattr(checkpointing.ocp.StandardCheckpointer, "save", full)
  message = rf"could not export the parameters to {tmp_path / 'params'}: No space left on device$"
  with pytest.raises(write_errors.ExportWriteError, match=message) as error:
    export_params(tmp_path / "params", {"w": jnp.ones(3)})
  assert error.value.errno == errno.ENOSPC and not (tmp_path / "params").exists()


def test_late_tensorstore_callbacks_into_a_closed_event_loop_print_nothing(tmp_path, capfd, caplog):
  """Orbax closes its event loop when a save fails; TensorStore writes still pending then call into it and would
  each print a traceback."""
  import tensorstore as ts  # pylint: disable=import-outside-toplevel
  with Checkpointer(tmp_path / "ckpt"):  # installs the filter
    pass
  array = ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": str(tmp_path / "array")}}, create=True,
                  dtype=ts.float32, shape=[4_000_000]).result()
  loop = asyncio.new_event_loop()
  waiting = loop.create_task(_awaited(array.write(np.ones(4_000_000, np.float32))))
  loop.run_until_complete(asyncio.sleep(0))  # TensorStore now holds a callback into the loop
  loop.close()  # the write is still in flight
  time.sleep(1)
  assert "Event loop is closed" not in capfd.readouterr().err
  with caplog.at_level(logging.CRITICAL, logger="asyncio"):  # asyncio's note on the task left pending
    del waiting
    gc.collect()


async def _awaited(future):
  await future


def test_a_directory_deleted_and_recreated_in_its_place_has_vanished(tmp_path):
  """A save in flight recreates a deleted checkpoints/ folder, where a freed inode number can come back: the writer
  still sees that its folder is gone (it was taken for a failing disk, quoting orbax)."""
  directory = tmp_path / "checkpoints"
  with Checkpointer(directory, async_save=False) as ckpt:
    assert not ckpt.vanished()
    for _ in range(3):  # inode numbers are reused at once on some file systems
      shutil.rmtree(directory)
      directory.mkdir()
      assert ckpt.vanished()
    shutil.rmtree(directory)
    assert ckpt.vanished()
    directory.mkdir()  # for close


def test_a_failed_write_future_nobody_retrieved_prints_nothing(tmp_path, caplog):
  """asyncio reports a future's error that nobody retrieved at garbage collection; a TensorStore error carries no
  traceback, so the report was one bare line ('ValueError: NOT_FOUND: ...') after a run's own error line."""
  with Checkpointer(tmp_path / "ckpt"):  # installs the filter
    pass

  async def fail_unretrieved():
    asyncio.get_running_loop().create_future().set_exception(ValueError("NOT_FOUND: Error opening \"zarr\" driver"))

  with caplog.at_level(logging.ERROR, logger="asyncio"):
    asyncio.run(fail_unretrieved())
    gc.collect()
  assert "NOT_FOUND" not in caplog.text


def test_orbax_tasks_a_failed_write_leaves_pending_print_nothing(tmp_path, caplog):
  """A failed write closes orbax's event loop with its sibling writes still pending, never started; asyncio's
  note on each task and Python's warning about each coroutine came at exit, after the run's own error line.
  Others' tasks and coroutines are still reported."""
  from orbax.checkpoint._src.serialization import serialization  # pylint: disable=import-outside-toplevel
  with Checkpointer(tmp_path / "ckpt"):  # installs the filters
    pass

  async def ours():
    pass

  loop = asyncio.new_event_loop()
  tasks = [loop.create_task(serialization.async_serialize_from_host(None, {})), loop.create_task(ours())]
  loop.close()
  with caplog.at_level(logging.ERROR, logger="asyncio"), warnings.catch_warnings(record=True) as caught:
    del tasks
    gc.collect()
  assert caplog.text.count("Task was destroyed but it is pending") == 1 and "ours()" in caplog.text
  assert [str(w.message) for w in caught] == [f"coroutine '{ours.__qualname__}' was never awaited"]
