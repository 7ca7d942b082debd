"""lm-evaluation-harness integration: the `retnet_jax` model of the harness's registry, registered on import.

    import lm_eval
    import retnet_jax.evaluation.lm_eval  # registers "retnet_jax"
    results = lm_eval.simple_evaluate(
        model="retnet_jax", model_args="workdir=runs/shakespeare,config=configs/retnet.py:small", tasks=["lambada"])

`model_args`: `workdir` and `config` (a config file and preset, as `--config` takes them; default: the preset and
model of the workdir's config.json), `step` (default: the latest checkpoint), `config.x.y=VALUE` overrides (as
`--config.x.y=VALUE`; a tuple needs the dict form of model_args, whose values may be any Python value), and the
adapter's options: `mode` (`parallel` | `chunkwise`: the form that prefills contexts), `max_length` (tokens of
context plus continuation a request keeps, from the right; default `train.seq_len`), `max_gen_toks`, `prefix_token`
(the token scored text starts after: the tokenizer's end-of-document token; the newline byte for the byte
tokenizer) and `seed` (sampled generation).

`loglikelihood` prefills each distinct context once (all its tokens but the last, left-padded into batches) and
scores every continuation of it from that state; `loglikelihood_rolling` scores a text in disjoint windows of
`max_length` tokens, each predicting its tokens from the window alone (the harness's convention, so any
architecture scores alike); `generate_until` decodes through `retnet_jax.evaluation.sampling` and cuts the text at the
first stop string. The model is anything called as `model(tokens_BxL, mode=..., state=...)` that returns
`(logits, state)` and has `init_state(batch)` and `config.vocab_size`: a RetNet continues from its recurrent
state, a Transformer from its KV cache.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from tqdm import tqdm

from retnet_jax.core import config_checks, sharding, whole_files
from retnet_jax.evaluation import sampling
from retnet_jax.input_pipeline import tokenizer as tokenizer_lib
from retnet_jax.models import architectures
from retnet_jax.runs import cli, workdir as workdir_lib
from retnet_jax.training import losses, metrics, run_config, train_state

try:
  import lm_eval.models  # noqa: F401  (the harness's own models first: a non-empty registry skips them)
  from lm_eval import utils as harness_utils
  from lm_eval.api.model import TemplateLM
  from lm_eval.api.registry import register_model
  from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
  from lm_eval.tasks import TaskManager
  import yaml  # the harness's task files
except ImportError as e:
  raise ImportError("retnet_jax.evaluation.lm_eval needs the lm-evaluation-harness: pip install -e '.[eval]'.") from e

# generation_kwargs the adapter reads (the harness's aliases of max_gen_toks among them).
GENERATION_KWARGS = ("until", "max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens", "do_sample",
                     "temperature", "top_k", "top_p")
OPTIONS = ("workdir", "config", "step", "batch_size", "mode", "max_length", "max_gen_toks", "prefix_token", "seed")
NEWLINE_BYTE = 10
MIN_WIDTH = 16  # batches are padded to widths of 16, 32, 64, ... tokens: one compilation each


class Generation(NamedTuple):
  """One request's checked generation settings (hashable: requests that share them decode together)."""
  until: tuple[str, ...]
  max_gen_toks: int
  temperature: float  # 0: greedy
  top_k: int | None
  top_p: float | None


