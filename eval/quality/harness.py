"""The evaluation harness: methods x budgets x layouts x tasks on one model.

    jaxkv eval --model embedded --task agent --methods snapkv,intentkv_memory \
        --budgets 256,512 --layouts dead_slot,compact --n 100 --out eval/results/run

Each example is replayed turn by turn through ``jaxkv.Session`` (``train.replay``,
which the TriAxialKV calibration's sweep runs too; teacher-forced history: the
recorded conversation before each assistant turn), the assistant turn is generated
greedily and scored by exact match against the generator's target (tool-call name +
arguments, or the answer string); the generated reply is then discarded and the
recorded one teacher-forced, so every turn sees the same history whatever the model
produced. One fresh session per example, so the radix cache reuses prefixes across
the turns of an example, never across examples. MQ-NIAH sessions run with
``protect_query=False`` (``train.replay.TASK_SESSION_OPTIONS``): the document
arrives in the same message as the first question.
``shared_docs`` is the exception: its sessions are one tenant's, so every example
of a cell runs on one ``Server`` (radix cache and segment store shared across its
sessions), and ``--reuse none,segment,cacheblend`` repeats each cell per
cross-query reuse mode (``jaxkv.serving.stages.reuse``), adding the columns
``reuse``, ``prefill_tokens_computed`` (token x layer units per request),
``prefill_s`` (per request), ``accept_rate`` and ``fallback_rate``
(``reuse_summary``; ``-`` where the stage is off).

Per cell (method, budget, layout, task) it reports: ``accuracy`` (scored turns
exact-matched, turns of incomplete examples counted wrong), ``completion``
(examples replayed without a context or memory error), and means over examples
of the KV accounting (``jaxkv.metrics``): peak request tokens, peak live KV, raw
and effective KV reads, prefix-hit rate; ``wall_s`` is the cell's total time.
The method ``full`` is the full cache: it ignores budget and layout and is run
once per task (budget and layout columns read ``-``). Budgets are live KV tokens,
or fractions in (0, 1) of each example's length (``--budgets 0.5,0.65``: the
tokens of its conversation up to the last scored turn, rendered with the model's
template), for traces whose lengths differ from model to model.

KV precision (``--kv-quant none,int4,kivi2,triaxial``, TriAxialKV) crosses every
other axis: each cell runs once per mode (``Session(kv_quant=...)``, a pool of
that kind), and the triaxial modes once per ``--kv-bits`` budget (default: the
calibrated one). ``avg_bits`` is the token-weighted mean of the code bits each
live token is written at after each prompt prefill (2, 4, or 16 for full
precision: what the budget B counts), ``kv_bytes_per_token`` the bytes per token
including scales and zero points (full precision counted as bf16), and
``stored_bits`` 8 * those bytes / elements (``jaxkv.cache.quantized_host.stored_bits``,
``stored_bits_of`` for rows journaled before the column), all over every request
of the cell. Tables report stored bits; code bits only as ``code bits``.
``--methods full`` runs only full-cache cells.

Outputs in ``--out`` (the synthetic tasks; a real-model task's are below):
``results.csv`` (the columns in ``COLUMNS``),
``results.md`` and PNG plots (accuracy vs budget per method; KV reads vs
budget), plus a printed comparison of prefix-hit rates of the two layouts.
``--quick`` shrinks everything so the whole grid finishes in minutes on a CPU.

``--compare-to best`` adds a paired comparison to ``results.md``: per budget and
layout, every method's accuracy, its share of the full cache's, and its gain over
the best baseline (the most accurate of ``BASELINES`` in that column) with a
paired bootstrap 95% interval over examples (``eval.common.stats.paired_gain``,
from the per-example counts every cell keeps in the journal), beside peak request
tokens, peak live KV and raw vs effective KV reads; ``--focus METHOD`` adds that
method's gain over each baseline. ``--compare-to METHOD`` compares with a named one.
``--resume --report-only`` writes the report from the journal's finished cells of
the grid, runs none, and lists the rest as not run.

Accuracy without generation (``--accuracy teacher``): a scored turn counts when
every token of its recorded reply is the argmax of its teacher-forced row, which is
what greedy decoding would reproduce exactly; the replay then decodes nothing (a
real model's decode steps are most of a greedy replay's time). It is stricter than
the greedy score, which matches the call or answer only, not the reasoning.

Fidelity (``--fidelity``, issue #27): how close, token by token, the managed
cache keeps the model to its full-cache behaviour on the turns after a compression
event, beside accuracy. Every replay also teacher-forces the recorded assistant
turns with their logits. The ``full`` cell of a task on the float pool
(``--kv-quant none``) runs first and stores, per example, each recorded token's NLL
and its distribution as the top ``FIDELITY_TOP`` (64) tokens plus the rest's mass
(``OUT/fidelity/``); every other cell, on the turns whose reply follows at least
one of its compression events (``TurnResult.compressions``), or on every turn with
a quantized pool (``--kv-quant int4,...``: the KV is stored quantized from the
first prefill on, so every reply reads it), reports ``nll_increase`` (mean NLL,
managed minus full, nats per recorded token) and ``kl`` (KL(full || managed) per
token on those 65 bins: a lower bound of the full-vocabulary KL, equal to it when
the top 64 carry all the mass), token-weighted over examples, ``fidelity_tokens``
the tokens counted, and per-example values for paired intervals. With
``--kv-quant``, ``results.md``'s KV-precision table adds each format's NLL
increase with a paired bootstrap 95% interval over examples and its KL.

Long grids: every finished cell is appended to ``--out/cells.jsonl`` at once, and
``--resume`` skips the cells already there (same examples: a cell's key includes
n, length, seed, needles and max_new_tokens), so an interrupted run loses at most
the cells in flight. ``--workers W`` replays cells in W processes, each with its
own copy of the model; a replay is one sequence of small jitted steps, so on a CPU
with C cores up to C workers scale nearly linearly. ``wall_s`` is then the
cell's time in its worker, not a share of the grid's.

Real-model tasks (``--task passkey``, ``niah``, ``niah_<variant>``, ``lm``, ``multiq``; one
per run) are ``eval.quality.real_model``'s grid: every method at ``--ratios``
(kvpress's protocol, each cell branched from one prefill), or with ``--kv-quant`` the
full cache on the float pool and on each format (``--kv-bits``: the triaxial modes at
each budget), or with one ``--repair-ks K`` RepairKV's matched trio as multi-turn
sessions. The run appends to that module's journals in ``--out``
(``examples.jsonl``, ``quant.jsonl``, ``sessions.jsonl``), then writes the report of
everything ``--out`` holds beside them and prints it, as the synthetic tasks do:
``results.md`` (the full cache's ceiling, then per task, context and setting every
method against the ratios with 95% intervals; per-layer sets against one set;
``multiq``: per question), ``results.csv`` (one row per task, context, setting,
method and ratio, or per KV format) and the plots ``accuracy_vs_ratio.png`` (retrieval
tasks) or ``quality_vs_bits.png`` (KV formats)
(``eval.quality.real_model_report.run_report``). ``--context``, ``--ratios`` and
``--settings`` are theirs; the synthetic grid's options (``SYNTHETIC_ONLY``) are
refused with them. The comparison with kvpress on the same examples reads another
layout: ``python -m eval.quality.real_model_report --root ROOT`` over ``ROOT/jaxkv``
and ``ROOT/kvpress``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy as np

from eval.common.stats import paired_gain, paired_ratio_difference
from jaxkv.markdown import md_table
from jaxkv.tasks.seeds import EVAL_SEED_BASE
from train.journal import append_journal, load_journal
from train.replay import PER_EXAMPLE, REPAIR_POLICIES, Cell, is_reference, run_cells

COLUMNS = (
    "method",
    "budget",
    "layout",
    "task",
    "n",
    "accuracy",
    "completion",
    "peak_request_tokens",
    "peak_live_kv",
    "raw_kv_reads",
    "effective_kv_reads",
    "prefix_hit_rate",
    "wall_s",
    "repair_policy",
    "repair_k",
    "base_budget",
    "kv_quant",
    "kv_bits",
    "kv_rotate",
    "avg_bits",
    "stored_bits",
    "kv_bytes_per_token",
    "reuse",
    "prefill_tokens_computed",
    "prefill_s",
    "accept_rate",
    "fallback_rate",
    "fidelity_tokens",
    "nll_increase",
    "kl",
)
KV_QUANTS = ("none", "int4", "kivi2", "kivi4", "triaxial", "triaxial_no_temporal", "triaxial_no_semantic")
REUSE_MODES = ("none", "segment", "cacheblend")
ALL_METHODS = (
    "full",
    "streaming_llm",
    "snapkv",
    "h2o",
    "tova",
    "random",
    "oldest",
    "agentkv",
    "intentkv_memory",
    "intentkv_query",
    "intentkv",
    "intentkv_no_memory",
    "intentkv_no_xattn",
    "intentkv_no_residual",
)
# The retention methods jaxkv had before IntentKV Phase 2: the baselines ``--compare-to best``
# picks from (the learned head, its ablations and the full cache are never "the best baseline").
BASELINES = ("streaming_llm", "snapkv", "h2o", "tova", "random", "oldest", "agentkv", "intentkv_memory", "intentkv_query")
TASKS = ("agent", "mqniah", "shared_docs")


def make_examples(task: str, n: int, length: int, seed: int = EVAL_SEED_BASE, needles: int = 4):
    """``n`` generated examples of ``task`` (held out from training by seed);
    ``needles`` is the MQ-NIAH needle count (2, 4, 6 or 8)."""
    from jaxkv.tasks import agent_traces, mqniah, shared_docs

    if task == "agent":
        return agent_traces(n, seed, length=length)
    if task == "mqniah":
        return mqniah(n, seed + 500_000, needles=needles, length=length)
    if task == "shared_docs":
        return shared_docs(n, seed + 700_000)
    raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")


def parse_budgets(spec: str) -> list:
    """``--budgets``: integers (live KV tokens) or fractions in (0, 1) of each
    example's length (``session_budget``); ``ValueError`` otherwise."""
    out = []
    for b in _names(spec, None, "budgets"):
        try:
            value = int(b) if b.strip().lstrip("-").isdigit() else float(b)
        except ValueError:
            raise ValueError(f"budgets must be integers or fractions in (0, 1), got {b!r}") from None
        if (isinstance(value, int) and value < 1) or (isinstance(value, float) and not 0.0 < value < 1.0):
            raise ValueError(f"budgets must be integers >= 1 or fractions in (0, 1), got {b!r}")
        out.append(value)
    return out


