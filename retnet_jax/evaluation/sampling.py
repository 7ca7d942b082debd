"""Text generation: prefill in the chunkwise (or parallel) form, then decode recurrently, for either architecture.

    sampler = Sampler()  # owns the compiled functions: keep one to reuse them
    tokens_BxP, lengths_B = pad_prompts(prompts)
    out = sampler.generate(model, tokens_BxP, lengths_B, max_new_tokens=64, key=jax.random.key(0), top_p=0.9)
    out.tokens  # int32 [B, 64]: new tokens only
    out.lengths  # int32 [B]: tokens generated per row, a final stop token included

`generate` is `decode(model, prefill(model, ...), ...)`: `prefill` runs every prompt token but the last in the
chunkwise (or parallel) form, block by block (`prefill_block` tokens, `streaming`) in one compiled call; `decode`
feeds one token at a time through the recurrent form in one compiled `lax.while_loop`, which stops once every row
has emitted a stop token. RetNet's memory is constant in the context length, the prefill's included; a Transformer
prefills in the parallel form into a KV cache of `model.max_len` tokens, which must hold the prompt and the new
tokens (as must a hybrid RetNet's unwindowed attention layers, of `model.attention_max_len`; windowed ones keep the
last `model.attention_window` tokens, constant memory again). Left-padded rows start at position -pad, so each
decodes as if alone. A `Sampler`'s prefill compiles once per (model structure, batch, prompt length, prefill_mode,
prefill_block), its loop once per (model structure, batch, max_new_tokens, stop tokens, greedy or not, top_k, whether
top_p is set, stream_every); new prompts, keys, temperatures and top_p do not recompile (one key and one key per row
are different shapes).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from retnet_jax.evaluation import sampling_checks as checks
from retnet_jax.models import model as model_lib, streaming

PAD_ID = 0

Stream = checks.Stream
# progress(columns_done, columns) of a prefill call, called from its compiled loop after each block (columns: the
# prompts' padded width less the last token, which the decoding loop takes).
Progress = Callable[[int, int], None]


class Generation(NamedTuple):
  """New tokens `[B, max_new_tokens]` and the number generated per row `[B]`, a final stop token included; after
  its stop token a row repeats it."""
  tokens: np.ndarray
  lengths: np.ndarray


# XLA's CPU backend runs the decoding loop's small matmuls ([batch, d] x [d, n]) faster through Eigen than
# through YNNPACK, its default for dots; training keeps the default, faster for its large matmuls.
CPU_DECODE_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


class _InOrder:
  """Hands a call's streamed steps to its `stream` in step order, once each: the loop's host callbacks are
  unordered (ordered ones need a single device), so a block may arrive after a later one."""

  def __init__(self, stream: Stream):
    self.stream, self.next_step, self.waiting = stream, 0, {}

  def __call__(self, step_tokens_B: np.ndarray, step: int) -> None:
    if step >= self.next_step:
      self.waiting[step] = step_tokens_B
    while self.next_step in self.waiting:
      self.stream(self.waiting.pop(self.next_step), self.next_step)
      self.next_step += 1


def pad_prompts(prompts: Sequence[Sequence[int]], max_prompt_len: int | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
  """Left-pads token prompts with id 0 to the longest: (int32 tokens `[B, P]`, int32 lengths `[B]`)."""
  if not len(prompts):
    raise ValueError("prompts is empty; give at least one prompt.")
  arrays = [np.asarray(prompt, dtype=np.int32).reshape(-1) for prompt in prompts]
  for i, prompt in enumerate(arrays):
    if not len(prompt):
      raise ValueError(f"prompt {i} is empty; every prompt needs at least one token (e.g. a BOS or newline).")
    if max_prompt_len is not None and len(prompt) > max_prompt_len:
      raise ValueError(f"prompt {i} holds {len(prompt)} tokens, more than max_prompt_len={max_prompt_len}; "
                       "shorten it or raise max_prompt_len.")
  lengths_B = np.asarray([len(prompt) for prompt in arrays], dtype=np.int32)
  tokens_BxP = np.full((len(arrays), int(lengths_B.max())), PAD_ID, dtype=np.int32)
  for row, prompt in zip(tokens_BxP, arrays):
    row[len(row) - len(prompt):] = prompt
  return tokens_BxP, lengths_B


class Prefilled(NamedTuple):
  """Prompts run through the model: the state after every prompt token but the last, and that last token `[B]`,
  the decoding loop's first input. One `Prefilled` can be decoded many times."""
  state: dict[str, Any]
  last_tokens: jax.Array


