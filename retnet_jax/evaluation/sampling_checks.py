"""What a `sampling.Sampler` refuses before any work, and the settings that fix its compiled loop: prompts and their
lengths, the prefill mode, the KV caches' room and the decoding state's memory, sampling settings and keys; each
error names the argument (or model field) and the fix.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from retnet_jax.core import config_checks, host_memory, sharding
from retnet_jax.mixers import stability
from retnet_jax.models import architectures, model as model_lib, streaming
from retnet_jax.nn import layers

Stream = Callable[[np.ndarray, int], None]


class Settings(NamedTuple):
  """Everything that fixes the compiled program besides the model structure and the input shapes."""
  max_new_tokens: int
  greedy: bool
  top_k: int | None
  use_top_p: bool
  stop_tokens: tuple[int, ...]
  stream_every: int  # 0: no stream


def split_padding(prompt_len: int, chunk_size: int | None) -> int:
  """Columns of left padding that let the P - 1 prefilled tokens split into whole chunks over the devices of the
  active mesh's `sequence` axis (`sharding.sequence_split`); 0 where no axis splits sequences."""
  split = sharding.sequence_split()
  if split is None or chunk_size is None:
    return 0
  return -(prompt_len - 1) % (split[1] * chunk_size)


def check_prefill(model: model_lib.Model, prompts_BxP: Any, lengths_B: Any, prefill_mode: str | None,
                  prefill_block: int | None = None, progress: Any = None) -> tuple[int, str, int, int]:
  """(The batch size, the prefill mode, the columns of left padding the active mesh's split of sequences needs, the
  tokens per block) after checking the prompts, their lengths, the prefill mode (None: the model's default,
  `architectures.prefill_modes`), the block (`streaming.check_block`) and the progress callable."""
  prefill_mode = check_prefill_mode(model, prefill_mode)
  prefill_block = streaming.check_block(model.config, prefill_block)
  if progress is not None and not callable(progress):
    raise ValueError(f"progress must be a callable progress(columns_done, columns) or None; got {progress!r}.")
  batch = check_prompts(prompts_BxP, lengths_B, model.config.vocab_size)
  cfg = model.config
  padding = split_padding(prompts_BxP.shape[1], getattr(cfg, "chunk_size", None))
  width = prompts_BxP.shape[1] + padding
  if (prefill_mode == "chunkwise" and stability.torchscale_normaliser(cfg)
      and np.any(np.asarray(lengths_B) != width)):
    raise ValueError(f"prompts of lengths {np.asarray(lengths_B).tolist()} are left-padded to {width} tokens (the "
                     "longest, and on a mesh that splits sequences to whole chunks per device), but with "
                     "model.stability_norm_style='torchscale' the chunkwise normaliser depends on where chunks start, "
                     "so a padded row would not decode as if alone; use prefill_mode='parallel' "
                     "(--prefill_mode=parallel) or prompts of one length.")
  return batch, prefill_mode, padding, prefill_block


def check_prefill_mode(model: model_lib.Model, prefill_mode: str | None) -> str:
  """`prefill_mode` after checking it is one of the model's (`architectures.prefill_modes`); None: the first."""
  own = architectures.prefill_modes(model.config)
  if prefill_mode is None:
    return own[0]
  if prefill_mode not in own:
    raise ValueError(f"unknown prefill_mode {prefill_mode!r} for a {model.config.architecture}; choose one of "
                     f"{tuple(own)} (or None: {own[0]}).")
  return prefill_mode


def device_memory(devices: Sequence[jax.Device]) -> int:
  """Bytes of memory of `devices` together: XLA's limit of each (accelerators), or where one reports none (CPU
  devices, which share the host's) the host memory still available (`host_memory.available_bytes`: within this
  process's address-space and cgroup limits too), not the physical memory, part of which other processes hold."""
  limits = [(device.memory_stats() or {}).get("bytes_limit") for device in devices]
  return sum(limits) if all(limits) else host_memory.available_bytes()


def size_text(num_bytes: int) -> str:
  """`num_bytes` in GiB, or in MiB below 1 GiB, for a message."""
  return f"{num_bytes / 2**30:.1f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


def memory_name(devices: Sequence[jax.Device]) -> str:
  """What `device_memory(devices)` measures, for a message: "memory of the gpu devices here", or for CPU devices
  "host memory available here, bounded by" the limit that gives it (`host_memory.available`), e.g. "MemAvailable"."""
  if not all((device.memory_stats() or {}).get("bytes_limit") for device in devices):
    return f"host memory available here, bounded by {host_memory.available()[1]}"
  return f"memory of the {devices[0].platform} device{'s' * (len(devices) > 1)} here"


def state_bytes(model: model_lib.Model, batch: int) -> int:
  """Bytes of the decoding state of `batch` rows (RetNet: retention states; attention layers: KV caches), from its
  shapes: nothing is allocated."""
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(lambda: model.init_state(batch))))


def check_cache(model: model_lib.Model, batch: int, prompt_len: int, max_new_tokens: int = 0
                 ) -> None:
  """The decoding state of `batch` rows (KV caches included) must fit in memory, and a KV cache must hold the
  context (`check_cache_length`)."""
  cfg = model.config
  needed_bytes = state_bytes(model, batch)
  devices = jax.local_devices()
  memory = device_memory(devices)
  if needed_bytes > memory:
    fields = architectures.state_fields(cfg)
    fix = (f"lower {' or '.join(f'model.{field}={cfg.flat_value(field)}' for field in fields)}, or the batch" if fields
           else "decode fewer rows at a time")
    raise ValueError(f"the decoding state of {batch} rows takes {needed_bytes / 2**30:.1f} GiB, more than the "
                     f"{memory / 2**30:.1f} GiB of {memory_name(devices)}; {fix}.")
  check_cache_length(cfg, prompt_len, max_new_tokens)


