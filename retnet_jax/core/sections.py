"""Typed config sections: frozen dataclasses that the user's config (an `ml_collections.ConfigDict`, or a workdir's
config.json) is turned into once, each checking its own fields when it is built.

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class CheckpointConfig(sections.Section):
      every_steps: int = sections.field("steps between checkpoints")

      def __post_init__(self):
        config_checks.positive_int(self.every_steps, "checkpoint.every_steps")

    checkpoint = CheckpointConfig.of(config.checkpoint, "checkpoint")  # a ConfigDict, a dict or a section

A section's fields have no defaults: the presets (`models.presets.get_config`) hold every field's value, so a
section is always built from a whole config. Lists (as JSON stores tuples) become tuples, so every section is
hashable and compares by value.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

S = TypeVar("S", bound="Section")


def field(meaning: str) -> Any:
  """A section field with its `meaning`, shown in the config reference (docs/config.md)."""
  return dataclasses.field(metadata={"meaning": meaning})


def frozen(value: Any) -> Any:
  """`value` with every list (JSON's tuples) a tuple, recursively: hashable and equal to the config's tuples."""
  if isinstance(value, (list, tuple)):
    return tuple(frozen(item) for item in value)
  return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
  return typing.get_type_hints(cls)


def subsection(cls: type, name: str) -> type[Section] | None:
  """The Section class of field `name` of section class `cls`, or None where the field holds a value."""
  hint = _hints(cls)[name]
  return hint if isinstance(hint, type) and issubclass(hint, Section) else None


class Section:
  """The base of the typed config sections (frozen dataclasses whose fields are `field`s)."""

  @classmethod
  def names(cls) -> tuple[str, ...]:
    """The section's field names, in order."""
    return tuple(f.name for f in dataclasses.fields(cls))

  @classmethod
  def of(cls: type[S], values: Any, where: str) -> S:
    """The section of `values` (a mapping of every field: a ConfigDict's section, a dict of config.json; or a
    section, returned as it is), checked; ValueError naming `where`.field for a field missing or unknown."""
    if isinstance(values, cls):
      return values
    if not (isinstance(values, Mapping) or hasattr(values, "items")):
      raise TypeError(f"{where} must be a config section (its fields by name); got a {type(values).__name__}.")
    given = dict(values.items())
    names = cls.names()
    unknown = sorted(set(given) - set(names))
    missing = [name for name in names if name not in given]
    if unknown or missing:
      verb = "is not a field" if len(unknown) == 1 else "are not fields"
      parts = [f"{', '.join(f'{where}.{k}' for k in unknown)} {verb}"] if unknown else []
      parts += [f"it lacks {', '.join(f'{where}.{k}' for k in missing)}"] if missing else []
      raise ValueError(f"the {where} section does not fit its fields ({'; '.join(parts)}); take the section from a "
                       "preset, e.g. --config=configs/retnet.py:small.")
    fields = {}
    for name in names:
      section = subsection(cls, name)
      fields[name] = section.of(given[name], f"{where}.{name}") if section else frozen(given[name])
    return cls(**fields)

  def to_dict(self) -> dict[str, Any]:
    """The fields by name, sections as dicts (the layout of config.json and of a checkpoint's config)."""
    return {name: value.to_dict() if isinstance(value, Section) else value
            for name, value in ((n, getattr(self, n)) for n in self.names())}

  def replace(self: S, **changes: Any) -> S:
    """A copy with `changes`, checked as any section is when built."""
    return dataclasses.replace(self, **{name: frozen(value) for name, value in changes.items()})

  @classmethod
  def reference(cls, where: str) -> list[tuple[str, str, str]]:
    """(dotted name, type, meaning) of every field, subsections' opened in place."""
    rows = []
    for f in dataclasses.fields(cls):
      section = subsection(cls, f.name)
      if section:
        rows += section.reference(f"{where}.{f.name}")
      else:
        rows.append((f"{where}.{f.name}", _type_name(_hints(cls)[f.name]), f.metadata.get("meaning", "")))
    return rows


def _type_name(hint: Any) -> str:
  """`hint` as written in an annotation: int, str | None, tuple[int, ...]."""
  if isinstance(hint, type) and not typing.get_args(hint):
    return hint.__name__
  return str(hint).replace("typing.", "").replace("NoneType", "None")
