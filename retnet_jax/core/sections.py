"""Typed config sections: frozen dataclasses that the user's config (the command line's ml_collections config, or a
workdir's config.json) is turned into once, each checking its own fields when it is built.

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class CheckpointConfig(sections.Section):
      every_steps: int = sections.field("steps between checkpoints")

      def __post_init__(self):
        config_checks.positive_int(self.every_steps, "checkpoint.every_steps")

    checkpoint = CheckpointConfig.of(config.checkpoint, "checkpoint")  # the user's section, a dict or a section

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
  """The base of the typed config sections (frozen dataclasses whose fields are `field`s).

  A subsection whose class sets `FLAT_PREFIX` (a string, maybe empty) groups fields that the user's config holds
  flat in the parent, named `FLAT_PREFIX + field` (a model's mixer sections: `model.attention_window` is
  `model.attention.window`); `of`, `to_dict`, `flat_names` and `reference` read and write them so.
  """

  FLAT_PREFIX: typing.ClassVar[str | None] = None

  @classmethod
  def names(cls) -> tuple[str, ...]:
    """The section's field names, in order."""
    return tuple(f.name for f in dataclasses.fields(cls))

  @classmethod
  def flat_names(cls) -> tuple[str, ...]:
    """The names the user's config gives the section's fields: flat subsections' fields in place, prefixed."""
    names = []
    for name in cls.names():
      section = subsection(cls, name)
      flat = section is not None and section.FLAT_PREFIX is not None
      names += [section.FLAT_PREFIX + inner for inner in section.names()] if flat else [name]
    return tuple(names)

  def flat_value(self, name: str) -> Any:
    """The value of the field the user's config names `name` (a flat subsection's `prefix + field` included)."""
    for field_name in self.names():
      section = subsection(type(self), field_name)
      if section is not None and section.FLAT_PREFIX is not None and name.startswith(section.FLAT_PREFIX):
        inner = name[len(section.FLAT_PREFIX):]
        if inner in section.names():
          return getattr(getattr(self, field_name), inner)
    return getattr(self, name)

  @classmethod
  def of(cls: type[S], values: Any, where: str) -> S:
    """The section of `values` (a mapping of every field: the user's config section, a dict of config.json; or a
    section, returned as it is), checked; ValueError naming `where`.field for a field missing or unknown."""
    if isinstance(values, cls):
      return values
    if not (isinstance(values, Mapping) or hasattr(values, "items")):
      raise TypeError(f"{where} must be a config section (its fields by name); got a {type(values).__name__}.")
    given = dict(values.items())
    names = cls.flat_names()
    unknown = sorted(set(given) - set(names))
    missing = [name for name in names if name not in given]
    if unknown or missing:
      raise ValueError(cls.misfit(where, unknown, missing))
    fields = {}
    for name in cls.names():
      section = subsection(cls, name)
      if section is not None and section.FLAT_PREFIX is not None:
        fields[name] = section.of({inner: given[section.FLAT_PREFIX + inner] for inner in section.names()}, where)
      else:
        fields[name] = section.of(given[name], f"{where}.{name}") if section else frozen(given[name])
    return cls(**fields)

  @classmethod
  def misfit(cls, where: str, unknown: list[str], missing: list[str]) -> str:
    """What `of` says of a mapping whose names are not the section's: the `unknown` ones, the `missing` ones."""
    verb = "is not a field" if len(unknown) == 1 else "are not fields"
    parts = [f"{', '.join(f'{where}.{k}' for k in unknown)} {verb}"] if unknown else []
    parts += [f"it lacks {', '.join(f'{where}.{k}' for k in missing)}"] if missing else []
    return (f"the {where} section does not fit its fields ({'; '.join(parts)}); take the section from a preset, "
            "e.g. --config=configs/retnet.py:small.")

  def to_dict(self) -> dict[str, Any]:
    """The fields by the names the user's config gives them, sections as dicts, flat subsections' fields in place
    (the layout of config.json and of a checkpoint's config)."""
    fields = {}
    for name in self.names():
      value = getattr(self, name)
      if isinstance(value, Section) and value.FLAT_PREFIX is not None:
        fields.update({value.FLAT_PREFIX + inner: item for inner, item in value.to_dict().items()})
      else:
        fields[name] = value.to_dict() if isinstance(value, Section) else value
    return fields

  def replace(self: S, **changes: Any) -> S:
    """A copy with `changes`, checked as any section is when built."""
    return dataclasses.replace(self, **{name: frozen(value) for name, value in changes.items()})

  @classmethod
  def reference(cls, where: str) -> list[tuple[str, str, str]]:
    """(dotted name, type, meaning) of every field, subsections' opened in place."""
    rows = []
    for f in dataclasses.fields(cls):
      section = subsection(cls, f.name)
      if section and section.FLAT_PREFIX is not None:
        rows += [(f"{where}.{section.FLAT_PREFIX}{name.rpartition('.')[2]}", kind, meaning)
                 for name, kind, meaning in section.reference(where)]
      elif section:
        rows += section.reference(f"{where}.{f.name}")
      else:
        rows.append((f"{where}.{f.name}", _type_name(_hints(cls)[f.name]), f.metadata.get("meaning", "")))
    return rows


def _type_name(hint: Any) -> str:
  """`hint` as written in an annotation: int, str | None, tuple[int, ...]."""
  if isinstance(hint, type) and not typing.get_args(hint):
    return hint.__name__
  return str(hint).replace("typing.", "").replace("NoneType", "None")
