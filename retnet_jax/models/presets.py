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
  """The `model` section for a preset."""
  sizes = preset(name).model
  model = config_dict.ConfigDict(dict(
      architecture="retnet",  # retnet | transformer (configs/transformer.py)
      # every layer's token mixer but attention_layers' (`architectures.MIXERS`): retention | gated_retention
      # (YOCO's per-token decay: decay_schedule, decay_gammas and the stability_norm fields are not read)
      mixer="retention",
      vocab_size=sizes.vocab_size,
      d_model=sizes.d_model,
      num_layers=sizes.num_layers,
      num_heads=sizes.num_heads,
      # key/value heads, each shared by num_heads / num_kv_heads query heads; None: num_heads
      num_kv_heads=config_dict.placeholder(int),
      value_dim=sizes.value_dim,  # total value width (all heads); the paper uses 2 x d_model
      ffn_dim=sizes.ffn_dim,
      ffn_activation="gelu",  # gelu (exact) | gelu_tanh | swish | relu
      tie_embeddings=sizes.tie_embeddings,
      chunk_size=sizes.chunk_size,  # chunk length of the chunkwise form
      decay_schedule="retnet",  # retnet: 1 - 2^(-5-h) | logspace: the paper's experiments | explicit
      decay_gammas=config_dict.placeholder(tuple),  # one gamma per head, for decay_schedule="explicit"
      rotation_base=10000.0,
      rotation_pairs="interleaved",  # interleaved: features (2j, 2j+1) (torchscale) | half: (j, j + d_k/2) (fla)
      rotation_freqs="linspace",  # linspace: base^(-j/(d_k/2-1)) (torchscale) | rope: base^(-2j/d_k) (fla)
      stability_norm=True,  # divide raw retention by sqrt(sum of decays) and the clamped score sum
      # shared: one scalar that every form computes alike (forms agree exactly) | torchscale: the official
      # code's per-form scalars (its outputs reproduced form by form; forms agree up to head_norm_eps)
      stability_norm_style="shared",
      gate_logit_normalizer=16.0,  # gated_retention: log gamma_t = logsigmoid(x_t W_gt) / this (YOCO: 16)
      # gated_retention's gate at initialisation: yoco (no bias: every head near 2^(-1/16)) | retnet (a learned
      # per-head bias starting head h at RetNet's decay 1 - 2^(-5-h))
      gate_init="yoco",
      head_norm_eps=1e-6,  # per-head RMSNorm epsilon
      head_norm_scale=False,  # a learned scale in the per-head RMSNorm, shared by all heads (fla)
      norm_eps=1e-6,  # block, final and embedding RMSNorm epsilon
      scale_embedding=False,  # multiply token embeddings by sqrt(d_model)
      embed_norm=False,  # RMSNorm on the embeddings before the first block
      dtype=sizes.dtype,  # compute dtype: float32 | bfloat16; training keeps float32 parameters
      # the weights' dtype outside training (evaluation, generation, export): float32 | bfloat16 (half the
      # weight reads of decoding); training always keeps float32 masters
      param_dtype="float32",
      # every matmul's precision: default (on GPUs float32 runs in TF32) | high | highest (exact float32)
      matmul_precision="default",
      # the chunkwise form: xla (einsums) | pallas (fused kernels, GPU) | auto (pallas where it compiles, else xla)
      retention_impl="xla",
      # the Pallas kernels' layout (`kernels.LAYOUTS`): split (a state pass, then chunk-parallel kernels) | fused
      # (one pass over the chunks per head); kept selectable until a GPU run has timed both
      kernel_layout="split",
      # the blocks' parameters stacked on a leading layer axis and run under a scan: compile time independent
      # of depth; the same function as the unrolled blocks, and checkpoints restore across the two layouts
      scan_layers=False,
      # hybrids: these layers (indices) use softmax attention, the Transformer's, in place of retention
      attention_layers=(),
      attention_num_heads=config_dict.placeholder(int),  # None: num_heads
      attention_num_kv_heads=config_dict.placeholder(int),  # None: one key/value head per query head
      # attend to the last W tokens only, through a ring-buffer KV cache of W tokens (decoding memory constant in
      # the context); None: every earlier token
      attention_window=config_dict.placeholder(int),
      attention_rotation_base=10000.0,  # the attention layers' rotary base (fla: rope_theta)
      # KV-cache length of unwindowed attention layers: the longest prompt + generation a decoding state holds
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
      rotation_freqs=retnet_model.rotation_freqs,  # interleaved pairs at these frequencies
      norm_eps=retnet_model.norm_eps,
      dtype=retnet_model.dtype,
      param_dtype=retnet_model.param_dtype,
      matmul_precision=retnet_model.matmul_precision,
      max_len=max_len,  # KV-cache length: the longest prompt + generation a decoding state holds
      scan_layers=retnet_model.scan_layers,  # as RetNet's model.scan_layers
  ))


