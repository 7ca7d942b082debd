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

from retnet_jax import layers, model as model_lib, presets, transformer

ARCHITECTURES = presets.ARCHITECTURES
Model = model_lib.RetNet | transformer.Transformer
# The forms each architecture computes; `parallel` first.
MODES = {"retnet": layers.MODES, "transformer": transformer.MODES}


def architecture(cfg: ml_collections.ConfigDict) -> str:
  """`cfg.architecture`, or ValueError naming it and the choices if it is unknown."""
  name = cfg.get("architecture")
  if name not in ARCHITECTURES:
    raise ValueError(f"unknown model.architecture {name!r}; choose one of {ARCHITECTURES} "
                     "(--config=configs/retnet.py:NAME or --config=configs/transformer.py:NAME).")
  return name


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


def build(cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs) -> Model:
  """The model of model section `cfg`, parameters drawn from `rngs` (its constructor checks `cfg`)."""
  if architecture(cfg) == "transformer":
    return transformer.Transformer(cfg, rngs=rngs)
  return model_lib.RetNet(cfg, rngs=rngs)
