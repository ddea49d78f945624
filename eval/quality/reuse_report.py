"""Cross-query segment reuse on ``shared_docs``: headline table, sweeps, acceptance.

    JAX_PLATFORMS=cpu python -m eval.quality.reuse_report --n 100 --sweep-n 100 --warmup 1 --resume \
        [--passes none,segment] --out eval/results/reuse

Held-out ``shared_docs`` sessions (one tenant, one shared corpus; in-distribution
agent traces of the embedded model over shared documents) are replayed turn by
turn with the harness (``train.replay.replay_example``: teacher-forced history,
each assistant turn generated greedily and scored by exact match). Each
configuration is one *pass*: its own ``Server`` (radix cache and segment store
shared by its sessions, as one tenant's sessions share them) over the sessions in
order. A pass is the unit of resumption: ``--passes`` runs the named ones (all by
default), ``--resume`` keeps the passes already in the journal, so a report is
built in chunks of a few minutes each on a shared machine. Passes run one after
the other, so their wall times are from different minutes of a shared 2-core CPU
(compute units are exact and load-independent).

Configurations: ``none`` (prefix caching only: the radix cache, full recompute of
the rest; the reference for accuracy), ``segment`` at the defaults of
``ReuseConfig``, ``cacheblend``; then sweeps one parameter at a time around the
default: ``L_reuse`` (n = |L_reuse|), ``h``, ``tau_seg``, ``W`` (with
``tau_ctx`` on, so that W matters) and the acceptance test off, each over the
first ``--sweep-n`` sessions of the headline. The sweep rows at the defaults
(``none``, ``L_reuse=4``, ``h=8``, ``tau_seg=0.8``) are the headline passes cut to
those sessions: a pass's first sessions do not depend on the later ones.

Per configuration: accuracy (scored turns exact-matched) and its difference from
``none`` in points; prefill compute per request in token x layer units (probe
references and rejected splices included) and the saving ``none / config``;
prefill wall time per request (CPU, this run; mean, which includes the jit
compiles of new bucket shapes met during the run, and median); acceptance and fallback rates over
the spans the test judged; with ``audit`` (every reuse configuration here), the
boundary KL against a full recompute (next-token KL at the first token after
each accepted span) and the false-accept rate (accepted spans whose boundary KL
exceeds ``kl_epsilon``). The audit's own recompute is excluded from both costs.

Outputs in ``--out``: ``results.csv`` (one row per configuration), ``report.md``
(the tables) and ``cells.jsonl`` (a journal: per pass, per session, the verdicts
and the reuse reports). Warm-up sessions (other seeds, not scored) compile the
jit'd steps first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from eval.quality import harness
from jaxkv.markdown import md_table
from jaxkv.tasks.seeds import EVAL_SEED_BASE
from train import replay
from train.journal import append_journal, read_journal


def _defaults() -> dict:
    from jaxkv.serving.stages.reuse import ReuseConfig

    c = ReuseConfig()
    return dict(
        reuse_layers=c.reuse_layers, halo=c.halo, tau_seg=c.tau_seg, tau_ctx=c.tau_ctx, ctx_window=c.ctx_window, kl_epsilon=c.kl_epsilon
    )


DEFAULT_ALIASES = ("L_reuse=4", "h=8", "tau_seg=0.8")  # sweep rows = the headline's segment pass


def configs(sweep) -> dict:
    """``name -> (reuse mode, session options)``: the headline, the sweeps (one
    parameter at a time around ``ReuseConfig``'s defaults; the default itself is
    the headline's pass), or the pilot grid the defaults were calibrated on
    (``sweep="pilot"``, other seeds)."""
    if sweep == "pilot":
        out = {"none": ("none", {})}
        for n in (3, 4):
            for eps in (0.1, 1.0, float("inf")):
                out[f"L_reuse={n},eps={eps}"] = ("segment", {"audit": True, "reuse_layers": n, "kl_epsilon": eps})
        return out
    if not sweep:
        return {"none": ("none", {}), "segment": ("segment", {"audit": True}), "cacheblend": ("cacheblend", {"audit": True})}
    out = {}
    for n in (1, 2, 3):
        out[f"L_reuse={n}"] = ("segment", {"audit": True, "reuse_layers": n})
    for h in (0, 4, 16):
        out[f"h={h}"] = ("segment", {"audit": True, "halo": h})
    for t in (0.7, 0.9):
        out[f"tau_seg={t}"] = ("segment", {"audit": True, "tau_seg": t})
    for w in (32, 64):
        out[f"W={w},tau_ctx=0.3"] = ("segment", {"audit": True, "ctx_window": w, "tau_ctx": 0.3})
    out["no acceptance test"] = ("segment", {"audit": True, "kl_epsilon": float("inf")})
    return out


def summarize(name, reuse, options, sessions) -> dict:
    """One row from a pass's per-session records (``run_pass``)."""
    from jaxkv.serving.stages.reuse import ReuseReport

    n_sessions = len(sessions)
    verdicts = [s["v"] for s in sessions]
    reports = [ReuseReport(**r) for s in sessions for r in s["reports"]]
    flat = [v for vs in verdicts for v in vs]
    units = [r.units for r in reports]
    full = [r.full_units for r in reports]
    spans = sum(r.spans for r in reports)
    accepted = sum(r.accepted for r in reports)
    bkl = [k for r in reports for k in r.boundary_kl]
    last = [r.last_kl for r in reports if r.last_kl is not None]
    opts = {**_defaults(), **options} if reuse == "segment" else options
    return {
        "config": name,
        "reuse": reuse,
        "n": n_sessions,
        "L_reuse": opts.get("reuse_layers", "-") if reuse == "segment" else ("all" if reuse == "cacheblend" else "-"),
        "h": opts.get("halo", "-") if reuse == "segment" else "-",
        "tau_seg": opts.get("tau_seg", "-") if reuse == "segment" else "-",
        "W": opts.get("ctx_window", "-") if reuse == "segment" else "-",
        "tau_ctx": opts.get("tau_ctx", "-") if reuse == "segment" else "-",
        "eps": opts.get("kl_epsilon", "-") if reuse == "segment" else "-",
        "accuracy": float(np.mean(flat)) if flat else 0.0,
        "requests": len(reports),
        "prefill_tokens_computed": float(np.mean(units)),
        "prefill_tokens_full": float(np.mean(full)),
        "saving": float(np.sum(full) / max(np.sum(units), 1)),
        "prefill_s": float(np.mean([r.prefill_s for r in reports])),
        "prefill_s_median": float(np.median([r.prefill_s for r in reports])),
        "spans": spans,
        "accept_rate": accepted / spans if spans else float("nan"),
        "fallback_rate": sum(r.rejected for r in reports) / spans if spans else float("nan"),
        "spliced_share": float(np.sum([r.spliced_tokens for r in reports]) / max(np.sum([r.suffix_tokens for r in reports]), 1)),
        "boundary_kl_mean": float(np.mean(bkl)) if bkl else float("nan"),
        "boundary_kl_p95": float(np.percentile(bkl, 95)) if bkl else float("nan"),
        "last_kl_mean": float(np.mean(last)) if last else float("nan"),
        "false_accept_rate": sum(r.false_accepts for r in reports) / accepted if accepted else float("nan"),
        "probe_kl_median": float(np.median([k for r in reports for k in r.probe_kl])) if spans else float("nan"),
    }


def run_pass(model, examples, reuse: str, options: dict, *, max_new_tokens: int, max_positions: int, warmup, log=print) -> list[dict]:
    """Replay ``examples`` in order on one fresh ``Server`` under one configuration;
    per session ``{"v": verdicts, "reports": [ReuseReport as a dict]}``. Warm-up
    sessions run first on a server of their own (they must not seed the store)."""
    from jaxkv.serving import Server

    out = []
    for phase, batch in (("warmup", warmup), ("run", examples)):
        server = Server(model, max_positions=max_positions)
        try:
            for i, ex in enumerate(batch):
                cell = replay.Cell("full", None, None, "shared_docs", reuse=reuse)
                v, _, _, session = replay.replay_example(
                    model, ex, cell, max_new_tokens=max_new_tokens, max_positions=max_positions, server=server, **options
                )
                if phase == "run":
                    out.append({"v": [bool(x) for x in v], "reports": [dataclasses.asdict(r) for r in session._stage("reuse").reports]})
                    if (i + 1) % 20 == 0:
                        log(f"  {i + 1}/{len(batch)} sessions")
        finally:
            server.close()
    return out


def fmt(v):
    if isinstance(v, float):
        return "-" if math.isnan(v) else (f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}")
    return str(v)


def table(rows, cols) -> str:
    return md_table(cols, [[fmt(r[c]) for c in cols] for r in rows])


def main(argv=None) -> int:
    import jaxkv
    from jaxkv.tasks import shared_docs

    p = argparse.ArgumentParser(prog="python -m eval.quality.reuse_report", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="embedded")
    p.add_argument("--n", type=int, default=100, help="sessions of the headline")
    p.add_argument("--sweep-n", type=int, default=100, help="sessions of each sweep configuration (0: no sweeps)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-positions", type=int, default=4096)
    p.add_argument("--seed", type=int, default=EVAL_SEED_BASE)
    p.add_argument("--only", choices=("headline", "sweeps", "pilot"), default=None)
    p.add_argument(
        "--passes",
        default=None,
        help="comma list of configurations to run now (default: all missing); a name with commas is named by its parts",
    )
    p.add_argument("--out", default="eval/results/reuse")
    p.add_argument("--resume", action="store_true")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    journal = out / "cells.jsonl"
    done = {rec["key"]: rec["sessions"] for rec in read_journal(journal) if "sessions" in rec} if args.resume else {}
    if not args.resume and journal.exists():
        journal.unlink()
    model = jaxkv.load_model(args.model)
    examples = harness.make_examples("shared_docs", args.n, 0, args.seed)
    warmup = shared_docs(args.warmup, args.seed + 123_457)
    groups = []  # (group, sessions, {name: (reuse, options)})
    if args.only in (None, "headline"):
        groups.append(("headline", args.n, configs(False)))
    if args.sweep_n and args.only in (None, "sweeps"):
        groups.append(("sweeps", args.sweep_n, configs(True)))
    if args.only == "pilot":
        groups.append(("pilot", args.sweep_n, configs("pilot")))
    wanted = set(args.passes.split(",")) if args.passes else None

    def key(name, n, reuse, options):
        return json.dumps([name, args.model, n, args.seed, args.max_new_tokens, reuse, sorted(options.items())])

    for group, n, cfgs in groups:
        for name, (reuse, options) in cfgs.items():
            k = key(name, n, reuse, options)
            if k in done or (wanted is not None and not set(name.split(",")) <= wanted):  # names may hold commas
                continue
            t0 = time.perf_counter()
            print(f"{group} {name}: {n} sessions", file=sys.stderr)
            done[k] = run_pass(
                model,
                examples[:n],
                reuse,
                options,
                max_new_tokens=args.max_new_tokens,
                max_positions=args.max_positions,
                warmup=warmup,
                log=lambda m: print(m, file=sys.stderr),
            )
            print(f"{group} {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            append_journal(journal, {"key": k, "sessions": done[k]})

    head = configs(False)
    cols = [
        "config",
        "n",
        "L_reuse",
        "h",
        "tau_seg",
        "W",
        "tau_ctx",
        "eps",
        "accuracy",
        "prefill_tokens_computed",
        "saving",
        "prefill_s",
        "prefill_s_median",
        "accept_rate",
        "fallback_rate",
        "spliced_share",
        "boundary_kl_mean",
        "boundary_kl_p95",
        "false_accept_rate",
        "last_kl_mean",
    ]
    md = [f"# Cross-query segment reuse on shared_docs ({args.model})", ""]
    rows, missing = [], []
    for group, n, cfgs in groups:
        members = dict(cfgs)
        if group == "sweeps":  # the default and the reference: the headline passes, first n sessions
            members = {"none": head["none"], **{a: head["segment"] for a in DEFAULT_ALIASES}, **cfgs}
        rs = []
        for name, (reuse, options) in members.items():
            src = name if group != "sweeps" or name in cfgs else ("none" if name == "none" else "segment")
            k = key(src, args.n if src in head and group == "sweeps" else n, reuse, options)
            if k not in done:
                missing.append(f"{group}/{name}")
                continue
            r = summarize(name, reuse, options, done[k][:n])
            r["group"] = group
            rs.append(r)
        base = next((r for r in rs if r["reuse"] == "none"), None)
        if base is None or len(rs) < 2:
            continue
        for r in rs:
            r["accuracy_delta_pts"] = 100 * (r["accuracy"] - base["accuracy"])
        rows += rs
        md += [
            f"## {group} ({n} held-out sessions, {base['requests']} requests)",
            "",
            table(rs, cols[:9] + ["accuracy_delta_pts"] + cols[9:]),
            "",
        ]
    if missing:
        md += [f"Missing passes (run them with --resume): {', '.join(missing)}", ""]
        print(f"missing: {', '.join(missing)}", file=sys.stderr)
    if rows:
        harness.write_csv(rows, out / "results.csv")
        (out / "report.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
