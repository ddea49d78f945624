"""RepairKV's matched-budget protocol on split-query MQ-NIAH (paper §4-5, Figure 2).

    JAX_PLATFORMS=cpu python -m eval.quality.repair_protocol --needles 2,4,6,8 \
        --ks 8,16,32,48,64,96,128 --n 100 --workers 2 --out eval/results/repair_mqniah

For each needle count: the examples (``jaxkv.tasks.mqniah``, held out from training)
are replayed turn by turn through ``jaxkv.Session`` as the harness does
(``train.replay.replay_example``: teacher-forced history, each answer generated
greedily and scored by exact match). The first-stage policy (``--first-stage``,
default SnapKV) compresses every request to the active budget on the dead-slot
layout; evicted rows go to the host tier. Cells:

* ``full``: the full cache;
* ``none``: no repair at ``B_base``;
* ``matched``: no repair at ``B_base + K`` (the same active-cache budget as a
  repaired cache);
* one cell per repair policy (``repairkv``, ``random``, ``oldest``, ``staleq``,
  ``wrongq``, ``refresh``) at ``B_base`` with ``repair=K``.

Score: exact match over the turns after the first (the turns that follow a
relevance shift; turn 1 is the same for every cell with the same active budget),
pooled over examples and turns. Repair cells also report their gain over matched
no-repair at the same K with a paired bootstrap 95% interval over examples.

Sharing turn 1: every repair cell of an example starts from the same turn 1 (the
first request has nothing shelved to repair, so K and the repair policy cannot
matter there). The driver replays turn 1 once per example at ``B_base`` and
``Session.fork``s that session for each (policy, K): the same result as replaying
each cell from scratch (``tests/test_repair_protocol.py`` checks it), about 4x
less work. WrongQ-K scores with another example's signal: example ``i`` uses the
turn-2 signal of example ``i - 1`` (example 0: the last one), whatever the order
or number of workers.

``B_base`` (``--base-budget``, or calibrated): the protocol needs a budget at which
matched no-repair is neither near the full cache nor near zero. Calibration runs
the full cache, and no repair at ``B + --calibrate-k`` (matched no-repair at the
paper's headline K = 96) for each candidate ``B`` in ``--candidates`` (fractions
of the shortest turn-1 request), on the first ``--calibrate-n`` examples, and
keeps the ``B`` whose accuracy is closest to half the full cache's.

Eviction inside the question: an MQ-NIAH document and its turn-1 question are one
user message, which ALGORITHMS.md §1 would protect as the actionable query; the
protocol's sessions run with ``protect_query=False`` (``train.replay.TASK_SESSION_OPTIONS``,
the harness does the same for its MQ-NIAH task) so the first event compresses
the document under the turn-1 question's signal (SnapKV's observation window is
the question), as the paper's first stage does. With a model that does not
solve the task with the full cache (accuracy below ``--min-full``) there is nothing
to repair: calibration raises ``ProtocolError`` naming the measured accuracy.

``--turns 5 --needles 8`` runs the repeated-shift schedule (paper §5.3).

Long runs: every finished example (all its cells) is appended to
``--out/examples.jsonl`` with the run's setup, and calibrations too; with
``--resume`` a rerun of the same setup skips what is there (without it, everything
is replayed again and the new lines supersede the old). ``--workers W`` replays
examples in W spawned processes. The report covers every complete setup in the
journal (the latest one per needle count, turn schedule and first stage), so runs
with different ``--needles``/``--first-stage``/``--turns`` into one ``--out``
build one report.

Outputs in ``--out``: ``results.csv`` (one row per cell), ``results.md`` (per
setup: accuracy by K and policy, next to matched, no-repair and full cache),
``repair_vs_k.png`` (one panel per setup, every policy) and ``figure2.png`` (the
layout of the paper's Figure 2: REPAIRKV solid, matched no-repair dotted, one
colour per needle count, gain at K = 96 labelled).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path

import numpy as np

from eval.common.stats import paired_gain
from jaxkv.markdown import md_table
from jaxkv.tasks.example import reply_matches
from jaxkv.tasks.seeds import EVAL_SEED_BASE
from train.journal import append_journal, read_journal
from train.replay import REPAIR_POLICIES, TASK_SESSION_OPTIONS, Cell, replay_cell, replay_example
from train.workers import pool_map

FIELDS = (
    "needles",
    "turns",
    "first_stage",
    "cell",
    "repair_k",
    "budget",
    "base_budget",
    "n",
    "accuracy",
    "accuracy_turn1",
    "completion",
    "gain_vs_matched",
    "gain_ci_low",
    "gain_ci_high",
)
PROTOCOL_SEED = EVAL_SEED_BASE + 700_000


class ProtocolError(ValueError):
    """The protocol cannot run meaningfully (e.g. the model fails with the full cache)."""


def score(model, examples, cell: Cell, *, max_new_tokens: int, max_positions: int, progress=None) -> dict:
    """Accuracy after turn 1 and on turn 1 over ``examples`` for one cell."""
    later, first, completed = [], [], 0
    for verdicts, done, _ in replay_cell(
        model, examples, cell, max_new_tokens=max_new_tokens, max_positions=max_positions, progress=progress
    ):
        first.append(verdicts[0])
        later += verdicts[1:]
        completed += done
    return {"accuracy": float(np.mean(later)), "accuracy_turn1": float(np.mean(first)), "completion": completed / len(examples)}


# ----------------------------------------------------------------------------- one example, every cell
def cell_names(ks, policies) -> list[str]:
    """Journal keys of an example's cells: ``full``, ``none``, ``matched@K``, ``policy@K``."""
    return ["full", "none"] + [f"{c}@{k}" for k in ks for c in ("matched", *policies)]


