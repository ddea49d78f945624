"""The sixth head's table (issue #75): per trace length, the NLL increase over the
full cache of the rule, the fourth head (shipped) and the sixth head, and their
paired differences, from the harness journals.

    python eval/results/real_smollm2_intentkv/head_v6_rows/report.py

Folders: ``../head_v5_1k4k/len<L>/`` holds the harness cells ``full``,
``intentkv_memory`` and ``intentkv`` with the fourth head in the asset folder;
``len<L>_v6/`` here the cell ``intentkv`` with the sixth head (its ``full`` cell's
journal line and references copied from ``../head_v5_1k4k/len<L>/``, so
``--resume`` skipped it). Intervals: ``eval.common.stats``'s paired percentile
bootstrap over traces (2,000 resamples, seed 0)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
V5 = HERE.parent / "head_v5_1k4k"
sys.path.insert(0, str(HERE.parents[3]))


def _head_v5_report():
    """``../head_v5_1k4k/report.py`` as a module: its journal readers and formats are
    this table's too (one copy of them)."""
    spec = importlib.util.spec_from_file_location("head_v5_report", V5 / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_V5_REPORT = _head_v5_report()
cells, head_row, fid, fmt = _V5_REPORT.cells, _V5_REPORT.head_row, _V5_REPORT.fid, _V5_REPORT.fmt
paired_nll_difference = _V5_REPORT.paired_nll_difference


def grid50_lines() -> list[str]:
    """The shipped head's grid: ``../cells.jsonl`` (50 held-out traces at 1,472
    embedded tokens, every method, the fourth head's ``intentkv``) against
    ``len1472_n50_v6/`` (the sixth head's ``intentkv`` on the same traces), with the
    sixth head against SnapKV, the best baseline there."""
    old, new = cells(HERE.parent), cells(HERE / "len1472_n50_v6")
    lines = [
        "| length (embedded → rendered SmolLM2 tokens) | n | budget | rule `intentkv_memory` | fourth head | sixth head | fourth head − rule | sixth head − rule | sixth − fourth | SnapKV | sixth − SnapKV |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in sorted({b for m, b in old if m == "intentkv_memory"}):
        line, cell6 = head_row(old, new, b, "sixth")
        snap = fid(old[("snapkv", b)][1])
        lines.append(line[:-1] + f"| {fmt(_V5_REPORT.increase(snap))} | {fmt(paired_nll_difference(fid(cell6[1]), snap))} |")
    return lines


def main():
    lines = [
        "| length (embedded → rendered SmolLM2 tokens) | n | budget | rule `intentkv_memory` | fourth head (shipped) | sixth head | fourth head − rule | sixth head − rule | sixth − fourth |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    kl = ["| tokens | budget | rule | fourth head | sixth head |", "|---|---:|---:|---:|---:|"]
    walls = []
    for L in (1000, 1472, 2600):
        old_dir, new_dir = V5 / f"len{L}", HERE / f"len{L}_v6"
        old = cells(old_dir)
        new = cells(new_dir) if (new_dir / "cells.jsonl").is_file() else {}
        full = old[("full", "-")][1]
        for (method, budget), (setup, row) in sorted(new.items()):
            if method != "full":
                walls.append((new_dir.name, method + " (sixth head)", budget, row["wall_s"]))
        for b in sorted({b for m, b in old if m == "intentkv_memory"}):
            line, cell6 = head_row(old, new, b, "sixth")
            lines.append(line)
            rule_row, head4_row, rendered = old[("intentkv_memory", b)][1], old[("intentkv", b)][1], full["peak_request_tokens"]
            kl.append(
                f"| ~{rendered:,.0f} | {b} | {rule_row['kl']:.3f} | {head4_row['kl']:.3f} | "
                + (f"{cell6[1]['kl']:.3f} |" if cell6 else "not run |")
            )
    lines += ["", "KL(full || managed) per token:", ""] + kl
    lines += ["", "| folder | cell | budget | wall s |", "|---|---|---:|---:|"]
    lines += [f"| {d} | {m} | {b} | {w:,.0f} |" for d, m, b, w in walls]
    if (HERE / "len1472_n50_v6" / "cells.jsonl").is_file():
        lines += ["", "The shipped head's grid, 50 held-out traces (`../cells.jsonl`, `len1472_n50_v6/`):", ""] + grid50_lines()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
