"""Next-token losses shared by training and evaluation: the mean token loss, its segmented form, per-sequence NLL.

A batch is `tokens [B, L + 1]` (text: every target counts alike) or `(tokens [B, L + 1], weights [B, L])` (synthetic
tasks: float32 weights over the targets, 1 at the answers and 0 elsewhere).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from retnet_jax import segments


def token_nll(logits_BxLxV: jax.Array, targets_BxL: jax.Array) -> jax.Array:
  """Cross-entropy (nats) of each target token under the logits: `[B, L]` float32."""
  return optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, targets_BxL)


Batch = jax.Array | tuple[jax.Array, jax.Array]


def split_batch(batch: Batch) -> tuple[jax.Array, jax.Array | None]:
  """(tokens `[B, L + 1]`, weights `[B, L]` or None for text) of a batch."""
  return batch if isinstance(batch, tuple) else (batch, None)


def token_loss(graphdef: nnx.GraphDef, params, batch: Batch, mode: str, remat: str = "none",
               segment_len: int = 0, segment_ids: jax.Array | None = None) -> jax.Array:
  """Mean next-token cross-entropy (nats) of `tokens [B, L + 1]`: inputs `[:, :-1]`, targets `[:, 1:]`.

  Args:
    graphdef, params: the model, as `nnx.split` gives them.
    batch: int32 tokens `[B, L + 1]`, or (tokens, weights `[B, L]`): then the weighted mean over the targets.
    mode: the retention form (`parallel`, `chunkwise`, `recurrent`).
    remat: `none` or a `model.REMAT_POLICIES` key: each block recomputed in the backward pass.
    segment_len: in (0, L): backpropagate through segments of this many tokens that carry the state, each
      under `jax.checkpoint`, so activation memory grows with the segment, not L; same loss and gradients to
      float rounding. Otherwise whole sequences.
    segment_ids: integer document ids `[B, L + 1]` of the tokens (packed documents: `model(segment_ids=...)` on the
      inputs), or None. Segments slice them alongside the tokens and empty the state of a row whose segment opens a
      document at its first token.
  Returns:
    The scalar mean loss, float32.
  """
  tokens_BxL1, weights_BxL = split_batch(batch)
  inputs_BxL, targets_BxL = tokens_BxL1[:, :-1], tokens_BxL1[:, 1:]
  batch_size, length = inputs_BxL.shape
  segments.check_segment_ids(segment_ids, batch_size, length + 1)
  ids_BxL = None if segment_ids is None else segment_ids[:, :-1]
  if not 0 < segment_len < length:
    logits, _ = nnx.merge(graphdef, params)(inputs_BxL, mode=mode, remat=remat, segment_ids=ids_BxL)
    nll_BxL = token_nll(logits, targets_BxL)
    return nll_BxL.mean() if weights_BxL is None else jnp.sum(nll_BxL * weights_BxL) / jnp.sum(weights_BxL)
  num_segments = -(-length // segment_len)
  # Padding goes after the last token, so (causal) it changes no real position's output; its loss is masked.
  pad = num_segments * segment_len - length
  split = lambda x_BxL: jnp.pad(x_BxL, ((0, 0), (0, pad))).reshape(
      batch_size, num_segments, segment_len).swapaxes(0, 1)

  # params enter as an argument, not a closure: a block's own `remat` must see them at this trace level.
  @functools.partial(jax.checkpoint, prevent_cse=False)  # inside a scan, CSE cannot undo the recomputation
  def segment(params, state, xs):
    inputs, targets, weights, *documents = xs
    if documents:  # (ids, whether the segment's first token opens a document [B])
      state = segments.empty_rows(state, documents[1])
    logits, state = nnx.merge(graphdef, params)(inputs, mode=mode, state=state, remat=remat,
                                                segment_ids=documents[0] if documents else None)
    return state, jnp.sum(token_nll(logits, targets) * weights)

  weights = jnp.ones((batch_size, length), jnp.float32) if weights_BxL is None else weights_BxL
  xs = (split(inputs_BxL), split(targets_BxL), split(weights))
  if ids_BxL is not None:
    xs += (split(ids_BxL), segments.starts(ids_BxL)[:, ::segment_len].T)
  _, sums = jax.lax.scan(functools.partial(segment, params), nnx.merge(graphdef, params).init_state(batch_size), xs)
  return sums.sum() / (batch_size * length if weights_BxL is None else jnp.sum(weights_BxL))


@functools.partial(jax.jit, static_argnames=("graphdef", "mode"))
def sequence_nll(graphdef: nnx.GraphDef, params, tokens_BxL1: jax.Array, mode: str
                 ) -> tuple[jax.Array, jax.Array]:
  """Summed next-token NLL per sequence `[B]` (float32) and the logits of the last position `[B, V]`."""
  logits, _ = nnx.merge(graphdef, params)(tokens_BxL1[:, :-1], mode=mode)
  return token_nll(logits, tokens_BxL1[:, 1:]).sum(axis=-1), logits[:, -1]
