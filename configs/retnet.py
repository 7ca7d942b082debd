"""RetNet configs: `--config=configs/retnet.py:NAME` with NAME one of PRESETS (default `small`).

Overrides from the command line, e.g. `--config.model.num_layers=8 --config.train.steps=500`; the config is
locked, so a misspelt field is an error rather than a silent no-op.
"""

from ml_collections import config_dict

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


def model_config(name: str) -> config_dict.ConfigDict:
  """The `model` section for a preset."""
  if name not in PRESETS:
    raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)} "
                     "(e.g. --config=configs/retnet.py:small).")
  d_model, num_layers, num_heads, value_dim, ffn_dim, vocab_size, tie, chunk_size, dtype = PRESETS[name]
  return config_dict.ConfigDict(dict(
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
      head_norm_eps=1e-6,  # per-head RMSNorm (no affine) epsilon
      norm_eps=1e-6,  # block and final RMSNorm epsilon
      dtype=dtype,  # compute dtype: float32 | bfloat16; parameters are always float32
  ))


def get_config(arg: str | None = None) -> config_dict.ConfigDict:
  name = arg or "small"
  config = config_dict.ConfigDict()
  config.preset = name
  config.seed = 0
  config.model = model_config(name)
  config.lock()
  return config
