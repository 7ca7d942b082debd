"""Writing a model as flash-linear-attention's (fla 0.6.0) RetNet checkpoint folder, without torch: the fields fla
cannot express refused by name first, then config.json, the safetensors files (or shards and their index) and the
tokenizer, into a folder the project owns (`owned_folders`).

    write_fla(model, config, "exported")             # a folder fla's RetNetForCausalLM.from_pretrained loads

The names and layouts are `retnet_jax.interop.convert_fla`'s, which reads such folders back.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx, traverse_util
from jax.experimental import multihost_utils
from safetensors.numpy import save_file

from retnet_jax.core import owned_folders, whole_files
from retnet_jax.input_pipeline import tokenizer as tokenizer_lib
from retnet_jax.interop.convert_fla import fla_names, split_qkv
from retnet_jax.interop.safetensors_folder import INDEX_FILE, SINGLE_FILE
from retnet_jax.mixers import attention, multiscale_retention
from retnet_jax.models import architectures, model_config
from retnet_jax.models.model import Model
from retnet_jax.models.model_config import ModelConfig
from retnet_jax.nn import layer_stack, layers
from retnet_jax.training import run_config

# config.model field -> the value fla computes; other values cannot be exported.
EXPORTABLE = {"stability_norm": False, "rotation_pairs": "half", "rotation_freqs": "rope", "rotation_base": 10000.0,
              "decay_schedule": "retnet", "scale_embedding": False, "embed_norm": False, "ffn_activation": "swish"}
MAX_KEY_HEAD_DIM = 256  # fla's MultiScaleRetention asserts head_k_dim <= 256 (its rotary kernel)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
FOLDER_FORMAT = "fla checkpoint"  # an export's folder, in its mark (`owned_folders`)
# tokenizer_config.json beside the byte tokenizer's tokenizer.json: transformers' AutoTokenizer then loads it as is.
BYTE_TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
BYTE_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MAX_ATTENTION_HEAD_DIM = 256  # flash-attn's largest head dim, which fla's Attention calls


def export_problems(cfg: ModelConfig | Any) -> list[str]:
  """The model fields of `cfg` (the model section, typed or as the config holds it) that fla's RetNet cannot express,
  each with the value it needs."""
  cfg = model_config.of(cfg)
  foreign = [mixer for mixer in architectures.mixers(cfg)
             if mixer not in (multiscale_retention.RETENTION, attention.HYBRID)]
  names = ", ".join(mixer.name for mixer in foreign)
  if attention.TRANSFORMER in foreign:
    return [f"model.architecture={cfg.architecture!r} (fla's RetNet is a RetNet: retention layers, a hybrid's "
            f"attention layers; these are {names} layers; export a RetNet workdir)"]
  if foreign:  # a RetNet whose model.mixer is not multi-scale retention
    return [f"model.mixer={cfg.mixer!r} (fla's RetNet computes multi-scale retention, a fixed decay per head; these "
            f"are {names} layers; export a workdir with model.mixer='retention')"]
  problems = [f"model.{name}={cfg.flat_value(name)!r} (fla computes {value!r})" for name, value in EXPORTABLE.items()
              if cfg.flat_value(name) != value]
  if cfg.head_norm_eps != cfg.norm_eps:
    problems.append(f"model.head_norm_eps={cfg.head_norm_eps} differs from model.norm_eps={cfg.norm_eps} (fla has "
                    "one norm_eps)")
  if cfg.d_model // cfg.num_heads > MAX_KEY_HEAD_DIM:
    problems.append(f"key head dim d_model / num_heads = {cfg.d_model // cfg.num_heads} (fla allows at most "
                    f"{MAX_KEY_HEAD_DIM})")
  heads = attention.HYBRID.settings(cfg).num_heads
  if cfg.attention.layers and cfg.d_model // heads > MAX_ATTENTION_HEAD_DIM:
    problems.append(f"attention head dim d_model / attention_num_heads = {cfg.d_model // heads} (flash-attn, which "
                    f"fla's attention calls, allows at most {MAX_ATTENTION_HEAD_DIM})")
  return problems


def fla_config_of(cfg: ModelConfig, eos_id: int | None) -> dict[str, Any]:
  """fla's config.json values for a model config that `export_problems` accepts."""
  return {
      "model_type": "retnet", "architectures": ["RetNetForCausalLM"], "hidden_size": cfg.d_model,
      "num_hidden_layers": cfg.num_layers, "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
      "expand_k": 1, "expand_v": cfg.value_dim / cfg.d_model, "intermediate_size": cfg.ffn_dim,
      "hidden_act": "swish", "norm_eps": cfg.norm_eps, "elementwise_affine": cfg.head_norm_scale,
      "fuse_norm": True, "use_output_gate": True, "use_short_conv": False, "feature_map": None,
      "tie_word_embeddings": cfg.tie_embeddings, "vocab_size": cfg.vocab_size, "bos_token_id": None,
      "eos_token_id": eos_id, "pad_token_id": None, "dtype": cfg.param_dtype, "attn": _fla_attn(cfg),
  }


