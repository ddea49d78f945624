"""JSON-lines journals: how a long run records finished work so that a rerun resumes.

A journal is a file of JSON records, one a line, each appended at once when a piece of
work finishes (an evaluation cell, a calibration request, a real-model example), so an
interrupted run loses only the work in flight. A run that resumes reads the records
back and skips what they hold; ``load_journal`` keeps only those written under the
same ``setup`` (a record of other examples or other settings is not reused).

Invariant: a line cut short by an interrupted write is skipped on reading, never an
error, so a journal is always readable.

The TriAxialKV calibration (``train.calibrate_triaxial``) and the evaluation scripts
(``eval/``) keep their journals with these functions.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_journal(path: Path):
    """The records of a JSON-lines journal, in order (none when it does not exist;
    a line cut short by an interrupted write is skipped)."""
    if not path.exists():
        return
    for line in path.read_text().splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue


def append_journal(path: Path, record: dict) -> None:
    """Append one record to a JSON-lines journal (one line, written at once)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def load_journal(path: Path, setup: dict) -> dict:
    """``{key: row}`` of the records in ``path`` written under the same ``setup``
    (other setups' lines are ignored: their examples differ)."""
    return {rec["key"]: rec["row"] for rec in read_journal(path) if rec.get("setup") == setup}
