"""``jaxkv.markdown``: tables in the form its docstring shows, written at once or row by row;
a row or an alignment of the wrong width is refused."""

import pytest

from jaxkv.markdown import md_header, md_row, md_table


def test_the_one_table_writer():
    assert md_table(["method", "accuracy"], [["snapkv", "0.910"], ["h2o", ""]], align="lr") == (
        "| method | accuracy |\n|---|---:|\n| snapkv | 0.910 |\n| h2o |  |"
    )
    assert md_table(["a"], []) == "| a |\n|---|"
    with pytest.raises(ValueError, match="2 cells"):
        md_table(["a"], [["x", "y"]])
    with pytest.raises(ValueError, match="align"):
        md_table(["a", "b"], [], align="l")


def test_a_table_written_row_by_row_is_the_same_table():
    rows = [["snapkv", "0.910"], ["h2o", "0.870"]]
    assert "\n".join(md_header(["method", "accuracy"], "lr") + [md_row(r) for r in rows]) == md_table(
        ["method", "accuracy"], rows, align="lr"
    )
