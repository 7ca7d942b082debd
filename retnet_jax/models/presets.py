"""Presets as named data, and the locked config (every field with its default) built from one, for either
architecture: RetNet, or the Transformer of the same size (`transformer_config`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ml_collections import config_dict

ARCHITECTURES = ("retnet", "transformer")  # config.model.architecture


@dataclasses.dataclass(frozen=True)
class ModelPreset:
  """A preset's model sizes; `options` holds the other model fields where the preset departs from the defaults."""
  d_model: int
  num_layers: int
  num_heads: int
  value_dim: int  # total value width (all heads)
  ffn_dim: int
  vocab_size: int
  tie_embeddings: bool
  chunk_size: int
  dtype: str
  options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class TrainPreset:
  """A preset's training settings."""
  steps: int
  batch_size: int
  seq_len: int
  learning_rate: float
  warmup_steps: int
  loss_tile: int = 0  # train.loss_tile: tokens per tile of the output projection and loss (0: all at once)


@dataclasses.dataclass(frozen=True)
class Preset:
  """A named preset: its model and its training run."""
  model: ModelPreset
  train: TrainPreset


@dataclasses.dataclass(frozen=True)
class TorchscaleSize:
  """One of the official code's sizes (torchscale's fairseq retnet_* architectures); key head dim 256."""
  d_model: int
  num_layers: int
  num_heads: int
  width: int  # value and FFN width, about 5/3 x d_model


def paper_train(learning_rate: float) -> TrainPreset:
  """The paper's recipe: 25k steps of 2048 x 2048 tokens, 375 warm-up steps; the loss over tiles of 8192 tokens (the
  float32 logits of a tile: 1.6 GB at 50304 tokens of vocabulary)."""
  return TrainPreset(steps=25000, batch_size=2048, seq_len=2048, learning_rate=learning_rate, warmup_steps=375,
                     loss_tile=8192)


def paper_preset(d_model: int, num_layers: int, num_heads: int, ffn_dim: int, learning_rate: float) -> Preset:
  """A paper size: value width 2 x d_model, 50304 tokens, tied embeddings, bfloat16, scanned layers (unrolled, the
  compiled train step holds every layer's chunk states and FFN activations at once, whatever the remat policy:
  2.8x the temporaries, docs/aot.md), the paper's recipe."""
  model = ModelPreset(d_model=d_model, num_layers=num_layers, num_heads=num_heads, value_dim=2 * d_model,
                      ffn_dim=ffn_dim, vocab_size=50304, tie_embeddings=True, chunk_size=256, dtype="bfloat16",
                      options=MappingProxyType(dict(scan_layers=True)))
  return Preset(model=model, train=paper_train(learning_rate))


# Paper sizes: value width 2 x d_model, key head dim 256, value head dim 512. The GLU FFN (three matrices) is
# 4/3 x d_model wide so that it holds as many parameters as the paper's 2 x d_model plain FFN.
PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        model=ModelPreset(d_model=32, num_layers=2, num_heads=2, value_dim=64, ffn_dim=64, vocab_size=256,
                          tie_embeddings=False, chunk_size=8, dtype="float32"),
        train=TrainPreset(steps=200, batch_size=8, seq_len=64, learning_rate=3e-3, warmup_steps=20)),
    "small": Preset(
        model=ModelPreset(d_model=256, num_layers=4, num_heads=4, value_dim=512, ffn_dim=512, vocab_size=256,
                          tie_embeddings=False, chunk_size=64, dtype="float32"),
        train=TrainPreset(steps=900, batch_size=8, seq_len=256, learning_rate=3e-3, warmup_steps=100)),
    "1.3b": paper_preset(d_model=2048, num_layers=24, num_heads=8, ffn_dim=2688, learning_rate=6e-4),
    "2.7b": paper_preset(d_model=2560, num_layers=32, num_heads=10, ffn_dim=3456, learning_rate=3e-4),
    "6.7b": paper_preset(d_model=4096, num_layers=32, num_heads=16, ffn_dim=5504, learning_rate=3e-4),
}

# Checkpoints converted from torchscale (scripts/convert_torchscale.py) get the preset of their size with the
# checkpoint's vocabulary.
TORCHSCALE_SIZES: dict[str, TorchscaleSize] = {
    "base": TorchscaleSize(d_model=512, num_layers=6, num_heads=2, width=864),
    "medium": TorchscaleSize(d_model=1024, num_layers=16, num_heads=4, width=1728),
    "xl": TorchscaleSize(d_model=2048, num_layers=24, num_heads=8, width=3456),
    "3b": TorchscaleSize(d_model=2560, num_layers=32, num_heads=10, width=4280),
    "7b": TorchscaleSize(d_model=4096, num_layers=32, num_heads=16, width=6912),
    "13b": TorchscaleSize(d_model=5120, num_layers=40, num_heads=20, width=8560),
    "65b": TorchscaleSize(d_model=8192, num_layers=64, num_heads=32, width=13824),
}

