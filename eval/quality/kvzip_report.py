"""Issue #75's side-by-side at one ratio: jaxkv's methods and kvpress 0.5.5's presses, KVzip on both sides, on the same examples.

What it is for: ``real_model_report`` reports one root's two sides over every
ratio; this round ran new cells into journals of their own (KVzip on both sides,
kvpress's issue-75 presses, the multi-question task, kvzip + RepairKV sessions)
while the older cells of the same examples stay where they were. This report reads
any number of journal folders per side and, for every task where KVzip ran on
either side, keeps only the examples both sides ran with the full cache (the
common seeds), and writes per task and setting:

* the full cache on each side first (the ceiling);
* every cell at ``--ratio`` on each side (jaxkv's branched cells, its session
  cells ``session:`` / ``repairkv{K}:`` / ``matched{K}:``, kvpress's presses) with
  its n, its teacher-forced and greedy accuracy (``lm``: NLL increase over the
  side's own full cache, nats per token, and KL) with 95% intervals, its mean
  seconds and, where it forwards tokens to score (KVzip's passes), its mean
  scoring tokens;
* the examples: the full cache's on both sides, narrowed to those KVzip ran
  (``--kvzip-cell``, ``kvzip`` by default, at R / ``KVzipPress@R``) where either side has it, so older cells of
  more examples are read on this round's; the best of a side is among the cells
  that ran every one of them;
* paired 95% intervals (``eval.common.stats.paired_gain``, bootstrap over
  examples) of jaxkv's best against kvpress's best, KVzip against KVzipPress, and
  every jaxkv cell against kvpress's best press; the best of a side is the
  branched cell (session cells excluded: another budget rule) with the best mean.

Invariants: nothing is recomputed; a cell's numbers come from the journals'
per-example records, restricted to the common seeds; the latest record of an
(example, setting, cell) wins (``real_model_report.verdicts``).

    python -m eval.quality.kvzip_report --ratio 0.5 \\
        --jaxkv eval/results/real_smollm2/jaxkv,eval/results/real_smollm2/kvzip_75/jaxkv \\
        --kvpress eval/results/real_smollm2/kvpress,eval/results/real_smollm2/kvzip_75/kvpress \\
        --out eval/results/real_smollm2/kvzip_75
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import numpy as np

from eval.common.stats import mean_ci, paired_gain
from eval.quality.real_model_report import journals, read, split_cell, verdicts

LM_TASKS = ("lm",)


def load(folders: list[Path]) -> dict:
    """``{(task, context, setting): {cell: {seed: record}}}`` over every folder's journals."""
    return verdicts([rec for folder in folders for path in journals(folder) if path.is_file() for rec in read(path)])


def per_seed(task: str, cells: dict) -> dict:
    """``{cell: {seed: (score, greedy)}}``: retrieval tasks their 0/1 (multiq: the mean
    over questions) teacher-forced and greedy verdicts, ``lm`` the NLL increase over
    the side's own full cache and the KL (lower is better)."""
    full = cells.get("full", {})
    out = {}
    for name, by_seed in cells.items():
        if task in LM_TASKS:
            out[name] = {s: (float(r["nll"]) - float(full[s]["nll"]), float(r.get("kl", 0.0))) for s, r in by_seed.items() if s in full}
        else:
            out[name] = {s: (float(r["tf_correct"]), float(r["gen_correct"])) for s, r in by_seed.items()}
    return out


def at_ratio(name: str, ratio: float) -> bool:
    """A cell at ``ratio``: branched (``method@ratio``) or a session cell (``kind:method@ratio``)."""
    return name != "full" and split_cell(name)[1] == ratio


def best(scores: dict, ratio: float, lower: bool, n: int) -> str | None:
    """The branched cell at ``ratio`` with the best mean score among those that ran
    all ``n`` examples (session cells excluded)."""
    cands = [
        (np.mean([v[0] for v in by.values()]), name)
        for name, by in scores.items()
        if at_ratio(name, ratio) and ":" not in name and len(by) == n
    ]
    if not cands:
        return None
    return (min if lower else max)(cands)[1]


