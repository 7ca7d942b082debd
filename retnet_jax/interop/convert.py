"""Import of RetNet checkpoints: torchscale's `RetNetDecoder` (late-2023 layout) as a `RetNet`; the workdir a
converted model goes to (fla's RetNet, in both directions, is retnet_jax.interop.convert_fla).

    model, config = load_torchscale(state_dict, torchscale_config)  # names -> arrays; RetNetConfig kwargs
    logits, _ = model(tokens, mode="parallel")                     # or "chunkwise", "recurrent"
    write_checkpoint(model, config, workdir)                       # for scripts/evaluate.py, generate.py

The late-2023 layout: RMSNorm, no biases, GLU FFN, per-head RMSNorm without affine, interleaved rotation,
decays 1 - 2^(-5-h). Its choices become model options: its normaliser (`stability_norm_style="torchscale"`),
the embedding scale and norm, the norm epsilon, the FFN activation and tied embeddings; options RetNet lacks
are refused by name. torch is never imported here: tensors are read duck-typed (anything with `.detach()`).
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import sys
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx, traverse_util

from retnet_jax.core import sharding, whole_files
from retnet_jax.interop.safetensors_folder import listing
from retnet_jax.mixers import decay
from retnet_jax.models import presets
from retnet_jax.models.model import Model
from retnet_jax.nn import layer_stack
from retnet_jax.runs import workdir as workdir_lib
from retnet_jax.training import checkpointing, run_config, train_state

# torchscale 0.3.0's RetNetConfig options and defaults (torchscale/architecture/config.py). Those not read
# below only act in training (dropout, drop path, activation checkpointing, FSDP), choose the forward form
# (chunkwise_recurrent: ours is a call argument), configure MoE layers that moe_freq=0 leaves out, or are
# unused by RetNetDecoder (relative position buckets, max_target_positions, xpos_scale_base).
TORCHSCALE_DEFAULTS = {
    "decoder_embed_dim": 768, "decoder_value_embed_dim": 1280, "decoder_retention_heads": 3,
    "decoder_ffn_embed_dim": 1280, "decoder_layers": 12, "decoder_normalize_before": True, "activation_fn": "gelu",
    "dropout": 0.0, "drop_path_rate": 0.0, "activation_dropout": 0.0, "no_scale_embedding": True,
    "layernorm_embedding": False, "moe_freq": 0, "moe_top1_expert": False, "moe_expert_count": 0,
    "moe_gating_use_fp32": True, "moe_eval_capacity_token_fraction": 0.25, "moe_second_expert_policy": "random",
    "moe_normalize_gate_prob_before_dropping": False, "use_xmoe": False, "rel_pos_buckets": 0, "max_rel_pos": 0,
    "deepnorm": False, "subln": True, "multiway": False, "share_decoder_input_output_embed": False,
    "max_target_positions": 1024, "no_output_layer": False, "layernorm_eps": 1e-6, "chunkwise_recurrent": False,
    "recurrent_chunk_size": 512, "vocab_size": -1, "checkpoint_activations": False, "fsdp": False, "ddp_rank": 0,
    "xpos_rel_pos": False, "xpos_scale_base": 512,
}

# Option -> (the value RetNet implements, what another value means). subln has no layer of its own in the
# RetNet decoder: it only forces pre-norm (checked as decoder_normalize_before).
UNSUPPORTED_OPTIONS = {
    "deepnorm": (False, "DeepNorm: post-norm blocks with up-weighted residuals"),
    "decoder_normalize_before": (True, "post-norm blocks"),
    "moe_freq": (0, "mixture-of-experts layers"),
    "multiway": (False, "multiway projections with two sets of weights"),
    "no_output_layer": (False, "no output projection, hence no logits"),
    "xpos_rel_pos": (False, "xPos-scaled rotation, as in the July-2023 RetNet; torchscale 0.3.0 ignores it, so a "
                            "checkpoint whose config sets it is likely from code that applies it"),
}

ACTIVATIONS = {"gelu": "gelu", "swish": "swish", "relu": "relu"}  # torchscale's GLU activations -> ours

# Our parameter path inside block i -> torchscale's name inside `layers.{i}.`.
BLOCK_NAMES = {
    ("retention_norm", "scale"): "retention_layer_norm.weight",
    ("retention", "q_proj", "kernel"): "retention.q_proj.weight",
    ("retention", "k_proj", "kernel"): "retention.k_proj.weight",
    ("retention", "v_proj", "kernel"): "retention.v_proj.weight",
    ("retention", "g_proj", "kernel"): "retention.g_proj.weight",
    ("retention", "out_proj", "kernel"): "retention.out_proj.weight",
    ("ffn_norm", "scale"): "final_layer_norm.weight",
    ("ffn", "fc1", "kernel"): "ffn.fc1.weight",
    ("ffn", "gate", "kernel"): "ffn.gate.weight",
    ("ffn", "fc2", "kernel"): "ffn.fc2.weight",
}
TOP_NAMES = {
    ("embed", "embedding"): "embed_tokens.weight",
    ("embed_norm", "scale"): "layernorm_embedding.weight",
    ("final_norm", "scale"): "layer_norm.weight",
    ("head", "kernel"): "output_projection.weight",
}
# Buffers of the official model: not parameters, checked against the config when present.
BUFFERS = ("retnet_rel_pos.angle", "retnet_rel_pos.decay")
# Name fragments of tensors from layouts RetNet does not implement -> what they are.
UNSUPPORTED_TENSORS = {
    ".bias": "biases (the July-2023 layout: LayerNorm and biased projections)",
    "ffn_layernorm.": "a norm inside the FFN (subln)",
    "group_norm.": "an affine per-head norm",
    "moe_layer.": "mixture-of-experts layers",
}


def torchscale_classes() -> tuple[type, type]:
  """torchscale's `(RetNetConfig, RetNetDecoder)`, imported on call (torch with them); ImportError if missing.

  torchscale imports timm for one drop-path helper, used only when training with drop_path_rate > 0; timm
  pulls in torchvision, which need not import beside this torch. Where timm is not installed, a stub module
  with that helper (the identity) stands in.
  """
  if "timm" not in sys.modules and importlib.util.find_spec("timm") is None:
    stubs = {name: types.ModuleType(name) for name in ("timm", "timm.models", "timm.models.layers")}
    stubs["timm.models.layers"].drop_path = lambda x, drop_prob=0.0, training=False: x
    sys.modules.update(stubs)
  from torchscale.architecture.config import RetNetConfig
  from torchscale.architecture.retnet import RetNetDecoder
  return RetNetConfig, RetNetDecoder


def to_numpy(tensor: Any) -> np.ndarray:
  """A float32 numpy copy of a numpy array or of a torch tensor (duck-typed; torch is never imported)."""
  if hasattr(tensor, "detach"):
    tensor = tensor.detach().cpu().float().numpy()  # float(): numpy has no bfloat16
  return np.asarray(tensor, np.float32)


def torchscale_name(path: tuple) -> str:
  """torchscale's state_dict name of our parameter at `path` (e.g. ("blocks", 0, "ffn", "fc1", "kernel"))."""
  if path[0] == "blocks":
    return f"layers.{path[1]}.{BLOCK_NAMES[tuple(path[2:])]}"
  return TOP_NAMES[tuple(path)]