def _prefill(params, prompts_BxP, lengths_B, call_id, *, graphdef, prefill_mode: str, prefill_block: int,
             report: Callable[..., None] | None = None):
  """The state after each row's prompt but its last token, run in blocks of `prefill_block` tokens (0: one call);
  each row starts at position -pad, so the padding stays out of the state. `report(call_id, done, columns)`, if
  given, is a host callback after each block."""
  model = nnx.merge(graphdef, params)
  batch, prompt_len = prompts_BxP.shape
  state = model.init_state(batch)
  state = state._replace(position=lengths_B - prompt_len)
  on_block = None
  if report is not None:
    def on_block(done, state):  # a value of the block's final state: the callback runs once the block has
      value = max(jax.tree.leaves(state.layers), key=lambda leaf: leaf.size).reshape(-1)[0]
      jax.debug.callback(report, call_id, done, prompt_len - 1, value, ordered=False)
  if prompt_len > 1:
    state = streaming.final_state(model, prompts_BxP, prefill_mode, prefill_block, state, on_block=on_block,
                                  length=prompt_len - 1)
  return state


class Sampler:
  """Owns the compiled prefill and decoding loop, and the streams of its calls in flight, which its loop's host
  callbacks reach; reusing one reuses its compilations."""

  def __init__(self):
    self._prefill_jit = jax.jit(_prefill, static_argnames=("graphdef", "prefill_mode", "prefill_block", "report"))
    self._streams: dict[int, _InOrder] = {}  # by call id: the loop gets the id as an argument, so no recompile
    self._progress: dict[int, list] = {}  # by call id: [progress, the most columns reported so far]
    self._compiled_prefills: dict[tuple, Any] = {}  # compile_prefill's executables, by `_prefill_key`
    self._call_ids = itertools.count()

  @functools.cached_property
  def _loop_jit(self) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """`_loop` jitted, with CPU_DECODE_OPTIONS on a CPU backend whose XLA knows them; made on first use, once the
    backend is set up."""
    options = CPU_DECODE_OPTIONS if jax.default_backend() == "cpu" else None
    if options:
      try:
        jax.jit(jnp.negative, compiler_options=options).lower(jnp.zeros(())).compile()
      except jax.errors.JaxRuntimeError:  # an XLA without the option: keep its defaults
        options = None
    return jax.jit(self._loop, static_argnames=("graphdef", "settings"), compiler_options=options)

  def prefill(self, model: model_lib.Model, prompts_BxP: Any, lengths_B: Any, *,
              prefill_mode: str | None = None, prefill_block: int | None = None,
              progress: Progress | None = None) -> Prefilled:
    """Runs left-padded prompts in the chunkwise or parallel form, block by block in one compiled call.

    Args:
      prompts_BxP: int token ids `[B, P]`, each row left-padded to P (`pad_prompts`).
      lengths_B: the true prompt lengths `[B]`, in [1, P].
      prefill_mode: one of `architectures.prefill_modes(model.config)`; None: the first, chunkwise for RetNet,
        parallel for a Transformer.
      prefill_block: tokens per block, a multiple of `model.chunk_size` (`streaming.check_block`): the prefill's
        memory is one block's whatever the prompt's length (but for a KV cache that holds the whole context). None:
        `streaming.DEFAULT_BLOCK` rounded up to whole chunks; 0: the whole prompt in one call.
      progress: `progress(columns_done, columns)` after each block, in order (`Progress`): for a progress line on
        a long prompt. Compiled in only where given.
    Returns: `Prefilled`: the state after every prompt token but the last, and the last tokens int32 `[B]`.
    """
    _, prefill_mode, padding, prefill_block = checks.check_prefill(model, prompts_BxP, lengths_B, prefill_mode,
                                                                   prefill_block, progress)
    checks.check_cache(model, *prompts_BxP.shape)
    return self._prefill_checked(*nnx.split(model), prompts_BxP, lengths_B, prefill_mode, padding, prefill_block,
                                 progress)

  def compile_prefill(self, model: model_lib.Model, batch: int, prompt_len: int, prefill_mode: str | None = None,
                      prefill_block: int | None = None) -> Any:
    """The prefill compiled for `batch` prompts padded to `prompt_len` tokens (`jax.stages.Compiled`), as `prefill`
    would run it: its `memory_analysis()` sizes the prefill with nothing allocated or run, and a prefill of those
    shapes by this sampler, with the same parameters' shapes, dtypes and placement and no `progress`, then runs it
    (without compiling again).

    Args:
      batch, prompt_len: the shape of the prompts `[B, P]` (`pad_prompts`).
      prefill_mode, prefill_block: as `prefill`.
    """
    prefill_mode = checks.check_prefill_mode(model, prefill_mode)
    prefill_block = streaming.check_block(model.config, prefill_block)
    width = prompt_len + checks.split_padding(prompt_len, getattr(model.config, "chunk_size", None))
    tokens = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    graphdef, params = nnx.split(model)
    compiled = self.trace_prefill(graphdef, params, tokens(batch, width), tokens(batch), prefill_mode,
                                  prefill_block).lower().compile()
    self._compiled_prefills[_prefill_key(graphdef, params, (batch, width), prefill_mode, prefill_block)] = compiled
    return compiled

  def decode(self, model: model_lib.Model, prefilled: Prefilled, *, max_new_tokens: int, key: jax.Array,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             stop_tokens: Sequence[int] = (), stream: Stream | None = None, stream_every: int = 8) -> Generation:
    """Samples `max_new_tokens` tokens after prefilled prompts in one compiled loop.

    Args:
      prefilled: from `prefill`, batch B; not consumed, so it can be decoded again.
      the rest: as `generate`.
    Returns: `Generation` of new tokens int32 `[B, max_new_tokens]` and tokens generated per row int32 `[B]`.
    """
    settings = checks.check_settings(model.config.vocab_size, max_new_tokens, temperature, top_k, top_p, stop_tokens,
                               stream, stream_every)
    keys = checks.check_key(key, prefilled.last_tokens.shape[0])
    checks.check_decoding_room(model, prefilled.state, settings.max_new_tokens)
    return self._decode_checked(*nnx.split(model), prefilled, settings, keys, temperature, top_p, stream)

  def generate(self, model: model_lib.Model, prompts_BxP: Any, lengths_B: Any, *, max_new_tokens: int,
               key: jax.Array, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
               stop_tokens: Sequence[int] = (), prefill_mode: str | None = None, prefill_block: int | None = None,
               progress: Progress | None = None, stream: Stream | None = None, stream_every: int = 8
               ) -> Generation:
    """Samples `max_new_tokens` tokens after each left-padded prompt: `decode(model, prefill(model, ...), ...)`.

    Args:
      prompts_BxP, lengths_B, prefill_mode, prefill_block, progress: as `prefill`.
      temperature: 0 decodes greedily (argmax); otherwise logits / temperature are filtered to the `top_k` most
        likely tokens, then to the smallest set whose probability reaches `top_p`, and sampled.
      key: one PRNG key (row r uses fold_in(key, r)) or one per row `[B]`; step s uses fold_in(row key, s), so a
        row with its own key samples the same tokens whatever the rest of the batch.
      stop_tokens: ids that end a row.
      stream: `stream(step_tokens_B, step)`, called in step order with every step's tokens `[B]`.
      stream_every: steps per hand-over of tokens to the host, one host callback each; 1 streams every token as
        it comes, at that cost per token.
    Returns: `Generation` of new tokens int32 `[B, max_new_tokens]` and tokens generated per row int32 `[B]`.
    """
    batch, prefill_mode, padding, prefill_block = checks.check_prefill(model, prompts_BxP, lengths_B, prefill_mode,
                                                                       prefill_block, progress)
    settings = checks.check_settings(model.config.vocab_size, max_new_tokens, temperature, top_k, top_p, stop_tokens,
                               stream, stream_every)
    keys = checks.check_key(key, batch)  # every argument checked before the prefill runs
    checks.check_cache(model, *prompts_BxP.shape, settings.max_new_tokens)
    graphdef, params = nnx.split(model)
    prefilled = self._prefill_checked(graphdef, params, prompts_BxP, lengths_B, prefill_mode, padding, prefill_block,
                                      progress)
    return self._decode_checked(graphdef, params, prefilled, settings, keys, temperature, top_p, stream)

  def trace_prefill(self, graphdef: nnx.GraphDef, params: Any, prompts_BxP: Any, lengths_B: Any,
                    prefill_mode: str, prefill_block: int) -> Any:
    """The compiled prefill traced on (abstract) `params`, prompts and lengths (`jax.ShapeDtypeStruct`s), in blocks
    of `prefill_block` tokens (checked: `streaming.check_block`), for ahead-of-time compilation (`aot`):
    `.lower().compile()` it on a target's devices."""
    return self._prefill_jit.trace(params, prompts_BxP, lengths_B, jax.ShapeDtypeStruct((), jnp.int32),
                                   graphdef=graphdef, prefill_mode=prefill_mode, prefill_block=prefill_block)

  def trace_decode(self, graphdef: nnx.GraphDef, params: Any, prompts_BxP: Any, lengths_B: Any, prefill_mode: str,
                   max_new_tokens: int) -> Any:
    """The decoding loop traced after a prefill of those (abstract) prompts, sampling with top-p and a key per row,
    without the CPU host's compiler options (`_loop_jit`): for ahead-of-time compilation on a target."""
    state = jax.eval_shape(functools.partial(_prefill, graphdef=graphdef, prefill_mode=prefill_mode, prefill_block=0),
                           params, prompts_BxP, lengths_B, jax.ShapeDtypeStruct((), jnp.int32))
    batch = prompts_BxP.shape[0]
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), batch))
    settings = checks.Settings(max_new_tokens, greedy=False, top_k=None, use_top_p=True, stop_tokens=(),
                               stream_every=0)
    scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype)
    loop = jax.jit(self._loop, static_argnames=("graphdef", "settings"))
    return loop.trace(params, state, jax.ShapeDtypeStruct((batch,), jnp.int32), keys, scalar(jnp.float32),
                      scalar(jnp.float32), scalar(jnp.int32), graphdef=graphdef, settings=settings)

  def _prefill_checked(self, graphdef, params, prompts_BxP: Any, lengths_B: Any, prefill_mode: str,
                       padding: int, prefill_block: int, progress: Progress | None) -> Prefilled:
    """The prefill of prompts `checks.check_prefill` accepted, left-padded by `padding` more columns
    (`checks.split_padding`), in blocks of `prefill_block` tokens, reporting to `progress`."""
    prompts_BxP = jnp.asarray(prompts_BxP, jnp.int32)
    if padding:
      prompts_BxP = jnp.pad(prompts_BxP, ((0, 0), (padding, 0)), constant_values=PAD_ID)
    call_id = next(self._call_ids)
    args = (params, prompts_BxP, jnp.asarray(lengths_B, jnp.int32), jnp.int32(call_id))
    compiled = self._compiled_prefills.get(_prefill_key(graphdef, params, prompts_BxP.shape, prefill_mode,
                                                        prefill_block)) if progress is None else None
    if progress is not None:
      self._progress[call_id] = [progress, 0]
    try:
      state = compiled(*args) if compiled is not None else self._prefill_jit(
          *args, graphdef=graphdef, prefill_mode=prefill_mode, prefill_block=prefill_block,
          report=None if progress is None else self._report)
      if progress is not None:
        jax.block_until_ready(state)
        jax.effects_barrier()  # every block's report has run before the call returns
    finally:
      self._progress.pop(call_id, None)
    return Prefilled(state, prompts_BxP[:, -1])

  def _report(self, call_id, done, columns, _) -> None:
    """Host side of a prefill's report: its progress, with the most columns done so far (reports are unordered)."""
    entry = self._progress.get(int(call_id))
    if entry is not None and int(done) > entry[1]:
      entry[1] = int(done)
      entry[0](entry[1], int(columns))

  def _decode_checked(self, graphdef, params, prefilled: Prefilled, settings: checks.Settings, keys: jax.Array,
                      temperature: float, top_p: float | None, stream: Stream | None) -> Generation:
    call_id = next(self._call_ids)
    if stream is not None:
      self._streams[call_id] = _InOrder(stream)
    try:
      tokens_BxN, generated_B = self._loop_jit(
          params, prefilled.state, prefilled.last_tokens, keys, jnp.float32(temperature or 1.0),
          jnp.float32(top_p or 1.0), jnp.int32(call_id), graphdef=graphdef, settings=settings)
      result = Generation(np.asarray(tokens_BxN), np.asarray(generated_B))
      if stream is not None:
        jax.effects_barrier()  # every block's callback has run before the call returns
    finally:
      self._streams.pop(call_id, None)
    return result

  def _loop(self, params, state, token_B, keys, temperature, top_p, call_id, *, graphdef,
            settings: checks.Settings):
    """The decoding loop: (tokens int32 `[B, N]`, generated per row int32 `[B]`)."""
    model = nnx.merge(graphdef, params)
    batch = token_B.shape[0]
    num_new = settings.max_new_tokens
    if keys.ndim == 0:
      keys = jax.vmap(jax.random.fold_in, (None, 0))(keys, jnp.arange(batch))

    def sample(logits_BxV, step):
      if settings.greedy:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
      step_keys = jax.vmap(jax.random.fold_in, (0, None))(keys, step)
      return _sample(step_keys, logits_BxV / temperature, settings.top_k, top_p if settings.use_top_p else None)

    stop_S = jnp.asarray(settings.stop_tokens, jnp.int32)
    block = min(settings.stream_every, num_new)  # columns handed to the host per callback

    def body(carry):
      step, token_B, state, done_B, out_BxN, generated_B = carry
      logits, state = model(token_B[:, None], mode="recurrent", state=state)
      next_B = jnp.where(done_B, token_B, sample(logits[:, 0].astype(jnp.float32), step))  # done: repeat stop
      out_BxN = jax.lax.dynamic_update_index_in_dim(out_BxN, next_B, step, axis=1)
      generated_B = generated_B + (~done_B).astype(jnp.int32)
      done_B = done_B | jnp.isin(next_B, stop_S)
      if settings.stream_every:
        jax.lax.cond((step + 1) % settings.stream_every == 0,
                     lambda: self._stream(call_id, out_BxN, step + 1, settings.stream_every, block), lambda: None)
      return step + 1, next_B, state, done_B, out_BxN, generated_B

    def cond(carry):
      step, _, _, done_B, _, _ = carry
      return (step < num_new) & ~jnp.all(done_B)

    init = (jnp.int32(0), token_B, state, jnp.zeros((batch,), bool),
            jnp.zeros((batch, num_new), jnp.int32), jnp.zeros((batch,), jnp.int32))
    steps, last_B, _, _, out_BxN, generated_B = jax.lax.while_loop(cond, body, init)
    if settings.stream_every:  # the steps after the last full block
      rest = steps % settings.stream_every
      jax.lax.cond(rest > 0, lambda: self._stream(call_id, out_BxN, steps, rest, block), lambda: None)
    # An early exit leaves columns unwritten; every row has stopped then, so fill them with its stop token.
    out_BxN = jnp.where(jnp.arange(num_new) < steps, out_BxN, last_B[:, None])
    return out_BxN, generated_B

  def _stream(self, call_id, out_BxN: jax.Array, end, count, width: int) -> None:
    """Hands steps `end - count ... end - 1` to the host, in a block of `width` columns ending at `end` (or
    starting at 0)."""
    start = jnp.maximum(end - width, 0)
    block_BxW = jax.lax.dynamic_slice_in_dim(out_BxN, start, width, axis=1)
    jax.debug.callback(ordered=False)(self._emit, call_id, block_BxW, start, end - count, end)

  def _emit(self, call_id, block_BxW, start, first, end) -> None:
    """Host side: hands steps `first ... end - 1` of a block starting at step `start` to the call's stream."""
    block_BxW = np.asarray(block_BxW)
    for step in range(int(first), int(end)):
      self._streams[int(call_id)](block_BxW[:, step - int(start)], step)


