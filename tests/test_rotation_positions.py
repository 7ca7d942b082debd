"""Rotations at any int32 position: each pair's phase depends on positions only through their difference, its angle
is the exact product of the position and the float32 frequency reduced mod 2 pi, and a model near the last position
computes what it computes at position 0.

The float32 product n * theta_j that torchscale and flash-linear-attention compute (and this code did) rounds n and
the product to 24 bits: off by 5e-3 to 3e-2 rad at n = 1e6 and up to pi near 2^31, which the tests show as well.
"""

from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from retnet_jax.models import model as model_lib
from retnet_jax.models import presets
from retnet_jax.nn import rotation
from tests.helpers import forward, max_abs_diff, random_tokens, tiny_model

MAX = model_lib.MAX_POSITION
POSITIONS = (0, 1, 1000, 10**5, 10**6, 10**7, 2**24 + 1, MAX - 1000 - 1, MAX - 2, MAX, -5, -(2**31))
SHIFTS = (1, 1000)
# Key head dims of the presets (16, 64, 256) and 128; the default base and a large one.
HEAD_DIMS = sorted({p.model.d_model // p.model.num_heads for p in presets.PRESETS.values()} | {128})
BASES = (10000.0, 500000.0)
SCHEDULES = [(d, base, freqs) for d in HEAD_DIMS for base in BASES for freqs in rotation.FREQS]
TWO_PI = 2 * Fraction("3.14159265358979323846264338327950288419716939937510582097494459230781640628620899")


def phases(cos, sin):
  """The unit complex phases `[..., P]` (complex128) of tables `[..., 1, P]`."""
  return np.asarray(cos, np.float64)[..., 0, :] + 1j * np.asarray(sin, np.float64)[..., 0, :]


def float32_product_tables(positions, head_dim, base, freqs):
  """The tables as torchscale and fla compute them (and this code did): cos and sin of float32(n) * theta_j."""
  angles = jnp.asarray(positions, jnp.float32)[..., None, None] * rotation.frequencies(head_dim, base, freqs)
  return jnp.cos(angles), jnp.sin(angles)


def shift_errors(tables):
  """{(n, k): max_j |z_j(n + k) conj(z_j(n)) - z_j(k)|} over the POSITIONS n >= 0 and SHIFTS k within int32."""
  pairs = [(n, k) for k in SHIFTS for n in POSITIONS if 0 <= n <= MAX - k]
  z = phases(*tables(np.array([[n for n, _ in pairs], [n + k for n, k in pairs], [k for _, k in pairs]], np.int32)))
  return dict(zip(pairs, np.abs(z[1] * np.conj(z[0]) - z[2]).max(axis=-1)))


def exact_angles(theta):
  """n * theta_j mod 2 pi `[len(POSITIONS), P]`, in [-pi, pi), of the float32 frequencies `theta [P]`, from exact
  rationals (a float64 product would round at n * theta ~ 2^31 by 2e-7 rad)."""
  wrapped = [[float((n * Fraction(float(t)) + TWO_PI / 2) % TWO_PI - TWO_PI / 2) for t in theta] for n in POSITIONS]
  return np.array(wrapped)


def angle_errors(tables, theta):
  """The largest angle error per position `[len(POSITIONS)]` of `tables`, mod 2 pi, against `exact_angles`."""
  error = np.angle(phases(*tables(np.array([POSITIONS], np.int32)))[0]) - exact_angles(theta)
  return np.abs((error + np.pi) % (2 * np.pi) - np.pi).max(axis=-1)


@pytest.mark.parametrize("head_dim,base,freqs", SCHEDULES)
def test_phases_depend_only_on_the_position_difference(head_dim, base, freqs):
  """z(n + k) conj(z(n)) = z(k) within 1e-5 (measured 9e-7) for every pair up to n + k = 2^31 - 1; the float32
  product fails it from n = 1e6 (measured 6e-3 to 6e-2 there, 1.1 to 2.0 near 2^31)."""
  errors = shift_errors(lambda p: rotation.rotation_tables(p, head_dim, base, freqs))
  assert max(errors.values()) <= 1e-5, errors
  before = shift_errors(lambda p: float32_product_tables(p, head_dim, base, freqs))
  for n in (10**6, 10**7, MAX - 1000 - 1):
    assert max(before[n, k] for k in SHIFTS) > 1e-3, (n, before)


@pytest.mark.parametrize("head_dim,base,freqs", SCHEDULES)
def test_angles_match_the_exact_product(head_dim, base, freqs):
  """Every angle within 1e-5 rad (measured 6e-7) of n * theta_j mod 2 pi, theta_j the config's float32 frequency,
  negative positions too; the peers' float32 product is off by more than 1e-3 from n = 1e6 (5e-3 to 3 rad), which is
  the whole of their difference from these tables there."""
  theta = np.asarray(rotation.frequencies(head_dim, base, freqs))
  after = angle_errors(lambda p: rotation.rotation_tables(p, head_dim, base, freqs), theta)
  assert after.max() < 1e-5, dict(zip(POSITIONS, after))
  before = angle_errors(lambda p: float32_product_tables(p, head_dim, base, freqs), theta)
  far = [i for i, n in enumerate(POSITIONS) if n >= 10**6]
  assert before[far].min() > 1e-3, dict(zip(POSITIONS, before))


def state_at(model, batch, position):
  """The model's empty state with every row at `position`."""
  state = model.init_state(batch)
  return state._replace(position=jnp.full((batch,), position, jnp.int32))


def test_a_call_near_the_last_position_computes_what_it_computes_at_0():
  """Without the stability normaliser (whose divisor sums the decays from position 0), retention depends on
  relative positions only: the logits from an empty state at 1e6, 2^24 + 1 and 2^31 - 1 - L equal those at 0 to
  float32 rounding (measured 3e-7 of the largest logit; the float32 product: 3e-3 at 1e6, 0.24 near 2^31)."""
  model = tiny_model(stability_norm=False)
  tokens = random_tokens(2, 13, seed=4)
  reference, _ = forward(model, tokens, state_at(model, 2, 0), "chunkwise")
  scale = float(np.max(np.abs(reference)))
  for start in (10**6, 2**24 + 1, MAX - tokens.shape[1]):
    logits, state = forward(model, tokens, state_at(model, 2, start), "chunkwise")
    assert max_abs_diff(logits, reference) < 1e-5 * scale, start
    assert int(state.position[0]) == start + tokens.shape[1]


def test_forms_and_decoding_agree_up_to_the_last_position():
  """From a state at 2^31 - 1 - L, the parallel, chunkwise and recurrent forms agree, and a chunkwise prefill followed
  by token-by-token decoding gives the one call's logits, up to position 2^31 - 1."""
  model = tiny_model()
  tokens = random_tokens(2, 11, seed=5)
  start = state_at(model, 2, MAX - tokens.shape[1])
  whole, whole_state = forward(model, tokens, start, "chunkwise")
  scale = float(np.max(np.abs(whole)))
  for mode in ("parallel", "recurrent"):
    logits, state = forward(model, tokens, start, mode)
    assert max_abs_diff(logits, whole) < 1e-5 * scale and max_abs_diff(state, whole_state) < 1e-5, mode
  prefill, state = forward(model, tokens[:, :6], start, "chunkwise")
  steps = [prefill]
  for n in range(6, tokens.shape[1]):
    logits, state = forward(model, tokens[:, n:n + 1], state, "recurrent")
    steps.append(logits)
  assert max_abs_diff(jnp.concatenate(steps, axis=1), whole) < 1e-5 * scale
  assert max_abs_diff(state, whole_state) < 1e-5 and int(state.position[0]) == MAX


def test_a_state_past_the_int32_positions_is_refused():
  """A carried state whose position plus the call's tokens would pass 2^31 - 1 is refused before any work (outside
  jit), naming the position and the limit; one that ends at the limit passes."""
  model = tiny_model()
  state = state_at(model, 2, MAX - 3)
  with pytest.raises(ValueError, match=rf"position {MAX - 3}, and 4 more tokens would pass position {MAX}"):
    model(jnp.zeros((2, 4), jnp.int32), mode="recurrent", state=state)
  model_lib.check_position(state.position, 3)


def test_tables_are_the_same_with_64_bit_types_enabled():
  """With jax_enable_x64 (float64 tests) a uint32 sum widened to uint64, whose bitcast to int32 added an axis."""
  positions = jnp.asarray([[0, 1, 1000, 2**31 - 1]], jnp.int32)
  expected = rotation.rotation_tables(positions, 16)
  with jax.enable_x64(True):
    got = rotation.rotation_tables(positions, 16)
  for a, b in zip(got, expected):
    assert a.shape == b.shape == (1, 4, 1, 8) and a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)
