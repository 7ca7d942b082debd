"""Conversion of flash-linear-attention's (fla 0.6.0) RetNet: logits against fla's own model in each form and across
a prefill hand-off, the round trip, refused options, bad input, the script.

Needs the `fla` extra (`pip install -e '.[fla]'`: torch, fla, transformers and triton, which fla imports); skipped
without it. fla's Triton kernels do not run on a CPU: the `fla_reference` fixture puts fla's own pure-PyTorch
reference functions in their place (naive retention in its chunk, recurrent and parallel forms, the rotary, RMSNorm
and gated-RMSNorm references, SwiGLU), so the reference is fla's modeling code around its reference math.
"""

import json
import re
import shlex

import jax
import numpy as np
import pytest
import tokenizers
from flax import nnx, traverse_util
from safetensors.numpy import load_file, save_file

from configs import retnet as retnet_config
from retnet_jax.core import owned_folders, sharding
from retnet_jax.input_pipeline.tokenizer import ByteTokenizer
from retnet_jax.interop import convert, convert_fla, export_fla, safetensors_folder
from retnet_jax.models import presets
from retnet_jax.models.model import Model
from tests.helpers import forward, random_tokens, run_script

torch = pytest.importorskip("torch")
fla_models = pytest.importorskip("fla.models")  # fla imports triton, which installs but does not run here
import fla.layers.attn as fla_attn  # noqa: E402
import fla.modules.mlp as fla_mlp  # noqa: E402
import fla.modules.norm.fused_norm_gate as fla_norm_gate  # noqa: E402
import fla.modules.norm.layernorm as fla_layernorm  # noqa: E402
import fla.modules.rotary.ops as fla_rotary  # noqa: E402
import fla.ops.retention.chunk as fla_chunk  # noqa: E402
import fla.ops.retention.fused_recurrent as fla_recurrent  # noqa: E402
import fla.ops.retention.parallel as fla_parallel  # noqa: E402
from fla.modules.norm.layernorm_gated import rms_norm_ref as gated_rms_norm_ref  # noqa: E402
from fla.ops.simple_gla.naive import (naive_chunk_simple_gla, naive_parallel_simple_gla,  # noqa: E402
                                      naive_recurrent_simple_gla)

MODES = ("parallel", "chunkwise", "recurrent")
FLA_KERNELS = {"parallel": "parallel", "chunkwise": "chunk", "recurrent": "fused_recurrent"}  # ours -> fla's
# Random tiny fla configs: untied head with fla's fused norm-and-gate; tied head, two key/value heads for four query
# heads, unfused norms and another epsilon; one key/value head for four and no per-head norm scale. Each with the
# forms of our prefill and continuation in the hand-off test.
CONFIGS = {
    "untied": (dict(hidden_size=32, num_hidden_layers=2, num_heads=2, vocab_size=61, intermediate_size=48),
               ("chunkwise", "recurrent")),
    "tied_shared_kv": (dict(hidden_size=48, num_hidden_layers=1, num_heads=4, num_kv_heads=2, expand_v=1.5,
                            hidden_ratio=3, vocab_size=53, tie_word_embeddings=True, fuse_norm=False, norm_eps=1e-5),
                       ("parallel", "chunkwise")),
    "one_kv_head_no_scale": (dict(hidden_size=32, num_hidden_layers=1, num_heads=4, num_kv_heads=1, vocab_size=40,
                                  intermediate_size=40, elementwise_affine=False), ("recurrent", "parallel")),
    # Hybrids: attention in layer 1 of 2 over a window of 24 tokens (past the hand-off's split and LENGTH's
    # reach), with grouped key/value heads and its own rotary base; attention over everything in layer 0 of 2.
    "hybrid_window": (dict(hidden_size=32, num_hidden_layers=2, num_heads=2, vocab_size=61, intermediate_size=48,
                           attn={"layers": [1], "num_heads": 4, "num_kv_heads": 2, "window_size": 24,
                                 "rope_theta": 500.0}), ("chunkwise", "recurrent")),
    "hybrid_full": (dict(hidden_size=32, num_hidden_layers=2, num_heads=2, vocab_size=61, tie_word_embeddings=True,
                         attn=[{"layers": [0], "num_heads": 2}]), ("parallel", "chunkwise")),
}
LENGTH = 70  # past 64, so that fla runs its chunk or parallel form rather than the recurrent one


