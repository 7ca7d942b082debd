"""The shared field checks (retnet_jax.core.config_checks): what each accepts and returns, and each refusal naming the
field, the bad value and what to give."""

import numpy as np
import pytest

from retnet_jax.core import config_checks


def test_accepted_values_come_back_as_plain_numbers():
  assert config_checks.positive_int(np.int64(3), "train.steps") == 3 and type(config_checks.positive_int(1, "x")) is int
  assert config_checks.choice("fused", "model.kernel_layout", ("split", "fused")) == "fused"
  assert config_checks.choice("relu", "model.ffn_activation", {"gelu": None, "relu": None}) == "relu"
  assert config_checks.finite_number(0, "model.norm_eps") == 0.0
  assert config_checks.finite_number(np.float32(2.5), "model.rotation_base", positive=True) == 2.5


@pytest.mark.parametrize("value, shown", [(0, "0"), (-2, "-2"), (np.int32(0), "0"), (2.0, "2.0"), ("4", "'4'"),
                                          (None, "None")])
def test_a_positive_int_refuses_zero_negatives_and_non_integers(value, shown):
  with pytest.raises(ValueError, match=rf"^train\.seq_len must be a positive integer; got {shown}\.$"):
    config_checks.positive_int(value, "train.seq_len")


def test_the_reason_follows_the_requirement():
  with pytest.raises(ValueError, match=r"^stream_every must be a positive integer \(steps per hand-over to the "
                                       r"stream\); got 0\.$"):
    config_checks.positive_int(0, "stream_every", "steps per hand-over to the stream")
  with pytest.raises(ValueError, match=r"^model\.rotation_base must be a positive finite number \(the base\); "
                                       r"got 0\.0\.$"):
    config_checks.finite_number(0.0, "model.rotation_base", positive=True, why="the base")


def test_a_choice_lists_the_choices_and_the_alternative():
  with pytest.raises(ValueError, match=r"^unknown data\.synthetic 'recall' \(the task\); choose one of \('mqar', "
                                       r"'passkey'\), or leave it unset for text data\.$"):
    config_checks.choice("recall", "data.synthetic", {"mqar": 1, "passkey": 2}, why="the task",
                         otherwise=", or leave it unset for text data")
  with pytest.raises(ValueError, match=r"^unknown model\.architecture None; choose one of \('retnet',\)\.$"):
    config_checks.choice(None, "model.architecture", ("retnet",))


@pytest.mark.parametrize("value, positive, message", [
    (-1.0, False, r"model\.norm_eps must be a finite number >= 0; got -1\.0\.$"),
    (float("nan"), False, r"model\.norm_eps must be a finite number >= 0; got nan\.$"),
    (float("inf"), True, r"model\.norm_eps must be a positive finite number; got inf\.$"),
    (0.0, True, r"model\.norm_eps must be a positive finite number; got 0\.0\.$"),
    ("1e-5", False, r"model\.norm_eps must be a finite number >= 0; got '1e-5'\.$"),
    (True, False, r"model\.norm_eps must be a finite number >= 0; got True\.$"),
])
def test_a_finite_number_refuses_nan_infinity_the_wrong_sign_and_non_numbers(value, positive, message):
  with pytest.raises(ValueError, match="^" + message):
    config_checks.finite_number(value, "model.norm_eps", positive=positive)