def config_from_torchscale(torchscale_config: Mapping[str, Any], vocab_size: int) -> ml_collections.ConfigDict:
  """The full config (the torchscale preset of the checkpoint's size, or `torchscale_base`, with its model).

  `torchscale_config` holds RetNetConfig keyword values; unknown names and unsupported values raise ValueError.
  """
  unknown = sorted(set(torchscale_config) - set(TORCHSCALE_DEFAULTS))
  if unknown:
    raise ValueError(f"unknown RetNetConfig option(s) {unknown}; this converter reads torchscale 0.3.0's: "
                     f"{sorted(TORCHSCALE_DEFAULTS)}.")
  options = {**TORCHSCALE_DEFAULTS, **torchscale_config}
  if options["deepnorm"]:  # RetNetConfig's own adjustments
    options.update(decoder_normalize_before=False, subln=False)
  if options["subln"]:
    options.update(decoder_normalize_before=True, deepnorm=False)
  problems = [f"{name}={options[name]!r} ({what}; supported: {supported!r})"
              for name, (supported, what) in UNSUPPORTED_OPTIONS.items() if options[name] != supported]
  if options["activation_fn"] not in ACTIVATIONS:
    problems.append(f"activation_fn={options['activation_fn']!r} (supported: {sorted(ACTIVATIONS)})")
  if problems:
    raise ValueError("the torchscale config uses what RetNet does not implement: " + "; ".join(problems) + ".")
  if options["vocab_size"] > 0 and options["vocab_size"] != vocab_size:
    raise ValueError(f"RetNetConfig vocab_size={options['vocab_size']} but embed_tokens.weight has {vocab_size} "
                     "rows.")
  sizes = (options["decoder_embed_dim"], options["decoder_layers"], options["decoder_retention_heads"],
           options["decoder_value_embed_dim"])
  preset = next((name for name, size in presets.TORCHSCALE_SIZES.items()
                 if (size.d_model, size.num_layers, size.num_heads, size.width) == sizes
                 and options["decoder_ffn_embed_dim"] == size.width), "base")
  config = presets.get_config(f"torchscale_{preset}")
  d_model, num_layers, num_heads, value_dim = sizes
  config.model.update(
      vocab_size=vocab_size, d_model=d_model, num_layers=num_layers, num_heads=num_heads, value_dim=value_dim,
      ffn_dim=options["decoder_ffn_embed_dim"], ffn_activation=ACTIVATIONS[options["activation_fn"]],
      tie_embeddings=bool(options["share_decoder_input_output_embed"]),
      chunk_size=options["recurrent_chunk_size"], decay_schedule="retnet", rotation_base=10000.0,
      stability_norm=True, stability_norm_style="torchscale", head_norm_eps=float(options["layernorm_eps"]),
      norm_eps=float(options["layernorm_eps"]), scale_embedding=not options["no_scale_embedding"],
      embed_norm=bool(options["layernorm_embedding"]), dtype="float32")
  return config


