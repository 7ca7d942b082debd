"""Evaluation of a trained model: loss, perplexity, bits per token and per byte (or a synthetic task's answer
loss and accuracy), in one or all forms.

    model, step = restore_model(config, workdir)  # latest checkpoint, on the devices present
    results = evaluate_model(model, config, modes=("parallel", "chunkwise", "recurrent"))
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from retnet_jax import data, losses, sharding
from retnet_jax.layers import MODES
from retnet_jax.model import RetNet
from retnet_jax.train_state import restore_model  # noqa: F401  (evaluate.restore_model: the documented entry)

# Largest relative difference of the forms' mean losses: float32 sums in another order differ by ~1e-6
# relative; bfloat16 rounds each product to 8 mantissa bits.
MODE_AGREEMENT_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}


def count_bytes(tokenizer: data.Tokenizer, targets_NxL: np.ndarray) -> int:
  """UTF-8 bytes the target tokens decode to (equal to the token count for the byte tokenizer)."""
  if isinstance(tokenizer, data.ByteTokenizer):
    return int(targets_NxL.size)
  return sum(len(tokenizer.decode(row).encode("utf-8")) for row in targets_NxL)


@functools.partial(jax.jit, static_argnames=("graphdef", "mode"))
def answer_stats(graphdef: nnx.GraphDef, params, batch: tuple[jax.Array, jax.Array], mode: str
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per sequence of a `(tokens [B, L + 1], weights [B, L])` batch: the weighted NLL sum `[B]`, the logits of the
  last position `[B, V]`, and the weighted count of targets whose logits' argmax is the target `[B]`."""
  tokens_BxL1, weights_BxL = batch
  logits_BxLxV, _ = nnx.merge(graphdef, params)(tokens_BxL1[:, :-1], mode=mode)
  targets_BxL = tokens_BxL1[:, 1:]
  nll_B = jnp.sum(losses.token_nll(logits_BxLxV, targets_BxL) * weights_BxL, axis=-1)
  hits_B = jnp.sum((jnp.argmax(logits_BxLxV, axis=-1) == targets_BxL) * weights_BxL, axis=-1)
  return nll_B, logits_BxLxV[:, -1], hits_B


def evaluate_model(model: RetNet, config: ml_collections.ConfigDict, modes=("parallel",),
                   max_batches: int | None = None) -> dict[str, Any]:
  """Validation metrics of `model` per mode, and with several modes their largest differences.

  Args:
    model: a RetNet (e.g. from `restore_model`).
    config: its config; `data` gives the validation split, `train.seq_len` and the micro-batch the batches.
    modes: retention forms to evaluate.
    max_batches: evaluate this many batches spread over the split (`data.eval_rows`); None: all. With
      `data.synthetic`: the first batches of the task's validation stream; None: `train.eval_batches`.
  Returns:
    `{"tokens", "bytes", "sequences", "modes": {mode: {loss, perplexity, bits_per_token, bits_per_byte}}}`
    plus, for several modes, `max_loss_difference`, `max_logit_difference`, `tolerance`, `modes_agree`.
    With `data.synthetic` (e.g. `mqar`): `{"task", "answers", "sequences", "modes": {mode: {loss, perplexity,
    bits_per_token, mqar_accuracy}}}`, the loss over the answers only and `TASK_accuracy` the fraction of answers
    whose logits' argmax is the answer (exact recall), plus the same agreement keys.
  """
  unknown = [m for m in modes if m not in MODES]
  if unknown:
    raise ValueError(f"unknown mode {unknown[0]!r}; choose one of {MODES} or all.")
  if max_batches is not None and max_batches < 1:
    raise ValueError(f"max_batches must be a positive number of batches (or None: all); got {max_batches}.")
  task, batch_size = config.data.synthetic, config.train.batch_size // config.train.grad_accum_steps
  placement = sharding.placement(config.mesh)
  if task:
    batches = list(data.synthetic_eval_batches(config, batch_size, max_batches or config.train.eval_batches,
                                               placement.batch_sharding))
    num_sequences, num_tokens = batch_size * len(batches), int(sum(float(weights.sum()) for _, weights in batches))
    results: dict[str, Any] = {"task": task, "answers": num_tokens, "sequences": num_sequences, "modes": {}}
  else:
    tokenizer = data.load_tokenizer(config.data.tokenizer)
    data.check_vocab_size(tokenizer, config.model.vocab_size)
    _, valid_tokens = data.load_splits(config.data, tokenizer)
    sequences = data.pack(valid_tokens, config.train.seq_len, "validation split")
    batches = list(data.eval_batches(sequences, batch_size, max_batches, placement.batch_sharding))
    targets = sequences[data.eval_rows(len(sequences), batch_size, max_batches).reshape(-1), 1:]
    num_sequences, num_tokens, num_bytes = len(targets), int(targets.size), count_bytes(tokenizer, targets)
    results = {"tokens": num_tokens, "bytes": num_bytes, "sequences": num_sequences, "modes": {}}

  graphdef, params = nnx.split(model)
  per_mode_nll, per_mode_logits = {}, {}
  with placement.active():
    for mode in modes:
      outputs = [(answer_stats if task else losses.sequence_nll)(graphdef, params, batch, mode) for batch in batches]
      nll = np.concatenate([np.asarray(o[0], np.float64) for o in outputs])
      per_mode_nll[mode], per_mode_logits[mode] = nll, np.concatenate([np.asarray(o[1]) for o in outputs])
      loss = float(nll.sum() / num_tokens)
      results["modes"][mode] = {"loss": loss, "perplexity": math.exp(min(loss, 50.0)),
                                "bits_per_token": loss / math.log(2)}
      if task:
        results["modes"][mode][f"{task}_accuracy"] = sum(float(o[2].sum()) for o in outputs) / num_tokens
      else:
        results["modes"][mode]["bits_per_byte"] = float(nll.sum()) / math.log(2) / num_bytes
  if len(modes) > 1:
    first = modes[0]
    loss_diff = max(abs(results["modes"][m]["loss"] - results["modes"][first]["loss"]) for m in modes)
    logit_diff = max(float(np.abs(per_mode_logits[m] - per_mode_logits[first]).max()) for m in modes)
    tolerance = MODE_AGREEMENT_TOLERANCE[config.model.dtype] * max(results["modes"][first]["loss"], 1.0)
    results.update(max_loss_difference=loss_diff, max_logit_difference=logit_diff, tolerance=tolerance,
                   modes_agree=loss_diff <= tolerance)
  return results


def format_table(results: dict[str, Any]) -> str:
  """A plain-text table of the per-mode metrics."""
  task = results.get("task")
  last, title = (f"{task}_accuracy", "accuracy") if task else ("bits_per_byte", "bits/byte")
  lines = [f"{'mode':<10} {'loss':>8} {'ppl':>8} {'bits/token':>11} {title:>10}"]
  for mode, m in results["modes"].items():
    lines.append(f"{mode:<10} {m['loss']:>8.4f} {m['perplexity']:>8.3f} {m['bits_per_token']:>11.4f} "
                 f"{m[last]:>10.4f}")
  lines.append(f"{results['sequences']} sequences of {task}, {results['answers']:,} answers" if task else
               f"{results['sequences']} sequences, {results['tokens']:,} tokens, {results['bytes']:,} bytes")
  if "modes_agree" in results:
    lines.append(f"largest difference between modes: loss {results['max_loss_difference']:.2e} "
                 f"(tolerance {results['tolerance']:.1e}), last-position logits "
                 f"{results['max_logit_difference']:.2e}: {'agree' if results['modes_agree'] else 'DISAGREE'}")
  return "\n".join(lines)
