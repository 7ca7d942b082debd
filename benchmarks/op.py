"""The retention op measured on its own, for the GPU suite's op part and the kernel check: bfloat16 inputs, the
error measure against a float32 reference, FLOP counts, and ahead-of-time compiled timed cases."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import Case, compile_timed, timed

# Largest error / largest reference value of the op's outputs from bfloat16 inputs, as the bfloat16 tests allow.
TOLERANCE = 2e-2
KINDS = ("forward", "forward_backward")  # a case's name ends in /<kind>


def op_inputs(batch: int, length: int, heads: int, d_k: int, d_v: int, seed: int = 0
              ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """bfloat16 q, k [B, T, H, d_k] (each scaled by d_k^-1/4, so that q . k is O(1)), v and the output cotangent
  d_out [B, T, H, d_v], made on the device. The same seed gives the same q and k at any d_v."""
  keys = jax.random.split(jax.random.key(seed), 4)
  normal = lambda key, dim, scale: (jax.random.normal(key, (batch, length, heads, dim), jnp.float32) * scale
                                    ).astype(jnp.bfloat16)
  return (normal(keys[0], d_k, d_k**-0.25), normal(keys[1], d_k, d_k**-0.25), normal(keys[2], d_v, 1.0),
          normal(keys[3], d_v, 1.0))


def relative_error(x, reference) -> float:
  """Largest absolute difference of `x` from `reference` over the largest magnitude of `reference`, in float64."""
  x, reference = np.asarray(x, np.float64), np.asarray(reference, np.float64)
  return float(np.abs(x - reference).max() / max(np.abs(reference).max(), 1e-30))


def retention_op_flops(batch: int, heads: int, length: int, d_k: int, d_v: int, chunk: int) -> int:
  """Forward FLOPs of chunkwise retention as computed: per head and token, the chunk's scores and their product with
  V, 2 C (d_k + d_v), plus the query read of the entry state and the state update, 4 d_k d_v."""
  return 2 * batch * heads * length * (chunk * (d_k + d_v) + 2 * d_k * d_v)


def attention_op_flops(batch: int, heads: int, length: int, head_dim: int) -> int:
  """Forward FLOPs of causal attention: scores and their product with V over half of the T x T pairs, 2 B H T^2 d."""
  return 2 * batch * heads * length**2 * head_dim


def kind_flops(forward: int, kind: str) -> int:
  """FLOPs of a case of `kind` whose forward pass takes `forward`: the backward pass counts as twice the forward."""
  return forward * (3 if kind == "forward_backward" else 1)


def op_case(form: Callable, q: jax.Array, k: jax.Array, v: jax.Array, d_out: jax.Array, kind: str, repeats: int,
            constants: tuple[jax.Array, ...] = ()) -> Case:
  """`form(q, k, v, *constants) -> out` compiled ahead of time as `kind` (forward, or forward_backward: the gradients
  in q, k and v for cotangent `d_out`), a Case of `repeats` calls with its compile seconds and XLA buffer bytes.
  `constants` (per-token log decays) are arguments of the compiled program, not differentiated."""
  if kind not in KINDS:
    raise ValueError(f"kind={kind!r}: choose one of {KINDS}.")
  backward = kind == "forward_backward"
  args = (q, k, v) + ((d_out,) if backward else ()) + tuple(constants)
  fn = jax.jit((lambda q, k, v, d_out, *c: jax.vjp(lambda q, k, v: form(q, k, v, *c), q, k, v)[1](d_out))
               if backward else form)
  compiled, compile_s, buffers = compile_timed(fn, *args)
  return Case(timed(lambda: jax.block_until_ready(compiled(*args)), repeats),
              {"compile_s": compile_s, "compiled_bytes": buffers})


def error_text(e: Exception) -> str:
  """`Type: first line of the message` (at most 300 characters) of an implementation that failed to run."""
  message = str(e).strip()
  return f"{type(e).__name__}: {message.splitlines()[0][:300] if message else ''}"
