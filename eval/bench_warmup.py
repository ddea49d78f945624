"""Start-up cost of a server: compiling the engine's whole shape set (``Server(warmup=True)``).

    JAX_PLATFORMS=cpu python eval/bench_warmup.py [--model embedded] [--rows 4]
        [--max-positions 4096] [--policies none|all|A,B] [--out FILE.md]

Runs two processes one after the other, each building ``Server(model, rows,
max_positions, warmup=True, warmup_policies=...)`` as ``jaxkv serve`` does
(``--policies none``, the default: ``jaxkv serve`` without ``--allow policy``;
``all``: every registered retention policy, ``Server(warmup=True)``'s default): the first with an empty
persistent compilation cache (a fresh folder: every program compiled), the
second on the cache the first left (a restart: programs loaded). Prints the
programs in the shape set (``jaxkv.buckets.shape_set``), XLA programs compiled
or loaded, cache hits and wall seconds of each. CPU only; absolute numbers are
for the machine named in the header. The 1-minute load average before and after
is printed: a run that starts above 0.5 (another job on the machine) is not a
start-up figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
import jaxkv
from jaxkv import buckets, compiles
from jaxkv.serving import Server
model_name, rows, P, policies = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
policies = None if policies == "all" else () if policies == "none" else tuple(policies.split(","))
model = jaxkv.load_model(model_name)
t0 = time.perf_counter()
server = Server(model, rows=rows, max_positions=P, warmup=True, warmup_policies=policies)
wall = time.perf_counter() - t0
eng = server.engine
shapes = buckets.shape_set(eng.rows, eng.max_positions, eng.prefill_chunk, server.scheduler.decode_chunk, eng.min_batch)
print(json.dumps({"shapes": shapes.size, "compiles": compiles.count(), "cache_hits": compiles.cache_hits(), "seconds": wall}))
server.close()
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--max-positions", type=int, default=4096)
    ap.add_argument("--policies", default="none", help="retention policies warmed: none, all, or names")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    runs = []
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "JAXKV_XLA_CACHE": cache}
        for label in ("cold (empty cache)", "restart (cache filled)"):
            out = subprocess.run([sys.executable, "-c", CHILD, args.model, str(args.rows), str(args.max_positions), args.policies],
                                 env=env, check=True, capture_output=True, text=True).stdout
            runs.append((label, json.loads(out.strip().splitlines()[-1])))
    load_after = os.getloadavg()[0]
    lines = [
        f"# Server warm-up: {args.model}, rows={args.rows}, max_positions={args.max_positions}, retention policies: {args.policies}",
        f"Machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores; `python eval/bench_warmup.py"
        f" --model {args.model} --rows {args.rows} --max-positions {args.max_positions} --policies {args.policies}`",
        f"1-minute load average {load_before:.2f} before, {load_after:.2f} after.",
        "",
        "| start | shape-set programs | XLA programs compiled or loaded | from the cache | seconds |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {label} | {r['shapes']} | {r['compiles']} | {r['cache_hits']} | {r['seconds']:.1f} |" for label, r in runs]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