def _base_session(model, setup):
    """A fresh session at ``B_base`` with repair on (turn 1 never repairs: nothing
    is shelved before it, so K and the policy do not matter until it is forked)."""
    from jaxkv.serving import Session

    return Session(
        model,
        max_positions=setup["max_positions"],
        max_new_tokens=setup["max_new_tokens"],
        policy=setup["first_stage"],
        budget=setup["base_budget"],
        layout="dead_slot",
        repair=1,
        **TASK_SESSION_OPTIONS["mqniah"],
    )


def _replay(session, example, setup, *, start_turn: int, stop_turn: int | None = None, generate=True) -> dict:
    """Replay assistant turns ``[start_turn, stop_turn)`` (up to the last scored
    one); ``{message index: generated reply}``."""
    last_target = max(t.message_index for t in example.targets)
    at = [j for j, m in enumerate(example.messages) if m.get("role") == "assistant" and j <= last_target]
    last = at[(stop_turn or len(at)) - 1]
    turns = session.replay(
        example.messages[: last + 1],
        example.tools or None,
        generate=generate,
        max_new_tokens=setup["max_new_tokens"],
        start_turn=start_turn,
    )
    return {j: t.generated for j, t in zip(at[start_turn:], turns)}


def turn2_signal(model, example, setup):
    """The repair signal of ``example``'s second request at ``B_base`` (what WrongQ-K
    hands to the next example); the same in every repair cell (it is read before
    the repair)."""
    session = _base_session(model, setup)
    _replay(session, example, setup, start_turn=0, stop_turn=1, generate=False)
    return _signal_after_turn1(session, example, setup)


def _signal_after_turn1(session, example, setup):
    """``turn2_signal`` from a base session that has replayed turn 1 (left as is)."""
    probe = session.fork()
    _replay(probe, example, setup, start_turn=1, stop_turn=2, generate=False)
    return probe.repair_signal


