"""Gated retention, the self-decoder layer of YOCO ("You Only Cache Once", Sun et al. 2024): retention whose decay is
a gate computed from each token (`model.mixer="gated_retention"`, `base.Mixer`).

Per head h and token n, with a gate projection W_gt `[d_model, heads]`,

    log gamma_n = logsigmoid(x_n W_gt)_h / gate_logit_normalizer,    S_n = gamma_n S_(n-1) + k_n^T v_n,    o_n = q_n S_n

then, as in multi-scale retention, a per-head RMSNorm (no affine unless `head_norm_scale`), the swish gate
swish(x W_g) * o and the output projection (`multiscale_retention.RetentionLayer`: q, k rotated by position, keys
scaled by d_k^-0.5 as YOCO's kernels scale them, its xavier_uniform(2^-2.5) initialisation, W_gt's too). fla's
`chunk_simple_gla` computes the same recurrence. There is no stability normaliser: the state is `kv [B, H, d_k, d_v]`
float32 alone. The forms are `retnet_jax.mixers.retention`'s with a per-token decay
(`retnet_jax.mixers.retention_decay`), split over a mesh's sequence axis by `retnet_jax.mixers.sequence_parallel`, or
the split-layout Pallas kernels. The fixed-decay fields (`decay_schedule`, `decay_gammas`) and the normaliser's
(`stability_norm`, `stability_norm_style`) are not read.

How the gate starts (`model.gate_init`, GATE_INITS):

- `yoco` (the default): YOCO's gate, no bias. W_gt's logits start near 0, so every head starts near
  gamma = 2^(-1/gate_logit_normalizer), one short memory (a half-life of 16 tokens with YOCO's 16).
- `retnet`: a learned per-head bias b `[heads]` (`gt_bias`), log gamma_n = logsigmoid(x_n W_gt + b)_h /
  gate_logit_normalizer, with b set so that a zero input gives each head RetNet's decay 1 - 2^(-5-h) (the retention
  mixer's default `decay_schedule` for the same head count): the heads start with memories from short to long,
  as RetNet's do, and the gate learns from there. The bias is set, not drawn, so every other parameter is drawn as
  under `yoco`.

A per-head decay drawn at random at initialisation (Mamba2's and Gated DeltaNet's A and dt) is not offered: it would
draw from the parameters' random stream and shift every later parameter's draw (or need a stream of its own),
while the deterministic spread above already starts the heads from short to long memories.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from retnet_jax.core import config_checks, sections, sharding
from retnet_jax.mixers import base, decay, multiscale_retention, retention
from retnet_jax.nn import layers

# model.gate_init: YOCO's gate without a bias, or with a per-head bias starting each head at RetNet's decay.
GATE_INITS = ("yoco", "retnet")


def retnet_gate_bias(num_heads: int, normalizer: float) -> np.ndarray:
  """The gate bias b `[num_heads]` float64 with logsigmoid(b_h) / `normalizer` = log gamma_h for RetNet's decays
  gamma_h = 1 - 2^(-5-h) (`decay.gammas("retnet", ...)`): b_h = logit(gamma_h^normalizer), computed from
  log(gamma_h^normalizer) through expm1, so that a power near 1 keeps its distance from 1 (no 1 - p rounding to 0)."""
  log_power = normalizer * np.log(decay.gammas("retnet", num_heads))  # log(gamma^N) < 0
  return log_power - np.log(-np.expm1(log_power))  # log p - log(1 - p)


def check_retnet_gate(num_heads: int, normalizer: float) -> None:
  """Raises ValueError naming the heads whose RetNet decay no finite bias gives (`retnet_gate_bias`): past 49 heads
  1 - 2^(-5-h) is 1 in float64, and an infinite parameter would turn to NaN in training."""
  with np.errstate(divide="ignore"):  # log(0): the heads refused below
    bad = np.flatnonzero(~np.isfinite(retnet_gate_bias(num_heads, normalizer)))
  if bad.size:
    raise ValueError(f"model.gate_init='retnet' cannot start heads {bad.tolist()} of model.num_heads={num_heads} at "
                     f"RetNet's decay 1 - 2^(-5-h) with model.gate_logit_normalizer={normalizer} (no finite gate bias "
                     "gives it); use fewer heads, or model.gate_init='yoco'.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatedRetentionConfig(sections.Section):
  """`model.gate_logit_normalizer`, `model.gate_init`: gated retention's own fields (flat in the model section)."""
  FLAT_PREFIX = ""
  gate_logit_normalizer: float = sections.field("gated_retention: log gamma_t = logsigmoid(x_t W_gt) / this "
                                                "(YOCO: 16)")
  gate_init: str = sections.field("gated_retention's gate at initialisation: yoco (no bias: every head near "
                                  "2^(-1/16)) | retnet (a learned per-head bias starting head h at RetNet's decay "
                                  "1 - 2^(-5-h))")

  def __post_init__(self):
    config_checks.finite_number(self.gate_logit_normalizer, "model.gate_logit_normalizer", positive=True,
                                why="the gate's log-sigmoid is divided by it; YOCO's is 16")
    config_checks.choice(self.gate_init, "model.gate_init", GATE_INITS,
                         why="how the gate starts: YOCO's, without a bias, or RetNet's decays per head")


