"""RetNet configs: `--config=configs/retnet.py:NAME` with NAME one of PRESETS (default `small`).

Overrides from the command line, e.g. `--config.model.num_layers=8 --config.train.steps=500`; the config is
locked, so a misspelt field is an error rather than a silent no-op.
"""

from ml_collections import config_dict

# Training settings per preset: (steps, batch_size, seq_len, learning_rate, warmup_steps).
TRAIN = {
    "tiny": (200, 8, 64, 3e-3, 20),
    "small": (900, 8, 256, 3e-3, 100),  # ~14 min on a 2-core CPU: validation ~1.5 nats/char
    "1.3b": (25000, 2048, 2048, 6e-4, 375),
    "2.7b": (25000, 2048, 2048, 3e-4, 375),
    "6.7b": (25000, 2048, 2048, 3e-4, 375),
}

# name: (d_model, num_layers, num_heads, value_dim, ffn_dim, vocab_size, tie_embeddings, chunk_size, dtype)
# Paper sizes: value width 2 x d_model, key head dim 256, value head dim 512. The GLU FFN (three matrices) is
# 4/3 x d_model wide so that it holds as many parameters as the paper's 2 x d_model plain FFN.
PRESETS = {
    "tiny": (32, 2, 2, 64, 64, 256, False, 8, "float32"),
    "small": (256, 4, 4, 512, 512, 256, False, 64, "float32"),
    "1.3b": (2048, 24, 8, 4096, 2688, 50304, True, 256, "bfloat16"),
    "2.7b": (2560, 32, 10, 5120, 3456, 50304, True, 256, "bfloat16"),
    "6.7b": (4096, 32, 16, 8192, 5504, 50304, True, 256, "bfloat16"),
}

# The official code's sizes (torchscale's fairseq retnet_* architectures): (d_model, num_layers, num_heads,
# value and FFN width about 5/3 x d_model); key head dim 256. Checkpoints converted from torchscale
# (scripts/convert_torchscale.py) get the preset of their size with the checkpoint's vocabulary.
TORCHSCALE_SIZES = {
    "base": (512, 6, 2, 864),
    "medium": (1024, 16, 4, 1728),
    "xl": (2048, 24, 8, 3456),
    "3b": (2560, 32, 10, 4280),
    "7b": (4096, 32, 16, 6912),
    "13b": (5120, 40, 20, 8560),
    "65b": (8192, 64, 32, 13824),
}
PRESETS.update({f"torchscale_{name}": (d, layers, heads, width, width, 50304, False, 512, "bfloat16")
                for name, (d, layers, heads, width) in TORCHSCALE_SIZES.items()})
# The paper's recipe, with its learning rates: 6e-4 up to 1.3B parameters, 3e-4 above.
TRAIN.update({f"torchscale_{name}": (25000, 2048, 2048, 6e-4 if d <= 2048 else 3e-4, 375)
              for name, (d, *_) in TORCHSCALE_SIZES.items()})

# Model fields beyond the PRESETS columns where a preset departs from the defaults. torchscale's recipe: swish
# GLU, embeddings scaled by sqrt(d_model), and its own stability normaliser.
PRESET_OPTIONS = {name: dict(ffn_activation="swish", scale_embedding=True, stability_norm_style="torchscale")
                  for name in PRESETS if name.startswith("torchscale_")}