def example_verdicts(model, example, setup, donor_signal) -> dict:
    """Every cell's per-turn verdicts on one example.

    Returns ``{"verdicts": {cell name: [bool per target]}, "incomplete": [cell
    names whose replay hit a context or memory error], "signal": this example's
    turn-2 repair signal}``.
    """
    import jaxkv

    kw = dict(max_new_tokens=setup["max_new_tokens"], max_positions=setup["max_positions"])
    stage, base = setup["first_stage"], setup["base_budget"]
    verdicts, incomplete = {}, []

    def plain(name, cell):
        v, done, _, _ = replay_example(model, example, cell, **kw)
        verdicts[name] = v
        if not done:
            incomplete.append(name)

    plain("full", Cell("full", None, None, "mqniah"))
    plain("none", Cell(stage, base, "dead_slot", "mqniah"))
    for k in setup["ks"]:
        plain(f"matched@{k}", Cell(stage, base + k, "dead_slot", "mqniah", "matched", k, base))

    repair_cells = [(p, k) for k in setup["ks"] for p in setup["policies"]]
    signal = None
    try:
        session = _base_session(model, setup)
        first = _replay(session, example, setup, start_turn=0, stop_turn=1)
        if any(r.promoted_positions.size for r in session.repairs):
            raise RuntimeError("turn 1 promoted rows: forks of it would not equal fresh replays")
        signal = _signal_after_turn1(session, example, setup)
        for policy, k in repair_cells:
            twin = session.fork(repair=k, repair_policy=policy, repair_wrong_signal=donor_signal if policy == "wrongq" else None)
            replies = {**first, **_replay(twin, example, setup, start_turn=1)}
            verdicts[f"{policy}@{k}"] = [reply_matches(t, replies[t.message_index]) for t in example.targets]
    except (jaxkv.ContextLengthError, jaxkv.OutOfSlotsError):
        for policy, k in repair_cells:
            verdicts[f"{policy}@{k}"] = [False] * len(example.targets)
            incomplete.append(f"{policy}@{k}")
    return {"verdicts": verdicts, "incomplete": incomplete, "signal": signal}


def _chunk_job(model, job, progress):
    """Worker job: consecutive examples; the first one's WrongQ donor is recomputed."""
    setup, first_index, examples, donor_example = job
    donor = turn2_signal(model, donor_example, setup)
    out = []
    for i, example in enumerate(examples):
        record = example_verdicts(model, example, setup, donor)
        donor = record.pop("signal")
        out.append((first_index + i, record))
        if progress is not None:
            progress(1)
    return out


def _score_job(model, job, progress):
    examples, cell, kw = job
    return score(model, examples, cell, progress=progress, **kw)


def calibrate(
    model,
    examples,
    first_stage: str,
    candidates,
    full_accuracy: float,
    min_full: float,
    *,
    reference_k: int = 96,
    workers: int = 1,
    model_name: str | None = None,
    bar=None,
    **kw,
) -> tuple[int, list]:
    """``(B_base, [(B, accuracy), ...])``: the candidate ``B`` whose matched no-repair
    accuracy at ``reference_k`` (no repair at ``B + reference_k``) is closest to
    half of ``full_accuracy`` (see the module docstring)."""
    if full_accuracy < min_full:
        raise ProtocolError(
            f"full-cache accuracy after turn 1 is {full_accuracy:.3f} (< {min_full}): the model does not "
            "solve the task even without eviction, so no budget separates repair from no repair"
        )
    jobs = [(examples, Cell(first_stage, b + reference_k, "dead_slot", "mqniah"), kw) for b in candidates]
    tried = sorted(
        (job[1].budget - reference_k, r["accuracy"])
        for job, r in pool_map(_score_job, jobs, model_name, workers=workers, model=model, bar=bar)
    )
    best = min(tried, key=lambda bt: (abs(bt[1] - full_accuracy / 2), -bt[0]))
    return best[0], tried


# ----------------------------------------------------------------------------- journal -> rows
def load_records(path: Path) -> tuple[dict, list]:
    """``({calibration setup: record}, [(setup, {index: example record})])`` from a
    journal; one entry per distinct example setup, in first-seen order."""
    calibrations, examples = {}, {}
    for rec in read_journal(path):
        key = json.dumps(rec.get("setup"), sort_keys=True)
        if "calibration" in rec:
            calibrations[key] = rec
        elif "index" in rec:
            examples.setdefault(key, (rec["setup"], {}))[1][rec["index"]] = rec
    return calibrations, list(examples.values())


