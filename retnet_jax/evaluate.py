"""Evaluation of a trained checkpoint: loss, perplexity, bits per token and per byte, in one or all forms.

    model, step = restore_model(config, workdir)            # latest checkpoint, on the devices present
    results = evaluate_model(model, config, modes=("parallel", "chunkwise", "recurrent"))
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np
import optax
from flax import nnx

from retnet_jax import checkpointing, data, sharding, train
from retnet_jax.layers import MODES
from retnet_jax.model import RetNet

# The forms agree to rounding (tests/test_model.py): differently ordered float32 sums differ by ~1e-6
# relative; bfloat16 rounds each product to 8 mantissa bits. Mean losses must agree within these.
MODE_AGREEMENT_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}


def restore_model(config: ml_collections.ConfigDict, workdir: str | os.PathLike, step: int | None = None
                  ) -> tuple[RetNet, int]:
  """The model of `workdir` at `step` (None: the latest), placed on the current devices' mesh.

  Reads the training checkpoints (`checkpoints/STEP`), or, in a workdir that has none, the parameters-only
  export that training writes at its end (`params/STEP`), checked against the workdir's `config.json`.
  """
  workdir = Path(workdir)
  ckpt_dir, export_dir = workdir / "checkpoints", workdir / "params"
  has_checkpoints = ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir())
  exported = sorted(int(p.name) for p in export_dir.iterdir() if p.name.isdigit()) if export_dir.is_dir() else []
  if not has_checkpoints and not exported:
    raise FileNotFoundError(f"no checkpoints in {workdir} (expected {ckpt_dir} or {export_dir}); train first "
                            f"with scripts/train.py --workdir={workdir}, or point --workdir at a training run.")
  train.check_config(config, jax.device_count())
  mesh = sharding.make_mesh(config.mesh)
  run = train.setup(config, mesh)
  if has_checkpoints:
    with checkpointing.Checkpointer(ckpt_dir) as checkpointer:
      step, steps = checkpointer.resolve(step), checkpointer.all_steps()
      unreadable = lambda e: ValueError(f"checkpoint {step} in {ckpt_dir} is unreadable ({type(e).__name__}: {e}); "
                                        f"choose another with --step (available steps: {steps}).")
      try:
        saved_model = checkpointer.restore_meta(step)["config"]["model"]
      except Exception as e:  # orbax raises many kinds for a damaged step folder
        raise unreadable(e) from e
      train.check_compatible(saved_model, config, workdir)
      try:
        state, _ = checkpointer.restore(run.abstract_state, step)
      except checkpointing.IncompatibleCheckpointError:
        raise
      except Exception as e:
        raise unreadable(e) from e
    return nnx.merge(run.graphdef, state["params"]), int(state["step"])
  if step is None:
    step = exported[-1]
  elif step not in exported:
    raise ValueError(f"No exported params for step {step} in {export_dir} (and no {ckpt_dir}); "
                     f"available steps: {exported}.")
  config_file = workdir / "config.json"
  if config_file.is_file():
    train.check_compatible(json.loads(config_file.read_text())["model"], config, workdir)
  params = checkpointing.load_params(export_dir / str(step), run.abstract_state["params"])
  return nnx.merge(run.graphdef, params), step


@functools.partial(jax.jit, static_argnames=("graphdef", "mode"))
def _sequence_nll(graphdef, params, tokens_BxL1, mode):
  """Summed next-token negative log-likelihood per sequence `[B]` and the logits of the last position."""
  logits, _ = nnx.merge(graphdef, params)(tokens_BxL1[:, :-1], mode=mode)
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens_BxL1[:, 1:])
  return nll.sum(axis=-1), logits[:, -1]


def count_bytes(tokenizer: data.Tokenizer, targets_NxL: np.ndarray) -> int:
  """UTF-8 bytes the target tokens decode to (equal to the token count for the byte tokenizer)."""
  if isinstance(tokenizer, data.ByteTokenizer):
    return int(targets_NxL.size)
  return sum(len(tokenizer.decode(row).encode("utf-8")) for row in targets_NxL)


def evaluate_model(model: RetNet, config: ml_collections.ConfigDict, modes=("parallel",),
                   max_batches: int | None = None) -> dict[str, Any]:
  """Validation metrics of `model` per mode, and with several modes their largest differences.

  Returns `{"tokens", "bytes", "modes": {mode: {loss, perplexity, bits_per_token, bits_per_byte}}}` plus,
  for several modes, `max_loss_difference`, `max_logit_difference`, `tolerance` and `modes_agree`.
  """
  unknown = [m for m in modes if m not in MODES]
  if unknown:
    raise ValueError(f"unknown mode {unknown[0]!r}; choose one of {MODES} or all.")
  if max_batches is not None and max_batches < 1:
    raise ValueError(f"max_batches must be a positive number of batches (or None: all); got {max_batches}.")
  tokenizer = data.load_tokenizer(config.data.tokenizer)
  data.check_vocab_size(tokenizer, config.model.vocab_size)
  _, valid_tokens = data.load_splits(config.data, tokenizer)
  sequences = data.pack(valid_tokens, config.train.seq_len)
  batch_size = config.train.batch_size // config.train.grad_accum_steps
  mesh = sharding.make_mesh(config.mesh)
  rules = sharding.logical_rules(config.mesh)
  batch_sharding = sharding.batch_sharding(mesh, rules)
  batches = list(data.eval_batches(sequences, batch_size, max_batches, batch_sharding))
  num_sequences = len(batches) * batch_size
  targets = sequences[:num_sequences, 1:]
  num_tokens, num_bytes = int(targets.size), count_bytes(tokenizer, targets)

  graphdef, params = nnx.split(model)
  results: dict[str, Any] = {"tokens": num_tokens, "bytes": num_bytes, "sequences": num_sequences, "modes": {}}
  per_mode_nll, per_mode_logits = {}, {}
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    for mode in modes:
      outputs = [_sequence_nll(graphdef, params, batch, mode) for batch in batches]
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