def grid(
    methods,
    budgets,
    layouts,
    tasks,
    repair_ks=(),
    repair_policies=("repairkv",),
    kv_quants=("none",),
    kv_bits=(),
    reuses=("-",),
    kv_rotates=(False,),
) -> list[Cell]:
    """Every cell to run. With ``repair_ks``, each (method, B_base) on the dead-slot
    layout (repair needs stable positions) also gets, per K, one cell per repair
    policy at B_base and the matched no-repair cell at B_base + K. Every cell is
    then run once per ``kv_quants`` mode (the triaxial modes once per ``kv_bits``
    budget; none given: the calibrated budget), a quantized mode once per
    ``kv_rotates`` setting (the float pool is never rotated), and per reuse mode in
    ``reuses`` (``"-"``: the reuse stage is off)."""
    return [
        dataclasses.replace(cell, kv_quant=q, kv_bits=b, reuse=r, kv_rotate=rot)
        for cell in _grid(methods, budgets, layouts, tasks, repair_ks, repair_policies)
        for q in kv_quants
        for b in ((list(kv_bits) or [None]) if q.startswith("triaxial") else [None])
        for rot in (kv_rotates if q != "none" else (False,))
        for r in reuses
    ]


def _grid(methods, budgets, layouts, tasks, repair_ks, repair_policies) -> list[Cell]:
    cells = []
    for task in tasks:
        for method in methods:
            if method == "full":
                cells.append(Cell("full", None, None, task))
                continue
            for budget in budgets:
                for layout in layouts:
                    cells.append(Cell(method, budget, layout, task, base_budget=budget))
                    if layout != "dead_slot":
                        continue
                    for k in repair_ks:
                        cells.append(Cell(method, budget + k, layout, task, "matched", k, budget))
                        for policy in repair_policies:
                            cells.append(Cell(method, budget, layout, task, policy, k, budget))
    return cells