def setup_rows(setup: dict, records: dict) -> list[dict]:
    """Result rows (``FIELDS``) of one complete setup from its example records."""
    order = sorted(records)
    n = len(order)
    later = {
        name: np.asarray([sum(records[i]["verdicts"][name][1:]) for i in order]) for name in cell_names(setup["ks"], setup["policies"])
    }
    first = {name: np.asarray([records[i]["verdicts"][name][0] for i in order]) for name in later}
    turns_E = np.asarray([len(records[i]["verdicts"]["full"]) - 1 for i in order])
    done = {name: 1 - sum(name in records[i]["incomplete"] for i in order) / n for name in later}
    rows = []

    def row(name, cell, k, budget):
        r = {
            "needles": setup["needles"],
            "turns": setup["turns"],
            "first_stage": setup["first_stage"],
            "cell": cell,
            "repair_k": k,
            "budget": budget,
            "base_budget": setup["base_budget"],
            "n": n,
            "accuracy": float(later[name].sum() / turns_E.sum()),
            "accuracy_turn1": float(first[name].mean()),
            "completion": done[name],
            "gain_vs_matched": "",
            "gain_ci_low": "",
            "gain_ci_high": "",
        }
        if cell in REPAIR_POLICIES:
            g, lo, hi = paired_gain(later[name], later[f"matched@{k}"], turns_E)
            r.update(gain_vs_matched=g, gain_ci_low=lo, gain_ci_high=hi)
        rows.append(r)

    base = setup["base_budget"]
    row("full", "full", 0, "-")
    row("none", "none", 0, base)
    for k in setup["ks"]:
        row(f"matched@{k}", "matched", k, base + k)
        for policy in setup["policies"]:
            row(f"{policy}@{k}", policy, k, base)
    return rows


def report_rows(path: Path) -> list[dict]:
    """Rows of every complete setup in the journal; per (needles, turns, first
    stage) only the latest complete setup."""
    _, setups = load_records(path)
    latest = {}
    for setup, records in setups:
        if len(records) == setup["n"]:
            latest[(setup["needles"], setup["turns"], setup["first_stage"])] = (setup, records)
    rows = []
    for key in sorted(latest, key=lambda k: (k[2] != "snapkv", k[2], k[1], k[0])):
        rows += setup_rows(*latest[key])
    return rows


# ----------------------------------------------------------------------------- output
def _panels(rows):
    return sorted({(r["needles"], r["turns"], r["first_stage"]) for r in rows}, key=lambda p: (p[2] != "snapkv", p[2], p[1], p[0]))