def _per_step(g_gamma, q):
  return g_gamma.view(1, 1, -1).expand(q.shape[0], q.shape[1], -1)


def _rotary_ref(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                chunk_indices=None):
  assert cu_seqlens is None and isinstance(seqlen_offsets, int)
  rows = slice(seqlen_offsets, seqlen_offsets + x.shape[1])
  return fla_rotary.rotary_embedding_ref(x, cos[rows], sin[rows], interleaved)


def _flash_attn_ref(q, k, v, causal=True, window_size=(-1, -1), **_):
  """flash-attn's flash_attn_func (which fla's Attention calls; it needs a GPU) in plain PyTorch: query i of L sees
  the keys up to i + S - L of S (causal, aligned to the last key), the last window_size[0] + 1 of them if >= 0, each
  group of query heads one key/value head."""
  assert causal
  group = q.shape[2] // k.shape[2]
  k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
  scores = torch.einsum("blhd,bshd->bhls", q.float(), k.float()) * q.shape[-1]**-0.5
  query = torch.arange(q.shape[1])[:, None] + k.shape[1] - q.shape[1]
  key = torch.arange(k.shape[1])[None]
  visible = (key <= query) & ((key >= query - window_size[0]) if window_size[0] >= 0 else True)
  probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
  return torch.einsum("bhls,bshd->blhd", probs, v.float()).to(q.dtype)


def _weight(weight, x):
  return torch.ones(x.shape[-1]) if weight is None else weight


@pytest.fixture(scope="module", autouse=True)
def fla_reference():
  """fla's reference functions in place of its Triton kernels, where fla's modules call them."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(fla_chunk, "chunk_simple_gla", lambda q, k, v, scale, g_gamma, initial_state, output_final_state,
                  cu_seqlens, chunk_size: naive_chunk_simple_gla(q, k, v, _per_step(g_gamma, q), initial_state,
                                                                 output_final_state, chunk_size or 64, scale))
    patch.setattr(fla_recurrent, "fused_recurrent_simple_gla", lambda q, k, v, g_gamma, scale, initial_state,
                  output_final_state, reverse, cu_seqlens, state_v_first: naive_recurrent_simple_gla(
                      q, k, v, _per_step(g_gamma, q), scale, initial_state, output_final_state))
    patch.setattr(fla_parallel, "parallel_simple_gla", lambda q, k, v, scale, g, output_attentions, cu_seqlens: (
        naive_parallel_simple_gla(q, k, v, g, scale)[0], None))
    patch.setattr(fla_rotary, "rotary_embedding", _rotary_ref)
    patch.setattr(fla_layernorm, "rms_norm", lambda x, weight, bias, residual=None, eps=1e-6, prenorm=False,
                  residual_in_fp32=False: fla_layernorm.rms_norm_ref(x, _weight(weight, x), bias, residual, eps,
                                                                     prenorm))
    patch.setattr(fla_norm_gate, "rms_norm_gated", lambda x, g, weight, bias, activation, residual, prenorm,
                  residual_in_fp32, eps: gated_rms_norm_ref(x, _weight(weight, x), bias, g, eps))
    patch.setattr(fla_mlp, "swiglu_linear", lambda x, y, weight, bias: torch.nn.functional.linear(
        torch.nn.functional.silu(x) * y, weight, bias))
    patch.setattr(fla_mlp, "swiglu", lambda x, y: torch.nn.functional.silu(x) * y)
    patch.setattr(fla_attn, "flash_attn_func", _flash_attn_ref)
    yield


def fla_model(options, seed=0):
  """fla's RetNetForCausalLM in eval mode with random weights: matrices ~ N(0, 1/fan_in), norm weights 1 + noise."""
  torch.manual_seed(seed)
  model = fla_models.RetNetForCausalLM(fla_models.RetNetConfig(**options))
  with torch.no_grad():
    for param in model.parameters():
      param.copy_(1 + 0.3 * torch.randn_like(param) if param.ndim == 1 else
                  torch.randn_like(param) / param.shape[-1]**0.5)
  return model.eval()


def fla_logits(model, tokens, kernel="chunk", past=None):
  """fla's logits from its `kernel` form (with no gradient and at most 64 tokens it always runs fused_recurrent),
  and its cache."""
  for layer in model.model.layers:
    layer.attn.mode = kernel
  with torch.no_grad():
    out = model(torch.as_tensor(tokens), past_key_values=past, use_cache=True)
  return out.logits.numpy(), out.past_key_values