def _prefill_key(graphdef: nnx.GraphDef, params: Any, prompts_shape: tuple[int, ...], prefill_mode: str,
                 prefill_block: int) -> tuple:
  """What a compiled prefill depends on: the model's structure, its parameters' shapes, dtypes and placement (abstract
  ones have none), the prompts' shape `[B, P]` (left padding included), the form and the block."""
  leaves, treedef = jax.tree.flatten(params)
  return (graphdef, treedef, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves),
          tuple(prompts_shape), prefill_mode, prefill_block)


def _sample(keys_B, logits_BxV, top_k: int | None, top_p: jax.Array | None) -> jax.Array:
  """One token per row `[B]` int32 from the scaled logits, after optional top-k and nucleus (top-p) filtering of
  the sorted candidates; the most likely token always survives the nucleus filter."""
  categorical = jax.vmap(jax.random.categorical)
  if top_k is None and top_p is None:
    return categorical(keys_B, logits_BxV).astype(jnp.int32)
  values_BxK, ids_BxK = jax.lax.top_k(logits_BxV, top_k or logits_BxV.shape[-1])
  if top_p is not None:
    probs_BxK = jax.nn.softmax(values_BxK, axis=-1)
    mass_before_BxK = jnp.cumsum(probs_BxK, axis=-1) - probs_BxK
    values_BxK = jnp.where(mass_before_BxK < top_p, values_BxK, -jnp.inf)
  choice_B = categorical(keys_B, values_BxK)
  return jnp.take_along_axis(ids_BxK, choice_B[:, None], axis=-1)[:, 0].astype(jnp.int32)