# ----------------------------------------------------------------------------- running a grid
def cell_key(cell: Cell) -> str:
    """A cell's journal key: its fields in order. Fields added later are left out
    while they hold their defaults, so older journals still resume: a full-precision
    cell (``kv_quant == "none"``, ``kv_bits`` None) keys as before those fields
    existed, one with the reuse stage off (``reuse == "-"``) also as before
    ``Cell.reuse`` did, and an unrotated one as before ``Cell.kv_rotate``."""
    fields = dataclasses.astuple(cell)
    if cell.kv_rotate:
        return json.dumps(fields)
    fields = fields[:-1]  # kv_rotate off keys as before the field
    base, (kv_quant, kv_bits, reuse) = fields[:-3], fields[-3:]
    if kv_quant != "none" or kv_bits is not None:
        return json.dumps(fields)
    return json.dumps(base if reuse == "-" else base + (reuse,))


# ----------------------------------------------------------------------------- output
def _fmt(v):
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def write_csv(rows, path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[c for c in rows[0] if c != PER_EXAMPLE], extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def markdown_table(rows) -> str:
    cols = [c for c in rows[0] if c != PER_EXAMPLE]
    return md_table(cols, [[_fmt(r.get(c, "-")) for c in cols] for r in rows])


def pivot_table(rows, metric: str, task: str) -> str:
    """``metric`` of the no-repair cells of ``task``: one row per method, one
    column per (layout, budget); the full cache spans every column."""
    rows = [r for r in rows if r["task"] == task and r["repair_policy"] == "none" and r.get("kv_quant", "none") == "none"]
    cols = sorted({(r["layout"], r["budget"]) for r in rows if r["method"] != "full"})
    full = [r for r in rows if r["method"] == "full"]
    table = [["full cache"] + [_fmt(full[0][metric]) for _ in cols]] if full else []
    for method in dict.fromkeys(r["method"] for r in rows if r["method"] != "full"):
        by = {(r["layout"], r["budget"]): r[metric] for r in rows if r["method"] == method}
        table.append([method] + [_fmt(by[c]) if c in by else "" for c in cols])
    return md_table(["method"] + [f"{layout} B={b}" for layout, b in cols], table)


def _paired(a, b):
    """``(gain, low, high)`` of ``a``'s pooled accuracy over ``b``'s on the same
    examples (``eval.common.stats.paired_gain``: paired bootstrap 95% interval over
    examples); None when a row lacks per-example counts (an older journal)."""
    if PER_EXAMPLE not in a or PER_EXAMPLE not in b:
        return None
    ea, eb = a[PER_EXAMPLE], b[PER_EXAMPLE]
    if ea["scored"] != eb["scored"]:
        raise ValueError(f"{a['method']} and {b['method']} were not scored on the same turns")
    return paired_gain(ea["correct"], eb["correct"], ea["scored"])


def _gain_text(g) -> str:
    return "-" if g is None else f"{g[0]:+.3f} [{g[1]:+.3f}, {g[2]:+.3f}]"


def comparison(rows, task: str, reference: str = "best", focus: str | None = None) -> list[dict]:
    """Per (layout, budget) column of ``task``'s no-repair cells: the reference cell
    (``"best"``: the most accurate of ``BASELINES`` in that column; else the named
    method) and, for every method (the full cache included), its accuracy, its share of
    the full cache's, and its paired gain over the reference. With ``focus``, also its
    gain over every baseline of the column (``focus_gains``)."""
    rows = [r for r in rows if r["task"] == task and r["repair_policy"] == "none" and r.get("reuse", "-") == "-"]
    full = next((r for r in rows if r["method"] == "full"), None)
    out = []
    for layout, budget in sorted({(r["layout"], r["budget"]) for r in rows if r["method"] != "full"}):
        col = [r for r in rows if (r["layout"], r["budget"]) == (layout, budget)]
        if reference == "best":
            base = [r for m in BASELINES for r in col if r["method"] == m]
            ref = max(base, key=lambda r: r["accuracy"]) if base else None  # ties: first in BASELINES
        else:
            ref = next((r for r in col if r["method"] == reference), None)
        if ref is None:
            continue
        entries = [
            {
                "row": r,
                "gain": _paired(r, ref) if r is not ref else None,
                "share": r["accuracy"] / full["accuracy"] if full and full["accuracy"] else None,
            }
            for r in ([full] if full else []) + col
        ]
        focus_row = next((r for r in col if r["method"] == focus), None)
        focus_gains = {r["method"]: _paired(focus_row, r) for m in BASELINES for r in col if r["method"] == m} if focus_row else {}
        out.append(
            {"layout": layout, "budget": budget, "reference": ref, "entries": entries, "focus": focus_row, "focus_gains": focus_gains}
        )
    return out


def comparison_markdown(rows, task: str, reference: str = "best", focus: str | None = None) -> str:
    """``comparison`` as markdown: one table per column (accuracy, share of the full
    cache, gain over the reference [95% CI], peak request tokens, peak live KV, raw and
    effective KV reads), then the focus method against each baseline."""
    what = "the best baseline" if reference == "best" else reference
    lines = [
        f"Gain = accuracy − {what}'s on the same examples, with a paired bootstrap 95% interval over "
        f"examples (`eval.common.stats.paired_gain`); baselines: {', '.join(BASELINES)}.",
        "",
    ]
    for c in comparison(rows, task, reference, focus):
        ref = c["reference"]
        table = []
        for e in c["entries"]:
            r = e["row"]
            name = "full cache" if r["method"] == "full" else r["method"]
            gain = "reference" if r is ref else _gain_text(e["gain"])
            share = "-" if e["share"] is None else f"{e['share']:.3f}"
            table.append(
                [
                    name,
                    f"{r['accuracy']:.3f}",
                    share,
                    gain,
                    f"{r['peak_request_tokens']:.0f}",
                    f"{r['peak_live_kv']:.0f}",
                    f"{r['raw_kv_reads']:.0f}",
                    f"{r['effective_kv_reads']:.0f}",
                ]
            )
        lines += [
            f"### {task}, {c['layout']}, B = {c['budget']}: reference {ref['method']} ({ref['accuracy']:.3f})",
            "",
            md_table(
                [
                    "method",
                    "accuracy",
                    "of full cache",
                    "gain vs reference [95% CI]",
                    "peak request tokens",
                    "peak live KV",
                    "raw KV reads",
                    "effective KV reads",
                ],
                table,
                align="lrrrrrrr",
            ),
        ]
        if c["focus_gains"]:
            gains = c["focus_gains"]
            paired = {m: g for m, g in gains.items() if g is not None}
            unpaired = [m for m in gains if m not in paired]
            verdict = "no" if any(g[1] <= 0 for g in paired.values()) else "yes" if not unpaired else "not decided"
            lines += [
                "",
                f"{focus} against each baseline: "
                + "; ".join(f"{m} {_gain_text(g)}" for m, g in gains.items())
                + f". Above every baseline with the interval clear of zero: **{verdict}**"
                + (f" (no per-example counts for {', '.join(unpaired)}: cells from an older journal)." if unpaired else "."),
            ]
        lines.append("")
    return "\n".join(lines)


def paired_nll_difference(a: list, b: list, *, seed=0) -> tuple[float, float, float]:
    """``a``'s token-weighted NLL increase minus ``b``'s on the same examples, with a
    paired percentile bootstrap 95% interval over examples. ``a``, ``b``: per-example
    fidelity dicts (``fidelity_of``: ``tokens``, ``dnll``)."""
    if len(a) != len(b):
        raise ValueError("fidelity of different example lists")
    ta, da, tb, db = (np.asarray([f[k] for f in x], np.float64) for x, k in ((a, "tokens"), (a, "dnll"), (b, "tokens"), (b, "dnll")))
    return paired_ratio_difference(da, ta, db, tb, seed=seed)


def fidelity_comparison_markdown(rows, task: str) -> str:
    """Per (layout, budget) column of ``task``'s no-repair cells: every method's NLL
    increase and KL over the full cache on the turns after its compression events,
    and its NLL increase minus that of the best baseline (the lowest of
    ``BASELINES``) with a paired bootstrap 95% interval over examples."""
    rows = [
        r
        for r in rows
        if r["task"] == task
        and r["repair_policy"] == "none"
        and r.get("reuse", "-") == "-"
        and r["method"] != "full"
        and isinstance(r.get("nll_increase"), float)
        and "fidelity" in r.get(PER_EXAMPLE, {})
    ]
    lines = [
        "NLL increase = mean NLL of the recorded assistant tokens after a compression event, managed minus full "
        "cache (nats/token); Δ = minus the best baseline's on the same examples (negative: closer to the full "
        f"cache), paired bootstrap 95% interval over examples; baselines: {', '.join(BASELINES)}.",
        "",
    ]
    for layout, budget in sorted({(r["layout"], r["budget"]) for r in rows}, key=str):
        col = [r for r in rows if (r["layout"], r["budget"]) == (layout, budget)]
        base = [r for m in BASELINES for r in col if r["method"] == m]
        if not base:
            continue
        ref = min(base, key=lambda r: r["nll_increase"])
        table = []
        for r in sorted(col, key=lambda r: r["nll_increase"]):
            if r is ref:
                gain = "reference"
            else:
                d = paired_nll_difference(r[PER_EXAMPLE]["fidelity"], ref[PER_EXAMPLE]["fidelity"])
                gain = f"{d[0]:+.4f} [{d[1]:+.4f}, {d[2]:+.4f}]"
            table.append([r["method"], f"{r['nll_increase']:+.4f}", f"{r['kl']:.4f}", gain, r["fidelity_tokens"], f"{r['accuracy']:.3f}"])
        lines += [
            f"### {task}, {layout}, B = {budget}: best baseline {ref['method']} ({ref['nll_increase']:+.4f})",
            "",
            md_table(
                ["method", "NLL increase", "KL per token", "Δ NLL vs best baseline [95% CI]", "tokens", "accuracy"], table, align="lrrrrr"
            ),
            "",
        ]
        lines += head_verdict(col, ref)
    return "\n".join(lines)


HEAD, HEAD_RULE = "intentkv", "intentkv_memory"  # IntentKV's learned head and the rule it corrects


def head_verdict(col: list, ref: dict) -> list[str]:
    """Issue #27's verdict in one (layout, budget) column where the learned head ran:
    the head minus its rule (paired, the minimum) and whether it has the lowest NLL
    increase of every method with its interval against the best baseline clear of
    zero (the goal), among the methods in the column (``--report-only`` lists the
    grid's cells not run yet)."""
    head = next((r for r in col if r["method"] == HEAD), None)
    if head is None:
        return []
    rule = next((r for r in col if r["method"] == HEAD_RULE), None)
    lines = []
    if rule is not None:
        d, lo, hi = paired_nll_difference(head[PER_EXAMPLE]["fidelity"], rule[PER_EXAMPLE]["fidelity"])
        beats = "beats its rule" if hi < 0 else ("loses to its rule" if lo > 0 else "does not separate from its rule")
        lines.append(f"- Minimum: the head minus `{HEAD_RULE}`: {d:+.4f} [{lo:+.4f}, {hi:+.4f}]: the head {beats}.")
    d, lo, hi = paired_nll_difference(head[PER_EXAMPLE]["fidelity"], ref[PER_EXAMPLE]["fidelity"])
    lowest = min(col, key=lambda r: r["nll_increase"])["method"] == HEAD
    met = lowest and hi < 0
    lines.append(
        f"- Goal: the head minus the best baseline (`{ref['method']}`): {d:+.4f} [{lo:+.4f}, {hi:+.4f}]; "
        + (
            "met (lowest of all methods, interval below zero)."
            if met
            else f"not met ({'lowest, but the interval includes zero' if lowest else 'not the lowest NLL increase'})."
        )
    )
    if rule is None:
        lines.append(f"- Minimum: `{HEAD_RULE}` is not in this column yet.")
    return lines + [""]


def stored_bits_of(row, float_row=None) -> float:
    """A cell's stored bits per element (``jaxkv.cache.quantized_host.stored_bits``:
    8 * bytes / elements, scales, zero points and float rows included). Rows
    journaled before the ``stored_bits`` column get it from their bytes per token,
    the float pool's row of the same model giving the elements per token (its
    bytes count bf16, 2 bytes an element); NaN without one."""
    from jaxkv.cache.quantized_host import stored_bits

    if isinstance(row.get("stored_bits"), float):
        return row["stored_bits"]
    if float_row is None:
        return float("nan")
    return stored_bits(row["kv_bytes_per_token"], float_row["kv_bytes_per_token"] / 2)


def quant_table(rows, task: str) -> str:
    """Accuracy, bits and bytes per KV precision of ``task``'s no-repair cells, with
    the capacity ratio against bf16 (same bytes budget, tokens held); with
    ``--fidelity`` also each cell's NLL increase over the full cache on the float
    pool, with a paired bootstrap 95% interval over examples (``quant_nll_increase``),
    and its KL per token."""
    rows = [r for r in rows if r["task"] == task and r["repair_policy"] == "none"]
    full = {(r["method"], r["budget"], r["layout"]): r for r in rows if r["kv_quant"] == "none"}
    fidelity = any(isinstance(r.get("nll_increase"), float) for r in rows)
    header = [
        "method",
        "budget",
        "layout",
        "kv_quant",
        "kv_bits",
        "rotation",
        "accuracy",
        "Δ vs none",
        "code bits",
        "stored bits",
        "KV bytes/token",
        "capacity vs bf16",
    ]
    table = []
    for r in rows:
        base = full.get((r["method"], r["budget"], r["layout"]))
        delta = "" if base is None else f"{100 * (r['accuracy'] - base['accuracy']):+.1f}"
        bf16 = base["kv_bytes_per_token"] if base is not None else float("nan")
        row = [
            r["method"],
            r["budget"],
            r["layout"],
            r["kv_quant"],
            r["kv_bits"],
            r.get("kv_rotate", "off"),
            _fmt(r["accuracy"]),
            delta,
            f"{r['avg_bits']:.2f}",
            f"{stored_bits_of(r, base):.2f}",
            f"{r['kv_bytes_per_token']:.0f}",
            f"{bf16 / r['kv_bytes_per_token']:.2f}x",
        ]
        if fidelity:
            d = quant_nll_increase(r)
            row += [f"{d[0]:+.4f} [{d[1]:+.4f}, {d[2]:+.4f}]", f"{r['kl']:.4f}"] if d is not None else ["-", "-"]
        table.append(row)
    if fidelity:
        header += ["NLL increase [95% CI]", "KL per token"]
    return md_table(header, table, align="llllll" + "r" * (len(header) - 6))


def quant_nll_increase(row) -> tuple[float, float, float] | None:
    """A cell's NLL increase over the reference (the full cache on the float pool,
    whose own increase is 0 on every example) with a paired percentile bootstrap
    95% interval over examples (``paired_nll_difference``), or None without
    per-example fidelity."""
    per = [f for f in row.get(PER_EXAMPLE, {}).get("fidelity") or () if f is not None]  # None: a replay that did not complete
    if not isinstance(row.get("nll_increase"), float) or not per:
        return None
    return paired_nll_difference(per, [{"tokens": max(f["tokens"], 1), "dnll": 0.0} for f in per])


def prefix_summary(rows) -> str:
    """Prefix-hit rate per layout (mean over methods and budgets) next to full cache."""
    out = []
    for task in sorted({r["task"] for r in rows}):
        parts = []
        for layout in ("-", "dead_slot", "compact"):
            vals = [
                r["prefix_hit_rate"]
                for r in rows
                if r["task"] == task and r["layout"] == layout and r["repair_policy"] == "none" and r.get("kv_quant", "none") == "none"
            ]
            if vals:
                parts.append(f"{'full cache' if layout == '-' else layout} {np.mean(vals):.3f}")
        out.append(f"prefix-hit rate on {task}: " + ", ".join(parts))
    return "\n".join(out)


def plot(rows, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    quant_rows = [r for r in rows if r.get("kv_quant", "none") != "none"]
    rows = [r for r in rows if r.get("kv_quant", "none") == "none"]
    repair_rows = [r for r in rows if r["repair_policy"] != "none"]
    rows = [r for r in rows if r["repair_policy"] == "none"]
    paths = plot_repair(repair_rows, rows, out_dir, plt) if repair_rows else []
    if quant_rows:
        paths.append(plot_quant(quant_rows, rows, out_dir, plt))
    for metric, fname, ylabel in (
        ("accuracy", "accuracy_vs_budget.png", "exact-match accuracy"),
        ("raw_kv_reads", "kv_reads_vs_budget.png", "KV reads per example (tokens)"),
    ):
        tasks = sorted({r["task"] for r in rows})
        if not tasks:  # only quantized cells: their plot is accuracy_vs_kv_bits.png
            continue
        layouts = sorted({r["layout"] for r in rows if r["layout"] != "-"}) or ["-"]
        fig, axes = plt.subplots(len(tasks), len(layouts), figsize=(6 * len(layouts), 4 * len(tasks)), squeeze=False)
        for i, task in enumerate(tasks):
            for j, layout in enumerate(layouts):
                ax = axes[i][j]
                budgets = sorted({r["budget"] for r in rows if r["budget"] != "-"})
                for method in sorted({r["method"] for r in rows if r["method"] != "full"}):
                    pts = sorted(
                        (r["budget"], r[metric]) for r in rows if r["task"] == task and r["layout"] == layout and r["method"] == method
                    )
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
                    if metric == "raw_kv_reads":
                        eff = sorted(
                            (r["budget"], r["effective_kv_reads"])
                            for r in rows
                            if r["task"] == task and r["layout"] == layout and r["method"] == method
                        )
                        if eff:
                            ax.plot([p[0] for p in eff], [p[1] for p in eff], linestyle=":", color=ax.lines[-1].get_color())
                for r in rows:
                    if r["method"] == "full" and r["task"] == task:
                        ax.axhline(r[metric], color="black", linestyle="--", label="full cache")
                ax.set_title(f"{task}, {layout}" + (" (solid raw, dotted effective)" if metric == "raw_kv_reads" else ""))
                ax.set_xlabel("budget B (tokens)")
                ax.set_ylabel(ylabel)
                if budgets:
                    ax.set_xscale("log", base=2)
                ax.grid(alpha=0.3)
                ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / fname
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_quant(quant_rows, base_rows, out_dir: Path, plt) -> Path:
    """Accuracy vs stored KV bits per task: one marker per precision mode (a line
    for a triaxial budget sweep), full precision as a dashed line."""
    tasks = sorted({r["task"] for r in quant_rows})
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        base = next((r for r in base_rows if r["task"] == task and r["method"] == "full"), None)
        for mode in dict.fromkeys(r["kv_quant"] for r in quant_rows):
            pts = sorted(
                (stored_bits_of(r, base), r["accuracy"])
                for r in quant_rows
                if r["task"] == task and r["kv_quant"] == mode and r["method"] == "full"
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        for r in base_rows:
            if r["task"] == task and r["method"] == "full":
                ax.axhline(r["accuracy"], color="black", linestyle="--", label="full precision")
        ax.set_title(f"{task}: full cache, KV precision")
        ax.set_xlabel("stored bits per KV element (scales and zero points included)")
        ax.set_ylabel("exact-match accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "accuracy_vs_kv_bits.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_repair(repair_rows, base_rows, out_dir: Path, plt) -> list[Path]:
    """Accuracy vs repair budget K, one panel per (task, method, B_base): each
    repair policy, the matched no-repair cell (B_base + K), the no-repair cell at
    B_base and the full cache (the layout of RepairKV's Figure 2)."""
    panels = sorted({(r["task"], r["method"], r["base_budget"]) for r in repair_rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (task, method, base) in zip(axes[0], panels):
        for policy in sorted({r["repair_policy"] for r in repair_rows}):
            pts = sorted(
                (r["repair_k"], r["accuracy"])
                for r in repair_rows
                if (r["task"], r["method"], r["base_budget"], r["repair_policy"]) == (task, method, base, policy)
            )
            style = dict(linestyle="--", color="gray") if policy == "matched" else {}
            ax.plot(
                [p[0] for p in pts], [p[1] for p in pts], marker="o", label="matched no-repair" if policy == "matched" else policy, **style
            )
        for r in base_rows:
            if r["task"] == task and r["method"] == "full":
                ax.axhline(r["accuracy"], color="black", linestyle="--", label="full cache")
            if (r["task"], r["method"], r["budget"], r["layout"]) == (task, method, base, "dead_slot"):
                ax.axhline(r["accuracy"], color="red", linestyle=":", label=f"no repair (B={base})")
        ax.set_title(f"{task}: {method}, B_base={base}")
        ax.set_xlabel("repair budget K (rows)")
        ax.set_ylabel("exact-match accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "repair_accuracy_vs_k.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


# ----------------------------------------------------------------------------- CLI
QUICK = dict(n=2, length=1024, budgets="256,512", max_new_tokens=48)


def build_parser(parser=None):
    p = parser or argparse.ArgumentParser(prog="jaxkv eval", description=__doc__.splitlines()[0])
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint folder, repo id, reference model name or 'embedded' (default: 'embedded' "
        "for the synthetic tasks, smollm2-135m-instruct for the real-model ones)",
    )
    p.add_argument(
        "--task",
        default="agent",
        help="agent, mqniah, shared_docs, or a comma list; or a real-model task "
        "(passkey, niah, niah_<variant>, lm, multiq: eval.quality.real_model with --context, --ratios, --settings)",
    )
    p.add_argument("--context", type=int, default=2048, help="real-model tasks: the compressed request's tokens")
    p.add_argument("--ratios", default="0.25,0.5,0.75", help="real-model tasks: kvpress compression ratios (fraction removed)")
    p.add_argument("--settings", default=None, help="real-model tasks: aware,agnostic")
    p.add_argument("--methods", default=",".join(ALL_METHODS))
    p.add_argument(
        "--budgets", default="256,512,1024", help="live KV tokens, or fractions in (0, 1) of each example's rendered length (0.5,0.65)"
    )
    p.add_argument("--layouts", default="dead_slot,compact")
    p.add_argument("--n", type=int, default=100, help="examples per cell")
    p.add_argument("--length", type=int, default=2048, help="target tokens per conversation")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="example seed base (default: jaxkv.tasks.seeds.EVAL_SEED_BASE for the synthetic "
        "tasks, jaxkv.tasks.haystack's for the real-model ones)",
    )
    p.add_argument("--needles", type=int, default=4, choices=(2, 4, 6, 8), help="MQ-NIAH needles per document (task mqniah)")
    p.add_argument("--out", default="eval/results/harness")
    p.add_argument("--repair-ks", default="", help="repair budgets K (RepairKV): adds repair and matched cells")
    p.add_argument("--repair-policies", default="repairkv", help=f"comma list of {', '.join(REPAIR_POLICIES)}")
    p.add_argument("--kv-quant", default="none", help=f"KV precision modes, comma list of {', '.join(KV_QUANTS)}")
    p.add_argument("--kv-bits", default="", help="average-bit budgets B of the triaxial modes (default: the calibrated B)")
    p.add_argument(
        "--kv-rotate", default="off", help="off, on or off,on: quantized pools store K/V rotated (jaxkv.cache.rotation), per cell"
    )
    p.add_argument(
        "--kv-allocation",
        default=None,
        help="a TriAxialKV allocation JSON every triaxial cell uses instead of the model's calibration (e.g. a pinned one, "
        "jaxkv.policies.quant_allocation); cells are keyed as without it, so give each allocation its own --out",
    )
    p.add_argument("--reuse", default="-", help=f"cross-query reuse modes, a comma list of {', '.join(REUSE_MODES)} ('-': stage off)")
    p.add_argument("--workers", type=int, default=1, help="processes replaying cells in parallel (up to the core count)")
    p.add_argument("--resume", action="store_true", help="skip cells already recorded in OUT/cells.jsonl for the same setup")
    p.add_argument(
        "--compare-to",
        default=None,
        help="add paired-bootstrap comparisons to results.md: 'best' (the best baseline per budget) or a method",
    )
    p.add_argument("--focus", default=None, help="with --compare-to: also this method's gain over every baseline")
    p.add_argument(
        "--report-only", action="store_true", help="with --resume: write the report from the cells already in the journal, run none"
    )
    p.add_argument(
        "--accuracy",
        choices=("greedy", "teacher"),
        default="greedy",
        help="greedy: generate each scored turn and match it; teacher: no generation, a turn counts when every "
        "recorded reply token is the argmax of its teacher-forced row (what greedy would reproduce exactly)",
    )
    p.add_argument(
        "--fidelity",
        action="store_true",
        help="also teacher-force the recorded turns: NLL increase and KL against the full cell after each "
        "compression event (needs the method full; its cells run first)",
    )
    p.add_argument("--quick", action="store_true", help=f"small preset: {QUICK}")
    return p


def add_command(subparsers) -> None:
    """The ``jaxkv eval`` sub-command (entry point ``jaxkv.commands``)."""
    e = subparsers.add_parser("eval", help="evaluate retention methods x budgets x layouts on generated tasks")
    build_parser(e)
    e.set_defaults(func=_cmd_eval)


def _cmd_eval(args) -> int:
    if not _real_model_task(args):
        run(args)
    return 0


# Options of the synthetic tasks' grid that a real-model task has no use for: given
# with one, they are an error, not silently dropped.
SYNTHETIC_ONLY = (
    "budgets",
    "layouts",
    "length",
    "needles",
    "repair_policies",
    "reuse",
    "workers",
    "compare_to",
    "focus",
    "report_only",
    "accuracy",
    "fidelity",
    "quick",
)


def _real_model_task(args) -> bool:
    """Hand a real-model task (``eval.quality.real_model``) its grid: every method at
    kvpress's ratios, each cell branched from one prefill; with ``--kv-quant``, the
    full cache on the float pool and on each format. Returns whether it did.

    The grid starts from ``real_model``'s own defaults (its ``build_parser``), so an
    option this command does not set keeps the value ``python -m
    eval.quality.real_model`` gives it."""
    from eval.quality import real_model
    from jaxkv.errors import ConfigError

    tasks = [t.strip() for t in str(args.task).split(",") if t.strip()]
    real = [t for t in tasks if t in real_model.REAL_TASKS]
    if not real:
        return False
    if len(tasks) > 1:
        raise ConfigError(f"a real-model task runs alone: --task {args.task!r} lists {', '.join(tasks)}")
    model = args.model or real_model.DEFAULT_MODEL
    if model == "embedded":
        raise ConfigError(
            f"task {tasks[0]!r} needs a pretrained model's tokenizer and chat template; "
            f"pass --model {real_model.DEFAULT_MODEL} (or another checkpoint)"
        )
    defaults = build_parser().parse_args([])
    unused = [f"--{name.replace('_', '-')}" for name in SYNTHETIC_ONLY if getattr(args, name) != getattr(defaults, name)]
    if unused:
        raise ConfigError(f"{', '.join(unused)} set the synthetic tasks' grid ({', '.join(TASKS)}); task {tasks[0]!r} does not use them")
    if args.n < 1:
        raise ValueError("--n must be positive")
    methods = [m for m in _names(args.methods, None, "methods") if m != "full"]  # the full cache is always a cell
    if args.methods == defaults.methods:
        methods = list(real_model.METHODS)
    formats = [f for f in _names(args.kv_quant, KV_QUANTS, "kv_quant modes") if f != "none"]
    bits = [b.strip() for b in str(args.kv_bits).split(",") if b.strip()]
    if bits:  # the triaxial modes at each budget (format spec mode@B); the others have one
        formats = list(dict.fromkeys(f"{f}@{b}" if f.startswith("triaxial") else f for f in formats for b in bits))
    repair_ks = [int(k) for k in str(args.repair_ks).split(",") if k.strip()]
    if len(repair_ks) > 1:
        raise ConfigError(f"task {tasks[0]!r} runs one repair budget K per run, got --repair-ks {args.repair_ks}")
    grid = real_model.build_parser().parse_args([])
    if repair_ks:  # the trio's method and ratio: the one --methods and --ratios name (else real_model's defaults)
        ratios = [r for r in str(args.ratios).split(",") if r.strip()]
        if args.methods != defaults.methods and len(methods) != 1 or len(ratios) != 1 and args.ratios != defaults.ratios:
            raise ConfigError(
                f"--repair-ks runs RepairKV's trio for one method at one ratio; got --methods {args.methods} --ratios {args.ratios}"
            )
        grid.repair_method = methods[0] if args.methods != defaults.methods else grid.repair_method
        grid.repair_ratio = float(ratios[0]) if args.ratios != defaults.ratios else grid.repair_ratio
    vars(grid).update(
        model=model,
        task=tasks[0],
        context=args.context,
        n=args.n,
        ratios=args.ratios,
        methods=",".join(methods),
        settings=args.settings,
        seed=args.seed,
        out=Path(args.out),
        resume=args.resume,
        kv_quant=",".join(formats) or None,
        repair=repair_ks[0] if repair_ks else None,
        max_new=args.max_new_tokens if args.max_new_tokens != defaults.max_new_tokens else grid.max_new,
    )
    real_model.run_grid(grid)
    journal = "sessions.jsonl" if grid.repair is not None else "quant.jsonl" if grid.kv_quant else "examples.jsonl"
    from eval.quality.real_model_report import run_report

    print(run_report(grid.out, model))
    plots = ", ".join(p.name for p in sorted(grid.out.glob("*.png")))
    print(
        f"wrote {grid.out / journal}, {grid.out / 'results.md'}, {grid.out / 'results.csv'}"
        + (f" and {plots}" if plots else "")
        + f"; the same report again: python -m eval.quality.real_model_report --out {grid.out} --model {model}"
    )
    return True


def _names(text, allowed, what):
    names = [x.strip() for x in str(text).split(",") if x.strip()]
    bad = [x for x in names if allowed is not None and x not in allowed]
    if bad or not names:
        from jaxkv.errors import ConfigError

        known = ", ".join(allowed) if allowed is not None else "a non-empty comma list"
        raise ConfigError(f"unknown {what} {bad or text!r}; known: {known}")
    return names


def run(args, model=None) -> list[dict]:
    """Run the grid ``args`` asks for (see ``build_parser``); ``model``: an already
    loaded ``jaxkv.Model`` (a dtype, a mesh) to use instead of loading ``args.model``
    (which then only names it in the outputs; ``--workers`` processes load the name)."""
    import jaxkv
    from jaxkv.policies import REGISTRY
    from jaxkv.policies.layouts import LAYOUTS
    from tqdm import tqdm

    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    if args.model is None:
        args.model = "embedded"
    if args.seed is None:
        args.seed = EVAL_SEED_BASE
    methods = _names(args.methods, ("full",) + tuple(sorted(REGISTRY)), "methods")
    layouts = _names(args.layouts, LAYOUTS, "layouts")
    tasks = _names(args.task, TASKS, "tasks")
    budgets = parse_budgets(args.budgets)
    if any(isinstance(b, float) for b in budgets) and str(args.repair_ks).strip():
        raise ValueError("--repair-ks adds K tokens to a budget: give budgets as token counts, not fractions")
    if args.n < 1:
        raise ValueError("--n must be positive")
    if args.workers < 1:
        raise ValueError(f"--workers must be at least 1, got {args.workers}")
    try:
        repair_ks = [int(k) for k in str(args.repair_ks).split(",") if k.strip()]
    except ValueError:
        raise ValueError(f"--repair-ks must be integers, got {args.repair_ks!r}") from None
    if any(k < 1 for k in repair_ks):
        raise ValueError("--repair-ks must be positive")
    repair_policies = _names(args.repair_policies, REPAIR_POLICIES, "repair policies")
    kv_quants = _names(args.kv_quant, KV_QUANTS, "kv_quant modes")
    try:
        kv_bits = [float(b) for b in str(args.kv_bits).split(",") if b.strip()]
    except ValueError:
        raise ValueError(f"--kv-bits must be numbers, got {args.kv_bits!r}") from None
    if any(not 2.0 <= b <= 4.0 for b in kv_bits):
        raise ValueError("--kv-bits must be average bits in [2, 4]")
    reuses = _names(args.reuse, ("-",) + REUSE_MODES, "reuse modes")
    kv_rotates = [{"off": False, "on": True}[x] for x in _names(args.kv_rotate, ("off", "on"), "--kv-rotate settings")]
    if getattr(args, "kv_allocation", None) and any(q != "none" and not q.startswith("triaxial") for q in kv_quants):
        raise jaxkv.ConfigError("--kv-allocation applies to the triaxial modes: run the other --kv-quant modes without it")
    for flag, name in (("--compare-to", args.compare_to), ("--focus", args.focus)):
        if name is not None and name not in methods + (["best"] if flag == "--compare-to" else []):
            raise ValueError(f"{flag} {name!r} must be {'best or ' if flag == '--compare-to' else ''}one of the methods run")
    model = model if model is not None else jaxkv.load_model(args.model)
    if model.tokenizer is None:
        raise jaxkv.ConfigError(f"{args.model} has no tokenizer; the harness renders chats")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    examples = {t: make_examples(t, args.n, args.length, args.seed, args.needles) for t in tasks}
    cells = grid(methods, budgets, layouts, tasks, repair_ks, repair_policies, kv_quants, kv_bits, reuses, kv_rotates)
    total = sum(len(examples[c.task]) for c in cells)
    max_positions = int(
        min(model.config.max_position_embeddings, 1 << math.ceil(math.log2(max(2 * args.length + 4 * args.max_new_tokens, 1024))))
    )
    setup = dict(
        model=args.model,
        n=args.n,
        length=args.length,
        seed=args.seed,
        needles=args.needles,
        max_new_tokens=args.max_new_tokens,
        max_positions=max_positions,
    )
    fidelity = getattr(args, "fidelity", False)
    teacher = getattr(args, "accuracy", "greedy") == "teacher"
    if teacher:
        setup["accuracy"] = "teacher"  # a journal of greedy cells does not match
    if fidelity:
        if "full" not in methods:
            raise ValueError("--fidelity compares every cell with the full cache: add full to --methods")
        setup["fidelity"] = True  # a journal of cells without it does not match
    journal = out / "cells.jsonl"
    done = load_journal(journal, setup) if args.resume else {}
    if not args.resume and journal.exists():
        journal.unlink()
    todo = [c for c in cells if cell_key(c) not in done]
    if args.report_only:  # the report from the journal alone; unfinished cells are listed, not run
        if not args.resume:
            raise ValueError("--report-only reads the journal: pass --resume too")
        missing, cells, todo = todo, [c for c in cells if cell_key(c) in done], []
        if not cells:
            raise ValueError(f"--report-only: no finished cell of this grid in {journal}")
    with tqdm(
        total=total, initial=total - sum(len(examples[c.task]) for c in todo), desc="jaxkv eval", unit="example", file=sys.stderr
    ) as bar:
        if done:
            tqdm.write(f"--resume: {len(cells) - len(todo)} of {len(cells)} cells already in {journal}", file=sys.stderr)
        # with --fidelity the full cells on the float pool write the references every other cell reads: they run first
        passes = [[c for c in todo if is_reference(c)], [c for c in todo if not is_reference(c)]] if fidelity else [todo]
        options = {
            **({"fidelity": out / "fidelity"} if fidelity else {}),
            **({"accuracy": "teacher"} if teacher else {}),
            **({"kv_allocation": args.kv_allocation} if getattr(args, "kv_allocation", None) else {}),
        } or None
        for cells_now in passes:
            for cell, row in run_cells(model, examples, cells_now, setup, workers=args.workers, bar=bar, session_options=options):
                done[cell_key(cell)] = row
                append_journal(journal, {"setup": setup, "key": cell_key(cell), "row": row})
    rows = [done[cell_key(c)] for c in cells]
    write_csv(rows, out / "results.csv")
    md = [
        f"# jaxkv eval: {args.model}",
        "",
        f"n={args.n} per cell, length {args.length}, max_new_tokens {args.max_new_tokens}"
        + (", accuracy by teacher forcing (every recorded reply token the argmax; no generation)" if teacher else ""),
        "",
    ]
    if args.report_only and missing:
        md += [
            f"Not run (--report-only; {len(missing)} cells of the grid): "
            + ", ".join(f"{c.method}@{c.budget}/{c.layout}/{c.task}" for c in missing)
            + ".",
            "",
        ]
    for task in tasks:
        for metric in ("accuracy", "raw_kv_reads") + (("nll_increase", "kl") if fidelity else ()):
            md += [f"## {task}: {metric}", "", pivot_table(rows, metric, task), ""]
        if args.compare_to:
            md += [f"## {task}: paired comparison", "", comparison_markdown(rows, task, args.compare_to, args.focus), ""]
        if fidelity:
            md += [f"## {task}: fidelity against the best baseline", "", fidelity_comparison_markdown(rows, task), ""]
        if kv_quants != ["none"]:
            md += [f"## {task}: KV precision", "", quant_table(rows, task), ""]
    md += ["## All cells", "", markdown_table(rows), "", prefix_summary(rows), ""]
    (out / "results.md").write_text("\n".join(md))
    plot(rows, out)
    print(markdown_table(rows))
    print(prefix_summary(rows))
    print(f"wrote {out}/results.csv, results.md and plots " + ", ".join(p.name for p in sorted(out.glob("*.png"))))
    return rows


def main(argv=None) -> int:
    return _cmd_eval(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