def relative_error(ours, theirs):
  theirs = np.asarray(theirs, np.float64)
  return float(np.max(np.abs(np.asarray(ours, np.float64) - theirs)) / np.max(np.abs(theirs)))


def saved_fla(tmp_path, options, seed=0):
  """An fla model and the folder its save_pretrained wrote."""
  model = fla_model(options, seed)
  model.save_pretrained(tmp_path / "fla")
  return model, tmp_path / "fla"


def with_chunk_size(model, config, chunk_size):
  """`model` with the chunkwise form's chunk length set to `chunk_size` (the fla preset's 256 exceeds LENGTH)."""
  config.model.chunk_size = chunk_size
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: Model(config.model, rngs=nnx.Rngs(0))))
  return nnx.merge(graphdef, nnx.state(model))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_fla_in_each_form_and_across_a_handoff(tmp_path, name):
  """Each of our forms gives the logits of fla's matching form, and a prefill in one of our forms continued in
  another gives fla's chunk prefill continued recurrently (relative to the largest logit; measured 5e-7 to 1e-5)."""
  options, (first, then) = CONFIGS[name]
  model, folder = saved_fla(tmp_path, options)
  ours = with_chunk_size(*convert_fla.load_fla(folder), 16)
  tokens = random_tokens(2, LENGTH, options["vocab_size"])
  errors = {}
  for mode in MODES:
    theirs, _ = fla_logits(model, tokens, FLA_KERNELS[mode])
    errors[mode] = relative_error(forward(ours, tokens, None, mode)[0], theirs)
  split = 29
  with torch.enable_grad():  # fla's chunk form: it runs whenever gradients are on
    prefill, cache = fla_logits(model, tokens[:, :split])
  rest, _ = fla_logits(model, tokens[:, split:], past=cache)
  theirs = np.concatenate([prefill, rest], axis=1)
  logits, state = forward(ours, tokens[:, :split], None, first)
  more, _ = forward(ours, tokens[:, split:], state, then)
  errors[f"{first}->{then}"] = relative_error(np.concatenate([logits, more], axis=1), theirs)
  assert all(error < 1e-4 for error in errors.values()), errors


def test_load_places_parameters_on_a_mesh(tmp_path):
  """With a placement, each parameter is read straight onto the mesh with its logical axes' sharding."""
  options = {**CONFIGS["untied"][0], "vocab_size": 64}
  _, folder = saved_fla(tmp_path, options)
  config = presets.get_config("fla")
  config.mesh.shape = (2, 2, 2)
  placed, _ = convert_fla.load_fla(folder, sharding.placement(config.mesh))
  plain, _ = convert_fla.load_fla(folder)
  kernel = placed.blocks[0].retention.q_proj.kernel[...]
  assert kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor") and len(kernel.devices()) == 8
  assert jax.tree.all(jax.tree.map(np.array_equal, flat_params(placed), flat_params(plain)))
  tokens = random_tokens(2, 9, 64)  # sharded matmuls sum in another order
  assert relative_error(forward(placed, tokens, None, "parallel")[0],
                        forward(plain, tokens, None, "parallel")[0]) < 1e-5


def test_bfloat16_shards_written_by_transformers_load(tmp_path):
  """A bfloat16 checkpoint that transformers split into shards with an index: each tensor is its float32 value."""
  model = fla_model(CONFIGS["tied_shared_kv"][0]).to(torch.bfloat16)
  model.save_pretrained(tmp_path / "fla", max_shard_size="20KB")
  assert (tmp_path / "fla" / safetensors_folder.INDEX_FILE).is_file()
  ours, config = convert_fla.load_fla(tmp_path / "fla")
  theirs = {name: value.float().numpy() for name, value in model.state_dict().items()}
  assert all(np.array_equal(value.T if path[-1] == "kernel" else value, theirs[convert_fla.fla_names(path, False)[0]])
             for path, value in flat_params(ours).items())


def write_tokenizer(path, size):
  """A word-level tokenizer.json of `size` tokens, `</s>` (id 0) among them."""
  vocab = {"</s>": 0, **{f"w{i}": i for i in range(1, size)}}
  tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="</s>"))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  path.parent.mkdir(parents=True, exist_ok=True)
  tokenizer.save(str(path))
  return path


