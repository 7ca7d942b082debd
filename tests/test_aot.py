"""Compiling for GPUs and TPUs without them (retnet_jax.planning.aot, scripts/aot_compile.py): the tiny preset's steps
for an H100 (with the Pallas kernels) and a TPU, a compiler out-of-memory as a result, the targets' names and bad input.
Compiles need the aot extra (pip install -e '.[aot]'); without it those tests are skipped, naming it."""

import json
import re

import jax
import jax.numpy as jnp
import pytest

from benchmarks import cases
from retnet_jax.hardware import accelerators, flops
from retnet_jax.mixers.kernels import support
from retnet_jax.models import model_config, presets
from retnet_jax.nn import layer_stack
from retnet_jax.planning import aot
from tests.helpers import aot_extra_missing, run_script

pytestmark = pytest.mark.optimized

needs_gpu = pytest.mark.skipif(aot_extra_missing("gpu") is not None, reason=str(aot_extra_missing("gpu")))
needs_tpu = pytest.mark.skipif(aot_extra_missing("tpu") is not None, reason=str(aot_extra_missing("tpu")))


def tiny(**fields):
  """The tiny preset with `section.field` values changed (one layer: fast compiles)."""
  config = presets.get_config("tiny")
  config.model.num_layers = 1
  for name, value in fields.items():
    section, field = name.split("__")
    config[section][field] = value
  return config


@needs_gpu
def test_h100_train_step_calls_the_pallas_kernels():
  config = tiny(model__retention_impl="pallas", train__mode="chunkwise", model__chunk_size=16)
  report = aot.plan(config, accelerators.parse_target("h100:1"), ("train",))
  step = report["steps"]["train"]
  assert report["device_kind"] == "NVIDIA H100 80GB HBM3" and report["fits"] and step["fits"]
  # one layer, split kernels: the state and output passes forward; backward the state pass again, the state
  # gradient's reverse pass, dv, and dq/dk
  assert step["pallas_kernel_calls"] == 6
  assert step["collectives"] == {}  # one device
  assert step["required_bytes_per_device"] == (step["argument_bytes"] + step["output_bytes"] - step["aliased_bytes"]
                                               + step["temporary_bytes"] + step["generated_code_bytes"])
  assert step["aliased_bytes"] > 0  # the donated state
  model = flops.train_flops_per_token(model_config.of(config.model), 64, "chunkwise") * 8 * 64
  assert step["model_flops_per_device"] == model
  # XLA's count of the program before optimization, without the kernels' custom calls: below the model's.
  assert step["xla_flops_source"] == "lowered" and 0.3 * model < step["xla_flops_per_device"] < model
  assert step["step_seconds_lower_bound"] >= model / accelerators.CHIPS["h100"].peak_bf16_flops


@needs_gpu
def test_a_plan_reports_the_float32_operand_share_of_each_step():
  """The jaxpr's matmul FLOPs by operand dtypes, per step: none with a float32 operand in bfloat16, all in float32."""
  shares = {}
  for dtype in ("bfloat16", "float32"):
    report = aot.plan(tiny(model__dtype=dtype), accelerators.parse_target("h100:1"), ("train", "eval"))
    shares[dtype] = {name: step["float32_matmul_share"] for name, step in report["steps"].items()}
    assert all(sum(step["matmul_flops_by_dtype"].values()) > 0 for step in report["steps"].values())
  assert shares == {"bfloat16": {"train": 0.0, "eval": 0.0}, "float32": {"train": 1.0, "eval": 1.0}}
  assert "| f32-operand matmuls |" in aot.format_table(report) and "| 100.0% |" in aot.format_table(report)


@needs_gpu
def test_the_13b_preset_trains_batch_32_on_one_h100():
  """docs/aot.md's memory table: with the preset's defaults (scanned layers, loss tiles of 8192 tokens), 32 x 2048
  tokens with `remat=full` in at most 85% of an H100 and at most 20 GB of temporaries (86.3 GiB unrolled before), all
  matmuls on bfloat16 operands."""
  config = presets.get_config("1.3b")
  config.train.update(dict(batch_size=32, remat="full"))
  step = aot.plan(config, accelerators.parse_target("h100:1"), ("train",))["steps"]["train"]
  assert step["fits"] and step["required_bytes_per_device"] <= 0.85 * step["device_memory_bytes"], step
  assert step["temporary_bytes"] <= 20e9 and step["float32_matmul_share"] <= 0.02, step