# torchscale's recipe: swish GLU, embeddings scaled by sqrt(d_model), and its own stability normaliser.
TORCHSCALE_OPTIONS: Mapping[str, Any] = MappingProxyType(dict(
    ffn_activation="swish", scale_embedding=True, stability_norm_style="torchscale"))


def torchscale_preset(size: TorchscaleSize) -> Preset:
  """The preset of a torchscale size: its recipe, with the paper's learning rates (6e-4 up to 1.3B, 3e-4 above)."""
  model = ModelPreset(d_model=size.d_model, num_layers=size.num_layers, num_heads=size.num_heads,
                      value_dim=size.width, ffn_dim=size.width, vocab_size=50304, tie_embeddings=False,
                      chunk_size=512, dtype="bfloat16", options=TORCHSCALE_OPTIONS)
  return Preset(model=model, train=paper_train(6e-4 if size.d_model <= 2048 else 3e-4))


PRESETS.update({f"torchscale_{name}": torchscale_preset(size) for name, size in TORCHSCALE_SIZES.items()})

# flash-linear-attention's RetNet (scripts/convert_fla.py): half-split rotation pairs at RoPE frequencies, no
# stability normaliser, a learned per-head norm scale shared by the heads, swish GLU.
FLA_OPTIONS: Mapping[str, Any] = MappingProxyType(dict(
    ffn_activation="swish", stability_norm=False, rotation_pairs="half", rotation_freqs="rope",
    head_norm_scale=True))
# fla's RetNetConfig defaults (1.3B): value width 2 x d_model, FFN from hidden_ratio=2, a 32000-token vocabulary.
PRESETS["fla"] = Preset(
    model=ModelPreset(d_model=2048, num_layers=24, num_heads=8, value_dim=4096, ffn_dim=2816, vocab_size=32000,
                      tie_embeddings=False, chunk_size=256, dtype="bfloat16", options=FLA_OPTIONS),
    train=paper_train(6e-4))


def preset(name: str) -> Preset:
  """The preset called `name`; ValueError naming the choices for an unknown one."""
  if name not in PRESETS:
    raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)} "
                     "(e.g. --config=configs/retnet.py:small).")
  return PRESETS[name]


def model_config(name: str) -> config_dict.ConfigDict:
  """The `model` section for a preset: its values (each field's type and meaning: `model_config`'s sections,
  docs/config.md)."""
  sizes = preset(name).model
  model = config_dict.ConfigDict(dict(
      architecture="retnet",
      mixer="retention",
      vocab_size=sizes.vocab_size,
      d_model=sizes.d_model,
      num_layers=sizes.num_layers,
      num_heads=sizes.num_heads,
      num_kv_heads=config_dict.placeholder(int),
      value_dim=sizes.value_dim,
      ffn_dim=sizes.ffn_dim,
      ffn_activation="gelu",
      tie_embeddings=sizes.tie_embeddings,
      chunk_size=sizes.chunk_size,
      decay_schedule="retnet",
      decay_gammas=config_dict.placeholder(tuple),
      rotation_base=10000.0,
      rotation_pairs="interleaved",
      rotation_freqs="linspace",
      stability_norm=True,
      stability_norm_style="shared",
      gate_logit_normalizer=16.0,
      gate_init="yoco",
      head_norm_eps=1e-6,
      head_norm_scale=False,
      norm_eps=1e-6,
      scale_embedding=False,
      embed_norm=False,
      dtype=sizes.dtype,
      param_dtype="float32",
      matmul_precision="default",
      retention_impl="xla",
      kernel_layout="split",
      scan_layers=False,
      attention_layers=(),
      attention_num_heads=config_dict.placeholder(int),
      attention_num_kv_heads=config_dict.placeholder(int),
      attention_window=config_dict.placeholder(int),
      attention_rotation_base=10000.0,
      attention_max_len=max(preset(name).train.seq_len, 1024),
  ))
  model.update(dict(sizes.options))
  return model