def our_fla_model(seed=3, vocab_size=47, **overrides):
  """A RetNet of fla's variant (the fla preset, tiny) with random weights, its norm scales too, and its config."""
  config = presets.get_config("fla")
  config.model.update(vocab_size=vocab_size, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, value_dim=48,
                      ffn_dim=40, chunk_size=16, dtype="float32", **overrides)
  model = Model(config.model, rngs=nnx.Rngs(seed))
  params = nnx.state(model, nnx.Param)
  rng = np.random.default_rng(seed)
  vector = lambda path, value: value.ndim == 1 + (config.model.scan_layers and path[0] == "blocks")  # scales
  flat = {path: value + 0.3 * rng.standard_normal(value.shape, np.float32) if vector(path, value) else value
          for path, value in traverse_util.flatten_dict(nnx.to_pure_dict(params)).items()}
  nnx.replace_by_pure_dict(params, traverse_util.unflatten_dict(flat))
  nnx.update(model, params)
  return model, config


def flat_params(model):
  return traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


HYBRID = dict(attention_layers=(0,), attention_num_heads=8, attention_num_kv_heads=2, attention_window=20,
              attention_rotation_base=300.0)


@pytest.mark.parametrize("tie,max_shard_bytes,scan,hybrid", [(False, 2**30, False, {}), (True, 30_000, True, {}),
                                                             (False, 30_000, True, HYBRID)])
def test_round_trip_through_fla(tmp_path, tie, max_shard_bytes, scan, hybrid):
  """JAX -> fla folder (one file, or shards with an index) -> fla's from_pretrained gives our logits; -> JAX again
  gives the same parameters and model config; the tokenizer travels with it. Either layout of the blocks; a hybrid
  (its fused q/k/v kernel as fla's three, its window, heads and rotary base in fla's attn entry)."""
  model, config = our_fla_model(tie_embeddings=tie, scan_layers=scan, **hybrid)
  config.data.tokenizer = str(write_tokenizer(tmp_path / "tok" / "tokenizer.json", 30))
  out = export_fla.write_fla(model, config, tmp_path / "out", max_shard_bytes=max_shard_bytes)
  sharded = (out / safetensors_folder.INDEX_FILE).is_file()
  assert sharded == (max_shard_bytes < 2**30) and (out / "tokenizer.json").is_file()
  assert json.loads((out / "config.json").read_text())["eos_token_id"] == 0
  theirs = fla_models.RetNetForCausalLM.from_pretrained(out).eval()
  tokens = random_tokens(2, LENGTH, 47)
  assert relative_error(forward(model, tokens, None, "chunkwise")[0], fla_logits(theirs, tokens)[0]) < 1e-4
  back, back_config = convert_fla.load_fla(out, scan_layers=scan)
  assert jax.tree.all(jax.tree.map(np.array_equal, flat_params(back), flat_params(model)))
  config.model.chunk_size = back_config.model.chunk_size  # a choice of computation, not stored by fla
  assert back_config.model == config.model and back_config.data.tokenizer == str((out / "tokenizer.json").resolve())


def test_export_in_bfloat16(tmp_path):
  """model.param_dtype=bfloat16 writes every tensor (norm scales too) in bfloat16, half the float32 bytes, as
  config.json's dtype says; fla's from_pretrained gives the logits of our model on those rounded weights, and the
  folder imports back to them."""
  model, config = our_fla_model()
  config.data.tokenizer = str(write_tokenizer(tmp_path / "tok" / "tokenizer.json", 30))
  full = export_fla.write_fla(model, config, tmp_path / "float32")
  config.model.param_dtype = "bfloat16"
  out = export_fla.write_fla(model, config, tmp_path / "bfloat16")
  tensors, reference = load_file(out / safetensors_folder.SINGLE_FILE), load_file(full / safetensors_folder.SINGLE_FILE)
  assert {t.dtype.name for t in tensors.values()} == {"bfloat16"} and tensors.keys() == reference.keys()
  assert 2 * sum(t.nbytes for t in tensors.values()) == sum(t.nbytes for t in reference.values())
  assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
  back, _ = convert_fla.load_fla(out)
  rounded = jax.tree.map(lambda p: np.asarray(p.astype(jax.numpy.bfloat16), np.float32), flat_params(model))
  assert jax.tree.all(jax.tree.map(np.array_equal, flat_params(back), rounded))
  theirs = fla_models.RetNetForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
  tokens = random_tokens(2, LENGTH, 47)
  assert relative_error(forward(back, tokens, None, "chunkwise")[0], fla_logits(theirs, tokens)[0]) < 1e-4


