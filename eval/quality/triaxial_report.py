"""The TriAxialKV report: tables from the calibration file, the eval grids and the
decode bench, written to one markdown file (nothing is measured here).

    python -m eval.quality.triaxial_report \\
        --calibration jaxkv/assets/embedded-agent/triaxial.json \\
        --grid eval/results/triaxial/grid/results.csv \\
        --sweep eval/results/triaxial/sweep/results.csv \\
        --bench eval/results/triaxial/bench_quant_decode.md \\
        --out eval/results/triaxial/README.md

Tables: accuracy of every KV precision at the calibrated budget per task with
average bits, KV bytes per token (scales and zero points included) and capacity
against bf16; the goal of issue #17 checked row by row; the budget sweep on the
evaluation set and on the calibration set; the calibrated tag table of each
variant; the attention-output error per format on captured K/V; the decode bench.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from eval.quality.harness import stored_bits_of
from jaxkv.markdown import md_table

GOAL_POINTS, GOAL_BITS, GOAL_CAPACITY, GOAL_KIVI = 1.0, 2.7, 4.5, 3.0


def read_csv(path):
    with open(path) as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k in ("accuracy", "avg_bits", "kv_bytes_per_token", "n"):
            r[k] = float(r[k])
        if r.get("stored_bits") not in (None, ""):
            r["stored_bits"] = float(r["stored_bits"])
        else:
            r.pop("stored_bits", None)
    return rows


def precision_table(rows, task, budget=None):
    """Rows of one task at the calibrated budget (a triaxial mode's ``-`` is it)."""
    rows = [r for r in rows if r["task"] == task and r["method"] == "full"]
    none = next(r for r in rows if r["kv_quant"] == "none")
    table = []
    for r in rows:
        B = budget if r["kv_bits"] == "-" and r["kv_quant"].startswith("triaxial") else r["kv_bits"]
        table.append(
            [
                r["kv_quant"],
                B,
                f"{r['n']:.0f}",
                f"{100 * r['accuracy']:.1f}%",
                f"{100 * (r['accuracy'] - none['accuracy']):+.1f}",
                f"{r['avg_bits']:.2f}",
                f"{stored_bits_of(r, none):.2f}",
                f"{r['kv_bytes_per_token']:.0f}",
                f"{none['kv_bytes_per_token'] / r['kv_bytes_per_token']:.2f}x",
            ]
        )
    header = [
        "kv_quant",
        "B",
        "n",
        "accuracy",
        "Δ vs full precision (points)",
        "code bits",
        "stored bits",
        "KV bytes / token",
        "capacity vs bf16",
    ]
    return md_table(header, table, align="ll" + "r" * 7), {r["kv_quant"]: r for r in rows}, none


def goal_lines(by, none, task):
    tri, kivi = by.get("triaxial"), by.get("kivi2")
    if tri is None:
        return [f"- {task}: no triaxial cell"]
    loss = 100 * (none["accuracy"] - tri["accuracy"])
    cap = none["kv_bytes_per_token"] / tri["kv_bytes_per_token"]
    lines = [
        f"- {task}: triaxial loses {loss:+.1f} points (goal <= {GOAL_POINTS:.0f}): **{'met' if loss <= GOAL_POINTS else 'not met'}**; "
        f"{stored_bits_of(tri, none):.2f} stored bits (goal <= {GOAL_BITS}): **{'met' if stored_bits_of(tri, none) <= GOAL_BITS else 'not met'}**; "
        f"{cap:.2f}x capacity vs bf16 (goal >= {GOAL_CAPACITY}x): **{'met' if cap >= GOAL_CAPACITY else 'not met'}**."
    ]
    if kivi is not None:
        kloss = 100 * (none["accuracy"] - kivi["accuracy"])
        ratio = kloss / loss if loss > 0 else float("inf")
        met = kloss >= GOAL_KIVI * max(loss, 0) and kloss > 0
        lines.append(
            f"- {task}: kivi2 loses {kloss:+.1f} points, {'∞' if ratio == float('inf') else f'{ratio:.1f}x'} triaxial's loss "
            f"(goal >= {GOAL_KIVI:.0f}x): **{'met' if met else 'not met'}**."
        )
    return lines


def sweep_table(rows, none_by_task, same_as):
    """One row per (budget, mode); ``same_as[B]`` lists the budgets whose triaxial
    allocation is the same as B's (identical serving)."""
    tasks = sorted({r["task"] for r in rows})
    header = ["B (same allocation as)", "kv_quant"] + [
        f"{t} {what}" for t in tasks for what in ("accuracy", "Δ", "stored bits", "capacity")
    ]
    table = []
    keys = sorted({(float(r["kv_bits"]), r["kv_quant"]) for r in rows if r["kv_bits"] != "-"})
    for b, mode in keys:
        cells = []
        for t in tasks:
            r = next(
                (r for r in rows if r["task"] == t and r["kv_quant"] == mode and r["kv_bits"] != "-" and float(r["kv_bits"]) == b), None
            )
            n = none_by_task[t]
            if r is None:
                cells += ["", "", "", ""]
                continue
            cells += [
                f"{100 * r['accuracy']:.1f}%",
                f"{100 * (r['accuracy'] - n['accuracy']):+.1f}",
                f"{stored_bits_of(r, n):.2f}",
                f"{n['kv_bytes_per_token'] / r['kv_bytes_per_token']:.2f}x",
            ]
        label = f"{b:.1f}" + (
            f" ({', '.join(f'{x:.1f}' for x in same_as.get(b, []) if x != b)})"
            if mode == "triaxial" and len(same_as.get(b, [])) > 1
            else ""
        )
        table.append([label, mode, *cells])
    return md_table(header, table, align="ll" + "r" * (4 * len(tasks)))


def calibration_tables(cal):
    out = []
    B = cal["budget"]
    for name, v in cal["variants"].items():
        out += [
            f"**{name}** (axes: {', '.join(v['axes'])}; bits at B = {B}):",
            "",
            md_table(
                ["tag", "N", "D(2)", "D(4)", "bits"],
                [
                    [t["name"].replace("|", "\\|"), f"{t['N']:.0f}", f"{t['D2']:.3g}", f"{t['D4']:.3g}", v["bits"][t["name"]]]
                    for t in v["tags"]
                ],
                align="lrrrr",
            ),
            "",
        ]
    sweep = cal.get("sweep") or []
    if sweep:
        tasks = [t for t in cal["calibration"]["tasks"]]
        full = cal["full_precision"]
        out += [
            f"Calibration sweep ({cal['calibration']['n_per_task']} conversations per task; full precision "
            f"{100 * full['accuracy']:.1f}% pooled, " + ", ".join(f"{t} {100 * full[t]:.1f}%" for t in tasks) + "):",
            "",
            md_table(
                ["B", "pooled accuracy", *tasks, "code bits (served)"],
                [
                    [f"{r['B']:.1f}", f"{100 * r['accuracy']:.1f}%", *(f"{100 * r[t]:.1f}%" for t in tasks), f"{r['avg_bits']:.2f}"]
                    for r in sweep
                ],
                align="r" * (len(tasks) + 3),
            ),
        ]
        met = [r for r in sweep if full["accuracy"] - r["accuracy"] <= 0.01]
        verdict = (
            ""
            if met
            else (
                f"; no budget met it, even B = {max(r['B'] for r in sweep)} (uniform INT4 on this model), "
                "so the largest budget is the fallback"
            )
        )
        out += ["", f"Calibrated B = **{B}** ({cal['criterion']}{verdict}).", ""]
    return "\n".join(out)


def attention_table(cal):
    err = cal["attention_error"]
    L = len(next(iter(err.values()))["all_rows_per_layer"])
    return md_table(
        ["format", "all rows (mean)", "last row (mean)", *(f"last row, layer {i}" for i in range(L))],
        [[fmt, f"{e['all_rows']:.3f}", f"{e['last_row']:.3f}", *(f"{x:.3f}" for x in e["last_row_per_layer"])] for fmt, e in err.items()],
        align="l" + "r" * (L + 2),
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", default="jaxkv/assets/embedded-agent/triaxial.json")
    ap.add_argument("--grid", default="eval/results/triaxial/grid/results.csv")
    ap.add_argument("--sweep", default="eval/results/triaxial/sweep/results.csv")
    ap.add_argument("--bench", default="eval/results/triaxial/bench_quant_decode.md")
    ap.add_argument("--out", default="eval/results/triaxial/README.md")
    args = ap.parse_args(argv)
    cal = json.loads(Path(args.calibration).read_text())
    grid = read_csv(args.grid)
    md = [
        "# TriAxialKV on the embedded model",
        "",
        "Generated by `python -m eval.quality.triaxial_report` from the files it names; the commands that made them are in",
        "`docs/triaxial.md`.",
        "",
    ]
    none_by_task, goals = {}, []
    for task in sorted({r["task"] for r in grid}):
        table, by, none = precision_table(grid, task, cal["budget"])
        none_by_task[task] = none
        md += [f"## {task}: KV precision at the calibrated B = {cal['budget']}", "", table, ""]
        goals += goal_lines(by, none, task)
    md += ["## Goal of issue #17", ""] + goals + [""]
    if Path(args.sweep).exists():
        from jaxkv.policies.quant_allocation import load_allocation

        alloc = load_allocation(args.calibration, "triaxial")
        groups: dict = {}
        for r in cal.get("sweep", []):
            groups.setdefault(tuple(alloc.table(r["B"]).tolist()), []).append(r["B"])
        same_as = {b: bs for bs in groups.values() for b in bs}
        calibrated = [dict(r, kv_bits=str(cal["budget"])) for r in grid if r["kv_quant"] == "triaxial" and r["kv_bits"] == "-"]
        md += [
            "## Budget sweep on the evaluation set (triaxial)",
            "",
            "Budgets that give the same triaxial allocation serve identically; each group ran once, at the budget "
            f"listed first (the others in brackets). B = {cal['budget']} is the calibrated cell of the table above.",
            "",
            sweep_table(read_csv(args.sweep) + calibrated, none_by_task, same_as),
            "",
        ]
    md += [
        "## Calibration",
        "",
        calibration_tables(cal),
        "",
        "## Attention-output error per format on K/V captured from the embedded model",
        "",
        "Relative error ||o' - o|| / ||o|| of the attention output with the format applied to the calibration "
        "requests' K/V (every query row, and the last row as a decode step), mean over requests:",
        "",
        attention_table(cal),
        "",
    ]
    if Path(args.bench).exists():
        md += ["## CPU decode speed, quantized vs float pool", "", Path(args.bench).read_text(), ""]
    Path(args.out).write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