@needs_gpu
def test_scanned_layers_compile_one_block_with_the_kernels():
  """Two layers under nnx.scan: the kernels appear once, in the scanned body, and the memory is the unrolled
  step's (the same buffers, stacked)."""
  fields = dict(model__retention_impl="pallas", train__mode="chunkwise", model__chunk_size=16, model__num_layers=2)
  steps = {scan: aot.plan(tiny(model__scan_layers=scan, **fields), accelerators.parse_target("h100:1"),
                          ("train",))["steps"]["train"] for scan in (False, True)}
  assert steps[False]["pallas_kernel_calls"] == 12 and steps[True]["pallas_kernel_calls"] == 6  # split: 6 a layer
  assert steps[True]["fits"] and steps[True]["argument_bytes"] == steps[False]["argument_bytes"]


@needs_gpu
def test_a_hybrid_compiles_its_train_step_and_decoding_for_an_h100():
  """A hybrid (layer 1 of 2 attends over a window of 16 tokens) compiles for an H100 with the kernels in its
  retention layer only; its decoding's model FLOPs read the window's 16 cached tokens."""
  config = tiny(model__num_layers=2, model__attention_layers=(1,), model__attention_window=16,
                model__retention_impl="pallas", train__mode="chunkwise", model__chunk_size=16)
  report = aot.plan(config, accelerators.parse_target("h100:1"), ("train", "decode"))
  train, decode = report["steps"]["train"], report["steps"]["decode"]
  assert report["fits"] and train["pallas_kernel_calls"] == 6  # one retention layer: the split kernels' 2 + 4
  per_token = flops.forward_flops_per_token(model_config.of(config.model), 16, "recurrent")
  assert decode["model_flops_per_device"] == per_token * config.train.batch_size * aot.DECODE_TOKENS


@needs_tpu
def test_tpu_train_and_decode_steps_with_their_collectives():
  config = tiny()
  report = aot.plan(config, accelerators.parse_target("v5e-4"), ("train", "decode"))
  train, decode = report["steps"]["train"], report["steps"]["decode"]
  assert report["mesh"] == {"data": 4, "fsdp": 1, "tensor": 1, "sequence": 1} and report["fits"]
  # Data parallel: the gradients (float32) are summed over the 4 chips, in one all-reduce or a few.
  assert train["collectives"]["all-reduce"]["bytes"] >= 4 * cases.param_count(config.model)
  assert train["xla_flops_source"] == "compiled" and train["pallas_kernel_calls"] == 0
  per_device = flops.train_flops_per_token(model_config.of(config.model), 64, "parallel") * 8 * 64 / 4
  assert 0.5 * per_device < train["xla_flops_per_device"] < 2 * per_device
  assert train["argument_bytes"] >= 3 * 4 * cases.param_count(config.model)  # parameters and Adam's two moments
  assert decode["fits"] and decode["compile_seconds"] > 0


@needs_tpu
def test_several_slices_reduce_over_the_network_last():
  report = aot.plan(tiny(), accelerators.parse_target("v5e-4", slices=2), ("train",))
  collectives = report["steps"]["train"]["collectives"]
  assert (report["devices"], report["slices"], report["mesh"]["data"]) == (8, 2, 8) and report["fits"]
  assert {"reduce-scatter", "all-reduce", "all-gather"} <= set(collectives)  # within a slice, across, within
  with pytest.raises(ValueError, match=r"no axis of mesh.shape=\(2, 2, 1, 1\) splits over the 4 slices"):
    aot.check_request(tiny(mesh__shape=(2, 2, 1, 1)), accelerators.parse_target("v5e-1", slices=4), ("train",))


@needs_tpu
def test_compiler_out_of_memory_is_a_result():
  config = tiny(train__batch_size=4096, train__seq_len=2048)
  step = aot.plan(config, accelerators.parse_target("v5e-1"), ("train",))["steps"]["train"]
  assert not step["fits"] and "RESOURCE_EXHAUSTED" in step["error"]
  assert step["required_bytes_per_device"] > accelerators.CHIPS["v5e"].memory_bytes * 0.9


def test_kernels_are_judged_against_the_target_platform():
  native = jax.default_backend()
  assert support.default_backend() == native
  with support.target_backend("gpu"):
    assert support.is_supported(64, 64, jnp.bfloat16, 64) and not support.resolve_interpret(None)
    with support.target_backend("cpu"):
      assert support.resolve_interpret(None)
      with pytest.raises(ValueError, match="compile for GPUs only .* the backend is 'cpu'"):
        support.check_supported(64, 64, jnp.bfloat16, 64)
    assert support.default_backend() == "gpu"
  assert support.default_backend() == native