FLA_CONFIG = {"model_type": "retnet", "hidden_size": 32, "num_hidden_layers": 1, "num_heads": 2, "vocab_size": 61}


@pytest.mark.parametrize("option,value", [
    ("expand_k", 2.0), ("use_short_conv", True), ("feature_map", "relu"), ("use_output_gate", False),
    ("attnres_block_size", 2), ("hidden_act", "powlu"),
])
def test_unsupported_fla_options_are_refused(tmp_path, option, value):
  (tmp_path / "config.json").write_text(json.dumps({**FLA_CONFIG, option: value}))
  with pytest.raises(ValueError, match=re.escape(f"{option}={value!r}")):
    convert_fla.load_fla(tmp_path)


@pytest.mark.parametrize("attn,message", [
    ({"layers": [0], "num_heads": 2, "qkv_bias": True}, "attn has qkv_bias=True (biases on q, k and v"),
    ({"layers": [0], "num_heads": 2, "qk_norm": True}, "attn gives qk_norm, which RetNet's hybrids do not implement"),
    ({"layers": [0]}, "attn lacks num_heads"),
    ([{"layers": [0], "num_heads": 2}, {"layers": [1], "num_heads": 2, "window_size": 8}],
     "attn gives 2 specifications with different settings"),
    ({"layers": [0], "num_heads": 2, "window_size": 1.5}, "window_size=1.5 (needs a whole number)"),
    ({"layers": "0", "num_heads": 2}, "layers=['0'] (needs lists of layer indices)"),
    ({"layers": [3], "num_heads": 2}, r"model.attention_layers=(3,) names layers [3] outside [0, model.num_layers=2"),
    ({"layers": [0], "num_heads": 3}, "model.attention_num_heads=3 must be a positive divisor of model.d_model=32"),
    ("attention", "attn must be an object (layers, num_heads, ...) or a list of them"),
])
def test_fla_attention_entries_we_cannot_express_are_refused(tmp_path, attn, message):
  """fla's attn entry: what RetNet's hybrids do not implement, or a malformed entry, refused by name."""
  (tmp_path / "config.json").write_text(json.dumps({**FLA_CONFIG, "num_hidden_layers": 2, "attn": attn}))
  with pytest.raises(ValueError, match=re.escape(message)):
    convert_fla.load_fla(tmp_path)


@pytest.mark.parametrize("override,message", [
    (dict(stability_norm=True), "model.stability_norm=True"),
    (dict(rotation_pairs="interleaved"), "model.rotation_pairs='interleaved'"),
    (dict(rotation_freqs="linspace"), "model.rotation_freqs='linspace'"),
    (dict(rotation_base=500.0), "model.rotation_base=500.0"),
    (dict(decay_schedule="logspace"), "model.decay_schedule='logspace'"),
    (dict(scale_embedding=True), "model.scale_embedding=True"),
    (dict(embed_norm=True), "model.embed_norm=True"),
    (dict(ffn_activation="gelu"), "model.ffn_activation='gelu'"),
    (dict(head_norm_eps=1e-5), "model.head_norm_eps=1e-05 differs from model.norm_eps=1e-06"),
    (dict(d_model=1024, num_heads=2), "key head dim d_model / num_heads = 512"),
    (dict(d_model=1024, num_heads=8, attention_layers=(0,), attention_num_heads=2),
     "attention head dim d_model / attention_num_heads = 512"),
])
def test_models_fla_cannot_express_are_refused(tmp_path, override, message):
  config = presets.get_config("fla")
  config.model.update(override)
  with pytest.raises(ValueError, match=re.escape(message)):
    export_fla.check_export(config, tmp_path / "out")


def test_a_transformer_is_refused(tmp_path):
  with pytest.raises(ValueError, match=re.escape("model.architecture='transformer' (fla's RetNet is a RetNet")):
    export_fla.check_export(presets.get_config("tiny", "transformer"), tmp_path / "out")


