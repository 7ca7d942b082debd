"""The interface every token mixer offers the model, sampling, FLOP counts, the AOT planner and training's checks.

A mixer is one module: its config fields and their checks, its layer (an `nnx.Module` called as
`layer(x_BxLxD, context, state) -> (y_BxLxD, state)`), the forms it computes, its decoding state and that state's
room, its FLOPs per token, and what it refuses (documents in some form, meshes that split sequences). Blocks,
`architectures` (the registry) and every tool reach a mixer only through these methods, so adding one touches its
module, the registry and its tests.
"""

from __future__ import annotations

import abc
from typing import Any, NamedTuple

import jax
from flax import nnx

# One layer's decoding state: a pytree of the mixer's own type (`multiscale_retention.RetentionState`,
# `attention.KVCache`), compared with others by its tree structure and leaf shapes.
State = Any
# The model section a mixer reads (`models.model_config.RetNetConfig` or `TransformerConfig`, typed and checked
# there): its fields by name.
ModelConfig = Any


class Call(NamedTuple):
  """What one model call gives every mixer: token positions `[B, L]` (negative: left padding), the form, and the
  documents `[B, L]` (None: one per row)."""
  positions_BxL: jax.Array
  mode: str
  segment_ids_BxL: jax.Array | None


class Mixer(abc.ABC):
  """A token mixer as the registry holds it (stateless: every method reads the model section `cfg`)."""

  name: str  # the block attribute its layer takes (checkpoints' parameter paths name it)
  modes: tuple[str, ...]  # the forms it computes (in a hybrid's other forms, its module says what it runs)
  splits_sequences: bool  # runs on a mesh whose `sequence` axis splits each sequence
  fixed_state: bool  # its decoding state keeps one size whatever the context (no KV cache growing with it)
  # the RetNet model section's field holding the section of fields it alone reads (None: it reads shared fields
  # only): set away from their defaults in a model none of whose layers run it, they would be ignored
  # (`architectures.check_config` refuses that)
  section: str | None = None

  @abc.abstractmethod
  def check_config(self, cfg: ModelConfig) -> None:
    """Raises ValueError naming the field, the bad value and the fix for its fields."""

  @abc.abstractmethod
  def layer(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
    """Its layer, parameters drawn from `rngs`, computing in `dtype`."""

  @abc.abstractmethod
  def context(self, cfg: ModelConfig, call: Call) -> Any:
    """What all its layers share in one call (rotation tables, documents), made once per call; refuses a call it
    cannot compute (ValueError naming the fix)."""

  @abc.abstractmethod
  def init_state(self, cfg: ModelConfig, batch_size: int, max_len: int | None = None) -> State:
    """One layer's empty decoding state for `batch_size` rows (a KV cache: of `max_len` slots where it grows)."""

  def state_for(self, cfg: ModelConfig, batch_size: int, found: Any) -> State:
    """The empty state a layer state must match in tree and shapes, given `found`, that state with each leaf replaced
    by its shape (a KV cache may be made of any size)."""
    del found
    return self.init_state(cfg, batch_size)

  def check_room(self, cfg: ModelConfig, state: State, length: int) -> None:
    """For a concrete layer state: ValueError naming the field to raise where `length` more tokens do not fit."""

  def cache_field(self, cfg: ModelConfig) -> str | None:
    """The model field sizing a state that must hold the whole context, or None."""
    return None

  def state_field(self, cfg: ModelConfig) -> str | None:
    """The model field to lower where its decoding state does not fit in memory (a window, a cache's length), or
    None: no field sizes it but the model's widths."""
    return None

  def decode_context(self, cfg: ModelConfig) -> int:
    """The tokens a decoding step reads: 1 for a fixed-size state, a KV cache's slots otherwise."""
    return 1

  @abc.abstractmethod
  def matmul_params(self, cfg: ModelConfig) -> int:
    """Parameters used in matmuls per token by one layer of it (its projections)."""

  @abc.abstractmethod
  def mixing_flops(self, cfg: ModelConfig, seq_len: int, mode: str) -> int:
    """Forward FLOPs per token of one layer's mixing products (not its projections) in `mode`."""

  def check_backend(self, cfg: ModelConfig, backend: str | None = None) -> None:
    """Raises ValueError where its implementation chosen in `cfg` cannot run on `backend` (default: JAX's)."""

  def check_sequence_split(self, cfg: ModelConfig, where: str, devices: int, length: int,
                           modes: tuple[str, ...]) -> None:
    """Raises ValueError (beginning with `where`) where calls of `length` tokens in `modes` cannot be split over
    `devices` devices of the sequence axis: by default wherever it does not split sequences (`splits_sequences`)."""
    if not self.splits_sequences:
      raise ValueError(f"{where}, but its {self.name!r} layers do not split sequences: use a mesh whose sequence axis "
                       "has size 1.")

  def check_segments(self, cfg: ModelConfig, segment_len: int, seq_len: int, mode: str) -> None:
    """Raises ValueError naming the fields and the fix where training sequences of `seq_len` tokens cannot be
    backpropagated through segments of `segment_len` tokens carrying its state in `mode`."""

  def document_refusal(self, cfg: ModelConfig, mode: str) -> str | None:
    """Why packed documents cannot reset its state in `mode` and what to use instead ("the chunkwise form of ...:
    use ..."), or None."""
    return None
