"""The real-model report: jaxkv and kvpress on the same examples (issue #32).

    python -m eval.quality.real_model_report --root eval/results/real_smollm2
    python -m eval.quality.real_model_report --out DIR --model M   # one `jaxkv eval` run (run_report)

Reads ``ROOT/summary.md`` (the findings in prose, kept across regenerations,
``findings``), the journals ``ROOT/jaxkv/examples*.jsonl`` (``eval.quality.real_model``;
the cells of one example merge across files) and ``ROOT/jaxkv/sessions.jsonl``
(RepairKV's trio, ``--repair K``), ``ROOT/kvpress/examples*.jsonl``
(``eval.quality.kvpress_side``): one record per (task, context, seed, setting) with every
cell, each cell keyed ``"full"`` or ``"<method>@<ratio>"``;
``ROOT/kvpress_live/examples.jsonl`` (kvpress at repaired sessions' live budgets,
for the RepairKV table only) and ``ROOT/reuse/examples.jsonl``
(``eval.quality.real_model_reuse``, the segment-reuse table). Writes
``ROOT/README.md`` (tables), ``ROOT/results.csv`` (one row per side, task,
context, setting, method, ratio) and
``ROOT/accuracy_vs_ratio.png`` (jaxkv solid, kvpress dashed, one panel per task
and setting; the full cache's ceiling as a grey band).

Statistics: accuracy is the mean of per-example 0/1 verdicts with a percentile
bootstrap 95% interval over examples; a comparison of two cells uses only the
examples both ran and a paired bootstrap (``eval.common.stats``).
A (task, context, setting) whose full cache is below ``--min-full`` is reported
as a ceiling and left out of the comparisons.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from eval.common.stats import mean_ci, paired_gain
from eval.quality.harness import HEAD, HEAD_RULE  # IntentKV's learned head and the rule it corrects (issue #27)
from jaxkv.markdown import md_header, md_row

SIDES = ("jaxkv", "kvpress")
# jaxkv method -> the kvpress press that implements the same rule
COUNTERPARTS = {
    "snapkv": "SnapKVPress",
    "streaming_llm": "StreamingLLMPress",
    "tova": "TOVAPress",
    "h2o": "ObservedAttentionPress",
    "random": "RandomPress",
    "keydiff": "KeyDiffPress",
    "expected_attention": "ExpectedAttentionPress",
    "snapkv/pyramid": "PyramidKVPress",  # PyramidKV's budgets over SnapKV's scorer on both sides (windows differ: 32 / 64)
}
PLOT_COLUMNS = 4  # panels per row of accuracy_vs_ratio.png


def read(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def findings(root: Path) -> list[str]:
    """``ROOT/summary.md``, the findings in prose written by hand from a report's
    tables, as the lines to place under its title (none without the file): a
    regenerated report keeps them. Shared by the real-model reports."""
    path = root / "summary.md"
    return [path.read_text().strip(), ""] if path.is_file() else []


def journals(folder: Path) -> list[Path]:
    """A side's journals: ``examples.jsonl`` first, then other ``examples*.jsonl``
    (more methods on the same examples, ``eval.quality.real_model --journal``), then
    ``sessions.jsonl`` (RepairKV); cells of one example merge across them."""
    extra = sorted(p for p in folder.glob("examples*.jsonl") if p.name != "examples.jsonl")
    return [folder / "examples.jsonl", *extra, folder / "sessions.jsonl"]


def split_cell(name: str) -> tuple[str, float]:
    if name == "full":
        return "full", 0.0
    method, ratio = name.rsplit("@", 1)
    return method, float(ratio)


def flatten(records: list[dict]) -> list[dict]:
    """One record per (example, setting): jaxkv's journal already is; kvpress's
    holds both settings of an example (``settings: {setting: {cells}}``) and names
    the example's own task ``example_task``."""
    out = []
    for rec in records:
        if "settings" in rec:
            task = rec.get("example_task", rec["task"])
            out += [dict(rec, task=task, setting=setting, cells=block["cells"]) for setting, block in rec["settings"].items()]
        else:
            out.append(rec)
    return out


def verdicts(records: list[dict]) -> dict:
    """``{(task, context, setting): {cell: {seed: cell record}}}``, latest record wins."""
    out: dict = defaultdict(lambda: defaultdict(dict))
    for rec in flatten(records):
        for cell, res in rec["cells"].items():
            out[(rec["task"], rec["context"], rec["setting"])][cell][rec["seed"]] = res
    return out


def score_of(task: str):
    """The per-example score of a cell: retrieval tasks 0/1 (teacher forced and
    greedy), ``lm`` the NLL increase over the full cache and the KL."""
    if task == "lm":
        return ("nll_increase", "kl")
    return ("tf_correct", "gen_correct")


