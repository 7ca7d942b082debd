"""Model FLOPs per token, counted analytically, and the peak FLOP/s that MFU divides by: the devices' nominal bf16
peak on GPUs and TPUs (`accelerators.CHIPS`), the best measured matmul rate on CPUs."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from retnet_jax import accelerators, model as model_lib


def matmul_params(cfg: ml_collections.ConfigDict) -> int:
  """Parameters used in matmuls per token: every projection and the output head (not the embedding lookup).

  RetNet: q (d^2), k (d^2), v (d d_v), each of k and v scaled by num_kv_heads / num_heads, g (d d_v), out (d_v d)
  and the GLU FFN (3 d f) per layer; the Transformer, and a hybrid RetNet's attention layers: q, k, v, o (d^2
  each, k and v scaled by the key/value heads' share) and the GLU FFN.
  """
  d, f = cfg.d_model, cfg.ffn_dim
  if cfg.architecture == "transformer":
    return cfg.num_layers * (4 * d * d + 3 * d * f) + d * cfg.vocab_size
  v = cfg.value_dim
  kv_share = (cfg.num_heads if cfg.num_kv_heads is None else cfg.num_kv_heads) / cfg.num_heads
  per_layer = d * d + round(kv_share * (d * d + d * v)) + d * v + v * d + 3 * d * f
  num_attention = len(cfg.get("attention_layers", ()))
  if not num_attention:
    return cfg.num_layers * per_layer + d * cfg.vocab_size
  heads, kv_heads = model_lib.attention_heads(cfg)
  attention_per_layer = 2 * d * d + 2 * d * (d * kv_heads // heads) + 3 * d * f
  return (cfg.num_layers - num_attention) * per_layer + num_attention * attention_per_layer + d * cfg.vocab_size


def retention_flops_per_token(cfg: ml_collections.ConfigDict, seq_len: int, mode: str) -> int:
  """Forward FLOPs per token of the retention products themselves (all layers), as the form computes them.

  parallel: the full [L, L] score matrix and its product with V, 2 L (d + d_v) per token;
  chunkwise: the same inside a chunk of C, plus the cross-chunk read q S and the state update k^T v,
  2 C (d + d_v) + 4 d d_v / H; recurrent: the state update and read, 4 d d_v / H.
  """
  d, v, h = cfg.d_model, cfg.value_dim, cfg.num_heads
  state_rw = 4 * d * v // h
  if mode == "parallel":
    per_layer = 2 * seq_len * (d + v)
  elif mode == "chunkwise":
    per_layer = 2 * min(cfg.chunk_size, seq_len) * (d + v) + state_rw
  elif mode == "recurrent":
    per_layer = state_rw
  else:
    raise ValueError(f"unknown mode {mode!r}; choose parallel, chunkwise or recurrent.")
  return (cfg.num_layers - len(cfg.get("attention_layers", ()))) * per_layer


def attention_flops_per_token(cfg: ml_collections.ConfigDict, seq_len: int, mode: str = "parallel") -> int:
  """Forward FLOPs per token of the attention products (a Transformer's layers, a hybrid's attention layers): the
  full [L, L] score matrix and its product with V, 4 L d per token (a window masks scores, it does not skip them);
  a windowed layer decoding (recurrent) reads its W cached tokens, 4 W d."""
  if cfg.architecture == "transformer":
    return cfg.num_layers * 4 * seq_len * cfg.d_model
  window = cfg.get("attention_window")
  keys = min(seq_len, window) if window and mode == "recurrent" else seq_len
  return len(cfg.get("attention_layers", ())) * 4 * keys * cfg.d_model


def forward_flops_per_token(cfg: ml_collections.ConfigDict, seq_len: int, mode: str) -> int:
  """Forward: 2 x matmul params + the retention products in `mode` and the attention products."""
  if cfg.architecture == "transformer":
    return 2 * matmul_params(cfg) + attention_flops_per_token(cfg, seq_len)
  mixing = retention_flops_per_token(cfg, seq_len, mode) + attention_flops_per_token(cfg, seq_len, mode)
  return 2 * matmul_params(cfg) + mixing


def train_flops_per_token(cfg: ml_collections.ConfigDict, seq_len: int, mode: str) -> int:
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


def peak_flops(dtype, devices: list[jax.Device]) -> tuple[float, bool]:
  """(FLOP/s of `devices` together, measured): GPUs and TPUs in `accelerators.CHIPS` give their nominal bf16 peak
  (MFU's usual reference, whatever `dtype`); CPUs the fastest of 10 measured `dtype` matmuls per process (each
  process's devices share its cores). A measured ceiling is a lower bound of the machine's: one taken while the
  machine was busy reads low, so the training loop raises it to any faster rate it achieves."""
  chip = accelerators.chip_of(devices[0].device_kind)
  if chip is not None:
    return chip.peak_bf16_flops * len(devices), False
  processes = len({device.process_index for device in devices})
  return measure_matmul_flops(dtype, repeats=10, best=True) * processes, True