def check_cache_length(cfg: Any, prompt_len: int, max_new_tokens: int = 0) -> None:
  """A KV cache that holds the whole context (`architectures.cache_field`) must hold every prompt token but the
  last, then one token per decoding step; ValueError naming the model field and the length it needs."""
  field = architectures.cache_field(cfg)
  if field is None:
    return
  needed, size = prompt_len - 1 + max_new_tokens, cfg.flat_value(field)
  if needed > size:
    what = f"prompts padded to {prompt_len} tokens" + (f" and {max_new_tokens} new tokens" if max_new_tokens else "")
    raise ValueError(f"{what} need a KV cache of {needed} tokens, but model.{field}={size}; raise model.{field} "
                     f"(--config.model.{field}={needed}), or shorten the prompts or max_new_tokens.")


def check_decoding_room(model: model_lib.Model, state: model_lib.ModelState, max_new_tokens: int) -> None:
  """A prefilled state's KV caches that hold the whole context must hold `max_new_tokens` more."""
  for mixer, layer_state in zip(architectures.layer_mixers(model.config), state.layers):
    mixer.check_room(model.config, layer_state, max_new_tokens)


def check_prompts(prompts_BxP: Any, lengths_B: Any, vocab_size: int) -> int:
  """The batch size, after checking the padded prompts and their lengths."""
  layers.check_tokens(prompts_BxP, vocab_size)
  batch, prompt_len = prompts_BxP.shape
  lengths = np.asarray(lengths_B)
  if lengths.shape != (batch,) or not np.issubdtype(lengths.dtype, np.integer):
    raise ValueError(f"lengths_B must be integers of shape [batch] = ({batch},); got {lengths.dtype} "
                     f"{lengths.shape}. Use pad_prompts to build tokens and lengths.")
  if lengths.min() < 1 or lengths.max() > prompt_len:
    raise ValueError(f"prompt lengths must lie in [1, {prompt_len}] (the padded length); got {lengths.tolist()}. "
                     "Use pad_prompts to build tokens and lengths.")
  return batch


def _integer(value: Any, name: str, requirement: str) -> int:
  """`value` as a Python int (any integer type), or ValueError naming `name` and what it must be."""
  try:
    return operator.index(value)
  except TypeError:
    raise ValueError(f"{name} must be {requirement}; got {value!r}.") from None


def check_settings(vocab_size: int, max_new_tokens: int, temperature: float, top_k: int | None,
                    top_p: float | None, stop_tokens: Sequence[int], stream: Stream | None, stream_every: int
                    ) -> Settings:
  """The checked arguments as the loop's static `Settings`."""
  max_new_tokens = config_checks.positive_int(max_new_tokens, "max_new_tokens")
  temperature = float(temperature)
  if not 0 <= temperature < math.inf:
    raise ValueError(f"temperature must be >= 0 and finite (0 decodes greedily); got {temperature}.")
  top_k = None if top_k is None else _integer(top_k, "top_k", f"an integer in [1, vocab_size={vocab_size}] or None")
  if top_k is not None and not 1 <= top_k <= vocab_size:
    raise ValueError(f"top_k must lie in [1, vocab_size={vocab_size}], or be None to keep every token; "
                     f"got {top_k}.")
  if top_p is not None and not 0 < float(top_p) <= 1:
    raise ValueError(f"top_p must lie in (0, 1], or be None to keep every token; got {top_p}.")
  if np.ndim(stop_tokens) != 1:  # a list, tuple or array of ids; not one id, None or a string
    raise ValueError(f"stop_tokens must be a sequence of token ids, e.g. [eos_id] or (); got {stop_tokens!r}.")
  stop = tuple(_integer(t, "every stop token", "an integer token id") for t in stop_tokens)
  bad = [t for t in stop if not 0 <= t < vocab_size]
  if bad:
    raise ValueError(f"stop tokens {bad} lie outside [0, vocab_size={vocab_size}); check the tokenizer's ids.")
  stream_every = config_checks.positive_int(stream_every, "stream_every", "steps per hand-over to the stream")
  if stream is not None and not callable(stream):
    raise ValueError(f"stream must be a callable stream(step_tokens_B, step) or None; got {stream!r}.")
  return Settings(max_new_tokens, temperature == 0, top_k, top_p is not None, stop,
                   0 if stream is None else stream_every)


def check_key(key: jax.Array, batch: int) -> jax.Array:
  """A typed PRNG key of shape `[]` or `[batch]`; raw uint32 keys (jax.random.PRNGKey) are wrapped."""
  key = None if key is None else jnp.asarray(key)
  if key is None or not (jnp.issubdtype(key.dtype, jax.dtypes.prng_key) or key.dtype == jnp.uint32):
    raise ValueError(f"key must be a PRNG key, e.g. jax.random.key(seed), or one per row; got {key!r}.")
  if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.wrap_key_data(key)
  if key.shape not in ((), (batch,)):
    raise ValueError(f"key must be one PRNG key or one per row [{batch}]; got keys of shape {key.shape}. "
                     "Use jax.random.key(seed) or jax.random.split(key, batch).")
  return key
