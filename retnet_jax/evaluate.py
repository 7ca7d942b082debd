"""Evaluation of a trained model: loss, perplexity, bits per token and per byte, in one or all forms.

    model, step = restore_model(config, workdir)  # latest checkpoint, on the devices present
    results = evaluate_model(model, config, modes=("parallel", "chunkwise", "recurrent"))
"""

from __future__ import annotations

import math
from typing import Any

import ml_collections
import numpy as np
from flax import nnx

from retnet_jax import architectures, data, losses, sharding
from retnet_jax.train_state import restore_model  # noqa: F401  (evaluate.restore_model: the documented entry)

# Largest relative difference of the forms' mean losses: float32 sums in another order differ by ~1e-6
# relative; bfloat16 rounds each product to 8 mantissa bits.
MODE_AGREEMENT_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}


def count_bytes(tokenizer: data.Tokenizer, targets_NxL: np.ndarray) -> int:
  """UTF-8 bytes the target tokens decode to (equal to the token count for the byte tokenizer)."""
  if isinstance(tokenizer, data.ByteTokenizer):
    return int(targets_NxL.size)
  return sum(len(tokenizer.decode(row).encode("utf-8")) for row in targets_NxL)


def evaluate_model(model: architectures.Model, config: ml_collections.ConfigDict, modes=("parallel",),
                   max_batches: int | None = None) -> dict[str, Any]:
  """Validation metrics of `model` per mode, and with several modes their largest differences.

  Args:
    model: a RetNet or Transformer (e.g. from `restore_model`).
    config: its config; `data` gives the validation split, `train.seq_len` and the micro-batch the batches.
    modes: forms to evaluate, of `architectures.modes(config.model)`.
    max_batches: evaluate this many batches spread over the split (`data.eval_rows`); None: all.
  Returns:
    `{"tokens", "bytes", "sequences", "modes": {mode: {loss, perplexity, bits_per_token, bits_per_byte}}}`
    plus, for several modes, `max_loss_difference`, `max_logit_difference`, `tolerance`, `modes_agree`.
  """
  own = architectures.modes(config.model)
  unknown = [m for m in modes if m not in own]
  if unknown:
    raise ValueError(f"unknown mode {unknown[0]!r} for a {config.model.architecture}; choose one of {own} or all.")
  if max_batches is not None and max_batches < 1:
    raise ValueError(f"max_batches must be a positive number of batches (or None: all); got {max_batches}.")
  tokenizer = data.load_tokenizer(config.data.tokenizer)
  data.check_vocab_size(tokenizer, config.model.vocab_size)
  _, valid_tokens = data.load_splits(config.data, tokenizer)
  sequences = data.pack(valid_tokens, config.train.seq_len, "validation split")
  batch_size = config.train.batch_size // config.train.grad_accum_steps
  placement = sharding.placement(config.mesh)
  batches = list(data.eval_batches(sequences, batch_size, max_batches, placement.batch_sharding))
  targets = sequences[data.eval_rows(len(sequences), batch_size, max_batches).reshape(-1), 1:]
  num_sequences, num_tokens, num_bytes = len(targets), int(targets.size), count_bytes(tokenizer, targets)

  graphdef, params = nnx.split(model)
  results: dict[str, Any] = {"tokens": num_tokens, "bytes": num_bytes, "sequences": num_sequences, "modes": {}}
  per_mode_nll, per_mode_logits = {}, {}
  with placement.active():
    for mode in modes:
      outputs = [losses.sequence_nll(graphdef, params, batch, mode) for batch in batches]
      nll = np.concatenate([np.asarray(o[0], np.float64) for o in outputs])
      per_mode_nll[mode], per_mode_logits[mode] = nll, np.concatenate([np.asarray(o[1]) for o in outputs])
      loss = float(nll.sum() / num_tokens)
      results["modes"][mode] = {"loss": loss, "perplexity": math.exp(min(loss, 50.0)),
                                "bits_per_token": loss / math.log(2),
                                "bits_per_byte": float(nll.sum()) / math.log(2) / num_bytes}
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
  lines = [f"{'mode':<10} {'loss':>8} {'ppl':>8} {'bits/token':>11} {'bits/byte':>10}"]
  for mode, m in results["modes"].items():
    lines.append(f"{mode:<10} {m['loss']:>8.4f} {m['perplexity']:>8.3f} {m['bits_per_token']:>11.4f} "
                 f"{m['bits_per_byte']:>10.4f}")
  lines.append(f"{results['sequences']} sequences, {results['tokens']:,} tokens, {results['bytes']:,} bytes")
  if "modes_agree" in results:
    lines.append(f"largest difference between modes: loss {results['max_loss_difference']:.2e} "
                 f"(tolerance {results['tolerance']:.1e}), last-position logits "
                 f"{results['max_logit_difference']:.2e}: {'agree' if results['modes_agree'] else 'DISAGREE'}")
  return "\n".join(lines)
