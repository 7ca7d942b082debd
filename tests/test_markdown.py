"""The one Markdown table formatter (retnet_jax.core.markdown): header, separator, rows, alignment, blank cells."""

import pytest

from retnet_jax.core import markdown


def test_a_table_is_its_header_separator_and_rows():
  assert markdown.table(["step", "GiB", "fits"], [["train", 1.25, "yes"], ["decode", "0.50", "no"]]) == [
      "| step | GiB | fits |", "|---|---|---|", "| train | 1.25 | yes |", "| decode | 0.50 | no |"]


def test_right_aligned_columns_and_blank_cells():
  assert markdown.table(["name", "bytes", "rss"], [["a", "", 3]], right=(1, 2)) == [
      "| name | bytes | rss |", "|---|---:|---:|", "| a | | 3 |"]
  assert markdown.table(["only"], []) == ["| only |", "|---|"]


def test_a_row_of_another_width_is_refused():
  with pytest.raises(ValueError, match=r"a row has \[1\] cells but the header \['a', 'b'\] has 2; give each row one "
                                       r"cell per column"):
    markdown.table(["a", "b"], [["x", "y"], ["z"]])
