"""Where the Pallas retention kernels compile, their block sizes, and when they run interpreted.

The kernels are written for Pallas' Triton lowering on GPUs. Elsewhere they run in Pallas interpret mode (correct,
slow: tests only). `check_supported` is the one place that states the compiled kernels' limits, so that a config
asking for `retention_impl=pallas` fails before training starts, naming the limit and the fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp

DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# The [chunk, chunk] score tile: Triton dots need >= 16 per side; at 128 the kernels' tiles overflow shared memory
# unless their loads are not pipelined.
CHUNK_SIZES = (16, 32, 64)
KEY_DIMS = (16, 32, 64, 128, 256)  # whole key rows per program and a [d_k, block_v] float32 state in registers
_FIX = "use retention_impl='xla' (or 'auto', which picks the XLA form wherever the kernel does not compile)"
_TARGETS: list[str] = []  # the platforms `target_backend` names, innermost last


@dataclasses.dataclass(frozen=True)
class Tiling:
  """One kernel's tiling: `block_v` value columns per program, and Triton's `num_warps` and `num_stages` (how many
  chunks ahead the chunk loop's loads are pipelined)."""
  block_v: int
  num_warps: int = 8
  num_stages: int = 2

  @classmethod
  def parse(cls, text: str) -> Tiling:
    """From `block_v:num_warps:num_stages`, e.g. `64:8:2`."""
    return cls(*(int(x) for x in text.split(":")))


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """The forward and the backward kernel's tilings; d_v is zero-padded to a multiple of both block sizes."""
  forward: Tiling
  backward: Tiling

  @property
  def value_multiple(self) -> int:
    return math.lcm(self.forward.block_v, self.backward.block_v)


def default_config(key_dim: int, value_dim: int) -> KernelConfig:
  """Starting points from compiling the kernels for sm_90 (H100) ahead of time, to be tuned on the GPU: 8 warps, 2
  pipeline stages (3 overflow the backward kernel's shared memory at d_k 256); value columns per program: 64 in the
  backward kernel, in the forward kernel 32 where d_k > 128 (its registers spill at 64), 128 where d_k <= 128 and d_v
  is a multiple of 128, else 64; fewer for narrow values."""
  narrow = max(16, 1 << (value_dim - 1).bit_length())
  forward_block = 32 if key_dim > 128 else 128 if value_dim % 128 == 0 else 64
  return KernelConfig(forward=Tiling(min(forward_block, narrow)), backward=Tiling(min(64, narrow)))


@contextlib.contextmanager
def target_backend(backend: str) -> Iterator[None]:
  """Within it the kernels are judged, and compiled rather than interpreted, for `backend` instead of JAX's default
  backend: compiling ahead of time for accelerators this process does not have."""
  _TARGETS.append(backend)
  try:
    yield
  finally:
    _TARGETS.pop()


def default_backend() -> str:
  """The backend the kernels are judged against: the innermost `target_backend`, else JAX's default."""
  return _TARGETS[-1] if _TARGETS else jax.default_backend()


def _unsupported_reason(key_dim: int, value_dim: int, dtype, chunk_size: int, backend: str | None = None) -> str | None:
  """Why the compiled kernels cannot run these per-head sizes on `backend` (default: `default_backend()`), or None
  if they can."""
  backend = backend or default_backend()
  if backend != "gpu":
    return f"the Pallas retention kernels compile for GPUs only (Triton); the backend is {backend!r}"
  if jnp.dtype(dtype) not in DTYPES:
    return f"dtype {jnp.dtype(dtype).name} is not supported by the Pallas kernels (float32 or bfloat16)"
  if chunk_size not in CHUNK_SIZES:
    return f"chunk_size {chunk_size} is not one of the kernels' chunk tiles {CHUNK_SIZES}"
  if key_dim not in KEY_DIMS:
    return f"the key head dim {key_dim} is not one of the kernels' key widths {KEY_DIMS}"
  if value_dim < 1:
    return f"the value head dim {value_dim} is empty"
  return None


def check_supported(key_dim: int, value_dim: int, dtype, chunk_size: int, backend: str | None = None) -> None:
  """Raises ValueError naming the limit and the fix unless the compiled kernels support these sizes.

  Args:
    key_dim, value_dim: the per-head dims d_k and d_v (any d_v: it is padded to whole value tiles).
    dtype: the compute dtype of q, k and v. chunk_size: the chunk length.
    backend: a JAX backend name (`gpu`, `cpu`, `tpu`); default `default_backend()`.
  """
  reason = _unsupported_reason(key_dim, value_dim, dtype, chunk_size, backend)
  if reason is not None:
    raise ValueError(f"retention_impl='pallas': {reason}; {_FIX}.")


def is_supported(key_dim: int, value_dim: int, dtype, chunk_size: int, backend: str | None = None) -> bool:
  """Whether the compiled kernels support these sizes on `backend`: `retention_impl='auto'` picks Pallas if so."""
  return _unsupported_reason(key_dim, value_dim, dtype, chunk_size, backend) is None


def resolve_interpret(interpret: bool | None) -> bool:
  """`interpret=None`: interpreted unless `default_backend()` is a GPU, the one the kernels compile for."""
  return default_backend() != "gpu" if interpret is None else bool(interpret)
