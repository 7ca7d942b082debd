"""The `train` and `checkpoint` sections of a config, typed, each checking its own fields when built.

    train = TrainConfig.of(config.train, "train")   # ValueError naming the field, the value and the fix
    train.batch_size, train.mode, train.remat

What a field may be together with other sections (a form the model computes, segments a mixer can carry, the
batch split over the mesh) is checked where the whole config is built (`run_config.check_across`).
"""

from __future__ import annotations

import dataclasses

from retnet_jax.core import config_checks, sections
from retnet_jax.models import architectures
from retnet_jax.nn import layer_stack
from retnet_jax.training import optimizer

# What a non-finite loss or gradient does: skip the update (counted and logged), or stop the run.
NONFINITE_POLICIES = ("stop", "skip")
field = sections.field


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig(sections.Section):
  """`config.train`: the run's length, batches, form, optimizer, memory policies and logging."""
  steps: int = field("optimizer steps of the run")
  batch_size: int = field("global batch, in sequences")
  seq_len: int = field("tokens per training sequence")
  grad_accum_steps: int = field("micro-batches per step (batch_size must divide evenly)")
  mode: str = field("the form used for training: parallel | chunkwise")
  learning_rate: float = field("peak learning rate, reached after warmup_steps")
  lr_schedule: str = field("decay after warm-up: cosine | linear")
  warmup_steps: int = field("steps of linear warm-up from 0")
  end_lr_fraction: float = field("final learning rate as a fraction of the peak")
  b1: float = field("AdamW's first-moment decay")
  b2: float = field("AdamW's second-moment decay")
  weight_decay: float = field("AdamW's decoupled weight decay (not applied to norm scales)")
  grad_clip_norm: float = field("gradients clipped to this global norm")
  remat: str = field("jax.checkpoint policy per block (no saving on CPU): none | full | dots_saveable | "
                     "dots_with_no_batch_dims_saveable | save_mixer_out | ... (`layer_stack.REMAT_POLICIES`)")
  segment_len: int = field("> 0: backpropagate through segments of this many tokens carrying the state, "
                           "recomputing one segment at a time (memory grows with the segment, not seq_len, for one "
                           "more forward pass); 0: whole sequences. Fixed-size states only")
  loss_tile: int = field("> 0: the output projection, logsumexp and loss (and their gradients) over tiles of this "
                         "many tokens, so the [tokens, vocab] logits never exist for the whole batch; 0: all tokens "
                         "at once")
  optimizer_state_dtype: str = field("the AdamW first moment's dtype: float32 | bfloat16 (the second stays "
                                     "float32)")
  nonfinite: str = field("a NaN/Inf loss or gradient: stop (naming the step) | skip (the update, counted)")
  log_every_steps: int = field("steps between metric lines")
  eval_every_steps: int = field("steps between validation losses")
  eval_batches: int = field("validation batches per evaluation")
  profile_steps: tuple[int, int] | None = field("(first, last) step of a profiler trace; None: no trace")

  def __post_init__(self):
    for name in ("steps", "batch_size", "seq_len", "grad_accum_steps", "log_every_steps", "eval_every_steps",
                 "eval_batches"):
      config_checks.positive_int(getattr(self, name), f"train.{name}")
    optimizer.check_config(self)
    if self.mode not in architectures.SEQUENCE_MODES:
      raise ValueError(f"train.mode={self.mode!r}; train with "
                       f"{' or '.join(map(repr, architectures.SEQUENCE_MODES))} (the recurrent form is for decoding).")
    config_checks.choice(self.nonfinite, "train.nonfinite", NONFINITE_POLICIES)
    layer_stack.check_remat(self.remat, field="train.remat")
    if not isinstance(self.segment_len, int) or isinstance(self.segment_len, bool) or self.segment_len < 0:
      raise ValueError(f"train.segment_len must be 0 (whole sequences) or a positive number of tokens; "
                       f"got {self.segment_len!r}.")
    if not isinstance(self.loss_tile, int) or isinstance(self.loss_tile, bool) or self.loss_tile < 0:
      raise ValueError(f"train.loss_tile must be 0 (the loss over all tokens at once) or a positive number of "
                       f"tokens per tile; got {self.loss_tile!r}.")
    profile = self.profile_steps
    if profile is not None and (len(profile) != 2 or not 0 <= profile[0] <= profile[1] < self.steps):
      raise ValueError(f"train.profile_steps must be (first, last) with 0 <= first <= last < train.steps="
                       f"{self.steps}; got {profile}.")

  @property
  def segment(self) -> int:
    """Tokens per backward segment: `segment_len` where it splits a sequence, else `seq_len`."""
    return self.segment_len if 0 < self.segment_len < self.seq_len else self.seq_len


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig(sections.Section):
  """`config.checkpoint`: how often training saves and what it keeps."""
  every_steps: int = field("steps between checkpoints (and one at the end)")
  keep: int = field("the last K checkpoints are kept")
  keep_best: bool = field("also keep the one with the best validation loss")
  async_save: bool = field("write checkpoints in the background while training goes on")

  def __post_init__(self):
    for name in ("every_steps", "keep"):
      config_checks.positive_int(getattr(self, name), f"checkpoint.{name}")
