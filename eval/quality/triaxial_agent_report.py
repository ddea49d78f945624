"""TriAxialKV on its own workload: KV formats on held-out agent traces, fidelity against the float pool.

    python -m eval.quality.triaxial_agent_report --root eval/results/triaxial/agent_workload \\
        --out eval/results/triaxial/agent_workload.md

Issue #60, item 3: does a TriAxialKV budget B <= 3.0 keep SmolLM2 within 0.05
nats/token of the float pool on the agent traces the method was designed for?
Reads, under ``--root``:

* ``grid/cells.jsonl``: the harness journal of ``jaxkv eval --task agent
  --methods full --kv-quant none,int4,... --fidelity --accuracy teacher``
  (``eval.quality.harness``): held-out agent traces (``jaxkv.tasks.agent_traces`` at the
  harness's seeds, tools inlined for SmolLM2's template) replayed turn by turn,
  every recorded assistant reply teacher-forced. Per cell: the NLL increase of the
  recorded reply tokens over the float pool's (nats/token, token-weighted) with a
  paired bootstrap 95% interval over traces (``eval.quality.harness.quant_nll_increase``),
  the KL(float || format) per token over the float pool's top-64 tokens and the
  rest, teacher-forced accuracy, and the stored bits and bytes per token of the
  live KV after each prompt prefill;
* ``grid/fidelity/*.npz``: the float pool's per-token reply NLL (its absolute
  level, the ceiling row);
* ``lm/quant*.jsonl`` (optional): ``eval.quality.real_model --task lm --kv-quant int4``,
  the INT4 ``lm`` check (continuation NLL increase on real text with its bootstrap
  interval, ``eval.common.stats.mean_ci``);
* ``summary.md``: the findings, written by hand from the tables, placed under the
  title (regenerating keeps them);
* ``commands.md``: the commands, date, machine and load of each run, placed after
  the tables.

Each triaxial row names the allocation its B gives under the calibration the
sessions found (``--calibration``, default the one shipped for SmolLM2): which
tags are INT2 (and, for an allocation with the INT3 tier, which are INT3). Writes ``--out``.

Several grids in one table (``--grid ROOT:ALLOCATION``, repeated; e.g. one grid per
pinned allocation, ``eval.quality.harness --kv-allocation``): each grid's triaxial
rows are named by its allocation file (B ``pinned`` for a pinned one), the float
pool's row is the first grid's, and the others' float rows, the same cell, must
match it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from jaxkv.markdown import md_header, md_row

GOAL = 0.05  # nats/token: TriAxialKV at B <= 3.0 within this of the float pool (issue #60)
LM_GOAL = 0.01  # nats/token: INT4 on real-text lm at 2k (issue #26, unchanged)


def read_cells(path: Path) -> list[dict]:
    return [json.loads(line)["row"] for line in path.read_text().splitlines() if line.strip()]


def float_ceiling(fidelity: Path) -> dict:
    """The float pool's own reply NLL: token-weighted mean over every trace's
    recorded reply tokens, and the token count."""
    nll = [np.load(p)["nll"] for p in sorted(fidelity.glob("*.npz"))]
    total = np.concatenate(nll) if nll else np.zeros(0)
    return {"nll": float(total.mean()) if total.size else float("nan"), "tokens": int(total.size), "traces": len(nll)}


def int2_tags(calibration: Path, budget: float) -> str:
    from jaxkv.policies.quant_allocation import load_allocation

    alloc = load_allocation(calibration)
    bits = alloc.bits(budget)
    # named by the semantic tag, with the tool output's copy sub-tag if the allocation has the axis ("obs/key")
    keep = sum(a in alloc.axes for a in ("semantic", "copy")) or 1
    short = {name: "/".join(name.split("|")[-keep:]) for name in bits}
    short = {n: s if s.startswith("obs/") else s.removesuffix("/plain") for n, s in short.items()}  # only obs is split
    low = [short[name] for name, b in bits.items() if b == 2]
    mid = [short[name] for name, b in bits.items() if b == 3]  # the INT3 tier's tags, named apart
    text = "every tag" if len(low) == len(bits) else (", ".join(low) or "none")
    if mid:
        text = (text + "; " if low else "") + ("every tag" if len(mid) == len(bits) else ", ".join(mid)) + " INT3"
    return text


def agent_table(rows: list[dict], calibration: Path) -> list[str]:
    """The table; a row's ``_calibration`` (set for ``--grid`` rows) overrides ``calibration``."""
    from eval.quality.harness import quant_nll_increase, stored_bits_of
    from jaxkv.policies.quant_allocation import load_allocation

    base = next(r for r in rows if r["kv_quant"] == "none")
    files = {Path(r["_calibration"]) for r in rows if r.get("_calibration")}
    stems = [f.stem for f in files]
    # a row is named by its allocation file's stem, or folder/stem where two files share a stem
    label = {f: f"{f.parent.name}/{f.stem}" if stems.count(f.stem) > 1 else f.stem for f in files}
    lines = md_header(
        [
            "kv_quant",
            "B",
            "INT2 tags" + (" (INT3 tags)" if any(r.get("_calibration") for r in rows) else ""),
            "code bits",
            "stored bits",
            "KV bytes / token",
            "capacity vs bf16",
            "NLL increase, nats/token [95%]",
            f"within {GOAL}",
            "KL per token",
            "teacher-forced accuracy",
        ],
        "lrlrrrrrlrr",
    )
    for r in rows:
        if r["kv_quant"] == "none":
            lines.append(
                md_row(
                    [
                        "none (float pool)",
                        "-",
                        "-",
                        "16.00",
                        f"{stored_bits_of(base, base):.2f}",
                        f"{base['kv_bytes_per_token']:.0f}",
                        "1.00x",
                        "(ceiling)",
                        "",
                        "",
                        f"{100 * r['accuracy']:.1f}%",
                    ]
                )
            )
            continue
        d = quant_nll_increase(r)
        verdict = "yes" if d[2] < GOAL else ("point estimate only" if d[0] < GOAL else "no")
        B = r["kv_bits"] if r["kv_quant"].startswith("triaxial") else "-"
        cal = r.get("_calibration", calibration)
        tags = int2_tags(cal, float(B)) if B != "-" else "-"
        name = r["kv_quant"]
        if B != "-" and cal != calibration:
            name += f" [{label.get(Path(cal), Path(cal).stem)}]"
            B = "pinned" if load_allocation(cal).pinned is not None else B
        lines.append(
            md_row(
                [
                    name + (" (rotated)" if r.get("kv_rotate") == "on" else ""),
                    B,
                    tags,
                    f"{r['avg_bits']:.2f}",
                    f"{stored_bits_of(r, base):.2f}",
                    f"{r['kv_bytes_per_token']:.0f}",
                    f"{base['kv_bytes_per_token'] / r['kv_bytes_per_token']:.2f}x",
                    f"{d[0]:+.4f} [{d[1]:+.4f}, {d[2]:+.4f}]",
                    verdict,
                    f"{r['kl']:.4f}",
                    f"{100 * r['accuracy']:.1f}%",
                ]
            )
        )
    return lines