def generation_settings(gen_kwargs: Any, default_max_gen_toks: int = 256) -> Generation:
  """A task's `generation_kwargs` as `Generation`, normalised as the harness does; ValueError for what the
  adapter cannot use."""
  if not isinstance(gen_kwargs, dict):
    raise ValueError(f"generation_kwargs must be a mapping such as {{'until': ['\\n']}}; got {gen_kwargs!r}.")
  unknown = sorted(set(gen_kwargs) - set(GENERATION_KWARGS))
  if unknown:
    raise ValueError(f"generation_kwargs {unknown} are not supported by the retnet_jax model (it reads "
                     f"{list(GENERATION_KWARGS)}); remove them from the task's generation_kwargs.")
  try:
    kwargs = normalize_gen_kwargs(gen_kwargs, default_max_gen_toks)
  except (TypeError, ValueError) as e:
    raise ValueError(f"generation_kwargs {gen_kwargs!r} could not be read ({e}); give numbers for max_gen_toks "
                     "and temperature.") from e
  until = handle_stop_sequences(kwargs["until"], eos=None)
  if not all(isinstance(s, str) and s for s in until):
    raise ValueError(f"generation_kwargs until={until!r} must be non-empty strings; fix the task's "
                     "generation_kwargs.")
  # do_sample without a temperature samples at temperature 1, as Hugging Face's generate does.
  max_gen_toks, temperature = kwargs["max_gen_toks"], float(kwargs.get("temperature", float(kwargs["do_sample"])))
  top_k, top_p = kwargs.get("top_k"), kwargs.get("top_p")
  if max_gen_toks < 1 or temperature < 0:
    raise ValueError(f"generation_kwargs need max_gen_toks >= 1 and temperature >= 0; got {max_gen_toks} and "
                     f"{temperature}.")
  if top_k is not None:
    config_checks.positive_int(top_k, "generation_kwargs top_k", "or absent")
  if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
    raise ValueError(f"generation_kwargs top_p={top_p!r} must lie in (0, 1] or be absent.")
  greedy = not kwargs["do_sample"] or temperature == 0
  return Generation(tuple(until), max_gen_toks, 0.0 if greedy else temperature, top_k,
                    None if top_p is None else float(top_p))


def check_task(task: Any) -> None:
  """Raises ValueError naming the task and the fix if the adapter cannot run it: a generation task whose
  generation_kwargs it cannot use."""
  if task.config.output_type == "generate_until":
    try:
      generation_settings(task.config.generation_kwargs or {})
    except ValueError as e:
      raise ValueError(f"task {task.task_name!r}: {e}") from None


def load_tasks(names: Sequence[str], include_path: str | None = None) -> tuple[TaskManager, list[Any]]:
  """The harness's tasks (and groups) of `names`, checked with `check_task` before any model runs.

  Args:
    names: task, group or tag names, or paths of task YAML files.
    include_path: a folder of more task YAML files. When it holds every task named, the harness's built-in tasks
      are not indexed (which takes seconds).
  Returns:
    (the task manager, the top-level tasks and groups), to pass to `lm_eval.simple_evaluate`.
  """
  names = [name for name in names if name]
  if not names:
    raise ValueError("no tasks given; name at least one, e.g. --tasks=lambada_openai,hellaswag.")
  if include_path is not None and not Path(include_path).is_dir():
    raise ValueError(f"include_path={include_path!r} is not a folder; give the folder holding the task YAML files.")
  manager = None
  if include_path is not None:
    manager = TaskManager(include_path=include_path, include_defaults=False)
    if not all(name in manager.all_tasks or Path(name).is_file() for name in names):
      manager = None
  manager = manager or TaskManager(include_path=include_path)
  broken = _unparsable_yaml([Path(name) for name in names if Path(name).is_file()] +
                            ([] if include_path is None else sorted(Path(include_path).rglob("*.yaml"))))
  unknown = [name for name in names if name not in manager.all_tasks and not Path(name).is_file()]
  if broken and (unknown or any(Path(name).is_file() for name in names)):
    raise ValueError(f"task files that do not parse as YAML: {broken}; fix them (the harness skips such a file, "
                     "and its tasks would read as unknown).")
  if unknown:
    raise ValueError(f"unknown tasks {unknown}: neither the harness's tasks nor task YAML files"
                     f"{'' if include_path is None else f' under include_path={include_path!r}'}; check the names "
                     "(`lm-eval ls tasks` lists the harness's) or give the folder of your task files as include_path.")
  try:
    loaded = manager.load(names)
  except Exception as e:  # the harness raises many kinds for a task file it cannot build
    raise ValueError(f"the tasks {names} could not be loaded ({type(e).__name__}: {e}); fix the task file.") from e
  for task in loaded["tasks"].values():
    check_task(task)
  children = {child for child_names in loaded["group_map"].values() for child in child_names}
  top = [item for name, item in {**loaded["groups"], **loaded["tasks"]}.items() if name not in children]
  return manager, top


