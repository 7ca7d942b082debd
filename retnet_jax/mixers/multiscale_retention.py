"""Multi-scale retention, RetNet's token mixer: its layer, fields, decoding state and FLOPs (`base.Mixer`).

Its forms are `retnet_jax.mixers.retention`'s (parallel, chunkwise, recurrent) and the Pallas kernels
(`model.retention_impl`), split over a mesh's sequence axis by `retnet_jax.mixers.sequence_parallel`; the normaliser is
`retnet_jax.mixers.stability`'s. `RetentionLayer` and `check_retention_fields` hold what gated retention
(`mixers.gated_retention`) shares with it.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from retnet_jax.core import config_checks, sections, sharding
from retnet_jax.mixers import base, decay, kernels, retention, sequence_parallel, stability
from retnet_jax.nn import layer_stack, layers, rotation

# model.retention_impl: the chunkwise form as XLA einsums, as the Pallas kernels (in model.kernel_layout), or the
# kernels where they compile (GPU) and XLA elsewhere.
RETENTION_IMPLS = ("xla", "pallas", "auto")


class RetentionState(NamedTuple):
  """One retention layer's decoding state, float32: the decayed sum of key-value products `kv [B, H, d_k, d_v]`,
  and the decayed key sum `key_sum [B, H, d_k]` that the normaliser reads (None where the layer has none: gated
  retention, or `model.stability_norm` off)."""
  kv: jax.Array
  key_sum: jax.Array | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RetentionConfig(sections.Section):
  """`model.decay_schedule`, `model.decay_gammas`: multi-scale retention's fixed decay per head (its own fields,
  flat in the model section; checked against `model.num_heads` by `Retention.check_config`)."""
  FLAT_PREFIX = ""
  decay_schedule: str = sections.field("retention: retnet: 1 - 2^(-5-h) | logspace: the paper's experiments | "
                                       "explicit")
  decay_gammas: tuple[float, ...] | None = sections.field("retention: one gamma per head, for "
                                                          "decay_schedule='explicit'")


class Context(NamedTuple):
  """What every retention layer of one call shares: positions `[B, L]`, rotation tables, form, documents."""
  positions_BxL: jax.Array
  tables: tuple[jax.Array, jax.Array]
  mode: str
  segment_ids_BxL: jax.Array | None


def kernel_config_unfit(cfg: base.ModelConfig, per_token_decay: bool = False) -> str | None:
  """Why the Pallas kernels cannot take this model's chunkwise retention on any backend, or None. With
  `per_token_decay` (gated retention: a decay per token, no normaliser) only the split layout takes the decays."""
  if per_token_decay and cfg.kernel_layout != "split":
    return (f"per-token decays run on the split kernels only, not model.kernel_layout={cfg.kernel_layout!r}: set "
            "model.kernel_layout='split', or use retention_impl='xla'")
  if not per_token_decay and stability.torchscale_normaliser(cfg):
    return ("the torchscale normaliser's chunkwise scalars need by-products only the XLA form computes; use "
            "retention_impl='xla' (or 'auto'), or stability_norm_style='shared'")
  return None


def kernel_unfit(cfg: base.ModelConfig, backend: str | None, per_token_decay: bool = False) -> str | None:
  """Why the compiled Pallas kernels cannot run this model's chunkwise retention on `backend`, or None: its
  configuration (`kernel_config_unfit`), then the kernels' sizes and dtypes on that backend."""
  if reason := kernel_config_unfit(cfg, per_token_decay):
    return reason
  try:
    kernels.check_supported(cfg.d_model // cfg.num_heads, cfg.value_dim // cfg.num_heads,
                            layers.compute_dtype(cfg.dtype), cfg.chunk_size, backend, cfg.kernel_layout)
  except ValueError as e:
    return str(e)
  return None


def check_retention_impl(cfg: base.ModelConfig, backend: str | None = None,
                         per_token_decay: bool = False) -> None:
  """Raises ValueError naming the limit and the fix where `retention_impl=pallas` cannot compile on `backend`
  (default: JAX's) for this model (`per_token_decay` as in `kernel_unfit`): before any work, as training and
  evaluation call it. (A model built directly runs the kernels interpreted where they do not compile: slow, for
  tests.)"""
  if cfg.retention_impl == "pallas" and (reason := kernel_unfit(cfg, backend, per_token_decay)):
    raise ValueError(f"model.retention_impl='pallas' cannot run here: {reason}")


