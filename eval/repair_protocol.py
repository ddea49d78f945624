"""RepairKV's matched-budget protocol on split-query MQ-NIAH (paper §4-5, Figure 2).

    JAX_PLATFORMS=cpu python -m eval.repair_protocol --needles 2,4,6,8 \
        --ks 8,16,32,48,64,96,128 --n 100 --out eval/results/repair_mqniah

For each needle count: the examples (``eval.tasks.mqniah``, held out from training)
are replayed turn by turn through ``jaxkv.Session`` exactly as the harness does
(``eval.harness.replay_cell``: teacher-forced history, each answer generated
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
relevance shift; turn 1 is the same for every cell with the same active budget).

``B_base`` (``--base-budget``, or calibrated): the protocol needs a budget at which
matched no-repair is neither near the full cache nor near zero. Calibration runs
no-repair on the first ``--calibrate-n`` examples at each of ``--candidates``
(fractions of the shortest turn-1 request) and keeps the budget whose accuracy is
closest to half the full cache's. With a model that does not solve the task with
the full cache (accuracy below ``--min-full``) there is nothing to repair:
calibration raises ``ProtocolError`` naming the measured accuracy.

``--turns 5 --needles 8`` runs the repeated-shift schedule (paper §5.3).

Outputs in ``--out``: ``results.csv`` (one row per cell), ``results.md`` (per needle
count: accuracy by K and policy, next to matched, no-repair and full cache) and
``repair_vs_k.png`` (one panel per needle count, the layout of the paper's Figure 2).
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from pathlib import Path

import numpy as np

from eval.harness import EVAL_SEED_BASE, REPAIR_POLICIES, Cell, replay_cell

FIELDS = ("needles", "turns", "first_stage", "cell", "repair_k", "budget", "base_budget", "n", "accuracy",
          "accuracy_turn1", "completion", "wall_s")
PROTOCOL_SEED = EVAL_SEED_BASE + 700_000


class ProtocolError(ValueError):
    """The protocol cannot run meaningfully (e.g. the model fails with the full cache)."""


def score(model, examples, cell: Cell, *, max_new_tokens: int, max_positions: int, progress=None) -> dict:
    """Accuracy after turn 1 and on turn 1 over ``examples`` for one cell."""
    t0 = time.perf_counter()
    later, first, completed = [], [], 0
    for verdicts, done, _ in replay_cell(model, examples, cell, max_new_tokens=max_new_tokens,
                                         max_positions=max_positions, progress=progress):
        first.append(verdicts[0])
        later += verdicts[1:]
        completed += done
    return {"accuracy": float(np.mean(later)), "accuracy_turn1": float(np.mean(first)),
            "completion": completed / len(examples), "wall_s": time.perf_counter() - t0}


def calibrate(model, examples, first_stage: str, candidates, full_accuracy: float, min_full: float, **kw) -> tuple[int, list]:
    """``(B_base, [(budget, accuracy), ...])``: the candidate whose no-repair accuracy
    is closest to half of ``full_accuracy`` (see the module docstring)."""
    if full_accuracy < min_full:
        raise ProtocolError(
            f"full-cache accuracy after turn 1 is {full_accuracy:.3f} (< {min_full}): the model does not "
            "solve the task even without eviction, so no budget separates repair from no repair")
    tried = [(b, score(model, examples, Cell(first_stage, b, "dead_slot", "mqniah"), **kw)["accuracy"]) for b in candidates]
    best = min(tried, key=lambda bt: (abs(bt[1] - full_accuracy / 2), -bt[0]))
    return best[0], tried


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["needles"], r["turns"], r["first_stage"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (needles, turns, stage) in zip(axes[0], panels):
        mine = [r for r in rows if (r["needles"], r["turns"], r["first_stage"]) == (needles, turns, stage)]
        for cell in ("repairkv", "matched", *[p for p in REPAIR_POLICIES if p != "repairkv"]):
            pts = sorted((r["repair_k"], r["accuracy"]) for r in mine if r["cell"] == cell)
            if pts:
                style = {"repairkv": dict(color="C3", linewidth=2.2), "matched": dict(color="gray", linestyle="--")}.get(cell, {})
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label="matched no-repair" if cell == "matched" else cell, **style)
        for r in mine:
            if r["cell"] == "full":
                ax.axhline(r["accuracy"], color="black", linestyle="--", label="full cache")
            if r["cell"] == "none":
                ax.axhline(r["accuracy"], color="red", linestyle=":", label=f"no repair (B_base={r['budget']})")
        ax.set_title(f"MQ-NIAH-{needles}Q{'' if turns == 2 else f', {turns} turns'}: {stage} first stage")
        ax.set_xlabel("repair budget K (rows)")
        ax.set_ylabel("exact match after turn 1")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(rows) -> str:
    out = []
    for needles, turns, stage in sorted({(r["needles"], r["turns"], r["first_stage"]) for r in rows}):
        mine = [r for r in rows if (r["needles"], r["turns"], r["first_stage"]) == (needles, turns, stage)]
        fixed = {r["cell"]: r for r in mine if r["cell"] in ("full", "none")}
        cells = [c for c in ("repairkv", "matched", *REPAIR_POLICIES) if any(r["cell"] == c for r in mine)]
        cells = list(dict.fromkeys(cells))
        out.append(f"### MQ-NIAH-{needles}Q, {turns} turns, {stage} first stage, B_base = {fixed['none']['budget']}, "
                   f"n = {fixed['none']['n']}")
        out.append(f"full cache {fixed['full']['accuracy']:.3f}; no repair at B_base {fixed['none']['accuracy']:.3f} "
                   "(exact match after turn 1)\n")
        out.append("| K | " + " | ".join("matched no-repair" if c == "matched" else c for c in cells) + " |")
        out.append("|---:|" + "---:|" * len(cells))
        for k in sorted({r["repair_k"] for r in mine if r["repair_k"]}):
            acc = {r["cell"]: r["accuracy"] for r in mine if r["repair_k"] == k}
            out.append(f"| {k} | " + " | ".join(f"{acc[c]:.3f}" if c in acc else "-" for c in cells) + " |")
        out.append("")
    return "\n".join(out)


def run(args) -> list[dict]:
    import jaxkv
    from eval.tasks import mqniah
    from tqdm import tqdm

    needles_list = [int(x) for x in str(args.needles).split(",")]
    ks = [int(x) for x in str(args.ks).split(",")]
    policies = [p.strip() for p in str(args.policies).split(",") if p.strip()]
    bad = [p for p in policies if p not in REPAIR_POLICIES]
    if bad or not policies:
        raise ValueError(f"unknown repair policies {bad}; known: {', '.join(REPAIR_POLICIES)}")
    if any(k < 1 for k in ks) or args.n < 1:
        raise ValueError("--ks and --n must be positive")
    model = jaxkv.load_model(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    max_positions = int(min(model.config.max_position_embeddings,
                            1 << math.ceil(math.log2(max(2 * args.length + 8 * args.max_new_tokens, 1024)))))
    kw = dict(max_new_tokens=args.max_new_tokens, max_positions=max_positions)
    rows = []
    per_needles = (2 + len(ks) * (1 + len(policies))) * args.n
    if not args.base_budget:  # calibration replays (an upper bound: equal candidates run once)
        per_needles += min(args.calibrate_n, args.n) * len(args.candidates)
    with tqdm(total=len(needles_list) * per_needles, desc="repair protocol", unit="example", file=sys.stderr) as bar:
        for needles in needles_list:
            examples = mqniah(args.n, PROTOCOL_SEED + needles, needles=needles, length=args.length, turns=args.turns)

            def add(cell_name, cell, k=0):
                bar.set_postfix_str(f"{needles}Q {cell_name} K={k}")
                r = score(model, examples, cell, progress=bar.update, **kw)
                rows.append({"needles": needles, "turns": args.turns, "first_stage": args.first_stage, "cell": cell_name,
                             "repair_k": k, "budget": cell.budget if cell.budget is not None else "-",
                             "base_budget": base, "n": len(examples), **r})
                return r

            base = "-"
            full = add("full", Cell("full", None, None, "mqniah"))
            if args.base_budget:
                base = args.base_budget
            else:
                shortest = min(e.approx_tokens() for e in examples)
                candidates = sorted({max(16, int(shortest * f)) for f in args.candidates})
                cal = examples[: args.calibrate_n]
                bar.set_postfix_str(f"{needles}Q calibrating B_base")
                base, tried = calibrate(model, cal, args.first_stage, candidates, full["accuracy"], args.min_full,
                                        progress=bar.update, **kw)
                tqdm.write(f"{needles}Q calibration (n={len(cal)}): " + ", ".join(f"B={b}: {a:.3f}" for b, a in tried)
                           + f" -> B_base {base}")
            rows[-1]["base_budget"] = base
            add("none", Cell(args.first_stage, base, "dead_slot", "mqniah"))
            for k in ks:
                add("matched", Cell(args.first_stage, base + k, "dead_slot", "mqniah", "matched", k, base), k)
                for policy in policies:
                    add(policy, Cell(args.first_stage, base, "dead_slot", "mqniah", policy, k, base), k)
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{r[k]:.6g}" if isinstance(r[k], float) else r[k]) for k in FIELDS})
    md = markdown(rows)
    (out / "results.md").write_text(f"# RepairKV matched-budget protocol: {args.model}\n\n"
                                    f"length {args.length}, max_new_tokens {args.max_new_tokens}\n\n{md}")
    plot(rows, out / "repair_vs_k.png")
    print(md)
    print(f"wrote {out}/results.csv, results.md, repair_vs_k.png")
    return rows


def build_parser():
    p = argparse.ArgumentParser(prog="python -m eval.repair_protocol", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
    p.add_argument("--candidates", type=lambda s: [float(x) for x in s.split(",")], default=[0.05, 0.1, 0.2, 0.3, 0.5],
                   help="calibration budgets as fractions of the shortest turn-1 request")
    p.add_argument("--calibrate-n", type=int, default=20)
    p.add_argument("--min-full", type=float, default=0.5, help="full-cache accuracy below which calibration refuses")
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