def _unparsable_yaml(paths: Sequence[Path]) -> list[str]:
  """`path (the parser's first line)` of each file of `paths` that is not YAML (the harness's `!function` tags
  allowed)."""
  loader = type("TaskLoader", (yaml.SafeLoader,), {})
  loader.add_multi_constructor("!", lambda *_: None)
  broken = []
  for path in paths:
    try:
      yaml.load(path.read_text(), Loader=loader)  # noqa: S506  (a SafeLoader)
    except yaml.YAMLError as e:
      broken.append(f"{path} ({str(e).splitlines()[0]})")
  return broken


def _integer(name: str, value: Any, minimum: int) -> int:
  """`value` of model_args' option `name` as an integer of at least `minimum`."""
  if isinstance(value, bool) or not str(value).strip().lstrip("-").isdigit() or int(value) < minimum:
    raise ValueError(f"model_args {name}={value!r} must be an integer of at least {minimum}.")
  return int(value)


def write_results(results: dict[str, Any], path: str | Path) -> str | None:
  """The harness's full results (`results_json`) written whole to `path` by the first process; returns the path as
  written, or None where it could not be (logged: the results still reach stdout)."""
  if jax.process_index() == 0:
    try:
      Path(path).parent.mkdir(parents=True, exist_ok=True)
      whole_files.write_text(path, results_json(results) + "\n")
    except OSError as e:  # a read-only or full disk
      logging.error(f"could not write {path} ({e.strerror}); the results are the table and the JSON line only")
      return None
  return str(path)


def _bucket(length: int, cap: int) -> int:
  """The padded width for `length` tokens: the next power of two from MIN_WIDTH, at most `cap` (fewer
  compilations)."""
  return max(length, min(max(MIN_WIDTH, 1 << max(length - 1, 0).bit_length()), cap))


def _left_padded(sequences: list[list[int]], rows: int, width: int) -> tuple[np.ndarray, np.ndarray]:
  """Sequences left-padded to `width` tokens, the batch filled to `rows` with copies of the first:
  (int32 tokens `[rows, width]`, lengths `[rows]`)."""
  tokens, lengths = sampling.pad_prompts(sequences + sequences[:1] * (rows - len(sequences)))
  return np.pad(tokens, ((0, 0), (width - tokens.shape[1], 0)), constant_values=sampling.PAD_ID), lengths


@functools.partial(jax.jit, static_argnames=("graphdef", "mode"))
def _continuation_logprobs(graphdef, params, state, rows_B, inputs_BxC, targets_BxC, *, mode: str):
  """Log-probabilities of `targets` `[B, C]` after `inputs`, row b continuing row `rows_B[b]` of a prefilled state,
  and whether each target is the most likely token."""
  prefill_batch = state.position.shape[0]
  # Leaves with the batch first are the rows' own; others (a KV cache's shared next slot) are common.
  state = jax.tree.map(lambda x: x[rows_B] if x.ndim and x.shape[0] == prefill_batch else x, state)
  logits_BxCxV, _ = nnx.merge(graphdef, params)(inputs_BxC, mode=mode, state=state)
  return -losses.token_nll(logits_BxCxV, targets_BxC), jnp.argmax(logits_BxCxV, axis=-1) == targets_BxC