class GatedRetentionLayer(multiscale_retention.RetentionLayer):
  """Gated retention: `RetentionLayer` with a decay per token and head from the gate projection `gt_proj`.

  A left-padding token (position below 0) adds no key and keeps the state (its gate is exactly 1, log 0), so a
  left-padded prompt gives the outputs it gives alone; a document start of `segment_ids` zeroes the state and the
  gate products reaching across it (the forms do). With `gate_init="retnet"` the gate's logits add the per-head
  bias `gt_bias` `[H]` (`retnet_gate_bias`); with `yoco` there is none.
  """

  def __init__(self, cfg: base.ModelConfig, *, dtype, rngs: nnx.Rngs):
    super().__init__(cfg, per_token_decay=True, dtype=dtype, rngs=rngs)
    own = cfg.gated_retention
    self.gate_logit_normalizer = float(own.gate_logit_normalizer)
    self.gt_proj = layers.Dense(cfg.d_model, cfg.num_heads, ("embed", "heads"), init=layers.xavier_uniform(2**-2.5),
                                dtype=dtype, rngs=rngs)
    self.gt_bias = (layers.fixed_param(retnet_gate_bias(cfg.num_heads, self.gate_logit_normalizer), ("heads",))
                    if own.gate_init == "retnet" else None)

  def gate_log_decay(self, x_BxLxD: jax.Array, positions_BxL: jax.Array) -> jax.Array:
    """log gamma `[B, L, H]` = logsigmoid(x W_gt (+ gt_bias)) / gate_logit_normalizer, in float32 (float64 for
    float64 inputs), 0 (gamma = 1) at left padding."""
    wide = jnp.promote_types(self.dtype, jnp.float32)
    logits_BxLxH = self.gt_proj(x_BxLxD).astype(wide)
    if self.gt_bias is not None:
      logits_BxLxH = logits_BxLxH + self.gt_bias[...].astype(wide)
    log_decay = jax.nn.log_sigmoid(logits_BxLxH) / jnp.asarray(self.gate_logit_normalizer, wide)
    return jnp.where((positions_BxL >= 0)[..., None], log_decay, 0)

  def __call__(self, x_BxLxD: jax.Array, context: multiscale_retention.Context,
               state: multiscale_retention.RetentionState | None
               ) -> tuple[jax.Array, multiscale_retention.RetentionState]:
    """`x [B, L, D]` in the call `context` (positions, rotation tables, form, documents) with the layer's incoming
    state `RetentionState(kv)` (None: empty) -> (y, new state)."""
    positions_BxL, rotation_tables, mode, segment_ids_BxL = context
    q, k, v = self.project(x_BxLxD, positions_BxL, rotation_tables)
    log_decay_BxLxH = self.gate_log_decay(x_BxLxD, positions_BxL)
    kv_in = None if state is None else state.kv
    split_over = None if mode == "recurrent" else sharding.sequence_split()
    if mode == "chunkwise" and self.kernel and split_over is None:
      out_BxLxHxV, kv = self.kernel_form(q, k, v, log_decay_BxLxH, kv_in, segment_ids_BxL)
    else:
      out_BxLxHxV, kv, _, _ = self.retention_form(mode, q, k, v, log_decay_BxLxH, kv_in, split_over=split_over,
                                                  segment_ids=segment_ids_BxL)
      out_BxLxHxV = out_BxLxHxV.astype(retention.accumulation_dtype(out_BxLxHxV))
    return self.output(out_BxLxHxV, x_BxLxD), multiscale_retention.RetentionState(kv)


class GatedRetention(multiscale_retention.Retention):
  """Gated retention as the registry holds it (`model.mixer="gated_retention"`): multi-scale retention's fields,
  forms, context, sequence split and FLOPs, its own decay (`model.gate_logit_normalizer`, `model.gate_init`), no
  normaliser.

  Its FLOPs per token are retention's products form by form (`Retention.mixing_flops`): the per-token decay's own
  work (cumulative sums and exps of the gates, per token and head L terms in the parallel form, C in the chunkwise
  form, 1 recurrent) is elementwise and not counted, as the fixed decay's mask is not; the gate projection is
  counted in `matmul_params`."""

  name = "gated_retention"
  section = "gated_retention"

  def check_config(self, cfg: base.ModelConfig) -> None:
    multiscale_retention.check_retention_fields(cfg)
    if cfg.gated_retention.gate_init == "retnet":
      check_retnet_gate(cfg.num_heads, cfg.gated_retention.gate_logit_normalizer)
    # What no backend changes is refused as the model is built; the kernels' sizes by check_backend, before work.
    if cfg.retention_impl == "pallas" and (reason := multiscale_retention.kernel_config_unfit(cfg, True)):
      raise ValueError(f"model.retention_impl='pallas' cannot run: {reason}")

  def layer(self, cfg: base.ModelConfig, *, dtype, rngs: nnx.Rngs) -> GatedRetentionLayer:
    return GatedRetentionLayer(cfg, dtype=dtype, rngs=rngs)

  def init_state(self, cfg: base.ModelConfig, batch_size: int, max_len: int | None = None
                 ) -> multiscale_retention.RetentionState:
    """`kv [B, H, d_k, d_v]` float32 zeros, retention's state without a normaliser (`max_len` is unused)."""
    return multiscale_retention.RetentionState(super().init_state(cfg, batch_size, max_len).kv)

  def matmul_params(self, cfg: base.ModelConfig) -> int:
    """Multi-scale retention's projections (q, k, v, g, out) and the gate's, d x heads (`gate_init="retnet"`'s
    bias is no matmul)."""
    return super().matmul_params(cfg) + cfg.d_model * cfg.num_heads

  def check_backend(self, cfg: base.ModelConfig, backend: str | None = None) -> None:
    multiscale_retention.check_retention_impl(cfg, backend, per_token_decay=True)

  def check_segments(self, cfg: base.ModelConfig, segment_len: int, seq_len: int, mode: str) -> None:
    """Any segment length: no normaliser depends on where chunks start."""

  def document_refusal(self, cfg: base.ModelConfig, mode: str) -> str | None:
    return None  # every form resets the state at a document start; no normaliser spans documents


GATED_RETENTION = GatedRetention()
