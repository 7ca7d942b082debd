"""Training and validation batches of prepared corpora (`retnet_jax.input_pipeline.prepared`), read through Grain: the
one loader of text, whether from `data.prepared` or from plain files through their cached corpus
(`retnet_jax.input_pipeline.corpus_cache`).

    corpora = open_corpora(config.data, tokenizer)  # checked: directories, tokenizer, weights, documents
    batches = PreparedBatches(corpora, seq_len, batch_size, seed, sharding, config.data.prepared_weights)
    tokens_BxL1 = next(batches)  # global jax.Array [batch, seq_len + 1]: inputs [:, :-1], targets [:, 1:]
    meta = batches.get_state()   # into the checkpoint: resume continues with the next batch, mid-epoch too
    valid = global_batches.eval_batches(validation_rows(corpora, seq_len, False), batch_size, max_batches, sharding)

The rows of every corpus are a Grain `MapDataset` over the memory-mapped shards, shuffled from the seed (another
order each epoch) and repeated; several corpora are mixed by `data.prepared_weights` (empty: in proportion to their
training tokens). Process p of P reads only the rows p, p + P, p + 2P, ... of that sequence: global batch b is rows
[bB, (b+1)B), each process holding B/P of them. Batches are read when asked for, without Grain's prefetch threads:
a batch takes microseconds per row and training dispatches steps ahead of the device, so reading overlaps its work;
on a 2-core CPU the threads slowed the steps by about 5% and the loader itself (docs/benchmarks.md, entry 29). Host
memory is a batch and the page cache, whatever the corpus's size.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import grain
from absl import logging
import jax

from retnet_jax.input_pipeline import corpus_cache, data, global_batches, packed_rows, prepared
from retnet_jax.input_pipeline.tokenizer import Tokenizer
from retnet_jax.input_pipeline.data_config import DataConfig



def open_corpora(data_cfg: DataConfig, tokenizer: Tokenizer) -> list[prepared.Corpus]:
  """The corpora of `data.prepared` (`DataConfig` checked their paths, weights and that no text field is set beside
  them); without it, the cached corpus of `data.files` (`corpus_cache`, built on first use). With
  `data.reset_at_documents`, a training split of one document is refused: nothing would reset."""
  paths = data_cfg.prepared
  if paths:
    corpora = [prepared.open_corpus(path, tokenizer, f"data.prepared[{i}]" if len(paths) > 1 else "data.prepared")
               for i, path in enumerate(paths)]
    source = f"data.prepared={data_cfg.prepared!r}"
  else:
    corpora = [corpus_cache.open_cached(data_cfg, tokenizer)]
    source = corpora[0].label
  if data_cfg.reset_at_documents and sum(c.metadata["documents"]["train"] for c in corpora) == 1:
    raise ValueError(f"data.reset_at_documents=True but {source} holds a single document (a .txt file is one, a "
                     "JSON-lines, Parquet or hub dataset row one each), so nothing would reset; give several files "
                     "or rows, or set data.reset_at_documents=False.")
  return corpora


def mixture_weights(corpora: Sequence[prepared.Corpus], weights: Sequence[float]) -> list[float]:
  """The sampling weights: as given, else each corpus's share of the training tokens."""
  return list(weights) if weights else [c.num_tokens("train") for c in corpora]


class PreparedBatches:
  """Endless global batches `[global_batch_size, seq_len + 1]` int32 from `corpora` (`open_corpora`), mixed by
  `weights` (empty: in proportion to their training tokens); with `documents` (`data.reset_at_documents`)
  `(tokens, None, document ids)`; placed by `sharding` (None: one host's array)."""

  def __init__(self, corpora: Sequence[prepared.Corpus], seq_len: int, global_batch_size: int, seed: int,
               sharding: jax.sharding.NamedSharding | None = None, weights: Sequence[float] = (),
               documents: bool = False):
    local = global_batches.process_rows(global_batch_size, jax.process_index(), jax.process_count())
    sources = [c.rows("train", seq_len, documents) for c in corpora]
    for corpus, rows in zip(corpora, sources):
      if not len(rows):
        raise ValueError(f"{corpus.label}: its training split holds {corpus.num_tokens('train')} tokens, too few for "
                         f"one sequence of train.seq_len + 1 = {seq_len + 1} tokens in any of its shards; use a "
                         "smaller train.seq_len or more data.")
      global_batches.check_one_batch(
          len(rows), global_batch_size, f"{corpus.label}: its training split holds {len(rows)} sequences of "
          f"train.seq_len + 1 = {seq_len + 1} tokens", f"train.batch_size={global_batch_size}",
          "use a smaller batch or seq_len, or more data")
    datasets = [grain.MapDataset.source(rows).shuffle(seed=seed + i).repeat() for i, rows in enumerate(sources)]
    mixed = (datasets[0] if len(datasets) == 1 else
             grain.MapDataset.mix(datasets, mixture_weights(corpora, weights)))
    per_process = mixed[jax.process_index()::jax.process_count()].batch(local.stop - local.start)
    self._dataset = per_process.to_iter_dataset(grain.ReadOptions(num_threads=0))
    self._iterator = iter(self._dataset)
    self._rows, self.global_batch_size, self.sharding = sources, global_batch_size, sharding

  def __iter__(self) -> Iterator[Any]:
    return self

  def __next__(self):
    local = next(self._iterator)  # Grain's batch of this process's rows: tokens, or (tokens, document ids)
    return global_batches.global_batch((local[0], None, local[1]) if isinstance(local, tuple) else local,
                             self.global_batch_size, self.sharding)

  def get_state(self) -> dict[str, Any]:
    """Grain's position of the next batch, for checkpoints."""
    return {"grain": self._iterator.get_state()}

  def set_state(self, state: dict[str, Any]) -> None:
    """Continues from a `get_state()` position (read back from a checkpoint). A position saved before batches came
    through Grain (epoch, index) continues after as many batches, in Grain's order."""
    if set(state) == {"epoch", "index"} and len(self._rows) == 1:
      consumed = int(state["epoch"]) * (len(self._rows[0]) // self.global_batch_size) + int(state["index"])
      logging.info(f"NOTE: the checkpoint's data position (epoch {state['epoch']}, batch {state['index']}) predates "
                   f"Grain's loader: training continues after {consumed} batches in Grain's order.")
      state = {"grain": {"next_index": consumed}}
    data.check_state_keys(state, ("grain",))
    saved = {key: int(value) for key, value in dict(state["grain"]).items()}
    self._iterator = iter(self._dataset)
    self._iterator.set_state(saved)


def validation_rows(corpora: Sequence[prepared.Corpus], seq_len: int, documents: bool) -> packed_rows.PackedRows:
  """Every corpus's validation split, one after another, as rows."""
  return packed_rows.PackedRows([shard for c in corpora for shard in c.shards["validation"]], seq_len, documents)
