"""Gradients at the extremes of the gates: every retention form and the split kernels (interpreted on a CPU) against a
float64 recurrence, element by element, for log gamma from -1e-6 (gamma near 1) to -1e4 (gamma an exact 0 in float32).

Inputs and cotangents are positive, so that every value and gradient is a sum of positive terms: a float32
computation that forms each term to its own precision is then exact to a few float32 roundings relative to the
float64 value, however small the terms (a gate of log gamma = -20 scales a decay gradient by 2e-9; where
1 + (gamma - 1) cancels, gamma's share is lost). The tolerance floor, 1e-35, lies far below those tiny values and
only admits float32's subnormals (the exact values of log gamma = -100 are 4e-44).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from retnet_jax.core import segments
from retnet_jax.mixers import kernels, retention
from tests.test_kernel_decays import recurrence, vjp_all
from tests.test_kernels import D_K as KERNEL_D_K, two_tiles

GATES = {"-1e-6": -1e-6, "-1e-3": -1e-3, "-1": -1.0, "-20": -20.0, "-100": -100.0, "-1e4": -1e4, "mixed": None}
RTOL, ATOL = 4e-6, 1e-35
LENGTH = 7
IDS = np.array([[0, 0, 0, 1, 1, 2, 2], [5] * LENGTH], np.int32)  # documents starting on and off chunk edges (chunk 3)


def inputs(per_token, gate, d_k, d_v, seed=0):
  """float64 NumPy q, k, v, the carried state and the cotangents of out and the final state, all in [0.5, 1.5], and
  log gamma `[batch, seq, heads]` or `[heads]`: the gate everywhere, or (`mixed`) each extreme drawn per token (per
  head for `[heads]`). All float32 numbers, as the float32 forms see them."""
  rng = np.random.default_rng(seed)
  batch, heads = IDS.shape[0], 2
  positive = lambda *shape: rng.uniform(0.5, 1.5, size=shape).astype(np.float32).astype(np.float64)
  q, k = positive(2, batch, LENGTH, heads, d_k)
  v, d_out = positive(2, batch, LENGTH, heads, d_v)
  state, d_final = positive(2, batch, heads, d_k, d_v)
  shape = (batch, LENGTH, heads) if per_token else (heads,)
  extremes = [g for g in GATES.values() if g is not None]
  log_decay = np.full(shape, gate) if gate is not None else rng.choice(extremes, size=shape)
  return q, k, v, log_decay.astype(np.float32).astype(np.float64), state, d_out, d_final


@functools.cache
def _reference(packed):
  starts = segments.starts(jnp.asarray(IDS)) if packed else None
  return jax.jit(functools.partial(vjp_all, lambda q, k, v, a, s: recurrence(q, k, v, a, s, starts)))


def reference(args, packed):
  with jax.enable_x64(True):
    out, final, grads = _reference(packed)(*(jnp.asarray(x, jnp.float64) for x in args))
    return [np.asarray(x) for x in (out, final, *grads)]


XLA_FORMS = {"parallel": retention.parallel_retention, "recurrent": retention.recurrent_retention,
             "chunkwise1": functools.partial(retention.chunkwise_retention, chunk_size=1),
             "chunkwise3": functools.partial(retention.chunkwise_retention, chunk_size=3)}


@functools.cache
def xla_form(name, packed):
  ids = jnp.asarray(IDS) if packed else None
  return jax.jit(functools.partial(vjp_all, lambda q, k, v, a, s: XLA_FORMS[name](q, k, v, a, state=s,
                                                                                   segment_ids=ids)))


@functools.cache
def split_kernel(packed):
  ids = jnp.asarray(IDS) if packed else None
  form = lambda q, k, v, a, s: kernels.chunkwise_retention(q, k, v, a, 3, s, config=two_tiles("split"),
                                                           segment_ids=ids)
  return jax.jit(functools.partial(vjp_all, form))


NAMES = ("out", "final", "dq", "dk", "dv", "d_log_decay", "d_state")


def worst_errors(results, expected):
  """The largest error per result (`vjp_all`'s), in units of the allowed error `RTOL |exact| + ATOL` (at most 1 to
  pass)."""
  found = {}
  out, final, grads = results
  for name, got, exact in zip(NAMES, (out, final, *grads), expected):
    got = np.asarray(got, np.float64)
    assert got.shape == exact.shape and np.isfinite(got).all(), name
    found[name] = float(np.max(np.abs(got - exact) / (RTOL * np.abs(exact) + ATOL)))
  return found


def check(run, per_token, gate, packed, d_k, d_v):
  args = inputs(per_token, GATES[gate], d_k, d_v)
  found = worst_errors(run(*(jnp.asarray(x, jnp.float32) for x in args)), reference(args, packed))
  assert all(e <= 1 for e in found.values()), found


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("per_token,packed", [(True, False), (True, True), (False, False)])
@pytest.mark.parametrize("form", XLA_FORMS)
def test_forms_exact_at_gate_extremes(form, per_token, packed, gate):
  """Outputs, final state and the gradients of q, k, v, log gamma and the carried state: chunk 1 and 3 over 7 tokens,
  per-token gates (in packed documents too) and per-head decays."""
  check(xla_form(form, packed), per_token, gate, packed, d_k=3, d_v=2)


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("packed", [False, True])
def test_split_kernels_exact_at_gate_extremes(packed, gate):
  """The split kernels (two key and two value tiles, chunk 3 over 7 tokens) as the forms above, per-token gates."""
  check(split_kernel(packed), True, gate, packed, d_k=KERNEL_D_K, d_v=2 * KERNEL_D_K)


@pytest.mark.parametrize("gate", ["-1e-6", "-1e-3", "-1"])
def test_split_kernels_per_head_decays(gate):
  """Per-head decays in the split kernels, whose decay gradient takes the cheaper path, exact for decays away from 0
  (`split._split_bwd`): fixed decays live near 1."""
  check(split_kernel(False), False, gate, False, d_k=KERNEL_D_K, d_v=2 * KERNEL_D_K)


@pytest.mark.parametrize("form", [*XLA_FORMS, "split", "fused"])
def test_one_token_gate_near_zero(form):
  """The issue's case: one token, q, k, v and the state all ones (d wide), log gamma = -20: out and the final state
  sum to d^2 (2 + 2 gamma), so d log_decay = 2 gamma d^2 and d state = 2 gamma = 4.122e-9 per element (float32: 0 in
  the recurrent form before, where gamma S cancelled). The fused kernels take a per-head decay and stop its gradient."""
  d, gamma = KERNEL_D_K, np.exp(-20.0)
  ones, state = jnp.ones((1, 1, 1, d), jnp.float32), jnp.ones((1, 1, d, d), jnp.float32)
  log_decay = jnp.full((1,) if form == "fused" else (1, 1, 1), -20.0, jnp.float32)
  if form in ("split", "fused"):
    run = functools.partial(kernels.chunkwise_retention, chunk_size=1, config=two_tiles(form))
  else:
    run = XLA_FORMS[form]
  loss = lambda a, s: sum(jnp.sum(x) for x in run(ones, ones, ones, a, state=s))
  d_log_decay, d_state = jax.jit(jax.grad(loss, argnums=(0, 1)))(log_decay, state)
  np.testing.assert_allclose(d_state, np.full(state.shape, 2 * gamma), rtol=RTOL)
  np.testing.assert_allclose(d_log_decay, np.zeros(1) if form == "fused" else np.full((1, 1, 1), 2 * gamma * d * d),
                             rtol=RTOL)