def test_export_refuses_before_writing(tmp_path):
  """A model fla cannot express, a tokenizer larger than the vocabulary, a folder in use: nothing is written."""
  model, config = our_fla_model(stability_norm=True)
  with pytest.raises(ValueError, match="model.stability_norm=True"):
    export_fla.write_fla(model, config, tmp_path / "out")
  model, config = our_fla_model()
  config.data.tokenizer = str(write_tokenizer(tmp_path / "tokenizer.json", 60))
  with pytest.raises(ValueError, match="the tokenizer has 60 tokens but model.vocab_size=47"):
    export_fla.write_fla(model, config, tmp_path / "out")
  assert not (tmp_path / "out").exists()
  (tmp_path / "out").mkdir()
  (tmp_path / "out" / "config.json").write_text("{}")
  config.data.tokenizer = "byte"
  with pytest.raises(owned_folders.NotOwnedError, match=r"--checkpoint='.*out' holds 'config.json', which this "
                                                        r"project did not write \(no \.retnet_jax\.json\)"):
    export_fla.write_fla(model, config, tmp_path / "out")
  assert (tmp_path / "out" / "config.json").read_text() == "{}"


def test_export_writes_only_into_its_own_folders_and_keeps_a_users_files(tmp_path):
  """--to_fla wrote into a folder holding a user's files without the project's mark. Such a folder is refused before
  any work, naming it and its files; --take_folder writes beside them, keeping their bytes; a second export into
  the folder replaces only what the first wrote (its shards, which the fewer ones of this export do not reuse)."""
  model, config = our_fla_model()
  out = tmp_path / "out"
  out.mkdir()
  (out / "notes.txt").write_bytes(b"mine\x00")
  with pytest.raises(owned_folders.NotOwnedError, match=r"^--checkpoint='.*out' holds 'notes.txt', which this "
                                                        r"project did not write .* pass --take_folder"):
    export_fla.check_export(config, out)
  export_fla.write_fla(model, config, out, max_shard_bytes=30_000, take=True)
  shards = sorted(p.name for p in out.glob("model-*.safetensors"))
  assert len(shards) > 1 and (out / safetensors_folder.INDEX_FILE).is_file()
  export_fla.write_fla(model, config, out)  # its own folder now: no --take_folder needed
  ours = ["config.json", safetensors_folder.SINGLE_FILE]  # a byte tokenizer of 47 tokens: no tokenizer files
  assert sorted(p.name for p in out.iterdir()) == sorted([owned_folders.MARK, "notes.txt", *ours])
  assert (out / "notes.txt").read_bytes() == b"mine\x00"
  assert owned_folders.read_mark(out)["written"] == sorted(ours)
  back, _ = convert_fla.load_fla(out)
  assert jax.tree.all(jax.tree.map(np.array_equal, flat_params(back), flat_params(model)))


def edited_checkpoint(tmp_path, edit):
  """An untied fla checkpoint folder whose tensors `edit(tensors)` changed in place."""
  _, folder = saved_fla(tmp_path, CONFIGS["untied"][0])
  tensors = {name: np.asarray(value) for name, value in load_file(folder / "model.safetensors").items()}
  edit(tensors)
  save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
  return folder


def _misshape(tensors):
  tensors["model.layers.1.attn.v_proj.weight"] = np.zeros((40, 32), np.float32)


def _retype(tensors):
  tensors["model.norm.weight"] = np.zeros(32, np.int8)


def _move(tensors):
  tensors["model.layers.2.mlp.up_proj.weight"] = tensors.pop("model.layers.0.mlp.up_proj.weight")


@pytest.mark.parametrize("edit,message", [
    (_move, r"missing tensors: \[model\.layers\.0\.mlp\.up_proj\.weight\]; unexpected tensors: "
            r"\[model\.layers\.2\.mlp\.up_proj\.weight\]"),
    (_misshape, r"model\.layers\.1\.attn\.v_proj\.weight has shape \(40, 32\) but config\.json needs \(64, 32\)"),
    (_retype, r"model\.norm\.weight is stored as I8"),
])
def test_missing_extra_misshapen_and_mistyped_tensors_are_named(tmp_path, edit, message):
  with pytest.raises(ValueError, match=message):
    convert_fla.load_fla(edited_checkpoint(tmp_path, edit))