@pytest.mark.parametrize("name,topology,devices", [
    ("h100:8", "1x1x8", 8), ("a100:2", "1x1x2", 2), ("v4-8", "2x2x1", 4), ("v5p-16", "2x2x2", 8),
    ("v5p-128", "4x4x4", 64), ("v5e-1", "1x1", 1), ("v5e-16", "4x4", 16), ("v6e-8", "2x4", 8)])
def test_target_names_follow_the_clouds(name, topology, devices):
  target = accelerators.parse_target(name)
  assert (target.topology, target.num_devices) == (topology, devices)


@needs_gpu
@needs_tpu
def test_each_chip_is_the_device_xla_describes():
  for name in ("h100:1", "h200:1", "a100:1", "v4-8", "v5e-1", "v5p-8", "v6e-1"):
    target = accelerators.parse_target(name)
    kind = accelerators.devices(target)[0].device_kind
    assert kind == target.chip.device_kind and accelerators.chip_of(kind) is target.chip
  assert accelerators.chip_of("cpu") is None


def test_gpu_target_description_names_the_chip():
  text = accelerators.gpu_target_config(accelerators.CHIPS["a100"])
  assert "core_count: 108" in text and "cuda_compute_capability: { major: 8 }" in text
  assert 'device_description_str: "NVIDIA A100-SXM4-80GB"' in text


def test_collectives_are_counted_with_their_bytes():
  hlo = ("  %all-reduce.1 = (f32[]{:T(128)}, bf16[4,8]{1,0:T(8,128)}) all-reduce(%a, %b), replica_groups={}\n"
         "  %ag = (f32[2]{0}, f32[8]{0}) all-gather-start(%c), dimensions={0}\n"
         "  %agd = f32[8]{0} all-gather-done(%ag)\n"
         "  ROOT %cp = s32[3]{0} collective-permute(%d), source_target_pairs={{0,1}}\n")
  assert aot.collectives(hlo) == {"all-reduce": {"count": 1, "bytes": 4 + 64}, "all-gather": {"count": 1, "bytes": 32},
                                  "collective-permute": {"count": 1, "bytes": 12}}


def test_out_of_memory_messages_give_the_bytes_needed():
  assert aot._bytes_needed("RESOURCE_EXHAUSTED: the total memory required for HLO temporaries (69.54G) exceeds "
                           "available HBM (15.75G).") == int(69.54 * 2**30)
  assert aot._bytes_needed("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 20.5G of 15.75G hbm."
                           ) == int(20.5 * 2**30)
  assert aot._bytes_needed("RESOURCE_EXHAUSTED: something else") is None


@pytest.mark.parametrize("name,message", [
    ("h100-8", r"unknown --target='h100-8'; choose one of h100:N, h200:N, a100:N, v4-N, v5e-N, v5p-N, v6e-N"),
    ("v5e-2", r"no v5e slice of that size; Cloud TPU's v5e-N has N in 1, 4, 8"),
    ("v5p-4", r"v5p-N has N in 8, 16, 32, ... \(TensorCores, 2 per chip\)"),
    ("h100:0", r"0 GPUs per host; give 1 to 16")])
def test_bad_targets_are_named(name, message):
  with pytest.raises(ValueError, match=message):
    accelerators.parse_target(name)


def test_a_missing_extra_names_the_pip_command(monkeypatch):
  monkeypatch.setattr(accelerators, "_find_spec", lambda module: None)
  with pytest.raises(ValueError, match=re.escape("needs libtpu, from the aot extra: pip install -e '.[aot]'")):
    aot.check_request(tiny(), accelerators.parse_target("v5e-4"), ("train",))


@needs_gpu
@needs_tpu
@pytest.mark.parametrize("target,fields,message", [
    ("h100:8", {"mesh__shape": (3, 1, 1, 1)}, r"--target=h100:8 has 8 devices: mesh.shape=\(3, 1, 1, 1\) needs 3"),
    ("h100:8", {"mesh__shape": (-1, 3, 1, 1)}, r"--target=h100:8 has 8 devices: .*cannot be split"),
    ("h100:1", {"model__retention_impl": "pallas", "model__chunk_size": 8},
     r"chunk_size 8 is not one of the split kernels'"),
    ("v5e-4", {"model__retention_impl": "pallas", "model__chunk_size": 16}, r"compile for GPUs only .* 'tpu'"),
    ("v5e-4", {"train__batch_size": 6}, r"micro-batch of 6 sequences .* not divisible by the 4 data shards"),
    # training's own checks, as train.py makes them (aot_compile.py accepted loss_tile=-5)
    ("h100:1", {"train__loss_tile": -5}, r"^train\.loss_tile must be 0 \(the loss over all tokens at once\) or a "
                                         r"positive number of tokens per tile; got -5\.$"),
    ("h100:1", {"train__steps": 0}, r"^train\.steps must be a positive integer; got 0\.$")])