def gain(a: dict, b: dict) -> tuple | None:
    """Paired gain of ``a`` over ``b`` (their first score) on their common seeds."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    g, lo, hi = paired_gain(np.array([a[s][0] for s in seeds]), np.array([b[s][0] for s in seeds]), np.ones(len(seeds)))
    return g, lo, hi, len(seeds)


def fmt(m, lo, hi, lower: bool) -> str:
    return f"{m:.3f} [{lo:.3f}, {hi:.3f}]" if lower else f"{100 * m:.0f} [{100 * lo:.0f}, {100 * hi:.0f}]"


def fmt_gain(res, lower: bool) -> str:
    if res is None:
        return "-"
    g, lo, hi, n = res
    if lower:
        return f"{g:+.3f} [{lo:+.3f}, {hi:+.3f}] (n {n})"
    return f"{100 * g:+.0f} [{100 * lo:+.0f}, {100 * hi:+.0f}] (n {n})"


def section(key: tuple, jx: dict, kp: dict, ratio: float, kvzip_cell: str = "kvzip") -> tuple[list[str], list[dict]]:
    """The markdown of one (task, context, setting) and its csv rows; ``kvzip_cell``
    names jaxkv's KVzip cell (``kvzip``, ``kvzip/shared``, ...) that sets this round's
    examples and stands against ``KVzipPress``."""
    task, context, setting = key
    lower = task in LM_TASKS
    jx_kvzip = f"{kvzip_cell}@{ratio:g}"
    common = set(jx.get("full", {})) & set(kp.get("full", {}))
    for side, cell in ((jx, jx_kvzip), (kp, f"KVzipPress@{ratio:g}")):
        if cell in side:  # this round's examples: those KVzip ran on
            common &= set(side[cell])
    common = sorted(common)
    sides = {"jaxkv": per_seed(task, jx), "kvpress": per_seed(task, kp)}
    sides = {side: {name: {s: v for s, v in by.items() if s in common} for name, by in cells.items()} for side, cells in sides.items()}
    best_kp = best(sides["kvpress"], ratio, lower, len(common))
    best_jx = best(sides["jaxkv"], ratio, lower, len(common))
    cols = ("NLL increase", "KL") if lower else ("teacher-forced %", "greedy %")
    lines = [
        f"## {task}, {context} tokens, question-{setting}, ratio {ratio:g}",
        "",
        f"{len(common)} examples both sides ran (with KVzip where either side has it); the best of a side is among the cells that ran all of them. kvpress's best press here: {best_kp or '-'}; jaxkv's best branched cell: {best_jx or '-'}.",
        "",
        f"| side | cell | n | {cols[0]} | {cols[1]} | against kvpress's best (paired) | mean s | scoring tokens |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    rows = []
    raw = {"jaxkv": jx, "kvpress": kp}
    for side in ("jaxkv", "kvpress"):
        names = ["full"] + sorted(n for n in sides[side] if at_ratio(n, ratio))
        for name in names:
            by = sides[side].get(name, {})
            if not by:
                continue
            a, b = np.array([v[0] for v in by.values()]), np.array([v[1] for v in by.values()])
            ca, cb = mean_ci(a), mean_ci(b)
            vs = gain(by, sides["kvpress"][best_kp]) if best_kp and name != "full" and (side, name) != ("kvpress", best_kp) else None
            recs = [raw[side][name][s] for s in by]
            secs = [float(r["seconds"]) for r in recs if "seconds" in r]
            scoring = [int(r["scoring_tokens"]) for r in recs if r.get("scoring_tokens")]
            mean_s = f"{np.mean(secs):.1f}" if secs else "-"
            mean_scoring = f"{np.mean(scoring):.0f}" if scoring else "-"
            lines.append(
                f"| {side} | {name} | {len(by)} | {fmt(*ca, lower)} | {fmt(*cb, lower)} | {fmt_gain(vs, lower)} | {mean_s} | {mean_scoring} |"
            )
            rows.append(
                {
                    "task": task,
                    "context": context,
                    "setting": setting,
                    "side": side,
                    "cell": name,
                    "n": len(by),
                    "score": ca[0],
                    "score_lo": ca[1],
                    "score_hi": ca[2],
                    "second": cb[0],
                    "vs_kvpress_best": None if vs is None else vs[0],
                    "vs_lo": None if vs is None else vs[1],
                    "vs_hi": None if vs is None else vs[2],
                    "seconds": float(np.mean(secs)) if secs else None,
                    "scoring_tokens": float(np.mean(scoring)) if scoring else None,
                }
            )
    lines.append("")
    pairs = [
        ("jaxkv's best against kvpress's best", best_jx, best_kp),
        ("KVzip against KVzipPress", jx_kvzip, f"KVzipPress@{ratio:g}"),
        ("jaxkv's best against KVzipPress", best_jx, f"KVzipPress@{ratio:g}"),
    ]
    for label, a, b in pairs:
        if a in sides["jaxkv"] and b in sides["kvpress"]:
            lines.append(f"- {label} ({a} − {b}): {fmt_gain(gain(sides['jaxkv'][a], sides['kvpress'][b]), lower)}")
    for name in sorted(n for n in sides["jaxkv"] if at_ratio(n, ratio) and ":" in n):
        res = gain(sides["jaxkv"][name], sides["jaxkv"]["full"])
        lines.append(f"- {name} against jaxkv's full cache: {fmt_gain(res, lower)}")
    lines.append("")
    return lines, rows


def report(
    jx_folders: list[Path],
    kp_folders: list[Path],
    ratio: float,
    setting: str | None = None,
    context: int | None = None,
    kvzip_cell: str = "kvzip",
) -> tuple[str, list[dict]]:
    """The markdown and csv rows of every (task, context, setting) where KVzip ran on
    either side at ``ratio`` (``setting`` / ``context``: only those; ``kvzip_cell``:
    jaxkv's KVzip cell, as in ``section``)."""
    jx, kp = load(jx_folders), load(kp_folders)
    lines = [
        "# jaxkv and kvpress at one ratio, KVzip on both sides (issue #75)",
        "",
        (
            "Written by `python -m eval.quality.kvzip_report`; teacher-forced and greedy accuracy"
            " (`lm`: NLL increase over the side's own full cache, nats per token, lower is better)"
            " with bootstrap 95% intervals, paired over the examples both cells ran."
        ),
        "",
    ]
    rows = []
    for key in sorted(set(jx) & set(kp)):
        if setting is not None and key[2] != setting or context is not None and key[1] != context:
            continue
        if f"{kvzip_cell}@{ratio:g}" not in jx[key] and f"KVzipPress@{ratio:g}" not in kp[key]:
            continue
        text, r = section(key, jx[key], kp[key], ratio, kvzip_cell)
        lines += text
        rows += r
    return "\n".join(lines), rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.quality.kvzip_report", description=__doc__.splitlines()[0])
    p.add_argument("--jaxkv", required=True, help="comma list of jaxkv journal folders")
    p.add_argument("--kvpress", required=True, help="comma list of kvpress journal folders")
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--setting", default="agnostic")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument(
        "--kvzip-cell",
        default="kvzip",
        help="jaxkv's KVzip cell without its ratio (kvzip, kvzip/layer, kvzip/shared): its examples are the round's, "
        "and it is paired against KVzipPress",
    )
    p.add_argument("--out", type=Path, default=None, help="write results.md and results.csv here")
    args = p.parse_args(argv)
    folders = lambda text: [Path(x) for x in text.split(",") if x]
    text, rows = report(folders(args.jaxkv), folders(args.kvpress), args.ratio, args.setting, args.context, args.kvzip_cell)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text(text + "\n")
        with (args.out / "results.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["task"])
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
