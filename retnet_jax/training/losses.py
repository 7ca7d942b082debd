"""Next-token losses shared by training and evaluation: the mean token loss, its segmented form, per-sequence NLL.

A batch is `tokens [B, L + 1]` (text: every target counts alike) or `(tokens [B, L + 1], weights [B, L])` (synthetic
tasks: float32 weights over the targets, 1 at the answers and 0 elsewhere), or with packed documents
(`data.reset_at_documents`) `(tokens, weights or None, segment_ids [B, L + 1])`: each token's document id, the
inputs' `[:, :-1]` passed to the model, so a target is predicted from its input's document alone.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from retnet_jax.core import segments


def token_nll(logits_BxLxV: jax.Array, targets_BxL: jax.Array) -> jax.Array:
  """Cross-entropy (nats) of each target token under the logits: `[B, L]` float32."""
  return optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, targets_BxL)


def tiled_nll(logits_fn, x_BxLxD: jax.Array, targets_BxL: jax.Array, tile: int) -> jax.Array:
  """`token_nll(logits_fn(x), targets)` computed over tiles of about `tile` tokens: `[B, L]` float32.

  Each tile takes the same positions of every row (`tile // B` of them, at least one; the batch axis stays whole,
  so a batch split over devices stays split) and runs the output projection, logsumexp and loss under
  `jax.checkpoint` in a scan: the backward pass recomputes one tile's logits at a time, so the `[B, L, vocab]`
  logits never exist whole, for one more output projection per step.

  Args:
    logits_fn: hidden states `[B, T, D]` -> float32 logits `[B, T, vocab]` (the model's `logits`).
    x_BxLxD: the final hidden states. targets_BxL: integer targets.
    tile: tokens per tile (over the whole batch); positive.
  """
  batch, length = targets_BxL.shape
  size = min(max(tile // batch, 1), length)
  num_tiles = -(-length // size)
  pad = num_tiles * size - length  # zero padding after the last position: its losses are dropped
  split = lambda x: jnp.moveaxis(jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)).reshape(
      batch, num_tiles, size, *x.shape[2:]), 1, 0)
  one_tile = jax.checkpoint(lambda x_BxTxD, targets_BxT: token_nll(logits_fn(x_BxTxD), targets_BxT),
                            prevent_cse=False)  # inside a scan, CSE cannot undo the recomputation
  _, nll_NxBxT = jax.lax.scan(lambda carry, xs: (carry, one_tile(*xs)), None, (split(x_BxLxD), split(targets_BxL)))
  return jnp.moveaxis(nll_NxBxT, 0, 1).reshape(batch, -1)[:, :length]


def model_nll(model, inputs_BxL: jax.Array, targets_BxL: jax.Array, loss_tile: int = 0, **call
              ) -> tuple[jax.Array, Any]:
  """`(token_nll [B, L], the model's state)` of a model call (`call`: mode, state, remat, segment_ids); with
  `loss_tile` > 0 from its hidden states over tiles of that many tokens (`tiled_nll`)."""
  if loss_tile <= 0:
    logits, state = model(inputs_BxL, **call)
    return token_nll(logits, targets_BxL), state
  x_BxLxD, state = model.hidden(inputs_BxL, **call)
  return tiled_nll(model.logits, x_BxLxD, targets_BxL, loss_tile), state


Batch = jax.Array | tuple[jax.Array, jax.Array] | tuple[jax.Array, jax.Array | None, jax.Array]


def split_batch(batch: Batch) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
  """(tokens `[B, L + 1]`, weights `[B, L]` or None for text, segment ids `[B, L + 1]` or None) of a batch; ids of
  another shape than the tokens are refused."""
  tokens_BxL1, weights_BxL, segment_ids_BxL1 = (*batch, None)[:3] if isinstance(batch, tuple) else (batch, None, None)
  segments.check_segment_ids(segment_ids_BxL1, *tokens_BxL1.shape, name="the batch's segment_ids (like its tokens)")
  return tokens_BxL1, weights_BxL, segment_ids_BxL1


def input_ids(segment_ids_BxL1: jax.Array | None) -> jax.Array | None:
  """The inputs' segment ids `[B, L]` of a batch's `[B, L + 1]` (None stays None)."""
  return None if segment_ids_BxL1 is None else segment_ids_BxL1[:, :-1]


def token_loss(graphdef: nnx.GraphDef, params, batch: Batch, mode: str, remat: str = "none",
               segment_len: int = 0, loss_tile: int = 0) -> jax.Array:
  """Mean next-token cross-entropy (nats) of `tokens [B, L + 1]`: inputs `[:, :-1]`, targets `[:, 1:]`.

  Args:
    graphdef, params: the model, as `nnx.split` gives them.
    batch: int32 tokens `[B, L + 1]`, or (tokens, weights `[B, L]`): then the weighted mean over the targets; or
      (tokens, weights or None, segment ids `[B, L + 1]`): packed documents, the inputs' ids passed to the model.
    mode: the retention form (`parallel`, `chunkwise`, `recurrent`).
    remat: `none` or a `layer_stack.REMAT_POLICIES` key: each block recomputed in the backward pass.
    segment_len: in (0, L): backpropagate through segments of this many tokens that carry the state, each
      under `jax.checkpoint`, so activation memory grows with the segment, not L; same loss and gradients to
      float rounding. Otherwise whole sequences. With segment ids, a row whose segment opens a document at its
      first token starts that segment from the empty state.
    loss_tile: > 0: the output projection and loss over tiles of this many tokens (`tiled_nll`); 0: at once.
  Returns:
    The scalar mean loss, float32.
  """
  tokens_BxL1, weights_BxL, segment_ids_BxL1 = split_batch(batch)
  inputs_BxL, targets_BxL, ids_BxL = tokens_BxL1[:, :-1], tokens_BxL1[:, 1:], input_ids(segment_ids_BxL1)
  batch_size, length = inputs_BxL.shape
  if not 0 < segment_len < length:
    nll_BxL, _ = model_nll(nnx.merge(graphdef, params), inputs_BxL, targets_BxL, loss_tile, mode=mode, remat=remat,
                           segment_ids=ids_BxL)
    return nll_BxL.mean() if weights_BxL is None else jnp.sum(nll_BxL * weights_BxL) / jnp.sum(weights_BxL)
  num_segments = -(-length // segment_len)
  # Padding goes after the last token, so (causal) it changes no real position's output; its loss is masked.
  pad = num_segments * segment_len - length
  split = lambda x_BxL, mode="constant": jnp.pad(x_BxL, ((0, 0), (0, pad)), mode=mode).reshape(
      batch_size, num_segments, segment_len).swapaxes(0, 1)

  # params enter as an argument, not a closure: a block's own `remat` must see them at this trace level.
  @functools.partial(jax.checkpoint, prevent_cse=False)  # inside a scan, CSE cannot undo the recomputation
  def segment(params, state, xs):
    inputs, targets, weights, ids, opens_B = xs
    if ids is not None:  # a document opening on the segment's first token starts from the empty state
      state = segments.empty_rows(state, opens_B)
    nll, state = model_nll(nnx.merge(graphdef, params), inputs, targets, loss_tile, mode=mode, state=state,
                           remat=remat, segment_ids=ids)
    return state, jnp.sum(nll * weights)

  weights = jnp.ones((batch_size, length), jnp.float32) if weights_BxL is None else weights_BxL
  opens_KxB = None
  if ids_BxL is not None:  # where a document starts on a segment's first token (never on the first segment's)
    opens_KxB = segments.starts(ids_BxL)[:, ::segment_len].T
  xs = (split(inputs_BxL), split(targets_BxL), split(weights), None if ids_BxL is None else split(ids_BxL, "edge"),
        opens_KxB)
  _, sums = jax.lax.scan(functools.partial(segment, params), nnx.merge(graphdef, params).init_state(batch_size), xs)
  return sums.sum() / (batch_size * length if weights_BxL is None else jnp.sum(weights_BxL))


def batch_nll(graphdef: nnx.GraphDef, params, batch: Batch, mode: str) -> tuple[jax.Array, jax.Array]:
  """Next-token NLL of each target `[B, L]` (float32) of a text batch and the logits `[B, L, V]`."""
  tokens_BxL1, _, segment_ids_BxL1 = split_batch(batch)
  logits, _ = nnx.merge(graphdef, params)(tokens_BxL1[:, :-1], mode=mode, segment_ids=input_ids(segment_ids_BxL1))
  return token_nll(logits, tokens_BxL1[:, 1:]), logits


@functools.partial(jax.jit, static_argnames=("graphdef", "mode"))
def sequence_nll(graphdef: nnx.GraphDef, params, batch: Batch, mode: str) -> tuple[jax.Array, jax.Array]:
  """Summed next-token NLL per sequence `[B]` (float32) of a text batch and the logits of the last position
  `[B, V]`."""
  nll_BxL, logits = batch_nll(graphdef, params, batch, mode)
  return nll_BxL.sum(axis=-1), logits[:, -1]
