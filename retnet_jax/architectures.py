"""The model architectures that `config.model.architecture` chooses: RetNet, or the Transformer of its size.

    architectures.check_config(config.model)                  # before any work
    model = architectures.build(config.model, rngs=nnx.Rngs(seed))
    logits_BxLxV, state = model(tokens_BxL, mode=architectures.modes(config.model)[0], state=None)

Both take `model(tokens, mode, state)` and return `(logits, state)`, so training, evaluation, checkpoints and
sampling build and run either through this module; only the forms differ (the Transformer has no chunkwise form).
"""

from __future__ import annotations

import ml_collections
from flax import nnx

from retnet_jax import config_checks, layers, model as model_lib, presets, transformer

ARCHITECTURES = presets.ARCHITECTURES
Model = model_lib.RetNet | transformer.Transformer
# The forms each architecture computes, `parallel` first, as its model module defines them.
MODES = {"retnet": model_lib.MODES, "transformer": transformer.MODES}
ALL_MODES = tuple(dict.fromkeys(mode for forms in MODES.values() for mode in forms))  # any architecture's
# The forms that run whole sequences (training, prefill); the recurrent form decodes one token at a time.
SEQUENCE_MODES = tuple(mode for mode in ALL_MODES if mode != "recurrent")
# The forms a prompt is prefilled in, the default first: chunkwise, whose memory grows linearly in the prompt.
PREFILL_MODES = tuple(sorted(SEQUENCE_MODES, key=lambda mode: mode != "chunkwise"))


def architecture(cfg: ml_collections.ConfigDict) -> str:
  """`cfg.architecture`, or ValueError naming it and the choices if it is unknown."""
  return config_checks.choice(cfg.get("architecture"), "model.architecture", ARCHITECTURES,
                              otherwise=" (--config=configs/retnet.py:NAME or --config=configs/transformer.py:NAME)")


def check_config(cfg: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the bad value and the fix for a model section that cannot be built: an unknown
  architecture, another architecture's fields, or a bad value of its own."""
  name = architecture(cfg)
  missing, foreign = sorted(presets.MODEL_FIELDS[name] - set(cfg)), sorted(set(cfg) - presets.MODEL_FIELDS[name])
  if missing or foreign:
    parts = ([f"it lacks {', '.join('model.' + k for k in missing)}"] if missing else []) + (
        [f"{', '.join('model.' + k for k in foreign)} are not {name} fields"] if foreign else [])
    raise ValueError(f"model.architecture={name!r} does not fit this model section ({'; '.join(parts)}); take "
                     f"the whole section from configs/{name}.py, e.g. --config=configs/{name}.py:small.")
  if name == "retnet":
    model_lib.check_model_config(cfg)
  else:
    transformer.check_config(cfg)
  config_checks.choice(cfg.param_dtype, "model.param_dtype", layers.DTYPES,
                       why="the weights' dtype for evaluation, generation and export")


def check_training(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the option and the fix for train options the architecture lacks (the chunkwise
  form and state-carrying segments are retention's)."""
  if architecture(config.model) != "transformer":
    return
  if config.train.mode != "parallel":
    raise ValueError(f"train.mode={config.train.mode!r}: a Transformer trains in the parallel form (chunkwise is a "
                     "retention form, recurrent is for decoding); set --config.train.mode=parallel.")
  if config.train.segment_len:
    raise ValueError(f"train.segment_len={config.train.segment_len}: segments carry retention's fixed-size state; "
                     "a Transformer's KV cache grows with the sequence, so they would not bound its memory. Set "
                     "--config.train.segment_len=0 (train.remat trades compute for memory instead).")


def modes(cfg: ml_collections.ConfigDict) -> tuple[str, ...]:
  """The forms the model of `cfg` computes: parallel, chunkwise, recurrent for RetNet; parallel, recurrent for the
  Transformer."""
  return MODES[architecture(cfg)]


def prefill_modes(cfg: ml_collections.ConfigDict) -> tuple[str, ...]:
  """The forms of PREFILL_MODES the model of `cfg` computes, its default first: chunkwise, parallel for RetNet;
  parallel for the Transformer."""
  return tuple(mode for mode in PREFILL_MODES if mode in modes(cfg))


def build(cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs) -> Model:
  """The model of model section `cfg`, parameters drawn from `rngs` (its constructor checks `cfg`)."""
  if architecture(cfg) == "transformer":
    return transformer.Transformer(cfg, rngs=rngs)
  return model_lib.RetNet(cfg, rngs=rngs)
