"""Model FLOPs per token, counted analytically, and the peak FLOP/s that MFU divides by: the devices' nominal bf16
peak on GPUs and TPUs (`accelerators.CHIPS`), the best measured matmul rate on CPUs. The counts take the model
section typed or as the config holds it (`model_config.of`)."""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from retnet_jax.hardware import accelerators
from retnet_jax.models import architectures, model_config
from retnet_jax.models.model_config import ModelConfig


def matmul_params(cfg: ModelConfig | Any) -> int:
  """Parameters used in matmuls per token: every layer's mixer projections (`Mixer.matmul_params`), its GLU FFN
  (3 d f) and the output head (not the embedding lookup)."""
  cfg = model_config.of(cfg)
  per_layer = sum(mixer.matmul_params(cfg) for mixer in architectures.layer_mixers(cfg))
  return per_layer + cfg.num_layers * 3 * cfg.d_model * cfg.ffn_dim + cfg.d_model * cfg.vocab_size


def mixing_flops_per_token(cfg: ModelConfig | Any, seq_len: int, mode: str) -> int:
  """Forward FLOPs per token of the mixing products themselves (all layers, `Mixer.mixing_flops`): retention's as
  its form `mode` computes them, attention's [L, L] scores (a windowed layer decoding: its window)."""
  cfg = model_config.of(cfg)
  return sum(mixer.mixing_flops(cfg, seq_len, mode) for mixer in architectures.layer_mixers(cfg))


def forward_flops_per_token(cfg: ModelConfig | Any, seq_len: int, mode: str) -> int:
  """Forward: 2 x matmul params + the mixing products in `mode`."""
  return 2 * matmul_params(cfg) + mixing_flops_per_token(cfg, seq_len, mode)


def train_flops_per_token(cfg: ModelConfig | Any, seq_len: int, mode: str) -> int:
  """Forward + backward: 3 x the forward (the backward pass costs two forwards)."""
  return 3 * forward_flops_per_token(cfg, seq_len, mode)


@functools.cache
def _compiled_matmul(dtype, size: int):
  """A `size`^2 operand and its compiled square, made once: measuring again compiles and allocates nothing."""
  a = jnp.ones((size, size), dtype)
  return jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32)).lower(a, a).compile(), a


def measure_matmul_flops(dtype=jnp.float32, size: int = 2048, repeats: int = 5, best: bool = False) -> float:
  """Median (with `best`, the highest) FLOP/s of a `size`^2 matmul (accumulating in float32), after a warm-up."""
  matmul, a = _compiled_matmul(dtype, size)
  matmul(a, a).block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a, a).block_until_ready()
    times.append(time.perf_counter() - start)
  return 2 * size**3 / float(np.min(times) if best else np.median(times))


@functools.cache
def measured_peak_flops(dtype) -> float:
  """The fastest of 10 `dtype` matmuls (`measure_matmul_flops`), measured once per process and dtype: every
  training in a process (a notebook's, a test suite's) shares the ceiling, each raising it to what it achieves."""
  return measure_matmul_flops(dtype, repeats=10, best=True)


def peak_flops(dtype, devices: list[jax.Device]) -> tuple[float, bool]:
  """(FLOP/s of `devices` together, measured): GPUs and TPUs in `accelerators.CHIPS` give their nominal bf16 peak
  (MFU's usual reference, whatever `dtype`); CPUs `measured_peak_flops` per process (each process's devices share
  its cores). A measured ceiling is a lower bound of the machine's: one taken while the machine was busy reads low,
  so the training loop raises it to any faster rate it achieves."""
  chip = accelerators.chip_of(devices[0].device_kind)
  if chip is not None:
    return chip.peak_bf16_flops * len(devices), False
  processes = len({device.process_index for device in devices})
  return measured_peak_flops(jnp.dtype(dtype)) * processes, True