def plot(rows, path: Path) -> None:
    """Every policy against K, one panel per setup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(rows)
    cols = min(4, len(panels))
    nrows = math.ceil(len(panels) / cols)
    ncol = min(5, 2 * cols)  # legend columns; at most 9 entries
    legend_h = 0.25 * math.ceil(9 / ncol) + 0.1
    fig, axes = plt.subplots(nrows, cols, figsize=(4.6 * cols, 3.7 * nrows + legend_h), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    handles = {}
    for ax, (needles, turns, stage) in zip(axes.flat, panels):
        mine = [r for r in rows if (r["needles"], r["turns"], r["first_stage"]) == (needles, turns, stage)]
        for cell in ("repairkv", "matched", *[p for p in REPAIR_POLICIES if p != "repairkv"]):
            pts = sorted((r["repair_k"], r["accuracy"]) for r in mine if r["cell"] == cell)
            if pts:
                label = "matched no-repair (B_base + K)" if cell == "matched" else cell
                (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, **_STYLE[cell])
                handles[label] = line
        for r in mine:
            if r["cell"] == "full":
                handles["full cache"] = ax.axhline(r["accuracy"], color="black", linestyle="--", linewidth=0.8)
            if r["cell"] == "none":
                handles["no repair at B_base"] = ax.axhline(r["accuracy"], color="red", linestyle=":", linewidth=0.8)
        ax.set_title(f"MQ-NIAH-{needles}Q{'' if turns == 2 else f', {turns} turns'}, {stage}, B_base {mine[0]['base_budget']}", fontsize=9)
        ax.set_xlabel("repair budget K (rows)")
        ax.set_ylabel("exact match after turn 1")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, legend_h / (3.7 * nrows + legend_h), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


_STYLE = {
    "repairkv": dict(color="C3", linewidth=2.2),
    "matched": dict(color="gray", linestyle="--"),
    "random": dict(color="C0", linewidth=1),
    "oldest": dict(color="C1", linewidth=1),
    "staleq": dict(color="C2", linewidth=1),
    "wrongq": dict(color="C9", linewidth=1),
    "refresh": dict(color="C4", linewidth=1),
}


def plot_figure2(rows, path: Path, *, first_stage="snapkv", turns=2, label_k=96) -> bool:
    """The paper's Figure 2 layout: REPAIRKV (solid) and matched no-repair (dotted)
    against K, one colour per needle count, gain at ``label_k`` at the right.
    False (nothing written) when no such setup is in ``rows``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in rows if r["first_stage"] == first_stage and r["turns"] == turns]
    if not mine:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    labels = []  # (y, text, colour) at the right end of each REPAIRKV curve
    for color, needles in enumerate(sorted({r["needles"] for r in mine})):
        cur = {
            c: sorted((r["repair_k"], r["accuracy"]) for r in mine if r["needles"] == needles and r["cell"] == c)
            for c in ("repairkv", "matched")
        }
        for c, style in (("repairkv", "-"), ("matched", ":")):
            if cur[c]:
                ax.plot(
                    [p[0] for p in cur[c]],
                    [p[1] for p in cur[c]],
                    style,
                    marker="o",
                    markersize=3,
                    color=f"C{color}",
                    linewidth=2 if c == "repairkv" else 1.4,
                )
        at = {c: dict(cur[c]).get(label_k) for c in cur}
        if cur["repairkv"]:
            gain = f", Δ{label_k} {at['repairkv'] - at['matched']:+.2f}" if None not in at.values() else ""
            labels.append([cur["repairkv"][-1][1], f"{needles}Q{gain}", f"C{color}"])
    k_right = max(r["repair_k"] for r in mine)
    labels.sort(key=lambda lab: lab[0])
    for i in range(1, len(labels)):  # keep labels at least 0.05 apart, pushing upwards
        labels[i][0] = max(labels[i][0], labels[i - 1][0] + 0.05)
    for y, text, color in labels:
        ax.annotate(text, (k_right, y), xytext=(4, 0), textcoords="offset points", color=color, fontsize=8, va="center")
    ax.plot([], [], "k-", label="REPAIRKV")
    ax.plot([], [], "k:", label="matched no-repair (B_base + K)")
    ax.set_xlabel("repair budget K (rows)")
    ax.set_ylabel("exact match after turn 1")
    ax.set_ylim(-0.02, 1.05)
    ax.set_xlim(right=ax.get_xlim()[1] * 1.18)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"Split-query MQ-NIAH, {first_stage} first stage, embedded model", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _gain(r) -> str:
    return f"{r['gain_vs_matched']:+.3f} [{r['gain_ci_low']:+.3f}, {r['gain_ci_high']:+.3f}]"


def markdown(rows) -> str:
    out = []
    for needles, turns, stage in _panels(rows):
        mine = [r for r in rows if (r["needles"], r["turns"], r["first_stage"]) == (needles, turns, stage)]
        fixed = {r["cell"]: r for r in mine if r["cell"] in ("full", "none")}
        cells = list(dict.fromkeys(c for c in ("repairkv", "matched", *REPAIR_POLICIES) if any(r["cell"] == c for r in mine)))
        out.append(
            f"### MQ-NIAH-{needles}Q, {turns} turns, {stage} first stage, B_base = {fixed['none']['budget']}, n = {fixed['none']['n']}"
        )
        out.append(
            f"full cache {fixed['full']['accuracy']:.3f}; no repair at B_base {fixed['none']['accuracy']:.3f} "
            f"(exact match after turn 1; turn 1: full {fixed['full']['accuracy_turn1']:.3f}, "
            f"B_base {fixed['none']['accuracy_turn1']:.3f})\n"
        )
        table = []
        for k in sorted({r["repair_k"] for r in mine if r["repair_k"]}):
            at = {r["cell"]: r for r in mine if r["repair_k"] == k}
            gain = _gain(at["repairkv"]) if "repairkv" in at else "-"
            table.append([k, *(f"{at[c]['accuracy']:.3f}" if c in at else "-" for c in cells), gain])
        out.append(
            md_table(
                ["K", *("matched no-repair" if c == "matched" else c for c in cells), "REPAIRKV − matched [95% CI]"],
                table,
                align="r" * (len(cells) + 2),
            )
        )
        out.append("")
    return "\n".join(out)


