"""Chunkwise retention as Pallas kernels, with `retention.chunkwise_retention`'s contract: the public functions, their
checks and padding, and the fused layout's custom VJP (the split layout's is `split`).

The sequence is zero-padded to whole chunks and d_v to whole value tiles here, outside the custom VJPs, so autodiff
of the padding hands the kernels aligned cotangents; the kernels are told the true length (split: per-token decays
are padded with 0, a per-head decay counts real rows only), so the final state decays by it. The fused layout stops
log_decay's gradient (`lax.stop_gradient`); the split layout differentiates it. Packed documents (`segment_ids`)
reach the kernels as each token's document index in its row (`segments.document_index`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from retnet_jax.core import segments
from retnet_jax.mixers import retention
from retnet_jax.mixers.kernels import split, support
from retnet_jax.mixers.kernels.backward import backward
from retnet_jax.mixers.kernels.forward import forward


class _Static(NamedTuple):
  size: int
  length: int
  precision: lax.Precision | str | None
  config: support.KernelConfig
  interpret: bool


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _fused(q, k, v, log_decay, state, key_sum, documents, static: _Static):
  return forward(q, k, v, log_decay, state, key_sum, documents=documents, size=static.size, length=static.length,
                 precision=static.precision, tiling=static.config.forward, interpret=static.interpret)


def _fused_fwd(q, k, v, log_decay, state, key_sum, documents, static: _Static):
  return _fused(q, k, v, log_decay, state, key_sum, documents, static), (q, k, v, log_decay, state, key_sum, documents)


def _fused_bwd(static: _Static, residuals, cotangents):
  """Gradients for q, k, v and the state; zeros for log_decay and the key sum, which the callers stop, and none for
  the integer document index."""
  q, k, v, log_decay, state, key_sum, documents = residuals
  d_out, d_final_state, _, _ = cotangents
  dq, dk, dv, d_state = backward(q, k, v, log_decay, state, d_out, d_final_state, documents=documents,
                                 size=static.size, length=static.length, precision=static.precision,
                                 tiling=static.config.backward, interpret=static.interpret)
  return dq, dk, dv, jnp.zeros_like(log_decay), d_state, None if key_sum is None else jnp.zeros_like(key_sum), None


_fused.defvjp(_fused_fwd, _fused_bwd)


def _check(q, k, v, log_decay, chunk_size, state, key_sum, segment_ids, layout: str) -> int:
  """Validates the inputs as the XLA forms do, plus the kernels' dtypes and the decays' shape; returns the chunk
  size as an int."""
  log_decay = jnp.asarray(log_decay)
  if log_decay.ndim == 3 and q.ndim == 4:
    expected = q.shape[:3]
    if log_decay.shape != expected:
      raise ValueError(f"log_decay must be [heads] = ({q.shape[2]},) or [batch, seq, heads] = {expected}; got "
                       f"{log_decay.shape}.")
    if layout != "split":
      raise ValueError("per-token decays ([batch, seq, heads] log_decay) run on the split kernels only: use "
                       "KernelConfig(layout='split').")
    log_decay = jnp.max(log_decay, axis=(0, 1))  # the [heads] check below: each head's largest log decay
  retention.check_inputs(q, k, v, log_decay, state)
  segments.check_segment_ids(segment_ids, q.shape[0], q.shape[1])
  size = retention.check_chunk_size(chunk_size)
  if not q.dtype == k.dtype == v.dtype or q.dtype not in support.DTYPES:
    raise ValueError(f"the Pallas retention kernels take q, k and v of one dtype, float32 or bfloat16; got "
                     f"{q.dtype}, {k.dtype}, {v.dtype}.")
  expected = (q.shape[0], q.shape[2], q.shape[3])
  if key_sum is not None and key_sum.shape != expected:
    raise ValueError(f"key_sum must be [batch, heads, d_k] = {expected}; got {key_sum.shape}.")
  return size


def _pad_axis(x, axis: int, multiple: int):
  """`x` zero-padded at the end of `axis` to a multiple of `multiple`."""
  pad = -x.shape[axis] % multiple
  return jnp.pad(x, [(0, pad if i == axis else 0) for i in range(x.ndim)]) if pad else x


def _run(q, k, v, log_decay, chunk_size, state, key_sum, with_key_sum, segment_ids, precision, config, interpret):
  """Both public functions: `(out, final_state, qz, final_key_sum)`, the last two None unless `with_key_sum`."""
  config = config or support.default_config(q.shape[-1], v.shape[-1])
  size = _check(q, k, v, log_decay, chunk_size, state, key_sum, segment_ids, config.layout)
  batch, length, heads, key_dim = q.shape
  value_dim = v.shape[-1]
  interpret = support.resolve_interpret(interpret)
  if not interpret:
    support.check_supported(key_dim, value_dim, q.dtype, size, layout=config.layout)
  state = jnp.zeros((batch, heads, key_dim, value_dim), jnp.float32) if state is None else state.astype(jnp.float32)
  if with_key_sum:
    key_sum = jnp.zeros((batch, heads, key_dim), jnp.float32) if key_sum is None else key_sum.astype(jnp.float32)
    key_sum = lax.stop_gradient(key_sum)
  if length == 0:  # nothing to retain: the states pass through
    qz = None if key_sum is None else jnp.zeros((batch, 0, heads), jnp.float32)
    return jnp.zeros(v.shape, v.dtype), state, qz, key_sum

  q, k, v = (_pad_axis(x, 1, size) for x in (q, k, v))
  documents = None
  if segment_ids is not None:  # the padding joins the last document: it cuts no state
    documents = jnp.pad(segments.document_index(segment_ids), ((0, 0), (0, q.shape[1] - length)), mode="edge")
  v, state_padded = _pad_axis(v, 3, config.value_multiple), _pad_axis(state, 3, config.value_multiple)
  log_decay = jnp.asarray(log_decay, jnp.float32)
  if config.layout == "split":
    log_decay = _pad_axis(log_decay, 1, size) if log_decay.ndim == 3 else log_decay
    static = split.Static(size, length, precision, config, interpret)
    out, final_state, qz, final_key_sum = split.split(q, k, v, log_decay, state_padded, key_sum, documents, static)
  else:
    static = _Static(size, length, precision, config, interpret)
    out, final_state, qz, final_key_sum = _fused(q, k, v, lax.stop_gradient(log_decay), state_padded, key_sum,
                                                 documents, static)
  out, final_state = out[:, :length, :, :value_dim], final_state[..., :value_dim]
  if key_sum is None:
    return out, final_state, None, None
  return out, final_state, lax.stop_gradient(qz[:, :length]), lax.stop_gradient(final_key_sum)


def chunkwise_retention(q, k, v, log_decay, chunk_size, state=None, *, segment_ids=None, precision=None,
                        config: support.KernelConfig | None = None, interpret: bool | None = None):
  """`retention.chunkwise_retention` as Pallas kernels, differentiable in q, k, v and state (and, in the split
  layout, log_decay).

  Args:
    q, k: `[batch, seq, heads, d_k]`. v: `[batch, seq, heads, d_v]`; q, k and v float32 or bfloat16, one dtype.
    log_decay: log(gamma) <= 0, `[heads]`, or per token `[batch, seq, heads]` (split layout only: S_n = gamma_n
      S_(n-1) + k_n^T v_n, o_n = q_n S_n); the fused layout stops its gradient. chunk_size: a positive integer
      (compiled on a GPU: one of `support.CHUNK_SIZES[layout]`; shorter sequences are padded to one chunk).
    state: the carried-in state `[batch, heads, d_k, d_v]`, or None for an empty one.
    segment_ids: integer `[batch, seq]`, packed documents (`segments`: a document is a maximal run of equal ids),
      or None for one document per row. Token n retains token m only within its document; the state carried in
      reaches each row's first document, the final state is its last document's.
    precision: the `lax.Precision` of every product in the kernels (on GPUs, float32 inputs multiply in TF32
      unless `HIGHEST`); products accumulate in float32 whatever it is.
    config: the kernels' layout and tilings (default `support.default_config`: split). interpret: Pallas interpret
      mode; None: interpreted unless JAX's default backend is a GPU.
  Returns:
    `(out [batch, seq, heads, d_v]` in v's dtype, `final_state [batch, heads, d_k, d_v]` float32).
  Raises:
    ValueError: bad shapes or dtypes, or, compiled, sizes beyond `support.check_supported`.
  """
  out, final_state, _, _ = _run(q, k, v, log_decay, chunk_size, state, None, False, segment_ids, precision, config,
                                interpret)
  return out, final_state


def chunkwise_retention_with_key_sum(q, k, v, log_decay, chunk_size, state=None, key_sum=None, *, segment_ids=None,
                                     precision=None, config: support.KernelConfig | None = None,
                                     interpret: bool | None = None):
  """`chunkwise_retention` that also carries the decayed key sum z and returns q_n . z_n, in the same pass: what
  the `shared` stability normaliser needs (`stability.divisor(style, mode, qz, positions, log_decay)`).

  z is retention's state for a ones value column, so qz equals the retention of ones that `layers.py` computes
  with a second call (there rounded to the compute dtype; here float32). qz and the key sum are constants to
  autodiff (`lax.stop_gradient`), as the normaliser's divisor is; out and the state are differentiable as in
  `chunkwise_retention`. The torchscale style's chunkwise normaliser (in-chunk |score| sums, chunk entry states)
  is not computed here: it stays on the XLA form (`retention.chunkwise_with_states`).

  Args:
    q, k, v, log_decay, chunk_size, state, segment_ids, precision, config, interpret: as in `chunkwise_retention`.
    key_sum: the carried-in key sum `[batch, heads, d_k]` (the layer state's `key_sum`), or None for zeros; with
      segment_ids, like the state, it reaches each row's first document, and qz and the key sum restart with each
      document.
  Returns:
    `(out, final_state, qz [batch, seq, heads] float32, final_key_sum [batch, heads, d_k] float32)`.
  """
  return _run(q, k, v, log_decay, chunk_size, state, key_sum, True, segment_ids, precision, config, interpret)