def rows_for(side: str, table: dict) -> list[dict]:
    rows = []
    for (task, context, setting), cells in sorted(table.items()):
        full = cells.get("full", {})
        for cell, by_seed in sorted(cells.items()):
            method, ratio = split_cell(cell)
            seeds = sorted(by_seed)
            row = {"side": side, "task": task, "context": context, "setting": setting, "method": method, "ratio": ratio, "n": len(seeds)}
            if task == "lm":
                inc = [by_seed[s]["nll"] - full[s]["nll"] for s in seeds if s in full]
                row.update(zip(("nll_increase", "nll_increase_lo", "nll_increase_hi"), mean_ci(inc)))
                row.update(zip(("kl", "kl_lo", "kl_hi"), mean_ci([by_seed[s]["kl"] for s in seeds])))
            else:
                row.update(zip(("tf_acc", "tf_lo", "tf_hi"), mean_ci([by_seed[s]["tf_correct"] for s in seeds])))
                row.update(zip(("gen_acc", "gen_lo", "gen_hi"), mean_ci([by_seed[s]["gen_correct"] for s in seeds])))
                row["answer_nll"] = float(np.mean([by_seed[s]["answer_nll"] for s in seeds]))
            scoring = [by_seed[s]["scoring_tokens"] for s in seeds if "scoring_tokens" in by_seed[s]]
            if scoring:  # a policy's own passes (KVzip's reconstruction), tokens per example
                row["scoring_tokens"] = float(np.mean(scoring))
            rows.append(row)
    return rows