def _fla_attn(cfg: ModelConfig) -> dict[str, Any] | None:
  """fla's `attn` entry of a hybrid model config (None: no attention layers)."""
  if not cfg.attention.layers:
    return None
  heads, kv_heads = attention.HYBRID.settings(cfg)[:2]
  return {"layers": sorted(cfg.attention.layers), "num_heads": heads, "num_kv_heads": kv_heads, "qkv_bias": False,
          "window_size": cfg.attention.window, "rope_theta": cfg.attention.rotation_base}


def _shards(sizes: Mapping[str, int], max_bytes: int) -> list[list[str]]:
  """Tensor names in order, grouped into consecutive shards of at most `max_bytes` (a larger tensor alone)."""
  shards, used = [[]], 0
  for name, size in sizes.items():
    if shards[-1] and used + size > max_bytes:
      shards.append([])
      used = 0
    shards[-1].append(name)
    used += size
  return shards


def _host_arrays(params: Mapping[tuple, jax.Array], paths: list[tuple], cfg: ModelConfig
                 ) -> Iterator[tuple[str, np.ndarray]]:
  """fla's names and numpy copies in `model.param_dtype` of `params[path]` in torch's layout ([out, in] for kernels;
  a fused q/k/v kernel as fla's three), gathered across processes."""
  dtype = layers.compute_dtype(cfg.param_dtype)
  for path in paths:
    value = np.asarray(multihost_utils.process_allgather(params[path], tiled=True), dtype)
    names = fla_names(path)
    parts = split_qkv(value, *attention.HYBRID.settings(cfg)[:2]) if len(names) > 1 else (value,)
    for name, part in zip(names, parts):
      yield name, np.ascontiguousarray(part.T if path[-1] == "kernel" else part)


def _export_names(config: run_config.Config) -> tuple[str, ...]:
  """The names every export of `config` writes, whatever its shards: config.json, tokenizer.json (a
  `data.tokenizer` file's, or the byte tokenizer's with its tokenizer_config.json), and both names that decide what
  fla loads (one file, or an index of shards)."""
  if config.data.tokenizer != "byte":
    return ("config.json", SINGLE_FILE, INDEX_FILE, "tokenizer.json")
  return ("config.json", SINGLE_FILE, INDEX_FILE) + (BYTE_TOKENIZER_FILES if _writes_byte_tokenizer(config) else ())


def _writes_byte_tokenizer(config: run_config.Config) -> bool:
  """Whether an export writes the byte tokenizer's files: a byte-tokenizer model whose vocabulary holds every byte
  (a smaller one could not be loaded back with them)."""
  return config.data.tokenizer == "byte" and config.model.vocab_size >= tokenizer_lib.ByteTokenizer.vocab_size


def check_export(config: run_config.Config | Any, out_dir: str | Path, take: bool = False
                 ) -> tokenizer_lib.Tokenizer:
  """Raises before anything is written if `out_dir` is not new, empty or an export's (`owned_folders.check`;
  `take`: --take_folder, beside the files found), if fla cannot express the model (ValueError naming the fields),
  or if the tokenizer does not fit the vocabulary; returns the tokenizer."""
  config = run_config.build(config)
  owned_folders.check(out_dir, FOLDER_FORMAT, flag="--checkpoint", writes=_export_names(config), take=take)
  problems = export_problems(config.model)
  if problems:
    raise ValueError("fla's RetNet cannot express this model: " + "; ".join(problems) + ".")
  vocab_size = None if config.data.tokenizer == "byte" else config.model.vocab_size
  return tokenizer_lib.load(config.data.tokenizer, vocab_size=vocab_size)


