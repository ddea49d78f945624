"""The one markdown table writer of jaxkv, its trainers (``train/``) and its evaluation (``eval/``).

    md_table(["method", "accuracy"], [["snapkv", "0.910"], ["h2o", "0.870"]], align="lr")

gives::

    | method | accuracy |
    |---|---:|
    | snapkv | 0.910 |
    | h2o | 0.870 |

Cells are written as given (``str`` of each): formatting numbers
is the caller's, since every report has its own digits. ``align`` has one letter per
column: ``l`` (``---``, the default) or ``r`` (``---:``). A row of the wrong width is
an error, not a shifted table.

It imports nothing and sits in the bottom layer of the package (``pyproject.toml``,
``[tool.importlinter]``), so every part of jaxkv may write its reports with it, and
``train/`` and ``eval/`` share it without ``train/`` importing ``eval/``.
"""

from __future__ import annotations

from typing import Iterable, Sequence

RULE = {"l": "---", "r": "---:"}


def md_row(cells: Sequence) -> str:
    """One table row: ``| a | b |``."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def md_table(header: Sequence, rows: Iterable[Sequence], align: str | None = None) -> str:
    """A GitHub markdown table of ``header`` and ``rows`` (module docstring)."""
    header = list(header)
    align = align if align is not None else "l" * len(header)
    if len(align) != len(header) or set(align) - set(RULE):
        raise ValueError(f"align needs one of {'/'.join(RULE)} per column: {len(header)} columns, got {align!r}")
    lines = [md_row(header), "|" + "".join(RULE[a] + "|" for a in align)]
    for row in rows:
        row = list(row)
        if len(row) != len(header):
            raise ValueError(f"a row of {len(row)} cells in a table of {len(header)} columns: {row}")
        lines.append(md_row(row))
    return "\n".join(lines)


def md_header(header: Sequence, align: str | None = None) -> list[str]:
    """A table's first two lines (its titles and alignment rule), for a writer that
    emits its rows one ``md_row`` at a time."""
    return md_table(header, [], align).split("\n")