def write_report(out: Path, title: str) -> list[dict]:
    """results.csv / results.md / PNGs from every complete setup in the journal."""
    rows = report_rows(out / "examples.jsonl")
    if not rows:
        return rows
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{r[k]:.6g}" if isinstance(r[k], float) else r[k]) for k in FIELDS})
    (out / "results.md").write_text(f"# {title}\n\n{markdown(rows)}")
    plot(rows, out / "repair_vs_k.png")
    plot_figure2(rows, out / "figure2.png")
    return rows


# ----------------------------------------------------------------------------- driver
def run(args, model=None) -> list[dict]:
    """Run the protocol ``args`` asks for; ``model``: an already loaded ``jaxkv.Model``
    (a dtype, a mesh) to use instead of loading ``args.model`` (as ``harness.run``)."""
    import jaxkv
    from jaxkv.tasks import mqniah
    from tqdm import tqdm

    needles_list = [int(x) for x in str(args.needles).split(",")]
    ks = [int(x) for x in str(args.ks).split(",")]
    policies = [p.strip() for p in str(args.policies).split(",") if p.strip()]
    bad = [p for p in policies if p not in REPAIR_POLICIES]
    if bad or not policies:
        raise ValueError(f"unknown repair policies {bad}; known: {', '.join(REPAIR_POLICIES)}")
    if any(k < 1 for k in ks) or args.n < 1 or args.workers < 1 or args.chunk < 1:
        raise ValueError("--ks, --n, --workers and --chunk must be positive")
    out = Path(args.out)
    journal = out / "examples.jsonl"
    title = f"RepairKV matched-budget protocol: {args.model}"
    if args.report_only:
        if not journal.exists():
            raise ProtocolError(f"no journal at {journal}: nothing to report")
        rows = write_report(out, title)
        print(markdown(rows))
        return rows
    model = model if model is not None else jaxkv.load_model(args.model)
    out.mkdir(parents=True, exist_ok=True)
    max_positions = int(
        min(model.config.max_position_embeddings, 1 << math.ceil(math.log2(max(2 * args.length + 8 * args.max_new_tokens, 1024))))
    )
    kw = dict(max_new_tokens=args.max_new_tokens, max_positions=max_positions)
    for needles in needles_list:
        seed = PROTOCOL_SEED + needles
        examples = mqniah(args.n, seed, needles=needles, length=args.length, turns=args.turns)
        common = {
            "model": args.model,
            "needles": needles,
            "turns": args.turns,
            "first_stage": args.first_stage,
            "length": args.length,
            "seed": seed,
            **kw,
        }
        base = args.base_budget or _calibrated(model, examples, common, journal, args, kw)
        setup = {**common, "n": args.n, "base_budget": base, "ks": ks, "policies": policies}
        done = next((recs for s, recs in load_records(journal)[1] if s == setup), {}) if args.resume else {}
        todo = [i for i in range(args.n) if i not in done]
        jobs = [(setup, run[0], [examples[i] for i in run], examples[(run[0] - 1) % args.n]) for run in _runs(todo, args.chunk)]
        desc = f"{needles}Q {args.first_stage} {args.turns} turns, B_base {base}"
        with tqdm(total=args.n, initial=args.n - len(todo), desc=desc, unit="example", file=sys.stderr) as bar:
            for _, records in pool_map(_chunk_job, jobs, args.model, workers=args.workers, model=model, bar=bar):
                for index, record in records:
                    append_journal(journal, {"setup": setup, "index": index, **record})
    rows = write_report(out, title)
    mine = [r for r in rows if r["needles"] in needles_list and r["turns"] == args.turns and r["first_stage"] == args.first_stage]
    print(markdown(mine))
    print(f"wrote {out}/results.csv, results.md, repair_vs_k.png, figure2.png (journal: {journal})")
    return mine


