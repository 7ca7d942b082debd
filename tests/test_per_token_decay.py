"""Per-token decays `log_decay [batch, seq, heads]` (gated retention) in the three retention forms: against a float64
recurrence, against each other, hand-offs, packed documents, decays near 0 and near 1, gradients (of the decay too),
a constant per-token decay as the `[heads]` path, bfloat16 inputs, bad shapes refused; the sequence split over devices
as one device."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from retnet_jax.mixers import retention, sequence_parallel

BATCH, HEADS, D_K, D_V = 2, 3, 4, 5
CHUNKS = (1, 3, 4, 16)
# Starts on a chunk edge (4, chunk 4), a one-token document (5), one document in the second row.
IDS = np.array([[0, 0, 0, 0, 1, 2, 2, 2, 2, 2, 3], [7] * 11], np.int32)


@jax.jit
def reference(q, k, v, log_decay, state, starts):
  """The definition, token by token, in the inputs' dtype (float64 in the tests): S_n = gamma_n S_(n-1) + k_n^T v_n
  with gamma_n = exp(log_decay[:, n]) and S_(n-1) zeroed where a document starts; o_n = q_n S_n."""
  outs = []
  for n in range(q.shape[1]):
    state = jnp.where(starts[:, n, None, None, None], 0, state)
    state = jnp.exp(log_decay[:, n, :, None, None]) * state + k[:, n, :, :, None] * v[:, n, :, None, :]
    outs.append(jnp.einsum("bhk,bhkv->bhv", q[:, n], state))
  return jnp.stack(outs, axis=1), state


def random_inputs(length, seed=0, kind="mixed"):
  """float64 NumPy q, k, v, state and a per-token log decay: `mixed` spans gamma from 0.05 to 1 - 1e-6, `near0` holds
  tokens that forget everything (log gamma -30 and -1e4) among ordinary ones, `near1` log gamma ~ -1e-6."""
  rng = np.random.default_rng(seed)
  q, k = rng.normal(size=(2, BATCH, length, HEADS, D_K))
  v = rng.normal(size=(BATCH, length, HEADS, D_V))
  state = rng.normal(size=(BATCH, HEADS, D_K, D_V))
  shape = (BATCH, length, HEADS)
  if kind == "mixed":
    log_decay = -np.exp(rng.uniform(np.log(1e-6), np.log(3.0), size=shape))
  elif kind == "near0":
    log_decay = np.where(rng.uniform(size=shape) < 0.3, rng.choice([-30.0, -1e4], size=shape),
                         -rng.uniform(0, 0.5, size=shape))
  else:
    log_decay = -rng.uniform(0.5e-6, 2e-6, size=shape)
  return q, k, v, state, log_decay.astype(np.float32).astype(np.float64)  # the decays as float32 inputs see them


def expected(q, k, v, state, log_decay, ids=None):
  starts = np.zeros(q.shape[:2], bool) if ids is None else np.asarray(retention.segments.starts(jnp.asarray(ids)))
  with jax.enable_x64(True):
    return tuple(np.asarray(x) for x in reference(q, k, v, log_decay, state, starts))


_parallel = jax.jit(retention.parallel_retention)
_recurrent = jax.jit(retention.recurrent_retention)
_chunkwise = jax.jit(retention.chunkwise_retention, static_argnames="chunk_size")
FORMS = {"parallel": lambda q, k, v, lg, s, ids=None: _parallel(q, k, v, lg, s, ids),
         "recurrent": lambda q, k, v, lg, s, ids=None: _recurrent(q, k, v, lg, s, ids),
         **{f"chunkwise{c}": lambda q, k, v, lg, s, ids=None, c=c: _chunkwise(q, k, v, lg, chunk_size=c, state=s,
                                                                                 segment_ids=ids) for c in CHUNKS}}


def run_forms(dtype, q, k, v, state, log_decay, ids=None):
  with jax.enable_x64(dtype == np.float64):
    args = [jnp.asarray(x, dtype) for x in (q, k, v)]
    s = None if state is None else jnp.asarray(state, dtype)
    lg = jnp.asarray(log_decay, dtype)
    return {name: tuple(map(np.asarray, form(*args, lg, s, None if ids is None else jnp.asarray(ids))))
            for name, form in FORMS.items()}


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def assert_all_close(results, out_ref, final_ref, tol):
  for name, (out, final) in results.items():
    assert out.shape == out_ref.shape and final.shape == final_ref.shape, name
    assert rel_err(out, out_ref) < tol, (name, rel_err(out, out_ref))
    assert rel_err(final, final_ref) < tol, (name, rel_err(final, final_ref))
  for (a, (out_a, final_a)), (b, (out_b, final_b)) in itertools.combinations(results.items(), 2):
    assert rel_err(out_a, out_b) < tol and rel_err(final_a, final_b) < tol, (a, b)


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-10), (np.float32, 1e-5)])
@pytest.mark.parametrize("kind", ["mixed", "near0", "near1"])
@pytest.mark.parametrize("length,with_state", [(1, True), (11, False), (11, True)])
def test_forms_match_float64_recurrence(length, with_state, kind, dtype, tol):
  """Every form (chunk sizes 1, 3, 4, 16: lengths not divisible by them, one chunk longer than the sequence) against
  the recurrence and each other, outputs and final states, with and without a carried state."""
  q, k, v, state, log_decay = random_inputs(length, seed=length + 3 * with_state, kind=kind)
  state = state if with_state else None
  results = run_forms(dtype, q, k, v, state, log_decay)
  assert all(out.dtype == dtype for out, _ in results.values())
  out_ref, final_ref = expected(q, k, v, np.zeros((BATCH, HEADS, D_K, D_V)) if state is None else state, log_decay)
  assert_all_close(results, out_ref, final_ref, tol)


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-10), (np.float32, 1e-5)])
def test_packed_documents(dtype, tol):
  """segment_ids: the state and the products of the decays restart at each document (starts on and off chunk edges,
  a one-token document), the carried state reaching each row's first document only."""
  q, k, v, state, log_decay = random_inputs(IDS.shape[1], seed=11)
  assert_all_close(run_forms(dtype, q, k, v, state, log_decay, IDS), *expected(q, k, v, state, log_decay, IDS), tol)


