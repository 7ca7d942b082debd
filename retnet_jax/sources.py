"""`config.data`'s sources as a stream of document texts, read as they are needed (for `prepared.write`).

A `.txt` file is one document; a JSON-lines, JSON or Parquet row, or a hub dataset row, is one document (its
`data.text_field`). Hub datasets are streamed, so a corpus larger than the disk can stop at `--max_tokens`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import datasets
import ml_collections
import pyarrow as pa

from retnet_jax import data


class Stream:
  """The texts of `files` (glob patterns expanded) or of a hub dataset, counting the characters read."""

  def __init__(self, files: Sequence[str], hub_dataset: str | None, hub_config: str | None, text_field: str,
               source: str):
    self.files = data.expand_files(files, source) if files else []
    self.hub_dataset, self.hub_config, self.text_field, self.source = hub_dataset, hub_config, text_field, source
    self.characters = 0

  @property
  def total_characters(self) -> int | None:
    """About how many characters the files hold (their bytes); None for a hub dataset."""
    return sum(Path(f).stat().st_size for f in self.files) if self.files else None

  def names(self) -> list[str]:
    return [str(f) for f in self.files] or [f"hub:{self.hub_dataset}" + (f"/{self.hub_config}" if self.hub_config
                                                                         else "")]

  def __iter__(self) -> Iterator[str]:
    if not self.files:
      yield from self._rows(datasets.load_dataset(self.hub_dataset, self.hub_config, split="train", streaming=True),
                            f"data.hub_dataset={self.hub_dataset!r}")
      return
    for file in self.files:
      builder = data.BUILDERS[Path(file).suffix.lower()]
      if builder == "text":
        text = Path(file).read_text(encoding="utf-8", errors="replace")
        self.characters += len(text)
        yield text
      else:
        try:
          yield from self._rows(datasets.load_dataset(builder, data_files=str(file), split="train", streaming=True),
                                f"{self.source}: {file!r}")
        except (datasets.exceptions.DatasetGenerationError, pa.ArrowException) as e:
          raise data.unreadable(self.source, file, e) from None

  def _rows(self, dataset: datasets.IterableDataset, where: str) -> Iterator[str]:
    for row in dataset:
      if self.text_field not in row:
        raise ValueError(f"{where} has no field {self.text_field!r} (fields: {sorted(row)}); set data.text_field "
                         "to the field holding the text.")
      text = row[self.text_field] or ""
      if not isinstance(text, str):
        raise ValueError(f"{where}: field {self.text_field!r} holds {type(text).__name__}, not text; set "
                         "data.text_field to the field holding the text.")
      self.characters += len(text)
      yield text


def of_config(data_cfg: ml_collections.ConfigDict) -> tuple[Stream, Stream | None]:
  """(training documents, validation documents or None to hold documents out) of `config.data`."""
  files, validation = data.as_tuple(data_cfg.files), data.as_tuple(data_cfg.validation_files)
  if not files and not data_cfg.hub_dataset:
    files = (str(data.DEFAULT_CORPUS),)
  train = Stream(files, data_cfg.hub_dataset, data_cfg.hub_config, data_cfg.text_field, "data.files")
  return train, (Stream(validation, None, None, data_cfg.text_field, "data.validation_files") if validation else None)
