"""The registry: which token mixer each layer of a model section runs, and the checks and counts over them.

    architectures.check_config(config.model)           # before any work
    mixers = architectures.layer_mixers(config.model)  # one `mixers.base.Mixer` per layer
    model = model.Model(config.model, rngs=nnx.Rngs(seed))

`model.architecture` names the family: a RetNet's layers run `model.mixer` (retention), but for its
`model.attention_layers` (a hybrid: attention with the `attention_` fields); a Transformer's layers all run
attention. This module is the only one that tells families or mixers apart by name: everything else asks the
mixers (`layer_mixers`, `mixers`) or the functions below.
"""

from __future__ import annotations

from typing import Any

from retnet_jax.core import config_checks, sharding
from retnet_jax.mixers import attention, base, gated_retention, multiscale_retention
from retnet_jax.models import presets
from retnet_jax.nn import layers

ARCHITECTURES = presets.ARCHITECTURES
# `model.mixer`: a RetNet's token mixer (hybrids put attention in `model.attention_layers`): RetNet's multi-scale
# retention, or YOCO's gated retention (a decay per token).
MIXERS: dict[str, base.Mixer] = {"retention": multiscale_retention.RETENTION,
                                 "gated_retention": gated_retention.GATED_RETENTION}
MODES = ("parallel", "chunkwise", "recurrent")  # every form a mixer computes, in this order
# The forms that run whole sequences (training, prefill); the recurrent form decodes one token at a time.
SEQUENCE_MODES = tuple(mode for mode in MODES if mode != "recurrent")
# The forms a prompt is prefilled in, the default first: chunkwise, whose memory grows linearly in the prompt.
PREFILL_MODES = tuple(sorted(SEQUENCE_MODES, key=lambda mode: mode != "chunkwise"))


def architecture(name: Any) -> str:
  """`name` (a model section's `architecture`), or ValueError naming it and the choices if it is unknown."""
  return config_checks.choice(name, "model.architecture", ARCHITECTURES,
                              otherwise=" (--config=configs/retnet.py:NAME or --config=configs/transformer.py:NAME)")


def layer_mixers(cfg: base.ModelConfig) -> tuple[base.Mixer, ...]:
  """The mixer of each layer of model section `cfg` (checked by `check_config`)."""
  if cfg.architecture == "transformer":
    return (attention.TRANSFORMER,) * cfg.num_layers
  mixer = MIXERS[cfg.mixer]
  return tuple(attention.HYBRID if layer in cfg.attention.layers else mixer for layer in range(cfg.num_layers))


def mixers(cfg: base.ModelConfig) -> tuple[base.Mixer, ...]:
  """The distinct mixers of `cfg`'s layers, in the order the layers first use them."""
  return tuple(dict.fromkeys(layer_mixers(cfg)))


def _check_attention_layers(cfg: base.ModelConfig) -> None:
  """A RetNet's per-layer choice: indices in range and distinct, and no attention option without attention
  layers (its section's types: `attention.HybridAttentionConfig`)."""
  chosen = cfg.attention.layers
  if not chosen:
    for name in ("num_heads", "num_kv_heads", "window"):
      if (value := getattr(cfg.attention, name)) is not None:
        raise ValueError(f"model.attention_{name}={value} configures attention layers, but model.attention_layers "
                         "is empty: name them (e.g. --config.model.attention_layers='(1,)') or unset "
                         f"model.attention_{name}.")
    return
  bad = [i for i in chosen if not 0 <= i < cfg.num_layers]
  if bad:
    raise ValueError(f"model.attention_layers={tuple(chosen)} names layers {bad} outside [0, model.num_layers="
                     f"{cfg.num_layers}); choose indices from 0 to {cfg.num_layers - 1}.")
  repeated = sorted({i for i in chosen if list(chosen).count(i) > 1})
  if repeated:
    raise ValueError(f"model.attention_layers={tuple(chosen)} repeats layers {repeated}; name each layer once.")


_DEFAULTS = presets.model_config("tiny")  # the model fields' defaults (the mixers' own fields are no preset's size)


def _check_other_mixers_fields(cfg: base.ModelConfig) -> None:
  """No field of the section of a mixer this RetNet's layers do not run (`Mixer.section`) set away from its
  default: the model would ignore it, as attention options without attention layers (`_check_attention_layers`)."""
  used = mixers(cfg)
  for mixer in MIXERS.values():
    if mixer in used or mixer.section is None:
      continue
    for field, value in getattr(cfg, mixer.section).to_dict().items():
      if value != _DEFAULTS[field]:
        raise ValueError(f"model.{field}={value!r} is read by model.mixer={mixer.name!r} only, but this model's "
                         f"layers run {', '.join(repr(m.name) for m in used)}, which ignore it: leave model.{field} at "
                         f"its default ({_DEFAULTS[field]!r}), or set model.mixer={mixer.name!r}.")


