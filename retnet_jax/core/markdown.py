"""Markdown tables: the one formatter of the tables the package, its benchmark and its scripts print or write.

    lines = markdown.table(["step", "GiB"], [["train", "1.25"], ["decode", "0.50"]], right=(1,))
    # ['| step | GiB |', '|---|---:|', '| train | 1.25 |', '| decode | 0.50 |']
"""

from __future__ import annotations

from typing import Any, Collection, Iterable, Sequence


def row(cells: Iterable[Any]) -> str:
  """One table line: each cell as `str` gives it, an empty one as a blank cell (`| a | | b |`)."""
  return "|" + "|".join(f" {text} " if (text := str(cell)) else " " for cell in cells) + "|"


def table(header: Sequence[str], rows: Iterable[Sequence[Any]], right: Collection[int] = ()) -> list[str]:
  """A Markdown table's lines (no newlines): the header, the separator, then one line per row.

  Args:
    header: the column names.
    rows: each row's cells, one per column, written as `str` gives them.
    right: the indices of the columns aligned right (`---:`, e.g. numbers); the others align left.

  Returns:
    The lines, for `"\\n".join`.
  """
  rows = [list(cells) for cells in rows]
  widths = {len(cells) for cells in rows} - {len(header)}
  if widths:
    raise ValueError(f"a row has {sorted(widths)} cells but the header {list(header)} has {len(header)}; give each "
                     "row one cell per column.")
  separator = "|" + "".join("---:|" if i in right else "---|" for i in range(len(header)))
  return [row(header), separator] + [row(cells) for cells in rows]
