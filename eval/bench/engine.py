"""This engine against the one it replaced, on the same machine in one run: prefill
seconds at several lengths and decode tokens/s at batch 1 and 8, 512 and 4,096
tokens of context.

    python -m eval.bench.engine [--old 44e9456] [--model smollm2-135m-instruct]
        [--lengths 512,2048,4096,8000] [--batches 1,8] [--contexts 512,4096] [--rounds 1]
        [--interleave] [--out eval/results/bench_engine_cpu.md]

``--lengths ''`` runs the decode table alone, ``--batches ''`` the prefill table alone.

The previous engine is checked out from git at ``--old`` into a scratch worktree.
Each measurement runs in a process of its own (``RUNNER``: the same code for both
trees, through the engine API both share: ``Engine``, ``open_row``, ``prefill``,
``decode``, ``truncate_row``), the two trees alternating cell by cell, so a drift
of the machine's speed during the run touches both sides alike. Prefill: one
row, a random prompt from an empty cache at the engine's default chunk, median of
``--repeats`` after a warm-up run (compiles excluded). Decode: ``--steps`` greedy
steps after a warm-up call over random K/V of ``context`` tokens per row (the pool
filled on the device), as ``eval/bench/decode.py`` times it, each row truncated back
to its context after each call. Calls follow each other, as a long generation's
chunks do (this engine's CPU decode window is then kept from call to call); with
``--interleave`` another row's one-token prefill comes before each call (not timed),
as when requests arrive while others decode, so every call copies its window again; one process's decode speed
varies by about 10% from the next one's, and one prefill of 4,096 tokens by as much
(10.1 s and 11.9 s in two warm runs of one process), so ``--rounds N`` runs N
alternating process pairs per cell, prefill and decode alike, and reports the
medians and every round's ratio. Float32, threads
pinned to the machine's cores; the load average is recorded before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxkv.markdown import md_header, md_row

ROOT = Path(__file__).resolve().parents[2]
OLD = "44e9456"

RUNNER = r"""
import json, os, statistics, sys, time
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax, numpy as np
import jaxkv
from jaxkv.engine import Engine

