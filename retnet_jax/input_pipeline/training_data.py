"""The batches a training run reads: its train batches, resumable from a saved position, and its validation
batches; packed text through Grain, or a synthetic task's rows.

    batches, valid_batches = training_data.open_batches(config, tokenizer, batch_sharding)
    next(batches)        # a global batch (`losses.Batch`), placed with `batch_sharding`
    for batch in valid_batches(): ...   # the `train.eval_batches` validation batches, the same each call
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax

from retnet_jax.input_pipeline import global_batches, loader, synthetic, tokenizer as tokenizer_lib


def open_batches(config: Any, tokenizer: tokenizer_lib.Tokenizer | None, batch_sharding: jax.sharding.NamedSharding
                 ) -> tuple[loader.PreparedBatches | synthetic.SyntheticBatches, Callable[[], Iterable[Any]]]:
  """The training batches of the run config `config`, and a function giving its `train.eval_batches` validation
  batches: packed text read through Grain (from `data.prepared`, or the cached corpus of the files, tokenized by
  `tokenizer`), or the synthetic task's `(tokens, loss weights)` with `data.synthetic`, each with document ids with
  `data.reset_at_documents`. Fails here if either cannot be made."""
  train_cfg, reset = config.train, config.data.reset_at_documents
  eval_batch, num_eval = train_cfg.batch_size // train_cfg.grad_accum_steps, train_cfg.eval_batches
  if config.data.synthetic:
    valid_rows = synthetic.ValidationRows(config, eval_batch, num_eval)
    batches = synthetic.SyntheticBatches(config, train_cfg.batch_size, batch_sharding)
    too_few = {}  # the task makes every row asked for
  else:
    corpora = loader.open_corpora(config.data, tokenizer)
    valid_rows = loader.validation_rows(corpora, train_cfg.seq_len, reset)
    batches = loader.PreparedBatches(corpora, train_cfg.seq_len, train_cfg.batch_size, config.seed, batch_sharding,
                                     config.data.prepared_weights, reset)
    too_few = dict(holds=f"the prepared validation split holds {len(valid_rows)} sequences", batch=str(eval_batch),
                   fix="use a smaller batch size or seq_len, or prepare more validation data")
  global_batches.eval_batches(valid_rows, eval_batch, 1, **too_few)  # enough to evaluate?
  return batches, lambda: global_batches.eval_batches(valid_rows, eval_batch, num_eval, batch_sharding, **too_few)