def write_fla(model: Model, config: run_config.Config | Any, out_dir: str | Path,
              max_shard_bytes: int = 2 * 2**30, take: bool = False) -> Path:
  """Writes `model` as an fla RetNet checkpoint folder that `RetNetForCausalLM.from_pretrained` loads.

  Args:
    model: the model, in either layout of its blocks; its parameters may be sharded.
    config: its full config; `check_export` must accept it. The tensors are written in `model.param_dtype`
      (float32 or bfloat16: every one, norm scales included), as config.json's `dtype` says. A `data.tokenizer`
      tokenizer.json is copied, with the tokenizer files beside it; the byte tokenizer of a model whose vocabulary
      holds every byte is written as a tokenizer.json that encodes as it does (`tokenizer.byte_tokenizer_json`),
      with a tokenizer_config.json naming transformers' fast tokenizer.
    out_dir: a folder that is new, empty, or an earlier export's (it carries the project's mark): the files of
      that export that this one does not write again (shards of another count) are removed, and nothing else.
    max_shard_bytes: the bytes of one safetensors file; more make shards with an index.
    take: write into a folder holding files this project did not write, beside them (--take_folder).
  Returns:
    The folder: config.json, model.safetensors (or shards and model.safetensors.index.json), tokenizer files.
  """
  config, out = run_config.build(config), Path(out_dir)
  tokenizer = check_export(config, out, take)
  tokenizer_file = None if config.data.tokenizer == "byte" else Path(config.data.tokenizer)
  params = traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(layer_stack.as_layout(model, False), nnx.Param)))
  itemsize = np.dtype(layers.compute_dtype(config.model.param_dtype)).itemsize
  shards = _shards({path: itemsize * math.prod(value.shape) for path, value in params.items()}, max_shard_bytes)
  files = ([SINGLE_FILE] if len(shards) == 1 else
           [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
  siblings = tuple(name for name in TOKENIZER_FILES[1:] if tokenizer_file is not None  # beside a tokenizer.json
                   and tokenizer_file.name == "tokenizer.json" and (tokenizer_file.parent / name).is_file())
  names = [*files, *([INDEX_FILE] if len(shards) > 1 else []), "config.json",
           *(["tokenizer.json", *siblings] if tokenizer_file is not None else []),
           *(BYTE_TOKENIZER_FILES if _writes_byte_tokenizer(config) else ())]
  writer = jax.process_index() == 0
  if writer:
    folder = owned_folders.claim(out, FOLDER_FORMAT, flag="--checkpoint", writes=names, take=take)
    stale = sorted(folder.written() - set(names))  # an earlier export's, not written again: fla would load them
    for name in stale:
      (out / name).unlink(missing_ok=True)
    folder.forget(*stale)
  for file, paths in zip(files, shards):
    tensors = dict(_host_arrays(params, paths, config.model))
    if writer:
      with whole_files.replacing(out / file) as partial:
        save_file(tensors, partial, metadata={"format": "pt"})
    del tensors
  if writer:
    if len(shards) > 1:
      weight_map = {name: file for file, paths in zip(files, shards) for path in paths for name in fla_names(path)}
      total = sum(itemsize * math.prod(value.shape) for value in params.values())
      whole_files.write_text(out / INDEX_FILE, json.dumps({"metadata": {"total_size": total},
                                                          "weight_map": weight_map}, indent=2))
    whole_files.write_text(out / "config.json", json.dumps(fla_config_of(config.model, tokenizer.eos_id), indent=2))
    if tokenizer_file is not None:
      shutil.copyfile(tokenizer_file, out / "tokenizer.json")
      for name in siblings:
        shutil.copyfile(tokenizer_file.parent / name, out / name)
    elif _writes_byte_tokenizer(config):
      whole_files.write_text(out / "tokenizer.json", tokenizer_lib.byte_tokenizer_json())
      whole_files.write_text(out / "tokenizer_config.json", json.dumps(BYTE_TOKENIZER_CONFIG, indent=2))
  return out
