"""Evaluation of a trained model: loss, perplexity, bits per token and per byte (or a synthetic task's answer
loss and accuracy), in one or all forms, and the loss per position bucket at any length (the length-extrapolation
curve).

    model, step = train_state.restore_model(config, workdir)  # latest checkpoint, on the devices present
    results = evaluate_model(model, config, modes=architectures.modes(config.model))
    results = evaluate_model(model, config, modes=("chunkwise",), seq_len=4096, position_buckets=16)
    plot_loss_by_position(results, "loss_by_position.png", train_seq_len=config.train.seq_len)

A RetNet's chunkwise and recurrent forms (and a hybrid's whose attention layers are windowed) evaluate long
sequences block by block with the state carried (`streaming`, `streamed_nll`): memory is one block's at any length.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from retnet_jax.core import dispatch, segments, sharding, whole_files
from retnet_jax.evaluation import sampling_checks
from retnet_jax.hardware import accelerators
from retnet_jax.input_pipeline import data, global_batches, loader, synthetic, tokenizer as tokenizer_lib
from retnet_jax.input_pipeline.data_config import DataConfig
from retnet_jax.models import architectures, model as model_lib, streaming
from retnet_jax.models.model_config import ModelConfig
from retnet_jax.training import losses, run_config

# Largest relative difference of the forms' mean losses: float32 sums in another order differ by ~1e-6
# relative; bfloat16 rounds each product to 8 mantissa bits.
MODE_AGREEMENT_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}


def count_bytes(tokenizer: tokenizer_lib.Tokenizer, targets_NxL: np.ndarray) -> int:
  """UTF-8 bytes the target tokens decode to (equal to the token count for the byte tokenizer)."""
  if isinstance(tokenizer, tokenizer_lib.ByteTokenizer):
    return int(targets_NxL.size)
  return sum(len(tokenizer.decode(row).encode("utf-8")) for row in targets_NxL)


def position_buckets_of(segment_ids_BxL1, buckets: int):
  """Each input's position bucket `[B, L]` (int32): its position within its document, in `buckets` equal buckets of
  the `L` positions."""
  width = (segment_ids_BxL1.shape[1] - 1) // buckets
  return segments.positions_in_document(segment_ids_BxL1[:, :-1]) // width


@functools.partial(jax.jit, static_argnames=("graphdef", "mode", "buckets"))
def bucket_nll(graphdef: nnx.GraphDef, params, batch: losses.Batch, mode: str, buckets: int
               ) -> tuple[jax.Array, jax.Array]:
  """Summed next-token NLL per sequence and position bucket `[B, buckets]` (float32; bucket k holds the inputs'
  positions `[k L / buckets, (k + 1) L / buckets)`, with segment ids their positions within their documents) and
  the logits of the last position `[B, V]`."""
  nll_BxL, logits = losses.batch_nll(graphdef, params, batch, mode)
  segment_ids_BxL1 = losses.split_batch(batch)[2]
  if segment_ids_BxL1 is None:
    return nll_BxL.reshape(nll_BxL.shape[0], buckets, -1).sum(axis=-1), logits[:, -1]
  rows_Bx1 = jnp.arange(nll_BxL.shape[0])[:, None]
  sums_BxK = jnp.zeros((nll_BxL.shape[0], buckets), jnp.float32)
  return sums_BxK.at[rows_Bx1, position_buckets_of(segment_ids_BxL1, buckets)].add(nll_BxL), logits[:, -1]


def streams(model_cfg: ModelConfig, mode: str, seq_len: int, block: int) -> bool:
  """Whether `evaluate_model` runs sequences of `seq_len` tokens in `mode` block by block (`streamed_nll`): the
  chunkwise and recurrent forms of a model whose state does not grow with the context (no KV cache holding it all),
  at lengths beyond one `block` (`streaming.check_block`'s; 0: never)."""
  return (mode in ("chunkwise", "recurrent") and architectures.cache_field(model_cfg) is None
          and 0 < block < seq_len)


@functools.partial(jax.jit, static_argnames=("graphdef", "mode", "buckets", "block"))
def streamed_nll(graphdef: nnx.GraphDef, params, batch: losses.Batch, mode: str, buckets: int, block: int
                 ) -> tuple[jax.Array, jax.Array]:
  """`bucket_nll` (or with `buckets` 0 `losses.sequence_nll`) computed block by block, the state carried: summed
  NLL per sequence `[B]` or per sequence and bucket `[B, buckets]` (float32, the blocks' sums added with a
  compensated sum) and the logits of the last position `[B, V]`, with the memory of one block of `block` tokens.
  Each block's positions come from the carried state (within documents: `segments.model_positions`)."""
  tokens_BxL1, _, segment_ids_BxL1 = losses.split_batch(batch)
  model = nnx.merge(graphdef, params)
  batch_size, length = tokens_BxL1.shape[0], tokens_BxL1.shape[1] - 1
  width = length // buckets if buckets else length
  rows_Bx1 = jnp.arange(batch_size)[:, None]

  def run(carry, start, size):
    state, sums_BxK, error_BxK, _ = carry
    state = streaming.enter_block(state, segment_ids_BxL1, start)
    tokens = streaming.columns(tokens_BxL1, start, size + 1)
    ids = streaming.columns(segment_ids_BxL1, start, size)
    positions_BxT = segments.model_positions(ids, state.position, size)
    logits, state = model(tokens[:, :-1], mode=mode, state=state, segment_ids=ids)
    nll_BxT = losses.token_nll(logits, tokens[:, 1:])
    block_BxK = jnp.zeros_like(sums_BxK).at[rows_Bx1, positions_BxT // width].add(nll_BxT)
    total_BxK = sums_BxK + block_BxK  # Knuth's two-sum: the rounding error of each addition kept apart
    rounded_BxK = total_BxK - sums_BxK
    error_BxK = error_BxK + ((sums_BxK - (total_BxK - rounded_BxK)) + (block_BxK - rounded_BxK))
    return state, total_BxK, error_BxK, logits[:, -1]

  sums = jnp.zeros((batch_size, max(buckets, 1)), jnp.float32)
  logits_BxV = jnp.zeros((batch_size, model.config.vocab_size), jnp.float32)
  _, sums, error, logits_BxV = streaming.fold(run, (model.init_state(batch_size), sums, sums, logits_BxV), length,
                                              block)
  sums = sums + error
  return (sums if buckets else sums[:, 0]), logits_BxV


def check_position_buckets(seq_len: int, buckets: int) -> None:
  """Refuses an evaluation length that is not a positive integer, or a bucket count that does not split it into
  equal buckets, naming the nearest count that does."""
  if seq_len < 1:
    raise ValueError(f"--eval_seq_len={seq_len} must be a positive number of tokens (default: train.seq_len).")
  if buckets < 0:
    raise ValueError(f"--by_position={buckets} must be a number of position buckets (0: off).")
  if buckets and seq_len % buckets:
    fits = min((d for d in range(1, seq_len + 1) if seq_len % d == 0), key=lambda d: (abs(d - buckets), d))
    raise ValueError(f"--by_position={buckets} buckets do not split the {seq_len} positions of --eval_seq_len into "
                     f"equal buckets; choose a bucket count that divides {seq_len} (e.g. {fits}), or another "
                     "--eval_seq_len.")


def check_request(config: run_config.Config | Any, modes, seq_len: int, position_buckets: int = 0,
                  block: int | None = None) -> None:
  """What `evaluate_model` checks before any work, for callers to check before restoring a model too: the config
  (`run_config.build`), the forms, the length and its buckets, the streamed forms' block, the mesh's split of
  sequences."""
  config = run_config.build(config)
  if isinstance(modes, str):
    raise ValueError(f"modes={modes!r} is one string; give a sequence of forms, e.g. ({modes!r},).")
  own = architectures.modes(config.model)
  unknown = [m for m in modes if m not in own]
  if unknown:
    raise ValueError(f"unknown mode {unknown[0]!r} for a {config.model.architecture}; choose one of {own} or all.")
  check_position_buckets(seq_len, position_buckets)
  streaming.check_block(config.model, block, "--eval_block")
  run_config.check_documents(config, modes, "--mode")
  architectures.check_mesh_split(config.model, config.mesh, jax.device_count(), seq_len, modes)
  if task := config.data.synthetic:
    if seq_len != config.train.seq_len or position_buckets:
      raise ValueError(f"--eval_seq_len and --by_position evaluate text; the synthetic task {task!r} "
                       "(data.synthetic) is evaluated at train.seq_len over its answers: drop those flags.")


@functools.partial(jax.jit, static_argnames=("graphdef", "mode"))
def answer_stats(graphdef: nnx.GraphDef, params, batch: losses.Batch, mode: str
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per sequence of a `(tokens [B, L + 1], weights [B, L][, segment ids])` batch: the weighted NLL sum `[B]`, the
  logits of the last position `[B, V]`, and the weighted count of targets whose logits' argmax is the target `[B]`."""
  tokens_BxL1, weights_BxL, _ = losses.split_batch(batch)
  nll_BxL, logits_BxLxV = losses.batch_nll(graphdef, params, batch, mode)
  targets_BxL = tokens_BxL1[:, 1:]
  nll_B = jnp.sum(nll_BxL * weights_BxL, axis=-1)
  hits_B = jnp.sum((jnp.argmax(logits_BxLxV, axis=-1) == targets_BxL) * weights_BxL, axis=-1)
  return nll_B, logits_BxLxV[:, -1], hits_B


def compile_mode(graphdef: nnx.GraphDef, params: Any, batch: losses.Batch, mode: str, task: str | None,
                 position_buckets: int, block: int) -> jax.stages.Compiled:
  """`evaluate_model`'s program for `mode` on batches shaped and placed like `batch`, compiled (called as
  `compiled(params, batch)`): `answer_stats` with a synthetic `task`, else `streamed_nll` by blocks of `block`
  tokens (0: whole sequences, `bucket_nll` or `losses.sequence_nll`)."""
  if task:
    return answer_stats.lower(graphdef, params, batch, mode).compile()
  if block:
    return streamed_nll.lower(graphdef, params, batch, mode, position_buckets, block).compile()
  if position_buckets:
    return bucket_nll.lower(graphdef, params, batch, mode, position_buckets).compile()
  return losses.sequence_nll.lower(graphdef, params, batch, mode).compile()


def check_memory(compiled: dict[str, jax.stages.Compiled], config: run_config.Config, seq_len: int, block: int,
                 devices: Iterable[jax.Device]) -> None:
  """Refuses, before any batch runs, a mode whose program (`compile_mode`) needs more memory than `devices` have
  (their limits; CPU devices: the host memory still available), by XLA's memory analysis (arguments, the parameters
  included, outputs and temporaries), naming the fixes: a form that runs block by block (`streams`), a smaller
  block, a shorter length, a smaller batch."""
  devices = list(devices)
  memory = sampling_checks.device_memory(devices)
  for mode, program in compiled.items():
    needed = accelerators.required_bytes(accelerators.memory_sizes(program)) * len(devices)
    if needed <= memory:
      continue
    fixes = []
    if not config.data.synthetic:
      if streams(config.model, mode, seq_len, block):
        fixes.append("a smaller --eval_block")
      elif others := [m for m in architectures.modes(config.model) if streams(config.model, m, seq_len, block)]:
        runs = "forms run" if len(others) > 1 else "form runs"
        fixes.append(f"--mode={others[0]} (the {' and '.join(others)} {runs} block by block)")
      fixes.append("a shorter --eval_seq_len")
    fixes.append("a smaller --config.train.batch_size")
    raise ValueError(f"the {mode} form at {seq_len} tokens per sequence needs about "
                     f"{sampling_checks.size_text(needed)} (XLA's memory analysis of its compiled program), more than "
                     f"the {sampling_checks.size_text(memory)} of {sampling_checks.memory_name(devices)}; use "
                     f"{', '.join(fixes[:-1])}{' or ' * (len(fixes) > 1)}{fixes[-1]}.")


def evaluate_model(model: model_lib.Model, config: run_config.Config | Any, modes=("parallel",),
                   max_batches: int | None = None, seq_len: int | None = None,
                   position_buckets: int = 0, block: int | None = None) -> dict[str, Any]:
  """Validation metrics of `model` per mode, and with several modes their largest differences.

  Args:
    model: a RetNet or Transformer (e.g. from `train_state.restore_model`).
    config: its config; `data` gives the validation split, `train.seq_len` and the micro-batch the batches.
    modes: forms to evaluate, of `architectures.modes(config.model)`. The parallel form holds `[L, L]` scores
      per head: at long `seq_len` evaluate the chunkwise or recurrent form, which run block by block (`streams`).
    max_batches: evaluate this many batches spread over the split (`global_batches.eval_rows`); None: all. With
      `data.synthetic`: the first batches of the task's validation stream; None: `train.eval_batches`.
    seq_len: tokens per validation sequence (None: `train.seq_len`); it may exceed the training length. Text only.
    position_buckets: 0, or a count K dividing `seq_len`: each mode also reports the mean loss of the positions
      `[k L / K, (k + 1) L / K)` of every sequence (position p predicts token p + 1 from tokens 0 to p). Text only.
      With `data.reset_at_documents`, positions within each document (its first token's is 0), and a bucket no
      input falls in is left out.
    block: tokens per block of the streamed forms (`streams`), a multiple of `model.chunk_size`
      (`streaming.check_block`); None: `streaming.DEFAULT_BLOCK` in whole chunks; 0: whole sequences at once.
  Returns:
    `{"seq_len", "tokens", "bytes", "sequences", "modes": {mode: {loss, perplexity, bits_per_token,
    bits_per_byte}}}` (a streamed mode's also `block`, its tokens per block) plus, for several modes,
    `max_loss_difference`, `max_logit_difference`, `tolerance`,
    `modes_agree`; with `position_buckets`, each mode's `loss_by_position`: a list of `{"start", "end", "loss",
    "tokens"}` (`tokens`: the inputs in the bucket).
    With `data.synthetic` (e.g. `mqar`): `{"task", "answers", "sequences", "modes": {mode: {loss, perplexity,
    bits_per_token, mqar_accuracy}}}`, the loss over the answers only and `TASK_accuracy` the fraction of answers
    whose logits' argmax is the answer (exact recall), plus the same agreement keys.
  """
  config = run_config.build(config)
  if max_batches is not None and max_batches < 1:
    raise ValueError(f"max_batches must be a positive number of batches (or None: all); got {max_batches}.")
  seq_len = config.train.seq_len if seq_len is None else seq_len
  check_request(config, modes, seq_len, position_buckets, block)
  task, batch_size = config.data.synthetic, config.train.batch_size // config.train.grad_accum_steps
  placement = sharding.placement(config.mesh)
  if task:
    valid_rows = synthetic.ValidationRows(config, batch_size, max_batches or config.train.eval_batches)
    batches = list(global_batches.eval_batches(valid_rows, batch_size, None, placement.batch_sharding))
    num_sequences, num_tokens = batch_size * len(batches), int(sum(float(batch[1].sum()) for batch in batches))
    results: dict[str, Any] = {"task": task, "answers": num_tokens, "sequences": num_sequences, "modes": {}}
  else:
    tokenizer = tokenizer_lib.load(config.data.tokenizer, vocab_size=config.model.vocab_size)
    reset = config.data.reset_at_documents
    corpora = loader.open_corpora(config.data, tokenizer)  # only the rows evaluated are read
    valid = loader.validation_rows(corpora, seq_len, reset)
    batches = list(global_batches.eval_batches(
        valid, batch_size, max_batches, placement.batch_sharding,
        holds=f"the validation split holds {sum(c.num_tokens('validation') for c in corpora)} tokens: {len(valid)} "
        f"sequences of --eval_seq_len + 1 = {seq_len + 1} tokens",
        batch=f"{batch_size} (train.batch_size / train.grad_accum_steps)", fix="use a shorter --eval_seq_len, a "
        "smaller --config.train.batch_size, or more validation data (--config.data.validation_files)"))
    # The evaluated rows, read back for their counts.
    sequences = np.concatenate([np.asarray(batch[0] if reset else batch) for batch in batches])
    ids = np.concatenate([np.asarray(batch[2]) for batch in batches]) if reset else None
    targets = sequences[:, 1:]
    if position_buckets:  # inputs per bucket: every sequence's `width`, or by positions within documents
      bucket_tokens = (np.full(position_buckets, len(sequences) * (seq_len // position_buckets)) if ids is None else
                       np.bincount(np.asarray(position_buckets_of(ids, position_buckets)).reshape(-1),
                                   minlength=position_buckets))
    num_sequences, num_tokens, num_bytes = len(targets), int(targets.size), count_bytes(tokenizer, targets)
    results = {"seq_len": seq_len, "tokens": num_tokens, "bytes": num_bytes, "sequences": num_sequences,
               "data": evaluated_data(config.data, sum(c.num_tokens("validation") for c in corpora)), "modes": {}}

  graphdef, params = nnx.split(model)
  per_mode_logits = {}
  with placement.active():
    block = streaming.check_block(config.model, block, "--eval_block")
    blocks = {mode: block if not task and streams(config.model, mode, seq_len, block) else 0 for mode in modes}
    compiled = {mode: compile_mode(graphdef, params, batches[0], mode, task, position_buckets, blocks[mode])
                for mode in modes}  # all before any runs: check_memory
    check_memory(compiled, config, seq_len, block, placement.mesh.devices.flat)
    for mode in modes:
      outputs = dispatch.host_map(lambda batch: compiled[mode](params, batch), batches)
      nll = np.concatenate([np.asarray(o[0], np.float64) for o in outputs])  # [N] or [N, buckets]
      per_mode_logits[mode] = np.concatenate([np.asarray(o[1]) for o in outputs])
      loss = float(nll.sum() / num_tokens)
      results["modes"][mode] = {"loss": loss, "perplexity": math.exp(min(loss, 50.0)),
                                "bits_per_token": loss / math.log(2), **({"block": block} if blocks[mode] else {})}
      if task:
        results["modes"][mode][f"{task}_accuracy"] = sum(float(o[2].sum()) for o in outputs) / num_tokens
      else:
        results["modes"][mode]["bits_per_byte"] = float(nll.sum()) / math.log(2) / num_bytes
      if position_buckets:
        width = seq_len // position_buckets
        results["modes"][mode]["loss_by_position"] = [
            {"start": k * width, "end": (k + 1) * width, "loss": float(total / count), "tokens": int(count)}
            for k, (total, count) in enumerate(zip(nll.sum(axis=0), bucket_tokens)) if count]
  if len(modes) > 1:
    first = modes[0]
    loss_diff = max(abs(results["modes"][m]["loss"] - results["modes"][first]["loss"]) for m in modes)
    logit_diff = max(float(np.abs(per_mode_logits[m] - per_mode_logits[first]).max()) for m in modes)
    tolerance = MODE_AGREEMENT_TOLERANCE[config.model.dtype] * max(results["modes"][first]["loss"], 1.0)
    results.update(max_loss_difference=loss_diff, max_logit_difference=logit_diff, tolerance=tolerance,
                   modes_agree=loss_diff <= tolerance)
  return results


def evaluated_data(data_cfg: DataConfig, split_tokens: int) -> dict[str, Any]:
  """What an evaluation of text read, for its results: the data section's sources that are set (files, validation
  files, prepared corpora, a hub dataset; none: the shipped corpus), the split and the tokens it holds."""
  sources = {field: list(paths) for field in ("files", "validation_files", "prepared")
             if (paths := getattr(data_cfg, field))}
  if data_cfg.hub_dataset:
    sources["hub_dataset"] = data_cfg.hub_dataset
  return {**(sources or {"shipped_corpus": f"data/{data.DEFAULT_CORPUS.name}"}), "split": "validation",
          "split_tokens": int(split_tokens)}


def format_table(results: dict[str, Any]) -> str:
  """A plain-text table of the per-mode metrics."""
  task = results.get("task")
  last, title = (f"{task}_accuracy", "accuracy") if task else ("bits_per_byte", "bits/byte")
  lines = [f"{'mode':<10} {'loss':>8} {'ppl':>8} {'bits/token':>11} {title:>10}"]
  for mode, m in results["modes"].items():
    lines.append(f"{mode:<10} {m['loss']:>8.4f} {m['perplexity']:>8.3f} {m['bits_per_token']:>11.4f} "
                 f"{m[last]:>10.4f}")
  lines.append(f"{results['sequences']} sequences of {task}, {results['answers']:,} answers" if task else
               f"{results['sequences']} sequences, {results['tokens']:,} tokens, {results['bytes']:,} bytes of the "
               f"validation split of {_sources(results['data'])}")
  if "modes_agree" in results:
    lines.append(f"largest difference between modes: loss {results['max_loss_difference']:.2e} "
                 f"(tolerance {results['tolerance']:.1e}), last-position logits "
                 f"{results['max_logit_difference']:.2e}: {'agree' if results['modes_agree'] else 'DISAGREE'}")
  by_position = {mode: m["loss_by_position"] for mode, m in results["modes"].items() if "loss_by_position" in m}
  if by_position:
    lines.append(f"loss by position ({results['seq_len']} tokens per sequence):")
    lines.append(f"{'positions':>15} " + " ".join(f"{mode:>10}" for mode in by_position))
    for k, bucket in enumerate(next(iter(by_position.values()))):
      lines.append(f"{bucket['start']}-{bucket['end']}".rjust(15) + " " +
                   " ".join(f"{buckets[k]['loss']:>10.4f}" for buckets in by_position.values()))
  return "\n".join(lines)


def _sources(data_: dict[str, Any]) -> str:
  """`evaluated_data`'s sources in a few words: "data.files=['a.txt'] (1,234 tokens in the split)"."""
  named = "; ".join(f"the shipped corpus {value}" if field == "shipped_corpus" else f"data.{field}={value}"
                    for field, value in data_.items() if field not in ("split", "split_tokens"))
  return f"{named} ({data_['split_tokens']:,} tokens in the split)"


def plot_loss_by_position(results: dict[str, Any], path: str | os.PathLike, train_seq_len: int | None = None) -> None:
  """Writes a PNG of each mode's loss against position (`evaluate_model` with `position_buckets`).

  Args:
    results: `evaluate_model`'s results (with `loss_by_position`), optionally with `step`.
    path: the PNG file.
    train_seq_len: the training length, marked when the evaluation runs past it.
  """
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel  (Agg canvas, no pyplot state)

  fig = Figure(figsize=(7, 4.5))
  ax = fig.subplots()
  for i, (mode, m) in enumerate(results["modes"].items()):
    buckets = m["loss_by_position"]
    ax.plot([(b["start"] + b["end"]) / 2 for b in buckets], [b["loss"] for b in buckets], label=mode,
            marker="os^"[i % 3], linestyle=("-", "--", ":")[i % 3], markersize=4)
  if train_seq_len is not None and train_seq_len < results["seq_len"]:
    ax.axvline(train_seq_len, color="gray", linestyle="-.", label=f"training length ({train_seq_len})")
  step = f" at step {results['step']}" if "step" in results else ""
  ax.set(xlabel="position (tokens of context)", ylabel="loss (nats per token)", xlim=(0, results["seq_len"]),
         title=f"Validation loss by position{step}, {results['sequences']} sequences of {results['seq_len']} tokens")
  ax.grid(True, alpha=0.3)
  ax.legend()
  fig.tight_layout()
  with whole_files.replacing(path) as png:  # a run killed while plotting leaves no half-written PNG
    fig.savefig(png, dpi=100)
