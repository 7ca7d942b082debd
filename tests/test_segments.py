"""Packed documents (`segment_ids`): every retention form, the sequence-split form, the models and the segmented loss
against each document run alone, values and gradients; segment_ids=None as one document per row; bad ids refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from configs import retnet as retnet_config
from retnet_jax.core import segments, sharding
from retnet_jax.mixers import retention, sequence_parallel
from retnet_jax.models.model import Model
from retnet_jax.training import losses
from tests import helpers
from tests.test_retention import reference

BATCH, HEADS, D_K, D_V = 3, 3, 4, 5
LOG_DECAY = np.log(np.array([0.5, 0.9, 0.995])).astype(np.float32)
# 13 tokens: starts at 4 (a chunk edge for chunk 4), 5 (a one-token document) and 12 (a one-token last document);
# one document in the whole row; an id that comes back (a new document) with starts off the chunk edges.
IDS = np.array([[0, 0, 0, 0, 1, 2, 2, 2, 2, 2, 2, 2, 3],
                [7] * 13,
                [5, 5, 5, 9, 9, 9, 9, 9, 9, 9, 5, 5, 5]], np.int32)

_parallel = jax.jit(retention.parallel_retention)
_recurrent = jax.jit(retention.recurrent_retention)
_chunkwise = jax.jit(retention.chunkwise_retention, static_argnames="chunk_size")
FORMS = {"parallel": lambda *args: _parallel(*args[:5], segment_ids=args[5]),
         "recurrent": lambda *args: _recurrent(*args[:5], segment_ids=args[5]),
         **{f"chunkwise{c}": lambda *args, c=c: _chunkwise(*args[:4], chunk_size=c, state=args[4],
                                                           segment_ids=args[5]) for c in (1, 3, 4, 16)}}


def documents(ids_L):
  """The (start, end) of each document of one row of ids."""
  cuts = [0] + [n for n in range(1, len(ids_L)) if ids_L[n] != ids_L[n - 1]] + [len(ids_L)]
  return list(zip(cuts[:-1], cuts[1:]))


def alone(form, q, k, v, log_decay, state, ids):
  """Each document of each row through `form(q, k, v, log_decay, state)` alone, the carried state into the row's
  first only: (outputs, each row's last document's final state), stacked as the packed call returns them."""
  outs, finals = [], []
  for b in range(q.shape[0]):
    carried = None if state is None else state[b:b + 1]
    for start, end in documents(ids[b]):
      out, final = form(*(x[b:b + 1, start:end] for x in (q, k, v)), log_decay, carried if start == 0 else None)
      outs.append(out[0])
    finals.append(final)
  return jnp.concatenate(outs).reshape(v.shape), jnp.concatenate(finals)


def reference_alone(q, k, v, log_decay, state, ids):
  """`alone` with the float64 NumPy double sum of tests/test_retention.py, in float64."""
  with jax.enable_x64(True):
    return tuple(np.asarray(x) for x in alone(
        lambda q, k, v, lg, s: tuple(map(jnp.asarray, reference(*map(np.asarray, (q, k, v, lg)), s))),
        *(np.asarray(x, np.float64) for x in (q, k, v, log_decay)),
        None if state is None else np.asarray(state, np.float64), ids))


def random_inputs(length, seed=0, dtype=np.float64, batch=BATCH):
  rng = np.random.default_rng(seed)
  q, k = rng.normal(size=(2, batch, length, HEADS, D_K))
  v = rng.normal(size=(batch, length, HEADS, D_V))
  state = rng.normal(size=(batch, HEADS, D_K, D_V))
  return tuple(np.asarray(x, dtype) for x in (q, k, v, state))


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def test_helpers():
  assert documents([7, 7, 3, 3, 7]) == [(0, 2), (2, 4), (4, 5)]
  ids = jnp.asarray(IDS[:1])
  assert segments.positions_in_document(ids).tolist() == [[0, 1, 2, 3, 0, 0, 1, 2, 3, 4, 5, 6, 0]]
  assert segments.model_positions(ids, jnp.asarray([10]), 13).tolist() == [[10, 11, 12, 13, 0, 0, 1, 2, 3, 4, 5, 6, 0]]
  assert segments.model_positions(None, jnp.asarray([10]), 3).tolist() == [[10, 11, 12]]


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-10), (np.float32, 1e-5)])
@pytest.mark.parametrize("with_state", [False, True])
def test_forms_match_each_document_alone(with_state, dtype, tol):
  """Every form (chunk 1, 3, 4 and one past the length) against the float64 reference run per document."""
  q, k, v, state = random_inputs(IDS.shape[1], seed=int(with_state), dtype=dtype)
  state = state if with_state else None
  expected_out, expected_final = reference_alone(q, k, v, LOG_DECAY, state, IDS)
  with jax.enable_x64(dtype == np.float64):
    for name, form in FORMS.items():
      out, final = form(q, k, v, LOG_DECAY.astype(dtype), state, jnp.asarray(IDS))
      assert out.dtype == dtype
      assert rel_err(out, expected_out) < tol, (name, rel_err(out, expected_out))
      assert rel_err(final, expected_final) < tol, (name, rel_err(final, expected_final))


@pytest.mark.slow
def test_gradients_match_each_document_alone():
  """The gradients of every form with respect to q, k, v and the carried state equal those of the documents run
  alone (in the same form), in float64."""
  q, k, v, state = random_inputs(IDS.shape[1], seed=2)
  rng = np.random.default_rng(3)
  w_out, w_final = rng.normal(size=v.shape), rng.normal(size=state.shape)
  loss = lambda out_final: jnp.sum(out_final[0] * w_out) + jnp.sum(out_final[1] * w_final)
  with jax.enable_x64(True):
    for name in ("parallel", "recurrent", "chunkwise3", "chunkwise4"):
      form = FORMS[name]
      packed = jax.jit(jax.grad(lambda *x: loss(form(*x[:3], LOG_DECAY.astype(np.float64), x[3], jnp.asarray(IDS))),
                                argnums=(0, 1, 2, 3)))(q, k, v, state)
      one = lambda *x, form=form: form(*x, None)
      each = jax.jit(jax.grad(lambda *x: loss(alone(one, *x[:3], LOG_DECAY.astype(np.float64), x[3], IDS)),
                              argnums=(0, 1, 2, 3)))(q, k, v, state)
      for got, expected in zip(packed, each):
        assert rel_err(got, expected) < 1e-10, (name, rel_err(got, expected))


def test_prefill_hands_off_mid_document():
  """A chunkwise prefill of a packed prefix continues its last document in the recurrent form (one token at a time)
  and in the parallel form; a next call whose row opens a document at its first token takes an emptied row."""
  q, k, v, _ = random_inputs(IDS.shape[1], seed=4)
  with jax.enable_x64(True):
    log_decay = LOG_DECAY.astype(np.float64)
    whole_out, whole_final = _recurrent(q, k, v, log_decay, None, segment_ids=jnp.asarray(IDS))
    _, prefix_state = _chunkwise(q[:, :7], k[:, :7], v[:, :7], log_decay, chunk_size=4, segment_ids=IDS[:, :7])
    state = prefix_state
    for n in range(7, 10):  # mid-document on every row
      out, state = _recurrent(q[:, n:n + 1], k[:, n:n + 1], v[:, n:n + 1], log_decay, state)
      assert rel_err(out, whole_out[:, n:n + 1]) < 1e-10
    out, final = _parallel(q[:, 7:], k[:, 7:], v[:, 7:], log_decay, prefix_state, segment_ids=IDS[:, 7:])
    assert rel_err(out, whole_out[:, 7:]) < 1e-10 and rel_err(final, whole_final) < 1e-10
    # Cut at 10: row 2 opens a document there (ids 9 -> 5), rows 0 and 1 continue theirs.
    _, state = _parallel(q[:, :10], k[:, :10], v[:, :10], log_decay, None, segment_ids=IDS[:, :10])
    opens = segments.starts(jnp.asarray(IDS))[:, 10]
    assert opens.tolist() == [False, False, True]
    out, final = _chunkwise(q[:, 10:], k[:, 10:], v[:, 10:], log_decay, chunk_size=2,
                            state=segments.empty_rows(state, opens), segment_ids=IDS[:, 10:])
    assert rel_err(out, whole_out[:, 10:]) < 1e-10 and rel_err(final, whole_final) < 1e-10


# 32 tokens over 8 or 4 slices of chunk 2: documents crossing slices, starting on slice edges (8, 24) and off them,
# a one-token document, a slice opening a document at its first token.
MESH_IDS = np.array([[0] * 5 + [1] * 3 + [2] * 9 + [3] + [4] * 6 + [5] * 8,
                     [7] * 8 + [8] * 16 + [9] * 8], np.int32)


@pytest.mark.devices(8)
@pytest.mark.parametrize("mesh_shape", [(1, 1, 1, 8), (2, 1, 1, 4)])
def test_sequence_meshes_match_each_document_alone(mesh_shape):
  """Outputs, final state and gradients of the sequence-split chunkwise form, with a carried state, on meshes over
  (data, fsdp, tensor, sequence), against the documents alone (float64)."""
  names = ("data", "fsdp", "tensor", "sequence")
  mesh = jax.make_mesh(mesh_shape, names, axis_types=(AxisType.Auto,) * 4, devices=jax.devices()[:8])
  q, k, v, state = random_inputs(MESH_IDS.shape[1], seed=5, batch=2)
  w_out = np.random.default_rng(6).normal(size=v.shape)
  with jax.enable_x64(True):
    log_decay = LOG_DECAY.astype(np.float64)

    def loss(q, k, v, state, form):
      out, final = form(q, k, v, log_decay, state)
      return jnp.sum(out * w_out) + jnp.sum(final), (out, final)

    sharded = lambda q, k, v, log_decay, state: sequence_parallel.chunkwise_retention(
        q, k, v, log_decay, 2, state, segment_ids=MESH_IDS)
    split = jax.jit(lambda *x: jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(*x, sharded))
    each = jax.jit(lambda *x: jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
        *x, lambda *y: alone(_recurrent, *y, MESH_IDS)))(q, k, v, state)
    qkv = NamedSharding(mesh, P("data", "sequence"))
    with jax.set_mesh(mesh):
      got = split(*(jax.device_put(x, qkv) for x in (q, k, v)), state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(each)):
      assert rel_err(a, b) < 1e-10, rel_err(a, b)


@nnx.jit(static_argnames="mode")
def forward(model, tokens, state, mode, segment_ids=None):
  """`model(tokens, mode=mode, state=state, segment_ids=segment_ids)` compiled."""
  return model(tokens, mode=mode, state=state, segment_ids=segment_ids)


def documents_alone(model, tokens, ids, mode, state, after):
  """Each document of each row as a row of its own (right-padded: causal, so the padding changes no logit), the
  carried state (None: empty) in the rows of first documents, then each row's last document followed by `after`
  `[B, 1]`, in one compiled call: (logits of the documents `[B, L, V]`, logits after the last ones `[B, V]`)."""
  pieces = [(b, start, end) for b in range(tokens.shape[0]) for start, end in documents(ids[b])]
  rows = [tokens[b, start:end] for b, start, end in pieces]
  lasts = [(b, start) for b, start, end in pieces if end == tokens.shape[1]]
  rows += [np.concatenate([tokens[b, start:], after[b]]) for b, start in lasts]
  width = max(len(x) for x in rows)
  padded = np.stack([np.pad(x, (0, width - len(x))) for x in rows])
  firsts = [b for b, start, _ in pieces] + [b for b, _ in lasts]
  opened = np.asarray([start > 0 for _, start, _ in pieces] + [start > 0 for _, start in lasts])
  if state is None:
    state = model.init_state(tokens.shape[0])
  rows_state = segments.empty_rows(jax.tree.map(lambda x: x[np.asarray(firsts)] if x.ndim else x, state), opened)
  logits, _ = forward(model, jnp.asarray(padded), rows_state, mode)
  alone_logits = jnp.concatenate([logits[n, :end - start] for n, (_, start, end) in enumerate(pieces)])
  ends = [tokens.shape[1] - start for _, start in lasts]
  return alone_logits.reshape(tokens.shape + (-1,)), jnp.stack([logits[len(pieces) + b, e] for b, e in enumerate(ends)])


@pytest.mark.parametrize("style", ["shared", "torchscale"])
def test_retnet_logits_match_each_document_alone(style):
  """Every mode (chunk 4), after a carried state; the returned state continues each row's last document."""
  model = helpers.tiny_model(stability_norm_style=style, chunk_size=4, num_layers=1)
  tokens = helpers.random_tokens(BATCH, IDS.shape[1] + 4)
  _, carried = forward(model, jnp.asarray(tokens[:, :3]), None, "chunkwise")
  for mode in ("parallel", "recurrent") if style == "torchscale" else ("parallel", "chunkwise", "recurrent"):
    logits, state = forward(model, jnp.asarray(tokens[:, 3:-1]), carried, mode, jnp.asarray(IDS))
    assert state.position.tolist() == [1, 16, 3]
    next_logits, _ = forward(model, jnp.asarray(tokens[:, -1:]), state, "recurrent")
    expected, expected_next = documents_alone(model, tokens[:, 3:-1], IDS, mode, carried, tokens[:, -1:])
    assert rel_err(logits, expected) < 1e-5, (mode, rel_err(logits, expected))
    assert rel_err(next_logits[:, 0], expected_next) < 1e-5, (mode, rel_err(next_logits[:, 0], expected_next))