def model_config(name: str) -> config_dict.ConfigDict:
  """The `model` section for a preset."""
  if name not in PRESETS:
    raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)} "
                     "(e.g. --config=configs/retnet.py:small).")
  d_model, num_layers, num_heads, value_dim, ffn_dim, vocab_size, tie, chunk_size, dtype = PRESETS[name]
  model = config_dict.ConfigDict(dict(
      vocab_size=vocab_size,
      d_model=d_model,
      num_layers=num_layers,
      num_heads=num_heads,
      value_dim=value_dim,  # total value width (all heads); the paper uses 2 x d_model
      ffn_dim=ffn_dim,
      ffn_activation="gelu",  # gelu (exact) | gelu_tanh | swish | relu
      tie_embeddings=tie,
      chunk_size=chunk_size,  # chunk length of the chunkwise form
      decay_schedule="retnet",  # retnet: 1 - 2^(-5-h) | logspace: the paper's experiments | explicit
      decay_gammas=config_dict.placeholder(tuple),  # one gamma per head, for decay_schedule="explicit"
      rotation_base=10000.0,
      stability_norm=True,  # divide raw retention by sqrt(sum of decays) and the clamped score sum
      # shared: one scalar that every form computes alike (forms agree exactly) | torchscale: the official
      # code's per-form scalars (its outputs reproduced form by form; forms agree up to head_norm_eps)
      stability_norm_style="shared",
      head_norm_eps=1e-6,  # per-head RMSNorm (no affine) epsilon
      norm_eps=1e-6,  # block, final and embedding RMSNorm epsilon
      scale_embedding=False,  # multiply token embeddings by sqrt(d_model)
      embed_norm=False,  # RMSNorm on the embeddings before the first block
      dtype=dtype,  # compute dtype: float32 | bfloat16; parameters are always float32
  ))
  model.update(PRESET_OPTIONS.get(name, {}))
  return model


def get_config(arg: str | None = None) -> config_dict.ConfigDict:
  name = arg or "small"
  config = config_dict.ConfigDict()
  config.preset = name
  config.seed = 0
  config.model = model_config(name)
  steps, batch_size, seq_len, lr, warmup = TRAIN[name]

  config.data = config_dict.ConfigDict(dict(
      files=(),  # local .txt / .jsonl / .json / .parquet files; empty: the shipped corpus data/tinyshakespeare.txt
      hub_dataset=config_dict.placeholder(str),  # a datasets hub name (needs network), instead of files
      hub_config=config_dict.placeholder(str),
      text_field="text",  # the column holding text in JSON lines / parquet / hub datasets
      tokenizer="byte",  # byte | path to a tokenizers tokenizer.json
      validation_files=(),  # explicit validation files; empty: hold out the last validation_fraction
      validation_fraction=0.1,
  ))

  config.train = config_dict.ConfigDict(dict(
      steps=steps,
      batch_size=batch_size,  # global batch, in sequences
      seq_len=seq_len,
      grad_accum_steps=1,  # micro-batches per step (batch_size must divide evenly)
      mode="chunkwise" if seq_len > 512 else "parallel",  # retention form used for training
      learning_rate=lr,
      lr_schedule="cosine",  # cosine | linear decay after warm-up
      warmup_steps=warmup,
      end_lr_fraction=0.1,  # final learning rate as a fraction of the peak
      b1=0.9,
      b2=0.98,
      weight_decay=0.05,  # not applied to norm scales
      grad_clip_norm=1.0,
      remat="none",  # none | full | dots_saveable: jax.checkpoint policy per block (no saving on CPU)
      # > 0: backpropagate through segments of this many tokens carrying the state, recomputing one segment
      # at a time (memory grows with the segment, not seq_len; ~20-40% more time); 0: whole sequences
      segment_len=0,
      nonfinite="stop",  # a NaN/Inf loss or gradient: stop (naming the step) | skip (the update, counted)
      inject_nonfinite_steps=(),  # steps whose loss is forced to NaN, to exercise the guard
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
      shape=(-1, 1, 1),  # sizes of the (data, fsdp, tensor) axes; -1 takes the remaining devices
      axis_names=("data", "fsdp", "tensor"),
      # logical axis -> mesh axis (or None); swap these to change the parallelism without code changes
      rules=(("batch", ("data", "fsdp")), ("vocab", "tensor"), ("embed", "fsdp"), ("heads", "tensor"),
             ("mlp", "tensor")),
  ))
  config.lock()
  return config