@pytest.mark.parametrize("first,second", [("parallel", "chunkwise3"), ("chunkwise4", "recurrent"),
                                          ("recurrent", "parallel"), ("chunkwise16", "chunkwise1")])
def test_hand_off_continues_from_state(first, second):
  """Half the sequence in one form, its state into another form for the rest: the whole sequence's outputs and
  final state."""
  length, split = 11, 6
  q, k, v, state, log_decay = (jnp.asarray(x, jnp.float32) for x in random_inputs(length, seed=5))
  whole_out, whole_state = FORMS["parallel"](q, k, v, log_decay, state)
  head, tail = (lambda x: x[:, :split]), (lambda x: x[:, split:])
  out1, s1 = FORMS[first](*map(head, (q, k, v, log_decay)), state)
  out2, s2 = FORMS[second](*map(tail, (q, k, v, log_decay)), s1)
  assert rel_err(jnp.concatenate([out1, out2], axis=1), whole_out) < 1e-5
  assert rel_err(s2, whole_state) < 1e-5


def loss(out, final, w_out, w_final):
  return jnp.sum(out * w_out) + jnp.sum(final * w_final)


def gradients(form):
  """Jitted gradients of `loss` through `form(q, k, v, log_decay, state, ids)` w.r.t. q, k, v, state and log_decay."""
  return jax.jit(jax.grad(lambda q, k, v, s, lg, ids, w_out, w_final: loss(*form(q, k, v, lg, s, ids), w_out, w_final),
                          argnums=(0, 1, 2, 3, 4)))


GRADIENTS = {name: gradients(form) for name, form in FORMS.items()}