def test_bad_requests_fail_before_compiling(target, fields, message):
  with pytest.raises(ValueError, match=message):
    aot.check_request(tiny(**fields), accelerators.parse_target(target), ("train",))
  with pytest.raises(ValueError, match="choose steps among train,eval,prefill,decode"):
    aot.check_request(tiny(), accelerators.parse_target("v5e-4"), ("train", "backward"))


@needs_gpu
def test_a_kv_cache_shorter_than_the_planned_context_is_refused_before_compiling():
  """The prefill step reads prompts of train.seq_len + 1 tokens and decode adds DECODE_TOKENS more: a Transformer's
  KV cache shorter than that failed deep in the trace with a dynamic_update_slice shape error."""
  config = presets.get_config("tiny", "transformer")
  config.model.update(num_layers=1, max_len=64)
  config.train.seq_len = 64
  target = accelerators.parse_target("h100:1")
  aot.check_request(config, target, ("train", "eval", "prefill"))  # 64 prompt tokens but the last: 64 slots
  needed = 64 + aot.DECODE_TOKENS
  with pytest.raises(ValueError, match=rf"need a KV cache of {needed} tokens, but model.max_len=64; raise "
                                       rf"model.max_len \(--config.model.max_len={needed}\)"):
    aot.check_request(config, target, ("decode",))
  config.model.max_len = needed
  aot.check_request(config, target, ("prefill", "decode"))
  config.train.seq_len = needed + 1
  with pytest.raises(ValueError, match=rf"need a KV cache of {needed + 1} tokens, but model.max_len={needed}"):
    aot.check_request(config, target, ("prefill",))


@pytest.mark.slow
@needs_tpu
def test_search_finds_the_largest_batch_per_remat_policy():
  found = aot.search(tiny(), accelerators.parse_target("v5e-1"), max_batch=2)
  assert found["largest_batch_per_remat"] == {name: 2 for name in ("none", *layer_stack.REMAT_POLICIES)}
  assert found["largest_batch"] == 2 and len(found["attempts"]) == 7  # 8 (the config's) capped at max_batch=2
  assert found["lightest_remat_at_largest_batch"] == "none"  # keeps everything: no recomputation


@pytest.mark.slow
@needs_tpu
def test_script_prints_the_report_last_and_writes_it(tmp_path):
  result = run_script("aot_compile.py", "--config=configs/retnet.py:tiny", "--target=v5e-1", "--steps=eval",
                      f"--out={tmp_path}", "--config.model.num_layers=1")
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(result.stdout.strip().splitlines()[-1])
  assert report["steps"]["eval"]["fits"] and report["config"] == "configs/retnet.py:tiny"
  assert json.loads((tmp_path / "report.json").read_text())["target"] == "v5e-1"
  assert "| eval | yes |" in (tmp_path / "report.md").read_text()
  bad = run_script("aot_compile.py", "--target=v9-8", f"--out={tmp_path}")
  assert bad.returncode == 1 and "Traceback" not in bad.stderr
  assert "error: unknown --target='v9-8'; choose one of" in bad.stderr


def test_a_users_report_in_out_is_kept_and_refused_before_compiling(tmp_path):
  """aot_compile.py --out wrote over a user's report.md and report.json: --out is owned, checked before any work."""
  for name in ("report.md", "report.json"):
    (tmp_path / name).write_bytes(b"the user's")
  result = run_script("aot_compile.py", "--config=configs/retnet.py:tiny", "--target=v5e-1", "--steps=eval",
                      f"--out={tmp_path}")
  assert result.returncode == 1 and "Traceback" not in result.stderr
  assert re.search(r"^error: --out='.*' holds 'report.json', 'report.md', which this project did not write",
                   result.stderr, flags=re.MULTILINE), result.stderr[-2000:]
  assert all((tmp_path / name).read_bytes() == b"the user's" for name in ("report.md", "report.json"))
