"""`config.data`'s sources as a stream of document texts, read as they are needed (for `prepared.write`).

A `.txt` file is one document; a JSON-lines, JSON or Parquet row, or a hub dataset row, is one document (its
`data.text_field`, `data.document_texts`). Hub datasets are streamed, so a corpus larger than the disk can stop at
`--max_tokens`. Which source `config.data` names is `data.text_sources`' choice, as for training.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import datasets
import pyarrow as pa

from retnet_jax.input_pipeline import data
from retnet_jax.input_pipeline.data_config import DataConfig

ROWS_PER_READ = 256  # rows of a JSON-lines, Parquet or hub dataset read at a time


class Stream:
  """The texts of a `data.TextSource` (its files in order, or its hub dataset's train split), counting the
  characters read."""

  def __init__(self, source: data.TextSource):
    self.source, self.characters = source, 0

  @property
  def total_characters(self) -> int | None:
    """About how many characters the files hold (their bytes); None for a hub dataset."""
    return sum(Path(f).stat().st_size for f in self.source.files) if self.source.files else None

  def names(self) -> list[str]:
    return self.source.names()

  def __iter__(self) -> Iterator[str]:
    source = self.source
    if source.kind == "hub":
      yield from self._rows(datasets.load_dataset(source.hub_dataset, source.hub_config, split="train",
                                                  streaming=True), source.label)
      return
    for file in source.files:
      builder = data.BUILDERS[Path(file).suffix.lower()]
      if builder == "text":
        text = Path(file).read_text(encoding="utf-8", errors="replace")
        self.characters += len(text)
        yield text
      else:
        try:
          yield from self._rows(datasets.load_dataset(builder, data_files=str(file), split="train", streaming=True),
                                f"{source.label}: {file!r}")
        except (datasets.exceptions.DatasetGenerationError, pa.ArrowException) as e:
          raise data.unreadable(source.label, file, e) from None

  def _rows(self, dataset: datasets.IterableDataset, where: str) -> Iterator[str]:
    for rows in dataset.iter(batch_size=ROWS_PER_READ):
      for text in data.document_texts(rows, self.source.text_field, where):
        self.characters += len(text)
        yield text


def of_config(data_cfg: DataConfig) -> tuple[Stream, Stream | None]:
  """(training documents, validation documents or None to hold documents out) of `config.data` (`data.text_sources`)."""
  train, validation = data.text_sources(data_cfg)
  return Stream(train), (Stream(validation) if validation is not None else None)