def transformer_config(retnet_model: config_dict.ConfigDict, max_len: int) -> config_dict.ConfigDict:
  """The `model` section of the Transformer of RetNet model section `retnet_model`'s size, with a KV cache of
  `max_len` tokens.

  Attention holds 4 d^2 parameters against retention's 2 d^2 + 3 d d_v (gate and wider values); as in the
  paper, the difference goes to the FFN: ffn_dim + d_v - 2 d / 3, rounded to a multiple of 8. Embedding,
  activation, tying, rotation frequencies, norm epsilon, dtype and matmul precision are RetNet's.
  """
  ffn_dim = retnet_model.ffn_dim + retnet_model.value_dim - 2 * retnet_model.d_model / 3
  return config_dict.ConfigDict(dict(
      architecture="transformer",
      vocab_size=retnet_model.vocab_size,
      d_model=retnet_model.d_model,
      num_layers=retnet_model.num_layers,
      num_heads=retnet_model.num_heads,
      ffn_dim=max(8, 8 * round(ffn_dim / 8)),
      ffn_activation=retnet_model.ffn_activation,
      tie_embeddings=retnet_model.tie_embeddings,
      rotation_base=retnet_model.rotation_base,
      rotation_freqs=retnet_model.rotation_freqs,
      norm_eps=retnet_model.norm_eps,
      dtype=retnet_model.dtype,
      param_dtype=retnet_model.param_dtype,
      matmul_precision=retnet_model.matmul_precision,
      max_len=max_len,
      scan_layers=retnet_model.scan_layers,
  ))


# Each architecture's model section from the preset's RetNet section and training run (the Transformer's with a KV
# cache for the training length, at least 1024 tokens).
MODEL_SECTIONS = MappingProxyType({
    "retnet": lambda retnet_model, run: retnet_model,
    "transformer": lambda retnet_model, run: transformer_config(retnet_model, max(run.seq_len, 1024))})


def get_config(name: str, architecture: str = "retnet") -> config_dict.ConfigDict:
  """The full locked config of the preset called `name`, for `architecture` (retnet | transformer): every field's
  value (its type and meaning: the typed sections that `training.run_config.build` makes of it, docs/config.md)."""
  if architecture not in ARCHITECTURES:
    raise ValueError(f"unknown architecture {architecture!r}; choose one of {ARCHITECTURES}.")
  config = config_dict.ConfigDict()
  config.preset = name
  config.seed = 0
  config.model = model_config(name)
  run = preset(name).train
  config.model = MODEL_SECTIONS[architecture](config.model, run)

  config.data = config_dict.ConfigDict(dict(
      files=(),
      prepared=(),
      prepared_weights=(),
      hub_dataset=config_dict.placeholder(str),
      hub_config=config_dict.placeholder(str),
      text_field="text",
      tokenizer="byte",
      validation_files=(),
      validation_fraction=0.1,
      reset_at_documents=False,
      synthetic=config_dict.placeholder(str),
      mqar=config_dict.ConfigDict(dict(
          vocab_size=config_dict.placeholder(int),
          num_pairs=8,
          query_placement="power",
          power_a=0.01,
      )),
      passkey=config_dict.ConfigDict(dict(
          depth=config_dict.placeholder(float),
          digits=5,
      )),
  ))

  config.train = config_dict.ConfigDict(dict(
      steps=run.steps,
      batch_size=run.batch_size,
      seq_len=run.seq_len,
      grad_accum_steps=1,
      mode="chunkwise" if "chunk_size" in config.model and run.seq_len > 512 else "parallel",
      learning_rate=run.learning_rate,
      lr_schedule="cosine",
      warmup_steps=run.warmup_steps,
      end_lr_fraction=0.1,
      b1=0.9,
      b2=0.98,
      weight_decay=0.05,
      grad_clip_norm=1.0,
      remat="none",
      segment_len=0,
      loss_tile=run.loss_tile,
      optimizer_state_dtype="float32",
      nonfinite="stop",
      log_every_steps=50,
      eval_every_steps=300,
      eval_batches=8,
      profile_steps=config_dict.placeholder(tuple),
  ))

  config.checkpoint = config_dict.ConfigDict(dict(
      every_steps=300,
      keep=3,
      keep_best=True,
      async_save=True,
  ))

  config.mesh = config_dict.ConfigDict(dict(
      shape=(-1, 1, 1, 1),
      axis_names=("data", "fsdp", "tensor", "sequence"),
      rules=(("batch", ("data", "fsdp")), ("vocab", "tensor"), ("embed", "fsdp"), ("heads", "tensor"),
             ("mlp", "tensor"), ("length", "sequence")),
  ))
  config.lock()
  return config


# The model section's fields per architecture.
MODEL_FIELDS: Mapping[str, frozenset[str]] = MappingProxyType({
    "retnet": frozenset(model_config("tiny")), "transformer": frozenset(transformer_config(model_config("tiny"), 1))})
