"""KVzip's scoring of one reconstruction pass, this tree against an older one, at a real model's shapes.

    JAX_PLATFORMS=cpu python -m eval.bench.kvzip_scoring [--old ab9a270] [--model smollm2-135m-instruct]
        [--context 2048] [--rounds 3] [--out FILE.md]

What is timed: ``jaxkv.policies.kvzip.pass_scores`` (the scorer the retention
stage jits, ``jaxkv.serving.stages.reconstruction``) on the arrays an event of a
``--context``-token row hands it: ``N = buckets.event_size(context)`` context
entries, a pass of ``context + 32`` input rows (a 2,048-token chunk and its repeat
prompt) padded to ``reconstruction.pass_rows``, every context entry visible and
scored. The inputs are random normal queries and keys of the model's shapes (layers,
query and KV heads, head dim from its config): the scorer's
cost depends on shapes only. The older scorer is the same function read from
``git show OLD:jaxkv/policies/kvzip.py`` (the function, the module's imports and
constants; both read this tree's ``jaxkv.attention`` helpers, whose signatures they
share).

Both run in one process, each jitted and run once to compile, then alternately
``--rounds`` times; each figure is the median, and the ratio is old over new
(above 1: this tree is faster). The largest difference between the two scorers'
outputs is printed too (the same rule, so float32 rounding only). The header
gives the load average before and after, and the threads the process may use.
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OLD = "ab9a270"  # the scorer before the online log-sum-exp


def old_scorer(rev: str):
    """``pass_scores`` of ``rev``'s ``jaxkv/policies/kvzip.py``: the module's imports,
    its constants and that function, run in a namespace of their own (importing the
    whole module would register its policy a second time)."""
    source = subprocess.run(["git", "show", f"{rev}:jaxkv/policies/kvzip.py"], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    tree = ast.parse(source)
    keep = [
        node
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        or (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant))
        or (isinstance(node, ast.FunctionDef) and node.name == "pass_scores")
    ]
    namespace: dict = {}
    code = compile(ast.Module(body=keep, type_ignores=[]), f"{rev}:jaxkv/policies/kvzip.py", "exec")
    exec(code, namespace)  # noqa: S102 (the older tree's own source, from git)
    return namespace["pass_scores"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.bench.kvzip_scoring", description=__doc__.splitlines()[0])
    p.add_argument("--old", default=OLD, help="git revision of the older scorer")
    p.add_argument("--model", default="smollm2-135m-instruct", help="a registry name or folder: its config gives the shapes")
    p.add_argument("--context", type=int, default=2048, help="the row's live tokens (one chunk of the pass)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = p.parse_args(argv)

    import jax
    import numpy as np

    import jaxkv
    from jaxkv import buckets
    from jaxkv.policies import kvzip
    from jaxkv.serving.stages.reconstruction import pass_rows

    load_before = os.getloadavg()
    cfg = jaxkv.load_model(args.model, load_tokenizer=False).config
    L, Hq, Hkv, D = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    N, x_real = buckets.event_size(args.context), min(args.context, kvzip.CHUNK_SIZE) + 32
    X = pass_rows(x_real)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((L, X, Hq, D), np.float32)
    k_ctx = rng.standard_normal((L, N, Hkv, D), np.float32)
    k_self = rng.standard_normal((L, X, Hkv, D), np.float32)
    softmax_ln = np.ones((L, N), bool)
    scored_ln = np.ones((L, N), bool)
    valid = np.arange(X) < x_real
    scorers = {"old": jax.jit(old_scorer(args.old)), "new": jax.jit(kvzip.pass_scores)}
    inputs = (q, k_ctx, k_self, softmax_ln, scored_ln, valid)

    def run(name):
        t0 = time.perf_counter()
        out = jax.block_until_ready(scorers[name](*inputs))
        return time.perf_counter() - t0, np.asarray(out)

    first = {name: run(name) for name in scorers}
    diff = float(np.abs(first["old"][1] - first["new"][1]).max())
    times = {name: [] for name in scorers}
    for r in range(args.rounds):
        for name in scorers:
            times[name].append(run(name)[0])
        print(f"round {r + 1}: old {times['old'][-1]:.2f} s, new {times['new'][-1]:.2f} s", flush=True)
    old, new = statistics.median(times["old"]), statistics.median(times["new"])
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    command = f"`python -m eval.bench.kvzip_scoring --old {args.old} --model {args.model} --context {args.context} --rounds {args.rounds}`"
    lines = [
        f"# KVzip pass scoring: this tree against {args.old}, {args.model} shapes, CPU",
        "",
        command + f"; {threads} CPU threads allowed; load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after.",
        f"Shapes: L={L}, Hq={Hq}, Hkv={Hkv}, D={D}; {N} context entries, a pass of {x_real} rows padded to {X}.",
        f"Largest difference between the two scorers' outputs: {diff:.2e}.",
        "",
        "| scorer | first call (compile + run), s | median of runs, s | runs, s |",
        "|---|---:|---:|---|",
        f"| {args.old} | {first['old'][0]:.2f} | {old:.2f} | {', '.join(f'{t:.2f}' for t in times['old'])} |",
        f"| this tree | {first['new'][0]:.2f} | {new:.2f} | {', '.join(f'{t:.2f}' for t in times['new'])} |",
        "",
        f"Old over new: **{old / new:.2f}x**.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
