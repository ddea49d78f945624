"""The fifth head's table (issue #75): per trace length, the NLL increase over the
full cache of the rule, the shipped (fourth) head and the fifth head, and their
paired differences, from the harness journals in this folder.

    python eval/results/real_smollm2_intentkv/head_v5_1k4k/report.py

Folders: ``len<L>/`` holds the harness cells ``full``, ``intentkv_memory`` and
``intentkv`` with the fourth head in the asset folder; ``len<L>_v5/`` the cell
``intentkv`` with the fifth head (its ``full`` cell and references copied from
``len<L>/``, so ``--resume`` skipped it). Intervals: ``eval.common.stats``'s paired
percentile bootstrap over traces (2,000 resamples, seed 0)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[3]))

from eval.common.stats import bootstrap_ci
from eval.quality.harness import paired_nll_difference


def cells(folder: Path) -> dict:
    out = {}
    for line in (folder / "cells.jsonl").read_text().splitlines():
        rec = json.loads(line)
        row = rec["row"]
        out[(row["method"], str(row["budget"]))] = (rec["setup"], row)
    return out


def fid(row) -> list:
    per = row["per_example"]["fidelity"]
    if any(f is None for f in per):
        raise ValueError(f"{row['method']}: a replay did not complete")
    return per


def increase(per) -> tuple[float, float, float]:
    t = np.asarray([f["tokens"] for f in per], np.float64)
    d = np.asarray([f["dnll"] for f in per], np.float64)
    return bootstrap_ci(lambda d, t: d.sum(-1) / t.sum(-1), d, t)


def fmt(x):
    return f"{x[0]:+.3f} [{x[1]:+.3f}, {x[2]:+.3f}]"


def fmt4(x):
    return f"{x[0]:+.4f} [{x[1]:+.4f}, {x[2]:+.4f}]"


def head_row(old: dict, new: dict, budget: str, name: str):
    """The table row of one budget: the rule, the fourth head (``old``'s cells) and a
    new head (``new``'s ``intentkv`` cell, ``name``: "fifth", "sixth"), with the paired
    differences; and the new head's cell (None: not run). The new cell must replay the
    old one's setup against the same full cell."""
    full_setup, full = old[("full", "-")]
    rule, head4 = fid(old[("intentkv_memory", budget)][1]), fid(old[("intentkv", budget)][1])
    cell = new.get(("intentkv", budget))
    if cell is not None:
        assert cell[0] == old[("intentkv", budget)][0], f"the {name} head's cell must replay the same setup"
        assert new[("full", "-")][1]["per_example"] == full["per_example"], "the same full cell"
    head = fid(cell[1]) if cell else None
    cols = [
        f"{full_setup['length']} → {full['peak_request_tokens']:,.0f}",
        str(full["n"]),
        budget,
        fmt(increase(rule)),
        fmt(increase(head4)),
        fmt(increase(head)) if head else "not run",
        fmt(paired_nll_difference(head4, rule)),
        fmt(paired_nll_difference(head, rule)) if head else "-",
        fmt4(paired_nll_difference(head, head4)) if head else "-",
    ]
    return "| " + " | ".join(cols) + " |", cell


def main():
    lines = [
        "| length (embedded → rendered SmolLM2 tokens) | n | budget | rule `intentkv_memory` | fourth head (shipped before) | fifth head | fourth head − rule | fifth head − rule | fifth − fourth |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    walls = []
    for old_dir in sorted(HERE.glob("len*"), key=lambda p: int(p.name[3:].split("_")[0])):
        if not (old_dir / "cells.jsonl").is_file() or old_dir.name.endswith("_v5"):
            continue
        new_dir = old_dir.with_name(old_dir.name + "_v5")
        old, new = cells(old_dir), cells(new_dir) if (new_dir / "cells.jsonl").is_file() else {}
        for (method, budget), (setup, row) in sorted(old.items()):
            walls.append((old_dir.name, method, budget, row["wall_s"]))
        for (method, budget), (setup, row) in sorted(new.items()):
            if method != "full":
                walls.append((new_dir.name, method + " (fifth head)", budget, row["wall_s"]))
        budgets = sorted({b for m, b in old if m == "intentkv_memory"})
        for b in budgets:
            lines.append(head_row(old, new, b, "fifth")[0])
    lines += ["", "| folder | cell | budget | wall s |", "|---|---|---:|---:|"]
    lines += [f"| {d} | {m} | {b} | {w:,.0f} |" for d, m, b, w in walls]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