spec = json.loads(sys.argv[1])
model = jaxkv.load_model(spec["model"])
cfg = model.config
rng = np.random.default_rng(0)
if spec["kind"] == "prefill":
    T = spec["tokens"]
    tokens = rng.integers(100, cfg.vocab_size - 100, T).tolist()
    P = -(-(T + 1) // 512) * 512
    engine = Engine(model, rows=1, max_positions=P, num_slots=P + 1)
    def run():
        row = engine.open_row()
        t = time.perf_counter()
        engine.prefill([row], [tokens])
        jax.block_until_ready(engine.cache.k if hasattr(engine.cache, "k") else engine.cache)
        dt = time.perf_counter() - t
        engine.close_row(row)
        return dt
    run()
    value = statistics.median(run() for _ in range(spec["repeats"]))
else:
    B, ctx, steps = spec["batch"], spec["context"], spec["steps"]
    interleave = spec.get("interleave", False)
    engine = Engine(model, rows=B + interleave, max_positions=ctx + steps + 1)
    rows = []
    for _ in range(B):
        slots = engine.allocator.allocate(ctx)
        rows.append(engine.open_row(slots))
        engine.allocator.release(slots)
    spare = engine.open_row() if interleave else None
    key = jax.random.key(1)
    filled = engine.cache.replace(
        k=jax.random.normal(jax.random.fold_in(key, 0), engine.cache.k.shape, engine.cache.k.dtype) * 0.5,
        v=jax.random.normal(jax.random.fold_in(key, 1), engine.cache.v.shape, engine.cache.v.dtype) * 0.5,
    )
    if hasattr(engine, "kv"):  # the KV manager writes the cache (older trees: the engine itself)
        engine.kv.commit(filled)
    else:
        engine.cache = filled
    first = rng.integers(0, cfg.vocab_size, B).tolist()
    snapshot = [len(engine.row_state[r].slots) for r in rows]
    def run():
        if interleave:  # another request's prefill step between two decode calls (not timed)
            engine.prefill([spare], [[7]])
            jax.block_until_ready(engine.cache.k)
        t = time.perf_counter()
        engine.decode(rows, first, steps)
        jax.block_until_ready(engine.cache.k)
        dt = time.perf_counter() - t
        for r, n in zip(rows, snapshot):
            engine.truncate_row(r, n)
        if interleave:
            engine.truncate_row(spare, 0)
        return dt
    run()
    value = B * steps / min(run() for _ in range(spec["repeats"]))
print("RESULT " + json.dumps(value))
"""


def machine_rates() -> str:
    """The float32 GEMM rate (the MLP's shapes) and the read bandwidth, measured in
    a process of its own like the cells."""
    code = (
        "import os; os.environ.setdefault('JAX_PLATFORMS', 'cpu')\n"
        "from eval.bench.prefill import gemm_peak_gflops\nfrom eval.bench.decode import read_bandwidth_gbs\n"
        "print(f'GEMM {gemm_peak_gflops(512, 576, 1536):.0f} GFLOP/s (float32, 512 x 576 x 1536), "
        "read bandwidth {read_bandwidth_gbs():.1f} GB/s')"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return proc.stdout.strip().splitlines()[-1]


def measure(tree: Path, spec: dict) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree), "JAX_PLATFORMS": "cpu", "JAXKV_XLA_CACHE": "off"}
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(spec)], env=env, cwd=tree, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{tree}: {spec} failed:\n{proc.stderr[-3000:]}")
    return float(json.loads(lines[-1][len("RESULT ") :]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", default=OLD, help="git revision of the previous engine")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--lengths", default="512,2048,4096,8000")
    p.add_argument("--contexts", default="512,4096")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="alternating old/new processes per cell (prefill and decode); medians and the ratio per round are reported",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="decode: another row's one-token prefill before each timed call, so no decode call follows another",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    load0 = os.getloadavg()
    machine = machine_rates()
    scratch = Path(tempfile.mkdtemp(prefix="jaxkv-bench-engine-"))
    old_tree = scratch / "old"
    subprocess.run(["git", "worktree", "add", "--detach", str(old_tree), args.old], check=True, cwd=ROOT, capture_output=True)
    lines = [
        f"# This engine against the previous one ({args.old}), {args.model}, float32, CPU",
        "",
        (
            f"Generated by `python -m eval.bench.engine {shlex.join(sys.argv[1:] if argv is None else argv)}` on {os.cpu_count()} cores; "
            f"each cell in a process of its own, the two engines alternating; load average before {load0[0]:.2f}. "
            f"This machine in the same run: {machine}."
        ),
    ]
    lengths = [int(x) for x in args.lengths.split(",") if x]  # --lengths '': the decode table only
    if lengths:
        lines += [
            "",
            (
                f"## Prefill (one row, from an empty cache; the median of {args.repeats} after a warm-up prefill; "
                f"{args.rounds} round(s) of one process per engine, alternating; medians)"
            ),
            "",
            *md_header(["tokens", "previous s", "now s", "speed-up", "speed-up per round"], "rrrrl"),
        ]
    try:
        for T in lengths:
            spec = dict(kind="prefill", model=args.model, tokens=T, repeats=args.repeats)
            pairs = [(measure(old_tree, spec), measure(ROOT, spec)) for _ in range(args.rounds)]
            old, new = statistics.median(o for o, _ in pairs), statistics.median(n for _, n in pairs)
            per_round = ", ".join(f"{o / n:.2f}" for o, n in pairs)
            lines.append(md_row([T, f"{old:.2f}", f"{new:.2f}", f"{old / new:.2f}x", per_round]))
            print(lines[-1], flush=True)
        between = "another row's one-token prefill before each call" if args.interleave else "calls back to back"
        lines += [
            "",
            f"## Decode ({args.steps} greedy steps per call, {between}, best of {args.repeats} calls after a warm-up call; "
            f"{args.rounds} round(s) of one process per engine, alternating; medians)",
            "",
            *md_header(["batch", "context", "previous tok/s", "now tok/s", "ratio", "ratio per round"], "rrrrrl"),
        ]
        for B in [int(x) for x in args.batches.split(",") if x]:  # --batches '': the prefill table only
            for ctx in [int(x) for x in args.contexts.split(",") if x]:
                spec = dict(
                    kind="decode",
                    model=args.model,
                    batch=B,
                    context=ctx,
                    steps=args.steps,
                    repeats=args.repeats,
                    interleave=args.interleave,
                )
                pairs = [(measure(old_tree, spec), measure(ROOT, spec)) for _ in range(args.rounds)]
                old, new = statistics.median(o for o, _ in pairs), statistics.median(n for _, n in pairs)
                per_round = ", ".join(f"{n / o:.2f}" for o, n in pairs)
                lines.append(md_row([B, ctx, f"{old:.1f}", f"{new:.1f}", f"{new / old:.2f}x", per_round]))
                print(lines[-1], flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=ROOT, capture_output=True)
    load1 = os.getloadavg()
    lines += ["", f"Load average after: {load1[0]:.2f} / {load1[1]:.2f} / {load1[2]:.2f} (1/5/15 min)."]
    text = "\n".join(lines) + "\n"
    print(lines[-1])
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