@pytest.mark.parametrize("kind", ["mixed", "near0", "near1"])
def test_gradients_match_float64_recurrence(kind):
  """Gradients of q, k, v, the carried state and the per-token log decay, through outputs and final state (packed
  documents in the first row), float64 at 1e-10 and float32 at 1e-5 of the recurrence's; finite for decays near 0
  and near 1."""
  q, k, v, state, log_decay = random_inputs(IDS.shape[1], seed=21, kind=kind)
  rng = np.random.default_rng(1)
  w_out, w_final = rng.normal(size=v.shape), rng.normal(size=state.shape)
  starts = retention.segments.starts(jnp.asarray(IDS))
  with jax.enable_x64(True):
    ref = gradients(lambda q, k, v, lg, s, ids: reference(q, k, v, lg, s, ids))(q, k, v, state, log_decay, starts,
                                                                               w_out, w_final)
  for dtype, tol in ((np.float64, 1e-10), (np.float32, 1e-5)):
    with jax.enable_x64(dtype == np.float64):
      args = [jnp.asarray(x, dtype) for x in (q, k, v, state, log_decay)]
      for name, grad in GRADIENTS.items():
        grads = grad(*args, jnp.asarray(IDS), *(jnp.asarray(w, dtype) for w in (w_out, w_final)))
        for arg, g, g_ref in zip("q k v state log_decay".split(), grads, ref):
          assert np.isfinite(np.asarray(g)).all(), (name, arg, dtype)
          assert rel_err(g, g_ref) < tol, (name, arg, dtype, rel_err(g, g_ref))


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-13), (np.float32, 1e-6)])
def test_constant_per_token_decay_is_the_heads_path(dtype, tol):
  """A per-token decay equal at every token gives the `[heads]` path's outputs and states to float rounding."""
  q, k, v, state, _ = random_inputs(11, seed=8)
  log_decay_H = np.log(np.array([0.5, 0.9, 1 - 1e-6])).astype(np.float32)
  per_token = np.broadcast_to(log_decay_H, (BATCH, 11, HEADS))
  with jax.enable_x64(dtype == np.float64):
    args = [jnp.asarray(x, dtype) for x in (q, k, v)]
    s = jnp.asarray(state, dtype)
    for name, form in FORMS.items():
      (out_t, final_t), (out_h, final_h) = (form(*args, jnp.asarray(lg, dtype), s) for lg in (per_token, log_decay_H))
      assert rel_err(out_t, out_h) < tol and rel_err(final_t, final_h) < tol, name


def test_bfloat16_inputs_within_bfloat16_rounding():
  """bfloat16 q, k, v and per-token decay (float32 state) in every form: within bfloat16 rounding of the float64
  recurrence, the state kept in float32."""
  q, k, v, state, log_decay = random_inputs(11, seed=9)
  # The reference sees the inputs as rounded to bfloat16, so what remains is the forms' own rounding.
  q, k, v, log_decay = (np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64) for x in (q, k, v, log_decay))
  out_ref, final_ref = expected(q, k, v, state, log_decay)
  args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, log_decay)]
  for name, form in FORMS.items():
    out, final = form(*args[:3], args[3], jnp.asarray(state, jnp.float32))
    assert out.dtype == jnp.bfloat16 and final.dtype == jnp.float32, name
    assert rel_err(out, out_ref) < 1e-2 and rel_err(final, final_ref) < 1e-2, name