def lm_table(root: Path) -> list[str]:
    from eval.common.stats import mean_ci

    records = [json.loads(line) for p in sorted(root.glob("quant*.jsonl")) for line in p.read_text().splitlines() if line.strip()]
    if not records:
        return []
    lines = md_header(
        ["format", "context", "examples", "float pool NLL", "NLL increase, nats/token [95%]", f"within {LM_GOAL}", "KL per token [95%]"],
        "lrrrrlr",
    )
    for ctx in sorted({r["context"] for r in records}):
        recs = [r for r in records if r["context"] == ctx]
        for cell in sorted({c for r in recs for c in r["cells"] if c != "full"}):
            got = [r for r in recs if cell in r["cells"]]
            d = mean_ci([r["cells"][cell]["nll"] - r["cells"]["full"]["nll"] for r in got])
            kl = mean_ci([r["cells"][cell]["kl"] for r in got])
            verdict = "yes" if d[2] < LM_GOAL else ("point estimate only" if d[0] < LM_GOAL else "no")
            full = np.mean([r["cells"]["full"]["nll"] for r in got])
            lines.append(
                md_row(
                    [
                        cell.removeprefix("kv:"),
                        ctx,
                        len(got),
                        f"{full:.3f}",
                        f"{d[0]:+.4f} [{d[1]:+.4f}, {d[2]:+.4f}]",
                        verdict,
                        f"{kl[0]:.4f} [{kl[1]:.4f}, {kl[2]:.4f}]",
                    ]
                )
            )
    return lines


