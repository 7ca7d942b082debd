"""Text files -> token stream (with where documents start) -> packed sequences.

    tok = tokenizer.load(config.data.tokenizer, vocab_size=config.model.vocab_size)
    train, valid = load_documents(config.data, tok)  # Splits: int32 token streams and document starts
    sequences = pack(valid.tokens, seq_len)          # [num_sequences, seq_len + 1]: inputs [:, :-1], targets [:, 1:]
    batches = global_batches.eval_batches(global_batches.SequenceRows(sequences), batch_size, max_batches, sharding)

Training reads these splits through the cached prepared corpus (`retnet_jax.input_pipeline.corpus_cache`,
`retnet_jax.input_pipeline.loader`). With `data.reset_at_documents`, `pack_split` packs the per-token document ids
beside the tokens, and a batch is `(tokens, None, document ids)`, both `[batch, seq_len + 1]` (`losses.Batch`). A
separator (the tokenizer's eos_id) opens the document after it, so every target is predicted from its own document: the
separator from the document it ends, a document's first token from the separator alone, as from a BOS. Without a
separator (the byte tokenizer) a document's first token is predicted from the end of the previous one: that one target
crosses.

Files are read and tokenized with HF `datasets`. A synthetic task's batches (`data.synthetic`) come from
`retnet_jax.input_pipeline.synthetic` instead; every source's batches are placed by `global_batches`, and its
validation batches (`global_batches.EvalRows`: these sequences, a prepared corpus's rows, a synthetic task's) come
from the one `global_batches.eval_batches`.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging as logging_lib
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from absl import logging
from huggingface_hub.errors import HfHubHTTPError

from retnet_jax.core import config_checks
from retnet_jax.input_pipeline.tokenizer import Tokenizer
from retnet_jax.input_pipeline.data_config import DataConfig

DEFAULT_CORPUS = Path(__file__).resolve().parents[2] / "data" / "tinyshakespeare.txt"
# File suffix -> `datasets` builder that reads it.
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# A file below this size is read and tokenized in seconds at most (the shipped 1 MB corpus: under half a second), so
# the datasets library's progress bars (two per file) would only flash by: they are shown for larger files and hub
# datasets (downloads) alone.
QUIET_BELOW_BYTES = 16 * 2**20



def _quiet_read_errors(record: logging_lib.LogRecord) -> bool:
  """datasets logs each file it fails to read (twice: its handler and absl's) before raising; `unreadable` then
  names the file, the line and the fix in one line, so those records are dropped."""
  return not record.getMessage().startswith(("Failed to load JSON from file", "Failed to read schema from",
                                             "Failed to read file"))


for _reader in ("json.json", "parquet.parquet"):
  logging_lib.getLogger(f"datasets.packaged_modules.{_reader}").addFilter(_quiet_read_errors)


class Split(NamedTuple):
  """A token stream and where its documents start."""
  tokens: np.ndarray  # int32 [num_tokens]
  starts: np.ndarray  # int64 [num_documents]: each document's first token (the separator opening it), from 0


def load_documents(data_cfg: DataConfig, tokenizer: Tokenizer, one_document_ok: bool = False,
                   sources: tuple[TextSource, TextSource | None] | None = None) -> tuple[Split, Split]:
  """(train, valid) `Split`s from `config.data` (`one_document_ok`: whatever `reset_at_documents` says, as a corpus
  cached for any later run is).

  Sources: `sources`, else `text_sources(data_cfg)`. Validation: the `validation_files`, else the last
  `validation_fraction` of the stream (a fixed split, so it never overlaps training data; the document it cuts ends
  the training split and opens the validation split; `DataConfig` checked the fraction). With
  `reset_at_documents`, training data of one document is refused: nothing would reset.
  """
  fraction = data_cfg.validation_fraction
  train_source, valid_source = sources or text_sources(data_cfg)
  split = _read(train_source, tokenizer)
  if data_cfg.reset_at_documents and not one_document_ok and len(split.starts) == 1:
    raise ValueError(f"data.reset_at_documents=True but {train_source.label} holds a single document (a .txt file is "
                     "one, a JSON-lines, Parquet or hub dataset row one each), so nothing would reset; give several "
                     "files or rows, or set data.reset_at_documents=False.")

  if valid_source is not None:
    return split, _read(valid_source, tokenizer)
  tokens, starts = split
  num_valid = int(len(tokens) * fraction)
  if num_valid == 0 or num_valid == len(tokens):
    raise ValueError(f"data.validation_fraction={fraction} of {len(tokens)} tokens leaves an empty split; "
                     "use more data, another fraction, or data.validation_files.")
  cut = len(tokens) - num_valid
  return (Split(tokens[:-num_valid], starts[starts < cut]),
          Split(tokens[-num_valid:], np.concatenate([[0], starts[starts > cut] - cut])))


def document_ids(split: Split) -> np.ndarray:
  """int32 `[num_tokens]`: each token's document, counted from 0 along the stream."""
  opens = np.zeros(len(split.tokens), np.int32)
  opens[split.starts[1:]] = 1
  return np.cumsum(opens, dtype=np.int32)


def pack_split(split: Split, seq_len: int, name: str, reset_at_documents: bool
               ) -> tuple[np.ndarray, np.ndarray | None]:
  """`pack` of the split's tokens and, with `reset_at_documents`, of its document ids (else None) alike."""
  sequences = pack(split.tokens, seq_len, name)
  return sequences, pack(document_ids(split), seq_len, name) if reset_at_documents else None


class TextSource(NamedTuple):
  """A text source that `config.data` names (`text_sources`): local files, a hub dataset or the shipped corpus."""
  kind: str  # "files", "hub" or "shipped"
  files: tuple[str, ...]  # the files, glob patterns expanded and checked (`expand_files`); () for a hub dataset
  hub_dataset: str | None
  hub_config: str | None
  text_field: str  # the field holding a row's text (`document_texts`)
  label: str  # how messages name it: "data.files", "data.hub_dataset='NAME'", "the shipped corpus (data.files empty)"

  def names(self) -> list[str]:
    """The files, or `hub:NAME[/CONFIG]`: the sources a prepared corpus records."""
    return list(self.files) or [f"hub:{self.hub_dataset}" + (f"/{self.hub_config}" if self.hub_config else "")]


def text_sources(data_cfg: DataConfig) -> tuple[TextSource, TextSource | None]:
  """(the training source, the validation files or None) of `config.data`, for training, evaluation and preparing.

  The training source is `data.files`, else `data.hub_dataset`, else the shipped corpus. Files are expanded and
  checked here (`expand_files`); a missing shipped corpus is a FileNotFoundError naming the fix.
  """
  files, validation, field = data_cfg.files, data_cfg.validation_files, data_cfg.text_field
  if files:
    train = TextSource("files", tuple(expand_files(files, "data.files")), None, None, field, "data.files")
  elif data_cfg.hub_dataset:
    train = TextSource("hub", (), data_cfg.hub_dataset, data_cfg.hub_config, field,
                       f"data.hub_dataset={data_cfg.hub_dataset!r}")
  else:
    if not DEFAULT_CORPUS.is_file():
      raise FileNotFoundError(f"the shipped corpus {DEFAULT_CORPUS} is missing (data/ is not installed with "
                              "the package); set data.files to your own text files or run from the repository.")
    label = "the shipped corpus (data.files empty)"
    train = TextSource("shipped", tuple(expand_files((str(DEFAULT_CORPUS),), label)), None, None, field, label)
  if not validation:
    return train, None
  return train, TextSource("files", tuple(expand_files(validation, "data.validation_files")), None, None, field,
                           "data.validation_files")


def document_texts(rows: Mapping[str, Sequence[Any]], field: str, where: str) -> list[str]:
  """The texts of a batch of rows (columns by name; a JSON-lines, JSON, Parquet or hub dataset row is one document):
  each row's `field`, "" where it is null. Both readers take their texts here: `load_documents` and `sources.Stream`.

  Raises:
    ValueError naming `where`, the fields and the fix when the rows have no `field` or it holds other than text.
  """
  if field not in rows:
    raise ValueError(f"{where} has no field {field!r} (fields: {sorted(rows)}); set data.text_field to the field "
                     "holding the text.")
  texts = ["" if text is None else text for text in rows[field]]
  wrong = next((text for text in texts if not isinstance(text, str)), None)
  if wrong is not None:
    raise ValueError(f"{where}: field {field!r} holds {type(wrong).__name__}, not text; set data.text_field to the "
                     "field holding the text.")
  return texts


def expand_files(files: Sequence[str], source: str) -> list[str]:
  """The paths, each glob pattern (`*`, `?`, `[`) replaced by the files it matches, sorted; each checked to be a
  non-empty file of a readable type (ValueError / FileNotFoundError naming it and the fix)."""
  expanded = []
  for file in files:
    if any(c in file for c in "*?["):
      matches = sorted(glob.glob(file))
      if not matches:
        raise FileNotFoundError(f"{source}: the pattern {file!r} matches no file; check it.")
      expanded += matches
    else:
      expanded.append(file)
  for file in expanded:
    path = Path(file)
    if path.is_dir():
      raise ValueError(f"{source}: {file!r} is a directory; list the files in it (e.g. a tuple of paths).")
    if not path.is_file():
      raise FileNotFoundError(f"{source}: {file!r} does not exist; check the path.")
    if path.suffix.lower() not in BUILDERS:
      raise ValueError(f"{source}: {file!r} has unsupported type {path.suffix!r}; "
                       f"use one of {tuple(BUILDERS)}.")
    if path.stat().st_size == 0:
      raise ValueError(f"{source}: {file!r} is empty; remove it or add text.")
  return expanded


def unreadable(source: str, file: str, error: BaseException) -> ValueError:
  """One line for a file of `source` that datasets could not read: the file, for JSON lines the first line that is
  not a JSON object (Arrow's row numbers count within a block), the parser's words and the fix."""
  builder = BUILDERS[Path(file).suffix.lower()]
  detail = " ".join(str(error.__cause__ or error).split())[:300]
  if builder == "json":
    bad = _first_bad_json_line(file)
    if bad is not None:
      line, why = bad
      return ValueError(f"{source}: {file!r} line {line} is not a JSON object ({why}); a JSON-lines file holds one "
                        "object per line: fix or remove that line.")
    return ValueError(f"{source}: {file!r} could not be read as JSON lines ({detail}); give one JSON object per line "
                      "(or a .txt file for plain text).")
  if builder == "parquet":
    return ValueError(f"{source}: {file!r} is not a readable Parquet file ({detail}); give a Parquet file, or a "
                      "file named by its format (.jsonl, .txt).")
  return ValueError(f"{source}: {file!r} could not be read as text ({detail}); check the file.")


def _first_bad_json_line(file: str) -> tuple[int, str] | None:
  """(line number from 1, why) of the first non-blank line of `file` that is not a JSON object, read line by line;
  None when every one is, or when the file is one JSON array (a .json file datasets reads another way)."""
  with open(file, encoding="utf-8", errors="replace") as lines:
    for number, line in enumerate(lines, 1):
      if not line.strip():
        continue
      if number == 1 and line.lstrip().startswith("[") and Path(file).suffix.lower() == ".json":
        return None
      try:
        value = json.loads(line)
      except ValueError as e:
        return number, f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
      if not isinstance(value, dict):
        return number, f"a {type(value).__name__}"
  return None


def _read(source: TextSource, tokenizer: Tokenizer) -> Split:
  """Token stream of `source`: its files in order, or its hub dataset's train split (downloaded into the usual HF
  cache); the files' datasets cache lives in a temporary directory."""
  if source.kind == "hub":
    return _read_hub(source, tokenizer)
  splits = []
  with tempfile.TemporaryDirectory(prefix="retnet_jax_data_") as cache_dir:
    for file in source.files:
      builder = BUILDERS[Path(file).suffix.lower()]
      options = dict(sample_by="document") if builder == "text" else {}  # a .txt file is one document
      field = "text" if builder == "text" else source.text_field
      with _progress_bars_hidden(Path(file).stat().st_size < QUIET_BELOW_BYTES):
        try:
          dataset = datasets.load_dataset(builder, data_files=str(file), split="train", cache_dir=cache_dir,
                                          keep_in_memory=True, **options)
        except (datasets.exceptions.DatasetGenerationError, pa.ArrowException) as e:
          raise unreadable(source.label, file, e) from None
        split = _tokenize(dataset, field, tokenizer, f"{source.label}: {file!r}")
      if not len(split.tokens):
        raise ValueError(f"{source.label}: {file!r} holds no text in field {field!r}; remove it or add text.")
      splits.append(split)
  return _join(splits, tokenizer.eos_id)


@contextlib.contextmanager
def _progress_bars_hidden(hide: bool) -> Iterator[None]:
  """Within: the datasets library's progress bars off where `hide` (they are a process-wide setting, restored after),
  unless HF_DATASETS_DISABLE_PROGRESS_BARS is set: the user's choice wins."""
  if not hide or datasets.config.HF_DATASETS_DISABLE_PROGRESS_BARS is not None or \
      datasets.are_progress_bars_disabled():
    yield
    return
  datasets.disable_progress_bars()
  try:
    yield
  finally:
    datasets.enable_progress_bars()


def _read_hub(source: TextSource, tokenizer: Tokenizer) -> Split:
  """Token stream of a hub dataset's train split."""
  try:
    dataset = datasets.load_dataset(source.hub_dataset, source.hub_config, split="train")
  except (ConnectionError, TimeoutError, HfHubHTTPError) as e:
    raise ConnectionError(f"{source.label}: the Hugging Face hub could not be reached ({e}); "
                          "use local files with data.files instead.") from e
  except datasets.exceptions.DatasetNotFoundError as e:
    raise FileNotFoundError(f"{source.label} was not found on the hub ({e}); check the name and "
                            "data.hub_config, or use local files with data.files.") from e
  split = _tokenize(dataset, source.text_field, tokenizer, source.label)
  if not len(split.tokens):
    raise ValueError(f"{source.label} holds no text in field {source.text_field!r}; check data.text_field.")
  return split


def _tokenize(dataset: datasets.Dataset, field: str, tokenizer: Tokenizer, where: str) -> Split:
  """The dataset's documents (rows with text in `field`, `document_texts`) in order, joined by the tokenizer's
  eos_id; rows without text are skipped, counted in a warning."""
  eos = np.asarray([] if tokenizer.eos_id is None else [tokenizer.eos_id], dtype=np.int32)

  def encode(batch: Mapping[str, list[Any]]) -> dict[str, list[Any]]:
    texts = document_texts(batch, field, where)
    documents = tokenizer.encode_batch(texts)
    return {"ids": [np.concatenate([ids, eos]) if len(ids) else ids for ids in documents],  # empty: skipped
            "empty": [not text for text in texts]}

  encoded = dataset.map(encode, batched=True, remove_columns=dataset.column_names, keep_in_memory=True,
                        desc="Tokenizing").with_format("arrow")
  missing = int(pc.sum(encoded["empty"]).as_py() or 0)
  if missing:
    logging.warning(f"{where}: {missing} of {len(dataset)} rows have no text in field {field!r}; they are skipped.")
  column = encoded["ids"]
  stream = pc.list_flatten(column).to_numpy().astype(np.int32)
  lengths = pc.list_value_length(column).to_numpy()
  ends = np.cumsum(lengths[lengths > 0])  # each document's end, after its separator
  starts = np.concatenate([[0], ends[:-1] - len(eos)])  # a separator opens the next document
  # separators between documents, not after the last
  return Split(stream[:-1], starts) if len(eos) and len(stream) else Split(stream, starts)


def _join(splits: Sequence[Split], eos_id: int | None) -> Split:
  """Concatenation of splits, with `eos_id` between consecutive ones (opening the next) when the tokenizer has it."""
  streams, gap = [split.tokens for split in splits], int(eos_id is not None)
  offsets = np.cumsum([0] + [len(stream) + gap for stream in streams[:-1]])
  starts = [np.concatenate([[max(offset - gap, 0)], split.starts[1:] + offset])
            for split, offset in zip(splits, offsets)]
  if eos_id is not None:
    separator = np.asarray([eos_id], dtype=np.int32)
    streams = [part for stream in streams for part in (separator, stream)][1:]
  return Split(np.concatenate(streams), np.concatenate(starts))


def pack(tokens: np.ndarray, seq_len: int, split: str = "data") -> np.ndarray:
  """`[num_sequences, seq_len + 1]`: consecutive non-overlapping windows; the trailing remainder is dropped.

  Each row holds inputs `[:-1]` and next-token targets `[1:]`; every token appears exactly once, in order.
  `split` names the tokens in errors (e.g. "validation split").
  """
  config_checks.positive_int(seq_len, "train.seq_len")
  tokens = np.asarray(tokens, dtype=np.int32).reshape(-1)
  num_sequences = len(tokens) // (seq_len + 1)
  if num_sequences == 0:
    raise ValueError(f"the {split} holds {len(tokens)} tokens, too few for one sequence of train.seq_len + 1 = "
                     f"{seq_len + 1} tokens; use a smaller train.seq_len or more data.")
  return tokens[:num_sequences * (seq_len + 1)].reshape(num_sequences, seq_len + 1)


def check_state_keys(state: dict[str, Any], keys: tuple[str, ...]) -> None:
  """Refuses a saved iterator position whose keys are not `keys` (one written by another kind of data source)."""
  if set(state) != set(keys):
    raise ValueError(f"data iterator state {dict(state)} was saved by another kind of data source (text data "
                     "saves Grain's position, earlier runs epoch and index, a synthetic task the batch index); set "
                     "data.synthetic as in the run that wrote the checkpoint, or use another --workdir.")