@pytest.mark.parametrize("option,value,needs", [
    ("hidden_size", None, "a whole number"), ("expand_v", "2", "a finite number"),
    ("tie_word_embeddings", "false", "true or false"), ("num_hidden_layers", 2.5, "a whole number"),
])
def test_options_of_the_wrong_type_are_refused(tmp_path, option, value, needs):
  (tmp_path / "config.json").write_text(json.dumps({**FLA_CONFIG, option: value}))
  with pytest.raises(ValueError, match=re.escape(f"config.json gives options of the wrong type: {option}={value!r} "
                                                 f"(needs {needs})")):
    convert_fla.load_fla(tmp_path)


def _nan(tensors):
  tensors["model.norm.weight"][3] = np.nan


def test_damaged_weights_are_named(tmp_path):
  """Empty, truncated and garbage files, and a tensor holding NaN: one message naming the file, not safetensors'."""
  folder = edited_checkpoint(tmp_path, lambda tensors: None)
  weights = folder / "model.safetensors"
  intact = weights.read_bytes()
  for damaged in (b"", intact[:len(intact) // 2], b"\x07" * 500):
    weights.write_bytes(damaged)
    with pytest.raises(ValueError, match=f"{re.escape(str(weights))} is not a readable safetensors file .*: "
                                         "download or save it again"):
      convert_fla.load_fla(folder)
  with pytest.raises(ValueError, match=r"the tensor model.norm.weight holds 1 NaN or infinite values"):
    convert_fla.load_fla(edited_checkpoint(tmp_path / "nan", _nan))


def test_bad_folders_are_refused(tmp_path):
  """No config.json, no weights (or only a torch .bin), another model_type, a missing shard, a tokenizer larger than
  the vocabulary."""
  folder = edited_checkpoint(tmp_path, lambda tensors: None)
  config_json = (folder / "config.json").read_text()
  (folder / "config.json").unlink()
  with pytest.raises(FileNotFoundError, match="config.json is missing"):
    convert_fla.load_fla(folder)
  (folder / "config.json").write_text(json.dumps({**json.loads(config_json), "model_type": "gla"}))
  with pytest.raises(ValueError, match="model_type='gla'; only fla's RetNet"):
    convert_fla.load_fla(folder)
  (folder / "config.json").write_text(config_json)
  write_tokenizer(folder / "tokenizer.json", 80)
  with pytest.raises(ValueError, match="the tokenizer has 80 tokens but model.vocab_size=61"):
    convert_fla.load_fla(folder)
  (folder / "tokenizer.json").unlink()
  (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
  with pytest.raises(FileNotFoundError, match=r"holds no model\.safetensors nor .* \(only pytorch_model\.bin"):
    convert_fla.load_fla(folder)
  index = {"weight_map": {"lm_head.weight": "model-00002.safetensors"}}
  (folder / safetensors_folder.INDEX_FILE).write_text(json.dumps(index))
  with pytest.raises(FileNotFoundError, match="model-00002.safetensors, a shard that"):
    convert_fla.load_fla(folder)


def test_an_index_of_invalid_json_and_a_workdir_that_is_a_file_are_named(tmp_path):
  """json's own "Expecting value: line 1 column 1" named no file; a --workdir that is a file (or lies under one)
  failed with "[Errno 17] File exists" after reading the whole checkpoint."""
  folder = edited_checkpoint(tmp_path, lambda tensors: None)
  for damaged in ("", "{not json", '{"weight_map": ', "\xff\xfe"):
    (folder / safetensors_folder.INDEX_FILE).write_text(damaged)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(folder / safetensors_folder.INDEX_FILE))} is not valid "
                                         r"JSON \(.*\); the checkpoint is damaged or truncated: copy or download its "
                                         r"index again.$"):
      convert_fla.load_fla(folder)
  (tmp_path / "a-file").write_text("mine")
  for workdir, where in ((tmp_path / "a-file", "is a file"),
                         (tmp_path / "a-file" / "run", f"lies under '{tmp_path / 'a-file'}', which is a file")):
    with pytest.raises(NotADirectoryError, match=rf"^--workdir='{re.escape(str(workdir))}' {re.escape(where)}; give "
                                                 r"a new or empty directory to convert into.$"):
      convert.check_empty_workdir(workdir)
  assert (tmp_path / "a-file").read_text() == "mine"


