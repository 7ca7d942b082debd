"""A model run over a long sequence block by block, its state carried from block to block, so that memory depends on
the block and not on the length: the prefill of a long prompt, the evaluation of a long sequence.

    block = streaming.check_block(model.config, None)            # the default: 2048 tokens, whole chunks
    state = streaming.final_state(model, tokens_BxL, "chunkwise", block, state)  # = model(tokens, ...)[1]
    carry = streaming.fold(fn, carry, length, block)  # carry = fn(carry, start, width) per block

The forms hand their state over exactly (any form continues any other), so a streamed run equals one call to float
rounding. Full blocks run in one compiled `fori_loop` whose temporaries are one block's; the last, partial block runs
after them, so blocks start where one call's chunks would (a multiple of `chunk_size` from the first column, which
the torchscale normaliser needs). A block that starts a packed document in some row starts that row from the empty
state, as one call does (`segments.empty_rows`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from retnet_jax.core import config_checks, segments, sharding
from retnet_jax.models import model_config

DEFAULT_BLOCK = 2048  # tokens per block, rounded up to whole chunks: one block's temporaries, a few MB to 100s of MB


def block_unit(cfg: model_config.ModelConfig) -> int:
  """The tokens a block must be a multiple of: `chunk_size` (a RetNet's; 1 for a Transformer), times the devices of
  the active mesh's axis that splits sequences, which split each block into whole chunks."""
  split = sharding.sequence_split()
  return getattr(cfg, "chunk_size", 1) * (1 if split is None else split[1])


def check_block(cfg: model_config.ModelConfig, block: int | None, name: str = "prefill_block") -> int:
  """`block` checked against the model config `cfg` (None: `DEFAULT_BLOCK` rounded up to whole units, `block_unit`;
  0: no streaming, one call), or ValueError naming `name`, the value and the fix."""
  unit = block_unit(cfg)
  if block is None:
    return -(-DEFAULT_BLOCK // unit) * unit
  if block == 0 and not isinstance(block, bool):
    return 0
  block = config_checks.positive_int(block, name, "tokens per block, or 0: the whole sequence in one call")
  if block % unit:
    what = (f"model.chunk_size={cfg.chunk_size}" if hasattr(cfg, "chunk_size") else "1") + (
        f" times the {unit // getattr(cfg, 'chunk_size', 1)} devices that split each sequence"
        if unit != getattr(cfg, "chunk_size", 1) else "")
    raise ValueError(f"{name}={block} is not a multiple of {what} = {unit}, so its blocks would not hold whole "
                     f"chunks; use {max(unit, block // unit * unit)} or {-(-block // unit) * unit}.")
  return block


def fold(fn: Callable[[Any, Any, int], Any], carry: Any, length: int, block: int) -> Any:
  """`carry = fn(carry, start, width)` over consecutive blocks `[start, start + width)` of `length` columns, in
  order: the full blocks of `block` columns in one `fori_loop` (`start` traced there), a last partial block after
  them (`start` a Python int); `block` 0 or at least `length`: one call (0, length). `fn` takes its block's columns
  (`columns`). Returns the final carry."""
  if not 0 < block < length:
    return fn(carry, 0, length)
  num_full, rest = divmod(length, block)
  if num_full == 1:
    carry = fn(carry, 0, block)
  else:
    carry = jax.lax.fori_loop(0, num_full, lambda i, c: fn(c, i * block, block), carry)
  if rest:
    carry = fn(carry, num_full * block, rest)
  return carry


def columns(x_BxL: jax.Array | None, start, width: int) -> jax.Array | None:
  """Columns `[start, start + width)` of `x [B, L, ...]` (`start` may be traced); None stays None."""
  return None if x_BxL is None else jax.lax.dynamic_slice_in_dim(x_BxL, start, width, axis=1)


def opens_at(segment_ids_BxL: jax.Array | None, start) -> jax.Array | None:
  """`[B]` bool: whether column `start` opens a document (its id differs from the column before; never at 0), or
  None without documents."""
  if segment_ids_BxL is None:
    return None
  before = jax.lax.dynamic_index_in_dim(segment_ids_BxL, jnp.maximum(start - 1, 0), axis=1, keepdims=False)
  here = jax.lax.dynamic_index_in_dim(segment_ids_BxL, start, axis=1, keepdims=False)
  return (here != before) & (start > 0)


def enter_block(state: Any, segment_ids_BxL: jax.Array | None, start) -> Any:
  """The state a block starting at column `start` of the whole `segment_ids` continues: emptied in the rows where a
  document opens at that column."""
  opens_B = opens_at(segment_ids_BxL, start)
  return state if opens_B is None else segments.empty_rows(state, opens_B)


def final_state(model: Any, tokens_BxL: jax.Array, mode: str, block: int, state: Any = None,
                segment_ids_BxL: jax.Array | None = None, on_block: Callable[[Any, Any], None] | None = None,
                length: int | None = None) -> Any:
  """The model's state after `tokens [B, L]` run in `mode` from `state` (None: `init_state`), block by block
  (`block` tokens, `check_block`'s; 0: one call): `model(tokens, mode, state, segment_ids=...)[1]` to float
  rounding, with one block's memory. `length`: run the first `length` columns only (None: all; no copy of the
  rest is made). `on_block(columns_done, state)` is traced after each kind of block (for a host callback reporting
  progress: given the state, it runs once the block has)."""
  if state is None:
    state = model.init_state(tokens_BxL.shape[0])

  def run(state, start, width):
    state = enter_block(state, segment_ids_BxL, start)
    _, state = model.hidden(columns(tokens_BxL, start, width), mode, state,
                            segment_ids=columns(segment_ids_BxL, start, width))
    if on_block is not None:
      on_block(start + width, state)
    return state
  return fold(run, state, tokens_BxL.shape[1] if length is None else length, block)