@register_model("retnet_jax")
class RetNetLM(TemplateLM):
  """The harness's model for a retnet_jax checkpoint (`workdir`, `config`, `step`) or a model object (`model`,
  `tokenizer`, `max_length`); the other options as the module docstring lists them."""

  def __init__(self, workdir: str | None = None, config: Any = None,
               step: int | None = None, *, model: Any = None, tokenizer: tokenizer_lib.Tokenizer | None = None,
               batch_size: int | str = 8, mode: str = "parallel", max_length: int | None = None,
               max_gen_toks: int = 256, prefix_token: int | None = None, seed: int = 0, device: str | None = None,
               max_batch_size: int | None = None, **overrides: Any):
    super().__init__()
    unknown = sorted(name for name in overrides if not name.startswith("config."))
    if unknown:
      raise ValueError(f"model_args {unknown} are not options of the retnet_jax model; it takes {list(OPTIONS)} "
                       "and config.x.y=VALUE overrides.")
    if device is not None or max_batch_size is not None:
      raise ValueError(f"device={device!r} and max_batch_size={max_batch_size!r} do not apply to the retnet_jax "
                       "model (config.mesh places it on JAX's devices, and batch_size is fixed); leave them out.")
    try:
      self.batch_size = int(batch_size)
    except ValueError:
      raise ValueError(f"batch_size={batch_size!r}: the retnet_jax model needs a number of rows, e.g. "
                       "batch_size=8 (no 'auto').") from None
    if self.batch_size < 1:
      raise ValueError(f"batch_size={batch_size!r} must be at least 1.")
    if mode not in architectures.PREFILL_MODES:
      raise ValueError(f"mode={mode!r}: contexts are prefilled in one of {architectures.PREFILL_MODES}.")
    self.mode, self.max_gen_toks, self.seed = mode, _integer("max_gen_toks", max_gen_toks, 1), _integer("seed", seed, 0)
    self.workdir, self.step = workdir, step
    if (workdir is None) == (model is None):
      raise ValueError("give either workdir (with config, and optionally step) or a model object (with tokenizer "
                       "and max_length) to the retnet_jax model, not both or neither.")
    if model is None:
      fields = {name.removeprefix("config."): v for name, v in overrides.items()}
      if config is None and workdir_lib.config_file(workdir).exists():  # as the scripts that read a run
        config = cli.apply_overrides(workdir_lib.saved_config(workdir), fields)
      elif config is None:
        raise ValueError(f"model_args needs config=FILE:PRESET beside workdir, as --config takes it, e.g. "
                         f"workdir={workdir},config=configs/retnet.py:small ({workdir} holds no config.json).")
      elif isinstance(config, str):
        config = cli.load_config(config, fields)
      elif overrides:
        raise ValueError(f"config.x.y overrides {sorted(overrides)} apply to a config file; set them on the "
                         "config object given instead.")
      config = run_config.build(config)
      tokenizer = tokenizer_lib.load(config.data.tokenizer, vocab_size=config.model.vocab_size)
      max_length = config.train.seq_len if max_length is None else max_length
      self._context = sharding.placement(config.mesh).active
      split = sharding.sequence_devices(config.mesh, jax.device_count())
      self._multiple = split * config.model.chunk_size if split > 1 else 1
    else:
      if tokenizer is None or max_length is None:
        raise ValueError("a model object needs its tokenizer and max_length (tokens of context per request).")
      tokenizer_lib.check_vocab_size(tokenizer, model.config.vocab_size)
      self._context, self._multiple = contextlib.nullcontext, 1
    self.max_length = _integer("max_length", max_length, 1)
    self.tokenizer = tokenizer
    model_cfg = config.model if model is None else model.config
    self._prefix_token = self._choose_prefix_token(prefix_token, model_cfg.vocab_size)
    field = architectures.cache_field(model_cfg)
    if field is not None and self.max_length > model_cfg.flat_value(field):
      raise ValueError(f"max_length={self.max_length} tokens of context and continuation do not fit the KV cache of "
                       f"model.{field}={model_cfg.flat_value(field)}; raise it (config.model.{field}="
                       f"{self.max_length}) or "
                       "lower max_length.")
    if model is None:
      model, self.step = train_state.restore_model(config, workdir, step)
    self.model = model
    self.sampler = sampling.Sampler()  # its compiled prefill and decoding loop, reused by every request
    self._graphdef, self._params = nnx.split(model)

  def _choose_prefix_token(self, prefix_token: int | None, vocab_size: int) -> int:
    if prefix_token is None:
      if self.tokenizer.eos_id is not None:
        return int(self.tokenizer.eos_id)
      if isinstance(self.tokenizer, tokenizer_lib.ByteTokenizer):
        return NEWLINE_BYTE
      raise ValueError(f"the tokenizer has no end-of-document token (one of {tokenizer_lib.EOS_TOKENS}) to start "
                       "scored text after; give one with prefix_token=ID.")
    if not isinstance(prefix_token, int) or not 0 <= prefix_token < vocab_size:
      raise ValueError(f"prefix_token={prefix_token!r} must be a token id in [0, {vocab_size}).")
    return prefix_token

  @property
  def eot_token_id(self) -> int:
    return self._prefix_token

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
    return self.tokenizer.encode(string).tolist()

  def tok_decode(self, tokens: Sequence[int]) -> str:
    return self.tokenizer.decode(np.asarray(tokens, np.int32))

  def get_model_info(self) -> dict[str, Any]:
    """What the harness records in its results' `config`."""
    return {"workdir": None if self.workdir is None else str(self.workdir), "step": self.step, "mode": self.mode,
            "max_length": self.max_length}

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
    """(log-probability, greedy) of each `(key, context tokens, continuation tokens)`: each distinct context is
    prefilled once, in batches, and its continuations are scored from its state."""
    results: list[tuple[float, bool] | None] = [None] * len(requests)
    groups: dict[tuple[int, ...], list[tuple[int, list[int]]]] = {}
    for i, (_, context, continuation) in enumerate(requests):
      if len(continuation) > self.max_length:
        raise ValueError(f"a continuation of {len(continuation)} tokens is longer than max_length={self.max_length}; "
                         "raise max_length.")
      if not continuation:
        results[i] = (0.0, True)
        continue
      whole = (list(context) + list(continuation))[-(self.max_length + 1):]
      groups.setdefault(tuple(whole[:-len(continuation)]), []).append((i, list(continuation)))
    contexts = sorted(groups, key=len, reverse=True)  # the longest first: a batch too large fails at once
    progress = tqdm(total=len(requests), disable=disable_tqdm, desc="loglikelihood")
    with self._context():
      for start in range(0, len(contexts), self.batch_size):
        chunk = contexts[start:start + self.batch_size]
        width = _bucket(len(chunk[0]), self.max_length)
        tokens_BxP, lengths_B = _left_padded([list(c) for c in chunk], self.batch_size, width)
        state = self.sampler.prefill(self.model, tokens_BxP, lengths_B, prefill_mode=self.mode).state
        rows = [(row, i, continuation) for row, context in enumerate(chunk) for i, continuation in groups[context]]
        for first in range(0, len(rows), self.batch_size):
          part = rows[first:first + self.batch_size]
          for (_, i, continuation), (logprob, greedy) in zip(part, self._score(state, chunk, part)):
            results[i] = (logprob, greedy)
            if requests[i][0] is not None:
              self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
          progress.update(len(part))
    progress.close()
    return results

  def _score(self, state, chunk: list[tuple[int, ...]], part: list[tuple[int, int, list[int]]]
             ) -> list[tuple[float, bool]]:
    """Scores continuations of prefilled rows: each input is its context's last token and its continuation but
    the last token."""
    width = _bucket(max(len(continuation) for _, _, continuation in part), self.max_length)
    # A mesh that splits sequences runs whole chunks per device: the inputs are right-padded to such a width
    # (a causal model's scored positions do not see the padding after them; only those are summed).
    width = -(-width // self._multiple) * self._multiple
    inputs_BxC = np.full((self.batch_size, width), sampling.PAD_ID, np.int32)
    targets_BxC = np.full((self.batch_size, width), sampling.PAD_ID, np.int32)
    rows_B = np.zeros((self.batch_size,), np.int32)
    for b, (row, _, continuation) in enumerate(part):
      inputs_BxC[b, :len(continuation)] = [chunk[row][-1]] + continuation[:-1]
      targets_BxC[b, :len(continuation)] = continuation
      rows_B[b] = row
    logprobs_BxC, greedy_BxC = _continuation_logprobs(self._graphdef, self._params, state, rows_B, inputs_BxC,
                                                      targets_BxC, mode=self.mode)
    logprobs_BxC, greedy_BxC = np.asarray(logprobs_BxC, np.float64), np.asarray(greedy_BxC)
    return [(float(logprobs_BxC[b, :len(c)].sum()), bool(greedy_BxC[b, :len(c)].all()))
            for b, (_, _, c) in enumerate(part)]

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """Log-probability of each text after the prefix token, in disjoint windows of `max_length` tokens."""
    windows, owners = [], []
    for i, (text,) in enumerate(request.args for request in requests):
      for context, continuation in map(harness_utils.make_disjoint_window, harness_utils.get_rolling_token_windows(
          self.tok_encode(text), self.prefix_token_id, self.max_length, context_len=1)):
        windows.append((None, context, continuation))
        owners.append(i)
    totals = [0.0] * len(requests)
    for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
      totals[owner] += logprob
    for request, total in zip(requests, totals):
      self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
    return totals

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Each request's generated text up to its first stop string; requests with the same settings decode in
    batches, every request's settings checked first."""
    settings = [self._generation(request.args[1]) for request in requests]
    contexts = [self.tok_encode(request.args[0]) for request in requests]
    results: list[str | None] = [None] * len(requests)
    by_settings: dict[Generation, list[int]] = {}
    for i, setting in enumerate(settings):
      by_settings.setdefault(setting, []).append(i)
    progress = tqdm(total=len(requests), disable=disable_tqdm, desc="generate_until")
    with self._context():
      for setting, indices in by_settings.items():
        keep = self.max_length - setting.max_gen_toks
        prompts = {i: contexts[i][-keep:] or [self._prefix_token] for i in indices}
        indices = sorted(indices, key=lambda i: len(prompts[i]), reverse=True)
        for start in range(0, len(indices), self.batch_size):
          part = indices[start:start + self.batch_size]
          for i, text in zip(part, self._generate([prompts[i] for i in part], setting, start)):
            results[i] = text
            self.cache_hook.add_partial("generate_until", requests[i].args, text)
          progress.update(len(part))
    progress.close()
    return results

  def _generation(self, gen_kwargs: Any) -> Generation:
    """`generation_settings` with the tokenizer's end-of-document text as a stop string, checked against
    max_length."""
    setting = generation_settings(gen_kwargs, self.max_gen_toks)
    if setting.max_gen_toks >= self.max_length:
      raise ValueError(f"max_gen_toks={setting.max_gen_toks} leaves no room for a context in max_length="
                       f"{self.max_length}; raise max_length or lower the task's max_gen_toks.")
    if self.tokenizer.eos_id is not None:
      until = handle_stop_sequences(list(setting.until), eos=self.tok_decode([self.tokenizer.eos_id]))
      setting = setting._replace(until=tuple(until))
    return setting

  def _generate(self, prompts: list[list[int]], setting: Generation, batch_index: int) -> list[str]:
    """Texts generated after `prompts`, each cut at its first stop string."""
    tokens_BxP, lengths_B = _left_padded(prompts, self.batch_size, _bucket(len(prompts[0]), self.max_length))
    # Stop strings of one token, and the end-of-document token, end a row's decoding early.
    stop_tokens = {self.tokenizer.eos_id} - {None}
    for stop in setting.until:
      ids = self.tok_encode(stop)
      if len(ids) == 1 and self.tok_decode(ids) == stop:
        stop_tokens.add(ids[0])
    out = self.sampler.generate(self.model, tokens_BxP, lengths_B, max_new_tokens=setting.max_gen_toks,
                                key=jax.random.fold_in(jax.random.key(self.seed), batch_index),
                                temperature=setting.temperature, top_k=setting.top_k, top_p=setting.top_p,
                                stop_tokens=sorted(stop_tokens), prefill_mode=self.mode)
    texts = []
    for row, length in zip(out.tokens[:len(prompts)], out.lengths[:len(prompts)]):
      ids = row[:length]
      if length and self.tokenizer.eos_id is not None and int(ids[-1]) == self.tokenizer.eos_id:
        ids = ids[:-1]
      text = self.tok_decode(ids)
      for stop in setting.until:
        text = text.split(stop, 1)[0]
      texts.append(text)
    return texts


def results_json(results: dict[str, Any]) -> str:
  """The harness's results as one line of valid JSON: objects it holds (task functions) as text, non-finite
  numbers as null."""
  return metrics.to_json(json.loads(json.dumps(results, default=harness_utils.handle_non_serializable)))
