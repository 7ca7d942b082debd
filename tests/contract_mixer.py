"""A test-only token mixer, the worked example of docs/models.md's "Adding a mixer": causal linear attention without
decay, o_t = q_t . S_t with S_t = sum_{s<=t} k_s^T v_s per head (keys scaled by d_k^-0.5), its decoding state S
`LinearAttentionState(kv [B, H, d_k, d_v])` (fixed size). Its three forms: the parallel form's [L, L] scores, chunks of
`model.chunk_size` carrying S (a scan of the parallel form), one token at a time. Packed documents reset S in the
parallel and recurrent forms; the chunkwise form refuses them (so the contract suite checks a refusal too).
tests/test_mixer_contract.py registers it as `model.mixer=NAME` for its tests and runs the contract on it."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from retnet_jax.core import segments
from retnet_jax.mixers import base
from retnet_jax.nn import layers

NAME = "test_linear_attention"


class LinearAttentionState(NamedTuple):
  """One layer's decoding state: S, the sum of k^T v so far, `[B, H, d_k, d_v]` float32."""
  kv: jax.Array


def _parallel(q, k, v, s_BxHxKxV, segment_ids_BxL=None):
  """Every token at once: causal [L, L] scores within each document, plus q . S_in on the row's first document;
  (out `[B, L, H, d_v]`, the last document's S)."""
  length = q.shape[1]
  visible_BxLxL = jnp.tril(jnp.ones((1, length, length), bool))
  document_BxL = jnp.zeros(q.shape[:2], jnp.int32)
  if segment_ids_BxL is not None:
    document_BxL = segments.document_index(segment_ids_BxL)
    visible_BxLxL = visible_BxLxL & (document_BxL[:, :, None] == document_BxL[:, None, :])
  scores_BxHxLxL = jnp.einsum("blhk,bmhk->bhlm", q, k) * visible_BxLxL[:, None]
  out = jnp.einsum("bhlm,bmhv->blhv", scores_BxHxLxL, v)
  last_BxL = document_BxL == document_BxL[:, -1:]  # S reaches the first document; the last one's keys leave
  out = out + jnp.einsum("blhk,bhkv->blhv", q, s_BxHxKxV) * (document_BxL == 0)[..., None, None]
  kept_B = (document_BxL[:, -1] == 0)[:, None, None, None]
  return out, jnp.where(kept_B, s_BxHxKxV, 0) + jnp.einsum("blhk,blhv->bhkv", k * last_BxL[..., None, None], v)


def _chunkwise(q, k, v, s_BxHxKxV, size):
  """The parallel form per chunk of `size`, S carried by a scan (zero-padded keys add nothing to S)."""
  (batch, length, heads, _), chunks = q.shape, -(-q.shape[1] // size)
  to_chunks = lambda x: jnp.moveaxis(jnp.pad(x, ((0, 0), (0, chunks * size - length), (0, 0), (0, 0))).reshape(
      batch, chunks, size, heads, -1), 1, 0)
  s_BxHxKxV, out_CxBxSxHxV = jax.lax.scan(lambda s, qkv: _parallel(*qkv, s)[::-1], s_BxHxKxV,
                                          tuple(map(to_chunks, (q, k, v))))
  return jnp.moveaxis(out_CxBxSxHxV, 0, 1).reshape(batch, chunks * size, heads, -1)[:, :length], s_BxHxKxV


def _recurrent(q, k, v, s_BxHxKxV, starts_BxL):
  """One token per scan step: S zeroed where a document starts, S += k^T v, o = q . S."""
  def step(s, inputs):
    q_t, k_t, v_t, start_B = inputs
    s = jnp.where(start_B[:, None, None, None], 0, s) + jnp.einsum("bhk,bhv->bhkv", k_t, v_t)
    return s, jnp.einsum("bhk,bhkv->bhv", q_t, s)
  s_BxHxKxV, out_LxBxHxV = jax.lax.scan(step, s_BxHxKxV, tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v, starts_BxL)))
  return jnp.swapaxes(out_LxBxHxV, 0, 1), s_BxHxKxV


