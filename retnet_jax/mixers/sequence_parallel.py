"""Sequence-parallel chunkwise retention: one sequence split over the devices of a mesh axis.

With R devices along the axis, device r holds the slice of L_s = L / R tokens starting at r L_s and runs the
chunkwise form on it from a zero state. The slices' final states S_loc(j) are small (`[batch, heads, d_k, d_v]`,
whatever the length), and each head decays by a constant gamma, so one all-gather of them gives every device the
state entering its slice (as LASP-2 does for linear attention), and one sum over the devices the final state:

    S_in(r) = sum_{j<r} gamma^(L_s (r-1-j)) S_loc(j) + gamma^(r L_s) S_carried,    S_out = S_in(R).

The state entering chunk c of a slice is its local one plus gamma^(c S) S_in(r) (chunks of S tokens), and each chunk's
outputs follow from it as in the single-device form, at no extra matrix product. Autodiff runs backward through the
collectives.

With a per-token decay (`log_decay [batch, seq, heads]`, split over the axis like q) the powers become the products
of the gammas between: with A_j the sum of slice j's log decays (one all-gather of `[batch, heads]`),
gamma^(L_s (r-1-j)) is exp(sum_(j<i<r) A_i), gamma^(r L_s) is exp(sum_(i<r) A_i), and gamma^(c S) the exp of the slice's
log decays before chunk c: each exponent a sum of its own terms, as in `retention_decay`.

With packed documents (`segment_ids`), a document start is a decay of zero: a term of the sums above is dropped where
a document starts between it and the slice (or chunk) it enters, and S_loc(j) holds only slice j's last document.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from retnet_jax.core import segments
from retnet_jax.mixers import retention, retention_decay


def check_length(length: int, devices: int, chunk_size, axis_name: str) -> None:
  """ValueError unless `length` splits into `devices` slices of whole chunks."""
  size = retention.check_chunk_size(chunk_size)
  if length % (devices * size):
    raise ValueError(f"sequence-parallel retention splits the sequence over the {devices} devices of mesh axis "
                     f"{axis_name!r} in whole chunks, so its length {length} must be a multiple of {devices} x "
                     f"chunk_size {size} = {devices * size}: pad or cut the sequences to such a length, or choose a "
                     "chunk_size that divides length / devices.")


def _decay(log_decay_H, steps):
  """gamma^steps per head, shaped to scale states: `steps [...]` -> `[..., 1, heads, 1, 1]`."""
  powers = retention.powers(log_decay_H, jnp.asarray(steps).astype(log_decay_H.dtype))
  return jnp.moveaxis(powers, 0, -1)[..., None, :, None, None]


def _constant_decays(log_decay_H, r, devices: int, slice_len: int, num_chunks: int, size: int) -> dict:
  """The decays that carry states between slices and into chunks (`chunkwise_slice`), from a `[heads]` decay: powers
  of gamma, shaped `[..., 1, heads, 1, 1]` to scale states."""
  j_R = jnp.arange(devices)
  earlier_R = j_R < r
  return {"between": jnp.where(earlier_R[:, None, None, None, None],
                               _decay(log_decay_H, jnp.where(earlier_R, (r - 1 - j_R) * slice_len, 0)), 0),
          "out": _decay(log_decay_H, (devices - 1 - r) * slice_len), "in": _decay(log_decay_H, r * slice_len),
          "carried_out": _decay(log_decay_H, devices * slice_len),
          "chunks": _decay(log_decay_H, size * jnp.arange(num_chunks))}


def _per_token_decays(log_decay_BxLxH, r, axis_name: str, size: int) -> dict:
  """`_constant_decays` for this slice's per-token decay `[batch, seq / R, heads]` (in the accumulation dtype): the
  exps of sums of log decays, shaped `[..., batch, heads, 1, 1]`."""
  batch, length, heads = log_decay_BxLxH.shape
  total_BxH = jnp.sum(log_decay_BxLxH, axis=1)
  total_RxBxH = jax.lax.all_gather(total_BxH, axis_name)  # A_i: each slice's log decay
  i_R = jnp.arange(total_RxBxH.shape[0])
  sum_over = lambda which_R: jnp.sum(jnp.where(which_R[:, None, None], total_RxBxH, 0), axis=0)  # [B, H]
  scale = lambda exponent: jnp.exp(exponent)[..., None, None]
  # From the end of slice j < r to the start of slice r: the slices strictly between.
  between_RxR = (i_R[None, :] > i_R[:, None]) & (i_R[None, :] < r)
  between_RxBxH = jnp.sum(jnp.where(between_RxR[:, :, None, None], total_RxBxH[None], 0), axis=1)
  chunk_totals_BxCxH = jnp.sum(log_decay_BxLxH.reshape(batch, length // size, size, heads), axis=2)
  before_chunk_BxCxH = jnp.cumsum(jnp.pad(chunk_totals_BxCxH, ((0, 0), (1, 0), (0, 0)))[:, :-1], axis=1)
  return {"between": jnp.where((i_R < r)[:, None, None, None, None], scale(between_RxBxH), 0),
          "out": scale(sum_over(i_R > r)), "in": scale(sum_over(i_R < r)),
          "carried_out": scale(jax.lax.psum(total_BxH, axis_name)),  # a psum: the same on every device
          "chunks": scale(jnp.swapaxes(before_chunk_BxCxH, 0, 1))}


def _slice_starts(segment_ids_BxL, axis_name: str):
  """This slice's document starts `[batch, seq / R]`, its first token included where the id differs from the last one
  of the slice before (one all-gather of the slices' last ids)."""
  last_RxB = jax.lax.all_gather(segment_ids_BxL[:, -1], axis_name)
  r = jax.lax.axis_index(axis_name)
  opens_B = (r > 0) & (segment_ids_BxL[:, 0] != last_RxB[jnp.maximum(r - 1, 0)])
  return segments.starts(segment_ids_BxL).at[:, 0].set(opens_B)


def chunkwise_slice(q, k, v, log_decay, chunk_size, axis_name: str, state=None, score_abs_sums=False,
                    segment_ids=None):
  """Per-device body, to call inside `jax.shard_map` over mesh axis `axis_name`: `retention.chunkwise_with_states` of
  this device's slice of the sequence, with the states of the slices before it combined in.

  Args:
    q, k: this device's slice `[batch, seq / R, heads, d_k]`. v: `[batch, seq / R, heads, d_v]`. log_decay: `[heads]`,
      the same on every device, or this device's slice `[batch, seq / R, heads]` of a per-token decay. chunk_size: a
      positive integer dividing seq / R.
    axis_name: the mesh axis (of R devices) that splits the sequence, slice r on the r-th device along it.
    state: the state carried into the whole sequence, `[batch, heads, d_k, d_v]`, the same on every device; or None.
    score_abs_sums: as in `retention.chunkwise_with_states`.
    segment_ids: this device's slice `[batch, seq / R]` of the document ids (`retention.parallel_retention`), or None.
  Returns:
    `(out [batch, seq / R, heads, d_v]` in v's dtype, `final_state [batch, heads, d_k, d_v]` (the whole sequence's,
    the same on every device), `entry_states [chunks / R, batch, heads, d_k, d_v]` (this slice's chunks), `abs_sums`
    `[batch, seq / R, heads]` or None), as `retention.chunkwise_with_states` gives for the whole sequence.
  """
  retention.check_inputs(q, k, v, log_decay, state)
  segments.check_segment_ids(segment_ids, q.shape[0], q.shape[1])
  devices, slice_len = jax.lax.axis_size(axis_name), q.shape[1]
  check_length(slice_len * devices, devices, chunk_size, axis_name)
  size = retention.check_chunk_size(chunk_size)
  log_decay = log_decay.astype(retention.accumulation_dtype(q))

  # From a zero state that varies over the axis, as the scan's keys and values do.
  zero = jax.lax.pcast(retention.zeros_state(q, v, log_decay.dtype), axis_name, to="varying")
  starts_BxL = None if segment_ids is None else _slice_starts(segment_ids, axis_name)
  local_entry_CxBxHxKxV, local_state = retention.chunk_states(k, v, log_decay, size, zero, starts_BxL)

  # The state entering this slice from the slices before it (one all-gather), and the final state from all of them
  # (one sum, the same on every device): sum_j gamma^(L_s (r-1-j)) S_loc(j) over j < r, and over j < R.
  r = jax.lax.axis_index(axis_name)
  if retention_decay.is_per_token(log_decay):
    decays = _per_token_decays(log_decay, r, axis_name, size)
  else:
    decays = _constant_decays(log_decay, r, devices, slice_len, local_entry_CxBxHxKxV.shape[0], size)
  weights_RxBxHx1x1 = decays["between"]
  kept = {}  # with documents: where each term survives, [batch] (or [chunks, batch]) broadcast against states
  if starts_BxL is not None:  # drop the terms a document start separates from where they arrive
    opened_BxL = jnp.cumsum(starts_BxL, axis=1)  # starts in this slice up to each token
    # Starts in slices 0..j: slice j's state reaches slice r > j iff there are as many in slices 0..r-1.
    upto_RxB = jnp.cumsum(jax.lax.all_gather(opened_BxL[:, -1], axis_name), axis=0)
    # Starts before this slice, and in all (a psum, so that the final state stays the same on every device).
    before_B, total_B = upto_RxB[r] - opened_BxL[:, -1], jax.lax.psum(opened_BxL[:, -1], axis_name)
    weights_RxBxHx1x1 = jnp.where((upto_RxB == before_B)[:, :, None, None, None], weights_RxBxHx1x1, 0)
    opened_before_BxC = jnp.pad(opened_BxL[:, size - 1::size], ((0, 0), (1, 0)))[:, :-1]  # before each chunk
    kept = {"out": upto_RxB[r] == total_B, "in": before_B == 0, "carried_out": total_B == 0,
            "chunks": (opened_before_BxC == 0).T}
  keep = lambda name, x: jnp.where(kept[name][..., None, None, None], x, 0) if name in kept else x
  state_in = jnp.sum(weights_RxBxHx1x1 * jax.lax.all_gather(local_state, axis_name), axis=0)
  state_out = jax.lax.psum(keep("out", decays["out"] * local_state), axis_name)
  if state is not None:
    state = state.astype(log_decay.dtype)
    state_in = state_in + keep("in", decays["in"] * state)
    state_out = state_out + keep("carried_out", decays["carried_out"] * state)
  entry_CxBxHxKxV = local_entry_CxBxHxKxV + keep("chunks", decays["chunks"] * state_in)
  out, abs_sums = retention.chunk_outputs(q, k, v, log_decay, size, entry_CxBxHxKxV, score_abs_sums, starts_BxL)
  return out, state_out, entry_CxBxHxKxV, abs_sums


def sharded_chunkwise(q, k, v, log_decay, chunk_size, state=None, score_abs_sums=False, segment_ids=None, *,
                      axis_name="sequence", mesh=None):
  """`retention.chunkwise_with_states` (with its by-products) with the sequence split over mesh axis `axis_name`.

  A `jax.shard_map` of `chunkwise_slice`, manual over `axis_name` only: the other mesh axes stay automatic, so arrays
  split over them (batch over `data`, heads over `tensor`) stay split. Arguments and returns as in
  `chunkwise_retention`, plus `score_abs_sums` and the two by-products of `retention.chunkwise_with_states`, split over
  `axis_name` along their chunk and sequence axes.
  """
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  if axis_name not in mesh.axis_names:
    raise ValueError(f"sequence-parallel retention needs a mesh with an axis {axis_name!r}; the mesh has "
                     f"{tuple(mesh.axis_names)} (set one with jax.set_mesh or pass mesh=).")
  check_length(q.shape[1], mesh.shape[axis_name], chunk_size, axis_name)
  segments.check_segment_ids(segment_ids, q.shape[0], q.shape[1])
  seq = P(None, axis_name)
  out_specs = (seq, P(), P(axis_name), seq if score_abs_sums else None)
  optional = {name: x for name, x in (("state", state), ("segment_ids", segment_ids)) if x is not None}
  decay_spec = seq if retention_decay.is_per_token(log_decay) else P()
  in_specs = (seq, seq, seq, decay_spec, {name: seq if name == "segment_ids" else P() for name in optional})

  def body(q, k, v, log_decay, optional):
    return chunkwise_slice(q, k, v, log_decay, chunk_size, axis_name, score_abs_sums=score_abs_sums, **optional)

  mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names={axis_name})
  return mapped(q, k, v, log_decay, optional)


def chunkwise_retention(q, k, v, log_decay, chunk_size, state=None, segment_ids=None, *, axis_name="sequence",
                        mesh=None):
  """`retention.chunkwise_retention` with the sequence split over the devices of mesh axis `axis_name`.

  Args:
    q, k, v, log_decay, chunk_size, state, segment_ids: as in `retention.chunkwise_retention`; the length must be a
      multiple of (devices along `axis_name`) x chunk_size.
    axis_name: the mesh axis that splits the sequence.
    mesh: the mesh (default: the one `jax.set_mesh` made current).
  Returns:
    `(out [batch, seq, heads, d_v]` in v's dtype, split over `axis_name` along seq, `final_state [batch, heads, d_k,
    d_v]` in the accumulation dtype, replicated over `axis_name`).
  """
  out, state_out, _, _ = sharded_chunkwise(q, k, v, log_decay, chunk_size, state, segment_ids=segment_ids,
                                           axis_name=axis_name, mesh=mesh)
  return out, state_out
