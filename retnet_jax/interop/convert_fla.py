"""flash-linear-attention's (fla 0.6.0) RetNet in its Hugging Face format, read without torch (written by
`retnet_jax.interop.export_fla`), and the names and layouts both directions share.

    model, config = load_fla("checkpoints/retnet")   # config.json, model.safetensors (or shards), tokenizer.json

fla's RetNet is RetNet with: half-split rotation pairs at RoPE frequencies (`rotation_pairs="half"`,
`rotation_freqs="rope"`), no stability normaliser (`stability_norm=False`), a learned per-head norm scale shared by
the heads (`head_norm_scale`, its `elementwise_affine`), one epsilon for every norm, shared key/value heads
(`num_kv_heads`) and a swish GLU of width `intermediate_size`. fla's `attn` entry (hybrids: softmax attention in
chosen layers, optionally over a sliding window) maps to `model.attention_layers` and the `attention_*` fields; its
separate q, k, v projections are our attention's fused one, split per key/value head. fla scales queries by d_k^-1/2
where RetNet scales keys: the same function, with the retention state 1/sqrt(d_k) times fla's. fla builds its decays
in float32, where 1 - 2^(-5-h) is exactly 1 for heads h >= 20; RetNet keeps them below 1 (it matters only past 20
heads).

Tensors are read one at a time from the safetensors files (float32, bfloat16 or float16) and placed at once, so
the peak host memory stays near the float32 parameters' size; every name, shape and dtype is checked first.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx, traverse_util

from retnet_jax.core import sharding
from retnet_jax.input_pipeline import tokenizer as tokenizer_lib
from retnet_jax.interop.safetensors_folder import DTYPES, SafetensorsFolder, listing
from retnet_jax.mixers import attention
from retnet_jax.models import model_config, presets
from retnet_jax.models.model import Model
from retnet_jax.nn import layer_stack

# fla 0.6.0's RetNetConfig defaults of the options that shape the model (a key absent from config.json takes
# these). Its other options act only in training (initializer_range, fuse_cross_entropy, use_l2warp, ...),
# choose a kernel (attn_mode, fuse_swiglu) or are generation settings (token ids, use_cache).
FLA_DEFAULTS = {
    "hidden_size": 2048, "num_hidden_layers": 24, "num_heads": 8, "num_kv_heads": None, "expand_k": 1.0,
    "expand_v": 2.0, "hidden_ratio": 2, "intermediate_size": None, "vocab_size": 32000, "norm_eps": 1e-6,
    "elementwise_affine": True, "tie_word_embeddings": False, "fuse_norm": True, "hidden_act": "swish",
    "use_short_conv": False, "feature_map": None, "use_output_gate": True, "attn": None, "attnres_block_size": None,
}
# Option -> the JSON type config.json must give it ("int": a whole number; "number": a finite number; "bool": true or
# false), None allowed where fla's default is None.
OPTION_TYPES = {"hidden_size": "int", "num_hidden_layers": "int", "num_heads": "int", "num_kv_heads": "int",
                "expand_k": "number", "expand_v": "number", "hidden_ratio": "number", "intermediate_size": "int",
                "vocab_size": "int", "norm_eps": "number", "elementwise_affine": "bool",
                "tie_word_embeddings": "bool", "fuse_norm": "bool"}
TYPE_NAMES = {"int": "a whole number", "number": "a finite number", "bool": "true or false"}
# Option -> (the value RetNet implements, what another value means).
UNSUPPORTED_OPTIONS = {
    "expand_k": (1, "a key width other than hidden_size"),
    "use_short_conv": (False, "short convolutions on q, k and v"),
    "feature_map": (None, "a feature map on q and k"),
    "use_output_gate": (True, "retention without its swish output gate"),
    "attnres_block_size": (None, "attention residuals across layers"),
    "hidden_act": ("swish", "another activation in the FFN and the output gate"),
}

# Our parameter path inside block i -> fla's name inside `model.layers.{i}.`: a retention block, then what differs in
# a hybrid's attention block (its fused q/k/v kernel holds fla's three, `QKV_NAMES`).
_FFN_NAMES = {
    ("ffn_norm", "scale"): "mlp_norm.weight",
    ("ffn", "fc1", "kernel"): "mlp.gate_proj.weight",
    ("ffn", "gate", "kernel"): "mlp.up_proj.weight",
    ("ffn", "fc2", "kernel"): "mlp.down_proj.weight",
}
BLOCK_NAMES = {
    ("retention_norm", "scale"): "attn_norm.weight",
    ("retention", "q_proj", "kernel"): "attn.q_proj.weight",
    ("retention", "k_proj", "kernel"): "attn.k_proj.weight",
    ("retention", "v_proj", "kernel"): "attn.v_proj.weight",
    ("retention", "g_proj", "kernel"): "attn.g_proj.weight",
    ("retention", "out_proj", "kernel"): "attn.o_proj.weight",
    **_FFN_NAMES,
}
QKV = ("attention", "qkv_proj", "kernel")
QKV_NAMES = ("attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight")
ATTENTION_BLOCK_NAMES = {
    ("attention_norm", "scale"): "attn_norm.weight",
    ("attention", "out_proj", "kernel"): "attn.o_proj.weight",
    **_FFN_NAMES,
}
# fla's `attn` entry: its keys (fla's AttentionSpec), their defaults, and the value of those we implement one way.
ATTN_DEFAULTS = {"num_kv_heads": None, "qkv_bias": False, "window_size": None, "rope_theta": 10000.0}
ATTN_KEYS = ("layers", "num_heads", *ATTN_DEFAULTS)
# The head norm: fla's fused norm-and-gate module when fuse_norm is on (its default), its plain RMSNorm otherwise.
HEAD_NORM_NAMES = {True: "attn.g_norm_swish_gate.weight", False: "attn.g_norm.weight"}
TOP_NAMES = {
    ("embed", "embedding"): "model.embeddings.weight",
    ("final_norm", "scale"): "model.norm.weight",
    ("head", "kernel"): "lm_head.weight",
}


def fla_names(path: tuple, fuse_norm: bool = True) -> tuple[str, ...]:
  """fla's tensor names of our parameter at `path` (e.g. ("blocks", 0, "ffn", "fc1", "kernel")): one, or for an
  attention block's fused q/k/v kernel fla's q, k and v."""
  if path[0] != "blocks":
    return (TOP_NAMES[tuple(path)],)
  inner = tuple(path[2:])
  if inner == QKV:
    names = QKV_NAMES
  elif inner == ("retention", "head_norm_scale"):
    names = (HEAD_NORM_NAMES[fuse_norm],)
  else:
    names = ((BLOCK_NAMES | ATTENTION_BLOCK_NAMES)[inner],)
  return tuple(f"model.layers.{path[1]}.{name}" for name in names)


def fuse_qkv(q_DxHK: np.ndarray, k_DxGK: np.ndarray, v_DxGK: np.ndarray, num_kv_heads: int) -> np.ndarray:
  """fla's q, k, v kernels (ours: [in, out]) as our attention's fused one, columns grouped per key/value head (its
  query heads, then its key and value: `attention.CausalSelfAttention`)."""
  d_model = q_DxHK.shape[0]
  q, k, v = (x.reshape(d_model, num_kv_heads, -1, k_DxGK.shape[1] // num_kv_heads) for x in (q_DxHK, k_DxGK, v_DxGK))
  return np.concatenate([q, k, v], axis=2).reshape(d_model, -1)


def split_qkv(kernel: np.ndarray, num_heads: int, num_kv_heads: int) -> tuple[np.ndarray, ...]:
  """`fuse_qkv` undone: (q, k, v) kernels `[in, out]`."""
  d_model = kernel.shape[0]
  grouped = kernel.reshape(d_model, num_kv_heads, num_heads // num_kv_heads + 2, -1)
  return (grouped[:, :, :-2].reshape(d_model, -1), grouped[:, :, -2].reshape(d_model, -1),
          grouped[:, :, -1].reshape(d_model, -1))


def ffn_width(options: Mapping[str, Any]) -> int:
  """fla's GatedMLP width: intermediate_size, else 2/3 x hidden_ratio (None: 4) x hidden_size rounded up to 256."""
  if options["intermediate_size"] is not None:
    return int(options["intermediate_size"])
  width = int(options["hidden_size"] * (4 if options["hidden_ratio"] is None else options["hidden_ratio"]) * 2 / 3)
  return 256 * -(-width // 256)


def config_from_fla(fla_config: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """The full config (the `fla` preset with the checkpoint's model) of fla's config.json values.

  Raises ValueError for another model_type and, by name, for options RetNet does not implement.
  """
  if fla_config.get("model_type") != "retnet":
    raise ValueError(f"config.json has model_type={fla_config.get('model_type')!r}; only fla's RetNet "
                     "(model_type 'retnet') converts.")
  options = {**FLA_DEFAULTS, **{name: fla_config[name] for name in FLA_DEFAULTS if name in fla_config}}
  wrong = [f"{name}={options[name]!r} (needs {TYPE_NAMES[kind]})"
           for name, kind in OPTION_TYPES.items()
           if not (options[name] is None and FLA_DEFAULTS[name] is None) and not _is_type(options[name], kind)]
  if wrong:
    raise ValueError("config.json gives options of the wrong type: " + "; ".join(wrong) + "; fix config.json.")
  options["attn"] = options["attn"] or None  # an empty list of attention layers is no hybrid
  problems = [f"{name}={options[name]!r} ({what}; supported: {supported!r})"
              for name, (supported, what) in UNSUPPORTED_OPTIONS.items() if options[name] != supported]
  if problems:
    raise ValueError("the fla config uses what RetNet does not implement: " + "; ".join(problems) + ".")
  d_model = int(options["hidden_size"])
  attention = _attention_fields(options["attn"], options["num_heads"])
  value_dim = round(d_model * options["expand_v"])
  if not math.isclose(d_model * options["expand_v"], value_dim):
    raise ValueError(f"hidden_size * expand_v = {d_model * options['expand_v']} is not an integer (fla refuses it "
                     "too).")
  num_heads, num_kv_heads = int(options["num_heads"]), options["num_kv_heads"]
  config = presets.get_config("fla")
  config.model.update(presets.FLA_OPTIONS)
  config.model.update(
      vocab_size=int(options["vocab_size"]), d_model=d_model, num_layers=int(options["num_hidden_layers"]),
      num_heads=num_heads, num_kv_heads=None if num_kv_heads in (None, num_heads) else int(num_kv_heads),
      value_dim=value_dim, ffn_dim=ffn_width(options), tie_embeddings=bool(options["tie_word_embeddings"]),
      norm_eps=float(options["norm_eps"]), head_norm_eps=float(options["norm_eps"]),
      head_norm_scale=bool(options["elementwise_affine"]), decay_schedule="retnet", rotation_base=10000.0,
      dtype="float32", **attention)
  model_config.of(config.model)  # checked before any tensor is read
  return config


def _attention_fields(attn: Any, num_heads: int) -> dict[str, Any]:
  """The `model.attention_*` fields of fla's `attn` entry (None, one specification, or a list of them sharing their
  settings) in a model of `num_heads` retention heads, or ValueError naming what RetNet's hybrids do not express."""
  if attn is None:
    return {}
  specs = [attn] if isinstance(attn, dict) else attn
  if not isinstance(specs, list) or not all(isinstance(spec, dict) for spec in specs):
    raise ValueError(f"config.json's attn must be an object (layers, num_heads, ...) or a list of them; got {attn!r}.")
  for spec in specs:
    unknown = sorted(set(spec) - set(ATTN_KEYS))
    if unknown:
      raise ValueError(f"config.json's attn gives {', '.join(unknown)}, which RetNet's hybrids do not implement "
                       f"(supported: {', '.join(ATTN_KEYS)}).")
    missing = [key for key in ("layers", "num_heads") if key not in spec]
    if missing:
      raise ValueError(f"config.json's attn lacks {', '.join(missing)} (fla requires them too).")
  settings = [{**ATTN_DEFAULTS, **{k: v for k, v in spec.items() if k != "layers"}} for spec in specs]
  if any(setting != settings[0] for setting in settings):
    raise ValueError(f"config.json's attn gives {len(specs)} specifications with different settings ({settings}); "
                     "RetNet's hybrids give every attention layer one setting.")
  setting = settings[0]
  if setting["qkv_bias"] is not False:
    raise ValueError(f"config.json's attn has qkv_bias={setting['qkv_bias']!r} (biases on q, k and v; supported: "
                     "false).")
  layers = [layer for spec in specs for layer in (spec["layers"] if isinstance(spec["layers"], list) else [None])]
  wrong = [f"layers={[spec['layers'] for spec in specs]!r} (needs lists of layer indices)"
           if not all(_is_type(layer, "int") for layer in layers) else None]
  wrong += [f"{name}={setting[name]!r} (needs {TYPE_NAMES[kind]})" for name, kind in (
      ("num_heads", "int"), ("num_kv_heads", "int"), ("window_size", "int"), ("rope_theta", "number"))
      if not (setting[name] is None and name in ("num_kv_heads", "window_size")) and not _is_type(setting[name], kind)]
  if any(wrong):
    raise ValueError("config.json's attn gives options of the wrong type: " + "; ".join(filter(None, wrong)) +
                     "; fix config.json.")
  heads = int(setting["num_heads"])
  kv_heads = setting["num_kv_heads"]
  return dict(attention_layers=tuple(sorted(int(layer) for layer in layers)),
              attention_num_heads=None if heads == num_heads else heads,
              attention_num_kv_heads=None if kv_heads in (None, heads) else int(kv_heads),
              attention_window=None if setting["window_size"] is None else int(setting["window_size"]),
              attention_rotation_base=float(setting["rope_theta"]))


def _is_type(value: Any, kind: str) -> bool:
  """Whether a JSON value is of `kind` (OPTION_TYPES): bools are not numbers, 2.0 is an int, 2.5 is not."""
  if kind == "bool":
    return isinstance(value, bool)
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    return False
  return kind == "number" or float(value).is_integer()


def _check_tensors(specs: Mapping[str, tuple], expected: Mapping[str, tuple[int, ...]], ignored: set[str]) -> None:
  """Names every tensor missing, left over, of another shape or of an unsupported dtype."""
  missing, extra = sorted(set(expected) - set(specs)), sorted(set(specs) - set(expected) - ignored)
  if missing or extra:
    raise ValueError("the safetensors do not match an fla RetNet of this config.json: "
                     f"missing tensors: [{listing(missing)}]; unexpected tensors: [{listing(extra)}].")
  for name, shape in expected.items():
    if specs[name][1] != shape:
      raise ValueError(f"{name} has shape {specs[name][1]} but config.json needs {shape}.")
    if specs[name][2] not in DTYPES:
      raise ValueError(f"{name} is stored as {specs[name][2]}; supported: {sorted(DTYPES)}.")


def _read_json(path: Path) -> dict[str, Any]:
  if not path.is_file():
    raise FileNotFoundError(f"{path} is missing; point at the folder of an fla RetNet checkpoint (config.json, "
                            "model.safetensors).")
  try:
    value = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is not valid JSON ({e}).") from e
  if not isinstance(value, dict):
    raise ValueError(f"{path} holds a JSON {type(value).__name__}, not an object.")
  return value


def load_fla(checkpoint_dir: str | Path, placement: sharding.Placement | None = None, scan_layers: bool = False
             ) -> tuple[Model, ml_collections.ConfigDict]:
  """An fla RetNet checkpoint folder as a RetNet: `model(tokens, mode=...)` gives fla's logits in every form.

  Args:
    checkpoint_dir: the folder: config.json (model_type retnet), model.safetensors or the shards of
      model.safetensors.index.json, and optionally tokenizer.json (then `config.data.tokenizer`).
    placement: the mesh and rules to place each parameter on as it is read (None: the default device).
    scan_layers: build the model with its blocks stacked (`model.scan_layers`).
  Returns:
    (model, config): the model and the full config (the `fla` preset with the checkpoint's model fields).
  """
  folder = Path(checkpoint_dir)
  fla_config = _read_json(folder / "config.json")
  config = config_from_fla(fla_config)
  if (folder / "tokenizer.json").is_file():
    config.data.tokenizer = str((folder / "tokenizer.json").resolve())
    tokenizer_lib.load(config.data.tokenizer, vocab_size=config.model.vocab_size)  # refused if it outgrows V
  tensors = SafetensorsFolder(folder)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Model(config.model, rngs=nnx.Rngs(0))))
  targets = traverse_util.flatten_dict(nnx.to_pure_dict(state))
  fuse_norm = bool(fla_config.get("fuse_norm", FLA_DEFAULTS["fuse_norm"]))
  names = {path: fla_names(path, fuse_norm) for path in targets}
  # fla ties lm_head to the embeddings whatever a stored lm_head.weight holds.
  ignored = {TOP_NAMES[("head", "kernel")]} if config.model.tie_embeddings else set()
  heads, kv_heads = attention.HYBRID.settings(model_config.of(config.model))[:2]
  expected = {}
  for path, target in targets.items():
    d_model, width = target.shape if len(names[path]) > 1 else (None, None)
    head_dim = None if width is None else width // (heads + 2 * kv_heads)
    shapes = ([(d_model, n * head_dim) for n in (heads, kv_heads, kv_heads)] if width is not None else
              [tuple(target.shape)])  # a fused q/k/v kernel: fla's q, k, v
    expected.update({name: shape[::-1] if path[-1] == "kernel" else shape for name, shape in zip(names[path], shapes)})
  _check_tensors(tensors.specs, expected, ignored)
  if placement is None:
    shardings = {path: jax.sharding.SingleDeviceSharding(jax.devices()[0]) for path in targets}
  else:
    shardings = traverse_util.flatten_dict(nnx.to_pure_dict(
        sharding.tree_shardings(state, placement.mesh, placement.rules)))
  arrays = {}
  for path, target in targets.items():
    # torch Linear weights are [out, in]; our kernels [in, out]
    parts = [host.T if path[-1] == "kernel" else host for host in map(tensors.read, names[path])]
    host = fuse_qkv(*parts, kv_heads) if len(parts) > 1 else parts[0]
    del parts
    arrays[path] = jax.make_array_from_callback(target.shape, shardings[path], host.__getitem__)
    del host
  nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(arrays))
  config.model.scan_layers = scan_layers
  return layer_stack.as_layout(nnx.merge(graphdef, state), scan_layers), config