def test_pallas_kernels_in_the_model_match_each_document_alone():
  """The chunkwise form through the Pallas kernels (interpreted on a CPU, compiled on a GPU), after a carried state,
  with the shared normaliser's key sum from the same pass: as each document run alone through the XLA form."""
  chunk = helpers.kernel_chunk(4)
  kernel_model = helpers.tiny_model(chunk_size=chunk, num_layers=1, retention_impl="pallas")
  model = helpers.tiny_model(chunk_size=chunk, num_layers=1)
  tokens = helpers.random_tokens(BATCH, IDS.shape[1] + 3)
  _, carried = forward(model, jnp.asarray(tokens[:, :3]), None, "chunkwise")
  logits, state = forward(kernel_model, jnp.asarray(tokens[:, 3:]), carried, "chunkwise", jnp.asarray(IDS))
  expected, _ = documents_alone(model, tokens[:, 3:], IDS, "chunkwise", carried, tokens[:, -1:])
  assert state.position.tolist() == [1, 16, 3]
  assert rel_err(logits, expected) < 1e-5, rel_err(logits, expected)


def test_transformer_logits_match_each_document_alone():
  """Parallel form from no state (block-diagonal mask) and after a cached prefix (reaching the first documents only);
  decoding from the returned state continues the last documents; its recurrent form resets at documents alike."""
  model = helpers.tiny_transformer(max_len=32, num_layers=1)
  tokens = helpers.random_tokens(BATCH, IDS.shape[1] + 4)
  _, cached = forward(model, jnp.asarray(tokens[:, :3]), None, "parallel")
  for state, positions in ((None, [1, 13, 3]), (cached, [1, 16, 3])):
    logits, after = forward(model, jnp.asarray(tokens[:, 3:-1]), state, "parallel", jnp.asarray(IDS))
    assert after.position.tolist() == positions
    next_logits, _ = forward(model, jnp.asarray(tokens[:, -1:]), after, "recurrent")
    expected, expected_next = documents_alone(model, tokens[:, 3:-1], IDS, "parallel", state, tokens[:, -1:])
    assert rel_err(logits, expected) < 1e-5
    assert rel_err(next_logits[:, 0], expected_next) < 1e-5
  for state in (None, cached):  # token by token, a key before its query's document start is unseen
    recurrent, _ = forward(model, jnp.asarray(tokens[:, 3:-1]), state, "recurrent", jnp.asarray(IDS))
    expected, _ = documents_alone(model, tokens[:, 3:-1], IDS, "parallel", state, tokens[:, -1:])
    assert rel_err(recurrent, expected) < 1e-5, rel_err(recurrent, expected)