def _check_names(given: set[str], expected: set[str]) -> None:
  """Refuses unsupported layouts by their tensors, then any tensor missing or left over, naming them all."""
  for fragment, what in UNSUPPORTED_TENSORS.items():
    found = sorted(name for name in given if fragment in name)
    if found:
      raise ValueError(f"the state_dict holds {what}, which RetNet does not implement: {listing(found)}. "
                       "Only torchscale's late-2023 RetNet layout converts (RMSNorm, no biases, GLU FFN).")
  missing, extra = sorted(expected - given), sorted(given - expected - set(BUFFERS))
  if missing or extra:
    raise ValueError("the state_dict does not match a torchscale RetNetDecoder of this config: "
                     f"missing tensors: [{listing(missing)}]; unexpected tensors: [{listing(extra)}].")


def _check_buffers(state_dict: Mapping[str, Any], cfg: ml_collections.ConfigDict) -> None:
  """The rotation angles and decays stored with the checkpoint must be the ones the config computes.

  Decays are compared as gamma: torchscale builds them in float32, where 1 - 2^(-5-h) is exactly 1 for h >= 20.
  """
  key_dim = cfg.d_model // cfg.num_heads
  expected = {"retnet_rel_pos.angle": np.repeat(cfg.rotation_base ** -np.linspace(0, 1, key_dim // 2), 2),
              "retnet_rel_pos.decay": decay.gammas(cfg.decay_schedule, cfg.num_heads, cfg.decay_gammas)}
  for name, value in expected.items():
    if name not in state_dict:
      continue
    stored = to_numpy(state_dict[name]).astype(np.float64)
    stored = np.exp(stored) if name.endswith("decay") else stored
    if stored.shape != value.shape or not np.allclose(stored, value, rtol=1e-5, atol=1e-6):
      raise ValueError(f"{name} differs from the official rotation (base 10000) and decays (1 - 2^(-5-h)) that "
                       "RetNet computes; a checkpoint of modified torchscale code cannot be converted.")


def unwrap_fairseq(state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
  """The decoder's own names of a fairseq checkpoint (`{"model": {"decoder.layers.0...": ...}, "cfg": ...}`) or
  of its `model` dict; any other state_dict as it is."""
  if isinstance(state_dict.get("model"), Mapping):
    state_dict = state_dict["model"]
  prefix = "decoder."
  if any(name.startswith(prefix) for name in state_dict):
    state_dict = {name[len(prefix):] if name.startswith(prefix) else name: value for name, value in state_dict.items()}
  return state_dict


def load_torchscale(state_dict: Mapping[str, Any], torchscale_config: Mapping[str, Any], scan_layers: bool = False
                    ) -> tuple[Model, ml_collections.ConfigDict]:
  """A torchscale RetNetDecoder as a RetNet: `model(tokens, mode=...)` gives torchscale's logits in each form.

  Args:
    state_dict: the decoder's names -> numpy arrays or torch tensors (float32 or bfloat16), or a fairseq
      checkpoint holding them (`{"model": {"decoder.NAME": ...}, ...}`).
    torchscale_config: its RetNetConfig keyword values; unsupported options are refused by name.
    scan_layers: build the model with its blocks stacked (`model.scan_layers`).
  Returns:
    (model, config): the model and the full config (the torchscale preset of its size, with its model fields).
  """
  state_dict = unwrap_fairseq(state_dict)
  embed = state_dict.get("embed_tokens.weight")
  if embed is None:
    raise ValueError("the state_dict has no embed_tokens.weight (the token embedding); pass the state_dict of a "
                     "torchscale RetNetDecoder built with its embed_tokens.")
  vocab_size = int(embed.shape[0])
  config = config_from_torchscale(torchscale_config, vocab_size)
  abstract = nnx.eval_shape(lambda: Model(config.model, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  targets = traverse_util.flatten_dict(nnx.to_pure_dict(state))
  names = {path: torchscale_name(path) for path in targets}
  # With tied embeddings torchscale's state_dict also holds the shared weight as output_projection.weight.
  tied_copy = config.model.tie_embeddings and "output_projection.weight" in state_dict
  _check_names(set(state_dict), set(names.values()) | ({"output_projection.weight"} if tied_copy else set()))
  if tied_copy and not np.array_equal(to_numpy(state_dict["output_projection.weight"]), to_numpy(embed)):
    raise ValueError("share_decoder_input_output_embed is set but output_projection.weight differs from "
                     "embed_tokens.weight.")
  _check_buffers(state_dict, config.model)
  arrays = {}
  for path, target in targets.items():
    tensor = to_numpy(state_dict[names[path]])
    kernel = path[-1] == "kernel"  # torch Linear weights are [out, in]; our kernels [in, out]
    expected = tuple(target.shape)[::-1] if kernel else tuple(target.shape)
    if tensor.shape != expected:
      raise ValueError(f"{names[path]} has shape {tensor.shape} but the config needs {expected}.")
    arrays[path] = jnp.asarray(tensor.T if kernel else tensor)
  nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(arrays))
  config.model.scan_layers = scan_layers
  return layer_stack.as_layout(nnx.merge(graphdef, state), scan_layers), config


def model_overrides(config: run_config.Config | ml_collections.ConfigDict) -> dict[str, Any]:
  """The model fields of `config` that differ from its preset: with `--config=configs/retnet.py:PRESET`,
  scripts/evaluate.py and scripts/generate.py need them as `--config.model.NAME=VALUE`."""
  config = run_config.build(config)
  preset = presets.model_config(config.preset)
  return {name: value for name, value in config.model.to_dict().items() if value != preset[name]}


def load_flags(config: run_config.Config | ml_collections.ConfigDict, workdir: str | Path) -> str:
  """The flags with which scripts/evaluate.py and scripts/generate.py load a converted `config` from `workdir`:
  its preset, the model overrides and a tokenizer other than the byte one, quoted for a shell where needed."""
  flags = [f"--config=configs/retnet.py:{config.preset}"]
  flags += [f"--config.model.{name}={value}" for name, value in model_overrides(config).items()]
  if config.data.tokenizer != "byte":
    flags.append(f"--config.data.tokenizer={config.data.tokenizer}")
  return " ".join(map(shlex.quote, flags + [f"--workdir={workdir}"]))  # a tuple's parentheses quoted for the shell


def conversion_names() -> tuple[str, ...]:
  """The names a conversion writes in its workdir: checkpoints/ (step 0) and config.json."""
  return workdir_lib.checkpoint_dir("").name, workdir_lib.config_file("").name


def check_empty_workdir(workdir: str | Path, take: bool = False) -> None:
  """Raises FileExistsError if `workdir` already holds checkpoints (a conversion writes step 0 of a new one),
  NotADirectoryError naming it when it is a file or lies under one, and ValueError where it is a folder this
  project may not write into (`workdir.check_training_dir`; `take`: --take_folder)."""
  workdir = Path(workdir)
  blocking = next((p for p in (workdir, *workdir.parents) if p.exists() and not p.is_dir()), None)
  if blocking is not None:
    where = "is a file" if blocking == workdir else f"lies under {str(blocking)!r}, which is a file"
    raise NotADirectoryError(f"--workdir={str(workdir)!r} {where}; give a new or empty directory to convert into.")
  ckpt_dir = workdir_lib.checkpoint_dir(workdir)
  if ckpt_dir.exists() and any(ckpt_dir.iterdir()):
    raise FileExistsError(f"{ckpt_dir} already holds checkpoints; convert into an empty --workdir.")
  workdir_lib.check_training_dir(workdir, conversion_names(), take)


def write_checkpoint(model: Model, config: run_config.Config | ml_collections.ConfigDict, workdir: str | Path,
                     take: bool = False) -> Path:
  """Writes `model` into `workdir` as training does: a step-0 checkpoint and config.json, which
  `train_state.restore_model`, the scripts and training's resume load. `workdir` is refused as by
  `check_empty_workdir` (`take`: --take_folder), and marked as a workdir of this project first.

  Returns:
    The checkpoint directory. Everything but the parameters is a fresh train state.
  """
  config, workdir = run_config.build(config), Path(workdir)
  check_empty_workdir(workdir, take)
  ckpt_dir = workdir_lib.checkpoint_dir(workdir)
  layout = train_state.make_layout(config, sharding.placement(config.mesh))
  state = train_state.from_params(layout, nnx.state(model, nnx.Param))
  workdir_lib.claim(workdir, conversion_names(), take)
  with checkpointing.Checkpointer(ckpt_dir, keep=1, async_save=False) as checkpointer:
    checkpointer.save(0, state.saved(), {"data": {"epoch": 0, "index": 0}, "config": config.to_dict()}, force=True)
  if jax.process_index() == 0:
    whole_files.write_text(workdir_lib.config_file(workdir), json.dumps(config.to_dict(), indent=2))
  return ckpt_dir