def report(root: Path, calibration: Path, grids=None, title: str | None = None, notes: Path | None = None) -> str:
    """The report of ``root`` (its calibration ``calibration``), or of several
    ``grids``: ``[(root, allocation file)]`` (module docstring), the first one's
    float pool the reference; ``notes``: where ``summary.md`` and ``commands.md``
    are (default: the root)."""
    if grids:
        rows = []
        for i, (r_root, cal) in enumerate(grids):
            for r in read_cells(Path(r_root) / "grid" / "cells.jsonl"):
                if r["kv_quant"] == "none":
                    if i:
                        ref = next(x for x in rows if x["kv_quant"] == "none")
                        if (r["nll_increase"], r["accuracy"], r["fidelity_tokens"]) != (
                            ref["nll_increase"],
                            ref["accuracy"],
                            ref["fidelity_tokens"],
                        ):
                            raise ValueError(f"{r_root}: its float pool's cell differs from {grids[0][0]}'s")
                        continue
                rows.append({**r, "_calibration": Path(cal)})
        root = Path(grids[0][0])
    else:
        rows = read_cells(root / "grid" / "cells.jsonl")
    order = {q: i for i, q in enumerate(("none", "int4", "kivi4", "kivi2", "triaxial"))}
    rows.sort(
        key=lambda r: (
            order.get(r["kv_quant"], 9),
            float(r["kv_bits"]) if r["kv_bits"] != "-" else 0.0,
            str(r.get("_calibration", "")),
            r.get("kv_rotate", "off") == "on",
        )
    )
    ceiling = float_ceiling(root / "grid" / "fidelity")
    n = {r["n"] for r in rows}
    tokens = {r["fidelity_tokens"] for r in rows if isinstance(r.get("fidelity_tokens"), int)}
    md = [f"# {title or 'TriAxialKV on agent traces: SmolLM2-135M-Instruct (issue #60, item 3)'}", ""]
    notes = root if notes is None else Path(notes)
    if (notes / "summary.md").is_file():
        md += [(notes / "summary.md").read_text().strip(), ""]
    md += [
        "## Agent traces: every KV format against the float pool",
        "",
        f"{'/'.join(map(str, sorted(n)))} held-out agent traces, {ceiling['tokens']} teacher-forced reply tokens "
        f"({'/'.join(map(str, sorted(tokens)))} compared per cell); the float pool's own reply NLL is "
        f"{ceiling['nll']:.3f} nats/token. Bits and bytes per token are those of the live KV after each "
        "prompt prefill: *code bits* count the codes alone (2, 3 or 4, or 16 for full precision: what B budgets), "
        "*stored bits* are 8 x bytes / elements with every scale, zero point and float-window row counted "
        "(`jaxkv.cache.quantized_host.stored_bits`; the float pool counted as bf16). The NLL increase is "
        "token-weighted over every recorded reply, with a paired bootstrap 95% interval over traces; "
        f"*within {GOAL}* asks the interval's upper end to be below {GOAL} nats/token. INT2 tags: the tags the "
        f"allocation at B stores at 2 bits (calibration `{calibration}`"
        + ("; a row named [file] uses that allocation file, B *pinned*: the same bits at every budget)." if grids else ")."),
        "",
    ]
    md += agent_table(rows, calibration) + [""]
    lm = lm_table(root / "lm")
    if lm:
        md += (
            [
                "## INT4 on real text (`lm`), re-measured on the rewritten engine",
                "",
                "Continuation NLL increase of 256 teacher-forced tokens after 2,048 context tokens of real text, "
                "chunked prefill (what a server does), mean over windows with a bootstrap 95% interval.",
                "",
            ]
            + lm
            + [""]
        )
    if (notes / "commands.md").is_file():
        md += [(notes / "commands.md").read_text().strip(), ""]
    return "\n".join(md)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.quality.triaxial_agent_report", description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=Path("eval/results/triaxial/agent_workload"))
    p.add_argument("--calibration", type=Path, default=Path("jaxkv/assets/smollm2-135m-instruct/triaxial.json"))
    p.add_argument("--out", type=Path, default=Path("eval/results/triaxial/agent_workload.md"))
    p.add_argument("--grid", action="append", default=[], help="ROOT[:ALLOCATION] (repeated): several grids in one table")
    p.add_argument("--title", default=None)
    p.add_argument("--notes", type=Path, default=None, help="the folder of summary.md and commands.md (default: the root)")
    args = p.parse_args(argv)
    grids = [(g.split(":")[0], g.split(":")[1] if ":" in g else args.calibration) for g in args.grid]
    args.out.write_text(report(args.root, args.calibration, grids or None, args.title, args.notes))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