@pytest.mark.slow
def test_script_converts_both_ways(tmp_path):
  """fla folder (a hybrid: windowed attention in layer 1) -> scripts/convert_fla.py -> scripts/generate.py with the
  flags it prints: fla's greedy tokens; the workdir -> --to_fla -> fla's from_pretrained: fla's logits. A tokenizer
  larger than the vocabulary is refused before anything is written."""
  options = CONFIGS["hybrid_window"][0]
  model, folder = saved_fla(tmp_path, options)
  write_tokenizer(folder / "tokenizer.json", 80)
  workdir = tmp_path / "converted"
  result = run_script("convert_fla.py", f"--checkpoint={folder}", f"--workdir={workdir}")
  assert result.returncode == 1 and "the tokenizer has 80 tokens but model.vocab_size=61" in result.stderr
  assert not workdir.exists()
  write_tokenizer(folder / "tokenizer.json", 61)
  result = run_script("convert_fla.py", f"--checkpoint={folder}", f"--workdir={workdir}")
  assert result.returncode == 0, result.stderr[-3000:]
  load_flags = shlex.split(next(line for line in result.stdout.splitlines() if "scripts/generate.py" in line))[2:]
  assert load_flags[0] == "--config=configs/retnet.py:fla"
  assert "--config.model.attention_layers=(1,)" in load_flags and "--config.model.attention_window=24" in load_flags

  prompt = "w3 w14 w15 w9"
  result = run_script("generate.py", *load_flags, f"--prompt={prompt}",
                      "--max_new_tokens=6", "--temperature=0", "--stream=false")
  assert result.returncode == 0, result.stderr[-3000:]
  completion = json.loads(result.stdout.splitlines()[-1])["samples"][0]["completion"]
  tokens = [[int(word[1:]) for word in prompt.split()]]
  for _ in range(6):
    tokens[0].append(int(fla_logits(model, tokens, "fused_recurrent")[0][0, -1].argmax()))
  assert completion.split() == [f"w{i}" if i else "</s>" for i in tokens[0][4:]]

  exported = tmp_path / "exported"
  result = run_script("convert_fla.py", "--to_fla", f"--workdir={workdir}", f"--checkpoint={exported}")
  assert result.returncode == 0, result.stderr[-3000:]
  assert (exported / "tokenizer.json").read_text() == (folder / "tokenizer.json").read_text()
  theirs = fla_models.RetNetForCausalLM.from_pretrained(exported).eval()
  tokens = random_tokens(2, LENGTH, options["vocab_size"])
  assert relative_error(fla_logits(theirs, tokens)[0], fla_logits(model, tokens)[0]) < 1e-6


def test_the_training_recipe_of_the_docs_exports():
  """docs/interop.md's way to train a model that exports to fla: the fla preset, or a preset with the four fields
  the exporter names."""
  assert not export_fla.export_problems(retnet_config.get_config("fla").model)
  small = retnet_config.get_config("small").model
  assert len(export_fla.export_problems(small)) == 4
  small.update(ffn_activation="swish", stability_norm=False, rotation_pairs="half", rotation_freqs="rope")
  assert not export_fla.export_problems(small)


def test_a_byte_tokenizer_model_exports_a_tokenizer_that_encodes_alike(tmp_path):
  """The fla export of a byte-tokenizer model wrote no tokenizer files: it writes a tokenizer.json (one token per
  byte) that transformers' AutoTokenizer loads and that encodes and decodes as the byte tokenizer does."""
  transformers = pytest.importorskip("transformers")
  model, config = our_fla_model(vocab_size=256)
  assert config.data.tokenizer == "byte"
  export_fla.write_fla(model, config, tmp_path / "out")
  assert owned_folders.read_mark(tmp_path / "out")["written"] == sorted(
      ["config.json", safetensors_folder.SINGLE_FILE, "tokenizer.json", "tokenizer_config.json"])
  back, back_config = convert_fla.load_fla(tmp_path / "out")  # imported back with its tokenizer
  assert back_config.model.vocab_size == 256
  loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
  text = "Hé, wörld!\n  \x00\x7f 日本 \ufffd"
  ids = ByteTokenizer().encode(text).tolist()
  assert loaded(text, add_special_tokens=False)["input_ids"] == ids
  assert loaded.decode(ids) == text and loaded.vocab_size == 256