def test_none_is_bitwise_one_document_per_row():
  """segment_ids=None (the default) computes bit for bit what ids of one document per row do (whatever the id,
  different per row): logits and states, each traced from its own call."""
  model, transformer = helpers.tiny_model(chunk_size=4, num_layers=1), helpers.tiny_transformer(num_layers=1)
  tokens = jnp.asarray(helpers.random_tokens(2, 11))
  one_per_row = jnp.asarray([[3] * 11, [-8] * 11], jnp.int32)
  for net, modes in ((model, ("parallel", "chunkwise")), (transformer, ("parallel",))):
    for mode in modes:
      plain, plain_state = nnx.jit(lambda net: net(tokens, mode=mode))(net)
      given, given_state = nnx.jit(lambda net: net(tokens, mode=mode, segment_ids=one_per_row))(net)
      assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves((plain, plain_state)),
                                                      jax.tree.leaves((given, given_state)))), mode


@pytest.mark.slow
def test_segmented_loss_matches_whole_sequences():
  """`train.segment_len` segments (one starting a document at its first token) give the loss and gradients of the
  whole packed sequence, which differ from those without documents."""
  model = helpers.tiny_model(chunk_size=4, num_layers=1)
  graphdef, params = nnx.split(model)
  tokens = jnp.asarray(helpers.random_tokens(2, 25))
  ids = jnp.asarray([[0] * 8 + [1] + [2] * 8 + [3] * 8, [4] * 4 + [5] * 21], jnp.int32)  # a start at 8
  loss = jax.jit(jax.value_and_grad(lambda p, n, ids: losses.token_loss(graphdef, p, (tokens, None, ids), "chunkwise",
                                                                        segment_len=n)),
                 static_argnums=1)
  whole, whole_grads = loss(params, 0, ids)
  got, grads = loss(params, 8, ids)
  assert abs(got - whole) < 1e-5 * abs(whole)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(whole_grads)):
    assert rel_err(a, b) < 1e-4
  assert abs(jax.jit(lambda p: losses.token_loss(graphdef, p, tokens, "chunkwise"))(params) - whole) > 1e-3