class LinearAttentionLayer(nnx.Module):
  """q, k, v projections, the form of the call, output projection; q, k, v and S in float32 (float64 for float64
  inputs)."""

  def __init__(self, cfg, *, dtype, rngs: nnx.Rngs):
    d, self.heads, self.chunk_size, self.dtype = cfg.d_model, cfg.num_heads, cfg.chunk_size, dtype
    dense = lambda i, o, axes: layers.Dense(i, o, axes, init=layers.xavier_uniform(2**-2.5), dtype=dtype, rngs=rngs)
    self.q_proj, self.k_proj = dense(d, d, ("embed", "heads")), dense(d, d, ("embed", "heads"))
    self.v_proj = dense(d, cfg.value_dim, ("embed", "heads"))
    self.out_proj = dense(cfg.value_dim, d, ("heads", "embed"))

  def __call__(self, x_BxLxD, context: base.Call, state: base.State | None):
    """`x [B, L, D]` in the call `context` (positions, form, documents) from `state` (None: empty) -> (y, state)."""
    positions_BxL, mode, segment_ids_BxL = context
    batch, length, _ = x_BxLxD.shape
    wide = jnp.promote_types(x_BxLxD.dtype, jnp.float32)
    split = lambda proj: proj(x_BxLxD).reshape(batch, length, self.heads, -1).astype(wide)
    q, k, v = split(self.q_proj), split(self.k_proj), split(self.v_proj)
    k = jnp.where((positions_BxL >= 0)[..., None, None], k * k.shape[-1]**-0.5, 0)  # left padding adds no key
    s = jnp.zeros((batch, self.heads, k.shape[-1], v.shape[-1]), wide) if state is None else state.kv.astype(wide)
    if mode == "parallel":
      out, s = _parallel(q, k, v, s, segment_ids_BxL)
    elif mode == "chunkwise":
      out, s = _chunkwise(q, k, v, s, self.chunk_size)
    else:
      starts_BxL = jnp.zeros((batch, length), bool) if segment_ids_BxL is None else segments.starts(segment_ids_BxL)
      out, s = _recurrent(q, k, v, s, starts_BxL)
    return self.out_proj(out.reshape(batch, length, -1).astype(self.dtype)), LinearAttentionState(s)


class LinearAttention(base.Mixer):
  """The registry's side of it: reads d_model, num_heads, value_dim, chunk_size; no fields of its own."""

  name = NAME
  modes = ("parallel", "chunkwise", "recurrent")
  splits_sequences = False
  fixed_state = True

  def check_config(self, cfg) -> None:
    for field in ("d_model", "value_dim"):
      if getattr(cfg, field) % cfg.num_heads:
        raise ValueError(f"model.{field}={getattr(cfg, field)} is not divisible by model.num_heads={cfg.num_heads}.")

  def layer(self, cfg, *, dtype, rngs: nnx.Rngs) -> LinearAttentionLayer:
    return LinearAttentionLayer(cfg, dtype=dtype, rngs=rngs)

  def context(self, cfg, call: base.Call) -> base.Call:
    """The call itself (nothing to share beyond it), refused where documents cannot reset in its form."""
    if call.segment_ids_BxL is not None and (reason := self.document_refusal(cfg, call.mode)):
      raise ValueError(f"segment_ids cannot reset {reason}.")
    return call

  def init_state(self, cfg, batch_size: int, max_len: int | None = None) -> LinearAttentionState:
    """S = 0, `kv [B, H, d_k, d_v]` float32 (`max_len` unused: S keeps its size)."""
    heads = cfg.num_heads
    return LinearAttentionState(jnp.zeros((batch_size, heads, cfg.d_model // heads, cfg.value_dim // heads),
                                          jnp.float32))

  def matmul_params(self, cfg) -> int:
    """q, k (d^2 each), v (d d_v), out (d_v d)."""
    return 2 * cfg.d_model**2 + 2 * cfg.d_model * cfg.value_dim

  def mixing_flops(self, cfg, seq_len: int, mode: str) -> int:
    """parallel: [L, L] scores and their product with V, 2 L (d + d_v) per token; chunkwise: the same in a chunk of
    C, plus the read q S and the update k^T v, 4 d d_v / H; recurrent: the update and the read."""
    state_rw = 4 * cfg.d_model * cfg.value_dim // cfg.num_heads
    if mode == "parallel":
      return 2 * seq_len * (cfg.d_model + cfg.value_dim)
    return state_rw + (2 * min(cfg.chunk_size, seq_len) * (cfg.d_model + cfg.value_dim) if mode == "chunkwise" else 0)

  def document_refusal(self, cfg, mode: str) -> str | None:
    if mode == "chunkwise":
      return (f"the chunkwise form of model.mixer={NAME!r} (its chunks carry S across documents): use the parallel "
              "or recurrent form")
    return None


LINEAR_ATTENTION = LinearAttention()