def check_full_config(config: Any, argument: str = "config") -> None:
  """Raises TypeError, naming what was given and the fix, unless `config` is a full config (model, data, train,
  mesh, ...) as `get_config` builds it."""
  if isinstance(config, config_dict.ConfigDict) and all(name in config for name in ("model", "data", "train", "mesh")):
    return
  if isinstance(config, str):
    got = f"the string {config!r}: build the config with get_config (configs/retnet.py:NAME's get_config('NAME'))"
  elif isinstance(config, config_dict.ConfigDict) and "d_model" in config:
    got = "the model fields alone (config.model): pass the whole config"
  else:
    got = f"a {type(config).__name__}"
  raise TypeError(f"{argument} must be the full config (an ml_collections.ConfigDict with model, data, train, mesh, "
                  f"... as get_config builds it); got {got}.")


# Each architecture's model section from the preset's RetNet section and training run (the Transformer's with a KV
# cache for the training length, at least 1024 tokens).
MODEL_SECTIONS = MappingProxyType({
    "retnet": lambda retnet_model, run: retnet_model,
    "transformer": lambda retnet_model, run: transformer_config(retnet_model, max(run.seq_len, 1024))})


def get_config(name: str, architecture: str = "retnet") -> config_dict.ConfigDict:
  """The full locked config of the preset called `name`, for `architecture` (retnet | transformer)."""
  if architecture not in ARCHITECTURES:
    raise ValueError(f"unknown architecture {architecture!r}; choose one of {ARCHITECTURES}.")
  config = config_dict.ConfigDict()
  config.preset = name
  config.seed = 0
  config.model = model_config(name)
  run = preset(name).train
  config.model = MODEL_SECTIONS[architecture](config.model, run)

  config.data = config_dict.ConfigDict(dict(
      files=(),  # local .txt / .jsonl / .json / .parquet files; empty: the shipped corpus data/tinyshakespeare.txt
      # corpora prepared by scripts/prepare_data.py (directories), read through Grain instead of files; several
      # are mixed by prepared_weights (empty: in proportion to their training tokens)
      prepared=(),
      prepared_weights=(),
      hub_dataset=config_dict.placeholder(str),  # a datasets hub name (needs network), instead of files
      hub_config=config_dict.placeholder(str),
      text_field="text",  # the column holding text in JSON lines / parquet / hub datasets
      tokenizer="byte",  # byte | path to a tokenizers tokenizer.json
      validation_files=(),  # explicit validation files; empty: hold out the last validation_fraction
      validation_fraction=0.1,
      # packed documents: batches carry each token's document id and retention (attention) resets where a
      # document (a .txt file, a JSON-lines / Parquet / hub dataset row; a synthetic task's row) starts
      reset_at_documents=False,
      # a synthetic task instead of text (retnet_jax/input_pipeline/synthetic.py), the loss on its answers only: None |
      # mqar | passkey
      synthetic=config_dict.placeholder(str),
      mqar=config_dict.ConfigDict(dict(  # multi-query associative recall (Zoology)
          vocab_size=config_dict.placeholder(int),  # keys [1, V/2), values [V/2, V); None: model.vocab_size
          num_pairs=8,  # key-value pairs per example, each queried once
          query_placement="power",  # power: Zoology's slot weights s^(power_a - 1) | uniform | packed: right after
          power_a=0.01,
      )),
      # a key hidden in filler text, asked for at the end (retnet_jax/input_pipeline/passkey.py)
      passkey=config_dict.ConfigDict(dict(
          depth=config_dict.placeholder(float),  # fraction of the filler before the key; None: uniform per example
          digits=5,
      )),
  ))

  config.train = config_dict.ConfigDict(dict(
      steps=run.steps,
      batch_size=run.batch_size,  # global batch, in sequences
      seq_len=run.seq_len,
      grad_accum_steps=1,  # micro-batches per step (batch_size must divide evenly)
      # the form used for training: parallel | chunkwise (RetNet only)
      mode="chunkwise" if "chunk_size" in config.model and run.seq_len > 512 else "parallel",
      learning_rate=run.learning_rate,
      lr_schedule="cosine",  # cosine | linear decay after warm-up
      warmup_steps=run.warmup_steps,
      end_lr_fraction=0.1,  # final learning rate as a fraction of the peak
      b1=0.9,
      b2=0.98,
      weight_decay=0.05,  # not applied to norm scales
      grad_clip_norm=1.0,
      # jax.checkpoint policy per block (no saving on CPU): none | full | dots_saveable |
      # dots_with_no_batch_dims_saveable
      remat="none",
      # > 0: backpropagate through segments of this many tokens carrying the state, recomputing one segment
      # at a time (memory grows with the segment, not seq_len, for one more forward pass); 0: whole sequences.
      # RetNet only
      segment_len=0,
      # > 0: the output projection, logsumexp and loss (and their gradients) computed over tiles of this many
      # tokens, so the [tokens, vocab] logits never exist for the whole batch; 0: all tokens at once
      loss_tile=run.loss_tile,
      # the AdamW moments' dtype: float32 | bfloat16 (the first moment only, as MaxText allows; the second stays
      # float32)
      optimizer_state_dtype="float32",
      nonfinite="stop",  # a NaN/Inf loss or gradient: stop (naming the step) | skip (the update, counted)
      log_every_steps=50,
      eval_every_steps=300,
      eval_batches=8,
      profile_steps=config_dict.placeholder(tuple),  # (first, last) step of a profiler trace
  ))

  config.checkpoint = config_dict.ConfigDict(dict(
      every_steps=300,
      keep=3,  # the last K checkpoints are kept
      keep_best=True,  # also keep the one with the best validation loss
      async_save=True,
  ))

  config.mesh = config_dict.ConfigDict(dict(
      # sizes of the (data, fsdp, tensor, sequence) axes; -1 takes the remaining devices. A shape with fewer
      # entries than axis_names (e.g. an older (data, fsdp, tensor) one) gives the axes left out size 1.
      shape=(-1, 1, 1, 1),
      axis_names=("data", "fsdp", "tensor", "sequence"),
      # logical axis -> mesh axis (or None); swap these to change the parallelism without code changes. `length`
      # (the token axis of activations) over `sequence` > 1 splits each sequence over those devices
      # (sequence-parallel retention, retnet_jax.mixers.sequence_parallel).
      rules=(("batch", ("data", "fsdp")), ("vocab", "tensor"), ("embed", "fsdp"), ("heads", "tensor"),
             ("mlp", "tensor"), ("length", "sequence")),
  ))
  config.lock()
  return config


# The model section's fields per architecture.
MODEL_FIELDS: Mapping[str, frozenset[str]] = MappingProxyType({
    "retnet": frozenset(model_config("tiny")), "transformer": frozenset(transformer_config(model_config("tiny"), 1))})