def test_bad_segment_ids_are_refused_before_any_work():
  model, transformer = helpers.tiny_model(), helpers.tiny_transformer()
  tokens = jnp.asarray(helpers.random_tokens(2, 5))
  for net in (model, transformer):
    with pytest.raises(ValueError, match=r"segment_ids must be an integer array \[batch, seq\] = \[2, 5\].*"
                                         r"got shape \(2, 4\) dtype int32"):
      net(tokens, segment_ids=jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match=r"got shape \(2, 5\) dtype float32"):
      net(tokens, segment_ids=jnp.zeros((2, 5), jnp.float32))
    with pytest.raises(ValueError, match=r"got a list \(convert it: jnp.asarray\(ids, jnp.int32\)\)"):
      net(tokens, segment_ids=[[0] * 5] * 2)
  with pytest.raises(ValueError, match="segment_ids cannot reset the chunkwise form of model.stability_norm_style="):
    helpers.tiny_model(stability_norm_style="torchscale")(tokens, mode="chunkwise", segment_ids=jnp.zeros((2, 5), int))
  q = jnp.zeros((2, 5, HEADS, D_K))
  with pytest.raises(ValueError, match=r"\[batch, seq\] = \[2, 5\]"):
    retention.chunkwise_retention(q, q, q, jnp.asarray(LOG_DECAY), 2, segment_ids=jnp.zeros((5,), jnp.int32))
  with pytest.raises(ValueError, match=r"\[batch, seq\] = \[2, 5\].*got shape \(2, 4\)"):  # tokens [B, L + 1]
    losses.token_loss(*nnx.split(model), (tokens, None, jnp.zeros((2, 4), jnp.int32)), "parallel")


@pytest.mark.devices(8)
def test_model_split_over_sequence_matches_one_device():
  """RetNet with packed documents on mesh (2, 1, 1, 4) (each 32-token row over 4 devices in chunks of 4, documents
  crossing slices) gives the logits and final state of one device, after a carried-in state."""
  config = retnet_config.get_config("tiny")
  config.model.update(chunk_size=4, num_layers=1)
  config.mesh.shape = (2, 1, 1, 4)
  model = Model(config.model, rngs=nnx.Rngs(0))
  tokens = jnp.asarray(helpers.random_tokens(2, 3 + 32))
  _, carried = forward(model, tokens[:, :3], None, "chunkwise")
  expected = forward(model, tokens[:, 3:], carried, "chunkwise", jnp.asarray(MESH_IDS))
  with sharding.placement(config.mesh, jax.devices()[:8]).active():
    assert sharding.sequence_split() == ("sequence", 4)
    got = forward(model, tokens[:, 3:], carried, "chunkwise", jnp.asarray(MESH_IDS))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    assert rel_err(a, b) < 1e-5, rel_err(a, b)