def test_chunkwise_by_products_with_per_token_decay():
  """`_chunkwise`'s entry states (the state before each chunk) and in-chunk |score| row sums sum_m D[j, m]
  |q_j . k_m| with D the per-token decay mask, against float64."""
  length, chunk = 10, 4
  q, k, v, state, log_decay = random_inputs(length, seed=13)
  expected_states = np.stack([state] + [expected(*(x[:, :s] for x in (q, k, v)), state, log_decay[:, :s])[1]
                                       for s in range(chunk, length, chunk)])
  b = np.cumsum(log_decay, axis=1)  # [B, L, H]
  n = np.arange(length)
  in_chunk = (n[:, None] >= n[None, :]) & (n[:, None] // chunk == n[None, :] // chunk)
  mask = np.where(in_chunk[None, None], np.exp(np.minimum(b.transpose(0, 2, 1)[..., :, None]
                                                          - b.transpose(0, 2, 1)[..., None, :], 0)), 0)
  expected_sums = np.einsum("bhnm,bhnm->bnh", np.abs(np.einsum("bnhk,bmhk->bhnm", q, k)), mask)
  with jax.enable_x64(True):
    _, _, states, sums = retention.chunkwise_with_states(*(jnp.asarray(x) for x in (q, k, v, log_decay)), chunk,
                                                         jnp.asarray(state), score_abs_sums=True,
                                                         wide_entry_states=True)
  assert rel_err(states, expected_states) < 1e-10 and rel_err(sums, expected_sums) < 1e-10


def test_empty_sequence_passes_the_state_through():
  q, k, v, state, log_decay = (jnp.asarray(x, jnp.float32) for x in random_inputs(5))
  for form in (retention.parallel_retention, retention.recurrent_retention,
               lambda *args: retention.chunkwise_retention(*args[:4], 3, args[4])):
    out, final = form(q[:, :0], k[:, :0], v[:, :0], log_decay[:, :0], state)
    assert out.shape == v[:, :0].shape
    np.testing.assert_array_equal(final, state)


def test_bad_log_decay_refused():
  q, k, v, state, log_decay = (jnp.asarray(x, jnp.float32) for x in random_inputs(5))
  for bad in (log_decay[..., 0], log_decay[:, :4], log_decay[:1], log_decay[0]):
    with pytest.raises(ValueError, match=r"log_decay must have shape \[heads\] = \(3,\) .* or \[batch, seq, heads\] "
                                         rf"= \(2, 5, 3\) .*; got \({', '.join(map(str, bad.shape))},?\)"):
      retention.chunkwise_retention(q, k, v, bad, 2)
  with pytest.raises(ValueError, match=r"log_decay must be <= 0 .* got 0.5 at \[batch, seq, head\] \(1, 2, 0\)"):
    retention.parallel_retention(q, k, v, log_decay.at[1, 2, 0].set(0.5))
  for value in (-jnp.inf, jnp.nan):
    with pytest.raises(ValueError, match="log_decay must be finite"):
      retention.recurrent_retention(q, k, v, log_decay.at[0, 1, 2].set(value))


_sharded = jax.jit(sequence_parallel.sharded_chunkwise, static_argnames=("chunk_size", "score_abs_sums"))
_single = jax.jit(retention.chunkwise_with_states, static_argnames=("chunk_size", "score_abs_sums"))


@pytest.mark.devices(8)
@pytest.mark.parametrize("shape,names", [((4,), ("sequence",)), ((2, 4), ("data", "sequence"))])
def test_sequence_parallel_matches_one_device(shape, names):
  """The sequence split over the `sequence` axis, the per-token decay with it: outputs, final and chunk-entry states,
  in-chunk score sums and the gradients (of the decay too) as one device's chunkwise form, with a carried state and
  packed documents (starts inside slices and on a slice edge), gates near 0 among them."""
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names), devices=jax.devices()[:8])
  chunk, length = 2, 16
  q, k, v, state, log_decay = (jnp.asarray(x, jnp.float32) for x in random_inputs(length, seed=17, kind="near0"))
  ids = jnp.asarray([[0] * 5 + [1] * 3 + [2] * 8, [4] * 16], jnp.int32)  # starts at 5 and 8 (a slice edge at 4 x 2)
  expected = _single(q, k, v, log_decay, chunk_size=chunk, state=state, score_abs_sums=True, segment_ids=ids)
  axis = lambda name: name if name in names else None
  split = lambda x, spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
  args = (*(split(x, (axis("data"), "sequence", axis("tensor"))) for x in (q, k, v, log_decay)),
          split(state, (axis("data"), axis("tensor"))), split(ids, (axis("data"), "sequence")))
  with jax.set_mesh(mesh):
    result = _sharded(*args[:4], chunk_size=chunk, state=args[4], score_abs_sums=True, segment_ids=args[5])
  for name, got, want in zip(("out", "final state", "entry states", "score sums"), result, expected):
    assert got.shape == want.shape and rel_err(got, want) < 1e-5, (name, rel_err(got, want))

  rng = np.random.default_rng(2)
  w_out, w_final = (jnp.asarray(rng.normal(size=x.shape), jnp.float32) for x in (v, state))
  single = lambda q, k, v, lg, s, ids: retention.chunkwise_retention(q, k, v, lg, chunk, s, ids)
  sharded = lambda q, k, v, lg, s, ids: sequence_parallel.chunkwise_retention(q, k, v, lg, chunk, s, ids)
  want = gradients(single)(q, k, v, state, log_decay, ids, w_out, w_final)
  with jax.set_mesh(mesh):
    got = gradients(sharded)(*args[:3], args[4], args[3], args[5], w_out, w_final)
  for name, g, g_ref in zip("q k v state log_decay".split(), got, want):
    assert np.isfinite(np.asarray(g)).all() and rel_err(g, g_ref) < 1e-5, (name, rel_err(g, g_ref))