def paired(a: dict, b: dict, key: str):
    """Paired gain of cell ``a`` over cell ``b`` on their common examples."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    x = [float(a[s][key]) for s in seeds]
    y = [float(b[s][key]) for s in seeds]
    g, lo, hi = paired_gain(x, y, np.ones(len(seeds)))
    return g, lo, hi, len(seeds)


def fmt_ci(m, lo, hi, pct=True) -> str:
    if m != m:
        return "-"
    if pct:
        return f"{100 * m:.0f} [{100 * lo:.0f}, {100 * hi:.0f}]"
    return f"{m:.3f} [{lo:.3f}, {hi:.3f}]"


def best_cell(cells: dict, ratio: float, key: str, lower_better: bool = False):
    """The cell at ``ratio`` with the best mean ``key`` (name, {seed: record})."""
    best = None
    for name, by_seed in cells.items():
        if name == "full" or ":" in name or split_cell(name)[1] != ratio:  # session cells: another budget rule
            continue
        m = float(np.mean([float(r[key]) for r in by_seed.values()]))
        m = -m if lower_better else m
        if best is None or m > best[0]:
            best = (m, name, by_seed)
    return (best[1], best[2]) if best else (None, None)


def live_budget_best(kp_cells: dict, matched: dict | None, key: str, tolerance: float = 0.02):
    """kvpress's best press at the live budget of a repaired session (B + K rows, the
    ``matched`` cell's ``budget``): the ratio whose cells keep, on average, within
    ``tolerance`` of that many tokens (``eval.quality.kvpress_side --ratios`` run for it),
    as (cell name, {seed: record}); (None, None) when no ratio was run there."""
    if not matched:
        return None, None
    live = np.mean([r["budget"] for r in matched.values()])
    kept: dict = defaultdict(list)
    for name, by_seed in kp_cells.items():
        if name != "full":
            kept[split_cell(name)[1]] += [r["kept"] for r in by_seed.values() if "kept" in r]
    near = [x for x, k in kept.items() if k and abs(np.mean(k) - live) <= tolerance * live]
    if not near:
        return None, None
    return best_cell(kp_cells, near[0], key)


def answer_nll_increase(cells: dict) -> dict:
    """``{cell: {seed: {"inc": answer NLL minus the full cache's}}}`` over the
    examples that also ran the full cache; each side against its own full cache
    (kvpress's torch numerics and kept counts differ slightly from jaxkv's)."""
    full = cells.get("full", {})
    return {
        name: {s: {"inc": float(r["answer_nll"]) - float(full[s]["answer_nll"])} for s, r in by_seed.items() if s in full}
        for name, by_seed in cells.items()
        if name != "full" and ":" not in name
    }


def head_fidelity(tables: dict, key: tuple, ratios: list) -> list[str]:
    """Issue #27's fidelity table on a retrieval task: every method's mean NLL
    increase on the answer tokens over its side's full cache, and the learned
    head (``intentkv``) paired against its rule (``intentkv_memory``) and against
    the best baseline at each ratio (the lowest mean increase of any other
    method, either side, among those run on at least half of the head's examples). Differences are head minus other: negative is better.
    KL is not recorded for retrieval cells (their answers are scored by NLL and
    argmax only)."""
    inc = {side: answer_nll_increase(tables[side].get(key, {})) for side in SIDES}
    lines = [
        f"Answer NLL increase over the full cache (nats/token [95% interval]; issue #27's fidelity measure on the answer tokens):",
        "",
        *md_header(["side", "method", *(f"ratio {x:g}" for x in ratios)], "ll" + "r" * len(ratios)),
    ]
    for side in SIDES:
        for m in sorted({split_cell(n)[0] for n in inc[side]}):
            row = []
            for x in ratios:
                by_seed = inc[side].get(f"{m}@{x:g}")
                row.append(fmt_ci(*mean_ci([r["inc"] for r in by_seed.values()]), pct=False) if by_seed else "-")
            lines.append(md_row([side, m, *row]))
    pairs = []
    for x in ratios:
        head = inc["jaxkv"].get(f"{HEAD}@{x:g}")
        if not head:
            continue
        # a baseline competes on at least half of the head's examples (a 3-example pilot does not)
        others = [
            (side, name, by_seed)
            for side in SIDES
            for name, by_seed in inc[side].items()
            if split_cell(name)[1] == x and split_cell(name)[0] != HEAD and 2 * len(set(by_seed) & set(head)) >= len(head)
        ]
        if not others:
            continue
        best = min(others, key=lambda o: np.mean([r["inc"] for r in o[2].values()]))
        rule = next(((s, n, b) for s, n, b in others if (s, split_cell(n)[0]) == ("jaxkv", HEAD_RULE)), None)
        for label, other in (("rule", rule), ("best baseline", best)):
            if other is None:
                continue
            res = paired(head, other[2], "inc")
            if res:
                g, lo, hi, n = res
                pairs.append(md_row([f"{x:g}", f"{label}: {other[0]} {split_cell(other[1])[0]}", n, f"{g:+.3f} [{lo:+.3f}, {hi:+.3f}]"]))
    if pairs:
        lines += [
            "",
            f"The learned head (`{HEAD}`) against its rule and the best baseline, paired on common examples "
            "(head minus other, nats/token; negative: the head keeps the answer closer to the full cache):",
            "",
            *md_header(["ratio", "against", "n", "difference [95%]"], "rlrr"),
            *pairs,
        ]
    return lines + [""]


def fmt_paired(g: float, lo: float, hi: float, lower: bool, gain: bool) -> str:
    """A paired difference ``paired`` returned, as a table cell: points (x100, no
    decimals) on the retrieval tasks, nats (3 decimals) on ``lm``. ``gain``: signed so
    that positive is better, which for an NLL (``lower``) flips the difference."""
    if gain and lower:
        g, lo, hi = -g, -hi, -lo
    s, d = (1, 3) if lower else (100, 0)
    return f"{g * s:+.{d}f} [{lo * s:+.{d}f}, {hi * s:+.{d}f}]"


def write_csv(rows: list[dict], path: Path) -> None:
    """``rows`` as a CSV (nothing without rows): the first row's columns in its order,
    then the others' by name (a set's order changes per process); a row without a
    column leaves it empty."""
    if not rows:
        return
    first = list(rows[0])
    fields = sorted({k for r in rows for k in r}, key=lambda k: (first.index(k) if k in first else len(first), k))
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, restval="")
        w.writeheader()
        w.writerows(rows)


def ceiling(tables: dict, sides, min_full: float) -> tuple[list[str], set]:
    """The full cache's table (every (task, context, setting) and side) and the keys
    usable for comparisons: ``lm`` always, a retrieval task where jaxkv's full cache
    (the only side's, when there is one) reaches ``min_full`` teacher forced."""
    lines = [
        "## The full cache (the ceiling)",
        "",
        *md_header(["task", "context", "setting", "side", "n", "teacher-forced %", "greedy %"], "lrllrrr"),
    ]
    usable = set()
    for key in sorted(set().union(*(tables[side] for side in sides))):
        task, context, setting = key
        for side in sides:
            full = tables[side].get(key, {}).get("full")
            if not full:
                continue
            if task == "lm":
                nll = np.mean([r["nll"] for r in full.values()])
                lines.append(md_row([task, context, setting, side, len(full), f"NLL {nll:.3f}", "-"]))
                usable.add(key)
                continue
            tf = mean_ci([r["tf_correct"] for r in full.values()])
            gen = mean_ci([r["gen_correct"] for r in full.values()])
            lines.append(md_row([task, context, setting, side, len(full), fmt_ci(*tf), fmt_ci(*gen)]))
            if side == sides[0] and tf[0] >= min_full:
                usable.add(key)
    return lines + [""], usable


def ratio_table(rows: list[dict], key: tuple, sides) -> list[str]:
    """One (task, context, setting)'s methods against the ratios, per side, and the
    line that says what a cell holds."""
    task = key[0]
    sel = [r for r in rows if (r["task"], r["context"], r["setting"]) == key and r["method"] != "full"]
    ratios = sorted({r["ratio"] for r in sel})
    lines = [*md_header(["side", "method", *(f"ratio {x:g}" for x in ratios)], "ll" + "r" * len(ratios))]
    for side in sides:
        for m in sorted({r["method"] for r in sel if r["side"] == side}):
            cells = []
            for x in ratios:
                r = next((r for r in sel if (r["side"], r["method"], r["ratio"]) == (side, m, x)), None)
                if r is None:
                    cells.append("-")
                elif task == "lm":
                    cells.append(f"{fmt_ci(r['nll_increase'], r['nll_increase_lo'], r['nll_increase_hi'], pct=False)} (KL {r['kl']:.3f})")
                else:
                    cells.append(f"{fmt_ci(r['tf_acc'], r['tf_lo'], r['tf_hi'])} / {100 * r['gen_acc']:.0f}")
            lines.append(md_row([side, m, *cells]))
    lines.append("")
    if task == "lm":
        lines.append("Cells: NLL increase over the full cache, nats/token [95% interval] (mean KL(full || cell) per token).")
    elif task == "multiq":
        lines.append(
            "Cells: the share of an example's questions answered right, teacher forced, % [95% interval over examples] "
            "/ greedy exact match %."
        )
    else:
        lines.append("Cells: teacher-forced accuracy % [95% interval] / greedy exact match %.")
    passes = [r for r in sel if r.get("scoring_tokens")]
    if passes:
        lines += [
            "",
            "Compute beside the quality: tokens a method forwarded to score, beside the compressed request's own prefill "
            "(mean per example): " + ", ".join(f"{r['side']} {r['method']}@{r['ratio']:g} {r['scoring_tokens']:.0f}" for r in passes) + ".",
        ]
    return lines + [""]


def per_layer_gains(cells: dict, score: str, lower: bool) -> list[str]:
    """Per-layer keep sets (``<method>/layer@r``, ``<method>/pyramid@r``) against one
    set for the model with the same scorer and ratio, paired on common examples."""
    gran = []
    for name in sorted(n for n in cells if "/" in split_cell(n)[0]):
        method, x = split_cell(name)
        one = cells.get(f"{method.split('/')[0]}@{x:g}")
        res = paired(cells[name], one, score) if one else None
        if res:
            gran.append(md_row([method, method.split("/")[0], f"{x:g}", res[3], fmt_paired(*res[:3], lower, gain=True)]))
    if not gran:
        return []
    unit = "nats, positive: the per-layer sets lower the NLL" if lower else "points"
    return [
        f"Keep sets per layer against one set for the model, same scorer and KV (jaxkv, paired; {unit}):",
        "",
        *md_header(["per layer", "one set", "ratio", "n", "gain [95%]"], "llrrr"),
        *gran,
        "",
    ]


def question_table(cells_by_side: dict) -> list[str]:
    """A multiq (task, context, setting): each cell's teacher-forced accuracy per
    question of the conversation (Q1 is in the compressed request when aware, every
    later one arrives after the compression) and per kind of fact."""
    lines = []
    for side, cells in cells_by_side.items():
        for name, by_seed in sorted(cells.items(), key=lambda kv: (kv[0] != "full", kv[0])):
            per = [r["questions"] for r in by_seed.values() if r.get("questions")]
            if not per:
                continue
            turns = max(len(q) for q in per)
            kinds = sorted({q["kind"] for qs in per for q in qs})
            if not lines:
                header = ["side", "cell", "n", *(f"Q{i + 1}" for i in range(turns)), *kinds]
                lines = [
                    "Per question (teacher-forced %; Q1 first in the conversation) and per kind of fact:",
                    "",
                    *md_header(header, "llr" + "r" * (turns + len(kinds))),
                ]
            at = [f"{100 * np.mean([float(qs[i]['tf_correct']) for qs in per if len(qs) > i]):.0f}" for i in range(turns)]
            by_kind = [f"{100 * np.mean([float(q['tf_correct']) for qs in per for q in qs if q['kind'] == k]):.0f}" for k in kinds]
            lines.append(md_row([side, name, len(per), *at, *by_kind]))
    return lines + [""] if lines else []


def report(root: Path, min_full: float = 0.5) -> str:
    tables = {side: verdicts([rec for f in journals(root / side) for rec in read(f)]) for side in SIDES}
    # kvpress at the live budgets of repaired sessions (B + K): for the RepairKV comparison only
    live_tables = verdicts(read(root / "kvpress_live" / "examples.jsonl"))
    rows = [r for side in SIDES for r in rows_for(side, tables[side])]
    write_csv(rows, root / "results.csv")
    lines = ["# jaxkv and kvpress on SmolLM2-135M-Instruct, on the same examples", "", *findings(root)]

    def seconds(rec):
        sec = rec.get("seconds", 0)
        return sec.get("total", 0) if isinstance(sec, dict) else sec

    secs = {side: sum(seconds(rec) for f in journals(root / side) for rec in read(f)) for side in SIDES}
    lines += [
        f"CPU time in the journals: jaxkv {secs['jaxkv'] / 3600:.2f} h, kvpress {secs['kvpress'] / 3600:.2f} h "
        "(2-core x86_64; sums of per-example seconds).",
        "",
    ]
    compute_at = len(lines)  # the compute section goes here, once the left-out rows are known
    ceiling_lines, usable = ceiling(tables, SIDES, min_full)
    lines += ceiling_lines
    dropped = sorted(k for k in set(tables["jaxkv"]) if k not in usable)
    lines[compute_at:compute_at] = compute_section(root, left_out=set(dropped))
    if dropped:
        lines += [
            f"Left out of the comparisons (full cache below {100 * min_full:.0f}%): " + ", ".join(f"{t} {c} {s}" for t, c, s in dropped),
            "",
        ]
    # per-task tables
    for key in sorted(usable):
        task, context, setting = key
        lines += [f"## {task}, {context} tokens, question-{setting}", "", *ratio_table(rows, key, SIDES)]
        ratios = sorted({r["ratio"] for r in rows if (r["task"], r["context"], r["setting"]) == key and r["method"] != "full"})
        # head to head
        score = "nll" if task == "lm" else "tf_correct"
        lower = task == "lm"
        jx, kp = tables["jaxkv"].get(key, {}), tables["kvpress"].get(key, {})
        h2h = []
        for x in ratios:
            jn, jc = best_cell(jx, x, score, lower)
            kn, kc = best_cell(kp, x, score, lower)
            if jc and kc:
                res = paired(jc, kc, score)
                if res:
                    h2h.append(md_row([f"{x:g}", jn, kn, res[3], fmt_paired(*res[:3], lower, gain=True)]))
        if h2h:
            unit = "nats (positive: jaxkv lower NLL)" if lower else "points"
            lines += [
                f"Best of each side, paired on common examples (gain of jaxkv's best, {unit}):",
                "",
                *md_header(["ratio", "jaxkv best", "kvpress best", "n", "gain [95%]"], "rllrr"),
                *h2h,
                "",
            ]
        cp = []
        for jm, km in COUNTERPARTS.items():
            for x in ratios:
                a, b = jx.get(f"{jm}@{x:g}"), kp.get(f"{km}@{x:g}")
                if a and b:
                    res = paired(a, b, score)
                    if res:
                        cp.append(md_row([f"{jm} vs {km}", f"{x:g}", res[3], fmt_paired(*res[:3], lower, gain=False)]))
        if cp:
            lines += [
                "Counterparts (jaxkv minus kvpress, paired):",
                "",
                *md_header(["pair", "ratio", "n", "difference [95%]"], "lrrr"),
                *cp,
                "",
            ]
        lines += per_layer_gains(jx, score, lower)
        if task == "multiq":
            lines += question_table({side: tables[side].get(key, {}) for side in SIDES})
        if task != "lm" and any(split_cell(n)[0] == HEAD for n in jx):
            lines += head_fidelity(tables, key, ratios)
        repair = sorted(n for n in jx if n.startswith("repairkv"))
        if repair and task != "lm":
            rl = []
            for name in repair:
                x = split_cell(name)[1]
                matched = jx.get(name.replace("repairkv", "matched"))
                live_name, live = live_budget_best({**kp, **live_tables.get(key, {})}, matched, score)
                acc = 100 * np.mean([float(r[score]) for r in jx[name].values()])
                rl.append(md_row([name, f"itself ({acc:.0f}%)", len(jx[name]), "-"]))
                for other, label in (
                    (jx.get("full"), "full cache"),
                    (best_cell(kp, x, score)[1], f"kvpress best at {x:g} (live B)"),
                    (live, f"kvpress best at live B + K ({live_name})"),
                    (matched, "matched no-repair (B + K)"),
                    (jx.get("session:" + name.split(":", 1)[1]), "no repair (B)"),
                ):
                    if other:
                        res = paired(jx[name], other, score)
                        if res:
                            g, lo, hi, n = res
                            rl.append(md_row([name, label, n, f"{100 * g:+.0f} [{100 * lo:+.0f}, {100 * hi:+.0f}]"]))
            if rl:
                lines += [
                    "RepairKV across the turn boundary (multi-turn sessions; gain in points, paired). B is the "
                    "ratio's budget; RepairKV holds B + K live rows while it answers, as the matched cell does:",
                    "",
                    *md_header(["cell", "against", "n", "gain [95%]"], "llrr"),
                    *rl,
                    "",
                ]
    lines += reuse_section(root / "reuse")
    text = "\n".join(lines) + "\n"
    plot(root, rows, usable)
    return text


# The report's sizes (issue #32): examples per cell at each context, per side, and the
# compute budget of each side's whole grid (hours on the 2-core CPU).
REQUIRED_EXAMPLES = {2048: {"jaxkv": 100, "kvpress": 50}, 4096: {"jaxkv": 50, "kvpress": 30}, 8192: {"jaxkv": 30, "kvpress": 30}}
BUDGET_HOURS = {"jaxkv": 4.0, "kvpress": 3.0}


PINNED_MIN = 5  # pinned examples a row needs before its rate is taken from them alone
PINNED_LOAD = 2.8  # the 1-minute load above which an example shared the 2 cores with a third job (two pinned jobs read 2.2-2.6)


def pinned(record: dict) -> bool:
    """Whether an example ran as the compute budget assumes: its job on one core with
    one XLA / torch thread (``setup.cpus`` 1; jaxkv's ``XLA_FLAGS`` or kvpress's
    ``--threads``) and no more runnable jobs than cores when it started (``load``).
    Journals written before these fields existed count as not pinned: their 2k rows
    ran as 2-thread jobs beside other jobs, about twice a pinned example's time."""
    setup = record.get("setup") or {}
    threads = setup.get("threads")
    one_thread = threads == 1 or (isinstance(threads, str) and "intra_op_parallelism_threads=1" in threads)
    return setup.get("cpus") == 1 and one_thread and record.get("load", float("inf")) <= PINNED_LOAD


def example_seconds(records: list[dict]) -> dict:
    """``{(task, context, setting): {seed: seconds}}`` of a side's grid journals: one
    prefill and every cell of one example in one setting (kvpress records each setting's
    seconds; sessions and extra-method journals are left out, they are not the grid)."""
    out: dict = defaultdict(dict)
    for rec in records:
        if "settings" in rec:
            task = rec.get("example_task", rec["task"])
            for setting in rec["settings"]:
                sec = rec["seconds"].get(setting) if isinstance(rec["seconds"], dict) else None
                if sec is not None:
                    out[(task, rec["context"], setting)][rec["seed"]] = float(sec)
        else:
            out[(rec["task"], rec["context"], rec["setting"])][rec["seed"]] = float(rec["seconds"])
    return out


def compute_section(root: Path, left_out: set = frozenset()) -> list[str]:
    """What each side's grid has cost and what the report's sizes (``REQUIRED_EXAMPLES``)
    would cost at the median seconds per example (one core per job; two jobs run at once
    on the 2 cores, so the wall clock is about half the CPU hours). A row's rate is the
    median of its pinned examples (``pinned``) when it has ``PINNED_MIN`` of them, else
    of all its examples, and the table says which. Rows in ``left_out`` ((task, context,
    setting) whose full cache is below the report's ceiling) are not projected; a
    (task, context) not run yet has no rate and no row."""
    lines = [
        "## Compute against the report's sizes",
        "",
        "Per side, task, context and setting: examples run, the median seconds of one example (its prefill "
        "and every cell), where that median comes from (`pinned`: examples whose job had one core and one "
        "thread with at most one other job beside it, as the budget assumes; `all`: the row has fewer than "
        f"{PINNED_MIN} such examples, so its rate includes oversubscribed runs), the CPU hours spent, and the "
        "CPU hours the report's size (jaxkv 100 / 50 / 30 examples at 2k / 4k / 8k, kvpress 50 / 30 / 30) would "
        "take at that median. The 8k rows in the issue need only the full cache and two methods per side; "
        "their cost is not projected here.",
        "",
        *md_header(
            ["side", "task", "context", "setting", "n run", "n wanted", "median s", "rate from", "h spent", "h for the size"], "llrlrrrlrr"
        ),
    ]
    totals = {}
    for side in SIDES:
        records = read(root / side / "examples.jsonl")
        per, per_pinned = example_seconds(records), example_seconds([r for r in records if pinned(r)])
        spent = wanted_h = 0.0
        for (task, context, setting), by_seed in sorted(per.items()):
            if (task, context, setting) in left_out or context not in REQUIRED_EXAMPLES:
                continue
            want = REQUIRED_EXAMPLES[context][side]
            clean = per_pinned.get((task, context, setting), {})
            rated, rate_from = (clean, f"pinned ({len(clean)})") if len(clean) >= PINNED_MIN else (by_seed, "all")
            med = float(np.median(list(rated.values())))
            h = sum(by_seed.values()) / 3600
            full_h = med * want / 3600
            spent += h
            wanted_h += full_h
            lines.append(md_row([side, task, context, setting, len(by_seed), want, f"{med:.0f}", rate_from, f"{h:.2f}", f"{full_h:.2f}"]))
        totals[side] = (spent, wanted_h)
    lines.append("")
    for side, (spent, wanted_h) in totals.items():
        lines.append(
            f"- {side}: {spent:.2f} CPU h spent on these rows; the rows above at their sizes: {wanted_h:.2f} CPU h "
            f"(~{wanted_h / 2:.1f} h of wall clock on the 2 cores), against a budget of {BUDGET_HOURS[side]:.0f} h "
            "for the whole report, before the contexts not run yet."
        )
    return lines + [""]


def reuse_section(folder: Path) -> list[str]:
    """Segment reuse on documents shared across requests (``eval.quality.real_model_reuse``:
    a primer session reads the document behind another system prompt, a second
    session asks about it): per mode, the scores, the tokens spliced instead of
    recomputed, the token-layer units computed as a share of what prefix caching
    alone computes, the spans accepted / rejected, and the target request's
    prefill-and-reply seconds; each mode paired against ``none`` (full recompute)."""
    by_key: dict = defaultdict(lambda: defaultdict(dict))
    for rec in read(folder / "examples.jsonl"):
        for mode, row in rec["modes"].items():
            by_key[(rec["task"], rec["context"])][mode][rec["seed"]] = row
    if not by_key:
        return []
    lines = [
        "## Segment reuse: one document, two requests",
        "",
        "Regenerate: `python -m eval.quality.real_model_reuse --task TASK --context N --n 20 --out " + str(folder) + " --resume`. "
        "Each mode on a fresh server; the target request's prompt differs from the primer's before the document, so "
        "the radix prefix cache cannot serve it and only segment reuse can.",
        "",
        *md_header(
            [
                "task",
                "context",
                "mode",
                "n",
                "teacher-forced %",
                "greedy %",
                "answer NLL",
                "spliced tokens",
                "units computed",
                "spans accepted / rejected",
                "target seconds",
                "teacher-forced gain vs none [95%]",
            ],
            "lrl" + "r" * 9,
        ),
    ]
    for (task, context), modes in sorted(by_key.items()):
        none = modes.get("none", {})
        for mode, by_seed in modes.items():
            rows = list(by_seed.values())
            tf, gen = (100 * np.mean([r[k] for r in rows]) for k in ("tf_correct", "gen_correct"))
            nll = np.mean([r["answer_nll"] for r in rows])
            spliced = f"{np.mean([r['spliced'] for r in rows]):.0f}" if "spliced" in rows[0] else "-"
            units = (
                f"{100 * sum(r['units'] for r in rows) / max(sum(r['full_units'] for r in rows), 1):.0f}%" if "units" in rows[0] else "100%"
            )
            spans = f"{sum(r['accepted'] for r in rows)} / {sum(r['rejected'] for r in rows)}" if "accepted" in rows[0] else "-"
            res = paired(by_seed, none, "tf_correct") if mode != "none" and none else None
            gain = f"{100 * res[0]:+.0f} [{100 * res[1]:+.0f}, {100 * res[2]:+.0f}]" if res else "-"
            lines.append(
                md_row(
                    [
                        task,
                        context,
                        mode,
                        len(rows),
                        f"{tf:.0f}",
                        f"{gen:.0f}",
                        f"{nll:.3f}",
                        spliced,
                        units,
                        spans,
                        f"{np.mean([r['seconds'] for r in rows]):.1f}",
                        gain,
                    ]
                )
            )
    return lines + [
        "",
        "Target seconds: the second request's prefill and greedy reply on one core, not a timing bench (other jobs ran on the other core).",
        "",
    ]


def plot(root: Path, rows: list[dict], usable: set) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    keys = sorted(k for k in usable if k[0] != "lm")
    if not keys:
        return
    ncols = min(len(keys), PLOT_COLUMNS)  # a grid, so panels stay readable as lengths are added
    nrows = -(-len(keys) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 4.0 * nrows + 1.2), squeeze=False)
    for ax in axes.flat[len(keys) :]:
        ax.set_visible(False)
    # a jaxkv method and its kvpress counterpart share a colour (solid vs dashed)
    family = {**{m: m for m in COUNTERPARTS}, **{press: m for m, press in COUNTERPARTS.items()}}
    names = sorted({family.get(r["method"], r["method"]) for r in rows if r["method"] != "full"})
    palette = plt.get_cmap("tab20").colors
    colour = {name: palette[i % len(palette)] for i, name in enumerate(names)}
    handles = {}
    for ax, key in zip(axes.flat, keys):
        sel = [r for r in rows if (r["task"], r["context"], r["setting"]) == key]
        full = [r for r in sel if r["method"] == "full" and r["side"] == "jaxkv"]
        if full:
            ax.axhspan(100 * full[0]["tf_lo"], 100 * full[0]["tf_hi"], color="0.85")
            ax.axhline(100 * full[0]["tf_acc"], color="0.5", lw=1)
        for side, style in (("jaxkv", "-"), ("kvpress", "--")):
            for m in sorted({r["method"] for r in sel if r["side"] == side and r["method"] != "full"}):
                pts = sorted((r["ratio"], 100 * r["tf_acc"]) for r in sel if r["side"] == side and r["method"] == m)
                (line,) = ax.plot(*zip(*pts), style, marker="o", ms=3, color=colour[family.get(m, m)])
                handles[f"{side}: {m}"] = line
        ax.set_title(f"{key[0]} {key[1]} ({key[2]})", fontsize=9)
        ax.set_xlabel("fraction of KV removed")
        ax.set_ylabel("teacher-forced accuracy %")
        ax.set_ylim(-3, 103)
    fig.legend(list(handles.values()), list(handles), fontsize=6, loc="lower center", ncol=4, frameon=False)
    fig.tight_layout(rect=(0, 0.22 / nrows, 1, 1))
    fig.savefig(root / "accuracy_vs_ratio.png", dpi=120, bbox_inches="tight")
    plt.close(fig)


def run_report(out: Path, model: str, min_full: float = 0.5) -> str:
    """The report of one ``jaxkv eval`` run on a real-model task, from what its
    ``--out`` holds (jaxkv's side alone: ``examples*.jsonl``, ``sessions.jsonl``,
    ``quant*.jsonl``), written beside them as ``results.md`` and ``results.csv``
    (one row per task, context, setting, method and ratio; a KV-format run's rows
    are its formats) with the plots (``accuracy_vs_ratio.png`` for the retrieval
    tasks, ``quality_vs_bits.png`` for KV formats). Returns the markdown.

    Every (task, context, setting) gets its table, its full cache first; one whose
    full cache is below ``min_full`` says so in its title. The two-side comparison
    with kvpress is ``report`` (``--root``), which reads another layout."""
    records = [rec for f in journals(out) for rec in read(f)]
    lines = [
        f"# jaxkv eval: {model}",
        "",
        f"The journals in `{out}`; regenerate this page with `python -m eval.quality.real_model_report --out {out} --model {model}`.",
        "",
    ]
    rows: list[dict] = []
    if records:
        table = {"jaxkv": verdicts(records)}
        rows = rows_for("jaxkv", table["jaxkv"])
        ceiling_lines, usable = ceiling(table, ("jaxkv",), min_full)
        lines += ceiling_lines
        for key in sorted(table["jaxkv"]):
            task, context, setting = key
            below = "" if key in usable or "full" not in table["jaxkv"][key] else f" (full cache below {100 * min_full:.0f}%)"
            lines += [f"## {task}, {context} tokens, question-{setting}{below}", "", *ratio_table(rows, key, ("jaxkv",))]
            lines += per_layer_gains(table["jaxkv"][key], "nll" if task == "lm" else "tf_correct", task == "lm")
            if task == "multiq":
                lines += question_table({"jaxkv": table["jaxkv"][key]})
        plot(out, rows, set(table["jaxkv"]))
        if (out / "accuracy_vs_ratio.png").is_file():
            lines += ["![accuracy against the ratio](accuracy_vs_ratio.png)", ""]
    if any(out.glob("quant*.jsonl")):
        from eval.quality import real_model_quant_report

        points: list[dict] = []
        lines += [real_model_quant_report.report(out, model, points=points), ""]
        rows += [
            {
                "side": "jaxkv",
                "task": p["group"][0],
                "context": p["group"][1],
                "setting": p["group"][2],
                "kv_format": p["name"],
                "stored_bits": round(p["bits"], 4),
                "value": p["y"],
                "value_lo": p["lo"],
                "value_hi": p["hi"],
                "value_is": "nll_increase" if p["group"][0] == "lm" else "tf_acc_pct",
            }
            for p in points
        ]
    if not records and not rows:
        lines += [f"No journal in `{out}` yet.", ""]
    write_csv(rows, out / "results.csv")
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.quality.real_model_report", description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=Path("eval/results/real_smollm2"))
    p.add_argument("--min-full", type=float, default=0.5)
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="instead of --root's two-side report: one `jaxkv eval` run's folder (results.md, results.csv, plots)",
    )
    p.add_argument("--model", default="smollm2-135m-instruct", help="with --out: the model the run used")
    args = p.parse_args(argv)
    if args.out is not None:
        print(run_report(args.out, args.model, args.min_full))
        return 0
    text = report(args.root, args.min_full)
    (args.root / "README.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
