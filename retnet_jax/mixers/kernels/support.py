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
# The [chunk, chunk] score tile: Triton dots need >= 16 per side; at 128 the fused kernels' tiles overflow shared
# memory unless their loads are not pipelined. The split kernels compile for sm_90 at 128 too (ahead of time, d_k 128
# and 256, d_v up to 512, the default config): `CHUNK_SIZES[layout]`.
CHUNK_SIZES = {"split": (16, 32, 64, 128), "fused": (16, 32, 64)}
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


LAYOUTS = ("split", "fused")  # KernelConfig.layout: the state pass + chunk-parallel kernels, or one pass per head


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """The kernels' tilings; d_v is zero-padded to a multiple of both block sizes.

  `layout='split'` (`split`): the state passes and the output pass take `forward`'s tiling, the state gradient's
  reverse pass, the dv kernel and the dq/dk kernel's walk over the values `backward`'s; the dq/dk kernel tiles the
  keys by `block_k` (one tile where it does not divide d_k); the state entering each chunk is stored in
  `states_dtype` (None: the inputs' dtype, the one the fused kernels round it to for its products). `layout='fused'`
  (`forward`, `backward`): one program per (value tile, batch, head) walks every chunk.
  """
  forward: Tiling
  backward: Tiling
  layout: str = "split"
  block_k: int = 64
  states_dtype: str | None = None

  def __post_init__(self):
    if self.layout not in LAYOUTS:
      raise ValueError(f"unknown kernel layout {self.layout!r}; choose one of {LAYOUTS}.")

  @property
  def value_multiple(self) -> int:
    return math.lcm(self.forward.block_v, self.backward.block_v)

  def key_block(self, key_dim: int) -> int:
    """The dq/dk kernel's key columns per program at key width `key_dim`."""
    return self.block_k if key_dim % self.block_k == 0 else key_dim


def default_config(key_dim: int, value_dim: int, layout: str = "split") -> KernelConfig:
  """Starting points, to be tuned on the GPU (`scripts/kernel_check.py` times both layouts).

  fused (from compiling for sm_90 ahead of time): 8 warps, 2 pipeline stages (3 overflow the backward kernel's shared
  memory at d_k 256); value columns per program: 64 in the backward kernel, in the forward kernel 32 where d_k > 128
  (its registers spill at 64), 128 where d_k <= 128 and d_v is a multiple of 128, else 64; fewer for narrow values.
  split: 64 value columns per state-pass and output program (the state passes carry a [d_k, 64] float32 state, as
  the fused backward does, with its 8 warps and 2 stages), 64 per step of the dq/dk walk over the values and per dv
  program, 64 key columns per dq/dk program (fla's tiles at these sizes); fewer for narrow values.
  """
  narrow = max(16, 1 << (value_dim - 1).bit_length())
  if layout == "fused":
    forward_block = 32 if key_dim > 128 else 128 if value_dim % 128 == 0 else 64
    return KernelConfig(forward=Tiling(min(forward_block, narrow)), backward=Tiling(min(64, narrow)), layout=layout)
  return KernelConfig(forward=Tiling(min(64, narrow)), backward=Tiling(min(64, narrow)), layout=layout,
                      block_k=min(64, key_dim))


def launch_grids(batch: int, length: int, heads: int, key_dim: int, value_dim: int, chunk: int,
                 config: KernelConfig) -> dict[str, dict[str, int]]:
  """Each kernel launch of a forward and backward pass: `{name: {"programs", "serial_steps"}}`, programs per launch
  and the chunks each walks one after another (1: chunk-parallel); the split dq/dk kernel also `value_steps`, its
  walk over the value columns. Names: `fused/forward`, `fused/backward`; `split/states` (run again in the backward
  pass), `split/output`, `split/state_gradients`, `split/dv`, `split/dqk`."""
  chunks = -(-max(length, 1) // chunk)
  padded_v = -(-value_dim // config.value_multiple) * config.value_multiple
  forward_tiles, backward_tiles = padded_v // config.forward.block_v, padded_v // config.backward.block_v
  rows = batch * heads
  grid = lambda programs, steps, **more: {"programs": programs, "serial_steps": steps, **more}
  if config.layout == "fused":
    return {"fused/forward": grid(forward_tiles * rows, chunks), "fused/backward": grid(backward_tiles * rows,
                                                                                         2 * chunks)}
  key_tiles = key_dim // config.key_block(key_dim)
  return {"split/states": grid(forward_tiles * rows, chunks), "split/output": grid(forward_tiles * chunks * rows, 1),
          "split/state_gradients": grid(backward_tiles * rows, chunks),
          "split/dv": grid(backward_tiles * chunks * rows, 1),
          "split/dqk": grid(key_tiles * chunks * rows, 1, value_steps=backward_tiles)}


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


def default_chunk(key_dim: int, value_dim: int) -> int:
  """The split kernels' chunk for these head dims, to be checked on the GPU: 128 where the per-chunk states are
  largest (d_k x d_v >= 256 x 512: the entering states' memory and the state passes' serial steps halve, for a sixth
  more FLOPs), else 64 (fla's chunk; a 128 x 128 float32 score tile is 64 KB of registers)."""
  return 128 if key_dim * value_dim >= 256 * 512 else 64


def _unsupported_reason(key_dim: int, value_dim: int, dtype, chunk_size: int, backend: str | None = None,
                        layout: str = "split") -> str | None:
  """Why the compiled kernels cannot run these per-head sizes on `backend` (default: `default_backend()`) in
  `layout`, or None if they can."""
  backend = backend or default_backend()
  if backend != "gpu":
    return f"the Pallas retention kernels compile for GPUs only (Triton); the backend is {backend!r}"
  if jnp.dtype(dtype) not in DTYPES:
    return f"dtype {jnp.dtype(dtype).name} is not supported by the Pallas kernels (float32 or bfloat16)"
  if chunk_size not in CHUNK_SIZES[layout]:
    return f"chunk_size {chunk_size} is not one of the {layout} kernels' chunk tiles {CHUNK_SIZES[layout]}"
  if key_dim not in KEY_DIMS:
    return f"the key head dim {key_dim} is not one of the kernels' key widths {KEY_DIMS}"
  if value_dim < 1:
    return f"the value head dim {value_dim} is empty"
  return None


def check_supported(key_dim: int, value_dim: int, dtype, chunk_size: int, backend: str | None = None,
                    layout: str = "split") -> None:
  """Raises ValueError naming the limit and the fix unless the compiled kernels support these sizes.

  Args:
    key_dim, value_dim: the per-head dims d_k and d_v (any d_v: it is padded to whole value tiles).
    dtype: the compute dtype of q, k and v. chunk_size: the chunk length.
    backend: a JAX backend name (`gpu`, `cpu`, `tpu`); default `default_backend()`. layout: `KernelConfig.layout`.
  """
  reason = _unsupported_reason(key_dim, value_dim, dtype, chunk_size, backend, layout)
  if reason is not None:
    raise ValueError(f"retention_impl='pallas': {reason}; {_FIX}.")


def is_supported(key_dim: int, value_dim: int, dtype, chunk_size: int, backend: str | None = None,
                 layout: str = "split") -> bool:
  """Whether the compiled kernels support these sizes on `backend`: `retention_impl='auto'` picks Pallas if so."""
  return _unsupported_reason(key_dim, value_dim, dtype, chunk_size, backend, layout) is None


def resolve_interpret(interpret: bool | None) -> bool:
  """`interpret=None`: interpreted unless `default_backend()` is a GPU, the one the kernels compile for."""
  return default_backend() != "gpu" if interpret is None else bool(interpret)
