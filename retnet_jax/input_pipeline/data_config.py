"""The `data` section of a config, typed (with its synthetic tasks' subsections), checking its own fields when built.

    data = DataConfig.of(config.data, "data")
    data.files, data.synthetic, data.mqar.num_pairs

What the data needs from other sections (a synthetic task's vocabulary and lengths against the model and
`train.seq_len`) is checked where the whole config is built (`synthetic.check_config`, by
`training.run_config.check_across`); what it needs from the files, when they are read.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from retnet_jax.core import config_checks, sections
from retnet_jax.input_pipeline import passkey

SYNTHETIC_TASKS = ("mqar", "passkey")  # data.synthetic: `synthetic.SOURCES`
QUERY_PLACEMENTS = ("power", "uniform", "packed")  # data.mqar.query_placement
TEXT_FIELDS = ("files", "validation_files", "hub_dataset", "prepared")  # what names text data
PATH_FIELDS = ("files", "validation_files", "prepared")  # a path or several: a tuple once the section is built
field = sections.field


def as_tuple(files: str | Sequence[str] | None) -> tuple[str, ...]:
  """A path field's value as a tuple: a single path given as a string (`--config.data.files=a.txt`, or an older
  config.json) counts as one file (or directory); None as none."""
  if not files:
    return ()
  return (files,) if isinstance(files, str) else tuple(files)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MqarConfig(sections.Section):
  """`config.data.mqar`: multi-query associative recall (Zoology)."""
  vocab_size: int | None = field("keys [1, V/2), values [V/2, V); None: model.vocab_size")
  num_pairs: int = field("key-value pairs per example, each queried once")
  query_placement: str = field("power: Zoology's slot weights s^(power_a - 1) | uniform | packed: right after the "
                               "pairs")
  power_a: float = field("the exponent of power placement (Zoology: 0.01; 1 is uniform)")

  def __post_init__(self):
    config_checks.positive_int(self.num_pairs, "data.mqar.num_pairs")
    config_checks.choice(self.query_placement, "data.mqar.query_placement", QUERY_PLACEMENTS)
    if not 0 < self.power_a < math.inf:
      raise ValueError(f"data.mqar.power_a must be positive and finite (slot s drawn with weight s^(power_a - 1)); "
                       f"got {self.power_a}. Zoology uses 0.01; 1 is uniform.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PasskeyConfig(sections.Section):
  """`config.data.passkey`: a key hidden in filler text, asked for at the end (`input_pipeline.passkey`)."""
  depth: float | None = field("fraction of the filler before the key; None: uniform per example")
  digits: int = field("digits of the key")

  def __post_init__(self):
    if self.depth is not None and not 0 <= self.depth <= 1:
      raise ValueError(f"data.passkey.depth={self.depth} must lie in [0, 1] (the fraction of the filler before the "
                       "key), or be unset for a uniform depth per example.")
    config_checks.positive_int(self.digits, "data.passkey.digits")
    if self.digits > passkey.MAX_DIGITS:
      raise ValueError(f"data.passkey.digits={self.digits} exceeds {passkey.MAX_DIGITS}: keys are drawn as 64-bit "
                       f"integers; use {passkey.MAX_DIGITS} digits or fewer.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig(sections.Section):
  """`config.data`: where the tokens come from (files, prepared corpora, a hub dataset or a synthetic task)."""
  files: tuple[str, ...] = field("local .txt / .jsonl / .json / .parquet files; empty: the shipped corpus "
                                 "data/tinyshakespeare.txt")
  prepared: tuple[str, ...] = field("corpora prepared by scripts/prepare_data.py (folders), read through Grain "
                                    "instead of files")
  prepared_weights: tuple[float, ...] = field("the prepared corpora's mixing weights; empty: in proportion to "
                                              "their training tokens")
  hub_dataset: str | None = field("a datasets hub name (needs network), instead of files")
  hub_config: str | None = field("the hub dataset's configuration name")
  text_field: str = field("the column holding text in JSON lines / Parquet / hub datasets")
  tokenizer: str = field("byte | path to a tokenizers tokenizer.json")
  validation_files: tuple[str, ...] = field("explicit validation files; empty: hold out the last "
                                            "validation_fraction")
  validation_fraction: float = field("the share of the stream held out for validation")
  reset_at_documents: bool = field("packed documents: batches carry each token's document id and retention "
                                   "(attention) resets where a document (a .txt file, a JSON-lines / Parquet / hub "
                                   "dataset row; a synthetic task's row) starts")
  synthetic: str | None = field("a synthetic task instead of text, the loss on its answers only: None | mqar | "
                                "passkey")
  mqar: MqarConfig = field("the mqar task's knobs")
  passkey: PasskeyConfig = field("the passkey task's knobs")

  def __post_init__(self):
    for name in PATH_FIELDS:  # typed as tuples whatever the user's config held
      object.__setattr__(self, name, as_tuple(getattr(self, name)))
    if self.prepared:
      self._check_prepared(self.prepared)
    if not self.validation_files and not 0 < self.validation_fraction < 1:
      raise ValueError(f"data.validation_fraction must lie strictly between 0 and 1; got {self.validation_fraction}. "
                       "Set it to e.g. 0.1, or give data.validation_files.")
    if self.synthetic is None:
      return
    config_checks.choice(self.synthetic, "data.synthetic", SYNTHETIC_TASKS,
                         otherwise=", or leave it unset for text data")
    for name in TEXT_FIELDS:
      if getattr(self, name):
        raise ValueError(f"data.{name}={getattr(self, name)!r} is text data, unused by data.synthetic="
                         f"{self.synthetic!r} (the task makes its own examples); drop it, or unset data.synthetic "
                         "to train on the text.")
    if self.synthetic == "mqar" and self.tokenizer != "byte":
      raise ValueError(f"data.tokenizer={self.tokenizer!r} is unused by data.synthetic='mqar' (its examples are "
                       "token ids, data.mqar.vocab_size of them); drop it, or train on text or passkey.")

  def _check_prepared(self, paths: tuple[str, ...]) -> None:
    """Refuses an empty entry of `paths` (`data.prepared`), weights that do not fit the corpora, and text fields
    beside them."""
    for i, path in enumerate(paths):
      if not str(path).strip():  # Path('') is the current directory
        where = f"data.prepared[{i}]" if len(paths) > 1 else "data.prepared"
        raise ValueError(f"{where} is empty (data.prepared={self.prepared!r}); give the --out directory of "
                         "scripts/prepare_data.py, or unset data.prepared to train on data.files.")
    weights = tuple(self.prepared_weights or ())
    if weights and len(weights) != len(paths):
      raise ValueError(f"data.prepared_weights={weights} gives {len(weights)} weights for {len(paths)} prepared "
                       "corpora; give one weight per directory of data.prepared, or none (in proportion to tokens).")
    if any(not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0 for w in weights):
      raise ValueError(f"data.prepared_weights={weights}: every weight must be a positive number; fix or drop it.")
    for name, value in (("files", self.files), ("hub_dataset", self.hub_dataset),
                        ("validation_files", self.validation_files)):
      if value:
        raise ValueError(f"data.prepared and data.{name} are both set; a prepared corpus holds its own splits: drop "
                         f"data.{name} (or data.prepared to read the files directly).")