def uses_kernel(cfg: base.ModelConfig, backend: str | None = None, per_token_decay: bool = False) -> bool:
  """Whether the chunkwise form runs as the Pallas kernels: `pallas` (interpreted where they do not compile: for
  tests), or `auto` where they compile (`per_token_decay` as in `kernel_unfit`)."""
  return cfg.retention_impl == "pallas" or (cfg.retention_impl == "auto" and
                                            kernel_unfit(cfg, backend, per_token_decay) is None)


def kv_heads(cfg: base.ModelConfig) -> int:
  """The key/value heads of a model config: `num_kv_heads`, or `num_heads` where it is None."""
  return cfg.num_heads if cfg.num_kv_heads is None else cfg.num_kv_heads


def check_retention_fields(cfg: base.ModelConfig) -> None:
  """Raises ValueError naming the field, the bad value and the fix for the fields every retention layer reads
  (`RetentionLayer`'s: heads, widths, rotation, head norm, chunk size, implementation), whatever its decay."""
  for field in ("num_heads", "value_dim"):
    config_checks.positive_int(getattr(cfg, field), f"model.{field}")
  if cfg.d_model % cfg.num_heads:
    raise ValueError(f"model.d_model={cfg.d_model} is not divisible by model.num_heads={cfg.num_heads}; "
                     "choose num_heads dividing d_model.")
  if cfg.value_dim % cfg.num_heads:
    raise ValueError(f"model.value_dim={cfg.value_dim} is not divisible by model.num_heads={cfg.num_heads}; "
                     "choose value_dim as a multiple of num_heads.")
  if cfg.num_kv_heads is not None and (cfg.num_kv_heads < 1 or cfg.num_heads % cfg.num_kv_heads):
    raise ValueError(f"model.num_kv_heads={cfg.num_kv_heads} must be a positive divisor of model.num_heads="
                     f"{cfg.num_heads} (or None: one key/value head per query head).")
  rotation.check_rotary_dim(cfg.d_model // cfg.num_heads)
  rotation.check_rotation(cfg.rotation_pairs, cfg.rotation_freqs)
  config_checks.finite_number(cfg.rotation_base, "model.rotation_base", positive=True)
  config_checks.finite_number(cfg.head_norm_eps, "model.head_norm_eps")
  retention.check_chunk_size(cfg.chunk_size, "model.chunk_size")
  config_checks.choice(cfg.retention_impl, "model.retention_impl", RETENTION_IMPLS)
  config_checks.choice(cfg.kernel_layout, "model.kernel_layout", kernels.LAYOUTS)


class RetentionLayer(nnx.Module):
  """What multi-scale and gated retention layers share: the q/k/v/g/out projections (keys scaled by d_k^-0.5),
  rotated q/k, grouped key/value heads, left padding, the retention forms (XLA's, split over a mesh's sequence axis,
  the Pallas kernels), the per-head RMSNorm, swish gate and output projection. Subclasses give the decay.

  With `num_kv_heads` < `num_heads`, each group of num_heads / num_kv_heads query heads shares one key/value head
  (query head j reads key/value head j // group size); `head_norm_scale` gives the per-head RMSNorm a learned
  scale that all heads share. Positions below 0 are left padding: their keys are zeroed, so they add nothing to the
  state. With `segment_ids` (packed documents, `retnet_jax.core.segments`) every form retains within a document only.
  """

  def __init__(self, cfg: base.ModelConfig, *, per_token_decay: bool, dtype, rngs: nnx.Rngs):
    d, heads = cfg.d_model, cfg.num_heads
    self.num_heads = heads
    self.num_kv_heads = kv_heads(cfg)
    self.key_dim = d // heads
    self.value_dim = cfg.value_dim // heads
    self.dtype = dtype
    self.rotation_pairs = cfg.rotation_pairs
    self.head_norm_eps = cfg.head_norm_eps
    self.chunk_size = cfg.chunk_size
    self.kernel = uses_kernel(cfg, per_token_decay=per_token_decay)
    self.kernel_config = kernels.default_config(self.key_dim, self.value_dim, cfg.kernel_layout)
    self.precision = layers.MATMUL_PRECISIONS[cfg.matmul_precision]
    qkvg_init = layers.xavier_uniform(2**-2.5)
    dense = lambda i, o, axes, init: layers.Dense(i, o, axes, init=init, dtype=dtype, rngs=rngs)
    self.q_proj = dense(d, d, ("embed", "heads"), qkvg_init)
    self.k_proj = dense(d, self.key_dim * self.num_kv_heads, ("embed", "heads"), qkvg_init)
    self.v_proj = dense(d, self.value_dim * self.num_kv_heads, ("embed", "heads"), qkvg_init)
    self.g_proj = dense(d, cfg.value_dim, ("embed", "heads"), qkvg_init)
    self.out_proj = dense(cfg.value_dim, d, ("heads", "embed"), layers.xavier_uniform(2**-1))
    self.head_norm_scale = (layers.param(rngs, nnx.initializers.ones, (self.value_dim,), (None,))
                            if cfg.head_norm_scale else None)

  def project(self, x_BxLxD: jax.Array, positions_BxL: jax.Array, rotation_tables) -> tuple[jax.Array, ...]:
    """q, k `[B, L, H, d_k]` (rotated; k scaled by d_k^-0.5 and zero at left padding) and v `[B, L, H, d_v]`, each
    key/value head repeated over its group of query heads."""
    batch, length, _ = x_BxLxD.shape
    heads = self.num_heads
    split = lambda proj, num_heads: checkpoint_name(proj(x_BxLxD), layer_stack.QKV).reshape(
        batch, length, num_heads, -1)
    q = split(self.q_proj, heads)
    k = split(self.k_proj, self.num_kv_heads) * jnp.asarray(self.key_dim**-0.5, self.dtype)
    v = split(self.v_proj, self.num_kv_heads)
    q, k = (rotation.rotate(y, rotation_tables, self.rotation_pairs) for y in (q, k))
    if self.num_kv_heads < heads:  # each key/value head serves a group of consecutive query heads
      k, v = (jnp.repeat(y, heads // self.num_kv_heads, axis=2) for y in (k, v))
    return q, jnp.where((positions_BxL >= 0)[..., None, None], k, 0), v  # negative positions are left padding

  def retention_form(self, mode: str, q, k, v, log_decay, state, score_abs_sums=False, split_over=None,
                     segment_ids=None, wide_entry_states=False):
    """(out, final state, chunk entry states, in-chunk |score| row sums) of the XLA form of `mode`; the last two
    from the chunkwise form only, the entry states in q's dtype unless `wide_entry_states`
    (`retention.chunkwise_with_states`). `log_decay`: `[heads]` or `[batch, seq, heads]`.

    `split_over`: the (mesh axis, size) that splits the sequence (`sharding.sequence_split`), where the parallel and
    chunkwise modes both run the chunkwise form per slice (`sequence_parallel`), or None."""
    if split_over is not None:
      return sequence_parallel.sharded_chunkwise(q, k, v, log_decay, self.chunk_size, state, score_abs_sums,
                                                 segment_ids, axis_name=split_over[0])
    if mode == "parallel":
      return *retention.parallel_retention(q, k, v, log_decay, state, segment_ids), None, None
    if mode == "chunkwise":
      return retention.chunkwise_with_states(q, k, v, log_decay, self.chunk_size, state, score_abs_sums,
                                             segment_ids, wide_entry_states)
    return *retention.recurrent_retention(q, k, v, log_decay, state, segment_ids), None, None

  def kernel_form(self, q, k, v, log_decay, kv_in, segment_ids_BxL=None) -> tuple[jax.Array, jax.Array]:
    """The chunkwise form as the Pallas kernels, on each device's batch and head shards: (float32 output, final
    state). `log_decay`: `[heads]`, or `[batch, seq, heads]` (split layout), split like q."""
    qkv_axes, state_axes = ("batch", None, "heads", None), ("batch", "heads", None, None)
    decay_axes = ("batch", None, "heads") if log_decay.ndim == 3 else ("heads",)
    kernel = lambda q, k, v, log_decay, kv, ids: kernels.chunkwise_retention(
        q, k, v, log_decay, self.chunk_size, kv, segment_ids=ids, precision=self.precision, config=self.kernel_config)
    out, kv = sharding.per_shard(kernel, [qkv_axes] * 3 + [decay_axes, state_axes, ("batch", None)],
                                 [qkv_axes, state_axes])(q, k, v, log_decay, kv_in, segment_ids_BxL)
    return out.astype(jnp.float32), kv

  def output(self, out_BxLxHxV: jax.Array, x_BxLxD: jax.Array) -> jax.Array:
    """The layer's output `[B, L, D]` from the raw retention `[B, L, H, d_v]` (float32, or float64 in float64
    tests) and the layer's input: per-head RMSNorm, swish gate, output projection."""
    batch, length, _ = x_BxLxD.shape
    y = layers.rms_norm(out_BxLxHxV, self.head_norm_eps)
    if self.head_norm_scale is not None:
      y = y * self.head_norm_scale[...]
    y = checkpoint_name(y.reshape(batch, length, -1), layer_stack.MIXER_OUT)
    gate = jax.nn.swish(self.g_proj(x_BxLxD).astype(y.dtype))
    return self.out_proj((gate * y).astype(self.dtype))


class MultiScaleRetention(RetentionLayer):
  """Multi-scale retention: `RetentionLayer` with a fixed decay per head (`model.decay_schedule`).

  With `stability_norm`, each head's raw output is divided by the `stability_norm_style` scalars of
  `retnet_jax.mixers.stability`. As retention depends on relative positions only, a left-padded prompt gives the outputs
  it gives alone; with packed documents positions count from each document's start, so the normaliser restarts too.
  """

  def __init__(self, cfg: base.ModelConfig, *, dtype, rngs: nnx.Rngs):
    super().__init__(cfg, per_token_decay=False, dtype=dtype, rngs=rngs)
    self.stability_norm = cfg.stability_norm
    self.stability_norm_style = cfg.stability_norm_style
    own = cfg.retention
    self.log_decay = tuple(float(x) for x in decay.log_decay(own.decay_schedule, cfg.num_heads, own.decay_gammas))

  def __call__(self, x_BxLxD: jax.Array, context: "Context", state: dict[str, jax.Array] | None
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`x [B, L, D]` in the call `context` (positions, rotation tables, form, documents: positions then count
    within each) with the layer's incoming state (None: empty) -> (y, new state)."""
    positions_BxL, rotation_tables, mode, segment_ids_BxL = context
    q, k, v = self.project(x_BxLxD, positions_BxL, rotation_tables)
    log_decay_H = jnp.asarray(self.log_decay, jnp.float32)

    # No state (training from the start of a sequence): the forms skip the cross term with a zero state.
    split_over = None if mode == "recurrent" else sharding.sequence_split()
    if mode == "chunkwise" and self.kernel and split_over is None:
      out_BxLxHxV, new_state = self._fused(q, k, v, log_decay_H, state, positions_BxL, segment_ids_BxL)
    else:
      out_BxLxHxV, new_state = self._unfused(mode, q, k, v, log_decay_H, state, positions_BxL, split_over,
                                             segment_ids_BxL)
    return self.output(out_BxLxHxV, x_BxLxD), new_state

  def _fused(self, q, k, v, log_decay_H, state, positions_BxL, segment_ids_BxL=None):
    """The chunkwise form and the shared normaliser's q . z from one pass of the Pallas kernels, on each device's
    batch and head shards: (normalised float32 output, new state)."""
    kv_in = None if state is None else state.kv
    if not self.stability_norm:
      out, kv = self.kernel_form(q, k, v, log_decay_H, kv_in, segment_ids_BxL)
      return out, RetentionState(kv)
    qkv_axes, state_axes = ("batch", None, "heads", None), ("batch", "heads", None, None)
    doc_axes = ("batch", None)  # the documents split over the batch like q
    kernel = lambda q, k, v, log_decay, kv, z, ids: kernels.chunkwise_retention_with_key_sum(
        q, k, v, log_decay, self.chunk_size, kv, z, segment_ids=ids, precision=self.precision,
        config=self.kernel_config)
    z_in = None if state is None else state.key_sum
    out, kv, qz, key_sum = sharding.per_shard(
        kernel, [qkv_axes] * 3 + [("heads",), state_axes, ("batch", "heads", None), doc_axes],
        [qkv_axes, state_axes, ("batch", None, "heads"), ("batch", "heads", None)],
    )(q, k, v, log_decay_H, kv_in, z_in, segment_ids_BxL)
    divisor = stability.divisor(self.stability_norm_style, "chunkwise", qz, positions_BxL, log_decay_H)
    return out.astype(jnp.float32) / divisor[..., None], RetentionState(kv, key_sum)

  def _unfused(self, mode: str, q, k, v, log_decay_H, state, positions_BxL, split_over=None, segment_ids_BxL=None):
    """The XLA form of `mode` (split over `split_over`, as in `retention_form`), then the normaliser from a second
    call on a ones value column: (normalised float32 output, new state)."""
    batch, length, heads = q.shape[:3]
    kv_in = None if state is None else state.kv
    # torchscale's chunkwise scalars read the entry states in float32.
    torchscale_chunks = stability.torchscale_normaliser(self) and mode == "chunkwise"
    out_BxLxHxV, kv, entry_states, _ = self.retention_form(mode, q, k, v, log_decay_H, kv_in, split_over=split_over,
                                                           segment_ids=segment_ids_BxL,
                                                           wide_entry_states=torchscale_chunks)
    new_state = RetentionState(kv)
    out_BxLxHxV = out_BxLxHxV.astype(jnp.float32)
    if self.stability_norm:
      # q_n . z_n is the retention of a ones value column, z the decayed key sum in the state. A call of its own
      # without gradient (the divisor is a constant to autodiff): XLA shares its scores with the call above, and
      # v keeps its width. Its in-chunk scores are q . k, so it also gives torchscale's chunkwise score sums.
      q_sg, k_sg = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
      ones = jnp.ones((batch, length, heads, 1), q.dtype)
      z_in = None if state is None else state.key_sum[..., None]
      qz, key_sum, _, abs_sums = self.retention_form(mode, q_sg, k_sg, ones, log_decay_H, z_in, torchscale_chunks,
                                                     split_over, segment_ids_BxL)
      new_state = RetentionState(kv, key_sum[..., 0])
      if torchscale_chunks:
        divisor = stability.torchscale_chunkwise_divisor(abs_sums, entry_states, self.chunk_size, log_decay_H)
      else:
        divisor = stability.divisor(self.stability_norm_style, mode, qz[..., 0], positions_BxL, log_decay_H)
      out_BxLxHxV = out_BxLxHxV / jax.lax.stop_gradient(divisor)[..., None]
    return out_BxLxHxV, new_state


class Retention(base.Mixer):
  """RetNet's multi-scale retention as the registry holds it (`model.mixer="retention"`)."""

  name = "retention"
  modes = ("parallel", "chunkwise", "recurrent")
  splits_sequences = True
  fixed_state = True
  # (the stability_norm fields, which gated retention does not read either, are presets' choices: torchscale's
  # and fla's set them, so a gated model built on those presets carries them unset by its user)
  section = "retention"

  def check_config(self, cfg: base.ModelConfig) -> None:
    check_retention_fields(cfg)
    decay.gammas(cfg.retention.decay_schedule, cfg.num_heads, cfg.retention.decay_gammas)
    config_checks.choice(cfg.stability_norm_style, "model.stability_norm_style", stability.NORM_STYLES)

  def layer(self, cfg: base.ModelConfig, *, dtype, rngs: nnx.Rngs) -> MultiScaleRetention:
    return MultiScaleRetention(cfg, dtype=dtype, rngs=rngs)

  def context(self, cfg: base.ModelConfig, call: base.Call) -> Context:
    if call.segment_ids_BxL is not None and (reason := self.document_refusal(cfg, call.mode)):
      raise ValueError(f"segment_ids cannot reset {reason}.")
    return Context(call.positions_BxL, rotation.tables_for(cfg, call.positions_BxL), call.mode, call.segment_ids_BxL)

  def init_state(self, cfg: base.ModelConfig, batch_size: int, max_len: int | None = None
                 ) -> RetentionState:
    """`kv [B, H, d_k, d_v]` zeros, plus `key_sum [B, H, d_k]` if normalised; float32 (`max_len` is unused)."""
    del max_len
    heads = cfg.num_heads
    d_k, d_v = cfg.d_model // heads, cfg.value_dim // heads
    key_sum = jnp.zeros((batch_size, heads, d_k), jnp.float32) if cfg.stability_norm else None
    return RetentionState(jnp.zeros((batch_size, heads, d_k, d_v), jnp.float32), key_sum)

  def matmul_params(self, cfg: base.ModelConfig) -> int:
    """q (d^2), k (d^2), v (d d_v), each of k and v scaled by num_kv_heads / num_heads, g (d d_v), out (d_v d)."""
    d, v = cfg.d_model, cfg.value_dim
    kv_share = kv_heads(cfg) / cfg.num_heads
    return d * d + round(kv_share * (d * d + d * v)) + d * v + v * d

  def mixing_flops(self, cfg: base.ModelConfig, seq_len: int, mode: str) -> int:
    """As the form computes them. parallel: the full [L, L] score matrix and its product with V, 2 L (d + d_v) per
    token; chunkwise: the same inside a chunk of C, plus the cross-chunk read q S and the state update k^T v,
    2 C (d + d_v) + 4 d d_v / H; recurrent: the state update and read, 4 d d_v / H."""
    d, v, h = cfg.d_model, cfg.value_dim, cfg.num_heads
    state_rw = 4 * d * v // h
    if mode == "parallel":
      return 2 * seq_len * (d + v)
    if mode == "chunkwise":
      return 2 * min(cfg.chunk_size, seq_len) * (d + v) + state_rw
    if mode == "recurrent":
      return state_rw
    raise ValueError(f"unknown mode {mode!r}; choose parallel, chunkwise or recurrent.")

  def check_backend(self, cfg: base.ModelConfig, backend: str | None = None) -> None:
    check_retention_impl(cfg, backend)

  def check_sequence_split(self, cfg: base.ModelConfig, where: str, devices: int, length: int,
                           modes: tuple[str, ...]) -> None:
    if "recurrent" in modes:
      raise ValueError(f"{where}, which the recurrent form (one token after another) cannot use: use the parallel "
                       "or chunkwise mode, or a mesh whose sequence axis has size 1.")
    if cfg.retention_impl == "pallas":
      raise ValueError(f"{where}, but the Pallas kernels run whole sequences only: use model.retention_impl='xla' "
                       "(or 'auto', which runs XLA's form where sequences are split).")
    if length % (devices * cfg.chunk_size):
      raise ValueError(f"{where} in whole chunks, so the {length} tokens of each call must be a multiple of "
                       f"{devices} x model.chunk_size {cfg.chunk_size} = {devices * cfg.chunk_size}: change "
                       "train.seq_len (or train.segment_len), the chunk size or the sequence axis's size.")

  def check_segments(self, cfg: base.ModelConfig, segment_len: int, seq_len: int, mode: str) -> None:
    if mode == "chunkwise" and stability.torchscale_normaliser(cfg) and segment_len % cfg.chunk_size:
      raise ValueError(f"train.segment_len={segment_len} is not a multiple of model.chunk_size={cfg.chunk_size}: "
                       "the torchscale-style chunkwise normaliser depends on where chunks start; choose a multiple "
                       "of the chunk size.")

  def document_refusal(self, cfg: base.ModelConfig, mode: str) -> str | None:
    if mode == "chunkwise" and stability.torchscale_normaliser(cfg):
      return ("the chunkwise form of model.stability_norm_style='torchscale' (its per-chunk scalars span "
              "documents): use the parallel or recurrent form, or model.stability_norm_style='shared'")
    return None


RETENTION = Retention()