def _runs(indices, size) -> list[list[int]]:
    """``indices`` (sorted) cut into runs of consecutive values, at most ``size`` long."""
    runs = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1 and len(runs[-1]) < size:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _calibrated(model, examples, common, journal, args, kw) -> int:
    """B_base from the journal's calibration for this setup, or a new calibration."""
    from tqdm import tqdm

    cal = examples[: args.calibrate_n]
    key = {**common, "calibrate_n": len(cal), "candidates": args.candidates, "min_full": args.min_full, "calibrate_k": args.calibrate_k}
    calibrations, _ = load_records(journal)
    found = calibrations.get(json.dumps(key, sort_keys=True))
    if found is not None and args.resume:
        return found["base_budget"]
    shortest = min(e.approx_tokens() for e in examples)
    candidates = sorted({max(16, int(shortest * f)) for f in args.candidates})
    with tqdm(
        total=len(cal) * (1 + len(candidates)), desc=f"{common['needles']}Q calibrating B_base", unit="example", file=sys.stderr
    ) as bar:
        full = score(model, cal, Cell("full", None, None, "mqniah"), progress=bar.update, **kw)["accuracy"]
        base, tried = calibrate(
            model,
            cal,
            common["first_stage"],
            candidates,
            full,
            args.min_full,
            reference_k=args.calibrate_k,
            workers=args.workers,
            model_name=args.model,
            bar=bar,
            **kw,
        )
    tqdm.write(
        f"{common['needles']}Q calibration (n={len(cal)}): full {full:.3f}; no repair at B + {args.calibrate_k}: "
        + ", ".join(f"B={b}: {a:.3f}" for b, a in tried)
        + f" -> B_base {base}"
    )
    append_journal(journal, {"setup": key, "calibration": tried, "full": full, "base_budget": base})
    return base


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m eval.quality.repair_protocol",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default="embedded")
    p.add_argument("--needles", default="2,4,6,8", help="needle counts (comma list)")
    p.add_argument("--turns", type=int, default=2, choices=(2, 5), help="5: repeated-shift schedule (needles 4 or 8)")
    p.add_argument("--first-stage", default="snapkv", choices=("snapkv", "h2o", "streaming_llm"))
    p.add_argument("--ks", default="8,16,32,48,64,96,128", help="repair budgets K")
    p.add_argument("--policies", default=",".join(REPAIR_POLICIES))
    p.add_argument("--n", type=int, default=100, help="examples per cell")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--base-budget", type=int, default=None, help="B_base (default: calibrated)")
    p.add_argument(
        "--candidates",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5],
        help="calibration budgets as fractions of the shortest turn-1 request",
    )
    p.add_argument("--calibrate-k", type=int, default=96, help="K at which calibration aims matched no-repair at half of full")
    p.add_argument("--calibrate-n", type=int, default=20)
    p.add_argument("--min-full", type=float, default=0.5, help="full-cache accuracy below which calibration refuses")
    p.add_argument("--workers", type=int, default=1, help="processes replaying examples")
    p.add_argument("--chunk", type=int, default=5, help="consecutive examples per worker job")
    p.add_argument("--resume", action="store_true", help="skip examples and calibrations --out/examples.jsonl already holds")
    p.add_argument("--report-only", action="store_true", help="rebuild the report from --out/examples.jsonl, replay nothing")
    p.add_argument("--out", default="eval/results/repair_mqniah")
    return p


def main(argv=None) -> int:
    try:
        run(build_parser().parse_args(argv))
    except ProtocolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