def check_config(cfg: base.ModelConfig) -> None:
  """Raises ValueError naming the bad value and the fix for a model section that cannot be built: an unknown mixer,
  or a bad value of its own or of its mixers' fields (`model_config` checks the section's field names)."""
  layers.check_config(cfg)
  if cfg.architecture == "retnet":
    config_checks.choice(cfg.mixer, "model.mixer", MIXERS)
    _check_attention_layers(cfg)
    _check_other_mixers_fields(cfg)
  for mixer in mixers(cfg):
    mixer.check_config(cfg)


def modes(cfg: base.ModelConfig) -> tuple[str, ...]:
  """The forms the model of `cfg` computes, parallel first: its mixers' (parallel, chunkwise, recurrent for
  retention; parallel, recurrent for a Transformer's attention)."""
  own = {mode for mixer in mixers(cfg) for mode in mixer.modes}
  return tuple(mode for mode in MODES if mode in own)


def prefill_modes(cfg: base.ModelConfig) -> tuple[str, ...]:
  """The forms of PREFILL_MODES the model of `cfg` computes, its default first: chunkwise, parallel for RetNet;
  parallel for the Transformer."""
  return tuple(mode for mode in PREFILL_MODES if mode in modes(cfg))


def check_backend(cfg: base.ModelConfig, backend: str | None = None) -> None:
  """Raises ValueError naming the field and the fix where an implementation `cfg` chooses (the Pallas kernels)
  cannot run on `backend` (default: JAX's)."""
  for mixer in mixers(cfg):
    mixer.check_backend(cfg, backend)


def check_training(config: Any) -> None:
  """Raises ValueError naming the option and the fix for train options the model lacks: a form it does not
  compute, state-carrying segments where no layer's state has a fixed size."""
  cfg, train = config.model, config.train
  if train.mode in SEQUENCE_MODES and train.mode not in modes(cfg):  # train_step refuses the others
    own = tuple(mode for mode in modes(cfg) if mode in SEQUENCE_MODES)
    raise ValueError(f"train.mode={train.mode!r}: this model's layers do not compute the {train.mode} form (they "
                     f"compute {modes(cfg)}); set --config.train.mode={own[0]}.")
  if train.segment_len and not any(mixer.fixed_state for mixer in mixers(cfg)):
    raise ValueError(f"train.segment_len={train.segment_len}: segments carry retention's fixed-size state; "
                     "a KV cache grows with the sequence, so they would not bound this model's memory. Set "
                     "--config.train.segment_len=0 (train.remat trades compute for memory instead).")


def check_mesh_split(cfg: base.ModelConfig, mesh_cfg: sharding.MeshConfig, num_devices: int, length: int,
                     modes_: tuple[str, ...] = ()) -> None:
  """Where `mesh_cfg` splits each sequence over several of `num_devices` devices: raises ValueError where some
  layer cannot split calls of `length` tokens in `modes_` so (`Mixer.check_sequence_split`: whole chunks per device,
  not the recurrent form, not the kernels); mixers that cannot split at all are asked first."""
  devices = sharding.sequence_devices(mesh_cfg, num_devices)
  if devices > 1:
    where = f"config.mesh splits each sequence over {devices} devices (mesh.shape={tuple(mesh_cfg.shape)})"
    for mixer in sorted(mixers(cfg), key=lambda mixer: mixer.splits_sequences):
      mixer.check_sequence_split(cfg, where, devices, length, tuple(modes_))


def document_refusal(cfg: base.ModelConfig, mode: str) -> str | None:
  """Why some layer cannot reset its state at packed documents in `mode` (`Mixer.document_refusal`), or None."""
  return next(filter(None, (mixer.document_refusal(cfg, mode) for mixer in mixers(cfg))), None)


def cache_field(cfg: base.ModelConfig) -> str | None:
  """The model field sizing a KV cache that must hold the whole context (a Transformer's `max_len`, an unwindowed
  hybrid's `attention_max_len`), or None: the decoding state's size does not grow with the context."""
  return next(filter(None, (mixer.cache_field(cfg) for mixer in mixers(cfg))), None)


def state_fields(cfg: base.ModelConfig) -> tuple[str, ...]:
  """The model fields that size the layers' decoding states (a window, a KV cache's length), in layer order."""
  return tuple(dict.fromkeys(filter(None, (mixer.state_field(cfg) for mixer in mixers(cfg)))))


def decode_context(cfg: base.ModelConfig) -> int:
  """The tokens the widest layer reads per decoding step: 1 for retention, a KV cache's slots for attention."""
  return max(mixer.decode_context(cfg) for mixer in mixers(cfg))
